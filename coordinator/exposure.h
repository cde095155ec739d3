// The coordinator's safe default: it serves its gRPC ports without credentials only on loopback
// addresses, which no other host can reach. A listen address on any other interface needs
// credentials that name who calls (users' tokens; workers' certificates or tokens), or the
// operator's explicit --insecure. TLS alone names no one: a server certificate is not a
// credential.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace spindle {

// The host of a HOST:PORT listen address ("[::1]:7070" -> "::1", "0.0.0.0:7070" -> "0.0.0.0").
std::string ListenHost(const std::string& address);

// OK when every address in `addresses` (listen addresses; empty ones are skipped) is loopback,
// when `has_credentials` (users' tokens are configured), or when `insecure`. Otherwise
// FailedPrecondition naming the first exposed address and the --insecure flag: an operator
// must fix the configuration, a retry would not help.
absl::Status CheckListenExposure(const std::vector<std::string>& addresses, bool has_credentials,
                                 bool insecure);

// OK when every address is loopback, when the users' token is not the only credential (workers
// have tokens of their own, or there is no user token), or when `insecure`. Otherwise
// FailedPrecondition: with one token for users and workers, any user could register as a worker
// and receive its assignments and their rendezvous tokens.
absl::Status CheckWorkerCredentials(const std::vector<std::string>& addresses, bool user_token,
                                    bool worker_tokens, bool insecure);

// Both checks for a coordinator: the client port `listen` needs users' credentials
// (`user_credentials`: --users-file or --token-file); a separate `worker_listen` needs either
// kind; and users' tokens alone are not the workers' (`worker_credentials`: the CA's
// certificates or --worker-token-file).
absl::Status CheckCoordinatorExposure(const std::string& listen, const std::string& worker_listen,
                                      bool user_credentials, bool worker_credentials,
                                      bool insecure);

}  // namespace spindle
