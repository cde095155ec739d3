// FP8 GEMM inputs on CUDA: the tensorwise current-scaling quantization of kernels/cpu/fp8.h, done
// on the device, and its fusion into the kernels that produce each GEMM input (RMSNorm with and
// without the residual add, SwiGLU, the group RMSNorm + gate) and into the cast of the fp32 master
// weights after an optimizer step.
//
// The recipe (cpu::Fp8Recipe, worker/engine/numerics.h): E4M3 activations and weights, E5M2
// output gradients; scale = fp8_max / max(amax, 1e-12) in fp32 from the tensor's own amax, code =
// fp8_satfinite(value * scale) rounded to nearest even; the GEMM multiplies codes and applies the
// inverse scale (1 / scale, fp32) of each operand to its fp32 accumulator.
//
// Every function here writes an Fp8Output: the codes of a [rows, cols] row-major tensor, its
// transposed copy [cols, rows] (the K-contiguous layout the backward GEMMs need: cuBLASLt's FP8
// takes only C = A B^T with both operands K-contiguous, see GemmArgs), or both, and three device
// scalars: the amax, the scale and the inverse scale that the GEMM reads (GemmArgs::a_scale /
// b_scale). Nothing synchronises the host: the scale is computed on the device from the amax.
//
// Values quantized: the fused producers quantize their fp32 result, before any bf16 rounding, as
// the CPU emulation does (worker/engine/numerics.h); their bf16 output is optional (y null: not
// written; under FP8 no backward reads it). NaN in a tensor makes its amax, scale and every code
// NaN, as on the CPU.
//
// Conventions of ops.h: device pointers; inputs in `dtype` (kBFloat16 or kFloat32); fp32 norm
// statistics; work enqueued on `stream`; results bitwise reproducible (the amax is a max, exact in
// any order); errors as a Status. No function here allocates.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dtype.h"
#include "kernels/cuda/status.h"

namespace spindle::kernels::cuda {

// Largest finite value of an FP8 format: 448 (E4M3) or 57344 (E5M2); 0 for other types.
float Fp8MaxOf(DType format);

// Where one FP8 GEMM input goes. codes and codes_t are one byte per value; any alignment.
struct Fp8Output {
  DType format = DType::kFp8E4M3;  // kFp8E4M3 or kFp8E5M2
  void* codes = nullptr;           // [rows, cols] row-major; null: not written
  void* codes_t = nullptr;         // [cols, rows] row-major (the transpose); null: not written
  float* amax = nullptr;           // [1], required: max |value| over the tensor
  float* scale = nullptr;          // [1], nullable: fp8_max / max(amax, 1e-12)
  // [1], required: 1 / scale, the GEMM's factor for this operand; 16-byte aligned where a GEMM
  // reads it (cuBLASLt refuses other scale pointers, see GemmArgs).
  float* inverse_scale = nullptr;
};

// ---- Quantization of a stored tensor ------------------------------------------------------------
// *amax = max |x[i]| over n values (overwritten; NaN if any is NaN; 0 for n = 0).
Status Fp8AbsMax(const void* x, int64_t n, DType dtype, float* amax, cudaStream_t stream);
// The second pass alone: scale from the amax already in *out.amax (a producer's, or one chosen by
// the caller: values beyond it saturate), then codes of x [rows, cols] (row stride cols).
Status Fp8QuantizeFromAmax(const void* x, int64_t rows, int64_t cols, DType dtype,
                           const Fp8Output& out, cudaStream_t stream);
// Both passes: Fp8AbsMax into out.amax, then Fp8QuantizeFromAmax. An output gradient stored in
// bf16 (E5M2), or the attention output that no kernel of ours produces (E4M3).
Status Fp8Quantize(const void* x, int64_t rows, int64_t cols, DType dtype, const Fp8Output& out,
                   cudaStream_t stream);

// ---- The weights' FP8 copies --------------------------------------------------------------------
// One fp32 master weight [rows, cols] and where its FP8 copy goes (usually both layouts: codes for
// the forward x W^T, codes_t for the input gradient dy W).
struct Fp8WeightCast {
  const float* master;
  int64_t rows, cols;
  Fp8Output out;
};
// Every tensor's own amax, scale and codes, in three launches per 32 tensors, whatever their
// sizes (call after the optimizer step). Tensors must not overlap their outputs.
Status Fp8CastWeights(const Fp8WeightCast* tensors, int64_t n_tensors, cudaStream_t stream);

// ---- Producers with the quantization fused ------------------------------------------------------
// Each is its ops.h namesake (same arguments, same rstd and h), with y optional and the FP8 codes
// of its fp32 result written to `q` ([rows, D], [rows, cols] or [T, H * Dh]). Two passes: the first
// computes the statistics, h and y if asked, and the amax of the fp32 results; the second
// recomputes each result from the inputs and the saved statistics (the same fp32 operations, so
// the same values) and quantizes it. D and H * Dh <= 12288 as in ops.h.
Status RmsNormForwardFp8(const void* x, const void* w, void* y, float* rstd, int64_t rows,
                         int64_t D, float eps, DType dtype, const Fp8Output& q,
                         cudaStream_t stream);
Status RmsNormResidualForwardFp8(const void* x, const void* residual, void* h, const void* w,
                                 void* y, float* rstd, int64_t rows, int64_t D, float eps,
                                 DType dtype, const Fp8Output& q, cudaStream_t stream);
// y = silu(g) * u over [rows, cols] (the FFN's [T, F]).
Status SwiGluForwardFp8(const void* g, const void* u, void* y, int64_t rows, int64_t cols,
                        DType dtype, const Fp8Output& q, cudaStream_t stream);
Status GroupNormGateForwardFp8(const void* o, const void* w, const void* gate, void* y, float* rstd,
                               int64_t T, int64_t H, int64_t Dh, float eps, DType dtype,
                               const Fp8Output& q, cudaStream_t stream);

// ---- The second pass alone ----------------------------------------------------------------------
// A recomputed forward's quantization: the producer's first pass ran on the same inputs in the
// layer's first forward, and the caller kept its statistics (rstd) and its amax (in *q.amax).
// These quantize from them in one pass over the inputs: the same codes, scale and inverse scale as
// the full producer's.
Status RmsNormQuantizeFp8(const void* x, const void* w, const float* rstd, int64_t rows, int64_t D,
                          DType dtype, const Fp8Output& q, cudaStream_t stream);
Status SwiGluQuantizeFp8(const void* g, const void* u, int64_t rows, int64_t cols, DType dtype,
                         const Fp8Output& q, cudaStream_t stream);
Status GroupNormGateQuantizeFp8(const void* o, const void* w, const void* gate, const float* rstd,
                                int64_t T, int64_t H, int64_t Dh, DType dtype, const Fp8Output& q,
                                cudaStream_t stream);

// ---- Blockwise scaling (cpu::Fp8Scaling::kBlockwise, DeepSeek-V3's recipe) --------------------
// One power-of-two scale per block of kFp8BlockSize values, exactly cpu::Pow2Scale of the block's
// amax (the largest 2^e with amax * 2^e <= fp8_max, e in [-126, 126]; 2^126 for an all-zero block,
// NaN for a block holding a NaN), codes = fp8_satfinite(value * 2^e) rounded to nearest even: the
// dequantized values code * 2^-e are bit for bit cpu::QuantizeRowBlocks / QuantizeColumnBlocks /
// QuantizeSquareBlocks'. Blocks at a matrix's right or bottom edge are partial (their amax over the
// values present), as on the CPU. One pass: no amax crosses a block of the grid, so nothing waits
// for the whole tensor.
//
// The scales stored are the inverse scales 2^-e, the factors the GEMM applies to each block's
// partial sum, laid out as gemm.h's Fp8ScaleMode says (cuBLASLt's VEC128_32F and BLK128x128_32F on
// Hopper), for an operand [R, K] whose K (the reduced dimension) is contiguous:
//  - 1 x 128 blocks along K (kRow128): float [ceil(K / 128), R] row-major, scale of row r's block
//    kb at [kb * R + r] (R-major: the rows of one K block are adjacent).
//  - 128 x 128 blocks (kBlock128): float [ceil(R / 128), L4] row-major, L4 = ceil(K / 128) rounded
//    up to a multiple of 4 (Fp8SquareScalesLd), scale of block (r / 128, kb) at
//    [(r / 128) * L4 + kb]; the padding columns are not written and not read.
// Every scale tensor starts 16-byte aligned where a GEMM reads it (cuBLASLt refuses others).
inline constexpr int64_t kFp8BlockSize = 128;

// Number of blocks of kFp8BlockSize covering n values.
inline int64_t Fp8Blocks(int64_t n) { return (n + kFp8BlockSize - 1) / kFp8BlockSize; }
// The row stride (floats) of a kBlock128 scale tensor of an operand with K columns.
inline int64_t Fp8SquareScalesLd(int64_t K) { return (Fp8Blocks(K) + 3) / 4 * 4; }

// Where the blockwise quantization of an activation or output gradient x [rows, cols] goes: the
// codes in x's layout with 1 x 128 blocks along each row (the forward's and the input gradient's
// operand, reduced over cols), and the transposed codes [cols, rows] with 1 x 128 blocks along
// each of their rows, i.e. 128 x 1 blocks down x's columns (the weight gradient's operand, reduced
// over the tokens). Either layout may be null (not written; a forward that will be recomputed
// skips codes_t), not both. Codes: one byte each, any alignment.
struct Fp8BlockOutput {
  DType format = DType::kFp8E4M3;  // kFp8E4M3 or kFp8E5M2
  void* codes = nullptr;           // [rows, cols]
  float* scales = nullptr;         // with codes: kRow128 of [rows, cols]: [ceil(cols / 128), rows]
  void* codes_t = nullptr;         // [cols, rows]
  float* scales_t = nullptr;       // with codes_t: kRow128 of [cols, rows]: [ceil(rows/128), cols]
};
// x [rows, cols] in `dtype` (kBFloat16 or kFloat32; row stride cols) -> out.
Status Fp8QuantizeBlockwise(const void* x, int64_t rows, int64_t cols, DType dtype,
                            const Fp8BlockOutput& out, cudaStream_t stream);

// The producers' fp32 results quantized blockwise from their inputs and the statistics their
// forward kept (rstd: ops.h's RmsNormForward / GroupNormGateForward or the FP8 producers' first
// pass), with the same fp32 operations as the tensorwise producers (so the same values: the CPU
// emulation's, see "Values quantized" above); one pass, no amax pass. Shapes and limits as their
// *QuantizeFp8 namesakes; out as Fp8QuantizeBlockwise's ([rows, D], [rows, cols], [T, H * Dh]).
Status RmsNormQuantizeBlockwise(const void* x, const void* w, const float* rstd, int64_t rows,
                                int64_t D, DType dtype, const Fp8BlockOutput& out,
                                cudaStream_t stream);
Status SwiGluQuantizeBlockwise(const void* g, const void* u, int64_t rows, int64_t cols,
                               DType dtype, const Fp8BlockOutput& out, cudaStream_t stream);
Status GroupNormGateQuantizeBlockwise(const void* o, const void* w, const void* gate,
                                      const float* rstd, int64_t T, int64_t H, int64_t Dh,
                                      DType dtype, const Fp8BlockOutput& out, cudaStream_t stream);

// One fp32 master weight [rows, cols] (W [out, in]) and its blockwise FP8 copies, 128 x 128 blocks:
// codes [rows, cols] with kBlock128 scales [ceil(rows / 128), Fp8SquareScalesLd(cols)] (the
// forward x W^T reads them), codes_t [cols, rows] with kBlock128 scales [ceil(cols / 128),
// Fp8SquareScalesLd(rows)] (the input gradient dy W reads them); a block's scale is the same in
// both, its two positions transposed. Either layout may be null, not both.
struct Fp8BlockWeightCast {
  const float* master = nullptr;
  int64_t rows = 0, cols = 0;
  DType format = DType::kFp8E4M3;
  void* codes = nullptr;
  float* scales = nullptr;
  void* codes_t = nullptr;
  float* scales_t = nullptr;
};
// Every tensor's blocks, in one launch per 32 tensors whatever their sizes (call after the
// optimizer step). Tensors must not overlap their outputs.
Status Fp8CastWeightsBlockwise(const Fp8BlockWeightCast* tensors, int64_t n_tensors,
                               cudaStream_t stream);

}  // namespace spindle::kernels::cuda
