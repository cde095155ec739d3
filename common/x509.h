// X.509 for the cluster's own certificate authority, on OpenSSL's C API: private keys, certificate
// signing requests, certificates issued by a CA (or self-signed for the CA itself) and what a
// certificate says (names, serial, validity). The coordinator's CA signs the workers' requests
// with it (coordinator/certificate_authority.h); a worker makes its key and request with it
// (worker/worker_identity.h). Keys are EC P-256; everything travels as PEM text.
//
// Thread-safety: free functions without shared state; safe from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace spindle {

// A new EC P-256 private key, PEM (PKCS#8, unencrypted).
absl::StatusOr<std::string> GeneratePrivateKey();

// A certificate signing request for subject CN=`common_name`, signed with `key_pem`.
absl::StatusOr<std::string> MakeCertificateRequest(const std::string& key_pem,
                                                   const std::string& common_name);

struct CertificateRequestInfo {
  std::string common_name;     // the subject's one CN
  std::string public_key_pem;  // SubjectPublicKeyInfo, PEM
};
// Parses a request and checks its signature. InvalidArgument when it is not a PEM request, its
// signature does not verify, or its subject has other than exactly one CN.
absl::StatusOr<CertificateRequestInfo> ParseCertificateRequest(const std::string& csr_pem);

enum class CertificateUsage { kAuthority, kServer, kClient };

// What IssueCertificate writes into a certificate.
struct CertificateTemplate {
  std::string common_name;
  std::string organization;  // "" for none
  CertificateUsage usage = CertificateUsage::kClient;
  std::vector<std::string> dns_names;     // subjectAltName DNS entries (server certificates)
  std::vector<std::string> ip_addresses;  // subjectAltName IP entries, IPv4 or IPv6 text
  int64_t not_before_unix_s = 0;
  int64_t not_after_unix_s = 0;
  std::string public_key_pem;  // the subject's key
};

// A certificate for `t`, signed with `issuer_key_pem` under `issuer_cert_pem`'s name, or
// self-signed with `issuer_key_pem` when `issuer_cert_pem` is empty (a CA's own certificate; its
// key must then be the subject's). A random 128-bit serial; `serial_hex` (may be null) receives
// it in upper-case hex. InvalidArgument for an unusable key, certificate or address.
absl::StatusOr<std::string> IssueCertificate(const CertificateTemplate& t,
                                             const std::string& issuer_cert_pem,
                                             const std::string& issuer_key_pem,
                                             std::string* serial_hex = nullptr);

struct CertificateInfo {
  std::vector<std::string> common_names;   // every CN of the subject
  std::vector<std::string> organizations;  // every O of the subject
  std::string issuer;                      // the issuer's name, one line
  std::string serial_hex;                  // upper-case hex
  int64_t not_before_unix_s = 0;
  int64_t not_after_unix_s = 0;
};
// InvalidArgument when `cert_pem` holds no certificate (the first one of a chain is read).
absl::StatusOr<CertificateInfo> ParseCertificate(const std::string& cert_pem);

// The SubjectPublicKeyInfo (PEM) of a private key.
absl::StatusOr<std::string> PublicKeyOf(const std::string& key_pem);

// OK when `cert_pem` was signed by `ca_cert_pem`'s key and is valid now, and `key_pem` (if not
// empty) is its private key. FailedPrecondition naming what does not hold.
absl::Status CheckCertificate(const std::string& cert_pem, const std::string& ca_cert_pem,
                              const std::string& key_pem);

// SHA-256 of `data`, lower-case hex (the store keeps bootstrap tokens only as this).
std::string Sha256Hex(const std::string& data);

}  // namespace spindle
