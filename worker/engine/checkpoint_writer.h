// Checkpoints off the step's critical path: a CheckpointSnapshot copies one checkpoint's state
// (parameters, optimizer state, gathered expert shards; the TrainState with the data position and
// RNG) into host buffers inside the step, and a CheckpointWriter commits it on a thread of its
// own with the crash-safe protocol of checkpoint.h (CommitCheckpoint: writer lock, fence,
// temporary directory, fsync, rename, latest, commits.log) while training goes on.
//
// At most one write is in flight, and the writer holds one snapshot: the next snapshot can only
// be taken once the previous write has finished (WaitIdle, which says how long it waited), so
// memory stays one copy of the state however slow the volume is. The buffers are allocated by
// the first snapshot and reused by every later one (they reallocate only if the sizes change).
//
// Thread-safety: one owning thread calls every method but Drain(); the writer's thread touches the
// snapshot only between Start() and the end of that write, during which the owner does not touch
// it. Destruction waits for the write in flight (its result is then dropped).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/model_config.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/params.h"
#include "worker/engine/tensor.h"

namespace spindle {

// One checkpoint's state in host memory, in the flat layout of the ParamSet it was taken from.
class CheckpointSnapshot {
 public:
  // Copies the values of `params` into the snapshot.
  void CopyParams(ParamSet& params);
  // Copies the optimizer's state (AdamW's moments, SGD's momentum; none when it keeps none) and
  // records its kind and step count.
  void CopyOptimizer(Optimizer& optimizer);
  // For a device backend, which downloads its optimizer state straight into the snapshot:
  // the buffers (DownloadOptimizerState resizes them only when their size is wrong) and the
  // optimizer's kind.
  // PrepareOptimizerState sizes them as Optimizer::AllocateState would (zeroed when allocated).
  void PrepareOptimizerState(int64_t numel, OptimizerKind kind);
  Tensor& state0() { return state0_; }
  Tensor& state1() { return state1_; }
  // The whole tensors of sharded parameters (Trainer gathers them into it; their vectors keep
  // their capacity from one snapshot to the next).
  GatheredShards& gathered() { return gathered_; }

  // The tensors to write, read from the snapshot's buffers (which must outlive their use).
  absl::StatusOr<CheckpointTensors> Tensors(const ParamSet& params) const;
  // Bytes held in buffers.
  int64_t bytes() const;

 private:
  Tensor values_, state0_, state1_;
  std::optional<OptimizerKind> kind_;
  GatheredShards gathered_;
};

// What one background write ended with.
struct CheckpointWriteResult {
  int64_t step = 0;
  absl::StatusOr<std::string> dir;  // the checkpoint directory, or the write's error
  double write_s = 0;               // the write's own duration, on the writer's thread
};

class CheckpointWriter {
 public:
  struct Options {
    std::string root;
    ModelConfig config;
    int64_t keep = 2;
    int64_t attempt = 0;
    int64_t pause_between_files_ms = 0;  // test hook: CommitCheckpoint's
  };
  explicit CheckpointWriter(Options options);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // The buffers of the next snapshot: only while no write is in flight (after WaitIdle()).
  CheckpointSnapshot& snapshot() { return snapshot_; }

  // Commits the snapshot's `tensors` (CheckpointSnapshot::Tensors) as checkpoint `state.step` in
  // the background. Only while no write is in flight; the previous result must have been taken.
  void Start(CheckpointTensors tensors, const TrainState& state);
  // Whether a write has been started and its result not yet taken.
  bool pending() const { return pending_; }
  // Whether the pending write has finished (its result can be taken without waiting).
  bool Finished() const;
  // Waits for the pending write to finish and takes its result (nullopt when none is pending);
  // `waited_s` (optional) gets the seconds spent waiting.
  std::optional<CheckpointWriteResult> Wait(double* waited_s = nullptr);
  // Returns once no write is in flight (the result stays for Wait). Unlike the other methods it
  // may be called from any thread: a process being stopped lets the write in flight finish.
  void Drain() const;

 private:
  void Loop();

  const Options opt_;
  CheckpointSnapshot snapshot_;
  bool pending_ = false;  // owner's view: started, result not taken

  mutable absl::Mutex mu_;
  // The job handed to the thread, and what it gave back.
  std::optional<CheckpointTensors> job_tensors_ ABSL_GUARDED_BY(mu_);
  TrainState job_state_ ABSL_GUARDED_BY(mu_);
  std::optional<CheckpointWriteResult> result_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // the thread is writing
  bool quit_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace spindle
