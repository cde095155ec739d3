// Training-step benchmark of the CUDA model (worker/engine/cuda/cuda_model.h): one sequence of T
// random tokens per step (zero gradients, forward + backward, gradient norm, AdamW), the median of
// the timed steps after warm-up, printed as a table row per (preset, T, recompute) with tokens/s,
// model TFLOP/s (ModelConfig::TrainFlopsPerToken) and memory. Run it beside the peer
// (bench/cuda/model_vs_peer.sh). The last timed step of each row runs between cudaProfilerStart and
// cudaProfilerStop, so `ncu --profile-from-start off` records exactly the kernels of those steps.
// --head_start_ms N: each step's work queues behind a host callback that holds the stream for
// N ms, so the host has enqueued (most of) the step before the GPU starts; the row's step time is
// then wall time - N, the GPU's own time without launch gaps (a diagnostic: if it is well below
// the plain step time, the host, not the GPU, paces the step). "host enqueue ms": how long
// ForwardBackward took to queue its work (CudaModel::last_enqueue_seconds), median step.
// "loss": the last step's, on the one batch every step trains on (a 1B model memorises it within
// a few steps); "held-out loss": a forward pass over fresh random tokens after those steps, which
// stays near ln(vocab) or above (nothing to predict), so a low training loss is memorisation, not a
// look at later tokens.
//
// --head_rows N: rows per LM-head block (CudaModel::SetHeadBlockRows; 0, the default, is the
// model's automatic choice).
// --recompute: 0 (none), 1 (every layer), both (a row each), or a comma list of how many leading
// layers recompute (e.g. 16,12,8: one row each; the "recompute" column prints the count), where
// "all" is every layer and "auto" the planner's choice for this GPU (train.recompute "auto":
// CpPlanner against the device's memory, with its estimate printed above the row).
// --offload 0 (default), 1 or both (a row each): the layers' inputs wait in pinned host memory
// between the forward and the backward (CudaModel::SetOffloadInputs); "host GiB" is that memory.
// --mla_grad_heads N: MLA's backward in groups of N heads (CudaModel::SetMlaGradHeadsPerGroup; 0,
// the default, is the model's rule; n_heads: one group).
// --precision bf16 (default) or fp8 (CudaModel::SetPrecision); --fp8_fast_forward 0: the FP8
// forward GEMMs accumulate accurately too (CudaModel::SetFp8FastForward); --fp8_recipe
// tensorwise (default) or blockwise (train.fp8_recipe; also spelled --fp8-recipe): blockwise
// scaling, whose GEMMs never fast-accumulate (the header line says which ran).
// --expert_gemm streams (default), loop or persistent: how the MoE experts' grouped GEMMs run
// (CudaModel::SetExpertGemm; persistent: our own sm_90 kernel in bf16).
// --forward 0: skip the forward-only timing and the held-out loss (their columns print -1), which
// at the longest sequences take as long as half a step.
//
// Usage: bench_model_cuda [--preset 1b] [--T 8192,32768] [--recompute 0|1|both|N,all,auto,...]
//                         [--offload 0|1|both] [--steps 6] [--head_start_ms 0] [--head_rows 0]
//                         [--mla_grad_heads 0] [--forward 1] [--precision bf16|fp8]
//                         [--fp8_fast_forward 1] [--fp8_recipe tensorwise|blockwise]
//                         [--expert_gemm streams|loop|persistent]
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "planner/cp_planner.h"
#include "worker/engine/batch.h"
#include "worker/engine/cuda/cuda_model.h"

namespace spindle {
namespace {

double Gib(int64_t b) { return static_cast<double>(b) / (1 << 30); }

void CUDART_CB HoldStream(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(ms)));
}

// `recs`: layers recomputed per row (-1: every layer, kAuto: the planner's choice).
constexpr int64_t kAuto = -2;
int Run(const std::string& preset, const std::vector<int64_t>& Ts, const std::vector<int64_t>& recs,
        const std::vector<bool>& offloads, int steps, int head_start_ms, int64_t head_rows,
        int64_t mla_grad_heads, bool forward, TrainPrecision precision, bool fast_forward,
        TrainFp8Recipe recipe, const std::string& expert_gemm) {
  auto config = ModelPreset(preset);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 2;
  }
  auto model_or = CudaModel::Create(*config, 1);
  if (!model_or.ok()) {
    std::fprintf(stderr, "bench_model_cuda: %s\n", model_or.status().ToString().c_str());
    return 1;
  }
  CudaModel& m = **model_or;
  absl::Status set = m.SetHeadBlockRows(head_rows);
  if (set.ok()) set = m.SetMlaGradHeadsPerGroup(mla_grad_heads);
  if (set.ok()) set = m.SetPrecision(precision, recipe);
  if (set.ok()) set = m.SetExpertGemm(expert_gemm);
  m.SetFp8FastForward(fast_forward);
  if (!set.ok()) {
    std::fprintf(stderr, "bench_model_cuda: %s\n", set.ToString().c_str());
    return 2;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf(
      "# %s, preset %s (%.0fM parameters), precision %s (bf16 activations%s), fp32 "
      "master + AdamW%s\n",
      prop.name, preset.c_str(), config->NumParams() / 1e6,
      std::string(TrainPrecisionName(precision)).c_str(),
      precision != TrainPrecision::kFp8             ? ""
      : recipe == TrainFp8Recipe::kBlockwise         ? ", FP8 linears, blockwise scaling"
      : fast_forward ? ", FP8 linears, tensorwise, fast-accumulating forward"
                     : ", FP8 linears, tensorwise, accurate accumulation",
      config->moe.experts > 0 ? (", expert GEMMs " + expert_gemm).c_str() : "");
  std::printf(
      "| T | recompute | offload | step ms | host enqueue ms | forward-only ms | optimizer ms | "
      "tokens/s | TFLOP/s | peak act GiB | fixed GiB | device used GiB | host GiB | loss | "
      "held-out loss |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  TrainSpec spec;
  spec.weight_decay = 0.1;
  auto random_batch = [&](int64_t T, uint32_t seed) {
    std::mt19937 gen(seed);
    std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(config->vocab) - 2);
    std::vector<int32_t> tokens(T);
    for (auto& t : tokens) t = tok(gen);
    return MakeSequenceBatch(tokens, static_cast<int32_t>(config->vocab) - 1);
  };
  for (int64_t T : Ts) {
    const Batch b = random_batch(T, 7), held_out = random_batch(T, 8);
    for (const int64_t asked : recs)
      for (const bool offload : offloads) {
        // "auto" is planned for each row's own offload setting.
        int64_t rec = asked;
        if (rec == kAuto) {
          JobSpec job;
          job.model = *config;
          job.seq_len = T;
          job.resources = "cuda";
          job.train.recompute_layers = TrainSpec::kRecomputeAuto;
          job.train.offload = offload;
          job.train.precision = precision;
          if (precision == TrainPrecision::kFp8) job.train.fp8_recipe = recipe;
          const CpPlan plan = CpPlanner().Plan(job, static_cast<int64_t>(prop.totalGlobalMem));
          rec = plan.memory.recompute_layers;
          std::printf("# T %lld, recompute auto: %lld layers, estimate %s of %s\n",
                      static_cast<long long>(T), static_cast<long long>(rec),
                      FormatBytes(plan.memory.total_bytes).c_str(),
                      FormatBytes(static_cast<int64_t>(prop.totalGlobalMem)).c_str());
        }
        if (rec < 0 || rec > config->n_layers) rec = config->n_layers;
        const Recompute rc = Recompute::First(rec);
        // Each row starts from an empty allocator: its peak is its own step's, not shaped by the
        // blocks earlier rows left cached (the 2x reuse rule of kernels/cuda/allocator.h).
        absl::Status reset = m.ReleaseActivationMemory();
        if (reset.ok()) reset = m.SetOffloadInputs(offload);
        if (absl::Status st = reset; !st.ok()) {
          std::fprintf(stderr, "bench_model_cuda: %s\n", st.ToString().c_str());
          return 1;
        }
        m.ResetPeakMemory();
        std::vector<double> times, enqueue;
        double loss = 0;
        for (int s = 0; s < steps; ++s) {
          const bool profiled = s == steps - 1;
          if (profiled) cudaProfilerStart();
          const auto t0 = std::chrono::steady_clock::now();
          if (head_start_ms > 0) cudaLaunchHostFunc(m.stream(), HoldStream, &head_start_ms);
          absl::Status st = m.ZeroGrads();
          auto ls = m.ForwardBackward(b, 1.0f / static_cast<float>(b.NumValidTargets()), rc);
          if (!ls.ok()) st = ls.status();
          if (st.ok()) {
            auto norm = m.GradSquaredNorm();
            st = norm.ok() ? m.OptimizerStep(spec, 1e-4, 1.0f) : norm.status();
          }
          if (st.ok() && cudaStreamSynchronize(m.stream()) != cudaSuccess)
            st = absl::InternalError("stream sync failed");
          if (profiled) cudaProfilerStop();
          if (!st.ok()) {
            std::printf("| %lld | %lld | %d | failed: %s |\n", static_cast<long long>(T),
                        static_cast<long long>(rec), offload ? 1 : 0, st.ToString().c_str());
            std::fflush(stdout);
            break;
          }
          times.push_back(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() -
              head_start_ms * 1e-3);
          enqueue.push_back(m.last_enqueue_seconds());
          loss = ls->loss_sum / std::max<int64_t>(1, ls->n_valid);
        }
        if (static_cast<int>(times.size()) < steps) continue;
        std::vector<double> timed(times.begin() + std::min(2, steps - 1), times.end());
        std::sort(timed.begin(), timed.end());
        const double t = timed[timed.size() / 2];
        std::vector<double> queued(enqueue.begin() + std::min(2, steps - 1), enqueue.end());
        std::sort(queued.begin(), queued.end());
        const double q = queued[queued.size() / 2];
        const DeviceMemory mem = m.memory();
        // Where the time goes: a forward-only pass and the optimizer step, timed alone.
        auto timed_ms = [&](auto&& fn) {
          cudaStreamSynchronize(m.stream());
          const auto t0 = std::chrono::steady_clock::now();
          const bool ok = fn();
          cudaStreamSynchronize(m.stream());
          return ok ? std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                                t0)
                          .count()
                    : -1.0;
        };
        double fwd_ms = -1.0, ho_loss = -1.0;
        if (forward) {
          fwd_ms = timed_ms([&] { return m.Forward(b).ok(); });
          auto ho = m.Forward(held_out);
          if (ho.ok()) ho_loss = ho->loss_sum / std::max<int64_t>(1, ho->n_valid);
        }
        const double opt_ms = timed_ms(
            [&] { return m.GradSquaredNorm().ok() && m.OptimizerStep(spec, 1e-4, 1.0f).ok(); });
        std::printf(
            "| %lld | %lld | %d | %.1f | %.1f | %.1f | %.1f | %.0f | %.0f | %.2f | %.2f | %.2f | "
            "%.2f | %.3f | %.3f |\n",
            static_cast<long long>(T), static_cast<long long>(rec), offload ? 1 : 0, t * 1e3,
            q * 1e3, fwd_ms, opt_ms, T / t, config->TrainFlopsPerToken(T) * T / t / 1e12,
            Gib(mem.peak_allocated), Gib(mem.fixed), Gib(mem.device_used), Gib(mem.offload_host),
            loss, ho_loss);
        std::fflush(stdout);
      }
  }
  return 0;
}

}  // namespace
}  // namespace spindle

int main(int argc, char** argv) {
  std::string preset = "1b", rec = "0", offload = "0", expert_gemm = "streams";
  std::vector<int64_t> Ts = {8192, 32768};
  int steps = 6, head_start_ms = 0;
  int64_t head_rows = 0, mla_grad_heads = 0;
  bool forward = true, fast_forward = true;
  spindle::TrainPrecision precision = spindle::TrainPrecision::kBf16;
  spindle::TrainFp8Recipe recipe = spindle::TrainFp8Recipe::kTensorwise;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--preset") {
      preset = v;
    } else if (k == "--T") {
      Ts.clear();
      std::stringstream ss(v);
      for (std::string x; std::getline(ss, x, ',');) Ts.push_back(std::atoll(x.c_str()));
    } else if (k == "--recompute") {
      rec = v;
    } else if (k == "--offload") {
      offload = v;
    } else if (k == "--steps") {
      steps = std::max(1, std::atoi(v.c_str()));
    } else if (k == "--head_start_ms") {
      head_start_ms = std::max(0, std::atoi(v.c_str()));
    } else if (k == "--head_rows") {
      head_rows = std::atoll(v.c_str());
    } else if (k == "--mla_grad_heads") {
      mla_grad_heads = std::atoll(v.c_str());
    } else if (k == "--forward") {
      forward = v != "0";
    } else if (k == "--expert_gemm") {
      expert_gemm = v;
    } else if (k == "--fp8_fast_forward") {
      fast_forward = v != "0";
    } else if (k == "--fp8_recipe" || k == "--fp8-recipe") {
      if (v != "tensorwise" && v != "blockwise") {
        std::fprintf(stderr,
                     "bench_model_cuda: --fp8_recipe takes tensorwise or blockwise, got %s\n",
                     v.c_str());
        return 2;
      }
      recipe = v == "blockwise" ? spindle::TrainFp8Recipe::kBlockwise
                                : spindle::TrainFp8Recipe::kTensorwise;
    } else if (k == "--precision") {
      if (v != "bf16" && v != "fp8") {
        std::fprintf(stderr, "bench_model_cuda: --precision takes bf16 or fp8, got %s\n",
                     v.c_str());
        return 2;
      }
      precision = v == "fp8" ? spindle::TrainPrecision::kFp8 : spindle::TrainPrecision::kBf16;
    } else {
      std::fprintf(stderr, "bench_model_cuda: unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  std::vector<int64_t> recs;
  if (rec == "both") {
    recs = {0, -1};
  } else if (rec == "1") {
    recs = {-1};
  } else {
    std::stringstream ss(rec);
    for (std::string x; std::getline(ss, x, ',');)
      recs.push_back(x == "auto" ? spindle::kAuto : x == "all" ? -1 : std::atoll(x.c_str()));
  }
  std::vector<bool> offloads;
  if (offload == "both") {
    offloads = {false, true};
  } else if (offload == "0" || offload == "1") {
    offloads = {offload == "1"};
  } else {
    std::fprintf(stderr, "bench_model_cuda: --offload takes 0, 1 or both, got %s\n",
                 offload.c_str());
    return 2;
  }
  return spindle::Run(preset, Ts, recs, offloads, steps, head_start_ms, head_rows, mla_grad_heads,
                      forward, precision, fast_forward, recipe, expert_gemm);
}
