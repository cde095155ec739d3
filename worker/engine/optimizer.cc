// AdamW / SGD over flat parameter buffers and the warmup + cosine schedule (see optimizer.h).
#include "worker/engine/optimizer.h"

#include <cmath>

#include "kernels/cpu/ops.h"

namespace spindle {

double ScheduledLr(const TrainSpec& t, int64_t step) {
  if (t.warmup_steps > 0 && step < t.warmup_steps)
    return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup_steps);
  if (t.schedule == "constant") return t.lr;
  const int64_t decay_steps = t.steps - t.warmup_steps;
  if (decay_steps <= 1) return t.lr;
  const double progress =
      static_cast<double>(step - t.warmup_steps) / static_cast<double>(decay_steps - 1);
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
}

Optimizer::Optimizer(const TrainSpec& spec, ParamSet& params) : spec_(spec), params_(params) {
  AllocateState();
}

void Optimizer::AllocateState() {
  if (m_.empty()) m_ = Tensor::Zeros({params_.numel()});
  if (is_adamw() && v_.empty()) v_ = Tensor::Zeros({params_.numel()});
}

void Optimizer::ReleaseState() {
  m_ = Tensor();
  v_ = Tensor();
}

void Optimizer::Step(double lr) {
  ++steps_;
  for (int i = 0; i < params_.size(); ++i) {
    const ParamInfo& p = params_.info(i);
    const float wd = p.weight_decay ? static_cast<float>(spec_.weight_decay) : 0.0f;
    float* m = m_.f32() + p.offset;
    if (is_adamw()) {
      kernels::cpu::AdamWParams hp{static_cast<float>(lr), static_cast<float>(spec_.beta1),
                                   static_cast<float>(spec_.beta2), static_cast<float>(spec_.eps),
                                   wd, steps_};
      kernels::cpu::AdamWStep(params_.data(i), params_.grad(i), m, v_.f32() + p.offset, p.numel,
                              hp);
    } else {
      kernels::cpu::SgdStep(params_.data(i), params_.grad(i), spec_.momentum > 0 ? m : nullptr,
                            p.numel, static_cast<float>(lr), static_cast<float>(spec_.momentum),
                            wd);
    }
  }
}

}  // namespace spindle
