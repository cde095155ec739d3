// Trainer: the step loop of one rank. Builds the model from the job spec, opens the data,
// resumes from the newest complete checkpoint under the checkpoint directory (if any), then per
// step: micro-batches forward+backward, global gradient norm and clipping, the optimizer update
// at the scheduled learning rate, a progress event, and checkpoints every `checkpoint.every`
// steps and at the end. Events are JSON objects handed to a callback (spindle-train prints them
// one per line). Not thread-safe; one trainer per process.
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
};

class Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(TrainerOptions options);
  absl::Status Run();

  Model& model() { return *model_; }
  const TrainState& state() const { return state_; }
  // Loss of every step this process ran.
  const std::vector<double>& losses() const { return losses_; }

 private:
  Trainer(TrainerOptions options) : opt_(std::move(options)) {}
  absl::Status Step();
  absl::Status Checkpoint();
  void Emit(nlohmann::json event);

  TrainerOptions opt_;
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
