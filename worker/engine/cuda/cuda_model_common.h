// What every file of CudaModel uses (see cuda_model.cc's design notes): the kernels' status as
// absl::Status, device buffers of the caching allocator (DevBuf) and their FP8 forms, one layer's
// parameter indices, the shared KindArena of the two attention families, a layer's own
// activations that its families read (LayerActs), and the batch and CP levels on the device.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/allocator.h"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sdpa.h"
#include "worker/engine/cp/cp_ulysses.h"
#include "worker/engine/cuda/cuda_model.h"
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
  // Blockwise recipe (kernels/cuda/fp8.h): the block scales of the codes and of their transpose,
  // after the codes (BlockScaleBytes); an activation's or gradient's in 1 x 128 blocks along each
  // layout's rows (kRow128), a weight's in 128 x 128 blocks (kBlock128). Null: tensorwise.
  static int64_t RowScaleBytes(int64_t r, int64_t c) {
    return Padded(4 * kc::Fp8Blocks(c) * r) + Padded(4 * kc::Fp8Blocks(r) * c);
  }
  static int64_t SquareScaleBytes(int64_t r, int64_t c) {
    return Padded(4 * kc::Fp8Blocks(r) * kc::Fp8SquareScalesLd(c)) +
           Padded(4 * kc::Fp8Blocks(c) * kc::Fp8SquareScalesLd(r));
  }
  void* base = nullptr;  // null: none (a weight that is not an FP8 linear)
  int64_t rows = 0, cols = 0;
  KDType format = KDType::kFp8E4M3;
  void* rows_at = nullptr;  // the row-major codes when not in the block
  float* scales = nullptr;    // blockwise: the codes' block scales
  float* scales_t = nullptr;  // blockwise: the transpose's block scales

  bool blockwise() const { return scales != nullptr; }
  // Points scales and scales_t at `at` (16-byte aligned), the codes' first: kRow128 (weight
  // false) or kBlock128 (weight true) of [rows, cols] and of [cols, rows].
  void SetScales(void* at, bool weight) {
    scales = static_cast<float*>(at);
    const int64_t first = weight ? 4 * kc::Fp8Blocks(rows) * kc::Fp8SquareScalesLd(cols)
                                 : 4 * kc::Fp8Blocks(cols) * rows;
    scales_t = reinterpret_cast<float*>(static_cast<uint8_t*>(at) + Padded(first));
  }

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
  // Blockwise: both layouts with their block scales (an activation's or gradient's).
  kc::Fp8BlockOutput BlockOutput() const {
    return {format, codes(), scales, codes_t(), scales_t};
  }
};

// The FP8 copies of one MoE layer's stacked expert weights [experts, rows, cols]
// (train.precision fp8), in the model's fixed memory: one scale per expert (expert g's inverse
// scale, amax and scale at scalars() + 4 g, 16-byte aligned), the codes [experts, rows, cols] for
// the forward and each expert's transpose [experts, cols, rows] for the input gradient. Blockwise
// (blockwise true): after them each expert's 128 x 128 block scales of both layouts (kBlock128 of
// [rows, cols] at scales + g * ScaleStride(), of [cols, rows] at scales_t + g * ScaleStrideT()),
// and the scalars go unused.
struct Fp8ExpertBlock {
  void* base = nullptr;  // null: none
  int64_t experts = 0, rows = 0, cols = 0;
  bool blockwise = false;

  static int64_t Bytes(int64_t experts, int64_t numel) {
    return Fp8Block::Padded(experts * 16) + 2 * Fp8Block::Padded(numel);
  }
  // Floats between two experts' block scales (multiples of 4: each expert's 16-byte aligned).
  int64_t ScaleStride() const { return kc::Fp8Blocks(rows) * kc::Fp8SquareScalesLd(cols); }
  int64_t ScaleStrideT() const { return kc::Fp8Blocks(cols) * kc::Fp8SquareScalesLd(rows); }
  // The blockwise scales' bytes, after Bytes().
  int64_t BlockScaleBytes() const {
    return Fp8Block::Padded(4 * experts * ScaleStride()) +
           Fp8Block::Padded(4 * experts * ScaleStrideT());
  }
  float* scalars() const { return static_cast<float*>(base); }
  uint8_t* codes() const { return static_cast<uint8_t*>(base) + Fp8Block::Padded(experts * 16); }
  uint8_t* codes_t() const { return codes() + Fp8Block::Padded(experts * rows * cols); }
  float* scales() const {
    return reinterpret_cast<float*>(codes_t() + Fp8Block::Padded(experts * rows * cols));
  }
  float* scales_t() const {
    return reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(scales()) +
                                    Fp8Block::Padded(4 * experts * ScaleStride()));
  }
  kc::Fp8Experts Forward() const {
    if (blockwise)
      return {codes(), KDType::kFp8E4M3, scales(), ScaleStride(), kc::Fp8ScaleMode::kBlock128};
    return {codes(), KDType::kFp8E4M3, scalars(), 4};
  }
  kc::Fp8Experts Transposed() const {
    if (blockwise)
      return {codes_t(), KDType::kFp8E4M3, scales_t(), ScaleStrideT(), kc::Fp8ScaleMode::kBlock128};
    return {codes_t(), KDType::kFp8E4M3, scalars(), 4};
  }
  // One cast per expert, from the master [experts, rows, cols].
  void AddCasts(const float* master, std::vector<kc::Fp8WeightCast>* t) const {
    const int64_t n = rows * cols;
    for (int64_t g = 0; g < experts; ++g)
      t->push_back(
          {master + g * n, rows, cols,
           kc::Fp8Output{KDType::kFp8E4M3, codes() + g * n, codes_t() + g * n,
                         scalars() + 4 * g + 1, scalars() + 4 * g + 2, scalars() + 4 * g}});
  }
  // Blockwise: one 128 x 128 cast per expert, both layouts.
  void AddBlockCasts(const float* master, std::vector<kc::Fp8BlockWeightCast>* t) const {
    const int64_t n = rows * cols;
    for (int64_t g = 0; g < experts; ++g)
      t->push_back({master + g * n, rows, cols, KDType::kFp8E4M3, codes() + g * n,
                    scales() + g * ScaleStride(), codes_t() + g * n,
                    scales_t() + g * ScaleStrideT()});
  }
};

// An activation's Fp8Block in a block of the caching allocator (grown on demand); with
// `row_scratch`, its row-major codes go there (the block holds the transpose only).
// `blockwise`: with its block scales after the codes (Fp8Block::SetScales), in both layouts.
struct Fp8Act : Fp8Block {
  DevBuf mem;
  absl::Status Ensure(kc::CachingAllocator* a, int64_t r, int64_t c, KDType f,
                      void* row_scratch = nullptr, bool blockwise = false) {
    rows = r, cols = c, format = f, rows_at = row_scratch;
    const int64_t codes = row_scratch != nullptr ? TransposeBytes(r * c) : Bytes(r * c);
    RETURN_IF_ERROR(mem.Ensure(a, codes + (blockwise ? RowScaleBytes(r, c) : 0)));
    base = mem.get();
    scales = scales_t = nullptr;
    if (blockwise) SetScales(static_cast<uint8_t*>(base) + codes, /*weight=*/false);
    return absl::OkStatus();
  }
  // Blockwise, the MoE experts' rows [r, c] in kernels/cuda/moe.h's grouped layout: both layouts
  // of codes in the block, the groups' row scales (r * ceil(c / 128) floats) at `scales`, the
  // segments' column scales (col_blocks * c floats) at `scales_t`.
  absl::Status EnsureGrouped(kc::CachingAllocator* a, int64_t r, int64_t c, KDType f,
                             int64_t col_blocks) {
    rows = r, cols = c, format = f, rows_at = nullptr;
    const int64_t codes = Bytes(r * c), row_scales = Padded(4 * kc::Fp8Blocks(c) * r);
    RETURN_IF_ERROR(mem.Ensure(a, codes + row_scales + Padded(4 * col_blocks * c)));
    base = mem.get();
    scales = reinterpret_cast<float*>(static_cast<uint8_t*>(base) + codes);
    scales_t = reinterpret_cast<float*>(static_cast<uint8_t*>(base) + codes + row_scales);
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

// The FP8 producers of a layer, whose amaxes a recomputing layer keeps (KeptForRecompute): the
// attention norm (q_h), the group norm + gate (q_y), the FFN norm (q_h2), SwiGLU (q_a) and MLA's
// attention output (q_O).
enum Fp8Site { kSiteH, kSiteY, kSiteH2, kSiteA, kSiteO, kFp8Sites };

// A layer's own activations, which the families of its attention and FFN read: the attention
// norm's output h and statistics, the attention's residual sum x_mid, the FFN norm's output h2 and
// statistics; under FP8 the codes of h and h2 (q_h, q_h2; the bf16 h2 then is not written but for
// a MoE layer) and a recomputing layer's amaxes by Fp8Site while its kept buffers are swapped in
// (else none).
struct LayerActs {
  DevBuf h, rstd1, x_mid, h2, rstd2;
  Fp8Act q_h, q_h2;
  DevBuf fp8_amax;
  // CP: the attention core's head-split inputs. All2All: over the whole sequence in stream order,
  // [T_full, 3 * H/cp * Dh] (Lightning q | k | v) or [T_full, H/cp * (2 qk + vd)] (MLA Q | K | V);
  // hybrid: the Ulysses group's (Lightning q | k | v; MLA the queries). One buffer for the two
  // attention families, a layer being of one (a field of each in the shared cache's KindArena).
  DevBuf cp_full;
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

}  // namespace spindle
