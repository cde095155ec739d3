// Per-kernel timings of the CUDA backend: CUDA events around each launch after warm-up, median
// of the repetitions, printed as one table with bytes moved, the fraction of the measured device
// copy bandwidth reached, and TFLOP/s where the kernel is compute-bound. Includes Lightning
// forward + backward at T=32K, H=16, Dh=128 over several launch configurations, and cuDNN causal
// attention (sdpa.h) at T=32K, H=16, Dqk=192, Dv=128, one document.
// Usage: bench_kernels_cuda [--quick] [--sdpa-only] [--lightning-only] [--lightning-row N]
//                           [--cp-pieces] [--causal-vs-full] [--step-gemms] [--gemm-candidates]
//                           [--fp8-gemms] [--moe]
//   --quick: the first two Lightning configurations only; --lightning-only: every Lightning
//   configuration at T=32K, nothing else; --lightning-row N: only the N-th (from 0) of those
//   configurations (one kernel of each kind per call, for a profiler); --cp-pieces: only the MLA
//   attention each rank runs under cp = 2 at 64K tokens, All2All against AllGather's causal and
//   full pieces; --causal-vs-full: cuDNN's causal graph against the unmasked (non-causal) one,
//   forward and backward apart, at H=16, Dqk=192, Dv=128 and T = 4K to 32K, per useful FLOP (a
//   Ring's diagonal block against its off-diagonal ones); --step-gemms: every GEMM shape of the 1b
//   training step at T = 32K in each of its three roles (forward, input gradient, fp32 weight
//   gradient), with the step's count of each and the alternatives that would change it (merged
//   projections, the weight gradient without beta);
//   --gemm-candidates: the step's large GEMMs with each algorithm cuBLASLt offers, timed under
//   sustained load (the power cap's clock); --fp8-gemms: the step's linears in each role as FP8
//   GEMMs, cuBLASLt's accurate against its fast accumulation, beside bf16; --moe: the MoE FFN's
//   kernels at the `moe` preset's shapes (moe.h): the experts' grouped GEMMs by each method beside
//   a dense GEMM of the same FLOPs (bf16, FP8 and FP8 with the blockwise recipe's block scales:
//   the experts' rows in moe.h's grouped layout, one segment per expert as at ep = 1), the
//   router, the grouping, the gathers and the combine.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/fp8.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/lightning.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sdpa.h"

namespace cu = spindle::kernels::cuda;

namespace {

constexpr cu::DType kBf16 = cu::DType::kBFloat16;

void Check(const cu::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.message().c_str());
    std::exit(1);
  }
}
void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Device buffer of random values (bf16 or fp32), freed at exit of scope.
struct Buf {
  void* p = nullptr;
  size_t bytes = 0;
  Buf(size_t n, cu::DType t, float sd = 1.0f, float mean = 0.0f) : bytes(n * cu::DTypeSize(t)) {
    CheckCuda(cudaMalloc(&p, bytes + 256), "cudaMalloc");
    std::vector<float> h(std::min<size_t>(n, 1 << 20));
    std::mt19937 rng(1234);
    std::normal_distribution<float> d(mean, sd);
    for (auto& e : h) e = d(rng);
    std::vector<unsigned char> raw(h.size() * cu::DTypeSize(t));
    if (t == kBf16) {
      for (size_t i = 0; i < h.size(); ++i) {
        const __nv_bfloat16 b = __float2bfloat16(h[i]);
        std::memcpy(&raw[i * 2], &b, 2);
      }
    } else {
      std::memcpy(raw.data(), h.data(), raw.size());
    }
    for (size_t off = 0; off < bytes; off += raw.size()) {
      CheckCuda(cudaMemcpy(static_cast<char*>(p) + off, raw.data(), std::min(raw.size(), bytes - off),
                           cudaMemcpyHostToDevice),
                "upload");
    }
  }
  ~Buf() { cudaFree(p); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Median milliseconds of fn over reps after warm-up.
double TimeMs(const std::function<void()>& fn, int reps = 20, int warmup = 3) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a);
    fn();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  CheckCuda(cudaGetLastError(), "timed kernel");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double g_copy_tbps = 0;

void Row(const std::string& name, double ms, double bytes, double flops = 0) {
  const double tbps = bytes / ms / 1e9;
  std::printf("| %-52s | %9.4f | %8.1f | %6.1f%% | %8s |\n", name.c_str(), ms, bytes / 1e6,
              100.0 * tbps / g_copy_tbps,
              flops > 0 ? std::to_string(static_cast<int>(flops / ms / 1e9)).c_str() : "-");
  std::fflush(stdout);
}

// ---- The 1b step's GEMMs at T = 32K (--step-gemms) ---------------------------------------------
// Each linear y[T, out] = x[T, in] W^T runs three GEMMs a step: the forward (bf16 out), the input
// gradient dx = dy W (bf16 out) and the weight gradient dW += dy^T x (fp32 out, beta 1), as
// CudaModel issues them. Prints each shape and role's time and TFLOP/s and the step's total
// (times the count of that linear in the step), then the alternatives.
// Milliseconds per call of fn once the GPU has run it back to back for about fill_ms (so that the
// power cap's clock has settled as in a training step): the mean over n calls, timed as one span.
double SustainedMs(const std::function<void()>& fn, double fill_ms = 500, int n = 50) {
  const double one = TimeMs(fn, 3, 1);
  const int fill = static_cast<int>(std::ceil(fill_ms / std::max(one, 1e-3)));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < fill; ++i) fn();
  cudaEventRecord(a);
  for (int i = 0; i < n; ++i) fn();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  CheckCuda(cudaGetLastError(), "sustained kernel");
  float t = 0;
  cudaEventElapsedTime(&t, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return t / n;
}

// With `candidates`: each of the step's large GEMMs (the FFN's and the Lightning projections',
// all three roles) with every algorithm cuBLASLt's heuristic offers (up to 8), each timed
// sustained (SustainedMs), two rounds in opposite orders, best of the two.
int StepGemms(bool candidates) {
  const int64_t T = 32768, d = 2048, F = 5632, V = 32000, head_rows = 8192;
  std::unique_ptr<cu::Blas> blas;
  Check(cu::Blas::Create(&blas), "blas");
  const size_t max_elems = static_cast<size_t>(T) * 2 * F;
  Buf A(max_elems, kBf16), B(max_elems, kBf16), C(max_elems, cu::DType::kFloat32);
  // C[M, N] (+)= op(A) op(B), A stored [M, K] or (trans_a) [K, M], B [K, N] or (trans_b) [N, K].
  auto gemm_args = [&](int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b,
                       float beta = 0.0f, cu::DType c_type = kBf16) {
    cu::GemmArgs a;
    a.A = A.p, a.B = B.p, a.C = C.p, a.M = M, a.N = N, a.K = K, a.beta = beta, a.c_type = c_type;
    a.trans_a = trans_a, a.trans_b = trans_b;
    a.lda = trans_a ? M : K, a.ldb = trans_b ? K : N, a.ldc = N;
    return a;
  };
  auto time_gemm = [&](int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b,
                       float beta = 0.0f, cu::DType c_type = kBf16) {
    const cu::GemmArgs a = gemm_args(M, N, K, trans_a, trans_b, beta, c_type);
    return TimeMs([&] { Check(blas->Gemm(a, 0), "gemm"); }, 10, 2);
  };
  // role 0: forward, 1: input gradient, 2: weight gradient (fp32, beta 1), 3: weight gradient
  // fp32 beta 0, 4: weight gradient bf16 beta 0.
  auto role_args = [&](int64_t rows, int64_t in, int64_t out, int role) {
    if (role == 0) return gemm_args(rows, out, in, false, true);
    if (role == 1) return gemm_args(rows, in, out, false, false);
    return gemm_args(out, in, rows, true, false, role == 2 ? 1.0f : 0.0f,
                     role == 4 ? kBf16 : cu::DType::kFloat32);
  };
  auto time_role = [&](int64_t rows, int64_t in, int64_t out, int role) {
    const cu::GemmArgs a = role_args(rows, in, out, role);
    return time_gemm(a.M, a.N, a.K, a.trans_a, a.trans_b, a.beta, a.c_type);
  };
  struct Linear {
    const char* name;
    int64_t rows, in, out, count;
  };
  const std::vector<Linear> step = {
      {"L qkv", T, d, 3 * d, 14},      {"L gate", T, d, d, 14},       {"L out", T, d, d, 14},
      {"M q_a", T, d, 768, 2},         {"M q_b", T, 768, 16 * 192, 2}, {"M kv_a", T, d, 576, 2},
      {"M kv_b", T, 512, 16 * 256, 2}, {"M out", T, 16 * 128, d, 2},  {"ffn w1 / w3", T, d, F, 32},
      {"ffn w2", T, F, d, 16},         {"head (8192-row blocks)", head_rows, d, V, T / head_rows}};
  const char* roles[] = {"fwd", "dgrad", "wgrad fp32 b1", "wgrad fp32 b0", "wgrad bf16 b0"};
  if (candidates) {
    struct Run {
      const Linear* l;
      int role, candidate;
      double best_ms = 1e9;
    };
    std::vector<Run> runs;
    for (const Linear& l : step) {
      if (l.rows != T || l.count < 14) continue;  // the FFN's and Lightning's linears
      for (int role = 0; role < 3; ++role)
        for (int c = 0; c < 8; ++c) {
          cu::GemmArgs a = role_args(l.rows, l.in, l.out, role);
          a.candidate = c;
          if (!blas->Gemm(a, 0).ok()) break;  // fewer candidates offered
          runs.push_back({&l, role, c});
        }
    }
    CheckCuda(cudaDeviceSynchronize(), "candidates");
    for (int round = 0; round < 2; ++round)
      for (size_t i = 0; i < runs.size(); ++i) {
        Run& r = runs[round == 0 ? i : runs.size() - 1 - i];
        cu::GemmArgs a = role_args(r.l->rows, r.l->in, r.l->out, r.role);
        a.candidate = r.candidate;
        r.best_ms = std::min(r.best_ms, SustainedMs([&] { Check(blas->Gemm(a, 0), "gemm"); }));
      }
    std::printf("| %-12s | %-13s | %4s | %-52s | %8s | %7s | %8s |\n", "linear", "role", "cand",
                "algorithm", "ms", "TFLOP/s", "vs first");
    std::printf("|---|---|---|---|---|---|---|\n");
    double first_total = 0, best_total = 0, first_ms = 0, best_ms = 1e9;
    for (size_t i = 0; i < runs.size(); ++i) {
      const Run& r = runs[i];
      if (r.candidate == 0) first_ms = r.best_ms, best_ms = r.best_ms;
      best_ms = std::min(best_ms, r.best_ms);
      cu::GemmArgs a = role_args(r.l->rows, r.l->in, r.l->out, r.role);
      a.candidate = r.candidate;
      std::printf("| %-12s | %-13s | %4d | %-52s | %8.3f | %7.0f | %7.1f%% |\n", r.l->name,
                  roles[r.role], r.candidate, blas->AlgorithmName(a).c_str(), r.best_ms,
                  2.0 * a.M * a.N * a.K / r.best_ms / 1e9, 100.0 * (r.best_ms / first_ms - 1));
      const bool last_of_gemm = i + 1 == runs.size() || runs[i + 1].candidate == 0;
      if (last_of_gemm) first_total += first_ms * r.l->count, best_total += best_ms * r.l->count;
    }
    std::printf(
        "\nthese GEMMs in one step, sustained: %.1f ms with the first candidates, %.1f ms "
        "with the best of each\n",
        first_total, best_total);
    return 0;
  }
  std::printf("| %-24s | %-13s | %5s | %8s | %7s | %10s |\n", "linear", "role", "count", "ms",
              "TFLOP/s", "step ms");
  std::printf("|---|---|---|---|---|---|\n");
  double total = 0, total_b0 = 0;
  auto row = [&](const Linear& l, int role) {
    const double ms = time_role(l.rows, l.in, l.out, role);
    const double flops = 2.0 * l.rows * l.in * l.out;
    std::printf("| %-24s | %-13s | %5lld | %8.3f | %7.0f | %10.2f |\n", l.name, roles[role],
                static_cast<long long>(l.count), ms, flops / ms / 1e9, ms * l.count);
    std::fflush(stdout);
    return ms * l.count;
  };
  for (const Linear& l : step) {
    double fd = 0;
    for (int role = 0; role < 2; ++role) fd += row(l, role);
    total += fd + row(l, 2);
    total_b0 += fd + row(l, 3);
  }
  std::printf("\nstep GEMMs as issued: %.1f ms; with beta-0 weight gradients: %.1f ms\n\n", total,
              total_b0);
  // Merged projections: q/k/v with the gate (d -> 4d) and w1 with w3 (d -> 2F) as one GEMM each.
  const std::vector<Linear> merged = {{"L qkv+gate", T, d, 4 * d, 14},
                                      {"ffn w1+w3", T, d, 2 * F, 16}};
  for (const Linear& l : merged)
    for (int role = 0; role < 3; ++role) row(l, role);
  // The same products in each operand layout: C[M, N] = op(A) op(B) with A stored [M, K] or
  // [K, M] and B [K, N] or [N, K]. Rounds alternate the layouts, with a pause before each
  // measurement so that the power cap's state is alike for all. The last three shapes are the
  // merged projections (q/k/v + gate, w1 + w3 and its weight gradient).
  std::printf("\n| M x N x K | A [M,K] B [K,N] | A [M,K] B [N,K] | A [K,M] B [K,N] | A [K,M] B "
              "[N,K] |\n|---|---|---|---|---|\n");
  const std::vector<std::array<int64_t, 3>> shapes = {
      {T, d, F},         {T, F, d},     {T, 3 * d, d},     {T, d, d},
      {F, d, T},         {d, F, T},     {head_rows, V, d}, {head_rows, d, V},
      {V, d, head_rows}, {T, 4 * d, d}, {T, 2 * F, d},     {2 * F, d, T}};
  for (const auto& [M, N, K] : shapes) {
    double best[4] = {1e9, 1e9, 1e9, 1e9};
    for (int round = 0; round < 3; ++round)
      for (int layout = 0; layout < 4; ++layout) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        best[layout] = std::min(best[layout], time_gemm(M, N, K, layout >= 2, layout % 2 == 1));
      }
    std::printf("| %lld x %lld x %lld |", static_cast<long long>(M), static_cast<long long>(N),
                static_cast<long long>(K));
    for (double ms : best) std::printf(" %.3f ms %.0f |", ms, 2.0 * M * N * K / ms / 1e9);
    std::printf("\n");
    std::fflush(stdout);
  }
  return 0;
}

// The FP8 quantizers' bandwidth at the step's shapes: an activation [T, d] and [T, F] in bf16 to
// codes and transposed codes (tensorwise: Fp8Quantize's amax pass and quantize pass; blockwise:
// Fp8QuantizeBlockwise's one pass, with the scale tensors), the same without the transposed codes
// (a forward that will be recomputed), and the weights' cast from fp32 masters [F, d] (one tensor
// per call). GB/s counts the bytes each must move at least: the input once, every code once.
void Fp8Quantizers(int64_t T, int64_t d, int64_t F) {
  std::printf("\n| %-44s | %9s | %9s | %8s | %8s |\n", "quantizer", "tensor ms", "block ms",
              "tensor GB/s", "block GB/s");
  std::printf("|---|---|---|---|---|\n");
  const size_t max_n = static_cast<size_t>(T) * std::max(d, F);
  Buf x(max_n, kBf16), master(static_cast<size_t>(F) * d, cu::DType::kFloat32);
  Buf codes(max_n / 2 + 64, kBf16), codes_t(max_n / 2 + 64, kBf16);
  Buf scales(max_n / 64 + 64, cu::DType::kFloat32), scales_t(max_n / 64 + 64, cu::DType::kFloat32);
  Buf scalars(64, cu::DType::kFloat32);
  auto row = [](const std::string& name, double tensor_ms, double block_ms, double bytes) {
    std::printf("| %-44s | %9.4f | %9.4f | %8.0f | %8.0f |\n", name.c_str(), tensor_ms, block_ms,
                bytes / tensor_ms / 1e6, bytes / block_ms / 1e6);
    std::fflush(stdout);
  };
  for (const int64_t cols : {d, F})
    for (const bool both : {true, false}) {
      const int64_t n = T * cols;
      cu::Fp8Output o;
      o.format = cu::DType::kFp8E4M3, o.codes = codes.p, o.codes_t = both ? codes_t.p : nullptr;
      o.amax = scalars.as<float>(), o.scale = scalars.as<float>() + 4;
      o.inverse_scale = scalars.as<float>() + 8;
      cu::Fp8BlockOutput b;
      b.format = cu::DType::kFp8E4M3, b.codes = codes.p, b.scales = scales.as<float>();
      if (both) b.codes_t = codes_t.p, b.scales_t = scales_t.as<float>();
      const double tms = TimeMs([&] { Check(cu::Fp8Quantize(x.p, T, cols, kBf16, o, 0), "q"); });
      const double bms =
          TimeMs([&] { Check(cu::Fp8QuantizeBlockwise(x.p, T, cols, kBf16, b, 0), "qb"); });
      row("bf16 [" + std::to_string(T) + ", " + std::to_string(cols) + "] -> " +
              (both ? "codes + codes_t" : "codes"),
          tms, bms, n * 2.0 + n * (both ? 2.0 : 1.0));
    }
  {
    const int64_t n = F * d;
    cu::Fp8WeightCast w{master.as<float>(), F, d, {}};
    w.out.format = cu::DType::kFp8E4M3, w.out.codes = codes.p, w.out.codes_t = codes_t.p;
    w.out.amax = scalars.as<float>(), w.out.scale = scalars.as<float>() + 4;
    w.out.inverse_scale = scalars.as<float>() + 8;
    cu::Fp8BlockWeightCast b;
    b.master = master.as<float>(), b.rows = F, b.cols = d, b.format = cu::DType::kFp8E4M3;
    b.codes = codes.p, b.scales = scales.as<float>();
    b.codes_t = codes_t.p, b.scales_t = scales_t.as<float>();
    const double tms = TimeMs([&] { Check(cu::Fp8CastWeights(&w, 1, 0), "cast"); });
    const double bms = TimeMs([&] { Check(cu::Fp8CastWeightsBlockwise(&b, 1, 0), "cast b"); });
    row("fp32 master [" + std::to_string(F) + ", " + std::to_string(d) +
            "] -> codes + codes_t",
        tms, bms, n * 4.0 + n * 2.0);
  }
}

// ---- The 1b step's linears in FP8 (--fp8-gemms)
// -------------------------------------------------- Each linear of the step at T = 32K in its
// three roles as CudaModel issues them under fp8: the forward (E4M3 x E4M3 -> bf16), the input
// gradient (E5M2 x E4M3 -> bf16) and the weight gradient (E5M2 x E4M3 -> fp32, beta 1), each on
// cuBLASLt's one FP8 layout, beside the bf16 GEMM of the same role, FP8 with cuBLASLt's accurate
// accumulation and with its fast accumulation, and FP8 with the blockwise recipe's block scales
// (forward and input gradient 1x128 x 128x128, weight gradient 1x128 x 1x128; the path Blas::Gemm
// takes is printed); sustained (SustainedMs), the step's totals weighted by each linear's count.
// Then the quantizers' bandwidth, tensorwise (amax pass + quantize pass) against blockwise (one
// pass), on the step's activation and weight shapes.
int Fp8Gemms() {
  const int64_t T = 32768, d = 2048, F = 5632;
  std::unique_ptr<cu::Blas> blas;
  Check(cu::Blas::Create(&blas), "blas");
  const size_t max_elems = static_cast<size_t>(T) * std::max(3 * d, F);  // the widest operand
  Buf A(max_elems, kBf16), B(max_elems, kBf16), C(max_elems, cu::DType::kFloat32);
  // Codes of N(0, 1) values at scale 1 (about 2^-3 .. 2^2 for E4M3): any valid codes do for a
  // timing; the scales are device floats of 1.
  auto codes = [&](cu::DType format) {
    Buf src(max_elems, kBf16);
    auto q = std::make_unique<Buf>(max_elems / 2 + 64, kBf16);  // max_elems bytes of codes
    cu::Fp8Output o;
    Buf amax(64, cu::DType::kFloat32), scale(64, cu::DType::kFloat32), inv(64, cu::DType::kFloat32);
    o.format = format, o.codes = q->p, o.amax = amax.as<float>(), o.scale = scale.as<float>();
    o.inverse_scale = inv.as<float>();
    Check(cu::Fp8Quantize(src.p, static_cast<int64_t>(max_elems) / 64, 64, kBf16, o, 0),
          "quantize");
    CheckCuda(cudaDeviceSynchronize(), "quantize");
    return q;
  };
  const auto e4 = codes(cu::DType::kFp8E4M3), e4b = codes(cu::DType::kFp8E4M3),
             e5 = codes(cu::DType::kFp8E5M2);
  Buf one(64, cu::DType::kFloat32);
  const std::vector<float> ones(64, 1.0f);
  CheckCuda(cudaMemcpy(one.p, ones.data(), 64 * 4, cudaMemcpyHostToDevice), "scales");
  const float* s = one.as<float>();
  // Block scales of 1 for every operand: the largest is a 1x128 tensor of [T, F] or of the weight
  // gradient's [out, T] (ceil(K / 128) * rows floats).
  const size_t max_scales = static_cast<size_t>(T) * 64;
  Buf block_ones(max_scales, cu::DType::kFloat32);
  {
    const std::vector<float> h(max_scales, 1.0f);
    CheckCuda(cudaMemcpy(block_ones.p, h.data(), max_scales * 4, cudaMemcpyHostToDevice), "ones");
  }
  const float* bs = block_ones.as<float>();
  struct Linear {
    const char* name;
    int64_t in, out, count;
  };
  const std::vector<Linear> step = {{"L qkv", d, 3 * d, 14},   {"L gate", d, d, 14},
                                    {"L out", d, d, 14},       {"M q_a", d, 768, 2},
                                    {"M kv_a", d, 576, 2},     {"M out", 16 * 128, d, 2},
                                    {"ffn w1 / w3", d, F, 32}, {"ffn w2", F, d, 16}};
  const char* roles[] = {"fwd", "dgrad", "wgrad fp32 b1"};
  // mode 0: bf16, 1: FP8 accurate, 2: FP8 fast accumulation, 3: FP8 blockwise.
  auto args = [&](const Linear& l, int role, int mode) {
    cu::GemmArgs a;
    a.C = C.p;
    a.trans_b = true;
    if (role == 0) a.M = T, a.N = l.out, a.K = l.in;
    if (role == 1) a.M = T, a.N = l.in, a.K = l.out;
    if (role == 2) a.M = l.out, a.N = l.in, a.K = T, a.beta = 1.0f;
    a.lda = a.K, a.ldb = a.K, a.ldc = a.N;
    a.c_type = role == 2 ? cu::DType::kFloat32 : kBf16;
    if (mode == 0) {  // the bf16 engine's layouts: dgrad B untransposed, wgrad A transposed
      a.A = A.p, a.B = B.p;
      if (role == 1) a.trans_b = false, a.ldb = a.N;
      if (role == 2) a.trans_a = true, a.trans_b = false, a.lda = a.M, a.ldb = a.N;
      return a;
    }
    a.A = role == 0 ? e4->p : e5->p, a.B = e4b->p;
    a.ab_type = role == 0 ? cu::DType::kFp8E4M3 : cu::DType::kFp8E5M2;
    a.b_type = cu::DType::kFp8E4M3;
    a.a_scale = s, a.b_scale = s;
    a.fast_accum = mode == 2;
    if (mode == 3) {
      a.a_scale = bs, a.b_scale = bs;
      a.a_scale_mode = cu::Fp8ScaleMode::kRow128;
      a.b_scale_mode = role == 2 ? cu::Fp8ScaleMode::kRow128 : cu::Fp8ScaleMode::kBlock128;
    }
    return a;
  };
  std::printf("| %-12s | %-13s | %5s | %9s | %9s | %9s | %9s | %8s | %8s | %8s | %s |\n", "linear",
              "role", "count", "bf16 ms", "fp8 ms", "fast ms", "block ms", "fp8 TF/s",
              "fast TF/s", "blk TF/s", "blockwise path");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  double total[3][4] = {};
  for (const Linear& l : step)
    for (int role = 0; role < 3; ++role) {
      double ms[4];
      for (int mode = 0; mode < 4; ++mode) {
        const cu::GemmArgs a = args(l, role, mode);
        ms[mode] = SustainedMs([&] { Check(blas->Gemm(a, 0), "gemm"); });
        total[role][mode] += ms[mode] * l.count;
      }
      const double flops = 2.0 * T * l.in * l.out;
      std::printf(
          "| %-12s | %-13s | %5lld | %9.3f | %9.3f | %9.3f | %9.3f | %8.0f | %8.0f | %8.0f | %s "
          "|\n",
          l.name, roles[role], static_cast<long long>(l.count), ms[0], ms[1], ms[2], ms[3],
          flops / ms[1] / 1e9, flops / ms[2] / 1e9, flops / ms[3] / 1e9,
          blas->AlgorithmName(args(l, role, 3)).c_str());
      std::fflush(stdout);
    }
  std::printf("\nthese GEMMs in one step, ms (bf16 / fp8 / fp8 fast / fp8 blockwise):");
  for (int role = 0; role < 3; ++role)
    std::printf(" %s %.1f / %.1f / %.1f / %.1f;", roles[role], total[role][0], total[role][1],
                total[role][2], total[role][3]);
  std::printf("\n");
  {  // our own block-scaled kernel (the fallback) on one shape, for scale
    cu::GemmArgs a = args(step[1], 0, 3);
    a.own_kernel = true;
    const double ms = TimeMs([&] { Check(blas->Gemm(a, 0), "own gemm"); }, 5, 1);
    std::printf("own block-scaled kernel, %s fwd: %.3f ms, %.0f TF/s\n", step[1].name, ms,
                2.0 * T * step[1].in * step[1].out / ms / 1e9);
  }
  Fp8Quantizers(T, d, F);
  return 0;
}

// ---- The MoE FFN at the `moe` preset's shapes (--moe) -------------------------------------------
// d_model 2048, 64 experts of width 256 (W1 and W3 stacked per expert as [512, 2048], W2
// [2048, 256]), top 8, at 16K and 32K tokens: 131,072 and 262,144 rows in 64 groups padded to
// multiples of 16 (of 64 for the persistent kernel, whose weight gradient needs them: its
// TFLOP/s count the same useful FLOPs, the extra padding rows its cost), with a uniform load (each row's expert drawn at random) and a skewed one
// (expert loads from 0.7x to 1.3x the mean: max / mean 1.3). Each expert GEMM role runs grouped
// by each GroupedGemmMethod and as one dense GEMM of the same FLOPs (the rows of all groups as
// one matrix against one expert's weights), medians of 10 after warm-up; then the six roles' sum
// (the experts' GEMMs of one layer's forward and backward).
std::vector<int64_t> MoeCounts(int64_t rows, int64_t E, bool skewed, std::mt19937& rng) {
  std::vector<int64_t> counts(E, 0);
  if (skewed) {
    double sum = 0;
    std::vector<double> w(E);
    for (int64_t e = 0; e < E; ++e) sum += w[e] = 0.7 + 0.6 * e / (E - 1);
    int64_t given = 0;
    for (int64_t e = 0; e < E; ++e) given += counts[e] = static_cast<int64_t>(rows * w[e] / sum);
    counts[E - 1] += rows - given;
    std::shuffle(counts.begin(), counts.end(), rng);
  } else {
    std::uniform_int_distribution<int64_t> pick(0, E - 1);
    for (int64_t i = 0; i < rows; ++i) ++counts[pick(rng)];
  }
  return counts;
}

// Group offsets of `counts`, each group padded to a multiple of `align`.
std::vector<int64_t> PaddedOffsets(const std::vector<int64_t>& counts, int64_t align) {
  std::vector<int64_t> off(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e)
    off[e + 1] = off[e] + (counts[e] + align - 1) / align * align;
  return off;
}

int MoeBench() {
  const int64_t d = 2048, F = 256, E = 64, topk = 8;
  const int64_t max_rows = 32768 * topk + E * 64;
  std::mt19937 rng(7);
  // Activations (the widest: [rows, 2048]), stacked weights, fp32 weight gradients.
  Buf X(max_rows * d, kBf16), Y(max_rows * d, kBf16), W(E * 2 * F * d, kBf16, 0.02f),
      dW(E * 2 * F * d, cu::DType::kFloat32);
  // FP8 codes: valid codes of N(0, 1) values, as a quantization makes them; scales of 1.
  auto codes = [&](int64_t n, cu::DType format) {
    auto q = std::make_unique<Buf>(n / 2 + 64, kBf16);
    Buf src(n, kBf16), scal(64, cu::DType::kFloat32);
    cu::Fp8Output o;
    o.format = format, o.codes = q->p, o.amax = scal.as<float>();
    o.inverse_scale = scal.as<float>() + 8;
    Check(cu::Fp8Quantize(src.p, n / 64, 64, kBf16, o, 0), "quantize");
    CheckCuda(cudaDeviceSynchronize(), "quantize");
    return q;
  };
  const auto X8 = codes(max_rows * d, cu::DType::kFp8E4M3),
             Y8 = codes(max_rows * d, cu::DType::kFp8E5M2),
             W8 = codes(E * 2 * F * d, cu::DType::kFp8E4M3);
  Buf ones(E * 4 + 64, cu::DType::kFloat32);
  const std::vector<float> one(E * 4 + 64, 1.0f);
  CheckCuda(cudaMemcpy(ones.p, one.data(), one.size() * 4, cudaMemcpyHostToDevice), "ones");
  const float* s1 = ones.as<float>();
  // Blockwise: every block scale 1 (a power of two, as the quantizers write), enough of them for
  // the widest operand's row scales (max_rows x 16 blocks) and column scales (max_rows / 128 + E
  // blocks of 2048 columns).
  const int64_t n_block_scales = max_rows * 16 + (max_rows / 128 + E + 1) * d;
  Buf block_ones(n_block_scales, cu::DType::kFloat32);
  {
    const std::vector<float> v(n_block_scales, 1.0f);
    CheckCuda(cudaMemcpy(block_ones.p, v.data(), v.size() * 4, cudaMemcpyHostToDevice), "ones");
  }
  const float* b1 = block_ones.as<float>();

  struct Variant {
    cu::GroupedGemmMethod method;
    int streams;
    const char* name;
    bool persistent = false;  // bf16 only (FP8 would run as 2 streams), groups padded to 64
  };
  const std::vector<Variant> variants = {{cu::GroupedGemmMethod::kLoop, 1, "loop"},
                                         {cu::GroupedGemmMethod::kStreams, 2, "2 streams"},
                                         {cu::GroupedGemmMethod::kStreams, 4, "4 streams"},
                                         {cu::GroupedGemmMethod::kStreams, 8, "8 streams"},
                                         {cu::GroupedGemmMethod::kGroupedBatched, 1, "grouped"},
                                         {cu::GroupedGemmMethod::kPersistent, 2, "persistent",
                                          true}};
  std::vector<std::unique_ptr<cu::GroupedGemm>> gg(variants.size());
  for (size_t v = 0; v < variants.size(); ++v) {
    Check(cu::GroupedGemm::Create({variants[v].method, variants[v].streams}, &gg[v]), "grouped");
    if (variants[v].persistent && !gg[v]->persistent_kernel())
      std::printf("(the persistent kernel does not run on this device: its column is 2 streams)\n");
  }
  std::unique_ptr<cu::Blas> blas;
  Check(cu::Blas::Create(&blas), "blas");

  struct Role {
    const char* name;
    int64_t N, K;  // the expert weight [N, K]
    int kind;      // 0 forward, 1 input gradient, 2 weight gradient
  };
  const std::vector<Role> roles = {{"w13 fwd", 2 * F, d, 0}, {"w2 fwd", d, F, 0},
                                   {"w2 dgrad", d, F, 1},    {"w13 dgrad", 2 * F, d, 1},
                                   {"w2 wgrad", d, F, 2},    {"w13 wgrad", 2 * F, d, 2}};
  std::printf(
      "Experts' GEMMs, TFLOP/s (grouped by each method; dense: one GEMM of the same "
      "FLOPs):\n\n");
  std::printf("| tokens | load | dtype | GEMM | ");
  for (const Variant& v : variants) std::printf("%s | ", v.name);
  std::printf("dense | best / dense | persistent / dense |\n|---|---|---|---|");
  for (size_t v = 0; v <= variants.size() + 2; ++v) std::printf("---|");
  std::printf("\n");
  std::vector<std::string> summary;
  for (int64_t tokens : {int64_t{16384}, int64_t{32768}}) {
    for (bool skewed : {false, true}) {
      const auto counts = MoeCounts(tokens * topk, E, skewed, rng);
      const auto off16 = PaddedOffsets(counts, 16), off64 = PaddedOffsets(counts, 64);
      const auto& off = off16;
      const int64_t rows = off[E];
      int64_t max_m = 0;
      for (int64_t e = 0; e < E; ++e) max_m = std::max(max_m, off[e + 1] - off[e]);
      for (int mode : {0, 1, 2}) {  // bf16, fp8, fp8 blockwise
        const bool fp8 = mode > 0, blockwise = mode == 2;
        const char* dtype_name = blockwise ? "fp8 blockwise" : fp8 ? "fp8" : "bf16";
        std::vector<double> total(variants.size(), 0.0), role_ms(variants.size(), 0.0);
        double dense_total = 0, flops_total = 0;
        for (const Role& r : roles) {
          const double flops = 2.0 * rows * r.N * r.K;
          flops_total += flops;
          std::printf("| %lldK | %s | %s | %s | ", static_cast<long long>(tokens / 1024),
                      skewed ? "skewed 1.3" : "uniform", dtype_name, r.name);
          double best = 1e30;
          for (size_t v = 0; v < variants.size(); ++v) {
            if (fp8 && (variants[v].method == cu::GroupedGemmMethod::kGroupedBatched ||
                        variants[v].persistent)) {
              std::printf("- | ");
              role_ms[v] = 0;
              continue;
            }
            cu::GroupedGemm& g = *gg[v];
            const std::vector<int64_t>& o = variants[v].persistent ? off64 : off16;
            std::function<void()> fn;
            if (!fp8) {
              if (r.kind == 0)
                fn = [&] {
                  Check(g.Forward(X.p, W.p, Y.p, o.data(), E, r.N, r.K, kBf16, 0), "f");
                };
              if (r.kind == 1)
                fn = [&] {
                  Check(g.BackwardData(X.p, W.p, Y.p, o.data(), E, r.N, r.K, kBf16, 0), "d");
                };
              if (r.kind == 2)
                fn = [&] {
                  Check(
                      g.BackwardWeight(X.p, Y.p, dW.as<float>(), o.data(), E, r.N, r.K, kBf16, 0),
                      "w");
                };
            } else if (blockwise) {
              constexpr auto kRow = cu::Fp8ScaleMode::kRow128;
              const cu::Fp8Experts w8{W8->p, cu::DType::kFp8E4M3, b1,
                                      cu::Fp8Blocks(r.N) * cu::Fp8SquareScalesLd(r.K),
                                      cu::Fp8ScaleMode::kBlock128};
              const cu::Fp8Experts w8t{W8->p, cu::DType::kFp8E4M3, b1,
                                       cu::Fp8Blocks(r.K) * cu::Fp8SquareScalesLd(r.N),
                                       cu::Fp8ScaleMode::kBlock128};
              if (r.kind == 0)
                fn = [&, w8] {
                  Check(g.ForwardFp8({X8->p, cu::DType::kFp8E4M3, b1, kRow}, w8, Y.p, kBf16,
                                     off.data(), E, r.N, r.K, 0),
                        "f8b");
                };
              if (r.kind == 1)
                fn = [&, w8t] {
                  Check(g.BackwardDataFp8({Y8->p, cu::DType::kFp8E5M2, b1, kRow}, w8t, X.p, kBf16,
                                          off.data(), E, r.N, r.K, 0),
                        "d8b");
                };
              if (r.kind == 2)  // at ep = 1 the segments are the groups
                fn = [&] {
                  Check(g.BackwardWeightFp8({Y8->p, cu::DType::kFp8E5M2, b1, kRow},
                                            {X8->p, cu::DType::kFp8E4M3, b1, kRow}, dW.as<float>(),
                                            off.data(), E, r.N, r.K, 0, off.data(), E),
                        "w8b");
                };
            } else {
              const cu::Fp8Experts w8{W8->p, cu::DType::kFp8E4M3, s1, 4};
              if (r.kind == 0)
                fn = [&, w8] {
                  Check(g.ForwardFp8({X8->p, cu::DType::kFp8E4M3, s1}, w8, Y.p, kBf16, off.data(),
                                     E, r.N, r.K, 0),
                        "f8");
                };
              if (r.kind == 1)
                fn = [&, w8] {
                  Check(g.BackwardDataFp8({Y8->p, cu::DType::kFp8E5M2, s1}, w8, X.p, kBf16,
                                          off.data(), E, r.N, r.K, 0),
                        "d8");
                };
              if (r.kind == 2)
                fn = [&] {
                  Check(g.BackwardWeightFp8({Y8->p, cu::DType::kFp8E5M2, s1},
                                            {X8->p, cu::DType::kFp8E4M3, s1}, dW.as<float>(),
                                            off.data(), E, r.N, r.K, 0),
                        "w8");
                };
            }
            const double ms = TimeMs(fn, 10, 3);
            total[v] += ms;
            role_ms[v] = ms;
            best = std::min(best, ms);
            std::printf("%.0f | ", flops / ms / 1e9);
          }
          // The dense GEMM of the same FLOPs, in the role's layout.
          cu::GemmArgs a;
          a.C = r.kind == 2 ? dW.p : Y.p;
          a.c_type = r.kind == 2 ? cu::DType::kFloat32 : kBf16;
          a.beta = r.kind == 2 ? 1.0f : 0.0f;
          if (!fp8) {
            a.A = X.p, a.B = r.kind == 2 ? Y.p : W.p;  // wgrad: dC^T [N, rows] A [rows, K]
            if (r.kind == 0) a.trans_b = true, a.M = rows, a.N = r.N, a.K = r.K;
            if (r.kind == 1) a.M = rows, a.N = r.K, a.K = r.N;
            if (r.kind == 2) a.trans_a = true, a.M = r.N, a.N = r.K, a.K = rows;
            a.lda = a.trans_a ? a.M : a.K, a.ldb = a.trans_b ? a.K : a.N;
          } else {
            a.trans_b = true;
            a.a_scale = s1, a.b_scale = s1;
            a.ab_type = r.kind == 0 ? cu::DType::kFp8E4M3 : cu::DType::kFp8E5M2;
            a.b_type = cu::DType::kFp8E4M3;
            a.A = r.kind == 0 ? X8->p : Y8->p;
            a.B = r.kind == 2 ? X8->p : W8->p;
            if (r.kind == 0) a.M = rows, a.N = r.N, a.K = r.K;
            if (r.kind == 1) a.M = rows, a.N = r.K, a.K = r.N;
            if (r.kind == 2) a.M = r.N, a.N = r.K, a.K = rows;
            a.lda = a.K, a.ldb = a.K;
            if (blockwise) {  // activations 1 x 128, weights 128 x 128 (wgrad: both 1 x 128)
              a.a_scale = b1, a.b_scale = b1;
              a.a_scale_mode = cu::Fp8ScaleMode::kRow128;
              a.b_scale_mode =
                  r.kind == 2 ? cu::Fp8ScaleMode::kRow128 : cu::Fp8ScaleMode::kBlock128;
            }
          }
          a.ldc = a.N;
          const double dense = TimeMs([&] { Check(blas->Gemm(a, 0), "dense"); }, 10, 3);
          dense_total += dense;
          const double pers = role_ms.back();  // the persistent variant is the last
          std::printf("%.0f | %.0f%% | ", flops / dense / 1e9, 100.0 * dense / best);
          std::printf(pers > 0 ? "%.0f%% |\n" : "- |\n", 100.0 * dense / pers);
          std::fflush(stdout);
        }
        char line[512];
        int n =
            std::snprintf(line, sizeof(line), "| %lldK | %s (max group %lld rows) | %s | ",
                          static_cast<long long>(tokens / 1024), skewed ? "skewed 1.3" : "uniform",
                          static_cast<long long>(max_m), dtype_name);
        double best = 1e30;
        for (size_t v = 0; v < variants.size(); ++v) {
          if (total[v] > 0) best = std::min(best, total[v]);
          n += std::snprintf(line + n, sizeof(line) - n, total[v] > 0 ? "%.3f | " : "- | ",
                             total[v]);
        }
        n += std::snprintf(line + n, sizeof(line) - n, "%.3f | %.0f / %.0f | %.0f%% | ",
                           dense_total, flops_total / best / 1e9, flops_total / dense_total / 1e9,
                           100.0 * dense_total / best);
        std::snprintf(line + n, sizeof(line) - n, total.back() > 0 ? "%.0f%% |" : "- |",
                      100.0 * dense_total / total.back());
        summary.push_back(line);
      }
    }
  }
  std::printf("\nThe six GEMMs of one MoE layer's experts (forward and backward), ms:\n\n");
  std::printf("| tokens | load | dtype | ");
  for (const Variant& v : variants) std::printf("%s | ", v.name);
  std::printf("dense | best / dense TFLOP/s | best / dense | persistent / dense |\n|---|---|---|");
  for (size_t v = 0; v < variants.size() + 4; ++v) std::printf("---|");
  std::printf("\n");
  for (const auto& l : summary) std::printf("%s\n", l.c_str());

  // ---- Routing and data movement at 32K tokens (262,144 rows) ----
  std::printf("\nRouting, gathers and combine at 32K tokens, top 8 of 64, d 2048:\n\n");
  std::printf("| %-52s | %9s | %8s | %7s | %8s |\n", "kernel", "ms", "MB", "copy bw", "TFLOP/s");
  std::printf("|---|---|---|---|---|\n");
  const int64_t T = 32768, n = T * topk, cap = n + E * 15;
  Buf logits(T * E, cu::DType::kFloat32), bias(E, cu::DType::kFloat32, 0.01f),
      weights(n, cu::DType::kFloat32, 0.1f, 0.125f), lse(T, cu::DType::kFloat32),
      dlogits(T * E, cu::DType::kFloat32), dwts(n, cu::DType::kFloat32);
  int32_t *idx = nullptr, *item_row = nullptr, *row_source = nullptr;
  int64_t *counts = nullptr, *offsets = nullptr, *counts_host = nullptr;
  CheckCuda(cudaMalloc(&idx, n * 4), "idx");
  CheckCuda(cudaMalloc(&item_row, n * 4), "item_row");
  CheckCuda(cudaMalloc(&row_source, cap * 4), "row_source");
  CheckCuda(cudaMalloc(&counts, E * 8), "counts");
  CheckCuda(cudaMalloc(&offsets, (E + 1) * 8), "offsets");
  CheckCuda(cudaMallocHost(&counts_host, E * 8), "counts_host");
  Buf ws(cu::MoeGroupRowsWorkspaceBytes(n, E), cu::DType::kFloat32);
  Row("router fwd (T 32K, E 64, K 8)", TimeMs([&] {
        Check(cu::MoeRouterForward(logits.as<float>(), bias.as<float>(), idx, weights.as<float>(),
                                   lse.as<float>(), T, E, topk, 0),
              "router");
      }),
      T * E * 4.0 + n * 8.0);
  Row("router bwd (+ z-loss)", TimeMs([&] {
        Check(cu::MoeRouterBackward(logits.as<float>(), idx, weights.as<float>(), lse.as<float>(),
                                    1e-3f, dlogits.as<float>(), T, E, topk, 0),
              "router bwd");
      }),
      T * E * 8.0 + n * 8.0);
  Row("group rows (262,144 pairs, align 16, counts to host)", TimeMs([&] {
        Check(cu::MoeGroupRows(idx, n, topk, E, 16, counts, offsets, item_row, row_source, cap,
                               counts_host, {ws.p, ws.bytes}, 0),
              "group");
      }),
      n * 12.0 + cap * 4.0);
  CheckCuda(cudaDeviceSynchronize(), "group");
  int64_t rows = 0;
  for (int64_t e = 0; e < E; ++e) rows += (counts_host[e] + 15) / 16 * 16;
  const double row_bytes = static_cast<double>(rows) * d;
  Row("gather rows bf16",
      TimeMs([&] { Check(cu::GatherRows(X.p, row_source, Y.p, rows, d, kBf16, 0), "gather"); }),
      4.0 * row_bytes);
  Buf scal(64, cu::DType::kFloat32, 0.0f, 4.0f);
  cu::Fp8Output q;
  q.codes = X8->p, q.codes_t = Y8->p, q.amax = scal.as<float>(), q.scale = scal.as<float>() + 4;
  q.inverse_scale = scal.as<float>() + 8;
  Row("gather + fp8 quantize, codes and codes_t (bf16 in)", TimeMs([&] {
        Check(cu::GatherRowsFp8(X.p, row_source, rows, d, kBf16, q, 0), "gather fp8");
      }),
      4.0 * row_bytes);
  q.codes_t = nullptr;
  Row("gather + fp8 quantize, codes only", TimeMs([&] {
        Check(cu::GatherRowsFp8(X.p, row_source, rows, d, kBf16, q, 0), "gather fp8");
      }),
      3.0 * row_bytes);
  Row("combine bf16, weighted, accumulate", TimeMs([&] {
        Check(cu::MoeCombine(Y.p, kBf16, item_row, weights.as<float>(), X.p, kBf16, T, topk, d,
                             true, 0),
              "combine");
      }),
      2.0 * row_bytes + 4.0 * T * d);
  Buf dy(rows * d, kBf16);
  Row("combine backward bf16 (dy, dw, dy amax)", TimeMs([&] {
        Check(cu::MoeCombineBackward(X.p, Y.p, item_row, weights.as<float>(), dy.p,
                                     dwts.as<float>(), T, topk, d, kBf16, 0, scal.as<float>()),
              "combine bwd");
      }),
      4.0 * row_bytes + 2.0 * T * d);
  cudaFree(idx), cudaFree(item_row), cudaFree(row_source), cudaFree(counts), cudaFree(offsets);
  cudaFreeHost(counts_host);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, sdpa_only = false, lightning_only = false, cp_pieces = false,
       causal_vs_full = false, step_gemms = false, gemm_candidates = false, fp8_gemms = false,
       moe = false;
  int lightning_row = -1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--lightning-row") == 0 && i + 1 < argc) {
      lightning_row = std::atoi(argv[++i]);
      lightning_only = true;
    }
    quick |= std::strcmp(argv[i], "--quick") == 0;
    sdpa_only |= std::strcmp(argv[i], "--sdpa-only") == 0;
    cp_pieces |= std::strcmp(argv[i], "--cp-pieces") == 0;
    causal_vs_full |= std::strcmp(argv[i], "--causal-vs-full") == 0;
    step_gemms |= std::strcmp(argv[i], "--step-gemms") == 0;
    gemm_candidates |= std::strcmp(argv[i], "--gemm-candidates") == 0;
    fp8_gemms |= std::strcmp(argv[i], "--fp8-gemms") == 0;
    moe |= std::strcmp(argv[i], "--moe") == 0;
    lightning_only |= std::strcmp(argv[i], "--lightning-only") == 0;
  }
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("no CUDA device: nothing to benchmark\n");
    return 0;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  {
    const size_t n = size_t{1} << 30;
    void *x, *y;
    CheckCuda(cudaMalloc(&x, n), "malloc");
    CheckCuda(cudaMalloc(&y, n), "malloc");
    const double ms = TimeMs([&] { cudaMemcpyAsync(y, x, n, cudaMemcpyDeviceToDevice); });
    g_copy_tbps = 2.0 * n / ms / 1e9;
    cudaFree(x);
    cudaFree(y);
  }
  std::printf("device copy: %.2f TB/s (read + write)\n\n", g_copy_tbps);
  if (step_gemms || gemm_candidates) return StepGemms(gemm_candidates);
  if (fp8_gemms) return Fp8Gemms();
  if (moe) return MoeBench();

  std::printf("| %-52s | %9s | %8s | %7s | %8s |\n", "kernel", "ms", "MB", "copy bw", "TFLOP/s");
  std::printf("|%s|%s|%s|%s|%s|\n", std::string(54, '-').c_str(), std::string(11, '-').c_str(),
              std::string(10, '-').c_str(), std::string(9, '-').c_str(),
              std::string(10, '-').c_str());

  // ---- cuDNN causal against unmasked attention, forward and backward apart ---------------------
  // A Ring's diagonal block is causal (T^2 / 2 pairs), its off-diagonal blocks unmasked (T^2).
  // TFLOP/s count the pairs each graph computes: 2 (Dqk + Dv) per pair forward, 2.5x that
  // backward (dS, dP, dQ, dK, dV: five GEMMs against the forward's two).
  if (causal_vs_full) {
    const int64_t H = 16, Dqk = 192, Dv = 128, Tmax = 32768;
    Buf q(Tmax * H * Dqk, kBf16), k(Tmax * H * Dqk, kBf16), v(Tmax * H * Dv, kBf16),
        o(Tmax * H * Dv, kBf16), dout(Tmax * H * Dv, kBf16), dq(Tmax * H * Dqk, kBf16),
        dk(Tmax * H * Dqk, kBf16), dv(Tmax * H * Dv, kBf16),
        stats(Tmax * H, cu::DType::kFloat32);
    std::unique_ptr<cu::Sdpa> sdpa;
    Check(cu::Sdpa::Create(&sdpa), "Sdpa::Create");
    const float scale = 1.0f / std::sqrt(static_cast<float>(Dqk));
    for (int64_t T : {int64_t{4096}, int64_t{8192}, int64_t{16384}, int64_t{32768}}) {
      cu::SdpaDims d;
      d.T = T, d.Tkv = T, d.H = H, d.Dqk = Dqk, d.Dv = Dv;
      const int32_t cu_h[2] = {0, static_cast<int32_t>(T)};
      const double fwd_pair = 2.0 * (Dqk + Dv) * H, bwd_pair = 2.5 * fwd_pair;
      const double causal_pairs = static_cast<double>(T) * T / 2, full_pairs = 2 * causal_pairs;
      auto causal_fwd = [&] {
        Check(sdpa->Forward(q.p, k.p, v.p, o.p, stats.as<float>(), cu_h, 1, scale, d, kBf16, 0),
              "causal fwd");
      };
      auto full_fwd = [&] {
        Check(sdpa->ForwardFull(q.p, k.p, v.p, o.p, stats.as<float>(), scale, d, kBf16, 0),
              "full fwd");
      };
      const std::string t = std::to_string(T / 1024) + "K";
      causal_fwd();
      Row("causal fwd " + t, TimeMs(causal_fwd, 10, 2), 0, causal_pairs * fwd_pair);
      Row("causal bwd " + t,
          TimeMs(
              [&] {
                Check(sdpa->Backward(q.p, k.p, v.p, o.p, stats.as<float>(), dout.p, dq.p, dk.p,
                                     dv.p, cu_h, 1, scale, d, kBf16, 0),
                      "causal bwd");
              },
              10, 2),
          0, causal_pairs * bwd_pair);
      full_fwd();
      Row("full fwd " + t + " x " + t, TimeMs(full_fwd, 10, 2), 0, full_pairs * fwd_pair);
      Row("full bwd " + t + " x " + t,
          TimeMs(
              [&] {
                Check(sdpa->BackwardFull(q.p, k.p, v.p, o.p, stats.as<float>(), dout.p, dq.p,
                                         dk.p, dv.p, scale, d, kBf16, 0),
                      "full bwd");
              },
              10, 2),
          0, full_pairs * bwd_pair);
    }
    return 0;
  }

  // ---- MLA attention under CP = 2, one document of 64K tokens: what each rank runs -------------
  // All2All: causal attention over all 64K tokens for 8 of the 16 heads. AllGather (chunks of
  // 16K; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2): every chunk's causal piece over its
  // own 16K tokens for 16 heads, plus a full (unmasked) piece over the earlier tokens: 48K keys
  // for chunk 3; 16K and 32K for chunks 1 and 2. All four cost the same FLOPs per rank.
  if (cp_pieces) {
    const int64_t Tf = 65536, ch = Tf / 4, H = 16, Dqk = 192, Dv = 128;
    Buf q(Tf * H * Dqk, kBf16), k(Tf * H * Dqk, kBf16), v(Tf * H * Dv, kBf16),
        o(Tf * H * Dv, kBf16), dout(Tf * H * Dv, kBf16), dq(Tf * H * Dqk, kBf16),
        dk(Tf * H * Dqk, kBf16), dv(Tf * H * Dv, kBf16), stats(Tf * H, cu::DType::kFloat32);
    std::unique_ptr<cu::Sdpa> sdpa;
    Check(cu::Sdpa::Create(&sdpa), "Sdpa::Create");
    const float scale = 1.0f / std::sqrt(static_cast<float>(Dqk));
    auto causal = [&](int64_t T, int64_t heads) {
      cu::SdpaDims d;
      d.T = T, d.H = heads, d.Dqk = Dqk, d.Dv = Dv;
      const int32_t cu_h[2] = {0, static_cast<int32_t>(T)};
      Check(sdpa->Forward(q.p, k.p, v.p, o.p, stats.as<float>(), cu_h, 1, scale, d, kBf16, 0),
            "causal fwd");
      Check(sdpa->Backward(q.p, k.p, v.p, o.p, stats.as<float>(), dout.p, dq.p, dk.p, dv.p, cu_h, 1,
                           scale, d, kBf16, 0),
            "causal bwd");
    };
    auto full = [&](int64_t Tq, int64_t Tkv) {
      cu::SdpaDims d;
      d.T = Tq, d.Tkv = Tkv, d.H = H, d.Dqk = Dqk, d.Dv = Dv;
      Check(sdpa->ForwardFull(q.p, k.p, v.p, o.p, stats.as<float>(), scale, d, kBf16, 0),
            "full fwd");
      Check(sdpa->BackwardFull(q.p, k.p, v.p, o.p, stats.as<float>(), dout.p, dq.p, dk.p, dv.p,
                               scale, d, kBf16, 0),
            "full bwd");
    };
    const double pairs_rank = static_cast<double>(Tf) * Tf / 2 * H / 2;  // per rank, causal half
    const double flops = pairs_rank * 2 * (Dqk + Dv) * 3.5;              // fwd + bwd ~ 3.5 fwd
    Row("cp2 64K all2all: causal 64K x 8 heads", TimeMs([&] { causal(Tf, H / 2); }, 5, 1), 0,
        flops);
    Row("cp2 64K allgather rank 0: 2 causal 16K + full 16Kx48K",
        TimeMs(
            [&] {
              causal(ch, H);
              causal(ch, H);
              full(ch, 3 * ch);
            },
            5, 1),
        0, flops);
    Row("cp2 64K allgather rank 1: 2 causal 16K + full 16K, 32K",
        TimeMs(
            [&] {
              causal(ch, H);
              causal(ch, H);
              full(ch, ch);
              full(ch, 2 * ch);
            },
            5, 1),
        0, flops);
    Row("  causal 16K x 16 heads", TimeMs([&] { causal(ch, H); }, 5, 1), 0,
        static_cast<double>(ch) * ch / 2 * H * 2 * (Dqk + Dv) * 3.5);
    Row("  full 16K x 48K x 16 heads", TimeMs([&] { full(ch, 3 * ch); }, 5, 1), 0,
        static_cast<double>(ch) * 3 * ch * H * 2 * (Dqk + Dv) * 3.5);
    Row("  full 16K x 16K x 16 heads", TimeMs([&] { full(ch, ch); }, 5, 1), 0,
        static_cast<double>(ch) * ch * H * 2 * (Dqk + Dv) * 3.5);
    cu::SdpaDims d;
    d.T = ch, d.Tkv = 3 * ch, d.H = H, d.Dqk = Dqk, d.Dv = Dv;
    Row("  full 16K x 48K x 16 heads fwd",
        TimeMs(
            [&] {
              Check(sdpa->ForwardFull(q.p, k.p, v.p, o.p, stats.as<float>(), scale, d, kBf16, 0),
                    "full fwd");
            },
            5, 1),
        0, static_cast<double>(ch) * 3 * ch * H * 2 * (Dqk + Dv));
    return 0;
  }

  // ---- Lightning, T=32K H=16 Dh=128 ---------------------------------------------------------------
  for (int64_t T : {int64_t{32768}, int64_t{65536}}) {
    if (sdpa_only || ((quick || lightning_only) && T > 32768)) break;
    const int64_t H = 16, Dh = 128, HD = H * Dh, stride = 3 * HD;
    Buf qkv(T * stride, kBf16, 0.1f), out(T * HD, kBf16), dout(T * HD, kBf16),
        grads(T * stride, kBf16);
    std::vector<float> ld(H);
    for (int64_t h = 0; h < H; ++h) ld[h] = -(8.0f / H) * h / H - 0.01f;  // the peer's g_gamma
    Buf d_ld(H, cu::DType::kFloat32);
    cudaMemcpy(d_ld.p, ld.data(), H * 4, cudaMemcpyHostToDevice);
    std::vector<int32_t> cu_h{0, static_cast<int32_t>(T)};
    Buf d_cu(2, cu::DType::kFloat32);
    cudaMemcpy(d_cu.p, cu_h.data(), 8, cudaMemcpyHostToDevice);
    auto* q = qkv.as<__nv_bfloat16>();
    auto* g = grads.as<__nv_bfloat16>();
    const float scale = 1.0f / std::sqrt(128.0f);
    const cu::LightningDims dims{T, H, Dh, stride};
    const double act = static_cast<double>(T) * HD * 2;  // one [T, H, Dh] bf16 tensor
    const double n_chunks = T / 64.0;
    const double fwd_flops = n_chunks * H * 2.0 * (64.0 * 64 * Dh * 2 + 64.0 * Dh * Dh * 2);
    // (chunks per block, stages, separate dk and dv sweeps, sweep kernel: 1 mma.sync, 2 wgmma,
    // 3 mma.sync with the state transposed); 0 = automatic. The first three rows are the sweep
    // kernels side by side.
    int row = -1;
    for (auto [cpb, stages, separate, kernel] : {std::tuple{0, 1, false, 2},
                                                 {0, 0, false, 1},
                                                 {0, 0, false, 3},
                                                 {0, 0, true, 0},
                                                 {0, 1, false, 0},
                                                 {16, 1, false, 2},
                                                 {32, 1, false, 2},
                                                 {64, 1, false, 2},
                                                 {16, 1, false, 1},
                                                 {64, 0, true, 4},
                                                 {0, 0, true, 4}}) {
      if (++row != lightning_row && lightning_row >= 0) continue;
      const cu::LightningConfig cfg{cpb, stages, separate, kernel};
      Buf ws(cu::LightningWorkspaceBytes(dims, cfg) / 4 + 1, cu::DType::kFloat32);
      const cu::Workspace w{ws.p, ws.bytes};
      // kept: the forward keeps its block states for the backward (as the model runs it).
      Buf saved(cu::LightningSavedBytes(dims, cfg) / 4 + 1, cu::DType::kFloat32);
      auto fwd = [&](bool kept) {
        Check(cu::LightningForward(q, q + HD, q + 2 * HD, d_ld.as<float>(), d_cu.as<int32_t>(), 1,
                                   nullptr, scale, dims, out.p, nullptr, kBf16, w, 0, cfg,
                                   kept ? saved.as<float>() : nullptr),
              "LightningForward");
      };
      auto bwd = [&](bool kept) {
        Check(cu::LightningBackward(q, q + HD, q + 2 * HD, d_ld.as<float>(), d_cu.as<int32_t>(), 1,
                                    nullptr, scale, dims, dout.p, nullptr, g, g + HD, g + 2 * HD,
                                    nullptr, kBf16, w, 0, cfg, kept ? saved.as<float>() : nullptr),
              "LightningBackward");
      };
      const std::string tag = "lightning T=" + std::to_string(T / 1024) + "K H=16 Dh=128 cpb=" +
                              (cpb == 0 ? std::string("auto") : std::to_string(cpb)) +
                              " st=" + std::to_string(stages) + (separate ? " dk|dv" : "") +
                              (kernel == 4   ? " wgmma-ws"
                               : kernel == 3 ? " mma.sync-T"
                               : kernel == 2 ? " wgmma"
                               : kernel == 1 ? " mma.sync"
                                             : "");
      const double tf = TimeMs([&] { fwd(false); }), tb = TimeMs([&] { bwd(false); });
      const double tfb = TimeMs([&] {
        fwd(false);
        bwd(false);
      });
      fwd(true);
      const double tb_kept = TimeMs([&] { bwd(true); });
      const double tfb_kept = TimeMs([&] {
        fwd(true);
        bwd(true);
      });
      // Bytes: the floor's traffic (fwd reads q, k, v and writes o; bwd reads q, k, v, dout and
      // writes dq, dk, dv), so the copy-bandwidth column is the fraction of the memory-bound floor.
      Row(tag + " fwd", tf, 4 * act, fwd_flops);
      Row(tag + " bwd", tb, 7 * act, 2 * fwd_flops);
      Row(tag + " fwd+bwd", tfb, 11 * act, 3 * fwd_flops);
      Row(tag + " bwd, fwd states kept", tb_kept, 7 * act, 2 * fwd_flops);
      Row(tag + " fwd+bwd, states kept", tfb_kept, 11 * act, 3 * fwd_flops);
      if (T == 32768) {
        std::printf("|   fwd+bwd (states kept) vs FLA chunk_simple_gla 1.90 ms (peer README figure): "
                    "%.2fx |\n",
                    1.90 / tfb_kept);
      }
      if (quick && kernel == 1) break;
    }
  }

  if (lightning_only) return 0;

  // ---- cuDNN causal attention (MLA core), T=32K H=16 Dqk=192 Dv=128, one document ---------------
  {
    const int64_t T = 32768, H = 16, Dqk = 192, Dv = 128;
    Buf q(T * H * Dqk, kBf16), k(T * H * Dqk, kBf16), v(T * H * Dv, kBf16), o(T * H * Dv, kBf16),
        dout(T * H * Dv, kBf16), dq(T * H * Dqk, kBf16), dk(T * H * Dqk, kBf16),
        dv(T * H * Dv, kBf16), stats(T * H, cu::DType::kFloat32);
    std::unique_ptr<cu::Sdpa> sdpa;
    Check(cu::Sdpa::Create(&sdpa), "Sdpa::Create");
    cu::SdpaDims dims;
    dims.T = T, dims.H = H, dims.Dqk = Dqk, dims.Dv = Dv;  // dense views
    const int32_t cu_h[2] = {0, static_cast<int32_t>(T)};
    const float scale = 1.0f / std::sqrt(static_cast<float>(Dqk));
    auto fwd = [&] {
      Check(sdpa->Forward(q.p, k.p, v.p, o.p, stats.as<float>(), cu_h, 1, scale, dims, kBf16, 0),
            "Sdpa::Forward");
    };
    auto bwd = [&] {
      Check(sdpa->Backward(q.p, k.p, v.p, o.p, stats.as<float>(), dout.p, dq.p, dk.p, dv.p, cu_h,
                           1, scale, dims, kBf16, 0),
            "Sdpa::Backward");
    };
    // First calls build the plans (heuristics + engine finalize): timed once, on the host.
    const auto t0 = std::chrono::steady_clock::now();
    fwd();
    bwd();
    CheckCuda(cudaDeviceSynchronize(), "sdpa first calls");
    const double build_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    // Causal FLOPs: each [T, T] x D matmul counts T^2 D (half of 2 T^2 D). Forward: Q K^T and
    // P V; backward: S recomputed, dP, dV, dQ, dK.
    const double tt = static_cast<double>(T) * T * H;
    const double fwd_flops = tt * (Dqk + Dv), bwd_flops = tt * (3.0 * Dqk + 2.0 * Dv);
    const double io_fwd = T * H * (2.0 * Dqk + 2.0 * Dv) * 2;
    const double io_bwd = T * H * (4.0 * Dqk + 6.0 * Dv) * 2;
    const double tf = TimeMs(fwd, 10, 2), tb = TimeMs(bwd, 10, 2);
    const double tfb = TimeMs([&] { fwd(); bwd(); }, 10, 2);
    Row("sdpa cuDNN T=32K H=16 qk192 v128 fwd", tf, io_fwd, fwd_flops);
    Row("sdpa cuDNN T=32K H=16 qk192 v128 bwd", tb, io_bwd, bwd_flops);
    Row("sdpa cuDNN T=32K H=16 qk192 v128 fwd+bwd", tfb, io_fwd + io_bwd, fwd_flops + bwd_flops);
    std::printf("|   sdpa vs PyTorch cuDNN SDPA (peer, H200): fwd %.3f ms = %.2fx of 9.39, "
                "fwd+bwd %.3f ms = %.2fx of 38.1; first fwd+bwd with plan builds %.0f ms |\n",
                tf, tf / 9.39, tfb, tfb / 38.1, build_ms);
    sdpa->SetDeterministic(true);
    bwd();  // plan build
    CheckCuda(cudaDeviceSynchronize(), "sdpa deterministic first call");
    Row("sdpa cuDNN T=32K H=16 qk192 v128 bwd deterministic", TimeMs(bwd, 10, 2), io_bwd,
        bwd_flops);
    std::fflush(stdout);

    // 16 documents over the same 32K tokens: one ragged graph, and one graph per document.
    std::vector<int32_t> cu_docs{0};
    for (int32_t len : {4096, 1024, 8192, 512, 2048, 3000, 1500, 6000, 777, 1223, 900, 1100, 600,
                        400, 200, 1196}) {
      cu_docs.push_back(cu_docs.back() + len);
    }
    double doc_tt = 0;
    for (size_t i = 0; i + 1 < cu_docs.size(); ++i) {
      const double len = cu_docs[i + 1] - cu_docs[i];
      doc_tt += len * len * H;
    }
    const int64_t n_docs = static_cast<int64_t>(cu_docs.size()) - 1;
    for (const bool per_doc : {false, true}) {
      if (per_doc) setenv("SPINDLE_SDPA_PER_DOCUMENT", "1", 1);
      std::unique_ptr<cu::Sdpa> s;
      Check(cu::Sdpa::Create(&s), "Sdpa::Create");
      unsetenv("SPINDLE_SDPA_PER_DOCUMENT");
      auto dfwd = [&] {
        Check(s->Forward(q.p, k.p, v.p, o.p, stats.as<float>(), cu_docs.data(), n_docs, scale,
                         dims, kBf16, 0),
              "Sdpa::Forward docs");
      };
      auto dbwd = [&] {
        Check(s->Backward(q.p, k.p, v.p, o.p, stats.as<float>(), dout.p, dq.p, dk.p, dv.p,
                          cu_docs.data(), n_docs, scale, dims, kBf16, 0),
              "Sdpa::Backward docs");
      };
      const std::string tag = std::string("sdpa 32K, 16 docs, ") + (per_doc ? "per-doc" : "ragged");
      Row(tag + " fwd", TimeMs(dfwd, 10, 2), io_fwd, doc_tt * (Dqk + Dv));
      Row(tag + " fwd+bwd", TimeMs([&] { dfwd(); dbwd(); }, 10, 2), io_fwd + io_bwd,
          doc_tt * (4.0 * Dqk + 3.0 * Dv));
    }
  }
  if (sdpa_only) return 0;

  // ---- Dense ops at the 1B model's sizes, T = 32K tokens -----------------------------------------------
  const int64_t T = 32768, D = 2048, H = 16, Dh = 128, F = 5632, V = 32000;
  {
    Buf x(T * D, kBf16), w(D, kBf16, 0.1f, 1.0f), y(T * D, kBf16), rstd(T, cu::DType::kFloat32),
        dw(D, cu::DType::kFloat32), res(T * D, kBf16), h(T * D, kBf16);
    Buf ws(cu::RmsNormBackwardWorkspaceBytes(T, D) / 4 + 1, cu::DType::kFloat32);
    const double act = T * D * 2.0;
    Row("rmsnorm fwd T=32K D=2048", TimeMs([&] {
          Check(cu::RmsNormForward(x.p, w.p, y.p, rstd.as<float>(), T, D, 1e-6f, kBf16, 0), "rms");
        }),
        2 * act);
    Row("rmsnorm+residual fwd T=32K D=2048", TimeMs([&] {
          Check(cu::RmsNormResidualForward(x.p, res.p, h.p, w.p, y.p, rstd.as<float>(), T, D, 1e-6f,
                                           kBf16, 0),
                "rmsres");
        }),
        4 * act);
    Row("rmsnorm bwd T=32K D=2048", TimeMs([&] {
          Check(cu::RmsNormBackward(x.p, w.p, rstd.as<float>(), y.p, nullptr, h.p, dw.as<float>(), T,
                                    D, kBf16, {ws.p, ws.bytes}, 0),
                "rmsbwd");
        }),
        3 * act);
  }
  {
    Buf qkv(T * 3 * H * Dh, kBf16), out(T * 3 * H * Dh, kBf16), w(Dh, kBf16, 0.1f, 1.0f),
        rq(T * H, cu::DType::kFloat32), rk(T * H, cu::DType::kFloat32),
        dw(2 * Dh, cu::DType::kFloat32);
    std::vector<int32_t> pos(T);
    for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t);
    Buf d_pos(T, cu::DType::kFloat32);
    cudaMemcpy(d_pos.p, pos.data(), T * 4, cudaMemcpyHostToDevice);
    Buf ws(cu::QkNormRopeBackwardWorkspaceBytes(T, H, Dh) / 4 + 1, cu::DType::kFloat32);
    const double act = T * 3.0 * H * Dh * 2;
    Row("qk norm+rope fwd (copies v) T=32K H=16 Dh=128", TimeMs([&] {
          Check(cu::QkNormRopeForward(qkv.p, w.p, w.p, d_pos.as<int32_t>(), out.p, rq.as<float>(),
                                      rk.as<float>(), T, H, Dh, 1e-6f, 10000.0f, true, kBf16, 0),
                "qkfwd");
        }),
        2 * act);
    Row("qk norm+rope bwd (copies dv) T=32K H=16 Dh=128", TimeMs([&] {
          Check(cu::QkNormRopeBackward(qkv.p, w.p, w.p, rq.as<float>(), rk.as<float>(),
                                       d_pos.as<int32_t>(), out.p, out.p, dw.as<float>(),
                                       dw.as<float>() + Dh, T, H, Dh, 10000.0f, true, kBf16,
                                       {ws.p, ws.bytes}, 0),
                "qkbwd");
        }),
        3 * act);
  }
  {
    const int64_t n = T * F;
    Buf g(n, kBf16), u(n, kBf16), y(n, kBf16);
    Row("swiglu fwd T=32K F=5632", TimeMs([&] {
          Check(cu::SwiGluForward(g.p, u.p, y.p, n, kBf16, 0), "swiglu");
        }),
        3.0 * n * 2);
    Row("swiglu bwd T=32K F=5632 (in place)", TimeMs([&] {
          Check(cu::SwiGluBackward(g.p, u.p, y.p, g.p, u.p, n, kBf16, 0), "swiglubwd");
        }),
        5.0 * n * 2);
  }
  {
    Buf o(T * H * Dh, kBf16), gate(T * H * Dh, kBf16), w(H * Dh, kBf16, 0.1f, 1.0f),
        y(T * H * Dh, kBf16), rstd(T * H, cu::DType::kFloat32), dw(H * Dh, cu::DType::kFloat32),
        dgate(T * H * Dh, kBf16);
    Buf ws(cu::GroupNormGateBackwardWorkspaceBytes(T, H, Dh) / 4 + 1, cu::DType::kFloat32);
    const double act = T * H * Dh * 2.0;
    Row("group norm+gate fwd T=32K H=16 Dh=128", TimeMs([&] {
          Check(cu::GroupNormGateForward(o.p, w.p, gate.p, y.p, rstd.as<float>(), T, H, Dh, 1e-6f,
                                         kBf16, 0),
                "gng");
        }),
        3 * act);
    Row("group norm+gate bwd T=32K H=16 Dh=128", TimeMs([&] {
          Check(cu::GroupNormGateBackward(o.p, w.p, gate.p, rstd.as<float>(), y.p, y.p,
                                          dw.as<float>(), dgate.p, T, H, Dh, kBf16,
                                          {ws.p, ws.bytes}, 0),
                "gngbwd");
        }),
        5 * act);
  }
  {
    const int64_t rows = 4096;
    Buf logits(rows * V, kBf16, 2.0f), loss(rows, cu::DType::kFloat32);
    std::vector<int32_t> tg(rows);
    for (int64_t t = 0; t < rows; ++t) tg[t] = static_cast<int32_t>((t * 7919) % V);
    Buf d_tg(rows, cu::DType::kFloat32);
    cudaMemcpy(d_tg.p, tg.data(), rows * 4, cudaMemcpyHostToDevice);
    Row("cross-entropy+grad rows=4096 V=32000 (in place)", TimeMs([&] {
          Check(cu::CrossEntropy(logits.p, d_tg.as<int32_t>(), rows, V, 1e-4f, loss.as<float>(),
                                 logits.p, kBf16, 0),
                "ce");
        }),
        3.0 * rows * V * 2);
  }
  {
    Buf ids_f(T, cu::DType::kFloat32), table(V * D, kBf16), out(T * D, kBf16),
        dtable(V * D, cu::DType::kFloat32);
    std::vector<int32_t> ids(T);
    for (int64_t t = 0; t < T; ++t) ids[t] = static_cast<int32_t>((t * 7919) % V);
    cudaMemcpy(ids_f.p, ids.data(), T * 4, cudaMemcpyHostToDevice);
    Buf ws(cu::EmbeddingBackwardWorkspaceBytes(T) / 4 + 1, cu::DType::kFloat32);
    Row("embedding fwd T=32K D=2048", TimeMs([&] {
          Check(cu::EmbeddingForward(ids_f.as<int32_t>(), table.p, out.p, T, D, kBf16, 0), "emb");
        }),
        2.0 * T * D * 2);
    Row("embedding bwd T=32K D=2048 V=32000", TimeMs([&] {
          Check(cu::EmbeddingBackward(ids_f.as<int32_t>(), out.p, dtable.as<float>(), T, D, V, kBf16,
                                      {ws.p, ws.bytes}, 0),
                "embbwd");
        }),
        T * D * 2.0 + 2.0 * T * D * 4);
  }
  {
    const int64_t n = 100'000'000;
    Buf p(n, cu::DType::kFloat32), g(n, cu::DType::kFloat32, 0.01f), m(n, cu::DType::kFloat32, 0.0f),
        v(n, cu::DType::kFloat32, 0.0f, 0.0f), pb(n, kBf16);
    std::vector<cu::OptimizerTensor> ts;
    const int64_t parts = 100;
    for (int64_t i = 0; i < parts; ++i) {
      const int64_t off = i * (n / parts);
      ts.push_back({p.as<float>() + off, g.as<float>() + off, m.as<float>() + off,
                    v.as<float>() + off, pb.as<__nv_bfloat16>() + off, n / parts, 0.1f});
    }
    cu::AdamWHyper hp{1e-4f, 0.9f, 0.95f, 1e-8f, 10, 1.0f};
    Row("adamw multi-tensor 100 tensors, 100M params", TimeMs([&] {
          Check(cu::AdamWMultiTensor(ts.data(), parts, hp, 0), "adamw");
        }),
        n * (4.0 * 4 + 3 * 4 + 2));
  }
  {
    std::unique_ptr<cu::Blas> blas;
    Check(cu::Blas::Create(&blas), "blas");
    for (auto [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{8192, 8192, 8192},
                           {32768, 6144, 2048}, {32768, 2048, 5632}, {4096, 32000, 2048}}) {
      Buf A(M * K, kBf16), B(K * N, kBf16), C(M * N, kBf16);
      cu::GemmArgs a;
      a.trans_b = true, a.M = M, a.N = N, a.K = K, a.A = A.p, a.lda = K, a.B = B.p, a.ldb = K;
      a.C = C.p, a.ldc = N;
      Row("gemm bf16 " + std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K),
          TimeMs([&] { Check(blas->Gemm(a, 0), "gemm"); }), 2.0 * (M * K + K * N + M * N),
          2.0 * M * N * K);
    }
  }
  return 0;
}
