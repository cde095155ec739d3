// CPU benchmark: time per op (forward, backward) at the `small` preset's shapes, and tokens/s of
// a whole training step (forward, backward, AdamW) for the `tiny` and `small` presets.
// Prints a table; medians over repeats after one warm-up. Threads: OMP_NUM_THREADS.
//
//   bench_cpu [--T 4096] [--repeats 5] [--steps 4]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/lightning.h"
#include "kernels/cpu/ops.h"
#include "worker/engine/batch.h"
#include "worker/engine/data.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"

namespace k = spindle::kernels::cpu;

namespace {

double MedianMs(int repeats, const std::function<void()>& fn) {
  fn();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::vector<float> Random(int64_t n, std::mt19937& g, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(g);
  return v;
}

void Row(const char* op, const std::string& shape, double fwd, double bwd) {
  std::printf("| %-22s | %-28s | %9.2f | %9.2f |\n", op, shape.c_str(), fwd, bwd);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t T = 4096;
  int repeats = 5, steps = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--T") T = std::atoll(argv[i + 1]);
    if (a == "--repeats") repeats = std::atoi(argv[i + 1]);
    if (a == "--steps") steps = std::atoi(argv[i + 1]);
  }
  std::mt19937 g(1);
  const spindle::ModelConfig c = *spindle::ModelPreset("small");
  const int64_t d = c.d_model, H = c.n_heads, Dh = c.head_dim(), F = c.ffn_dim, V = c.vocab;
  std::printf("Spindle CPU benchmark, %d threads, T = %lld, `small` shapes (d %lld, H %lld, "
              "ffn %lld, vocab %lld)\n\n",
              omp_get_max_threads(), static_cast<long long>(T), static_cast<long long>(d),
              static_cast<long long>(H), static_cast<long long>(F), static_cast<long long>(V));
  std::printf("| %-22s | %-28s | %9s | %9s |\n", "op", "shape", "fwd ms", "bwd ms");
  std::printf("|%s|%s|%s|%s|\n", std::string(24, '-').c_str(), std::string(30, '-').c_str(),
              std::string(11, '-').c_str(), std::string(11, '-').c_str());

  std::vector<int32_t> ids(T), pos(T), idx(T), doc(T, 0), tgt(T);
  for (int64_t t = 0; t < T; ++t) ids[t] = tgt[t] = static_cast<int32_t>(g() % V), pos[t] = idx[t] = static_cast<int32_t>(t);
  auto x = Random(T * d, g), y = std::vector<float>(T * d), dy = Random(T * d, g), dx = std::vector<float>(T * d);
  auto table = Random(V * d, g), dtable = std::vector<float>(V * d);
  auto w = Random(d, g), dw = std::vector<float>(d), rstd = std::vector<float>(T * H);
  std::string td = std::to_string(T) + " x " + std::to_string(d);

  Row("embedding", td, MedianMs(repeats, [&] { k::EmbeddingForward(ids.data(), table.data(), y.data(), T, d); }),
      MedianMs(repeats, [&] { k::EmbeddingBackward(ids.data(), dy.data(), dtable.data(), T, d, V); }));
  Row("rmsnorm", td, MedianMs(repeats, [&] { k::RmsNormForward(x.data(), w.data(), y.data(), rstd.data(), T, d, 1e-6f); }),
      MedianMs(repeats, [&] { k::RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), T, d); }));
  Row("rope (q, per head)", td, MedianMs(repeats, [&] { k::RopeApply(y.data(), pos.data(), T, H, Dh, d, Dh, 1e4f, false); }),
      MedianMs(repeats, [&] { k::RopeApply(y.data(), pos.data(), T, H, Dh, d, Dh, 1e4f, true); }));
  auto W3 = Random(3 * d * d, g, 0.05f), dW3 = std::vector<float>(3 * d * d), y3 = std::vector<float>(T * 3 * d), dy3 = Random(T * 3 * d, g);
  Row("linear d -> 3d", td + " -> 3d", MedianMs(repeats, [&] { k::LinearForward(x.data(), W3.data(), y3.data(), T, d, 3 * d); }),
      MedianMs(repeats, [&] { k::LinearBackward(x.data(), W3.data(), dy3.data(), dx.data(), dW3.data(), T, d, 3 * d); }));
  auto gg = Random(T * F, g), uu = Random(T * F, g), yf = std::vector<float>(T * F), dyf = Random(T * F, g), dg = std::vector<float>(T * F), du = std::vector<float>(T * F);
  Row("swiglu", std::to_string(T) + " x " + std::to_string(F), MedianMs(repeats, [&] { k::SwiGluForward(gg.data(), uu.data(), yf.data(), T * F); }),
      MedianMs(repeats, [&] { k::SwiGluBackward(gg.data(), uu.data(), dyf.data(), dg.data(), du.data(), T * F); }));
  auto gate = Random(T * d, g), dgate = std::vector<float>(T * d), wd = Random(d, g);
  Row("group norm + gate", td, MedianMs(repeats, [&] { k::GroupNormGateForward(x.data(), wd.data(), gate.data(), y.data(), rstd.data(), T, H, Dh, 1e-6f); }),
      MedianMs(repeats, [&] { k::GroupNormGateBackward(x.data(), wd.data(), gate.data(), rstd.data(), dy.data(), dx.data(), dw.data(), dgate.data(), T, H, Dh); }));
  {
    auto q = Random(T * d, g, 0.3f), kk = Random(T * d, g, 0.3f), v = Random(T * d, g), o = std::vector<float>(T * d);
    auto dq = std::vector<float>(T * d), dk = std::vector<float>(T * d), dv = std::vector<float>(T * d);
    std::vector<float> ld(H);
    for (int64_t h = 0; h < H; ++h) ld[h] = -std::pow(2.0f, -8.0f * (h + 1) / H);
    std::vector<int32_t> cu = {0, static_cast<int32_t>(T)};
    k::LightningDims dims{T, H, Dh, d};
    const float s = 1.0f / std::sqrt(static_cast<float>(Dh));
    Row("lightning", std::to_string(T) + " x " + std::to_string(H) + " x " + std::to_string(Dh),
        MedianMs(repeats, [&] { k::LightningForward(q.data(), kk.data(), v.data(), ld.data(), cu.data(), 1, nullptr, s, dims, o.data(), nullptr); }),
        MedianMs(repeats, [&] { k::LightningBackward(q.data(), kk.data(), v.data(), ld.data(), cu.data(), 1, nullptr, s, dims, dy.data(), nullptr, dq.data(), dk.data(), dv.data(), nullptr); }));
  }
  {
    const int64_t qk = c.mla.qk_nope_dim + c.mla.qk_rope_dim, vd = c.mla.v_head_dim;
    auto q = Random(T * H * qk, g, 0.3f), kk = Random(T * H * qk, g, 0.3f), v = Random(T * H * vd, g);
    auto o = std::vector<float>(T * H * vd), lse = std::vector<float>(T * H), dO = Random(T * H * vd, g);
    auto dq = std::vector<float>(T * H * qk), dk = std::vector<float>(T * H * qk), dv = std::vector<float>(T * H * vd);
    k::AttentionMask m{doc.data(), idx.data(), doc.data(), idx.data()};
    k::AttentionDims ad{T, T, H, qk, vd};
    const float s = 1.0f / std::sqrt(static_cast<float>(qk));
    Row("mla attention (causal)", std::to_string(T) + " x " + std::to_string(H) + " x " + std::to_string(qk) + "/" + std::to_string(vd),
        MedianMs(repeats, [&] { k::AttentionForward(q.data(), kk.data(), v.data(), m, s, ad, o.data(), lse.data()); }),
        MedianMs(repeats, [&] { k::AttentionBackward(q.data(), kk.data(), v.data(), o.data(), lse.data(), dO.data(), m, s, ad, dq.data(), dk.data(), dv.data()); }));
  }
  {
    auto logits = Random(T * V, g), dl = std::vector<float>(T * V);
    int64_t n = 0;
    Row("cross-entropy (+grad)", std::to_string(T) + " x " + std::to_string(V),
        MedianMs(repeats, [&] { k::CrossEntropy(logits.data(), tgt.data(), T, V, 1.0f, nullptr, &n); }),
        MedianMs(repeats, [&] { k::CrossEntropy(logits.data(), tgt.data(), T, V, 1.0f, dl.data(), &n); }));
  }
  {
    const int64_t n = c.NumParams();
    auto p = Random(n, g), gr = Random(n, g), m = std::vector<float>(n), v = std::vector<float>(n);
    k::AdamWParams hp{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
    Row("adamw (all params)", std::to_string(n) + " params", MedianMs(repeats, [&] { k::AdamWStep(p.data(), gr.data(), m.data(), v.data(), n, hp); }), 0.0);
  }

  std::printf("\n| %-8s | %-7s | %9s | %11s | %10s |\n", "preset", "T", "params M", "step s", "tokens/s");
  std::printf("|----------|---------|-----------|-------------|------------|\n");
  for (const char* preset : {"tiny", "small"}) {
    const spindle::ModelConfig mc = *spindle::ModelPreset(preset);
    auto model = spindle::Model::Create(mc, 1);
    spindle::TrainSpec ts;
    spindle::Optimizer opt(ts, (*model)->params());
    spindle::DataSpec ds;
    ds.task = "recall";
    auto data = spindle::OpenDataSource(ds, T, mc.vocab, 1);
    spindle::Batch b = spindle::MakeSequenceBatch((*data)->Sequence(0), (*data)->eos_id());
    std::vector<double> times;
    for (int s = 0; s < steps + 1; ++s) {
      auto t0 = std::chrono::steady_clock::now();
      (*model)->params().ZeroGrad();
      (*model)->ForwardBackward(b, 1.0f / static_cast<float>(b.NumValidTargets()),
                                spindle::Recompute::None());
      opt.Step(1e-3);
      if (s > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
    const double st = times[times.size() / 2];
    std::printf("| %-8s | %-7lld | %9.2f | %11.3f | %10.0f |\n", preset, static_cast<long long>(T),
                mc.NumParams() / 1e6, st, T / st);
  }
  return 0;
}
