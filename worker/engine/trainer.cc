// The single-rank step loop, resume and evaluation (see trainer.h).
#include "worker/engine/trainer.h"

#include <chrono>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cpu/ops.h"
#include "worker/engine/batch.h"

namespace spindle {

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(TrainerOptions options) {
  std::unique_ptr<Trainer> t(new Trainer(std::move(options)));
  const JobSpec& spec = t->opt_.spec;
  if (t->opt_.world != 1 || spec.parallel.world() != 1)
    return absl::UnimplementedError(
        absl::StrCat("trainer: this build runs one rank per job; the job asks for cp=",
                     spec.parallel.cp, " dp=", spec.parallel.dp));
  t->ckpt_dir_ = t->opt_.checkpoint_dir.empty() ? spec.checkpoint.dir : t->opt_.checkpoint_dir;
  ASSIGN_OR_RETURN(t->data_,
                   OpenDataSource(spec.data, spec.seq_len, spec.model.vocab, spec.train.seed));
  ASSIGN_OR_RETURN(t->model_, Model::Create(spec.model, spec.train.seed));
  t->optimizer_ = std::make_unique<Optimizer>(spec.train, t->model_->params());
  t->state_.seed = spec.train.seed;
  if (!t->ckpt_dir_.empty()) {
    auto latest = LatestCheckpoint(t->ckpt_dir_);
    if (latest.ok()) {
      ASSIGN_OR_RETURN(t->state_, LoadCheckpoint(*latest, t->model_->params(),
                                                 t->optimizer_.get(), spec.model));
      if (t->state_.seed != spec.train.seed)
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint: \"", *latest, "\" was written with seed ", t->state_.seed,
            ", the job has train.seed = ", spec.train.seed));
    } else if (latest.status().code() != absl::StatusCode::kNotFound) {
      return latest.status();
    }
  }
  return t;
}

void Trainer::Emit(nlohmann::json event) {
  if (opt_.on_event) opt_.on_event(event);
}

absl::Status Trainer::Run() {
  const JobSpec& spec = opt_.spec;
  Emit({{"event", "start"},
        {"job", spec.name},
        {"rank", opt_.rank},
        {"world", opt_.world},
        {"resumed_from_step", state_.step},
        {"total_steps", spec.train.steps},
        {"params", model_->config().NumParams()},
        {"seq_len", spec.seq_len}});
  while (state_.step < spec.train.steps) {
    if (opt_.stop_at_step >= 0 && state_.step >= opt_.stop_at_step) return absl::OkStatus();
    RETURN_IF_ERROR(Step());
    const bool last = state_.step == spec.train.steps;
    const bool due = spec.checkpoint.every > 0 && state_.step % spec.checkpoint.every == 0;
    if (!ckpt_dir_.empty() && (last || due)) RETURN_IF_ERROR(Checkpoint());
  }
  Emit({{"event", "done"},
        {"step", state_.step},
        {"final_loss", losses_.empty() ? std::numeric_limits<double>::quiet_NaN() : losses_.back()}});
  return absl::OkStatus();
}

absl::Status Trainer::Step() {
  const JobSpec& spec = opt_.spec;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t mb = spec.train.micro_batches;
  std::vector<Batch> batches;
  int64_t n_valid = 0;
  for (int64_t m = 0; m < mb; ++m) {
    batches.push_back(MakeSequenceBatch(data_->Sequence(state_.data_position + m), data_->eos_id()));
    n_valid += batches.back().NumValidTargets();
  }
  ParamSet& P = model_->params();
  P.ZeroGrad();
  LossStats total;
  const float grad_scale = n_valid > 0 ? 1.0f / static_cast<float>(n_valid) : 0.0f;
  for (const Batch& b : batches) {
    LossStats s = model_->ForwardBackward(b, grad_scale, spec.train.recompute);
    total.loss_sum += s.loss_sum;
    total.n_valid += s.n_valid;
  }
  const double loss = total.n_valid ? total.loss_sum / total.n_valid : 0.0;
  if (!std::isfinite(loss))
    return absl::InternalError(absl::StrCat("trainer: loss is not finite at step ", state_.step + 1));
  const double grad_norm =
      std::sqrt(kernels::cpu::SumSquares(P.flat_grad().f32(), P.flat_grad().numel()));
  if (spec.train.grad_clip > 0 && grad_norm > spec.train.grad_clip)
    kernels::cpu::Scale(P.flat_grad().f32(), P.flat_grad().numel(),
                        static_cast<float>(spec.train.grad_clip / (grad_norm + 1e-6)));
  const double lr = ScheduledLr(spec.train, state_.step);
  optimizer_->Step(lr);
  state_.step += 1;
  state_.data_position += mb * spec.parallel.dp;
  losses_.push_back(loss);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  elapsed_s_ += dt;
  const double tokens = static_cast<double>(spec.seq_len * mb * spec.parallel.dp);
  Emit({{"event", "step"},
        {"step", state_.step},
        {"total_steps", spec.train.steps},
        {"loss", loss},
        {"tokens_per_s", tokens / dt},
        {"step_s", dt},
        {"lr", lr},
        {"grad_norm", grad_norm},
        {"elapsed_s", elapsed_s_},
        {"tflops", model_->config().TrainFlopsPerToken(spec.seq_len) * tokens / dt / 1e12}});
  return absl::OkStatus();
}

absl::Status Trainer::Checkpoint() {
  if (opt_.rank != 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::string dir,
                   SaveCheckpoint(ckpt_dir_, model_->params(), optimizer_.get(),
                                  opt_.spec.model, state_, opt_.spec.checkpoint.keep));
  Emit({{"event", "checkpoint"}, {"step", state_.step}, {"path", dir}});
  return absl::OkStatus();
}

absl::StatusOr<EvalResult> EvaluateCheckpoint(const JobSpec& spec, const std::string& checkpoint,
                                              const DataSpec& data, int64_t n_sequences) {
  ASSIGN_OR_RETURN(auto source, OpenDataSource(data, spec.seq_len, spec.model.vocab, spec.train.seed));
  ASSIGN_OR_RETURN(auto model, Model::Create(spec.model, spec.train.seed));
  RETURN_IF_ERROR(LoadCheckpoint(checkpoint, model->params(), nullptr, spec.model).status());
  EvalResult r;
  double sum = 0.0, ans_sum = 0.0;
  for (int64_t n = 0; n < n_sequences; ++n) {
    Batch b = MakeSequenceBatch(source->Sequence(n), source->eos_id());
    LossStats s = model->Forward(b);
    sum += s.loss_sum;
    r.n_valid += s.n_valid;
    // Answer tokens: keep only targets that are answers, and run again (cheap at eval sizes).
    std::vector<bool> mask = source->AnswerMask(n);
    if (!mask.empty()) {
      Batch a = b;
      for (int64_t i = 0; i < a.T; ++i)
        a.targets[i] = (i + 1 < a.T && mask[i + 1]) ? a.targets[i] : -1;
      LossStats sa = model->Forward(a);
      ans_sum += sa.loss_sum;
      r.n_answers += sa.n_valid;
    }
  }
  r.loss = r.n_valid ? sum / r.n_valid : 0.0;
  r.answer_loss = r.n_answers ? ans_sum / r.n_answers : std::numeric_limits<double>::quiet_NaN();
  return r;
}

}  // namespace spindle
