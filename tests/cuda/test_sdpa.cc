// cuDNN causal attention (kernels/cuda/sdpa.h) against the CPU reference (kernels/cpu/attention.h):
// forward out and log-sum-exp, backward dq/dk/dv, on fresh random inputs rounded to the storage
// dtype. Shapes: the tiny model (H=4, Dqk=32, Dv=16; T odd, a multiple of 128, and not), the 1B
// MLA head (H=16, Dqk=192, Dv=128), strided views inside larger buffers (fused q/k rows, V at an
// offset with head stride 256, head-major out) whose bytes outside the view must stay untouched,
// several documents (one-token and empty ones included) through both routes (one ragged graph;
// one graph per document), fp16, the deterministic backward, argument errors, and context
// parallelism's split of one causal attention into a full (unmasked, queries and keys of different
// lengths) piece and a causal piece merged by their log-sum-exp statistics.
//
// Tolerances (|got - want| <= abs * peak + rel * |want|, peak = max |want|): out 1% + 1% (bf16
// output rounding plus P rounded to bf16 before P V), dq/dk/dv 2% + 2% (P and dS enter the
// gradient matmuls in bf16), stats 1e-3 + 1e-3 (fp32 throughout). Each comparison prints how much
// of its tolerance it used.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sdpa.h"
#include "tests/cuda/cuda_test_util.h"

namespace spindle::kernels::cuda {
namespace {

using testing::DeviceBuffer;
using testing::FreshSeed;

constexpr DType kBf16 = DType::kBFloat16;
constexpr DType kFp16 = DType::kFloat16;

uint16_t ToBits(float x, DType t) {
  if (t == kFp16) return static_cast<__half_raw>(__float2half(x)).x;
  return static_cast<__nv_bfloat16_raw>(__float2bfloat16(x)).x;
}

float FromBits(uint16_t b, DType t) {
  if (t == kFp16) {
    __half_raw r;
    r.x = b;
    return __half2float(__half(r));
  }
  __nv_bfloat16_raw r;
  r.x = b;
  return __bfloat162float(__nv_bfloat16(r));
}

std::vector<float> RandomRounded(std::mt19937& rng, int64_t n, DType t) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& e : x) e = FromBits(ToBits(dist(rng), t), t);
  return x;
}

// A [T, H, D] tensor stored as a strided view (token stride, head stride, element offset) inside
// a larger device buffer whose other elements hold random background bits.
class StridedTensor {
 public:
  StridedTensor(int64_t T, int64_t H, int64_t D, SdpaView view, int64_t offset, DType t,
                std::mt19937& rng)
      : T_(T), H_(H), D_(D), t_(t), offset_(offset) {
    view_ = view;
    if (view_.token_stride == 0 && view_.head_stride == 0) view_ = {H * D, D};
    size_ = offset + std::max<int64_t>(T - 1, 0) * view_.token_stride +
            (H - 1) * view_.head_stride + D + 8;
    raw_.resize(size_);
    in_view_.assign(size_, 0);
    std::uniform_int_distribution<int> bg(0, 0xFFFF);
    for (auto& r : raw_) r = ToBits(static_cast<float>(bg(rng) % 2000) / 100.0f - 10.0f, t);
    for (int64_t i = 0; i < T; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = 0; d < D; ++d) in_view_[Pos(i, h, d)] = 1;
      }
    }
    buf_ = DeviceBuffer(size_ * 2);
  }

  void Set(const std::vector<float>& dense) {
    for (int64_t i = 0; i < T_; ++i) {
      for (int64_t h = 0; h < H_; ++h) {
        for (int64_t d = 0; d < D_; ++d) {
          raw_[Pos(i, h, d)] = ToBits(dense[(i * H_ + h) * D_ + d], t_);
        }
      }
    }
    Upload();
  }
  void Upload() { cudaMemcpy(buf_.get(), raw_.data(), size_ * 2, cudaMemcpyHostToDevice); }

  // The view's values, dense [T, H, D]; counts background elements that changed.
  std::vector<float> Get(int64_t* background_changed = nullptr) const {
    cudaDeviceSynchronize();
    std::vector<uint16_t> now(size_);
    cudaMemcpy(now.data(), buf_.get(), size_ * 2, cudaMemcpyDeviceToHost);
    std::vector<float> dense(T_ * H_ * D_);
    for (int64_t i = 0; i < T_; ++i) {
      for (int64_t h = 0; h < H_; ++h) {
        for (int64_t d = 0; d < D_; ++d) {
          dense[(i * H_ + h) * D_ + d] = FromBits(now[Pos(i, h, d)], t_);
        }
      }
    }
    if (background_changed != nullptr) {
      *background_changed = 0;
      for (int64_t e = 0; e < size_; ++e) {
        *background_changed += !in_view_[e] && now[e] != raw_[e];
      }
    }
    return dense;
  }

  void* ptr() const { return static_cast<char*>(buf_.get()) + offset_ * 2; }
  const SdpaView& view() const { return view_; }

 private:
  int64_t Pos(int64_t i, int64_t h, int64_t d) const {
    return offset_ + i * view_.token_stride + h * view_.head_stride + d;
  }
  int64_t T_, H_, D_;
  DType t_;
  int64_t offset_;
  SdpaView view_;
  int64_t size_ = 0;
  std::vector<uint16_t> raw_;
  std::vector<uint8_t> in_view_;
  DeviceBuffer buf_;
};

// Fails unless |got - want| <= abs * peak + rel * |want| everywhere; prints the share of the
// tolerance used.
void Compare(const std::vector<float>& got, const std::vector<float>& want, double abs_tol,
             double rel_tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double peak = 0.0;
  for (float w : want) peak = std::max(peak, static_cast<double>(std::abs(w)));
  if (peak == 0.0) peak = 1.0;
  int64_t bad = 0;
  double worst = 0.0, max_err = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    const double allowed = abs_tol * peak + rel_tol * std::abs(want[i]);
    if (std::isnan(err)) {
      worst = err;
    } else {
      worst = std::max(worst, err / allowed);
      max_err = std::max(max_err, err);
    }
    if (!(err <= allowed) && ++bad <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i]
                    << " (peak " << peak << ")";
    }
  }
  std::printf("[  sdpa    ] %-34s max|err|/peak %.2e, %.0f%% of tolerance\n", what.c_str(),
              max_err / peak, 100.0 * worst);
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements off, worst "
                    << worst << "x the tolerance";
}

struct Case {
  std::string name;
  int64_t H = 4, Dqk = 32, Dv = 16;
  std::vector<int32_t> cu;  // cu.back() == T
  SdpaView q, k, v, o;      // zero: dense
  int64_t q_off = 0, k_off = 0, v_off = 0, o_off = 0;
  DType dtype = kBf16;
  bool deterministic = false;
  bool per_document = false;  // several documents: one graph per document instead of ragged
};

class SdpaCudnn : public ::testing::Test {
 protected:
  void SetUp() override {
    SPINDLE_REQUIRE_GPU();
    Status s = cuda::Sdpa::Create(&ragged_);
    ASSERT_TRUE(s.ok()) << s.message();
    setenv("SPINDLE_SDPA_PER_DOCUMENT", "1", 1);
    s = cuda::Sdpa::Create(&per_document_);
    unsetenv("SPINDLE_SDPA_PER_DOCUMENT");
    ASSERT_TRUE(s.ok()) << s.message();
    sdpa_ = ragged_.get();
  }

  void Run(const Case& c) {
    const uint32_t seed = FreshSeed();
    SCOPED_TRACE(c.name + ", seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    const int64_t T = c.cu.back(), H = c.H, Dqk = c.Dqk, Dv = c.Dv;
    const int64_t n_seg = static_cast<int64_t>(c.cu.size()) - 1;
    const DType t = c.dtype;
    const float scale = 1.0f / std::sqrt(static_cast<float>(Dqk));
    sdpa_ = c.per_document ? per_document_.get() : ragged_.get();
    sdpa_->SetDeterministic(c.deterministic);

    const std::vector<float> q = RandomRounded(rng, T * H * Dqk, t);
    const std::vector<float> k = RandomRounded(rng, T * H * Dqk, t);
    const std::vector<float> v = RandomRounded(rng, T * H * Dv, t);
    const std::vector<float> dout = RandomRounded(rng, T * H * Dv, t);
    StridedTensor dq_(T, H, Dqk, c.q, c.q_off, t, rng), q_(T, H, Dqk, c.q, c.q_off, t, rng);
    StridedTensor dk_(T, H, Dqk, c.k, c.k_off, t, rng), k_(T, H, Dqk, c.k, c.k_off, t, rng);
    StridedTensor dv_(T, H, Dv, c.v, c.v_off, t, rng), v_(T, H, Dv, c.v, c.v_off, t, rng);
    StridedTensor out_(T, H, Dv, c.o, c.o_off, t, rng), dout_(T, H, Dv, c.o, c.o_off, t, rng);
    q_.Set(q), k_.Set(k), v_.Set(v), dout_.Set(dout);
    dq_.Upload(), dk_.Upload(), dv_.Upload(), out_.Upload();
    DeviceBuffer stats(std::max<int64_t>(H * T, 1) * 4);
    cudaMemset(stats.get(), 0xFF, std::max<int64_t>(H * T, 1) * 4);  // NaN until written

    SdpaDims dims;
    dims.T = T, dims.H = H, dims.Dqk = Dqk, dims.Dv = Dv;
    dims.q = c.q, dims.k = c.k, dims.v = c.v, dims.out = c.o;
    ASSERT_OK(sdpa_->Forward(q_.ptr(), k_.ptr(), v_.ptr(), out_.ptr(), stats.as<float>(),
                             c.cu.data(), n_seg, scale, dims, t, 0));
    ASSERT_CUDA(cudaDeviceSynchronize());
    int64_t out_bg = 0;
    const std::vector<float> out = out_.Get(&out_bg);
    std::vector<float> stats_h(H * T);
    cudaMemcpy(stats_h.data(), stats.get(), H * T * 4, cudaMemcpyDeviceToHost);

    // CPU reference: documents from cu_seqlens, positions 0..T-1.
    std::vector<int32_t> doc(T), pos(T);
    for (int64_t s = 0; s < n_seg; ++s) {
      for (int32_t i = c.cu[s]; i < c.cu[s + 1]; ++i) doc[i] = static_cast<int32_t>(s);
    }
    for (int64_t i = 0; i < T; ++i) pos[i] = static_cast<int32_t>(i);
    const cpu::AttentionMask mask{doc.data(), pos.data(), doc.data(), pos.data()};
    const cpu::AttentionDims ad{T, T, H, Dqk, Dv};
    std::vector<float> out_ref(T * H * Dv), lse_ref(T * H);
    cpu::AttentionForward(q.data(), k.data(), v.data(), mask, scale, ad, out_ref.data(),
                          lse_ref.data());
    std::vector<float> stats_ref(H * T);
    for (int64_t i = 0; i < T; ++i) {
      for (int64_t h = 0; h < H; ++h) stats_ref[h * T + i] = lse_ref[i * H + h];
    }
    Compare(out, out_ref, 1e-2, 1e-2, c.name + " out");
    Compare(stats_h, stats_ref, 1e-3, 1e-3, c.name + " stats");
    EXPECT_EQ(out_bg, 0) << "forward wrote outside the out view";

    // A second forward (cached plan) gives the same bits.
    ASSERT_OK(sdpa_->Forward(q_.ptr(), k_.ptr(), v_.ptr(), out_.ptr(), stats.as<float>(),
                             c.cu.data(), n_seg, scale, dims, t, 0));
    EXPECT_EQ(out_.Get(), out) << "second forward differs";

    ASSERT_OK(sdpa_->Backward(q_.ptr(), k_.ptr(), v_.ptr(), out_.ptr(), stats.as<float>(),
                              dout_.ptr(), dq_.ptr(), dk_.ptr(), dv_.ptr(), c.cu.data(), n_seg,
                              scale, dims, t, 0));
    ASSERT_CUDA(cudaDeviceSynchronize());
    // The ragged backward's fp32 dQ accumulator is part of the workspace it reports.
    if (!c.per_document && !c.deterministic) EXPECT_GE(sdpa_->WorkspaceBytes(), T * H * Dqk * 4);
    int64_t dq_bg = 0, dk_bg = 0, dv_bg = 0;
    const std::vector<float> dq = dq_.Get(&dq_bg), dk = dk_.Get(&dk_bg), dv = dv_.Get(&dv_bg);
    std::vector<float> dq_ref(T * H * Dqk), dk_ref(T * H * Dqk), dv_ref(T * H * Dv);
    cpu::AttentionBackward(q.data(), k.data(), v.data(), out_ref.data(), lse_ref.data(),
                           dout.data(), mask, scale, ad, dq_ref.data(), dk_ref.data(),
                           dv_ref.data());
    Compare(dq, dq_ref, 2e-2, 2e-2, c.name + " dq");
    Compare(dk, dk_ref, 2e-2, 2e-2, c.name + " dk");
    Compare(dv, dv_ref, 2e-2, 2e-2, c.name + " dv");
    EXPECT_EQ(dq_bg + dk_bg + dv_bg, 0) << "backward wrote outside the dq/dk/dv views";

    if (c.deterministic) {
      ASSERT_OK(sdpa_->Backward(q_.ptr(), k_.ptr(), v_.ptr(), out_.ptr(), stats.as<float>(),
                                dout_.ptr(), dq_.ptr(), dk_.ptr(), dv_.ptr(), c.cu.data(),
                                n_seg, scale, dims, t, 0));
      testing::ExpectSameBits(dq_.Get(), dq, c.name + " dq, second run");
      testing::ExpectSameBits(dk_.Get(), dk, c.name + " dk, second run");
      testing::ExpectSameBits(dv_.Get(), dv, c.name + " dv, second run");
    }
  }

  std::unique_ptr<cuda::Sdpa> ragged_, per_document_;
  cuda::Sdpa* sdpa_ = nullptr;
};

Case Tiny(const std::string& name, std::vector<int32_t> cu) {
  Case c;
  c.name = name;
  c.cu = std::move(cu);
  return c;
}

Case Mla(const std::string& name, std::vector<int32_t> cu) {
  Case c = Tiny(name, std::move(cu));
  c.H = 16, c.Dqk = 192, c.Dv = 128;
  return c;
}

TEST_F(SdpaCudnn, TinyOddLength) { Run(Tiny("tiny T=77", {0, 77})); }
TEST_F(SdpaCudnn, TinyT200) { Run(Tiny("tiny T=200", {0, 200})); }
TEST_F(SdpaCudnn, TinyMultipleOf128) { Run(Tiny("tiny T=256", {0, 256})); }
TEST_F(SdpaCudnn, Mla1000) { Run(Mla("mla T=1000", {0, 1000})); }

// q and k rows of a fused [T, H, 384] buffer (k at offset 192), V a view into [T, H, 256] at
// offset 128 with head stride 256, out (and dout) head-major [H, T, 128].
TEST_F(SdpaCudnn, MlaStridedViews) {
  Case c = Mla("mla strided T=300", {0, 300});
  const int64_t T = 300, H = 16;
  c.q = {H * 384, 384};
  c.k = {H * 384, 384}, c.k_off = 192;
  c.v = {H * 256, 256}, c.v_off = 128;
  c.o = {128, T * 128};
  Run(c);
}

// Several documents, through the ragged graph and through one graph per document.
TEST_F(SdpaCudnn, TinyDocuments) {
  Case c = Tiny("tiny docs 1,2,37,1,129,130", {0, 1, 3, 40, 41, 170, 300});
  Run(c);
  c.name += " per-document", c.per_document = true;
  Run(c);
}

TEST_F(SdpaCudnn, TinyEmptyDocuments) {
  Case c = Tiny("tiny docs 0,50,0,50", {0, 0, 50, 50, 100});
  Run(c);
  c.name += " per-document", c.per_document = true;
  Run(c);
}

// 37 random documents (one-token ones likely) over 1000 tokens: 64 ragged batches.
TEST_F(SdpaCudnn, TinyManyDocuments) {
  const uint32_t seed = FreshSeed();
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> cut(1, 999);
  std::vector<int32_t> cu{0};
  for (int i = 0; i < 36; ++i) cu.push_back(cut(rng));
  cu.push_back(1000);
  std::sort(cu.begin(), cu.end());
  Run(Tiny("tiny 37 random docs T=1000 (cuts seed " + std::to_string(seed) + ")", cu));
}

TEST_F(SdpaCudnn, MlaDocuments) {
  Case c = Mla("mla docs 130,1,369", {0, 130, 131, 500});
  Run(c);
  c.name += " per-document", c.per_document = true;
  Run(c);
}

// The model's layout with documents: fused q/k rows, V inside kv_b's output, head-major out.
TEST_F(SdpaCudnn, MlaDocumentsStridedViews) {
  const int64_t T = 600, H = 16;
  Case c = Mla("mla strided docs 100,1,249,250", {0, 100, 101, 350, 600});
  c.q = {H * 384, 384};
  c.k = {H * 384, 384}, c.k_off = 192;
  c.v = {H * 256, 256}, c.v_off = 128;
  c.o = {128, T * 128};
  Run(c);
  c.name += " per-document", c.per_document = true;
  Run(c);
}

TEST_F(SdpaCudnn, TinyFp16) {
  Case c = Tiny("tiny fp16 T=77", {0, 77});
  c.dtype = kFp16;
  Run(c);
}

TEST_F(SdpaCudnn, DeterministicBackward) {
  Case c = Tiny("tiny deterministic T=200", {0, 200});
  c.deterministic = true;
  Run(c);
  Case m = Mla("mla deterministic T=1000", {0, 1000});
  m.deterministic = true;
  Run(m);
  Case d = Tiny("tiny deterministic docs 1,59,140", {0, 1, 60, 200});
  d.deterministic = true;
  Run(d);
}

// Context parallelism's split of one causal attention: the last Tq of Tkv + Tq tokens (one
// document) attend the first Tkv through ForwardFull (no mask, different lengths) and their own
// Tq causally through Forward; AttentionMerge combines the two outputs by their stats. The merged
// output and stats, and the backward (each piece's BackwardFull / Backward with the merged out
// and stats, dq summed, dk and dv concatenated), must match one CPU attention over all keys.
void RunSplit(Sdpa& sdpa, int64_t H, int64_t Dqk, int64_t Dv, int64_t Tkv, int64_t Tq) {
  const uint32_t seed = FreshSeed();
  const std::string name = "split Tkv=" + std::to_string(Tkv) + " Tq=" + std::to_string(Tq) +
                           " H=" + std::to_string(H) + " Dqk=" + std::to_string(Dqk);
  SCOPED_TRACE(name + ", seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const int64_t Tk = Tkv + Tq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dqk));
  const std::vector<float> q = RandomRounded(rng, Tq * H * Dqk, kBf16);
  const std::vector<float> k = RandomRounded(rng, Tk * H * Dqk, kBf16);
  const std::vector<float> v = RandomRounded(rng, Tk * H * Dv, kBf16);
  const std::vector<float> dout = RandomRounded(rng, Tq * H * Dv, kBf16);
  using testing::Download;
  using testing::Upload;
  DeviceBuffer q_d = Upload(q, kBf16), k_d = Upload(k, kBf16), v_d = Upload(v, kBf16);
  DeviceBuffer dout_d = Upload(dout, kBf16);
  DeviceBuffer out(Tq * H * Dv * 2), out_x(Tq * H * Dv * 2), stats(H * Tq * 4), stats_x(H * Tq * 4);
  SdpaDims dims;
  dims.T = Tq, dims.H = H, dims.Dqk = Dqk, dims.Dv = Dv;
  SdpaDims full = dims;
  full.Tkv = Tkv;
  auto at = [](const DeviceBuffer& b, int64_t elems) {
    return static_cast<char*>(b.get()) + elems * 2;
  };
  const std::vector<int32_t> cu{0, static_cast<int32_t>(Tq)};
  ASSERT_OK(sdpa.Forward(q_d.get(), at(k_d, Tkv * H * Dqk), at(v_d, Tkv * H * Dv), out.get(),
                         stats.as<float>(), cu.data(), 1, scale, dims, kBf16, 0));
  ASSERT_OK(sdpa.ForwardFull(q_d.get(), k_d.get(), v_d.get(), out_x.get(), stats_x.as<float>(),
                             scale, full, kBf16, 0));
  ASSERT_OK(AttentionMerge(out.get(), kBf16, H * Dv, stats.as<float>(), Tq, out_x.get(), kBf16,
                           H * Dv, stats_x.as<float>(), Tq, Tq, H, Dv, 0));
  const std::vector<float> got_out = Download(out.get(), Tq * H * Dv, kBf16);
  const std::vector<float> got_stats = Download(stats.get(), H * Tq, DType::kFloat32);

  std::vector<int32_t> doc_q(Tq, 0), pos_q(Tq), doc_k(Tk, 0), pos_k(Tk);
  for (int64_t i = 0; i < Tq; ++i) pos_q[i] = static_cast<int32_t>(Tkv + i);
  for (int64_t j = 0; j < Tk; ++j) pos_k[j] = static_cast<int32_t>(j);
  const cpu::AttentionMask mask{doc_q.data(), pos_q.data(), doc_k.data(), pos_k.data()};
  const cpu::AttentionDims ad{Tq, Tk, H, Dqk, Dv};
  std::vector<float> out_ref(Tq * H * Dv), lse_ref(Tq * H), stats_ref(H * Tq);
  cpu::AttentionForward(q.data(), k.data(), v.data(), mask, scale, ad, out_ref.data(),
                        lse_ref.data());
  for (int64_t i = 0; i < Tq; ++i)
    for (int64_t h = 0; h < H; ++h) stats_ref[h * Tq + i] = lse_ref[i * H + h];
  Compare(got_out, out_ref, 1e-2, 1e-2, name + " out");
  Compare(got_stats, stats_ref, 1e-3, 1e-3, name + " stats");

  DeviceBuffer dq(Tq * H * Dqk * 2), dq_x(Tq * H * Dqk * 2), dk(Tk * H * Dqk * 2),
      dv(Tk * H * Dv * 2);
  ASSERT_OK(sdpa.Backward(q_d.get(), at(k_d, Tkv * H * Dqk), at(v_d, Tkv * H * Dv), out.get(),
                          stats.as<float>(), dout_d.get(), dq.get(), at(dk, Tkv * H * Dqk),
                          at(dv, Tkv * H * Dv), cu.data(), 1, scale, dims, kBf16, 0));
  ASSERT_OK(sdpa.BackwardFull(q_d.get(), k_d.get(), v_d.get(), out.get(), stats.as<float>(),
                              dout_d.get(), dq_x.get(), dk.get(), dv.get(), scale, full, kBf16, 0));
  ASSERT_OK(AddRows(dq.get(), H * Dqk, dq_x.get(), H * Dqk, Tq, H * Dqk, kBf16, 0));
  std::vector<float> dq_ref(Tq * H * Dqk), dk_ref(Tk * H * Dqk), dv_ref(Tk * H * Dv);
  cpu::AttentionBackward(q.data(), k.data(), v.data(), out_ref.data(), lse_ref.data(), dout.data(),
                         mask, scale, ad, dq_ref.data(), dk_ref.data(), dv_ref.data());
  Compare(Download(dq.get(), Tq * H * Dqk, kBf16), dq_ref, 2e-2, 2e-2, name + " dq");
  Compare(Download(dk.get(), Tk * H * Dqk, kBf16), dk_ref, 2e-2, 2e-2, name + " dk");
  Compare(Download(dv.get(), Tk * H * Dv, kBf16), dv_ref, 2e-2, 2e-2, name + " dv");
}

TEST_F(SdpaCudnn, FullPieceMergedWithCausalPieceIsOneCausalAttention) {
  RunSplit(*sdpa_, 4, 32, 16, 300, 77);
  RunSplit(*sdpa_, 4, 32, 16, 1, 5);
  RunSplit(*sdpa_, 16, 192, 128, 1000, 200);
  RunSplit(*sdpa_, 16, 192, 128, 256, 128);
}

// Unmasked graphs are planned for lengths rounded up to powers of two: three splits whose query
// and key counts fall in the same buckets (128 queries, 512 keys) build the full graphs' two plans
// once; each new query count still builds its causal piece's two plans.
TEST_F(SdpaCudnn, FullPlansAreSharedAcrossLengths) {
  const int64_t before = sdpa_->PlanCount();
  RunSplit(*sdpa_, 4, 32, 16, 300, 77);
  EXPECT_EQ(sdpa_->PlanCount() - before, 4);  // causal fwd + bwd, full fwd + bwd
  RunSplit(*sdpa_, 4, 32, 16, 290, 100);
  RunSplit(*sdpa_, 4, 32, 16, 257, 128);
  EXPECT_EQ(sdpa_->PlanCount() - before, 8);  // + causal fwd + bwd for T = 100 and 128 only
}

TEST_F(SdpaCudnn, FullAttentionNeedsKeys) {
  DeviceBuffer q(64 * 4 * 32 * 2), o(64 * 4 * 16 * 2), stats(64 * 4 * 4);
  SdpaDims d;
  d.T = 64, d.H = 4, d.Dqk = 32, d.Dv = 16;  // Tkv left 0
  const Status s =
      sdpa_->ForwardFull(q.get(), q.get(), o.get(), o.get(), stats.as<float>(), 0.1f, d, kBf16, 0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("at least one key"), std::string::npos) << s.message();
}

TEST_F(SdpaCudnn, BadArguments) {
  const int64_t T = 64, H = 4;
  DeviceBuffer q(T * H * 48 * 2), o(T * H * 16 * 2), stats(T * H * 4);
  SdpaDims d;
  d.T = T, d.H = H, d.Dqk = 20, d.Dv = 16;
  const std::vector<int32_t> cu{0, static_cast<int32_t>(T)};
  Status s = sdpa_->Forward(q.get(), q.get(), o.get(), o.get(), stats.as<float>(), cu.data(), 1,
                            0.1f, d, kBf16, 0);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.message();
  EXPECT_NE(s.message().find("Dqk=20"), std::string::npos) << s.message();

  d.Dqk = 32;
  const std::vector<int32_t> short_cu{0, static_cast<int32_t>(T - 1)};
  s = sdpa_->Forward(q.get(), q.get(), o.get(), o.get(), stats.as<float>(), short_cu.data(), 1,
                     0.1f, d, kBf16, 0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("cu_seqlens"), std::string::npos) << s.message();

  s = sdpa_->Backward(q.get(), q.get(), o.get(), o.get(), stats.as<float>(), o.get(), q.get(),
                      q.get(), o.get(), short_cu.data(), 1, 0.1f, d, kBf16, 0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("cu_seqlens"), std::string::npos) << s.message();

  d.q = {H * 32 + 4, 32};  // token stride not a multiple of 8
  s = sdpa_->Forward(q.get(), q.get(), o.get(), o.get(), stats.as<float>(), cu.data(), 1, 0.1f, d,
                     kBf16, 0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("view q"), std::string::npos) << s.message();

  d.q = {};
  s = sdpa_->Forward(static_cast<char*>(q.get()) + 2, q.get(), o.get(), o.get(),
                     stats.as<float>(), cu.data(), 1, 0.1f, d, kBf16, 0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("q is not 16-byte aligned"), std::string::npos) << s.message();

  s = sdpa_->Forward(q.get(), q.get(), o.get(), o.get(), stats.as<float>(), cu.data(), 1, 0.1f, d,
                     DType::kFloat32, 0);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.message();
}

}  // namespace
}  // namespace spindle::kernels::cuda
