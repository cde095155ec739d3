// PEM files for TLS (the coordinator's certificate and key, the CA bundle its clients trust),
// read whole and checked for the kind of block their flag promises. A wrong or empty file is
// thereby named when a program starts, instead of surfacing later as a port that cannot listen
// or a coordinator that cannot be reached. gRPC still validates the contents themselves.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace spindle {

enum class PemKind { kCertificate, kPrivateKey };

// `flag` names the file in errors ("--tls-ca"). NotFound when the file cannot be read;
// InvalidArgument when it holds no block of `kind`.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, PemKind kind,
                                        std::string_view flag);

}  // namespace spindle
