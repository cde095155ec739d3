// MLA's keys and values from the compressed latent, and the two payloads of the Ring level
// (common/cp_modes.h: MlaRingPayload), on the CPU.
//
// The latent of a token is [c_n (kv values), RoPE'd k_r (rd values)]; with kv_b's rows for H heads
// ([H (nope + vd), kv], head-major) its key is [W c_n (nope), k_r] per head and its value the
// other vd rows. The AllGather mode rebuilds the keys of the gathered prefix this way; the Ring
// level rebuilds each block it receives when the latent is what travels.
// Not thread-safe: the scratch belongs to the caller.
#pragma once

#include <cstdint>
#include <vector>

#include "worker/engine/cp/cp_ring_cpu.h"

namespace spindle {

struct MlaHeads {
  int64_t H, nope, rd, vd, kv;  // heads, head sizes, latent rank
  int64_t qk() const { return nope + rd; }
  int64_t latent() const { return kv + rd; }
};

// K [n, H, qk] and V [n, H, vd] from the latent rows lat [n, kv + rd]. kvb: scratch, grown to
// n * H * (nope + vd).
void MlaExpandLatent(const float* lat, int64_t n, const float* W_kv_b, const MlaHeads& h,
                     std::vector<float>& kvb, float* K, float* V);
// The gradient: dK, dV -> d_lat [n, kv + rd] (overwritten; the rope part summed over heads) and
// dW_kv_b += the rows' share. dkvb: scratch.
void MlaContractLatent(const float* lat, int64_t n, const float* dK, const float* dV,
                       const float* W_kv_b, const MlaHeads& h, std::vector<float>& dkvb,
                       float* d_lat, float* dW_kv_b);

// The keys and values themselves: a block is [K (n H qk) | V (n H vd)].
class KvRingPayload : public RingPayload {
 public:
  KvRingPayload(int64_t H, int64_t qk, int64_t vd) : H_(H), qk_(qk), vd_(vd) {}
  int64_t width() const override { return H_ * (qk_ + vd_); }
  void Expand(const float* block, int64_t n, const float** K, const float** V) override;
  void Contract(const float* block, int64_t n, const float* dK, const float* dV,
                float* d_block) override;

 private:
  const int64_t H_, qk_, vd_;
};

// The latent, [n, kv + rd]; keys and values rebuilt with the kv_b rows of the heads computed here
// (W_kv_b and dW_kv_b point at the first of them).
class LatentRingPayload : public RingPayload {
 public:
  LatentRingPayload(const MlaHeads& h, const float* W_kv_b, float* dW_kv_b)
      : h_(h), W_(W_kv_b), dW_(dW_kv_b) {}
  int64_t width() const override { return h_.latent(); }
  void Expand(const float* block, int64_t n, const float** K, const float** V) override;
  void Contract(const float* block, int64_t n, const float* dK, const float* dV,
                float* d_block) override;

 private:
  const MlaHeads h_;
  const float* W_;
  float* dW_;
  std::vector<float> K_, V_, kvb_;
};

}  // namespace spindle
