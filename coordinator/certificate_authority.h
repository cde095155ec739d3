// The coordinator's certificate authority: the key and self-signed certificate that sign the
// workers' certificates (from their requests, at join) and the coordinator's own server
// certificate. Generated at the first start and kept beside the database (`<db>.ca.pem` and
// `<db>.ca-key.pem`, the key readable by its owner only), or given as files.
//
// Thread-safety: immutable after construction; every method is safe from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace spindle {

// The organization (O) of every worker certificate the CA issues, and of the server's: a
// certificate of one kind is never taken for the other.
inline constexpr char kWorkerOrganization[] = "spindle-workers";
inline constexpr char kServerOrganization[] = "spindle-coordinator";

struct KeyAndCertificate {
  std::string key_pem;
  std::string cert_pem;
};

class CertificateAuthority {
 public:
  // The CA in `cert_path` and `key_path`; when neither file exists, a new CA (10 years) written
  // there first. InvalidArgument when only one exists, when they do not hold a CA certificate and
  // its key, or when they cannot be written.
  static absl::StatusOr<CertificateAuthority> LoadOrCreate(const std::string& cert_path,
                                                           const std::string& key_path);
  // A CA from PEM text (checked like LoadOrCreate's files).
  static absl::StatusOr<CertificateAuthority> FromPem(std::string cert_pem, std::string key_pem);
  // A new CA named `name`, valid for `validity` from now.
  static absl::StatusOr<CertificateAuthority> Create(const std::string& name,
                                                     absl::Duration validity);

  const std::string& cert_pem() const { return cert_pem_; }
  const std::string& key_pem() const { return key_pem_; }

  // A server certificate (with a new key) for the names and IP addresses in `names` (each entry
  // is either), valid for `validity` from an hour ago.
  absl::StatusOr<KeyAndCertificate> IssueServerCertificate(const std::vector<std::string>& names,
                                                           absl::Duration validity) const;
  // A client certificate for worker `worker_id` (CN, O=spindle-workers) on the key of
  // `public_key_pem`, valid from `not_before` for `validity`; `serial_hex` receives its serial.
  absl::StatusOr<std::string> IssueWorkerCertificate(const std::string& worker_id,
                                                     const std::string& public_key_pem,
                                                     absl::Time not_before, absl::Duration validity,
                                                     std::string* serial_hex) const;

 private:
  CertificateAuthority(std::string cert_pem, std::string key_pem)
      : cert_pem_(std::move(cert_pem)), key_pem_(std::move(key_pem)) {}
  std::string cert_pem_;
  std::string key_pem_;
};

}  // namespace spindle
