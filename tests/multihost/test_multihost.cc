// Multi-host tests: the coordinator and three workers (four for elastic jobs), each on a host of
// its own (a network namespace, TestNetwork), real processes talking real gRPC and Gloo over the
// hosts' addresses, one checkpoint directory shared by all hosts (as a shared volume would be). The
// daemons run with their default flags but for what a test names (the worker ids: the namespaces
// share one hostname). Links are cut and restored under the running jobs; every test ends with the
// job SUCCEEDED at its final step with the loss of an uninterrupted run (resume is exact), no
// trainer of a stopped attempt running past the fence deadline after the cut, and no checkpoint of
// an old attempt committed after the next attempt fenced the directory (its commits.log). Two
// tests are about lost work instead: a trainer killed while its background checkpoint write is in
// flight, and the goodput of a job whose ranks are killed periodically. Skips, naming why, where
// network namespaces cannot be created.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster_harness.h"
#include "tests/multihost/test_network.h"

namespace spindle::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kPort = 7070;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The command line of a process as its arguments.
std::vector<std::string> Argv(pid_t pid) {
  const std::string cmdline = ReadFile(absl::StrCat("/proc/", pid, "/cmdline"));
  std::vector<std::string> argv;
  for (absl::string_view a : absl::StrSplit(cmdline, '\0')) argv.emplace_back(a);
  return argv;
}

// Samples the process table every 50 ms and records, per attempt of one job, when a trainer of it
// was last seen alive.
class TrainerWatch {
 public:
  TrainerWatch(std::string job_id, std::string scope)
      : job_id_(std::move(job_id)), scope_(std::move(scope)), thread_([this] { Run(); }) {}
  ~TrainerWatch() {
    stop_ = true;
    thread_.join();
  }
  // When a trainer of `attempt` was last (first) seen; nullopt: never.
  std::optional<Clock::time_point> LastSeen(int64_t attempt) { return Find(last_, attempt); }
  std::optional<Clock::time_point> FirstSeen(int64_t attempt) { return Find(first_, attempt); }

 private:
  void Run() {
    while (!stop_) {
      for (pid_t pid : ProcessesWithArgs({"--job-id", job_id_}, scope_)) {
        const std::vector<std::string> argv = Argv(pid);
        for (size_t i = 0; i + 1 < argv.size(); ++i) {
          int64_t attempt = 0;
          if (argv[i] == "--attempt" && absl::SimpleAtoi(argv[i + 1], &attempt)) {
            std::lock_guard<std::mutex> l(mu_);
            const auto now = Clock::now();
            last_[attempt] = now;
            first_.emplace(attempt, now);
          }
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  std::optional<Clock::time_point> Find(const std::map<int64_t, Clock::time_point>& m,
                                        int64_t attempt) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = m.find(attempt);
    if (it == m.end()) return std::nullopt;
    return it->second;
  }
  const std::string job_id_, scope_;
  std::mutex mu_;
  std::map<int64_t, Clock::time_point> last_, first_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The faster failure detection these tests run with: 4 s heartbeat timeout, 2 s stop grace.
const std::vector<std::string> kFastFailure = {"--heartbeat_timeout=4", "--stop_grace=2"};
constexpr double kFenceSeconds = 4 + 2;
// Sampling (50 ms), process exit and reaping after SIGKILL.
constexpr double kSlackSeconds = 1.5;
// The elastic job's steps, and how far its final loss may be from a fixed-layout run's
// (relative). Measured on this job (standalone, 100 steps): fixed cp = 2, 3 and 4 runs agree to
// 3e-6 through step 11, then the training amplifies the fp32 noise of their summation orders to
// up to 2.9% apart at some step and 1.0% at the last. The exact check is the replay of the same
// layouts (ElasticMultihostTest).
constexpr int kElasticSteps = 100;
constexpr double kElasticLossTolerance = 0.03;

class MultihostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(SPINDLE_COORDINATOR_BINARY).empty() ||
        std::string(SPINDLE_WORKER_BINARY).empty() || std::string(SPINDLE_CLI_BINARY).empty())
      GTEST_SKIP() << "the daemons are not part of this build";
    absl::StatusOr<std::unique_ptr<TestNetwork>> net = TestNetwork::Create(Hosts());
    if (!net.ok()) GTEST_SKIP() << net.status().message();
    net_ = *std::move(net);
  }
  void TearDown() override {
    for (auto& [name, p] : procs_)
      if (p) p->Kill().IgnoreError();
    procs_.clear();
    if (HasFailure() && net_) std::fprintf(stderr, "%s\n", Logs().c_str());
    net_.reset();  // deletes the namespaces, also after a failure
  }

  // The coordinator's host and the worker hosts (1..Hosts() - 1).
  virtual int Hosts() const { return 4; }

  std::string CoordinatorAddress() const { return absl::StrCat(net_->Address(0), ":", kPort); }

  // The coordinator's CA (made at its first start), which workers and the CLI trust.
  std::string CaFile() const { return dir_.File("spindle.db.ca.pem"); }
  // The bootstrap token workers join with.
  std::string BootstrapTokenFile() const { return dir_.File("bootstrap-token"); }

  // TLS on its port (the default): workers join with a bootstrap token and then call with their
  // certificates; users are not authenticated (--insecure), as no test here is about them.
  void StartCoordinator(const std::vector<std::string>& extra = {}) {
    std::ofstream(BootstrapTokenFile()) << "multihost-bootstrap-0123456789\n";
    std::ofstream(dir_.File("bootstrap-tokens"))
        << "multihost-bootstrap-0123456789 "
        << absl::FormatTime(absl::RFC3339_sec, absl::Now() + absl::Hours(24), absl::UTCTimeZone())
        << "\n";
    std::vector<std::string> argv = {SPINDLE_COORDINATOR_BINARY, "--listen=" + CoordinatorAddress(),
                                     "--db=" + dir_.File("spindle.db"), "--insecure",
                                     "--bootstrap_token_file=" + dir_.File("bootstrap-tokens")};
    argv.insert(argv.end(), extra.begin(), extra.end());
    Spawn("coordinator", net_->On(0, argv));
    // Workers start once it serves (it writes its CA, which they read, before).
    ASSERT_TRUE(WaitFor(
        [&] {
          return ReadFile(dir_.File("coordinator.log")).find("serving clients") !=
                 std::string::npos;
        },
        std::chrono::seconds(30)))
        << Logs();
  }
  // How a worker reaches the coordinator: TLS with its CA, joining with the bootstrap token.
  std::vector<std::string> WorkerTls() const {
    return {"--tls_ca_file=" + CaFile(), "--bootstrap_token_file=" + BootstrapTokenFile()};
  }
  // Worker w<host> on host `host` (1..Hosts() - 1), one CPU slot, one thread per rank (so that its
  // losses are those of the single-threaded reference run); `env` ("NAME=value") is added to its
  // environment, which its trainers inherit.
  void StartWorker(int host, const std::vector<std::string>& env = {}) {
    const std::string id = absl::StrCat("w", host);
    std::vector<std::string> argv;
    if (!env.empty()) {
      argv.push_back("env");
      argv.insert(argv.end(), env.begin(), env.end());
    }
    argv.insert(argv.end(), {SPINDLE_WORKER_BINARY, "--coordinator=" + CoordinatorAddress(),
                             "--worker_id=" + id, "--work_dir=" + dir_.File("work-" + id),
                             "--cpu_threads_per_slot=1", "--checkpoint_root=" + dir_.path(),
                             "--data_root=" + dir_.path(),
                             "--replica_dir=" + dir_.File("replicas-" + id)});
    for (const std::string& f : WorkerTls()) argv.push_back(f);
    Spawn(id, net_->On(host, argv));
  }
  // Worker w<host> seeing its own empty `dir` (a tmpfs mounted over it in a mount namespace of its
  // own): a host that does not share the checkpoint volume.
  void StartWorkerWithPrivateDir(int host, const std::string& dir) {
    const std::string id = absl::StrCat("w", host);
    Spawn(id, net_->On(host, {"unshare", "--mount", "--propagation", "private", "sh", "-c",
                              "mount -t tmpfs tmpfs \"$0\" && exec \"$@\"", dir,
                              SPINDLE_WORKER_BINARY, "--coordinator=" + CoordinatorAddress(),
                              "--worker_id=" + id, "--work_dir=" + dir_.File("work-" + id),
                              "--cpu_threads_per_slot=1", "--checkpoint_root=" + dir_.path(),
                              "--data_root=" + dir_.path(),
                              "--replica_dir=" + dir_.File("replicas-" + id), WorkerTls()[0],
                              WorkerTls()[1]}));
  }
  void Spawn(const std::string& name, const std::vector<std::string>& argv) {
    SubprocessOptions options;
    options.stderr_path = dir_.File(name + ".log");
    absl::StatusOr<std::unique_ptr<Subprocess>> p = Subprocess::Spawn(argv, options);
    ASSERT_TRUE(p.ok()) << p.status();
    procs_[name] = *std::move(p);
  }
  void Kill(const std::string& name) {
    if (procs_[name]) procs_[name]->Kill().IgnoreError();
    procs_[name].reset();
  }

  // The CLI on the coordinator's host with --output json; the parsed last line, or null.
  nlohmann::json Cli(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {SPINDLE_CLI_BINARY, "--coordinator=" + CoordinatorAddress(),
                                     "--tls-ca",         CaFile(),
                                     "--output",         "json",
                                     "--timeout",        "5"};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<CommandResult> r = RunCommand(net_->On(0, argv), "", absl::Seconds(30));
    if (!r.ok() || r->exit_code != 0) return nullptr;
    std::vector<std::string> lines = absl::StrSplit(r->stdout_text, '\n', absl::SkipEmpty());
    if (lines.empty()) return nullptr;
    nlohmann::json j = nlohmann::json::parse(lines.back(), nullptr, false);
    return j.is_discarded() ? nullptr : j;
  }
  bool WaitForWorkers(int n) {
    return WaitFor(
        [&] {
          nlohmann::json w = Cli({"workers"});
          if (w.is_null()) return false;
          int alive = 0;
          for (const auto& x : w.value("workers", nlohmann::json::array()))
            alive += x.value("state", "") == "alive";
          return alive >= n;
        },
        std::chrono::seconds(60));
  }
  nlohmann::json Status(const std::string& id) { return Cli({"status", id}); }
  // Waits for `pred(status)`; returns the last status seen.
  nlohmann::json WaitJob(const std::string& id,
                         const std::function<bool(const nlohmann::json&)>& pred,
                         std::chrono::seconds timeout) {
    nlohmann::json last;
    WaitFor(
        [&] {
          nlohmann::json s = Status(id);
          if (!s.is_null()) last = s;
          return !last.is_null() && pred(last);
        },
        timeout);
    return last;
  }
  static bool Ended(const nlohmann::json& s) {
    const std::string st = s.value("state", "");
    return st == "JOB_STATE_SUCCEEDED" || st == "JOB_STATE_FAILED" || st == "JOB_STATE_CANCELLED";
  }
  // An integer field (protobuf JSON writes int64 as a string).
  static int64_t Int(const nlohmann::json& s, const char* key) {
    const nlohmann::json& v = s.value(key, nlohmann::json());
    if (v.is_number()) return v.get<int64_t>();
    int64_t out = 0;
    if (v.is_string()) (void)absl::SimpleAtoi(v.get<std::string>(), &out);
    return out;
  }
  // The worker holding `rank` of the job's current attempt ("" when not placed).
  static std::string WorkerOf(const nlohmann::json& s, int rank) {
    for (const auto& r : s.value("ranks", nlohmann::json::array()))
      if (Int(r, "rank") == rank) return r.value("worker_id", "");
    return "";
  }
  static std::string Events(const nlohmann::json& s) {
    std::string out;
    for (const auto& e : s.value("events", nlohmann::json::array()))
      absl::StrAppend(&out, e.value("attempt", nlohmann::json()).dump(), ": ",
                      e.value("message", ""), "\n");
    return out;
  }

  // The job spec: the tiny model on recall data, `steps` steps of 2048 tokens, checkpoints every
  // 10 steps into `ckpt`.
  static std::string Spec(const std::string& name, int cp, int steps, const std::string& ckpt) {
    return absl::StrCat(R"({"name": ")", name, R"(", "model": {"preset": "tiny"},
          "data": {"source": "synthetic:recall", "recall_pairs": 8, "recall_gap": 512},
          "seq_len": 2048, "parallel": {"cp": )",
                        cp, R"(},
          "train": {"steps": )",
                        steps, R"(, "lr": 3e-3, "warmup_steps": 10, "optimizer": "adamw",
                    "grad_clip": 1.0, "seed": 7},
          "checkpoint": {"dir": ")",
                        ckpt, R"(", "every": 10},
          "resources": "cpu", "max_restarts": 5})");
  }
  std::string Submit(const std::string& spec) {
    const std::string file = dir_.File(absl::StrCat("job-", ++jobs_, ".json"));
    std::ofstream(file) << spec;
    nlohmann::json r = Cli({"submit", file});
    return r.is_null() ? "" : r.value("job_id", "");
  }

  // The final loss of the same job run uninterrupted: spindle-train standalone, one process per
  // rank through a file store, one thread each, into a checkpoint directory of its own.
  // With `ckpt`, into that directory (resuming from its latest checkpoint), and `extra` arguments
  // for every rank.
  std::string ReferenceLoss(const std::string& spec, int cp, const std::string& ckpt = "",
                            const std::vector<std::string>& extra = {}) {
    const std::string file = dir_.File(absl::StrCat("reference-", ++jobs_, ".json"));
    std::ofstream(file) << spec;
    const std::string store = dir_.File(absl::StrCat("store-", jobs_));
    std::filesystem::create_directories(store);
    std::vector<std::unique_ptr<Subprocess>> ranks;
    for (int r = cp - 1; r >= 0; --r) {
      SubprocessOptions o;
      o.stdout_path = dir_.File(absl::StrCat("reference-", jobs_, "-rank", r, ".out"));
      o.stderr_path = dir_.File(absl::StrCat("reference-", jobs_, "-rank", r, ".log"));
      std::vector<std::string> argv = {
          SPINDLE_TRAIN_BINARY,
          "--job",
          file,
          "--rank",
          absl::StrCat(r),
          "--world",
          absl::StrCat(cp),
          "--file-store",
          store,
          "--threads",
          "1",
          "--checkpoint-dir",
          ckpt.empty() ? dir_.File(absl::StrCat("reference-ckpt-", jobs_)) : ckpt};
      argv.insert(argv.end(), extra.begin(), extra.end());
      auto p = Subprocess::Spawn(argv, o);
      if (!p.ok()) return "";
      ranks.push_back(*std::move(p));
    }
    for (auto& p : ranks)
      if (!p->Wait().ok()) return "";
    std::string loss;
    for (absl::string_view line : absl::StrSplit(
             ReadFile(dir_.File(absl::StrCat("reference-", jobs_, "-rank0.out"))), '\n')) {
      nlohmann::json e = nlohmann::json::parse(line, nullptr, false);
      if (!e.is_discarded() && e.value("event", "") == "step") loss = e["loss"].dump();
    }
    return loss;
  }

  // Every fence and commit in `ckpt`'s commits.log, checked in order: no commit by an attempt
  // older than a fence before it. Returns the highest fence.
  int64_t CheckCommitLog(const std::string& ckpt) {
    int64_t fence = 0;
    int line_no = 0;
    for (absl::string_view line :
         absl::StrSplit(ReadFile(ckpt + "/commits.log"), '\n', absl::SkipEmpty())) {
      ++line_no;
      nlohmann::json e = nlohmann::json::parse(line, nullptr, false);
      EXPECT_FALSE(e.is_discarded()) << line;
      if (e.is_discarded()) continue;
      if (e.contains("fence")) fence = std::max(fence, e["fence"].get<int64_t>());
      if (e.contains("commit"))
        EXPECT_GE(e["attempt"].get<int64_t>(), fence)
            << "commits.log line " << line_no << ": attempt " << e["attempt"] << " committed step "
            << e["commit"] << " after attempt " << fence << " fenced";
    }
    return fence;
  }

  // The end every partition test asserts.
  void ExpectExactFinish(const nlohmann::json& s, int steps, const std::string& reference) {
    ASSERT_EQ(s.value("state", ""), "JOB_STATE_SUCCEEDED") << s.dump(1) << "\n" << Events(s);
    EXPECT_EQ(Int(s, "step"), steps);
    EXPECT_GE(Int(s, "attempt"), 2) << Events(s);
    ASSERT_FALSE(reference.empty());
    EXPECT_EQ(s["loss"].dump(), reference) << "the resumed run's final loss differs from an "
                                              "uninterrupted run's\n"
                                           << Events(s);
  }

  // Starts the coordinator with `flags` and workers on hosts 1..`workers`, submits `spec` and
  // waits until the job has made 12 steps; returns its status and sets `*id`.
  nlohmann::json StartAndRun(const std::vector<std::string>& flags, int workers,
                             const std::string& spec, std::string* id) {
    StartCoordinator(flags);
    for (int h = 1; h <= workers; ++h) StartWorker(h);
    if (!WaitForWorkers(workers)) return nullptr;
    *id = Submit(spec);
    if (id->empty()) return nullptr;
    return WaitJob(
        *id, [](const nlohmann::json& j) { return Int(j, "step") >= 12; },
        std::chrono::seconds(180));
  }

  // The end every partition test asserts: the job SUCCEEDED at `steps` with the loss of an
  // uninterrupted run, no trainer of attempt 1 alive later than the fence deadline after `cut`,
  // and a commit log fenced by a later attempt with no older commit after the fence.
  void ExpectFencedFinish(const std::string& id, const std::string& spec, int cp, int steps,
                          const std::string& ckpt, TrainerWatch& watch, Clock::time_point cut) {
    const nlohmann::json s = WaitJob(id, Ended, std::chrono::seconds(300));
    ExpectExactFinish(s, steps, ReferenceLoss(spec, cp));
    const auto last = watch.LastSeen(1);
    ASSERT_TRUE(last.has_value());
    EXPECT_LE(Seconds(*last - cut), kFenceSeconds + kSlackSeconds)
        << "a trainer of attempt 1 ran " << Seconds(*last - cut) << " s after the cut";
    EXPECT_GE(CheckCommitLog(ckpt), 2);
  }

  std::string Logs() {
    std::string out;
    for (const auto& entry : std::filesystem::directory_iterator(dir_.path()))
      if (entry.path().extension() == ".log")
        out += "==== " + entry.path().filename().string() + "\n" + ReadFile(entry.path());
    return out;
  }

  ScratchDir dir_{"spindle-multihost"};
  std::unique_ptr<TestNetwork> net_;
  std::map<std::string, std::unique_ptr<Subprocess>> procs_;
  int jobs_ = 0;
};

TEST_F(MultihostTest, DefaultFlagsRouteAcrossHosts) {
  StartCoordinator();
  for (int h = 1; h <= 3; ++h) StartWorker(h);
  ASSERT_TRUE(WaitForWorkers(3)) << Logs();
  nlohmann::json workers = Cli({"workers"});
  for (const auto& w : workers["workers"]) {
    const std::string id = w.value("worker_id", "");
    EXPECT_EQ(w.value("address", ""), net_->Address(std::stoi(id.substr(1)))) << w.dump();
  }
  const std::string ckpt = dir_.File("ckpt-route");
  const std::string spec = Spec("route", 2, 12, ckpt);
  const std::string id = Submit(spec);
  ASSERT_FALSE(id.empty()) << Logs();
  nlohmann::json s = WaitJob(id, Ended, std::chrono::seconds(180));
  ASSERT_EQ(s.value("state", ""), "JOB_STATE_SUCCEEDED") << Events(s) << Logs();
  EXPECT_NE(WorkerOf(s, 0), WorkerOf(s, 1)) << "the two ranks should be on two hosts";
  EXPECT_EQ(Int(s, "attempt"), 1) << Events(s);
  EXPECT_EQ(CheckCommitLog(ckpt), 1);
}

// (a): the host of one rank of a cp = 2 job cut off for 25 s, then back.
TEST_F(MultihostTest, HostOfOneRankOfACp2JobCutOff) {
  const std::string ckpt = dir_.File("ckpt-a");
  const std::string spec = Spec("cut-a", 2, 100, ckpt);
  std::string id;
  nlohmann::json s = StartAndRun(kFastFailure, 3, spec, &id);
  ASSERT_GE(Int(s, "step"), 12) << Events(s) << Logs();
  TrainerWatch watch(id, dir_.path());
  const int host = std::stoi(WorkerOf(s, 1).substr(1));
  const auto cut = Clock::now();
  ASSERT_TRUE(net_->Cut(host).ok());
  std::this_thread::sleep_for(std::chrono::seconds(25));
  ASSERT_TRUE(net_->Restore(host).ok());
  ExpectFencedFinish(id, spec, 2, 100, ckpt, watch, cut);
}

// (b): the host of a cp = 1 job cut off: its rank has no peer to block on and trains on alone
// until its worker fences it.
TEST_F(MultihostTest, HostOfACp1JobCutOff) {
  const std::string ckpt = dir_.File("ckpt-b");
  const std::string spec = Spec("cut-b", 1, 80, ckpt);
  std::string id;
  nlohmann::json s = StartAndRun(kFastFailure, 2, spec, &id);
  ASSERT_GE(Int(s, "step"), 12) << Events(s) << Logs();
  TrainerWatch watch(id, dir_.path());
  const int host = std::stoi(WorkerOf(s, 0).substr(1));
  const auto cut = Clock::now();
  ASSERT_TRUE(net_->Cut(host).ok());
  std::this_thread::sleep_for(std::chrono::seconds(25));
  ASSERT_TRUE(net_->Restore(host).ok());
  ExpectFencedFinish(id, spec, 1, 80, ckpt, watch, cut);
}

// (c): the coordinator's host cut off from every worker for 30 s.
TEST_F(MultihostTest, CoordinatorHostCutOffFromEveryWorker) {
  const std::string ckpt = dir_.File("ckpt-c");
  const std::string spec = Spec("cut-c", 2, 80, ckpt);
  std::string id;
  nlohmann::json s = StartAndRun(kFastFailure, 3, spec, &id);
  ASSERT_GE(Int(s, "step"), 12) << Events(s) << Logs();
  TrainerWatch watch(id, dir_.path());
  const auto cut = Clock::now();
  ASSERT_TRUE(net_->Cut(0).ok());
  std::this_thread::sleep_for(std::chrono::seconds(30));
  ASSERT_TRUE(net_->Restore(0).ok());
  ExpectFencedFinish(id, spec, 2, 80, ckpt, watch, cut);
}

// (d): a worker killed while cut off; the host comes back with a new daemon.
TEST_F(MultihostTest, WorkerKilledWhileCutOff) {
  const std::string ckpt = dir_.File("ckpt-d");
  const std::string spec = Spec("cut-d", 2, 80, ckpt);
  std::string id;
  nlohmann::json s = StartAndRun(kFastFailure, 3, spec, &id);
  ASSERT_GE(Int(s, "step"), 12) << Events(s) << Logs();
  TrainerWatch watch(id, dir_.path());
  const std::string victim = WorkerOf(s, 1);
  const int host = std::stoi(victim.substr(1));
  const auto cut = Clock::now();
  ASSERT_TRUE(net_->Cut(host).ok());
  std::this_thread::sleep_for(std::chrono::seconds(2));
  Kill(victim);  // SIGKILL: its trainers go with it (PR_SET_PDEATHSIG)
  std::this_thread::sleep_for(std::chrono::seconds(10));
  ASSERT_TRUE(net_->Restore(host).ok());
  StartWorker(host);
  ExpectFencedFinish(id, spec, 2, 80, ckpt, watch, cut);
}

// A checkpoint directory the job's hosts do not share is named in one line at the job's start:
// the job fails at once instead of restarting until its restarts run out.
TEST_F(MultihostTest, AnUnsharedCheckpointDirectoryIsNamedAtTheStart) {
  const std::string ckpt_parent = dir_.File("volume");
  std::filesystem::create_directories(ckpt_parent);
  StartCoordinator(kFastFailure);
  StartWorker(1);
  StartWorkerWithPrivateDir(2, ckpt_parent);
  ASSERT_TRUE(WaitForWorkers(2)) << Logs();
  const std::string id = Submit(Spec("unshared", 2, 20, ckpt_parent + "/ckpt"));
  ASSERT_FALSE(id.empty()) << Logs();
  const nlohmann::json s = WaitJob(id, Ended, std::chrono::seconds(120));
  EXPECT_EQ(s.value("state", ""), "JOB_STATE_FAILED") << Events(s) << Logs();
  EXPECT_NE(
      s.value("message", "")
          .find(absl::StrCat("checkpoint.dir \"", ckpt_parent, "/ckpt\" is not shared: rank ")),
      std::string::npos)
      << s.value("message", "");
  EXPECT_EQ(Int(s, "restarts"), 0) << Events(s);
}

// (e): 50 random events, kill -9 of the coordinator or a worker and link cuts of any host, under
// four jobs; each ends SUCCEEDED with the loss of an uninterrupted run, no trainer of an attempt
// alive once a later attempt of its job has started, and no commit of an attempt after a later
// one fenced its directory.
TEST_F(MultihostTest, FiftyRandomKillsAndCutsUnderFourJobs) {
  const std::vector<std::string> coordinator_flags = {"--heartbeat_timeout=4", "--stop_grace=2",
                                                      "--recovery_grace=5"};
  StartCoordinator(coordinator_flags);
  for (int h = 1; h <= 3; ++h) StartWorker(h);
  ASSERT_TRUE(WaitForWorkers(3)) << Logs();
  struct Job {
    std::string id, ckpt, spec;
    int cp;
    std::unique_ptr<TrainerWatch> watch;
  };
  const int steps = 150;
  std::vector<Job> jobs(4);
  for (int i = 0; i < 4; ++i) {
    Job& j = jobs[i];
    j.cp = i < 2 ? 2 : 1;
    j.ckpt = dir_.File(absl::StrCat("ckpt-e", i));
    j.spec = absl::StrCat(R"({"name": "chaos", "model": {"preset": "tiny"},
        "data": {"source": "synthetic:recall", "recall_pairs": 4, "recall_gap": 128},
        "seq_len": 512, "parallel": {"cp": )",
                          j.cp, R"(},
        "train": {"steps": )",
                          steps, R"(, "lr": 3e-3, "warmup_steps": 10, "seed": 11},
        "checkpoint": {"dir": ")",
                          j.ckpt, R"(", "every": 10},
        "resources": "cpu", "max_restarts": 1000})");
    j.id = Submit(j.spec);
    ASSERT_FALSE(j.id.empty()) << Logs();
    j.watch = std::make_unique<TrainerWatch>(j.id, dir_.path());
  }
  std::mt19937 rng(20261202);
  auto pause = [&](int lo_ms, int hi_ms) {
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::uniform_int_distribution<int>(lo_ms, hi_ms)(rng)));
  };
  const auto chaos_start = Clock::now();
  for (int event = 0; event < 50; ++event) {
    const int kind = std::uniform_int_distribution<int>(0, 2)(rng);
    const int host = std::uniform_int_distribution<int>(kind == 1 ? 1 : 0, 3)(rng);
    if (kind == 0) {  // a link cut of any host, coordinator's included
      ASSERT_TRUE(net_->Cut(host).ok());
      pause(1000, 6000);
      ASSERT_TRUE(net_->Restore(host).ok());
    } else if (kind == 1) {  // kill -9 of a worker, back after a while
      Kill(absl::StrCat("w", host));
      pause(500, 3000);
      StartWorker(host);
    } else {  // kill -9 of the coordinator, restarted on its database
      Kill("coordinator");
      pause(500, 3000);
      StartCoordinator(coordinator_flags);
    }
    pause(500, 2500);
  }
  ASSERT_LT(Seconds(Clock::now() - chaos_start), 400.0);
  std::map<int, std::string> reference;
  for (Job& j : jobs) {
    nlohmann::json s = WaitJob(j.id, Ended, std::chrono::seconds(600));
    if (!reference.count(j.cp)) reference[j.cp] = ReferenceLoss(j.spec, j.cp);
    ASSERT_EQ(s.value("state", ""), "JOB_STATE_SUCCEEDED") << j.id << "\n" << Events(s);
    EXPECT_EQ(Int(s, "step"), steps);
    EXPECT_EQ(s["loss"].dump(), reference[j.cp]) << j.id << "\n" << Events(s);
    // No trainer of an attempt once a later attempt's trainers run (50 ms sampling).
    const int64_t attempts = Int(s, "attempt");
    for (int64_t a = 1; a < attempts; ++a) {
      const auto last = j.watch->LastSeen(a);
      for (int64_t later = a + 1; later <= attempts && last; ++later) {
        const auto first = j.watch->FirstSeen(later);
        if (first)
          EXPECT_LE(Seconds(*last - *first), 0.1)
              << j.id << ": attempt " << a << " ran " << Seconds(*last - *first)
              << " s after attempt " << later << " started";
      }
    }
    CheckCommitLog(j.ckpt);
  }
}

// With every flag at its default, a rank that stops (SIGSTOP: its trainer no longer runs
// while its peer waits for it in a collective) is found within 10 s, and the job still finishes
// with the uninterrupted run's loss.
TEST_F(MultihostTest, StoppedRankFoundInSecondsWithDefaultFlags) {
  StartCoordinator();
  for (int h = 1; h <= 3; ++h) StartWorker(h);
  ASSERT_TRUE(WaitForWorkers(3)) << Logs();
  const int steps = 60;
  const std::string spec = Spec("stall", 2, steps, dir_.File("ckpt-stall"));
  const std::string id = Submit(spec);
  ASSERT_FALSE(id.empty()) << Logs();
  nlohmann::json s = WaitJob(
      id, [](const nlohmann::json& j) { return Int(j, "step") >= 12; }, std::chrono::seconds(180));
  ASSERT_GE(Int(s, "step"), 12) << Events(s) << Logs();
  std::vector<pid_t> pids = ProcessesWithArgs({"--job-id", id, "--rank", "1"}, dir_.path());
  ASSERT_EQ(pids.size(), 1u);
  const auto stall = Clock::now();
  ASSERT_EQ(::kill(pids[0], SIGSTOP), 0);
  s = WaitJob(
      id, [](const nlohmann::json& j) { return Int(j, "restarts") >= 1 || Ended(j); },
      std::chrono::seconds(60));
  const double found = Seconds(Clock::now() - stall);
  EXPECT_LE(found, 10.0) << Events(s);
  EXPECT_NE(Events(s).find("stopped responding"), std::string::npos) << Events(s);
  s = WaitJob(id, Ended, std::chrono::seconds(300));
  ExpectExactFinish(s, steps, ReferenceLoss(spec, 2));
}

// Four worker hosts, for elastic jobs.
class ElasticMultihostTest : public MultihostTest {
 protected:
  int Hosts() const override { return 5; }
  // The coordinator's spindle_job_world{job_id="<id>"}; -1 when not exported.
  int64_t JobWorldGauge(const std::string& id) {
    absl::StatusOr<CommandResult> r = RunCommand(
        net_->On(0, {"curl", "-sf", "http://127.0.0.1:9400/metrics"}), "", absl::Seconds(10));
    if (!r.ok() || r->exit_code != 0) return -1;
    const std::string series = absl::StrCat("spindle_job_world{job_id=\"", id, "\"} ");
    for (absl::string_view line : absl::StrSplit(r->stdout_text, '\n')) {
      double v = 0;
      if (absl::ConsumePrefix(&line, series) && absl::SimpleAtod(line, &v))
        return static_cast<int64_t>(v);
    }
    return -1;
  }
  static int64_t World(const nlohmann::json& s) {
    return s.contains("plan") ? Int(s["plan"], "world") : 0;
  }
};

// A cp = 4 elastic job (min_world 2, wait_s 3) loses one of its four hosts for good (its worker
// killed): no replacement comes, so it resumes from its last checkpoint at the largest world the
// planner can place on the three left. 768 tokens cut into 6 chunks, so that is cp = 3, where
// All2All does not split the 4 heads: both layer types re-planned to AllGather. When a worker
// comes back on the host, the job grows back to cp = 4 (All2All again) at its next checkpoint.
// Each resize is an event and the coordinator's spindle_job_world follows it. The resumes are
// token-exact: the same layouts replayed by standalone trainers from the same checkpoint steps
// end with the same loss, bit for bit. Against a fixed cp = 4 run over the same tokens the final
// loss differs by the fp32 noise of other summation orders, which this training amplifies: fixed
// cp = 2, 3 and 4 runs of this job end up to kElasticLossTolerance apart (see its comment).
TEST_F(ElasticMultihostTest, ACp4JobShrinksWhenAHostIsLostAndGrowsBackWhenItReturns) {
  StartCoordinator(kFastFailure);
  for (int h = 1; h <= 4; ++h) StartWorker(h);
  ASSERT_TRUE(WaitForWorkers(4)) << Logs();
  const int steps = kElasticSteps;
  const std::string ckpt = dir_.File("ckpt-elastic");
  auto spec = [&](int cp, const std::string& elastic) {
    return absl::StrCat(R"({"name": "elastic", "model": {"preset": "tiny"},
        "data": {"source": "synthetic:recall", "recall_pairs": 4, "recall_gap": 128},
        "seq_len": 768, "parallel": {"cp": )",
                        cp, elastic, R"(},
        "train": {"steps": )",
                        steps, R"(, "lr": 3e-3, "warmup_steps": 10, "seed": 5},
        "checkpoint": {"dir": ")",
                        ckpt, R"(", "every": 10},
        "resources": "cpu", "max_restarts": 5})");
  };
  const std::string id = Submit(spec(4, R"(, "elastic": {"min_world": 2, "wait_s": 3})"));
  ASSERT_FALSE(id.empty()) << Logs();
  // What a user following the job sees.
  SubprocessOptions watch_options;
  watch_options.stdout_path = dir_.File("watch.out");
  watch_options.stderr_path = dir_.File("watch.log");
  absl::StatusOr<std::unique_ptr<Subprocess>> watch =
      Subprocess::Spawn(net_->On(0, {SPINDLE_CLI_BINARY, "--coordinator=" + CoordinatorAddress(),
                                     "--tls-ca", CaFile(), "watch", id}),
                        watch_options);
  ASSERT_TRUE(watch.ok()) << watch.status();
  nlohmann::json s = WaitJob(
      id, [](const nlohmann::json& j) { return Int(j, "last_checkpoint_step") >= 10; },
      std::chrono::seconds(120));
  ASSERT_GE(Int(s, "last_checkpoint_step"), 10) << Events(s) << Logs();
  ASSERT_EQ(World(s), 4);
  EXPECT_EQ(JobWorldGauge(id), 4);

  const std::string victim = WorkerOf(s, 3);
  const int host = std::stoi(victim.substr(1));
  const auto lost = Clock::now();
  Kill(victim);  // SIGKILL: its trainer goes with it
  s = WaitJob(
      id,
      [](const nlohmann::json& j) {
        return Ended(j) || (World(j) == 3 && j.value("state", "") == "JOB_STATE_RUNNING");
      },
      std::chrono::seconds(60));
  const double shrunk_after = Seconds(Clock::now() - lost);
  ASSERT_EQ(World(s), 3) << Events(s) << Logs();
  ASSERT_EQ(s.value("state", ""), "JOB_STATE_RUNNING") << Events(s);
  EXPECT_EQ(Int(s["plan"], "cp"), 3);
  // Lost within the heartbeat timeout, fenced, resized and started: kFenceSeconds after the
  // timeout bounds the wait (wait_s is shorter), plus starting three trainers.
  EXPECT_LE(shrunk_after, 4 + kFenceSeconds + 15) << Events(s);
  std::printf("lost worker %s: running at world 3 after %.1f s\n", victim.c_str(), shrunk_after);
  const std::string shrink =
      "resized (no gang of world 4 could be placed within parallel.elastic.wait_s = 3 s); world "
      "4 -> 3: cp x dp 4 x 1 -> 3 x 1, lightning mode all2all -> allgather, mla mode all2all -> "
      "allgather; tokens per step kept at 768 (parallel.elastic.batch \"keep\"); resumes from "
      "checkpoint step ";
  const std::string events = Events(s);
  const size_t shrink_at = events.find(shrink);
  ASSERT_NE(shrink_at, std::string::npos) << events;
  const int64_t shrunk_from = std::atoll(events.c_str() + shrink_at + shrink.size());
  EXPECT_GE(shrunk_from, 10);
  EXPECT_EQ(JobWorldGauge(id), 3);
  for (int r = 0; r < 3; ++r) EXPECT_NE(WorkerOf(s, r), victim);

  // The host's worker returns; the job grows at its next checkpoint.
  StartWorker(host);
  s = WaitJob(
      id,
      [](const nlohmann::json& j) {
        return Ended(j) || (World(j) == 4 && j.value("state", "") == "JOB_STATE_RUNNING");
      },
      std::chrono::seconds(90));
  ASSERT_EQ(World(s), 4) << Events(s) << Logs();
  const std::string grow = "growing at checkpoint step ";
  const size_t grow_at = Events(s).find(grow);
  ASSERT_NE(grow_at, std::string::npos) << Events(s);
  const int64_t grown_at = std::atoll(Events(s).c_str() + grow_at + grow.size());
  EXPECT_GT(grown_at, shrunk_from);
  EXPECT_NE(Events(s).find(absl::StrCat(
                grown_at,
                ": world 3 -> 4: cp x dp 3 x 1 -> 4 x 1, lightning mode allgather -> all2all, mla "
                "mode allgather -> all2all; tokens per step kept at 768")),
            std::string::npos)
      << Events(s);
  EXPECT_EQ(JobWorldGauge(id), 4);
  EXPECT_EQ(Int(s, "restarts"), 1) << "growing spends no restart\n" << Events(s);

  s = WaitJob(id, Ended, std::chrono::seconds(120));
  ASSERT_EQ(s.value("state", ""), "JOB_STATE_SUCCEEDED") << Events(s) << Logs();
  EXPECT_EQ(Int(s, "step"), steps);
  EXPECT_EQ(Int(s, "attempt"), 3) << Events(s);
  CheckCommitLog(ckpt);
  ASSERT_TRUE((*watch)->Wait().ok());  // watch ends with the job
  const std::string watched = ReadFile(dir_.File("watch.out"));
  EXPECT_NE(watched.find("restarting: " + shrink), std::string::npos) << watched;
  EXPECT_NE(watched.find("restarting: growing at checkpoint step "), std::string::npos) << watched;
  std::printf("spindle watch:\n%s", watched.c_str());
  std::printf("shrunk to cp = 3 from checkpoint step %lld, grown to cp = 4 at step %lld\n",
              static_cast<long long>(shrunk_from), static_cast<long long>(grown_at));

  // Token-exact: the same layouts from the same checkpoint steps, by standalone trainers.
  const std::string replay = dir_.File("ckpt-replay");
  ASSERT_FALSE(
      ReferenceLoss(spec(4, ""), 4, replay, {"--stop-at-step", absl::StrCat(shrunk_from)}).empty());
  ASSERT_FALSE(
      ReferenceLoss(spec(3, ""), 3, replay, {"--stop-at-step", absl::StrCat(grown_at)}).empty());
  EXPECT_EQ(s["loss"].dump(), ReferenceLoss(spec(4, ""), 4, replay))
      << "the resized run's final loss differs from the same layouts replayed";
  // A fixed cp = 4 run over the same tokens.
  const std::string reference = ReferenceLoss(spec(4, ""), 4);
  ASSERT_FALSE(reference.empty());
  const double want = std::stod(reference), got = s["loss"].get<double>();
  std::printf("elastic final loss %.9g, fixed cp = 4 %.9g (relative difference %.3g)\n", got, want,
              std::abs(got - want) / want);
  EXPECT_NEAR(got, want, kElasticLossTolerance * want) << Events(s);
}

// Whether process `pid` has ended (gone, or a zombie its parent has not reaped yet).
bool ProcessEnded(pid_t pid) {
  const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  return stat.empty() ||
         (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'Z');
}

// The temporary directories of checkpoint writes under `ckpt` (".tmp.step_<step>.<pid>").
std::vector<std::string> TemporaryCheckpoints(const std::string& ckpt) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(ckpt, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp.", 0) == 0) out.push_back(name);
  }
  return out;
}

// A SIGKILL of rank 0's trainer while the background writer is writing the checkpoint of step 20
// (SPINDLE_CHECKPOINT_PAUSE_MS makes each of its files take 1.5 s, so its temporary directory
// lives for at least 4.5 s): the checkpoint of step 10 stays `latest` and loads (spindle-train
// --eval reads it), the gang restarts from it, and the job ends with the uninterrupted run's
// loss; the killed write's temporary directory is removed by the next writer.
TEST_F(MultihostTest, AKillDuringABackgroundCheckpointWriteLeavesThePreviousCheckpoint) {
  StartCoordinator();
  for (int h = 1; h <= 2; ++h) StartWorker(h, {"SPINDLE_CHECKPOINT_PAUSE_MS=1500"});
  ASSERT_TRUE(WaitForWorkers(2)) << Logs();
  const int steps = 40;
  const std::string ckpt = dir_.File("ckpt-write-kill");
  const std::string spec = Spec("write-kill", 2, steps, ckpt);
  const std::string id = Submit(spec);
  ASSERT_FALSE(id.empty()) << Logs();
  // The write of step 20 is in flight once its temporary directory exists.
  ASSERT_TRUE(WaitFor(
      [&] {
        for (const std::string& t : TemporaryCheckpoints(ckpt))
          if (t.rfind(".tmp.step_00000020.", 0) == 0) return true;
        return false;
      },
      std::chrono::seconds(180)))
      << Events(Status(id)) << Logs();
  std::vector<pid_t> pids = ProcessesWithArgs({"--job-id", id, "--rank", "0"}, dir_.path());
  ASSERT_EQ(pids.size(), 1u);
  ASSERT_EQ(::kill(pids[0], SIGKILL), 0);
  ASSERT_TRUE(WaitFor([&] { return ProcessEnded(pids[0]); }, std::chrono::seconds(30)));
  EXPECT_EQ(ReadFile(ckpt + "/latest"), "step_00000010\n");
  EXPECT_FALSE(std::filesystem::exists(ckpt + "/step_00000020"));
  const std::string spec_file = dir_.File("write-kill-eval.json");
  std::ofstream(spec_file) << spec;
  absl::StatusOr<CommandResult> eval =
      RunCommand({SPINDLE_TRAIN_BINARY, "--eval", "--job", spec_file, "--checkpoint",
                  ckpt + "/step_00000010", "--threads", "1"},
                 "", absl::Seconds(120));
  ASSERT_TRUE(eval.ok()) << eval.status();
  EXPECT_EQ(eval->exit_code, 0) << eval->stderr_text;
  EXPECT_NE(eval->stdout_text.find("\"loss\""), std::string::npos) << eval->stdout_text;

  const nlohmann::json s = WaitJob(id, Ended, std::chrono::seconds(300));
  EXPECT_NE(Events(s).find("from checkpoint step 10"), std::string::npos) << Events(s);
  ExpectExactFinish(s, steps, ReferenceLoss(spec, 2));
  EXPECT_GE(CheckCommitLog(ckpt), 2);
  EXPECT_TRUE(TemporaryCheckpoints(ckpt).empty());
}

// checkpoint.replicas across hosts: a cp = 2 job whose only file checkpoint is its last takes an
// in-memory replica every 4 steps; rank 0's host is cut off for 25 s. Its own copy is on the lost
// host, so the gang, restarted on the other two, resumes from the peer copy that rank 1's worker
// holds (the job's events name it and its step) and ends with the uninterrupted run's loss.
TEST_F(MultihostTest, ALostHostsRankResumesFromThePeerCopyOfItsReplica) {
  const std::string ckpt = dir_.File("ckpt-replicas");
  std::string spec = Spec("replicas", 2, 100, ckpt);
  const std::string every = R"("every": 10})";
  ASSERT_NE(spec.find(every), std::string::npos);
  spec.replace(spec.find(every), every.size(), R"("every": 0, "replicas": {"every": 4}})");
  std::string id;
  nlohmann::json s = StartAndRun(kFastFailure, 3, spec, &id);
  ASSERT_GE(Int(s, "step"), 12) << Events(s) << Logs();
  const std::string lost = WorkerOf(s, 0), peer = WorkerOf(s, 1);
  ASSERT_NE(lost, peer);
  TrainerWatch watch(id, dir_.path());
  const auto cut = Clock::now();
  ASSERT_TRUE(net_->Cut(std::stoi(lost.substr(1))).ok());
  std::this_thread::sleep_for(std::chrono::seconds(25));
  ASSERT_TRUE(net_->Restore(std::stoi(lost.substr(1))).ok());
  ExpectFencedFinish(id, spec, 2, 100, ckpt, watch, cut);
  const nlohmann::json end = Status(id);
  const std::string events = Events(end);
  const std::string used = absl::StrCat("resumed from in-memory replicas at step ");
  const size_t at = events.find(used);
  ASSERT_NE(at, std::string::npos) << events;
  int64_t step = 0;
  ASSERT_TRUE(absl::SimpleAtoi(
      events.substr(at + used.size(), events.find(' ', at + used.size()) - at - used.size()),
      &step));
  // Cut after step 12: the replica of step 8 was complete (each is, at the latest, when the next
  // one starts).
  EXPECT_GE(step, 8) << events;
  EXPECT_EQ(step % 4, 0) << events;
  EXPECT_NE(events.find("restart 1/5 from scratch or a newer in-memory replica"), std::string::npos)
      << events;
  EXPECT_NE(events.find(absl::StrCat("(the copy on worker \"", peer, "\"")), std::string::npos)
      << "the peer copy, on rank 1's worker " << peer << ", should be the one used\n"
      << events;
}

// Goodput under failures: rank 0 or 1 of a cp = 2 job (alternately) has its trainer killed
// (SIGKILL) every kKillPeriod seconds while the job runs, with every flag at its default and
// checkpoints every 10 steps written in the background. The coordinator's goodput (time on steps
// that count over the wall time, coordinator/goodput.h) stays at or above 90% (measured on the
// 2-core development machine with 600 steps: 93.8% and 95.3% with 3 kills, 96.3% with 2; with
// 800: 96.4% with 3; each kill costs the restart, about a second, and on average 5 steps of
// 0.1-0.15 s), and the job succeeds. The issue's scenario kills every 60 s; 25 s keeps this test
// near two minutes with three or four kills.
TEST_F(MultihostTest, GoodputStaysAbove90PercentWithARankKilledPeriodically) {
  constexpr int kKillPeriodS = 25;
  StartCoordinator();
  for (int h = 1; h <= 2; ++h) StartWorker(h);
  ASSERT_TRUE(WaitForWorkers(2)) << Logs();
  const int steps = 800;  // 80-120 s of steps: three or four kills
  const std::string ckpt = dir_.File("ckpt-goodput");
  const std::string spec = Spec("goodput", 2, steps, ckpt);
  const std::string id = Submit(spec);
  ASSERT_FALSE(id.empty()) << Logs();
  int kills = 0;
  nlohmann::json s = WaitJob(
      id, [](const nlohmann::json& j) { return Int(j, "step") >= 1 || Ended(j); },
      std::chrono::seconds(120));
  ASSERT_GE(Int(s, "step"), 1) << Events(s) << Logs();
  while (true) {
    s = WaitJob(id, Ended, std::chrono::seconds(kKillPeriodS));
    if (Ended(s)) break;
    std::vector<pid_t> pids =
        ProcessesWithArgs({"--job-id", id, "--attempt", absl::StrCat(Int(s, "attempt")), "--rank",
                           absl::StrCat(kills % 2)},
                          dir_.path());
    if (pids.size() != 1u) continue;  // between attempts: the next period kills
    ASSERT_EQ(::kill(pids[0], SIGKILL), 0);
    ++kills;
  }
  const double goodput = s.value("goodput", -1.0);
  std::fprintf(stderr, "goodput %.4f with %d kills every %d s, %lld restarts\n", goodput, kills,
               kKillPeriodS, static_cast<long long>(Int(s, "restarts")));
  RecordProperty("goodput", absl::StrCat(goodput));
  EXPECT_GE(kills, 2) << "the job ended before the kills it is about";
  EXPECT_EQ(Int(s, "restarts"), kills) << Events(s);
  EXPECT_GE(goodput, 0.90) << Events(s);
  EXPECT_LE(goodput, 1.0);
  // Exact resumes are the other tests' (an uninterrupted reference run would double this one).
  EXPECT_EQ(s.value("state", ""), "JOB_STATE_SUCCEEDED") << Events(s);
  EXPECT_EQ(Int(s, "step"), steps);
}

}  // namespace
}  // namespace spindle::testing
