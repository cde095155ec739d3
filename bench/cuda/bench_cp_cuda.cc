// Context-parallel scaling benchmark of the CUDA model (worker/engine/cuda/cuda_model.h): one
// training step of the 1b preset on one sequence of T tokens (default 262144, recompute on), first
// on one GPU (cp = 1, the whole sequence, no communicator), then for each cp = N of --cp that the
// visible GPUs allow, as N ranks that are threads of this process, rank r on GPU r with its own
// CudaModel and its own NCCL communicator (bootstrapped over an in-process MemoryKvStore), set as
// the model's CP group with --lightning_mode for Lightning and --mla_mode for MLA (all2all, the
// planner's default while cp <= n_heads, or allgather: Lightning's chunk states gathered and
// scanned; MLA's latent gathered, causal and cross pieces merged; or, for MLA, ring: the latent
// passed around the group). A step
// on every rank: ZeroGrads,
// ForwardBackward on the rank's zigzag share (ShardForCp), the all-reduce of the gradients over
// the group (the trainer's job, done here on device_grads() with the same NCCL communicator),
// GradSquaredNorm, OptimizerStep, stream sync. Steps start together (a host barrier) and a step's
// time is the longest rank's; the table gives the median of the timed steps after the warm-up.
// Grad scale is 1 / (valid targets of the whole sequence), so cp = N sums to cp = 1's gradient
// and the first step's loss of every row should agree (a cheap check that the ranks did the same
// training). The cp = 1 row has no all-reduce (it has no group).
//
// Failures. Each configuration's ranks share an abort flag; a rank that fails records its error
// and raises the flag, which wakes every rank waiting in the host barrier (they stop with
// "cancelled"). A rank inside an NCCL collective cannot be woken from outside (the Communicator
// interface has no abort), so it waits for the communicator's timeout (--timeout, seconds), after
// which the communicator aborts itself and the collective returns DeadlineExceeded. NCCL's own
// bootstrap (ncclCommInitRank) has no deadline and ncclCommDestroy may wait for peers, so the main
// thread is also a watchdog: once the flag is up it waits --timeout + 60 s for all ranks to end,
// then prints what it knows and exits with status 1 without unwinding (std::_Exit). Every error
// prints one line starting "bench_cp_cuda:" to stderr; the exit status is 1 when a run failed or
// no cp > 1 of --cp fits the visible GPUs, else 2 for bad flags or a cp the model refuses
// (n_heads or T not divisible by it; the other cp values still run).
//
// Usage: bench_cp_cuda [--preset 1b] [--T 262144] [--cp 2,4,8] [--recompute 1] [--single 1]
//                      [--warmup 2] [--steps 5] [--doc 0] [--timeout 120]
//                      [--lightning_mode all2all] [--mla_mode all2all|allgather|ring]
//                      [--comm_only MB,...]
//   --single 0: no cp = 1 row (for a sequence one GPU cannot hold; no scaling column then).
//   --doc D: a document end about every D tokens (0: the whole sequence is one document).
//   --comm_only MB,...: no model; the CP all-to-all alone on buffers of these sizes (RunCommOnly).
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "worker/engine/batch.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/comm/kv_stores.h"
#include "worker/engine/comm/nccl_communicator.h"
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/cuda/cuda_model.h"

namespace spindle {
namespace {

struct Options {
  std::string preset = "1b";
  int64_t T = 262144;
  std::vector<int> cps = {2, 4, 8};
  bool recompute = true;
  bool single = true;  // --single 0: no cp = 1 row (a sequence one GPU cannot hold)
  int warmup = 2;
  int steps = 5;
  int64_t doc = 0;
  int timeout_s = 120;
  uint64_t seed = 1;
  CpMode lightning = CpMode::kAll2All;
  CpMode mla = CpMode::kAll2All;
  std::vector<int> comm_only_mb;  // --comm_only: all-to-all buffer sizes (MB a rank), no model
};

double Gib(int64_t b) { return static_cast<double>(b) / (1 << 30); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Random tokens in [0, vocab - 1); with doc > 0 an end-of-document token (vocab - 1) about every
// doc tokens (uniform in [doc/2, 3doc/2]).
Batch MakeBatch(const ModelConfig& c, int64_t T, int64_t doc, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.vocab) - 2);
  std::vector<int32_t> t(T);
  if (doc > 0) {
    std::uniform_int_distribution<int64_t> len(std::max<int64_t>(1, doc / 2), doc + doc / 2);
    int64_t next_eos = len(gen);
    for (int64_t i = 0; i < T; ++i) {
      t[i] = tok(gen);
      if (i == next_eos) {
        t[i] = static_cast<int32_t>(c.vocab) - 1;
        next_eos += len(gen);
      }
    }
  } else {
    for (auto& x : t) x = tok(gen);
  }
  return MakeSequenceBatch(t, static_cast<int32_t>(c.vocab) - 1);
}

// A host barrier for the ranks of one run that a failing rank can break: Abort() wakes every
// waiter and makes every later Arrive() return false at once. Also counts finished ranks for the
// main thread's watchdog.
class RunControl {
 public:
  explicit RunControl(int n) : n_(n) {}

  bool Arrive() {
    std::unique_lock<std::mutex> lk(mu_);
    if (aborted_) return false;
    const int64_t gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return true;
    }
    cv_.wait(lk, [&] { return gen_ != gen || aborted_; });
    return !aborted_;
  }
  // The first caller's reason is the run's failure (later ones follow from it).
  void Abort(const std::string& why) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!aborted_) {
      abort_time_ = std::chrono::steady_clock::now();
      first_error_ = why;
    }
    aborted_ = true;
    cv_.notify_all();
  }
  std::string first_error() {
    std::lock_guard<std::mutex> lk(mu_);
    return first_error_;
  }
  void Finished() {
    std::lock_guard<std::mutex> lk(mu_);
    ++finished_;
    cv_.notify_all();
  }
  // Waits for all ranks to finish. Returns false when the run was aborted and some rank had not
  // finished `grace` after the abort.
  bool WaitAll(std::chrono::seconds grace) {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      if (finished_ == n_) return true;
      if (aborted_) {
        return cv_.wait_until(lk, abort_time_ + grace, [&] { return finished_ == n_; });
      }
      cv_.wait(lk, [&] { return finished_ == n_ || aborted_; });
    }
  }
  int finished() {
    std::lock_guard<std::mutex> lk(mu_);
    return finished_;
  }

 private:
  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0, finished_ = 0;
  int64_t gen_ = 0;
  bool aborted_ = false;
  std::chrono::steady_clock::time_point abort_time_;
  std::string first_error_;
};

struct RankResult {
  absl::Status status;
  std::vector<double> step_s;  // every step, warm-up included
  double first_loss_sum = 0.0;  // first step (before any update)
  double loss_sum = 0.0;        // last step
  int64_t n_valid = 0;
  DeviceMemory mem;
  double a2a_s = 0.0, grad_s = 0.0;  // communicator seconds over the timed steps
  int64_t a2a_bytes = 0, grad_bytes = 0;
};

struct RunResult {
  bool ok = false;
  std::string error;  // the first failing rank's status
  double step_s = 0.0;
  double first_loss = 0.0, loss = 0.0;
  int64_t peak_act = 0, fixed = 0, device_used = 0;  // max over ranks
  int64_t attention_ws = 0;                          // cuDNN's workspace, max over ranks
  int64_t reserved = 0;  // the allocator's reserve at the end (its cache), max over ranks
  double a2a_s = 0.0, grad_s = 0.0;                  // per timed step, max over ranks
  double a2a_gb = 0.0, grad_gb = 0.0;                // sent per rank per timed step
  std::vector<double> rank_a2a_s;                    // per timed step, each rank's
};

#define BENCH_RETURN_IF_ERROR(expr) \
  do {                              \
    absl::Status s_ = (expr);       \
    if (!s_.ok()) return s_;        \
  } while (0)

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

// One rank's whole run. comm stays null for cp = 1. The caller owns the communicator and the
// model, so that on an error it can raise the abort flag before tearing them down (destroying an
// NCCL communicator may wait for peers that are waiting in the host barrier).
absl::Status RankBody(int rank, int cp, const Options& opt, const ModelConfig& config,
                      const Batch& full, KvStore* store, RunControl& ctl, RankResult& res,
                      std::unique_ptr<Communicator>& comm, std::unique_ptr<CudaModel>& model) {
  BENCH_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(rank), "cudaSetDevice"));
  if (cp > 1) {
    auto c = CreateNcclCommunicator(*store, absl::StrCat("bench_cp/cp", cp), rank, cp, rank,
                                    absl::Seconds(opt.timeout_s));
    if (!c.ok()) return c.status();
    comm = std::move(*c);
  }
  auto model_or = CudaModel::Create(config, opt.seed, rank);
  if (!model_or.ok()) return model_or.status();
  model = std::move(*model_or);
  CudaModel& m = *model;
  CpBatch share;
  if (cp > 1) {
    BENCH_RETURN_IF_ERROR(m.SetCp({comm.get(), opt.lightning, opt.mla}));
    auto s = ShardForCp(full, cp, rank);
    if (!s.ok()) return s.status();
    share = std::move(*s);
  }
  const float scale = 1.0f / static_cast<float>(std::max<int64_t>(1, full.NumValidTargets()));
  const int64_t numel = m.host_params().numel();
  TrainSpec spec;
  spec.weight_decay = 0.1;
  m.ResetPeakMemory();
  const int total = opt.warmup + opt.steps;
  for (int step = 0; step < total; ++step) {
    if (!ctl.Arrive()) return absl::CancelledError("another rank failed");
    if (step == opt.warmup && comm) comm->TakeStats();  // drop the warm-up's (and setup's)
    const auto t0 = std::chrono::steady_clock::now();
    BENCH_RETURN_IF_ERROR(m.ZeroGrads());
    const Recompute rc = opt.recompute ? Recompute::All() : Recompute::None();
    auto ls = cp > 1 ? m.ForwardBackward(share, scale, rc) : m.ForwardBackward(full, scale, rc);
    if (!ls.ok()) return ls.status();
    if (comm) {
      // NCCL runs on its own stream: the gradients must be complete before it starts; Wait()
      // returns with the sums in place.
      BENCH_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(m.stream()), "cudaStreamSynchronize"));
      BENCH_RETURN_IF_ERROR(
          comm->AllReduceSum(m.device_grads(), numel, CommType::kF32, CommLayer::kGrad));
    }
    auto norm = m.GradSquaredNorm();
    if (!norm.ok()) return norm.status();
    BENCH_RETURN_IF_ERROR(m.OptimizerStep(spec, 1e-4, 1.0f));
    BENCH_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(m.stream()), "cudaStreamSynchronize"));
    if (res.step_s.empty()) res.first_loss_sum = ls->loss_sum;
    res.loss_sum = ls->loss_sum;
    res.n_valid = ls->n_valid;
    if (!ctl.Arrive()) return absl::CancelledError("another rank failed");
    res.step_s.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  res.mem = m.memory();
  if (comm) {
    for (const auto& [key, amount] : comm->TakeStats()) {
      if (key.second != CommLayer::kGrad) {  // CP: all-to-alls, or AllGather's state gathers
        res.a2a_s += amount.seconds;
        res.a2a_bytes += amount.bytes;
      } else if (key.first == Collective::kAllReduce && key.second == CommLayer::kGrad) {
        res.grad_s += amount.seconds;
        res.grad_bytes += amount.bytes;
      }
    }
  }
  return absl::OkStatus();
}

// Runs one configuration; cp = 1 runs one rank on GPU 0 without a communicator.
RunResult RunConfig(int cp, const Options& opt, const ModelConfig& config, const Batch& full) {
  MemoryKvStore store;
  RunControl ctl(cp);
  std::vector<RankResult> res(cp);
  std::vector<std::thread> threads;
  for (int r = 0; r < cp; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Communicator> comm;
      std::unique_ptr<CudaModel> model;
      absl::Status s = RankBody(r, cp, opt, config, full, &store, ctl, res[r], comm, model);
      if (!s.ok()) {
        res[r].status = absl::Status(s.code(), absl::StrCat("rank ", r, ": ", s.message()));
        ctl.Abort(res[r].status.ToString());
      }
      model.reset();  // uses the communicator: goes first
      comm.reset();
      ctl.Finished();  // the main thread reads res[r] only after every rank got here
    });
  }
  const int grace_s = opt.timeout_s + 60;
  if (!ctl.WaitAll(std::chrono::seconds(grace_s))) {
    // Some rank is stuck (NCCL bootstrap or teardown): report and leave without unwinding.
    // Only what RunControl holds is read here: the stuck ranks still own their results.
    const std::string first = ctl.first_error();
    std::fprintf(stderr,
                 "bench_cp_cuda: cp=%d failed (%s); %d of %d ranks had not stopped %d s after the "
                 "failure (stuck in NCCL), exiting\n",
                 cp, first.empty() ? "a rank failed" : first.c_str(), cp - ctl.finished(), cp,
                 grace_s);
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(1);
  }
  for (auto& t : threads) t.join();

  RunResult out;
  // The first rank to fail caused the others' errors (cancelled, timed out): report it.
  out.error = ctl.first_error();
  if (!out.error.empty()) return out;

  out.ok = true;
  const int total = opt.warmup + opt.steps;
  std::vector<double> timed;
  for (int s = opt.warmup; s < total; ++s) {
    double worst = 0.0;
    for (int r = 0; r < cp; ++r) worst = std::max(worst, res[r].step_s[s]);
    timed.push_back(worst);
  }
  out.step_s = Median(timed);
  double first_loss_sum = 0.0, loss_sum = 0.0;
  int64_t n_valid = 0;
  for (int r = 0; r < cp; ++r) {
    const RankResult& x = res[r];
    first_loss_sum += x.first_loss_sum;
    loss_sum += x.loss_sum;
    n_valid += x.n_valid;
    out.peak_act = std::max(out.peak_act, x.mem.peak_allocated);
    out.fixed = std::max(out.fixed, x.mem.fixed);
    out.device_used = std::max(out.device_used, x.mem.device_used);
    out.attention_ws = std::max(out.attention_ws, x.mem.attention_workspace);
    out.reserved = std::max(out.reserved, x.mem.reserved);
    out.a2a_s = std::max(out.a2a_s, x.a2a_s / opt.steps);
    out.rank_a2a_s.push_back(x.a2a_s / opt.steps);
    out.grad_s = std::max(out.grad_s, x.grad_s / opt.steps);
    out.a2a_gb = std::max(out.a2a_gb, x.a2a_bytes / 1e9 / opt.steps);
    out.grad_gb = std::max(out.grad_gb, x.grad_bytes / 1e9 / opt.steps);
  }
  out.first_loss = first_loss_sum / static_cast<double>(std::max<int64_t>(1, n_valid));
  out.loss = loss_sum / static_cast<double>(std::max<int64_t>(1, n_valid));
  return out;
}

// Free memory of the current device.
size_t DeviceFreeBytes() {
  size_t free_b = 0, total_b = 0;
  return cudaMemGetInfo(&free_b, &total_b) == cudaSuccess ? free_b : 0;
}

// --comm_only: the CP all-to-all alone, as the model's exchanges call it (CommType::kByte, one
// block per rank, the communicator's Wait), for each buffer size: 2 warm-up calls, then --steps
// calls between host barriers; per call the slowest rank's time. "GB/s out" is what each rank
// sends to the others ((cp - 1) blocks) over that time. Then the device memory NCCL holds a rank
// (cudaMemGetInfo, after the CUDA context): once the communicator is created, once every
// collective the trainer uses has run on it (all-to-all, all-gather, reduce-scatter, all-reduce),
// and what a second communicator over the same ranks adds after the same collectives (the
// trainer holds a second when both dp and cp exceed 1: the world's for the gradient sum and the CP
// group's).
int RunCommOnly(const Options& opt, int cp) {
  MemoryKvStore store;
  RunControl ctl(cp);
  const size_t max_bytes =
      static_cast<size_t>(*std::max_element(opt.comm_only_mb.begin(), opt.comm_only_mb.end()))
      << 20;
  std::vector<std::vector<double>> secs(cp);  // [rank][size]
  std::vector<std::array<double, 3>> nccl_gib(cp);  // [rank]: after init, collectives, second
  std::vector<std::thread> threads;
  for (int r = 0; r < cp; ++r) {
    threads.emplace_back([&, r] {
      auto body = [&]() -> absl::Status {
        BENCH_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(r), "cudaSetDevice"));
        BENCH_RETURN_IF_ERROR(CudaStatus(cudaFree(nullptr), "cudaFree"));  // the context
        constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
        const double free0 = static_cast<double>(DeviceFreeBytes());
        auto comm = CreateNcclCommunicator(store, absl::StrCat("bench_cp/comm", cp), r, cp, r,
                                           absl::Seconds(opt.timeout_s));
        if (!comm.ok()) return comm.status();
        nccl_gib[r][0] = (free0 - static_cast<double>(DeviceFreeBytes())) / kGiB;
        void *in = nullptr, *out = nullptr;
        BENCH_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&in, max_bytes), "cudaMalloc"));
        BENCH_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&out, max_bytes), "cudaMalloc"));
        const double buffers = 2.0 * static_cast<double>(max_bytes);
        // Every collective the trainer runs, once, on `c`; then NCCL's share of the device.
        auto every_collective = [&](Communicator& c) -> absl::Status {
          const int64_t n = static_cast<int64_t>(max_bytes / 4 / cp);
          BENCH_RETURN_IF_ERROR(c.AllToAll(in, n, CommType::kF32, out, CommLayer::kLightning));
          BENCH_RETURN_IF_ERROR(c.AllGather(in, n, CommType::kF32, out, CommLayer::kMla));
          BENCH_RETURN_IF_ERROR(c.ReduceScatterSum(static_cast<const float*>(in), n,
                                                   static_cast<float*>(out), CommLayer::kMla));
          return c.AllReduceSum(in, n * cp, CommType::kF32, CommLayer::kGrad);
        };
        auto nccl_held = [&] {
          return (free0 - buffers - static_cast<double>(DeviceFreeBytes())) / kGiB;
        };
        absl::Status st;
        for (int mb : opt.comm_only_mb) {
          const int64_t block = (static_cast<int64_t>(mb) << 20) / cp;
          auto call = [&] {
            return (*comm)->AllToAll(in, block, CommType::kByte, out, CommLayer::kLightning);
          };
          for (int i = 0; i < 2 && st.ok(); ++i) st = call();
          if (!st.ok() || !ctl.Arrive()) break;
          const auto t0 = std::chrono::steady_clock::now();
          for (int i = 0; i < opt.steps && st.ok(); ++i) st = call();
          if (!st.ok() || !ctl.Arrive()) break;
          secs[r].push_back(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
              opt.steps);
        }
        if (st.ok()) st = every_collective(**comm);
        if (st.ok()) {
          nccl_gib[r][1] = nccl_held();
          auto second = CreateNcclCommunicator(store, absl::StrCat("bench_cp/second", cp), r, cp, r,
                                               absl::Seconds(opt.timeout_s));
          st = second.ok() ? every_collective(**second) : second.status();
          nccl_gib[r][2] = nccl_held() - nccl_gib[r][1];
        }
        cudaFree(in);
        cudaFree(out);
        return st;
      };
      if (absl::Status s = body(); !s.ok()) ctl.Abort(absl::StrCat("rank ", r, ": ", s.ToString()));
      ctl.Finished();
    });
  }
  if (!ctl.WaitAll(std::chrono::seconds(opt.timeout_s + 60))) {
    std::fprintf(stderr, "bench_cp_cuda: cp=%d all-to-all failed (%s), ranks stuck in NCCL\n", cp,
                 ctl.first_error().c_str());
    std::_Exit(1);
  }
  for (auto& t : threads) t.join();
  if (!ctl.first_error().empty()) {
    std::fprintf(stderr, "bench_cp_cuda: cp=%d all-to-all failed: %s\n", cp,
                 ctl.first_error().c_str());
    return 1;
  }
  for (size_t i = 0; i < opt.comm_only_mb.size(); ++i) {
    double worst = 0.0;
    for (int r = 0; r < cp; ++r) worst = std::max(worst, secs[r][i]);
    const double out_gb =
        static_cast<double>(opt.comm_only_mb[i]) * (1 << 20) * (cp - 1) / cp / 1e9;
    std::printf("| %d | %d | %.3f | %.1f |\n", cp, opt.comm_only_mb[i], 1e3 * worst,
                out_gb / worst);
  }
  std::array<double, 3> most = {0.0, 0.0, 0.0};
  for (int r = 0; r < cp; ++r)
    for (int k = 0; k < 3; ++k) most[k] = std::max(most[k], nccl_gib[r][k]);
  std::printf(
      "\nNCCL device memory a rank (GiB, the most over ranks), cp = %d: %.2f once created, %.2f "
      "after all-to-all, all-gather, reduce-scatter and all-reduce; a second communicator "
      "adds %.2f\n",
      cp, most[0], most[1], most[2]);
  std::fflush(stdout);
  return 0;
}

int Run(const Options& opt) {
  auto config = ModelPreset(opt.preset);
  if (!config.ok()) {
    std::fprintf(stderr, "bench_cp_cuda: %s\n", config.status().ToString().c_str());
    return 2;
  }
  int gpus = 0;
  if (cudaError_t e = cudaGetDeviceCount(&gpus); e != cudaSuccess || gpus == 0) {
    std::fprintf(stderr, "bench_cp_cuda: no usable CUDA device (%s)\n",
                 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices visible");
    return 1;
  }
  // Which cp > 1 can run: one rank per GPU, n_heads % cp == 0 (All2All), T % (2 cp) == 0.
  std::vector<int> runnable;
  bool refused = false;
  for (int cp : opt.cps) {
    if (cp <= 1) continue;  // cp = 1 always runs first
    if (cp > gpus) {
      std::printf("# cp=%d skipped: needs %d GPUs (one rank per GPU), %d visible\n", cp, cp, gpus);
      continue;
    }
    spindle::ParallelSpec par;
    par.cp = cp;
    par.lightning_mode = opt.lightning;
    par.mla_mode = opt.mla;
    if (auto modes = PlannedCpModes(par, config->n_heads); !modes.ok()) {
      std::fprintf(stderr, "bench_cp_cuda: cp=%d refused: %s\n", cp,
                   std::string(modes.status().message()).c_str());
      refused = true;
      continue;
    }
    if (opt.T % (2 * cp) != 0) {
      std::fprintf(stderr, "bench_cp_cuda: cp=%d refused: T=%lld is not divisible by 2 cp = %d\n",
                   cp, static_cast<long long>(opt.T), 2 * cp);
      refused = true;
      continue;
    }
    if (std::find(runnable.begin(), runnable.end(), cp) == runnable.end()) runnable.push_back(cp);
  }
  if (runnable.empty()) {
    std::fprintf(stderr, "bench_cp_cuda: no cp > 1 of --cp can run on %d visible GPU%s\n", gpus,
                 gpus == 1 ? "" : "s");
    return refused ? 2 : 1;
  }

  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  if (!opt.comm_only_mb.empty()) {
    const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
    std::printf(
        "# %s x %d visible, the CP all-to-all alone, mean of %d calls after 2 warm-up, "
        "NCCL_NVLS_ENABLE=%s\n| cp | buffer MB a rank | ms a call | GB/s out a rank |\n"
        "|---|---|---|---|\n",
        prop.name, gpus, opt.steps, nvls ? nvls : "(unset)");
    int rc = 0;
    for (int cp : runnable) rc = std::max(rc, RunCommOnly(opt, cp));
    return rc;
  }
  const Batch full = MakeBatch(*config, opt.T, opt.doc, 7);
  const std::string docs =
      opt.doc > 0 ? absl::StrCat("documents of ~", opt.doc, " tokens") : "one document";
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  std::printf(
      "# %s x %d visible, preset %s (%.0fM parameters, %lld heads), T=%lld (%s), "
      "recompute %d, Lightning %s, MLA %s, median of %d steps after %d warm-up, "
      "NCCL_NVLS_ENABLE=%s\n",
      prop.name, gpus, opt.preset.c_str(), config->NumParams() / 1e6,
      static_cast<long long>(config->n_heads), static_cast<long long>(opt.T), docs.c_str(),
      opt.recompute ? 1 : 0, std::string(CpModeName(opt.lightning)).c_str(),
      std::string(CpModeName(opt.mla)).c_str(), opt.steps, opt.warmup, nvls ? nvls : "(unset)");
  std::printf(
      "| cp | GPUs | step s | tokens/s | tokens/s per GPU | scaling eff | "
      "peak act GiB/rank | reserved GiB/rank | fixed GiB/rank | attention ws GiB/rank | "
      "device used GiB/rank | "
      "CP comm s/step | grad all-reduce s/step | CP comm GB/step/rank | loss (first / last "
      "step) |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);

  bool failed = false;
  double t1 = 0.0;
  std::vector<int> order;
  if (opt.single) order.push_back(1);
  order.insert(order.end(), runnable.begin(), runnable.end());
  std::string by_rank;  // printed after the table
  for (int cp : order) {
    const RunResult r = RunConfig(cp, opt, *config, full);
    if (!r.ok) {
      std::printf("| %d | %d | failed | | | | | | | | | | | | |\n", cp, cp);
      std::fflush(stdout);
      std::fprintf(stderr, "bench_cp_cuda: cp=%d failed: %s\n", cp, r.error.c_str());
      failed = true;
      continue;
    }
    if (cp == 1) t1 = r.step_s;
    const double tps = static_cast<double>(opt.T) / r.step_s;
    const std::string eff =
        t1 > 0.0 ? absl::StrCat(static_cast<int>(100.0 * t1 / (cp * r.step_s) + 0.5), "%") : "-";
    auto comm_col = [&](double x) {
      if (cp == 1) return std::string("-");
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.3f", x);
      return std::string(buf);
    };
    const std::string a2a = comm_col(r.a2a_s), grad = comm_col(r.grad_s),
                      a2a_gb = comm_col(r.a2a_gb);
    std::printf(
        "| %d | %d | %.3f | %.0f | %.0f | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %s | %s | %s | "
        "%.4f / %.4f |\n",
        cp, cp, r.step_s, tps, tps / cp, eff.c_str(), Gib(r.peak_act), Gib(r.reserved),
        Gib(r.fixed), Gib(r.attention_ws), Gib(r.device_used), a2a.c_str(), grad.c_str(),
        a2a_gb.c_str(), r.first_loss, r.loss);
    if (cp > 1) {
      // Each rank's CP communicator seconds: a rank that waits for a slower peer shows more.
      absl::StrAppend(&by_rank, "\nCP comm s/step by rank, cp = ", cp, ":");
      for (size_t k = 0; k < r.rank_a2a_s.size(); ++k)
        absl::StrAppend(&by_rank, k ? ", " : " ", absl::StrFormat("%.3f", r.rank_a2a_s[k]));
    }
    std::fflush(stdout);
  }
  std::printf("%s\n", by_rank.c_str());
  std::printf(
      "\nStep time: the slowest rank's, from a common host barrier to the stream sync after "
      "AdamW; tokens/s counts the whole sequence (T) per step. Scaling eff = t_1 / (cp * t_cp). "
      "cp > 1 steps include the gradient all-reduce over the group (NCCL, fp32, on "
      "device_grads()); cp = 1 has none. Communicator seconds are the collectives' time on the "
      "communicator thread (waiting for slower peers included), max over ranks; CP comm is the "
      "layers' collectives (all-to-alls, and Lightning AllGather's state gathers). Memory: "
      "CudaModel::memory() at the end, max over ranks (the attention workspace is cuDNN's, outside "
      "the allocator; device used counts it and NCCL's buffers too). "
      "The first step's loss (before any update) should agree across rows to bf16 rounding (same "
      "data, seed and summed gradients); the last may drift further, since AdamW's first steps "
      "magnify small gradient differences.\n");
  return failed ? 1 : refused ? 2 : 0;
}

bool ParseInts(const std::string& v, std::vector<int>* out) {
  out->clear();
  std::stringstream ss(v);
  for (std::string x; std::getline(ss, x, ',');) {
    char* end = nullptr;
    const long n = std::strtol(x.c_str(), &end, 10);
    if (x.empty() || *end != '\0' || n < 1 || n > 1024) return false;
    out->push_back(static_cast<int>(n));
  }
  return !out->empty();
}

bool ParseInt64(const std::string& v, int64_t lo, int64_t* out) {
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < lo) return false;
  *out = n;
  return true;
}

}  // namespace
}  // namespace spindle

int main(int argc, char** argv) {
  spindle::Options opt;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_cp_cuda: flag %s needs a value\n", k.c_str());
      return 2;
    }
    const std::string v = argv[i + 1];
    int64_t n = 0;
    bool ok = true;
    if (k == "--preset") {
      opt.preset = v;
    } else if (k == "--T") {
      ok = spindle::ParseInt64(v, 2, &n);
      opt.T = n;
    } else if (k == "--cp") {
      ok = spindle::ParseInts(v, &opt.cps);
    } else if (k == "--recompute") {
      ok = v == "0" || v == "1";
      opt.recompute = v == "1";
    } else if (k == "--single") {
      ok = v == "0" || v == "1";
      opt.single = v == "1";
    } else if (k == "--warmup") {
      ok = spindle::ParseInt64(v, 0, &n) && n <= 1000;
      opt.warmup = static_cast<int>(n);
    } else if (k == "--steps") {
      ok = spindle::ParseInt64(v, 1, &n) && n <= 1000;
      opt.steps = static_cast<int>(n);
    } else if (k == "--doc") {
      ok = spindle::ParseInt64(v, 0, &n);
      opt.doc = n;
    } else if (k == "--timeout") {
      ok = spindle::ParseInt64(v, 1, &n) && n <= 86400;
      opt.timeout_s = static_cast<int>(n);
    } else if (k == "--lightning_mode") {
      ok = v == "all2all" || v == "allgather";
      opt.lightning = v == "allgather" ? spindle::CpMode::kAllGather : spindle::CpMode::kAll2All;
    } else if (k == "--comm_only") {
      ok = spindle::ParseInts(v, &opt.comm_only_mb);
    } else if (k == "--mla_mode") {
      ok = v == "all2all" || v == "allgather" || v == "ring";
      opt.mla = v == "allgather" ? spindle::CpMode::kAllGather
                : v == "ring"    ? spindle::CpMode::kRing
                                 : spindle::CpMode::kAll2All;
    } else {
      std::fprintf(stderr, "bench_cp_cuda: unknown flag %s\n", k.c_str());
      return 2;
    }
    if (!ok) {
      std::fprintf(stderr, "bench_cp_cuda: bad value for %s: %s\n", k.c_str(), v.c_str());
      return 2;
    }
  }
  // NVLink multicast (NVLS) stays off unless the caller asked for it (the device machines'
  // notes: the two-GPU NCCL test ran with NCCL_NVLS_ENABLE=0).
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  return spindle::Run(opt);
}
