// spindle-train: runs one rank of a training job, or evaluates a checkpoint.
//
//   spindle-train --planned-job FILE --rank R
//                 [--rendezvous HOST:PORT --job-id ID --attempt N --token-file F]
//                 [--resume-step S] [--gloo-host H] [--threads N] [--stop-at-step K]
//                 [--pulse-ms N] [--replica-dir DIR --replica-host ID]
//   spindle-train --job JOB.json [--rank R --world W] [--checkpoint-dir DIR]
//                 [--file-store DIR] [--gloo-host H] [--threads N] [--stop-at-step K]
//                 [--inject-outliers FACTOR]
//   spindle-train --eval --job JOB.json --checkpoint DIR [--data SOURCE] [--eval-sequences N]
//   spindle-train --probe-rates [--job JOB.json] [--threads N]
//   spindle-train --probe-link
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
// The job runs as planned once (planner/planned_job.h). Under the worker daemon the
// coordinator's PlannedJob arrives whole (--planned-job: a spindle.v1.PlannedJob file): its spec
// has every decision in place (world, modes, ulysses, ep, recompute, checkpoint directory) and is
// run as given. Standalone (--job), the spec is planned here first, against this machine's device
// (the GPU's memory, or host memory shared by the world's ranks) with the cost model's built-in
// rates, and then takes the same path; --checkpoint-dir sets the spec's checkpoint.dir before it
// is planned, and --world, when given, must be the spec's dp x cp. A plan that cannot run (a
// forced all2all with n_heads % cp != 0, ...) is refused before any rank connects. Gloo listens on
// --gloo-host (default $SPINDLE_GLOO_HOST, else 127.0.0.1).
// --attempt N (under the worker daemon): the job's attempt; rank 0 fences the checkpoint directory
// for it before resuming and every rank checks the fence (checkpoint.h), so an older attempt
// still running somewhere can no longer commit, and a directory the ranks do not share is named at
// the start. Rank 0 picks the newest checkpoint that loads (passing over a corrupt one, with a
// {"event": "note"} line naming both) and every rank resumes from it. --resume-step S (under the
// worker daemon: the last checkpoint the coordinator recorded every rank completing) bounds that
// choice from below: a checkpoint older than S is never resumed from, and when none at or after S
// loads the run fails (exit code 2) naming S, rather than redo the job's recorded progress.
// Checkpoints are written in the background (checkpoint.async, worker/engine/checkpoint_writer.h);
// SIGTERM (the worker stopping a rank) lets a write in flight finish before the process ends by
// it. $SPINDLE_CHECKPOINT_PAUSE_MS (a test hook) makes the writer sleep that many milliseconds
// after each file of a checkpoint, so that a test can kill the process while one is being written.
// --replica-dir DIR --replica-host ID (under the worker daemon, for checkpoint.replicas): the
// job's directory in the worker's replica directory (tmpfs) and the worker's id; the ranks keep
// their in-memory replicas there (worker/engine/replica_store.h). Without them the job keeps none.
// --inject-outliers FACTOR (a developer flag, for FP8 experiments: bench/fp8_outlier_run.sh): on
// the CPU engine, one value of each dense layer's FFN input, at a token and a channel fixed per
// layer by the job's train.seed, is multiplied by FACTOR (in [1, 1e6]) in the forward and its
// gradient likewise in the backward, under every train.precision (Numerics::outliers in
// worker/engine/numerics.h). It changes the model being trained; a "cuda" job refuses it.
// --pulse-ms N: a {"event": "pulse"} line at the start and then every N ms, so that the worker can
// tell a stopped rank.
// --probe-rates: one {"event": "rates", ...} line with this process's CPU kernel rates
// (worker/engine/rate_probe.h) for the planner's cost model, at the job's shapes (its model, one
// rank's tokens up to 4096) when --job is given, else at the probe's default shapes; then the
// --probe-link line.
// --probe-link: one {"event": "link", "bytes_per_s", "latency_s"} line: what two ranks of this
// host exchange over Gloo on 127.0.0.1 (worker/engine/link_probe.h), the link the planner rates
// CPU slots ("loopback") and ranks sharing one GPU ("same-device") by.
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
#include <fcntl.h>
#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
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
#include "planner/plan_proto.h"
#include "planner/planned_job.h"
#include "spindle/v1/job.pb.h"
#include "worker/engine/comm/kv_stores.h"
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/link_probe.h"
#include "worker/engine/parity_local.h"
#include "worker/engine/rate_probe.h"
#include "worker/engine/trainer.h"
#include "worker/rendezvous_store.h"
#include "worker/trainer_job.h"
#ifdef SPINDLE_HAVE_CUDA_ENGINE
#include "worker/engine/cuda/trainer_cuda.h"
#endif

namespace {

constexpr char kUsage[] =
    "usage: spindle-train --planned-job FILE --rank R [--rendezvous HOST:PORT --job-id ID\n"
    "                     --attempt N --token-file F [--resume-step S]] [--gloo-host H]\n"
    "                     [--threads N] [--stop-at-step K] [--pulse-ms N]\n"
    "                     [--replica-dir DIR --replica-host ID]\n"
    "       spindle-train --job JOB.json [--rank R --world W] [--checkpoint-dir DIR]\n"
    "                     [--file-store DIR] [--gloo-host H] [--threads N] [--stop-at-step K]\n"
    "                     [--inject-outliers FACTOR]  (developer: FP8 outlier experiments)\n"
    "       spindle-train --eval --job JOB.json --checkpoint DIR [--data SOURCE]\n"
    "                     [--eval-sequences N]\n"
    "       spindle-train --probe-rates [--job JOB.json] [--threads N]\n"
    "       spindle-train --probe-link\n"
    "       spindle-train --verify-only --job JOB.json [--threads N]\n";

// --probe-link (and after --probe-rates' line): one {"event": "link", "bytes_per_s",
// "latency_s"} line with what two ranks of this host exchange over Gloo on 127.0.0.1
// (worker/engine/link_probe.h); 1 with the error on stderr when the probe fails.
int PrintLink() {
  absl::StatusOr<spindle::MeasuredLink> link = spindle::MeasureLoopbackLink();
  if (!link.ok()) {
    std::fprintf(stderr, "spindle-train: %s\n", std::string(link.status().message()).c_str());
    return 1;
  }
  nlohmann::json e = link->ToJson();
  e["event"] = "link";
  std::cout << e.dump() << std::endl;
  return 0;
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

// Checkpoints are written in the background (checkpoint.async, worker/engine/checkpoint_writer.h);
// $SPINDLE_CHECKPOINT_PAUSE_MS (a test hook) makes the writer sleep that many milliseconds after
// each file of a checkpoint, so that a test can kill the process while one is being written.
// --pulse-ms N: a {"event": "pulse"} line every N ms from a thread of its own, from the start
// (rendezvous and resume included) to the end, so the worker can tell a rank that stopped (a
// frozen process, a host that hangs) from one in a long step or a collective. The first line is
// written before the constructor returns: the worker counts a rank's silence only once it has
// seen it pulse, and a rank stopped in its first N ms (a fast job is steps in by then) would
// otherwise never count as silent.
class Pulse {
 public:
  explicit Pulse(int64_t every_ms) {
    if (every_ms <= 0) return;
    PrintEvent({{"event", "pulse"}, {"pulse_ms", every_ms}});
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

// SIGTERM, which the worker sends to stop a rank: a handler wakes a thread of its own, which lets
// the background checkpoint write in flight (of the trainer it follows) finish, then ends the
// process by SIGTERM as before. A handler rather than a blocked signal: threads that libraries
// start before main (OpenBLAS's) would not have it blocked and would take the default action.
// The handler's one piece of state, the pipe it writes to, is a function-local static because a
// signal handler cannot be given any; it is set before the handler is installed. The thread's
// state is shared with it, as the thread outlives main's locals.
class StopOnTerm {
 public:
  StopOnTerm() : state_(std::make_shared<State>()) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return;  // SIGTERM then ends the process at once
    WakeFd().store(fds[1]);
    struct sigaction sa = {};
    sa.sa_handler = [](int) {
      const char b = 1;
      (void)!::write(WakeFd().load(), &b, 1);  // async-signal-safe
    };
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    std::thread([state = state_, read_fd = fds[0]] {
      char b;
      while (::read(read_fd, &b, 1) < 0 && errno == EINTR) {
      }
      {
        std::lock_guard<std::mutex> lock(state->mu);
        if (state->trainer) state->trainer->DrainCheckpointWrite();
      }
      std::signal(SIGTERM, SIG_DFL);
      std::raise(SIGTERM);
    }).detach();
    ::sigaction(SIGTERM, &sa, nullptr);
  }
  // The trainer whose writes a stop waits for (null: none, before it goes).
  void Follow(const spindle::Trainer* trainer) {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->trainer = trainer;
  }

 private:
  struct State {
    std::mutex mu;
    const spindle::Trainer* trainer = nullptr;
  };
  static std::atomic<int>& WakeFd() {
    static std::atomic<int> fd{-1};
    return fd;
  }
  std::shared_ptr<State> state_;
};

}  // namespace

int main(int argc, char** argv) {
  StopOnTerm stop;  // a stop lets the background checkpoint write finish
  std::map<std::string, std::string> flags;
  bool eval = false, probe = false, probe_link = false, verify_only = false;
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
    if (a == "--probe-link") {
      probe_link = true;
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
                                    "--planned-job",
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
                                    "--pulse-ms",
                                    "--replica-dir",
                                    "--replica-host",
                                    "--inject-outliers"};
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
    PrintLink();  // a link that cannot be measured leaves the kernel rates measured
    return 0;
  }
  if (probe_link) return PrintLink();
  const bool planned_input = flags.count("planned-job") > 0;
  if (planned_input == (flags.count("job") > 0) && !eval) {
    std::fprintf(stderr, "spindle-train: give one of --planned-job and --job\n%s", kUsage);
    return 2;
  }
  if (eval && !flags.count("job")) {
    std::fprintf(stderr, "spindle-train: --eval needs --job\n%s", kUsage);
    return 2;
  }
  std::optional<spindle::OutlierInjection> outliers;
  if (flags.count("inject-outliers")) {
    float factor = 0;
    if (!absl::SimpleAtof(flags["inject-outliers"], &factor) || !(factor >= 1.0f) ||
        !(factor <= 1e6f)) {
      std::fprintf(stderr,
                   "spindle-train: --inject-outliers must be a number in [1, 1e6], got \"%s\"\n",
                   flags["inject-outliers"].c_str());
      return 2;
    }
    if (planned_input || eval) {
      std::fprintf(stderr,
                   "spindle-train: --inject-outliers is for standalone training runs (--job)\n");
      return 2;
    }
    outliers = spindle::OutlierInjection{factor, 0};
  }
  if (planned_input && (flags.count("world") || flags.count("checkpoint-dir"))) {
    std::fprintf(stderr,
                 "spindle-train: --planned-job carries the whole job; --world and "
                 "--checkpoint-dir are for standalone runs (--job)\n");
    return 2;
  }
  int64_t pulse_ms = 0;
  if (!int_flag("pulse-ms", 0, 0, &pulse_ms)) return 2;
  Pulse pulse(pulse_ms);
  int64_t threads = 0, rank = 0, world = 0, stop_at = -1, eval_sequences = 4;
  if (!int_flag("threads", 0, 0, &threads) || !int_flag("rank", 0, 0, &rank) ||
      !int_flag("world", 0, 1, &world) || !int_flag("stop-at-step", -1, 1, &stop_at) ||
      !int_flag("eval-sequences", 4, 1, &eval_sequences))
    return 2;
  if (threads > 0) omp_set_num_threads(static_cast<int>(threads));

  if (eval) {
    auto spec = spindle::LoadJobSpec(flags["job"]);
    if (!spec.ok()) return Fail(spec.status());
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

  // The job as planned: the coordinator's, or planned here first (standalone). Either way its
  // spec is run as given; the plan check comes first, so a refused plan never waits for peers.
  absl::StatusOr<spindle::PlannedJob> job;
  if (planned_input) {
    job = spindle::ReadPlannedJob(flags["planned-job"]);
  } else {
    auto spec = spindle::LoadJobSpec(flags["job"]);
    if (!spec.ok()) return Fail(spec.status());
    if (flags.count("checkpoint-dir")) spec->checkpoint.dir = flags["checkpoint-dir"];
    job = spindle::PlanStandalone(*spec);
  }
  if (!job.ok()) return Fail(job.status());
  if (auto m = spindle::PlannedCpModes(job->spec.parallel, job->spec.model.n_heads); !m.ok())
    return Fail(m.status());
  if (verify_only) {
    spindle::LocalParityOptions verify;
    verify.threads = threads;
    verify.on_event = PrintEvent;
    auto parity = spindle::VerifyLayoutInProcess(job->spec, verify);
    if (!parity.ok()) return Fail(parity.status());
    if (!parity->passed) return Fail(absl::FailedPreconditionError(parity->FailureMessage()));
    return 0;
  }
  if (world == 0) world = job->spec.parallel.world();
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
  options.spec = job->spec;
  options.store = store.get();
  if (flags.count("gloo-host")) {
    options.gloo.hostname = flags["gloo-host"];
  } else if (const char* h = std::getenv("SPINDLE_GLOO_HOST"); h && *h) {
    options.gloo.hostname = h;
  }
  options.rank = rank;
  options.world = world;
  options.attempt = attempt;
  options.resume_step = resume_step;
  options.stop_at_step = stop_at;
  options.on_event = PrintEvent;
  options.cuda_backend = kCudaBackend;
  if (flags.count("replica-dir")) {
    options.replica_root = flags["replica-dir"];
    options.replica_host = flags.count("replica-host") ? flags["replica-host"] : "";
    options.job_id = flags.count("job-id") ? flags["job-id"] : job->spec.name;
  }
  if (outliers) {
    outliers->seed = job->spec.train.seed;
    options.inject_outliers = outliers;
  }
  // Test hook: the background checkpoint writer pauses this long after each file it writes.
  if (const char* p = std::getenv("SPINDLE_CHECKPOINT_PAUSE_MS"); p && *p) {
    int64_t ms = 0;
    if (!absl::SimpleAtoi(p, &ms) || ms < 0 || ms > 600000) {
      std::fprintf(stderr,
                   "spindle-train: SPINDLE_CHECKPOINT_PAUSE_MS=\"%s\" is not a count of "
                   "milliseconds in [0, 600000]\n",
                   p);
      return 2;
    }
    options.checkpoint_pause_ms = ms;
  }
  auto trainer = spindle::Trainer::Create(std::move(options));
  if (!trainer.ok()) return Fail(trainer.status());
  stop.Follow(trainer->get());
  absl::Status s = (*trainer)->Run();
  stop.Follow(nullptr);
  if (!s.ok()) return Fail(s);
  return 0;
}
