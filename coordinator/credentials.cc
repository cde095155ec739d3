// Users' and workers' bearer tokens (see credentials.h).
#include "coordinator/credentials.h"

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "coordinator/auth.h"

namespace spindle {

absl::StatusOr<std::vector<WorkerToken>> ParseWorkerTokens(const std::string& text) {
  std::vector<WorkerToken> out;
  std::set<std::string> seen;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
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

Credentials::Credentials(std::string user_token, std::vector<WorkerToken> worker_tokens)
    : user_token_(std::move(user_token)), worker_tokens_(std::move(worker_tokens)) {}

grpc::Status Credentials::Identify(const grpc::ServerContext& ctx, Caller* caller) const {
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end())
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing authorization metadata (expected \"Bearer <token>\")");
  const std::string value(it->second.data(), it->second.size());
  static constexpr char kPrefix[] = "Bearer ";
  // Every token is compared (in constant time each), whichever matches.
  bool user = !user_token_.empty() && ConstantTimeEquals(value, kPrefix + user_token_);
  const WorkerToken* worker = nullptr;
  for (const WorkerToken& t : worker_tokens_)
    if (ConstantTimeEquals(value, kPrefix + t.token)) worker = &t;
  if (user) {
    caller->kind = Kind::kUser;
  } else if (worker != nullptr) {
    caller->kind = Kind::kWorker;
    caller->worker = worker;
  } else {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token");
  }
  return grpc::Status::OK;
}

grpc::Status Credentials::CheckUser(const grpc::ServerContext& ctx) const {
  if (user_token_.empty()) return grpc::Status::OK;  // users are not authenticated
  Caller c;
  if (grpc::Status s = Identify(ctx, &c); !s.ok()) return s;
  if (c.kind == Kind::kWorker)
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "a worker token cannot call JobService (submit, cancel, list jobs); use "
                        "the users' token");
  return grpc::Status::OK;
}

grpc::Status Credentials::CheckWorker(const grpc::ServerContext& ctx,
                                      const std::string& worker_id) const {
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

grpc::Status Credentials::CheckAny(const grpc::ServerContext& ctx) const {
  if (!enabled()) return grpc::Status::OK;
  Caller c;
  return Identify(ctx, &c);
}

}  // namespace spindle
