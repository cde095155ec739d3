// CUDA Lightning attention against the CPU reference (kernels/cpu/lightning.h): forward and
// backward with document resets on and off the 64-token chunk grid, carry-in, end state and its
// gradient, fused-buffer strides, Dh 64 and 128, several chunks-per-block and pipeline configurations,
// bitwise determinism; the CP state scan and carry correction with their backwards.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "kernels/cpu/lightning.h"
#include "kernels/cuda/lightning.h"
#include "tests/cuda/cuda_test_util.h"

namespace spindle::kernels::cuda {
namespace {

using testing::DeviceBuffer;
using testing::Download;
using testing::ExpectClose;
using testing::ExpectSameBits;
using testing::Normal;
using testing::RoundTo;
using testing::Upload;
using testing::UploadRaw;

constexpr DType kBf16 = DType::kBFloat16;

// Decays as the model sets them (DESIGN.md section 2) for layer l of n.
std::vector<float> ModelDecays(int64_t H, int64_t l = 1, int64_t n = 4) {
  std::vector<float> ld(H);
  for (int64_t h = 0; h < H; ++h) {
    ld[h] = -std::exp2(-8.0f * (h + 1) / H) * (1.0f - static_cast<float>(l) / n + 1e-5f);
  }
  return ld;
}

struct Case {
  int64_t T, H, Dh, pad;
  std::vector<int32_t> cu;
  bool carry, d_end;
};

struct Result {
  std::vector<float> out, end, dq, dk, dv, dcarry;
};

class Lightning : public ::testing::Test {
 protected:
  void SetUp() override { SPINDLE_REQUIRE_GPU(); }

  void Build(const Case& c) {
    c_ = c;
    stride_ = 3 * c.H * c.Dh + c.pad;
    qkv_ = Normal(rng_, c.T * stride_);
    RoundTo(kBf16, qkv_);
    dout_ = Normal(rng_, c.T * c.H * c.Dh);
    RoundTo(kBf16, dout_);
    ld_ = ModelDecays(c.H);
    carry_ = c.carry ? Normal(rng_, c.H * c.Dh * c.Dh, 0.3f) : std::vector<float>();
    dend_ = c.d_end ? Normal(rng_, c.H * c.Dh * c.Dh, 0.3f) : std::vector<float>();
    scale_ = 1.0f / std::sqrt(static_cast<float>(c.Dh));
  }

  Result Cpu() const {
    const int64_t HD = c_.H * c_.Dh, S = c_.H * c_.Dh * c_.Dh;
    cpu::LightningDims d{c_.T, c_.H, c_.Dh, stride_};
    Result r;
    r.out.resize(c_.T * HD);
    r.end.resize(S);
    std::vector<float> grads(c_.T * stride_, 0.0f);
    r.dcarry.resize(S);
    const float* carry = carry_.empty() ? nullptr : carry_.data();
    const int64_t n_seg = static_cast<int64_t>(c_.cu.size()) - 1;
    cpu::LightningForward(qkv_.data(), qkv_.data() + HD, qkv_.data() + 2 * HD, ld_.data(),
                          c_.cu.data(), n_seg, carry, scale_, d, r.out.data(), r.end.data());
    cpu::LightningBackward(qkv_.data(), qkv_.data() + HD, qkv_.data() + 2 * HD, ld_.data(),
                           c_.cu.data(), n_seg, carry, scale_, d, dout_.data(),
                           dend_.empty() ? nullptr : dend_.data(), grads.data(),
                           grads.data() + HD, grads.data() + 2 * HD, r.dcarry.data());
    Split(grads, &r);
    return r;
  }

  // keep_states: the forward keeps its block states for the backward (LightningSavedBytes).
  Result Gpu(const LightningConfig& cfg, bool keep_states = false) const {
    const int64_t HD = c_.H * c_.Dh, S = c_.H * c_.Dh * c_.Dh;
    LightningDims d{c_.T, c_.H, c_.Dh, stride_};
    auto qkv = Upload(qkv_, kBf16), dout = Upload(dout_, kBf16), ld = Upload(ld_, DType::kFloat32);
    auto cu = UploadRaw(c_.cu);
    DeviceBuffer carry = carry_.empty() ? DeviceBuffer() : Upload(carry_, DType::kFloat32);
    DeviceBuffer dend = dend_.empty() ? DeviceBuffer() : Upload(dend_, DType::kFloat32);
    DeviceBuffer out(c_.T * HD * 2 + 16), end(S * 4), grads(c_.T * stride_ * 2 + 16),
        dcarry(S * 4), ws(LightningWorkspaceBytes(d, cfg)),
        saved(keep_states ? LightningSavedBytes(d, cfg) : 0);
    cudaMemset(grads.get(), 0, grads.bytes());
    auto* base = qkv.as<__nv_bfloat16>();
    auto* g = grads.as<__nv_bfloat16>();
    const int64_t n_seg = static_cast<int64_t>(c_.cu.size()) - 1;
    Result r;
    Status s = LightningForward(base, base + HD, base + 2 * HD, ld.as<float>(), cu.as<int32_t>(),
                                n_seg, carry.as<float>(), scale_, d, out.get(), end.as<float>(),
                                kBf16, {ws.get(), ws.bytes()}, 0, cfg, saved.as<float>());
    EXPECT_TRUE(s.ok()) << s.message();
    // Scribble over the workspace: with kept states the backward must not need what the forward
    // left there.
    cudaMemset(ws.get(), 0xFF, ws.bytes());
    s = LightningBackward(base, base + HD, base + 2 * HD, ld.as<float>(), cu.as<int32_t>(), n_seg,
                          carry.as<float>(), scale_, d, dout.get(), dend.as<float>(), g, g + HD,
                          g + 2 * HD, dcarry.as<float>(), kBf16, {ws.get(), ws.bytes()}, 0, cfg,
                          saved.as<float>());
    EXPECT_TRUE(s.ok()) << s.message();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    r.out = Download(out.get(), c_.T * HD, kBf16);
    r.end = Download(end.get(), S, DType::kFloat32);
    r.dcarry = Download(dcarry.get(), S, DType::kFloat32);
    Split(Download(grads.get(), c_.T * stride_, kBf16), &r);
    return r;
  }

  // dq, dk, dv out of a fused [T, stride] gradient buffer.
  void Split(const std::vector<float>& grads, Result* r) const {
    const int64_t HD = c_.H * c_.Dh;
    for (auto* v : {&r->dq, &r->dk, &r->dv}) v->assign(c_.T * HD, 0.0f);
    for (int64_t t = 0; t < c_.T; ++t) {
      std::copy_n(&grads[t * stride_], HD, &r->dq[t * HD]);
      std::copy_n(&grads[t * stride_ + HD], HD, &r->dk[t * HD]);
      std::copy_n(&grads[t * stride_ + 2 * HD], HD, &r->dv[t * HD]);
    }
  }

  // Defined below (with the document mixes it runs over).
  void CompareMainSweeps(int sweep_kernel, std::initializer_list<int> cpbs);

  void Compare(const Result& got, const Result& want) const {
    ExpectClose(got.out, want.out, kBf16, "out");
    ExpectClose(got.end, want.end, kBf16, "end_state");
    ExpectClose(got.dq, want.dq, kBf16, "dq");
    ExpectClose(got.dk, want.dk, kBf16, "dk");
    ExpectClose(got.dv, want.dv, kBf16, "dv");
    ExpectClose(got.dcarry, want.dcarry, kBf16, "d_carry_in");
  }

  Case c_;
  int64_t stride_ = 0;
  std::vector<float> qkv_, dout_, ld_, carry_, dend_;
  float scale_ = 1.0f;
  mutable std::mt19937 rng_{testing::FreshSeed()};
};

TEST_F(Lightning, DocumentsOnAndOffTheChunkGridAllLaunchConfigs) {
  // Documents start mid-chunk (37, 300), exactly on the grid (128, 640), one is a single token
  // (299); carry-in and end-state gradient; padded fused buffer.
  Build({1000, 3, 64, 8, {0, 37, 128, 299, 300, 640, 1000}, true, true});
  const Result want = Cpu();
  for (int stages : {1, 2}) {
    for (int cpb : {1, 3, 8, 0}) {
      for (bool separate : {false, true}) {
        SCOPED_TRACE("chunks_per_block " + std::to_string(cpb) + " stages " +
                     std::to_string(stages) + (separate ? " separate dk, dv" : " fused dk, dv"));
        Compare(Gpu({cpb, stages, separate}), want);
      }
    }
  }
}

TEST_F(Lightning, HeadSize128OneDocumentNoCarry) {
  Build({300, 2, 128, 0, {0, 300}, false, false});
  const Result want = Cpu();
  for (int cpb : {1, 2, 16}) {
    SCOPED_TRACE("chunks_per_block " + std::to_string(cpb));
    Compare(Gpu({cpb}), want);
  }
}

TEST_F(Lightning, ManyShortDocumentsBothHeadSizes) {
  // Documents of 1..70 tokens, so most chunks hold several starts and the reverse sweeps (dk, dv)
  // see the transposed mask cut at many places; odd T ends inside a chunk.
  for (int64_t Dh : {64, 128}) {
    SCOPED_TRACE("Dh " + std::to_string(Dh));
    std::vector<int32_t> cu{0};
    std::mt19937 pick(7);
    while (cu.back() < 777) cu.push_back(std::min<int32_t>(777, cu.back() + 1 + pick() % 70));
    Build({777, 2, Dh, 8, cu, true, true});
    const Result want = Cpu();
    for (int stages : {1, 2}) {
      for (int cpb : {1, 5}) {
        for (bool separate : {false, true}) {
          SCOPED_TRACE("chunks_per_block " + std::to_string(cpb) + " stages " +
                       std::to_string(stages) + (separate ? " separate dk, dv" : " fused dk, dv"));
          Compare(Gpu({cpb, stages, separate}), want);
        }
      }
    }
  }
}

// The document mixes of the Dh = 128 sweep tests: documents of 1..90 tokens up to T = 900 (a
// fresh seed each run), and document starts on the chunk grid with an odd T.
std::vector<std::vector<int32_t>> Dh128DocumentMixes() {
  std::vector<int32_t> cu{0};
  std::mt19937 pick(testing::FreshSeed());
  while (cu.back() < 900) cu.push_back(std::min<int32_t>(900, cu.back() + 1 + pick() % 90));
  return {cu, {0, 64, 128, 700, 1001}};
}

TEST_F(Lightning, HeadSize128WgmmaAndMmaSyncSweepsMatchCpu) {
  // Dh = 128 runs the wgmma sweep when the config asks and it is built (sm_90a) and the device is
  // an sm_90; both sweeps, every pass (forward, dq, the reverse state pass, and dk / dv as two
  // reverse sweeps), against the CPU: documents of 1..90 tokens and ones on the chunk grid,
  // carry-in, end-state gradient, odd T, a padded fused buffer, short and automatic blocks.
  if (!LightningWgmmaAvailable()) GTEST_SKIP() << "no wgmma sweep in this build or on this device";
  for (const std::vector<int32_t>& docs : Dh128DocumentMixes()) {
    Build({docs.back(), 3, 128, 8, docs, true, true});
    const Result want = Cpu();
    for (int kernel : {1, 2}) {
      for (int cpb : {1, 3, 0}) {
        for (bool separate : {false, true}) {
          SCOPED_TRACE(std::string(kernel == 2 ? "wgmma" : "mma.sync") + " chunks_per_block " +
                       std::to_string(cpb) + (separate ? " separate dk, dv" : " fused dk, dv") +
                       " documents " + std::to_string(docs.size() - 1));
          Compare(Gpu({cpb, 1, separate, kernel}), want);
        }
      }
    }
  }
}

// The main passes (forward, dq, and with separate dk / dv the two reverse sweeps) on one sweep
// kernel against the CPU, with and without the forward's kept states, fused and separate dk / dv,
// over Dh128DocumentMixes with carry-in, end-state gradient and a padded fused buffer.
void Lightning::CompareMainSweeps(int sweep_kernel, std::initializer_list<int> cpbs) {
  for (const std::vector<int32_t>& docs : Dh128DocumentMixes()) {
    Build({docs.back(), 3, 128, 8, docs, true, true});
    const Result want = Cpu();
    for (int cpb : cpbs) {
      for (bool separate : {false, true}) {
        for (bool kept : {false, true}) {
          SCOPED_TRACE("chunks_per_block " + std::to_string(cpb) +
                       (separate ? " separate dk, dv" : " fused dk, dv") +
                       (kept ? " kept states" : "") + " documents " +
                       std::to_string(docs.size() - 1));
          Compare(Gpu({cpb, 0, separate, sweep_kernel}, kept), want);
        }
      }
    }
  }
}

TEST_F(Lightning, HeadSize128TransposedStateSweepMatchesCpu) {
  // sweep_kernel 3: the sweep that holds the state transposed; one-chunk, short and automatic
  // blocks.
  CompareMainSweeps(3, {1, 3, 0});
}

TEST_F(Lightning, HeadSize128WarpSpecialisedSweepMatchesCpu) {
  // sweep_kernel 4: the warp-specialised wgmma sweep; one-chunk, short, automatic and long
  // blocks.
  if (!LightningWgmmaAvailable()) GTEST_SKIP() << "no wgmma sweep in this build or on this device";
  CompareMainSweeps(4, {1, 3, 0, 64});
}

TEST_F(Lightning, HeadSize128StrongAndWeakDecaysOverLongBlocksMatchCpu) {
  // Decays far from the model's on both sides (a head losing e^-0.9 a token, so e^-58 over a
  // chunk, down to e^-0.02), over blocks of 32 chunks and one block of all 41; documents starting
  // mid-chunk, carry-in and the end-state gradient; fused and separate dk / dv, with and without
  // the forward's kept states.
  Build({40 * 64 + 17, 4, 128, 8, {0, 1000, 1030, 40 * 64 + 17}, true, true});
  ld_ = {-0.9f, -0.72f, -0.3f, -0.02f};
  const Result want = Cpu();
  for (int cpb : {32, 64}) {
    for (bool separate : {false, true}) {
      for (bool kept : {false, true}) {
        SCOPED_TRACE("chunks_per_block " + std::to_string(cpb) +
                     (separate ? " separate dk, dv" : " fused dk, dv") +
                     (kept ? " kept states" : ""));
        Compare(Gpu({cpb, 0, separate, 3}, kept), want);
      }
    }
  }
}

TEST_F(Lightning, HeadSize128OddLengthCarryAndDocuments) {
  Build({127, 3, 128, 8, {0, 5, 64, 127}, true, true});
  Compare(Gpu({}), Cpu());
}

TEST_F(Lightning, SmallHeadsTokenPathMatchesCpu) {
  // Dh 16 (the tiny preset) and 32 take the token-by-token path: documents, carry-in and the
  // end-state gradient, padded fused buffer.
  for (int64_t Dh : {16, 32}) {
    SCOPED_TRACE("Dh " + std::to_string(Dh));
    Build({211, 3, Dh, 8, {0, 1, 50, 64, 200, 211}, true, true});
    Compare(Gpu({}), Cpu());
  }
}

TEST_F(Lightning, LongSequenceIsDeterministic) {
  Build({4099, 4, 128, 0, {0, 1000, 1001, 2500, 4099}, true, true});
  const Result a = Gpu({4, 2}), b = Gpu({4, 2});
  for (auto [x, y, what] : {std::tuple{&a.out, &b.out, "out"}, {&a.dq, &b.dq, "dq"},
                            {&a.dk, &b.dk, "dk"}, {&a.dv, &b.dv, "dv"},
                            {&a.end, &b.end, "end"}, {&a.dcarry, &b.dcarry, "dcarry"}}) {
    ExpectSameBits(*x, *y, what);
  }
  Compare(a, Cpu());
}

TEST_F(Lightning, BackwardFromTheForwardsKeptStatesIsBitwiseTheSame) {
  // Documents on and off the chunk grid, carry-in and end-state gradient, both head sizes, a
  // small block size (many blocks: a real scan) and the automatic one.
  for (int64_t Dh : {64, 128}) {
    for (int cpb : {0, 2}) {
      SCOPED_TRACE("Dh " + std::to_string(Dh) + " cpb " + std::to_string(cpb));
      Build({1000, 3, Dh, 8, {0, 1, 64, 300, 513, 1000}, true, true});
      LightningConfig cfg;
      cfg.chunks_per_block = cpb;
      const Result plain = Gpu(cfg), kept = Gpu(cfg, /*keep_states=*/true);
      for (const auto& [x, y, what] :
           {std::tuple{&plain.out, &kept.out, "out"}, {&plain.end, &kept.end, "end"},
            {&plain.dq, &kept.dq, "dq"}, {&plain.dk, &kept.dk, "dk"}, {&plain.dv, &kept.dv, "dv"},
            {&plain.dcarry, &kept.dcarry, "dcarry"}}) {
        ExpectSameBits(*x, *y, what);
      }
      Compare(kept, Cpu());
    }
  }
}

TEST_F(Lightning, UnsupportedHeadSizeAndDtypeAreNamed) {
  LightningDims d{64, 2, 96, 3 * 2 * 96};
  DeviceBuffer buf(64 * 3 * 2 * 96 * 2);
  Status s = LightningForward(buf.get(), buf.get(), buf.get(), nullptr, nullptr, 1, nullptr, 1.0f,
                              d, buf.get(), nullptr, kBf16, {}, 0);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("Dh=96"), std::string::npos) << s.message();
  d.Dh = 64;
  s = LightningForward(buf.get(), buf.get(), buf.get(), nullptr, nullptr, 1, nullptr, 1.0f, d,
                       buf.get(), nullptr, DType::kFloat32, {}, 0);
  EXPECT_NE(s.message().find("unsupported dtype 'float32'"), std::string::npos) << s.message();
  // The CP carry correction runs for the head sizes Lightning runs, and names the others.
  for (int64_t ok : {2, 16, 32, 64, 128}) EXPECT_TRUE(LightningSupportsHeadDim(ok)) << ok;
  d.Dh = 48;
  d.qkv_stride = 3 * 2 * 48;
  EXPECT_FALSE(LightningSupportsHeadDim(48));
  s = LightningCarryCorrection(buf.get(), nullptr, nullptr, 1.0f, d, 8, buf.get(), kBf16, 0);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("LightningCarryCorrection: unsupported head size Dh=48"),
            std::string::npos)
      << s.message();
  s = LightningCarryCorrectionBackward(buf.get(), nullptr, nullptr, 1.0f, d, 8, buf.get(),
                                       buf.get(), nullptr, kBf16, {}, 0);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("LightningCarryCorrectionBackward: unsupported head size Dh=48"),
            std::string::npos)
      << s.message();
}

TEST_F(Lightning, CpStateScanAndBackwardMatchLoop) {
  const int64_t C = 7, H = 3, Dh = 64, E = Dh * Dh;
  auto S = Normal(rng_, C * H * E), dP = Normal(rng_, C * H * E);
  std::vector<int32_t> doc{0, 1, 0, 0, 1, 0, 0}, len{64, 50, 17, 64, 3, 64, 64};
  const auto ld = ModelDecays(H);
  auto d_S = Upload(S, DType::kFloat32), d_dP = Upload(dP, DType::kFloat32);
  auto d_doc = UploadRaw(doc), d_len = UploadRaw(len), d_ld = Upload(ld, DType::kFloat32);
  DeviceBuffer d_P(C * H * E * 4), d_dS(C * H * E * 4);
  ASSERT_OK(LightningStateScan(d_S.as<float>(), d_doc.as<int32_t>(), d_len.as<int32_t>(),
                               d_ld.as<float>(), C, H, Dh, d_P.as<float>(), 0));
  ASSERT_OK(LightningStateScanBackward(d_dP.as<float>(), d_doc.as<int32_t>(), d_len.as<int32_t>(),
                                       d_ld.as<float>(), C, H, Dh, d_dS.as<float>(), 0));
  std::vector<float> P(C * H * E, 0.0f), dS(C * H * E, 0.0f);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t c = 1; c < C; ++c) {
      const float f = doc[c - 1] ? 0.0f : std::exp(static_cast<float>(len[c - 1]) * ld[h]);
      for (int64_t e = 0; e < E; ++e) {
        P[(c * H + h) * E + e] = S[((c - 1) * H + h) * E + e] + f * P[((c - 1) * H + h) * E + e];
      }
    }
    std::vector<float> G(E, 0.0f);  // G_{c+1}
    for (int64_t c = C - 1; c >= 0; --c) {
      const float f = doc[c] ? 0.0f : std::exp(static_cast<float>(len[c]) * ld[h]);
      for (int64_t e = 0; e < E; ++e) {
        dS[(c * H + h) * E + e] = G[e];
        G[e] = dP[(c * H + h) * E + e] + f * G[e];
      }
    }
  }
  ExpectClose(Download(d_P.get(), C * H * E, DType::kFloat32), P, DType::kFloat32, "P");
  ExpectClose(Download(d_dS.get(), C * H * E, DType::kFloat32), dS, DType::kFloat32, "dS");
}

TEST_F(Lightning, CarryCorrectionAndBackwardMatchCpu) {
  for (int64_t Dh : {64, 128, 16, 32}) {  // tensor-core sizes, then the token path's
    SCOPED_TRACE("Dh " + std::to_string(Dh));
    const int64_t T = 333, H = 3, n_tokens = 201, HD = H * Dh, stride = 3 * HD;
    Build({T, H, Dh, 0, {0, T}, false, false});
    auto P = Normal(rng_, H * Dh * Dh, 0.3f);
    auto out0 = Normal(rng_, T * HD);
    RoundTo(kBf16, out0);
    auto dP0 = Normal(rng_, H * Dh * Dh);
    auto d_qkv = Upload(qkv_, kBf16), d_P = Upload(P, DType::kFloat32);
    auto d_ld = Upload(ld_, DType::kFloat32), d_out = Upload(out0, kBf16);
    auto d_dout = Upload(dout_, kBf16), d_dq = Upload(qkv_, kBf16);  // dq accumulates onto q's values
    auto d_dP = Upload(dP0, DType::kFloat32);
    LightningDims d{T, H, Dh, stride};
    ASSERT_OK(LightningCarryCorrection(d_qkv.get(), d_ld.as<float>(), d_P.as<float>(), scale_, d,
                                       n_tokens, d_out.get(), kBf16, 0));
    DeviceBuffer ws(LightningWorkspaceBytes({n_tokens, H, Dh, stride}));
    ASSERT_OK(LightningCarryCorrectionBackward(d_qkv.get(), d_ld.as<float>(), d_P.as<float>(),
                                               scale_, d, n_tokens, d_dout.get(), d_dq.get(),
                                               d_dP.as<float>(), kBf16, {ws.get(), ws.bytes()}, 0));
    cpu::LightningDims cd{T, H, Dh, stride};
    auto out = out0;
    cpu::LightningCarryCorrection(qkv_.data(), ld_.data(), P.data(), scale_, cd, n_tokens,
                                  out.data());
    auto dq = qkv_;
    auto dP = dP0;
    cpu::LightningCarryCorrectionBackward(qkv_.data(), ld_.data(), P.data(), scale_, cd, n_tokens,
                                          dout_.data(), dq.data(), dP.data());
    ExpectClose(Download(d_out.get(), T * HD, kBf16), out, kBf16, "out");
    ExpectClose(Download(d_dq.get(), T * stride, kBf16), dq, kBf16, "dq");
    ExpectClose(Download(d_dP.get(), H * Dh * Dh, DType::kFloat32), dP, kBf16, "dP");
  }
}

}  // namespace
}  // namespace spindle::kernels::cuda
