// GEMMs on cuBLASLt: bf16 (or fp32) inputs, fp32 accumulation, bf16 or fp32 output, row-major
// semantics matching cpu::Gemm, and the Linear forward/backward built on them; FP8 inputs (E4M3 /
// E5M2 codes with a device inverse scale each, or block scales under the blockwise recipe, fp8.h)
// on the one layout cuBLASLt's FP8 kernels take.
//
// A Blas owns the cuBLASLt handle, a workspace and a cache of chosen algorithms, created once and
// reused for every call. Not thread-safe: use one Blas per thread (or per stream).
#pragma once

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>

#include "kernels/cuda/dtype.h"
#include "kernels/cuda/status.h"

namespace spindle::kernels::cuda {

// How an FP8 operand's scale pointer is read, for an operand [R, K] stored K-contiguous (A [M, K],
// B [N, K]: the one FP8 layout), as cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_* on Hopper. Block
// scales multiply each block's partial sum over its K range; fp8.h's blockwise quantizers write
// them (the inverse scales, powers of two).
enum class Fp8ScaleMode : int32_t {
  kTensor = 0,    // SCALAR_32F: one float for the operand
  kRow128 = 1,    // VEC128_32F: 1 x 128 blocks along K; float [ceil(K / 128), R] row-major,
                  // row r's block kb at [kb * R + r]
  kBlock128 = 2,  // BLK128x128_32F: 128 x 128 blocks; float [ceil(R / 128), L4] row-major,
                  // L4 = ceil(K / 128) rounded up to a multiple of 4, block (r / 128, kb) at
                  // [(r / 128) * L4 + kb]
};
const char* Fp8ScaleModeName(Fp8ScaleMode m);  // "tensor", "1x128", "128x128"

struct GemmArgs {
  bool trans_a = false, trans_b = false;
  int64_t M = 0, N = 0, K = 0;
  float alpha = 1.0f, beta = 0.0f;
  const void* A = nullptr;  // [M, K] or, transposed, [K, M]; row-major with leading dim lda
  int64_t lda = 0;
  const void* B = nullptr;  // [K, N] or, transposed, [N, K]
  int64_t ldb = 0;
  void* C = nullptr;  // [M, N]
  int64_t ldc = 0;
  // With beta != 0: the matrix added is C_in (same shape, leading dim and type as C) instead of C
  // itself, and C is only written: C = alpha op(A) op(B) + beta C_in (a residual add without a
  // copy). Null: C_in = C.
  const void* C_in = nullptr;
  DType ab_type = DType::kBFloat16;  // A and B (A alone when b_type is set)
  DType c_type = DType::kBFloat16;   // C (read when beta != 0) and the output
  // Which of cuBLASLt's heuristic candidates runs: 0, its first choice, everywhere but in
  // benchmarks that compare the others.
  int candidate = 0;

  // FP8 inputs: ab_type kFp8E4M3 or kFp8E5M2 (codes, fp8.h), b_type B's format when it differs
  // (E5M2 gradients against E4M3 activations or weights; E5M2 x E5M2 is refused). The product is
  // a_scale[0] * b_scale[0] * sum_k A_code B_code, accumulated in fp32; a_scale and b_scale are
  // device floats (an Fp8Output's inverse_scale), read when the GEMM runs, so a scale computed on
  // the stream just before is used. cuBLASLt's FP8 kernels take one layout only, C = A B^T with
  // both operands K-contiguous: trans_a false, trans_b true (a transposed operand comes from its
  // Fp8Output::codes_t); another layout is refused with kUnsupported. Refused with
  // kInvalidArgument: K, N, lda and ldb not multiples of 16 (M may be any), A, B, a_scale or
  // b_scale not 16-byte aligned, a missing scale, c_type other than kBFloat16 or kFloat32, an FP8
  // operand against a non-FP8 one.
  std::optional<DType> b_type;
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  // FP8: cuBLASLt's fast accumulation (partial sums kept in the tensor cores' reduced precision
  // instead of promoted to fp32 at intervals). Off: the accurate mode.
  bool fast_accum = false;

  // FP8 block scaling (blockwise recipe): how a_scale and b_scale are read (Fp8ScaleMode).
  // C = alpha sum_kb a_scale(m, kb) b_scale(n, kb) sum_{k in block kb} A_code B_code + beta C_in,
  // fp32 accumulation, ceil(K / 128) blocks (the last one partial where K is not a multiple of
  // 128). The layout stays C = A B^T with both operands K-contiguous (lda, ldb >= K).
  // Where it runs (AlgorithmName tells): cuBLASLt when its Hopper block-scaled kernels take the
  // problem (cuBLAS 13 documents, for A_SCALE_MODE x B_SCALE_MODE in cuBLASLt's terms, i.e. our
  // B x A: 1x128 x 1x128, 1x128 x 128x128 and 128x128 x 1x128, not 128x128 x 128x128; M and N
  // multiples of 4 besides FP8's K, N, lda and ldb multiples of 16 and 16-byte pointers; no fast
  // accumulation; output bf16, fp16 or fp32) and its heuristic finds an algorithm that the call
  // then takes; otherwise, or with own_kernel, our own tiled kernel (gemm_blockwise.cu: fp32
  // accumulation, any M, N, K and alignment, any mix of modes; correct, not fast; E5M2 x E5M2
  // too). The three roles of a linear layer all fit
  // cuBLASLt's combinations: the forward x (1x128) W^T (128x128), the input gradient dy (1x128)
  // (W^T)^T (128x128, W's transposed codes), the weight gradient dy^T (1x128 along the tokens)
  // x^T (1x128 along the tokens), from the transposed codes. fast_accum is refused with block
  // scales (as PyTorch's _scaled_mm refuses it with cuBLASLt's block modes).
  Fp8ScaleMode a_scale_mode = Fp8ScaleMode::kTensor;
  Fp8ScaleMode b_scale_mode = Fp8ScaleMode::kTensor;
  bool own_kernel = false;
};

// One FP8 GEMM operand: its codes, their format and the device inverse scale (a scalar, or the
// block scale tensor that scale_mode describes).
struct Fp8Operand {
  const void* codes = nullptr;
  DType format = DType::kFp8E4M3;
  const float* inverse_scale = nullptr;
  Fp8ScaleMode scale_mode = Fp8ScaleMode::kTensor;
};

// The block-scaled FP8 GEMM on our own kernel (GemmArgs::own_kernel), whatever cuBLASLt takes:
// FP8 codes of A [M, K] and B [N, K] (trans_a false, trans_b true, lda, ldb >= K), their scales as
// a_scale_mode / b_scale_mode say, C bf16 or fp32. Blas::Gemm calls it where cuBLASLt does not run
// the problem.
Status Fp8BlockScaledGemmOwn(const GemmArgs& args, cudaStream_t stream);

// The cuBLAS type of a DType.
cudaDataType_t CudaDataType(DType t);

class Blas {
 public:
  static constexpr size_t kWorkspaceBytes = 32u << 20;

  // Creates the handle and the workspace on the current device.
  static Status Create(std::unique_ptr<Blas>* out);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // C = alpha * op(A) op(B) + beta * C (or C_in), row-major, enqueued on stream.
  Status Gemm(const GemmArgs& args, cudaStream_t stream);

  // The algorithm a Gemm with these arguments ran (its tile, stages, cluster shape, split-K and
  // CTA swizzle), for benchmark tables; empty before the first such Gemm.
  std::string AlgorithmName(const GemmArgs& args) const;
  // y[T, out] = x[T, in] W[out, in]^T (x, W, y in `dtype`).
  Status LinearForward(const void* x, const void* W, void* y, int64_t T, int64_t in, int64_t out,
                       DType dtype, cudaStream_t stream);
  // dx[T, in] = dy W (overwritten, in `dtype`; skipped when dx is null); dW[out, in] += dy^T x
  // accumulated in fp32 (dW fp32).
  Status LinearBackward(const void* x, const void* W, const void* dy, void* dx, float* dW,
                        int64_t T, int64_t in, int64_t out, DType dtype, cudaStream_t stream);

  // The same on FP8 operands (each in the layout the one FP8 GEMM layout needs; tensorwise or
  // block scales as each operand's scale_mode says: blockwise, x, dy and their transposed codes
  // kRow128, W and W_t kBlock128):
  // y[T, out] (y_type bf16 or fp32) = x[T, in] W[out, in]^T.
  Status LinearForwardFp8(const Fp8Operand& x, const Fp8Operand& W, void* y, DType y_type,
                          int64_t T, int64_t in, int64_t out, cudaStream_t stream);
  // dx[T, in] (overwritten, dx_type; skipped when dx is null) = dy[T, out] W, from W^T's codes
  // W_t [in, out]; dW[out, in] += dy^T x (fp32), from the transposed codes dy_t [out, T] and
  // x_t [in, T]. T, in and out multiples of 16 (the forward: in and out).
  Status LinearBackwardFp8(const Fp8Operand& dy, const Fp8Operand& dy_t, const Fp8Operand& W_t,
                           const Fp8Operand& x_t, void* dx, DType dx_type, float* dW, int64_t T,
                           int64_t in, int64_t out, cudaStream_t stream);

 private:
  struct Impl;
  explicit Blas(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace spindle::kernels::cuda
