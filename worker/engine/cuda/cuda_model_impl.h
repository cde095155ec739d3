// CudaModel's internals, shared by the files that implement it (cuda_model.cc: setup, the
// parameters, optimizer and memory; cuda_model_run.cc: the batch upload and the whole model's
// passes; cuda_model_layers.cc: one layer of each kind; cuda_model_cp.cc: context parallelism's
// All2All and AllGather modes; cuda_model_ring.cc: MLA's Ring mode; cuda_moe_ffn.cc: the
// mixture-of-experts FFN).
// Nothing outside those files includes it; the design notes are cuda_model.cc's.
#pragma once

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
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lightning.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sdpa.h"
#include "worker/engine/cp/cp_ulysses.h"
#include "worker/engine/cuda/cuda_model.h"
#include "worker/engine/layer_passes.h"
#include "worker/engine/moe/moe_exchange.h"
#include "worker/engine/moe/moe_ffn.h"

namespace spindle {

namespace kc = kernels::cuda;
using KDType = kc::DType;

namespace cuda_model_detail {


constexpr KDType kAct = KDType::kBFloat16;  // activations and the weights' working copy
constexpr int64_t kAb = 2;                  // bytes per activation element
// 16-byte aligned offset (in fp32 elements) of each local chunk's [H, chunk] attention stats.
inline int64_t StatsSlot(int64_t H, int64_t ch) { return (H * ch + 3) / 4 * 4; }

inline absl::Status FromKernel(const kc::Status& s) {
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

inline absl::Status FromCuda(cudaError_t e, const char* expr) {
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

// One FP8 GEMM input [rows, cols] (train.precision fp8) in a block of Bytes(rows * cols) at base:
// its scalars (the inverse scale, which the GEMM reads, 16-byte aligned at the start; the amax;
// the scale), its codes, and their transpose [cols, rows] (the backward's K-contiguous layout).
// A linear weight's copy (in the model's fixed memory) and an activation's (Fp8Act) alike. An
// activation whose row-major codes only its forward GEMMs read keeps just the transpose in its
// block (TransposeBytes) and has its codes in shared scratch (`rows_at`).
struct Fp8Block {
  static constexpr int64_t kHeader = 256;
  static int64_t Padded(int64_t n) { return (n + 255) / 256 * 256; }
  static int64_t Bytes(int64_t n) { return kHeader + 2 * Padded(n); }
  static int64_t TransposeBytes(int64_t n) { return kHeader + Padded(n); }
  void* base = nullptr;  // null: none (a weight that is not an FP8 linear)
  int64_t rows = 0, cols = 0;
  KDType format = KDType::kFp8E4M3;
  void* rows_at = nullptr;  // the row-major codes when not in the block

  void* codes() const {
    return rows_at != nullptr ? rows_at : static_cast<uint8_t*>(base) + kHeader;
  }
  void* codes_t() const {
    return static_cast<uint8_t*>(base) + kHeader + (rows_at != nullptr ? 0 : Padded(rows * cols));
  }
  const float* inverse_scale() const { return static_cast<float*>(base); }
  kc::Fp8Output Output() const {
    float* s = static_cast<float*>(base);
    return {format, codes(), codes_t(), s + 1, s + 2, s};
  }
};

// The FP8 copies of one MoE layer's stacked expert weights [experts, rows, cols]
// (train.precision fp8), in the model's fixed memory: one scale per expert (expert g's inverse
// scale, amax and scale at scalars() + 4 g, 16-byte aligned), the codes [experts, rows, cols] for
// the forward and each expert's transpose [experts, cols, rows] for the input gradient.
struct Fp8ExpertBlock {
  void* base = nullptr;  // null: none
  int64_t experts = 0, rows = 0, cols = 0;

  static int64_t Bytes(int64_t experts, int64_t numel) {
    return Fp8Block::Padded(experts * 16) + 2 * Fp8Block::Padded(numel);
  }
  float* scalars() const { return static_cast<float*>(base); }
  uint8_t* codes() const { return static_cast<uint8_t*>(base) + Fp8Block::Padded(experts * 16); }
  uint8_t* codes_t() const { return codes() + Fp8Block::Padded(experts * rows * cols); }
  kc::Fp8Experts Forward() const { return {codes(), KDType::kFp8E4M3, scalars(), 4}; }
  kc::Fp8Experts Transposed() const { return {codes_t(), KDType::kFp8E4M3, scalars(), 4}; }
  // One cast per expert, from the master [experts, rows, cols].
  void AddCasts(const float* master, std::vector<kc::Fp8WeightCast>* t) const {
    const int64_t n = rows * cols;
    for (int64_t g = 0; g < experts; ++g)
      t->push_back({master + g * n, rows, cols,
                    kc::Fp8Output{KDType::kFp8E4M3, codes() + g * n, codes_t() + g * n,
                                  scalars() + 4 * g + 1, scalars() + 4 * g + 2,
                                  scalars() + 4 * g}});
  }
};

// An activation's Fp8Block in a block of the caching allocator (grown on demand); with
// `row_scratch`, its row-major codes go there (the block holds the transpose only).
struct Fp8Act : Fp8Block {
  DevBuf mem;
  absl::Status Ensure(kc::CachingAllocator* a, int64_t r, int64_t c, KDType f,
                      void* row_scratch = nullptr) {
    rows = r, cols = c, format = f, rows_at = row_scratch;
    RETURN_IF_ERROR(mem.Ensure(a, row_scratch != nullptr ? TransposeBytes(r * c) : Bytes(r * c)));
    base = mem.get();
    return absl::OkStatus();
  }
};

// One layer's parameter indices (into the host ParamSet) and its decays on the device.
struct LayerIdx {
  char kind = 'L';
  int attn_norm = -1, ffn_norm = -1, w1 = -1, w2 = -1, w3 = -1;
  int qkv = -1, gate = -1, out = -1, q_norm = -1, k_norm = -1, out_norm = -1;
  int q = -1, q_a = -1, q_a_norm = -1, q_b = -1, kv_a = -1, kv_norm = -1, kv_b = -1, mo = -1;
  float* log_decay = nullptr;  // [H] fp32, device (Lightning)
  int index = 0;
  bool moe = false;  // the MoE FFN (moe_p) in place of w1, w2, w3
  MoeLayerParams moe_p;
};

// The MoE FFN's forward state of one layer (cuda_moe_ffn.cc), kept for its backward: the router's
// input in fp32, logits, choices, weights and lse; the exchange's plan (host) and its row maps on
// the device; the experts' rows (inputs, SwiGLU parts, outputs), the outputs back in send order
// (ep > 1), and the shared expert's hidden layer.
struct MoeDevCache {
  DevBuf h32, logits, idx, weights, lse;
  std::vector<int32_t> idx_host;
  MoeDispatchPlan plan;
  DevBuf expert_src, pair_row, send_token, recv_expert_row;  // the plan's maps, int32
  DevBuf xe, g, u, a, ye, returned, sg, su, sa;
  // fp8: the experts' inputs and SwiGLU outputs as FP8 codes, both layouts (the forward's GEMMs
  // read the codes, the weight gradients their transposes); no bf16 xe (at ep = 1) nor a.
  Fp8Act q_xe, q_a;
};

// The MoE FFN's scratch, shared by the layers: the exchange's send and receive rows, the gradients
// of the experts' rows and of the shared expert, the weights' and logits' gradients, and an fp32
// accumulator of the input gradient.
struct MoeDevWork {
  DevBuf send, recv, y, dye, da, dg, du, dxe, dw, dlogits, acc, sda, sdg, sdu;
  DevBuf group_counts, group_offsets, group_ws;  // MoeGroupRows's (ep = 1: grouped on the device)
  DevBuf lse_sq_ws;                              // SquaredNorm's workspace
  Fp8Act q_dye, q_dg, q_du;                      // fp8: the experts' output gradients (E5M2)
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
  // CP (MLA AllGather, Ring and hybrid): latent rows [c_n | rotated k_r], [rows, kv + rd]: the
  // whole sequence's in stream order (AllGather), this rank's (Ring, the latent payload's own
  // block) or its Ulysses group's (hybrid).
  DevBuf ag_lat;
  // CP (MLA Ring and hybrid, the kv payload): the ring's own block, the keys and values of this
  // rank's tokens (Ring) or its group's (hybrid) for the heads it computes: [rows, Hh qk], then
  // [rows, Hh v_head].
  DevBuf ring_kv;
  // FP8 (train.precision fp8): the codes of every FP8 GEMM input, written by its producer: the
  // attention norm's output h, the Lightning group norm + gate's y, the FFN norm's h2, SwiGLU's a
  // and MLA's attention output O. Under FP8 the bf16 y, h2 and a are not written (no kernel but
  // their GEMMs reads them); h still is (MLA's bf16 q reads it), and O is (cuDNN's backward).
  Fp8Act q_h, q_y, q_h2, q_a, q_O;
  // A recomputing layer's FP8 amaxes by Fp8Site while its kept buffers are swapped in (else none).
  DevBuf fp8_amax;
  // The cache the recomputing layers share (kind_union) holds one layer kind's own buffers at a
  // time, as views of one arena (KindArena); the others own theirs.
  bool kind_union = false;
  KindArena arena;
  MoeDevCache moe;
};

// Recompute: what a recomputing layer keeps from its first forward for its backward, swapped into
// the layer's Cache while either pass runs. An MLA layer keeps its attention's output and
// statistics (and under CP All2All the head-split output), so that the recomputed forward skips
// the quadratic attention. Under FP8 every recomputing layer keeps its FP8 producers' row
// statistics (rstd1, rstd2 and Lightning's rstd_o) and amaxes (fp8_amax, one per Fp8Site), so that
// its recomputed forward quantizes in one pass: the same inputs give the same values.
struct KeptForRecompute {
  DevBuf O, stats, cp_out, rstd1, rstd2, rstd_o, fp8_amax;
  void SwapInto(Cache& C) {
    O.Swap(C.O);
    stats.Swap(C.stats);
    cp_out.Swap(C.cp_out);
    rstd1.Swap(C.rstd1);
    rstd2.Swap(C.rstd2);
    rstd_o.Swap(C.rstd_o);
    fp8_amax.Swap(C.fp8_amax);
  }
  void Release() {
    for (DevBuf* b : {&O, &stats, &cp_out, &rstd1, &rstd2, &rstd_o, &fp8_amax}) b->Release();
  }
};

// The FP8 producers of a layer, whose amaxes a recomputing layer keeps (KeptForRecompute): the
// attention norm (q_h), the group norm + gate (q_y), the FFN norm (q_h2), SwiGLU (q_a) and MLA's
// attention output (q_O).
enum Fp8Site { kSiteH, kSiteY, kSiteH2, kSiteA, kSiteO, kFp8Sites };

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
  // CP (MLA Ring) scratch, sized by Upload: the two latent blocks in flight (bf16 [T, kv + rd]),
  // the gradient accumulators sent and received and a step's share (fp32), and the gradient of
  // this rank's own block (fp32). The key blocks' buffers are MLA AllGather's (ag_K ...), and
  // ag_acc holds both local chunks' fp32 running outputs.
  DevBuf ring_block[2], ring_acc[2], ring_share, ring_own;
  // The layer-kind gradients (Lightning: dy, dgate, dqkv; MLA: dO through dqa) hold one kind at a
  // time (KindArena).
  KindArena arena;
  // FP8: an output gradient's E5M2 codes, for the two GEMMs of one linear's backward; and the
  // row-major codes of the activation being produced (Cache's q_* keep only their transposes):
  // read by the forward GEMMs right after their producer, and by nothing later but a recomputing
  // layer's FFN, whose backward runs first after the recomputed forward wrote them.
  Fp8Act q_dy;
  DevBuf fp8_rows;
  // FP8: the output gradients' amaxes (fp32, by GradAmax), each reduced by the kernel that writes
  // the gradient and read by its quantization (BwdQ); allocated for the whole backward.
  enum GradAmax { kAmaxDg, kAmaxDu, kAmaxDx, kAmaxDgate, kAmaxDqkv, kGradAmaxes };
  DevBuf grad_amax;
  float* Amax(GradAmax which) { return grad_amax.f32() + which; }
  MoeDevWork moe;
};

// One level of a CP split on the device: the zigzag of `cp` ranks (this one `rank`) over which
// Lightning's chunk states are gathered and MLA's ring runs. The CP group itself, or under the
// hybrid modes the ring of Ulysses groups, each group's tokens one rank's share (cp_groups.h).
struct CpLevel {
  const CpLayout* layout = nullptr;            // the caller's, valid while a pass runs
  int64_t T = 0, cp = 1, rank = 0, chunk = 0;  // local tokens (two chunks), chunk size
  // Per local slot (chunk ChunkOf(rank, slot)): its document starts relative to its first token
  // (host and device), its chunk index, whether its first token continues an earlier document
  // and, if so, the tokens before its first start, and the first row of the level's stream its
  // queries see (the start of that document, else the chunk's own first token); and the 2cp
  // chunks' b_c flags and lengths for the state scans (device).
  std::vector<int32_t> piece_cu_host[2], chunk_has_start_host, chunk_len_host;
  DevBuf piece_cu[2], chunk_has_start, chunk_len;
  int64_t slot_chunk[2] = {0, 0}, first_segment[2] = {0, 0}, key_begin[2] = {0, 0};
  bool continues[2] = {false, false};
};

// The CP exchanges' copies on the device (cp/cp_copies.h): CopyRows launches and async copies on
// the engine's stream (the one `stream` points to when they run); Fence synchronises it.
class DeviceCopies final : public CpCopies {
 public:
  explicit DeviceCopies(const cudaStream_t* stream) : stream_(stream) {}
  int64_t elem_bytes() const override { return kAb; }
  absl::Status CopyRows(void* dst, int64_t dst_token, int64_t dst_head, const void* src,
                        int64_t src_token, int64_t src_head, int64_t T, int64_t heads,
                        int64_t width) override;
  absl::Status Copy(void* dst, const void* src, int64_t bytes) override;
  absl::Status Fence() override;

 private:
  const cudaStream_t* stream_;
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
  // Under CP: the CP group's level and its all-to-all over every rank; under the hybrid modes
  // also the level across the Ulysses groups and the exchange inside this rank's group.
  CpLevel lv, group_lv;
  UlyssesComm whole, ulysses;  // the groups' exchanges (cp/cp_ulysses.h)
};

// MLA's attention views over T tokens and H heads (all of them by default): Q and K [T, H, qk], V
// inside kv_b's output, O [T, H, vd].
inline kc::SdpaDims MlaDims(const ModelConfig& c, int64_t T, int64_t H = 0) {
  const MlaConfig& m = c.mla;
  if (H == 0) H = c.n_heads;
  const int64_t qk = m.qk_nope_dim + m.qk_rope_dim, vd = m.v_head_dim;
  const int64_t kvw = m.qk_nope_dim + vd;  // one head's row of kv_b's output
  kc::SdpaDims s;
  s.T = T, s.H = H, s.Dqk = qk, s.Dv = vd;
  s.q = {H * qk, qk};
  s.k = {H * qk, qk};
  s.v = {H * kvw, kvw};  // a view into kv_b's output, after each head's k_nope
  s.out = {H * vd, vd};
  return s;
}

}  // namespace cuda_model_detail

// The files of CudaModel name these unqualified.
using namespace cuda_model_detail;  // NOLINT(build/namespaces)


struct CudaModel::Impl {
  ModelConfig c;
  std::unique_ptr<Model> host;  // the CPU model: parameter layout, initial values, host mirror
  int device = 0;
  cudaStream_t stream = nullptr;
  DeviceCopies copies{&stream};  // the CP exchanges' copies on `stream`
  std::unique_ptr<kc::Blas> blas;
  std::unique_ptr<kc::Sdpa> sdpa;
  kc::CachingAllocator alloc;
  // Fixed device buffers (cudaMalloc): fp32 master, gradients, moments; bf16 working copy `w`,
  // parameter i at element w_at[i] (-1: none; under fp8 the FP8 linears, whose GEMMs read fp8_w,
  // have no bf16 copy), w_numel elements (LayOutWorkingCopy).
  float *p = nullptr, *g = nullptr, *m = nullptr, *v = nullptr;
  void* w = nullptr;
  std::vector<int64_t> w_at;
  int64_t w_numel = 0;
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
  std::vector<KeptForRecompute> kept;  // per layer; each recomputing layer fills its own
  std::vector<DevBuf> layer_in;  // [n + 1][T, d] bf16 residual stream
  DevBuf hf, rstd_f, dhf, logits, row_loss, dx;
  Work W;
  BatchDev B;
  // Context parallelism: the context of SetCp, whose communicators take device buffers (NCCL's as
  // they are; a host communicator's through a StagedCommunicator in `staged`).
  CpContext cp;
  std::vector<std::unique_ptr<Communicator>> staged;
  // train.precision fp8 (SetPrecision): the blocks' linears but MLA's per-head ones (q or q_b,
  // kv_b; worker/engine/numerics.h) multiply FP8 codes; fp8_w holds each one's weight copy (by
  // parameter index), all in fp8_w_mem.
  bool fp8 = false;
  bool fp8_fast_forward = true;  // see SetFp8FastForward
  float z_loss = 0.0f;           // train.z_loss (SetZLoss)
  std::vector<Fp8Block> fp8_w;
  std::vector<Fp8ExpertBlock> fp8_e;  // by parameter index: the MoE layers' expert weights
  void* fp8_w_mem = nullptr;
  int64_t fp8_fixed_bytes = 0;
  // Mixture of experts (cuda_moe_ffn.cc): the experts' grouped GEMMs, the row gathers of the
  // token exchange (moe/moe_exchange.h) on this stream, the EP group (null: ep = 1; a host
  // communicator's through `staged`), a training step's statistics by layer and its z-loss scale.
  std::unique_ptr<kc::GroupedGemm> moe_gemm;
  std::unique_ptr<MoeRows> moe_rows;
  Communicator* ep = nullptr;
  std::unique_ptr<Communicator> ep_staged;
  std::vector<MoeLayerStats> moe_stats;
  float zloss_scale = 0.0f;
  bool moe_counting = false;  // a training pass: the first forwards count the choices
  // ep = 1: the group sizes of MoeGroupRows (pinned, kMoeMaxExperts entries) and the event after
  // their copy, which the host waits on while the shared expert runs.
  int64_t* moe_counts_host = nullptr;
  cudaEvent_t moe_counts_ready = nullptr;
  // The step's router statistics on the device: each counting forward's sum of lse^2 in a slot
  // of moe_lse_sq (doubles), its layer in moe_lse_sq_layer; read by FinishMoeStep.
  DevBuf moe_lse_sq;
  std::vector<int> moe_lse_sq_layer;

  // Every activation and scratch buffer back to the allocator (the next step allocates afresh).
  void ReleaseActivations() {
    caches.clear();
    kept.clear();
    layer_in.clear();
    off.ReleaseSlots();
    for (DevBuf* b : {&hf, &rstd_f, &dhf, &logits, &row_loss, &dx}) b->Release();
    for (DevBuf* b : {&W.dh,
                      &W.da,
                      &W.dg,
                      &W.du,
                      &W.dy,
                      &W.dgate,
                      &W.dqkv,
                      &W.dO,
                      &W.dQ,
                      &W.dK,
                      &W.dkvb,
                      &W.dc_n,
                      &W.dc,
                      &W.dkva,
                      &W.dqa_n,
                      &W.dqa,
                      &W.ws,
                      &W.cp_block,
                      &W.cp_tmp,
                      &W.gQ,
                      &W.gK,
                      &W.gkvb,
                      &W.sum_lat,
                      &W.sum_q,
                      &W.ag_send,
                      &W.ag_recv,
                      &W.ag_K,
                      &W.ag_kvb,
                      &W.ag_dK,
                      &W.ag_dkvb,
                      &W.ag_dlat,
                      &W.ag_o,
                      &W.ag_stats,
                      &W.ag_acc,
                      &W.ag_dq,
                      &W.ring_block[0],
                      &W.ring_block[1],
                      &W.ring_acc[0],
                      &W.ring_acc[1],
                      &W.ring_share,
                      &W.ring_own,
                      &W.arena.mem,
                      &W.q_dy.mem,
                      &W.fp8_rows,
                      &W.grad_amax})
      b->Release();
    MoeDevWork& mw = W.moe;
    for (DevBuf* b : {&mw.send, &mw.recv, &mw.y, &mw.dye, &mw.da, &mw.dg, &mw.du, &mw.dxe, &mw.dw,
                      &mw.dlogits, &mw.acc, &mw.sda, &mw.sdg, &mw.sdu})
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
                    static_cast<void*>(log_decays), fp8_w_mem})
      if (q) cudaFree(q);
    if (loss_host) cudaFreeHost(loss_host);
    if (moe_counts_host) cudaFreeHost(moe_counts_host);
    if (moe_counts_ready) cudaEventDestroy(moe_counts_ready);
    if (stream) cudaStreamDestroy(stream);
  }

  ParamSet& P() { return host->params(); }
  // Parameter i's bf16 copy; null for an FP8 linear under fp8 (a kernel handed it faults loudly).
  const void* Wb(int i) { return w_at[i] >= 0 ? At(w, w_at[i]) : nullptr; }
  // (Re)allocates w with a copy of every parameter but those in `none`, 128-byte aligned, and
  // fills it from the fp32 masters.
  absl::Status LayOutWorkingCopy(const std::vector<int>& none);
  absl::Status FillWorkingCopy();  // w's copies from the fp32 masters
  float* G(int i) { return g + P().info(i).offset; }
  float* Master(int i) { return p + P().info(i).offset; }

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
  // A cached FP8 activation [rows, cols] (E4M3) about to be produced: its transpose in q's own
  // block, its row-major codes in W.fp8_rows. W.fp8_rows is sized once for the widest such input
  // (so it never moves within a step).
  absl::Status QAct(Fp8Act& q, int64_t rows, int64_t cols) {
    const int64_t widest = std::max({c.d_model, c.ffn_dim, c.n_heads * c.mla.v_head_dim});
    RETURN_IF_ERROR(W.fp8_rows.Ensure(&alloc, std::max(rows * cols, B.T * widest)));
    return q.Ensure(&alloc, rows, cols, KDType::kFp8E4M3, W.fp8_rows.get());
  }
  // Where producer `site` writes q's codes: both layouts, or (transposes false: a forward that no
  // backward reads, that of a recomputing layer or a forward-only pass) the row-major codes the
  // forward's GEMMs read alone; its amax in a recomputing layer's kept slot (C.fp8_amax) if any.
  static kc::Fp8Output QOut(const Fp8Act& q, bool transposes, const Cache& C, Fp8Site site) {
    kc::Fp8Output o = q.Output();
    if (!transposes) o.codes_t = nullptr;
    if (C.fp8_amax.get() != nullptr) o.amax = C.fp8_amax.f32() + site;
    return o;
  }
  // Under FP8, a recomputing layer's recomputed forward (x_out null) with its first forward's
  // statistics and amaxes in C: the producers run their second pass alone.
  bool Requantizes(const Cache& C, const void* x_out) const {
    return fp8 && x_out == nullptr && C.fp8_amax.get() != nullptr;
  }

  // The same on FP8 codes (fp8): y[T, out] (+)= x W^T from x's codes and weight w's copy.
  absl::Status FwdQ(const Fp8Block& x, int w, void* y, int64_t T, int64_t in, int64_t out, bool acc,
                    const void* residual = nullptr) {
    kc::GemmArgs a;
    a.trans_b = true;
    a.M = T, a.N = out, a.K = in, a.beta = acc ? 1.0f : 0.0f;
    a.A = x.codes(), a.lda = in, a.B = fp8_w[w].codes(), a.ldb = in, a.C = y, a.ldc = out;
    a.C_in = residual;
    a.ab_type = x.format, a.b_type = KDType::kFp8E4M3;
    a.a_scale = x.inverse_scale(), a.b_scale = fp8_w[w].inverse_scale();
    a.fast_accum = fp8_fast_forward;
    return FromKernel(blas->Gemm(a, stream));
  }
  // dy (bf16 [T, out]) quantized to E5M2 with its transpose (W.q_dy), then dx (+)= dy W (dx
  // nullable) from the weight's transposed codes and dW += dy^T x from both transposes.
  // dy_amax (nullable): max |dy| already reduced by dy's producer (a device float), which spares
  // the quantization its own pass over dy.
  absl::Status BwdQ(const Fp8Block& x, int w, const void* dy, void* dx, float* dW, int64_t T,
                    int64_t in, int64_t out, bool acc_dx, float* dy_amax = nullptr) {
    Fp8Act& q = W.q_dy;
    RETURN_IF_ERROR(q.Ensure(&alloc, T, out, KDType::kFp8E5M2));
    if (dy_amax != nullptr) {
      kc::Fp8Output o = q.Output();
      o.amax = dy_amax;
      KC(kc::Fp8QuantizeFromAmax(dy, T, out, kAct, o, stream));
    } else {
      KC(kc::Fp8Quantize(dy, T, out, kAct, q.Output(), stream));
    }
    kc::GemmArgs a;
    a.trans_b = true;
    a.ab_type = KDType::kFp8E5M2, a.b_type = KDType::kFp8E4M3, a.a_scale = q.inverse_scale();
    if (dx) {
      a.M = T, a.N = in, a.K = out, a.beta = acc_dx ? 1.0f : 0.0f;
      a.A = q.codes(), a.lda = out, a.B = fp8_w[w].codes_t(), a.ldb = out, a.C = dx, a.ldc = in;
      a.b_scale = fp8_w[w].inverse_scale();
      KC(blas->Gemm(a, stream));
    }
    a.M = out, a.N = in, a.K = T, a.beta = 1.0f;
    a.A = q.codes_t(), a.lda = T, a.B = x.codes_t(), a.ldb = T, a.C = dW, a.ldc = in;
    a.c_type = KDType::kFloat32, a.b_type = x.format, a.b_scale = x.inverse_scale();
    return FromKernel(blas->Gemm(a, stream));
  }
  // FP8: where the kernel writing an output gradient reduces its amax for the quantization that
  // reads it (Work::GradAmax; kAmaxDx: the residual stream's dx, written by each RMSNorm backward,
  // read by w2's and then the attention output projection's); null without FP8.
  float* GradAmax(Work::GradAmax which) { return fp8 ? W.Amax(which) : nullptr; }
  // Casts every FP8 linear's master into its copy (fp8; after each update of the masters).
  absl::Status CastFp8Weights();
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
  // its own (KeptForRecompute).
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
  // cpb: null (or cp = 1) for a whole sequence; else b is cpb->local, this rank's zigzag share.
  absl::Status Upload(const Batch& b, const CpBatch* cpb);
  // x_out null: no output, only what the backward reads. ffn_kept: the FFN's [T, F] activations
  // stay in C for the backward (a layer that keeps its cache); otherwise the FFN runs in blocks
  // (FfnForward) and the backward recomputes them. attention_kept: the MLA attention's output and
  // statistics are already in C (see KeptForRecompute); only what its backward reads besides them
  // is computed.
  absl::Status LayerForward(const LayerIdx& L, Cache& C, const void* x_in, void* x_out,
                            bool ffn_kept, bool attention_kept = false);
  absl::Status LayerBackward(const LayerIdx& L, Cache& C, const void* x_in, void* dx,
                             bool ffn_kept);
  // transposes: see QOut; requantize: see Requantizes.
  absl::Status FfnHidden(const LayerIdx& L, Cache& C, bool transposes, bool requantize,
                         const void* h, void* g, void* u, void* a, int64_t n);
  absl::Status FfnForward(const LayerIdx& L, Cache& C, void* x_out, bool ffn_kept);
  absl::Status FfnBackward(const LayerIdx& L, Cache& C, void* dx, bool ffn_kept);
  // The MoE FFN (DESIGN.md section 2; the CPU model's moe/moe_ffn.h, with the same roundings):
  // from C.h2, y (nullable) = MoE(h2), its state in C.moe; `stats` (nullable) takes the choices.
  absl::Status MoeForward(const LayerIdx& L, Cache& C, void* y, MoeLayerStats* stats);
  // From dy, the gradient of y: W.dh (overwritten) and the parameter gradients.
  absl::Status MoeBackward(const LayerIdx& L, Cache& C, const void* dy);
  // fp8: the experts' backward from X.dye (the combine's backward, its amax in X.q_dye at ep = 1)
  // to X.dxe and the experts' weight gradients, on their FP8 codes.
  absl::Status MoeExpertsBackwardFp8(const LayerIdx& L, Cache& C);
  // ep = 1: groups the router's choices C.moe.idx by expert on the device (C.moe.pair_row,
  // expert_src), enqueues `overlap` (the shared expert), then waits only for the group sizes and
  // fills C.moe.plan's counts and offsets (its row maps stay on the device).
  absl::Status MoeGroupOnDevice(Cache& C, int64_t align, const std::function<void()>& overlap);
  // A counting forward's sum of lse^2 into the step's next slot (moe_lse_sq).
  absl::Status MoeCountLseSq(const LayerIdx& L, const float* lse, int64_t T);
  // The slots so far into moe_stats (syncs the stream) and none left.
  absl::Status MoeDrainLseSq();
  absl::Status LightningForward(const LayerIdx& L, Cache& C, bool transposes, bool requantize);
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
  absl::StatusOr<LossStats> Run(const Batch& b, const CpBatch* cpb, float grad_scale,
                                Recompute recompute, bool backward);

  // ---- Context parallelism: the Ulysses exchanges (All2All, and the hybrid modes' groups) ----
  absl::Status CheckCpContext() const;
  absl::Status CheckCpBatch(const CpBatch& b) const;
  // A level's host and device description from its local tokens and layout (Upload).
  absl::Status SetLevel(CpLevel& V, const Batch& local, const CpLayout& L);
  // The Ulysses steps (cp/cp_ulysses.h) on this engine's buffers and T local tokens:
  // local views -> W.cp_block (block j: [T][the views' heads of member j side by side]);
  absl::Status PackByHeads(const UlyssesComm& g, const std::vector<UlyssesView>& views) {
    return UlyssesPackByHeads(copies, B.T, c.n_heads, g.members, views, W.cp_block.get());
  }
  // recv's blocks [j0, j1) -> the local views, block j0's first head at the views' head 0;
  absl::Status UnpackToTokens(const UlyssesComm& g, const void* recv,
                              const std::vector<UlyssesView>& views, int64_t j0 = 0,
                              int64_t j1 = -1) {
    return UlyssesUnpackToTokens(copies, recv, B.T, c.n_heads, g.members, views, j0, j1);
  }
  // rows of `width` elements of `elem` bytes, run by run, between member blocks and group rows;
  absl::Status CopyRuns(const UlyssesComm& g, const void* src, bool src_grouped, void* dst,
                        bool dst_grouped, int64_t width, int64_t elem = kAb) {
    return UlyssesCopyRuns(copies, g, B.T, src, src_grouped, dst, dst_grouped, width * elem);
  }
  // the group's all-to-all from the member blocks `send` into `full` [members T, width] in the
  // group's row order, or back (distinct send and receive memory).
  absl::Status ExchangeToGroup(const UlyssesComm& g, const void* send, void* full, int64_t width,
                               CommLayer layer) {
    return UlyssesExchange(copies, g, B.T, send, false, full, true, width * kAb, layer);
  }
  absl::Status ExchangeFromGroup(const UlyssesComm& g, const void* full, void* recv, int64_t width,
                                 CommLayer layer) {
    return UlyssesExchange(copies, g, B.T, full, true, recv, false, width * kAb, layer);
  }
  absl::Status LightningCoreForward(const LayerIdx& L, Cache& C);
  absl::Status LightningCoreBackward(const LayerIdx& L, Cache& C);
  // ---- Context parallelism (Lightning AllGather and hybrid: DESIGN.md section 3) ----
  bool LightningAllGather() const { return B.cp > 1 && cp.lightning_mode == CpMode::kAllGather; }
  bool LightningHybrid() const { return B.cp > 1 && cp.lightning_mode == CpMode::kHybrid; }
  // send: this rank's two [H, Dh, Dh] fp32 blocks -> W.cp_state_stream: the level's 2cp in stream
  // order, gathered over `comm` (the level's).
  absl::Status GatherStates(const CpLevel& V, Communicator& comm, const float* send, int64_t H);
  // The AllGather core on level V: q | k | v rows [V.T, 3 H Dh] at qkv for H heads of decays
  // log_decay; out [V.T, H Dh] overwritten; P [2, H, Dh, Dh] receives the local chunks' carry-ins.
  absl::Status LightningStatesForward(const CpLevel& V, Communicator& comm, const void* qkv,
                                      int64_t H, const float* log_decay, void* out, float* P);
  // Its backward from dout [V.T, H Dh]: dqkv [V.T, 3 H Dh] overwritten.
  absl::Status LightningStatesBackward(const CpLevel& V, Communicator& comm, const void* qkv,
                                       int64_t H, const float* log_decay, const float* P,
                                       const void* dout, void* dqkv);
  absl::Status LightningAllGatherForward(const LayerIdx& L, Cache& C);
  absl::Status LightningAllGatherBackward(const LayerIdx& L, Cache& C);
  // Hybrid: q, k, v to this rank's Ulysses group's tokens for its H/u heads (C.cp_full), the
  // AllGather core across the groups, outputs back (C.o); the backward mirrors it into W.dqkv.
  absl::Status LightningHybridForward(const LayerIdx& L, Cache& C);
  absl::Status LightningHybridBackward(const LayerIdx& L, Cache& C);
  absl::Status MlaCoreForward(Cache& C, bool attention_kept);
  // The gradients stay in C.cp_full, rank block by rank block (MlaUnpackGrads).
  absl::Status MlaCoreBackward(Cache& C);
  // Rank blocks [j0, j1) of the received MLA core gradients -> W.dQ, W.dK and dkvb's V columns,
  // `Hg` heads wide.
  absl::Status MlaUnpackGrads(const void* recv, int64_t Hg, int64_t j0, int64_t j1);
  // ---- Context parallelism (MLA AllGather: DESIGN.md section 3) ----
  bool MlaAllGather() const { return B.cp > 1 && cp.mla_mode == CpMode::kAllGather; }
  // Collectives of the CP group on device buffers, once the stream's work is done.
  absl::Status GatherDevice(const void* send, int64_t n, CommType type, void* recv,
                            CommLayer layer);
  absl::Status ReduceScatterDevice(const float* send, int64_t n, float* recv, CommLayer layer);
  // n latent rows [c_n | rotated k_r] (`lat`, kv + rd apart) -> W.ag_K (keys [k_nope | k_r] of
  // every head) and W.ag_kvb (kv_b's output: k_nope and V of every head), from their first row.
  absl::Status MlaBuildKeysFrom(const LayerIdx& L, const void* lat, int64_t n);
  // The same for heads [h0, h0 + Hh) (keys and kv_b's output Hh heads wide).
  absl::Status MlaBuildKeysFrom(const LayerIdx& L, const void* lat, int64_t n, int64_t h0,
                                int64_t Hh);
  // The same from c_n and the rotated k_r in rows of their own (`ldc`, `ldk` apart).
  absl::Status MlaBuildKeysFrom(const LayerIdx& L, const void* c_n, int64_t ldc, const void* k_r,
                                int64_t ldk, int64_t n, int64_t h0, int64_t Hh);
  // The same from stream rows [a, b) of the gathered latent (C.ag_lat).
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
  // ---- Context parallelism (MLA Ring and hybrid: DESIGN.md section 3; the loop is
  // cp/cp_ring.h's) ----
  bool MlaRing() const { return B.cp > 1 && cp.mla_mode == CpMode::kRing; }
  bool MlaHybrid() const { return B.cp > 1 && cp.mla_mode == CpMode::kHybrid; }
  // Whether MLA rebuilds its keys and values from latent rows per key block (AllGather, Ring,
  // hybrid) rather than keeping them for the whole local sequence.
  bool MlaLatentKeys() const { return MlaAllGather() || MlaRing() || MlaHybrid(); }
  // Whether MLA's ring passes keys and values (else the latent rows): CpContext::mla_payload.
  bool MlaRingKv() const { return cp.mla_payload == MlaRingPayload::kKv; }
  // The kv payload's block: the keys and values of n tokens for heads [h0, h0 + Hh), rebuilt from
  // their c_n and rotated k_r (rows `ldc`, `ldk` apart) key block by key block into `block`
  // ([n, Hh qk] then [n, Hh v_head]).
  absl::Status MlaKvBlock(const LayerIdx& L, const void* c_n, int64_t ldc, const void* k_r,
                          int64_t ldk, int64_t n, int64_t h0, int64_t Hh, void* block);
  // The gradient of such a block (fp32, the same layout) back through kv_b: dW_kv_b's rows of
  // those heads (accumulated) and the tokens' latent gradients into `lat` ([n, kv + rd] of
  // `lat_type`, overwritten); `rows` tokens at a time (the key buffers' capacity).
  absl::Status MlaKvGradsToLatent(const LayerIdx& L, const float* d_block, const void* c_n,
                                  int64_t ldc, int64_t n, int64_t h0, int64_t Hh, int64_t rows,
                                  void* lat, KDType lat_type);
  // Ring: this rank's block (its latent rows in C.ag_lat, or under the kv payload its keys and
  // values in C.ring_kv, kept for the backward) around the ring; O and the statistics of both
  // local chunks merged over every visible block. Reads C.Q. Hybrid: Q to this rank's Ulysses
  // group's tokens for its H/u heads (C.cp_full) and the group's latent rows (C.ag_lat; under the
  // kv payload also their keys and values for those heads, C.ring_kv), the ring across the groups
  // into the group's output (C.cp_out), O back.
  absl::Status MlaRingForward(const LayerIdx& L, Cache& C, bool attention_kept);
  absl::Status MlaHybridForward(const LayerIdx& L, Cache& C, bool attention_kept);
  // Read W.dO; write W.dQ and the latent gradients of this rank's tokens into W.dkva.
  absl::Status MlaRingBackward(const LayerIdx& L, Cache& C);
  absl::Status MlaHybridBackward(const LayerIdx& L, Cache& C);
  struct MlaRingOps;  // the ring's block operations (cuda_model_ring.cc)
};

}  // namespace spindle
