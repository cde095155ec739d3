// MetricsServer: serves a MetricsRegistry over HTTP (cpp-httplib) for Prometheus to scrape.
//   GET /metrics  -> text exposition format 0.0.4 (Content-Type kExpositionContentType)
//   GET /healthz  -> "ok"
// Limits (no request can hold the server's threads or memory): a request body of more than
// kMetricsMaxBodyBytes is answered 413 without being read, a connection silent (or a client not
// reading) for kMetricsIoTimeoutSeconds is closed, and a kept-alive connection serves at most
// kMetricsMaxKeepAliveRequests requests; headers are capped by cpp-httplib (8 KiB).
// Thread-safety: Start() and Stop() are called by the owner, not concurrently with each other.
// Requests are handled on the server's own threads, which only read the (thread-safe) registry and
// call `before_scrape`; that callback must therefore be thread-safe.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/metrics.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace spindle {

inline constexpr size_t kMetricsMaxBodyBytes = 4096;  // GET /metrics and /healthz take no body
inline constexpr int kMetricsIoTimeoutSeconds = 5;
inline constexpr size_t kMetricsMaxKeepAliveRequests = 100;

class MetricsServer {
 public:
  // `registry` is not owned and must outlive the server. `before_scrape`, if set, runs at the
  // start of every GET /metrics (e.g. to refresh a host RSS gauge with UpdateRssGauge).
  explicit MetricsServer(const MetricsRegistry* registry,
                         std::function<void()> before_scrape = nullptr);
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  ~MetricsServer();  // Stop()s.

  // Binds `host`:`port` (port 0: an ephemeral port) and serves on a background thread until
  // Stop(). Returns the bound port. FailedPrecondition if already running; Unavailable if the
  // address cannot be bound (in use, bad host).
  absl::StatusOr<int> Start(const std::string& host, int port);

  // Stops serving and joins the server thread. Idempotent; the server may be Start()ed again.
  void Stop();

  // The bound port while running, else 0.
  int port() const { return port_; }

 private:
  const MetricsRegistry* const registry_;
  const std::function<void()> before_scrape_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::atomic<bool> listen_returned_{false};
  int port_ = 0;
};

}  // namespace spindle
