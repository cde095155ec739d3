// Our own block-scaled FP8 GEMM (gemm.h, Fp8BlockScaledGemmOwn): C = alpha sum_kb
// a_scale(m, kb) b_scale(n, kb) sum_{k in kb} A[m, k] B[n, k] + beta C_in, for the problems
// cuBLASLt's block-scaled kernels do not take. Correctness first: a plain tiled kernel on CUDA
// cores. A block computes a 64 x 64 tile of C, 16 x 16 threads of 4 x 4 outputs each (rows ty +
// 16 i, columns tx + 16 j: the shared-memory reads of a warp fall on distinct banks or broadcast);
// K runs in chunks of 32 codes decoded to fp32 in shared memory. Each 128-wide K block's partial
// sums are kept apart in fp32 and added to the fp32 accumulator times the two blocks' scales, as
// the block-scaled product is defined (the FP8 codes' products are exact in fp32; only the order
// of the additions differs from cuBLASLt's).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/gemm.h"

namespace spindle::kernels::cuda {
namespace {

constexpr int kTileMN = 64;
constexpr int kChunk = 32;
constexpr int kBlockK = static_cast<int>(kFp8BlockSize);
constexpr int kSide = 16;  // threads per side of the block
static_assert(kBlockK % kChunk == 0, "a chunk never crosses a scale block");

// One operand [R, K] (K-contiguous, leading dimension ld) and its scales.
struct Operand {
  const uint8_t* codes;
  int64_t ld;
  int64_t rows;
  const float* scales;
  Fp8ScaleMode mode;
  int64_t scales_ld;  // kBlock128: the scale tensor's row stride (Fp8SquareScalesLd(K))
  int e5m2;
};

__device__ __forceinline__ float Decode(uint8_t code, int e5m2) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(code, e5m2 ? __NV_E5M2 : __NV_E4M3);
  return __half2float(__half(h));
}

__device__ __forceinline__ float ScaleOf(const Operand& op, int64_t r, int64_t kb) {
  switch (op.mode) {
    case Fp8ScaleMode::kRow128:
      return op.scales[kb * op.rows + r];
    case Fp8ScaleMode::kBlock128:
      return op.scales[(r / kBlockK) * op.scales_ld + kb];
    case Fp8ScaleMode::kTensor:
      break;
  }
  return op.scales[0];
}

// s[k][i] = operand row (r0 + i), column (k0 + k), decoded; 0 outside the matrix.
__device__ __forceinline__ void LoadChunk(const Operand& op, int64_t r0, int64_t k0, int64_t K,
                                          float (&s)[kChunk][kTileMN + 1]) {
  for (int e = static_cast<int>(threadIdx.x); e < kTileMN * kChunk; e += kSide * kSide) {
    const int i = e / kChunk, k = e % kChunk;
    const int64_t r = r0 + i, c = k0 + k;
    s[k][i] = r < op.rows && c < K ? Decode(op.codes[r * op.ld + c], op.e5m2) : 0.0f;
  }
}

template <typename TC>
__global__ void __launch_bounds__(kSide* kSide)
    BlockScaledGemmKernel(Operand a, Operand b, int64_t K, float alpha, float beta, TC* C,
                          const TC* C_in, int64_t ldc) {
  __shared__ float As[kChunk][kTileMN + 1];
  __shared__ float Bs[kChunk][kTileMN + 1];
  const int tx = static_cast<int>(threadIdx.x) % kSide, ty = static_cast<int>(threadIdx.x) / kSide;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTileMN;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTileMN;
  float acc[4][4] = {};
  for (int64_t kb0 = 0; kb0 < K; kb0 += kBlockK) {
    float part[4][4] = {};
    for (int64_t k0 = kb0; k0 < kb0 + kBlockK && k0 < K; k0 += kChunk) {
      __syncthreads();
      LoadChunk(a, m0, k0, K, As);
      LoadChunk(b, n0, k0, K, Bs);
      __syncthreads();
#pragma unroll 8
      for (int k = 0; k < kChunk; ++k) {
        float av[4], bv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) av[i] = As[k][ty + kSide * i], bv[i] = Bs[k][tx + kSide * i];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) part[i][j] = fmaf(av[i], bv[j], part[i][j]);
      }
    }
    const int64_t kb = kb0 / kBlockK;
    float sa[4], sb[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t m = m0 + ty + kSide * i, n = n0 + tx + kSide * i;
      sa[i] = m < a.rows ? ScaleOf(a, m, kb) : 0.0f;
      sb[i] = n < b.rows ? ScaleOf(b, n, kb) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(part[i][j], sa[i] * sb[j], acc[i][j]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + ty + kSide * i;
    if (m >= a.rows) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + tx + kSide * j;
      if (n >= b.rows) continue;
      float v = alpha * acc[i][j];
      if (beta != 0.0f) v = fmaf(beta, internal::ToFloat(C_in[m * ldc + n]), v);
      C[m * ldc + n] = internal::FromFloat<TC>(v);
    }
  }
}

Operand OperandOf(const void* codes, int64_t ld, int64_t rows, int64_t K, DType format,
                  const float* scales, Fp8ScaleMode mode) {
  return {static_cast<const uint8_t*>(codes), ld, rows, scales, mode, Fp8SquareScalesLd(K),
          format == DType::kFp8E5M2 ? 1 : 0};
}

}  // namespace

Status Fp8BlockScaledGemmOwn(const GemmArgs& g, cudaStream_t stream) {
  const DType bt = g.b_type.value_or(g.ab_type);
  SPINDLE_CHECK_ARG(g.M >= 0 && g.N >= 0 && g.K >= 0, "Fp8BlockScaledGemmOwn: negative size");
  SPINDLE_CHECK_ARG(IsFp8(g.ab_type) && IsFp8(bt), "Fp8BlockScaledGemmOwn: FP8 operands only");
  SPINDLE_CHECK_ARG(!g.trans_a && g.trans_b,
                    "Fp8BlockScaledGemmOwn: trans_a = false, trans_b = true only");
  SPINDLE_CHECK_ARG(g.lda >= g.K && g.ldb >= g.K && g.ldc >= g.N,
                    "Fp8BlockScaledGemmOwn: leading dimensions below the rows' lengths");
  SPINDLE_CHECK_ARG(g.a_scale != nullptr && g.b_scale != nullptr,
                    "Fp8BlockScaledGemmOwn: a_scale and b_scale are required");
  if (g.M == 0 || g.N == 0) return Status::Ok();
  const Operand a = OperandOf(g.A, g.lda, g.M, g.K, g.ab_type, g.a_scale, g.a_scale_mode);
  const Operand b = OperandOf(g.B, g.ldb, g.N, g.K, bt, g.b_scale, g.b_scale_mode);
  const dim3 grid(static_cast<unsigned>(internal::CeilDiv(g.N, kTileMN)),
                  static_cast<unsigned>(internal::CeilDiv(g.M, kTileMN)));
  SPINDLE_CHECK_ARG(internal::CeilDiv(g.M, kTileMN) < 65536,
                    "Fp8BlockScaledGemmOwn: M too large for one launch");
  const void* c_in = g.C_in != nullptr ? g.C_in : g.C;
  if (g.c_type == DType::kFloat32) {
    BlockScaledGemmKernel<float>
        <<<grid, kSide * kSide, 0, stream>>>(a, b, g.K, g.alpha, g.beta, static_cast<float*>(g.C),
                                             static_cast<const float*>(c_in), g.ldc);
  } else if (g.c_type == DType::kBFloat16) {
    BlockScaledGemmKernel<__nv_bfloat16><<<grid, kSide * kSide, 0, stream>>>(
        a, b, g.K, g.alpha, g.beta, static_cast<__nv_bfloat16*>(g.C),
        static_cast<const __nv_bfloat16*>(c_in), g.ldc);
  } else {
    return internal::UnsupportedDType(g.c_type, "Fp8BlockScaledGemmOwn");
  }
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda
