// Tests of the CPU Lightning attention kernels against a token-by-token fp64 recurrence (whose
// backward is itself checked by finite differences), on odd shapes, document layouts, carry-in,
// fused-buffer strides, and the sequence-split identities that context parallelism relies on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/lightning.h"

namespace spindle::kernels::cpu {
namespace {

// Tolerances of fp32 kernel results against the fp64 reference: |got - want| <= kAbs * scale +
// kRel * |want|, where scale = max(1, max |want|) over the compared tensor.
constexpr double kRel = 1e-4;
constexpr double kAbs = 2e-5;

uint32_t FreshSeed() { return std::random_device{}(); }

// Fails (NaN included) unless every got[i] matches want[i] within the tolerances above.
void ExpectNear(const std::vector<float>& got, const std::vector<double>& want,
                const std::string& what, double abs_tol = kAbs, double rel_tol = kRel) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double peak = 1.0;
  for (double w : want) peak = std::max(peak, std::abs(w));
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= abs_tol * peak + rel_tol * std::abs(want[i]))) {
      if (++bad <= 5) {
        ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i]
                      << " (peak " << peak << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements off";
}

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want,
                const std::string& what, double abs_tol = kAbs, double rel_tol = kRel) {
  ExpectNear(got, std::vector<double>(want.begin(), want.end()), what, abs_tol, rel_tol);
}

// One problem instance. q, k, v live inside one fused [T, stride] buffer at column offsets
// 0, H*Dh and 2*H*Dh, with `stride - 3*H*Dh` padding columns after them.
struct Problem {
  int64_t T, H, Dh, stride;
  std::vector<int32_t> cu;                   // cu_seqlens, n_segments + 1 entries
  std::vector<float> qkv, log_decay, carry;  // carry empty = none
  float scale;

  int64_t segments() const { return static_cast<int64_t>(cu.size()) - 1; }
  LightningDims dims() const { return {T, H, Dh, stride}; }
  const float* q() const { return qkv.data(); }
  const float* k() const { return qkv.data() + H * Dh; }
  const float* v() const { return qkv.data() + 2 * H * Dh; }
  const float* carry_ptr() const { return carry.empty() ? nullptr : carry.data(); }
  // Element (t, h, i) of q (which = 0), k (1) or v (2) inside a fused buffer.
  int64_t at(int which, int64_t t, int64_t h, int64_t i) const {
    return t * stride + which * H * Dh + h * Dh + i;
  }
};

std::vector<float> Normal(std::mt19937& rng, int64_t n, float sd = 1.0f) {
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

// Decays as the model sets them, for a layer in the middle of the stack.
std::vector<float> ModelDecays(int64_t H) {
  std::vector<float> ld(H);
  for (int64_t h = 0; h < H; ++h) {
    ld[h] = static_cast<float>(-std::pow(2.0, -8.0 * (h + 1) / H) * 0.5);
  }
  return ld;
}

enum class Layout { kOneDoc, kInsideChunk, kChunkEdges, kTinyDocs, kLongDoc };
constexpr Layout kLayouts[] = {Layout::kOneDoc, Layout::kInsideChunk, Layout::kChunkEdges,
                               Layout::kTinyDocs, Layout::kLongDoc};

std::string LayoutName(Layout l) {
  switch (l) {
    case Layout::kOneDoc:
      return "one_doc";
    case Layout::kInsideChunk:
      return "inside_chunk";
    case Layout::kChunkEdges:
      return "chunk_edges";
    case Layout::kTinyDocs:
      return "tiny_docs";
    case Layout::kLongDoc:
      return "long_doc";
  }
  return "?";
}

std::vector<int32_t> MakeSegments(Layout layout, int64_t T, std::mt19937& rng) {
  std::vector<int32_t> starts;
  switch (layout) {
    case Layout::kOneDoc:
      break;
    case Layout::kInsideChunk:
      starts = {3, 30, 31, 100, 130, 190};
      break;
    case Layout::kChunkEdges:
      starts = {64, 128, 192, 256, 320};
      break;
    case Layout::kTinyDocs: {
      std::uniform_int_distribution<int32_t> len(1, 3);
      for (int32_t t = len(rng); t < T; t += len(rng)) starts.push_back(t);
      break;
    }
    case Layout::kLongDoc:
      starts = {5};
      break;
  }
  std::vector<int32_t> cu = {0};
  for (int32_t s : starts) {
    if (s < T) cu.push_back(s);
  }
  cu.push_back(static_cast<int32_t>(T));
  return cu;
}

Problem MakeProblem(int64_t T, int64_t H, int64_t Dh, Layout layout, bool with_carry,
                    std::mt19937& rng) {
  Problem p;
  p.T = T;
  p.H = H;
  p.Dh = Dh;
  p.stride = 3 * H * Dh + 3;
  p.cu = MakeSegments(layout, T, rng);
  p.qkv = Normal(rng, T * p.stride);
  p.log_decay = ModelDecays(H);
  if (with_carry) p.carry = Normal(rng, H * Dh * Dh, 2.0f);
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dh)));
  return p;
}

// ---- fp64 reference: the recurrence token by token --------------------------------------------

struct RefForward {
  std::vector<double> out;        // [T, H, Dh]
  std::vector<double> end_state;  // [H, Dh, Dh]
};

bool IsSegmentStart(const Problem& p, int64_t t) {
  return std::binary_search(p.cu.begin() + 1, p.cu.end() - 1, static_cast<int32_t>(t));
}

// States S_t of head h for every token (before the output), [T, Dh, Dh].
std::vector<double> RefStates(const Problem& p, const std::vector<double>& qkv,
                              const std::vector<double>& carry, int64_t h) {
  const int64_t dh = p.Dh;
  const double a = std::exp(static_cast<double>(p.log_decay[h]));
  std::vector<double> s(dh * dh, 0.0), states(p.T * dh * dh);
  if (!carry.empty())
    std::copy(carry.begin() + h * dh * dh, carry.begin() + (h + 1) * dh * dh, s.begin());
  for (int64_t t = 0; t < p.T; ++t) {
    if (IsSegmentStart(p, t)) std::fill(s.begin(), s.end(), 0.0);
    for (int64_t i = 0; i < dh; ++i) {
      for (int64_t j = 0; j < dh; ++j) {
        s[i * dh + j] = a * s[i * dh + j] + qkv[p.at(1, t, h, i)] * qkv[p.at(2, t, h, j)];
      }
    }
    std::copy(s.begin(), s.end(), states.begin() + t * dh * dh);
  }
  return states;
}

RefForward RefLightningForward(const Problem& p, const std::vector<double>& qkv,
                               const std::vector<double>& carry) {
  const int64_t dh = p.Dh;
  RefForward r{std::vector<double>(p.T * p.H * dh), std::vector<double>(p.H * dh * dh)};
  for (int64_t h = 0; h < p.H; ++h) {
    const std::vector<double> states = RefStates(p, qkv, carry, h);
    for (int64_t t = 0; t < p.T; ++t) {
      const double* s = states.data() + t * dh * dh;
      for (int64_t j = 0; j < dh; ++j) {
        double acc = 0.0;
        for (int64_t i = 0; i < dh; ++i) acc += qkv[p.at(0, t, h, i)] * s[i * dh + j];
        r.out[(t * p.H + h) * dh + j] = p.scale * acc;
      }
    }
    for (int64_t i = 0; i < dh * dh; ++i) {
      r.end_state[h * dh * dh + i] = p.T > 0 ? states[(p.T - 1) * dh * dh + i]
                                             : (carry.empty() ? 0.0 : carry[h * dh * dh + i]);
    }
  }
  return r;
}

struct RefGrads {
  std::vector<double> dqkv;    // fused layout like Problem::qkv (padding stays 0)
  std::vector<double> dcarry;  // [H, Dh, Dh]
};

// Reverse recurrence: dS_t = scale q_t^T g_t + a dS_{t+1} inside a segment (d_end flows into the
// last token's state), dq_t = scale g_t S_t^T, dk_t = v_t dS_t^T, dv_t = k_t dS_t.
RefGrads RefLightningBackward(const Problem& p, const std::vector<double>& qkv,
                              const std::vector<double>& carry, const std::vector<double>& dout,
                              const std::vector<double>& d_end) {
  const int64_t dh = p.Dh;
  RefGrads g{std::vector<double>(qkv.size(), 0.0), std::vector<double>(p.H * dh * dh, 0.0)};
  for (int64_t h = 0; h < p.H; ++h) {
    const double a = std::exp(static_cast<double>(p.log_decay[h]));
    const std::vector<double> states = RefStates(p, qkv, carry, h);
    std::vector<double> ds(dh * dh, 0.0);
    if (!d_end.empty())
      std::copy(d_end.begin() + h * dh * dh, d_end.begin() + (h + 1) * dh * dh, ds.begin());
    if (p.T == 0) std::copy(ds.begin(), ds.end(), g.dcarry.begin() + h * dh * dh);
    for (int64_t t = p.T - 1; t >= 0; --t) {
      const double* gt = dout.data() + (t * p.H + h) * dh;
      const double* s = states.data() + t * dh * dh;
      for (int64_t i = 0; i < dh; ++i) {
        for (int64_t j = 0; j < dh; ++j) ds[i * dh + j] += p.scale * qkv[p.at(0, t, h, i)] * gt[j];
      }
      for (int64_t i = 0; i < dh; ++i) {
        double dq = 0.0, dk = 0.0, dv = 0.0;
        for (int64_t j = 0; j < dh; ++j) {
          dq += gt[j] * s[i * dh + j];
          dk += qkv[p.at(2, t, h, j)] * ds[i * dh + j];
          dv += qkv[p.at(1, t, h, j)] * ds[j * dh + i];
        }
        g.dqkv[p.at(0, t, h, i)] = p.scale * dq;
        g.dqkv[p.at(1, t, h, i)] = dk;
        g.dqkv[p.at(2, t, h, i)] = dv;
      }
      if (t == 0) {
        for (int64_t i = 0; i < dh * dh; ++i) g.dcarry[h * dh * dh + i] = a * ds[i];
      }
      if (IsSegmentStart(p, t)) {
        std::fill(ds.begin(), ds.end(), 0.0);
      } else {
        for (double& e : ds) e *= a;
      }
    }
  }
  return g;
}

std::vector<double> ToDouble(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// The kernel on a problem: out, end_state.
struct KernelForward {
  std::vector<float> out, end_state;
};

KernelForward RunForward(const Problem& p) {
  KernelForward r{std::vector<float>(p.T * p.H * p.Dh, std::nanf("")),
                  std::vector<float>(p.H * p.Dh * p.Dh, std::nanf(""))};
  LightningForward(p.q(), p.k(), p.v(), p.log_decay.data(), p.cu.data(), p.segments(),
                   p.carry_ptr(), p.scale, p.dims(), r.out.data(), r.end_state.data());
  return r;
}

struct KernelGrads {
  std::vector<float> dqkv, dcarry;
};

KernelGrads RunBackward(const Problem& p, const std::vector<float>& dout,
                        const std::vector<float>& d_end) {
  // NaN everywhere: the kernel must overwrite every q/k/v gradient and leave the padding alone.
  KernelGrads g{std::vector<float>(p.qkv.size(), std::nanf("")),
                std::vector<float>(p.H * p.Dh * p.Dh, std::nanf(""))};
  float* d = g.dqkv.data();
  LightningBackward(p.q(), p.k(), p.v(), p.log_decay.data(), p.cu.data(), p.segments(),
                    p.carry_ptr(), p.scale, p.dims(), dout.data(),
                    d_end.empty() ? nullptr : d_end.data(), d, d + p.H * p.Dh, d + 2 * p.H * p.Dh,
                    g.dcarry.data());
  return g;
}

// The q/k/v part of a fused gradient (padding columns dropped), and checks the padding untouched.
std::vector<float> QkvPart(const Problem& p, const std::vector<float>& fused) {
  std::vector<float> r;
  for (int64_t t = 0; t < p.T; ++t) {
    for (int64_t c = 0; c < p.stride; ++c) {
      const float x = fused[t * p.stride + c];
      if (c < 3 * p.H * p.Dh) {
        r.push_back(x);
      } else {
        EXPECT_TRUE(std::isnan(x)) << "padding column " << c << " of token " << t << " written";
      }
    }
  }
  return r;
}

std::vector<double> QkvPart(const Problem& p, const std::vector<double>& fused) {
  std::vector<double> r;
  for (int64_t t = 0; t < p.T; ++t) {
    for (int64_t c = 0; c < 3 * p.H * p.Dh; ++c) r.push_back(fused[t * p.stride + c]);
  }
  return r;
}

std::string Describe(const Problem& p, Layout layout) {
  return "T=" + std::to_string(p.T) + " H=" + std::to_string(p.H) + " Dh=" + std::to_string(p.Dh) +
         " layout=" + LayoutName(layout) + " segments=" + std::to_string(p.segments()) +
         " carry=" + (p.carry.empty() ? "no" : "yes");
}

// ---- the reference itself ---------------------------------------------------------------------

// The fp64 reference backward matches central differences of the fp64 reference forward for
// L = sum(out * dout) + sum(end_state * d_end). L is linear in every single input element, so
// the differences are exact up to rounding.
TEST(LightningReference, BackwardMatchesFiniteDifferences) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (Layout layout : {Layout::kOneDoc, Layout::kInsideChunk, Layout::kTinyDocs}) {
    Problem p = MakeProblem(37, 2, 3, layout, /*with_carry=*/true, rng);
    SCOPED_TRACE(Describe(p, layout));
    const std::vector<double> dout = ToDouble(Normal(rng, p.T * p.H * p.Dh));
    const std::vector<double> d_end = ToDouble(Normal(rng, p.H * p.Dh * p.Dh));
    std::vector<double> qkv = ToDouble(p.qkv), carry = ToDouble(p.carry);
    auto loss = [&]() {
      const RefForward f = RefLightningForward(p, qkv, carry);
      double l = 0.0;
      for (size_t i = 0; i < f.out.size(); ++i) l += f.out[i] * dout[i];
      for (size_t i = 0; i < f.end_state.size(); ++i) l += f.end_state[i] * d_end[i];
      return l;
    };
    const RefGrads g = RefLightningBackward(p, qkv, carry, dout, d_end);
    const double eps = 1e-3;
    auto check = [&](std::vector<double>& x, const std::vector<double>& grad, const char* name) {
      for (size_t i = 0; i < x.size(); ++i) {
        const double x0 = x[i];
        x[i] = x0 + eps;
        const double lp = loss();
        x[i] = x0 - eps;
        const double lm = loss();
        x[i] = x0;
        const double fd = (lp - lm) / (2 * eps);
        ASSERT_NEAR(grad[i], fd, 1e-7 * (1 + std::abs(fd))) << name << "[" << i << "]";
      }
    };
    check(qkv, g.dqkv, "dqkv");
    check(carry, g.dcarry, "dcarry");
  }
}

// ---- forward ----------------------------------------------------------------------------------

TEST(LightningForward, MatchesRecurrenceOnOddShapes) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int64_t T : {1, 17, 63, 64, 65, 200, 333}) {
    for (int64_t H : {1, 3}) {
      for (int64_t Dh : {5, 16}) {
        for (Layout layout : kLayouts) {
          for (bool with_carry : {false, true}) {
            const Problem p = MakeProblem(T, H, Dh, layout, with_carry, rng);
            SCOPED_TRACE(Describe(p, layout));
            const RefForward want = RefLightningForward(p, ToDouble(p.qkv), ToDouble(p.carry));
            const KernelForward got = RunForward(p);
            ExpectNear(got.out, want.out, "out");
            ExpectNear(got.end_state, want.end_state, "end_state");
          }
        }
      }
    }
  }
}

// q, k, v as three separate dense buffers (token stride H*Dh), and a larger head size.
TEST(LightningForward, DenseBuffersAndWideHeads) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int64_t Dh : {64, 80}) {
    const int64_t T = 150, H = 2, n = T * H * Dh;
    const Problem p = MakeProblem(T, H, Dh, Layout::kInsideChunk, true, rng);
    std::vector<float> q(n), k(n), v(n);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < H * Dh; ++i) {
        q[t * H * Dh + i] = p.qkv[p.at(0, t, 0, i)];
        k[t * H * Dh + i] = p.qkv[p.at(1, t, 0, i)];
        v[t * H * Dh + i] = p.qkv[p.at(2, t, 0, i)];
      }
    }
    std::vector<float> out(n), end_state(H * Dh * Dh);
    LightningForward(q.data(), k.data(), v.data(), p.log_decay.data(), p.cu.data(), p.segments(),
                     p.carry_ptr(), p.scale, {T, H, Dh, H * Dh}, out.data(), end_state.data());
    const RefForward want = RefLightningForward(p, ToDouble(p.qkv), ToDouble(p.carry));
    ExpectNear(out, want.out, "out Dh=" + std::to_string(Dh));
    ExpectNear(end_state, want.end_state, "end_state Dh=" + std::to_string(Dh));
  }
}

// A slowly decaying head over a long document: powers of the decay must not drift.
TEST(LightningForward, LongDocumentSlowDecay) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  Problem p = MakeProblem(1000, 2, 8, Layout::kOneDoc, true, rng);
  p.log_decay = {-1e-4f, -2.0f};
  const RefForward want = RefLightningForward(p, ToDouble(p.qkv), ToDouble(p.carry));
  const KernelForward got = RunForward(p);
  ExpectNear(got.out, want.out, "out");
  ExpectNear(got.end_state, want.end_state, "end_state");
}

// ---- backward ---------------------------------------------------------------------------------

TEST(LightningBackward, MatchesReferenceOnOddShapes) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int64_t T : {1, 17, 63, 64, 65, 200, 333}) {
    for (int64_t H : {1, 3}) {
      for (int64_t Dh : {5, 16}) {
        for (Layout layout : kLayouts) {
          for (bool with_carry : {false, true}) {
            const Problem p = MakeProblem(T, H, Dh, layout, with_carry, rng);
            // Every other case without an end-state gradient (nullptr = zeros).
            const bool with_d_end = (T + H + Dh + static_cast<int>(layout)) % 2 == 0;
            SCOPED_TRACE(Describe(p, layout) + " d_end=" + (with_d_end ? "yes" : "no"));
            const std::vector<float> dout = Normal(rng, T * H * Dh);
            const std::vector<float> d_end =
                with_d_end ? Normal(rng, H * Dh * Dh) : std::vector<float>{};
            const RefGrads want = RefLightningBackward(p, ToDouble(p.qkv), ToDouble(p.carry),
                                                       ToDouble(dout), ToDouble(d_end));
            const KernelGrads got = RunBackward(p, dout, d_end);
            // Gradients are compared per tensor so that each gets its own scale.
            const std::vector<float> g = QkvPart(p, got.dqkv);
            const std::vector<double> w = QkvPart(p, want.dqkv);
            for (int which = 0; which < 3; ++which) {
              std::vector<float> gs;
              std::vector<double> ws;
              for (int64_t t = 0; t < T; ++t) {
                for (int64_t i = 0; i < H * Dh; ++i) {
                  gs.push_back(g[t * 3 * H * Dh + which * H * Dh + i]);
                  ws.push_back(w[t * 3 * H * Dh + which * H * Dh + i]);
                }
              }
              ExpectNear(gs, ws, std::string("d") + "qkv"[which]);
            }
            ExpectNear(got.dcarry, want.dcarry, "d_carry_in");
          }
        }
      }
    }
  }
}

// Head sizes above the chunk size (products split into several BLAS calls), and the nullable
// outputs: end_state and d_carry_in may be omitted without changing anything else.
TEST(LightningBackward, WideHeadsAndNullableOutputs) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int64_t Dh : {64, 80}) {
    const Problem p = MakeProblem(150, 2, Dh, Layout::kInsideChunk, /*with_carry=*/true, rng);
    SCOPED_TRACE(Describe(p, Layout::kInsideChunk));
    const std::vector<float> dout = Normal(rng, p.T * p.H * Dh);
    const std::vector<float> d_end = Normal(rng, p.H * Dh * Dh);
    const RefGrads want = RefLightningBackward(p, ToDouble(p.qkv), ToDouble(p.carry),
                                               ToDouble(dout), ToDouble(d_end));
    const KernelGrads got = RunBackward(p, dout, d_end);
    ExpectNear(QkvPart(p, got.dqkv), QkvPart(p, want.dqkv), "dqkv");
    ExpectNear(got.dcarry, want.dcarry, "d_carry_in");

    const KernelForward full = RunForward(p);
    std::vector<float> out(p.T * p.H * Dh, std::nanf(""));
    LightningForward(p.q(), p.k(), p.v(), p.log_decay.data(), p.cu.data(), p.segments(),
                     p.carry_ptr(), p.scale, p.dims(), out.data(), nullptr);
    EXPECT_EQ(out, full.out);
    std::vector<float> dqkv(p.qkv.size(), std::nanf(""));
    float* d = dqkv.data();
    LightningBackward(p.q(), p.k(), p.v(), p.log_decay.data(), p.cu.data(), p.segments(),
                      p.carry_ptr(), p.scale, p.dims(), dout.data(), d_end.data(), d, d + p.H * Dh,
                      d + 2 * p.H * Dh, nullptr);
    EXPECT_EQ(QkvPart(p, dqkv), QkvPart(p, got.dqkv));
  }
}

// ---- splitting a sequence (context parallelism) ------------------------------------------------

// The sub-problem of tokens [begin, end): segments clipped, carry supplied by the caller.
Problem Slice(const Problem& p, int64_t begin, int64_t end) {
  Problem s = p;
  s.T = end - begin;
  s.qkv.assign(p.qkv.begin() + begin * p.stride, p.qkv.begin() + end * p.stride);
  s.cu = {0};
  for (int32_t c : p.cu) {
    if (c > begin && c < end) s.cu.push_back(static_cast<int32_t>(c - begin));
  }
  s.cu.push_back(static_cast<int32_t>(s.T));
  s.carry.clear();
  return s;
}

bool StartsDocument(const Problem& p, int64_t t) {
  return std::find(p.cu.begin(), p.cu.end(), static_cast<int32_t>(t)) != p.cu.end();
}

TEST(LightningSplit, TwoPiecesEqualWhole) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (Layout layout : kLayouts) {
    for (int64_t split : {1, 30, 64, 100, 128, 199}) {
      const Problem whole = MakeProblem(200, 3, 16, layout, /*with_carry=*/true, rng);
      SCOPED_TRACE(Describe(whole, layout) + " split=" + std::to_string(split));
      Problem first = Slice(whole, 0, split), second = Slice(whole, split, whole.T);
      first.carry = whole.carry;
      const bool continues = !StartsDocument(whole, split);
      const KernelForward f1 = RunForward(first);
      if (continues) second.carry = f1.end_state;
      const KernelForward f2 = RunForward(second);
      const KernelForward fw = RunForward(whole);
      std::vector<float> joined = f1.out;
      joined.insert(joined.end(), f2.out.begin(), f2.out.end());
      ExpectNear(joined, fw.out, "out");
      ExpectNear(f2.end_state, fw.end_state, "end_state");

      // Backward: the second piece's d_carry_in is the first piece's end-state gradient.
      const std::vector<float> dout = Normal(rng, whole.T * whole.H * whole.Dh);
      const std::vector<float> d_end = Normal(rng, whole.H * whole.Dh * whole.Dh);
      const int64_t n1 = split * whole.H * whole.Dh;
      const KernelGrads gw = RunBackward(whole, dout, d_end);
      const KernelGrads g2 = RunBackward(second, {dout.begin() + n1, dout.end()}, d_end);
      const KernelGrads g1 = RunBackward(first, {dout.begin(), dout.begin() + n1},
                                         continues ? g2.dcarry : std::vector<float>{});
      std::vector<float> joined_grad = g1.dqkv;
      joined_grad.insert(joined_grad.end(), g2.dqkv.begin(), g2.dqkv.end());
      ExpectNear(QkvPart(whole, joined_grad), QkvPart(whole, gw.dqkv), "dqkv");
      ExpectNear(g1.dcarry, gw.dcarry, "d_carry_in");
    }
  }
}

// A piece run with zero carry plus LightningCarryCorrection equals the piece run with the carry.
TEST(LightningCarryCorrection, ZeroCarryPlusCorrectionEqualsCarry) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int64_t T : {1, 17, 65, 200}) {
    for (Layout layout : {Layout::kOneDoc, Layout::kInsideChunk, Layout::kTinyDocs}) {
      for (int64_t Dh : {5, 16}) {
        const Problem with = MakeProblem(T, 3, Dh, layout, /*with_carry=*/true, rng);
        SCOPED_TRACE(Describe(with, layout));
        Problem without = with;
        without.carry.clear();
        const int64_t n_first = with.cu[1];
        const KernelForward want = RunForward(with);
        KernelForward got = RunForward(without);
        LightningCarryCorrection(with.q(), with.log_decay.data(), with.carry.data(), with.scale,
                                 with.dims(), n_first, got.out.data());
        ExpectNear(got.out, want.out, "out");

        // Backward: dq of the zero-carry run plus the correction's dq equals dq with the carry;
        // dP equals d_carry_in when the end state does not depend on the carry.
        const std::vector<float> dout = Normal(rng, T * with.H * Dh);
        const KernelGrads gw = RunBackward(with, dout, {});
        KernelGrads g = RunBackward(without, dout, {});
        std::vector<float> dP(with.H * Dh * Dh, 0.0f);
        LightningCarryCorrectionBackward(with.q(), with.log_decay.data(), with.carry.data(),
                                         with.scale, with.dims(), n_first, dout.data(),
                                         g.dqkv.data(), dP.data());
        ExpectNear(QkvPart(with, g.dqkv), QkvPart(with, gw.dqkv), "dqkv");
        ExpectNear(dP, gw.dcarry, "dP");
        ExpectNear(g.dcarry, gw.dcarry, "d_carry_in (independent of the carry)");
      }
    }
  }
}

// The correction on its own against the formula, with accumulation into existing values.
TEST(LightningCarryCorrection, MatchesFormula) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const int64_t T = 150, H = 2, Dh = 7, n_tokens = 130;
  const Problem p = MakeProblem(T, H, Dh, Layout::kOneDoc, true, rng);
  std::vector<float> out = Normal(rng, T * H * Dh), dout = Normal(rng, T * H * Dh);
  std::vector<float> dq = Normal(rng, T * p.stride), dP = Normal(rng, H * Dh * Dh);
  std::vector<double> want_out(out.begin(), out.end()), want_dq(dq.begin(), dq.end()),
      want_dP(dP.begin(), dP.end());
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const double f = p.scale * std::exp((t + 1) * static_cast<double>(p.log_decay[h]));
      const float* P = p.carry.data() + h * Dh * Dh;
      for (int64_t i = 0; i < Dh; ++i) {
        for (int64_t j = 0; j < Dh; ++j) {
          want_out[(t * H + h) * Dh + j] += f * p.qkv[p.at(0, t, h, i)] * P[i * Dh + j];
          want_dq[p.at(0, t, h, i)] += f * dout[(t * H + h) * Dh + j] * P[i * Dh + j];
          want_dP[h * Dh * Dh + i * Dh + j] +=
              f * p.qkv[p.at(0, t, h, i)] * dout[(t * H + h) * Dh + j];
        }
      }
    }
  }
  LightningCarryCorrection(p.q(), p.log_decay.data(), p.carry.data(), p.scale, p.dims(), n_tokens,
                           out.data());
  LightningCarryCorrectionBackward(p.q(), p.log_decay.data(), p.carry.data(), p.scale, p.dims(),
                                   n_tokens, dout.data(), dq.data(), dP.data());
  ExpectNear(out, want_out, "out");
  ExpectNear(dq, want_dq, "dq");
  ExpectNear(dP, want_dP, "dP");
}

// Repeated runs give bit-identical results (no races, no order-dependent reductions).
TEST(LightningBackward, Deterministic) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const Problem p = MakeProblem(333, 3, 16, Layout::kTinyDocs, true, rng);
  const std::vector<float> dout = Normal(rng, p.T * p.H * p.Dh);
  const std::vector<float> d_end = Normal(rng, p.H * p.Dh * p.Dh);
  const KernelGrads first = RunBackward(p, dout, d_end);
  for (int rep = 0; rep < 3; ++rep) {
    const KernelGrads again = RunBackward(p, dout, d_end);
    EXPECT_EQ(0, std::memcmp(QkvPart(p, first.dqkv).data(), QkvPart(p, again.dqkv).data(),
                             sizeof(float) * p.T * 3 * p.H * p.Dh));
    EXPECT_EQ(first.dcarry, again.dcarry);
  }
}

}  // namespace
}  // namespace spindle::kernels::cpu
