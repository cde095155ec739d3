// Optimizer: AdamW (decoupled weight decay on matrices only) or SGD with momentum over the
// ParamSet's flat buffers, and the learning-rate schedule (linear warmup, then cosine to min_lr
// or constant). State buffers share the parameters' flat layout, which checkpoints save per
// parameter name. Not thread-safe.
#pragma once

#include <cstdint>

#include "common/job_spec.h"
#include "worker/engine/params.h"
#include "worker/engine/tensor.h"

namespace spindle {

// Learning rate of 0-based step `step`.
double ScheduledLr(const TrainSpec& t, int64_t step);

class Optimizer {
 public:
  Optimizer(const TrainSpec& spec, ParamSet& params);
  // One update with the current gradients (already averaged and clipped) at learning rate lr.
  void Step(double lr);

  const TrainSpec& spec() const { return spec_; }
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t n) { steps_ = n; }
  bool is_adamw() const { return spec_.optimizer == "adamw"; }
  // AdamW: exp_avg and exp_avg_sq; SGD: momentum (first) only, when momentum > 0.
  Tensor& state0() { return m_; }
  Tensor& state1() { return v_; }
  // The state buffers, zeroed where missing (the constructor does this), or gone. A trainer
  // whose optimizer state lives on a device holds the host copy only around checkpoint loads and
  // saves (12 bytes per parameter with AdamW would otherwise stay on the host).
  void AllocateState();
  void ReleaseState();

 private:
  TrainSpec spec_;
  ParamSet& params_;
  int64_t steps_ = 0;
  Tensor m_, v_;
};

}  // namespace spindle
