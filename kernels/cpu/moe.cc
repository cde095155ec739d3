// CPU reference kernels of the mixture-of-experts FFN (moe.h).
#include "kernels/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace spindle::kernels::cpu {
namespace {

float Sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

}  // namespace

void MoeRouterForward(const float* logits, const float* bias, int32_t* idx, float* weights,
                      float* lse, int64_t T, int64_t E, int64_t K) {
#pragma omp parallel
  {
    std::vector<float> key(E);
    std::vector<int32_t> order(E);
#pragma omp for
    for (int64_t t = 0; t < T; ++t) {
      const float* z = logits + t * E;
      for (int64_t e = 0; e < E; ++e) {
        key[e] = Sigmoid(z[e]) + bias[e];
        order[e] = static_cast<int32_t>(e);
      }
      std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int32_t a, int32_t b) {
        return key[a] > key[b] || (key[a] == key[b] && a < b);
      });
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += Sigmoid(z[order[k]]);
      for (int64_t k = 0; k < K; ++k) {
        idx[t * K + k] = order[k];
        weights[t * K + k] = Sigmoid(z[order[k]]) / sum;
      }
      if (lse != nullptr) {
        float m = z[0];
        for (int64_t e = 1; e < E; ++e) m = std::max(m, z[e]);
        double s = 0.0;
        for (int64_t e = 0; e < E; ++e) s += std::exp(static_cast<double>(z[e] - m));
        lse[t] = m + static_cast<float>(std::log(s));
      }
    }
  }
}

void MoeRouterBackward(const float* logits, const int32_t* idx, const float* dweights,
                       const float* lse, float zloss_scale, float* dlogits, int64_t T, int64_t E,
                       int64_t K) {
#pragma omp parallel for
  for (int64_t t = 0; t < T; ++t) {
    const float* z = logits + t * E;
    float* dz = dlogits + t * E;
    if (zloss_scale != 0.0f) {
      const float c = zloss_scale * 2.0f * lse[t];
      for (int64_t e = 0; e < E; ++e) dz[e] = c * std::exp(z[e] - lse[t]);
    } else {
      std::fill(dz, dz + E, 0.0f);
    }
    // g_k = s_k / S: dL/ds_j = (dg_j - sum_k g_k dg_k) / S for chosen j; ds/dz = s (1 - s).
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) sum += Sigmoid(z[idx[t * K + k]]);
    float dot = 0.0f;
    for (int64_t k = 0; k < K; ++k) dot += Sigmoid(z[idx[t * K + k]]) / sum * dweights[t * K + k];
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx[t * K + k];
      const float s = Sigmoid(z[e]);
      dz[e] += (dweights[t * K + k] - dot) / sum * s * (1.0f - s);
    }
  }
}

void MoeGroupRows(const int32_t* key, int64_t n, int64_t per_source, int64_t E, int64_t align,
                  int64_t* counts, int64_t* offsets, int32_t* item_row, int32_t* row_source) {
  std::fill(counts, counts + E, int64_t{0});
  for (int64_t i = 0; i < n; ++i) ++counts[key[i]];
  offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    offsets[e + 1] = offsets[e] + (counts[e] + align - 1) / align * align;
  }
  std::fill(row_source, row_source + offsets[E], -1);
  std::vector<int64_t> next(offsets, offsets + E);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = next[key[i]]++;
    item_row[i] = static_cast<int32_t>(r);
    row_source[r] = static_cast<int32_t>(i / per_source);
  }
}

void GatherRows(const float* in, const int32_t* src, float* out, int64_t rows, int64_t D) {
#pragma omp parallel for
  for (int64_t r = 0; r < rows; ++r) {
    if (src[r] < 0) {
      std::memset(out + r * D, 0, sizeof(float) * D);
    } else {
      std::memcpy(out + r * D, in + static_cast<int64_t>(src[r]) * D, sizeof(float) * D);
    }
  }
}

void MoeCombine(const float* y, const int32_t* row, const float* w, float* out, int64_t T,
                int64_t K, int64_t D, bool accumulate) {
#pragma omp parallel for
  for (int64_t t = 0; t < T; ++t) {
    float* o = out + t * D;
    if (!accumulate) std::fill(o, o + D, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float* src = y + static_cast<int64_t>(row[t * K + k]) * D;
      const float g = w != nullptr ? w[t * K + k] : 1.0f;
      for (int64_t j = 0; j < D; ++j) o[j] += g * src[j];
    }
  }
}

void MoeCombineBackward(const float* dout, const float* y, const int32_t* row, const float* w,
                        float* dy, float* dw, int64_t T, int64_t K, int64_t D) {
#pragma omp parallel for
  for (int64_t t = 0; t < T; ++t) {
    const float* g = dout + t * D;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = row[t * K + k];
      const float* src = y + r * D;
      float* d = dy + r * D;
      const float wk = w[t * K + k];
      double dot = 0.0;
      for (int64_t j = 0; j < D; ++j) {
        dot += static_cast<double>(g[j]) * src[j];
        d[j] = wk * g[j];
      }
      dw[t * K + k] = static_cast<float>(dot);
    }
  }
}

}  // namespace spindle::kernels::cpu
