// The check of a HOST:PORT address given on a command line (the daemons' --listen and
// --coordinator, the CLI's --coordinator): gRPC would take a port past 65535 modulo 65536 and
// listen on, or dial, another port than the one written.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace spindle {

// OK when `address` is HOST:PORT (HOST may be a bracketed IPv6 address) with a port in
// [0, 65535]; otherwise an error naming `flag`.
inline absl::Status CheckHostPort(const std::string& flag, const std::string& address) {
  const size_t colon = address.rfind(':');
  const std::string digits = colon == std::string::npos ? "" : address.substr(colon + 1);
  int port = -1;
  if (colon != std::string::npos && colon > 0 && !digits.empty() &&
      digits.find_first_not_of("0123456789") == std::string::npos &&
      absl::SimpleAtoi(digits, &port) && port <= 65535)
    return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " must be HOST:PORT with a port in [0, 65535], got \"", address, "\""));
}

}  // namespace spindle
