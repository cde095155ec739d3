// In-memory and directory KvStores (see kv_stores.h).
#include "worker/engine/comm/kv_stores.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace spindle {

absl::Status MemoryKvStore::Set(const std::string& key, const std::string& value) {
  absl::MutexLock l(&mu_);
  values_[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> MemoryKvStore::Get(const std::string& key, absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  auto present = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return values_.count(key) > 0;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&present), timeout))
    return absl::DeadlineExceededError(
        absl::StrCat("kv store: key \"", key, "\" not set within ", absl::FormatDuration(timeout)));
  return values_[key];
}

std::string FileKvStore::PathOf(const std::string& key) const {
  std::string name;
  for (char c : key) name += (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.')
                                  ? c : '_';
  // Keep distinct keys distinct after the substitution.
  return absl::StrCat(dir_, "/", name, ".", std::hash<std::string>{}(key));
}

absl::Status FileKvStore::Set(const std::string& key, const std::string& value) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  const std::string path = PathOf(key);
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid(), ".", gettid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(value.data(), static_cast<std::streamsize>(value.size()));
    if (!f) return absl::UnavailableError(absl::StrCat("file store: cannot write \"", tmp, "\""));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    return absl::UnavailableError(absl::StrCat("file store: cannot rename to \"", path, "\""));
  return absl::OkStatus();
}

absl::StatusOr<std::string> FileKvStore::Get(const std::string& key, absl::Duration timeout) {
  const std::string path = PathOf(key);
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    std::ifstream f(path, std::ios::binary);
    if (f) {
      std::stringstream ss;
      ss << f.rdbuf();
      return ss.str();
    }
    if (absl::Now() >= deadline)
      return absl::DeadlineExceededError(absl::StrCat(
          "file store: key \"", key, "\" not set in ", dir_, " within ",
          absl::FormatDuration(timeout)));
    absl::SleepFor(absl::Milliseconds(5));
  }
}

}  // namespace spindle
