// CudaStepBackend: the StepBackend of resources "cuda" jobs, a thin adapter over CudaModel (see
// trainer_cuda.h).
#include "worker/engine/cuda/trainer_cuda.h"

#include <cuda_runtime.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/engine/cuda/cuda_model.h"
#ifdef SPINDLE_HAVE_NCCL
#include "worker/engine/comm/nccl_communicator.h"
#endif

namespace spindle {
namespace {

class CudaStepBackend final : public StepBackend {
 public:
  explicit CudaStepBackend(std::unique_ptr<CudaModel> model) : m_(std::move(model)) {}

  const ModelConfig& config() const override { return m_->config(); }
  ParamSet& host_params() override { return m_->host_params(); }
  absl::Status ZeroGrads() override { return m_->ZeroGrads(); }
  absl::StatusOr<LossStats> ForwardBackward(const Batch& batch, float grad_scale,
                                            Recompute recompute, const GradReadyFn&) override {
    return m_->ForwardBackward(batch, grad_scale, recompute);
  }
  absl::StatusOr<LossStats> Forward(const Batch& batch) override { return m_->Forward(batch); }
  absl::Status SetCp(const CpContext& cp) override { return m_->SetCp(cp); }
  absl::StatusOr<LossStats> ForwardBackward(const CpBatch& batch, float grad_scale,
                                            Recompute recompute, const GradReadyFn&) override {
    return m_->ForwardBackward(batch, grad_scale, recompute);
  }
  absl::StatusOr<LossStats> Forward(const CpBatch& batch) override { return m_->Forward(batch); }
  absl::Status SetOffloadInputs(bool on) override { return m_->SetOffloadInputs(on); }
  absl::Status SetZLoss(float z_loss) override {
    m_->SetZLoss(z_loss);
    return absl::OkStatus();
  }
  absl::Status SetPrecision(TrainPrecision precision) override {
    return m_->SetPrecision(precision, fp8_recipe_);
  }
  absl::Status SetFp8Recipe(TrainFp8Recipe recipe) override {
    fp8_recipe_ = recipe;
    return absl::OkStatus();
  }
  absl::StatusOr<double> GradSquaredNorm() override { return m_->GradSquaredNorm(); }
  void BeginStep(double tokens) override { m_->BeginStep(tokens); }
  absl::StatusOr<nlohmann::json> FinishMoeStep(Communicator* world) override {
    return m_->FinishMoeStep(world);
  }
  absl::Status OptimizerStep(const TrainSpec& spec, double lr, float grad_scale) override {
    return m_->OptimizerStep(spec, lr, grad_scale);
  }
  int64_t steps_taken() const override { return m_->steps_taken(); }

  absl::Status DownloadGrads() override { return m_->DownloadGrads(); }
  absl::Status UploadGrads() override { return m_->UploadGrads(); }
  absl::Status DownloadParams() override { return m_->DownloadParams(); }
  absl::Status UploadParams() override { return m_->UploadParams(); }
  absl::Status DownloadOptimizerState(Tensor* m, Tensor* v) override {
    return m_->DownloadOptimizerState(m, v);
  }
  absl::Status UploadOptimizerState(const Tensor& m, const Tensor& v,
                                    int64_t steps_taken) override {
    return m_->UploadOptimizerState(m, v, steps_taken);
  }

  // Everything this trainer holds on the device: the fixed buffers (weights, bf16 copies,
  // gradients, moments) plus the activation allocator's figures.
  std::string DeviceId() override {
#ifdef SPINDLE_HAVE_NCCL
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      return "";
    }
    std::string id = "gpu-";
    for (unsigned char b : prop.uuid.bytes) absl::StrAppend(&id, absl::Hex(b, absl::kZeroPad2));
    return id;
#else
    return "";  // no NCCL in this build: Gloo through host copies
#endif
  }
  absl::StatusOr<std::unique_ptr<Communicator>> CreateDeviceCommunicator(
      KvStore& store, const std::string& prefix, int rank, int size,
      absl::Duration timeout) override {
#ifdef SPINDLE_HAVE_NCCL
    return CreateNcclCommunicator(store, prefix, rank, size, /*device=*/0, timeout);
#else
    // Not reached: without NCCL, DeviceId() reports no device, so the trainer keeps Gloo.
    return absl::FailedPreconditionError(
        "trainer: device communicators need NCCL, which this build was made without");
#endif
  }
  absl::Status AllReduceGrads(Communicator& comm, int64_t begin, int64_t end) override {
    // The communicator runs on its own stream: the backward must be done first.
    if (const cudaError_t e = cudaStreamSynchronize(m_->stream()); e != cudaSuccess)
      return absl::InternalError(
          absl::StrCat("trainer: cudaStreamSynchronize: ", cudaGetErrorString(e)));
    const int64_t n = m_->host_params().numel();
    if (end < 0) end = n;
    if (begin < 0 || end < begin || end > n)
      return absl::InvalidArgumentError("trainer: a gradient range outside the flat buffer");
    return comm.AllReduceSum(m_->device_grads() + begin, end - begin, CommType::kF32,
                             CommLayer::kGrad);
  }
  absl::Status SetExpertParallel(Communicator* ep) override { return m_->SetExpertParallel(ep); }
  int64_t ExpertGradEnd() const override { return m_->ExpertGradEnd(); }
  absl::StatusOr<double> GradSquaredNorm(int64_t begin, int64_t end) override {
    return m_->GradSquaredNorm(begin, end);
  }

  nlohmann::json StepEventFields() override {
    const DeviceMemory mem = m_->memory();
    return {{"mem_allocated_bytes", mem.fixed + mem.allocated},
            {"mem_reserved_bytes", mem.fixed + mem.reserved},
            {"mem_peak_bytes", mem.fixed + mem.peak_allocated},
            {"host_pinned_bytes", mem.offload_host}};
  }
  double PeakFlops() const override { return m_->peak_flops(); }

 private:
  std::unique_ptr<CudaModel> m_;
  TrainFp8Recipe fp8_recipe_ = TrainFp8Recipe::kTensorwise;  // SetPrecision's "fp8" recipe
};

}  // namespace

absl::StatusOr<std::unique_ptr<StepBackend>> CreateCudaStepBackend(const ModelConfig& config,
                                                                   uint64_t seed,
                                                                   int64_t /*cp: every one runs*/,
                                                                   int64_t ep, int64_t ep_rank) {
  // A shape the kernels cannot run is refused before any device work and before the ranks meet.
  if (const std::string shape = CudaShapeProblem(config); !shape.empty())
    return absl::FailedPreconditionError(
        absl::StrCat("trainer: resources \"cuda\" cannot run ", shape, "; use resources \"cpu\""));
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return absl::UnavailableError(absl::StrCat(
        "trainer: the job asks for resources \"cuda\" but no CUDA device is usable here (",
        err != cudaSuccess ? cudaGetErrorString(err) : "no device", ")"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<CudaModel> model, CudaModel::Create(config, seed, 0, ep, ep_rank));
  return std::unique_ptr<StepBackend>(new CudaStepBackend(std::move(model)));
}

}  // namespace spindle
