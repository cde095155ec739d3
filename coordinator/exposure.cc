// Loopback-or-credentials check of the coordinator's listen addresses (see exposure.h).
#include "coordinator/exposure.h"

#include "absl/strings/str_cat.h"
#include "common/host_port.h"

namespace spindle {

std::string ListenHost(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return host;
}

namespace {

// The first address that is not loopback (empty ones skipped); "" when there is none.
std::string FirstExposed(const std::vector<std::string>& addresses) {
  for (const std::string& address : addresses)
    if (!address.empty() && !IsLoopbackHost(ListenHost(address))) return address;
  return "";
}

}  // namespace

absl::Status CheckListenExposure(const std::vector<std::string>& addresses, bool has_credentials,
                                 bool insecure) {
  const std::string exposed = FirstExposed(addresses);
  if (has_credentials || insecure || exposed.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "refusing to serve ", exposed,
      " (not a loopback address) without credentials: set --users_file or --token_file (TLS "
      "alone names no one), or pass --insecure to let anyone who reaches it run jobs"));
}

absl::Status CheckWorkerCredentials(const std::vector<std::string>& addresses, bool user_token,
                                    bool worker_tokens, bool insecure) {
  const std::string exposed = FirstExposed(addresses);
  if (!user_token || worker_tokens || insecure || exposed.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "refusing to serve ", exposed,
      " with one token for users and workers (any user could register as a worker and take "
      "its assignments): give the workers their own with --worker_token_file, or pass "
      "--insecure"));
}

absl::Status CheckCoordinatorExposure(const std::string& listen, const std::string& worker_listen,
                                      bool user_credentials, bool worker_credentials,
                                      bool insecure) {
  if (absl::Status st = CheckListenExposure({listen}, user_credentials, insecure); !st.ok())
    return st;
  if (absl::Status st =
          CheckListenExposure({worker_listen}, user_credentials || worker_credentials, insecure);
      !st.ok())
    return st;
  return CheckWorkerCredentials({listen, worker_listen}, user_credentials, worker_credentials,
                                insecure);
}

}  // namespace spindle
