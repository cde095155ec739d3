// CUDA dense ops against the CPU reference (kernels/cpu/ops.h): embedding, RMSNorm (+ residual),
// RoPE, fused q/k norm + RoPE, SwiGLU, group norm + gate, cross-entropy, AdamW, cuBLASLt GEMMs,
// and the caching allocator. Odd shapes, fresh random inputs, fp32 and bf16, determinism; the
// vector paths of the memory-bound kernels and their scalar fallbacks (misaligned pointers).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cuda/allocator.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
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

Workspace Ws(DeviceBuffer& b) { return {b.get(), b.bytes()}; }

// Device copy of x placed `offset` elements into its buffer: offset 1 is not 16-byte aligned, so
// the kernels take their scalar paths.
struct OffsetBuf {
  DeviceBuffer buf;
  void* ptr;
};
OffsetBuf UploadAt(const std::vector<float>& x, DType t, int offset) {
  std::vector<float> padded(offset, 0.0f);
  padded.insert(padded.end(), x.begin(), x.end());
  DeviceBuffer b = Upload(padded, t);
  void* p = static_cast<char*>(b.get()) + offset * DTypeSize(t);
  return {std::move(b), p};
}

class DenseOps : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { SPINDLE_REQUIRE_GPU(); }
  DType dt() const { return GetParam(); }
  std::vector<float> Rand(int64_t n, float sd = 1.0f, float mean = 0.0f) {
    auto x = Normal(rng_, n, sd, mean);
    RoundTo(dt(), x);
    return x;
  }
  // Fused q/k norm + RoPE forward and backward against RMSNorm then RoPE on CPU, per block.
  // offset: elements by which qkv_in, qkv_out and the gradients are shifted (1: scalar path).
  void CheckQkNormRope(int64_t T, int64_t H, int64_t Dh, float theta,
                       const std::vector<int32_t>& pos, bool copy_v, int offset) {
    SCOPED_TRACE("T " + std::to_string(T) + " H " + std::to_string(H) + " Dh " +
                 std::to_string(Dh) + " theta " + std::to_string(theta) + " copy_v " +
                 std::to_string(copy_v) + " offset " + std::to_string(offset));
    const int64_t C = 3 * H * Dh;
    auto qkv = Rand(T * C), wq = Rand(Dh, 0.3f, 1.0f), wk = Rand(Dh, 0.3f, 1.0f),
         dout = Rand(T * C);
    auto dw0 = Normal(rng_, 2 * Dh);
    auto d_qkv = UploadAt(qkv, dt(), offset);
    auto d_wq = Upload(wq, dt()), d_wk = Upload(wk, dt());
    auto d_pos = UploadRaw(pos);
    const std::vector<float> sentinel(T * C, 7.0f);
    auto d_out = UploadAt(sentinel, dt(), offset);
    DeviceBuffer d_rq(T * H * 4), d_rk(T * H * 4);
    ASSERT_OK(QkNormRopeForward(d_qkv.ptr, d_wq.get(), d_wk.get(), d_pos.as<int32_t>(),
                                d_out.ptr, d_rq.as<float>(), d_rk.as<float>(), T, H, Dh, 1e-6f,
                                theta, copy_v, dt(), 0));
    std::vector<float> want(T * C), rstd[2], dwant(T * C), dw[2];
    for (int b = 0; b < 2; ++b) {
      std::vector<float> rows(T * H * Dh), y(T * H * Dh), g(T * H * Dh), gx(T * H * Dh);
      rstd[b].resize(T * H);
      dw[b].assign(dw0.begin() + b * Dh, dw0.begin() + (b + 1) * Dh);
      for (int64_t t = 0; t < T; ++t) {
        std::copy_n(&qkv[t * C + b * H * Dh], H * Dh, &rows[t * H * Dh]);
        std::copy_n(&dout[t * C + b * H * Dh], H * Dh, &g[t * H * Dh]);
      }
      const auto& w = b == 0 ? wq : wk;
      cpu::RmsNormForward(rows.data(), w.data(), y.data(), rstd[b].data(), T * H, Dh, 1e-6f);
      cpu::RopeApply(y.data(), pos.data(), T, H, Dh, H * Dh, Dh, theta, false);
      cpu::RopeApply(g.data(), pos.data(), T, H, Dh, H * Dh, Dh, theta, true);
      cpu::RmsNormBackward(rows.data(), w.data(), rstd[b].data(), g.data(), gx.data(),
                           dw[b].data(), T * H, Dh);
      for (int64_t t = 0; t < T; ++t) {
        std::copy_n(&y[t * H * Dh], H * Dh, &want[t * C + b * H * Dh]);
        std::copy_n(&gx[t * H * Dh], H * Dh, &dwant[t * C + b * H * Dh]);
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      // Without copy_v the v block of qkv_out is left alone; in place, dqkv's v block is dout's.
      std::copy_n(copy_v ? &qkv[t * C + 2 * H * Dh] : &sentinel[0], H * Dh,
                  &want[t * C + 2 * H * Dh]);
      std::copy_n(&dout[t * C + 2 * H * Dh], H * Dh, &dwant[t * C + 2 * H * Dh]);
    }
    ExpectClose(Download(d_out.ptr, T * C, dt()), want, dt(), "qkv out");
    ExpectClose(Download(d_rq.get(), T * H, DType::kFloat32), rstd[0], DType::kFloat32, "rstd q");
    ExpectClose(Download(d_rk.get(), T * H, DType::kFloat32), rstd[1], DType::kFloat32, "rstd k");
    // Backward twice: in place, then out of place from a fresh copy; dw must match bit for bit.
    DeviceBuffer ws(QkNormRopeBackwardWorkspaceBytes(T, H, Dh));
    std::vector<std::vector<float>> dws;
    for (int run = 0; run < 2; ++run) {
      auto d_g = UploadAt(dout, dt(), offset);
      auto d_din = UploadAt(std::vector<float>(T * C, 0.0f), dt(), offset);
      void* din = run == 0 ? d_g.ptr : d_din.ptr;
      auto d_dw = Upload(dw0, DType::kFloat32);
      DeviceBuffer amax(sizeof(float));
      ASSERT_OK(QkNormRopeBackward(d_qkv.ptr, d_wq.get(), d_wk.get(), d_rq.as<float>(),
                                   d_rk.as<float>(), d_pos.as<int32_t>(), d_g.ptr, din,
                                   d_dw.as<float>(), d_dw.as<float>() + Dh, T, H, Dh, theta, copy_v,
                                   dt(), Ws(ws), 0, amax.as<float>()));
      auto got = Download(din, T * C, dt());
      // The amax (FP8's): exactly max |stored value| over the blocks written.
      float want_amax = 0.0f;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < (copy_v ? 3 : 2) * H * Dh; ++j)
          want_amax = std::max(want_amax, std::fabs(got[t * C + j]));
      EXPECT_EQ(Download(amax.get(), 1, DType::kFloat32)[0], want_amax) << "run " << run;
      if (!copy_v && run == 1) {  // the v block of dqkv_in was not written
        for (int64_t t = 0; t < T; ++t) {
          std::copy_n(&dout[t * C + 2 * H * Dh], H * Dh, &got[t * C + 2 * H * Dh]);
        }
      }
      ExpectClose(got, dwant, dt(), "dqkv run " + std::to_string(run));
      dws.push_back(Download(d_dw.get(), 2 * Dh, DType::kFloat32));
    }
    ExpectClose(std::vector<float>(dws[0].begin(), dws[0].begin() + Dh), dw[0], dt(), "dw_q");
    ExpectClose(std::vector<float>(dws[0].begin() + Dh, dws[0].end()), dw[1], dt(), "dw_k");
    ExpectSameBits(dws[0], dws[1], "dw_q, dw_k");
  }

  std::mt19937 rng_{testing::FreshSeed()};
};


TEST_P(DenseOps, EmbeddingForwardBackwardWithRepeatedIds) {
  const int64_t T = 37, D = 127, V = 17;
  std::vector<int32_t> ids(T);
  for (auto& i : ids) i = static_cast<int32_t>(rng_() % V);
  auto table = Rand(V * D), dout = Rand(T * D);
  auto dtable0 = Normal(rng_, V * D);
  auto d_ids = UploadRaw(ids);
  auto d_table = Upload(table, dt()), d_dout = Upload(dout, dt());
  DeviceBuffer d_out(T * D * 4);
  ASSERT_OK(EmbeddingForward(d_ids.as<int32_t>(), d_table.get(), d_out.get(), T, D, dt(), 0));
  std::vector<float> want(T * D);
  cpu::EmbeddingForward(ids.data(), table.data(), want.data(), T, D);
  ExpectClose(Download(d_out.get(), T * D, dt()), want, dt(), "embedding out", 0.0);

  DeviceBuffer ws(EmbeddingBackwardWorkspaceBytes(T));
  std::vector<std::vector<float>> runs;
  for (int run = 0; run < 2; ++run) {
    auto d_dtable = Upload(dtable0, DType::kFloat32);
    ASSERT_OK(EmbeddingBackward(d_ids.as<int32_t>(), d_dout.get(), d_dtable.as<float>(), T, D, V,
                                dt(), Ws(ws), 0));
    runs.push_back(Download(d_dtable.get(), V * D, DType::kFloat32));
  }
  auto want_dt = dtable0;
  cpu::EmbeddingBackward(ids.data(), dout.data(), want_dt.data(), T, D, V);
  ExpectClose(runs[0], want_dt, DType::kFloat32, "dtable");
  ExpectSameBits(runs[0], runs[1], "dtable");
}

TEST_P(DenseOps, RmsNormForwardBackwardOddShapes) {
  for (int64_t D : {17, 127, 2048}) {
    for (int64_t rows : {1, 37, 1031}) {
      SCOPED_TRACE("rows " + std::to_string(rows) + " D " + std::to_string(D));
      auto x = Rand(rows * D), w = Rand(D, 0.5f, 1.0f), dy = Rand(rows * D);
      auto dw0 = Normal(rng_, D);
      auto d_x = Upload(x, dt()), d_w = Upload(w, dt()), d_dy = Upload(dy, dt());
      DeviceBuffer d_y(rows * D * 4), d_rstd(rows * 4), d_dx(rows * D * 4);
      ASSERT_OK(RmsNormForward(d_x.get(), d_w.get(), d_y.get(), d_rstd.as<float>(), rows, D, 1e-5f,
                               dt(), 0));
      std::vector<float> y(rows * D), rstd(rows);
      cpu::RmsNormForward(x.data(), w.data(), y.data(), rstd.data(), rows, D, 1e-5f);
      ExpectClose(Download(d_y.get(), rows * D, dt()), y, dt(), "y");
      ExpectClose(Download(d_rstd.get(), rows, DType::kFloat32), rstd, DType::kFloat32, "rstd");

      DeviceBuffer ws(RmsNormBackwardWorkspaceBytes(rows, D));
      std::vector<std::vector<float>> dws;
      for (int run = 0; run < 2; ++run) {
        auto d_dw = Upload(dw0, DType::kFloat32);
        ASSERT_OK(RmsNormBackward(d_x.get(), d_w.get(), d_rstd.as<float>(), d_dy.get(), nullptr,
                                  d_dx.get(), d_dw.as<float>(), rows, D, dt(), Ws(ws), 0));
        dws.push_back(Download(d_dw.get(), D, DType::kFloat32));
      }
      std::vector<float> dx(rows * D);
      auto dw = dw0;
      cpu::RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), rows, D);
      ExpectClose(Download(d_dx.get(), rows * D, dt()), dx, dt(), "dx");
      ExpectClose(dws[0], dw, dt(), "dw");
      ExpectSameBits(dws[0], dws[1], "dw");
    }
  }
}

TEST_P(DenseOps, RmsNormResidualFusedMatchesAddThenNorm) {
  const int64_t rows = 37, D = 300;
  auto x = Rand(rows * D), r = Rand(rows * D), w = Rand(D, 0.5f, 1.0f), dy = Rand(rows * D),
       dres = Rand(rows * D);
  auto d_x = Upload(x, dt()), d_r = Upload(r, dt()), d_w = Upload(w, dt());
  DeviceBuffer d_h(rows * D * 4), d_y(rows * D * 4), d_rstd(rows * 4);
  ASSERT_OK(RmsNormResidualForward(d_x.get(), d_r.get(), d_h.get(), d_w.get(), d_y.get(),
                                   d_rstd.as<float>(), rows, D, 1e-6f, dt(), 0));
  std::vector<float> h(rows * D), y(rows * D), rstd(rows);
  for (int64_t i = 0; i < rows * D; ++i) h[i] = x[i] + r[i];
  RoundTo(dt(), h);
  cpu::RmsNormForward(h.data(), w.data(), y.data(), rstd.data(), rows, D, 1e-6f);
  ExpectClose(Download(d_h.get(), rows * D, dt()), h, dt(), "h");
  ExpectClose(Download(d_y.get(), rows * D, dt()), y, dt(), "y");
  // Backward with the residual gradient added, dx aliasing dresidual.
  auto d_dy = Upload(dy, dt()), d_dx = Upload(dres, dt());
  DeviceBuffer ws(RmsNormBackwardWorkspaceBytes(rows, D));
  auto d_dw = Upload(std::vector<float>(D, 0.0f), DType::kFloat32);
  ASSERT_OK(RmsNormBackward(d_h.get(), d_w.get(), d_rstd.as<float>(), d_dy.get(), d_dx.get(),
                            d_dx.get(), d_dw.as<float>(), rows, D, dt(), Ws(ws), 0));
  std::vector<float> dx(rows * D), dw(D, 0.0f);
  cpu::RmsNormBackward(h.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), rows, D);
  for (int64_t i = 0; i < rows * D; ++i) dx[i] += dres[i];
  ExpectClose(Download(d_dx.get(), rows * D, dt()), dx, dt(), "dx + dresidual");
  ExpectClose(Download(d_dw.get(), D, DType::kFloat32), dw, dt(), "dw");
}

TEST_P(DenseOps, RopeStridedForwardAndInverse) {
  const int64_t T = 37, H = 3, d = 64, head_stride = 80, token_stride = H * head_stride + 8;
  auto x = Rand(T * token_stride);
  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t < 20 ? t + 70000 : t - 20);
  auto d_pos = UploadRaw(pos);
  for (bool inverse : {false, true}) {
    auto d_x = Upload(x, dt());
    ASSERT_OK(RopeApply(d_x.get(), d_pos.as<int32_t>(), T, H, d, token_stride, head_stride,
                        10000.0f, inverse, dt(), 0));
    auto want = x;
    cpu::RopeApply(want.data(), pos.data(), T, H, d, token_stride, head_stride, 10000.0f, inverse);
    ExpectClose(Download(d_x.get(), T * token_stride, dt()), want, dt(), "rope");
  }
}

TEST_P(DenseOps, QkNormRopeFusedMatchesNormThenRope) {
  for (int64_t Dh : {64, 128}) {
    const int64_t T = 37, H = 3, C = 3 * H * Dh;
    SCOPED_TRACE("Dh " + std::to_string(Dh));
    auto qkv = Rand(T * C), wq = Rand(Dh, 0.3f, 1.0f), wk = Rand(Dh, 0.3f, 1.0f),
         dout = Rand(T * C);
    std::vector<int32_t> pos(T);
    for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>((t * 7) % 23);
    auto d_qkv = Upload(qkv, dt()), d_wq = Upload(wq, dt()), d_wk = Upload(wk, dt());
    auto d_pos = UploadRaw(pos);
    DeviceBuffer d_out(T * C * 4), d_rq(T * H * 4), d_rk(T * H * 4);
    ASSERT_OK(QkNormRopeForward(d_qkv.get(), d_wq.get(), d_wk.get(), d_pos.as<int32_t>(),
                                d_out.get(), d_rq.as<float>(), d_rk.as<float>(), T, H, Dh, 1e-6f,
                                10000.0f, true, dt(), 0));
    // Reference: per block, RMSNorm over rows of Dh, then RoPE on the [T, H, Dh] view.
    std::vector<float> want(T * C), rstd[2], dwant(T * C), dw[2];
    for (int b = 0; b < 2; ++b) {
      std::vector<float> rows(T * H * Dh), y(T * H * Dh), g(T * H * Dh), gx(T * H * Dh);
      rstd[b].resize(T * H);
      dw[b].assign(Dh, 0.0f);
      for (int64_t t = 0; t < T; ++t) {
        std::copy_n(&qkv[t * C + b * H * Dh], H * Dh, &rows[t * H * Dh]);
        std::copy_n(&dout[t * C + b * H * Dh], H * Dh, &g[t * H * Dh]);
      }
      const auto& w = b == 0 ? wq : wk;
      cpu::RmsNormForward(rows.data(), w.data(), y.data(), rstd[b].data(), T * H, Dh, 1e-6f);
      cpu::RopeApply(y.data(), pos.data(), T, H, Dh, H * Dh, Dh, 10000.0f, false);
      cpu::RopeApply(g.data(), pos.data(), T, H, Dh, H * Dh, Dh, 10000.0f, true);
      cpu::RmsNormBackward(rows.data(), w.data(), rstd[b].data(), g.data(), gx.data(),
                           dw[b].data(), T * H, Dh);
      for (int64_t t = 0; t < T; ++t) {
        std::copy_n(&y[t * H * Dh], H * Dh, &want[t * C + b * H * Dh]);
        std::copy_n(&gx[t * H * Dh], H * Dh, &dwant[t * C + b * H * Dh]);
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      std::copy_n(&qkv[t * C + 2 * H * Dh], H * Dh, &want[t * C + 2 * H * Dh]);
      std::copy_n(&dout[t * C + 2 * H * Dh], H * Dh, &dwant[t * C + 2 * H * Dh]);
    }
    ExpectClose(Download(d_out.get(), T * C, dt()), want, dt(), "qkv out");
    ExpectClose(Download(d_rq.get(), T * H, DType::kFloat32), rstd[0], DType::kFloat32, "rstd q");
    // Backward in place (dqkv_in == dqkv_out).
    auto d_g = Upload(dout, dt());
    auto d_dwq = Upload(std::vector<float>(Dh, 0.0f), DType::kFloat32);
    auto d_dwk = Upload(std::vector<float>(Dh, 0.0f), DType::kFloat32);
    DeviceBuffer ws(QkNormRopeBackwardWorkspaceBytes(T, H, Dh));
    ASSERT_OK(QkNormRopeBackward(d_qkv.get(), d_wq.get(), d_wk.get(), d_rq.as<float>(),
                                 d_rk.as<float>(), d_pos.as<int32_t>(), d_g.get(), d_g.get(),
                                 d_dwq.as<float>(), d_dwk.as<float>(), T, H, Dh, 10000.0f, true,
                                 dt(), Ws(ws), 0));
    ExpectClose(Download(d_g.get(), T * C, dt()), dwant, dt(), "dqkv");
    ExpectClose(Download(d_dwq.get(), Dh, DType::kFloat32), dw[0], dt(), "dw_q");
    ExpectClose(Download(d_dwk.get(), Dh, DType::kFloat32), dw[1], dt(), "dw_k");
  }
}

TEST_P(DenseOps, QkNormRopeShapesPositionsAndFallbacks) {
  const int64_t T = 41;
  std::vector<int32_t> small(T), large(T);
  for (int64_t t = 0; t < T; ++t) {
    small[t] = static_cast<int32_t>(t);
    large[t] = static_cast<int32_t>(t % 3 == 0 ? t : 1048576 - 977 * t);  // up to ~1M
  }
  // Vector path (G = 1, 2, 4, 8, 16 values of Dh), model shape, no v copy, misaligned (scalar path),
  // heads the vector path does not take (Dh 96), large positions with theta 1e6.
  CheckQkNormRope(T, 3, 32, 10000.0f, small, true, 0);
  CheckQkNormRope(T, 4, 16, 10000.0f, small, true, 0);  // the tiny preset: one vector per half
  CheckQkNormRope(T, 16, 128, 10000.0f, small, false, 0);
  CheckQkNormRope(T, 2, 128, 10000.0f, small, true, 1);
  CheckQkNormRope(T, 2, 96, 10000.0f, small, true, 0);
  CheckQkNormRope(T, 2, 256, 10000.0f, small, true, 0);
  CheckQkNormRope(T, 4, 128, 1e6f, large, true, 0);
  CheckQkNormRope(T, 4, 64, 500000.0f, large, false, 1);
}

TEST_P(DenseOps, RopeLargePositionsWideHeadsAndMlaView) {
  const int64_t T = 23;
  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t < 5 ? t : 1000003 - 7919 * t);
  auto d_pos = UploadRaw(pos);
  struct Case {
    int64_t H, d, head_stride, token_stride;
    float theta;
  };
  // MLA's rotary part of q (H heads of 192, rotary 64 at the end), one shared head, a head wider
  // than the block (d/2 = 640 frequencies).
  for (const Case& c : {Case{16, 64, 192, 16 * 192, 10000.0f}, Case{1, 64, 64, 576, 1e6f},
                        Case{2, 1280, 1280, 2560, 1e6f}}) {
    SCOPED_TRACE("H " + std::to_string(c.H) + " d " + std::to_string(c.d));
    auto x = Rand(T * c.token_stride);
    for (bool inverse : {false, true}) {
      auto d_x = Upload(x, dt());
      ASSERT_OK(RopeApply(d_x.get(), d_pos.as<int32_t>(), T, c.H, c.d, c.token_stride,
                          c.head_stride, c.theta, inverse, dt(), 0));
      auto want = x;
      cpu::RopeApply(want.data(), pos.data(), T, c.H, c.d, c.token_stride, c.head_stride, c.theta,
                     inverse);
      ExpectClose(Download(d_x.get(), T * c.token_stride, dt()), want, dt(), "rope");
    }
  }
}

TEST_P(DenseOps, RmsNormVectorPathsResidualAndMisaligned) {
  // D: 64 (the tiny preset: fewer vectors than lanes), one vector per lane, several, above the
  // forward's register cache (4096: scalar forward, vector backward in bf16); offset 1: scalar
  // paths. Residual fused, dresidual aliasing dx.
  for (int64_t D : {64, 256, 1024, 2048, 4096}) {
    for (int offset : {0, 1}) {
      const int64_t rows = 67;
      SCOPED_TRACE("D " + std::to_string(D) + " offset " + std::to_string(offset));
      auto x = Rand(rows * D), r = Rand(rows * D), w = Rand(D, 0.5f, 1.0f), dy = Rand(rows * D),
           dres = Rand(rows * D);
      auto dw0 = Normal(rng_, D);
      auto d_x = UploadAt(x, dt(), offset), d_r = UploadAt(r, dt(), offset);
      auto d_w = Upload(w, dt());
      auto d_h = UploadAt(std::vector<float>(rows * D), dt(), offset);
      auto d_y = UploadAt(std::vector<float>(rows * D), dt(), offset);
      DeviceBuffer d_rstd(rows * 4);
      ASSERT_OK(RmsNormResidualForward(d_x.ptr, d_r.ptr, d_h.ptr, d_w.get(), d_y.ptr,
                                       d_rstd.as<float>(), rows, D, 1e-6f, dt(), 0));
      std::vector<float> h(rows * D), y(rows * D), rstd(rows);
      for (int64_t i = 0; i < rows * D; ++i) h[i] = x[i] + r[i];
      RoundTo(dt(), h);
      cpu::RmsNormForward(h.data(), w.data(), y.data(), rstd.data(), rows, D, 1e-6f);
      ExpectClose(Download(d_h.ptr, rows * D, dt()), h, dt(), "h");
      ExpectClose(Download(d_y.ptr, rows * D, dt()), y, dt(), "y");
      ExpectClose(Download(d_rstd.get(), rows, DType::kFloat32), rstd, DType::kFloat32, "rstd");
      // Plain forward in place (y over x).
      auto d_x2 = UploadAt(h, dt(), offset);
      DeviceBuffer d_rstd2(rows * 4);
      ASSERT_OK(RmsNormForward(d_x2.ptr, d_w.get(), d_x2.ptr, d_rstd2.as<float>(), rows, D, 1e-6f,
                               dt(), 0));
      ExpectClose(Download(d_x2.ptr, rows * D, dt()), y, dt(), "y in place");

      auto d_dy = UploadAt(dy, dt(), offset);
      DeviceBuffer ws(RmsNormBackwardWorkspaceBytes(rows, D));
      std::vector<std::vector<float>> dws;
      for (int run = 0; run < 2; ++run) {
        auto d_dx = UploadAt(dres, dt(), offset);
        auto d_dw = Upload(dw0, DType::kFloat32);
        DeviceBuffer amax(sizeof(float));  // run 1 with the amax (FP8's), run 0 without
        ASSERT_OK(RmsNormBackward(d_h.ptr, d_w.get(), d_rstd.as<float>(), d_dy.ptr, d_dx.ptr,
                                  d_dx.ptr, d_dw.as<float>(), rows, D, dt(), Ws(ws), 0,
                                  run == 1 ? amax.as<float>() : nullptr));
        if (run == 1) {  // exactly max |stored dx|
          float want = 0.0f;
          for (float v : Download(d_dx.ptr, rows * D, dt())) want = std::max(want, std::fabs(v));
          EXPECT_EQ(Download(amax.get(), 1, DType::kFloat32)[0], want);
        }
        if (run == 0) {
          std::vector<float> dx(rows * D);
          auto dw = dw0;
          cpu::RmsNormBackward(h.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(),
                               rows, D);
          for (int64_t i = 0; i < rows * D; ++i) dx[i] += dres[i];
          ExpectClose(Download(d_dx.ptr, rows * D, dt()), dx, dt(), "dx + dresidual");
          ExpectClose(Download(d_dw.get(), D, DType::kFloat32), dw, dt(), "dw");
        }
        dws.push_back(Download(d_dw.get(), D, DType::kFloat32));
      }
      ExpectSameBits(dws[0], dws[1], "dw");
    }
  }
}

TEST_P(DenseOps, GroupNormGateVectorShapesAndMisaligned) {
  // (H, Dh, offset): model shape, Dh 96 (bf16: idle lanes forward, scalar backward), Dh 32, Dh 16
  // (the tiny preset), misaligned (scalar paths).
  struct Case {
    int64_t H, Dh;
    int offset;
  };
  for (const Case& c :
       {Case{16, 128, 0}, Case{5, 96, 0}, Case{7, 32, 0}, Case{4, 16, 0}, Case{4, 64, 1}}) {
    const int64_t T = 45, H = c.H, Dh = c.Dh, C = H * Dh;
    SCOPED_TRACE("H " + std::to_string(H) + " Dh " + std::to_string(Dh) + " offset " +
                 std::to_string(c.offset));
    auto o = Rand(T * C), w = Rand(C, 0.3f, 1.0f), gate = Rand(T * C, 2.0f), dy = Rand(T * C);
    auto d_o = UploadAt(o, dt(), c.offset), d_gate = UploadAt(gate, dt(), c.offset);
    auto d_w = Upload(w, dt());
    auto d_y = UploadAt(std::vector<float>(T * C), dt(), c.offset);
    DeviceBuffer d_rstd(T * H * 4);
    ASSERT_OK(GroupNormGateForward(d_o.ptr, d_w.get(), d_gate.ptr, d_y.ptr, d_rstd.as<float>(), T,
                                   H, Dh, 1e-6f, dt(), 0));
    std::vector<float> y(T * C), rstd(T * H), do_(T * C), dgate(T * C), dw(C, 0.5f);
    cpu::GroupNormGateForward(o.data(), w.data(), gate.data(), y.data(), rstd.data(), T, H, Dh,
                              1e-6f);
    ExpectClose(Download(d_y.ptr, T * C, dt()), y, dt(), "y");
    ExpectClose(Download(d_rstd.get(), T * H, DType::kFloat32), rstd, DType::kFloat32, "rstd");
    cpu::GroupNormGateBackward(o.data(), w.data(), gate.data(), rstd.data(), dy.data(),
                               do_.data(), dw.data(), dgate.data(), T, H, Dh);
    DeviceBuffer ws(GroupNormGateBackwardWorkspaceBytes(T, H, Dh));
    std::vector<std::vector<float>> dws;
    for (int run = 0; run < 2; ++run) {
      // do_ over dy, dgate over a copy of gate.
      auto d_dy = UploadAt(dy, dt(), c.offset), d_g2 = UploadAt(gate, dt(), c.offset);
      auto d_dw = Upload(std::vector<float>(C, 0.5f), DType::kFloat32);
      DeviceBuffer amax(sizeof(float));  // run 1 with the amax of dgate (FP8's), run 0 without
      ASSERT_OK(GroupNormGateBackward(d_o.ptr, d_w.get(), d_g2.ptr, d_rstd.as<float>(), d_dy.ptr,
                                      d_dy.ptr, d_dw.as<float>(), d_g2.ptr, T, H, Dh, dt(), Ws(ws),
                                      0, run == 1 ? amax.as<float>() : nullptr));
      ExpectClose(Download(d_dy.ptr, T * C, dt()), do_, dt(), "do");
      const auto got_dgate = Download(d_g2.ptr, T * C, dt());
      ExpectClose(got_dgate, dgate, dt(), "dgate");
      if (run == 1) {  // exactly max |stored dgate|
        float want = 0.0f;
        for (float v : got_dgate) want = std::max(want, std::fabs(v));
        EXPECT_EQ(Download(amax.get(), 1, DType::kFloat32)[0], want);
      }
      dws.push_back(Download(d_dw.get(), C, DType::kFloat32));
    }
    ExpectClose(dws[0], dw, dt(), "dw");
    ExpectSameBits(dws[0], dws[1], "dw");
  }
}

TEST_P(DenseOps, SwiGluTailsAndMisaligned) {
  for (int64_t n : {1, 5, 8, 4099}) {
    for (int offset : {0, 1}) {
      SCOPED_TRACE("n " + std::to_string(n) + " offset " + std::to_string(offset));
      auto g = Rand(n, 2.0f), u = Rand(n), dy = Rand(n);
      auto d_g = UploadAt(g, dt(), offset), d_u = UploadAt(u, dt(), offset);
      auto d_dy = UploadAt(dy, dt(), offset), d_y = UploadAt(std::vector<float>(n), dt(), offset);
      ASSERT_OK(SwiGluForward(d_g.ptr, d_u.ptr, d_y.ptr, n, dt(), 0));
      std::vector<float> y(n), dg(n), du(n);
      cpu::SwiGluForward(g.data(), u.data(), y.data(), n);
      ExpectClose(Download(d_y.ptr, n, dt()), y, dt(), "y");
      // With the amaxes of dg and du (the FP8 recipe's): exactly max |stored value| of each.
      DeviceBuffer amax(2 * sizeof(float));
      ASSERT_OK(SwiGluBackward(d_g.ptr, d_u.ptr, d_dy.ptr, d_g.ptr, d_u.ptr, n, dt(), 0,
                               amax.as<float>()));
      cpu::SwiGluBackward(g.data(), u.data(), dy.data(), dg.data(), du.data(), n);
      const auto got_dg = Download(d_g.ptr, n, dt()), got_du = Download(d_u.ptr, n, dt());
      ExpectClose(got_dg, dg, dt(), "dg");
      ExpectClose(got_du, du, dt(), "du");
      const auto amaxes = Download(amax.get(), 2, DType::kFloat32);
      float want_g = 0.0f, want_u = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        want_g = std::max(want_g, std::fabs(got_dg[i]));
        want_u = std::max(want_u, std::fabs(got_du[i]));
      }
      EXPECT_EQ(amaxes[0], want_g);
      EXPECT_EQ(amaxes[1], want_u);
    }
  }
}

TEST_P(DenseOps, SwiGluForwardBackward) {
  const int64_t n = 100003;
  auto g = Rand(n, 2.0f), u = Rand(n), dy = Rand(n);
  auto d_g = Upload(g, dt()), d_u = Upload(u, dt()), d_dy = Upload(dy, dt());
  DeviceBuffer d_y(n * 4);
  ASSERT_OK(SwiGluForward(d_g.get(), d_u.get(), d_y.get(), n, dt(), 0));
  std::vector<float> y(n), dg(n), du(n);
  cpu::SwiGluForward(g.data(), u.data(), y.data(), n);
  ExpectClose(Download(d_y.get(), n, dt()), y, dt(), "y");
  // In place: dg over g, du over u.
  ASSERT_OK(SwiGluBackward(d_g.get(), d_u.get(), d_dy.get(), d_g.get(), d_u.get(), n, dt(), 0));
  cpu::SwiGluBackward(g.data(), u.data(), dy.data(), dg.data(), du.data(), n);
  ExpectClose(Download(d_g.get(), n, dt()), dg, dt(), "dg");
  ExpectClose(Download(d_u.get(), n, dt()), du, dt(), "du");
}

TEST_P(DenseOps, GroupNormGateForwardBackward) {
  for (int64_t Dh : {17, 64, 128}) {
    const int64_t T = 37, H = 3, C = H * Dh;
    SCOPED_TRACE("Dh " + std::to_string(Dh));
    auto o = Rand(T * C), w = Rand(C, 0.3f, 1.0f), gate = Rand(T * C, 2.0f), dy = Rand(T * C);
    auto d_o = Upload(o, dt()), d_w = Upload(w, dt()), d_gate = Upload(gate, dt());
    auto d_dy = Upload(dy, dt());
    DeviceBuffer d_y(T * C * 4), d_rstd(T * H * 4);
    ASSERT_OK(GroupNormGateForward(d_o.get(), d_w.get(), d_gate.get(), d_y.get(),
                                   d_rstd.as<float>(), T, H, Dh, 1e-6f, dt(), 0));
    std::vector<float> y(T * C), rstd(T * H), do_(T * C), dgate(T * C), dw(C, 0.0f);
    cpu::GroupNormGateForward(o.data(), w.data(), gate.data(), y.data(), rstd.data(), T, H, Dh,
                              1e-6f);
    ExpectClose(Download(d_y.get(), T * C, dt()), y, dt(), "y");
    auto d_dw = Upload(dw, DType::kFloat32);
    DeviceBuffer ws(GroupNormGateBackwardWorkspaceBytes(T, H, Dh));
    // do_ over dy, dgate over gate.
    ASSERT_OK(GroupNormGateBackward(d_o.get(), d_w.get(), d_gate.get(), d_rstd.as<float>(),
                                    d_dy.get(), d_dy.get(), d_dw.as<float>(), d_gate.get(), T, H,
                                    Dh, dt(), Ws(ws), 0));
    cpu::GroupNormGateBackward(o.data(), w.data(), gate.data(), rstd.data(), dy.data(),
                               do_.data(), dw.data(), dgate.data(), T, H, Dh);
    ExpectClose(Download(d_dy.get(), T * C, dt()), do_, dt(), "do");
    ExpectClose(Download(d_gate.get(), T * C, dt()), dgate, dt(), "dgate");
    ExpectClose(Download(d_dw.get(), C, DType::kFloat32), dw, dt(), "dw");
  }
}

TEST_P(DenseOps, CrossEntropyRowBlockWithIgnoredTargets) {
  // V = 1031: value by value; 1032 and 32000: whole 16-byte vectors (either dtype); 1032 with the
  // buffer one value off alignment: value by value again. The gradient overwrites the logits.
  // Without and with the z-loss (train.z_loss), against the CPU kernel.
  const int64_t T = 37;
  for (const float z : {0.0f, 0.2f})
  for (const auto& [V, offset] :
       {std::pair<int64_t, int64_t>{1031, 0}, {1032, 0}, {32000, 0}, {1032, 1}}) {
    SCOPED_TRACE("V " + std::to_string(V) + " offset " + std::to_string(offset) + " z " +
                 std::to_string(z));
    auto logits = Rand(T * V, 3.0f);
    logits[5 * V + 3] = 40.0f;  // one row with a dominant value
    std::vector<int32_t> targets(T);
    for (int64_t t = 0; t < T; ++t) {
      targets[t] = t % 5 == 4 ? -1 : static_cast<int32_t>(rng_() % V);
    }
    std::vector<float> padded(offset, 0.0f);
    padded.insert(padded.end(), logits.begin(), logits.end());
    auto d_buf = Upload(padded, dt());
    void* d_logits = static_cast<char*>(d_buf.get()) + offset * DTypeSize(dt());
    auto d_targets = UploadRaw(targets);
    DeviceBuffer d_loss(T * 4), d_loss_only(T * 4), d_sum(8);
    const float scale = 1.0f / 29.0f;
    // Loss only first (the logits stay), then loss and gradient in place.
    ASSERT_OK(CrossEntropy(d_logits, d_targets.as<int32_t>(), T, V, scale, d_loss_only.as<float>(),
                           nullptr, dt(), 0, z));
    ASSERT_OK(CrossEntropy(d_logits, d_targets.as<int32_t>(), T, V, scale, d_loss.as<float>(),
                           d_logits, dt(), 0, z));
    ASSERT_OK(SumRows(d_loss.as<float>(), T, d_sum.as<double>(), 0));
    std::vector<float> dlogits(T * V);
    int64_t n_valid = 0;
    const double want = cpu::CrossEntropy(logits.data(), targets.data(), T, V, scale,
                                          dlogits.data(), &n_valid, z);
    double got = 0.0;
    ASSERT_CUDA(cudaMemcpy(&got, d_sum.get(), 8, cudaMemcpyDeviceToHost));
    EXPECT_NEAR(got, want, 1e-4 * std::abs(want) + 1e-4);
    EXPECT_EQ(Download(d_loss_only.get(), T, DType::kFloat32),
              Download(d_loss.get(), T, DType::kFloat32));
    const auto all = Download(d_buf.get(), offset + T * V, dt());
    ExpectClose(std::vector<float>(all.begin() + offset, all.end()), dlogits, dt(), "dlogits");
  }
}

TEST_P(DenseOps, GemmAllTransposesAndLinear) {
  Blas* blas = nullptr;
  std::unique_ptr<Blas> owner;
  ASSERT_OK(Blas::Create(&owner));
  blas = owner.get();
  const int64_t M = 37, N = 127, K = 65;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      SCOPED_TRACE(std::string("ta ") + (ta ? "1" : "0") + " tb " + (tb ? "1" : "0"));
      auto A = Rand(M * K), B = Rand(K * N), C0 = Rand(M * N);
      auto d_A = Upload(A, dt()), d_B = Upload(B, dt()), d_C = Upload(C0, dt());
      GemmArgs g;
      g.trans_a = ta, g.trans_b = tb, g.M = M, g.N = N, g.K = K, g.alpha = 0.5f, g.beta = 2.0f;
      g.A = d_A.get(), g.lda = ta ? M : K, g.B = d_B.get(), g.ldb = tb ? K : N;
      g.C = d_C.get(), g.ldc = N, g.ab_type = dt(), g.c_type = dt();
      // Out of place first (C_in added, C only written), then in place.
      DeviceBuffer d_out(M * N * 4);
      g.C = d_out.get(), g.C_in = d_C.get();
      ASSERT_OK(blas->Gemm(g, 0));
      g.C = d_C.get(), g.C_in = nullptr;
      ASSERT_OK(blas->Gemm(g, 0));
      auto want = C0;
      cpu::Gemm(ta, tb, M, N, K, 0.5f, A.data(), g.lda, B.data(), g.ldb, 2.0f, want.data(), N);
      ExpectClose(Download(d_out.get(), M * N, dt()), want, dt(), "C from C_in");
      ExpectClose(Download(d_C.get(), M * N, dt()), want, dt(), "C");
    }
  }
  // Linear forward/backward, dW accumulated in fp32.
  const int64_t T = 37, in = 65, out = 127;
  auto x = Rand(T * in), W = Rand(out * in, 0.1f), dy = Rand(T * out), dW0 = Normal(rng_, out * in);
  auto d_x = Upload(x, dt()), d_W = Upload(W, dt()), d_dy = Upload(dy, dt());
  auto d_dW = Upload(dW0, DType::kFloat32);
  DeviceBuffer d_y(T * out * 4), d_dx(T * in * 4);
  ASSERT_OK(blas->LinearForward(d_x.get(), d_W.get(), d_y.get(), T, in, out, dt(), 0));
  ASSERT_OK(blas->LinearBackward(d_x.get(), d_W.get(), d_dy.get(), d_dx.get(), d_dW.as<float>(), T,
                                 in, out, dt(), 0));
  std::vector<float> y(T * out), dx(T * in);
  auto dW = dW0;
  cpu::LinearForward(x.data(), W.data(), y.data(), T, in, out);
  cpu::LinearBackward(x.data(), W.data(), dy.data(), dx.data(), dW.data(), T, in, out);
  ExpectClose(Download(d_y.get(), T * out, dt()), y, dt(), "y");
  ExpectClose(Download(d_dx.get(), T * in, dt()), dx, dt(), "dx");
  ExpectClose(Download(d_dW.get(), out * in, DType::kFloat32), dW, dt(), "dW");
}

// Benchmarks run the heuristic's other algorithms (GemmArgs::candidate): each one offered must
// compute the same product, each is described, and one beyond those offered is refused by name.
TEST_P(DenseOps, GemmEveryCandidateComputesTheSameProduct) {
  std::unique_ptr<Blas> blas;
  ASSERT_OK(Blas::Create(&blas));
  const int64_t M = 300, N = 200, K = 129;
  auto A = Rand(M * K), B = Rand(N * K), C0 = Rand(M * N);
  auto d_A = Upload(A, dt()), d_B = Upload(B, dt());
  auto want = C0;
  cpu::Gemm(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 1.0f, want.data(), N);
  GemmArgs g;
  g.trans_b = true, g.M = M, g.N = N, g.K = K, g.beta = 1.0f;
  g.A = d_A.get(), g.lda = K, g.B = d_B.get(), g.ldb = K, g.ldc = N;
  g.ab_type = dt(), g.c_type = dt();
  int offered = 0;
  for (int c = 0; c < 16; ++c) {
    SCOPED_TRACE("candidate " + std::to_string(c));
    auto d_C = Upload(C0, dt());
    g.C = d_C.get(), g.candidate = c;
    const Status st = blas->Gemm(g, 0);
    if (!st.ok()) {
      EXPECT_NE(st.message().find("candidate " + std::to_string(c) + " asked for"),
                std::string::npos)
          << st.message();
      break;
    }
    ++offered;
    EXPECT_NE(blas->AlgorithmName(g).find("tile"), std::string::npos) << blas->AlgorithmName(g);
    ExpectClose(Download(d_C.get(), M * N, dt()), want, dt(), "C");
  }
  EXPECT_GE(offered, 1);
  g.candidate = 16;
  EXPECT_FALSE(blas->Gemm(g, 0).ok());
  g.candidate = 0, g.M = M + 1;
  EXPECT_EQ(blas->AlgorithmName(g), "");  // no plan for this shape yet
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DenseOps,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

class CudaOnly : public ::testing::Test {
 protected:
  void SetUp() override { SPINDLE_REQUIRE_GPU(); }
};

// Uploads each host vector `off` floats into a fresh buffer (so off = 1 misaligns it for the
// vector path), its device pointers to ptr[...]; with `bf16_copy`, also a bf16 buffer shifted the
// same way, returned (else null). The buffers go to `bufs`.
void* UploadShifted(std::initializer_list<const std::vector<float>*> srcs, int off,
                    bool bf16_copy, std::vector<DeviceBuffer>& bufs, float** ptr) {
  int k = 0;
  int64_t n = 0;
  for (const std::vector<float>* src : srcs) {
    std::vector<float> padded(off, 0.0f);
    padded.insert(padded.end(), src->begin(), src->end());
    bufs.push_back(Upload(padded, DType::kFloat32));
    ptr[k++] = bufs.back().as<float>() + off;
    n = static_cast<int64_t>(src->size());
  }
  if (!bf16_copy) return nullptr;
  bufs.emplace_back((n + off) * 2 + 16);
  return static_cast<char*>(bufs.back().get()) + 2 * off;
}

TEST_F(CudaOnly, AdamWMultiTensorMatchesCpuAcrossLaunches) {
  std::mt19937 rng(testing::FreshSeed());
  // 30 tensors (more than one launch's table) and one of 11M values (more than one launch's
  // blocks), odd sizes.
  std::vector<int64_t> sizes;
  for (int i = 0; i < 30; ++i) sizes.push_back(1 + static_cast<int64_t>(rng() % 5000));
  sizes.push_back(11 * 1000 * 1000 + 17);
  AdamWHyper hp{1e-3f, 0.9f, 0.95f, 1e-8f, 7, 0.5f};
  std::vector<DeviceBuffer> bufs;
  std::vector<OptimizerTensor> tensors;
  std::vector<std::vector<float>> p, g, m, v;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    p.push_back(Normal(rng, n));
    g.push_back(Normal(rng, n));
    m.push_back(Normal(rng, n, 0.1f));
    auto vv = Normal(rng, n, 0.1f);
    for (auto& e : vv) e = e * e;
    v.push_back(vv);
    bufs.push_back(Upload(p[i], DType::kFloat32));
    bufs.push_back(Upload(g[i], DType::kFloat32));
    bufs.push_back(Upload(m[i], DType::kFloat32));
    bufs.push_back(Upload(v[i], DType::kFloat32));
    bufs.emplace_back(n * 2);
    const size_t b = bufs.size() - 5;
    tensors.push_back({bufs[b].as<float>(), bufs[b + 1].as<float>(), bufs[b + 2].as<float>(),
                       bufs[b + 3].as<float>(), bufs[b + 4].get(), n, i % 3 == 0 ? 0.0f : 0.1f});
  }
  ASSERT_OK(AdamWMultiTensor(tensors.data(), static_cast<int64_t>(tensors.size()), hp, 0));
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto gs = g[i];
    for (auto& e : gs) e *= hp.grad_scale;
    cpu::AdamWParams cp{hp.lr, hp.beta1, hp.beta2, hp.eps, tensors[i].weight_decay, hp.step};
    cpu::AdamWStep(p[i].data(), gs.data(), m[i].data(), v[i].data(), sizes[i], cp);
    const std::string what = "tensor " + std::to_string(i);
    ExpectClose(Download(tensors[i].p, sizes[i], DType::kFloat32), p[i], DType::kFloat32, what + " p");
    ExpectClose(Download(tensors[i].m, sizes[i], DType::kFloat32), m[i], DType::kFloat32, what + " m");
    ExpectClose(Download(tensors[i].v, sizes[i], DType::kFloat32), v[i], DType::kFloat32, what + " v");
    ExpectClose(Download(tensors[i].p_bf16, sizes[i], DType::kBFloat16), p[i], DType::kBFloat16,
                what + " p bf16");
  }
}

TEST_F(CudaOnly, AdamWManyTensorsMisalignedAndWithoutBf16Copy) {
  std::mt19937 rng(testing::FreshSeed());
  // 130 tensors (several launches), every third shifted by one float (scalar path), every fifth
  // without a bf16 copy, odd sizes around the per-block chunk.
  const int64_t n_t = 130;
  AdamWHyper hp{3e-4f, 0.9f, 0.999f, 1e-8f, 3, 1.0f};
  std::vector<DeviceBuffer> bufs;
  std::vector<OptimizerTensor> tensors;
  std::vector<std::vector<float>> p, g, m, v;
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < n_t; ++i) {
    const int64_t n = i % 17 == 0 ? 8192 * 3 + 5 : 1 + static_cast<int64_t>(rng() % 3000);
    sizes.push_back(n);
    const int off = i % 3 == 1 ? 1 : 0;
    p.push_back(Normal(rng, n));
    g.push_back(Normal(rng, n));
    m.push_back(Normal(rng, n, 0.1f));
    auto vv = Normal(rng, n, 0.1f);
    for (auto& e : vv) e = e * e;
    v.push_back(vv);
    float* ptr[4];
    void* pb = UploadShifted({&p[i], &g[i], &m[i], &v[i]}, off, i % 5 != 0, bufs, ptr);
    tensors.push_back({ptr[0], ptr[1], ptr[2], ptr[3], pb, n, i % 4 == 0 ? 0.0f : 0.1f});
  }
  ASSERT_OK(AdamWMultiTensor(tensors.data(), n_t, hp, 0));
  for (int64_t i = 0; i < n_t; ++i) {
    cpu::AdamWParams cp{hp.lr, hp.beta1, hp.beta2, hp.eps, tensors[i].weight_decay, hp.step};
    cpu::AdamWStep(p[i].data(), g[i].data(), m[i].data(), v[i].data(), sizes[i], cp);
    const std::string what = "tensor " + std::to_string(i);
    ExpectClose(Download(tensors[i].p, sizes[i], DType::kFloat32), p[i], DType::kFloat32, what + " p");
    ExpectClose(Download(tensors[i].m, sizes[i], DType::kFloat32), m[i], DType::kFloat32, what + " m");
    ExpectClose(Download(tensors[i].v, sizes[i], DType::kFloat32), v[i], DType::kFloat32, what + " v");
    if (tensors[i].p_bf16 != nullptr) {
      ExpectClose(Download(tensors[i].p_bf16, sizes[i], DType::kBFloat16), p[i], DType::kBFloat16,
                  what + " p bf16");
    }
  }
}

TEST_F(CudaOnly, SgdMultiTensorMatchesCpuWithAndWithoutMomentum) {
  std::mt19937 rng(testing::FreshSeed());
  // 70 tensors (two launches), every third shifted by one float (scalar path), every fourth
  // without a bf16 copy, odd sizes around the per-block chunk; no v at all, no m without momentum.
  for (const float momentum : {0.9f, 0.0f}) {
    SCOPED_TRACE("momentum " + std::to_string(momentum));
    const int64_t n_t = 70;
    const SgdHyper hp{2e-2f, momentum, 0.75f};
    std::vector<DeviceBuffer> bufs;
    std::vector<OptimizerTensor> tensors;
    std::vector<std::vector<float>> p, g, m;
    std::vector<int64_t> sizes;
    for (int64_t i = 0; i < n_t; ++i) {
      const int64_t n = i % 13 == 0 ? 8192 * 2 + 3 : 1 + static_cast<int64_t>(rng() % 3000);
      sizes.push_back(n);
      const int off = i % 3 == 1 ? 1 : 0;
      p.push_back(Normal(rng, n));
      g.push_back(Normal(rng, n));
      m.push_back(Normal(rng, n, 0.1f));
      float* ptr[3];
      void* pb = UploadShifted({&p[i], &g[i], &m[i]}, off, i % 4 != 0, bufs, ptr);
      tensors.push_back({ptr[0], ptr[1], momentum > 0 ? ptr[2] : nullptr, nullptr, pb, n,
                         i % 5 == 0 ? 0.0f : 0.1f});
    }
    ASSERT_OK(SgdMultiTensor(tensors.data(), n_t, hp, 0));
    for (int64_t i = 0; i < n_t; ++i) {
      auto gs = g[i];
      for (auto& e : gs) e *= hp.grad_scale;
      cpu::SgdStep(p[i].data(), gs.data(), momentum > 0 ? m[i].data() : nullptr, sizes[i], hp.lr,
                   momentum, tensors[i].weight_decay);
      const std::string what = "tensor " + std::to_string(i);
      ExpectClose(Download(tensors[i].p, sizes[i], DType::kFloat32), p[i], DType::kFloat32,
                  what + " p");
      if (momentum > 0) {
        ExpectClose(Download(tensors[i].m, sizes[i], DType::kFloat32), m[i], DType::kFloat32,
                    what + " m");
      }
      if (tensors[i].p_bf16 != nullptr) {
        ExpectClose(Download(tensors[i].p_bf16, sizes[i], DType::kBFloat16), p[i],
                    DType::kBFloat16, what + " p bf16");
      }
    }
  }
  // A rule's state that is missing is named, and nothing runs.
  DeviceBuffer x(64 * 4);
  OptimizerTensor t{x.as<float>(), x.as<float>(), nullptr, nullptr, nullptr, 16, 0.0f};
  const Status st = SgdMultiTensor(&t, 1, {1e-2f, 0.9f, 1.0f}, 0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("lacks the optimizer state"), std::string::npos) << st.message();
}

TEST_F(CudaOnly, CachingAllocatorReusesBlocksAndCounts) {
  CachingAllocator alloc;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  ASSERT_OK(alloc.Allocate(1000, &a));
  ASSERT_OK(alloc.Allocate(3u << 20, &b));
  AllocatorStats s = alloc.Stats();
  EXPECT_EQ(s.allocated, 1024u + (4u << 20));
  EXPECT_EQ(s.reserved, s.allocated);
  EXPECT_EQ(s.cuda_mallocs, 2);
  ASSERT_OK(alloc.Free(b));
  EXPECT_EQ(alloc.Stats().allocated, 1024u);
  ASSERT_OK(alloc.Allocate(3u << 20, &c));  // served from the cache
  EXPECT_EQ(c, b);
  EXPECT_EQ(alloc.Stats().cuda_mallocs, 2);
  EXPECT_EQ(alloc.Stats().peak_allocated, 1024u + (4u << 20));
  ASSERT_OK(alloc.Free(c));
  ASSERT_OK(alloc.Free(a));
  EXPECT_EQ(alloc.Stats().allocated, 0u);
  ASSERT_OK(alloc.EmptyCache());
  EXPECT_EQ(alloc.Stats().reserved, 0u);
  int local = 0;
  EXPECT_EQ(alloc.Free(&local).code(), StatusCode::kInvalidArgument);
}

TEST_F(CudaOnly, CachingAllocatorNamesAnAllocationTheDeviceCannotHold) {
  size_t free = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  CachingAllocator alloc;
  void *kept = nullptr, *cached = nullptr, *p = nullptr;
  ASSERT_OK(alloc.Allocate(3u << 20, &kept));
  ASSERT_OK(alloc.Allocate(5u << 20, &cached));
  ASSERT_OK(alloc.Free(cached));
  const AllocatorStats before = alloc.Stats();
  const Status s = alloc.Allocate(total + (1ull << 30), &p);
  EXPECT_EQ(s.code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(p, nullptr);
  char want[64];
  std::snprintf(
      want, sizeof(want), "allocating %.2f GiB",
      static_cast<double>(CachingAllocator::RoundSize(total + (1ull << 30))) / (1u << 30));
  for (const char* part : {"out of device memory", static_cast<const char*>(want),
                           "0.00 GiB allocated", " free of "}) {
    EXPECT_NE(s.message().find(part), std::string::npos) << part << " in: " << s.message();
  }
  // Only the cache went back to the device; the live block is untouched and more can be had.
  const AllocatorStats after = alloc.Stats();
  EXPECT_EQ(after.allocated, before.allocated);
  EXPECT_EQ(after.reserved, before.allocated);
  EXPECT_EQ(after.cuda_mallocs, before.cuda_mallocs);
  ASSERT_OK(alloc.Allocate(1u << 20, &p));
  EXPECT_NE(p, nullptr);
  ASSERT_OK(alloc.Free(p));
  ASSERT_OK(alloc.Free(kept));
}

// Needs no GPU: the dtype is refused before any launch.
TEST(CudaDispatch, UnsupportedDtypeIsNamed) {
  const Status s = SwiGluForward(nullptr, nullptr, nullptr, 10, DType::kFloat16, 0);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("SwiGluForward: unsupported dtype 'float16'"), std::string::npos)
      << s.message();
}

}  // namespace
}  // namespace spindle::kernels::cuda

namespace spindle::kernels::cuda {
namespace {

// CopyRows (MLA key assembly: strided, broadcast over heads; vector and element paths) and
// SumHeads (the shared rotary key's gradient) against host loops.
TEST(ModelGlue, CopyRowsAndSumHeadsMatchHostLoops) {
  SPINDLE_REQUIRE_GPU();
  std::mt19937 rng(testing::FreshSeed());
  const DType bf = DType::kBFloat16;
  // (T, H, width, src token stride, src head stride, dst token stride, dst head stride)
  struct C { int64_t T, H, w, sts, shs, dts, dhs; };
  for (const C c : {C{37, 5, 64, 576, 0, 5 * 192, 192}, C{29, 3, 16, 48, 0, 3 * 32, 32},
                    C{41, 4, 7, 4 * 9, 9, 4 * 11, 11}, C{50, 1, 512, 576, 0, 512, 0}}) {
    const int64_t src_n = (c.T - 1) * c.sts + (c.H - 1) * c.shs + c.w;
    const int64_t dst_n = (c.T - 1) * c.dts + (c.H - 1) * c.dhs + c.w;
    auto src = Normal(rng, src_n);
    RoundTo(bf, src);
    std::vector<float> dst0(dst_n, -7.0f), want = dst0;
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t j = 0; j < c.w; ++j)
          want[t * c.dts + h * c.dhs + j] = src[t * c.sts + h * c.shs + j];
    auto d_src = Upload(src, bf);
    auto d_dst = Upload(dst0, bf);
    ASSERT_OK(CopyRows(d_dst.get(), c.dts, c.dhs, d_src.get(), c.sts, c.shs, c.T, c.H, c.w, bf,
                       0));
    ExpectSameBits(Download(d_dst.get(), dst_n, bf), want, "CopyRows");
  }
  const int64_t T = 33, H = 6, d = 24, ts = H * 40, hs = 40, os = 30;
  auto x = Normal(rng, T * ts);
  RoundTo(bf, x);
  std::vector<float> want(T * os, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < d; ++j) {
      float s = 0.0f;
      for (int64_t h = 0; h < H; ++h) s += x[t * ts + h * hs + j];
      want[t * os + j] = s;
    }
  auto d_x = Upload(x, bf);
  auto d_out = Upload(std::vector<float>(T * os, 0.0f), bf);
  ASSERT_OK(SumHeads(d_x.get(), T, H, d, ts, hs, d_out.get(), os, bf, 0));
  ExpectClose(Download(d_out.get(), T * os, bf), want, bf, "SumHeads");
  // Added to fp32 rows that hold values already (a sum over groups of heads): the columns past d
  // keep theirs.
  auto base = Normal(rng, T * os);
  std::vector<float> added = base;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < d; ++j) added[t * os + j] += want[t * os + j];
  auto d_acc = Upload(base, DType::kFloat32);
  ASSERT_OK(SumHeads(d_x.get(), T, H, d, ts, hs, d_acc.get(), os, bf, 0, /*add_f32=*/true));
  ExpectClose(Download(d_acc.get(), T * os, DType::kFloat32), added, DType::kFloat32,
              "SumHeads added to fp32");
}

// AddRows and CastRows (MLA AllGather's gradient sums and fp32 reduce-scatter blocks) on strided
// rows: the columns past `width` keep their values; bf16 -> fp32 is exact, fp32 -> bf16 rounds
// once, a bf16 add rounds the fp32 sum once.
TEST(ModelGlue, AddRowsAndCastRowsMatchHostLoops) {
  SPINDLE_REQUIRE_GPU();
  std::mt19937 rng(testing::FreshSeed());
  const DType bf = DType::kBFloat16, f32 = DType::kFloat32;
  const int64_t rows = 37, width = 21, ds = 30, ss = 25;
  auto dst = Normal(rng, rows * ds), src = Normal(rng, rows * ss);
  RoundTo(bf, dst);
  RoundTo(bf, src);
  std::vector<float> sum = dst, cast_f32(rows * ds, -3.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j) {
      sum[r * ds + j] = dst[r * ds + j] + src[r * ss + j];
      cast_f32[r * ds + j] = src[r * ss + j];
    }
  RoundTo(bf, sum);
  auto d_dst = Upload(dst, bf), d_src = Upload(src, bf);
  ASSERT_OK(AddRows(d_dst.get(), ds, d_src.get(), ss, rows, width, bf, 0));
  ExpectSameBits(Download(d_dst.get(), rows * ds, bf), sum, "AddRows");
  auto d_f32 = Upload(std::vector<float>(rows * ds, -3.0f), f32);
  ASSERT_OK(CastRows(d_f32.get(), f32, ds, d_src.get(), bf, ss, rows, width, 0));
  ExpectSameBits(Download(d_f32.get(), rows * ds, f32), cast_f32, "CastRows bf16 -> fp32");
  auto unrounded = Normal(rng, rows * ss);
  std::vector<float> rounded(rows * ds, -3.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j) rounded[r * ds + j] = unrounded[r * ss + j];
  RoundTo(bf, rounded);
  auto d_un = Upload(unrounded, f32), d_bf = Upload(std::vector<float>(rows * ds, -3.0f), bf);
  ASSERT_OK(CastRows(d_bf.get(), bf, ds, d_un.get(), f32, ss, rows, width, 0));
  ExpectSameBits(Download(d_bf.get(), rows * ds, bf), rounded, "CastRows fp32 -> bf16");
  const Status bad = CastRows(d_bf.get(), bf, 10, d_un.get(), f32, ss, rows, width, 0);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.message();
}

}  // namespace
}  // namespace spindle::kernels::cuda
