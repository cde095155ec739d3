// CUDA kernels of the mixture-of-experts FFN (DESIGN.md section 2), mirroring kernels/cpu/moe.h
// (the reference): the sigmoid router with its balancing bias and top-k, the grouping of the
// (token, choice) pairs by expert, row gathers (plain, and fused with the FP8 quantization of the
// expert inputs), the weighted combine, and the experts' grouped GEMMs in bf16 and FP8.
//
// Conventions of ops.h: device pointers unless a comment says host; token-major rows; forward
// functions overwrite their outputs; fp32 parameter gradients are accumulated; every reduction in
// a fixed order (no float atomics, no order that depends on atomics): results are bitwise
// reproducible; work is enqueued on `stream`; errors come back as a Status. Expert ids and row
// maps are int32.
//
// The data path of one MoE FFN on one rank (the engine's):
//   router logits z = x Wr^T (fp32) -> MoeRouterForward -> idx [T, K], weights [T, K]
//   MoeGroupRows(idx, per_source K, align 16 under FP8) -> offsets, item_row, row_source, counts
//     (counts copied to the host: the grouped GEMMs' row counts)
//   GatherRows / GatherRowsFp8(x, row_source) -> the experts' input rows, padded per group
//   GroupedGemm (W1, W3), SwiGLU, GroupedGemm (W2) -> y rows
//   MoeCombine(y, item_row, weights) -> out[t] (+)= sum_k w_k y[item_row[t, k]]
// and back: MoeCombineBackward gives the y rows' gradient and dweights; the gradient of the
// gathered rows returns to the tokens through MoeCombine with no weights (the sum of a token's K
// rows); MoeRouterBackward gives dz.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/cuda/dtype.h"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/status.h"

namespace spindle::kernels::cuda {

// ---- Router (one warp per token)
// ------------------------------------------------------------------ logits [T, E] fp32, bias [E]
// fp32. The K largest sigmoid(z) + bias (ties to the lower expert id) go to idx [T, K] in
// descending order, weights [T, K] = s_chosen / sum_k s_chosen (the sum in choice order); lse
// (nullable) [T] = logsumexp(z[t, :]). 1 <= K <= E <= kMoeMaxExperts.
constexpr int64_t kMoeMaxExperts = 1024;
Status MoeRouterForward(const float* logits, const float* bias, int32_t* idx, float* weights,
                        float* lse, int64_t T, int64_t E, int64_t K, cudaStream_t stream);
// dlogits [T, E] overwritten: the gradient through the weights of dweights [T, K], plus, when
// zloss_scale != 0, zloss_scale * 2 * lse[t] * softmax(z[t]) (lse then required).
Status MoeRouterBackward(const float* logits, const int32_t* idx, const float* dweights,
                         const float* lse, float zloss_scale, float* dlogits, int64_t T, int64_t E,
                         int64_t K, cudaStream_t stream);

// ---- Grouping rows by expert (a stable counting sort)
// -------------------------------------------- The outputs of cpu::MoeGroupRows for n items with
// keys in [0, E): counts [E] and offsets [E + 1] (int64, groups padded to multiples of `align`),
// item_row [n], and row_source with row_capacity entries: (item / per_source) for the rows of
// items, -1 for padding rows and for every entry at or past offsets[E]. row_capacity >= n + E *
// (align - 1) (the most rows any keys can need). Items keep their order within a group. counts_host
// (nullable; pinned host memory, E entries) receives a copy of counts, complete when the stream
// reaches this point (the grouped GEMMs and the all-to-alls need the group sizes on the host). Keys
// outside [0, E) are undefined behaviour. n < 2^31, E <= kMoeMaxExperts.
size_t MoeGroupRowsWorkspaceBytes(int64_t n, int64_t E);
Status MoeGroupRows(const int32_t* key, int64_t n, int64_t per_source, int64_t E, int64_t align,
                    int64_t* counts, int64_t* offsets, int32_t* item_row, int32_t* row_source,
                    int64_t row_capacity, int64_t* counts_host, Workspace ws, cudaStream_t stream);

// ---- Row gathers
// ----------------------------------------------------------------------------------- out[r, :] =
// in[src[r], :] for r < rows, zeros where src[r] < 0 (in, out in `dtype`).
Status GatherRows(const void* in, const int32_t* src, void* out, int64_t rows, int64_t D,
                  DType dtype, cudaStream_t stream);
// The same gather quantized to FP8 in one pass (fp8.h's tensorwise current scaling), from the
// amax already in *q.amax (the gathered rows' amax: with every token routed somewhere, the amax of
// `in`, e.g. from the producer of `in` or Fp8AbsMax; padding rows are zeros). Writes q.scale,
// q.inverse_scale and the codes: q.codes [rows, D] row-major, and q.codes_t [D, rows] row-major
// (the transpose of the whole [rows, D]). Group g's transposed codes, the K-contiguous operand of
// its weight gradient, are the columns [offsets[g], offsets[g + 1]) of q.codes_t with leading
// dimension `rows`: with groups padded to multiples of 16 (MoeGroupRows with align 16) every
// group's block starts 16-byte aligned, and no separate pad or transpose pass exists. Either
// layout may be null. D and rows multiples of 16; codes 8-byte aligned.
Status GatherRowsFp8(const void* in, const int32_t* src, int64_t rows, int64_t D, DType dtype,
                     const Fp8Output& q, cudaStream_t stream);

// ---- Blockwise FP8 of the experts' rows (fp8.h's blockwise recipe, grouped)
// ---------------------------------------------------------------- The experts' rows [rows, D]
// lie in groups (offsets [G + 1], one group per local expert, each padded to a multiple of 16)
// and, within them, segments (ascending row bounds, the first 0 and the last rows, every group
// offset among them: one segment per (expert, source rank), worker/engine/moe/moe_exchange.h's
// MoeExpertSegments; at ep = 1 the groups themselves). The blockwise quantization of such rows
// writes, as the grouped GEMMs read them:
//  - codes [rows, D] row-major in 1 x 128 blocks along each row (a row's own scales, as
//    Fp8QuantizeBlockwise's), their scales per group: group g's kRow128 tensor [ceil(D / 128), m_g]
//    (m_g = offsets[g + 1] - offsets[g]) at scales + offsets[g] * ceil(D / 128), so each group's
//    GEMM reads a tensor of its own rows (16-byte aligned: offsets are multiples of 16);
//  - codes_t [D, rows] (the transpose of the whole tensor, as GatherRowsFp8's) in 128 x 1 blocks
//    down each column that start afresh at each segment's first row (the last block of a segment
//    partial), their scales per segment: segment s's kRow128 tensor [ceil(n_s / 128), D] (n_s
//    its rows, the weight gradient's K) at scales_t + first_block(s) * D, first_block(s) the
//    blocks of the segments before it (Fp8RowBands::col_blocks in all).
// A band is one segment's run of at most 128 rows starting at its first row or 128 k past it:
// the kernels' unit of work (its row scales in its group's tensor, its column scales one block).
struct Fp8RowBand {
  int64_t row0 = 0, rows = 0;              // the band's rows [row0, row0 + rows), rows <= 128
  int64_t group_row0 = 0, group_rows = 0;  // its group's first row and row count
  int64_t col_block = 0;                   // its column block among every segment's blocks
};
struct Fp8RowBands {
  std::vector<Fp8RowBand> bands;
  int64_t col_blocks = 0;  // the column blocks of every segment: scales_t holds col_blocks * D
};
// The bands of `segments` (n_segments + 1 ascending bounds) in groups `offsets` (G + 1, host).
// InvalidArgument where the segments do not start at 0, end at offsets[G], ascend, and hold every
// group offset.
Status Fp8GroupedRowBands(const int64_t* offsets, int64_t G, const int64_t* segments,
                          int64_t n_segments, Fp8RowBands* out);
// The blockwise quantization of the experts' rows into out (codes with the group layout's scales,
// codes_t with the segment layout's; either may be null, not both), from the device copy `bands`
// of Fp8GroupedRowBands's n_bands bands (their rows cover [0, rows)):
//  - GatherRowsBlockwise: rows in[src[r], :] (zeros where src[r] < 0; src null: in is [rows, D]
//    itself, e.g. received rows or a stored output gradient) in `dtype`;
//  - SwiGluQuantizeGroupedBlockwise: silu(g) * u in fp32 from g and u [rows, cols] (the same fp32
//    operations as SwiGluQuantizeBlockwise).
// rows a multiple of 16 (the groups' padding); the codes and values as Fp8QuantizeBlockwise's.
Status GatherRowsBlockwise(const void* in, const int32_t* src, const Fp8RowBand* bands,
                           int64_t n_bands, int64_t rows, int64_t D, DType dtype,
                           const Fp8BlockOutput& out, cudaStream_t stream);
Status SwiGluQuantizeGroupedBlockwise(const void* g, const void* u, const Fp8RowBand* bands,
                                      int64_t n_bands, int64_t rows, int64_t cols, DType dtype,
                                      const Fp8BlockOutput& out, cudaStream_t stream);

// ---- Combine
// --------------------------------------------------------------------------------------- out[t, :]
// (+)= sum_k w[t, k] * y[row[t * K + k], :] in fp32, the terms added in choice order to out's value
// (accumulate) or to zero, rounded once to out_dtype. w null: weight 1 (the sum of the rows: the
// backward of the gather). y and out in bf16 or fp32, independently.
Status MoeCombine(const void* y, DType y_dtype, const int32_t* row, const float* w, void* out,
                  DType out_dtype, int64_t T, int64_t K, int64_t D, bool accumulate,
                  cudaStream_t stream);
// The backward of MoeCombine with weights: dy[row[t * K + k], :] = w[t, k] * dout[t, :]
// (overwritten; rows that no pair names, the groups' padding among them, are left as they are:
// zero them first where a GEMM reads them) and dw[t, k] = dot(dout[t, :], y[row[t * K + k], :])
// in fp32 (per-lane partial sums, then a fixed butterfly). dout, y, dy share `dtype`.
// dy_amax (nullable, a device float, overwritten): max |dy| as stored, the E5M2 quantization's
// amax (then Fp8QuantizeFromAmax on dy).
Status MoeCombineBackward(const void* dout, const void* y, const int32_t* row, const float* w,
                          void* dy, float* dw, int64_t T, int64_t K, int64_t D, DType dtype,
                          cudaStream_t stream, float* dy_amax = nullptr);

// ---- Grouped GEMMs of the experts
// ------------------------------------------------------------------ Rows of the activations are
// stacked by group: group g owns rows [offsets[g], offsets[g + 1]) of A, C, dA and dC, with
// `offsets` a HOST array of G + 1 entries (MoeGroupRows's offsets, whose counts the host holds).
// Expert weights are stacked [G, N, K] (the checkpoint's [E, out, in]):
//   Forward:        C_g [m_g, N] = A_g [m_g, K] B_g^T            (rows x W^T)
//   BackwardData:   dA_g [m_g, K] (+)= dC_g [m_g, N] B_g          (the input gradient)
//   BackwardWeight: dB_g [N, K] += dC_g^T A_g, fp32               (the weight gradient)
// Empty groups are skipped (their dB_g untouched). bf16 (or fp32) storage, fp32 accumulation.
//
// FP8 (E4M3 activations and weights, E5M2 gradients; fp8.h): cuBLASLt's one FP8 layout
// (C = A B^T, both K-contiguous) takes, per role:
//   ForwardFp8:        A codes [rows, K], B codes [G, N, K]
//   BackwardDataFp8:   dC codes [rows, N], B's transposed codes [G, K, N]
//   BackwardWeightFp8: dC's and A's transposed codes [N, rows] and [K, rows] (Fp8Output::codes_t
//                      of the whole tensor: group g's block is its columns, leading dim `rows`)
// with one inverse scale per activation tensor and one per expert (Fp8CastWeights with a tensor
// per expert). N, K and every group's row count multiples of 16 (MoeGroupRows with align 16).
// Blockwise (the operands' scale_mode): activations and gradients kRow128 in the grouped layout
// above ("Blockwise FP8 of the experts' rows": the forward's and the input gradient's operand
// group g reads its group's row scales, the weight gradient runs one GEMM per segment on its
// column scales, a group's segments in order on one stream), each expert's weight kBlock128 in
// its own [ceil(rows / 128), Fp8SquareScalesLd(cols)] tensor, scale_stride floats apart. Blas::Gemm
// picks cuBLASLt or our own kernel per call (gemm.h), e.g. ours for a segment whose rows are not
// a multiple of 16 or do not start 16-byte aligned.
struct Fp8Experts {
  const void* codes = nullptr;  // [G, rows, cols] codes, one byte each
  DType format = DType::kFp8E4M3;
  // Expert g's inverse scale (kTensor) or block scales (kBlock128) at
  // inverse_scales[g * scale_stride] (16-byte aligned: scale_stride a multiple of 4, the pointer
  // 16-byte aligned).
  const float* inverse_scales = nullptr;
  int64_t scale_stride = 4;
  Fp8ScaleMode scale_mode = Fp8ScaleMode::kTensor;
};

// How the groups' GEMMs are issued (bench_kernels_cuda --moe measures each, bench/cuda/NOTES.md).
enum class GroupedGemmMethod {
  kLoop = 0,            // one cuBLASLt call per group, in order, on the caller's stream
  kStreams = 1,         // the same calls spread over `streams` streams forked from the caller's
  kGroupedBatched = 2,  // cuBLAS's cublasGemmGroupedBatchedEx, one call where A, B and C share
                        // one type (FP8 and the weight gradient run as kStreams)
  kPersistent = 3,      // our persistent bf16 kernel on Hopper (TMA + wgmma, sm_90 only): one
                        // launch for all groups (moe_gemm_sm90.h); FP8, fp32, other GPUs and
                        // shapes it refuses run as kStreams, per call. Its weight gradient needs
                        // every group offset at a multiple of 64 (MoeGroupRows with align 64)
};
const char* GroupedGemmMethodName(GroupedGemmMethod m);

struct GroupedGemmOptions {
  GroupedGemmMethod method = GroupedGemmMethod::kStreams;
  int streams = 2;  // kStreams (and kPersistent's fallback): streams in all (the caller's
                    // among them), 1..16
};

// Owns its cuBLASLt plans and workspaces (one Blas per stream it issues on), the side streams and
// their events, (kGroupedBatched) a cuBLAS handle and device pointer tables, and (kPersistent) the
// persistent kernel's tile table. Not thread-safe,
// and calls on different streams must not overlap: use one GroupedGemm per stream.
class GroupedGemm {
 public:
  static constexpr int64_t kMaxGroups = 1024;
  static Status Create(const GroupedGemmOptions& options, std::unique_ptr<GroupedGemm>* out);
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;

  const GroupedGemmOptions& options() const;
  // Whether kPersistent's kernel runs here (method kPersistent, an sm_90 device, a build with
  // sm_90a code); false: every call runs as kStreams.
  bool persistent_kernel() const;

  // A, B, C in `dtype`; C overwritten.
  Status Forward(const void* A, const void* B, void* C, const int64_t* offsets, int64_t G,
                 int64_t N, int64_t K, DType dtype, cudaStream_t stream);
  // dA overwritten, or accumulated (dA += ..., one rounding) when `accumulate`.
  Status BackwardData(const void* dC, const void* B, void* dA, const int64_t* offsets, int64_t G,
                      int64_t N, int64_t K, DType dtype, cudaStream_t stream,
                      bool accumulate = false);
  // dB fp32 [G, N, K], accumulated.
  Status BackwardWeight(const void* dC, const void* A, float* dB, const int64_t* offsets, int64_t G,
                        int64_t N, int64_t K, DType dtype, cudaStream_t stream);

  // C (c_type bf16 or fp32) = A B^T per group.
  Status ForwardFp8(const Fp8Operand& A, const Fp8Experts& B, void* C, DType c_type,
                    const int64_t* offsets, int64_t G, int64_t N, int64_t K, cudaStream_t stream);
  // dA (da_type) (+)= dC B per group, from B's transposed codes B_t [G, K, N].
  Status BackwardDataFp8(const Fp8Operand& dC, const Fp8Experts& B_t, void* dA, DType da_type,
                         const int64_t* offsets, int64_t G, int64_t N, int64_t K,
                         cudaStream_t stream, bool accumulate = false);
  // dB [G, N, K] += dC^T A per group, from dC_t [N, rows] and A_t [K, rows] (rows = offsets[G]).
  // Block-scaled operands (kRow128 along the tokens) need the segments (n_segments + 1 host
  // bounds, as Fp8GroupedRowBands's): one GEMM per non-empty segment into its group's dB_g.
  Status BackwardWeightFp8(const Fp8Operand& dC_t, const Fp8Operand& A_t, float* dB,
                           const int64_t* offsets, int64_t G, int64_t N, int64_t K,
                           cudaStream_t stream, const int64_t* segments = nullptr,
                           int64_t n_segments = 0);

  struct Impl;

 private:
  explicit GroupedGemm(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace spindle::kernels::cuda
