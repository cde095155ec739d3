// CudaModel: the hybrid Lightning/MLA model on one GPU (see cuda_model.h). The layer code follows
// worker/engine/model.cc step for step; the differences are the storage (bf16 activations, fp32
// master weights and gradients on the device), one [T, 3d] qkv GEMM with the fused q/k norm +
// RoPE kernel, residual adds folded into the GEMMs (beta = 1), and cuDNN attention for MLA.
//
// Context parallelism (see cuda_model.h) follows cp/cp_attention.cc with device buffers: All2All
// as its LightningAll2All* and MlaAll2All*, AllGather as DESIGN.md section 3 describes it. The
// blocks exchanged with rank j are token-major: [T local tokens][the views' H/cp heads, view after
// view], so a block received from rank i is rank i's two zigzag chunks of whole rows: putting them
// in stream order is 2 copies per rank, and the Lightning rows [q | k | v] of H/cp heads are
// exactly the kernel's strided layout (qkv_stride 3 * H/cp * Dh), MLA's [Q | K | V] rows cuDNN's
// strided views.
//
// Memory: every buffer comes from one caching allocator (kernels/cuda/allocator.h) through DevBuf.
// Each layer that keeps its activations has a Cache of its own; the layers that recompute share
// one, and every layer's backward shares the gradient scratch (Work). In the shared Cache and in
// Work the buffers only one layer kind uses are views of one KindArena, holding one kind's at a
// time.
#include "worker/engine/cuda/cuda_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/host_memory.h"
#include "common/status.h"
#include "kernels/cuda/allocator.h"
#include "kernels/cuda/device_support.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lightning.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sdpa.h"

namespace spindle {

namespace kc = kernels::cuda;
using KDType = kc::DType;

namespace {

constexpr KDType kAct = KDType::kBFloat16;  // activations and the weights' working copy
constexpr int64_t kAb = 2;                  // bytes per activation element
// 16-byte aligned offset (in fp32 elements) of each local chunk's [H, chunk] attention stats.
int64_t StatsSlot(int64_t H, int64_t ch) { return (H * ch + 3) / 4 * 4; }

absl::Status FromKernel(const kc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  switch (s.code()) {
    case kc::StatusCode::kInvalidArgument:
      return absl::InvalidArgumentError(s.message());
    case kc::StatusCode::kUnsupported:
      return absl::UnimplementedError(s.message());
    case kc::StatusCode::kOutOfMemory:
      return absl::ResourceExhaustedError(s.message());
    default:
      return absl::InternalError(s.message());
  }
}

absl::Status FromCuda(cudaError_t e, const char* expr) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("CUDA: ", expr, ": ", cudaGetErrorString(e)));
}

#define KC(expr) RETURN_IF_ERROR(FromKernel((expr)))
#define CUDA(expr) RETURN_IF_ERROR(FromCuda((expr), #expr))

// The largest divisor of n (>= 1) not above `at_most` (>= 1).
inline int64_t LargestDivisorAtMost(int64_t n, int64_t at_most) {
  int64_t g = std::min(at_most, n);
  while (n % g != 0) --g;
  return g;
}

// Element pointer arithmetic on bf16 buffers.
inline void* At(void* p, int64_t elems) { return static_cast<uint16_t*>(p) + elems; }
inline const void* At(const void* p, int64_t elems) {
  return static_cast<const uint16_t*>(p) + elems;
}

// A block of the caching allocator, grown on demand (contents are not kept when it grows), or a
// view of part of another DevBuf (KindArena), which Release drops without freeing.
class DevBuf {
 public:
  DevBuf() = default;
  ~DevBuf() { Release(); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;

  absl::Status Ensure(kc::CachingAllocator* a, int64_t bytes) {
    if (bytes <= bytes_ && ptr_ != nullptr) return absl::OkStatus();
    Release();
    alloc_ = a;
    void* p = nullptr;
    KC(a->Allocate(static_cast<size_t>(std::max<int64_t>(bytes, 1)), &p));
    ptr_ = p;
    bytes_ = bytes;
    return absl::OkStatus();
  }
  void Release() {
    if (alloc_ && ptr_) (void)alloc_->Free(ptr_);
    alloc_ = nullptr;
    ptr_ = nullptr;
    bytes_ = 0;
  }
  // Points at `bytes` bytes of memory someone else owns (none for 0 bytes).
  void View(void* p, int64_t bytes) {
    Release();
    ptr_ = bytes > 0 ? p : nullptr;
    bytes_ = bytes;
  }
  void Swap(DevBuf& o) {
    std::swap(alloc_, o.alloc_);
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
  }
  void* get() const { return ptr_; }
  float* f32() const { return static_cast<float*>(ptr_); }
  int32_t* i32() const { return static_cast<int32_t*>(ptr_); }

 private:
  kc::CachingAllocator* alloc_ = nullptr;
  void* ptr_ = nullptr;
  int64_t bytes_ = 0;
};

// One layer's parameter indices (into the host ParamSet) and its decays on the device.
struct LayerIdx {
  char kind = 'L';
  int attn_norm = -1, ffn_norm = -1, w1 = -1, w2 = -1, w3 = -1;
  int qkv = -1, gate = -1, out = -1, q_norm = -1, k_norm = -1, out_norm = -1;
  int q = -1, q_a = -1, q_a_norm = -1, q_b = -1, kv_a = -1, kv_norm = -1, kv_b = -1, mo = -1;
  float* log_decay = nullptr;  // [H] fp32, device (Lightning)
};

// Memory shared by the buffers of the two layer kinds, of which a layer uses one: the buffers of
// the kind in use are views of it, laid out one after another (256-byte aligned); it holds the
// larger kind's layout, so switching kinds allocates nothing. `kind` (0: none) and `key` (of the
// sizes) identify the layout carved; the other kind's buffers are released when it changes.
struct KindArena {
  DevBuf mem;
  char kind = 0;
  uint64_t key = 0;
};
// A kind's buffers in a KindArena with the bytes each needs: every buffer of the kind, those the
// current shapes and modes do not use with 0 bytes.
using KindFields = std::vector<std::pair<DevBuf*, int64_t>>;

// Saved activations of one layer (names as in model.cc).
struct Cache {
  // g, u, a: the FFN's w1 and w3 outputs and SwiGLU, [T, F] in a cache kept for the backward, a
  // block of ffn_block_rows rows otherwise (FfnForward).
  DevBuf h, rstd1, x_mid, h2, rstd2, g, u, a;
  DevBuf qkv_raw, qkv_n, rstd_q, rstd_k, gate, o, y, rstd_o;      // Lightning
  DevBuf lstates;  // Lightning (cp = 1): the forward's block states, kept for the backward
  DevBuf qa, qa_n, rstd_qa, Q, kva, c, c_n, rstd_c, kvb, K, O, stats;  // MLA
  // CP (All2All): the core's head-split inputs over the whole sequence in stream order,
  // [T_full, 3 * H/cp * Dh] (Lightning q | k | v) or [T_full, H/cp * (2 qk + vd)] (MLA Q | K | V),
  // and MLA's head-split output [T_full, H/cp * vd] (its backward reads it).
  DevBuf cp_full, cp_out;
  // CP (Lightning AllGather): the carry-ins P of this rank's two chunks, [2, H, Dh, Dh] fp32.
  DevBuf cp_P;
  // CP (MLA AllGather): the gathered latent [c_n | rotated k_r] of the whole sequence, in stream
  // order ([T_full, kv + rd]).
  DevBuf ag_lat;
  // The cache the recomputing layers share (kind_union) holds one layer kind's own buffers at a
  // time, as views of one arena (KindArena); the others own theirs.
  bool kind_union = false;
  KindArena arena;
};

// Recompute: what an MLA layer keeps from the forward for its backward, so that the recomputed
// forward skips the quadratic attention: its output and statistics, and under CP All2All the
// head-split output (swapped into the layer's Cache as O, stats and cp_out while it runs).
struct KeptAttention {
  DevBuf O, stats, cp_out;
  void SwapInto(Cache& C) {
    O.Swap(C.O);
    stats.Swap(C.stats);
    cp_out.Swap(C.cp_out);
  }
  void Release() {
    for (DevBuf* b : {&O, &stats, &cp_out}) b->Release();
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

// Gradient scratch shared by every layer's backward.
struct Work {
  DevBuf dh, da, dg, du, dy, dgate, dqkv, dO, dQ, dK, dkvb, dc_n, dc, dkva, dqa_n, dqa, ws;
  int64_t ws_bytes = 0;
  // MLA's backward in head groups (CudaMlaGradHeadsPerGroup): at cp = 1 a group's copies of Q, K
  // and kv_b's output at the group's width (dQ, dK and dkvb then hold the group's gradients; under
  // All2All they are the received block of a rank's heads), and the fp32 sums over the groups of
  // the latent's gradients [d c_n | d k_r] and of q_a's output gradient (without a q LoRA: of the
  // normed input's).
  DevBuf gQ, gK, gkvb, sum_lat, sum_q;
  // CP (All2All) scratch, sized by Upload: cp_block, the local tokens' side of an exchange (the
  // packed send blocks, or the received rows of the local tokens) and, while it is free, the
  // core's input gradients over the whole sequence; cp_tmp, a whole-sequence [T_full, H/cp *
  // width] output or output gradient.
  DevBuf cp_block, cp_tmp;
  // CP (Lightning AllGather) scratch: this rank's two chunk states (or their carry-in
  // gradients), every rank's as gathered, the 2cp of them in stream order, and their scan.
  DevBuf cp_state_send, cp_state_recv, cp_state_stream, cp_state_scan;
  // CP (MLA AllGather) scratch, sized by Upload: the latent gather's send and receive blocks (also
  // the fp32 reduce-scatter's); one key block's keys and kv_b output (ag_K, ag_kvb) and their
  // gradients (ag_dK, ag_dkvb) and latent gradients (ag_dlat), rows for the larger of a chunk and
  // a key block; the cross piece's output, stats, fp32 running output and dq.
  DevBuf ag_send, ag_recv, ag_K, ag_kvb, ag_dK, ag_dkvb, ag_dlat, ag_o, ag_stats, ag_acc, ag_dq;
  // The layer-kind gradients (Lightning: dy, dgate, dqkv; MLA: dO through dqa) hold one kind at a
  // time (KindArena).
  KindArena arena;
};

// The batch on the device.
struct BatchDev {
  DevBuf ids, targets, pos, cu;
  int64_t T = 0;  // local tokens
  // The attention core's documents: the batch's own (cp = 1) or, under CP, those of the whole
  // sequence (T_full tokens in stream order).
  std::vector<int32_t> cu_host;
  int64_t n_valid = 0;
  int64_t cp = 1, rank = 0, T_full = 0, chunk = 0;  // chunk: tokens per zigzag chunk (cp > 1)
  // Lightning AllGather under CP, per local slot (chunk ChunkOf(rank, slot)): its document starts
  // relative to its first token (host and device), its stream chunk index, whether its first
  // token continues an earlier document and, if so, the tokens before its first start; and the
  // 2cp chunks' b_c flags and lengths for the state scans (device).
  std::vector<int32_t> piece_cu_host[2], chunk_has_start_host, chunk_len_host;
  DevBuf piece_cu[2], chunk_has_start, chunk_len;
  int64_t slot_chunk[2] = {0, 0}, first_segment[2] = {0, 0};
  bool continues[2] = {false, false};
  // MLA AllGather: the first stream row each local chunk's queries see (the start of the
  // document its first token continues, else the chunk's own first token).
  int64_t key_begin[2] = {0, 0};
};

// One tensor of the local tokens seen as [T, H, width] (strides in elements), for the CP
// all-to-all packing.
struct HeadView {
  void* p;
  int64_t token_stride, head_stride, width;
};

}  // namespace

struct CudaModel::Impl {
  ModelConfig c;
  std::unique_ptr<Model> host;  // the CPU model: parameter layout, initial values, host mirror
  int device = 0;
  cudaStream_t stream = nullptr;
  std::unique_ptr<kc::Blas> blas;
  std::unique_ptr<kc::Sdpa> sdpa;
  kc::CachingAllocator alloc;
  // Fixed device buffers (cudaMalloc): fp32 master, gradients, moments; bf16 working copy.
  float *p = nullptr, *g = nullptr, *m = nullptr, *v = nullptr;
  void* w = nullptr;
  double* scalar = nullptr;     // [2] device results (loss sum, norms)
  double* loss_host = nullptr;  // pinned host copy of the loss sum
  float* log_decays = nullptr;
  int64_t fixed_bytes = 0;
  int64_t steps = 0;
  int64_t head_block_rows = 0;  // see SetHeadBlockRows
  int64_t ffn_block_rows = kCudaFfnBlockRows;  // see SetFfnBlockRows
  bool kind_union = true;                      // see SetKindUnion
  bool offload_inputs = false;                 // see SetOffloadInputs
  int64_t attention_heads_per_call = 0;        // see SetAttentionHeadsPerCall
  int64_t mla_grad_heads_per_group = 0;        // see SetMlaGradHeadsPerGroup
  Offload off;
  double enqueue_seconds = 0;  // see last_enqueue_seconds()
  double peak_flops = 0;       // see peak_flops()
  int embed = -1, final_norm = -1, lm_head = -1;
  std::vector<LayerIdx> layers;
  std::vector<std::unique_ptr<Cache>> caches;
  std::vector<KeptAttention> kept;  // per layer; each recomputing MLA layer fills its own
  std::vector<DevBuf> layer_in;  // [n + 1][T, d] bf16 residual stream
  DevBuf hf, rstd_f, dhf, logits, row_loss, dx;
  Work W;
  BatchDev B;
  // Context parallelism: the context of SetCp, whether its collectives take device buffers
  // (NCCL) rather than host ones, and the pinned host staging blocks for the latter.
  CpContext cp;
  bool cp_device_buffers = false;
  void* cp_host_send = nullptr;
  void* cp_host_recv = nullptr;
  int64_t cp_host_bytes = 0;

  // Every activation and scratch buffer back to the allocator (the next step allocates afresh).
  void ReleaseActivations() {
    caches.clear();
    kept.clear();
    layer_in.clear();
    off.ReleaseSlots();
    for (DevBuf* b : {&hf, &rstd_f, &dhf, &logits, &row_loss, &dx}) b->Release();
    for (DevBuf* b : {&W.dh,      &W.da,      &W.dg,       &W.du,     &W.dy,      &W.dgate,
                      &W.dqkv,    &W.dO,      &W.dQ,       &W.dK,     &W.dkvb,    &W.dc_n,
                      &W.dc,      &W.dkva,    &W.dqa_n,    &W.dqa,    &W.ws,      &W.cp_block,
                      &W.cp_tmp,  &W.gQ,      &W.gK,       &W.gkvb,   &W.sum_lat, &W.sum_q,
                      &W.ag_send, &W.ag_recv, &W.ag_K,     &W.ag_kvb, &W.ag_dK,   &W.ag_dkvb,
                      &W.ag_dlat, &W.ag_o,    &W.ag_stats, &W.ag_acc, &W.ag_dq,   &W.arena.mem})
      b->Release();
    W.ws_bytes = 0;
    W.arena.kind = 0;
  }

  ~Impl() {
    ReleaseActivations();
    off.Destroy();
    for (DevBuf* b : {&B.ids, &B.targets, &B.pos, &B.cu}) b->Release();
    for (void* q : {static_cast<void*>(p), static_cast<void*>(g), static_cast<void*>(m),
                    static_cast<void*>(v), w, static_cast<void*>(scalar),
                    static_cast<void*>(log_decays)})
      if (q) cudaFree(q);
    if (loss_host) cudaFreeHost(loss_host);
    for (void* h : {cp_host_send, cp_host_recv})
      if (h) cudaFreeHost(h);
    if (stream) cudaStreamDestroy(stream);
  }

  ParamSet& P() { return host->params(); }
  const void* Wb(int i) { return At(w, P().info(i).offset); }
  float* G(int i) { return g + P().info(i).offset; }

  // ---- GEMMs (row-major; bf16 in, fp32 accumulate) --------------------------------------------
  // y[T, out] (+)= x[T, in] W[out, in]^T; x rows `ldx` apart.
  // residual (nullable, with acc): y = residual + x W^T, y only written.
  absl::Status Fwd(const void* x, int64_t ldx, const void* Wt, void* y, int64_t T, int64_t in,
                   int64_t out, bool acc, const void* residual = nullptr) {
    kc::GemmArgs a;
    a.trans_b = true;
    a.M = T, a.N = out, a.K = in, a.beta = acc ? 1.0f : 0.0f;
    a.A = x, a.lda = ldx, a.B = Wt, a.ldb = in, a.C = y, a.ldc = out, a.C_in = residual;
    return FromKernel(blas->Gemm(a, stream));
  }
  // Where a GEMM's rows go: `ld` elements of `type` apart, overwritten or (add) added to.
  struct Rows {
    void* p;
    int64_t ld;
    KDType type = kAct;
    bool add = false;
  };
  // dx[T, in] (+)= dy[T, out] W[out, in] (dy rows `out` apart).
  absl::Status InputGrad(const void* dy, const void* Wt, Rows dx, int64_t T, int64_t in,
                         int64_t out) {
    kc::GemmArgs a;
    a.M = T, a.N = in, a.K = out, a.beta = dx.add ? 1.0f : 0.0f;
    a.A = dy, a.lda = out, a.B = Wt, a.ldb = in, a.C = dx.p, a.ldc = dx.ld, a.c_type = dx.type;
    return FromKernel(blas->Gemm(a, stream));
  }
  // dx[T, in] (+)= dy[T, out] W[out, in]  and  dW[out, in] += dy^T x (fp32).
  absl::Status Bwd(const void* x, int64_t ldx, const void* Wt, const void* dy, void* dx,
                   float* dW, int64_t T, int64_t in, int64_t out, bool acc_dx) {
    if (dx) RETURN_IF_ERROR(InputGrad(dy, Wt, {dx, in, kAct, acc_dx}, T, in, out));
    kc::GemmArgs b;
    b.trans_a = true;
    b.M = out, b.N = in, b.K = T, b.beta = 1.0f;
    b.A = dy, b.lda = out, b.B = x, b.ldb = ldx, b.C = dW, b.ldc = in;
    b.c_type = KDType::kFloat32;
    return FromKernel(blas->Gemm(b, stream));
  }
  // dst[rows, width] <- src[rows, width] with row strides (elements).
  absl::Status Copy2D(void* dst, int64_t dst_stride, const void* src, int64_t src_stride,
                      int64_t width, int64_t rows) {
    return FromKernel(
        kc::CopyRows(dst, dst_stride, 0, src, src_stride, 0, rows, 1, width, kAct, stream));
  }
  kc::Workspace Ws() { return {W.ws.get(), static_cast<size_t>(W.ws_bytes)}; }
  absl::Status Act(DevBuf& b, int64_t rows, int64_t cols) {
    return b.Ensure(&alloc, rows * cols * kAb);
  }
  absl::Status F32(DevBuf& b, int64_t n) { return b.Ensure(&alloc, n * 4); }

  // ---- One layer kind's buffers at a time (KindArena) -----------------------------------------
  // The buffers of `kind` ('L' or 'M') of C or of W that a layer of the other kind never uses,
  // with the bytes the layer code asks for at the current batch and CP mode (a buffer asked for
  // larger than its view gets a block of its own, so a mismatch costs memory, not correctness).
  // The MLA attention's output and statistics are not among them: a recomputing MLA layer keeps
  // its own (KeptAttention).
  KindFields CacheKindFields(Cache& C, char kind);
  KindFields WorkKindFields(char kind);
  // Makes `kind`'s buffers views of `a`, sized for the larger of the model's kinds, after
  // releasing both kinds' buffers, unless `a` already holds this layout.
  absl::Status UseKind(KindArena& a, char kind, const KindFields& lightning, const KindFields& mla);
  // Releases both kinds' buffers and the arena.
  static void DropArena(KindArena& a, const KindFields& lightning, const KindFields& mla);

  // Copies numel() floats per (dst, src) pair, skipping pairs with a null side, then syncs.
  absl::Status CopyFlat(std::initializer_list<std::pair<float*, const float*>> copies,
                        cudaMemcpyKind kind);
  // Allocates (zeroed) the optimizer state buffers asked for that do not exist yet.
  absl::Status EnsureOptimizerState(bool want_m, bool want_v);
  // layout: null for a whole sequence; else this rank's zigzag share (layout->cp > 1).
  absl::Status Upload(const Batch& b, const CpLayout* layout);
  // x_out null: no output, only what the backward reads. ffn_kept: the FFN's [T, F] activations
  // stay in C for the backward (a layer that keeps its cache); otherwise the FFN runs in blocks
  // (FfnForward) and the backward recomputes them. attention_kept: the MLA attention's output and
  // statistics are already in C (see KeptAttention); only what its backward reads besides them
  // is computed.
  absl::Status LayerForward(const LayerIdx& L, Cache& C, const void* x_in, void* x_out,
                            bool ffn_kept, bool attention_kept = false);
  absl::Status LayerBackward(const LayerIdx& L, Cache& C, const void* x_in, void* dx,
                             bool ffn_kept);
  absl::Status FfnHidden(const LayerIdx& L, const void* h, void* g, void* u, void* a, int64_t n);
  absl::Status FfnForward(const LayerIdx& L, Cache& C, void* x_out, bool ffn_kept);
  absl::Status FfnBackward(const LayerIdx& L, Cache& C, void* dx, bool ffn_kept);
  absl::Status LightningForward(const LayerIdx& L, Cache& C);
  absl::Status LightningBackward(const LayerIdx& L, Cache& C, const void* dout);
  absl::Status MlaForward(const LayerIdx& L, Cache& C, bool attention_kept);
  absl::Status MlaBackward(const LayerIdx& L, Cache& C, const void* dout);
  absl::StatusOr<LossStats> HeadAndLoss(const void* x, float grad_scale, void* dx);
  // Sdpa::Backward with the documents of cu_host, its dims.H heads in groups (see
  // SetAttentionHeadsPerCall): each group's views start at its first head, its statistics at
  // row h0 of stats [H, T].
  absl::Status AttentionBackward(const void* q, const void* k, const void* v, const void* o,
                                 const float* stats, const void* dout, void* dq, void* dk, void* dv,
                                 const std::vector<int32_t>& cu_host, float scale,
                                 kc::SdpaDims dims);
  absl::StatusOr<LossStats> Run(const Batch& b, const CpLayout* layout, float grad_scale,
                                Recompute recompute, bool backward);

  // ---- Context parallelism (All2All) ----------------------------------------------------------
  absl::Status CheckCpContext() const;
  absl::Status CheckCpBatch(const CpBatch& b) const;
  // Local tokens -> W.cp_block: block j = [T][the views' heads of rank j, view after view].
  absl::Status PackByHeads(const std::vector<HeadView>& views);
  // recv (block j = [T][the views' heads of rank j]) -> the local views: blocks [j0, j1), block
  // j0's first head at the views' head 0 (j1 = -1: every block).
  absl::Status UnpackToTokens(const void* recv, const std::vector<HeadView>& views, int64_t j0 = 0,
                              int64_t j1 = -1);
  // Every rank's two zigzag slots (ZigzagChunk): the slot's first row among the rank blocks of an
  // exchange (block i = rank i's T local rows) and its chunk's first row in stream order.
  struct SlotRows {
    int rank;
    int64_t block_row, stream_row;
    int64_t Row(bool in_stream) const { return in_stream ? stream_row : block_row; }
  };
  std::vector<SlotRows> ZigzagSlots() const {
    std::vector<SlotRows> v;
    for (int i = 0; i < B.cp; ++i)
      for (int64_t s = 0; s < 2; ++s)
        v.push_back({i, i * B.T + s * B.chunk, ZigzagChunk(B.cp, i, s) * B.chunk});
    return v;
  }
  // Every slot's rows of `width` from src to dst, each side in stream order ([T_full, width]) or in
  // rank-block order (block i = rank i's tokens). Device or pinned host memory.
  absl::Status CopySlots(const void* src, bool src_in_stream, void* dst, bool dst_in_stream,
                         int64_t width);
  // The all-to-all of the whole-sequence buffers (distinct send and receive memory): from the
  // local tokens' blocks (send: block j = [T, width] for rank j) into `full` [T_full, width] in
  // stream order, each rank's two zigzag chunks received where they belong; or from `full` in
  // stream order into blocks (recv: block i from rank i). With NCCL the pieces go straight to
  // their places; through Gloo via the pinned host staging.
  absl::Status ExchangeToStream(const void* send, void* full, int64_t width, CommLayer layer);
  absl::Status ExchangeFromStream(const void* full, void* recv, int64_t width, CommLayer layer);
  // The host-staged all-to-all: cp_host_send (filled by the caller, `bytes` in all) ->
  // cp_host_recv.
  absl::Status ExchangeHost(int64_t bytes, CommLayer layer);
  // The NCCL all-to-all by zigzag slots (ZigzagSlots), each side's rows in stream order or in
  // rank-block order.
  absl::Status ExchangeSlots(const void* send, bool send_in_stream, void* recv, bool recv_in_stream,
                             int64_t width, CommLayer layer);
  absl::Status LightningCoreForward(const LayerIdx& L, Cache& C);
  absl::Status LightningCoreBackward(const LayerIdx& L, Cache& C);
  // ---- Context parallelism (Lightning AllGather: DESIGN.md section 3) ----
  bool LightningAllGather() const { return B.cp > 1 && cp.lightning_mode == CpMode::kAllGather; }
  // send: this rank's two [H, Dh, Dh] fp32 blocks -> W.cp_state_stream: all 2cp in stream order.
  absl::Status GatherStates(const float* send);
  absl::Status LightningAllGatherForward(const LayerIdx& L, Cache& C);
  absl::Status LightningAllGatherBackward(const LayerIdx& L, Cache& C);
  absl::Status MlaCoreForward(Cache& C, bool attention_kept);
  // The gradients stay in C.cp_full, rank block by rank block (MlaUnpackGrads).
  absl::Status MlaCoreBackward(Cache& C);
  // Rank blocks [j0, j1) of the received MLA core gradients -> W.dQ, W.dK and dkvb's V columns,
  // `Hg` heads wide.
  absl::Status MlaUnpackGrads(const void* recv, int64_t Hg, int64_t j0, int64_t j1);
  // ---- Context parallelism (MLA AllGather: DESIGN.md section 3) ----
  bool MlaAllGather() const { return B.cp > 1 && cp.mla_mode == CpMode::kAllGather; }
  // Device-buffer collectives of the CP group (NCCL directly, Gloo through the pinned staging).
  absl::Status GatherDevice(const void* send, int64_t n, CommType type, int64_t elem_bytes,
                            void* recv, CommLayer layer);
  absl::Status ReduceScatterDevice(const float* send, int64_t n, float* recv, CommLayer layer);
  absl::Status MlaBuildKeys(const LayerIdx& L, Cache& C, int64_t a, int64_t b);
  absl::Status MlaKeyGradsToLatent(const LayerIdx& L, Cache& C, int64_t a, int64_t b);
  // MLA's backward by groups of heads (see CudaMlaGradHeadsPerGroup): the heads in a group,
  // n_heads for one group (always under MLA AllGather); under All2All n_heads / cp or n_heads.
  int64_t MlaGradHeadsPerGroup() const;
  // The attention backward of heads [h0, h0 + Hg) (cp = 1) into W.dQ, W.dK and dkvb's V columns at
  // the group's width, from copies of the group's Q, K and kv_b output when Hg < n_heads.
  absl::Status MlaGroupAttentionBackward(Cache& C, int64_t h0, int64_t Hg);
  // The key gradients of n rows for heads [h0, h0 + Hg) (dK [n, Hg, qk], dV in dkvb's V columns,
  // [n, Hg, nope + vd]) -> dW_kv_b's rows of those heads (accumulated; c_n: the normed latent rows,
  // `ldc` apart) and the rows' latent gradients [d c_n | d k_r, unrotated] into `lat`.
  absl::Status MlaKeyGradsToLatentRows(const LayerIdx& L, const void* c_n, int64_t ldc, void* dK,
                                       void* dkvb, int64_t n, int64_t h0, int64_t Hg, Rows lat);
  // dQ of heads [h0, h0 + Hg) (W.dQ at the group's width) -> RoPE's inverse, dW of q_b's (or q's)
  // rows of those heads (accumulated) and the input gradient into `dx` (q_a's normed output, or
  // without a q LoRA the normed layer input).
  absl::Status MlaQueryGrads(const LayerIdx& L, Cache& C, int64_t h0, int64_t Hg, Rows dx);
  absl::Status MlaAllGatherForward(const LayerIdx& L, Cache& C, bool attention_kept);
  absl::Status MlaAllGatherBackward(const LayerIdx& L, Cache& C);
};

// ---- Setup -------------------------------------------------------------------------------------

CudaModel::CudaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaModel::~CudaModel() = default;

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::Create(const ModelConfig& config,
                                                             uint64_t seed, int device) {
  RETURN_IF_ERROR(config.Validate());
  if (const std::string shape = CudaShapeProblem(config); !shape.empty())
    return absl::InvalidArgumentError(
        absl::StrCat("cuda model: the CUDA kernels cannot run ", shape));
  auto impl = std::make_unique<Impl>();
  impl->c = config;
  impl->device = device;
  cudaDeviceProp prop;
  CUDA(cudaGetDeviceProperties(&prop, device));
  if (const std::string problem =
          kc::DeviceSupportProblem(device, prop.name, prop.major, prop.minor);
      !problem.empty())
    return absl::FailedPreconditionError(absl::StrCat("cuda model: ", problem));
  int clock_khz = 0;
  CUDA(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  impl->peak_flops = kc::DenseBf16PeakFlops(prop.name, prop.multiProcessorCount, clock_khz);
  // The host copy: weights for checkpoints and evaluation; its gradient buffer only if a host
  // all-reduce asks for it (DownloadGrads).
  ASSIGN_OR_RETURN(impl->host, Model::Create(config, seed, /*host_grads=*/false));
  CUDA(cudaSetDevice(device));
  CUDA(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));
  KC(kc::Blas::Create(&impl->blas));
  if (config.NumLayersOfKind('M') > 0) KC(kc::Sdpa::Create(&impl->sdpa));
  ParamSet& P = impl->P();
  const int64_t n = P.numel(), H = config.n_heads;
  // The optimizer state (m, v) comes with the first optimizer step or state upload: AdamW needs
  // both, SGD with momentum m only, plain SGD neither.
  for (float** b : {&impl->p, &impl->g}) CUDA(cudaMalloc(b, n * 4));
  CUDA(cudaMalloc(&impl->w, n * kAb));
  CUDA(cudaMalloc(&impl->scalar, 2 * sizeof(double)));
  CUDA(cudaMallocHost(&impl->loss_host, sizeof(double)));
  CUDA(cudaMalloc(&impl->log_decays, std::max<int64_t>(1, config.n_layers * H) * 4));
  impl->fixed_bytes = n * (8 + kAb);
  CUDA(cudaMemsetAsync(impl->g, 0, n * 4, impl->stream));

  auto idx = [&](const std::string& name) { return P.Find(name); };
  impl->embed = idx("embed.weight");
  impl->final_norm = idx("final_norm.weight");
  impl->lm_head = idx("lm_head.weight");
  for (int64_t i = 0; i < config.n_layers; ++i) {
    const std::string p = absl::StrCat("layers.", i, ".");
    LayerIdx L;
    L.kind = config.LayerKind(i);
    L.attn_norm = idx(p + "attn_norm.weight");
    L.ffn_norm = idx(p + "ffn_norm.weight");
    L.w1 = idx(p + "ffn.w1.weight");
    L.w2 = idx(p + "ffn.w2.weight");
    L.w3 = idx(p + "ffn.w3.weight");
    if (L.kind == 'L') {
      L.qkv = idx(p + "la.qkv.weight");
      L.gate = idx(p + "la.gate.weight");
      L.out = idx(p + "la.out.weight");
      L.q_norm = idx(p + "la.q_norm.weight");
      L.k_norm = idx(p + "la.k_norm.weight");
      L.out_norm = idx(p + "la.out_norm.weight");
      const std::vector<float> ld = LightningLogDecays(config, i);
      L.log_decay = impl->log_decays + i * H;
      CUDA(cudaMemcpy(L.log_decay, ld.data(), H * 4, cudaMemcpyHostToDevice));
    } else {
      L.q = idx(p + "mla.q.weight");
      L.q_a = idx(p + "mla.q_a.weight");
      L.q_a_norm = idx(p + "mla.q_a_norm.weight");
      L.q_b = idx(p + "mla.q_b.weight");
      L.kv_a = idx(p + "mla.kv_a.weight");
      L.kv_norm = idx(p + "mla.kv_norm.weight");
      L.kv_b = idx(p + "mla.kv_b.weight");
      L.mo = idx(p + "mla.out.weight");
    }
    impl->layers.push_back(L);
  }
  std::unique_ptr<CudaModel> model(new CudaModel(std::move(impl)));
  RETURN_IF_ERROR(model->UploadParams());
  return model;
}

const ModelConfig& CudaModel::config() const { return impl_->c; }
ParamSet& CudaModel::host_params() { return impl_->P(); }
cudaStream_t CudaModel::stream() const { return impl_->stream; }
float* CudaModel::device_params() { return impl_->p; }
float* CudaModel::device_grads() { return impl_->g; }
int64_t CudaModel::steps_taken() const { return impl_->steps; }

// Copies flat fp32 buffers (numel() floats each) between host and device in order on the stream,
// then waits for them (and for everything enqueued before).
absl::Status CudaModel::Impl::CopyFlat(std::initializer_list<std::pair<float*, const float*>> copies,
                                       cudaMemcpyKind kind) {
  for (const auto& [dst, src] : copies)
    if (dst != nullptr && src != nullptr)
      CUDA(cudaMemcpyAsync(dst, src, P().numel() * 4, kind, stream));
  CUDA(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

absl::Status CudaModel::UploadParams() {
  Impl& I = *impl_;
  RETURN_IF_ERROR(I.CopyFlat({{I.p, I.P().flat_data().f32()}}, cudaMemcpyHostToDevice));
  KC(kc::ConvertFromFloat(I.p, I.w, I.P().numel(), kAct, I.stream));
  CUDA(cudaStreamSynchronize(I.stream));
  return absl::OkStatus();
}

absl::Status CudaModel::DownloadParams() {
  Impl& I = *impl_;
  return I.CopyFlat({{I.P().flat_data().f32(), I.p}}, cudaMemcpyDeviceToHost);
}

absl::Status CudaModel::DownloadGrads() {
  Impl& I = *impl_;
  return I.CopyFlat({{I.P().flat_grad().f32(), I.g}}, cudaMemcpyDeviceToHost);
}

absl::Status CudaModel::UploadGrads() {
  Impl& I = *impl_;
  return I.CopyFlat({{I.g, I.P().flat_grad().f32()}}, cudaMemcpyHostToDevice);
}

absl::Status CudaModel::Impl::EnsureOptimizerState(bool want_m, bool want_v) {
  const int64_t n = P().numel();
  for (auto [buf, want] : {std::pair{&m, want_m}, {&v, want_v}}) {
    if (!want || *buf != nullptr) continue;
    CUDA(cudaMalloc(buf, n * 4));
    CUDA(cudaMemsetAsync(*buf, 0, n * 4, stream));
    fixed_bytes += n * 4;
  }
  return absl::OkStatus();
}

absl::Status CudaModel::DownloadOptimizerState(Tensor* m, Tensor* v) {
  Impl& I = *impl_;
  const int64_t n = I.P().numel();
  // State this optimizer does not keep (no device buffer) is left as it is.
  for (auto [host, dev] : {std::pair{m, I.m}, {v, I.v}})
    if (dev != nullptr && host->numel() != n) *host = Tensor({n});
  return I.CopyFlat({{I.m ? m->f32() : nullptr, I.m}, {I.v ? v->f32() : nullptr, I.v}},
                    cudaMemcpyDeviceToHost);
}

absl::Status CudaModel::UploadOptimizerState(const Tensor& m, const Tensor& v,
                                             int64_t steps_taken) {
  Impl& I = *impl_;
  const int64_t n = I.P().numel();
  if ((m.numel() != n && m.numel() != 0) || (v.numel() != n && v.numel() != 0))
    return absl::InvalidArgumentError(absl::StrCat("optimizer state: expected ", n,
                                                   " values per state tensor (or none), got ",
                                                   m.numel(), " and ", v.numel()));
  RETURN_IF_ERROR(I.EnsureOptimizerState(m.numel() != 0, v.numel() != 0));
  RETURN_IF_ERROR(I.CopyFlat({{I.m, m.numel() ? m.f32() : nullptr},
                              {I.v, v.numel() ? v.f32() : nullptr}},
                             cudaMemcpyHostToDevice));
  I.steps = steps_taken;
  return absl::OkStatus();
}

absl::Status CudaModel::ZeroGrads() {
  CUDA(cudaMemsetAsync(impl_->g, 0, impl_->P().numel() * 4, impl_->stream));
  return absl::OkStatus();
}

absl::StatusOr<double> CudaModel::GradSquaredNorm() {
  Impl& I = *impl_;
  DevBuf ws;
  RETURN_IF_ERROR(ws.Ensure(&I.alloc, kc::SquaredNormWorkspaceBytes()));
  KC(kc::SquaredNorm(I.g, I.P().numel(), I.scalar,
                     {ws.get(), kc::SquaredNormWorkspaceBytes()}, I.stream));
  double out = 0.0;
  CUDA(cudaMemcpyAsync(&out, I.scalar, sizeof(double), cudaMemcpyDeviceToHost, I.stream));
  CUDA(cudaStreamSynchronize(I.stream));
  return out;
}

absl::Status CudaModel::OptimizerStep(const TrainSpec& spec, double lr, float grad_scale) {
  Impl& I = *impl_;
  ParamSet& P = I.P();
  const bool adamw = spec.optimizer == "adamw";
  if (!adamw && spec.optimizer != "sgd")
    return absl::InvalidArgumentError(
        absl::StrCat("cuda model: unknown optimizer \"", spec.optimizer, "\" (adamw or sgd)"));
  RETURN_IF_ERROR(I.EnsureOptimizerState(adamw || spec.momentum > 0, adamw));
  std::vector<kc::OptimizerTensor> t;
  for (int i = 0; i < P.size(); ++i) {
    const ParamInfo& info = P.info(i);
    const float wd = info.weight_decay ? static_cast<float>(spec.weight_decay) : 0.0f;
    // State the rule does not keep stays null (plain SGD: no m; SGD: no v).
    t.push_back({I.p + info.offset, I.g + info.offset, I.m ? I.m + info.offset : nullptr,
                 I.v ? I.v + info.offset : nullptr, At(I.w, info.offset), info.numel, wd});
  }
  ++I.steps;
  const auto n_t = static_cast<int64_t>(t.size());
  if (adamw) {
    kc::AdamWHyper hp{static_cast<float>(lr), static_cast<float>(spec.beta1),
                      static_cast<float>(spec.beta2), static_cast<float>(spec.eps), I.steps,
                      grad_scale};
    KC(kc::AdamWMultiTensor(t.data(), n_t, hp, I.stream));
  } else {
    kc::SgdHyper hp{static_cast<float>(lr), static_cast<float>(spec.momentum), grad_scale};
    KC(kc::SgdMultiTensor(t.data(), n_t, hp, I.stream));
  }
  return absl::OkStatus();
}

DeviceMemory CudaModel::memory() const {
  const kc::AllocatorStats s = impl_->alloc.Stats();
  DeviceMemory m;
  m.allocated = static_cast<int64_t>(s.allocated);
  m.reserved = static_cast<int64_t>(s.reserved);
  m.peak_allocated = static_cast<int64_t>(s.peak_allocated);
  m.fixed = impl_->fixed_bytes;
  if (impl_->sdpa) m.attention_workspace = impl_->sdpa->WorkspaceBytes();
  m.offload_host = impl_->off.host_bytes;
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
    m.device_used = static_cast<int64_t>(total_b - free_b);
  return m;
}

void CudaModel::ResetPeakMemory() { impl_->alloc.ResetPeak(); }

absl::Status CudaModel::ReleaseActivationMemory() {
  CUDA(cudaStreamSynchronize(impl_->stream));
  impl_->ReleaseActivations();
  return FromKernel(impl_->alloc.EmptyCache());
}
double CudaModel::last_enqueue_seconds() const { return impl_->enqueue_seconds; }

double CudaModel::peak_flops() const { return impl_->peak_flops; }
void CudaModel::SetPoisonActivations(bool on) { impl_->alloc.SetPoison(on); }

// ---- Batch ---------------------------------------------------------------------------------------

absl::Status CudaModel::Impl::Upload(const Batch& b, const CpLayout* layout) {
  if (b.T < 1) return absl::InvalidArgumentError("cuda model: empty batch");
  const bool split = layout != nullptr && layout->cp > 1;
  if (!split && (b.pieces.size() != 1 || b.pieces[0].begin != 0 || b.pieces[0].len != b.T))
    return absl::InvalidArgumentError(
        "cuda model: a batch must be one whole sequence (a share of a sequence needs context "
        "parallelism: SetCp and the CpBatch forms)");
  if (static_cast<int64_t>(b.ids.size()) != b.T || static_cast<int64_t>(b.targets.size()) != b.T ||
      static_cast<int64_t>(b.pos.size()) != b.T)
    return absl::InvalidArgumentError(
        absl::StrCat("cuda model: a batch of ", b.T, " tokens has ", b.ids.size(), " ids, ",
                     b.targets.size(), " targets and ", b.pos.size(), " positions"));
  if (split) {
    // This rank's two zigzag chunks of the layout's sequence, in that order (ShardForCp).
    const CpLayout& L = *layout;
    const int64_t ch = L.chunk;
    bool ok = ch > 0 && L.rank >= 0 && L.rank < L.cp && L.T_full == 2 * L.cp * ch &&
              b.T == 2 * ch && b.pieces.size() == 2 &&
              static_cast<int64_t>(b.idx.size()) == b.T && L.cu_seqlens.size() >= 2 &&
              L.cu_seqlens.front() == 0 && L.cu_seqlens.back() == L.T_full;
    for (int64_t s = 0; ok && s < 2; ++s)
      ok = b.pieces[s].begin == s * ch && b.pieces[s].len == ch;
    for (int64_t t = 0; ok && t < b.T; ++t)
      ok = b.idx[t] == L.ChunkOf(L.rank, t / ch) * ch + t % ch;
    if (!ok)
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda model: the batch (", b.T, " tokens, ", b.pieces.size(), " pieces) is not rank ",
          L.rank, "'s zigzag share of its cp=", L.cp, " layout (", L.T_full,
          " tokens in chunks of ", ch, "); build both with ShardForCp"));
  }
  for (int32_t id : b.ids)
    if (id < 0 || id >= c.vocab)
      return absl::InvalidArgumentError(
          absl::StrCat("cuda model: token id ", id, " outside the vocabulary [0, ", c.vocab, ")"));
  B.T = b.T;
  B.cp = split ? layout->cp : 1;
  B.rank = split ? layout->rank : 0;
  B.T_full = split ? layout->T_full : b.T;
  B.chunk = split ? layout->chunk : 0;
  B.cu_host = split ? layout->cu_seqlens : b.pieces[0].cu_seqlens;
  B.n_valid = b.NumValidTargets();
  RETURN_IF_ERROR(B.ids.Ensure(&alloc, b.T * 4));
  RETURN_IF_ERROR(B.targets.Ensure(&alloc, b.T * 4));
  RETURN_IF_ERROR(B.pos.Ensure(&alloc, b.T * 4));
  RETURN_IF_ERROR(B.cu.Ensure(&alloc, static_cast<int64_t>(B.cu_host.size()) * 4));
  CUDA(cudaMemcpyAsync(B.ids.get(), b.ids.data(), b.T * 4, cudaMemcpyHostToDevice, stream));
  CUDA(cudaMemcpyAsync(B.targets.get(), b.targets.data(), b.T * 4, cudaMemcpyHostToDevice,
                       stream));
  CUDA(cudaMemcpyAsync(B.pos.get(), b.pos.data(), b.T * 4, cudaMemcpyHostToDevice, stream));
  CUDA(cudaMemcpyAsync(B.cu.get(), B.cu_host.data(), B.cu_host.size() * 4,
                       cudaMemcpyHostToDevice, stream));
  // One workspace for every kernel that needs scratch (they run one after another).
  const int64_t T = b.T, d = c.d_model, H = c.n_heads, Dh = c.head_dim();
  const int64_t widest = std::max({d, c.mla.kv_lora_rank, std::max<int64_t>(c.mla.q_lora_rank, 1)});
  size_t need = std::max(
      {kc::LightningWorkspaceBytes({T, H, Dh, 3 * d}), kc::RmsNormBackwardWorkspaceBytes(T, widest),
       kc::QkNormRopeBackwardWorkspaceBytes(T, H, Dh),
       kc::GroupNormGateBackwardWorkspaceBytes(T, H, Dh), kc::EmbeddingBackwardWorkspaceBytes(T),
       kc::SquaredNormWorkspaceBytes()});
  if (split) {
    // The whole-sequence Lightning core over H/cp heads, and the CP buffers. Per rank the widest
    // exchange is the core's inputs (or their gradients): T * H * (one head's input width).
    const int64_t Hl = H / B.cp, Tf = B.T_full;
    const int64_t qk = c.mla.qk_nope_dim + c.mla.qk_rope_dim, vd = c.mla.v_head_dim;
    // The layer types that exchange by all-to-all (Lightning's AllGather gathers states only).
    const bool has_l = c.NumLayersOfKind('L') > 0 && cp.lightning_mode == CpMode::kAll2All;
    const bool has_m = c.NumLayersOfKind('M') > 0;
    const bool has_m_a2a = has_m && cp.mla_mode == CpMode::kAll2All;
    if (has_l) need = std::max(need, kc::LightningWorkspaceBytes({Tf, Hl, Dh, 3 * Hl * Dh}));
    const int64_t in_elems =
        std::max(has_l ? T * 3 * d : int64_t{0}, has_m_a2a ? T * H * (2 * qk + vd) : int64_t{0});
    const int64_t out_elems =
        std::max(has_l ? T * d : int64_t{0}, has_m_a2a ? T * H * vd : int64_t{0});
    RETURN_IF_ERROR(W.cp_block.Ensure(&alloc, in_elems * kAb));
    RETURN_IF_ERROR(W.cp_tmp.Ensure(&alloc, out_elems * kAb));
    // Lightning AllGather: the pieces' documents, the chunks' flags, the state blocks.
    const CpLayout& L = *layout;
    const int64_t n_chunks = 2 * B.cp, SZ = H * Dh * Dh;
    std::vector<int32_t>& has_start = B.chunk_has_start_host;
    std::vector<int32_t>& len = B.chunk_len_host;
    has_start.assign(n_chunks, 0);
    len.assign(n_chunks, 0);
    for (int64_t ci = 0; ci < n_chunks; ++ci) {
      has_start[ci] = L.chunks[ci].has_start ? 1 : 0;
      len[ci] = static_cast<int32_t>(L.chunks[ci].len);
    }
    for (int slot = 0; slot < 2; ++slot) {
      const CpChunk& chunk = L.chunks[L.ChunkOf(L.rank, slot)];
      B.slot_chunk[slot] = L.ChunkOf(L.rank, slot);
      B.continues[slot] = chunk.continues;
      B.first_segment[slot] = chunk.first_segment;
      const int64_t first = B.slot_chunk[slot] * B.chunk;
      B.key_begin[slot] = first;
      if (chunk.continues) {  // the last document start before the chunk's first token
        const auto it = std::upper_bound(B.cu_host.begin(), B.cu_host.end(), first);
        B.key_begin[slot] = *(it - 1);
      }
      B.piece_cu_host[slot] = b.pieces[slot].cu_seqlens;
      RETURN_IF_ERROR(B.piece_cu[slot].Ensure(&alloc, B.piece_cu_host[slot].size() * 4));
      CUDA(cudaMemcpyAsync(B.piece_cu[slot].get(), B.piece_cu_host[slot].data(),
                           B.piece_cu_host[slot].size() * 4, cudaMemcpyHostToDevice, stream));
    }
    // Lightning AllGather runs the core on each local chunk and the carry correction's backward
    // on each continuing chunk's first segment; a shorter sequence can need more workspace than
    // a longer one (its blocks of chunks are shorter), so each size counts.
    if (c.NumLayersOfKind('L') > 0 && cp.lightning_mode == CpMode::kAllGather) {
      need = std::max(need, kc::LightningWorkspaceBytes({B.chunk, H, Dh, 3 * d}));
      for (int slot = 0; slot < 2; ++slot)
        if (B.continues[slot])
          need = std::max(need, kc::LightningWorkspaceBytes({B.first_segment[slot], H, Dh, 3 * d}));
    }
    RETURN_IF_ERROR(B.chunk_has_start.Ensure(&alloc, n_chunks * 4));
    RETURN_IF_ERROR(B.chunk_len.Ensure(&alloc, n_chunks * 4));
    CUDA(cudaMemcpyAsync(B.chunk_has_start.get(), has_start.data(), n_chunks * 4,
                         cudaMemcpyHostToDevice, stream));
    CUDA(cudaMemcpyAsync(B.chunk_len.get(), len.data(), n_chunks * 4, cudaMemcpyHostToDevice,
                         stream));
    RETURN_IF_ERROR(F32(W.cp_state_send, 2 * SZ));
    for (DevBuf* x : {&W.cp_state_recv, &W.cp_state_stream, &W.cp_state_scan})
      RETURN_IF_ERROR(F32(*x, n_chunks * SZ));
    // MLA AllGather: the latent gather (bf16 [cp, T, w]) and the gradients' fp32 reduce-scatter
    // ([cp, T, w] in, [T, w] out) share two device blocks and the host staging.
    const int64_t lat_w = c.mla.kv_lora_rank + c.mla.qk_rope_dim;
    const int64_t ag_bytes = has_m && cp.mla_mode == CpMode::kAllGather ? B.cp * T * lat_w * 4 : 0;
    if (ag_bytes > 0) {
      RETURN_IF_ERROR(W.ag_send.Ensure(&alloc, ag_bytes));
      RETURN_IF_ERROR(W.ag_recv.Ensure(&alloc, ag_bytes));
      const int64_t rows = std::max(B.chunk, kCudaMlaKeyBlock);
      const int64_t kvw = c.mla.qk_nope_dim + vd;
      for (DevBuf* x : {&W.ag_K, &W.ag_dK}) RETURN_IF_ERROR(Act(*x, rows, H * qk));
      for (DevBuf* x : {&W.ag_kvb, &W.ag_dkvb}) RETURN_IF_ERROR(Act(*x, rows, H * kvw));
      RETURN_IF_ERROR(Act(W.ag_dlat, rows, lat_w));
      // The cross piece's per-block output, dq and statistics: one query block's.
      const int64_t qrows = std::min(B.chunk, kCudaMlaKeyBlock);
      RETURN_IF_ERROR(Act(W.ag_o, qrows, H * vd));
      RETURN_IF_ERROR(Act(W.ag_dq, qrows, H * qk));
      RETURN_IF_ERROR(F32(W.ag_acc, B.chunk * H * vd));
      RETURN_IF_ERROR(F32(W.ag_stats, StatsSlot(H, qrows)));
    }
    const int64_t staging = std::max({in_elems * kAb, n_chunks * SZ * 4, ag_bytes});
    if (!cp_device_buffers && cp_host_bytes < staging) {
      // The previous step ended with a stream sync: no copy still reads the old blocks.
      for (void** h : {&cp_host_send, &cp_host_recv}) {
        if (*h) CUDA(cudaFreeHost(*h));
        *h = nullptr;
      }
      cp_host_bytes = 0;
      CUDA(cudaMallocHost(&cp_host_send, staging));
      CUDA(cudaMallocHost(&cp_host_recv, staging));
      cp_host_bytes = staging;
    }
  }
  RETURN_IF_ERROR(W.ws.Ensure(&alloc, static_cast<int64_t>(need)));
  W.ws_bytes = static_cast<int64_t>(need);
  return absl::OkStatus();
}

// ---- Context parallelism: the all-to-all data movement -------------------------------------------

absl::Status CudaModel::Impl::CheckCpContext() const {
  if (cp.comm == nullptr || cp.comm->size() <= 1) return absl::OkStatus();
  const int64_t n = cp.comm->size();
  struct Kind {
    char kind;
    const char* field;
    CpMode mode;
  };
  bool all2all = false;
  for (const Kind& k : {Kind{'L', "lightning_mode", cp.lightning_mode},
                        Kind{'M', "mla_mode", cp.mla_mode}}) {
    if (c.NumLayersOfKind(k.kind) == 0) continue;
    if (k.mode != CpMode::kAll2All && k.mode != CpMode::kAllGather)
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda model: ", k.field, " ", std::string(CpModeName(k.mode)),
          " must be a planned mode (PlannedCpModes) before SetCp"));
    all2all |= k.mode == CpMode::kAll2All;
  }
  if (all2all && c.n_heads % n != 0)
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda model: all2all needs n_heads divisible by cp, but n_heads=", c.n_heads, " and cp=",
        n, " (", c.n_heads, " % ", n, " = ", c.n_heads % n, ")"));
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::CheckCpBatch(const CpBatch& b) const {
  if (b.layout.cp <= 1) return absl::OkStatus();
  if (cp.comm == nullptr || cp.comm->size() != b.layout.cp)
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda model: a cp=", b.layout.cp, " batch needs SetCp with a group of that size"));
  if (cp.comm->rank() != b.layout.rank)
    return absl::FailedPreconditionError(
        absl::StrCat("cuda model: the batch is rank ", b.layout.rank,
                     "'s share but this model's CP group rank is ", cp.comm->rank()));
  return CheckCpContext();
}

absl::Status CudaModel::Impl::PackByHeads(const std::vector<HeadView>& views) {
  const int64_t T = B.T, cp_n = B.cp, Hl = c.n_heads / cp_n;
  int64_t row = 0;  // one token's row in a block
  for (const HeadView& v : views) row += Hl * v.width;
  int64_t off = 0;
  for (const HeadView& v : views) {
    void* dst = At(W.cp_block.get(), off);
    if (v.head_stride == v.width) {
      // Every rank's heads are one run of the token's row: one copy for all ranks, with the rank
      // as the "head" index (the source's head stride is Hl heads, the block's T rows).
      KC(kc::CopyRows(dst, row, T * row, v.p, v.token_stride, Hl * v.width, T, cp_n,
                      Hl * v.width, kAct, stream));
    } else {
      for (int64_t j = 0; j < cp_n; ++j)
        KC(kc::CopyRows(At(dst, j * T * row), row, v.width, At(v.p, j * Hl * v.head_stride),
                        v.token_stride, v.head_stride, T, Hl, v.width, kAct, stream));
    }
    off += Hl * v.width;
  }
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::UnpackToTokens(const void* recv, const std::vector<HeadView>& views,
                                             int64_t j0, int64_t j1) {
  const int64_t T = B.T, Hl = c.n_heads / B.cp;
  if (j1 < 0) j1 = B.cp;
  int64_t row = 0;
  for (const HeadView& v : views) row += Hl * v.width;
  int64_t off = 0;
  for (const HeadView& v : views) {
    const void* src = At(recv, j0 * T * row + off);
    if (v.head_stride == v.width) {
      KC(kc::CopyRows(v.p, v.token_stride, Hl * v.width, src, row, T * row, T, j1 - j0,
                      Hl * v.width, kAct, stream));
    } else {
      for (int64_t j = 0; j < j1 - j0; ++j)
        KC(kc::CopyRows(At(v.p, j * Hl * v.head_stride), v.token_stride, v.head_stride,
                        At(src, j * T * row), row, v.width, T, Hl, v.width, kAct, stream));
    }
    off += Hl * v.width;
  }
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::CopySlots(const void* src, bool src_in_stream, void* dst,
                                        bool dst_in_stream, int64_t width) {
  for (const SlotRows& r : ZigzagSlots())
    CUDA(cudaMemcpyAsync(At(dst, r.Row(dst_in_stream) * width),
                         At(src, r.Row(src_in_stream) * width), B.chunk * width * kAb,
                         cudaMemcpyDefault, stream));
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::ExchangeHost(int64_t bytes, CommLayer layer) {
  if (bytes > cp_host_bytes)
    return absl::InternalError(absl::StrCat("cuda model: a CP exchange of ", bytes,
                                            " bytes exceeds its ", cp_host_bytes,
                                            "-byte host staging"));
  CUDA(cudaStreamSynchronize(stream));
  // The copies out of cp_host_recv that follow are asynchronous (pinned memory): the next
  // exchange writes it only after this stream sync.
  return cp.comm->AllToAll(cp_host_send, bytes / B.cp, CommType::kByte, cp_host_recv, layer);
}

absl::Status CudaModel::Impl::ExchangeSlots(const void* send, bool send_in_stream, void* recv,
                                            bool recv_in_stream, int64_t width, CommLayer layer) {
  const int64_t piece = B.chunk * width * kAb;
  std::vector<CommSendPiece> out;
  std::vector<CommRecvPiece> in;
  for (const SlotRows& r : ZigzagSlots()) {
    out.push_back({r.rank, At(send, r.Row(send_in_stream) * width), piece});
    in.push_back({r.rank, At(recv, r.Row(recv_in_stream) * width), piece});
  }
  // NCCL runs on its own stream: what it sends must be complete before it starts; its Wait()
  // returns once everything is received.
  CUDA(cudaStreamSynchronize(stream));
  return cp.comm->AllToAllPieces(std::move(out), std::move(in), layer);
}

absl::Status CudaModel::Impl::ExchangeToStream(const void* send, void* full, int64_t width,
                                               CommLayer layer) {
  if (cp_device_buffers) return ExchangeSlots(send, false, full, true, width, layer);
  const int64_t bytes = B.cp * B.T * width * kAb;
  CUDA(cudaMemcpyAsync(cp_host_send, send, bytes, cudaMemcpyDeviceToHost, stream));
  RETURN_IF_ERROR(ExchangeHost(bytes, layer));
  return CopySlots(cp_host_recv, false, full, true, width);
}

absl::Status CudaModel::Impl::ExchangeFromStream(const void* full, void* recv, int64_t width,
                                                 CommLayer layer) {
  if (cp_device_buffers) return ExchangeSlots(full, true, recv, false, width, layer);
  const int64_t bytes = B.cp * B.T * width * kAb;
  RETURN_IF_ERROR(CopySlots(full, true, cp_host_send, false, width));
  RETURN_IF_ERROR(ExchangeHost(bytes, layer));
  CUDA(cudaMemcpyAsync(recv, cp_host_recv, bytes, cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

// q, k, v of this rank's tokens (all heads, in C.qkv_n) -> the whole sequence for H/cp heads ->
// the Lightning core with the whole sequence's documents -> outputs back into C.o.
absl::Status CudaModel::Impl::LightningCoreForward(const LayerIdx& L, Cache& C) {
  const int64_t T = B.T, d = c.d_model, H = c.n_heads, Dh = c.head_dim();
  const int64_t Hl = H / B.cp, Tf = B.T_full, hw = Hl * Dh, w = 3 * hw;
  RETURN_IF_ERROR(Act(C.cp_full, Tf, w));
  void* q = C.qkv_n.get();
  RETURN_IF_ERROR(PackByHeads(
      {{q, 3 * d, Dh, Dh}, {At(q, d), 3 * d, Dh, Dh}, {At(q, 2 * d), 3 * d, Dh, Dh}}));
  RETURN_IF_ERROR(ExchangeToStream(W.cp_block.get(), C.cp_full.get(), w, CommLayer::kLightning));
  const void* f = C.cp_full.get();
  KC(kc::LightningForward(f, At(f, hw), At(f, 2 * hw), L.log_decay + B.rank * Hl, B.cu.i32(),
                          static_cast<int64_t>(B.cu_host.size()) - 1, nullptr,
                          1.0f / std::sqrt(static_cast<float>(Dh)), {Tf, Hl, Dh, w},
                          W.cp_tmp.get(), nullptr, kAct, Ws(), stream));
  RETURN_IF_ERROR(ExchangeFromStream(W.cp_tmp.get(), W.cp_block.get(), hw, CommLayer::kLightning));
  return UnpackToTokens(W.cp_block.get(), {{C.o.get(), d, Dh, Dh}});
}

// d o of this rank's tokens (W.dy) -> the whole sequence for H/cp heads -> the core's backward
// (its gradients into W.cp_block, free once d o is received) -> dq, dk, dv of this rank's tokens
// (received into C.cp_full, whose last reader the core's backward was) into W.dqkv.
absl::Status CudaModel::Impl::LightningCoreBackward(const LayerIdx& L, Cache& C) {
  const int64_t T = B.T, d = c.d_model, H = c.n_heads, Dh = c.head_dim();
  const int64_t Hl = H / B.cp, Tf = B.T_full, hw = Hl * Dh, w = 3 * hw;
  RETURN_IF_ERROR(PackByHeads({{W.dy.get(), d, Dh, Dh}}));
  RETURN_IF_ERROR(ExchangeToStream(W.cp_block.get(), W.cp_tmp.get(), hw, CommLayer::kLightning));
  void* f = C.cp_full.get();
  void* df = W.cp_block.get();
  KC(kc::LightningBackward(f, At(f, hw), At(f, 2 * hw), L.log_decay + B.rank * Hl, B.cu.i32(),
                           static_cast<int64_t>(B.cu_host.size()) - 1, nullptr,
                           1.0f / std::sqrt(static_cast<float>(Dh)), {Tf, Hl, Dh, w},
                           W.cp_tmp.get(), nullptr, df, At(df, hw), At(df, 2 * hw), nullptr,
                           kAct, Ws(), stream));
  RETURN_IF_ERROR(ExchangeFromStream(df, f, w, CommLayer::kLightning));
  void* dq = W.dqkv.get();
  return UnpackToTokens(
      f, {{dq, 3 * d, Dh, Dh}, {At(dq, d), 3 * d, Dh, Dh}, {At(dq, 2 * d), 3 * d, Dh, Dh}});
}

// ---- Context parallelism: Lightning AllGather (DESIGN.md section 3) ------------------------------

absl::Status CudaModel::Impl::GatherDevice(const void* send, int64_t n, CommType type,
                                           int64_t elem_bytes, void* recv, CommLayer layer) {
  if (cp_device_buffers) {
    CUDA(cudaStreamSynchronize(stream));  // NCCL runs on its own stream
    return cp.comm->AllGather(send, n, type, recv, layer);
  }
  const int64_t bytes = n * elem_bytes * B.cp;
  if (bytes > cp_host_bytes)
    return absl::InternalError(absl::StrCat("cuda model: a CP gather of ", bytes,
                                            " bytes exceeds its ", cp_host_bytes,
                                            "-byte host staging"));
  CUDA(cudaMemcpyAsync(cp_host_send, send, n * elem_bytes, cudaMemcpyDeviceToHost, stream));
  CUDA(cudaStreamSynchronize(stream));
  RETURN_IF_ERROR(cp.comm->AllGather(cp_host_send, n, type, cp_host_recv, layer));
  // Pinned, so asynchronous: the staging is rewritten only after a later stream sync.
  CUDA(cudaMemcpyAsync(recv, cp_host_recv, bytes, cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::ReduceScatterDevice(const float* send, int64_t n, float* recv,
                                                  CommLayer layer) {
  if (cp_device_buffers) {
    CUDA(cudaStreamSynchronize(stream));
    return cp.comm->ReduceScatterSum(send, n, recv, layer);
  }
  const int64_t bytes = n * 4 * B.cp;
  if (bytes > cp_host_bytes)
    return absl::InternalError(absl::StrCat("cuda model: a CP reduce-scatter of ", bytes,
                                            " bytes exceeds its ", cp_host_bytes,
                                            "-byte host staging"));
  float* hs = static_cast<float*>(cp_host_send);
  float* hr = static_cast<float*>(cp_host_recv);
  CUDA(cudaMemcpyAsync(hs, send, bytes, cudaMemcpyDeviceToHost, stream));
  CUDA(cudaStreamSynchronize(stream));
  RETURN_IF_ERROR(cp.comm->ReduceScatterSum(hs, n, hr, layer));
  CUDA(cudaMemcpyAsync(recv, hr, n * 4, cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::GatherStates(const float* send) {
  const int64_t SZ = c.n_heads * c.head_dim() * c.head_dim(), n = 2 * SZ;
  float* recv = W.cp_state_recv.f32();
  RETURN_IF_ERROR(GatherDevice(send, n, CommType::kF32, 4, recv, CommLayer::kLightning));
  // Rank r's block s is chunk ZigzagChunk(cp, r, s): into stream order.
  for (int64_t r = 0; r < B.cp; ++r)
    for (int64_t slot = 0; slot < 2; ++slot)
      CUDA(cudaMemcpyAsync(W.cp_state_stream.f32() + ZigzagChunk(B.cp, r, slot) * SZ,
                           recv + (2 * r + slot) * SZ, SZ * 4, cudaMemcpyDeviceToDevice, stream));
  return absl::OkStatus();
}

// Each local chunk runs from a zero state (its output and its end state S_c); the 2cp states are
// gathered and scanned into every chunk's carry-in P_c; a chunk that continues a document adds
// the carry's part to the tokens before its first document start. P is kept for the backward.
absl::Status CudaModel::Impl::LightningAllGatherForward(const LayerIdx& L, Cache& C) {
  const int64_t ch = B.chunk, d = c.d_model, H = c.n_heads, Dh = c.head_dim(), SZ = H * Dh * Dh;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  RETURN_IF_ERROR(F32(C.cp_P, 2 * SZ));
  float* S = W.cp_state_send.f32();
  for (int slot = 0; slot < 2; ++slot) {
    const void* q = At(C.qkv_n.get(), slot * ch * 3 * d);
    KC(kc::LightningForward(q, At(q, d), At(q, 2 * d), L.log_decay, B.piece_cu[slot].i32(),
                            static_cast<int64_t>(B.piece_cu_host[slot].size()) - 1, nullptr, scale,
                            {ch, H, Dh, 3 * d}, At(C.o.get(), slot * ch * d), S + slot * SZ, kAct,
                            Ws(), stream));
  }
  RETURN_IF_ERROR(GatherStates(S));
  KC(kc::LightningStateScan(W.cp_state_stream.f32(), B.chunk_has_start.i32(), B.chunk_len.i32(),
                            L.log_decay, 2 * B.cp, H, Dh, W.cp_state_scan.f32(), stream));
  for (int slot = 0; slot < 2; ++slot) {
    float* P = C.cp_P.f32() + slot * SZ;
    CUDA(cudaMemcpyAsync(P, W.cp_state_scan.f32() + B.slot_chunk[slot] * SZ, SZ * 4,
                         cudaMemcpyDeviceToDevice, stream));
    if (!B.continues[slot]) continue;
    KC(kc::LightningCarryCorrection(At(C.qkv_n.get(), slot * ch * 3 * d), L.log_decay, P, scale,
                                    {ch, H, Dh, 3 * d}, B.first_segment[slot],
                                    At(C.o.get(), slot * ch * d), kAct, stream));
  }
  return absl::OkStatus();
}

// The carry-ins' gradients from the corrected tokens (dP_c, zero for a chunk that does not
// continue a document) are gathered and reverse-scanned into every chunk's end-state gradient;
// each local chunk's backward then runs with its carry-in and that end-state gradient. Reads
// d o from W.dy, writes dq, dk, dv into W.dqkv.
absl::Status CudaModel::Impl::LightningAllGatherBackward(const LayerIdx& L, Cache& C) {
  const int64_t T = B.T, ch = B.chunk, d = c.d_model, H = c.n_heads, Dh = c.head_dim();
  const int64_t SZ = H * Dh * Dh;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  float* dP = W.cp_state_send.f32();
  CUDA(cudaMemsetAsync(dP, 0, 2 * SZ * 4, stream));
  // The correction's backward also adds its dq part into W.dqkv, which the chunk backward below
  // overwrites (its carry-in accounts for that part): start from zeros so nothing stale is read.
  CUDA(cudaMemsetAsync(W.dqkv.get(), 0, T * 3 * d * kAb, stream));
  for (int slot = 0; slot < 2; ++slot) {
    if (!B.continues[slot]) continue;
    KC(kc::LightningCarryCorrectionBackward(
        At(C.qkv_n.get(), slot * ch * 3 * d), L.log_decay, C.cp_P.f32() + slot * SZ, scale,
        {ch, H, Dh, 3 * d}, B.first_segment[slot], At(W.dy.get(), slot * ch * d),
        At(W.dqkv.get(), slot * ch * 3 * d), dP + slot * SZ, kAct, Ws(), stream));
  }
  RETURN_IF_ERROR(GatherStates(dP));
  KC(kc::LightningStateScanBackward(W.cp_state_stream.f32(), B.chunk_has_start.i32(),
                                    B.chunk_len.i32(), L.log_decay, 2 * B.cp, H, Dh,
                                    W.cp_state_scan.f32(), stream));
  for (int slot = 0; slot < 2; ++slot) {
    const void* q = At(C.qkv_n.get(), slot * ch * 3 * d);
    void* dq = At(W.dqkv.get(), slot * ch * 3 * d);
    KC(kc::LightningBackward(q, At(q, d), At(q, 2 * d), L.log_decay, B.piece_cu[slot].i32(),
                             static_cast<int64_t>(B.piece_cu_host[slot].size()) - 1,
                             B.continues[slot] ? C.cp_P.f32() + slot * SZ : nullptr, scale,
                             {ch, H, Dh, 3 * d}, At(W.dy.get(), slot * ch * d),
                             W.cp_state_scan.f32() + B.slot_chunk[slot] * SZ, dq, At(dq, d),
                             At(dq, 2 * d), nullptr, kAct, Ws(), stream));
  }
  return absl::OkStatus();
}

namespace {
// The head-split whole sequence of MLA's core: rows [Q | K | V] of H/cp heads, output [O].
kc::SdpaDims MlaCpDims(const ModelConfig& c, int64_t Tf, int64_t Hl) {
  const MlaConfig& m = c.mla;
  const int64_t qk = m.qk_nope_dim + m.qk_rope_dim, vd = m.v_head_dim, w = Hl * (2 * qk + vd);
  kc::SdpaDims s;
  s.T = Tf, s.H = Hl, s.Dqk = qk, s.Dv = vd;
  s.q = {w, qk};
  s.k = {w, qk};
  s.v = {w, vd};
  s.out = {Hl * vd, vd};
  return s;
}
}  // namespace

// Q, K (C.Q, C.K) and V (a view into C.kvb) of this rank's tokens -> the whole sequence for H/cp
// heads -> causal document attention -> O back into C.O.
absl::Status CudaModel::Impl::MlaCoreForward(Cache& C, bool attention_kept) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, H = c.n_heads, Hl = H / B.cp, Tf = B.T_full;
  const int64_t nope = m.qk_nope_dim, qk = nope + m.qk_rope_dim, vd = m.v_head_dim;
  const int64_t w = Hl * (2 * qk + vd), ow = Hl * vd;
  RETURN_IF_ERROR(Act(C.cp_full, Tf, w));
  RETURN_IF_ERROR(Act(C.cp_out, Tf, ow));
  RETURN_IF_ERROR(F32(C.stats, Hl * Tf));
  RETURN_IF_ERROR(PackByHeads({{C.Q.get(), H * qk, qk, qk},
                               {C.K.get(), H * qk, qk, qk},
                               {At(C.kvb.get(), nope), H * (nope + vd), nope + vd, vd}}));
  RETURN_IF_ERROR(ExchangeToStream(W.cp_block.get(), C.cp_full.get(), w, CommLayer::kMla));
  if (attention_kept) return absl::OkStatus();
  const void* f = C.cp_full.get();
  KC(sdpa->Forward(f, At(f, Hl * qk), At(f, 2 * Hl * qk), C.cp_out.get(), C.stats.f32(),
                   B.cu_host.data(), static_cast<int64_t>(B.cu_host.size()) - 1,
                   1.0f / std::sqrt(static_cast<float>(qk)), MlaCpDims(c, Tf, Hl), kAct, stream));
  RETURN_IF_ERROR(ExchangeFromStream(C.cp_out.get(), W.cp_tmp.get(), ow, CommLayer::kMla));
  return UnpackToTokens(W.cp_tmp.get(), {{C.O.get(), H * vd, vd, vd}});
}

// dO of this rank's tokens (W.dO) -> the whole sequence for H/cp heads -> attention backward (its
// gradients into W.cp_block, as in LightningCoreBackward) -> dQ, dK and dV of this rank's tokens,
// every rank's heads in a block of their own, received into C.cp_full (MlaUnpackGrads takes them
// out).
absl::Status CudaModel::Impl::MlaCoreBackward(Cache& C) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, H = c.n_heads, Hl = H / B.cp, Tf = B.T_full;
  const int64_t nope = m.qk_nope_dim, qk = nope + m.qk_rope_dim, vd = m.v_head_dim;
  const int64_t w = Hl * (2 * qk + vd), ow = Hl * vd;
  RETURN_IF_ERROR(PackByHeads({{W.dO.get(), H * vd, vd, vd}}));
  RETURN_IF_ERROR(ExchangeToStream(W.cp_block.get(), W.cp_tmp.get(), ow, CommLayer::kMla));
  void* f = C.cp_full.get();
  void* df = W.cp_block.get();
  RETURN_IF_ERROR(
      AttentionBackward(f, At(f, Hl * qk), At(f, 2 * Hl * qk), C.cp_out.get(), C.stats.f32(),
                        W.cp_tmp.get(), df, At(df, Hl * qk), At(df, 2 * Hl * qk), B.cu_host,
                        1.0f / std::sqrt(static_cast<float>(qk)), MlaCpDims(c, Tf, Hl)));
  return ExchangeFromStream(df, f, w, CommLayer::kMla);
}

absl::Status CudaModel::Impl::MlaUnpackGrads(const void* recv, int64_t Hg, int64_t j0, int64_t j1) {
  const MlaConfig& m = c.mla;
  const int64_t nope = m.qk_nope_dim, qk = nope + m.qk_rope_dim, vd = m.v_head_dim;
  return UnpackToTokens(recv,
                        {{W.dQ.get(), Hg * qk, qk, qk},
                         {W.dK.get(), Hg * qk, qk, qk},
                         {At(W.dkvb.get(), nope), Hg * (nope + vd), nope + vd, vd}},
                        j0, j1);
}

// ---- Context parallelism: MLA AllGather (DESIGN.md section 3) -----------------------------------
//
// Every rank gathers the latent [c_n | rotated k_r] of all tokens (kv + rd values a token, not
// the H * (qk + vd) of K and V). Each local chunk then attends in two pieces: its own tokens
// causally with its documents (Sdpa::Forward on the chunk), and, when its first token continues
// a document begun earlier, the tokens of that document inside the chunk (the first segment)
// attend the document's earlier tokens without a mask (Sdpa::ForwardFull), walked in key blocks
// of kCudaMlaKeyBlock rows so that memory does not grow with the whole sequence, and in query
// blocks of as many rows so that cuDNN's staging does not grow with the chunk: each key block's
// keys and values are rebuilt from the gathered latent with kv_b, and each (query block, key
// block) piece merges into an fp32 running output by the log-sum-exp statistics (AttentionMerge).
// The backward walks the same pieces with the merged output and statistics (which makes each
// piece's gradients its share), rebuilding each key block's keys and values, adds the pieces' dq,
// takes each piece's key gradients back through kv_b (dW_kv_b accumulated) to the latent, and
// reduce-scatters the latent gradients (fp32, summed over the pieces) to their owners.

namespace {
// The cross piece's query rows [q0, q0 + n) in blocks of kCudaMlaKeyBlock: cuDNN's full-attention
// plans pad to powers of two and stage zero-padded copies of the queries, their output and
// gradients, so whole chunks would cost ~8.7 GiB at 1M tokens (cp = 2) and double past each
// power of two; blocks keep that at one block's.
std::vector<std::pair<int64_t, int64_t>> MlaQueryBlocks(int64_t nq) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t q0 = 0; q0 < nq; q0 += kCudaMlaKeyBlock)
    out.emplace_back(q0, std::min(kCudaMlaKeyBlock, nq - q0));
  return out;
}

// MLA's attention views over T tokens: Q and K [T, H, qk], V inside kv_b's output, O [T, H, vd].
kc::SdpaDims MlaDims(const ModelConfig& c, int64_t T) {
  const MlaConfig& m = c.mla;
  const int64_t H = c.n_heads, qk = m.qk_nope_dim + m.qk_rope_dim, vd = m.v_head_dim;
  const int64_t kvw = m.qk_nope_dim + vd;  // one head's row of kv_b's output
  kc::SdpaDims s;
  s.T = T, s.H = H, s.Dqk = qk, s.Dv = vd;
  s.q = {H * qk, qk};
  s.k = {H * qk, qk};
  s.v = {H * kvw, kvw};  // a view into kv_b's output, after each head's k_nope
  s.out = {H * vd, vd};
  return s;
}
}  // namespace

// Stream rows [a, b) of the gathered latent -> W.ag_K (keys [k_nope | k_r] of every head) and
// W.ag_kvb (kv_b's output: k_nope and V of every head), from their first row.
absl::Status CudaModel::Impl::MlaBuildKeys(const LayerIdx& L, Cache& C, int64_t a, int64_t b) {
  const MlaConfig& m = c.mla;
  const int64_t H = c.n_heads, nope = m.qk_nope_dim, rd = m.qk_rope_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank, w = kv + rd, kvw = nope + m.v_head_dim, n = b - a;
  RETURN_IF_ERROR(
      Fwd(At(C.ag_lat.get(), a * w), w, Wb(L.kv_b), W.ag_kvb.get(), n, kv, H * kvw, false));
  RETURN_IF_ERROR(Copy2D(W.ag_K.get(), qk, W.ag_kvb.get(), kvw, nope, n * H));
  KC(kc::CopyRows(At(W.ag_K.get(), nope), H * qk, qk, At(C.ag_lat.get(), a * w + kv), w, 0, n, H,
                  rd, kAct, stream));
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::MlaKeyGradsToLatentRows(const LayerIdx& L, const void* c_n,
                                                      int64_t ldc, void* dK, void* dkvb, int64_t n,
                                                      int64_t h0, int64_t Hg, Rows lat) {
  const MlaConfig& m = c.mla;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, qk = nope + rd, kv = m.kv_lora_rank;
  const int64_t kvw = nope + m.v_head_dim, rows = h0 * kvw * kv;  // kv_b's rows of these heads
  RETURN_IF_ERROR(Copy2D(dkvb, kvw, dK, qk, nope, n * Hg));
  const bool f32 = lat.type == KDType::kFloat32;
  void* lat_kr = static_cast<char*>(lat.p) + kv * (f32 ? 4 : kAb);
  if (lat.add && !f32)
    return absl::InternalError("cuda model: latent gradients add up in fp32 only");
  KC(kc::SumHeads(At(dK, nope), n, Hg, rd, Hg * qk, qk, lat_kr, lat.ld, kAct, stream, lat.add));
  RETURN_IF_ERROR(
      Bwd(c_n, ldc, At(Wb(L.kv_b), rows), dkvb, nullptr, G(L.kv_b) + rows, n, kv, Hg * kvw, false));
  // d c_n rows = d kvb W_kv_b, into the latent's first kv columns.
  return InputGrad(dkvb, At(Wb(L.kv_b), rows), lat, n, kv, Hg * kvw);
}

// The key gradients of stream rows [a, b) (W.ag_dK, and dV inside W.ag_dkvb's V columns) ->
// dW_kv_b (accumulated) and the latent gradients, added (fp32) into the reduce-scatter blocks
// (W.ag_send: block i holds rank i's tokens in its local order).
absl::Status CudaModel::Impl::MlaKeyGradsToLatent(const LayerIdx& L, Cache& C, int64_t a,
                                                  int64_t b) {
  const int64_t T = B.T, ch = B.chunk, w = c.mla.kv_lora_rank + c.mla.qk_rope_dim;
  RETURN_IF_ERROR(MlaKeyGradsToLatentRows(L, At(C.ag_lat.get(), a * w), w, W.ag_dK.get(),
                                          W.ag_dkvb.get(), b - a, 0, c.n_heads,
                                          {W.ag_dlat.get(), w}));
  // Into the owners' blocks, chunk by chunk.
  float* send = static_cast<float*>(W.ag_send.get());
  for (int64_t j = a / ch; j * ch < b; ++j) {
    const int64_t r0 = std::max(a, j * ch), r1 = std::min(b, (j + 1) * ch);
    const int64_t owner = ZigzagRank(B.cp, j), slot = ZigzagSlot(B.cp, j);
    KC(kc::CastRows(send + (owner * T + slot * ch + (r0 - j * ch)) * w, KDType::kFloat32, w,
                    At(W.ag_dlat.get(), (r0 - a) * w), kAct, w, r1 - r0, w, stream,
                    /*accumulate=*/true));
  }
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::MlaAllGatherForward(const LayerIdx& L, Cache& C,
                                                  bool attention_kept) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, ch = B.chunk, Tf = B.T_full, H = c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, vd = m.v_head_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank, w = kv + rd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(qk));
  // This rank's latent rows -> every rank's, then into stream order.
  void* send = W.ag_send.get();
  RETURN_IF_ERROR(Copy2D(send, w, C.c_n.get(), kv, kv, T));
  RETURN_IF_ERROR(Copy2D(At(send, kv), w, At(C.kva.get(), kv), w, rd, T));
  RETURN_IF_ERROR(
      GatherDevice(send, T * w * kAb, CommType::kByte, 1, W.ag_recv.get(), CommLayer::kMla));
  RETURN_IF_ERROR(Act(C.ag_lat, Tf, w));
  RETURN_IF_ERROR(CopySlots(W.ag_recv.get(), false, C.ag_lat.get(), true, w));
  const int64_t SS = StatsSlot(H, ch);
  RETURN_IF_ERROR(F32(C.stats, 2 * SS));
  if (attention_kept) return absl::OkStatus();
  for (int slot = 0; slot < 2; ++slot) {
    const int64_t first = B.slot_chunk[slot] * ch;
    void* q = At(C.Q.get(), slot * ch * H * qk);
    void* o = At(C.O.get(), slot * ch * H * vd);
    float* stats = C.stats.f32() + slot * SS;
    RETURN_IF_ERROR(MlaBuildKeys(L, C, first, first + ch));
    KC(sdpa->Forward(q, W.ag_K.get(), At(W.ag_kvb.get(), nope), o, stats,
                     B.piece_cu_host[slot].data(),
                     static_cast<int64_t>(B.piece_cu_host[slot].size()) - 1, scale, MlaDims(c, ch),
                     kAct, stream));
    if (!B.continues[slot]) continue;
    // The first segment's output accumulates in fp32 over the key blocks; its queries go in
    // blocks of as many rows, so that cuDNN stages one block's (MlaQueryBlocks).
    const int64_t nq = B.first_segment[slot];
    float* acc = W.ag_acc.f32();
    KC(kc::CastRows(acc, KDType::kFloat32, H * vd, o, kAct, H * vd, nq, H * vd, stream));
    for (int64_t a = B.key_begin[slot]; a < first; a += kCudaMlaKeyBlock) {
      const int64_t b = std::min(first, a + kCudaMlaKeyBlock);
      RETURN_IF_ERROR(MlaBuildKeys(L, C, a, b));
      for (const auto& [q0, n] : MlaQueryBlocks(nq)) {
        kc::SdpaDims full = MlaDims(c, n);
        full.Tkv = b - a;
        KC(sdpa->ForwardFull(At(q, q0 * H * qk), W.ag_K.get(), At(W.ag_kvb.get(), nope),
                             W.ag_o.get(), W.ag_stats.f32(), scale, full, kAct, stream));
        KC(kc::AttentionMerge(acc + q0 * H * vd, KDType::kFloat32, H * vd, stats + q0, ch,
                              W.ag_o.get(), kAct, H * vd, W.ag_stats.f32(), n, n, H, vd, stream));
      }
    }
    KC(kc::CastRows(o, kAct, H * vd, acc, KDType::kFloat32, H * vd, nq, H * vd, stream));
  }
  return absl::OkStatus();
}

// Reads W.dO; writes W.dQ and the latent gradients of this rank's tokens into W.dkva.
absl::Status CudaModel::Impl::MlaAllGatherBackward(const LayerIdx& L, Cache& C) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, ch = B.chunk, H = c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, vd = m.v_head_dim, qk = nope + rd;
  const int64_t w = m.kv_lora_rank + rd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(qk));
  const int64_t SS = StatsSlot(H, ch);
  CUDA(cudaMemsetAsync(W.ag_send.get(), 0, B.cp * T * w * 4, stream));
  for (int slot = 0; slot < 2; ++slot) {
    const int64_t first = B.slot_chunk[slot] * ch;
    const void* q = At(C.Q.get(), slot * ch * H * qk);
    const void* o = At(C.O.get(), slot * ch * H * vd);
    const void* dout = At(W.dO.get(), slot * ch * H * vd);
    void* dq = At(W.dQ.get(), slot * ch * H * qk);
    // The causal piece writes this chunk's dq; the cross blocks add theirs.
    RETURN_IF_ERROR(MlaBuildKeys(L, C, first, first + ch));
    RETURN_IF_ERROR(AttentionBackward(
        q, W.ag_K.get(), At(W.ag_kvb.get(), nope), o, C.stats.f32() + slot * SS, dout, dq,
        W.ag_dK.get(), At(W.ag_dkvb.get(), nope), B.piece_cu_host[slot], scale, MlaDims(c, ch)));
    RETURN_IF_ERROR(MlaKeyGradsToLatent(L, C, first, first + ch));
    if (!B.continues[slot]) continue;
    const int64_t nq = B.first_segment[slot];
    for (int64_t a = B.key_begin[slot]; a < first; a += kCudaMlaKeyBlock) {
      const int64_t b = std::min(first, a + kCudaMlaKeyBlock);
      RETURN_IF_ERROR(MlaBuildKeys(L, C, a, b));
      for (const auto& [q0, n] : MlaQueryBlocks(nq)) {
        // The merged stats of these queries, dense [H, n] as the n-query graph reads them.
        CUDA(cudaMemcpy2DAsync(W.ag_stats.f32(), n * 4, C.stats.f32() + slot * SS + q0, ch * 4,
                               n * 4, H, cudaMemcpyDeviceToDevice, stream));
        kc::SdpaDims full = MlaDims(c, n);
        full.Tkv = b - a;
        KC(sdpa->BackwardFull(At(q, q0 * H * qk), W.ag_K.get(), At(W.ag_kvb.get(), nope),
                              At(o, q0 * H * vd), W.ag_stats.f32(), At(dout, q0 * H * vd),
                              W.ag_dq.get(), W.ag_dK.get(), At(W.ag_dkvb.get(), nope), scale, full,
                              kAct, stream));
        KC(kc::AddRows(At(dq, q0 * H * qk), H * qk, W.ag_dq.get(), H * qk, n, H * qk, kAct,
                       stream));
        // This query block's share of the key block's gradients, into the latent's.
        RETURN_IF_ERROR(MlaKeyGradsToLatent(L, C, a, b));
      }
    }
  }
  // Back to the owners, summed over ranks.
  float* rs_recv = static_cast<float*>(W.ag_recv.get());
  RETURN_IF_ERROR(
      ReduceScatterDevice(static_cast<float*>(W.ag_send.get()), T * w, rs_recv, CommLayer::kMla));
  KC(kc::CastRows(W.dkva.get(), kAct, w, rs_recv, KDType::kFloat32, w, T, w, stream));
  return absl::OkStatus();
}

// ---- One layer kind's buffers at a time --------------------------------------------------------

KindFields CudaModel::Impl::CacheKindFields(Cache& C, char kind) {
  const int64_t T = B.T, d = c.d_model, H = c.n_heads, Hl = H / B.cp;
  // Under All2All both kinds hold their core's head-split inputs in cp_full, at their own width
  // (as a field of both kinds it is one kind's at a time, like the rest; outside the arena it
  // grew from one width to the other and the allocator kept the first block unused).
  const int64_t full_rows = B.cp > 1 ? B.T_full : 0;
  if (kind == 'L') {
    // The forward's kept block states: cp = 1 only.
    const int64_t kept =
        B.cp == 1 ? static_cast<int64_t>(kc::LightningSavedBytes({T, H, c.head_dim(), 3 * d})) : 0;
    const int64_t full = LightningAllGather() ? 0 : full_rows * 3 * Hl * c.head_dim() * kAb;
    return {{&C.qkv_raw, T * 3 * d * kAb},
            {&C.qkv_n, T * 3 * d * kAb},
            {&C.gate, T * d * kAb},
            {&C.o, T * d * kAb},
            {&C.y, T * d * kAb},
            {&C.rstd_q, T * H * 4},
            {&C.rstd_k, T * H * 4},
            {&C.rstd_o, T * H * 4},
            {&C.lstates, kept},
            {&C.cp_full, full}};
  }
  const MlaConfig& m = c.mla;
  const int64_t qk = m.qk_nope_dim + m.qk_rope_dim, kv = m.kv_lora_rank, qr = m.q_lora_rank;
  // q_a and its norm only with a q LoRA; kv_b's output and K are rebuilt per key block under
  // MLA AllGather (Work's ag_kvb, ag_K).
  const int64_t q_lora = qr > 0 ? T : 0, keys = MlaAllGather() ? 0 : T;
  const int64_t full = MlaAllGather() ? 0 : full_rows * Hl * (2 * qk + m.v_head_dim) * kAb;
  return {{&C.cp_full, full},
          {&C.Q, T * H * qk * kAb},
          {&C.kva, T * (kv + m.qk_rope_dim) * kAb},
          {&C.c, T * kv * kAb},
          {&C.c_n, T * kv * kAb},
          {&C.rstd_c, T * 4},
          {&C.qa, q_lora * qr * kAb},
          {&C.qa_n, q_lora * qr * kAb},
          {&C.rstd_qa, q_lora * 4},
          {&C.kvb, keys * H * (m.qk_nope_dim + m.v_head_dim) * kAb},
          {&C.K, keys * H * qk * kAb}};
}

KindFields CudaModel::Impl::WorkKindFields(char kind) {
  const int64_t T = B.T, d = c.d_model, H = c.n_heads;
  if (kind == 'L')
    return {{&W.dy, T * d * kAb}, {&W.dgate, T * d * kAb}, {&W.dqkv, T * 3 * d * kAb}};
  const MlaConfig& m = c.mla;
  const int64_t qk = m.qk_nope_dim + m.qk_rope_dim, kv = m.kv_lora_rank, qr = m.q_lora_rank;
  const int64_t kvw = m.qk_nope_dim + m.v_head_dim, w = kv + m.qk_rope_dim;
  // In head groups: a group's gradients, the copies of its inputs and the fp32 sums.
  // (Under All2All the groups read the received blocks: no copies.)
  const int64_t Hg = MlaGradHeadsPerGroup(), groups = Hg < H ? T : 0;
  const int64_t copies = B.cp == 1 ? groups : 0;
  return {{&W.dO, T * H * m.v_head_dim * kAb},
          {&W.dQ, T * Hg * qk * kAb},
          {&W.dK, T * Hg * qk * kAb},
          {&W.dkvb, T * Hg * kvw * kAb},
          {&W.gQ, copies * Hg * qk * kAb},
          {&W.gK, copies * Hg * qk * kAb},
          {&W.gkvb, copies * Hg * kvw * kAb},
          {&W.sum_lat, groups * w * 4},
          {&W.sum_q, groups * (qr > 0 ? qr : d) * 4},
          {&W.dkva, T * w * kAb},
          {&W.dc_n, T * kv * kAb},
          {&W.dc, T * kv * kAb},
          {&W.dqa_n, T * qr * kAb},
          {&W.dqa, T * qr * kAb}};
}

namespace {
// A buffer's place in a KindArena: its bytes rounded up to 256.
int64_t ArenaBytes(int64_t bytes) { return (bytes + 255) / 256 * 256; }
void ReleaseKinds(const KindFields& lightning, const KindFields& mla) {
  for (const KindFields* f : {&lightning, &mla})
    for (const auto& [buf, bytes] : *f) buf->Release();
}
}  // namespace

absl::Status CudaModel::Impl::UseKind(KindArena& a, char kind, const KindFields& lightning,
                                      const KindFields& mla) {
  auto layout_bytes = [](const KindFields& f) {
    int64_t total = 0;
    for (const auto& [buf, bytes] : f) total += ArenaBytes(bytes);
    return total;
  };
  const int64_t need = std::max(c.NumLayersOfKind('L') > 0 ? layout_bytes(lightning) : 0,
                                c.NumLayersOfKind('M') > 0 ? layout_bytes(mla) : 0);
  const KindFields& mine = kind == 'L' ? lightning : mla;
  uint64_t key = static_cast<uint64_t>(need);
  for (const auto& [buf, bytes] : mine) key = key * 1000003u + static_cast<uint64_t>(bytes);
  if (a.kind == kind && a.key == key) return absl::OkStatus();
  ReleaseKinds(lightning, mla);
  RETURN_IF_ERROR(a.mem.Ensure(&alloc, need));
  int64_t off = 0;
  for (const auto& [buf, bytes] : mine) {
    buf->View(static_cast<char*>(a.mem.get()) + off, bytes);
    off += ArenaBytes(bytes);
  }
  a.kind = kind;
  a.key = key;
  return absl::OkStatus();
}

void CudaModel::Impl::DropArena(KindArena& a, const KindFields& lightning, const KindFields& mla) {
  ReleaseKinds(lightning, mla);
  a.mem.Release();
  a.kind = 0;
}

// ---- Lightning -----------------------------------------------------------------------------------

absl::Status CudaModel::Impl::LightningForward(const LayerIdx& L, Cache& C) {
  const int64_t T = B.T, d = c.d_model, H = c.n_heads, Dh = c.head_dim();
  const float eps = static_cast<float>(c.norm_eps), theta = static_cast<float>(c.rope_theta);
  for (DevBuf* b : {&C.qkv_raw, &C.qkv_n}) RETURN_IF_ERROR(Act(*b, T, 3 * d));
  for (DevBuf* b : {&C.gate, &C.o, &C.y}) RETURN_IF_ERROR(Act(*b, T, d));
  for (DevBuf* b : {&C.rstd_q, &C.rstd_k, &C.rstd_o}) RETURN_IF_ERROR(F32(*b, T * H));
  RETURN_IF_ERROR(Fwd(C.h.get(), d, Wb(L.qkv), C.qkv_raw.get(), T, d, 3 * d, false));
  KC(kc::QkNormRopeForward(C.qkv_raw.get(), Wb(L.q_norm), Wb(L.k_norm), B.pos.i32(),
                           C.qkv_n.get(), C.rstd_q.f32(), C.rstd_k.f32(), T, H, Dh, eps, theta,
                           /*copy_v=*/true, kAct, stream));
  if (LightningAllGather()) {
    RETURN_IF_ERROR(LightningAllGatherForward(L, C));
  } else if (B.cp > 1) {
    RETURN_IF_ERROR(LightningCoreForward(L, C));
  } else {
    const void* q = C.qkv_n.get();
    const int64_t kept = static_cast<int64_t>(kc::LightningSavedBytes({T, H, Dh, 3 * d}));
    if (kept > 0) RETURN_IF_ERROR(C.lstates.Ensure(&alloc, kept));
    KC(kc::LightningForward(q, At(q, d), At(q, 2 * d), L.log_decay, B.cu.i32(),
                            static_cast<int64_t>(B.cu_host.size()) - 1, nullptr,
                            1.0f / std::sqrt(static_cast<float>(Dh)), {T, H, Dh, 3 * d},
                            C.o.get(), nullptr, kAct, Ws(), stream, {},
                            kept > 0 ? C.lstates.f32() : nullptr));
  }
  RETURN_IF_ERROR(Fwd(C.h.get(), d, Wb(L.gate), C.gate.get(), T, d, d, false));
  KC(kc::GroupNormGateForward(C.o.get(), Wb(L.out_norm), C.gate.get(), C.y.get(), C.rstd_o.f32(),
                              T, H, Dh, eps, kAct, stream));
  return absl::OkStatus();
}

// dout: gradient of the block output [T, d]; writes W.dh (gradient of the normed input).
absl::Status CudaModel::Impl::LightningBackward(const LayerIdx& L, Cache& C, const void* dout) {
  const int64_t T = B.T, d = c.d_model, H = c.n_heads, Dh = c.head_dim();
  const float theta = static_cast<float>(c.rope_theta);
  for (DevBuf* b : {&W.dy, &W.dgate}) RETURN_IF_ERROR(Act(*b, T, d));
  RETURN_IF_ERROR(Act(W.dqkv, T, 3 * d));
  RETURN_IF_ERROR(Bwd(C.y.get(), d, Wb(L.out), dout, W.dy.get(), G(L.out), T, d, d, false));
  // dy -> d o (in place) and d gate.
  KC(kc::GroupNormGateBackward(C.o.get(), Wb(L.out_norm), C.gate.get(), C.rstd_o.f32(),
                               W.dy.get(), W.dy.get(), G(L.out_norm), W.dgate.get(), T, H, Dh,
                               kAct, Ws(), stream));
  void* dq = W.dqkv.get();
  if (LightningAllGather()) {
    RETURN_IF_ERROR(LightningAllGatherBackward(L, C));
  } else if (B.cp > 1) {
    RETURN_IF_ERROR(LightningCoreBackward(L, C));
  } else {
    const void* q = C.qkv_n.get();
    const bool kept = kc::LightningSavedBytes({T, H, Dh, 3 * d}) > 0;
    KC(kc::LightningBackward(q, At(q, d), At(q, 2 * d), L.log_decay, B.cu.i32(),
                             static_cast<int64_t>(B.cu_host.size()) - 1, nullptr,
                             1.0f / std::sqrt(static_cast<float>(Dh)), {T, H, Dh, 3 * d},
                             W.dy.get(), nullptr, dq, At(dq, d), At(dq, 2 * d), nullptr, kAct,
                             Ws(), stream, {}, kept ? C.lstates.f32() : nullptr));
  }
  KC(kc::QkNormRopeBackward(C.qkv_raw.get(), Wb(L.q_norm), Wb(L.k_norm), C.rstd_q.f32(),
                            C.rstd_k.f32(), B.pos.i32(), dq, dq, G(L.q_norm), G(L.k_norm), T, H,
                            Dh, theta, /*copy_v=*/true, kAct, Ws(), stream));
  RETURN_IF_ERROR(Bwd(C.h.get(), d, Wb(L.qkv), dq, W.dh.get(), G(L.qkv), T, d, 3 * d, false));
  return Bwd(C.h.get(), d, Wb(L.gate), W.dgate.get(), W.dh.get(), G(L.gate), T, d, d, true);
}

// ---- MLA -----------------------------------------------------------------------------------------

absl::Status CudaModel::Impl::MlaForward(const LayerIdx& L, Cache& C, bool attention_kept) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, d = c.d_model, H = c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, vd = m.v_head_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank;
  const float eps = static_cast<float>(c.norm_eps), theta = static_cast<float>(c.rope_theta);
  RETURN_IF_ERROR(Act(C.Q, T, H * qk));
  if (m.q_lora_rank > 0) {
    const int64_t qr = m.q_lora_rank;
    RETURN_IF_ERROR(Act(C.qa, T, qr));
    RETURN_IF_ERROR(Act(C.qa_n, T, qr));
    RETURN_IF_ERROR(F32(C.rstd_qa, T));
    RETURN_IF_ERROR(Fwd(C.h.get(), d, Wb(L.q_a), C.qa.get(), T, d, qr, false));
    KC(kc::RmsNormForward(C.qa.get(), Wb(L.q_a_norm), C.qa_n.get(), C.rstd_qa.f32(), T, qr, eps,
                          kAct, stream));
    RETURN_IF_ERROR(Fwd(C.qa_n.get(), qr, Wb(L.q_b), C.Q.get(), T, qr, H * qk, false));
  } else {
    RETURN_IF_ERROR(Fwd(C.h.get(), d, Wb(L.q), C.Q.get(), T, d, H * qk, false));
  }
  KC(kc::RopeApply(At(C.Q.get(), nope), B.pos.i32(), T, H, rd, H * qk, qk, theta, false, kAct,
                   stream));
  RETURN_IF_ERROR(Act(C.kva, T, kv + rd));
  RETURN_IF_ERROR(Act(C.c, T, kv));
  RETURN_IF_ERROR(Act(C.c_n, T, kv));
  RETURN_IF_ERROR(F32(C.rstd_c, T));
  RETURN_IF_ERROR(Fwd(C.h.get(), d, Wb(L.kv_a), C.kva.get(), T, d, kv + rd, false));
  RETURN_IF_ERROR(Copy2D(C.c.get(), kv, C.kva.get(), kv + rd, kv, T));
  KC(kc::RmsNormForward(C.c.get(), Wb(L.kv_norm), C.c_n.get(), C.rstd_c.f32(), T, kv, eps, kAct,
                        stream));
  // The shared rotary key, rotated in place inside kva.
  KC(kc::RopeApply(At(C.kva.get(), kv), B.pos.i32(), T, 1, rd, kv + rd, rd, theta, false, kAct,
                   stream));
  if (MlaAllGather()) {
    RETURN_IF_ERROR(Act(C.O, T, H * vd));
    return MlaAllGatherForward(L, C, attention_kept);
  }
  RETURN_IF_ERROR(Act(C.kvb, T, H * (nope + vd)));
  RETURN_IF_ERROR(Fwd(C.c_n.get(), kv, Wb(L.kv_b), C.kvb.get(), T, kv, H * (nope + vd), false));
  // K = [k_nope of each head, the shared rotary key].
  RETURN_IF_ERROR(Act(C.K, T, H * qk));
  RETURN_IF_ERROR(Copy2D(C.K.get(), qk, C.kvb.get(), nope + vd, nope, T * H));
  KC(kc::CopyRows(At(C.K.get(), nope), H * qk, qk, At(C.kva.get(), kv), kv + rd, 0, T, H, rd,
                  kAct, stream));
  RETURN_IF_ERROR(Act(C.O, T, H * vd));
  if (B.cp > 1) return MlaCoreForward(C, attention_kept);
  RETURN_IF_ERROR(F32(C.stats, H * T));
  if (attention_kept) return absl::OkStatus();
  const kc::SdpaDims dims = MlaDims(c, T);
  KC(sdpa->Forward(C.Q.get(), C.K.get(), At(C.kvb.get(), nope), C.O.get(), C.stats.f32(),
                   B.cu_host.data(), static_cast<int64_t>(B.cu_host.size()) - 1,
                   1.0f / std::sqrt(static_cast<float>(qk)), dims, kAct, stream));
  return absl::OkStatus();
}

int64_t CudaModel::Impl::MlaGradHeadsPerGroup() const {
  const int64_t H = c.n_heads;
  if (MlaAllGather()) return H;
  if (mla_grad_heads_per_group == 0) return CudaMlaGradHeadsPerGroup(c, B.T, B.cp);
  // All2All: a rank's block of heads, or all of them.
  if (B.cp > 1) return mla_grad_heads_per_group >= H ? H : H / B.cp;
  return LargestDivisorAtMost(H, mla_grad_heads_per_group);
}

absl::Status CudaModel::Impl::MlaGroupAttentionBackward(Cache& C, int64_t h0, int64_t Hg) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, H = c.n_heads, nope = m.qk_nope_dim, vd = m.v_head_dim;
  const int64_t qk = nope + m.qk_rope_dim, kvw = nope + vd;
  kc::SdpaDims dims = MlaDims(c, T);
  const void *q = C.Q.get(), *k = C.K.get(), *kvb = C.kvb.get();
  if (Hg < H) {
    RETURN_IF_ERROR(Copy2D(W.gQ.get(), Hg * qk, At(q, h0 * qk), H * qk, Hg * qk, T));
    RETURN_IF_ERROR(Copy2D(W.gK.get(), Hg * qk, At(k, h0 * qk), H * qk, Hg * qk, T));
    RETURN_IF_ERROR(Copy2D(W.gkvb.get(), Hg * kvw, At(kvb, h0 * kvw), H * kvw, Hg * kvw, T));
    q = W.gQ.get(), k = W.gK.get(), kvb = W.gkvb.get();
    dims.H = Hg;
    dims.q = dims.k = {Hg * qk, qk};
    dims.v = {Hg * kvw, kvw};
  }
  return AttentionBackward(q, k, At(kvb, nope), At(C.O.get(), h0 * vd), C.stats.f32() + h0 * T,
                           At(W.dO.get(), h0 * vd), W.dQ.get(), W.dK.get(), At(W.dkvb.get(), nope),
                           B.cu_host, 1.0f / std::sqrt(static_cast<float>(qk)), dims);
}

absl::Status CudaModel::Impl::MlaQueryGrads(const LayerIdx& L, Cache& C, int64_t h0, int64_t Hg,
                                            Rows dx) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, d = c.d_model, nope = m.qk_nope_dim, rd = m.qk_rope_dim, qk = nope + rd;
  KC(kc::RopeApply(At(W.dQ.get(), nope), B.pos.i32(), T, Hg, rd, Hg * qk, qk,
                   static_cast<float>(c.rope_theta), true, kAct, stream));
  const bool lora = m.q_lora_rank > 0;
  const int64_t in = lora ? m.q_lora_rank : d, rows = h0 * qk * in;  // the weight's rows
  const int w = lora ? L.q_b : L.q;
  RETURN_IF_ERROR(Bwd(lora ? C.qa_n.get() : C.h.get(), in, At(Wb(w), rows), W.dQ.get(), nullptr,
                      G(w) + rows, T, in, Hg * qk, false));
  return InputGrad(W.dQ.get(), At(Wb(w), rows), dx, T, in, Hg * qk);
}

// The attention's gradients, at cp = 1 and under All2All in groups of heads (MlaGradHeadsPerGroup;
// under All2All a group is a rank's block of the exchanged gradients), each group's taken back
// through kv_b and q_b (or q) at once; the latent's and q_a's gradients add up over the
// groups in fp32 (W.sum_lat, W.sum_q) when there are several, else go to W.dkva and W.dqa_n (or
// W.dh) directly. Then the shared tail: kv_norm, kv_a, q_a.
absl::Status CudaModel::Impl::MlaBackward(const LayerIdx& L, Cache& C, const void* dout) {
  const MlaConfig& m = c.mla;
  const int64_t T = B.T, d = c.d_model, H = c.n_heads;
  const int64_t nope = m.qk_nope_dim, rd = m.qk_rope_dim, vd = m.v_head_dim, qk = nope + rd;
  const int64_t kv = m.kv_lora_rank, w = kv + rd, kvw = nope + vd, qr = m.q_lora_rank;
  const int64_t Hg = MlaGradHeadsPerGroup(), dqw = qr > 0 ? qr : d;
  const bool grouped = Hg < H;
  const float theta = static_cast<float>(c.rope_theta);
  RETURN_IF_ERROR(Act(W.dO, T, H * vd));
  RETURN_IF_ERROR(Act(W.dQ, T, Hg * qk));
  RETURN_IF_ERROR(Act(W.dK, T, Hg * qk));
  RETURN_IF_ERROR(Act(W.dkvb, T, Hg * kvw));
  RETURN_IF_ERROR(Act(W.dkva, T, w));
  RETURN_IF_ERROR(Act(W.dc_n, T, kv));
  RETURN_IF_ERROR(Act(W.dc, T, kv));
  if (qr > 0) {
    RETURN_IF_ERROR(Act(W.dqa_n, T, qr));
    RETURN_IF_ERROR(Act(W.dqa, T, qr));
  }
  // q's input gradient: the normed q_a output, or without a q LoRA the normed input (which kv_a's
  // gradient then adds to).
  Rows dq_in{qr > 0 ? W.dqa_n.get() : W.dh.get(), dqw};
  RETURN_IF_ERROR(Bwd(C.O.get(), H * vd, Wb(L.mo), dout, W.dO.get(), G(L.mo), T, H * vd, d,
                      false));
  if (MlaAllGather()) {
    // The latent gradients [d c_n | d k_r (rotated)] of this rank's tokens into W.dkva, dQ into
    // W.dQ; dW_kv_b accumulated over the gathered keys.
    RETURN_IF_ERROR(MlaAllGatherBackward(L, C));
    RETURN_IF_ERROR(MlaQueryGrads(L, C, 0, H, dq_in));
  } else {
    Rows lat{W.dkva.get(), w};
    if (grouped && B.cp == 1) {
      for (DevBuf* b : {&W.gQ, &W.gK}) RETURN_IF_ERROR(Act(*b, T, Hg * qk));
      RETURN_IF_ERROR(Act(W.gkvb, T, Hg * kvw));
    }
    if (grouped) {
      RETURN_IF_ERROR(F32(W.sum_lat, T * w));
      RETURN_IF_ERROR(F32(W.sum_q, T * dqw));
      CUDA(cudaMemsetAsync(W.sum_lat.get(), 0, T * w * 4, stream));
      CUDA(cudaMemsetAsync(W.sum_q.get(), 0, T * dqw * 4, stream));
      lat = {W.sum_lat.get(), w, KDType::kFloat32, true};
      dq_in = {W.sum_q.get(), dqw, KDType::kFloat32, true};
    }
    if (B.cp > 1) RETURN_IF_ERROR(MlaCoreBackward(C));
    for (int64_t h0 = 0; h0 < H; h0 += Hg) {
      if (B.cp == 1) {
        RETURN_IF_ERROR(MlaGroupAttentionBackward(C, h0, Hg));
      } else {  // the group's ranks' blocks of the received gradients (one, or all of them)
        const int64_t Hl = H / B.cp;
        RETURN_IF_ERROR(MlaUnpackGrads(C.cp_full.get(), Hg, h0 / Hl, (h0 + Hg) / Hl));
      }
      RETURN_IF_ERROR(
          MlaKeyGradsToLatentRows(L, C.c_n.get(), kv, W.dK.get(), W.dkvb.get(), T, h0, Hg, lat));
      RETURN_IF_ERROR(MlaQueryGrads(L, C, h0, Hg, dq_in));
    }
    if (grouped) {
      KC(kc::CastRows(W.dkva.get(), kAct, w, W.sum_lat.get(), KDType::kFloat32, w, T, w, stream));
      if (qr > 0)
        KC(kc::CastRows(W.dqa_n.get(), kAct, qr, W.sum_q.get(), KDType::kFloat32, qr, T, qr,
                        stream));
    }
  }
  RETURN_IF_ERROR(Copy2D(W.dc_n.get(), kv, W.dkva.get(), w, kv, T));
  KC(kc::RmsNormBackward(C.c.get(), Wb(L.kv_norm), C.rstd_c.f32(), W.dc_n.get(), nullptr,
                         W.dc.get(), G(L.kv_norm), T, kv, kAct, Ws(), stream));
  RETURN_IF_ERROR(Copy2D(W.dkva.get(), w, W.dc.get(), kv, kv, T));
  KC(kc::RopeApply(At(W.dkva.get(), kv), B.pos.i32(), T, 1, rd, w, rd, theta, true, kAct, stream));
  // Without a q LoRA, q's gradient is in W.dh already (one group) or in W.sum_q.
  const bool q_in_dh = qr == 0 && dq_in.type == kAct;
  RETURN_IF_ERROR(
      Bwd(C.h.get(), d, Wb(L.kv_a), W.dkva.get(), W.dh.get(), G(L.kv_a), T, d, w, q_in_dh));
  if (qr == 0) {
    if (!q_in_dh)
      KC(kc::CastRows(W.dh.get(), kAct, d, W.sum_q.get(), KDType::kFloat32, d, T, d, stream,
                      /*accumulate=*/true));
    return absl::OkStatus();
  }
  KC(kc::RmsNormBackward(C.qa.get(), Wb(L.q_a_norm), C.rstd_qa.f32(), W.dqa_n.get(), nullptr,
                         W.dqa.get(), G(L.q_a_norm), T, qr, kAct, Ws(), stream));
  return Bwd(C.h.get(), d, Wb(L.q_a), W.dqa.get(), W.dh.get(), G(L.q_a), T, d, qr, true);
}

// ---- One layer -----------------------------------------------------------------------------------

// x_out = x_mid + FFN(norm(x_mid)), x_mid = x_in + Attn(norm(x_in)). x_out null (a recomputed
// forward): everything the backward reads, without the output itself, which is the next layer's
// input and kept, and without the FFN, which the backward recomputes block by block.
absl::Status CudaModel::Impl::LayerForward(const LayerIdx& L, Cache& C, const void* x_in,
                                           void* x_out, bool ffn_kept, bool attention_kept) {
  const int64_t T = B.T, d = c.d_model;
  const float eps = static_cast<float>(c.norm_eps);
  RETURN_IF_ERROR(Act(C.h, T, d));
  RETURN_IF_ERROR(F32(C.rstd1, T));
  KC(kc::RmsNormForward(x_in, Wb(L.attn_norm), C.h.get(), C.rstd1.f32(), T, d, eps, kAct,
                        stream));
  RETURN_IF_ERROR(Act(C.x_mid, T, d));
  if (L.kind == 'L') {
    RETURN_IF_ERROR(LightningForward(L, C));
    RETURN_IF_ERROR(Fwd(C.y.get(), d, Wb(L.out), C.x_mid.get(), T, d, d, true, x_in));
  } else {
    RETURN_IF_ERROR(MlaForward(L, C, attention_kept));
    const int64_t hv = c.n_heads * c.mla.v_head_dim;
    RETURN_IF_ERROR(Fwd(C.O.get(), hv, Wb(L.mo), C.x_mid.get(), T, hv, d, true, x_in));
  }
  RETURN_IF_ERROR(Act(C.h2, T, d));
  RETURN_IF_ERROR(F32(C.rstd2, T));
  KC(kc::RmsNormForward(C.x_mid.get(), Wb(L.ffn_norm), C.h2.get(), C.rstd2.f32(), T, d, eps, kAct,
                        stream));
  return FfnForward(L, C, x_out, ffn_kept);
}

// n rows of the FFN's hidden layer: g = h W1^T, u = h W3^T, a = SwiGLU(g, u).
absl::Status CudaModel::Impl::FfnHidden(const LayerIdx& L, const void* h, void* g, void* u, void* a,
                                        int64_t n) {
  const int64_t d = c.d_model, F = c.ffn_dim;
  RETURN_IF_ERROR(Fwd(h, d, Wb(L.w1), g, n, d, F, false));
  RETURN_IF_ERROR(Fwd(h, d, Wb(L.w3), u, n, d, F, false));
  KC(kc::SwiGluForward(g, u, a, n * F, kAct, stream));
  return absl::OkStatus();
}

// x_out = x_mid + SwiGLU(h2 W1^T, h2 W3^T) W2^T, with h2 = norm(x_mid) in C. With ffn_kept the
// whole sequence's g, u and a stay in C for the backward; otherwise they pass through
// [ffn_block_rows, F] buffers block by block, and without x_out nothing runs at all (the
// backward recomputes each block).
absl::Status CudaModel::Impl::FfnForward(const LayerIdx& L, Cache& C, void* x_out, bool ffn_kept) {
  const int64_t T = B.T, d = c.d_model, F = c.ffn_dim;
  if (!ffn_kept && x_out == nullptr) return absl::OkStatus();
  const int64_t rows = ffn_kept ? T : std::min(T, ffn_block_rows);
  for (DevBuf* b : {&C.g, &C.u, &C.a}) RETURN_IF_ERROR(Act(*b, rows, F));
  for (int64_t t0 = 0; t0 < T; t0 += rows) {
    const int64_t n = std::min(rows, T - t0);
    RETURN_IF_ERROR(FfnHidden(L, At(C.h2.get(), t0 * d), C.g.get(), C.u.get(), C.a.get(), n));
    if (x_out != nullptr)
      RETURN_IF_ERROR(
          Fwd(C.a.get(), F, Wb(L.w2), At(x_out, t0 * d), n, F, d, true, At(C.x_mid.get(), t0 * d)));
  }
  return absl::OkStatus();
}

// dx: in, the gradient of x_out; out, that of x_mid (dx plus the norm's backward of the FFN's
// input gradient). Block by block over [ffn_block_rows, F] gradient buffers, the weight
// gradients accumulated over the blocks; without ffn_kept each block's g, u, a are recomputed
// first.
absl::Status CudaModel::Impl::FfnBackward(const LayerIdx& L, Cache& C, void* dx, bool ffn_kept) {
  const int64_t T = B.T, d = c.d_model, F = c.ffn_dim;
  const int64_t rows = std::min(T, ffn_block_rows);
  for (DevBuf* b : {&W.da, &W.dg, &W.du}) RETURN_IF_ERROR(Act(*b, rows, F));
  if (!ffn_kept)
    for (DevBuf* b : {&C.g, &C.u, &C.a}) RETURN_IF_ERROR(Act(*b, rows, F));
  RETURN_IF_ERROR(Act(W.dh, T, d));
  for (int64_t t0 = 0; t0 < T; t0 += rows) {
    const int64_t n = std::min(rows, T - t0);
    const void* h = At(C.h2.get(), t0 * d);
    const int64_t off = ffn_kept ? t0 * F : 0;
    void *g = At(C.g.get(), off), *u = At(C.u.get(), off), *a = At(C.a.get(), off);
    if (!ffn_kept) RETURN_IF_ERROR(FfnHidden(L, h, g, u, a, n));
    void* dh = At(W.dh.get(), t0 * d);
    RETURN_IF_ERROR(Bwd(a, F, Wb(L.w2), At(dx, t0 * d), W.da.get(), G(L.w2), n, F, d, false));
    KC(kc::SwiGluBackward(g, u, W.da.get(), W.dg.get(), W.du.get(), n * F, kAct, stream));
    RETURN_IF_ERROR(Bwd(h, d, Wb(L.w1), W.dg.get(), dh, G(L.w1), n, d, F, false));
    RETURN_IF_ERROR(Bwd(h, d, Wb(L.w3), W.du.get(), dh, G(L.w3), n, d, F, true));
  }
  // dx = d x_mid = dx + RMSNorm backward of dh.
  KC(kc::RmsNormBackward(C.x_mid.get(), Wb(L.ffn_norm), C.rstd2.f32(), W.dh.get(), dx, dx,
                         G(L.ffn_norm), T, d, kAct, Ws(), stream));
  return absl::OkStatus();
}

// dx: in = gradient of x_out, out = gradient of x_in.
absl::Status CudaModel::Impl::LayerBackward(const LayerIdx& L, Cache& C, const void* x_in, void* dx,
                                            bool ffn_kept) {
  const int64_t T = B.T, d = c.d_model;
  if (kind_union)
    RETURN_IF_ERROR(UseKind(W.arena, L.kind, WorkKindFields('L'), WorkKindFields('M')));
  RETURN_IF_ERROR(FfnBackward(L, C, dx, ffn_kept));
  if (L.kind == 'L') {
    RETURN_IF_ERROR(LightningBackward(L, C, dx));
  } else {
    RETURN_IF_ERROR(MlaBackward(L, C, dx));
  }
  KC(kc::RmsNormBackward(x_in, Wb(L.attn_norm), C.rstd1.f32(), W.dh.get(), dx, dx,
                         G(L.attn_norm), T, d, kAct, Ws(), stream));
  return absl::OkStatus();
}

// ---- Whole model ---------------------------------------------------------------------------------

absl::StatusOr<LossStats> CudaModel::Impl::HeadAndLoss(const void* x, float grad_scale,
                                                       void* dx) {
  const int64_t T = B.T, d = c.d_model, V = c.vocab;
  RETURN_IF_ERROR(Act(hf, T, d));
  RETURN_IF_ERROR(F32(rstd_f, T));
  RETURN_IF_ERROR(F32(row_loss, T));
  KC(kc::RmsNormForward(x, Wb(final_norm), hf.get(), rstd_f.f32(), T, d,
                        static_cast<float>(c.norm_eps), kAct, stream));
  // Row blocks of about 256M bf16 logits (a multiple of 128 rows: whole GEMM tiles; 8192 rows at
  // V = 32000) bound the logits whatever T is. Each block's weight-gradient GEMM reads and writes
  // the whole fp32 [V, d] gradient, so fewer, larger blocks move fewer bytes: at T = 32K, 2048-row
  // blocks moved 8.4 GB of it per step, 8192-row blocks 2.1 GB.
  const int64_t block = std::min<int64_t>(
      T, head_block_rows > 0 ? head_block_rows
                             : std::max<int64_t>(128, (int64_t{1} << 28) / V / 128 * 128));
  RETURN_IF_ERROR(Act(logits, block, V));
  if (dx) RETURN_IF_ERROR(Act(dhf, T, d));
  for (int64_t r0 = 0; r0 < T; r0 += block) {
    const int64_t rows = std::min(block, T - r0);
    const void* h = At(hf.get(), r0 * d);
    RETURN_IF_ERROR(Fwd(h, d, Wb(lm_head), logits.get(), rows, d, V, false));
    KC(kc::CrossEntropy(logits.get(), B.targets.i32() + r0, rows, V, grad_scale,
                        row_loss.f32() + r0, dx ? logits.get() : nullptr, kAct, stream));
    if (dx)
      RETURN_IF_ERROR(Bwd(h, d, Wb(lm_head), logits.get(), At(dhf.get(), r0 * d), G(lm_head),
                          rows, d, V, false));
  }
  KC(kc::SumRows(row_loss.f32(), T, scalar, stream));
  if (dx)
    KC(kc::RmsNormBackward(x, Wb(final_norm), rstd_f.f32(), dhf.get(), nullptr, dx,
                           G(final_norm), T, d, kAct, Ws(), stream));
  // Read by the host after the step's final synchronisation (pinned: no implicit sync here).
  CUDA(cudaMemcpyAsync(loss_host, scalar, sizeof(double), cudaMemcpyDeviceToHost, stream));
  LossStats s;
  s.n_valid = B.n_valid;
  return s;
}

absl::StatusOr<LossStats> CudaModel::Impl::Run(const Batch& b, const CpLayout* layout,
                                               float grad_scale, Recompute recompute,
                                               bool backward) {
  const auto start = std::chrono::steady_clock::now();
  auto queued = [&] {
    enqueue_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  RETURN_IF_ERROR(Upload(b, layout));
  const int64_t T = B.T, d = c.d_model, n = c.n_layers;
  // Forward only (called with Recompute::All): two residual buffers and one cache. Training:
  // every layer input, one cache per layer that keeps its activations and one, refilled per
  // layer, for those that recompute.
  const size_t n_caches = static_cast<size_t>(recompute.NumCaches(n));
  while (caches.size() < n_caches) caches.push_back(std::make_unique<Cache>());
  caches.resize(n_caches);
  // The cache the recomputing layers share holds one layer kind's buffers at a time.
  for (size_t k = 0; k < caches.size(); ++k) {
    Cache& C = *caches[k];
    const bool shared = kind_union && k == 0 && (!backward || recompute.layers > 0);
    if (C.kind_union && !shared)
      DropArena(C.arena, CacheKindFields(C, 'L'), CacheKindFields(C, 'M'));
    C.kind_union = shared;
  }
  auto use_kind = [&](Cache& C, int64_t i) {
    return C.kind_union
               ? UseKind(C.arena, layers[i].kind, CacheKindFields(C, 'L'), CacheKindFields(C, 'M'))
               : absl::OkStatus();
  };
  // Layer inputs: forward only, two buffers in turn; training, all n + 1 or, offloading (see
  // Offload), the ring's slots for layers 0 .. n-1 and one buffer for the head's input.
  constexpr int64_t K = Offload::kSlots;
  const bool offload = backward && offload_inputs && n > K;
  const int64_t n_inputs = !backward ? 2 : offload ? 1 : n + 1;
  if (static_cast<int64_t>(layer_in.size()) != n_inputs) layer_in = std::vector<DevBuf>(n_inputs);
  for (DevBuf& t : layer_in) RETURN_IF_ERROR(Act(t, T, d));
  if (offload) {
    RETURN_IF_ERROR(off.EnsureHost((n - K) * T * d * kAb));
    for (DevBuf& t : off.slot) RETURN_IF_ERROR(Act(t, T, d));
  } else {
    off.ReleaseSlots();
  }
  auto in = [&](int64_t i) {
    if (!backward) return layer_in[i % 2].get();
    if (!offload) return layer_in[i].get();
    return i < n ? off.slot[i % K].get() : layer_in[0].get();
  };
  auto host_in = [&](int64_t i) { return At(off.host, i * T * d); };
  // Offloading: before input j is written, the copy of input j - K out of its slot is done;
  // once it is written, it goes to the host unless the backward finds it in its slot.
  auto slot_of = [&](int64_t i) { return static_cast<int>(i % K); };
  auto before_input = [&](int64_t j) -> absl::Status {
    if (offload && j >= K && j < n) return off.WaitCopied(stream, slot_of(j));
    return absl::OkStatus();
  };
  auto after_input = [&](int64_t j) -> absl::Status {
    if (!offload || j >= n - K) return absl::OkStatus();
    return off.CopyAfter(stream, slot_of(j), host_in(j), in(j), T * d * kAb,
                         cudaMemcpyDeviceToHost);
  };
  KC(kc::EmbeddingForward(B.ids.i32(), Wb(embed), in(0), T, d, kAct, stream));
  RETURN_IF_ERROR(after_input(0));
  // Each recomputing MLA layer keeps its attention output from this forward (KeptAttention).
  auto keeps = [&](int64_t i) { return backward && recompute.Layer(i) && layers[i].kind == 'M'; };
  if (!backward || recompute.layers <= 0) {
    kept.clear();
  } else if (static_cast<int64_t>(kept.size()) != n) {
    kept = std::vector<KeptAttention>(n);
  }
  for (int64_t i = 0; i < n; ++i) {
    Cache& C = *caches[recompute.CacheOf(i, n)];
    RETURN_IF_ERROR(use_kind(C, i));
    const bool swap = keeps(i);
    if (swap) kept[i].SwapInto(C);
    if (!swap && !kept.empty()) kept[i].Release();  // held by a step that recomputed layer i
    const bool ffn_kept = backward && !recompute.Layer(i);
    absl::Status st = before_input(i + 1);
    if (st.ok()) st = LayerForward(layers[i], C, in(i), in(i + 1), ffn_kept);
    if (swap) kept[i].SwapInto(C);  // back: kept[i] holds this layer's output
    RETURN_IF_ERROR(st);
    RETURN_IF_ERROR(after_input(i + 1));
  }
  if (!backward) {
    ASSIGN_OR_RETURN(LossStats s, HeadAndLoss(in(n), 0.0f, nullptr));
    queued();
    CUDA(cudaStreamSynchronize(stream));
    s.loss_sum = *loss_host;
    return s;
  }
  RETURN_IF_ERROR(Act(dx, T, d));
  ASSIGN_OR_RETURN(LossStats s, HeadAndLoss(in(n), grad_scale, dx.get()));
  for (int64_t i = n - 1; i >= 0; --i) {
    Cache& C = *caches[recompute.CacheOf(i, n)];
    RETURN_IF_ERROR(use_kind(C, i));
    const bool swap = keeps(i);
    if (swap) kept[i].SwapInto(C);
    absl::Status st;
    // Offloading: input i is back in its slot (see Offload).
    if (offload && i < n - K) st = off.WaitCopied(stream, slot_of(i));
    // The recomputed forward needs no output: it is the next layer's input, kept.
    const bool ffn_kept = !recompute.Layer(i);
    if (st.ok() && !ffn_kept)
      st = LayerForward(layers[i], C, in(i), nullptr, /*ffn_kept=*/false, swap);
    if (st.ok()) st = LayerBackward(layers[i], C, in(i), dx.get(), ffn_kept);
    if (swap) kept[i].SwapInto(C);
    RETURN_IF_ERROR(st);
    // Offloading: layer i was the last user of its slot; input i - K comes back into it.
    if (offload && i >= K)
      RETURN_IF_ERROR(off.CopyAfter(stream, slot_of(i), in(i - K), host_in(i - K), T * d * kAb,
                                    cudaMemcpyHostToDevice));
  }
  KC(kc::EmbeddingBackward(B.ids.i32(), dx.get(), G(embed), T, d, c.vocab, kAct, Ws(), stream));
  queued();
  CUDA(cudaStreamSynchronize(stream));
  s.loss_sum = *loss_host;
  return s;
}

absl::StatusOr<LossStats> CudaModel::ForwardBackward(const Batch& batch, float grad_scale,
                                                     Recompute recompute) {
  return impl_->Run(batch, nullptr, grad_scale, recompute, /*backward=*/true);
}

absl::StatusOr<LossStats> CudaModel::Forward(const Batch& batch) {
  return impl_->Run(batch, nullptr, 0.0f, Recompute::All(), /*backward=*/false);
}

namespace {
// Block rows as SetHeadBlockRows and SetFfnBlockRows take them: 0 (`zero`) or a positive multiple
// of 128.
absl::Status CheckBlockRows(const char* what, const char* zero, int64_t rows) {
  if (rows >= 0 && rows % 128 == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " block rows must be 0 (", zero,
                                                 ") or a positive multiple of 128, got ", rows));
}
}  // namespace

absl::Status CudaModel::SetHeadBlockRows(int64_t rows) {
  RETURN_IF_ERROR(CheckBlockRows("LM-head", "automatic", rows));
  impl_->head_block_rows = rows;
  return absl::OkStatus();
}

absl::Status CudaModel::SetFfnBlockRows(int64_t rows) {
  RETURN_IF_ERROR(CheckBlockRows("FFN", "the default", rows));
  impl_->ffn_block_rows = rows > 0 ? rows : kCudaFfnBlockRows;
  return absl::OkStatus();
}

void CudaModel::SetKindUnion(bool on) {
  Impl& I = *impl_;
  I.kind_union = on;
  if (on) return;
  I.DropArena(I.W.arena, I.WorkKindFields('L'), I.WorkKindFields('M'));
  for (auto& C : I.caches) {
    if (C->kind_union)
      I.DropArena(C->arena, I.CacheKindFields(*C, 'L'), I.CacheKindFields(*C, 'M'));
    C->kind_union = false;
  }
}

absl::Status CudaModel::SetOffloadInputs(bool on) {
  Impl& I = *impl_;
  if (on) {
    RETURN_IF_ERROR(I.off.Create());
  } else {
    CUDA(cudaStreamSynchronize(I.stream));
    I.off.ReleaseSlots();
    I.off.FreeHost();
  }
  I.offload_inputs = on;
  return absl::OkStatus();
}

namespace {
// A head-count override of the tests: >= 0 (0: the engine's rule).
absl::Status SetHeadCount(int64_t heads, const char* what, int64_t* out) {
  if (heads < 0)
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be >= 0 (0: automatic), got ", heads));
  *out = heads;
  return absl::OkStatus();
}
}  // namespace

absl::Status CudaModel::SetAttentionHeadsPerCall(int64_t heads) {
  return SetHeadCount(heads, "attention heads per call", &impl_->attention_heads_per_call);
}

absl::Status CudaModel::SetMlaGradHeadsPerGroup(int64_t heads) {
  return SetHeadCount(heads, "MLA gradient heads per group", &impl_->mla_grad_heads_per_group);
}

absl::Status CudaModel::Impl::AttentionBackward(const void* q, const void* k, const void* v,
                                                const void* o, const float* stats, const void* dout,
                                                void* dq, void* dk, void* dv,
                                                const std::vector<int32_t>& cu_host, float scale,
                                                kc::SdpaDims dims) {
  const int64_t H = dims.H, T = dims.T;
  const int64_t g = attention_heads_per_call > 0 ? LargestDivisorAtMost(H, attention_heads_per_call)
                                                 : CudaAttentionHeadsPerCall(T, H, dims.Dqk);
  dims.H = g;
  const int64_t n_seg = static_cast<int64_t>(cu_host.size()) - 1;
  for (int64_t h0 = 0; h0 < H; h0 += g) {
    KC(sdpa->Backward(At(q, h0 * dims.q.head_stride), At(k, h0 * dims.k.head_stride),
                      At(v, h0 * dims.v.head_stride), At(o, h0 * dims.out.head_stride),
                      stats + h0 * T, At(dout, h0 * dims.out.head_stride),
                      At(dq, h0 * dims.q.head_stride), At(dk, h0 * dims.k.head_stride),
                      At(dv, h0 * dims.v.head_stride), cu_host.data(), n_seg, scale, dims, kAct,
                      stream));
  }
  return absl::OkStatus();
}

absl::Status CudaModel::SetCp(const CpContext& cp) {
  Impl& I = *impl_;
  I.cp = cp;
  I.cp_device_buffers = cp.comm != nullptr && cp.comm->backend() == "nccl";
  return I.CheckCpContext();
}

absl::StatusOr<LossStats> CudaModel::ForwardBackward(const CpBatch& batch, float grad_scale,
                                                     Recompute recompute) {
  RETURN_IF_ERROR(impl_->CheckCpBatch(batch));
  const CpLayout* layout = batch.layout.cp > 1 ? &batch.layout : nullptr;
  return impl_->Run(batch.local, layout, grad_scale, recompute, /*backward=*/true);
}

absl::StatusOr<LossStats> CudaModel::Forward(const CpBatch& batch) {
  RETURN_IF_ERROR(impl_->CheckCpBatch(batch));
  const CpLayout* layout = batch.layout.cp > 1 ? &batch.layout : nullptr;
  return impl_->Run(batch.local, layout, 0.0f, Recompute::All(), /*backward=*/false);
}

}  // namespace spindle
