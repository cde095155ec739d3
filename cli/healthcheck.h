// Health probes for container health checks (`spindle-healthcheck`, deploy/docker/): the
// coordinator's grpc.health.v1.Health/Check and the worker's HTTP /healthz. No generated stubs:
// the two health messages are one optional field each, encoded by hand.
// Thread-safety: the functions are reentrant.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace spindle {

// grpc.health.v1.HealthCheckResponse.ServingStatus.
enum class ServingStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };

const char* ServingStatusName(ServingStatus status);

struct GrpcHealthOptions {
  std::string address;     // host:port
  std::string service;     // "" asks about the server as a whole
  std::string tls_ca_pem;  // non-empty: connect with TLS, trusting these roots
  absl::Duration timeout = absl::Seconds(3);
};

// Calls Health/Check. The serving status the server answered, or the RPC's failure as a status
// (Unavailable when nothing answers, DeadlineExceeded on timeout, NotFound for an unknown
// service, as gRPC reports them).
absl::StatusOr<ServingStatus> CheckGrpcHealth(const GrpcHealthOptions& options);

// GET http://host:port<path>; OK on HTTP 200, Unavailable otherwise (naming the status or the
// connection error).
absl::Status CheckHttpHealth(const std::string& host, int port, const std::string& path,
                             absl::Duration timeout);

// Decodes a HealthCheckResponse (field 1, varint). Exposed for tests.
absl::StatusOr<ServingStatus> DecodeHealthCheckResponse(const std::string& bytes);
// Encodes a HealthCheckRequest for `service`. Exposed for tests.
std::string EncodeHealthCheckRequest(const std::string& service);

}  // namespace spindle
