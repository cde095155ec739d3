// CpuStepBackend: the CPU model (model.h) and its optimizer behind the StepBackend interface, so
// that the trainer runs one step for every engine. Its "device" is the host: host_params() is the
// model's own ParamSet, the Download*/Upload* of parameters and gradients do nothing, and the
// trainer's checkpoints read and write its optimizer's state in place (HostOptimizer). The gradients being
// host memory, ForwardBackward reports them ready layer by layer (on_grad_ready) for the
// trainer's overlapped all-reduce. train.precision selects the CPU numerics (numerics.h: exact
// fp32, or the bf16 and fp8 emulations). No device collectives (DeviceId() is empty). Not
// thread-safe.
#pragma once

#include <memory>
#include <optional>

#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/step_backend.h"

namespace spindle {

class CpuStepBackend : public StepBackend {
 public:
  // The model initialised from `seed` (Model::Create, with the experts of EP rank ep_rank of ep)
  // with `train`'s optimizer.
  static absl::StatusOr<std::unique_ptr<CpuStepBackend>> Create(const ModelConfig& config,
                                                                uint64_t seed,
                                                                const TrainSpec& train,
                                                                int64_t ep = 1,
                                                                int64_t ep_rank = 0);

  const ModelConfig& config() const override { return model_->config(); }
  ParamSet& host_params() override { return model_->params(); }
  Model& model() { return *model_; }

  absl::Status ZeroGrads() override;
  bool HostGradients() const override { return true; }
  // The whole-sequence training pass runs as a share of one rank (ShardForCp at cp = 1), the CP
  // forms' path, which reports gradients ready as the backward goes (the whole-sequence form
  // computes the same bits, DeviceTrainerTest, but has no such report).
  absl::StatusOr<LossStats> ForwardBackward(const Batch& batch, float grad_scale,
                                            Recompute recompute,
                                            const GradReadyFn& on_grad_ready) override;
  absl::StatusOr<LossStats> Forward(const Batch& batch) override;
  absl::Status SetCp(const CpContext& cp) override;
  absl::StatusOr<LossStats> ForwardBackward(const CpBatch& batch, float grad_scale,
                                            Recompute recompute,
                                            const GradReadyFn& on_grad_ready) override;
  absl::StatusOr<LossStats> Forward(const CpBatch& batch) override;
  absl::Status SetPrecision(TrainPrecision precision) override;
  absl::Status SetFp8Recipe(TrainFp8Recipe recipe) override {
    fp8_recipe_ = recipe;
    return absl::OkStatus();
  }
  // Experiments only (Numerics::outliers): the outliers every later SetPrecision injects.
  void SetOutlierInjection(std::optional<OutlierInjection> outliers) { outliers_ = outliers; }
  absl::Status SetZLoss(float z_loss) override {
    model_->SetZLoss(z_loss);
    return absl::OkStatus();
  }
  absl::Status SetExpertParallel(Communicator* ep) override {
    return model_->SetExpertParallel(ep);
  }
  int64_t ExpertGradEnd() const override { return model_->ExpertGradEnd(); }
  void BeginStep(double tokens) override { model_->BeginStep(tokens); }
  absl::StatusOr<nlohmann::json> FinishMoeStep(Communicator* world) override {
    return model_->FinishMoeStep(world);
  }
  absl::StatusOr<double> GradSquaredNorm() override;
  absl::StatusOr<double> GradSquaredNorm(int64_t begin, int64_t end) override;
  absl::Status OptimizerStep(const TrainSpec& spec, double lr, float grad_scale) override;
  int64_t steps_taken() const override { return optimizer_->steps_taken(); }

  absl::Status DownloadGrads() override { return absl::OkStatus(); }
  absl::Status UploadGrads() override { return absl::OkStatus(); }
  absl::Status DownloadParams() override { return absl::OkStatus(); }
  absl::Status UploadParams() override { return absl::OkStatus(); }
  absl::Status DownloadOptimizerState(Tensor* m, Tensor* v) override;
  absl::Status UploadOptimizerState(const Tensor& m, const Tensor& v,
                                    int64_t steps_taken) override;
  Optimizer* HostOptimizer() override { return optimizer_.get(); }

  nlohmann::json StepEventFields() override { return nlohmann::json::object(); }
  std::string DeviceId() override { return ""; }
  absl::StatusOr<std::unique_ptr<Communicator>> CreateDeviceCommunicator(
      KvStore& store, const std::string& prefix, int rank, int size,
      absl::Duration timeout) override;
  absl::Status AllReduceGrads(Communicator& comm, int64_t begin, int64_t end) override;

 private:
  CpuStepBackend(std::unique_ptr<Model> model, const TrainSpec& train);

  std::unique_ptr<Model> model_;
  std::unique_ptr<Optimizer> optimizer_;
  TrainFp8Recipe fp8_recipe_;  // how SetPrecision's "fp8" scales (train.fp8_recipe)
  std::optional<OutlierInjection> outliers_;
};

}  // namespace spindle
