// Checks of job paths against the worker's roots (see path_roots.h).
#include "worker/path_roots.h"

#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/path_rules.h"

namespace spindle {
namespace {

// The realpath of the longest existing prefix of `p`, with the rest appended (p has no "..").
// A dangling symbolic link on the way resolves to nothing (false): a trainer creating the
// directory would follow it wherever it points.
bool Resolve(const std::filesystem::path& p, std::filesystem::path* out) {
  std::filesystem::path existing, rest;
  bool past_existing = false;
  for (const auto& part : p) {
    if (past_existing) {
      rest /= part;
      continue;
    }
    const std::filesystem::path next = existing / part;
    std::error_code ec;
    const auto st = std::filesystem::symlink_status(next, ec);
    if (ec || !std::filesystem::exists(st)) {
      past_existing = true;
      rest /= part;
      continue;
    }
    existing = next;
  }
  std::error_code ec;
  std::filesystem::path resolved = std::filesystem::canonical(existing, ec);
  if (ec) return false;
  *out = rest.empty() ? resolved : resolved / rest;
  return true;
}

}  // namespace

absl::Status CheckRootFlag(const std::string& flag, const std::string& root) {
  const std::filesystem::path p(root);
  if (root.empty() || !p.is_absolute() || HasDotDotComponent(root))
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " must be an absolute directory without \"..\" components, got \"", root, "\""));
  return absl::OkStatus();
}

absl::Status CheckPathUnderRoot(const std::string& what, const std::string& path,
                                const std::string& root_flag, const std::string& root) {
  const std::filesystem::path p(path);
  const std::string where = absl::StrCat("the worker's ", root_flag, " ", root);
  if (!p.is_absolute())
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, " is not an absolute path under ", where));
  if (HasDotDotComponent(path))
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, " has a \"..\" component; it must lie under ", where));
  std::filesystem::path resolved, resolved_root;
  if (!Resolve(p, &resolved))
    return absl::InvalidArgumentError(absl::StrCat(
        what, " ", path, " leads through a dangling symbolic link; it must lie under ", where));
  if (!Resolve(std::filesystem::path(root), &resolved_root)) resolved_root = root;
  if (LexicallyWithin(resolved.string(), resolved_root.string())) return absl::OkStatus();
  if (resolved.lexically_normal() != p.lexically_normal())
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, " resolves to ", resolved.string(), ", outside ", where));
  return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is outside ", where));
}

absl::Status CheckJobPaths(const JobSpec& spec, const PathRoots& roots) {
  if (!spec.checkpoint.dir.empty()) {
    absl::Status s = CheckPathUnderRoot("checkpoint.dir", spec.checkpoint.dir, "--checkpoint_root",
                                        roots.checkpoint_root);
    if (!s.ok()) return s;
  }
  if (const std::string file = DataSourceFile(spec.data); !file.empty())
    return CheckPathUnderRoot("data.source file", file, "--data_root", roots.data_root);
  return absl::OkStatus();
}

}  // namespace spindle
