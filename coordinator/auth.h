// Bearer-token authentication for the coordinator's gRPC services. When a token is configured,
// every JobService, ClusterService and RendezvousService call must carry the metadata
// `authorization: Bearer <token>`; otherwise the call fails with UNAUTHENTICATED before the
// handler does anything. grpc.health.v1.Health stays open for liveness probes.
// Thread-safety: immutable after construction; Check() is safe from any thread.
#pragma once

#include <string>

#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace spindle {

class TokenAuth {
 public:
  // Empty token: authentication disabled, every call passes.
  explicit TokenAuth(std::string token) : token_(std::move(token)) {}

  grpc::Status Check(const grpc::ServerContext& ctx) const;
  bool enabled() const { return !token_.empty(); }

 private:
  const std::string token_;
};

// Constant-time equality (time depends only on the lengths).
bool ConstantTimeEquals(const std::string& a, const std::string& b);

}  // namespace spindle
