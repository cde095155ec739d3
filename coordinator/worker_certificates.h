// WorkerCertificates: who a worker is, by its client certificate. A new worker joins the way a
// kubelet does (TLS bootstrapping): it sends a bootstrap token and a certificate request for its
// id; a token that is known, unexpired and has joins left gets the request signed by the
// coordinator's CA (certificate_authority.h). From then on the worker calls with that
// certificate (mutual TLS), and its id is the certificate's one common name. `spindle workers
// revoke ID` revokes every certificate of the worker; the revocations are kept in the store.
//
// Thread-safety: thread-safe (one internal mutex; store writes happen under it).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/certificate_authority.h"
#include "coordinator/clock.h"
#include "coordinator/identity_store.h"

namespace spindle {

struct BootstrapToken {
  std::string token;
  int64_t expires_unix_ms = 0;
  int64_t max_joins = 0;  // 0: no limit
};

// A --bootstrap-token-file: one token a line, "TOKEN EXPIRES [MAX_JOINS]", EXPIRES an RFC 3339
// time ("2026-12-31T00:00:00Z"), MAX_JOINS how many workers may join with it (absent or 0: no
// limit). Blank lines and lines starting with '#' are skipped. A token has at least 16
// characters. InvalidArgument naming the line otherwise, or for a file without a token.
absl::StatusOr<std::vector<BootstrapToken>> ParseBootstrapTokens(const std::string& text);

// Worker ids a certificate may hold: 1 to 253 characters of [A-Za-z0-9._-] (host names).
absl::Status CheckWorkerIdForCertificate(const std::string& worker_id);

class WorkerCertificates {
 public:
  // `store` and `clock` are not owned and must outlive this.
  WorkerCertificates(CertificateAuthority ca, std::vector<BootstrapToken> tokens,
                     IdentityStore* store, const Clock* clock, absl::Duration validity);

  // Loads the recorded certificates and revocations (call once, before serving).
  absl::Status Load() ABSL_LOCKS_EXCLUDED(mu_);

  const CertificateAuthority& ca() const { return ca_; }

  // A worker's certificate request is a few hundred bytes; a larger one is refused unread.
  static constexpr size_t kMaxCertificateRequestBytes = 16 * 1024;

  // Signs `csr_pem` for the worker id it names, with `token`. Unauthenticated for an unknown
  // token ("unknown bootstrap token") or an expired one ("the bootstrap token expired at T");
  // PermissionDenied for one that has made all its joins; InvalidArgument for a bad request or
  // worker id, or a request over kMaxCertificateRequestBytes. Returns the certificate (PEM).
  absl::StatusOr<std::string> Join(const std::string& token, const std::string& csr_pem)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The worker id of the peer whose TLS handshake presented `peer_cert_pem` (already verified
  // against the CA by the handshake; empty: the peer sent none). Unauthenticated without a
  // certificate or for a revoked one; PermissionDenied for a certificate that is not a worker's
  // (another organization, not exactly one common name). A certificate not seen before is
  // recorded, so that a later revocation covers it.
  absl::StatusOr<std::string> WorkerOf(const std::string& peer_cert_pem) ABSL_LOCKS_EXCLUDED(mu_);

  // Revokes every certificate of `worker_id` recorded so far; returns how many. NotFound when it
  // has none; InvalidArgument for an id no certificate may hold (CheckWorkerIdForCertificate).
  absl::StatusOr<int64_t> Revoke(const std::string& worker_id) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const CertificateAuthority ca_;
  const std::vector<BootstrapToken> tokens_;
  IdentityStore* const store_;
  const Clock* const clock_;
  const absl::Duration validity_;
  absl::Mutex mu_;
  std::map<std::string, std::string> known_ ABSL_GUARDED_BY(mu_);  // serial -> worker id
  std::set<std::string> revoked_ ABSL_GUARDED_BY(mu_);             // serials revoked
};

}  // namespace spindle
