// spindle-train: runs one rank of a training job, or evaluates a checkpoint.
//
//   spindle-train --job JOB.json [--rank R --world W] [--checkpoint-dir DIR]
//                 [--lightning-mode allgather|all2all|hybrid]
//                 [--mla-mode allgather|all2all|ring|hybrid]
//                 [--rendezvous HOST:PORT --job-id ID --attempt N --token-file F]
//                 [--resume-step S]
//                 [--file-store DIR] [--gloo-host H] [--threads N] [--stop-at-step K]
//                 [--recompute-layers N] [--pulse-ms N]
//   spindle-train --eval --job JOB.json --checkpoint DIR [--data SOURCE] [--eval-sequences N]
//   spindle-train --probe-rates [--job JOB.json] [--threads N]
//   spindle-train --verify-only --job JOB.json [--threads N]
//
// Prints one JSON object per line on stdout ({"event": "start" | "step" | "checkpoint" | "done" |
// "eval", ...}) and one line "spindle-train: <error>" on stderr when it fails. Exit codes:
// 0 success, 2 invalid input (job spec, data, checkpoint, flags, a CP plan that cannot run),
// 3 out of device memory, 1 other runtime failure.
//
// Multi-rank runs (world = dp x cp of the job > 1): the ranks rendezvous through the
// coordinator's rendezvous service (--rendezvous, under the worker daemon) or, standalone, through
// a directory every rank of one run shares (--file-store DIR; use a fresh one per run).
// The job runs as planned once (planner/cp_planner.h, PlannedSpec): under the worker daemon the
// coordinator's plan arrives as the spec (its modes, ulysses) and --lightning-mode / --mla-mode /
// --recompute-layers; standalone, whatever the spec and those flags leave open ("auto" and
// "fastest" modes, "auto" recompute) is planned here, against this machine's device (the GPU's
// memory, or host memory shared by the world's ranks) with the cost model's built-in rates. A
// plan that cannot run (a forced all2all with n_heads % cp != 0, ...) is refused before any rank
// connects. Gloo listens on --gloo-host (default $SPINDLE_GLOO_HOST, else 127.0.0.1).
// --attempt N (under the worker daemon): the job's attempt; rank 0 fences the checkpoint directory
// for it before resuming and every rank checks the fence (checkpoint.h), so an older attempt
// still running somewhere can no longer commit, and a directory the ranks do not share is named at
// the start. Rank 0 picks the newest checkpoint that loads (passing over a corrupt one, with a
// {"event": "note"} line naming both) and every rank resumes from it. --resume-step S (under the
// worker daemon: the last checkpoint the coordinator recorded every rank completing) bounds that
// choice from below: a checkpoint older than S is never resumed from, and when none at or after S
// loads the run fails (exit code 2) naming S, rather than redo the job's recorded progress.
// --pulse-ms N: a {"event": "pulse"} line every N ms, so that the worker can tell a stopped rank.
// --probe-rates: one {"event": "rates", ...} line with this process's CPU kernel rates
// (worker/engine/rate_probe.h) for the planner's cost model, at the job's shapes (its model, one
// rank's tokens up to 4096) when --job is given, else at the probe's default shapes.
// --verify-only: the parity canary of the job's plan (parallel.verify, worker/engine/
// parity_local.h) without a cluster: the spec planned as standalone runs plan it, the job's world
// as threads of this process on the CPU engine, one forward and backward of a slice of its first
// sequence at the planned layout against cp = 1, ep = 1; prints the {"event": "parity"} line and
// exits 0 when the layout passes (or has nothing to verify), 2 when it does not.
//
// Jobs with "resources": "cuda" train on the first visible GPU (the worker daemon sets
// CUDA_VISIBLE_DEVICES per rank) when this binary is built with the CUDA engine; otherwise, and
// for model shapes the CUDA kernels do not take (CudaShapeProblem in common/model_config.h), they
// fail at start with exit code 2, and with exit code 1 where no GPU is usable. --eval of such a
// job runs on the GPU too when built with it, else on the CPU (checkpoints are shared).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/exit_codes.h"
#include "common/job_spec.h"
#include "planner/cp_planner.h"
#include "worker/device_discovery.h"
#include "worker/engine/comm/kv_stores.h"
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/parity_local.h"
#include "worker/engine/rate_probe.h"
#include "worker/engine/trainer.h"
#include "worker/rendezvous_store.h"
#ifdef SPINDLE_HAVE_CUDA_ENGINE
#include "worker/engine/cuda/trainer_cuda.h"
#endif

namespace {

constexpr char kUsage[] =
    "usage: spindle-train --job JOB.json [--rank R --world W] [--checkpoint-dir DIR]\n"
    "                     [--lightning-mode M --mla-mode M] [--rendezvous HOST:PORT --job-id ID\n"
    "                     --attempt N --token-file F [--resume-step S]] [--file-store DIR]\n"
    "                     [--gloo-host H] [--threads N] [--stop-at-step K] [--recompute-layers N]\n"
    "                     [--pulse-ms N]\n"
    "       spindle-train --eval --job JOB.json --checkpoint DIR [--data SOURCE]\n"
    "                     [--eval-sequences N]\n"
    "       spindle-train --probe-rates [--job JOB.json] [--threads N]\n"
    "       spindle-train --verify-only --job JOB.json [--threads N]\n";

// A spec run standalone that leaves something open ("auto" or "fastest" modes, "auto"
// recompute) is planned here, once, as the coordinator plans the jobs it runs: against this
// machine's device (the GPU's memory, or host memory shared by the world's ranks) when recompute
// is "auto", with the cost model's built-in rates. A plan that cannot run is refused.
absl::StatusOr<spindle::JobSpec> PlanStandalone(const spindle::JobSpec& spec, int64_t world) {
  int64_t memory = 0;
  if (spec.train.recompute_layers == spindle::TrainSpec::kRecomputeAuto) {
    if (spec.resources == "cuda") {
      if (auto g = spindle::DiscoverCudaDevices(); g.ok()) memory = g->memory_bytes();
    } else if (auto g =
                   spindle::DiscoverDevices(static_cast<int>(std::max<int64_t>(1, world)));
               g.ok()) {
      memory = g->memory_bytes();
    }
  }
  const spindle::CpPlan plan = spindle::CpPlanner().Plan(spec, memory);
  if (!plan.ok())
    return absl::FailedPreconditionError(
        absl::StrCat("the job cannot run: ", absl::StrJoin(plan.problems, "; ")));
  return spindle::PlannedSpec(spec, plan);
}

int ExitCodeFor(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kOutOfRange:
      return spindle::kExitInvalidInput;
    case absl::StatusCode::kResourceExhausted:  // the device's memory
      return spindle::kExitOutOfMemory;
    default:
      return spindle::kExitRuntimeFailure;
  }
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "spindle-train: %s\n", std::string(s.message()).c_str());
  return ExitCodeFor(s);
}

// The GPU model factory of this build (null without the CUDA engine).
#ifdef SPINDLE_HAVE_CUDA_ENGINE
constexpr spindle::StepBackendFactory kCudaBackend = spindle::CreateCudaStepBackend;
#else
constexpr spindle::StepBackendFactory kCudaBackend = nullptr;
#endif

// One write per event line: libraries that print to stdout from their own threads (NCCL's
// warnings) can then only land between lines, never inside one.
void PrintEvent(const nlohmann::json& e) {
  std::string line = e.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  line.push_back('\n');
  std::fwrite(line.data(), 1, line.size(), stdout);  // one call: lines never interleave
  std::fflush(stdout);
}

// --pulse-ms N: a {"event": "pulse"} line every N ms from a thread of its own, from the start
// (rendezvous and resume included) to the end, so the worker can tell a rank that stopped (a
// frozen process, a host that hangs) from one in a long step or a collective.
class Pulse {
 public:
  explicit Pulse(int64_t every_ms) {
    if (every_ms <= 0) return;
    thread_ = std::thread([this, every_ms] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!cv_.wait_for(lock, std::chrono::milliseconds(every_ms), [this] { return stop_; }))
        PrintEvent({{"event", "pulse"}, {"pulse_ms", every_ms}});
    });
  }
  ~Pulse() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  bool eval = false, probe = false, verify_only = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (a == "--eval") {
      eval = true;
      continue;
    }
    if (a == "--probe-rates") {
      probe = true;
      continue;
    }
    if (a == "--verify-only") {
      verify_only = true;
      continue;
    }
    static const char* kValued[] = {"--job",
                                    "--rank",
                                    "--world",
                                    "--checkpoint-dir",
                                    "--lightning-mode",
                                    "--mla-mode",
                                    "--rendezvous",
                                    "--job-id",
                                    "--attempt",
                                    "--resume-step",
                                    "--token-file",
                                    "--threads",
                                    "--stop-at-step",
                                    "--checkpoint",
                                    "--data",
                                    "--eval-sequences",
                                    "--file-store",
                                    "--gloo-host",
                                    "--recompute-layers",
                                    "--pulse-ms"};
    bool known = false;
    for (const char* k : kValued) known |= a == k;
    if (!known || i + 1 >= argc) {
      std::fprintf(stderr, "spindle-train: %s\n%s",
                   known ? absl::StrCat("flag ", a, " needs a value").c_str()
                         : absl::StrCat("unknown flag ", a).c_str(),
                   kUsage);
      return 2;
    }
    flags[a.substr(2)] = argv[++i];
  }
  // An integer flag given as at least `min`; `def` when absent.
  auto int_flag = [&](const std::string& name, int64_t def, int64_t min, int64_t* out) -> bool {
    *out = def;
    auto it = flags.find(name);
    if (it == flags.end()) return true;
    if (!absl::SimpleAtoi(it->second, out)) {
      std::fprintf(stderr, "spindle-train: --%s must be an integer, got \"%s\"\n", name.c_str(),
                   it->second.c_str());
      return false;
    }
    if (*out < min) {
      std::fprintf(stderr, "spindle-train: --%s must be >= %lld, got %lld\n", name.c_str(),
                   static_cast<long long>(min), static_cast<long long>(*out));
      return false;
    }
    return true;
  };
  if (probe) {
    int64_t threads = 0;
    if (!int_flag("threads", 0, 0, &threads)) return 2;
    if (threads > 0) omp_set_num_threads(static_cast<int>(threads));
    spindle::ProbeShape shape;
    if (flags.count("job")) {
      auto spec = spindle::LoadJobSpec(flags["job"]);
      if (!spec.ok()) return Fail(spec.status());
      const spindle::ModelConfig& m = spec->model;
      shape = {std::min<int64_t>(4096, spec->seq_len / spec->parallel.cp), m.d_model, m.ffn_dim,
               m.n_heads, m.mla.qk_nope_dim + m.mla.qk_rope_dim, m.mla.v_head_dim};
    }
    nlohmann::json e = spindle::MeasureCpuRates(shape).ToJson();
    e["event"] = "rates";
    e["device"] = "cpu";
    e["threads"] = omp_get_max_threads();
    std::cout << e.dump() << std::endl;
    return 0;
  }
  if (!flags.count("job")) {
    std::fprintf(stderr, "spindle-train: --job is required\n%s", kUsage);
    return 2;
  }
  int64_t pulse_ms = 0;
  if (!int_flag("pulse-ms", 0, 0, &pulse_ms)) return 2;
  Pulse pulse(pulse_ms);
  int64_t threads = 0, rank = 0, world = 1, stop_at = -1, eval_sequences = 4;
  int64_t recompute_layers = spindle::TrainSpec::kRecomputeAuto;
  if (!int_flag("threads", 0, 0, &threads) || !int_flag("rank", 0, 0, &rank) ||
      !int_flag("world", 1, 1, &world) || !int_flag("stop-at-step", -1, 1, &stop_at) ||
      !int_flag("eval-sequences", 4, 1, &eval_sequences) ||
      !int_flag("recompute-layers", spindle::TrainSpec::kRecomputeAuto, 0, &recompute_layers))
    return 2;
  if (threads > 0) omp_set_num_threads(static_cast<int>(threads));

  auto spec = spindle::LoadJobSpec(flags["job"]);
  if (!spec.ok()) return Fail(spec.status());
  // --verify-only plans for the job's whole world, which runs in this process.
  if (verify_only) world = spec->parallel.world();
  if (eval) {
    if (!flags.count("checkpoint")) {
      std::fprintf(stderr, "spindle-train: --eval needs --checkpoint DIR\n");
      return 2;
    }
    spindle::DataSpec data = spec->data;
    if (flags.count("data")) {
      nlohmann::json j = spec->ToJson();
      j["data"]["source"] = flags["data"];
      auto with_data = spindle::ParseJobSpecJson(j);
      if (!with_data.ok()) return Fail(with_data.status());
      data = with_data->data;
    }
    std::string ckpt = flags["checkpoint"];
    if (auto latest = spindle::LatestCheckpoint(ckpt); latest.ok()) ckpt = *latest;
    auto r = spindle::EvaluateCheckpoint(*spec, ckpt, data, eval_sequences,
                                         spec->resources == "cuda" ? kCudaBackend : nullptr);
    if (!r.ok()) return Fail(r.status());
    nlohmann::json e = {{"event", "eval"},
                        {"checkpoint", ckpt},
                        {"data", data.source},
                        {"sequences", eval_sequences},
                        {"loss", r->loss},
                        {"tokens", r->n_valid}};
    if (r->n_answers > 0) {
      e["answer_loss"] = r->answer_loss;
      e["answer_tokens"] = r->n_answers;
    }
    PrintEvent(e);
    return 0;
  }

  spindle::CpMode modes[2] = {spindle::CpMode::kAuto, spindle::CpMode::kAuto};
  const char* mode_flags[2] = {"lightning-mode", "mla-mode"};
  for (int i = 0; i < 2; ++i) {
    auto it = flags.find(mode_flags[i]);
    if (it == flags.end() || it->second == "auto") continue;
    const std::optional<spindle::CpMode> m = spindle::CpModeFromName(it->second);
    if (!m || (i == 0 && *m == spindle::CpMode::kRing)) {
      std::fprintf(stderr, "spindle-train: --%s must be %s, got \"%s\"\n", mode_flags[i],
                   i == 0 ? "allgather, all2all, hybrid or auto"
                          : "allgather, all2all, ring, hybrid or auto",
                   it->second.c_str());
      return 2;
    }
    modes[i] = *m;
  }
  // The flags' decisions (the coordinator's plan, under the worker daemon) replace the spec's;
  // what is still open is planned here, once. The plan check comes first: a refused mode never
  // waits for peers.
  if (modes[0] != spindle::CpMode::kAuto) spec->parallel.lightning_mode = modes[0];
  if (modes[1] != spindle::CpMode::kAuto) spec->parallel.mla_mode = modes[1];
  if (recompute_layers != spindle::TrainSpec::kRecomputeAuto)
    spec->train.recompute_layers = recompute_layers;
  if (!spindle::IsPlanned(*spec)) {
    auto planned = PlanStandalone(*spec, world);
    if (!planned.ok()) return Fail(planned.status());
    *spec = *std::move(planned);
  }
  if (auto m = spindle::PlannedCpModes(spec->parallel, spec->model.n_heads); !m.ok())
    return Fail(m.status());
  if (verify_only) {
    spindle::LocalParityOptions verify;
    verify.threads = threads;
    verify.on_event = PrintEvent;
    auto parity = spindle::VerifyLayoutInProcess(*spec, verify);
    if (!parity.ok()) return Fail(parity.status());
    if (!parity->passed) return Fail(absl::FailedPreconditionError(parity->FailureMessage()));
    return 0;
  }
  int64_t attempt = 0, resume_step = 0;
  if (flags.count("attempt") && !int_flag("attempt", 0, 0, &attempt)) return 2;
  if (flags.count("resume-step") && !int_flag("resume-step", 0, 0, &resume_step)) return 2;
  std::unique_ptr<spindle::KvStore> store;
  if (world > 1) {
    if (flags.count("rendezvous")) {
      spindle::RendezvousOptions ro;
      ro.address = flags["rendezvous"];
      ro.job_id = flags["job-id"];
      ro.attempt = attempt;
      ro.bearer_token_file = flags.count("token-file") ? flags["token-file"] : "";
      auto rs = spindle::RendezvousStore::Connect(spindle::WithTrainerEnvironment(ro));
      if (!rs.ok()) return Fail(rs.status());
      store = std::move(*rs);
    } else if (flags.count("file-store")) {
      store = std::make_unique<spindle::FileKvStore>(flags["file-store"]);
    } else {
      std::fprintf(stderr,
                   "spindle-train: --world %lld needs --rendezvous HOST:PORT or --file-store DIR\n",
                   static_cast<long long>(world));
      return 2;
    }
  }

  spindle::TrainerOptions options;
  options.spec = *spec;
  options.store = store.get();
  if (flags.count("gloo-host")) {
    options.gloo.hostname = flags["gloo-host"];
  } else if (const char* h = std::getenv("SPINDLE_GLOO_HOST"); h && *h) {
    options.gloo.hostname = h;
  }
  options.rank = rank;
  options.world = world;
  options.checkpoint_dir = flags.count("checkpoint-dir") ? flags["checkpoint-dir"] : "";
  options.attempt = attempt;
  options.resume_step = resume_step;
  options.stop_at_step = stop_at;
  options.on_event = PrintEvent;
  options.cuda_backend = kCudaBackend;
  auto trainer = spindle::Trainer::Create(std::move(options));
  if (!trainer.ok()) return Fail(trainer.status());
  absl::Status s = (*trainer)->Run();
  if (!s.ok()) return Fail(s);
  return 0;
}
