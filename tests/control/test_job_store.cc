// JobStore: round trips, schema migrations, and crash durability: a writer process is killed
// with SIGKILL mid-stream and every transition it acknowledged must be there after reopening.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/sqlite_job_store.h"
#include "gtest/gtest.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

using testing::TempDir;

JobRecord NewJob(const std::string& name) {
  JobRecord j;
  j.name = name;
  j.priority = 3;
  j.spec_json = R"({"name":"x"})";
  j.plan = std::string("\x01\x00\x02", 3);
  j.submitted_ms = j.updated_ms = 1000;
  j.max_restarts = 2;
  j.message = "waiting";
  return j;
}

TEST(JobStoreTest, CreateSaveAndReopen) {
  TempDir dir;
  const std::string path = dir.File("s.db");
  {
    auto store = SqliteJobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    JobRecord a = NewJob("a"), b = NewJob("b");
    ASSERT_TRUE((*store)->CreateJob(&a, {"", 0, 1000, JobState::kQueued, "submitted"}).ok());
    ASSERT_TRUE((*store)->CreateJob(&b, {"", 0, 1001, JobState::kQueued, "submitted"}).ok());
    EXPECT_EQ(a.job_id, "j-000001");
    EXPECT_EQ(b.job_id, "j-000002");
    a.state = JobState::kPlaced;
    a.attempt = 1;
    AttemptRecord at{a.job_id, 1, {{0, "w1", 0}, {1, "w2", 3}}, "tok", 1200, 0, ""};
    EventRecord ev{a.job_id, 1, 1200, JobState::kPlaced, "placed"};
    ASSERT_TRUE((*store)->SaveJob(a, &ev, &at).ok());
    WorkerRecord w{"w1", "host1", "devs", "host1:9401", 900};
    ASSERT_TRUE((*store)->SaveWorker(w).ok());
  }
  auto store = SqliteJobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(*(*store)->SchemaVersion(), SqliteJobStore::kSchemaVersion);
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), 2u);
  EXPECT_EQ((*jobs)[0].state, JobState::kPlaced);
  EXPECT_EQ((*jobs)[0].plan, std::string("\x01\x00\x02", 3));
  EXPECT_EQ((*jobs)[0].priority, 3);
  EXPECT_EQ((*jobs)[1].name, "b");
  auto events = (*store)->LoadEvents("j-000001");
  ASSERT_TRUE(events.ok());
  ASSERT_EQ(events->size(), 2u);
  EXPECT_EQ((*events)[1].message, "placed");
  auto at = (*store)->LoadAttempt("j-000001", 1);
  ASSERT_TRUE(at.ok());
  ASSERT_EQ(at->ranks.size(), 2u);
  EXPECT_EQ(at->ranks[1].worker_id, "w2");
  EXPECT_EQ(at->ranks[1].device_index, 3);
  EXPECT_EQ(at->rendezvous_token, "tok");
  auto missing = (*store)->LoadAttempt("j-000001", 7);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(), "job store: no attempt 7 of job j-000001");
  auto workers = (*store)->LoadWorkers();
  ASSERT_EQ(workers->size(), 1u);
  EXPECT_EQ((*workers)[0].metrics_address, "host1:9401");
}

TEST(JobStoreTest, RejectsNonDatabaseAndUnopenablePath) {
  TempDir dir;
  const std::string junk_path = dir.File("junk.db");
  const std::string text =
      "this is not a sqlite database, just some text that is long enough......";
  {
    FILE* f = fopen(junk_path.c_str(), "w");
    fputs(text.c_str(), f);
    fclose(f);
  }
  auto junk = SqliteJobStore::Open(junk_path);
  EXPECT_EQ(junk.status().code(), absl::StatusCode::kDataLoss) << junk.status();
  EXPECT_EQ(junk.status().message(),
            "job store: " + junk_path + " is not a usable database: file is not a database");
  std::ifstream in(junk_path);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), text);  // refused, not rewritten
  auto bad = SqliteJobStore::Open(dir.File("no/such/dir/x.db"));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnavailable) << bad.status();
  EXPECT_EQ(bad.status().message(), "job store: cannot open " + dir.File("no/such/dir/x.db") +
                                        ": No such file or directory");
}

// Opens the store at `path` in a child process; returns the child's pid and what the open said
// ("ok", or the status code and message). With `hold` a child that opened it keeps it open until
// it is killed; otherwise the child exits.
std::pair<pid_t, std::string> OpenInChild(const std::string& path, bool hold) {
  int fds[2];
  if (::pipe(fds) != 0) return {-1, "pipe failed"};
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    auto store = SqliteJobStore::Open(path);
    const std::string said = store.ok() ? std::string("ok")
                                        : absl::StrCat(static_cast<int>(store.status().code()), " ",
                                                       store.status().message());
    (void)!::write(fds[1], (said + "\n").data(), said.size() + 1);
    if (hold && store.ok()) ::pause();
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string said;
  char ch;
  while (pid > 0 && ::read(fds[0], &ch, 1) == 1 && ch != '\n') said.push_back(ch);
  ::close(fds[0]);
  return {pid, said};
}

// One store, one writer: while a store is open, a second Open of the same file (from another
// process, as a second coordinator would be) is refused by name and changes nothing; once the
// holder is gone, even killed, the store opens again.
TEST(JobStoreTest, SecondWriterIsRefusedUntilTheFirstIsGone) {
  TempDir dir;
  const std::string path = dir.File("one.db");
  auto store = SqliteJobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  JobRecord a = NewJob("a");
  ASSERT_TRUE((*store)->CreateJob(&a, {"", 0, 1000, JobState::kQueued, "submitted"}).ok());

  const auto [child, said] = OpenInChild(path, /*hold=*/false);
  ASSERT_GT(child, 0) << said;
  ::waitpid(child, nullptr, 0);
  EXPECT_EQ(said, absl::StrCat(static_cast<int>(absl::StatusCode::kFailedPrecondition),
                               " job store: ", path, " is in use by another coordinator (pid ",
                               ::getpid(), "); one store takes one coordinator"));
  auto jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);  // the refused open wrote nothing

  store->reset();  // closing the store releases the lock
  auto again = SqliteJobStore::Open(path);
  ASSERT_TRUE(again.ok()) << again.status();
  again->reset();

  // A holder killed with SIGKILL releases it too (the kernel drops a dead process's flocks).
  const auto [holder, held] = OpenInChild(path, /*hold=*/true);
  ASSERT_GT(holder, 0) << held;
  ASSERT_EQ(held, "ok");
  EXPECT_EQ(SqliteJobStore::Open(path).status().code(), absl::StatusCode::kFailedPrecondition);
  ::kill(holder, SIGKILL);
  ::waitpid(holder, nullptr, 0);
  auto after = SqliteJobStore::Open(path);
  EXPECT_TRUE(after.ok()) << after.status();
}

// A child process creates jobs and transitions them, writing the id of each acknowledged write to
// a pipe; the parent SIGKILLs it at a random point. Every acknowledged write must survive.
TEST(JobStoreTest, AcknowledgedWritesSurviveSigkill) {
  TempDir dir;
  const std::string path = dir.File("crash.db");
  // Every acknowledged job, over all rounds: a job a writer created but was killed before
  // acknowledging stays in the store, QUEUED, and has a lower seq than later rounds' jobs.
  std::set<int64_t> acked;
  for (int round = 0; round < 3; ++round) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(fds[0]);
      auto store = SqliteJobStore::Open(path);
      if (!store.ok()) _exit(3);
      for (int i = 0;; ++i) {
        JobRecord j = NewJob("crash");
        if (!(*store)->CreateJob(&j, {"", 0, 1, JobState::kQueued, "submitted"}).ok()) _exit(4);
        j.state = JobState::kRunning;
        EventRecord ev{j.job_id, 1, 2, JobState::kRunning, "running"};
        if (!(*store)->SaveJob(j, &ev).ok()) _exit(5);
        int64_t seq = j.seq;
        if (write(fds[1], &seq, sizeof(seq)) != sizeof(seq)) _exit(6);
      }
    }
    close(fds[1]);
    int64_t last_acked = 0, seq;
    int acks = 0;
    while (acks < 20 + round * 15 && read(fds[0], &seq, sizeof(seq)) == sizeof(seq)) {
      last_acked = seq;
      acked.insert(seq);
      ++acks;
    }
    kill(pid, SIGKILL);
    while (read(fds[0], &seq, sizeof(seq)) == sizeof(seq)) last_acked = seq, acked.insert(seq);
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "writer exited early with status " << status;

    auto store = SqliteJobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    auto jobs = (*store)->LoadJobs();
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    ASSERT_GE(static_cast<int64_t>(jobs->size()), last_acked);
    size_t found = 0;
    for (const JobRecord& j : *jobs) found += acked.count(j.seq);
    EXPECT_EQ(found, acked.size()) << "an acknowledged job is missing";
    for (const JobRecord& j : *jobs) {
      if (!acked.count(j.seq)) continue;  // written but never acknowledged: may or may not exist
      EXPECT_EQ(j.state, JobState::kRunning) << j.job_id;
      auto ev = (*store)->LoadEvents(j.job_id);
      ASSERT_TRUE(ev.ok());
      EXPECT_EQ(ev->size(), 2u) << j.job_id;
    }
  }
}

}  // namespace
}  // namespace spindle
