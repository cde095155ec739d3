// The worker's replica directory: reset, per-job roots, bound (see replica_dirs.h).
#include "worker/replica_dirs.h"

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace spindle {

std::string DefaultReplicaDir(const std::string& worker_id, const std::string& work_dir) {
  std::error_code ec;
  if (std::filesystem::is_directory("/dev/shm", ec))
    return absl::StrCat("/dev/shm/spindle-replicas-", worker_id);
  return (std::filesystem::path(work_dir) / "replicas").string();
}

absl::Status ResetReplicaDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return absl::FailedPreconditionError(
        absl::StrCat("--replica_dir \"", dir, "\" cannot be created: ", ec.message()));
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::error_code rm;
    std::filesystem::remove_all(entry.path(), rm);
  }
  if (ec)
    return absl::FailedPreconditionError(
        absl::StrCat("--replica_dir \"", dir, "\" cannot be read: ", ec.message()));
  return absl::OkStatus();
}

std::string ReplicaJobRoot(const std::string& dir, const std::string& job_id,
                           const std::set<std::string>& running) {
  std::vector<std::pair<std::filesystem::file_time_type, std::filesystem::path>> others;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == job_id || running.count(name) > 0) continue;
    std::error_code t;
    const auto when = std::filesystem::last_write_time(entry.path(), t);
    others.emplace_back(t ? std::filesystem::file_time_type::min() : when, entry.path());
  }
  std::sort(others.begin(), others.end());
  const size_t keep = kMaxReplicaJobs - 1 - std::min<size_t>(running.size(), kMaxReplicaJobs - 1);
  for (size_t i = 0; i + keep < others.size(); ++i) {
    std::error_code rm;
    std::filesystem::remove_all(others[i].second, rm);
  }
  return (std::filesystem::path(dir) / job_id).string();
}

void RemoveReplicaJob(const std::string& dir, const std::string& job_id) {
  std::error_code ec;
  std::filesystem::remove_all(std::filesystem::path(dir) / job_id, ec);
}

}  // namespace spindle
