// The coordinator's certificate authority (see certificate_authority.h).
#include "coordinator/certificate_authority.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/x509.h"

namespace spindle {
namespace {

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Writes `text` to `path` (created with `mode`, never replacing a file) durably.
absl::Status WriteNew(const std::string& path, const std::string& text, mode_t mode) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
                  ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) {
    ::unlink(path.c_str());
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write ", path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

bool IsIpAddress(const std::string& s) {
  unsigned char buf[16];
  return inet_pton(AF_INET, s.c_str(), buf) == 1 || inet_pton(AF_INET6, s.c_str(), buf) == 1;
}

}  // namespace

absl::StatusOr<CertificateAuthority> CertificateAuthority::FromPem(std::string cert_pem,
                                                                   std::string key_pem) {
  if (absl::Status st = CheckCertificate(cert_pem, cert_pem, key_pem); !st.ok())
    return absl::InvalidArgumentError(absl::StrCat("not a usable CA: ", st.message()));
  return CertificateAuthority(std::move(cert_pem), std::move(key_pem));
}

absl::StatusOr<CertificateAuthority> CertificateAuthority::Create(const std::string& name,
                                                                  absl::Duration validity) {
  ASSIGN_OR_RETURN(std::string key, GeneratePrivateKey());
  ASSIGN_OR_RETURN(std::string public_key, PublicKeyOf(key));
  CertificateTemplate t;
  t.common_name = name;
  t.organization = kServerOrganization;
  t.usage = CertificateUsage::kAuthority;
  const int64_t now = absl::ToUnixSeconds(absl::Now());
  t.not_before_unix_s = now - 3600;
  t.not_after_unix_s = now + absl::ToInt64Seconds(validity);
  t.public_key_pem = public_key;
  ASSIGN_OR_RETURN(std::string cert, IssueCertificate(t, "", key));
  return CertificateAuthority(std::move(cert), std::move(key));
}

absl::StatusOr<CertificateAuthority> CertificateAuthority::LoadOrCreate(
    const std::string& cert_path, const std::string& key_path) {
  std::error_code ec;
  const bool have_cert = std::filesystem::exists(cert_path, ec);
  const bool have_key = std::filesystem::exists(key_path, ec);
  if (have_cert != have_key)
    return absl::InvalidArgumentError(absl::StrCat(
        "the CA needs both its certificate and its key: ", have_cert ? cert_path : key_path,
        " exists, ", have_cert ? key_path : cert_path, " does not"));
  if (have_cert) {
    ASSIGN_OR_RETURN(std::string cert, ReadText(cert_path));
    ASSIGN_OR_RETURN(std::string key, ReadText(key_path));
    absl::StatusOr<CertificateAuthority> ca = FromPem(std::move(cert), std::move(key));
    if (!ca.ok())
      return absl::InvalidArgumentError(
          absl::StrCat(cert_path, " and ", key_path, ": ", ca.status().message()));
    return ca;
  }
  ASSIGN_OR_RETURN(CertificateAuthority ca,
                   Create("Spindle cluster CA", absl::Hours(24 * 365 * 10)));
  // The key first: a certificate without its key is the state LoadOrCreate refuses.
  RETURN_IF_ERROR(WriteNew(key_path, ca.key_pem(), 0600));
  if (absl::Status st = WriteNew(cert_path, ca.cert_pem(), 0644); !st.ok()) {
    ::unlink(key_path.c_str());
    return st;
  }
  return ca;
}

absl::StatusOr<KeyAndCertificate> CertificateAuthority::IssueServerCertificate(
    const std::vector<std::string>& names, absl::Duration validity) const {
  KeyAndCertificate out;
  ASSIGN_OR_RETURN(out.key_pem, GeneratePrivateKey());
  CertificateTemplate t;
  t.common_name = "spindle-coordinator";
  t.organization = kServerOrganization;
  t.usage = CertificateUsage::kServer;
  for (const std::string& n : names) {
    if (n.empty()) continue;
    (IsIpAddress(n) ? t.ip_addresses : t.dns_names).push_back(n);
  }
  const int64_t now = absl::ToUnixSeconds(absl::Now());
  t.not_before_unix_s = now - 3600;
  t.not_after_unix_s = now + absl::ToInt64Seconds(validity);
  ASSIGN_OR_RETURN(t.public_key_pem, PublicKeyOf(out.key_pem));
  ASSIGN_OR_RETURN(out.cert_pem, IssueCertificate(t, cert_pem_, key_pem_));
  return out;
}

absl::StatusOr<std::string> CertificateAuthority::IssueWorkerCertificate(
    const std::string& worker_id, const std::string& public_key_pem, absl::Time not_before,
    absl::Duration validity, std::string* serial_hex) const {
  CertificateTemplate t;
  t.common_name = worker_id;
  t.organization = kWorkerOrganization;
  t.usage = CertificateUsage::kClient;
  t.not_before_unix_s = absl::ToUnixSeconds(not_before);
  t.not_after_unix_s = absl::ToUnixSeconds(not_before + validity);
  t.public_key_pem = public_key_pem;
  return IssueCertificate(t, cert_pem_, key_pem_, serial_hex);
}

}  // namespace spindle
