// A mixture-of-experts job through the cluster: `spindle submit` of a tiny-moe job with
// parallel.ep 2 (cp 2, one rank on each of two CPU workers, so the tokens cross daemons to their
// experts) trains to SUCCEEDED with a falling loss; the stored plan keeps ep 2, `spindle status`
// shows the experts' routing and exchange, and the checkpoint holds whole expert tensors. A spec
// that leaves ep out is planned (ep 1 without a known device), and an ep the experts cannot be
// split by is refused at submit with the field named.
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/subprocess.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster_harness.h"
#include "tests/integration/worker_test_util.h"

namespace spindle {
namespace {

using ::spindle::testing::ClusterHarness;
using ::spindle::testing::ReadFile;
using ::spindle::testing::ScratchDir;

std::string MoeSpec(const std::string& parallel, int steps, const std::string& ckpt) {
  return absl::StrCat(
      R"({"name":"moe","model":{"preset":"tiny-moe"},"data":{"source":"synthetic:copy"},)",
      R"("seq_len":256,"parallel":)", parallel, R"(,"train":{"steps":)", steps,
      R"(,"lr":3e-3,"seed":5},"checkpoint":{"dir":")", ckpt,
      R"(","every":0},"resources":"cpu","max_restarts":0})");
}

class ClusterMoeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(SPINDLE_COORDINATOR_BINARY).empty() ||
        std::string(SPINDLE_WORKER_BINARY).empty() || std::string(SPINDLE_TRAIN_BINARY).empty() ||
        std::string(SPINDLE_CLI_BINARY).empty()) {
      GTEST_SKIP() << "spindle-coordinator, spindle-worker, spindle-train or spindle not built";
    }
    ASSERT_TRUE(cluster_.StartCoordinator({"--heartbeat_interval=0.2", "--heartbeat_timeout=2",
                                           "--stop_grace=1"}))
        << cluster_.Logs();
    ASSERT_TRUE(cluster_.StartWorker("w0", 1, SPINDLE_TRAIN_BINARY));
    ASSERT_TRUE(cluster_.StartWorker("w1", 1, SPINDLE_TRAIN_BINARY));
    ASSERT_TRUE(cluster_.WaitForWorkers(2)) << cluster_.Logs();
  }

  // Runs `spindle args... --coordinator ADDRESS` with the cluster's client credentials: its
  // standard output.
  std::string Cli(std::vector<std::string> args) {
    args.insert(args.begin(), SPINDLE_CLI_BINARY);
    args.push_back("--coordinator");
    args.push_back(cluster_.address());
    if (!cluster_.client_ca_file().empty()) {
      args.push_back("--tls-ca");
      args.push_back(cluster_.client_ca_file());
    }
    if (!cluster_.token().empty()) {
      args.push_back("--token-file");
      args.push_back(cluster_.token_file());
    }
    absl::StatusOr<CommandResult> r = RunCommand(args, "", absl::Seconds(60));
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return "";
    EXPECT_EQ(r->exit_code, 0) << r->stdout_text << r->stderr_text;
    return r->stdout_text;
  }

  ScratchDir dir_{"spindle-cluster-moe"};
  ClusterHarness cluster_{&dir_};
};

TEST_F(ClusterMoeTest, ExpertParallelJobTrainsToAFallingLoss) {
  const std::string spec_path = dir_.File("moe.json");
  std::ofstream(spec_path) << MoeSpec(R"({"cp":2,"ep":2})", 40, dir_.File("ckpt"));
  // "submitted ID (STATE)"
  const std::string submitted = Cli({"submit", spec_path});
  const size_t at = submitted.find("submitted ");
  ASSERT_NE(at, std::string::npos) << submitted;
  const std::string id = submitted.substr(at + 10, submitted.find(' ', at + 10) - at - 10);
  ASSERT_FALSE(id.empty()) << submitted;
  auto job = cluster_.WaitJob(id, ClusterHarness::Ended, std::chrono::seconds(240));
  ASSERT_TRUE(job.has_value());
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << ClusterHarness::Events(*job)
                                                   << cluster_.Logs();
  EXPECT_EQ(job->step(), 40);
  EXPECT_EQ(job->plan().ep(), 2);
  // From ln(257) = 5.55 at the start: the copy task is learnt.
  EXPECT_LT(job->loss(), 4.5);
  ASSERT_TRUE(job->has_moe());
  EXPECT_GE(job->moe().load_max_over_mean(), 1.0);
  EXPECT_GT(job->moe().dispatch_bytes(), 0.0);
  EXPECT_LT(job->moe().bias_min(), job->moe().bias_max());
  const std::string status = Cli({"status", id});
  EXPECT_NE(status.find("experts: ep=2, load max/mean"), std::string::npos) << status;
  // The final checkpoint holds the whole stacked experts [8, 32, 64], whatever the ep.
  const std::string file = ReadFile(dir_.File("ckpt/step_00000040/model.safetensors"));
  ASSERT_GT(file.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[i]);
  ASSERT_LE(8 + n, file.size());
  const nlohmann::json header = nlohmann::json::parse(file.substr(8, n), nullptr, false);
  ASSERT_TRUE(header.is_object());
  EXPECT_EQ(header["layers.0.moe.experts.w1.weight"]["shape"], nlohmann::json({8, 32, 64}));
  EXPECT_EQ(header["layers.3.moe.router.bias"]["shape"], nlohmann::json({8}));
}

TEST_F(ClusterMoeTest, EpIsPlannedWhenLeftOutAndRefusedWhenImpossible) {
  absl::StatusOr<v1::Plan> plan = cluster_.Plan(MoeSpec(R"({"dp":2})", 2, dir_.File("a")));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->ep(), 1);
  EXPECT_EQ(plan->ep_estimates_size(), 2);  // ep 1 and 2 divide 8 experts and a world of 2
  absl::StatusOr<std::string> bad = cluster_.Submit(MoeSpec(R"({"dp":2,"ep":4})", 2, dir_.File("b")));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("parallel.ep: 4 must divide the world dp x cp = 2 x 1 = 2"),
            std::string::npos)
      << bad.status();
}

}  // namespace
}  // namespace spindle
