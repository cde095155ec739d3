// PEM file reading with a check of the block kind (see pem.h).
#include "common/pem.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace spindle {

absl::StatusOr<std::string> ReadPemFile(const std::string& path, PemKind kind,
                                        std::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  if (in) ss << in.rdbuf();
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read the ", std::string(flag), " file ", path));
  }
  std::string text = ss.str();
  // "-----BEGIN CERTIFICATE-----"; keys come as "PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY".
  const bool found = kind == PemKind::kCertificate
                         ? text.find("-----BEGIN CERTIFICATE-----") != std::string::npos
                         : text.find("PRIVATE KEY-----") != std::string::npos &&
                               text.find("-----BEGIN ") != std::string::npos;
  if (!found) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ", std::string(flag), " file ", path, " holds no PEM ",
        kind == PemKind::kCertificate ? "certificate (no -----BEGIN CERTIFICATE----- line)"
                                      : "private key (no -----BEGIN ... PRIVATE KEY----- line)"));
  }
  return text;
}

}  // namespace spindle
