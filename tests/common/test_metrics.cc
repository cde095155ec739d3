// Tests for common/metrics.h: exact exposition output, escaping, validation, concurrency, RSS.
#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics.h"
#include "gtest/gtest.h"

namespace spindle {
namespace {

TEST(MetricsTest, CounterExposition) {
  MetricsRegistry registry;
  absl::StatusOr<Family<Counter>*> family =
      registry.CounterFamily("spindle_restarts_total", "Gang restarts.", {"job_id"});
  ASSERT_TRUE(family.ok()) << family.status();
  absl::StatusOr<Counter*> j1 = (*family)->Add({{"job_id", "j1"}});
  ASSERT_TRUE(j1.ok()) << j1.status();
  (*j1)->Increment();
  (*j1)->Increment(2);
  (*j1)->Increment(-5);  // ignored: counters never go down
  (*j1)->Increment(NAN);
  ASSERT_TRUE((*family)->Add({{"job_id", "a"}}).ok());
  EXPECT_EQ(registry.Serialize(),
            "# HELP spindle_restarts_total Gang restarts.\n"
            "# TYPE spindle_restarts_total counter\n"
            "spindle_restarts_total{job_id=\"a\"} 0\n"
            "spindle_restarts_total{job_id=\"j1\"} 3\n");
}

TEST(MetricsTest, AddReturnsTheSameChildForTheSameLabels) {
  MetricsRegistry registry;
  Family<Counter>* family = *registry.CounterFamily("c_total", "h", {"a", "b"});
  Counter* first = *family->Add({{"a", "1"}, {"b", "2"}});
  Counter* again = *family->Add({{"b", "2"}, {"a", "1"}});
  Counter* other = *family->Add({{"a", "1"}, {"b", "3"}});
  EXPECT_EQ(first, again);
  EXPECT_NE(first, other);
  EXPECT_EQ(family->size(), 2u);
}

TEST(MetricsTest, FamiliesSortedByNameAndLabelOrderAsDeclared) {
  MetricsRegistry registry;
  Family<Gauge>* z = *registry.GaugeFamily("z_bytes", "Z.", {"rank", "job_id"});
  Family<Gauge>* a = *registry.GaugeFamily("a_bytes", "A.");
  (*z->Add({{"job_id", "j"}, {"rank", "0"}}))->Set(1);
  (*a->Add({}))->Set(2);
  EXPECT_EQ(registry.Serialize(),
            "# HELP a_bytes A.\n"
            "# TYPE a_bytes gauge\n"
            "a_bytes 2\n"
            "# HELP z_bytes Z.\n"
            "# TYPE z_bytes gauge\n"
            "z_bytes{rank=\"0\",job_id=\"j\"} 1\n");
}

TEST(MetricsTest, GaugeExpositionAndFloatFormatting) {
  MetricsRegistry registry;
  Family<Gauge>* family = *registry.GaugeFamily("spindle_loss", "Training loss.", {"case"});
  auto set = [&](const std::string& name, double v) { (*family->Add({{"case", name}}))->Set(v); };
  set("a_tenth", 0.1);
  set("b_big", 1e20);
  set("c_inf", INFINITY);
  set("d_neg_inf", -INFINITY);
  set("e_nan", NAN);
  set("f_neg", -2.5);
  set("g_int", 42);
  set("h_tiny", 1.5e-9);
  Gauge* g = *family->Add({{"case", "i_moved"}});
  g->Set(10);
  g->Increment(2.5);
  g->Decrement(0.5);
  g->Decrement();
  EXPECT_EQ(g->Value(), 11);
  EXPECT_EQ(registry.Serialize(),
            "# HELP spindle_loss Training loss.\n"
            "# TYPE spindle_loss gauge\n"
            "spindle_loss{case=\"a_tenth\"} 0.1\n"
            "spindle_loss{case=\"b_big\"} 1e+20\n"
            "spindle_loss{case=\"c_inf\"} +Inf\n"
            "spindle_loss{case=\"d_neg_inf\"} -Inf\n"
            "spindle_loss{case=\"e_nan\"} NaN\n"
            "spindle_loss{case=\"f_neg\"} -2.5\n"
            "spindle_loss{case=\"g_int\"} 42\n"
            "spindle_loss{case=\"h_tiny\"} 1.5e-09\n"
            "spindle_loss{case=\"i_moved\"} 11\n");
}

TEST(MetricsTest, FormatMetricValueRoundTrips) {
  for (double v : {0.1, 1.0 / 3.0, 123456789.123, 5e-324, 1.7976931348623157e308}) {
    EXPECT_EQ(std::strtod(FormatMetricValue(v).c_str(), nullptr), v) << FormatMetricValue(v);
  }
}

TEST(MetricsTest, HistogramExposition) {
  MetricsRegistry registry;
  Family<Histogram>* family =
      *registry.HistogramFamily("spindle_step_seconds", "Step time.", {"job_id"}, {0.5, 1, 8});
  Histogram* h = *family->Add({{"job_id", "j1"}});
  for (double v : {0.25, 0.5, 1.0, 4.0, 64.0}) h->Observe(v);
  Family<Histogram>* bare = *registry.HistogramFamily("spindle_wait_seconds", "Wait.", {}, {});
  (*bare->Add({}))->Observe(3);
  EXPECT_EQ(registry.Serialize(),
            "# HELP spindle_step_seconds Step time.\n"
            "# TYPE spindle_step_seconds histogram\n"
            "spindle_step_seconds_bucket{job_id=\"j1\",le=\"0.5\"} 2\n"
            "spindle_step_seconds_bucket{job_id=\"j1\",le=\"1\"} 3\n"
            "spindle_step_seconds_bucket{job_id=\"j1\",le=\"8\"} 4\n"
            "spindle_step_seconds_bucket{job_id=\"j1\",le=\"+Inf\"} 5\n"
            "spindle_step_seconds_sum{job_id=\"j1\"} 69.75\n"
            "spindle_step_seconds_count{job_id=\"j1\"} 5\n"
            "# HELP spindle_wait_seconds Wait.\n"
            "# TYPE spindle_wait_seconds histogram\n"
            "spindle_wait_seconds_bucket{le=\"+Inf\"} 1\n"
            "spindle_wait_seconds_sum 3\n"
            "spindle_wait_seconds_count 1\n");
}

TEST(MetricsTest, EscapesHelpAndLabelValues) {
  MetricsRegistry registry;
  Family<Gauge>* family =
      *registry.GaugeFamily("m", "back\\slash \"quoted\"\nsecond line", {"path"});
  (*family->Add({{"path", "C:\\dir\\\"x\"\nnext"}}))->Set(1);
  (*family->Add({{"path", "ünïcödé"}}))->Set(2);
  EXPECT_EQ(registry.Serialize(),
            "# HELP m back\\\\slash \"quoted\"\\nsecond line\n"
            "# TYPE m gauge\n"
            "m{path=\"C:\\\\dir\\\\\\\"x\\\"\\nnext\"} 1\n"
            "m{path=\"ünïcödé\"} 2\n");
}

TEST(MetricsTest, EmptyFamilyStillDeclaresItself) {
  MetricsRegistry registry;
  ASSERT_TRUE(registry.CounterFamily("spindle_jobs_total", "Jobs.", {"state"}).ok());
  EXPECT_EQ(registry.Serialize(),
            "# HELP spindle_jobs_total Jobs.\n"
            "# TYPE spindle_jobs_total counter\n");
}

TEST(MetricsTest, RemoveDropsTheChild) {
  MetricsRegistry registry;
  Family<Gauge>* family = *registry.GaugeFamily("g", "h", {"job_id"});
  (*family->Add({{"job_id", "a"}}))->Set(1);
  (*family->Add({{"job_id", "b"}}))->Set(2);
  ASSERT_TRUE(family->Remove({{"job_id", "a"}}).ok());
  EXPECT_EQ(registry.Serialize(), "# HELP g h\n# TYPE g gauge\ng{job_id=\"b\"} 2\n");
  const absl::Status again = family->Remove({{"job_id", "a"}});
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(again.message(), "metric \"g\": no child with labels {job_id=a}");
  // Adding it back starts from zero.
  EXPECT_EQ((*family->Add({{"job_id", "a"}}))->Value(), 0);
}

TEST(MetricsTest, InvalidMetricNames) {
  MetricsRegistry registry;
  for (const std::string name : {"", "1abc", "a-b", "a b", "é"}) {
    const absl::Status s = registry.CounterFamily(name, "h").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_EQ(s.message(),
              "invalid metric name \"" + name + "\": must match [a-zA-Z_:][a-zA-Z0-9_:]*");
  }
  for (const std::string name : {"a", "_a", ":a", "a:b_c9", "A"}) {
    EXPECT_TRUE(registry.GaugeFamily(name, "h").ok()) << name;
  }
}

TEST(MetricsTest, InvalidLabelNames) {
  MetricsRegistry registry;
  absl::Status s = registry.CounterFamily("c", "h", {"ok", "a:b"}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "metric \"c\": invalid label name \"a:b\": must match [a-zA-Z_][a-zA-Z0-9_]*");
  s = registry.CounterFamily("c", "h", {"9a"}).status();
  EXPECT_EQ(s.message(),
            "metric \"c\": invalid label name \"9a\": must match [a-zA-Z_][a-zA-Z0-9_]*");
  s = registry.CounterFamily("c", "h", {""}).status();
  EXPECT_EQ(s.message(),
            "metric \"c\": invalid label name \"\": must match [a-zA-Z_][a-zA-Z0-9_]*");
  s = registry.CounterFamily("c", "h", {"__name__"}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "metric \"c\": label name \"__name__\" is reserved (names starting with __)");
  s = registry.CounterFamily("c", "h", {"job_id", "job_id"}).status();
  EXPECT_EQ(s.message(), "metric \"c\": duplicate label name \"job_id\"");
  s = registry.HistogramFamily("h", "h", {"le"}, {1}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "metric \"h\": label name \"le\" is reserved for histogram buckets");
  EXPECT_TRUE(registry.GaugeFamily("g", "h", {"le"}).ok());  // only reserved on histograms
}

TEST(MetricsTest, InvalidBuckets) {
  MetricsRegistry registry;
  absl::Status s = registry.HistogramFamily("h", "h", {}, {1, 1}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "metric \"h\": bucket bounds must be strictly increasing");
  s = registry.HistogramFamily("h", "h", {}, {2, 1}).status();
  EXPECT_EQ(s.message(), "metric \"h\": bucket bounds must be strictly increasing");
  s = registry.HistogramFamily("h", "h", {}, {1, INFINITY}).status();
  EXPECT_EQ(s.message(),
            "metric \"h\": bucket bounds must be finite (the +Inf bucket is implicit)");
  s = registry.HistogramFamily("h", "h", {}, {NAN}).status();
  EXPECT_EQ(s.message(),
            "metric \"h\": bucket bounds must be finite (the +Inf bucket is implicit)");
}

TEST(MetricsTest, WrongLabelsOnAdd) {
  MetricsRegistry registry;
  Family<Counter>* family = *registry.CounterFamily("c_total", "h", {"job_id", "rank"});
  absl::Status s = family->Add({{"job_id", "j"}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "metric \"c_total\": missing label \"rank\"");
  s = family->Add({{"job_id", "j"}, {"rank", "0"}, {"node", "n"}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "metric \"c_total\": unknown label \"node\" (expected: job_id, rank)");
}

TEST(MetricsTest, ReRegistration) {
  MetricsRegistry registry;
  Family<Counter>* first = *registry.CounterFamily("x_total", "h", {"a"});
  absl::StatusOr<Family<Counter>*> same = registry.CounterFamily("x_total", "h", {"a"});
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(*same, first);

  absl::Status s = registry.GaugeFamily("x_total", "h", {"a"}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(s.message(), "metric \"x_total\" is already registered as a counter");
  s = registry.CounterFamily("x_total", "other help", {"a"}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(s.message(),
            "metric \"x_total\" is already registered with different help, labels or buckets");
  s = registry.CounterFamily("x_total", "h", {"b"}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);

  ASSERT_TRUE(registry.HistogramFamily("lat_seconds", "h", {}, {1, 2}).ok());
  s = registry.HistogramFamily("lat_seconds", "h", {}, {1, 3}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
}

TEST(MetricsTest, HistogramSeriesNamesCannotCollide) {
  MetricsRegistry registry;
  ASSERT_TRUE(registry.HistogramFamily("lat_seconds", "h", {}, {1}).ok());
  absl::Status s = registry.GaugeFamily("lat_seconds_count", "h").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(s.message(), "metric \"lat_seconds_count\" clashes with histogram \"lat_seconds\"");
  ASSERT_TRUE(registry.CounterFamily("wait_seconds_sum", "h").ok());
  s = registry.HistogramFamily("wait_seconds", "h", {}, {1}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(s.message(), "histogram \"wait_seconds\" clashes with metric \"wait_seconds_sum\"");
}

TEST(MetricsTest, BucketHelpers) {
  EXPECT_EQ(ExponentialBuckets(0.001, 10, 4), (std::vector<double>{0.001, 0.01, 0.1, 1}));
  EXPECT_EQ(LinearBuckets(1, 2, 3), (std::vector<double>{1, 3, 5}));
}

TEST(MetricsTest, ConcurrentIncrementsAreExact) {
  MetricsRegistry registry;
  Family<Counter>* counters = *registry.CounterFamily("hits_total", "h", {"k"});
  Family<Histogram>* hists = *registry.HistogramFamily("obs_seconds", "h", {"k"}, {0.5, 1.5});
  Family<Gauge>* gauges = *registry.GaugeFamily("level", "h", {"k"});
  Counter* shared = *counters->Add({{"k", "shared"}});
  Histogram* hist = *hists->Add({{"k", "shared"}});
  Gauge* gauge = *gauges->Add({{"k", "shared"}});
  constexpr int kThreads = 8;
  constexpr int kIters = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIters; ++i) {
        shared->Increment();
        hist->Observe(i % 2);  // half 0 (first bucket), half 1 (second)
        gauge->Increment(2);
        gauge->Decrement(1);
        // Churn other children of the same families while the shared ones are hot.
        const std::string key = "t" + std::to_string(t);
        if (i % 100 == 0) {
          (*counters->Add({{"k", key}}))->Increment();
          ASSERT_TRUE(counters->Remove({{"k", key}}).ok());
        }
      }
    });
  }
  // Scrape concurrently; every histogram seen must be internally consistent.
  std::thread scraper([&] {
    for (int i = 0; i < 200; ++i) {
      const std::string text = registry.Serialize();
      ASSERT_NE(text.find("hits_total{k=\"shared\"}"), std::string::npos);
      const Histogram::Snapshot snap = hist->Collect();
      ASSERT_EQ(snap.count, snap.cumulative_counts.back());
    }
  });
  for (std::thread& th : threads) th.join();
  scraper.join();
  EXPECT_EQ(shared->Value(), kThreads * kIters);
  EXPECT_EQ(gauge->Value(), kThreads * kIters);
  const Histogram::Snapshot snap = hist->Collect();
  EXPECT_EQ(snap.cumulative_counts,
            (std::vector<uint64_t>{kThreads * kIters / 2, kThreads * kIters, kThreads * kIters}));
  EXPECT_EQ(snap.sum, kThreads * kIters / 2);
  EXPECT_EQ(counters->size(), 1u);
}

TEST(MetricsTest, RssOfThisProcess) {
  absl::StatusOr<int64_t> before = ReadRssBytes();
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_GT(*before, 1 << 20);  // a test binary is over 1 MiB resident
  // Touch 64 MiB: RSS must grow by most of it.
  std::vector<char> block(64 << 20);
  for (size_t i = 0; i < block.size(); i += 4096) block[i] = 1;
  absl::StatusOr<int64_t> after = ReadRssBytes(getpid());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_GT(*after - *before, 48 << 20);

  MetricsRegistry registry;
  Gauge* gauge = *(*registry.GaugeFamily("spindle_host_rss_bytes", "RSS."))->Add({});
  ASSERT_TRUE(UpdateRssGauge(gauge).ok());
  EXPECT_GE(gauge->Value(), static_cast<double>(*before));
  EXPECT_EQ(block[4096], 1);
}

TEST(MetricsTest, RssOfMissingProcess) {
  const absl::Status s = ReadRssBytes(999999999).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "cannot open /proc/999999999/statm");
}

}  // namespace
}  // namespace spindle
