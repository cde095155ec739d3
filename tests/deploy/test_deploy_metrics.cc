// deploy/ against live daemons: a real spindle-coordinator and spindle-worker on 127.0.0.1 run a
// tiny two-rank CPU job, then
//  - every metric name used by deploy/grafana/*.json and deploy/prometheus/alerts.yml is exported
//    by one of their /metrics endpoints (histograms through _bucket/_sum/_count);
//  - the dashboards are well formed (a datasource variable every panel uses; the job view
//    selectable by job_id and rank);
//  - a real Prometheus running deploy/prometheus/prometheus.yml (intervals shortened, targets
//    pointed at the daemons) scrapes both with `job` left to the scrape config and `job_id` on
//    the per-job series, loads the alert rules, and runs every dashboard and alert query;
//  - spindle-healthcheck reports both daemons healthy.
#include <httplib.h>

#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/common/prometheus_server.h"
#include "tests/integration/cluster_harness.h"

#ifndef SPINDLE_SOURCE_DIR
#error "SPINDLE_SOURCE_DIR must name the repository root"
#endif

namespace spindle {
namespace {

using ::spindle::testing::ClusterHarness;
using ::spindle::testing::FindTestProgram;
using ::spindle::testing::FreePort;
using ::spindle::testing::ScratchDir;

const std::string kRoot = SPINDLE_SOURCE_DIR;

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Every PromQL expression of a dashboard: panel targets' `expr` and the queries of its query
// variables (the datasource variable's "prometheus" is a plugin type, not a query).
void CollectDashboardExprs(const nlohmann::json& node, std::vector<std::string>* out) {
  if (node.is_object()) {
    if (node.value("type", "") == "query" && node.contains("query")) {
      const nlohmann::json& q = node["query"];
      out->push_back(q.is_object() ? q.value("query", "") : q.get<std::string>());
    }
    for (const auto& [key, value] : node.items()) {
      if (key == "expr" && value.is_string()) out->push_back(value.get<std::string>());
      CollectDashboardExprs(value, out);
    }
  } else if (node.is_array()) {
    for (const auto& v : node) CollectDashboardExprs(v, out);
  }
}

std::vector<std::string> DashboardFiles() {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(kRoot + "/deploy/grafana")) {
    if (e.path().extension() == ".json") files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

struct RuleFile {
  std::vector<std::string> exprs;
  std::set<std::string> records;  // names defined by recording rules
};

// The `expr:` and `record:` values of a Prometheus rule file (inline or `>-` / `|` blocks).
RuleFile ParseRuleFile(const std::string& text) {
  RuleFile rules;
  std::vector<std::string> lines = absl::StrSplit(text, '\n');
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& line = lines[i];
    const size_t indent = line.find_first_not_of(' ');
    if (indent == std::string::npos) continue;
    absl::string_view rest = absl::string_view(line).substr(indent);
    absl::ConsumePrefix(&rest, "- ");
    if (absl::ConsumePrefix(&rest, "record:")) {
      rules.records.insert(std::string(absl::StripAsciiWhitespace(rest)));
      continue;
    }
    if (!absl::ConsumePrefix(&rest, "expr:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    if (rest == ">-" || rest == "|" || rest == ">" || rest == "|-") {
      std::string expr;
      while (i + 1 < lines.size()) {
        const std::string& next = lines[i + 1];
        const size_t next_indent = next.find_first_not_of(' ');
        if (next_indent != std::string::npos && next_indent <= indent) break;
        absl::StrAppend(&expr, absl::StripAsciiWhitespace(next), "\n");
        ++i;
      }
      rules.exprs.push_back(expr);
    } else {
      rules.exprs.push_back(std::string(rest));
    }
  }
  return rules;
}

// Metric names referenced by a PromQL expression (Grafana variables allowed).
std::set<std::string> MetricNames(const std::string& expr) {
  static const std::set<std::string> kKeywords = {
      "by", "without", "on",     "ignoring", "group_left", "group_right", "and",
      "or", "unless",  "offset", "bool",     "inf",        "nan"};
  std::string e = expr;
  // label_values(metric, label) in variable queries: keep the metric.
  e = std::regex_replace(
      e, std::regex(R"(label_values\(\s*([A-Za-z_:][\w:]*)(\{[^}]*\})?\s*,\s*\w+\s*\))"), "$1");
  e = std::regex_replace(e, std::regex(R"("([^"\\]|\\.)*")"), "\"\"");
  e = std::regex_replace(e, std::regex(R"(\{[^}]*\})"), " ");
  e = std::regex_replace(e, std::regex(R"(\[[^\]]*\])"), " ");
  e = std::regex_replace(
      e, std::regex(R"(\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\))"), " ");
  std::set<std::string> names;
  size_t i = 0;
  while (i < e.size()) {
    const char c = e[i];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      while (i < e.size() && (std::isalnum(static_cast<unsigned char>(e[i])) || e[i] == '.')) ++i;
      continue;
    }
    if (c == '$') {  // a Grafana variable
      ++i;
      while (i < e.size() && (std::isalnum(static_cast<unsigned char>(e[i])) || e[i] == '_')) ++i;
      continue;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':') {
      size_t j = i;
      while (j < e.size() &&
             (std::isalnum(static_cast<unsigned char>(e[j])) || e[j] == '_' || e[j] == ':'))
        ++j;
      const std::string word = e.substr(i, j - i);
      size_t k = j;
      while (k < e.size() && e[k] == ' ') ++k;
      const bool call = k < e.size() && e[k] == '(';
      if (!call && !kKeywords.count(word)) names.insert(word);
      i = j;
      continue;
    }
    ++i;
  }
  return names;
}

// Families declared on a /metrics page (name -> type) and the names that carry samples.
struct Exposition {
  std::map<std::string, std::string> types;
  std::set<std::string> sampled;
};

Exposition ParseExposition(const std::string& text) {
  Exposition out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ');
      if (parts.size() == 2) out.types[parts[0]] = parts[1];
      continue;
    }
    if (line.empty() || line[0] == '#') continue;
    const size_t end = line.find_first_of("{ ");
    out.sampled.insert(std::string(line.substr(0, end)));
  }
  return out;
}

// The family a sample name belongs to: histogram suffixes map to the histogram's name.
std::string FamilyOf(const std::string& name, const std::map<std::string, std::string>& types) {
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    absl::string_view base = name;
    if (absl::ConsumeSuffix(&base, suffix)) {
      auto it = types.find(std::string(base));
      if (it != types.end() && it->second == "histogram") return std::string(base);
    }
  }
  return name;
}

std::string Get(int port, const std::string& path) {
  httplib::Client client("127.0.0.1", port);
  httplib::Result res = client.Get(path);
  return res && res->status == 200 ? res->body : "";
}

int RunCommand(const std::string& command, std::string* output) {
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  char buf[512];
  output->clear();
  while (size_t n = std::fread(buf, 1, sizeof(buf), p)) output->append(buf, n);
  const int status = ::pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Replaces Grafana's variables by values Prometheus accepts.
std::string Instantiate(std::string expr, const std::string& job_id) {
  return absl::StrReplaceAll(
      expr,
      {{"$__rate_interval", "20s"}, {"$__range", "5m"}, {"$job_id", job_id}, {"$rank", ".*"}});
}

class DeployMetricsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::string(SPINDLE_COORDINATOR_BINARY).empty() ||
        std::string(SPINDLE_WORKER_BINARY).empty() || std::string(SPINDLE_TRAIN_BINARY).empty()) {
      return;
    }
    dir_ = new ScratchDir("spindle-deploy");
    cluster_ = new ClusterHarness(dir_);
    coordinator_metrics_port_ = FreePort();
    worker_metrics_port_ = FreePort();
    cluster_->UseToken("deploy-test-token");
    cluster_->UseCoordinatorMetricsPort(coordinator_metrics_port_);
    if (!cluster_->StartCoordinator({"--heartbeat_interval=0.2", "--heartbeat_timeout=2"})) return;
    if (!cluster_->StartWorker("w0", 2, SPINDLE_TRAIN_BINARY, {},
                               {absl::StrCat("--metrics_port=", worker_metrics_port_),
                                "--metrics_host=127.0.0.1", "--advertise_host=127.0.0.1"})) {
      return;
    }
    if (!cluster_->WaitForWorkers(1)) return;
    // Two data-parallel ranks, so the gradient all-reduce fills the comm series.
    absl::StatusOr<std::string> id = cluster_->Submit(absl::StrCat(
        R"({"name":"m","model":{"preset":"tiny"},"data":{"source":"synthetic:recall"},)",
        R"("seq_len":256,"parallel":{"cp":1,"dp":2},"train":{"steps":3},)",
        R"("checkpoint":{"dir":")", dir_->File("ckpt"), R"(","every":3},)",
        R"("resources":"cpu","max_restarts":0})"));
    if (!id.ok()) return;
    job_id_ = *id;
    auto job = cluster_->WaitJob(
        job_id_,
        [](const v1::Job& j) {
          return j.state() == v1::JOB_STATE_SUCCEEDED || j.state() == v1::JOB_STATE_FAILED;
        },
        std::chrono::seconds(240));
    job_succeeded_ = job && job->state() == v1::JOB_STATE_SUCCEEDED;
  }
  static void TearDownTestSuite() {
    delete cluster_;
    delete dir_;
    cluster_ = nullptr;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (cluster_ == nullptr) GTEST_SKIP() << "spindle-coordinator, -worker or -train not built";
    ASSERT_TRUE(job_succeeded_) << "the tiny job did not succeed; logs:\n" << cluster_->Logs();
  }

  static inline ScratchDir* dir_ = nullptr;
  static inline ClusterHarness* cluster_ = nullptr;
  static inline int coordinator_metrics_port_ = 0;
  static inline int worker_metrics_port_ = 0;
  static inline std::string job_id_;
  static inline bool job_succeeded_ = false;
};

TEST_F(DeployMetricsTest, EveryMetricInDashboardsAndRulesIsExported) {
  const Exposition coordinator = ParseExposition(Get(coordinator_metrics_port_, "/metrics"));
  const Exposition worker = ParseExposition(Get(worker_metrics_port_, "/metrics"));
  ASSERT_FALSE(coordinator.types.empty());
  ASSERT_FALSE(worker.types.empty());

  std::map<std::string, std::set<std::string>> used;  // name -> files using it
  for (const std::string& file : DashboardFiles()) {
    std::vector<std::string> exprs;
    CollectDashboardExprs(nlohmann::json::parse(Slurp(file)), &exprs);
    ASSERT_FALSE(exprs.empty()) << file;
    for (const std::string& e : exprs)
      for (const std::string& n : MetricNames(e)) used[n].insert(file);
  }
  const RuleFile rules = ParseRuleFile(Slurp(kRoot + "/deploy/prometheus/alerts.yml"));
  ASSERT_GE(rules.exprs.size(), 8u);
  for (const std::string& e : rules.exprs)
    for (const std::string& n : MetricNames(e)) used[n].insert("alerts.yml");
  ASSERT_GE(used.size(), 15u);

  const std::set<std::string> kPrometheusOwn = {"up"};
  for (const auto& [name, files] : used) {
    if (kPrometheusOwn.count(name) || rules.records.count(name)) continue;
    const bool exported = coordinator.types.count(FamilyOf(name, coordinator.types)) > 0 ||
                          worker.types.count(FamilyOf(name, worker.types)) > 0;
    EXPECT_TRUE(exported) << name << " (used by " << absl::StrJoin(files, ", ")
                          << ") is exported by neither the coordinator nor the worker";
  }

  // What a CPU job produces carries samples, labelled by job_id and rank. (The CPU trainer
  // reports no MFU and no device memory: those families are declared, without samples.)
  const std::string page = Get(worker_metrics_port_, "/metrics");
  for (const char* name :
       {"spindle_tokens_per_second", "spindle_step_seconds_bucket", "spindle_loss",
        "spindle_training_step", "spindle_host_rss_bytes", "spindle_comm_seconds_total",
        "spindle_comm_bytes_total", "spindle_restarts_total"}) {
    EXPECT_NE(page.find(absl::StrCat(name, "{job_id=\"", job_id_, "\",rank=\"1\"")),
              std::string::npos)
        << name << " has no sample for rank 1 of job " << job_id_ << ":\n"
        << page;
  }
  EXPECT_EQ(page.find("{job=\""), std::string::npos) << "a series still labelled `job`";
}

TEST_F(DeployMetricsTest, DashboardsHaveADatasourceVariableAndTheJobViewSelectsJobAndRank) {
  for (const std::string& file : DashboardFiles()) {
    SCOPED_TRACE(file);
    const nlohmann::json d = nlohmann::json::parse(Slurp(file));
    std::map<std::string, nlohmann::json> vars;
    for (const auto& v : d["templating"]["list"]) vars[v["name"]] = v;
    ASSERT_TRUE(vars.count("datasource"));
    EXPECT_EQ(vars["datasource"]["type"], "datasource");
    EXPECT_EQ(vars["datasource"]["query"], "prometheus");
    std::set<int> ids;
    for (const auto& p : d["panels"]) {
      EXPECT_TRUE(ids.insert(p["id"].get<int>()).second) << "duplicate panel id " << p["id"];
      if (p["type"] == "row") continue;
      EXPECT_EQ(p["datasource"]["uid"], "${datasource}") << p["title"];
      ASSERT_FALSE(p["targets"].empty()) << p["title"];
      for (const auto& t : p["targets"]) EXPECT_EQ(t["datasource"]["uid"], "${datasource}");
    }
    if (d["uid"] == "spindle-job") {
      ASSERT_TRUE(vars.count("job_id"));
      ASSERT_TRUE(vars.count("rank"));
      EXPECT_TRUE(vars["rank"]["multi"].get<bool>());
      EXPECT_TRUE(vars["rank"]["includeAll"].get<bool>());
      for (const auto& p : d["panels"]) {
        for (const auto& t : p.value("targets", nlohmann::json::array())) {
          EXPECT_NE(t["expr"].get<std::string>().find("job_id=\"$job_id\""), std::string::npos)
              << p["title"] << ": not restricted to the selected job";
        }
      }
    }
  }
}

TEST_F(DeployMetricsTest, PrometheusWithTheShippedConfigScrapesBothAndRunsEveryQuery) {
  absl::StatusOr<std::string> prometheus = FindTestProgram("prometheus");
  ASSERT_TRUE(prometheus.ok()) << prometheus.status();
  absl::StatusOr<int> port = ::spindle::testing::PickFreePort();
  ASSERT_TRUE(port.ok());
  ScratchDir prom_dir("spindle-deploy-prometheus");
  // deploy/prometheus as shipped, with second-long intervals so the test is quick.
  std::string config = Slurp(kRoot + "/deploy/prometheus/prometheus.yml");
  config = absl::StrReplaceAll(config, {{"scrape_interval: 15s", "scrape_interval: 1s"},
                                        {"scrape_timeout: 10s", "scrape_timeout: 1s"},
                                        {"evaluation_interval: 15s", "evaluation_interval: 1s"},
                                        {"refresh_interval: 1m", "refresh_interval: 1s"}});
  std::ofstream(prom_dir.File("prometheus.yml")) << config;
  std::ofstream(prom_dir.File("alerts.yml")) << Slurp(kRoot + "/deploy/prometheus/alerts.yml");
  std::filesystem::create_directory(prom_dir.File("targets"));
  std::ofstream(prom_dir.File("targets/coordinator.json"))
      << "[{\"targets\": [\"127.0.0.1:" << coordinator_metrics_port_ << "\"]}]\n";
  std::ofstream(prom_dir.File("targets/workers.json"))
      << "[{\"targets\": [\"127.0.0.1:" << worker_metrics_port_ << "\"]}]\n";

  SubprocessOptions options;
  options.stdout_path = prom_dir.File("prometheus.log");
  options.stderr_path = options.stdout_path;
  auto process = Subprocess::Spawn(
      {*prometheus, "--config.file=" + prom_dir.File("prometheus.yml"),
       "--storage.tsdb.path=" + prom_dir.File("data"),
       absl::StrCat("--web.listen-address=127.0.0.1:", *port), "--log.level=warn"},
      options);
  ASSERT_TRUE(process.ok()) << process.status();
  httplib::Client client("127.0.0.1", *port);
  auto query = [&](const std::string& promql) -> nlohmann::json {
    httplib::Result res =
        client.Get(absl::StrCat("/api/v1/query?query=", ::spindle::testing::UrlEncode(promql)));
    if (!res) return nlohmann::json();
    return nlohmann::json::parse(res->body, nullptr, false);
  };
  auto wait_for = [&](const std::string& promql) {
    for (int i = 0; i < 120; ++i) {
      nlohmann::json r = query(promql);
      if (r.is_object() && r.value("status", "") == "success" && !r["data"]["result"].empty())
        return r["data"]["result"];
      absl::SleepFor(absl::Milliseconds(250));
    }
    return nlohmann::json::array();
  };

  // The scrape jobs are named by the config; the training job is the job_id label.
  EXPECT_FALSE(wait_for(R"(up{job="spindle-coordinator"} == 1)").empty())
      << Slurp(prom_dir.File("prometheus.log"));
  EXPECT_FALSE(wait_for(R"(up{job="spindle-worker"} == 1)").empty());
  const nlohmann::json step = wait_for(
      absl::StrCat(R"(spindle_training_step{job="spindle-worker",job_id=")", job_id_, "\"}"));
  ASSERT_EQ(step.size(), 2u) << step.dump();
  EXPECT_EQ(step[0]["value"][1], "3");
  EXPECT_FALSE(
      wait_for(R"(spindle_jobs{job="spindle-coordinator",state="succeeded"} == 1)").empty());
  absl::SleepFor(absl::Seconds(3));  // a few samples, so rate() has something to compare

  // The alert rules are loaded and evaluate without errors.
  nlohmann::json rules;
  for (int i = 0; i < 40; ++i) {
    httplib::Result res = client.Get("/api/v1/rules");
    if (res) rules = nlohmann::json::parse(res->body, nullptr, false);
    int evaluated = 0;
    if (rules.is_object()) {
      for (const auto& g : rules["data"]["groups"])
        for (const auto& r : g["rules"]) evaluated += r.value("health", "") == "ok" ? 1 : 0;
    }
    if (evaluated == 9) break;
    absl::SleepFor(absl::Milliseconds(250));
  }
  int ok_rules = 0;
  for (const auto& g : rules["data"]["groups"]) {
    for (const auto& r : g["rules"]) {
      EXPECT_EQ(r.value("health", ""), "ok") << r.dump();
      ok_rules += r.value("health", "") == "ok";
    }
  }
  EXPECT_EQ(ok_rules, 9);  // the alerts of deploy/prometheus/alerts.yml

  // Every dashboard query and every alert expression runs against the scraped series.
  std::vector<std::string> exprs;
  for (const std::string& file : DashboardFiles()) {
    CollectDashboardExprs(nlohmann::json::parse(Slurp(file)), &exprs);
  }
  for (const std::string& e : ParseRuleFile(Slurp(kRoot + "/deploy/prometheus/alerts.yml")).exprs)
    exprs.push_back(e);
  int with_data = 0;
  for (const std::string& raw : exprs) {
    if (raw.rfind("label_values(", 0) == 0) continue;  // a Grafana function, not PromQL
    const std::string promql = Instantiate(raw, job_id_);
    nlohmann::json r = query(promql);
    ASSERT_TRUE(r.is_object()) << promql;
    EXPECT_EQ(r.value("status", ""), "success") << promql << "\n" << r.dump();
    with_data += r.is_object() && !r["data"]["result"].empty();
  }
  // Most panels show data for a finished two-rank CPU job (not MFU, device memory, restarts).
  EXPECT_GE(with_data, static_cast<int>(exprs.size()) / 2) << with_data << " of " << exprs.size();
}

TEST_F(DeployMetricsTest, HealthcheckReportsBothDaemonsHealthy) {
  ASSERT_FALSE(std::string(SPINDLE_HEALTHCHECK_BINARY).empty());
  std::string out;
  EXPECT_EQ(RunCommand(absl::StrCat(SPINDLE_HEALTHCHECK_BINARY, " --grpc ", cluster_->address(),
                                    " --tls_ca_file ", cluster_->ca_file()),
                       &out),
            0)
      << out;
  EXPECT_EQ(out, absl::StrCat(cluster_->address(), ": SERVING\n"));
  EXPECT_EQ(RunCommand(absl::StrCat(SPINDLE_HEALTHCHECK_BINARY,
                                    " --http 127.0.0.1:", worker_metrics_port_),
                       &out),
            0)
      << out;
  EXPECT_EQ(
      RunCommand(absl::StrCat(SPINDLE_HEALTHCHECK_BINARY, " --grpc ", cluster_->address(),
                              " --tls_ca_file ", cluster_->ca_file(), " --service no.such.Service"),
                 &out),
      1)
      << out;
  EXPECT_EQ(RunCommand(SPINDLE_HEALTHCHECK_BINARY, &out), 2) << out;
}

TEST(MetricNamesTest, ExtractsMetricsNotFunctionsLabelsOrVariables) {
  EXPECT_EQ(
      MetricNames(
          R"(histogram_quantile(0.9, sum by (le) (rate(spindle_step_seconds_bucket{job_id="$job_id", rank=~"$rank"}[$__rate_interval]))))"),
      std::set<std::string>{"spindle_step_seconds_bucket"});
  EXPECT_EQ(MetricNames("max by (instance) (a_b) > 0 unless on (instance) max(c:d[10m]) * 1e12"),
            (std::set<std::string>{"a_b", "c:d"}));
  EXPECT_EQ(MetricNames("label_values(spindle_training_step{job_id=\"$job_id\"}, rank)"),
            std::set<std::string>{"spindle_training_step"});
  EXPECT_EQ(MetricNames("x / on () group_left () y offset 5m"), (std::set<std::string>{"x", "y"}));
}

TEST(RuleFileTest, ReadsInlineAndBlockExpressionsAndRecords) {
  const RuleFile r = ParseRuleFile(
      "groups:\n  - name: g\n    rules:\n      - record: a:b\n        expr: vector(1)\n"
      "      - alert: A\n        expr: >-\n          x > 0\n          and y\n        for: 1m\n");
  EXPECT_EQ(r.records, std::set<std::string>{"a:b"});
  ASSERT_EQ(r.exprs.size(), 2u);
  EXPECT_EQ(r.exprs[0], "vector(1)");
  EXPECT_EQ(r.exprs[1], "x > 0\nand y\n");
}

}  // namespace
}  // namespace spindle
