// Atomic, verified checkpoints (see checkpoint.h).
#include "worker/engine/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/json_fields.h"
#include "common/status.h"
#include "worker/engine/safetensors.h"

namespace spindle {

absl::Status CheckpointIoError(const std::string& what, const std::string& path, int err) {
  const std::string msg = absl::StrCat("checkpoint: ", what, " \"", path, "\": ", strerror(err));
  // A full volume stays full through a restart: the job stops at once instead of retraining to
  // the same checkpoint until its restarts run out.
  if (err == ENOSPC || err == EDQUOT)
    return absl::FailedPreconditionError(absl::StrCat(
        msg,
        " (free space on the checkpoint volume, or lower checkpoint.keep; the job resumes "
        "from its last complete checkpoint when submitted again)"));
  // A volume being remounted or failing over answers these for a while: the gang restarts and
  // tries again rather than failing the job as if its input were wrong.
  if (err == EIO || err == ESTALE || err == EACCES || err == EAGAIN || err == ETIMEDOUT ||
      err == ENOTCONN || err == EHOSTDOWN)
    return absl::UnavailableError(absl::StrCat(msg, " (transient: the gang restarts)"));
  return absl::InternalError(msg);
}

namespace {

absl::Status Errno(const std::string& what, const std::string& path) {
  return CheckpointIoError(what, path, errno);
}

// A file that is not there is NotFound; one that cannot be opened for another reason is an I/O
// error (CheckpointIoError), transient ones included.
absl::Status OpenError(const std::string& path) {
  if (errno == ENOENT || errno == ENOTDIR)
    return absl::NotFoundError(absl::StrCat("checkpoint: cannot open \"", path, "\""));
  return Errno("cannot open", path);
}

absl::Status SyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("cannot open directory", dir);
  ::fsync(fd);
  ::close(fd);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return OpenError(path);
  std::string out;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  std::fclose(f);
  return out;
}

// Size and CRC-32 of a file's bytes, as state.json records them.
struct FileDigest {
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};

void AddToDigest(FileDigest& d, const char* p, size_t n) {
  uLong crc = d.crc32;
  for (size_t done = 0; done < n;) {
    const uInt chunk = static_cast<uInt>(std::min<size_t>(n - done, size_t{1} << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(p + done), chunk);
    done += chunk;
  }
  d.crc32 = static_cast<uint32_t>(crc);
  d.bytes += n;
}

// One piece of a file being written: n bytes at p.
struct Piece {
  const char* p;
  size_t n;
};

// Creates path from the pieces, in order, fsyncs it, and returns its size and CRC-32.
absl::StatusOr<FileDigest> WriteFileSynced(const std::string& path,
                                           const std::vector<Piece>& pieces) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot create", path);
  FileDigest d;
  absl::Status s;
  for (const Piece& piece : pieces) {
    AddToDigest(d, piece.p, piece.n);
    for (size_t done = 0; s.ok() && done < piece.n;) {
      const ssize_t w =
          ::write(fd, piece.p + done, std::min<size_t>(piece.n - done, size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) s = Errno("cannot write", path);
      if (w > 0) done += static_cast<size_t>(w);
    }
  }
  if (s.ok() && ::fsync(fd) != 0) s = Errno("cannot fsync", path);
  ::close(fd);
  if (!s.ok()) return s;
  return d;
}

absl::Status WriteFileSynced(const std::string& path, const std::string& bytes) {
  return WriteFileSynced(path, {{bytes.data(), bytes.size()}}).status();
}

// A safetensors file written straight from the tensors' buffers: the header, then each tensor
// in name order (the header's layout).
absl::StatusOr<FileDigest> WriteSafetensorsSynced(
    const std::string& path, const std::map<std::string, SafetensorsEntry>& tensors,
    const std::map<std::string, std::string>& metadata) {
  const std::string header = SafetensorsHeader(tensors, metadata);
  std::vector<Piece> pieces{{header.data(), header.size()}};
  for (const auto& [name, e] : tensors)
    pieces.push_back({reinterpret_cast<const char*>(e.data), static_cast<size_t>(e.numel) * 4});
  return WriteFileSynced(path, pieces);
}

// A file open for reading (closed when it goes), read at offsets.
class InputFile {
 public:
  static absl::StatusOr<InputFile> Open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return OpenError(path);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      return Errno("cannot stat", path);
    }
    return InputFile(fd, static_cast<uint64_t>(st.st_size), path);
  }
  InputFile(InputFile&& o) noexcept
      : fd_(std::exchange(o.fd_, -1)), size_(o.size_), path_(std::move(o.path_)) {}
  InputFile& operator=(InputFile&&) = delete;
  ~InputFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  uint64_t size() const { return size_; }

  // n bytes from offset into dst; an error when the file ends first.
  absl::Status ReadAt(uint64_t offset, char* dst, size_t n) const {
    for (size_t done = 0; done < n;) {
      const ssize_t r = ::pread(fd_, dst + done, std::min<size_t>(n - done, size_t{1} << 30),
                                static_cast<off_t>(offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return Errno("cannot read", path_);
      if (r == 0)
        return absl::DataLossError(absl::StrCat("checkpoint: \"", path_, "\" ended early"));
      done += static_cast<size_t>(r);
    }
    return absl::OkStatus();
  }
  // Up to n bytes from offset (fewer at the end of the file or on a read error).
  std::string Read(uint64_t offset, uint64_t n) const {
    std::string out(static_cast<size_t>(std::min<uint64_t>(n, size_ - std::min(offset, size_))),
                    '\0');
    if (!ReadAt(offset, out.data(), out.size()).ok()) out.clear();
    return out;
  }
  // The whole file through CRC-32, in pieces.
  absl::StatusOr<FileDigest> Digest() const {
    FileDigest d;
    // 8 MiB pieces, or one the size of a smaller file (no 8 MiB to clear for a tiny model).
    std::vector<char> buf(static_cast<size_t>(std::min<uint64_t>(size_, uint64_t{8} << 20)));
    for (uint64_t off = 0; off < size_;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size_ - off));
      RETURN_IF_ERROR(ReadAt(off, buf.data(), n));
      AddToDigest(d, buf.data(), n);
      off += n;
    }
    return d;
  }

 private:
  InputFile(int fd, uint64_t size, std::string path)
      : fd_(fd), size_(size), path_(std::move(path)) {}
  int fd_;
  uint64_t size_;
  std::string path_;
};

void RemoveTree(const std::string& dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") ::unlink((dir + "/" + n).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(dir.c_str());
}

std::vector<std::string> StepDirs(const std::string& root) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(root.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n.rfind("step_", 0) == 0) out.push_back(n);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string OptimizerName(const Optimizer& opt, int which, const std::string& param) {
  if (opt.is_adamw()) return (which == 0 ? "exp_avg." : "exp_avg_sq.") + param;
  return "momentum_buffer." + param;
}

absl::Status MakeDirs(const std::string& path) {
  std::string cur;
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      if (!cur.empty() && ::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST)
        return Errno("cannot create directory", cur);
    }
    if (i < path.size()) cur.push_back(path[i]);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckCheckpointRoot(const std::string& root) {
  absl::Status s = MakeDirs(root);
  if (s.ok()) {
    const std::string probe = absl::StrCat(root, "/.write-test.", ::getpid());
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      s = Errno("cannot write in", root);
    } else {
      ::close(fd);
      ::unlink(probe.c_str());
    }
  }
  // The job's checkpoint.dir is what is wrong, not the run: a restart would fail the same way
  // (unless the error is a transient one, which restarts).
  if (s.ok() || s.code() == absl::StatusCode::kUnavailable) return s;
  return absl::FailedPreconditionError(s.message());
}

namespace {

// The root's writer lock (flock on <root>/.writer.lock), held for one SaveCheckpoint: whoever
// holds it is the only writer, so temporary entries it finds were left by a writer that died.
class WriterLock {
 public:
  static absl::StatusOr<WriterLock> Acquire(const std::string& root) {
    const std::string path = root + "/.writer.lock";
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return Errno("cannot open", path);
    int r;
    while ((r = ::flock(fd, LOCK_EX)) != 0 && errno == EINTR) {
    }
    if (r != 0) {
      absl::Status s = Errno("cannot lock", path);
      ::close(fd);
      return s;
    }
    return WriterLock(fd);
  }
  WriterLock(WriterLock&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;
  WriterLock& operator=(WriterLock&&) = delete;
  ~WriterLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
  }

 private:
  explicit WriterLock(int fd) : fd_(fd) {}
  int fd_;
};

// Removes the temporary checkpoint directories and "latest" files of writers that died mid-write
// (a killed trainer's can hold a whole model's worth of disk).
void RemoveStaleTemporaries(const std::string& root) {
  std::vector<std::string> stale;
  if (DIR* d = ::opendir(root.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.rfind(".tmp.", 0) == 0 || n.rfind(".latest.", 0) == 0 || n.rfind(".fence.", 0) == 0)
        stale.push_back(n);
    }
    ::closedir(d);
  }
  for (const std::string& n : stale) {
    const std::string path = root + "/" + n;
    if (::unlink(path.c_str()) != 0) RemoveTree(path);
  }
}

constexpr char kCommitLog[] = "commits.log";

// Replaces <root>/<name> with `text` atomically (a synced temporary ".<name>.<pid>", renamed over
// it, the directory synced); a failure leaves the old file.
absl::Status ReplaceFile(const std::string& root, const std::string& name,
                         const std::string& text) {
  const std::string tmp = absl::StrCat(root, "/.", name, ".", ::getpid());
  absl::Status s = WriteFileSynced(tmp, text);
  if (s.ok() && ::rename(tmp.c_str(), (root + "/" + name).c_str()) != 0)
    s = Errno("cannot rename", tmp);
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  return SyncDir(root);
}

// The attempt that <root>/fence names; 0 when there is no fence.
absl::StatusOr<int64_t> ReadFenceFile(const std::string& root) {
  absl::StatusOr<std::string> text = ReadWholeFile(root + "/fence");
  if (!text.ok()) {
    if (text.status().code() == absl::StatusCode::kNotFound) return 0;
    return text.status();
  }
  int64_t attempt = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &attempt) || attempt < 0)
    return absl::DataLossError(absl::StrCat("checkpoint: \"", root, "/fence\" is corrupt"));
  return attempt;
}

absl::Status Superseded(const std::string& root, int64_t attempt, int64_t fence) {
  return absl::AbortedError(absl::StrCat("checkpoint: attempt ", attempt,
                                         " of the job may not write under \"", root, "\": attempt ",
                                         fence, " has taken it over"));
}

// Appends one JSON line to <root>/commits.log (the writer lock held), synced.
absl::Status AppendCommitLog(const std::string& root, nlohmann::json entry) {
  entry["unix_ms"] = std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  const std::string path = absl::StrCat(root, "/", kCommitLog);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot open", path);
  const std::string line = entry.dump() + "\n";
  absl::Status s;
  if (::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
    s = Errno("cannot write", path);
  if (s.ok() && ::fsync(fd) != 0) s = Errno("cannot fsync", path);
  ::close(fd);
  return s;
}

}  // namespace

absl::StatusOr<CheckpointTensors> CollectCheckpointTensors(const ParamSet& params,
                                                           const float* values, const float* state0,
                                                           const float* state1,
                                                           const OptimizerKind* optimizer,
                                                           const GatheredShards* gathered) {
  CheckpointTensors out;
  if (optimizer) {
    out.optimizer_name = optimizer->name;
    out.optimizer_steps = optimizer->steps;
  }
  auto opt_name = [optimizer](int which, const std::string& param) {
    if (optimizer->adamw) return (which == 0 ? "exp_avg." : "exp_avg_sq.") + param;
    return "momentum_buffer." + param;
  };
  for (int i = 0; i < params.size(); ++i) {
    const ParamInfo& p = params.info(i);
    const float* v[3] = {values + p.offset, nullptr, nullptr};
    if (optimizer && state0) {
      v[1] = state0 + p.offset;
      if (optimizer->adamw && state1) v[2] = state1 + p.offset;
    }
    int64_t numel = p.numel;
    if (p.sharded()) {
      numel = 1;
      for (int64_t n : p.full_shape) numel *= n;
      if (!gathered || gathered->tensors.count(i) == 0)
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint: \"", p.name, "\" is a shard and its whole tensor was not gathered"));
      const auto it = gathered->tensors.find(i);
      for (int k = 0; k < 3; ++k) {
        if (v[k] == nullptr) continue;
        if (static_cast<int64_t>(it->second[k].size()) != numel)
          return absl::FailedPreconditionError(absl::StrCat("checkpoint: the gathered \"", p.name,
                                                            "\" holds ", it->second[k].size(),
                                                            " values, its whole tensor ", numel));
        v[k] = it->second[k].data();
      }
    }
    out.model[p.name] = {p.full_shape, v[0], numel};
    if (v[1]) out.optimizer[opt_name(0, p.name)] = {p.full_shape, v[1], numel};
    if (v[2]) out.optimizer[opt_name(1, p.name)] = {p.full_shape, v[2], numel};
  }
  return out;
}

absl::StatusOr<std::string> SaveCheckpoint(const std::string& root, ParamSet& params,
                                           Optimizer* optimizer, const ModelConfig& config,
                                           const TrainState& state, int64_t keep, int64_t attempt,
                                           const GatheredShards* gathered) {
  std::optional<OptimizerKind> kind;
  const float *state0 = nullptr, *state1 = nullptr;
  if (optimizer) {
    kind =
        OptimizerKind{optimizer->spec().optimizer, optimizer->is_adamw(), optimizer->steps_taken()};
    if (!optimizer->state0().empty()) state0 = optimizer->state0().f32();
    if (!optimizer->state1().empty()) state1 = optimizer->state1().f32();
  }
  // The tensor files stream from the parameter and optimizer buffers (no copy of the state).
  ASSIGN_OR_RETURN(const CheckpointTensors tensors,
                   CollectCheckpointTensors(params, params.flat_data().f32(), state0, state1,
                                            kind ? &*kind : nullptr, gathered));
  return CommitCheckpoint(root, tensors, config, state, keep, attempt);
}

namespace {

// state.json of a checkpoint whose tensor files have the digests given.
std::string StateJson(const ModelConfig& config, const TrainState& state, int64_t optimizer_steps,
                      const FileDigest& model_file, const FileDigest& opt_file) {
  nlohmann::json st = {
      {"format", 1},
      {"step", state.step},
      {"data_position", state.data_position},
      {"seed", state.seed},
      {"rng_counter", state.rng_counter},
      {"loss", state.loss},
      {"optimizer_steps", optimizer_steps},
      {"model", config.ToJson()},
      {"files",
       {{"model.safetensors", {{"bytes", model_file.bytes}, {"crc32", model_file.crc32}}},
        {"optimizer.safetensors", {{"bytes", opt_file.bytes}, {"crc32", opt_file.crc32}}}}}};
  if (!state.verified_layout.empty()) st["verified_layout"] = state.verified_layout;
  return st.dump(2);
}

// The crash-safe commit of checkpoint `step` under root (the protocol SaveCheckpoint describes):
// `write` creates the files in the temporary directory it is given; `log_commit`: the commit is a
// line of commits.log.
absl::StatusOr<std::string> CommitStepDir(
    const std::string& root, int64_t step, int64_t keep, int64_t attempt, bool log_commit,
    const std::function<absl::Status(const std::string& tmp)>& write) {
  RETURN_IF_ERROR(MakeDirs(root));
  ASSIGN_OR_RETURN(WriterLock lock, WriterLock::Acquire(root));
  if (attempt > 0) {
    // Checked under the lock a newer attempt's fence takes: once that fence is written, this
    // writer can neither commit nor prune.
    ASSIGN_OR_RETURN(const int64_t fence, ReadFenceFile(root));
    if (fence > attempt) return Superseded(root, attempt, fence);
  }
  RemoveStaleTemporaries(root);
  const std::string name = absl::StrFormat("step_%08d", step);
  const std::string tmp = absl::StrCat(root, "/.tmp.", name, ".", ::getpid());
  const std::string final_dir = root + "/" + name;
  if (::mkdir(tmp.c_str(), 0755) != 0) return Errno("cannot create directory", tmp);
  // A write that fails (a full disk, say) takes its partial files with it.
  struct RemoveUnlessRenamed {
    const std::string& dir;
    bool renamed = false;
    ~RemoveUnlessRenamed() {
      if (!renamed) RemoveTree(dir);
    }
  } cleanup{tmp};
  RETURN_IF_ERROR(write(tmp));
  RETURN_IF_ERROR(SyncDir(tmp));
  if (attempt > 0) {
    // Checked again at the last moment, right before anything visible changes: on storage where
    // the writer lock does not hold across hosts, a newer attempt may have fenced the root while
    // this one wrote its files.
    ASSIGN_OR_RETURN(const int64_t fence, ReadFenceFile(root));
    if (fence > attempt) return Superseded(root, attempt, fence);
  }
  RemoveTree(final_dir);  // an earlier attempt's checkpoint of the same step
  if (::rename(tmp.c_str(), final_dir.c_str()) != 0) return Errno("cannot rename", tmp);
  cleanup.renamed = true;
  RETURN_IF_ERROR(ReplaceFile(root, "latest", name + "\n"));
  std::vector<std::string> dirs = StepDirs(root);
  for (size_t i = 0; i + static_cast<size_t>(keep) < dirs.size(); ++i)
    if (dirs[i] != name) RemoveTree(root + "/" + dirs[i]);
  if (log_commit) RETURN_IF_ERROR(AppendCommitLog(root, {{"commit", step}, {"attempt", attempt}}));
  return final_dir;
}

// The size and CRC-32 of `bytes`.
FileDigest DigestOf(std::string_view bytes) {
  FileDigest d;
  AddToDigest(d, bytes.data(), bytes.size());
  return d;
}

}  // namespace

absl::StatusOr<std::string> CommitCheckpoint(const std::string& root,
                                             const CheckpointTensors& tensors,
                                             const ModelConfig& config, const TrainState& state,
                                             int64_t keep, int64_t attempt,
                                             int64_t pause_between_files_ms) {
  auto pause = [pause_between_files_ms] {
    if (pause_between_files_ms > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(pause_between_files_ms));
  };
  return CommitStepDir(
      root, state.step, keep, attempt, /*log_commit=*/true,
      [&](const std::string& tmp) -> absl::Status {
        ASSIGN_OR_RETURN(
            const FileDigest model_file,
            WriteSafetensorsSynced(tmp + "/model.safetensors", tensors.model, {{"format", "pt"}}));
        pause();
        ASSIGN_OR_RETURN(const FileDigest opt_file,
                         WriteSafetensorsSynced(tmp + "/optimizer.safetensors", tensors.optimizer,
                                                {{"optimizer", tensors.optimizer_name}}));
        pause();
        RETURN_IF_ERROR(WriteFileSynced(
            tmp + "/state.json",
            StateJson(config, state, tensors.optimizer_steps, model_file, opt_file)));
        pause();
        return absl::OkStatus();
      });
}

CheckpointFiles SerializeCheckpoint(const CheckpointTensors& tensors, const ModelConfig& config,
                                    const TrainState& state, CheckpointFiles reuse) {
  CheckpointFiles out = std::move(reuse);
  auto serialize = [](const std::map<std::string, SafetensorsEntry>& t,
                      const std::map<std::string, std::string>& metadata, std::string* dst) {
    const std::string header = SafetensorsHeader(t, metadata);
    size_t total = header.size();
    for (const auto& [name, e] : t) total += static_cast<size_t>(e.numel) * 4;
    dst->clear();
    dst->reserve(total);
    dst->append(header);
    for (const auto& [name, e] : t)
      dst->append(reinterpret_cast<const char*>(e.data), static_cast<size_t>(e.numel) * 4);
  };
  serialize(tensors.model, {{"format", "pt"}}, &out.model);
  serialize(tensors.optimizer, {{"optimizer", tensors.optimizer_name}}, &out.optimizer);
  out.state = StateJson(config, state, tensors.optimizer_steps, DigestOf(out.model),
                        DigestOf(out.optimizer));
  return out;
}

absl::Status VerifyCheckpointFiles(const CheckpointFiles& files, const std::string& what) {
  ASSIGN_OR_RETURN(const nlohmann::json st, ParseCheckpointState(files.state, what));
  for (const auto& [fname, bytes] :
       {std::pair<const char*, const std::string*>{"model.safetensors", &files.model},
        {"optimizer.safetensors", &files.optimizer}}) {
    const nlohmann::json& rec = st["files"].value(fname, nlohmann::json());
    const FileDigest d = DigestOf(*bytes);
    if (!rec.is_object() || rec.value("bytes", uint64_t{0}) != d.bytes)
      return absl::DataLossError(absl::StrCat("checkpoint: ", what, ": ", fname,
                                              " is truncated or has the wrong size (", d.bytes,
                                              " bytes)"));
    if (rec.value("crc32", uint32_t{0}) != d.crc32)
      return absl::DataLossError(
          absl::StrCat("checkpoint: ", what, ": ", fname, " is corrupt: checksum mismatch"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckpointFiles> ReadCheckpointFiles(const std::string& dir) {
  CheckpointFiles out;
  ASSIGN_OR_RETURN(out.model, ReadWholeFile(dir + "/model.safetensors"));
  ASSIGN_OR_RETURN(out.optimizer, ReadWholeFile(dir + "/optimizer.safetensors"));
  ASSIGN_OR_RETURN(out.state, ReadWholeFile(dir + "/state.json"));
  return out;
}

absl::StatusOr<std::string> CommitCheckpointFiles(
    const std::string& root, int64_t step,
    const std::vector<std::pair<std::string, std::string_view>>& files, int64_t keep,
    int64_t attempt) {
  // state.json last: a directory is complete once it has one.
  return CommitStepDir(
      root, step, keep, attempt, /*log_commit=*/false, [&](const std::string& tmp) -> absl::Status {
        for (const auto& [name, bytes] : files)
          if (name != "state.json")
            RETURN_IF_ERROR(
                WriteFileSynced(tmp + "/" + name, std::vector<Piece>{{bytes.data(), bytes.size()}})
                    .status());
        for (const auto& [name, bytes] : files)
          if (name == "state.json")
            RETURN_IF_ERROR(
                WriteFileSynced(tmp + "/" + name, std::vector<Piece>{{bytes.data(), bytes.size()}})
                    .status());
        return absl::OkStatus();
      });
}

absl::Status FenceCheckpointRoot(const std::string& root, int64_t attempt) {
  RETURN_IF_ERROR(MakeDirs(root));
  ASSIGN_OR_RETURN(WriterLock lock, WriterLock::Acquire(root));
  ASSIGN_OR_RETURN(const int64_t fence, ReadFenceFile(root));
  if (fence > attempt) return Superseded(root, attempt, fence);
  if (fence == attempt) return absl::OkStatus();
  RETURN_IF_ERROR(ReplaceFile(root, "fence", absl::StrCat(attempt, "\n")));
  return AppendCommitLog(root, {{"fence", attempt}});
}

absl::StatusOr<int64_t> ReadFence(const std::string& root) { return ReadFenceFile(root); }

std::vector<std::string> CompleteCheckpoints(const std::string& root) {
  std::vector<std::string> out;
  const std::vector<std::string> dirs = StepDirs(root);
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    struct stat st;
    if (::stat((root + "/" + *it + "/state.json").c_str(), &st) == 0)
      out.push_back(root + "/" + *it);
  }
  return out;
}

int64_t CheckpointStepOf(const std::string& dir) {
  const size_t slash = dir.find_last_of('/');
  const std::string name = slash == std::string::npos ? dir : dir.substr(slash + 1);
  int64_t step = -1;
  if (name.rfind("step_", 0) != 0 || !absl::SimpleAtoi(name.substr(5), &step) || step < 0)
    return -1;
  return step;
}

absl::StatusOr<std::string> LatestCheckpoint(const std::string& root) {
  auto latest = ReadWholeFile(root + "/latest");
  if (latest.ok()) {
    std::string n = *latest;
    while (!n.empty() && (n.back() == '\n' || n.back() == ' ')) n.pop_back();
    struct stat st;
    if (!n.empty() && ::stat((root + "/" + n + "/state.json").c_str(), &st) == 0)
      return root + "/" + n;
  }
  std::vector<std::string> dirs = StepDirs(root);
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    struct stat st;
    if (::stat((root + "/" + *it + "/state.json").c_str(), &st) == 0) return root + "/" + *it;
  }
  return absl::NotFoundError(
      absl::StrCat("checkpoint: no complete checkpoint under \"", root, "\""));
}

absl::StatusOr<nlohmann::json> ParseCheckpointState(std::string_view text,
                                                    const std::string& path) {
  auto corrupt = [&path](const std::string& why) {
    return absl::DataLossError(
        absl::StrCat("checkpoint: \"", path, "\" is corrupt", why.empty() ? "" : ": ", why));
  };
  if (!JsonDepthWithin(text))
    return corrupt(absl::StrCat("nests deeper than ", kMaxJsonDepth, " levels"));
  nlohmann::json st = nlohmann::json::parse(text, nullptr, false);
  if (st.is_discarded() || !st.is_object() || !st.contains("step") || !st.contains("files") ||
      !st.contains("model"))
    return corrupt("");
  // Every field LoadCheckpoint reads has the type it reads it as (nlohmann throws otherwise).
  if (!st["model"].is_object()) return corrupt("model is not an object");
  for (const char* key : {"step", "data_position", "optimizer_steps", "seed", "rng_counter"})
    if (st.contains(key) && !st[key].is_number_integer())
      return corrupt(absl::StrCat(key, " is not an integer"));
  if (!st["files"].is_object()) return corrupt("files is not an object");
  for (auto it = st["files"].begin(); it != st["files"].end(); ++it) {
    if (!it.value().is_object())
      return corrupt(absl::StrCat("files.", ShortText(it.key()), " is not an object"));
    for (const char* key : {"bytes", "crc32"})
      if (it.value().contains(key) && !it.value()[key].is_number_unsigned())
        return corrupt(
            absl::StrCat("files.", ShortText(it.key()), ".", key, " is not an unsigned integer"));
  }
  return st;
}

absl::StatusOr<nlohmann::json> ReadCheckpointState(const std::string& dir) {
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(dir + "/state.json"));
  return ParseCheckpointState(text, dir + "/state.json");
}

absl::StatusOr<TrainState> LoadCheckpoint(const std::string& dir, ParamSet& params,
                                          Optimizer* optimizer, const ModelConfig& config) {
  ASSIGN_OR_RETURN(nlohmann::json st, ReadCheckpointState(dir));
  // The recorded model must be the one we are loading into.
  const nlohmann::json want = config.ToJson();
  for (const char* key :
       {"vocab", "d_model", "n_layers", "n_heads", "ffn_dim", "layer_pattern", "mla"}) {
    if (st["model"].value(key, nlohmann::json()) != want[key])
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint: \"", dir, "\" was written for a different model: model.", key,
                       " is ", DescribeJson(st["model"].value(key, nlohmann::json())),
                       ", the job has ", DescribeJson(want[key])));
  }
  // The experts' shapes and routing (their bias_rate and z_loss are training settings).
  for (const char* key : {"experts", "top_k", "expert_ffn", "shared_ffn", "first_dense"}) {
    const nlohmann::json have = st["model"].contains("moe") && st["model"]["moe"].is_object()
                                    ? st["model"]["moe"].value(key, nlohmann::json(0))
                                    : nlohmann::json(0);
    const nlohmann::json job =
        want.contains("moe") ? want["moe"].value(key, nlohmann::json(0)) : nlohmann::json(0);
    if (have != job)
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint: \"", dir, "\" was written for a different model: model.moe.",
                       key, " is ", DescribeJson(have), ", the job has ", DescribeJson(job)));
  }
  // Each tensor file is checked whole (size and CRC-32, streamed) and its header parsed; the
  // values are read into place only once everything has been validated.
  std::vector<InputFile> inputs;
  std::map<std::string, SafetensorsIndex> files;
  for (const char* fname : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string path = dir + "/" + fname;
    ASSIGN_OR_RETURN(InputFile in, InputFile::Open(path));
    const auto& rec = st["files"].value(fname, nlohmann::json());
    if (!rec.is_object() || rec.value("bytes", uint64_t{0}) != in.size())
      return absl::DataLossError(absl::StrCat("checkpoint: \"", path,
                                              "\" is truncated or has the "
                                              "wrong size (",
                                              in.size(), " bytes)"));
    ASSIGN_OR_RETURN(const FileDigest digest, in.Digest());
    if (rec.value("crc32", uint32_t{0}) != digest.crc32)
      return absl::DataLossError(
          absl::StrCat("checkpoint: \"", path, "\" is corrupt: checksum mismatch"));
    ASSIGN_OR_RETURN(files[fname], ParseSafetensorsHeader(
                                       [&in](uint64_t off, uint64_t n) { return in.Read(off, n); },
                                       in.size(), path));
    inputs.push_back(std::move(in));
  }
  const InputFile& model_in = inputs[0];
  const InputFile& opt_in = inputs[1];
  const SafetensorsIndex& model = files["model.safetensors"];
  const SafetensorsIndex& opt = files["optimizer.safetensors"];
  auto check = [&](const SafetensorsIndex& f, const std::string& file, const std::string& name,
                   const ParamInfo& p) -> absl::Status {
    auto it = f.tensors.find(name);
    if (it == f.tensors.end())
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint: \"", dir, "/", file, "\" has no tensor \"", name, "\""));
    if (it->second.shape != p.full_shape)
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint: \"", dir, "/", file, "\": tensor \"", name, "\" has shape [",
                       nlohmann::json(it->second.shape).dump(), "], the model expects ",
                       nlohmann::json(p.full_shape).dump()));
    return absl::OkStatus();
  };
  const bool want_opt = optimizer && !optimizer->state0().empty();
  if (want_opt && opt.metadata.count("optimizer") &&
      opt.metadata.at("optimizer") != optimizer->spec().optimizer)
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint: \"", dir, "\" holds ", opt.metadata.at("optimizer"),
                     " optimizer state, the job uses ", optimizer->spec().optimizer));
  // Validate everything before touching anything.
  for (int i = 0; i < params.size(); ++i) {
    const ParamInfo& p = params.info(i);
    RETURN_IF_ERROR(check(model, "model.safetensors", p.name, p));
    if (want_opt) {
      RETURN_IF_ERROR(check(opt, "optimizer.safetensors", OptimizerName(*optimizer, 0, p.name), p));
      if (optimizer->is_adamw())
        RETURN_IF_ERROR(
            check(opt, "optimizer.safetensors", OptimizerName(*optimizer, 1, p.name), p));
    }
  }
  if (model.tensors.size() != static_cast<size_t>(params.size()))
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint: \"", dir, "/model.safetensors\" holds ", model.tensors.size(),
                     " tensors, the model has ", params.size()));
  // Everything checked: read the values into place.
  // A shard reads its own range of the whole tensor.
  auto read = [](const InputFile& in, const SafetensorsEntry& e, const ParamInfo& p, float* dst) {
    return in.ReadAt(e.offset + static_cast<uint64_t>(p.full_offset) * 4,
                     reinterpret_cast<char*>(dst), static_cast<size_t>(p.numel) * 4);
  };
  for (int i = 0; i < params.size(); ++i) {
    const ParamInfo& p = params.info(i);
    RETURN_IF_ERROR(read(model_in, model.tensors.at(p.name), p, params.data(i)));
    if (want_opt) {
      RETURN_IF_ERROR(read(opt_in, opt.tensors.at(OptimizerName(*optimizer, 0, p.name)), p,
                           optimizer->state0().f32() + p.offset));
      if (optimizer->is_adamw())
        RETURN_IF_ERROR(read(opt_in, opt.tensors.at(OptimizerName(*optimizer, 1, p.name)), p,
                             optimizer->state1().f32() + p.offset));
    }
  }
  if (optimizer) optimizer->set_steps_taken(st.value("optimizer_steps", int64_t{0}));
  TrainState s;
  s.step = st.value("step", int64_t{0});
  s.data_position = st.value("data_position", int64_t{0});
  s.seed = st.value("seed", uint64_t{0});
  s.rng_counter = st.value("rng_counter", uint64_t{0});
  s.loss = st.contains("loss") && st["loss"].is_number() ? st["loss"].get<double>() : 0.0;
  if (st.contains("verified_layout") && st["verified_layout"].is_string())
    s.verified_layout = st["verified_layout"].get<std::string>();
  return s;
}

}  // namespace spindle
