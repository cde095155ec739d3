// StepBackend: the model and optimizer of one engine, which the trainer drives through one step
// for every engine. The trainer keeps the step's arithmetic (averaging over the step's targets,
// gradient norm, clipping, learning-rate schedule), the data-parallel all-reduce and the
// checkpoint format; a backend runs the per-sequence passes, the gradient norm and the optimizer
// update on its device and moves parameters, gradients and optimizer state between the device
// and a host ParamSet with the CPU model's names, shapes and flat layout, so a checkpoint written
// from one engine resumes on the other.
//
// Implementations: the CPU model (cpu_step_backend.h; its device is the host, its gradients host
// memory that the trainer all-reduces while the backward runs) and the CUDA one
// (worker/engine/cuda/trainer_cuda.h, library spindle_engine_cuda, which depends on
// spindle_engine, never the reverse): a binary linked with it passes its factory in
// TrainerOptions::cuda_backend.
//
// Context parallelism (cp > 1): the trainer builds the CP group, passes it with the decided modes
// to SetCp(), and feeds the rank's share of each sequence through the CpBatch forms; losses and
// gradients are the rank's part, summed over the world by the trainer on the host. A backend that
// does not run CP refuses it in its factory (before any device work or rendezvous) and in SetCp().
// At cp = 1 the trainer uses the whole-sequence forms only.
//
// Device collectives: when every rank of the world reports a DeviceId() of its own (no two ranks
// share a GPU, and the build has NCCL), the trainer builds its data- and context-parallel
// collectives with CreateDeviceCommunicator() instead of Gloo: the gradient sum runs in place on
// the device (AllReduceGrads), and CP's all-to-alls on device buffers. Not thread-safe.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/job_spec.h"
#include "common/model_config.h"
#include "nlohmann/json.hpp"
#include "worker/engine/batch.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/kv_store.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/params.h"
#include "worker/engine/tensor.h"

namespace spindle {

class StepBackend {
 public:
  virtual ~StepBackend() = default;

  virtual const ModelConfig& config() const = 0;
  // The host mirror: values as of the last Download*/Upload* (or the initial values).
  virtual ParamSet& host_params() = 0;

  virtual absl::Status ZeroGrads() = 0;
  // Whether the gradients live in host_params().flat_grad() itself (no Download/Upload needed):
  // the trainer then all-reduces them in buckets as the backward reports them final.
  virtual bool HostGradients() const { return false; }
  // Adds the gradients of grad_scale * sum(token losses) into the device gradients. A backend
  // with HostGradients() calls on_grad_ready (when set) as the backward finishes the gradients
  // from a flat offset up (GradReadyFn, model.h); the others ignore it.
  virtual absl::StatusOr<LossStats> ForwardBackward(const Batch& batch, float grad_scale,
                                                    Recompute recompute,
                                                    const GradReadyFn& on_grad_ready) = 0;
  virtual absl::StatusOr<LossStats> Forward(const Batch& batch) = 0;

  // The CP group of this rank and the decided modes (see Model::SetCp); called once before the
  // first CpBatch pass when cp > 1. An error refuses the job.
  virtual absl::Status SetCp(const CpContext& cp) = 0;
  // This rank's share of a sequence (after SetCp): as the Batch forms, on the share.
  virtual absl::StatusOr<LossStats> ForwardBackward(const CpBatch& batch, float grad_scale,
                                                    Recompute recompute,
                                                    const GradReadyFn& on_grad_ready) = 0;
  virtual absl::StatusOr<LossStats> Forward(const CpBatch& batch) = 0;
  // train.offload: the layers' inputs wait in host memory between the forward and the backward
  // (CudaModel::SetOffloadInputs). A backend whose activations already live in host memory
  // refuses it.
  virtual absl::Status SetOffloadInputs(bool on) {
    if (!on) return absl::OkStatus();
    return absl::FailedPreconditionError(
        "trainer: train.offload needs a backend with device memory of its own");
  }
  // train.precision: on a GPU (never "fp32", which the job spec keeps off devices) "auto" and
  // "bf16" are a backend's own bf16 storage, and a backend without FP8 GEMMs refuses "fp8"; the
  // CPU backend selects its numerics (fp32, or the bf16 and fp8 emulations).
  virtual absl::Status SetPrecision(TrainPrecision precision) {
    if (precision != TrainPrecision::kFp8) return absl::OkStatus();
    return absl::UnimplementedError(
        "trainer: train.precision \"fp8\": this device backend has no FP8 GEMMs yet; use "
        "\"auto\" or \"bf16\" on the device, or resources \"cpu\", which emulates FP8");
  }
  // train.fp8_recipe: how a later SetPrecision's "fp8" scales (call before it). A backend
  // without blockwise FP8 refuses "blockwise".
  virtual absl::Status SetFp8Recipe(TrainFp8Recipe recipe) {
    if (recipe == TrainFp8Recipe::kTensorwise) return absl::OkStatus();
    return absl::UnimplementedError(
        "trainer: train.fp8_recipe \"blockwise\": this device backend has no blockwise FP8 "
        "GEMMs; use \"tensorwise\" or resources \"cpu\"");
  }
  // train.z_loss: the LM head's objective adds z_loss * logsumexp(logits)^2 per valid token (the
  // loss reported stays the cross-entropy).
  virtual absl::Status SetZLoss(float z_loss) {
    if (z_loss == 0.0f) return absl::OkStatus();
    return absl::UnimplementedError("trainer: this backend has no z-loss (train.z_loss must be 0)");
  }
  // Mixture of experts (ModelConfig::moe): the EP group of this rank's experts (a backend built
  // for ep > 1 needs it before any pass; null or a group of one: ep = 1). A backend without
  // expert parallelism refuses a group of more than one rank.
  virtual absl::Status SetExpertParallel(Communicator* ep) {
    if (ep == nullptr || ep->size() == 1) return absl::OkStatus();
    return absl::UnimplementedError(
        "trainer: this backend does not shard experts (parallel.ep must be 1)");
  }
  // The end of the expert shards' range of the flat gradients ([0, end), reduced over the
  // expert-data-parallel group), 0 without sharded experts.
  virtual int64_t ExpertGradEnd() const { return 0; }
  // A training step begins over `tokens` tokens of the world (the z-loss's mean), and ends after
  // the optimizer's update: the balancing biases move by the loads summed over `world` (null:
  // this rank alone), and the step event gets the returned fields. Nothing for dense models.
  virtual void BeginStep(double tokens) { (void)tokens; }
  virtual absl::StatusOr<nlohmann::json> FinishMoeStep(Communicator* world) {
    (void)world;
    return nlohmann::json::object();
  }

  // Sum of squared device gradients; with `end` >= 0, of the flat range [begin, end) only.
  virtual absl::StatusOr<double> GradSquaredNorm() = 0;
  virtual absl::StatusOr<double> GradSquaredNorm(int64_t begin, int64_t end) {
    (void)begin, (void)end;
    return absl::UnimplementedError("trainer: this backend has no ranged gradient norm");
  }
  // The job's optimizer (spec.optimizer, as the CPU Optimizer: AdamW with decay on matrices only,
  // or SGD with or without momentum) with the device gradients multiplied by grad_scale first.
  // Increments steps_taken().
  virtual absl::Status OptimizerStep(const TrainSpec& spec, double lr, float grad_scale) = 0;
  virtual int64_t steps_taken() const = 0;

  // Gradients device <-> host_params().flat_grad() (the data-parallel all-reduce runs on the host).
  virtual absl::Status DownloadGrads() = 0;
  virtual absl::Status UploadGrads() = 0;
  // Parameters device <-> host_params().flat_data().
  virtual absl::Status DownloadParams() = 0;
  virtual absl::Status UploadParams() = 0;
  // Optimizer state (ParamSet flat layout, numel() floats each: AdamW's moments, or SGD's momentum
  // in m and v empty) and the step count. Download leaves state the device does not keep as is.
  virtual absl::Status DownloadOptimizerState(Tensor* m, Tensor* v) = 0;
  virtual absl::Status UploadOptimizerState(const Tensor& m, const Tensor& v,
                                            int64_t steps_taken) = 0;
  // A backend whose optimizer runs on host memory over host_params() returns it: checkpoints then
  // load into and save from it directly, with no staging copy of its state (which would double
  // the optimizer's memory at every checkpoint). Null for device backends.
  virtual Optimizer* HostOptimizer() { return nullptr; }

  // Fields added to every step event (device memory: "mem_allocated_bytes", ...).
  virtual nlohmann::json StepEventFields() = 0;
  // The device's dense bf16 peak in FLOP/s, against which the trainer reports model FLOP
  // utilisation ("mfu"); 0 when unknown (no "mfu").
  virtual double PeakFlops() const { return 0.0; }

  // The identity of this rank's device (a GPU's UUID) when the backend can build device
  // communicators, else "" (the trainer then uses Gloo through host copies).
  virtual std::string DeviceId() = 0;
  // Joins `size` ranks calling this with the same `prefix` over `store` in a communicator over
  // this backend's device buffers; `timeout` bounds the rendezvous and each collective.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> CreateDeviceCommunicator(
      KvStore& store, const std::string& prefix, int rank, int size, absl::Duration timeout) = 0;
  // Sums the device gradients of the flat range [begin, end) (end < 0: to the end) over `comm`
  // (from CreateDeviceCommunicator) in place.
  virtual absl::Status AllReduceGrads(Communicator& comm, int64_t begin = 0, int64_t end = -1) = 0;
};

// Builds a backend holding a model initialised from `seed` exactly as Model::Create does (with the
// experts of EP rank ep_rank of ep), for a job whose CP group has `cp` ranks (1: whole
// sequences); a factory refuses a cp its backend does not run here, before any device work.
using StepBackendFactory = absl::StatusOr<std::unique_ptr<StepBackend>> (*)(
    const ModelConfig& config, uint64_t seed, int64_t cp, int64_t ep, int64_t ep_rank);

}  // namespace spindle
