// Who may call what on the coordinator. Two kinds of bearer tokens: the users' token
// (--token_file: JobService, and ClusterService.ListWorkers for `spindle workers`) and the
// workers' tokens (--worker_token_file: ClusterService Register/Session/ListWorkers and
// RendezvousService, which worker daemons and the trainers they start call). A worker token is
// either cluster-wide (any worker id) or bound to one worker id, which its Register and Session
// must then name. Neither kind opens the other's services.
//
// Without worker tokens the users' token opens every service (one shared token, as before);
// without any token nothing is checked (the coordinator then listens on loopback only, unless
// --insecure, see exposure.h).
// Thread-safety: immutable after construction; every method is safe from any thread.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace spindle {

struct WorkerToken {
  std::string worker_id;  // empty: any worker
  std::string token;
};

// The contents of a --worker_token_file: one token a line ("TOKEN": any worker, or
// "WORKER_ID TOKEN": that worker only); blank lines and lines starting with '#' are skipped.
// InvalidArgument naming the line for a line of more than two fields, a repeated token, or a
// file with no token.
absl::StatusOr<std::vector<WorkerToken>> ParseWorkerTokens(const std::string& text);

class Credentials {
 public:
  // Empty `user_token` and no `worker_tokens`: authentication disabled, every call passes.
  Credentials(std::string user_token, std::vector<WorkerToken> worker_tokens);

  bool enabled() const { return !user_token_.empty() || !worker_tokens_.empty(); }
  bool separate_worker_tokens() const { return !worker_tokens_.empty(); }

  // JobService: the users' token. UNAUTHENTICATED for a missing or unknown token,
  // PERMISSION_DENIED for a worker token.
  grpc::Status CheckUser(const grpc::ServerContext& ctx) const;
  // ClusterService.Register/Session (`worker_id`: the worker the call speaks for) and
  // RendezvousService (`worker_id` empty): a worker token, bound to `worker_id` if bound at all.
  // UNAUTHENTICATED for a missing or unknown token, PERMISSION_DENIED for the users' token or a
  // token of another worker.
  grpc::Status CheckWorker(const grpc::ServerContext& ctx, const std::string& worker_id) const;
  // ClusterService.ListWorkers: either kind.
  grpc::Status CheckAny(const grpc::ServerContext& ctx) const;

 private:
  enum class Kind { kNone, kUser, kWorker };
  struct Caller {
    Kind kind = Kind::kNone;
    const WorkerToken* worker = nullptr;
  };
  // The caller's kind; a non-OK status when the metadata is missing or names no known token.
  grpc::Status Identify(const grpc::ServerContext& ctx, Caller* caller) const;

  const std::string user_token_;
  const std::vector<WorkerToken> worker_tokens_;
};

}  // namespace spindle
