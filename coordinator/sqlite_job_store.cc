// SqliteJobStore (see sqlite_job_store.h).
#include "coordinator/sqlite_job_store.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace spindle {
namespace {

constexpr char kLockSuffix[] = ".lock";

// Takes the store's writer lock: an exclusive flock on `<path>.lock`, which records the holder's
// pid for the message a second process gets. Returns the descriptor that holds the lock.
absl::StatusOr<int> LockStore(const std::string& path) {
  const std::string lock_path = path + kLockSuffix;
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("job store: cannot open ", path, ": ", std::strerror(errno)));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {};
    const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    ::close(fd);
    if (err != EWOULDBLOCK) {
      return absl::UnavailableError(
          absl::StrCat("job store: cannot lock ", lock_path, ": ", std::strerror(err)));
    }
    std::string holder(buf, n > 0 ? static_cast<size_t>(n) : 0);
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    return absl::FailedPreconditionError(
        absl::StrCat("job store: ", path, " is in use by another coordinator",
                     holder.empty() ? "" : absl::StrCat(" (pid ", holder, ")"),
                     "; one store takes one coordinator"));
  }
  // The pid only serves the message a second process gets: a failed write is no error.
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, pid.data(), pid.size(), 0);
  return fd;
}

// Migrations, applied in order; entry i brings the schema to version i + 1. Never edit a
// released entry: append a new one.
constexpr const char* kMigrations[] = {
    R"sql(
CREATE TABLE jobs (
  job_id TEXT PRIMARY KEY,
  seq INTEGER NOT NULL UNIQUE,
  name TEXT NOT NULL,
  state INTEGER NOT NULL,
  priority INTEGER NOT NULL,
  spec_json TEXT NOT NULL,
  plan BLOB NOT NULL,
  submitted_ms INTEGER NOT NULL,
  updated_ms INTEGER NOT NULL,
  attempt INTEGER NOT NULL,
  restarts INTEGER NOT NULL,
  max_restarts INTEGER NOT NULL,
  message TEXT NOT NULL,
  last_checkpoint_step INTEGER NOT NULL,
  last_checkpoint_path TEXT NOT NULL
);
CREATE TABLE attempts (
  job_id TEXT NOT NULL,
  attempt INTEGER NOT NULL,
  rendezvous_token TEXT NOT NULL,
  started_ms INTEGER NOT NULL,
  ended_ms INTEGER NOT NULL,
  outcome TEXT NOT NULL,
  PRIMARY KEY (job_id, attempt)
);
CREATE TABLE attempt_ranks (
  job_id TEXT NOT NULL,
  attempt INTEGER NOT NULL,
  rank INTEGER NOT NULL,
  worker_id TEXT NOT NULL,
  device_index INTEGER NOT NULL,
  PRIMARY KEY (job_id, attempt, rank)
);
CREATE TABLE workers (
  worker_id TEXT PRIMARY KEY,
  hostname TEXT NOT NULL,
  devices BLOB NOT NULL,
  metrics_address TEXT NOT NULL,
  registered_ms INTEGER NOT NULL
);
CREATE TABLE events (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT NOT NULL,
  attempt INTEGER NOT NULL,
  unix_ms INTEGER NOT NULL,
  state INTEGER NOT NULL,
  message TEXT NOT NULL
);
CREATE INDEX events_by_job ON events (job_id, id);
)sql",
    // 2: idempotent submits (request ids), and a sequence that survives deleting the newest jobs.
    R"sql(
ALTER TABLE jobs ADD COLUMN request_id TEXT NOT NULL DEFAULT '';
CREATE UNIQUE INDEX jobs_by_request_id ON jobs (request_id) WHERE request_id != '';
CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
)sql",
    // 3: where a finished job ended, shown after a restart.
    R"sql(
ALTER TABLE jobs ADD COLUMN final_step INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN final_loss REAL NOT NULL DEFAULT 0;
)sql",
    // 4: jobs have owners; the workers' certificates and the bootstrap tokens' joins.
    R"sql(
ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT '';
CREATE TABLE worker_certificates (
  serial TEXT PRIMARY KEY,
  worker_id TEXT NOT NULL,
  recorded_ms INTEGER NOT NULL,
  not_after_ms INTEGER NOT NULL,
  revoked_ms INTEGER NOT NULL
);
CREATE INDEX worker_certificates_by_worker ON worker_certificates (worker_id);
CREATE TABLE bootstrap_joins (token_sha256 TEXT PRIMARY KEY, joins INTEGER NOT NULL);
)sql",
};
static_assert(std::size(kMigrations) == SqliteJobStore::kSchemaVersion);

// A prepared statement that finalizes itself.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) : db_(db) {
    rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr);
  }
  ~Stmt() { sqlite3_finalize(stmt_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  absl::Status status() const {
    if (rc_ == SQLITE_OK) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("job store: prepare: ", sqlite3_errmsg(db_)));
  }
  Stmt& Bind(int i, int64_t v) {
    sqlite3_bind_int64(stmt_, i, v);
    return *this;
  }
  Stmt& Bind(int i, double v) {
    sqlite3_bind_double(stmt_, i, v);
    return *this;
  }
  Stmt& Bind(int i, const std::string& v) {
    sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Stmt& BindBlob(int i, const std::string& v) {
    sqlite3_bind_blob(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  // SQLITE_ROW, SQLITE_DONE or an error code.
  int Step() { return sqlite3_step(stmt_); }
  absl::Status Run() {
    RETURN_IF_ERROR(status());
    int rc = Step();
    if (rc != SQLITE_DONE)
      return absl::InternalError(absl::StrCat("job store: write: ", sqlite3_errmsg(db_)));
    return absl::OkStatus();
  }
  // Makes the statement runnable again (bindings are kept until rebound).
  void Reset() { sqlite3_reset(stmt_); }
  int64_t Int(int col) { return sqlite3_column_int64(stmt_, col); }
  double Real(int col) { return sqlite3_column_double(stmt_, col); }
  std::string Text(int col) {
    const void* p = sqlite3_column_blob(stmt_, col);
    int n = sqlite3_column_bytes(stmt_, col);
    return p ? std::string(static_cast<const char*>(p), n) : std::string();
  }
  absl::Status StepError() const {
    return absl::InternalError(absl::StrCat("job store: read: ", sqlite3_errmsg(db_)));
  }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  int rc_;
};

constexpr char kJobColumns[] =
    "job_id, seq, name, state, priority, spec_json, plan, submitted_ms, updated_ms, attempt, "
    "restarts, max_restarts, message, last_checkpoint_step, last_checkpoint_path, request_id, "
    "final_step, final_loss, owner";

// The next job sequence number: past every stored job and every deleted one.
constexpr char kNextSeq[] =
    "SELECT MAX(COALESCE((SELECT MAX(seq) FROM jobs), 0), "
    "COALESCE((SELECT value FROM counters WHERE name = 'last_seq'), 0)) + 1";

JobRecord ReadJob(Stmt& s) {
  JobRecord j;
  j.job_id = s.Text(0);
  j.seq = s.Int(1);
  j.name = s.Text(2);
  j.state = static_cast<JobState>(s.Int(3));
  j.priority = s.Int(4);
  j.spec_json = s.Text(5);
  j.plan = s.Text(6);
  j.submitted_ms = s.Int(7);
  j.updated_ms = s.Int(8);
  j.attempt = s.Int(9);
  j.restarts = s.Int(10);
  j.max_restarts = s.Int(11);
  j.message = s.Text(12);
  j.last_checkpoint_step = s.Int(13);
  j.last_checkpoint_path = s.Text(14);
  j.request_id = s.Text(15);
  j.final_step = s.Int(16);
  j.final_loss = s.Real(17);
  j.owner = s.Text(18);
  return j;
}

}  // namespace

void SqliteJobStore::RemoveFiles(const std::string& path) {
  for (const char* suffix : {"", "-wal", "-shm", "-journal", kLockSuffix})
    ::unlink((path + suffix).c_str());
}

absl::StatusOr<std::unique_ptr<SqliteJobStore>> SqliteJobStore::Open(const std::string& path) {
  ASSIGN_OR_RETURN(const int lock_fd, LockStore(path));
  sqlite3* db = nullptr;
  int rc = sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
    sqlite3_close(db);
    ::close(lock_fd);
    return absl::UnavailableError(absl::StrCat("job store: cannot open ", path, ": ", msg));
  }
  std::unique_ptr<SqliteJobStore> store(new SqliteJobStore(db, lock_fd));
  absl::MutexLock l(&store->mu_);
  sqlite3_busy_timeout(db, 5000);
  absl::Status st = store->Exec("PRAGMA journal_mode=WAL");
  if (st.ok()) st = store->Exec("PRAGMA synchronous=FULL");
  if (st.ok()) st = store->Exec("PRAGMA foreign_keys=ON");
  if (!st.ok()) {
    return absl::DataLossError(
        absl::StrCat("job store: ", path, " is not a usable database: ", sqlite3_errmsg(db)));
  }
  RETURN_IF_ERROR(store->Migrate());
  return store;
}

SqliteJobStore::~SqliteJobStore() {
  absl::MutexLock l(&mu_);
  sqlite3_close(db_);
  ::close(lock_fd_);
}

absl::Status SqliteJobStore::Exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : sqlite3_errmsg(db_);
    sqlite3_free(err);
    return absl::InternalError(absl::StrCat("job store: ", msg));
  }
  return absl::OkStatus();
}

template <typename F>
absl::Status SqliteJobStore::InTransaction(F body) {
  RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE"));
  absl::Status st = body();
  if (st.ok()) st = Exec("COMMIT");
  if (!st.ok()) Exec("ROLLBACK").IgnoreError();
  return st;
}

absl::Status SqliteJobStore::Migrate() {
  RETURN_IF_ERROR(
      Exec("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
           "applied_ms INTEGER NOT NULL)"));
  int current = 0;
  {
    Stmt s(db_, "SELECT COALESCE(MAX(version), 0) FROM schema_migrations");
    RETURN_IF_ERROR(s.status());
    if (s.Step() != SQLITE_ROW) return s.StepError();
    current = static_cast<int>(s.Int(0));
  }
  if (current > kSchemaVersion)
    return absl::DataLossError(absl::StrCat("job store: schema version ", current,
                                            " is newer than this coordinator's ", kSchemaVersion));
  for (int v = current; v < kSchemaVersion; ++v) {
    RETURN_IF_ERROR(InTransaction([&]() -> absl::Status {
      RETURN_IF_ERROR(Exec(kMigrations[v]));
      Stmt s(db_,
             "INSERT INTO schema_migrations (version, applied_ms) VALUES "
             "(?, CAST(strftime('%s','now') AS INTEGER) * 1000)");
      s.Bind(1, int64_t{v + 1});
      return s.Run();
    }));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> SqliteJobStore::SchemaVersion() {
  absl::MutexLock l(&mu_);
  Stmt s(db_, "SELECT COALESCE(MAX(version), 0) FROM schema_migrations");
  RETURN_IF_ERROR(s.status());
  if (s.Step() != SQLITE_ROW) return s.StepError();
  return static_cast<int>(s.Int(0));
}

absl::Status SqliteJobStore::WriteJobRow(const JobRecord& j) {
  Stmt s(db_, absl::StrCat("INSERT OR REPLACE INTO jobs (", kJobColumns,
                           ") VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)")
                  .c_str());
  s.Bind(1, j.job_id).Bind(2, j.seq).Bind(3, j.name).Bind(4, static_cast<int64_t>(j.state));
  s.Bind(5, j.priority).Bind(6, j.spec_json).BindBlob(7, j.plan).Bind(8, j.submitted_ms);
  s.Bind(9, j.updated_ms).Bind(10, j.attempt).Bind(11, j.restarts).Bind(12, j.max_restarts);
  s.Bind(13, j.message).Bind(14, j.last_checkpoint_step).Bind(15, j.last_checkpoint_path);
  s.Bind(16, j.request_id).Bind(17, j.final_step).Bind(18, j.final_loss).Bind(19, j.owner);
  return s.Run();
}

absl::Status SqliteJobStore::WriteEvent(const EventRecord& e) {
  {
    Stmt s(db_, "INSERT INTO events (job_id, attempt, unix_ms, state, message) VALUES (?,?,?,?,?)");
    s.Bind(1, e.job_id).Bind(2, e.attempt).Bind(3, e.unix_ms);
    s.Bind(4, static_cast<int64_t>(e.state)).Bind(5, e.message);
    RETURN_IF_ERROR(s.Run());
  }
  // The job keeps its newest kMaxEventsPerJob events (through the (job_id, id) index).
  Stmt s(db_,
         "DELETE FROM events WHERE job_id = ?1 AND id < (SELECT id FROM events WHERE job_id = ?1 "
         "ORDER BY id DESC LIMIT 1 OFFSET ?2)");
  s.Bind(1, e.job_id).Bind(2, kMaxEventsPerJob - 1);
  return s.Run();
}

absl::Status SqliteJobStore::WriteAttempt(const AttemptRecord& a) {
  {
    Stmt s(db_,
           "INSERT OR REPLACE INTO attempts (job_id, attempt, rendezvous_token, started_ms, "
           "ended_ms, outcome) VALUES (?,?,?,?,?,?)");
    s.Bind(1, a.job_id).Bind(2, a.attempt).Bind(3, a.rendezvous_token).Bind(4, a.started_ms);
    s.Bind(5, a.ended_ms).Bind(6, a.outcome);
    RETURN_IF_ERROR(s.Run());
  }
  for (const RankPlacement& r : a.ranks) {
    Stmt s(db_,
           "INSERT OR REPLACE INTO attempt_ranks (job_id, attempt, rank, worker_id, device_index) "
           "VALUES (?,?,?,?,?)");
    s.Bind(1, a.job_id).Bind(2, a.attempt).Bind(3, r.rank).Bind(4, r.worker_id);
    s.Bind(5, int64_t{r.device_index});
    RETURN_IF_ERROR(s.Run());
  }
  return absl::OkStatus();
}

absl::Status SqliteJobStore::CreateJob(JobRecord* job, const EventRecord& event) {
  absl::MutexLock l(&mu_);
  return InTransaction([&]() -> absl::Status {
    Stmt s(db_, kNextSeq);
    RETURN_IF_ERROR(s.status());
    if (s.Step() != SQLITE_ROW) return s.StepError();
    job->seq = s.Int(0);
    job->job_id = absl::StrFormat("j-%06d", job->seq);
    RETURN_IF_ERROR(WriteJobRow(*job));
    EventRecord e = event;
    e.job_id = job->job_id;
    return WriteEvent(e);
  });
}

absl::Status SqliteJobStore::SaveJob(const JobRecord& job, const EventRecord* event,
                                     const AttemptRecord* attempt) {
  absl::MutexLock l(&mu_);
  return InTransaction([&]() -> absl::Status {
    RETURN_IF_ERROR(WriteJobRow(job));
    if (event) RETURN_IF_ERROR(WriteEvent(*event));
    if (attempt) RETURN_IF_ERROR(WriteAttempt(*attempt));
    return absl::OkStatus();
  });
}

absl::Status SqliteJobStore::DeleteJobs(const std::vector<std::string>& job_ids) {
  if (job_ids.empty()) return absl::OkStatus();
  absl::MutexLock l(&mu_);
  return InTransaction([&]() -> absl::Status {
    {
      // Deleting the newest job must not give its sequence number (and id) to the next one.
      Stmt s(db_, absl::StrCat("INSERT OR REPLACE INTO counters (name, value) VALUES "
                               "('last_seq', (",
                               kNextSeq, ") - 1)")
                      .c_str());
      RETURN_IF_ERROR(s.Run());
    }
    for (const char* sql :
         {"DELETE FROM events WHERE job_id = ?", "DELETE FROM attempt_ranks WHERE job_id = ?",
          "DELETE FROM attempts WHERE job_id = ?", "DELETE FROM jobs WHERE job_id = ?"}) {
      Stmt s(db_, sql);
      RETURN_IF_ERROR(s.status());
      for (const std::string& id : job_ids) {
        s.Bind(1, id);
        RETURN_IF_ERROR(s.Run());
        s.Reset();
      }
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<std::vector<JobRecord>> SqliteJobStore::LoadJobs() {
  absl::MutexLock l(&mu_);
  Stmt s(db_, absl::StrCat("SELECT ", kJobColumns, " FROM jobs ORDER BY seq").c_str());
  RETURN_IF_ERROR(s.status());
  std::vector<JobRecord> out;
  int rc;
  while ((rc = s.Step()) == SQLITE_ROW) out.push_back(ReadJob(s));
  if (rc != SQLITE_DONE) return s.StepError();
  return out;
}

absl::StatusOr<std::vector<EventRecord>> SqliteJobStore::LoadEvents(const std::string& job_id) {
  absl::MutexLock l(&mu_);
  Stmt s(db_,
         "SELECT job_id, attempt, unix_ms, state, message FROM events WHERE job_id = ? ORDER BY "
         "id");
  RETURN_IF_ERROR(s.status());
  s.Bind(1, job_id);
  std::vector<EventRecord> out;
  int rc;
  while ((rc = s.Step()) == SQLITE_ROW) {
    EventRecord e;
    e.job_id = s.Text(0);
    e.attempt = s.Int(1);
    e.unix_ms = s.Int(2);
    e.state = static_cast<JobState>(s.Int(3));
    e.message = s.Text(4);
    out.push_back(std::move(e));
  }
  if (rc != SQLITE_DONE) return s.StepError();
  return out;
}

absl::StatusOr<AttemptRecord> SqliteJobStore::LoadAttempt(const std::string& job_id,
                                                          int64_t attempt) {
  absl::MutexLock l(&mu_);
  AttemptRecord a;
  {
    Stmt s(db_,
           "SELECT rendezvous_token, started_ms, ended_ms, outcome FROM attempts WHERE job_id = ? "
           "AND attempt = ?");
    RETURN_IF_ERROR(s.status());
    s.Bind(1, job_id).Bind(2, attempt);
    int rc = s.Step();
    if (rc == SQLITE_DONE)
      return absl::NotFoundError(
          absl::StrCat("job store: no attempt ", attempt, " of job ", job_id));
    if (rc != SQLITE_ROW) return s.StepError();
    a.job_id = job_id;
    a.attempt = attempt;
    a.rendezvous_token = s.Text(0);
    a.started_ms = s.Int(1);
    a.ended_ms = s.Int(2);
    a.outcome = s.Text(3);
  }
  Stmt s(db_,
         "SELECT rank, worker_id, device_index FROM attempt_ranks WHERE job_id = ? AND attempt = "
         "? ORDER BY rank");
  RETURN_IF_ERROR(s.status());
  s.Bind(1, job_id).Bind(2, attempt);
  int rc;
  while ((rc = s.Step()) == SQLITE_ROW)
    a.ranks.push_back({s.Int(0), s.Text(1), static_cast<int32_t>(s.Int(2))});
  if (rc != SQLITE_DONE) return s.StepError();
  return a;
}

absl::Status SqliteJobStore::SaveWorker(const WorkerRecord& w) {
  absl::MutexLock l(&mu_);
  Stmt s(db_,
         "INSERT OR REPLACE INTO workers (worker_id, hostname, devices, metrics_address, "
         "registered_ms) VALUES (?,?,?,?,?)");
  s.Bind(1, w.worker_id).Bind(2, w.hostname).BindBlob(3, w.devices).Bind(4, w.metrics_address);
  s.Bind(5, w.registered_ms);
  return s.Run();
}

absl::StatusOr<std::vector<WorkerRecord>> SqliteJobStore::LoadWorkers() {
  absl::MutexLock l(&mu_);
  Stmt s(db_,
         "SELECT worker_id, hostname, devices, metrics_address, registered_ms FROM workers ORDER "
         "BY worker_id");
  RETURN_IF_ERROR(s.status());
  std::vector<WorkerRecord> out;
  int rc;
  while ((rc = s.Step()) == SQLITE_ROW)
    out.push_back({s.Text(0), s.Text(1), s.Text(2), s.Text(3), s.Int(4)});
  if (rc != SQLITE_DONE) return s.StepError();
  return out;
}

// --- IdentityStore ---------------------------------------------------------------------------

absl::Status SqliteJobStore::SaveCertificate(const CertificateRecord& c) {
  absl::MutexLock l(&mu_);
  Stmt s(db_,
         "INSERT OR IGNORE INTO worker_certificates (serial, worker_id, recorded_ms, "
         "not_after_ms, revoked_ms) VALUES (?,?,?,?,?)");
  s.Bind(1, c.serial_hex).Bind(2, c.worker_id).Bind(3, c.recorded_ms).Bind(4, c.not_after_ms);
  s.Bind(5, c.revoked_ms);
  return s.Run();
}

absl::StatusOr<std::vector<CertificateRecord>> SqliteJobStore::LoadCertificates() {
  absl::MutexLock l(&mu_);
  Stmt s(db_,
         "SELECT serial, worker_id, recorded_ms, not_after_ms, revoked_ms FROM "
         "worker_certificates ORDER BY recorded_ms");
  RETURN_IF_ERROR(s.status());
  std::vector<CertificateRecord> out;
  int rc;
  while ((rc = s.Step()) == SQLITE_ROW)
    out.push_back({s.Text(0), s.Text(1), s.Int(2), s.Int(3), s.Int(4)});
  if (rc != SQLITE_DONE) return s.StepError();
  return out;
}

absl::StatusOr<int64_t> SqliteJobStore::RevokeCertificates(const std::string& worker_id,
                                                           int64_t now_ms) {
  absl::MutexLock l(&mu_);
  Stmt s(db_,
         "UPDATE worker_certificates SET revoked_ms = ? WHERE worker_id = ? AND revoked_ms = 0");
  s.Bind(1, now_ms).Bind(2, worker_id);
  RETURN_IF_ERROR(s.Run());
  return static_cast<int64_t>(sqlite3_changes(db_));
}

absl::StatusOr<int64_t> SqliteJobStore::CountBootstrapJoin(const std::string& token_sha256,
                                                           int64_t max_joins) {
  absl::MutexLock l(&mu_);
  int64_t joins = 0;
  absl::Status st = InTransaction([&]() -> absl::Status {
    {
      Stmt s(db_, "SELECT joins FROM bootstrap_joins WHERE token_sha256 = ?");
      RETURN_IF_ERROR(s.status());
      s.Bind(1, token_sha256);
      const int rc = s.Step();
      if (rc == SQLITE_ROW) {
        joins = s.Int(0);
      } else if (rc != SQLITE_DONE) {
        return s.StepError();
      }
    }
    if (max_joins > 0 && joins >= max_joins) return absl::ResourceExhaustedError("used up");
    ++joins;
    Stmt s(db_, "INSERT OR REPLACE INTO bootstrap_joins (token_sha256, joins) VALUES (?,?)");
    s.Bind(1, token_sha256).Bind(2, joins);
    return s.Run();
  });
  if (!st.ok()) return st;
  return joins;
}

}  // namespace spindle
