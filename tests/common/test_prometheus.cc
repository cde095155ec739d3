// Integration tests against the real Prometheus tools: a `prometheus` server scrapes a running
// MetricsServer on loopback, and `promtool check metrics` lints the exposition. Missing binaries
// are a failure (scripts/setup.sh installs them), not a skip.
#include <cmath>
#include <string>

#include "common/metrics.h"
#include "common/metrics_http.h"
#include "common/subprocess.h"
#include "gtest/gtest.h"
#include "tests/common/prometheus_server.h"

namespace spindle {
namespace {

using ::spindle::testing::FindTestProgram;
using ::spindle::testing::PrometheusServer;
using ::spindle::testing::SampleValue;

// Families shaped like the ones the daemons export.
struct SampleMetrics {
  explicit SampleMetrics(MetricsRegistry* registry) {
    restarts =
        *(*registry->CounterFamily("spindle_restarts_total", "Gang restarts of a job.", {"job_id"}))
             ->Add({{"job_id", "j1"}});
    loss = *(*registry->GaugeFamily("spindle_loss", "Training loss at the last step.",
                                    {"job_id", "rank"}))
                ->Add({{"job_id", "j1"}, {"rank", "0"}});
    step = *(*registry->HistogramFamily("spindle_step_seconds", "Training step time.", {"job_id"},
                                        {0.5, 1, 8}))
                ->Add({{"job_id", "j1"}});
    Family<Gauge>* special =
        *registry->GaugeFamily("spindle_test_special", "Non-finite values.", {"kind"});
    (*special->Add({{"kind", "inf"}}))->Set(INFINITY);
    (*special->Add({{"kind", "neg_inf"}}))->Set(-INFINITY);
    (*special->Add({{"kind", "nan"}}))->Set(NAN);
    (*(*registry->GaugeFamily("spindle_test_escaping", "Help with \\ and\nnewline.", {"path"}))
          ->Add({{"path", kEscapedValue}}))
        ->Set(1);
    rss = *(*registry->GaugeFamily("spindle_host_rss_bytes", "Resident memory of the process."))
               ->Add({});
    restarts->Increment(3);
    loss->Set(2.5);
    for (double v : {0.25, 0.5, 1.0, 4.0, 64.0}) step->Observe(v);
  }

  static constexpr char kEscapedValue[] = "C:\\dir \"quoted\"\nline2";
  Counter* restarts;
  Gauge* loss;
  Histogram* step;
  Gauge* rss;
};

TEST(PrometheusTest, PrometheusScrape) {
  MetricsRegistry registry;
  SampleMetrics metrics(&registry);
  MetricsServer exporter(&registry, [&] { (void)UpdateRssGauge(metrics.rss); });
  absl::StatusOr<int> port = exporter.Start("127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();

  absl::StatusOr<std::unique_ptr<PrometheusServer>> prometheus =
      PrometheusServer::Start({"127.0.0.1:" + std::to_string(*port)}, "spindle_test");
  ASSERT_TRUE(prometheus.ok()) << prometheus.status();
  PrometheusServer& prom = **prometheus;

  // The target is up: Prometheus scraped and parsed the whole exposition.
  absl::StatusOr<nlohmann::json> up =
      prom.WaitFor("up{job=\"spindle_test\"}", absl::Seconds(30),
                   [](const nlohmann::json& s) { return SampleValue(s) == "1"; });
  ASSERT_TRUE(up.ok()) << up.status();

  auto query_one = [&](const std::string& promql) -> std::string {
    absl::StatusOr<nlohmann::json> r = prom.WaitFor(promql, absl::Seconds(10));
    if (!r.ok()) return "error: " + std::string(r.status().message());
    if (r->size() != 1) return "series: " + r->dump();
    return SampleValue((*r)[0]);
  };
  EXPECT_EQ(query_one("spindle_restarts_total{job_id=\"j1\"}"), "3");
  EXPECT_EQ(query_one("spindle_loss{job_id=\"j1\",rank=\"0\"}"), "2.5");
  EXPECT_EQ(query_one("spindle_step_seconds_bucket{job_id=\"j1\",le=\"0.5\"}"), "2");
  EXPECT_EQ(query_one("spindle_step_seconds_bucket{job_id=\"j1\",le=\"1\"}"), "3");
  EXPECT_EQ(query_one("spindle_step_seconds_bucket{job_id=\"j1\",le=\"8\"}"), "4");
  EXPECT_EQ(query_one("spindle_step_seconds_bucket{job_id=\"j1\",le=\"+Inf\"}"), "5");
  EXPECT_EQ(query_one("spindle_step_seconds_sum{job_id=\"j1\"}"), "69.75");
  EXPECT_EQ(query_one("spindle_step_seconds_count{job_id=\"j1\"}"), "5");
  EXPECT_EQ(query_one("spindle_test_special{kind=\"inf\"}"), "+Inf");
  EXPECT_EQ(query_one("spindle_test_special{kind=\"neg_inf\"}"), "-Inf");
  EXPECT_EQ(query_one("spindle_test_special{kind=\"nan\"}"), "NaN");
  const std::string rss = query_one("spindle_host_rss_bytes");
  EXPECT_GT(std::atof(rss.c_str()), 1 << 20) << rss;

  // Escaped label values come back byte for byte.
  absl::StatusOr<nlohmann::json> escaped = prom.WaitFor("spindle_test_escaping", absl::Seconds(10));
  ASSERT_TRUE(escaped.ok()) << escaped.status();
  ASSERT_EQ(escaped->size(), 1u) << escaped->dump();
  EXPECT_EQ((*escaped)[0]["metric"]["path"].get<std::string>(), SampleMetrics::kEscapedValue);

  // Later updates reach Prometheus on the next scrape.
  metrics.restarts->Increment(7);
  absl::StatusOr<nlohmann::json> updated =
      prom.WaitFor("spindle_restarts_total{job_id=\"j1\"}", absl::Seconds(10),
                   [](const nlohmann::json& s) { return SampleValue(s) == "10"; });
  EXPECT_TRUE(updated.ok()) << updated.status();
}

TEST(PrometheusTest, PromtoolAcceptsTheExposition) {
  absl::StatusOr<std::string> promtool = FindTestProgram("promtool");
  ASSERT_TRUE(promtool.ok()) << promtool.status();
  MetricsRegistry registry;
  SampleMetrics metrics(&registry);
  ASSERT_TRUE(UpdateRssGauge(metrics.rss).ok());
  const std::string exposition = registry.Serialize();
  absl::StatusOr<CommandResult> r = RunCommand({*promtool, "check", "metrics"}, exposition);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << "stdout: " << r->stdout_text << "\nstderr: " << r->stderr_text
                             << "\nexposition:\n"
                             << exposition;
}

TEST(PrometheusTest, PromtoolRejectsBrokenExposition) {
  // Guards the test above: promtool really parses its stdin.
  absl::StatusOr<std::string> promtool = FindTestProgram("promtool");
  ASSERT_TRUE(promtool.ok()) << promtool.status();
  absl::StatusOr<CommandResult> r =
      RunCommand({*promtool, "check", "metrics"}, "spindle_x{job_id=\"unterminated} 1\n");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->exit_code, 0);
}

}  // namespace
}  // namespace spindle
