// Tests for common/metrics_http.h: /metrics and /healthz over loopback, port handling, restart.
#include <httplib.h>

#include <atomic>

#include "common/metrics_http.h"
#include "gtest/gtest.h"

namespace spindle {
namespace {

TEST(MetricsServerTest, ServesMetricsAndHealth) {
  MetricsRegistry registry;
  Counter* counter = *(*registry.CounterFamily("spindle_test_total", "A test.", {"job_id"}))
                          ->Add({{"job_id", "j1"}});
  counter->Increment(5);
  std::atomic<int> scrapes{0};
  MetricsServer server(&registry, [&] { scrapes++; });
  absl::StatusOr<int> port = server.Start("127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();
  ASSERT_GT(*port, 0);
  EXPECT_EQ(server.port(), *port);

  httplib::Client client("127.0.0.1", *port);
  httplib::Result res = client.Get("/metrics");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(res->body, registry.Serialize());
  EXPECT_NE(res->body.find("spindle_test_total{job_id=\"j1\"} 5\n"), std::string::npos);
  EXPECT_EQ(scrapes.load(), 1);

  counter->Increment();
  res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_NE(res->body.find("spindle_test_total{job_id=\"j1\"} 6\n"), std::string::npos);

  res = client.Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "ok\n");

  res = client.Get("/nope");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_EQ(scrapes.load(), 2);
}

TEST(MetricsServerTest, StartTwiceFailsAndStopAllowsRestart) {
  MetricsRegistry registry;
  MetricsServer server(&registry);
  absl::StatusOr<int> port = server.Start("127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();
  const absl::Status again = server.Start("127.0.0.1", 0).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(again.message(), "metrics server already running on port " + std::to_string(*port));
  server.Stop();
  server.Stop();  // idempotent
  EXPECT_EQ(server.port(), 0);
  EXPECT_FALSE(httplib::Client("127.0.0.1", *port).Get("/healthz"));

  // The same explicit port again: the listening socket was released.
  absl::StatusOr<int> same = server.Start("127.0.0.1", *port);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(*same, *port);
  EXPECT_TRUE(httplib::Client("127.0.0.1", *port).Get("/healthz"));
}

TEST(MetricsServerTest, PortInUseIsUnavailable) {
  MetricsRegistry registry;
  MetricsServer first(&registry);
  absl::StatusOr<int> port = first.Start("127.0.0.1", 0);
  ASSERT_TRUE(port.ok());
  MetricsServer second(&registry);
  const absl::Status s = second.Start("127.0.0.1", *port).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "metrics server cannot bind 127.0.0.1:" + std::to_string(*port));
}

TEST(MetricsServerTest, ImmediateStopAfterStartDoesNotHang) {
  MetricsRegistry registry;
  for (int i = 0; i < 20; ++i) {
    MetricsServer server(&registry);
    ASSERT_TRUE(server.Start("127.0.0.1", 0).ok());
  }  // each destructor stops and joins
}

// A request body past kMetricsMaxBodyBytes is refused before it is read (cpp-httplib's own
// default reads bodies of any size into memory).
TEST(MetricsServerTest, RefusesLargeRequestBodies) {
  MetricsRegistry registry;
  MetricsServer server(&registry);
  absl::StatusOr<int> port = server.Start("127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();
  httplib::Client client("127.0.0.1", *port);
  httplib::Result res =
      client.Post("/metrics", std::string(kMetricsMaxBodyBytes + 1, 'x'), "text/plain");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 413);
  res = client.Get("/healthz");  // still serving
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
}

}  // namespace
}  // namespace spindle
