// `spindle plan --verify` through spindle-train (see plan_verify.h).
#include "cli/plan_verify.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/subprocess.h"
#include "common/text_bounds.h"

namespace spindle {
namespace {

bool IsExecutable(const std::filesystem::path& p) {
  std::error_code ec;
  const auto st = std::filesystem::status(p, ec);
  return !ec && std::filesystem::is_regular_file(st) &&
         (st.permissions() & std::filesystem::perms::owner_exec) != std::filesystem::perms::none;
}

double Number(const nlohmann::json& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_number() ? it->get<double>() : 0.0;
}

bool Flag(const nlohmann::json& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_boolean() && it->get<bool>();
}

std::string Text(const nlohmann::json& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_string() ? PrintableText(it->get<std::string>()) : "";
}

}  // namespace

std::string VerifyTrainerBinary(const std::map<std::string, std::string>& env) {
  if (auto it = env.find("SPINDLE_TRAIN_BINARY"); it != env.end() && !it->second.empty())
    return it->second;
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (const std::filesystem::path& p :
         {self.parent_path() / "spindle-train",
          self.parent_path().parent_path() / "worker" / "spindle-train"})
      if (IsExecutable(p)) return p.string();
  }
  return "spindle-train";
}

absl::StatusOr<ParityCheck> RunParityCheck(const std::string& trainer,
                                           const std::string& planned_spec_json,
                                           absl::Duration timeout) {
  // The planned spec in a file of its own, removed when the check ends.
  std::error_code ec;
  const std::filesystem::path tmp = std::filesystem::temp_directory_path(ec);
  std::string path = (ec ? std::filesystem::path("/tmp") : tmp) / "spindle-verify-XXXXXX.json";
  const int fd = ::mkstemps(path.data(), 5);
  if (fd < 0)
    return absl::InternalError(absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  const bool written = ::write(fd, planned_spec_json.data(), planned_spec_json.size()) ==
                       static_cast<ssize_t>(planned_spec_json.size());
  ::close(fd);
  absl::StatusOr<CommandResult> r =
      written
          ? RunCommand({trainer, "--verify-only", "--job", path}, "", timeout)
          : absl::StatusOr<CommandResult>(absl::InternalError(absl::StrCat("cannot write ", path)));
  std::filesystem::remove(path, ec);
  if (!r.ok()) {
    if (r.status().code() == absl::StatusCode::kNotFound)
      return absl::NotFoundError(
          absl::StrCat("cannot run ", trainer, " (", r.status().message(),
                       "); set SPINDLE_TRAIN_BINARY to the spindle-train binary"));
    return r.status();
  }
  ParityCheck check;
  check.trainer_exit_code = r->exit_code;
  check.trainer_error = std::string(absl::StripAsciiWhitespace(r->stderr_text));
  for (absl::string_view line : absl::StrSplit(r->stdout_text, '\n')) {
    nlohmann::json e = nlohmann::json::parse(line.begin(), line.end(), nullptr, false);
    if (!e.is_object()) continue;
    auto event = e.find("event");
    if (event != e.end() && event->is_string() && event->get<std::string>() == "parity")
      check.event = std::move(e);
  }
  return check;
}

bool ParityOk(const nlohmann::json& e) { return Flag(e, "skipped") || Flag(e, "passed"); }

void PrintParity(const nlohmann::json& e, std::ostream& out) {
  if (Flag(e, "skipped")) {
    out << "parity: nothing to verify (" << Text(e, "layout") << ": " << Text(e, "reason") << ")\n";
    return;
  }
  const bool passed = Flag(e, "passed");
  out << absl::StrFormat(
      "parity: %s: %s against %s on a %d-token slice of the job's data (checked here on the CPU "
      "engine)\n",
      passed ? "passed" : "FAILED", Text(e, "layout"), Text(e, "reference"),
      static_cast<int64_t>(Number(e, "tokens")));
  out << absl::StrFormat(
      "  max relative gradient error %.3g, %.3g %s the bound (tolerance %.3g + 4 x the "
      "reference's rounding noise); loss %.6g, reference %.6g\n",
      Number(e, "max_rel_error"), Number(e, "max_excess"), passed ? "of" : "times",
      Number(e, "tolerance"), Number(e, "loss"), Number(e, "reference_loss"));
  auto worst = e.find("worst");
  if (worst == e.end() || !worst->is_array() || worst->empty()) return;
  out << absl::StrFormat("  %-36s %11s %11s %11s\n", "tensor", "rel error", "noise", "/ bound");
  for (const nlohmann::json& row : *worst) {
    if (!row.is_object()) continue;
    out << absl::StrFormat("  %-36s %11.3g %11.3g %11.3g%s\n", Text(row, "tensor"),
                           Number(row, "rel_error"), Number(row, "noise"), Number(row, "excess"),
                           Number(row, "excess") > 1.0 ? "  <- over" : "");
  }
}

}  // namespace spindle
