// IdentityStore: what the coordinator must remember about workers' certificates across restarts:
// each certificate it issued or saw (serial, worker, expiry) with its revocation, and how many
// joins each bootstrap token has made (by the token's SHA-256; the store never holds a secret).
// SqliteJobStore keeps it in the jobs database. Every write is durable when it returns OK.
//
// Thread-safety: implementations are thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace spindle {

struct CertificateRecord {
  std::string serial_hex;  // upper-case hex; unique
  std::string worker_id;
  int64_t recorded_ms = 0;
  int64_t not_after_ms = 0;
  int64_t revoked_ms = 0;  // 0: not revoked
};

class IdentityStore {
 public:
  virtual ~IdentityStore() = default;

  // Records a certificate; one already recorded (the same serial) is left as it is.
  virtual absl::Status SaveCertificate(const CertificateRecord& cert) = 0;
  virtual absl::StatusOr<std::vector<CertificateRecord>> LoadCertificates() = 0;
  // Marks every recorded, unrevoked certificate of `worker_id` revoked at `now_ms`; returns how
  // many.
  virtual absl::StatusOr<int64_t> RevokeCertificates(const std::string& worker_id,
                                                     int64_t now_ms) = 0;
  // Counts one join of the bootstrap token whose hash is `token_sha256`, unless it already made
  // `max_joins` (> 0; 0: no limit). Returns the joins counted so far including this one, or
  // ResourceExhausted "used up" when none is left (nothing counted then).
  virtual absl::StatusOr<int64_t> CountBootstrapJoin(const std::string& token_sha256,
                                                     int64_t max_joins) = 0;
};

}  // namespace spindle
