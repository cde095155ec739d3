// Metrics of a live cluster through a real Prometheus server (Debian's `prometheus`, harness in
// tests/common/prometheus_server.h): it scrapes the spindle-coordinator daemon and two
// spindle-worker daemons while a 2-rank job runs, and the query API finds the coordinator's
// series (jobs, workers, devices, scheduling latency) and the per-rank series of the job, labelled
// {job_id, rank} (not renamed to exported_job). `promtool check metrics` accepts both expositions.
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/prometheus_server.h"
#include "tests/integration/cluster_harness.h"
#include "tests/integration/worker_test_util.h"

namespace spindle {
namespace {

using ::spindle::testing::ClusterHarness;
using ::spindle::testing::FindTestProgram;
using ::spindle::testing::FreePort;
using ::spindle::testing::PrometheusServer;
using ::spindle::testing::SampleValue;
using ::spindle::testing::ScratchDir;
using ::spindle::testing::WriteScript;

// A trainer that reports every progress field the worker turns into metrics, one step per
// 0.2 s for a long time (the test cancels the job).
constexpr char kReportingTrainer[] = R"(
rank=0
while [ $# -gt 0 ]; do
  case $1 in --rank) rank=$2; shift ;; esac
  shift
done
echo '{"event":"start","step":0,"total_steps":1000}'
s=0
while [ $s -lt 1000 ]; do
  sleep 0.2
  s=$((s+1))
  echo "{\"event\":\"step\",\"step\":$s,\"total_steps\":1000,\"loss\":$((9-rank)).25,\"tokens_per_s\":2048,\"step_time_s\":0.2,\"elapsed_s\":$s,\"mfu\":0.125,\"mem_allocated_bytes\":1000,\"mem_reserved_bytes\":2000,\"mem_peak_bytes\":1500,\"comm\":[{\"collective\":\"all_gather\",\"layer_type\":\"lightning\",\"seconds\":0.01,\"bytes\":4096}]}"
done
echo '{"event":"done","step":1000}'
)";

constexpr char kSpec[] =
    R"({"name":"metrics","model":{"preset":"tiny"},"data":{"source":"synthetic:recall"},)"
    R"("seq_len":256,"parallel":{"cp":2},"train":{"steps":1000},"resources":"cpu"})";

class ClusterMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(SPINDLE_COORDINATOR_BINARY).empty() ||
        std::string(SPINDLE_WORKER_BINARY).empty()) {
      GTEST_SKIP() << "spindle-coordinator or spindle-worker not built";
    }
    trainer_ = WriteScript(dir_, "reporting-train.sh", kReportingTrainer);
  }

  // GET http://127.0.0.1:port/metrics.
  static std::string Scrape(int port) {
    httplib::Client client("127.0.0.1", port);
    httplib::Result res = client.Get("/metrics");
    return res && res->status == 200 ? res->body : "";
  }

  ScratchDir dir_{"spindle-metrics"};
  ClusterHarness cluster_{&dir_};
  std::string trainer_;
};

TEST_F(ClusterMetricsTest, PrometheusScrapesTheCoordinatorAndTheWorkers) {
  const int coordinator_metrics = FreePort();
  const std::vector<int> worker_metrics = {FreePort(), FreePort()};
  cluster_.UseCoordinatorMetricsPort(coordinator_metrics);
  ASSERT_TRUE(cluster_.StartCoordinator({"--heartbeat_interval=0.5", "--heartbeat_timeout=5",
                                         "--stop_grace=1", "--metrics_host=127.0.0.1"}))
      << cluster_.Logs();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(cluster_.StartWorker(absl::StrCat("w", i), 1, trainer_, {},
                                     {absl::StrCat("--metrics_port=", worker_metrics[i]),
                                      "--metrics_host=127.0.0.1", "--advertise_host=127.0.0.1"}));
  }
  ASSERT_TRUE(cluster_.WaitForWorkers(2)) << cluster_.Logs();
  absl::StatusOr<std::string> id = cluster_.Submit(kSpec);
  ASSERT_TRUE(id.ok()) << id.status();
  std::optional<v1::Job> progressed = cluster_.WaitJob(
      *id, [](const v1::Job& j) { return j.step() >= 3; }, std::chrono::seconds(30));
  ASSERT_TRUE(progressed.has_value()) << cluster_.Logs();
  // The coordinator's view: throughput summed over the ranks, MFU their mean.
  EXPECT_DOUBLE_EQ(progressed->tokens_per_s(), 2 * 2048.0);
  EXPECT_DOUBLE_EQ(progressed->mfu(), 0.125);
  for (const v1::RankStatus& r : progressed->ranks()) EXPECT_DOUBLE_EQ(r.mfu(), 0.125);

  const std::vector<std::string> targets = {absl::StrCat("127.0.0.1:", coordinator_metrics),
                                            absl::StrCat("127.0.0.1:", worker_metrics[0]),
                                            absl::StrCat("127.0.0.1:", worker_metrics[1])};
  absl::StatusOr<std::unique_ptr<PrometheusServer>> server =
      PrometheusServer::Start(targets, "spindle", absl::Seconds(60));
  ASSERT_TRUE(server.ok()) << server.status();
  PrometheusServer& prom = **server;
  const absl::Duration wait = absl::Seconds(45);
  auto equals = [](const char* value) {
    return [value](const nlohmann::json& s) { return SampleValue(s) == value; };
  };

  // Every target is up.
  absl::StatusOr<nlohmann::json> up = prom.WaitFor("sum(up{job=\"spindle\"})", wait, equals("3"));
  ASSERT_TRUE(up.ok()) << up.status();

  // Coordinator series.
  for (const auto& [query, value] : std::vector<std::pair<std::string, const char*>>{
           {"spindle_jobs{state=\"running\"}", "1"},
           {"spindle_workers{state=\"alive\"}", "2"},
           {"spindle_devices{state=\"used\"}", "2"},
           {"spindle_jobs_submitted_total", "1"},
           {"spindle_scheduling_latency_seconds_count", "1"},
           {"spindle_restarts_total{reason=\"hang\"}", "0"}}) {
    absl::StatusOr<nlohmann::json> r = prom.WaitFor(query, wait, equals(value));
    EXPECT_TRUE(r.ok()) << r.status();
  }

  // Per-rank series of the running job, from both workers.
  const std::string job = absl::StrCat("job_id=\"", *id, "\"");
  for (const auto& [query, value] : std::vector<std::pair<std::string, const char*>>{
           {absl::StrCat("spindle_loss{", job, ",rank=\"0\"}"), "9.25"},
           {absl::StrCat("spindle_loss{", job, ",rank=\"1\"}"), "8.25"},
           {absl::StrCat("spindle_tokens_per_second{", job, ",rank=\"1\"}"), "2048"},
           {absl::StrCat("spindle_mfu{", job, ",rank=\"0\"}"), "0.125"},
           {absl::StrCat("spindle_device_memory_bytes{", job, ",rank=\"0\",kind=\"peak\"}"),
            "1500"},
           {absl::StrCat("count(spindle_training_step{", job, "})"), "2"},
           {absl::StrCat("count(spindle_step_seconds_count{", job, "} > 0)"), "2"},
           {absl::StrCat("count(spindle_host_rss_bytes{", job, "} > 0)"), "2"},
           {absl::StrCat("count(spindle_comm_bytes_total{", job,
                         ",collective=\"all_gather\",layer_type=\"lightning\"} >= 8192)"),
            "2"},
           {absl::StrCat("count(spindle_restarts_total{", job, "})"), "2"},
           // The coordinator's goodput of the job (coordinator/goodput.h), a fraction.
           {absl::StrCat("count(spindle_job_goodput{", job, "} >= 0 <= 1)"), "1"},
           {"sum(spindle_worker_running_ranks)", "2"},
           {"sum(spindle_worker_slots)", "2"},
           {"sum(spindle_worker_coordinator_connected)", "2"},
           {"count(spindle_worker_heartbeats_total > 0)", "2"}}) {
    absl::StatusOr<nlohmann::json> r = prom.WaitFor(query, wait, equals(value));
    EXPECT_TRUE(r.ok()) << r.status();
  }
  // The scrape job keeps its own label; ours is job_id, so nothing was renamed.
  absl::StatusOr<nlohmann::json> loss = prom.Query(absl::StrCat("spindle_loss{", job, "}"));
  ASSERT_TRUE(loss.ok()) << loss.status();
  ASSERT_EQ(loss->size(), 2u) << loss->dump();
  for (const nlohmann::json& s : *loss) {
    EXPECT_EQ(s["metric"]["job"], "spindle") << s.dump();
    EXPECT_FALSE(s["metric"].contains("exported_job")) << s.dump();
  }
  absl::StatusOr<nlohmann::json> renamed = prom.Query("{exported_job!=\"\"}");
  ASSERT_TRUE(renamed.ok()) << renamed.status();
  EXPECT_TRUE(renamed->empty()) << renamed->dump();

  // promtool accepts both expositions as they are served.
  absl::StatusOr<std::string> promtool = FindTestProgram("promtool");
  ASSERT_TRUE(promtool.ok()) << promtool.status();
  for (int port : {coordinator_metrics, worker_metrics[0]}) {
    const std::string exposition = Scrape(port);
    ASSERT_THAT(exposition, ::testing::HasSubstr("# TYPE spindle_")) << port;
    absl::StatusOr<CommandResult> r = RunCommand({*promtool, "check", "metrics"}, exposition);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->exit_code, 0) << "stdout: " << r->stdout_text << "\nstderr: " << r->stderr_text
                               << "\nexposition:\n"
                               << exposition;
  }
  EXPECT_TRUE(cluster_.Cancel(*id));
}

}  // namespace
}  // namespace spindle
