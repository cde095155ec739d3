// Metrics registry, families and the text exposition format 0.0.4. Thread-safety: see metrics.h.
#include "common/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace spindle {
namespace {

constexpr const char* kHistogramSuffixes[] = {"_bucket", "_sum", "_count"};

bool IsAsciiLetter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsAsciiDigit(char c) { return c >= '0' && c <= '9'; }

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

template <typename T>
MetricType TypeOf();
template <>
MetricType TypeOf<Counter>() {
  return MetricType::kCounter;
}
template <>
MetricType TypeOf<Gauge>() {
  return MetricType::kGauge;
}
template <>
MetricType TypeOf<Histogram>() {
  return MetricType::kHistogram;
}

// HELP text: backslash and newline escaped.
void AppendEscapedHelp(const std::string& text, std::string* out) {
  for (char c : text) {
    if (c == '\\') {
      out->append("\\\\");
    } else if (c == '\n') {
      out->append("\\n");
    } else {
      out->push_back(c);
    }
  }
}

// Label values: backslash, double quote and newline escaped.
void AppendEscapedLabelValue(const std::string& text, std::string* out) {
  for (char c : text) {
    if (c == '\\') {
      out->append("\\\\");
    } else if (c == '"') {
      out->append("\\\"");
    } else if (c == '\n') {
      out->append("\\n");
    } else {
      out->push_back(c);
    }
  }
}

// `{a="x",b="y"}` (plus an optional trailing `le`), or nothing when there are no labels at all.
void AppendLabels(const std::vector<std::string>& names, const std::vector<std::string>& values,
                  const std::string* le, std::string* out) {
  if (names.empty() && le == nullptr) return;
  out->push_back('{');
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out->push_back(',');
    absl::StrAppend(out, names[i], "=\"");
    AppendEscapedLabelValue(values[i], out);
    out->push_back('"');
  }
  if (le != nullptr) {
    if (!names.empty()) out->push_back(',');
    absl::StrAppend(out, "le=\"", *le, "\"");
  }
  out->push_back('}');
}

void AppendSample(const std::string& name, const std::vector<std::string>& label_names,
                  const std::vector<std::string>& label_values, const std::string* le,
                  const std::string& value, std::string* out) {
  out->append(name);
  AppendLabels(label_names, label_values, le, out);
  absl::StrAppend(out, " ", value, "\n");
}

void AppendChild(const std::string& name, const std::vector<std::string>& label_names,
                 const std::vector<std::string>& values, const Counter& c, std::string* out) {
  AppendSample(name, label_names, values, nullptr, FormatMetricValue(c.Value()), out);
}

void AppendChild(const std::string& name, const std::vector<std::string>& label_names,
                 const std::vector<std::string>& values, const Gauge& g, std::string* out) {
  AppendSample(name, label_names, values, nullptr, FormatMetricValue(g.Value()), out);
}

void AppendChild(const std::string& name, const std::vector<std::string>& label_names,
                 const std::vector<std::string>& values, const Histogram& h, std::string* out) {
  const Histogram::Snapshot snap = h.Collect();
  const std::string bucket_name = absl::StrCat(name, "_bucket");
  for (size_t i = 0; i < snap.cumulative_counts.size(); ++i) {
    const std::string le = i < snap.upper_bounds.size() ? FormatMetricValue(snap.upper_bounds[i])
                                                        : FormatMetricValue(INFINITY);
    AppendSample(bucket_name, label_names, values, &le, absl::StrCat(snap.cumulative_counts[i]),
                 out);
  }
  AppendSample(absl::StrCat(name, "_sum"), label_names, values, nullptr,
               FormatMetricValue(snap.sum), out);
  AppendSample(absl::StrCat(name, "_count"), label_names, values, nullptr, absl::StrCat(snap.count),
               out);
}

absl::Status ValidateBuckets(const std::string& name, const std::vector<double>& bounds) {
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metric \"", name, "\": bucket bounds must be finite (the +Inf bucket is implicit)"));
    }
    if (i > 0 && !(bounds[i] > bounds[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric \"", name, "\": bucket bounds must be strictly increasing"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// ---- Counter, Gauge, Histogram ----

void Counter::Increment(double amount) {
  if (!(amount >= 0.0)) return;  // negative or NaN
  value_.fetch_add(amount, std::memory_order_relaxed);
}

double Counter::Value() const { return value_.load(std::memory_order_relaxed); }

void Gauge::Set(double value) { value_.store(value, std::memory_order_relaxed); }
void Gauge::Increment(double amount) { value_.fetch_add(amount, std::memory_order_relaxed); }
void Gauge::Decrement(double amount) { value_.fetch_sub(amount, std::memory_order_relaxed); }
double Gauge::Value() const { return value_.load(std::memory_order_relaxed); }

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)), bucket_counts_(upper_bounds_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  // First bound >= value (`le` is inclusive); NaN lands in +Inf, as in client_golang.
  const size_t bucket = std::isnan(value)
                            ? upper_bounds_.size()
                            : static_cast<size_t>(std::lower_bound(upper_bounds_.begin(),
                                                                   upper_bounds_.end(), value) -
                                                  upper_bounds_.begin());
  absl::MutexLock lock(&mu_);
  ++bucket_counts_[bucket];
  sum_ += value;
}

Histogram::Snapshot Histogram::Collect() const {
  Snapshot snap;
  snap.upper_bounds = upper_bounds_;
  absl::MutexLock lock(&mu_);
  snap.cumulative_counts.reserve(bucket_counts_.size());
  uint64_t running = 0;
  for (uint64_t c : bucket_counts_) {
    running += c;
    snap.cumulative_counts.push_back(running);
  }
  snap.sum = sum_;
  snap.count = running;
  return snap;
}

// ---- Family ----

template <typename T>
Family<T>::Family(std::string name, std::string help, std::vector<std::string> label_names,
                  std::vector<double> bucket_bounds)
    : name_(std::move(name)),
      help_(std::move(help)),
      label_names_(std::move(label_names)),
      bucket_bounds_(std::move(bucket_bounds)) {}

template <typename T>
absl::StatusOr<std::vector<std::string>> Family<T>::LabelValues(const MetricLabels& labels) const {
  std::vector<std::string> values;
  values.reserve(label_names_.size());
  for (const std::string& label : label_names_) {
    auto it = labels.find(label);
    if (it == labels.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric \"", name_, "\": missing label \"", label, "\""));
    }
    values.push_back(it->second);
  }
  if (labels.size() != label_names_.size()) {
    for (const auto& [key, value] : labels) {
      if (std::find(label_names_.begin(), label_names_.end(), key) == label_names_.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("metric \"", name_, "\": unknown label \"", key,
                         "\" (expected: ", absl::StrJoin(label_names_, ", "), ")"));
      }
    }
  }
  return values;
}

template <typename T>
absl::StatusOr<T*> Family<T>::Add(const MetricLabels& labels) {
  absl::StatusOr<std::vector<std::string>> values = LabelValues(labels);
  if (!values.ok()) return values.status();
  absl::MutexLock lock(&mu_);
  std::unique_ptr<T>& child = children_[*std::move(values)];
  if (child == nullptr) {
    if constexpr (std::is_same_v<T, Histogram>) {
      child = std::make_unique<Histogram>(bucket_bounds_);
    } else {
      child = std::make_unique<T>();
    }
  }
  return child.get();
}

template <typename T>
absl::Status Family<T>::Remove(const MetricLabels& labels) {
  absl::StatusOr<std::vector<std::string>> values = LabelValues(labels);
  if (!values.ok()) return values.status();
  absl::MutexLock lock(&mu_);
  if (children_.erase(*values) == 0) {
    return absl::NotFoundError(absl::StrCat("metric \"", name_, "\": no child with labels {",
                                            absl::StrJoin(labels, ",", absl::PairFormatter("=")),
                                            "}"));
  }
  return absl::OkStatus();
}

template <typename T>
size_t Family<T>::size() const {
  absl::MutexLock lock(&mu_);
  return children_.size();
}

template <typename T>
void Family<T>::Serialize(std::string* out) const {
  absl::StrAppend(out, "# HELP ", name_, " ");
  AppendEscapedHelp(help_, out);
  absl::StrAppend(out, "\n# TYPE ", name_, " ", TypeName(TypeOf<T>()), "\n");
  absl::MutexLock lock(&mu_);
  for (const auto& [values, child] : children_) {
    AppendChild(name_, label_names_, values, *child, out);
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

// ---- MetricsRegistry ----

template <typename T>
absl::StatusOr<Family<T>*> MetricsRegistry::GetOrCreate(MetricType type, const std::string& name,
                                                        const std::string& help,
                                                        const std::vector<std::string>& label_names,
                                                        const std::vector<double>& bucket_bounds) {
  if (absl::Status s = ValidateMetricName(name); !s.ok()) return s;
  std::set<std::string> seen;
  for (const std::string& label : label_names) {
    if (absl::Status s = ValidateLabelName(name, label); !s.ok()) return s;
    if (type == MetricType::kHistogram && label == "le") {
      return absl::InvalidArgumentError(absl::StrCat(
          "metric \"", name, "\": label name \"le\" is reserved for histogram buckets"));
    }
    if (!seen.insert(label).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric \"", name, "\": duplicate label name \"", label, "\""));
    }
  }
  if (type == MetricType::kHistogram) {
    if (absl::Status s = ValidateBuckets(name, bucket_bounds); !s.ok()) return s;
  }

  absl::MutexLock lock(&mu_);
  auto it = families_.find(name);
  if (it != families_.end()) {
    if (it->second.type != type) {
      return absl::AlreadyExistsError(absl::StrCat(
          "metric \"", name, "\" is already registered as a ", TypeName(it->second.type)));
    }
    auto* existing = static_cast<Family<T>*>(it->second.family.get());
    if (existing->help() != help || existing->label_names() != label_names ||
        existing->bucket_bounds() != bucket_bounds) {
      return absl::AlreadyExistsError(absl::StrCat(
          "metric \"", name, "\" is already registered with different help, labels or buckets"));
    }
    return existing;
  }
  // A histogram's series names must not collide with another family's name, either way round.
  for (const char* suffix : kHistogramSuffixes) {
    if (type == MetricType::kHistogram) {
      const std::string series = absl::StrCat(name, suffix);
      if (families_.count(series) > 0) {
        return absl::AlreadyExistsError(
            absl::StrCat("histogram \"", name, "\" clashes with metric \"", series, "\""));
      }
    }
    const std::string s = suffix;
    if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) {
      auto base = families_.find(name.substr(0, name.size() - s.size()));
      if (base != families_.end() && base->second.type == MetricType::kHistogram) {
        return absl::AlreadyExistsError(
            absl::StrCat("metric \"", name, "\" clashes with histogram \"", base->first, "\""));
      }
    }
  }
  auto family = std::make_unique<Family<T>>(name, help, label_names, bucket_bounds);
  Family<T>* raw = family.get();
  families_.emplace(name, Entry{type, std::move(family)});
  return raw;
}

absl::StatusOr<Family<Counter>*> MetricsRegistry::CounterFamily(
    const std::string& name, const std::string& help, const std::vector<std::string>& label_names) {
  return GetOrCreate<Counter>(MetricType::kCounter, name, help, label_names, {});
}

absl::StatusOr<Family<Gauge>*> MetricsRegistry::GaugeFamily(
    const std::string& name, const std::string& help, const std::vector<std::string>& label_names) {
  return GetOrCreate<Gauge>(MetricType::kGauge, name, help, label_names, {});
}

absl::StatusOr<Family<Histogram>*> MetricsRegistry::HistogramFamily(
    const std::string& name, const std::string& help, const std::vector<std::string>& label_names,
    const std::vector<double>& bucket_bounds) {
  return GetOrCreate<Histogram>(MetricType::kHistogram, name, help, label_names, bucket_bounds);
}

std::string MetricsRegistry::Serialize() const {
  std::string out;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, entry] : families_) entry.family->Serialize(&out);
  return out;
}

// ---- Free functions ----

absl::Status ValidateMetricName(const std::string& name) {
  bool ok = !name.empty();
  for (size_t i = 0; ok && i < name.size(); ++i) {
    const char c = name[i];
    ok = IsAsciiLetter(c) || c == '_' || c == ':' || (i > 0 && IsAsciiDigit(c));
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid metric name \"", name, "\": must match [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLabelName(const std::string& metric_name, const std::string& label_name) {
  bool ok = !label_name.empty();
  for (size_t i = 0; ok && i < label_name.size(); ++i) {
    const char c = label_name[i];
    ok = IsAsciiLetter(c) || c == '_' || (i > 0 && IsAsciiDigit(c));
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("metric \"", metric_name,
                                                   "\": invalid label name \"", label_name,
                                                   "\": must match [a-zA-Z_][a-zA-Z0-9_]*"));
  }
  if (label_name.rfind("__", 0) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("metric \"", metric_name, "\": label name \"",
                                                   label_name,
                                                   "\" is reserved (names starting with __)"));
  }
  return absl::OkStatus();
}

std::string FormatMetricValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buf[64];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), value);
  return std::string(buf, r.ptr);
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> bounds;
  double bound = start;
  for (int i = 0; i < count; ++i) {
    bounds.push_back(bound);
    bound *= factor;
  }
  return bounds;
}

std::vector<double> LinearBuckets(double start, double width, int count) {
  std::vector<double> bounds;
  for (int i = 0; i < count; ++i) bounds.push_back(start + width * i);
  return bounds;
}

absl::StatusOr<int64_t> ReadRssBytes(pid_t pid) {
  const std::string path =
      pid == 0 ? std::string("/proc/self/statm") : absl::StrCat("/proc/", pid, "/statm");
  // Plain read(2): reading the file of a process that exits meanwhile fails with ESRCH, which
  // std::filebuf would turn into an exception.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  char buf[256];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  buf[n] = '\0';
  long long size_pages = 0, resident_pages = 0;
  if (std::sscanf(buf, "%lld %lld", &size_pages, &resident_pages) != 2) {
    return absl::InternalError(absl::StrCat("cannot parse ", path));
  }
  return static_cast<int64_t>(resident_pages) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

absl::Status UpdateRssGauge(Gauge* gauge) {
  absl::StatusOr<int64_t> rss = ReadRssBytes();
  if (!rss.ok()) return rss.status();
  gauge->Set(static_cast<double>(*rss));
  return absl::OkStatus();
}

}  // namespace spindle
