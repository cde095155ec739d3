// The CPU model as a StepBackend (see cpu_step_backend.h).
#include "worker/engine/cpu_step_backend.h"

#include <cstring>

#include "common/status.h"
#include "kernels/cpu/ops.h"
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/numerics.h"

namespace spindle {
namespace {

// Copies `from` into `to` where both hold the same number of floats (state one side keeps and
// the other does not is left as it is).
void CopyState(const Tensor& from, Tensor* to) {
  if (from.empty() || to->empty() || from.numel() != to->numel()) return;
  std::memcpy(to->f32(), from.f32(), static_cast<size_t>(from.numel()) * sizeof(float));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuStepBackend>> CpuStepBackend::Create(const ModelConfig& config,
                                                                        uint64_t seed,
                                                                        const TrainSpec& train,
                                                                        int64_t ep,
                                                                        int64_t ep_rank) {
  ASSIGN_OR_RETURN(std::unique_ptr<Model> model,
                   Model::Create(config, seed, /*host_grads=*/true, ep, ep_rank));
  return std::unique_ptr<CpuStepBackend>(new CpuStepBackend(std::move(model), train));
}

CpuStepBackend::CpuStepBackend(std::unique_ptr<Model> model, const TrainSpec& train)
    : model_(std::move(model)),
      optimizer_(std::make_unique<Optimizer>(train, model_->params())),
      fp8_recipe_(train.fp8_recipe) {}

absl::Status CpuStepBackend::ZeroGrads() {
  model_->params().ZeroGrad();
  return absl::OkStatus();
}

absl::StatusOr<LossStats> CpuStepBackend::ForwardBackward(const Batch& batch, float grad_scale,
                                                          Recompute recompute,
                                                          const GradReadyFn& on_grad_ready) {
  ASSIGN_OR_RETURN(CpBatch share, ShardForCp(batch, 1, 0));
  return model_->ForwardBackward(share, grad_scale, recompute, on_grad_ready);
}

absl::StatusOr<LossStats> CpuStepBackend::Forward(const Batch& batch) {
  return model_->Forward(batch);
}

absl::Status CpuStepBackend::SetCp(const CpContext& cp) {
  model_->SetCp(cp);
  return absl::OkStatus();
}

absl::StatusOr<LossStats> CpuStepBackend::ForwardBackward(const CpBatch& batch, float grad_scale,
                                                          Recompute recompute,
                                                          const GradReadyFn& on_grad_ready) {
  return model_->ForwardBackward(batch, grad_scale, recompute, on_grad_ready);
}

absl::StatusOr<LossStats> CpuStepBackend::Forward(const CpBatch& batch) {
  return model_->Forward(batch);
}

absl::Status CpuStepBackend::SetPrecision(TrainPrecision precision) {
  Numerics n = CpuNumerics(precision, fp8_recipe_);
  n.outliers = outliers_;
  model_->SetNumerics(n);
  return absl::OkStatus();
}

absl::StatusOr<double> CpuStepBackend::GradSquaredNorm() {
  Tensor& g = model_->params().flat_grad();
  return kernels::cpu::SumSquares(g.f32(), g.numel());
}

absl::StatusOr<double> CpuStepBackend::GradSquaredNorm(int64_t begin, int64_t end) {
  Tensor& g = model_->params().flat_grad();
  if (begin < 0 || end < begin || end > g.numel())
    return absl::InvalidArgumentError("cpu backend: a gradient range outside the flat buffer");
  return kernels::cpu::SumSquares(g.f32() + begin, end - begin);
}

absl::Status CpuStepBackend::OptimizerStep(const TrainSpec& spec, double lr, float grad_scale) {
  (void)spec;  // the optimizer was built with the job's
  if (grad_scale != 1.0f) {
    Tensor& g = model_->params().flat_grad();
    kernels::cpu::Scale(g.f32(), g.numel(), grad_scale);
  }
  optimizer_->Step(lr);
  return absl::OkStatus();
}

absl::Status CpuStepBackend::DownloadOptimizerState(Tensor* m, Tensor* v) {
  CopyState(optimizer_->state0(), m);
  CopyState(optimizer_->state1(), v);
  return absl::OkStatus();
}

absl::Status CpuStepBackend::UploadOptimizerState(const Tensor& m, const Tensor& v,
                                                  int64_t steps_taken) {
  CopyState(m, &optimizer_->state0());
  CopyState(v, &optimizer_->state1());
  optimizer_->set_steps_taken(steps_taken);
  return absl::OkStatus();
}

// The trainer asks for device collectives only from backends that report a device (DeviceId is
// empty here): a call is a caller's mistake, refused by name.
absl::StatusOr<std::unique_ptr<Communicator>> CpuStepBackend::CreateDeviceCommunicator(
    KvStore&, const std::string&, int, int, absl::Duration) {
  return absl::FailedPreconditionError(
      "cpu backend: the host has no device communicators; its collectives are the trainer's Gloo "
      "groups");
}

absl::Status CpuStepBackend::AllReduceGrads(Communicator&, int64_t, int64_t) {
  return absl::FailedPreconditionError(
      "cpu backend: the host has no device communicators; the trainer sums host gradients over "
      "its Gloo world");
}

}  // namespace spindle
