// Users' and workers' bearer tokens (see credentials.h).
#include "coordinator/credentials.h"

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "coordinator/auth.h"
#include "coordinator/credential_lines.h"
#include "grpc/grpc_security_constants.h"

namespace spindle {

absl::StatusOr<std::vector<WorkerToken>> ParseWorkerTokens(const std::string& text) {
  std::vector<WorkerToken> out;
  std::set<std::string> seen;
  for (const CredentialLine& l : CredentialLines(text)) {
    const int line_no = l.number;
    const std::vector<std::string>& fields = l.fields;
    if (fields.size() > 2)
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, " has ", fields.size(),
                                                     " fields; expected TOKEN or WORKER_ID TOKEN"));
    WorkerToken t;
    t.token = fields.back();
    if (fields.size() == 2) t.worker_id = fields[0];
    if (!seen.insert(t.token).second)
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_no, " repeats a token of an earlier line"));
    out.push_back(std::move(t));
  }
  if (out.empty()) return absl::InvalidArgumentError("no token in it");
  return out;
}

Credentials::Credentials(std::string user_token, std::vector<WorkerToken> worker_tokens,
                         std::vector<UserToken> users, WorkerCertificates* certificates)
    : user_token_(std::move(user_token)),
      worker_tokens_(std::move(worker_tokens)),
      users_(std::move(users)),
      certificates_(certificates) {}

namespace {

grpc::Status ToGrpcStatus(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// The PEM of the client certificate the peer's TLS handshake presented; "" when none.
std::string PeerCertificate(const grpc::ServerContext& ctx) {
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr) return "";
  std::vector<grpc::string_ref> pem = auth->FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME);
  return pem.empty() ? "" : std::string(pem[0].data(), pem[0].size());
}

}  // namespace

grpc::Status Credentials::Identify(const grpc::ServerContext& ctx, Caller* caller) const {
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end())
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing authorization metadata (expected \"Bearer <token>\")");
  const std::string value(it->second.data(), it->second.size());
  static constexpr char kPrefix[] = "Bearer ";
  // Every token is compared (in constant time each), whichever matches.
  const UserToken* user = nullptr;
  const bool shared = !user_token_.empty() && ConstantTimeEquals(value, kPrefix + user_token_);
  for (const UserToken& u : users_)
    if (ConstantTimeEquals(value, kPrefix + u.token)) user = &u;
  const WorkerToken* worker = nullptr;
  for (const WorkerToken& t : worker_tokens_)
    if (ConstantTimeEquals(value, kPrefix + t.token)) worker = &t;
  if (user != nullptr) {
    caller->kind = Kind::kUser;
    caller->user = user->user;
  } else if (shared) {
    caller->kind = Kind::kUser;
    caller->user = User{kSharedTokenUser, true};
  } else if (worker != nullptr) {
    caller->kind = Kind::kWorker;
    caller->worker = worker;
  } else {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token");
  }
  return grpc::Status::OK;
}

grpc::Status Credentials::CheckUser(const grpc::ServerContext& ctx, User* user) const {
  if (!users_authenticated()) {  // users are not authenticated: everyone may do everything
    if (user != nullptr) *user = User{"", true};
    return grpc::Status::OK;
  }
  Caller c;
  if (grpc::Status s = Identify(ctx, &c); !s.ok()) return s;
  if (c.kind == Kind::kWorker)
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "a worker token cannot call JobService (submit, cancel, list jobs); use "
                        "a user's token");
  if (user != nullptr) *user = c.user;
  return grpc::Status::OK;
}

grpc::Status Credentials::CheckAdmin(const grpc::ServerContext& ctx, const std::string& what,
                                     User* user) const {
  User u;
  if (grpc::Status s = CheckUser(ctx, &u); !s.ok()) return s;
  if (!u.admin)
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat(what, ": user ", u.name, " is not an admin"));
  if (user != nullptr) *user = u;
  return grpc::Status::OK;
}

grpc::Status Credentials::CheckWorker(const grpc::ServerContext& ctx, const std::string& worker_id,
                                      std::string* certified) const {
  if (certificates_ != nullptr) {
    absl::StatusOr<std::string> id = certificates_->WorkerOf(PeerCertificate(ctx));
    if (!id.ok()) return ToGrpcStatus(id.status());
    if (!worker_id.empty() && *id != worker_id)
      return grpc::Status(
          grpc::StatusCode::PERMISSION_DENIED,
          absl::StrCat("this certificate belongs to worker ", *id, ", not to worker ", worker_id));
    if (certified != nullptr) *certified = *id;
    return grpc::Status::OK;
  }
  if (!enabled()) return grpc::Status::OK;
  Caller c;
  if (grpc::Status s = Identify(ctx, &c); !s.ok()) return s;
  if (!separate_worker_tokens()) return grpc::Status::OK;  // the one shared token
  if (c.kind == Kind::kUser)
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "the users' token cannot call ClusterService or RendezvousService; "
                        "workers and their trainers need a worker token (--worker-token-file)");
  if (!worker_id.empty() && !c.worker->worker_id.empty() && c.worker->worker_id != worker_id)
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("this worker token belongs to worker ", c.worker->worker_id,
                                     ", not to worker ", worker_id));
  return grpc::Status::OK;
}

grpc::Status Credentials::CheckRendezvous(const grpc::ServerContext& ctx) const {
  if (certificates_ != nullptr) return grpc::Status::OK;  // the attempt's token decides
  return CheckWorker(ctx, "");
}

grpc::Status Credentials::CheckAny(const grpc::ServerContext& ctx) const {
  if (certificates_ != nullptr && !PeerCertificate(ctx).empty()) return CheckWorker(ctx, "");
  if (!enabled() || (certificates_ != nullptr && !users_authenticated() && worker_tokens_.empty()))
    return grpc::Status::OK;
  Caller c;
  return Identify(ctx, &c);
}

}  // namespace spindle
