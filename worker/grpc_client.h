// Client-side gRPC plumbing shared by the worker daemon and the trainer's rendezvous client:
// channels to the coordinator (plaintext or TLS with a CA file, optionally with a client
// certificate, with keepalive so a vanished
// coordinator is noticed), the bearer token read from a token file, and grpc::Status ->
// absl::Status conversion.
//
// Thread-safety: free functions without shared state; safe from any thread.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/status.h"

namespace spindle {

struct ChannelOptions {
  std::string address;      // host:port
  std::string tls_ca_file;  // PEM roots; empty: plaintext
  // The client certificate (mutual TLS) and its key, PEM; empty: none. Only with tls_ca_file.
  std::string client_cert_pem;
  std::string client_key_pem;
  int keepalive_ms = 10000;
  int keepalive_timeout_ms = 5000;
};

// A channel (not yet connected). InvalidArgument for an empty address, NotFound when the CA file
// cannot be read.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeCoordinatorChannel(const ChannelOptions& options);

// The token in `path` (surrounding whitespace removed). Empty path: empty token. NotFound /
// InvalidArgument (empty file) name the path.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// Adds `authorization: Bearer <token>` unless the token is empty.
void AddBearerToken(grpc::ClientContext* context, const std::string& token);

// Same code, message prefixed with `what` ("rendezvous Get(\"k\"): ...").
absl::Status FromGrpcStatus(const grpc::Status& status, const std::string& what);

}  // namespace spindle
