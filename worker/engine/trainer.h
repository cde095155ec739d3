// Trainer: the step loop of one rank. Builds the model from the job spec, opens the data,
// resumes from the newest complete checkpoint under the checkpoint directory (if any), then per
// step: micro-batches forward+backward, global gradient norm and clipping, the optimizer update
// at the scheduled learning rate, a progress event, and checkpoints every `checkpoint.every`
// steps and at the end. Events are JSON objects handed to a callback (spindle-train prints them
// one per line). Not thread-safe; one trainer per process (or per thread in tests).
//
// Multi-rank (world = dp * cp > 1): rank r is CP rank r % cp of data-parallel replica r / cp.
// Each replica takes its own micro-batches of the step's sequences; each CP rank its zigzag share
// of them (cp/cp_layout.h). Communicators are Gloo groups bootstrapped from `store`: the world
// (gradients, loss) and the replica's CP group (the model's CP collectives). The loss and its
// token count are summed over the world; gradients are all-reduced over the world in buckets
// launched while the backward goes on; the norm, clipping and update follow the reduction, so
// every rank holds the same parameters. Rank 0 writes checkpoints; all ranks resume from the
// same step or Create() fails. Step events carry "comm": the step's collectives per (collective,
// layer type) with seconds and bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "nlohmann/json.hpp"
#include "worker/engine/checkpoint.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/kv_store.h"
#include "worker/engine/data.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"

namespace spindle {

struct TrainerOptions {
  JobSpec spec;
  int64_t rank = 0;
  int64_t world = 1;
  std::string checkpoint_dir;  // overrides spec.checkpoint.dir when non-empty
  std::function<void(const nlohmann::json&)> on_event;
  // Stop (as if killed) once this many steps are completed; -1 = run to spec.train.steps.
  int64_t stop_at_step = -1;
  // world > 1: where the communicators rendezvous (not owned; used during Create() only).
  KvStore* store = nullptr;
  GlooOptions gloo;
  // Mode per layer type; kAuto: the spec's (itself resolved by the planner's rule).
  CpMode lightning_mode = CpMode::kAuto;
  CpMode mla_mode = CpMode::kAuto;
  // Gradient all-reduce bucket size, in floats.
  int64_t grad_bucket_floats = int64_t{1} << 20;
};

class Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(TrainerOptions options);
  absl::Status Run();

  Model& model() { return *model_; }
  const TrainState& state() const { return state_; }
  // Loss of every step this process ran.
  const std::vector<double>& losses() const { return losses_; }
  const CpModes& cp_modes() const { return modes_; }

 private:
  Trainer(TrainerOptions options) : opt_(std::move(options)) {}
  absl::Status Step();
  absl::Status Checkpoint();
  void Emit(nlohmann::json event);

  absl::Status AgreeOnResume();

  TrainerOptions opt_;
  int64_t cp_ = 1, dp_ = 1, cp_rank_ = 0, dp_rank_ = 0;
  CpModes modes_;
  std::unique_ptr<Communicator> world_comm_, cp_comm_;
  std::string ckpt_dir_;
  std::unique_ptr<DataSource> data_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Optimizer> optimizer_;
  TrainState state_;
  std::vector<double> losses_;
  double elapsed_s_ = 0.0;
};

// Loss of a checkpoint on `n_sequences` sequences of `data` (sequences 0..n-1), without
// training. Also reports the loss on answer tokens for synthetic tasks.
struct EvalResult {
  double loss = 0.0;
  int64_t n_valid = 0;
  double answer_loss = 0.0;  // NaN when the source marks no answers
  int64_t n_answers = 0;
};
absl::StatusOr<EvalResult> EvaluateCheckpoint(const JobSpec& spec, const std::string& checkpoint,
                                              const DataSpec& data, int64_t n_sequences);

}  // namespace spindle
