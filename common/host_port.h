// HOST:PORT addresses: the check of one given on a command line (the daemons' --listen and
// --coordinator, the CLI's --coordinator: gRPC would take a port past 65535 modulo 65536 and
// listen on, or dial, another port than the one written), the host of a gRPC peer string, and
// whether a host is a loopback one (which no other host can reach).
#pragma once

#include <string>
#include <utility>

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

// The host of a gRPC peer ("ipv4:198.18.0.2:41234" -> "198.18.0.2", "ipv6:[::1]:5" -> "::1");
// "" for other kinds (unix sockets).
inline std::string PeerHost(const std::string& peer) {
  std::string rest;
  if (peer.rfind("ipv4:", 0) == 0) {
    rest = peer.substr(5);
    const size_t colon = rest.rfind(':');
    return colon == std::string::npos ? rest : rest.substr(0, colon);
  }
  if (peer.rfind("ipv6:", 0) == 0) {
    rest = peer.substr(5);
    // gRPC percent-encodes the brackets of IPv6 peers in some versions.
    for (const auto& [from, to] : {std::pair<const char*, const char*>{"%5B", "["}, {"%5D", "]"}}) {
      for (size_t at; (at = rest.find(from)) != std::string::npos;) rest.replace(at, 3, to);
    }
    if (!rest.empty() && rest[0] == '[') {
      const size_t close = rest.find(']');
      return close == std::string::npos ? rest.substr(1) : rest.substr(1, close - 1);
    }
    const size_t colon = rest.rfind(':');
    return colon == std::string::npos ? rest : rest.substr(0, colon);
  }
  return "";
}

// True for 127.0.0.0/8, ::1, IPv4-mapped loopback and "localhost".
inline bool IsLoopbackHost(const std::string& host) {
  return host.rfind("127.", 0) == 0 || host == "::1" || host == "localhost" ||
         host.rfind("::ffff:127.", 0) == 0;
}

}  // namespace spindle
