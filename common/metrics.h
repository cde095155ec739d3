// Prometheus metrics: a registry of metric families (counter, gauge, histogram) with label sets,
// rendered in the text exposition format 0.0.4. Same shape as prometheus-cpp (registry -> family
// -> child metric per label set) so that library can replace this one where it is installed.
//
// Thread-safety: everything here is thread-safe. MetricsRegistry and Family guard their maps with
// absl::Mutex; Counter and Gauge are lock-free atomics; Histogram takes a small per-child mutex so
// a scrape always sees _count equal to the +Inf bucket. Child pointers stay valid until the child
// is removed from its family or the registry is destroyed.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace spindle {

// Label name -> value, as in prometheus-cpp. Values may be any UTF-8 text.
using MetricLabels = std::map<std::string, std::string>;

enum class MetricType { kCounter, kGauge, kHistogram };

// Monotonic count. Increments by negative or NaN amounts are ignored (a counter never decreases).
class Counter {
 public:
  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  void Increment(double amount = 1.0);
  double Value() const;

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down.
class Gauge {
 public:
  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double value);
  void Increment(double amount = 1.0);
  void Decrement(double amount = 1.0);
  double Value() const;

 private:
  std::atomic<double> value_{0.0};
};

// Distribution over fixed upper bounds (the +Inf bucket is implicit). Observe() is O(log buckets).
class Histogram {
 public:
  struct Snapshot {
    std::vector<double> upper_bounds;         // finite bounds, strictly increasing
    std::vector<uint64_t> cumulative_counts;  // one per bound, plus the +Inf bucket last
    double sum = 0.0;
    uint64_t count = 0;  // equals cumulative_counts.back()
  };

  // `upper_bounds` must already be validated (finite, strictly increasing); families do that.
  explicit Histogram(std::vector<double> upper_bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  void Observe(double value);
  Snapshot Collect() const;

 private:
  const std::vector<double> upper_bounds_;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> bucket_counts_ ABSL_GUARDED_BY(mu_);  // non-cumulative, size bounds + 1
  double sum_ ABSL_GUARDED_BY(mu_) = 0.0;
};

namespace metrics_internal {

// What the registry needs from a family of any type.
class FamilyBase {
 public:
  virtual ~FamilyBase() = default;
  virtual void Serialize(std::string* out) const = 0;
};

}  // namespace metrics_internal

// All children of one metric name: one child per distinct set of label values.
// T is Counter, Gauge or Histogram.
template <typename T>
class Family : public metrics_internal::FamilyBase {
 public:
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         std::vector<double> bucket_bounds);

  // Returns the child for `labels` (created on first use; the same pointer afterwards). The keys
  // of `labels` must be exactly the family's label names. The pointer is owned by the family and
  // stays valid until Remove() of the same labels.
  absl::StatusOr<T*> Add(const MetricLabels& labels) ABSL_LOCKS_EXCLUDED(mu_);

  // Drops the child for `labels` (e.g. when a job ends); its pointer is dangling afterwards.
  // Returns NotFound if there is no such child.
  absl::Status Remove(const MetricLabels& labels) ABSL_LOCKS_EXCLUDED(mu_);

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  const std::vector<double>& bucket_bounds() const { return bucket_bounds_; }
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

  void Serialize(std::string* out) const override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::StatusOr<std::vector<std::string>> LabelValues(const MetricLabels& labels) const;

  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
  const std::vector<double> bucket_bounds_;  // histograms only
  mutable absl::Mutex mu_;
  // Keyed by label values in label_names_ order; sorted so the exposition is deterministic.
  std::map<std::vector<std::string>, std::unique_ptr<T>> children_ ABSL_GUARDED_BY(mu_);
};

// Owns metric families; an object the daemon owns (there is no global registry).
class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Create (or return the identical existing) family. Errors: InvalidArgument for a bad metric or
  // label name, a reserved or duplicate label, or bad bucket bounds; AlreadyExists when the name
  // (or a histogram's _bucket/_sum/_count series) is taken by a family of another type, help,
  // label names or buckets. The returned pointer lives as long as the registry.
  absl::StatusOr<Family<Counter>*> CounterFamily(const std::string& name, const std::string& help,
                                                 const std::vector<std::string>& label_names = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<Family<Gauge>*> GaugeFamily(const std::string& name, const std::string& help,
                                             const std::vector<std::string>& label_names = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  // `bucket_bounds`: finite, strictly increasing upper bounds; +Inf is added implicitly.
  absl::StatusOr<Family<Histogram>*> HistogramFamily(const std::string& name,
                                                     const std::string& help,
                                                     const std::vector<std::string>& label_names,
                                                     const std::vector<double>& bucket_bounds)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The whole registry in text exposition format 0.0.4, families sorted by name.
  std::string Serialize() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    MetricType type;
    std::unique_ptr<metrics_internal::FamilyBase> family;
  };
  template <typename T>
  absl::StatusOr<Family<T>*> GetOrCreate(MetricType type, const std::string& name,
                                         const std::string& help,
                                         const std::vector<std::string>& label_names,
                                         const std::vector<double>& bucket_bounds)
      ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Entry> families_ ABSL_GUARDED_BY(mu_);
};

// The Content-Type of Serialize()'s output.
inline constexpr char kExpositionContentType[] = "text/plain; version=0.0.4; charset=utf-8";

// Validation, exposed for callers that build names at run time. OK or InvalidArgument.
absl::Status ValidateMetricName(const std::string& name);
absl::Status ValidateLabelName(const std::string& metric_name, const std::string& label_name);

// A float as Prometheus parses it: shortest round-trip decimal, or +Inf, -Inf, NaN.
std::string FormatMetricValue(double value);

// `count` bounds start, start*factor, ... (start > 0, factor > 1, count >= 1), as prometheus-cpp.
std::vector<double> ExponentialBuckets(double start, double factor, int count);
// `count` bounds start, start+width, ... (width > 0, count >= 1).
std::vector<double> LinearBuckets(double start, double width, int count);

// Resident set size in bytes of process `pid` (0: this process), from /proc/<pid>/statm.
// NotFound if the process does not exist, Internal if statm cannot be parsed.
absl::StatusOr<int64_t> ReadRssBytes(pid_t pid = 0);

// Sets `gauge` to this process's RSS in bytes; call it before each scrape (see MetricsServer).
absl::Status UpdateRssGauge(Gauge* gauge);

}  // namespace spindle
