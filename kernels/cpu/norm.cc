// RMSNorm (model norms and per-head q/k norms) and the Lightning output group RMSNorm fused
// with its sigmoid gate, forward and backward.
//
// Backward passes compute the weight gradient first, each thread owning a block of weight
// columns and summing rows in order (race-free and bitwise independent of the thread count),
// then the row-local input gradients; that order also lets dx alias dy.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/ops.h"

namespace spindle::kernels::cpu {
namespace {

using internal::FastSigmoid;

// Most columns of a weight gradient reduced by one thread at a time.
constexpr int64_t kColBlock = 64;

// Column block width for a weight gradient of D columns: narrower than kColBlock when D is small
// (per-head norms: D = Dh), so every thread gets a block. Each column is still summed over rows in
// order by one thread, so the result does not depend on the width or the thread count.
int64_t ColumnBlockWidth(int64_t D) {
  const int64_t threads = omp_get_max_threads();
  const int64_t per_thread = (D + threads - 1) / threads;
  return std::clamp<int64_t>((per_thread + 15) / 16 * 16, 16, kColBlock);
}
// Below this many elements the work stays on the calling thread.
constexpr int64_t kParallelMin = 16384;

// Normalises one row of n values: y = x * rstd * w; returns rstd. x and y may alias.
SPINDLE_SIMD_CLONES float RmsNormRow(const float* x, const float* w, float* y, int64_t n,
                                     float eps) {
  double ss = 0.0;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) ss += static_cast<double>(x[j]) * x[j];
  const float s = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  for (int64_t j = 0; j < n; ++j) y[j] = x[j] * s * w[j];
  return s;
}

// dx = s * w * dy - x * s^3 / n * sum_j(dy * w * x) for one row; dx may alias dy.
SPINDLE_SIMD_CLONES void RmsNormRowBackward(const float* x, const float* w, float s,
                                            const float* dy, float* dx, int64_t n) {
  double dot = 0.0;
#pragma omp simd reduction(+ : dot)
  for (int64_t j = 0; j < n; ++j) dot += static_cast<double>(dy[j] * w[j] * x[j]);
  const float c = static_cast<float>(dot * s * s * s / static_cast<double>(n));
  for (int64_t j = 0; j < n; ++j) dx[j] = s * w[j] * dy[j] - c * x[j];
}

// dw[0:n] += sum_r dy[r, 0:n] * x[r, 0:n] * rstd[r * rstd_stride] over `rows` rows of stride ld,
// with sig(gate[r, 0:n]) as an extra factor when gate is non-null. Sums in fp64, in row order.
SPINDLE_SIMD_CLONES void AccumulateWeightGrad(const float* x, const float* dy, const float* gate,
                                              const float* rstd, int64_t rstd_stride, int64_t rows,
                                              int64_t ld, int64_t n, float* dw) {
  double acc[kColBlock] = {};
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ld;
    const float* dyr = dy + r * ld;
    const float s = rstd[r * rstd_stride];
    if (gate != nullptr) {
      const float* gr = gate + r * ld;
      for (int64_t j = 0; j < n; ++j) {
        acc[j] += static_cast<double>(dyr[j] * (xr[j] * s) * FastSigmoid(gr[j]));
      }
    } else {
      for (int64_t j = 0; j < n; ++j) acc[j] += static_cast<double>(dyr[j] * xr[j] * s);
    }
  }
  for (int64_t j = 0; j < n; ++j) dw[j] += static_cast<float>(acc[j]);
}

// One token of the group norm + gate: H heads of Dh values.
SPINDLE_SIMD_CLONES void GroupNormGateRow(const float* o, const float* w, const float* gate,
                                          float* y, float* rstd, int64_t H, int64_t Dh, float eps) {
  for (int64_t h = 0; h < H; ++h) {
    const float* oh = o + h * Dh;
    const float* gh = gate + h * Dh;
    const float* wh = w + h * Dh;
    float* yh = y + h * Dh;
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < Dh; ++j) ss += static_cast<double>(oh[j]) * oh[j];
    const float s = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(Dh) + eps));
    rstd[h] = s;
    for (int64_t j = 0; j < Dh; ++j) yh[j] = oh[j] * s * wh[j] * FastSigmoid(gh[j]);
  }
}

// With dn = dy * w * sig: dgate = dn * n * (1 - sig), do = rstd * dn - o * rstd^3 / Dh *
// sum_j(dn * o). dn is parked in do_ between the two loops.
SPINDLE_SIMD_CLONES void GroupNormGateRowBackward(const float* o, const float* w, const float* gate,
                                                  const float* rstd, const float* dy, float* do_,
                                                  float* dgate, int64_t H, int64_t Dh) {
  for (int64_t h = 0; h < H; ++h) {
    const float* oh = o + h * Dh;
    const float* gh = gate + h * Dh;
    const float* dyh = dy + h * Dh;
    const float* wh = w + h * Dh;
    float* doh = do_ + h * Dh;
    float* dgh = dgate + h * Dh;
    const float s = rstd[h];
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

}  // namespace

void RmsNormForward(const float* x, const float* w, float* y, float* rstd, int64_t rows, int64_t D,
                    float eps) {
#pragma omp parallel for schedule(static) if (rows * D > kParallelMin)
  for (int64_t r = 0; r < rows; ++r) rstd[r] = RmsNormRow(x + r * D, w, y + r * D, D, eps);
}

void RmsNormBackward(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                     float* dw, int64_t rows, int64_t D) {
  const int64_t width = ColumnBlockWidth(D);
  const int64_t n_blocks = (D + width - 1) / width;
#pragma omp parallel if (rows * D > kParallelMin)
  {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t j0 = b * width;
      AccumulateWeightGrad(x + j0, dy + j0, nullptr, rstd, 1, rows, D, std::min(width, D - j0),
                           dw + j0);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      RmsNormRowBackward(x + r * D, w, rstd[r], dy + r * D, dx + r * D, D);
    }
  }
}

void GroupNormGateForward(const float* o, const float* w, const float* gate, float* y, float* rstd,
                          int64_t T, int64_t H, int64_t Dh, float eps) {
  const int64_t C = H * Dh;
#pragma omp parallel for schedule(static) if (T * C > kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    GroupNormGateRow(o + t * C, w, gate + t * C, y + t * C, rstd + t * H, H, Dh, eps);
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
      const int64_t c0 = h * Dh + j0;
      AccumulateWeightGrad(o + c0, dy + c0, gate + c0, rstd + h, H, T, C,
                           std::min(kColBlock, Dh - j0), dw + c0);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      GroupNormGateRowBackward(o + t * C, w, gate + t * C, rstd + t * H, dy + t * C, do_ + t * C,
                               dgate + t * C, H, Dh);
    }
  }
}

}  // namespace spindle::kernels::cpu
