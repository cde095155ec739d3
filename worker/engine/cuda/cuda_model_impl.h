// CudaModel's internals (the design notes are cuda_model.cc's): one layer's cache of saved
// activations (its own, LayerActs, and its families'), what a recomputing layer keeps, the
// layer-input offload, and CudaModel::Impl, the whole model (cuda_model.cc: setup, the parameters,
// optimizer and memory; cuda_model_run.cc: the batch upload and the whole model's passes;
// cuda_model_layers.cc: one layer's residual structure over its families; cuda_model_cp.cc: the
// CP checks and the device's copies), which owns the layer families (cuda_moe_ffn.h, ...) and the
// context they share (cuda_layer_context.h).
// Nothing outside those files includes it.
#pragma once

#include "common/host_memory.h"
#include "kernels/cuda/device_support.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lightning.h"
#include "kernels/cuda/sdpa.h"
#include "worker/engine/cuda/cuda_dense_ffn.h"
#include "worker/engine/cuda/cuda_layer_context.h"
#include "worker/engine/cuda/cuda_lightning.h"
#include "worker/engine/cuda/cuda_mla.h"
#include "worker/engine/cuda/cuda_moe_ffn.h"
#include "worker/engine/layer_passes.h"

namespace spindle {
namespace cuda_model_detail {

// Saved activations of one layer (names as in model.cc): the layer's own (LayerActs) and those of
// its families. Under FP8 each producer of an FP8 GEMM input writes its codes (the attention norm's
// q_h, the FFN norm's q_h2, Lightning's q_y, MLA's q_O, the dense FFN's q_a).
struct Cache : LayerActs {
  // The cache the recomputing layers share (kind_union) holds one layer kind's own buffers at a
  // time, as views of one arena (KindArena); the others own theirs.
  bool kind_union = false;
  KindArena arena;
  LightningCache lt;
  MlaCache mla;
  DenseFfnCache ffn;
  MoeDevCache moe;
};

// Recompute: what a recomputing layer keeps from its first forward for its backward, swapped into
// the layer's Cache while either pass runs. An MLA layer keeps its attention's output and
// statistics (and under CP All2All the head-split output), so that the recomputed forward skips
// the quadratic attention. Under FP8 every recomputing layer keeps its FP8 producers' row
// statistics (rstd1, rstd2 and Lightning's rstd_o) and amaxes (fp8_amax, one per Fp8Site), so that
// its recomputed forward quantizes in one pass: the same inputs give the same values. Under the
// blockwise recipe the amaxes go unused (a block's scale comes from the block itself): the
// recomputed forward's quantizers read the kept statistics alone, skipping the norms' forward,
// and its codes are the first forward's (which wrote the row-major layout only).
struct KeptForRecompute {
  DevBuf O, stats, cp_out, rstd1, rstd2, rstd_o, fp8_amax;
  void SwapInto(Cache& C) {
    O.Swap(C.mla.O);
    stats.Swap(C.mla.stats);
    cp_out.Swap(C.mla.cp_out);
    rstd1.Swap(C.rstd1);
    rstd2.Swap(C.rstd2);
    rstd_o.Swap(C.lt.rstd_o);
    fp8_amax.Swap(C.fp8_amax);
  }
  void Release() {
    for (DevBuf* b : {&O, &stats, &cp_out, &rstd1, &rstd2, &rstd_o, &fp8_amax}) b->Release();
  }
};

// Layer-input offload (CudaModel::SetOffloadInputs). Input i of layers 0 .. n-1 lives in device
// slot i % kSlots; the forward copies each input that the backward will not find still in its
// slot (i < n - kSlots) to pinned host memory on the copy stream, and the layer that writes input
// i + kSlots into the same slot waits for that copy. The backward brings input i back into its
// slot once layer i + kSlots, the slot's last user, has run, so every copy has the compute of
// kSlots - 1 layers to hide behind. `computed[s]` (compute stream) and `copied[s]` (copy stream)
// mark the last use of slot s on each side.
struct Offload {
  static constexpr int kSlots = static_cast<int>(kCudaOffloadSlots);
  cudaStream_t copy = nullptr;
  cudaEvent_t computed[kSlots] = {}, copied[kSlots] = {};
  void* host = nullptr;  // pinned: input i at i * T * d elements, i < n - kSlots
  int64_t host_bytes = 0;
  DevBuf slot[kSlots];

  absl::Status Create() {
    if (copy) return absl::OkStatus();
    CUDA(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
    for (int s = 0; s < kSlots; ++s) {
      CUDA(cudaEventCreateWithFlags(&computed[s], cudaEventDisableTiming));
      CUDA(cudaEventCreateWithFlags(&copied[s], cudaEventDisableTiming));
    }
    return absl::OkStatus();
  }
  // The pinned host memory for `bytes` (kept between steps; grown when a step needs more). Not
  // more than the host has available: pinned pages cannot be swapped, so the machine's other
  // processes would be killed for them.
  absl::Status EnsureHost(int64_t bytes) {
    if (bytes <= host_bytes) return absl::OkStatus();
    FreeHost();
    if (const int64_t available = HostMemoryAvailableBytes(); available > 0 && bytes > available)
      return absl::FailedPreconditionError(
          absl::StrCat("cuda model: train.offload needs ", bytes >> 20,
                       " MiB of pinned host memory for the layer inputs, but this machine has ",
                       available >> 20, " MiB available"));
    if (const cudaError_t e =
            cudaHostAlloc(&host, static_cast<size_t>(bytes), cudaHostAllocDefault);
        e != cudaSuccess) {
      (void)cudaGetLastError();
      host = nullptr;
      // Not the device's memory: a restart with more layers recomputing would not help.
      return absl::FailedPreconditionError(absl::StrCat(
          "cuda model: train.offload needs ", bytes >> 20,
          " MiB of pinned host memory for the layer inputs, and cudaHostAlloc refused it (",
          cudaGetErrorString(e), ")"));
    }
    host_bytes = bytes;
    return absl::OkStatus();
  }
  void FreeHost() {
    if (host) cudaFreeHost(host);
    host = nullptr;
    host_bytes = 0;
  }
  // Copies `bytes` between slot s and host memory on the copy stream once `compute` has run what
  // it has queued (the slot's last writer or reader there); marks the copy's end in copied[s].
  absl::Status CopyAfter(cudaStream_t compute, int s, void* dst, const void* src, int64_t bytes,
                         cudaMemcpyKind kind) {
    CUDA(cudaEventRecord(computed[s], compute));
    CUDA(cudaStreamWaitEvent(copy, computed[s], 0));
    CUDA(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, copy));
    CUDA(cudaEventRecord(copied[s], copy));
    return absl::OkStatus();
  }
  // `compute` waits for slot s's last copy.
  absl::Status WaitCopied(cudaStream_t compute, int s) {
    CUDA(cudaStreamWaitEvent(compute, copied[s], 0));
    return absl::OkStatus();
  }
  // Waits for the copies in flight, then returns the slots to the allocator.
  void ReleaseSlots() {
    if (copy) cudaStreamSynchronize(copy);
    for (DevBuf& b : slot) b.Release();
  }
  void Destroy() {
    ReleaseSlots();
    FreeHost();
    for (int s = 0; s < kSlots; ++s) {
      if (computed[s]) cudaEventDestroy(computed[s]);
      if (copied[s]) cudaEventDestroy(copied[s]);
      computed[s] = copied[s] = nullptr;
    }
    if (copy) cudaStreamDestroy(copy);
    copy = nullptr;
  }
};

}  // namespace cuda_model_detail

// The whole model: the parameters and optimizer, the layer loop with recompute and offload, the
// LM head and loss, memory; the context its layer families share is its base (LayerContext).
struct CudaModel::Impl : LayerContext {
  int device = 0;
  // Fixed device buffers (cudaMalloc): the context's fp32 masters p, gradients g and bf16 working
  // copy w (w_numel elements: LayOutWorkingCopy), and the moments.
  float *m = nullptr, *v = nullptr;
  int64_t w_numel = 0;
  double* scalar = nullptr;     // [2] device results (loss sum, norms)
  double* loss_host = nullptr;  // pinned host copy of the loss sum
  float* log_decays = nullptr;
  int64_t fixed_bytes = 0;
  int64_t steps = 0;
  int64_t head_block_rows = 0;  // see SetHeadBlockRows
  bool kind_union = true;                      // see SetKindUnion
  bool offload_inputs = false;                 // see SetOffloadInputs
  Offload off;
  double enqueue_seconds = 0;  // see last_enqueue_seconds()
  double peak_flops = 0;       // see peak_flops()
  int embed = -1, final_norm = -1, lm_head = -1;
  std::vector<LayerIdx> layers;
  std::vector<std::unique_ptr<Cache>> caches;
  std::vector<KeptForRecompute> kept;  // per layer; each recomputing layer fills its own
  std::vector<DevBuf> layer_in;  // [n + 1][T, d] bf16 residual stream
  DevBuf hf, rstd_f, dhf, logits, row_loss, dx;
  // The context's CP communicators of a host backend, staged (SetCp).
  std::vector<std::unique_ptr<Communicator>> staged;
  float z_loss = 0.0f;  // train.z_loss (SetZLoss)
  // The FP8 weight copies (the context's fp8_w and fp8_e) all in fp8_w_mem.
  void* fp8_w_mem = nullptr;
  int64_t fp8_fixed_bytes = 0;
  // The layer families.
  CudaLightning lightning{*this};
  CudaMla mla{*this};
  CudaDenseFfn ffn{*this};
  CudaMoeFfn moe{*this};

  // Every activation and scratch buffer back to the allocator (the next step allocates afresh).
  void ReleaseActivations() {
    caches.clear();
    kept.clear();
    layer_in.clear();
    off.ReleaseSlots();
    for (DevBuf* b : {&hf, &rstd_f, &dhf, &logits, &row_loss, &dx}) b->Release();
    W.Release();
    lightning.Release();
    mla.Release();
    ffn.Release();
    moe.Release();
  }

  ~Impl() {
    ReleaseActivations();
    off.Destroy();
    for (DevBuf* b : {&B.ids, &B.targets, &B.pos, &B.cu}) b->Release();
    for (void* q : {static_cast<void*>(p), static_cast<void*>(g), static_cast<void*>(m),
                    static_cast<void*>(v), w, static_cast<void*>(scalar),
                    static_cast<void*>(log_decays), fp8_w_mem})
      if (q) cudaFree(q);
    if (loss_host) cudaFreeHost(loss_host);
    if (stream) cudaStreamDestroy(stream);
  }

  // (Re)allocates w with a copy of every parameter but those in `none`, 128-byte aligned, and
  // fills it from the fp32 masters.
  absl::Status LayOutWorkingCopy(const std::vector<int>& none);
  absl::Status FillWorkingCopy();  // w's copies from the fp32 masters
  // Casts every FP8 linear's master into its copy (fp8; after each update of the masters).
  absl::Status CastFp8Weights();

  // ---- One layer kind's buffers at a time (KindArena) -----------------------------------------
  // The buffers of `kind` ('L' or 'M') of C or of W that a layer of the other kind never uses,
  // with the bytes the layer code asks for at the current batch and CP mode (a buffer asked for
  // larger than its view gets a block of its own, so a mismatch costs memory, not correctness).
  // The MLA attention's output and statistics are not among them: a recomputing MLA layer keeps
  // its own (KeptForRecompute).
  KindFields CacheKindFields(Cache& C, char kind);
  KindFields WorkKindFields(char kind);
  // Makes `kind`'s buffers views of `a`, sized for the larger of the model's kinds, after
  // releasing both kinds' buffers, unless `a` already holds this layout.
  absl::Status UseKind(KindArena& a, char kind, const KindFields& lt_fields,
                       const KindFields& mla_fields);
  // Releases both kinds' buffers and the arena.
  static void DropArena(KindArena& a, const KindFields& lt_fields, const KindFields& mla_fields);

  // Copies numel() floats per (dst, src) pair, skipping pairs with a null side, then syncs.
  absl::Status CopyFlat(std::initializer_list<std::pair<float*, const float*>> copies,
                        cudaMemcpyKind kind);
  // Allocates (zeroed) the optimizer state buffers asked for that do not exist yet.
  absl::Status EnsureOptimizerState(bool want_m, bool want_v);
  // cpb: null (or cp = 1) for a whole sequence; else b is cpb->local, this rank's zigzag share.
  absl::Status Upload(const Batch& b, const CpBatch* cpb);
  // x_out null: no output, only what the backward reads. ffn_kept: the FFN's [T, F] activations
  // stay in C for the backward (a layer that keeps its cache); otherwise the FFN runs in blocks
  // (CudaDenseFfn::Forward) and the backward recomputes them. attention_kept: the MLA attention's
  // output and statistics are already in C (see KeptForRecompute); only what its backward reads
  // besides them is computed.
  absl::Status LayerForward(const LayerIdx& L, Cache& C, const void* x_in, void* x_out,
                            bool ffn_kept, bool attention_kept = false);
  absl::Status LayerBackward(const LayerIdx& L, Cache& C, const void* x_in, void* dx,
                             bool ffn_kept);
  absl::StatusOr<LossStats> HeadAndLoss(const void* x, float grad_scale, void* dx);
  absl::StatusOr<LossStats> Run(const Batch& b, const CpBatch* cpb, float grad_scale,
                                Recompute recompute, bool backward);

  // ---- Context parallelism: the checks and levels ----
  absl::Status CheckCpContext() const;
  absl::Status CheckCpBatch(const CpBatch& b) const;
  // A level's host and device description from its local tokens and layout (Upload).
  absl::Status SetLevel(CpLevel& V, const Batch& local, const CpLayout& L);
};

}  // namespace spindle
