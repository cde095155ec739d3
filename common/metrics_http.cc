// MetricsServer over cpp-httplib. Thread-safety: see metrics_http.h.
#include "common/metrics_http.h"

#include <httplib.h>
#include <sys/socket.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"

namespace spindle {

MetricsServer::MetricsServer(const MetricsRegistry* registry, std::function<void()> before_scrape)
    : registry_(registry), before_scrape_(std::move(before_scrape)) {}

MetricsServer::~MetricsServer() { Stop(); }

absl::StatusOr<int> MetricsServer::Start(const std::string& host, int port) {
  if (server_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("metrics server already running on port ", port_));
  }
  auto server = std::make_unique<httplib::Server>();
  // httplib's default sets SO_REUSEPORT, which lets a second exporter bind the same port and
  // silently take half the scrapes. SO_REUSEADDR alone still allows a quick restart.
  server->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server->set_payload_max_length(kMetricsMaxBodyBytes);
  server->set_read_timeout(kMetricsIoTimeoutSeconds);
  server->set_write_timeout(kMetricsIoTimeoutSeconds);
  server->set_keep_alive_timeout(kMetricsIoTimeoutSeconds);
  server->set_keep_alive_max_count(kMetricsMaxKeepAliveRequests);
  server->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    if (before_scrape_) before_scrape_();
    res.set_content(registry_->Serialize(), kExpositionContentType);
  });
  server->Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain; charset=utf-8");
  });

  int bound = 0;
  if (port == 0) {
    bound = server->bind_to_any_port(host);
  } else if (server->bind_to_port(host, port)) {
    bound = port;
  }
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("metrics server cannot bind ", host, ":", port));
  }

  server_ = std::move(server);
  port_ = bound;
  listen_returned_ = false;
  thread_ = std::thread([this] {
    server_->listen_after_bind();
    listen_returned_ = true;
  });
  // httplib's stop() is a no-op until the accept loop has started: wait for it, so that a Stop()
  // right after Start() cannot leave the thread listening forever.
  while (!server_->is_running() && !listen_returned_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return bound;
}

void MetricsServer::Stop() {
  if (server_ == nullptr) return;
  server_->stop();
  if (thread_.joinable()) thread_.join();
  server_.reset();
  port_ = 0;
}

}  // namespace spindle
