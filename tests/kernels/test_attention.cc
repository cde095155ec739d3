// Tests of the CPU document-masked causal attention against an fp64 reference that builds the
// full score matrix (its backward checked by finite differences): local causal attention, gathered
// keys for zigzag context-parallel slices, queries that see no key, and MLA head sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"

namespace spindle::kernels::cpu {
namespace {

// Tolerances of fp32 kernel results against the fp64 reference: |got - want| <= kAbs * scale +
// kRel * |want|, where scale = max(1, max |want|) over the compared tensor.
constexpr double kRel = 1e-4;
constexpr double kAbs = 2e-5;
constexpr double kInf = std::numeric_limits<double>::infinity();

uint32_t FreshSeed() { return std::random_device{}(); }

// Fails (NaN included) unless every got[i] matches want[i]; infinities must match exactly.
void ExpectNear(const std::vector<float>& got, const std::vector<double>& want,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double peak = 1.0;
  for (double w : want) {
    if (std::isfinite(w)) peak = std::max(peak, std::abs(w));
  }
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i];
    const bool ok = std::isinf(want[i])
                        ? g == want[i]
                        : std::abs(g - want[i]) <= kAbs * peak + kRel * std::abs(want[i]);
    if (!ok && ++bad <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements off";
}

struct AttnProblem {
  AttentionDims dims;
  std::vector<int32_t> q_doc, q_pos, k_doc, k_pos;
  std::vector<float> q, k, v;
  float scale;

  AttentionMask mask() const { return {q_doc.data(), q_pos.data(), k_doc.data(), k_pos.data()}; }
};

std::vector<float> Normal(std::mt19937& rng, int64_t n, float sd = 1.0f) {
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

// Document id of every token of a stream of n tokens, documents starting at `starts`.
std::vector<int32_t> DocIds(int64_t n, const std::vector<int64_t>& starts) {
  std::vector<int32_t> doc(n);
  int32_t id = 7;  // ids need not start at 0
  for (int64_t t = 0; t < n; ++t) {
    if (std::find(starts.begin(), starts.end(), t) != starts.end()) ++id;
    doc[t] = id;
  }
  return doc;
}

std::vector<int64_t> RandomStarts(int64_t n, int64_t count, std::mt19937& rng) {
  std::uniform_int_distribution<int64_t> pick(1, std::max<int64_t>(1, n - 1));
  std::vector<int64_t> s;
  for (int64_t i = 0; i < count && n > 1; ++i) s.push_back(pick(rng));
  return s;
}

// Queries are the stream tokens `q_tokens`, keys the tokens `k_tokens` (both ascending).
AttnProblem MakeProblem(int64_t stream_len, const std::vector<int64_t>& starts,
                        const std::vector<int64_t>& q_tokens, const std::vector<int64_t>& k_tokens,
                        int64_t H, int64_t Dqk, int64_t Dv, std::mt19937& rng) {
  const std::vector<int32_t> doc = DocIds(stream_len, starts);
  AttnProblem p;
  p.dims = {static_cast<int64_t>(q_tokens.size()), static_cast<int64_t>(k_tokens.size()), H, Dqk,
            Dv};
  for (int64_t t : q_tokens) {
    p.q_doc.push_back(doc[t]);
    p.q_pos.push_back(static_cast<int32_t>(t));
  }
  for (int64_t t : k_tokens) {
    p.k_doc.push_back(doc[t]);
    p.k_pos.push_back(static_cast<int32_t>(t));
  }
  p.q = Normal(rng, p.dims.Tq * H * Dqk, 1.5f);
  p.k = Normal(rng, p.dims.Tk * H * Dqk, 1.5f);
  p.v = Normal(rng, p.dims.Tk * H * Dv);
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dqk)));
  return p;
}

std::vector<int64_t> Range(int64_t begin, int64_t end) {
  std::vector<int64_t> r;
  for (int64_t t = begin; t < end; ++t) r.push_back(t);
  return r;
}

std::string Describe(const AttnProblem& p) {
  const AttentionDims& d = p.dims;
  return "Tq=" + std::to_string(d.Tq) + " Tk=" + std::to_string(d.Tk) +
         " H=" + std::to_string(d.H) + " Dqk=" + std::to_string(d.Dqk) +
         " Dv=" + std::to_string(d.Dv);
}

// ---- fp64 reference with the explicit score matrix ---------------------------------------------

struct RefResult {
  std::vector<double> out, lse, dq, dk, dv;
};

bool Visible(const AttnProblem& p, int64_t i, int64_t j) {
  return p.q_doc[i] == p.k_doc[j] && p.k_pos[j] <= p.q_pos[i];
}

RefResult RefAttention(const AttnProblem& p, const std::vector<double>& q,
                       const std::vector<double>& k, const std::vector<double>& v,
                       const std::vector<double>& dout) {
  const AttentionDims& d = p.dims;
  const int64_t H = d.H;
  RefResult r{std::vector<double>(d.Tq * H * d.Dv, 0.0), std::vector<double>(d.Tq * H, -kInf),
              std::vector<double>(d.Tq * H * d.Dqk, 0.0),
              std::vector<double>(d.Tk * H * d.Dqk, 0.0),
              std::vector<double>(d.Tk * H * d.Dv, 0.0)};
  std::vector<double> prob(d.Tk), dprob(d.Tk);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < d.Tq; ++i) {
      double m = -kInf;
      for (int64_t j = 0; j < d.Tk; ++j) {
        prob[j] = -kInf;
        if (!Visible(p, i, j)) continue;
        double s = 0.0;
        for (int64_t c = 0; c < d.Dqk; ++c)
          s += q[(i * H + h) * d.Dqk + c] * k[(j * H + h) * d.Dqk + c];
        prob[j] = p.scale * s;
        m = std::max(m, prob[j]);
      }
      if (m == -kInf) continue;
      double l = 0.0;
      for (int64_t j = 0; j < d.Tk; ++j) l += prob[j] == -kInf ? 0.0 : std::exp(prob[j] - m);
      for (int64_t j = 0; j < d.Tk; ++j)
        prob[j] = prob[j] == -kInf ? 0.0 : std::exp(prob[j] - m) / l;
      r.lse[i * H + h] = m + std::log(l);
      double* o = r.out.data() + (i * H + h) * d.Dv;
      for (int64_t j = 0; j < d.Tk; ++j) {
        for (int64_t c = 0; c < d.Dv; ++c) o[c] += prob[j] * v[(j * H + h) * d.Dv + c];
      }
      if (dout.empty()) continue;
      const double* g = dout.data() + (i * H + h) * d.Dv;
      double delta = 0.0;
      for (int64_t j = 0; j < d.Tk; ++j) {
        dprob[j] = 0.0;
        for (int64_t c = 0; c < d.Dv; ++c) dprob[j] += g[c] * v[(j * H + h) * d.Dv + c];
        delta += prob[j] * dprob[j];
      }
      for (int64_t j = 0; j < d.Tk; ++j) {
        if (prob[j] == 0.0) continue;
        const double ds = prob[j] * (dprob[j] - delta) * p.scale;
        for (int64_t c = 0; c < d.Dqk; ++c) {
          r.dq[(i * H + h) * d.Dqk + c] += ds * k[(j * H + h) * d.Dqk + c];
          r.dk[(j * H + h) * d.Dqk + c] += ds * q[(i * H + h) * d.Dqk + c];
        }
        for (int64_t c = 0; c < d.Dv; ++c) r.dv[(j * H + h) * d.Dv + c] += prob[j] * g[c];
      }
    }
  }
  return r;
}

std::vector<double> ToDouble(const std::vector<float>& x) { return {x.begin(), x.end()}; }

struct KernelResult {
  std::vector<float> out, lse, dq, dk, dv;
};

KernelResult RunKernel(const AttnProblem& p, const std::vector<float>& dout) {
  const AttentionDims& d = p.dims;
  const float nan = std::nanf("");
  KernelResult r{std::vector<float>(d.Tq * d.H * d.Dv, nan), std::vector<float>(d.Tq * d.H, nan),
                 std::vector<float>(d.Tq * d.H * d.Dqk, nan),
                 std::vector<float>(d.Tk * d.H * d.Dqk, nan),
                 std::vector<float>(d.Tk * d.H * d.Dv, nan)};
  AttentionForward(p.q.data(), p.k.data(), p.v.data(), p.mask(), p.scale, d, r.out.data(),
                   r.lse.data());
  AttentionBackward(p.q.data(), p.k.data(), p.v.data(), r.out.data(), r.lse.data(), dout.data(),
                    p.mask(), p.scale, d, r.dq.data(), r.dk.data(), r.dv.data());
  return r;
}

void CheckAgainstReference(const AttnProblem& p, std::mt19937& rng) {
  SCOPED_TRACE(Describe(p));
  const std::vector<float> dout = Normal(rng, p.dims.Tq * p.dims.H * p.dims.Dv);
  const RefResult want =
      RefAttention(p, ToDouble(p.q), ToDouble(p.k), ToDouble(p.v), ToDouble(dout));
  const KernelResult got = RunKernel(p, dout);
  ExpectNear(got.out, want.out, "out");
  ExpectNear(got.lse, want.lse, "lse");
  ExpectNear(got.dq, want.dq, "dq");
  ExpectNear(got.dk, want.dk, "dk");
  ExpectNear(got.dv, want.dv, "dv");
}

// ---- the reference itself ---------------------------------------------------------------------

TEST(AttentionReference, BackwardMatchesFiniteDifferences) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  // Queries are the later part of the stream; document 2 starts after the last key, so its
  // queries see nothing.
  const AttnProblem p = MakeProblem(14, {4, 11}, Range(3, 14), Range(0, 10), 2, 3, 2, rng);
  const std::vector<double> dout = ToDouble(Normal(rng, p.dims.Tq * p.dims.H * p.dims.Dv));
  std::vector<double> q = ToDouble(p.q), k = ToDouble(p.k), v = ToDouble(p.v);
  const RefResult g = RefAttention(p, q, k, v, dout);
  auto loss = [&]() {
    const RefResult r = RefAttention(p, q, k, v, {});
    double l = 0.0;
    for (size_t i = 0; i < r.out.size(); ++i) l += r.out[i] * dout[i];
    return l;
  };
  const double eps = 1e-5;
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
  check(q, g.dq, "dq");
  check(k, g.dk, "dk");
  check(v, g.dv, "dv");
  // Queries of the last document (stream tokens 11..13) see no key.
  for (int64_t i = 8; i < 11; ++i) EXPECT_EQ(g.lse[i * 2], -kInf);
}

// ---- kernel vs reference ----------------------------------------------------------------------

// Local causal attention: queries and keys are the same tokens.
TEST(AttentionKernel, LocalCausalOddShapes) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int64_t T : {1, 17, 65, 130}) {
    for (int64_t H : {1, 3}) {
      for (int64_t n_docs : {1, 4}) {
        const std::vector<int64_t> starts = RandomStarts(T, n_docs - 1, rng);
        SCOPED_TRACE("docs=" + std::to_string(n_docs));
        CheckAgainstReference(MakeProblem(T, starts, Range(0, T), Range(0, T), H, 24, 16, rng),
                              rng);
      }
    }
  }
}

// Many tiny documents and one boundary exactly at a tile edge.
TEST(AttentionKernel, TinyDocumentsAndTileEdges) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  std::vector<int64_t> tiny;
  std::uniform_int_distribution<int64_t> len(1, 3);
  for (int64_t t = len(rng); t < 150; t += len(rng)) tiny.push_back(t);
  CheckAgainstReference(MakeProblem(150, tiny, Range(0, 150), Range(0, 150), 2, 12, 8, rng), rng);
  CheckAgainstReference(
      MakeProblem(200, {64, 128, 129}, Range(0, 200), Range(0, 200), 2, 12, 8, rng), rng);
}

// Context-parallel slices: the stream is cut into 2*cp chunks and rank r holds chunks r and
// 2cp-1-r; its keys are every token up to its last query.
TEST(AttentionKernel, GatheredKeysZigzag) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int64_t chunk : {1, 9, 33, 65}) {
    for (int64_t cp : {2, 3}) {
      const int64_t n = 2 * cp * chunk;
      const std::vector<int64_t> starts = RandomStarts(n, 3, rng);
      for (int64_t r = 0; r < cp; ++r) {
        std::vector<int64_t> q_tokens = Range(r * chunk, (r + 1) * chunk);
        const std::vector<int64_t> late = Range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk);
        q_tokens.insert(q_tokens.end(), late.begin(), late.end());
        SCOPED_TRACE("chunk=" + std::to_string(chunk) + " cp=" + std::to_string(cp) +
                     " rank=" + std::to_string(r));
        CheckAgainstReference(MakeProblem(n, starts, q_tokens, Range(0, q_tokens.back() + 1),
                                          r % 2 ? 3 : 1, 24, 16, rng),
                              rng);
      }
    }
  }
  // A later contiguous slice: Tq = 65 queries, Tk = 130 keys.
  CheckAgainstReference(
      MakeProblem(130, RandomStarts(130, 2, rng), Range(65, 130), Range(0, 130), 3, 24, 16, rng),
      rng);
}

// Queries whose document has no key in the gathered set: out 0, lse -inf, no gradient anywhere.
TEST(AttentionKernel, QueriesWithoutVisibleKeys) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  // Keys are tokens [0, 50); queries [40, 130); a document starts at 55, another at 100.
  const AttnProblem p =
      MakeProblem(130, {20, 55, 100}, Range(40, 130), Range(0, 50), 2, 24, 16, rng);
  CheckAgainstReference(p, rng);
  const std::vector<float> dout = Normal(rng, p.dims.Tq * p.dims.H * p.dims.Dv);
  const KernelResult got = RunKernel(p, dout);
  for (int64_t i = 15; i < p.dims.Tq; ++i) {  // stream tokens 55 onwards
    for (int64_t h = 0; h < p.dims.H; ++h) {
      EXPECT_EQ(got.lse[i * p.dims.H + h], -std::numeric_limits<float>::infinity()) << i;
      for (int64_t c = 0; c < p.dims.Dv; ++c)
        EXPECT_EQ(got.out[(i * p.dims.H + h) * p.dims.Dv + c], 0.0f);
      for (int64_t c = 0; c < p.dims.Dqk; ++c)
        EXPECT_EQ(got.dq[(i * p.dims.H + h) * p.dims.Dqk + c], 0.0f);
    }
  }
  // Keys no query sees (tokens before 40 of document 1 are seen; tokens 0..19 of document 0 not).
  for (int64_t j = 0; j < 20; ++j) {
    for (int64_t c = 0; c < p.dims.H * p.dims.Dqk; ++c)
      EXPECT_EQ(got.dk[j * p.dims.H * p.dims.Dqk + c], 0.0f);
    for (int64_t c = 0; c < p.dims.H * p.dims.Dv; ++c)
      EXPECT_EQ(got.dv[j * p.dims.H * p.dims.Dv + c], 0.0f);
  }
}

// MLA's head sizes (Dqk = 192, Dv = 128) and equal head sizes.
TEST(AttentionKernel, MlaAndSquareHeadSizes) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  CheckAgainstReference(MakeProblem(140, {70}, Range(0, 140), Range(0, 140), 2, 192, 128, rng),
                        rng);
  CheckAgainstReference(MakeProblem(100, {}, Range(0, 100), Range(0, 100), 3, 8, 8, rng), rng);
  CheckAgainstReference(MakeProblem(90, {30}, Range(0, 90), Range(0, 90), 1, 4, 40, rng), rng);
}

// Repeated runs give bit-identical results (no races, no order-dependent reductions).
TEST(AttentionKernel, Deterministic) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int64_t H : {1, 2, 3}) {
    const AttnProblem p =
        MakeProblem(300, RandomStarts(300, 3, rng), Range(0, 300), Range(0, 300), H, 24, 16, rng);
    const std::vector<float> dout = Normal(rng, p.dims.Tq * H * p.dims.Dv);
    const KernelResult first = RunKernel(p, dout);
    for (int rep = 0; rep < 3; ++rep) {
      const KernelResult again = RunKernel(p, dout);
      EXPECT_EQ(first.out, again.out);
      EXPECT_EQ(first.dq, again.dq);
      EXPECT_EQ(first.dk, again.dk);
      EXPECT_EQ(first.dv, again.dv);
    }
  }
}

}  // namespace
}  // namespace spindle::kernels::cpu
