// SqliteJobStore: the JobStore (job_store.h) and IdentityStore (identity_store.h) in one SQLite
// file (WAL, synchronous=FULL). Every write is one transaction that is on disk when the call
// returns. The schema is versioned in `schema_migrations`; Open() applies the missing migrations in
// order. One store has one writer: Open() holds an exclusive lock on `<path>.lock` (flock, released
// when the store closes or the process dies), so a second coordinator started on the same file is
// refused before it reads or writes anything.
//
// Thread-safety: thread-safe; one connection serialised by an internal mutex.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/identity_store.h"
#include "coordinator/job_store.h"

struct sqlite3;

namespace spindle {

class SqliteJobStore : public JobStore, public IdentityStore {
 public:
  // The schema version Open() migrates to.
  static constexpr int kSchemaVersion = 4;

  // Opens (creating if needed) the database at `path` and migrates it. Unavailable when the file
  // cannot be opened; FailedPrecondition when another process holds the store (its pid named);
  // DataLoss when it is not a Spindle database or is newer than this binary.
  static absl::StatusOr<std::unique_ptr<SqliteJobStore>> Open(const std::string& path);
  // Deletes the files of the (closed) store at `path`: the database, SQLite's journals and the
  // lock file. For a store just created by a process that then failed to start.
  static void RemoveFiles(const std::string& path);
  ~SqliteJobStore() override;
  SqliteJobStore(const SqliteJobStore&) = delete;
  SqliteJobStore& operator=(const SqliteJobStore&) = delete;

  // Inserts a new job with its first event; fills job->job_id and job->seq. Sequence numbers
  // (and so ids) are never reused, not even those of deleted jobs.
  absl::Status CreateJob(JobRecord* job, const EventRecord& event) override
      ABSL_LOCKS_EXCLUDED(mu_);
  // Writes the whole job row, and (if given) an event and an attempt, in one transaction.
  absl::Status SaveJob(const JobRecord& job, const EventRecord* event = nullptr,
                       const AttemptRecord* attempt = nullptr) override ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<std::vector<JobRecord>> LoadJobs() override ABSL_LOCKS_EXCLUDED(mu_);
  // Events of one job, oldest first.
  absl::StatusOr<std::vector<EventRecord>> LoadEvents(const std::string& job_id) override
      ABSL_LOCKS_EXCLUDED(mu_);
  // NotFound when the attempt was never stored.
  absl::StatusOr<AttemptRecord> LoadAttempt(const std::string& job_id, int64_t attempt) override
      ABSL_LOCKS_EXCLUDED(mu_);

  // Deletes the jobs with their attempts, rank placements and events, in one transaction
  // (unknown ids are no error).
  absl::Status DeleteJobs(const std::vector<std::string>& job_ids) override
      ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status SaveWorker(const WorkerRecord& worker) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::vector<WorkerRecord>> LoadWorkers() override ABSL_LOCKS_EXCLUDED(mu_);

  // IdentityStore (identity_store.h).
  absl::Status SaveCertificate(const CertificateRecord& cert) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::vector<CertificateRecord>> LoadCertificates() override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<int64_t> RevokeCertificates(const std::string& worker_id, int64_t now_ms) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<int64_t> CountBootstrapJoin(const std::string& token_sha256,
                                             int64_t max_joins) override ABSL_LOCKS_EXCLUDED(mu_);

  // The schema version recorded in the file.
  absl::StatusOr<int> SchemaVersion() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  SqliteJobStore(sqlite3* db, int lock_fd) : db_(db), lock_fd_(lock_fd) {}
  absl::Status Migrate() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Exec(const char* sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteJobRow(const JobRecord& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteEvent(const EventRecord& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteAttempt(const AttemptRecord& attempt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `body` inside BEGIN IMMEDIATE / COMMIT, rolling back on error.
  template <typename F>
  absl::Status InTransaction(F body) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  sqlite3* const db_ ABSL_PT_GUARDED_BY(mu_);
  const int lock_fd_;  // holds the flock on <path>.lock until the destructor closes it
};

}  // namespace spindle
