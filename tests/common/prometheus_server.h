// Test harness: runs the real `prometheus` binary (Debian package `prometheus`) scraping given
// targets every second, and queries its HTTP API. Header-only so integration tests in other
// folders can include it. Thread-safety: one test thread owns a PrometheusServer.
#pragma once

#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/subprocess.h"

namespace spindle::testing {

// Absolute path of `program` on PATH, or FailedPrecondition naming the fix.
inline absl::StatusOr<std::string> FindTestProgram(const std::string& program) {
  const char* path = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path == nullptr ? "/usr/bin" : path, ':')) {
    const std::string candidate = absl::StrCat(dir, "/", program);
    if (!dir.empty() && ::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return absl::FailedPreconditionError(
      absl::StrCat(program, " not found on PATH: run scripts/setup.sh (it installs the Debian ",
                   "package `prometheus`, which provides prometheus and promtool)"));
}

// A TCP port on 127.0.0.1 that was free a moment ago.
inline absl::StatusOr<int> PickFreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    return absl::InternalError("cannot bind an ephemeral port");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

inline std::string UrlEncode(const std::string& text) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

class PrometheusServer {
 public:
  // Starts prometheus scraping `targets` ("host:port", path /metrics) under job `job` every
  // second, and waits (up to `timeout`) until it reports ready.
  static absl::StatusOr<std::unique_ptr<PrometheusServer>> Start(
      const std::vector<std::string>& targets, const std::string& job,
      absl::Duration timeout = absl::Seconds(30)) {
    absl::StatusOr<std::string> binary = FindTestProgram("prometheus");
    if (!binary.ok()) return binary.status();
    absl::StatusOr<int> port = PickFreePort();
    if (!port.ok()) return port.status();

    std::string dir_template =
        (std::filesystem::temp_directory_path() / "spindle_prometheus_XXXXXX").string();
    if (::mkdtemp(dir_template.data()) == nullptr) {
      return absl::InternalError("mkdtemp failed for the prometheus data directory");
    }
    std::unique_ptr<PrometheusServer> server(new PrometheusServer(dir_template, *port));
    const std::filesystem::path dir = dir_template;
    {
      std::ofstream config(dir / "prometheus.yml");
      config << "global:\n"
             << "  scrape_interval: 1s\n"
             << "  scrape_timeout: 1s\n"
             << "  evaluation_interval: 1s\n"
             << "scrape_configs:\n"
             << "  - job_name: " << job << "\n"
             << "    static_configs:\n"
             << "      - targets: ['" << absl::StrJoin(targets, "', '") << "']\n";
    }
    SubprocessOptions options;
    options.stdout_path = (dir / "prometheus.log").string();
    options.stderr_path = options.stdout_path;
    absl::StatusOr<std::unique_ptr<Subprocess>> process = Subprocess::Spawn(
        {*binary, absl::StrCat("--config.file=", (dir / "prometheus.yml").string()),
         absl::StrCat("--storage.tsdb.path=", (dir / "data").string()),
         absl::StrCat("--web.listen-address=127.0.0.1:", *port), "--log.level=warn"},
        options);
    if (!process.ok()) return process.status();
    server->process_ = *std::move(process);

    const absl::Time deadline = absl::Now() + timeout;
    httplib::Client client("127.0.0.1", *port);
    while (true) {
      httplib::Result res = client.Get("/-/ready");
      if (res && res->status == 200) return server;
      absl::StatusOr<std::optional<int>> exited = server->process_->Poll();
      if (exited.ok() && exited->has_value()) {
        return absl::InternalError(
            absl::StrCat("prometheus exited with code ", **exited, "; log:\n", server->Log()));
      }
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("prometheus not ready after ",
                                                        absl::FormatDuration(timeout), "; log:\n",
                                                        server->Log()));
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  }

  PrometheusServer(const PrometheusServer&) = delete;
  PrometheusServer& operator=(const PrometheusServer&) = delete;
  ~PrometheusServer() {
    process_.reset();  // SIGKILL and reap before deleting its files
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  int port() const { return port_; }

  // Instant query: the `data.result` array (empty when no series match yet).
  absl::StatusOr<nlohmann::json> Query(const std::string& promql) {
    httplib::Client client("127.0.0.1", port_);
    httplib::Result res = client.Get(absl::StrCat("/api/v1/query?query=", UrlEncode(promql)));
    if (!res) return absl::UnavailableError("prometheus query: no response");
    nlohmann::json body = nlohmann::json::parse(res->body, nullptr, /*allow_exceptions=*/false);
    if (res->status != 200 || body.is_discarded() || body.value("status", "") != "success") {
      return absl::InternalError(
          absl::StrCat("prometheus query ", promql, ": HTTP ", res->status, ": ", res->body));
    }
    return body["data"]["result"];
  }

  // Polls Query(promql) until some series satisfies `accept` (default: any series at all).
  // Returns the full result array.
  absl::StatusOr<nlohmann::json> WaitFor(
      const std::string& promql, absl::Duration timeout,
      const std::function<bool(const nlohmann::json& series)>& accept = nullptr) {
    const absl::Time deadline = absl::Now() + timeout;
    std::string last;
    while (true) {
      absl::StatusOr<nlohmann::json> result = Query(promql);
      if (!result.ok()) return result.status();
      for (const nlohmann::json& series : *result) {
        if (!accept || accept(series)) return result;
      }
      last = result->dump();
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "no matching series for ", promql, " after ", absl::FormatDuration(timeout),
            "; last result: ", last, "; prometheus log:\n", Log()));
      }
      absl::SleepFor(absl::Milliseconds(250));
    }
  }

  std::string Log() const {
    std::ifstream in(std::filesystem::path(dir_) / "prometheus.log");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  PrometheusServer(std::string dir, int port) : dir_(std::move(dir)), port_(port) {}

  const std::string dir_;
  const int port_;
  std::unique_ptr<Subprocess> process_;
};

// The sample value of one series in a query result, as Prometheus renders it ("3", "+Inf").
inline std::string SampleValue(const nlohmann::json& series) {
  return series["value"][1].get<std::string>();
}

}  // namespace spindle::testing
