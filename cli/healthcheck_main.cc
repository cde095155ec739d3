// spindle-healthcheck: the container health check of the Spindle images (deploy/docker/).
//   spindle-healthcheck --grpc 127.0.0.1:7070        coordinator: grpc.health.v1.Health/Check
//   spindle-healthcheck --http 127.0.0.1:9401        worker: GET /healthz of its metrics server
// Exit codes: 0 healthy (SERVING / HTTP 200), 1 unhealthy or unreachable, 2 usage error.
// One line on stdout says what was found.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/time/time.h"
#include "cli/healthcheck.h"
#include "common/daemon_flags.h"
#include "common/pem.h"

ABSL_FLAG(std::string, grpc, "", "host:port of a gRPC server with grpc.health.v1 (coordinator)");
ABSL_FLAG(std::string, service, "", "service name asked about with --grpc; empty: the server");
ABSL_FLAG(std::string, tls_ca_file, "", "PEM roots: connect to --grpc with TLS");
ABSL_FLAG(std::string, http, "", "host:port of an HTTP server with /healthz (worker metrics)");
ABSL_FLAG(std::string, path, "/healthz", "path requested with --http");
ABSL_FLAG(double, timeout, 3.0, "seconds before the probe gives up");

int main(int argc, char** argv) {
  spindle::ParseDaemonFlags(argc, argv,
                            "spindle-healthcheck: exits 0 when a Spindle daemon is healthy.",
                            "spindle-healthcheck --grpc 127.0.0.1:7070   (coordinator)\n"
                            "       spindle-healthcheck --http 127.0.0.1:9401   (worker)",
                            "cli/healthcheck_main.cc");
  const std::string grpc_address = absl::GetFlag(FLAGS_grpc);
  const std::string http_address = absl::GetFlag(FLAGS_http);
  const absl::Duration timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout));
  if (grpc_address.empty() == http_address.empty()) {
    std::fprintf(stderr, "spindle-healthcheck: give exactly one of --grpc and --http\n");
    return 2;
  }
  if (timeout <= absl::ZeroDuration()) {
    std::fprintf(stderr, "spindle-healthcheck: --timeout must be positive\n");
    return 2;
  }

  if (!grpc_address.empty()) {
    spindle::GrpcHealthOptions options;
    options.address = grpc_address;
    options.service = absl::GetFlag(FLAGS_service);
    options.timeout = timeout;
    if (const std::string ca = absl::GetFlag(FLAGS_tls_ca_file); !ca.empty()) {
      absl::StatusOr<std::string> pem =
          spindle::ReadPemFile(ca, spindle::PemKind::kCertificate, "--tls_ca_file");
      if (!pem.ok()) {
        std::fprintf(stderr, "spindle-healthcheck: %s\n",
                     std::string(pem.status().message()).c_str());
        return 2;
      }
      options.tls_ca_pem = *std::move(pem);
    }
    absl::StatusOr<spindle::ServingStatus> status = spindle::CheckGrpcHealth(options);
    if (!status.ok()) {
      std::printf("unhealthy: %s\n", std::string(status.status().message()).c_str());
      return 1;
    }
    std::printf("%s: %s\n", grpc_address.c_str(), spindle::ServingStatusName(*status));
    return *status == spindle::ServingStatus::kServing ? 0 : 1;
  }

  const size_t colon = http_address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(http_address.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    std::fprintf(stderr, "spindle-healthcheck: --http wants host:port, got \"%s\"\n",
                 http_address.c_str());
    return 2;
  }
  absl::Status status = spindle::CheckHttpHealth(http_address.substr(0, colon), port,
                                                 absl::GetFlag(FLAGS_path), timeout);
  if (!status.ok()) {
    std::printf("unhealthy: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  std::printf("%s%s: ok\n", http_address.c_str(), absl::GetFlag(FLAGS_path).c_str());
  return 0;
}
