// CudaModel: the DESIGN.md section 2 hybrid model (the same layers, parameters and math as
// worker/engine/model.h) on one GPU, with an explicit forward and backward per layer on the
// kernels of kernels/cuda: cuBLASLt GEMMs, our Lightning kernels, cuDNN attention for MLA, fused
// norms, RoPE, SwiGLU, a row-blocked LM head + cross-entropy (fp32 logits never exist for the
// whole sequence) and a multi-tensor AdamW.
//
// Precision: fp32 master weights, gradients and AdamW moments in flat device buffers with the
// ParamSet layout of the CPU model (so checkpoints are shared with it); a bf16 copy of the
// weights, refreshed by every optimizer step, feeds the forward. Activations (the residual
// stream included) are bf16; norm statistics, Lightning states and losses fp32. Under fp8
// (SetPrecision) most linear layers multiply FP8 codes instead.
//
// Initialisation is the CPU model's (same seed, same values), done on the host and uploaded.
// host_params() is a host mirror of names, shapes and values: Download*/Upload* move values
// between it and the device (checkpoints, tests).
//
// Work runs on one compute stream; the calls that return host values (losses, norms) wait for it.
// Activation memory comes from a CachingAllocator whose statistics memory() reports. A layer that
// recomputes (recompute.h) keeps only its input and, for MLA, its attention output and
// statistics, and its forward is re-run before its backward without the MLA attention itself.
//
// Context parallelism: after SetCp() with a CP group of size > 1, the CpBatch forms run this
// rank's zigzag share of a sequence (worker/engine/cp/cp_layout.h), as the CPU model does.
// All2All (Ulysses), for both layer types: the attention core's inputs (the Lightning q, k, v;
// MLA's Q, K, V) go by all-to-all from "this rank's tokens, all heads" to "the whole sequence in
// stream order, H/cp heads", the core runs over the whole sequence with its documents, and its
// output (and, in the backward, the gradients) go back the inverse way; needs n_heads % cp == 0.
// AllGather, for Lightning layers: each local chunk runs from a zero state,
// the 2cp chunk end states ([H, Dh, Dh] fp32 each) are gathered and scanned into carry-ins, and
// the tokens that continue an earlier document get the carry's part (DESIGN.md section 3); the
// backward gathers the carry-ins' gradients the same way. AllGather for MLA layers (any cp): the
// latent [c_n | k_r] of every token is gathered, keys and values are rebuilt with kv_b for the
// rows this rank's queries see, each local chunk attends causally inside itself and, for the
// document its first token continues, without a mask over that document's earlier tokens; the two
// pieces merge by their log-sum-exp statistics, and the backward reduce-scatters the latent
// gradients to their owners. Ring for MLA layers (any cp): the ring loop of cp/cp_ring.h, shared
// with the CPU engine, passes each rank's latent rows around the CP group while every rank
// attends its chunks to the pieces of the block it holds (the same causal and cross pieces as
// AllGather, merged the same way); the backward passes fp32 latent gradients along with them.
// The context's payload (MlaRingPayloadFor: the narrower of the two, as on the CPU engine) may be
// K and V instead: each rank builds its block's keys and values once, the ring passes them and
// their fp32 gradients, and the owner takes the gradients back through kv_b. The
// hybrid modes (the context's ulysses and ring groups, the batch's Ulysses groups: ShardForCp with
// ulysses): the All2All exchange inside each Ulysses group of u ranks puts the group's tokens and
// this rank's H/u heads together, then Lightning's AllGather core or MLA's ring runs across the cp
// / u groups on them, and the outputs come back the inverse way. Everything else (projections,
// norms, RoPE with the batch's positions, FFN, head, loss) stays token-local. Collectives take
// device buffers: NCCL's directly, a host backend's (Gloo) through a StagedCommunicator
// (comm/staged_communicator.h) that SetCp wraps around it; each one waits for the compute stream
// first. Losses and gradients are this rank's part: the caller sums them over the group
// (tests/cuda/test_cuda_cp.cc: 2 and 4 ranks sharing one GPU over Gloo against one rank;
// bench_cp_cuda: NCCL ranks on separate GPUs). Not thread-safe (several models, one per thread, may
// share a device).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "common/model_config.h"
#include "worker/engine/batch.h"
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/model.h"
#include "worker/engine/params.h"
#include "worker/engine/tensor.h"

namespace spindle {

struct DeviceMemory {
  int64_t allocated = 0;       // activation bytes handed out now
  int64_t reserved = 0;        // activation bytes held from the device (allocated + cached)
  int64_t peak_allocated = 0;  // since creation or ResetPeakMemory()
  int64_t fixed = 0;           // weights, bf16 copies, gradients, optimizer state
  int64_t attention_workspace = 0;  // cuDNN attention's workspace (outside the allocator)
  int64_t device_used = 0;     // cudaMemGetInfo: total - free, all users of the device
  int64_t offload_host = 0;    // pinned host memory holding offloaded layer inputs
};

class CudaModel {
 public:
  // InvalidArgument, before any device work, for an invalid config or a shape the CUDA kernels
  // cannot run (CudaShapeProblem in common/model_config.h); fails with the CUDA or cuDNN error
  // when no GPU is usable.
  // ep > 1 (MoE models): the experts of EP rank ep_rank of ep, as Model::Create shards them.
  static absl::StatusOr<std::unique_ptr<CudaModel>> Create(const ModelConfig& config,
                                                           uint64_t seed, int device = 0,
                                                           int64_t ep = 1, int64_t ep_rank = 0);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& config() const;
  ParamSet& host_params();
  cudaStream_t stream() const;

  // One whole sequence (no CP). Adds the gradients of grad_scale * sum(token losses) into the
  // device gradients and returns the loss sum and the number of valid targets.
  absl::StatusOr<LossStats> ForwardBackward(const Batch& batch, float grad_scale,
                                            Recompute recompute);
  absl::StatusOr<LossStats> Forward(const Batch& batch);

  // Uses `cp` for the CpBatch forms (the communicator must outlive the model's use of it). With a
  // group of size > 1: InvalidArgument for an undecided (auto) mode, FailedPrecondition when a
  // layer type runs All2All and n_heads % cp != 0. The context is kept even when refused, and the
  // CpBatch forms refuse it again with the same error.
  absl::Status SetCp(const CpContext& cp);
  // This rank's share of a sequence (a cp = 1 batch runs as the whole-sequence forms). Errors are
  // the context's (see SetCp), the batch's, or the communicator's (a peer failed).
  absl::StatusOr<LossStats> ForwardBackward(const CpBatch& batch, float grad_scale,
                                            Recompute recompute);
  absl::StatusOr<LossStats> Forward(const CpBatch& batch);

  absl::Status ZeroGrads();
  // Sum of squared gradients (fp64, fixed order).
  absl::StatusOr<double> GradSquaredNorm();
  // The job's optimizer (spec.optimizer: AdamW, or SGD with or without momentum) over every
  // tensor, as the CPU Optimizer (decay on matrices only), gradients multiplied by grad_scale
  // first (clipping, averaging). The first call allocates the state that optimizer keeps.
  // Increments steps_taken(); refreshes the bf16 copy.
  absl::Status OptimizerStep(const TrainSpec& spec, double lr, float grad_scale);
  int64_t steps_taken() const;

  // Device fp32 buffers in the ParamSet flat layout (numel() floats each), e.g. for NCCL.
  float* device_params();
  float* device_grads();

  // host_params() data <-> device master (and bf16 copy); gradients both ways (a data-parallel
  // all-reduce runs on the host).
  absl::Status UploadParams();
  absl::Status DownloadParams();
  absl::Status DownloadGrads();
  absl::Status UploadGrads();
  // Optimizer state and step count, in the ParamSet flat layout: m (AdamW's first moment or SGD's
  // momentum) and v (AdamW's second moment), numel() floats each. Download fills only the state
  // the device keeps (others are left as they are); Upload takes an empty tensor for state the
  // optimizer does not keep.
  absl::Status DownloadOptimizerState(Tensor* m, Tensor* v);
  absl::Status UploadOptimizerState(const Tensor& m, const Tensor& v, int64_t steps_taken);

  // Rows per LM-head block (logits, cross-entropy and the head's gradients run block by block):
  // 0, the default, picks about 256M logits a block; otherwise a positive multiple of 128
  // (InvalidArgument for others). Smaller blocks hold less memory and move more bytes.
  absl::Status SetHeadBlockRows(int64_t rows);
  // Tokens per FFN block (kCudaFfnBlockRows by default, 0 restores it): the FFN's gradients, and
  // the FFN of every layer that recomputes, run block by block with [rows, ffn_dim] scratch; a
  // layer that keeps its cache keeps the whole sequence's FFN activations. A positive multiple of
  // 128 or 0 (InvalidArgument for others).
  absl::Status SetFfnBlockRows(int64_t rows);
  // The backward's gradient scratch of the two layer kinds (Lightning, MLA), and the cache the
  // recomputing layers share, hold one kind's buffers at a time in memory both kinds use (on by
  // default). Off, each kind keeps buffers of its own, as a reference for tests.
  void SetKindUnion(bool on);
  // Layer-input offload (off by default): between the forward and the backward of a training
  // step the layers' inputs ([T, d] bf16 each) wait in pinned host memory instead of on the
  // device, which keeps kCudaOffloadSlots of them. The copies run on a stream of their own, each
  // with a few layers' compute to hide behind; the step's results are unchanged. A step fails with
  // FailedPrecondition when the pinned memory cannot be had (spindle-train: exit code 2, the job
  // fails without restarts; it is not the device's memory).
  absl::Status SetOffloadInputs(bool on);
  // train.precision: "auto" and "bf16" are the bf16 storage above; "fp8" runs the blocks' linear
  // layers but MLA's per-head ones (q or q_b, kv_b) as FP8 GEMMs (kernels/cuda/fp8.h: E4M3
  // activations and weights, E5M2 output gradients, tensorwise current scaling), the activation
  // codes and their transposes written by the kernels that produce them (the RMSNorms, SwiGLU, the
  // group norm + gate; MLA's attention output by a quantize pass), the weights' FP8 copies cast
  // from the masters after every update, and the FFN as one block (its scales are the whole
  // sequence's). The CPU model's fp8 numerics (worker/engine/numerics.h) emulate this recipe.
  // InvalidArgument: "fp32", or under fp8 an FP8 linear's width that is not a multiple of 16
  // (cuBLASLt's FP8 GEMMs); a step under fp8 refuses a local token count that is not one.
  // `recipe` (train.fp8_recipe, with fp8): "blockwise" scales the same tensors in blocks as the CPU
  // emulation does (numerics.h: activations and output gradients in 1 x 128 blocks along their
  // rows, their transposed codes in 128-token blocks for the weight gradients, weights in 128 x
  // 128), each producer quantizing its fp32 result from its inputs and statistics, and every FP8
  // GEMM taking block scales (kernels/cuda/gemm.h) without fast accumulation. A recomputed
  // forward quantizes as the first one did, in one pass from the kept statistics (no amax: a
  // block's scale is its own). The MoE experts likewise (numerics.h): each expert's weights in
  // 128 x 128 blocks, the gathered rows, SwiGLU's output and the output gradients in 1 x 128 row
  // blocks with their transposed codes in 128-token blocks restarting at each (expert, source
  // rank) segment (kernels/cuda/moe.h's grouped layout; a first forward that will be recomputed
  // writes no transposed codes).
  absl::Status SetPrecision(TrainPrecision precision,
                            TrainFp8Recipe recipe = TrainFp8Recipe::kTensorwise);
  // train.z_loss: the LM head's objective adds z_loss * logsumexp(logits)^2 per valid token
  // (kernels/cuda/ops.h CrossEntropy); the reported loss stays the cross-entropy.
  void SetZLoss(float z_loss);
  // Under fp8, the forward's GEMMs accumulate with cuBLASLt's fast accumulation (on by default,
  // as torchao's recipe and the peer's; the tensor cores' partial sums are not promoted to fp32
  // at intervals). The gradients' GEMMs always take the accurate mode. Off: every GEMM accurate.
  void SetFp8FastForward(bool on);
  // How the MoE experts' grouped GEMMs are issued (kernels/cuda/moe.h GroupedGemmMethod; benchmarks
  // and tests): "streams" (the default: cuBLASLt calls over two streams), "loop" (one stream), or
  // "persistent" (one launch of our own sm_90 kernel for every group, bf16; it falls back to
  // streams per call where it cannot run). Takes effect at the next forward. InvalidArgument for
  // another name.
  absl::Status SetExpertGemm(std::string_view method);
  // MLA attention's backward runs its heads in groups (CudaAttentionHeadsPerCall in
  // common/model_config.h, which bounds cuDNN's fp32 dQ accumulator). heads > 0: groups of the
  // largest divisor of a call's heads not above `heads` instead (tests); 0 restores the rule.
  // InvalidArgument for a negative count.
  absl::Status SetAttentionHeadsPerCall(int64_t heads);
  // On one GPU MLA's whole backward runs by groups of heads where that holds less memory
  // (CudaMlaGradHeadsPerGroup). heads > 0: groups of the largest divisor of n_heads not above
  // `heads` instead (tests; n_heads or more: one group); 0 restores the rule. InvalidArgument for
  // a negative count.
  absl::Status SetMlaGradHeadsPerGroup(int64_t heads);

  DeviceMemory memory() const;
  void ResetPeakMemory();
  // Returns every activation and scratch buffer, and the allocator's cache, to the device (after
  // waiting for queued work): the next step allocates afresh, so its peak is its own, whatever
  // sizes earlier steps left cached.
  absl::Status ReleaseActivationMemory();
  // Host seconds the last Forward / ForwardBackward spent queueing its work (from entry to its
  // final stream synchronisation). Near the step's time, the host, not the GPU, sets the pace.
  double last_enqueue_seconds() const;
  // The device's dense bf16 peak in FLOP/s (kernels/cuda/device_support.h DenseBf16PeakFlops).
  double peak_flops() const;
  // The EP group of a model built with ep > 1 (Model::SetExpertParallel's contract); a host
  // communicator takes device buffers through pinned staging.
  absl::Status SetExpertParallel(Communicator* ep);
  int64_t ExpertGradEnd() const;
  // Sum of squared device gradients of the flat range [begin, end).
  absl::StatusOr<double> GradSquaredNorm(int64_t begin, int64_t end);
  // Mixture of experts (ModelConfig::moe): a training step
  // begins over `tokens` tokens of the world (the router z-loss's mean), and after its update
  // the balancing biases move by the step's loads summed over `world` (null: alone), as
  // Model::BeginStep and Model::FinishMoeStep do; returns the step event's "moe" fields. Not under
  // train.precision "fp8" (SetPrecision refuses it).
  void BeginStep(double tokens);
  absl::StatusOr<nlohmann::json> FinishMoeStep(Communicator* world);
  // Fills activation memory with NaN whenever the allocator hands a block out (see
  // kernels::cuda::CachingAllocator::SetPoison): a read of memory no kernel wrote then shows in
  // the loss or the gradients. Slow; for tests.
  void SetPoisonActivations(bool on);

  struct Impl;

 private:
  explicit CudaModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace spindle
