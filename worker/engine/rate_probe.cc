// CPU kernel rates (see rate_probe.h).
#include "worker/engine/rate_probe.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "common/model_config.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/lightning.h"
#include "kernels/cpu/ops.h"

namespace spindle {
namespace {

namespace k = kernels::cpu;

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = u(g);
  return x;
}

// Seconds of the fastest of the runs of `f` made within `budget` seconds (at least two), after
// one warm-up run.
double Fastest(const std::function<void()>& f, double budget) {
  using Clock = std::chrono::steady_clock;
  f();
  double best = 1e30, spent = 0;
  for (int i = 0; i < 2 || spent < budget; ++i) {
    const auto t0 = Clock::now();
    f();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::min(best, s);
    spent += s;
    if (i > 1000) break;
  }
  return std::max(best, 1e-9);
}

}  // namespace

nlohmann::json MeasuredRates::ToJson() const {
  return {{"gemm_flops", gemm_flops},
          {"attention_flops", attention_flops},
          {"lightning_flops", lightning_flops},
          {"memory_bytes", memory_bytes},
          {"copy_bytes", copy_bytes}};
}

MeasuredRates MeasureCpuRates(const ProbeShape& s, double seconds_each) {
  MeasuredRates r;
  const int64_t T = s.tokens, d = s.d_model, f = s.ffn_dim, H = s.heads, Dh = d / H;
  // The FLOPs counted as ModelConfig counts them, for these shapes.
  ModelConfig counted;
  counted.d_model = d;
  counted.n_heads = H;
  counted.mla.qk_nope_dim = s.qk_dim;
  counted.mla.qk_rope_dim = 0;
  counted.mla.v_head_dim = s.v_dim;
  {  // The FFN's up projection and its backward: 6 T d f FLOPs.
    std::vector<float> x = Random(T * d, 1), W = Random(f * d, 2), y(T * f), dy = Random(T * f, 3),
                       dx(T * d), dW(f * d);
    const double t = Fastest(
        [&] {
          k::LinearForward(x.data(), W.data(), y.data(), T, d, f);
          k::LinearBackward(x.data(), W.data(), dy.data(), dx.data(), dW.data(), T, d, f);
        },
        seconds_each);
    r.gemm_flops = 6.0 * T * d * f / t;
  }
  {  // Causal attention of one document, forward + backward, over T^2 / 2 pairs.
    const int64_t qk = s.qk_dim, v = s.v_dim;
    std::vector<float> q = Random(T * H * qk, 4), kk = Random(T * H * qk, 5), vv = Random(T * H * v, 6),
                       o(T * H * v), lse(T * H), dout = Random(T * H * v, 7), dq(T * H * qk),
                       dk(T * H * qk), dv(T * H * v);
    std::vector<int32_t> doc(T, 0), pos(T);
    for (int64_t i = 0; i < T; ++i) pos[i] = static_cast<int32_t>(i);
    const k::AttentionMask mask{doc.data(), pos.data(), doc.data(), pos.data()};
    const k::AttentionDims dims{T, T, H, qk, v};
    const float scale = 1.0f / std::sqrt(static_cast<float>(qk));
    const double t = Fastest(
        [&] {
          k::AttentionForward(q.data(), kk.data(), vv.data(), mask, scale, dims, o.data(),
                              lse.data());
          k::AttentionBackward(q.data(), kk.data(), vv.data(), o.data(), lse.data(), dout.data(),
                               mask, scale, dims, dq.data(), dk.data(), dv.data());
        },
        seconds_each);
    r.attention_flops = counted.AttentionFlopsPerPair() * (static_cast<double>(T) * T / 2.0) / t;
  }
  {  // Chunked Lightning over one document, forward + backward.
    std::vector<float> qkv = Random(T * 3 * d, 8), log_decay(H), out(T * d), end(H * Dh * Dh),
                       dout = Random(T * d, 9), dqkv(T * 3 * d);
    for (int64_t h = 0; h < H; ++h) log_decay[h] = -0.05f * static_cast<float>(h + 1);
    const std::vector<int32_t> cu = {0, static_cast<int32_t>(T)};
    const k::LightningDims dims{T, H, Dh, 3 * d};
    const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
    const double t = Fastest(
        [&] {
          k::LightningForward(qkv.data(), qkv.data() + d, qkv.data() + 2 * d, log_decay.data(),
                              cu.data(), 1, nullptr, scale, dims, out.data(), end.data());
          k::LightningBackward(qkv.data(), qkv.data() + d, qkv.data() + 2 * d, log_decay.data(),
                               cu.data(), 1, nullptr, scale, dims, dout.data(), nullptr,
                               dqkv.data(), dqkv.data() + d, dqkv.data() + 2 * d, nullptr);
        },
        seconds_each);
    r.lightning_flops = T * counted.LightningFlopsPerToken() / t;
  }
  {  // SwiGLU forward and backward over [T, f]: reads 2 + 3, writes 1 + 2 arrays.
    std::vector<float> g = Random(T * f, 10), u = Random(T * f, 11), y(T * f),
                       dy = Random(T * f, 12), dg(T * f), du(T * f);
    const double t = Fastest(
        [&] {
          k::SwiGluForward(g.data(), u.data(), y.data(), T * f);
          k::SwiGluBackward(g.data(), u.data(), dy.data(), dg.data(), du.data(), T * f);
        },
        seconds_each);
    r.memory_bytes = 8.0 * static_cast<double>(T * f) * sizeof(float) / t;
  }
  {  // One thread's memcpy of an exchange's q, k, v and o ([T, 4 d] fp32) between warm buffers.
    const std::vector<float> src = Random(T * 4 * d, 13);
    std::vector<float> dst(src.size());
    const double t = Fastest(
        [&] { std::memcpy(dst.data(), src.data(), src.size() * sizeof(float)); }, seconds_each);
    r.copy_bytes = static_cast<double>(src.size() * sizeof(float)) / t;
  }
  return r;
}

}  // namespace spindle
