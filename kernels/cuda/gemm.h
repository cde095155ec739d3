// GEMMs on cuBLASLt: bf16 (or fp32) inputs, fp32 accumulation, bf16 or fp32 output, row-major
// semantics matching cpu::Gemm, and the Linear forward/backward built on them.
//
// A Blas owns the cuBLASLt handle, a workspace and a cache of chosen algorithms, created once and
// reused for every call. Not thread-safe: use one Blas per thread (or per stream).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "kernels/cuda/dtype.h"
#include "kernels/cuda/status.h"

namespace spindle::kernels::cuda {

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
  DType ab_type = DType::kBFloat16;  // A and B
  DType c_type = DType::kBFloat16;   // C (read when beta != 0) and the output
  // Which of cuBLASLt's heuristic candidates runs: 0, its first choice, everywhere but in
  // benchmarks that compare the others.
  int candidate = 0;
};

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

 private:
  struct Impl;
  explicit Blas(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace spindle::kernels::cuda
