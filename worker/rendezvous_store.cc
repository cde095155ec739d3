// RendezvousStore (see rendezvous_store.h).
#include "worker/rendezvous_store.h"

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "worker/grpc_client.h"

namespace spindle {
namespace {

constexpr absl::Duration kRpcSlack = absl::Seconds(5);  // beyond the server-side wait
constexpr absl::Duration kMinBackoff = absl::Milliseconds(100);
constexpr absl::Duration kMaxBackoff = absl::Seconds(2);

void SleepBackoff(absl::Duration* backoff, absl::Time deadline) {
  const absl::Duration sleep = std::min(*backoff, std::max(absl::ZeroDuration(), deadline - absl::Now()));
  std::this_thread::sleep_for(absl::ToChronoNanoseconds(sleep));
  *backoff = std::min(*backoff * 2, kMaxBackoff);
}

}  // namespace

RendezvousOptions WithTrainerEnvironment(RendezvousOptions options) {
  if (options.rendezvous_token.empty()) {
    if (const char* v = std::getenv("SPINDLE_RENDEZVOUS_TOKEN"); v != nullptr) {
      options.rendezvous_token = v;
    }
  }
  if (options.tls_ca_file.empty()) {
    if (const char* v = std::getenv("SPINDLE_TLS_CA_FILE"); v != nullptr) options.tls_ca_file = v;
  }
  return options;
}

absl::StatusOr<std::unique_ptr<RendezvousStore>> RendezvousStore::Connect(
    const RendezvousOptions& options) {
  if (options.address.empty()) return absl::InvalidArgumentError("rendezvous: address is empty");
  if (options.job_id.empty()) return absl::InvalidArgumentError("rendezvous: job_id is empty");
  if (options.attempt < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous: attempt must be >= 1, got ", options.attempt));
  }
  std::string bearer = options.bearer_token;
  if (bearer.empty() && !options.bearer_token_file.empty()) {
    absl::StatusOr<std::string> token = ReadTokenFile(options.bearer_token_file);
    if (!token.ok()) return token.status();
    bearer = *std::move(token);
  }
  ChannelOptions channel_options;
  channel_options.address = options.address;
  channel_options.tls_ca_file = options.tls_ca_file;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeCoordinatorChannel(channel_options);
  if (!channel.ok()) return channel.status();
  return std::unique_ptr<RendezvousStore>(new RendezvousStore(
      options, std::move(bearer), v1::RendezvousService::NewStub(*channel)));
}

RendezvousStore::RendezvousStore(RendezvousOptions options, std::string bearer_token,
                                 std::unique_ptr<v1::RendezvousService::Stub> stub)
    : options_(std::move(options)), bearer_token_(std::move(bearer_token)), stub_(std::move(stub)) {}

void RendezvousStore::FillScope(v1::RendezvousScope* scope) const {
  scope->set_job_id(options_.job_id);
  scope->set_attempt(options_.attempt);
  scope->set_token(options_.rendezvous_token);
}

absl::Status RendezvousStore::Set(const std::string& key, const std::string& value) {
  v1::SetRequest request;
  FillScope(request.mutable_scope());
  request.set_key(key);
  request.set_value(value);
  const absl::Time deadline = absl::Now() + options_.set_timeout;
  absl::Duration backoff = kMinBackoff;
  const std::string what = absl::StrCat("rendezvous Set(\"", key, "\")");
  for (;;) {
    grpc::ClientContext context;
    AddBearerToken(&context, bearer_token_);
    context.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + absl::Seconds(10))));
    context.set_wait_for_ready(true);
    v1::SetResponse response;
    const grpc::Status status = stub_->Set(&context, request, &response);
    if (status.ok()) return absl::OkStatus();
    const bool transient = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                           status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    if (!transient || absl::Now() >= deadline) return FromGrpcStatus(status, what);
    SleepBackoff(&backoff, deadline);
  }
}

absl::StatusOr<std::string> RendezvousStore::Get(const std::string& key, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + std::max(timeout, absl::ZeroDuration());
  const std::string what = absl::StrCat("rendezvous Get(\"", key, "\")");
  absl::Duration backoff = kMinBackoff;
  for (;;) {
    const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
    const absl::Duration wait = std::min(left, options_.max_wait_per_call);
    v1::GetRequest request;
    FillScope(request.mutable_scope());
    request.set_key(key);
    request.set_wait_timeout_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(wait)));
    grpc::ClientContext context;
    AddBearerToken(&context, bearer_token_);
    context.set_deadline(absl::ToChronoTime(absl::Now() + wait + kRpcSlack));
    context.set_wait_for_ready(true);
    v1::GetResponse response;
    const grpc::Status status = stub_->Get(&context, request, &response);
    if (status.ok()) return std::string(response.value());
    const grpc::StatusCode code = status.error_code();
    const bool waited_out = code == grpc::StatusCode::DEADLINE_EXCEEDED ||
                            (code == grpc::StatusCode::NOT_FOUND && wait > absl::ZeroDuration());
    // RESOURCE_EXHAUSTED: the coordinator holds its maximum of waiting Gets
    // (--max-rendezvous-waits); a later call finds room.
    const bool busy = code == grpc::StatusCode::RESOURCE_EXHAUSTED;
    const bool transient = code == grpc::StatusCode::UNAVAILABLE || busy || waited_out;
    if (!transient) return FromGrpcStatus(status, what);
    if (absl::Now() >= deadline) {
      if (code == grpc::StatusCode::NOT_FOUND) return FromGrpcStatus(status, what);
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": key \"", key, "\" not set within ", absl::FormatDuration(timeout),
          code == grpc::StatusCode::UNAVAILABLE || busy
              ? absl::StrCat(" (coordinator ", busy ? "busy" : "unavailable", ": ",
                             status.error_message(), ")")
              : ""));
    }
    if (code == grpc::StatusCode::UNAVAILABLE || busy) SleepBackoff(&backoff, deadline);
  }
}

}  // namespace spindle
