// Who may call what on the coordinator.
//
// Users: bearer tokens. --users-file names a user per token (some of them admins); the single
// token of --token-file is one user named "admin", an admin. JobService takes a user's token,
// and so does ClusterService.ListWorkers (`spindle workers`); RevokeWorker takes an admin's.
//
// Workers: with the coordinator's CA (the default of the daemon) a worker is who its client
// certificate says (worker_certificates.h): ClusterService Register and Session need a worker
// certificate naming the worker the call speaks for, and no token opens them. RendezvousService
// then takes no bearer token at all: the attempt's rendezvous token in each call's scope is the
// credential, and trainers hold nothing else. Join takes a bootstrap token instead.
// Without a CA, workers hold bearer tokens (--worker-token-file): cluster-wide or bound to one
// worker id, which Register and Session must then name; without worker tokens the users' token
// opens every service (one shared token); without any token nothing is checked (the coordinator
// then listens on loopback only, unless --insecure, see exposure.h).
// Neither kind of credential opens the other's services.
//
// Thread-safety: immutable after construction (WorkerCertificates is thread-safe); every method
// is safe from any thread.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/users.h"
#include "coordinator/worker_certificates.h"
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

// The name --token-file's holder has as a user.
inline constexpr char kSharedTokenUser[] = "admin";

class Credentials {
 public:
  // Empty `user_token`, no `users` and no `worker_tokens`: bearer tokens are not checked.
  // `certificates` (not owned; may be null) turns on worker certificates.
  Credentials(std::string user_token, std::vector<WorkerToken> worker_tokens,
              std::vector<UserToken> users = {}, WorkerCertificates* certificates = nullptr);

  bool enabled() const {
    return !user_token_.empty() || !users_.empty() || !worker_tokens_.empty() ||
           certificates_ != nullptr;
  }
  bool users_authenticated() const { return !user_token_.empty() || !users_.empty(); }
  bool separate_worker_tokens() const { return !worker_tokens_.empty(); }
  WorkerCertificates* certificates() const { return certificates_; }

  // JobService: a user's token; `user` (may be null) receives who (an admin without a name when
  // users are not authenticated). UNAUTHENTICATED for a missing or unknown token,
  // PERMISSION_DENIED for a worker token.
  grpc::Status CheckUser(const grpc::ServerContext& ctx, User* user = nullptr) const;
  // As CheckUser, and the user must be an admin (PERMISSION_DENIED naming the user otherwise).
  grpc::Status CheckAdmin(const grpc::ServerContext& ctx, const std::string& what,
                          User* user = nullptr) const;
  // ClusterService.Register/Session; `worker_id` is the worker the call speaks for ("" before
  // a Session's hello names it). With certificates: the peer's worker certificate, naming
  // `worker_id` (PERMISSION_DENIED "this certificate belongs to worker A, not to worker B");
  // `certified` (may be null) receives the certificate's worker id. Without: a worker token,
  // bound to `worker_id` if bound at all. UNAUTHENTICATED for a missing, unknown or revoked
  // credential, PERMISSION_DENIED for a user's.
  grpc::Status CheckWorker(const grpc::ServerContext& ctx, const std::string& worker_id,
                           std::string* certified = nullptr) const;
  // RendezvousService: nothing beyond the attempt's token with certificates; a worker token
  // without (CheckWorker with no worker id).
  grpc::Status CheckRendezvous(const grpc::ServerContext& ctx) const;
  // ClusterService.ListWorkers: a user's token or a worker's credential.
  grpc::Status CheckAny(const grpc::ServerContext& ctx) const;

 private:
  enum class Kind { kNone, kUser, kWorker };
  struct Caller {
    Kind kind = Kind::kNone;
    const WorkerToken* worker = nullptr;
    User user;
  };
  // The caller's kind by bearer token; a non-OK status when the metadata is missing or names no
  // known token.
  grpc::Status Identify(const grpc::ServerContext& ctx, Caller* caller) const;

  const std::string user_token_;
  const std::vector<WorkerToken> worker_tokens_;
  const std::vector<UserToken> users_;
  WorkerCertificates* const certificates_;
};

}  // namespace spindle
