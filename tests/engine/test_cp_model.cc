// Context-parallel parity of the model: for every Lightning x MLA mode pair and cp = 2 and 4
// (and cp = 8 on a model with 8 heads, so that All2All has a head a rank), ranks as threads (own
// Gloo communicators over 127.0.0.1) each run their zigzag share, and the summed losses and every
// parameter's summed gradient equal the cp = 1 run of the whole sequence. The sequence packs
// documents that cross chunk and rank boundaries, one longer than a rank's share and one shorter
// than a chunk.
//
// The Ring and hybrid modes the same way: MLA "ring" at cp = 2, 4, 8, and the hybrid modes at
// (ulysses, ring) = (2, 2), (2, 4), (4, 2), each with the latent and with K / V travelling the
// ring (a model whose latent is narrower than its keys and values, and one where it is wider: the
// payload is MlaRingPayloadFor's, as the trainer picks it), on two sequences: the one above and
// one of short odd documents where some ranks' blocks are wholly masked from others, plus a long
// document beginning at a chunk boundary. Every rank's bytes sent per layer type equal
// CpLayerCommBytes (common/cp_modes.h), the planner's formula.
//
// Tolerance (fp32 throughout): loss sum relative 1e-5; per parameter tensor,
// max |g_cp - g_1| <= 1e-4 * max |g_1| (kTolGrad). Differences come only from summation order.
#include <omp.h>

#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cp_modes.h"
#include "gtest/gtest.h"
#include "tests/engine/cp_test_util.h"
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/model.h"

namespace spindle {
namespace {

constexpr double kTolLoss = 1e-5;
constexpr double kTolGrad = 1e-4;

ModelConfig CpConfig(int64_t n_heads) {
  ModelConfig c = *ModelPreset("tiny");
  c.d_model = 32;
  c.n_heads = n_heads;
  c.ffn_dim = 40;
  c.n_layers = 3;
  c.layer_pattern = "LLM";
  c.mla = {0, 12, 8, 6, 10};
  // With 8 heads the head size is 4, and a q/k norm over a 4-element vector near zero amplifies
  // summation-order differences without bound at the default eps (1e-6): with OpenBLAS's AVX-512
  // kernels every cp = 8 case differed by 3e-4 of the largest gradient (the Haswell kernels:
  // within 1e-4). An eps of 1e-2 bounds that gain; the data movement under test is unchanged.
  if (n_heads == 8) c.norm_eps = 1e-2;
  return c;
}

// The same with a latent wider than the keys and values of every head together (102 values a
// token against 4 x 24): the ring modes move K and V.
ModelConfig WideLatentConfig() {
  ModelConfig c = CpConfig(4);
  c.mla.kv_lora_rank = 96;
  return c;
}

// 96 tokens: short odd documents [0, 3), [3, 10), [10, 17), [17, 30), then [30, 91) (longer than a
// rank's share; at cp = 8 it begins with chunk 5, so rank 5's chunks (5 and 10) see nothing of
// ranks 0-4: whole ring blocks are masked), [91, 96).
std::vector<int32_t> ShortDocTokens(uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> tok(0, 255);
  std::vector<int32_t> t(96);
  for (auto& x : t) x = tok(gen);
  for (int i : {2, 9, 16, 29, 90}) t[i] = 256;
  return t;
}

struct RunResult {
  double loss_sum = 0.0;
  int64_t n_valid = 0;
  std::vector<float> grad;
};

RunResult Reference(const ModelConfig& cfg, const Batch& full, Recompute recompute) {
  auto m = Model::Create(cfg, 7);
  EXPECT_TRUE(m.ok());
  (*m)->params().ZeroGrad();
  LossStats s = (*m)->ForwardBackward(full, 1.0f, recompute);
  Tensor& g = (*m)->params().flat_grad();
  return {s.loss_sum, s.n_valid, std::vector<float>(g.f32(), g.f32() + g.numel())};
}

// Bytes this rank sent for `layer` on all its communicators, and what CpLayerCommBytes says one
// ForwardBackward sends: each layer of the kind its forward and backward, a recomputed layer's
// forward twice.
std::map<CommLayer, int64_t> SentBytes(const std::vector<Communicator*>& comms) {
  std::map<CommLayer, int64_t> bytes;
  for (Communicator* c : comms)
    if (c)
      for (const auto& [key, amount] : c->TakeStats()) bytes[key.second] += amount.bytes;
  return bytes;
}
int64_t ExpectedBytes(const ModelConfig& cfg, char kind, CpMode mode, const ParallelSpec& p,
                      int64_t seq_len, Recompute recompute) {
  const CpCommBytes b = CpLayerCommBytes(cfg, kind, mode, p, seq_len);
  int64_t total = 0;
  for (int64_t i = 0; i < cfg.n_layers; ++i)
    if (cfg.LayerKind(i) == kind) total += b.forward * (recompute.Layer(i) ? 2 : 1) + b.backward;
  return total;
}

// Every rank's loss and gradient, summed in rank order. ulysses > 1: each rank also joins its
// Ulysses group and its ring (cp_groups.h).
absl::StatusOr<RunResult> RunCp(const ModelConfig& cfg, const Batch& full, int cp, CpMode lm,
                                CpMode mm, Recompute recompute, int ulysses = 1) {
  MemoryKvStore store;
  std::vector<RunResult> per(cp);
  ParallelSpec p;
  p.cp = cp;
  p.ulysses = ulysses;
  p.lightning_mode = lm;
  p.mla_mode = mm;
  const int64_t expect_l = ExpectedBytes(cfg, 'L', lm, p, full.T, recompute);
  const int64_t expect_m = ExpectedBytes(cfg, 'M', mm, p, full.T, recompute);
  absl::Status st = testing::RunRanks(cp, [&](int rank) -> absl::Status {
    omp_set_num_threads(1);
    auto comm = CreateGlooCommunicator(store, "cp", rank, cp, testing::TestGloo());
    if (!comm.ok()) return comm.status();
    const CpGroups groups{cp, ulysses};
    std::unique_ptr<Communicator> uc, rc;
    if (ulysses > 1) {
      auto u = CreateGlooCommunicator(store, absl::StrCat("u", groups.Group(rank)),
                                      static_cast<int>(groups.Member(rank)), ulysses,
                                      testing::TestGloo());
      if (!u.ok()) return u.status();
      auto r = CreateGlooCommunicator(store, absl::StrCat("r", groups.Member(rank)),
                                      static_cast<int>(groups.Group(rank)),
                                      static_cast<int>(groups.r()), testing::TestGloo());
      if (!r.ok()) return r.status();
      uc = std::move(*u);
      rc = std::move(*r);
    }
    auto m = Model::Create(cfg, 7);
    if (!m.ok()) return m.status();
    const MlaRingPayload payload =
        MlaRingPayloadFor(cfg.mla, MlaRingHeads(cfg.n_heads, mm, ulysses));
    (*m)->SetCp({comm->get(), lm, mm, uc.get(), rc.get(), payload});
    auto b = ShardForCp(full, cp, rank, ulysses);
    if (!b.ok()) return b.status();
    (*m)->params().ZeroGrad();
    auto s = (*m)->ForwardBackward(*b, 1.0f, recompute);
    if (!s.ok()) return s.status();
    std::map<CommLayer, int64_t> sent = SentBytes({comm->get(), uc.get(), rc.get()});
    EXPECT_EQ(sent[CommLayer::kLightning], expect_l) << "rank " << rank;
    EXPECT_EQ(sent[CommLayer::kMla], expect_m) << "rank " << rank;
    // The evaluation forward gives the same local loss.
    auto f = (*m)->Forward(*b);
    if (!f.ok()) return f.status();
    EXPECT_NEAR(f->loss_sum, s->loss_sum, 1e-4 * std::abs(s->loss_sum));
    Tensor& g = (*m)->params().flat_grad();
    per[rank] = {s->loss_sum, s->n_valid, std::vector<float>(g.f32(), g.f32() + g.numel())};
    return absl::OkStatus();
  });
  if (!st.ok()) return st;
  RunResult sum = per[0];
  for (int r = 1; r < cp; ++r) {
    sum.loss_sum += per[r].loss_sum;
    sum.n_valid += per[r].n_valid;
    for (size_t i = 0; i < sum.grad.size(); ++i) sum.grad[i] += per[r].grad[i];
  }
  return sum;
}

void ExpectParity(const ModelConfig& cfg, const RunResult& ref, const RunResult& got) {
  EXPECT_EQ(got.n_valid, ref.n_valid);
  EXPECT_NEAR(got.loss_sum, ref.loss_sum, kTolLoss * std::abs(ref.loss_sum));
  auto m = Model::Create(cfg, 7);
  ParamSet& P = (*m)->params();
  for (int i = 0; i < P.size(); ++i) {
    const ParamInfo& p = P.info(i);
    double max_ref = 0.0, max_diff = 0.0;
    for (int64_t j = 0; j < p.numel; ++j) {
      max_ref = std::max(max_ref, std::abs(static_cast<double>(ref.grad[p.offset + j])));
      max_diff = std::max(max_diff, std::abs(static_cast<double>(got.grad[p.offset + j]) -
                                             ref.grad[p.offset + j]));
    }
    EXPECT_GT(max_ref, 0.0) << p.name;
    EXPECT_LE(max_diff, kTolGrad * max_ref) << p.name << ": max diff " << max_diff << ", max "
                                            << max_ref;
  }
}

struct Case {
  int cp;
  CpMode lightning, mla;
  int64_t recompute_layers;  // the first this many layers recompute
  int64_t n_heads = 4;
  int ulysses = 1;
  bool wide_latent = false;  // WideLatentConfig: the ring modes move K and V
  bool short_docs = false;   // ShortDocTokens instead of PackedTokens
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "cp=" << c.cp << " lightning=" << CpModeName(c.lightning) << " mla=" << CpModeName(c.mla)
      << " recompute=" << c.recompute_layers << " n_heads=" << c.n_heads << " ulysses=" << c.ulysses
      << (c.wide_latent ? " wide latent" : "") << (c.short_docs ? " short documents" : "");
}

class CpModelParityTest : public ::testing::TestWithParam<Case> {};

TEST_P(CpModelParityTest, LossAndEveryGradientMatchCp1) {
  const Case c = GetParam();
  const ModelConfig cfg = c.wide_latent ? WideLatentConfig() : CpConfig(c.n_heads);
  // Fresh inputs for every case (the seed follows the case), the same for both runs.
  const uint32_t seed = 11 + 97 * c.cp + 13 * c.ulysses + static_cast<uint32_t>(c.mla) * 7 +
                        static_cast<uint32_t>(c.lightning) * 3 + (c.wide_latent ? 5 : 0);
  const Batch full =
      MakeSequenceBatch(c.short_docs ? ShortDocTokens(seed) : testing::PackedTokens(seed), 256);
  const RunResult ref = Reference(cfg, full, Recompute::None());
  auto got =
      RunCp(cfg, full, c.cp, c.lightning, c.mla, Recompute::First(c.recompute_layers), c.ulysses);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectParity(cfg, ref, *got);
}

std::string CaseName(const ::testing::TestParamInfo<Case>& i) {
  auto w = [](CpMode m) {
    switch (m) {
      case CpMode::kAll2All:
        return "A2A";
      case CpMode::kRing:
        return "Ring";
      case CpMode::kHybrid:
        return "Hybrid";
      default:
        return "AG";
    }
  };
  return absl::StrCat(
      "cp", i.param.cp, i.param.ulysses > 1 ? absl::StrCat("_u", i.param.ulysses) : "", "_L",
      w(i.param.lightning), "_M", w(i.param.mla),
      i.param.recompute_layers > 0 ? absl::StrCat("_recompute", i.param.recompute_layers) : "",
      i.param.n_heads != 4 ? absl::StrCat("_heads", i.param.n_heads) : "",
      i.param.wide_latent ? "_kv" : "", i.param.short_docs ? "_shortdocs" : "");
}

constexpr CpMode AG = CpMode::kAllGather, A2A = CpMode::kAll2All, RING = CpMode::kRing,
                 HYB = CpMode::kHybrid;
INSTANTIATE_TEST_SUITE_P(Modes, CpModelParityTest,
                         ::testing::Values(Case{2, AG, AG, 0}, Case{2, A2A, A2A, 0},
                                           Case{2, AG, A2A, 0}, Case{2, A2A, AG, 0},
                                           Case{4, AG, AG, 0}, Case{4, A2A, A2A, 0},
                                           Case{4, AG, A2A, 3}, Case{4, A2A, AG, 3},
                                           Case{2, A2A, AG, 1}, Case{2, AG, A2A, 2},
                                           Case{8, AG, AG, 0, 8}, Case{8, A2A, A2A, 0, 8},
                                           Case{8, A2A, AG, 3, 8}, Case{8, AG, A2A, 2, 8}),
                         CaseName);

// MLA Ring at cp = 2, 4, 8 with either payload, beside each Lightning mode.
INSTANTIATE_TEST_SUITE_P(Ring, CpModelParityTest,
                         ::testing::Values(Case{2, AG, RING, 0}, Case{4, AG, RING, 0},
                                           Case{8, AG, RING, 0}, Case{2, A2A, RING, 0, 4, 1, true},
                                           Case{4, A2A, RING, 3, 4, 1, true},
                                           Case{8, AG, RING, 0, 4, 1, true},
                                           Case{2, AG, RING, 0, 4, 1, false, true},
                                           Case{4, AG, RING, 2, 4, 1, true, true},
                                           Case{8, AG, RING, 0, 4, 1, false, true},
                                           Case{8, AG, RING, 3, 4, 1, true, true}),
                         CaseName);

// The hybrid modes at (u, r) = (2, 2), (2, 4), (4, 2), both layer types, either payload, with
// the other layer type in another mode too.
INSTANTIATE_TEST_SUITE_P(
    Hybrid, CpModelParityTest,
    ::testing::Values(Case{4, HYB, HYB, 0, 4, 2}, Case{8, HYB, HYB, 0, 4, 2},
                      Case{8, HYB, HYB, 0, 4, 4}, Case{4, HYB, HYB, 3, 4, 2, true},
                      Case{8, HYB, HYB, 2, 4, 2, true}, Case{8, HYB, HYB, 0, 4, 4, true},
                      Case{4, HYB, HYB, 0, 4, 2, false, true},
                      Case{8, HYB, HYB, 0, 4, 2, true, true},
                      Case{8, HYB, HYB, 3, 4, 4, false, true}, Case{8, HYB, RING, 0, 4, 4},
                      Case{4, AG, HYB, 0, 4, 2, true}, Case{4, A2A, HYB, 0, 4, 2},
                      Case{8, HYB, AG, 0, 4, 2, false, true}, Case{4, HYB, A2A, 1, 4, 2}),
    CaseName);

TEST(CpLayoutTest, ChunkFlagsOfThePackedSequence) {
  const Batch full = MakeSequenceBatch(testing::PackedTokens(11), 256);
  auto b = ShardForCp(full, 4, 1);
  ASSERT_TRUE(b.ok());
  const CpLayout& L = b->layout;
  ASSERT_EQ(L.chunks.size(), 8u);
  EXPECT_EQ(L.chunk, 12);
  // chunk 0 starts the sequence, holds document [0, 4) and the start of [4, 71).
  EXPECT_FALSE(L.chunks[0].continues);
  EXPECT_TRUE(L.chunks[0].has_start);
  // chunks 1..4 lie inside the long document: no start, they continue it.
  for (int c = 1; c <= 4; ++c) {
    EXPECT_TRUE(L.chunks[c].continues) << c;
    EXPECT_FALSE(L.chunks[c].has_start) << c;
    EXPECT_EQ(L.chunks[c].first_segment, 12) << c;
  }
  EXPECT_EQ(L.chunks[5].first_segment, 71 - 60);
  EXPECT_EQ(b->local.T, 24);
  EXPECT_EQ(b->local.idx[0], 12);
  EXPECT_EQ(b->local.idx[12], 72);
  EXPECT_EQ(ShardForCp(full, 5, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// The engine applies planned modes and decides none: "auto" only at cp = 1, where nothing is
// split; an undecided mode at cp > 1 and an impossible forced one are refused by name.
TEST(CpLayoutTest, TheEngineRunsPlannedModesOnly) {
  auto par = [](int64_t cp, CpMode l, CpMode m) {
    ParallelSpec p;
    p.cp = cp;
    p.lightning_mode = l;
    p.mla_mode = m;
    return p;
  };
  auto m = PlannedCpModes(par(1, CpMode::kAuto, CpMode::kAuto), 4);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->lightning, CpMode::kAllGather);
  EXPECT_EQ(m->mla, CpMode::kAllGather);
  m = PlannedCpModes(par(8, CpMode::kAllGather, CpMode::kRing), 4);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->lightning, CpMode::kAllGather);
  EXPECT_EQ(m->mla, CpMode::kRing);
  for (CpMode undecided : {CpMode::kAuto, CpMode::kFastest}) {
    auto open = PlannedCpModes(par(2, CpMode::kAll2All, undecided), 4);
    EXPECT_EQ(open.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(open.status().message(),
              absl::StrCat("trainer: parallel.mla_mode is \"", std::string(CpModeName(undecided)),
                           "\" at cp=2; the trainer runs planned specs (the coordinator's, or "
                           "spindle-train's own plan when run standalone: PlannedSpec in "
                           "planner/cp_planner.h)"));
  }
  auto bad = PlannedCpModes(par(3, CpMode::kAllGather, CpMode::kAll2All), 4);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(bad.status().message(),
            "parallel.mla_mode: all2all needs n_heads divisible by cp, but n_heads=4 and cp=3 "
            "(4 % 3 = 1); use allgather or a cp that divides 4");
}

}  // namespace
}  // namespace spindle
