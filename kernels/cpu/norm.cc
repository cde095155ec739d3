// RMSNorm (model norms and per-head q/k norms) and the Lightning output group RMSNorm fused
// with its sigmoid gate, forward and backward.
//
// Backward passes compute the weight gradient first, each thread owning a block of weight
// columns and summing rows in order (race-free and bitwise independent of the thread count),
// then the row-local input gradients; that order also lets dx alias dy.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/ops.h"

namespace spindle::kernels::cpu {
namespace {

using internal::FastSigmoid;

// Columns of a weight gradient reduced by one thread at a time.
constexpr int64_t kColBlock = 64;
// Below this many elements the work stays on the calling thread.
constexpr int64_t kParallelMin = 16384;

double RowSumSquares(const float* x, int64_t n) {
  double ss = 0.0;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) ss += static_cast<double>(x[j]) * x[j];
  return ss;
}

float Rstd(double sum_squares, int64_t n, float eps) {
  return static_cast<float>(1.0 / std::sqrt(sum_squares / static_cast<double>(n) + eps));
}

}  // namespace

void RmsNormForward(const float* x, const float* w, float* y, float* rstd, int64_t rows, int64_t D,
                    float eps) {
#pragma omp parallel for schedule(static) if (rows * D > kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    const float s = Rstd(RowSumSquares(xr, D), D, eps);
    rstd[r] = s;
    for (int64_t j = 0; j < D; ++j) yr[j] = xr[j] * s * w[j];
  }
}

void RmsNormBackward(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                     float* dw, int64_t rows, int64_t D) {
  const int64_t n_blocks = (D + kColBlock - 1) / kColBlock;
#pragma omp parallel if (rows * D > kParallelMin)
  {
    // dw[j] += sum_r dy[r, j] * x[r, j] * rstd[r].
#pragma omp for schedule(static)
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t j0 = b * kColBlock;
      const int64_t n = std::min(kColBlock, D - j0);
      double acc[kColBlock] = {};
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * D + j0;
        const float* dyr = dy + r * D + j0;
        const float s = rstd[r];
        for (int64_t j = 0; j < n; ++j) acc[j] += static_cast<double>(dyr[j] * xr[j] * s);
      }
      for (int64_t j = 0; j < n; ++j) dw[j0 + j] += static_cast<float>(acc[j]);
    }
    // dx = rstd * w * dy - x * rstd^3 / D * sum_j(dy * w * x).
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * D;
      const float* dyr = dy + r * D;
      float* dxr = dx + r * D;
      double dot = 0.0;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < D; ++j) dot += static_cast<double>(dyr[j] * w[j] * xr[j]);
      const float s = rstd[r];
      const float c = static_cast<float>(dot * s * s * s / static_cast<double>(D));
      for (int64_t j = 0; j < D; ++j) dxr[j] = s * w[j] * dyr[j] - c * xr[j];
    }
  }
}

void GroupNormGateForward(const float* o, const float* w, const float* gate, float* y, float* rstd,
                          int64_t T, int64_t H, int64_t Dh, float eps) {
  const int64_t C = H * Dh;
#pragma omp parallel for schedule(static) if (T * C > kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t off = t * C + h * Dh;
      const float* oh = o + off;
      const float* gh = gate + off;
      const float* wh = w + h * Dh;
      float* yh = y + off;
      const float s = Rstd(RowSumSquares(oh, Dh), Dh, eps);
      rstd[t * H + h] = s;
      for (int64_t j = 0; j < Dh; ++j) yh[j] = oh[j] * s * wh[j] * FastSigmoid(gh[j]);
    }
  }
}

void GroupNormGateBackward(const float* o, const float* w, const float* gate, const float* rstd,
                           const float* dy, float* do_, float* dw, float* dgate, int64_t T,
                           int64_t H, int64_t Dh) {
  const int64_t C = H * Dh;
  // Column blocks never straddle two heads, so rstd is one value per (token, block).
  const int64_t blocks_per_head = (Dh + kColBlock - 1) / kColBlock;
  const int64_t n_blocks = H * blocks_per_head;
#pragma omp parallel if (T * C > kParallelMin)
  {
    // dw[c] += sum_t dy * n * sigmoid(gate), n = o * rstd.
#pragma omp for schedule(static)
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t h = b / blocks_per_head;
      const int64_t j0 = (b % blocks_per_head) * kColBlock;
      const int64_t n = std::min(kColBlock, Dh - j0);
      const int64_t c0 = h * Dh + j0;
      double acc[kColBlock] = {};
      for (int64_t t = 0; t < T; ++t) {
        const float* ot = o + t * C + c0;
        const float* gt = gate + t * C + c0;
        const float* dyt = dy + t * C + c0;
        const float s = rstd[t * H + h];
        for (int64_t j = 0; j < n; ++j) {
          acc[j] += static_cast<double>(dyt[j] * (ot[j] * s) * FastSigmoid(gt[j]));
        }
      }
      for (int64_t j = 0; j < n; ++j) dw[c0 + j] += static_cast<float>(acc[j]);
    }
    // With dn = dy * w * sig: dgate = dn * n * (1 - sig), do = rstd * dn - o * rstd^3 / Dh *
    // sum_j(dn * o). dn is parked in do_ between the two loops.
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t off = t * C + h * Dh;
        const float* oh = o + off;
        const float* gh = gate + off;
        const float* dyh = dy + off;
        const float* wh = w + h * Dh;
        float* doh = do_ + off;
        float* dgh = dgate + off;
        const float s = rstd[t * H + h];
        double dot = 0.0;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < Dh; ++j) {
          const float sig = FastSigmoid(gh[j]);
          const float o_j = oh[j];
          const float dn = dyh[j] * wh[j] * sig;
          dgh[j] = dn * (o_j * s) * (1.0f - sig);
          doh[j] = dn;
          dot += static_cast<double>(dn * o_j);
        }
        const float c = static_cast<float>(dot * s * s * s / static_cast<double>(Dh));
        for (int64_t j = 0; j < Dh; ++j) doh[j] = s * doh[j] - c * oh[j];
      }
    }
  }
}

}  // namespace spindle::kernels::cpu
