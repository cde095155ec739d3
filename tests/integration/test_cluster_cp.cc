// Context parallelism with real processes: two spindle-train processes (cp=2) rendezvous through a
// file store and track the single-rank run of the same job step by step; a standalone
// spindle-train plans what its spec leaves open (train.recompute "auto") itself; the cluster
// path: jobs with cp=2 and cp=4 submitted to spindle-coordinator run on CPU spindle-worker slots
// (rendezvous through the coordinator) to SUCCEEDED with progress, like any job.
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/host_cores.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster_harness.h"
#include "tests/integration/worker_test_util.h"

namespace spindle {
namespace {

using ::spindle::testing::ClusterHarness;
using ::spindle::testing::ReadFile;
using ::spindle::testing::ScratchDir;

std::string CpSpec(int cp, int steps, const std::string& ckpt) {
  return absl::StrCat(
      R"({"name":"cp","model":{"preset":"tiny"},"data":{"source":"synthetic:copy"},)",
      R"("seq_len":256,"parallel":{"cp":)", cp, R"(,"dp":1},"train":{"steps":)", steps,
      R"(,"lr":3e-3,"seed":5},"checkpoint":{"dir":")", ckpt,
      R"(","every":0},"resources":"cpu","max_restarts":0})");
}

// CpSpec(cp, steps, <dir>/ckpt) with its text `from` replaced by `to`, written to <dir>/<name>;
// returns the file's path.
std::string WriteEditedCpSpec(const ScratchDir& dir, const std::string& name, int cp, int steps,
                              const std::string& from, const std::string& to) {
  std::string spec = CpSpec(cp, steps, dir.File("ckpt"));
  spec.replace(spec.find(from), from.size(), to);
  const std::string path = dir.File(name);
  std::ofstream(path) << spec;
  return path;
}

std::vector<double> StepLosses(const std::string& path) {
  std::ifstream f(path);
  std::vector<double> out;
  for (std::string line; std::getline(f, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.value("event", "") == "step") out.push_back(j["loss"].get<double>());
  }
  return out;
}

TEST(StandaloneCpTest, TwoProcessesThroughAFileStoreTrackTheSingleRankRun) {
  if (std::string(SPINDLE_TRAIN_BINARY).empty()) GTEST_SKIP() << "spindle-train not built";
  ScratchDir dir("spindle-cp-standalone");
  const std::string cp2 = dir.File("cp2.json"), cp1 = dir.File("cp1.json");
  {
    std::string spec = CpSpec(2, 6, dir.File("ckpt2"));
    const std::string from = R"("dp":1})";
    spec.replace(spec.find(from), from.size(),
                 R"("dp":1,"lightning_mode":"allgather","mla_mode":"allgather"})");
    std::ofstream(cp2) << spec;
  }
  std::ofstream(cp1) << CpSpec(1, 6, dir.File("ckpt1"));
  const std::string bin = SPINDLE_TRAIN_BINARY;
  const std::string cmd = absl::StrCat(
      bin, " --job ", cp1, " --threads 1 > ", dir.File("cp1.out"), " 2>&1 & ",  //
      bin, " --job ", cp2, " --rank 0 --world 2 --threads 1 --file-store ", dir.File("store"),
      " > ", dir.File("r0.out"), " 2>&1 & ",  //
      bin, " --job ", cp2, " --rank 1 --threads 1 --file-store ", dir.File("store"), " > ",
      dir.File("r1.out"),
      " 2>&1 & wait");
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const auto ref = StepLosses(dir.File("cp1.out")), r0 = StepLosses(dir.File("r0.out")),
             r1 = StepLosses(dir.File("r1.out"));
  ASSERT_EQ(ref.size(), 6u);
  ASSERT_EQ(r0.size(), 6u);
  EXPECT_EQ(r0, r1);  // both ranks report the world's loss
  EXPECT_NEAR(r0[0], ref[0], 1e-5 * ref[0]);
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(r0[i], ref[i], 2e-3 * ref[i]) << i;
  // Only rank 0 writes the checkpoint.
  EXPECT_TRUE(std::filesystem::exists(dir.File("ckpt2")));
}

TEST(StandaloneCpTest, All2AllWithIndivisibleHeadsIsRefusedBeforeConnecting) {
  if (std::string(SPINDLE_TRAIN_BINARY).empty()) GTEST_SKIP() << "spindle-train not built";
  ScratchDir dir("spindle-cp-refuse");
  std::string spec = CpSpec(3, 1, dir.File("ckpt"));
  for (const auto& [from, to] : {std::pair<std::string, std::string>{R"("seq_len":256)",
                                                                     R"("seq_len":192)"},
                                 {R"("dp":1})", R"("dp":1,"lightning_mode":"all2all"})"}})
    spec.replace(spec.find(from), from.size(), to);
  const std::string job = dir.File("cp3.json");
  std::ofstream(job) << spec;
  const std::string cmd = absl::StrCat(SPINDLE_TRAIN_BINARY, " --job ", job, " --rank 0 --file-store ",
                                       dir.File("store"), " 2> ", dir.File("err"));
  const int rc = std::system(cmd.c_str());
  EXPECT_EQ(WEXITSTATUS(rc), 2);
  std::ifstream f(dir.File("err"));
  std::string err((std::istreambuf_iterator<char>(f)), {});
  EXPECT_NE(err.find("parallel.lightning_mode: all2all needs n_heads divisible by cp, but "
                     "n_heads=4 and cp=3"),
            std::string::npos)
      << err;
}

// Standalone, "auto" is sized to this machine (host memory for CPU jobs): the tiny model at 256
// tokens keeps every activation; a number in the spec is taken as it is, and an impossible one
// is refused (exit code 2) before anything runs.
TEST(StandaloneCpTest, RecomputeAutoIsDecidedByTheTrainerBinary) {
  if (std::string(SPINDLE_TRAIN_BINARY).empty()) GTEST_SKIP() << "spindle-train not built";
  ScratchDir dir("spindle-recompute-auto");
  auto start_layers = [&](const std::string& recompute, const std::string& out) {
    const std::string name = std::filesystem::path(out).filename().string() + ".json";
    const std::string job = WriteEditedCpSpec(dir, name, 1, 2, "\"seed\":5",
                                              "\"seed\":5,\"recompute\":" + recompute);
    // A checkpoint directory per run, so that no run resumes from another's end.
    const std::string cmd =
        absl::StrCat(SPINDLE_TRAIN_BINARY, " --job ", job, " --threads 1 --checkpoint-dir ", out,
                     ".ckpt > ", out, " 2>&1");
    const int rc = std::system(cmd.c_str());
    std::ifstream f(out);
    for (std::string line; std::getline(f, line);) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.value("event", "") == "start")
        return j["recompute_layers"].get<int64_t>();
    }
    return int64_t{-100} - WEXITSTATUS(rc);
  };
  EXPECT_EQ(start_layers("\"auto\"", dir.File("auto.out")), 0);
  EXPECT_EQ(start_layers("3", dir.File("three.out")), 3);
  EXPECT_EQ(StepLosses(dir.File("auto.out")), StepLosses(dir.File("three.out")));
  EXPECT_EQ(start_layers("7", dir.File("bad.out")), -102);
  const std::string err = ReadFile(dir.File("bad.out"));
  EXPECT_NE(err.find("train.recompute"), std::string::npos) << err;
  EXPECT_NE(err.find("7"), std::string::npos) << err;
}

class ClusterCpTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (std::string(SPINDLE_COORDINATOR_BINARY).empty() ||
        std::string(SPINDLE_WORKER_BINARY).empty() || std::string(SPINDLE_TRAIN_BINARY).empty()) {
      GTEST_SKIP() << "spindle-coordinator, spindle-worker or spindle-train not built";
    }
    ASSERT_TRUE(cluster_.StartCoordinator({"--heartbeat_interval=0.2", "--heartbeat_timeout=2",
                                           "--stop_grace=1"}))
        << cluster_.Logs();
    // Two CPU workers, so a CP group spans daemons.
    ASSERT_TRUE(cluster_.StartWorker("w0", GetParam() / 2, SPINDLE_TRAIN_BINARY));
    ASSERT_TRUE(cluster_.StartWorker("w1", GetParam() / 2, SPINDLE_TRAIN_BINARY));
    ASSERT_TRUE(cluster_.WaitForWorkers(2)) << cluster_.Logs();
  }

  ScratchDir dir_{"spindle-cluster-cp"};
  ClusterHarness cluster_{&dir_};
};

TEST_P(ClusterCpTest, CpJobRunsOnCpuWorkersToSuccessWithProgress) {
  const int cp = GetParam();
  absl::StatusOr<std::string> id = cluster_.Submit(CpSpec(cp, 8, dir_.File("ckpt")));
  ASSERT_TRUE(id.ok()) << id.status();
  auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(180));
  ASSERT_TRUE(job.has_value());
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << ClusterHarness::Events(*job) << cluster_.Logs();
  EXPECT_EQ(job->step(), 8);
  EXPECT_EQ(job->total_steps(), 8);
  EXPECT_GT(job->loss(), 0.0);
  EXPECT_LT(job->loss(), 6.0);
  EXPECT_EQ(job->last_checkpoint_step(), 8);
  // The parity canary (parallel.verify "first") checked the layout before the first step: rank
  // 0's verdict is one of the job's events.
  int parity = 0;
  for (const v1::JobEvent& e : job->events())
    parity += absl::StartsWith(e.message(), "rank 0: parity: passed before step 1: cp=" +
                                                std::to_string(cp) + " dp=1 ep=1 ");
  EXPECT_EQ(parity, 1) << ClusterHarness::Events(*job);
}

// A worker started with --probe_rates measures its CPU kernels and its loopback link through the
// real trainer binary and reports them with its cores and threads; the coordinator's cost model
// then plans with them (the plan names the worker and the measured link), and a worker without the
// probe leaves the built-in rates.
TEST(ClusterRatesTest, MeasuredRatesReachThePlannersCostModel) {
  if (std::string(SPINDLE_COORDINATOR_BINARY).empty() ||
      std::string(SPINDLE_WORKER_BINARY).empty() || std::string(SPINDLE_TRAIN_BINARY).empty()) {
    GTEST_SKIP() << "spindle-coordinator, spindle-worker or spindle-train not built";
  }
  ScratchDir dir("spindle-cluster-rates");
  const std::string spec = CpSpec(2, 4, dir.File("ckpt"));
  for (const bool probe : {true, false}) {
    SCOPED_TRACE(probe ? "--probe_rates" : "no probe");
    ClusterHarness cluster(&dir);
    ASSERT_TRUE(cluster.StartCoordinator({"--heartbeat_interval=0.2", "--heartbeat_timeout=5"}))
        << cluster.Logs();
    ASSERT_TRUE(cluster.StartWorker("w0", 2, SPINDLE_TRAIN_BINARY, {},
                                    {"--cpu_threads_per_slot=1",
                                     probe ? "--probe_rates=true" : "--probe_rates=false"}));
    ASSERT_TRUE(cluster.WaitForWorkers(1)) << cluster.Logs();
    std::optional<v1::ListWorkersResponse> workers = cluster.ListWorkers();
    ASSERT_TRUE(workers.has_value());
    ASSERT_EQ(workers->workers_size(), 1);
    const v1::DeviceGroup& d = workers->workers(0).devices(0);
    EXPECT_EQ(d.threads_per_rank(), probe ? 1 : 0);
    EXPECT_EQ(d.rates().gemm_flops() > 0, probe);
    EXPECT_EQ(d.rates().attention_flops() > 0, probe);
    EXPECT_EQ(d.rates().lightning_flops() > 0, probe);
    EXPECT_EQ(d.rates().memory_bytes() > 0, probe);
    EXPECT_EQ(d.rates().copy_bytes() > 0, probe);  // one thread's memcpy, for the packing copies
    // The cores of the worker's affinity mask, which it inherits from this test.
    if (probe) EXPECT_EQ(d.cores(), HostCores());
    EXPECT_EQ(d.link_bytes_per_s() > 0, probe);  // the loopback link, measured over Gloo
    EXPECT_EQ(d.link_latency_s() > 0, probe);
    absl::StatusOr<v1::Plan> plan = cluster.Plan(spec);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_GT(plan->estimates_size(), 0);
    EXPECT_GT(plan->step_s(), 0);
    if (probe) {
      EXPECT_EQ(plan->cost_basis().rfind("rates measured by worker w0 (cpu ", 0), 0u)
          << plan->cost_basis();
      EXPECT_NE(plan->cost_basis().find(", link loopback measured by worker w0 ("),
                std::string::npos)
          << plan->cost_basis();
    } else {
      EXPECT_NE(plan->cost_basis().find("(worker w0 reported none)"), std::string::npos)
          << plan->cost_basis();
      EXPECT_EQ(plan->cost_basis().find("measured"), std::string::npos) << plan->cost_basis();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(CpSizes, ClusterCpTest, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return absl::StrCat("cp", i.param);
                         });

}  // namespace
}  // namespace spindle
