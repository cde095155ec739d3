// Bootstrap joins, worker identities from client certificates, revocation (see
// worker_certificates.h).
#include "coordinator/worker_certificates.h"

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/status.h"
#include "common/x509.h"
#include "coordinator/auth.h"
#include "coordinator/credential_lines.h"

namespace spindle {

absl::StatusOr<std::vector<BootstrapToken>> ParseBootstrapTokens(const std::string& text) {
  std::vector<BootstrapToken> out;
  std::set<std::string> seen;
  for (const CredentialLine& l : CredentialLines(text)) {
    const int line_no = l.number;
    const std::vector<std::string>& fields = l.fields;
    if (fields.size() < 2 || fields.size() > 3)
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", line_no, " has ", fields.size(), " fields; expected TOKEN EXPIRES [MAX_JOINS]"));
    BootstrapToken t;
    t.token = fields[0];
    if (t.token.size() < 16)
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_no, ": the token is shorter than 16 characters"));
    absl::Time expires;
    std::string err;
    if (!absl::ParseTime(absl::RFC3339_full, fields[1], &expires, &err))
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_no, ": \"", fields[1],
                       "\" is not an RFC 3339 time (e.g. 2026-12-31T00:00:00Z)"));
    t.expires_unix_ms = absl::ToUnixMillis(expires);
    if (fields.size() == 3 && (!absl::SimpleAtoi(fields[2], &t.max_joins) || t.max_joins < 0))
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", line_no, ": MAX_JOINS must be a number >= 0, got \"", fields[2], "\""));
    if (!seen.insert(t.token).second)
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_no, " repeats a token of an earlier line"));
    out.push_back(std::move(t));
  }
  if (out.empty()) return absl::InvalidArgumentError("no token in it");
  return out;
}

absl::Status CheckWorkerIdForCertificate(const std::string& worker_id) {
  bool ok = !worker_id.empty() && worker_id.size() <= 253;
  for (char c : worker_id) ok &= absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-';
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      "a worker id in a certificate is 1 to 253 characters of A-Z, a-z, 0-9, '.', '_' and '-'");
}

WorkerCertificates::WorkerCertificates(CertificateAuthority ca, std::vector<BootstrapToken> tokens,
                                       IdentityStore* store, const Clock* clock,
                                       absl::Duration validity)
    : ca_(std::move(ca)),
      tokens_(std::move(tokens)),
      store_(store),
      clock_(clock),
      validity_(validity) {}

absl::Status WorkerCertificates::Load() {
  ASSIGN_OR_RETURN(std::vector<CertificateRecord> certs, store_->LoadCertificates());
  absl::MutexLock l(&mu_);
  for (const CertificateRecord& c : certs) {
    known_[c.serial_hex] = c.worker_id;
    if (c.revoked_ms != 0) revoked_.insert(c.serial_hex);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> WorkerCertificates::Join(const std::string& token,
                                                     const std::string& csr_pem) {
  if (csr_pem.size() > kMaxCertificateRequestBytes)
    return absl::InvalidArgumentError(absl::StrCat("join: the certificate request has ",
                                                   csr_pem.size(), " bytes; at most ",
                                                   kMaxCertificateRequestBytes));
  const BootstrapToken* match = nullptr;
  for (const BootstrapToken& t : tokens_)  // every token compared, in constant time each
    if (ConstantTimeEquals(token, t.token)) match = &t;
  if (match == nullptr) return absl::UnauthenticatedError("join: unknown bootstrap token");
  const int64_t now_ms = clock_->NowMs();
  if (now_ms >= match->expires_unix_ms)
    return absl::UnauthenticatedError(absl::StrCat(
        "join: the bootstrap token expired at ",
        absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixMillis(match->expires_unix_ms),
                         absl::UTCTimeZone())));
  absl::StatusOr<CertificateRequestInfo> parsed = ParseCertificateRequest(csr_pem);
  if (!parsed.ok())
    return absl::InvalidArgumentError(absl::StrCat("join: ", parsed.status().message()));
  const CertificateRequestInfo& csr = *parsed;
  if (absl::Status id = CheckWorkerIdForCertificate(csr.common_name); !id.ok())
    return absl::InvalidArgumentError(
        absl::StrCat("join: the request names worker \"", csr.common_name, "\": ", id.message()));
  absl::MutexLock l(&mu_);
  absl::StatusOr<int64_t> joins = store_->CountBootstrapJoin(Sha256Hex(token), match->max_joins);
  if (absl::IsResourceExhausted(joins.status()))
    return absl::PermissionDeniedError(
        absl::StrCat("join: the bootstrap token has made all of its ", match->max_joins, " joins"));
  if (!joins.ok()) return joins.status();
  std::string serial;
  const absl::Time not_before = absl::FromUnixMillis(now_ms) - absl::Minutes(5);  // clock skew
  ASSIGN_OR_RETURN(std::string cert, ca_.IssueWorkerCertificate(csr.common_name, csr.public_key_pem,
                                                                not_before, validity_, &serial));
  CertificateRecord rec;
  rec.serial_hex = serial;
  rec.worker_id = csr.common_name;
  rec.recorded_ms = now_ms;
  rec.not_after_ms = absl::ToUnixMillis(not_before + validity_);
  RETURN_IF_ERROR(store_->SaveCertificate(rec));
  known_[serial] = csr.common_name;
  return cert;
}

absl::StatusOr<std::string> WorkerCertificates::WorkerOf(const std::string& peer_cert_pem) {
  if (peer_cert_pem.empty())
    return absl::UnauthenticatedError(
        "worker calls need the worker's client certificate (a new worker joins with a bootstrap "
        "token first)");
  absl::StatusOr<CertificateInfo> info = ParseCertificate(peer_cert_pem);
  if (!info.ok()) return absl::UnauthenticatedError("the client certificate cannot be read");
  if (info->organizations.size() != 1 || info->organizations[0] != kWorkerOrganization ||
      info->common_names.size() != 1)
    return absl::PermissionDeniedError(absl::StrCat(
        "the client certificate is not a worker's (one CN and O=", kWorkerOrganization, ")"));
  const std::string& worker_id = info->common_names[0];
  absl::MutexLock l(&mu_);
  if (revoked_.count(info->serial_hex))
    return absl::UnauthenticatedError(absl::StrCat("the certificate of worker ", worker_id,
                                                   " (serial ", info->serial_hex, ") was revoked"));
  if (!known_.count(info->serial_hex)) {
    CertificateRecord rec;
    rec.serial_hex = info->serial_hex;
    rec.worker_id = worker_id;
    rec.recorded_ms = clock_->NowMs();
    rec.not_after_ms = info->not_after_unix_s * 1000;
    RETURN_IF_ERROR(store_->SaveCertificate(rec));
    known_[info->serial_hex] = worker_id;
  }
  return worker_id;
}

absl::StatusOr<int64_t> WorkerCertificates::Revoke(const std::string& worker_id) {
  // No certificate names anything else (Join refuses it), and the id is not echoed unbounded.
  if (absl::Status id = CheckWorkerIdForCertificate(worker_id); !id.ok())
    return absl::InvalidArgumentError(absl::StrCat("revoke: ", id.message()));
  absl::MutexLock l(&mu_);
  bool any = false;
  for (const auto& [serial, id] : known_) any |= id == worker_id;
  if (!any)
    return absl::NotFoundError(
        absl::StrCat("worker ", worker_id, " has no certificate this coordinator issued or saw"));
  ASSIGN_OR_RETURN(int64_t n, store_->RevokeCertificates(worker_id, clock_->NowMs()));
  for (const auto& [serial, id] : known_)
    if (id == worker_id) revoked_.insert(serial);
  return n;
}

}  // namespace spindle
