// The host snapshot of a checkpoint and its background writer (see checkpoint_writer.h).
#include "worker/engine/checkpoint_writer.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <utility>

namespace spindle {

namespace {

// The writer thread's nice value (0: the process's own; 19: the lowest priority).
constexpr int kWriterNice = 10;

// `dst` sized to n values (reallocated only when its size differs) and zeroed when it was.
void SizeTo(Tensor& dst, int64_t n) {
  if (dst.numel() == n) return;
  dst.Resize({n});
  dst.SetZero();
}

void CopyInto(Tensor& dst, const Tensor& src) {
  SizeTo(dst, src.numel());
  if (src.numel() > 0) std::memcpy(dst.f32(), src.f32(), static_cast<size_t>(src.bytes()));
}

}  // namespace

void CheckpointSnapshot::CopyParams(ParamSet& params) { CopyInto(values_, params.flat_data()); }

void CheckpointSnapshot::CopyOptimizer(Optimizer& optimizer) {
  CopyInto(state0_, optimizer.state0());
  CopyInto(state1_, optimizer.state1());
  kind_ = OptimizerKind{optimizer.spec().optimizer, optimizer.is_adamw(), optimizer.steps_taken()};
}

void CheckpointSnapshot::PrepareOptimizerState(int64_t numel, OptimizerKind kind) {
  SizeTo(state0_, numel);
  SizeTo(state1_, kind.adamw ? numel : 0);
  kind_ = std::move(kind);
}

absl::StatusOr<CheckpointTensors> CheckpointSnapshot::Tensors(const ParamSet& params) const {
  if (values_.numel() != params.numel())
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint: the snapshot holds ", values_.numel(), " values, the model ", params.numel()));
  for (const Tensor* t : {&state0_, &state1_})
    if (!t->empty() && t->numel() != params.numel())
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint: the snapshot's optimizer state holds ", t->numel(),
                       " values, the model ", params.numel()));
  return CollectCheckpointTensors(params, values_.f32(), state0_.empty() ? nullptr : state0_.f32(),
                                  state1_.empty() ? nullptr : state1_.f32(),
                                  kind_ ? &*kind_ : nullptr, &gathered_);
}

int64_t CheckpointSnapshot::bytes() const {
  int64_t n = values_.bytes() + state0_.bytes() + state1_.bytes();
  for (const auto& [index, whole] : gathered_.tensors)
    for (const std::vector<float>& v : whole) n += static_cast<int64_t>(v.size() * sizeof(float));
  return n;
}

CheckpointWriter::CheckpointWriter(Options options)
    : opt_(std::move(options)), thread_([this] { Loop(); }) {}

CheckpointWriter::~CheckpointWriter() {
  {
    absl::MutexLock lock(&mu_);
    quit_ = true;  // the loop finishes the write it holds first
  }
  thread_.join();
}

void CheckpointWriter::Start(CheckpointTensors tensors, const TrainState& state) {
  absl::MutexLock lock(&mu_);
  job_tensors_ = std::move(tensors);
  job_state_ = state;
  result_.reset();
  pending_ = true;
}

bool CheckpointWriter::Finished() const {
  absl::MutexLock lock(&mu_);
  return result_.has_value();
}

std::optional<CheckpointWriteResult> CheckpointWriter::Wait(double* waited_s) {
  if (waited_s) *waited_s = 0;
  if (!pending_) return std::nullopt;
  const auto t0 = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](std::optional<CheckpointWriteResult>* r) { return r->has_value(); }, &result_));
  if (waited_s)
    *waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  pending_ = false;
  std::optional<CheckpointWriteResult> out = std::move(result_);
  result_.reset();
  return out;
}

void CheckpointWriter::Drain() const {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](const CheckpointWriter* w)
           ABSL_NO_THREAD_SAFETY_ANALYSIS { return !w->busy_ && !w->job_tensors_.has_value(); },
      this));
}

void CheckpointWriter::Loop() {
  // The write yields the cores to the steps: a nicer thread (Linux schedules threads one by one)
  // takes the time the compute threads leave, where the checksums and copies into the page cache
  // would otherwise slow the steps beside them. Best effort: the write is the same without it.
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), kWriterNice);
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(
        +[](CheckpointWriter* w)
             ABSL_NO_THREAD_SAFETY_ANALYSIS { return w->quit_ || w->job_tensors_.has_value(); },
        this));
    if (!job_tensors_) return;  // quit with nothing to write
    const CheckpointTensors tensors = std::move(*job_tensors_);
    job_tensors_.reset();
    const TrainState state = job_state_;
    busy_ = true;
    // The write runs unlocked: the owner may poll meanwhile.
    mu_.Unlock();
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<std::string> dir =
        CommitCheckpoint(opt_.root, tensors, opt_.config, state, opt_.keep, opt_.attempt,
                         opt_.pause_between_files_ms);
    const double write_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    mu_.Lock();
    result_ = CheckpointWriteResult{state.step, std::move(dir), write_s};
    busy_ = false;
  }
}

}  // namespace spindle
