// Fault injection into the SQLite store under the job manager (leveldb's fault_injection_test
// style): a job's whole life (placement, start, a checkpoint, a rank failure, the restart, success)
// is run once per write, with that write failing, and once per write with the coordinator
// "crashing" at it. A failed write leaves the job in memory exactly as the store holds it, and the
// life goes on to success; after a crash, a coordinator reopened on the file holds the job as the
// last acknowledged write left it. The same life runs on the in-memory store (MemoryJobStore).
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/job_manager.h"
#include "coordinator/sqlite_job_store.h"
#include "coordinator/worker_proto.h"
#include "gtest/gtest.h"
#include "spindle/v1/cluster.pb.h"
#include "spindle/v1/job.pb.h"
#include "tests/control/memory_job_store.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

using testing::FaultInjectingJobStore;
using Fault = FaultInjectingJobStore::Fault;

// What a restarted coordinator must see again: the job as stored.
struct JobView {
  v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
  int64_t attempt = 0, restarts = 0, checkpoint = 0, events = 0;
  std::string message;
  bool operator==(const JobView&) const = default;
};
std::string Show(const JobView& v) {
  return absl::StrCat("state ", v.state, " attempt ", v.attempt, " restarts ", v.restarts,
                      " checkpoint ", v.checkpoint, " events ", v.events, " \"", v.message, "\"");
}

class Coordinator {
 public:
  Coordinator(JobStore* store, FakeClock* clock) : store_(store) {
    JobManagerOptions o;
    o.heartbeat_timeout_ms = 3000;
    o.stop_grace_ms = 1000;
    o.recovery_grace_ms = 4000;
    o.rendezvous_address = "127.0.0.1:1";
    manager_ = std::make_unique<JobManager>(store, clock, &channel_, &rendezvous_, o);
    recovered_ = manager_->Recover();
  }
  JobManager& manager() { return *manager_; }
  const absl::Status& recovered() const { return recovered_; }

  JobView InMemory(const std::string& id) {
    v1::Job j;
    if (!testing::GetJobProto(*manager_, id, true, &j).ok()) return {};
    return {j.state(),       j.attempt(), j.restarts(), j.last_checkpoint_step(),
            j.events_size(), j.message()};
  }
  JobView Stored(const std::string& id) {
    absl::StatusOr<std::vector<JobRecord>> jobs = store_->LoadJobs();
    if (!jobs.ok()) return {};
    for (const JobRecord& r : *jobs) {
      if (r.job_id != id) continue;
      absl::StatusOr<std::vector<EventRecord>> events = store_->LoadEvents(id);
      return {static_cast<v1::JobState>(r.state),
              r.attempt,
              r.restarts,
              r.last_checkpoint_step,
              events.ok() ? static_cast<int64_t>(events->size()) : -1,
              r.message};
    }
    return {};
  }

  void Worker(const std::string& id) {
    if (!manager_
             ->RegisterWorker(
                 RegistrationFromProto(testing::OneCpuSlotWorker(id, id), "127.0.0.1"))
             .ok())
      return;
    v1::SessionHello h;
    h.set_worker_id(id);
    testing::OpenSession(*manager_, h, ++session_).IgnoreError();
  }
  // A message from each rank of the job's current attempt, from the worker it is on.
  void FromEveryRank(const std::string& id,
                     const std::function<void(v1::WorkerMessage*, const v1::RankRef&)>& fill,
                     int only_rank = -1) {
    v1::Job j;
    if (!testing::GetJobProto(*manager_, id, false, &j).ok()) return;
    for (const v1::RankStatus& r : j.ranks()) {
      if (only_rank >= 0 && r.rank() != only_rank) continue;
      v1::RankRef ref;
      ref.set_job_id(id);
      ref.set_attempt(j.attempt());
      ref.set_rank(r.rank());
      v1::WorkerMessage m;
      fill(&m, ref);
      testing::Deliver(*manager_, r.worker_id(), m);
    }
  }

 private:
  JobStore* store_;
  testing::FakeWorkerChannel channel_;
  RendezvousStore rendezvous_;
  std::unique_ptr<JobManager> manager_;
  absl::Status recovered_;
  uint64_t session_ = 0;
};

// One life of a cp = 2 job; `after_each` runs after every step and returns false to stop (a
// crash). `*job_id`: the job's id once submitted ("" when the submit was refused).
void Life(Coordinator& c, FakeClock& clock, const std::function<bool()>& after_each,
          std::string* job_id) {
  c.Worker("w1");
  c.Worker("w2");
  CpPlan plan;
  absl::StatusOr<std::string> submitted =
      c.manager().Submit(testing::SpecJson(2, 1, 0, /*max_restarts=*/5), &plan);
  if (!submitted.ok()) return;
  const std::string id = *job_id = *submitted;
  auto tick = [&] {
    clock.AdvanceMs(100);
    c.manager().Tick();  // a placement whose write failed is tried again
  };
  const std::vector<std::function<void()>> steps = {
      [&] { tick(); },
      [&] {
        c.FromEveryRank(id, [](v1::WorkerMessage* m, const v1::RankRef& r) {
          *m->mutable_rank_started()->mutable_ref() = r;
        });
      },
      [&] {
        c.FromEveryRank(id, [](v1::WorkerMessage* m, const v1::RankRef& r) {
          *m->mutable_checkpoint_done()->mutable_ref() = r;
          m->mutable_checkpoint_done()->set_step(5);
          m->mutable_checkpoint_done()->set_path("/tmp/ck/step_00000005");
        });
      },
      [&] {
        c.FromEveryRank(
            id,
            [](v1::WorkerMessage* m, const v1::RankRef& r) {
              *m->mutable_rank_exit()->mutable_ref() = r;
              m->mutable_rank_exit()->set_exit_code(1);
            },
            /*only_rank=*/1);
      },
      [&] {
        c.FromEveryRank(
            id,
            [](v1::WorkerMessage* m, const v1::RankRef& r) {
              *m->mutable_rank_exit()->mutable_ref() = r;
              m->mutable_rank_exit()->set_exit_code(-1);
              m->mutable_rank_exit()->set_signal(15);
              m->mutable_rank_exit()->set_stopped(true);
            },
            /*only_rank=*/0);
        tick();
      },
      [&] { tick(); },
      [&] {
        c.FromEveryRank(id, [](v1::WorkerMessage* m, const v1::RankRef& r) {
          *m->mutable_rank_started()->mutable_ref() = r;
        });
      },
      [&] {
        c.FromEveryRank(id, [](v1::WorkerMessage* m, const v1::RankRef& r) {
          *m->mutable_rank_exit()->mutable_ref() = r;
          m->mutable_rank_exit()->set_exit_code(0);
        });
      },
  };
  if (!after_each()) return;
  for (const auto& step : steps) {
    step();
    if (!after_each()) return;
  }
}

TEST(JobStoreFaultTest, EachFailedWriteLeavesMemoryAsStoredAndTheJobStillSucceeds) {
  testing::TempDir dir;
  int64_t total = 0;
  {  // Without faults: how many writes a life takes, and how it ends.
    auto sqlite = SqliteJobStore::Open(dir.File("clean.db"));
    ASSERT_TRUE(sqlite.ok());
    FaultInjectingJobStore store(sqlite->get(), Fault::kNone, 0);
    FakeClock clock;
    Coordinator c(&store, &clock);
    std::string id;
    Life(
        c, clock, [] { return true; }, &id);
    EXPECT_EQ(c.InMemory(id).state, v1::JOB_STATE_SUCCEEDED);
    EXPECT_EQ(c.InMemory(id).restarts, 1);
    total = store.writes();
  }
  ASSERT_GE(total, 8);
  for (int64_t k = 1; k <= total; ++k) {
    SCOPED_TRACE(absl::StrCat("write ", k, " of ", total, " fails"));
    auto sqlite = SqliteJobStore::Open(dir.File(absl::StrCat("fail-", k, ".db")));
    ASSERT_TRUE(sqlite.ok());
    FaultInjectingJobStore store(sqlite->get(), Fault::kFail, k);
    FakeClock clock;
    Coordinator c(&store, &clock);
    std::string id;
    int step = 0;
    Life(
        c, clock,
        [&] {
          const JobView mem = c.InMemory(id), disk = c.Stored(id);
          EXPECT_EQ(mem, disk) << "after step " << step << ": in memory " << Show(mem)
                               << ", stored " << Show(disk);
          ++step;
          return true;
        },
        &id);
    if (id.empty()) continue;  // the submit's own write failed: refused, nothing stored
    EXPECT_TRUE(store.fired());
    EXPECT_EQ(c.InMemory(id), c.Stored(id));
  }
}

TEST(JobStoreFaultTest, ACrashAtAnyWriteReopensAsTheLastAcknowledgedWriteLeftTheJob) {
  testing::TempDir dir;
  for (int64_t k = 1; k <= 12; ++k) {
    SCOPED_TRACE(absl::StrCat("the coordinator crashes at write ", k));
    const std::string path = dir.File(absl::StrCat("crash-", k, ".db"));
    JobView before;
    std::string id;
    bool fired = false;
    {
      auto sqlite = SqliteJobStore::Open(path);
      ASSERT_TRUE(sqlite.ok());
      FaultInjectingJobStore store(sqlite->get(), Fault::kCrash, k);
      FakeClock clock;
      Coordinator c(&store, &clock);
      Life(
          c, clock,
          [&] {
            fired = store.fired();
            return !fired;
          },
          &id);
      if (!fired || id.empty()) continue;
      before = c.InMemory(id);  // the last acknowledged state: the failed write changed nothing
      EXPECT_EQ(before, c.Stored(id));
    }
    auto sqlite = SqliteJobStore::Open(path);
    ASSERT_TRUE(sqlite.ok());
    FakeClock clock;
    Coordinator reopened(sqlite->get(), &clock);
    ASSERT_TRUE(reopened.recovered().ok()) << reopened.recovered();
    EXPECT_EQ(reopened.InMemory(id), before)
        << "reopened: " << Show(reopened.InMemory(id)) << ", before the crash: " << Show(before);
  }
}

TEST(JobStoreFaultTest, TheLifeRunsOnTheInMemoryStore) {
  testing::MemoryJobStore store;
  FakeClock clock;
  Coordinator c(&store, &clock);
  std::string id;
  Life(
      c, clock, [] { return true; }, &id);
  const JobView v = c.InMemory(id);
  EXPECT_EQ(v.state, v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(v.attempt, 2);
  EXPECT_EQ(v.restarts, 1);
  EXPECT_EQ(v.checkpoint, 5);
  EXPECT_EQ(v, c.Stored(id));
}

}  // namespace
}  // namespace spindle
