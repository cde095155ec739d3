// Latent -> keys and values of MLA, and the Ring level's payloads (see cp_mla_payload.h).
#include "worker/engine/cp/cp_mla_payload.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/ops.h"
#include "worker/engine/cp/cp_buffers.h"

namespace spindle {
namespace k = kernels::cpu;

void MlaExpandLatent(const float* lat, int64_t n, const float* W_kv_b, const MlaHeads& h,
                     std::vector<float>& kvb_buf, float* K, float* V) {
  const int64_t H = h.H, nope = h.nope, rd = h.rd, vd = h.vd, kv = h.kv, qk = h.qk();
  const int64_t w = h.latent(), kvb_w = H * (nope + vd);
  float* kvb = Grow(kvb_buf, n * kvb_w);
  k::Gemm(false, true, n, kvb_w, kv, 1.0f, lat, w, W_kv_b, kv, 0.0f, kvb, kvb_w);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t)
    for (int64_t hh = 0; hh < H; ++hh) {
      const float* src = kvb + (t * H + hh) * (nope + vd);
      float* kd = K + (t * H + hh) * qk;
      std::memcpy(kd, src, nope * sizeof(float));
      std::memcpy(kd + nope, lat + t * w + kv, rd * sizeof(float));
      std::memcpy(V + (t * H + hh) * vd, src + nope, vd * sizeof(float));
    }
}

void MlaContractLatent(const float* lat, int64_t n, const float* dK, const float* dV,
                       const float* W_kv_b, const MlaHeads& h, std::vector<float>& dkvb_buf,
                       float* d_lat, float* dW_kv_b) {
  const int64_t H = h.H, nope = h.nope, rd = h.rd, vd = h.vd, kv = h.kv, qk = h.qk();
  const int64_t w = h.latent(), kvb_w = H * (nope + vd);
  float* dkvb = Grow(dkvb_buf, n * kvb_w);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    float* dkr = d_lat + t * w + kv;
    std::fill(dkr, dkr + rd, 0.0f);
    for (int64_t hh = 0; hh < H; ++hh) {
      float* dst = dkvb + (t * H + hh) * (nope + vd);
      const float* dk = dK + (t * H + hh) * qk;
      std::memcpy(dst, dk, nope * sizeof(float));
      std::memcpy(dst + nope, dV + (t * H + hh) * vd, vd * sizeof(float));
      for (int64_t j = 0; j < rd; ++j) dkr[j] += dk[nope + j];
    }
  }
  k::Gemm(true, false, kvb_w, kv, n, 1.0f, dkvb, kvb_w, lat, w, 1.0f, dW_kv_b, kv);
  k::Gemm(false, false, n, kv, kvb_w, 1.0f, dkvb, kvb_w, W_kv_b, kv, 0.0f, d_lat, w);
}

void KvRingPayload::Expand(const float* block, int64_t n, const float** K, const float** V) {
  *K = block;
  *V = block + n * H_ * qk_;
}

void KvRingPayload::Contract(const float*, int64_t n, const float* dK, const float* dV,
                             float* d_block) {
  std::memcpy(d_block, dK, n * H_ * qk_ * sizeof(float));
  std::memcpy(d_block + n * H_ * qk_, dV, n * H_ * vd_ * sizeof(float));
}

void LatentRingPayload::Expand(const float* block, int64_t n, const float** K, const float** V) {
  float* k_out = Grow(K_, n * h_.H * h_.qk());
  float* v_out = Grow(V_, n * h_.H * h_.vd);
  MlaExpandLatent(block, n, W_, h_, kvb_, k_out, v_out);
  *K = k_out;
  *V = v_out;
}

void LatentRingPayload::Contract(const float* block, int64_t n, const float* dK, const float* dV,
                                 float* d_block) {
  MlaContractLatent(block, n, dK, dV, W_, h_, kvb_, d_block, dW_);
}

}  // namespace spindle
