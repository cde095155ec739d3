// In-memory checkpoint replicas: commit, choose, bound (see replica_store.h).
#include "worker/engine/replica_store.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/json_fields.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace spindle {
namespace {

constexpr char kOriginFile[] = "replica.json";
constexpr int64_t kStateBound = int64_t{1} << 20;
// Room for a safetensors header: its fixed part, and per tensor its name (bounded by the model's
// own names, counted below), dtype, shape and offsets.
constexpr int64_t kHeaderBase = 4096, kHeaderPerTensor = 256;

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, int64_t limit) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open \"", path, "\""));
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) {
    out.append(buf, n);
    if (static_cast<int64_t>(out.size()) > limit) {
      std::fclose(f);
      return absl::DataLossError(absl::StrCat("\"", path, "\" is larger than ", limit, " bytes"));
    }
  }
  std::fclose(f);
  return out;
}

}  // namespace

ReplicaBound ReplicaBoundFor(const ParamSet& params, int optimizer_states) {
  int64_t values = 0, names = 0;
  for (int i = 0; i < params.size(); ++i) {
    const ParamInfo& p = params.info(i);
    int64_t numel = 1;
    for (int64_t n : p.full_shape) numel *= n;
    values += numel * 4;
    names += static_cast<int64_t>(p.name.size()) + kHeaderPerTensor;
  }
  ReplicaBound b;
  b.model = kHeaderBase + names + values;
  // Optimizer tensor names add a prefix ("exp_avg_sq.") to each parameter's.
  b.optimizer = kHeaderBase + optimizer_states * (names + values);
  b.state = kStateBound;
  return b;
}

absl::Status CheckReplicaSizes(int64_t model, int64_t optimizer, int64_t state,
                               const ReplicaBound& bound, const std::string& from) {
  for (const auto& [name, size, limit] :
       {std::tuple<const char*, int64_t, int64_t>{"model.safetensors", model, bound.model},
        {"optimizer.safetensors", optimizer, bound.optimizer},
        {"state.json", state, bound.state}}) {
    if (size < 0 || size > limit)
      return absl::InvalidArgumentError(
          absl::StrCat("replica: ", from, " sent a ", name, " of ", size,
                       " bytes; a replica of this model has at most ", limit));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CommitReplica(const std::string& root, int64_t step,
                                          const CheckpointFiles& files,
                                          const ReplicaOrigin& origin) {
  const std::string who =
      nlohmann::json{{"job_id", origin.job_id}, {"attempt", origin.attempt}, {"step", step}}.dump();
  return CommitCheckpointFiles(root, step,
                               {{"model.safetensors", files.model},
                                {"optimizer.safetensors", files.optimizer},
                                {kOriginFile, who},
                                {"state.json", files.state}},
                               /*keep=*/1, origin.attempt);
}

ReplicaChoice NewestReplica(const std::string& root, const std::string& job_id, int64_t attempt,
                            const ReplicaBound& bound) {
  ReplicaChoice choice;
  for (const std::string& dir : CompleteCheckpoints(root)) {
    const int64_t step = CheckpointStepOf(dir);
    auto refuse = [&](const std::string& why) {
      choice.refused.push_back(
          absl::StrCat("in-memory replica of step ", step, " (\"", dir, "\") refused: ", why));
    };
    absl::StatusOr<std::string> text = ReadSmallFile(dir + "/" + kOriginFile, 4096);
    if (!text.ok()) {
      refuse(absl::StrCat("no readable ", kOriginFile, " (", text.status().message(), ")"));
      continue;
    }
    const nlohmann::json who = nlohmann::json::parse(*text, nullptr, false);
    if (!who.is_object() || !who.contains("job_id") || !who["job_id"].is_string() ||
        !who.contains("attempt") || !who["attempt"].is_number_integer() || !who.contains("step") ||
        !who["step"].is_number_integer()) {
      refuse(absl::StrCat(kOriginFile, " is corrupt"));
      continue;
    }
    if (who["job_id"].get<std::string>() != job_id) {
      refuse(absl::StrCat("it belongs to job \"", ShortText(who["job_id"].get<std::string>()),
                          "\", not \"", ShortText(job_id), "\""));
      continue;
    }
    const int64_t by = who["attempt"].get<int64_t>();
    if (by >= attempt) {
      refuse(
          absl::StrCat("it was taken by attempt ", by, ", not an earlier attempt than ", attempt));
      continue;
    }
    if (who["step"].get<int64_t>() != step) {
      refuse(absl::StrCat(kOriginFile, " names step ", who["step"].get<int64_t>()));
      continue;
    }
    // Bounded before anything is read: no file larger than a replica of the model can be.
    std::string oversized;
    for (const auto& [name, limit] :
         {std::pair<const char*, int64_t>{"model.safetensors", bound.model},
          {"optimizer.safetensors", bound.optimizer},
          {"state.json", bound.state}}) {
      struct stat st;
      if (oversized.empty() && ::stat((dir + "/" + name).c_str(), &st) == 0 && st.st_size > limit)
        oversized = absl::StrCat(name, " holds ", st.st_size,
                                 " bytes; a replica of this model has at most ", limit);
    }
    if (!oversized.empty()) {
      refuse(oversized);
      continue;
    }
    absl::StatusOr<CheckpointFiles> files = ReadCheckpointFiles(dir);
    if (!files.ok()) {
      refuse(std::string(files.status().message()));
      continue;
    }
    if (absl::Status s = VerifyCheckpointFiles(*files, dir); !s.ok()) {
      refuse(std::string(s.message()));
      continue;
    }
    absl::StatusOr<nlohmann::json> st = ParseCheckpointState(files->state, dir + "/state.json");
    if (!st.ok() || (*st)["step"].get<int64_t>() != step) {
      refuse("its state.json is of another step");
      continue;
    }
    choice.step = step;
    choice.dir = dir;
    choice.files = *std::move(files);
    break;
  }
  return choice;
}

std::string ReplicaLoadDir(const std::string& root) {
  return absl::StrCat(root, "/.tmp.load.", ::getpid());
}

absl::Status WriteReplicaForLoad(const std::string& dir, const CheckpointFiles& files) {
  RemoveReplicaDir(dir);
  if (::mkdir(dir.c_str(), 0755) != 0)
    return CheckpointIoError("cannot create directory", dir, errno);
  for (const auto& [name, bytes] :
       {std::pair<const char*, const std::string*>{"model.safetensors", &files.model},
        {"optimizer.safetensors", &files.optimizer},
        {"state.json", &files.state}}) {
    const std::string path = dir + "/" + name;
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) return CheckpointIoError("cannot create", path, errno);
    const bool ok = std::fwrite(bytes->data(), 1, bytes->size(), f) == bytes->size();
    const int err = errno;
    if (std::fclose(f) != 0 || !ok) return CheckpointIoError("cannot write", path, err);
  }
  return absl::OkStatus();
}

void RemoveReplicaDir(const std::string& dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") ::unlink((dir + "/" + n).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(dir.c_str());
}

}  // namespace spindle
