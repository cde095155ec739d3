// Bounded resources and idempotent submits in the JobManager (FakeClock, real SQLite file):
// List pages and page tokens, the retention of finished jobs (rows, events and memory, ids never
// reused), request ids that return the job of an earlier submit (also after a restart), the
// paging and retention helpers, and the rendezvous store's key cap and cancellable waits.
#include <atomic>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/text_bounds.h"
#include "coordinator/job_manager.h"
#include "coordinator/job_pages.h"
#include "coordinator/retention.h"
#include "coordinator/sqlite_job_store.h"
#include "coordinator/worker_proto.h"
#include "gtest/gtest.h"
#include "spindle/v1/job.pb.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

using testing::FakeWorkerChannel;
using testing::SpecJson;
using testing::TempDir;
using testing::WithCheckpointDir;

class JobBoundsTest : public ::testing::Test {
 protected:
  void SetUp() override { Reopen(); }

  void Reopen(RetentionPolicy retention = {0, 0}) {
    manager_.reset();
    store_.reset();
    auto s = SqliteJobStore::Open(dir_.File("c.db"));
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
    JobManagerOptions o;
    o.rendezvous_address = "127.0.0.1:1";
    o.retention = retention;
    manager_ = std::make_unique<JobManager>(store_.get(), &clock_, &channel_, &rendezvous_, o);
    ASSERT_TRUE(manager_->Recover().ok());
  }

  // A job with a checkpoint directory of its own (unfinished jobs may not share one).
  std::string Submit(int n, const std::string& request_id = "") {
    auto id = manager_->Submit(WithCheckpointDir(SpecJson(), absl::StrCat("/tmp/ck-", n)), nullptr,
                               request_id);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : "";
  }
  void Cancel(const std::string& id) {
    JobView out;
    ASSERT_TRUE(manager_->Cancel(id, "", &out).ok());
  }
  // Every page of a listing, as job ids.
  std::vector<std::vector<std::string>> Pages(const std::set<JobState>& states, int page_size) {
    std::vector<std::vector<std::string>> pages;
    std::string token;
    do {
      std::vector<JobView> jobs;
      std::string next;
      absl::Status st = manager_->ListJobPage(states, page_size, token, &jobs, &next);
      EXPECT_TRUE(st.ok()) << st;
      if (!st.ok()) break;
      pages.emplace_back();
      for (const JobView& j : jobs) pages.back().push_back(j.record.job_id);
      token = next;
    } while (!token.empty() && pages.size() < 100);
    return pages;
  }
  std::vector<std::string> StoredIds() {
    std::vector<std::string> ids;
    absl::StatusOr<std::vector<JobRecord>> jobs = store_->LoadJobs();
    EXPECT_TRUE(jobs.ok()) << jobs.status();
    if (jobs.ok())
      for (const JobRecord& r : *jobs) ids.push_back(r.job_id);
    return ids;
  }

  TempDir dir_;
  FakeClock clock_;
  FakeWorkerChannel channel_;
  RendezvousStore rendezvous_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<JobManager> manager_;
};

TEST_F(JobBoundsTest, ListPagesNewestFirstWithoutRepeatsOrGaps) {
  for (int i = 1; i <= 25; ++i) Submit(i);
  auto pages = Pages({}, 10);
  ASSERT_EQ(pages.size(), 3u);
  EXPECT_EQ(pages[0].size(), 10u);
  EXPECT_EQ(pages[1].size(), 10u);
  EXPECT_EQ(pages[2].size(), 5u);
  EXPECT_EQ(pages[0].front(), "j-000025");
  EXPECT_EQ(pages[2].back(), "j-000001");
  std::set<std::string> seen;
  for (const auto& p : pages) seen.insert(p.begin(), p.end());
  EXPECT_EQ(seen.size(), 25u);
  // A full last page has no next page.
  EXPECT_EQ(Pages({}, 25).size(), 1u);

  // A filter pages over the matching jobs only.
  for (int i = 1; i <= 25; i += 2) Cancel(absl::StrFormat("j-%06d", i));
  pages = Pages({JobState::kCancelled}, 5);
  ASSERT_EQ(pages.size(), 3u);
  EXPECT_EQ(pages[0].front(), "j-000025");
  EXPECT_EQ(pages[2].size(), 3u);

  // Jobs submitted between two pages do not shift the next one.
  std::vector<JobView> first, second;
  std::string next, after;
  ASSERT_TRUE(manager_->ListJobPage({}, 10, "", &first, &next).ok());
  Submit(26);
  ASSERT_TRUE(manager_->ListJobPage({}, 10, next, &second, &after).ok());
  EXPECT_EQ(second.front().record.job_id, "j-000015");
}

TEST_F(JobBoundsTest, ListRefusesTokensItDidNotIssue) {
  std::vector<JobView> jobs;
  std::string next;
  absl::Status st = manager_->ListJobPage({}, 10, "j-000003", &jobs, &next);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(),
            "list: page_token is not one this coordinator issued (pass a next_page_token from a "
            "previous List, or none for the first page)");
}

TEST(JobPagesTest, PageSizesAreClampedAndTokensRoundTrip) {
  EXPECT_EQ(*ListPageSize(0), kDefaultListPageSize);
  EXPECT_EQ(*ListPageSize(7), 7);
  EXPECT_EQ(*ListPageSize(1'000'000), kMaxListPageSize);
  EXPECT_EQ(ListPageSize(-1).status().message(), "list: page_size must not be negative, got -1");
  EXPECT_EQ(*ParsePageToken(MakePageToken(42)), 42);
  EXPECT_EQ(*ParsePageToken(""), std::numeric_limits<int64_t>::max());
  for (const char* bad : {"before-", "before-0", "before--3", "before-x", "42"})
    EXPECT_EQ(ParsePageToken(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
}

TEST(RetentionTest, KeepsTheMostRecentlyFinishedWithinTheAge) {
  const int64_t day = 24 * 3600 * 1000;
  std::vector<FinishedJob> finished = {
      {"a", 1, 10 * day}, {"b", 2, 1 * day}, {"c", 3, 9 * day}, {"d", 4, 8 * day}};
  // At most 2: a and c stay (finished last); d and b go, the later finished first.
  EXPECT_EQ(JobsToPrune({0, 2}, finished, 10 * day), (std::vector<std::string>{"d", "b"}));
  // Older than 3 days at day 10: b goes.
  EXPECT_EQ(JobsToPrune({3 * day, 0}, finished, 10 * day), (std::vector<std::string>{"b"}));
  EXPECT_TRUE(JobsToPrune({0, 0}, finished, 100 * day).empty());
}

TEST_F(JobBoundsTest, PruningDeletesFinishedJobsFromStoreAndMemory) {
  Reopen({/*max_age_ms=*/3600 * 1000, /*max_finished_jobs=*/2});
  for (int i = 1; i <= 5; ++i) Submit(i);
  for (int i = 1; i <= 4; ++i) {
    Cancel(absl::StrFormat("j-%06d", i));
    clock_.AdvanceMs(1000);
  }
  // 4 finished, 2 kept (the last cancelled); the queued j-000005 is never pruned.
  ASSERT_EQ(*manager_->PruneFinishedJobs(), 2);
  EXPECT_EQ(StoredIds(), (std::vector<std::string>{"j-000003", "j-000004", "j-000005"}));
  v1::Job j;
  absl::Status st = testing::GetJobProto(*manager_, "j-000001", true, &j);
  EXPECT_EQ(st.message(), "job j-000001 not found");
  EXPECT_TRUE(store_->LoadEvents("j-000001")->empty());
  EXPECT_EQ(manager_->ListJobs({}, 0).size(), 3u);

  // Past the age limit the rest of the finished jobs go too.
  clock_.AdvanceMs(3601 * 1000);
  ASSERT_EQ(*manager_->PruneFinishedJobs(), 2);
  EXPECT_EQ(StoredIds(), (std::vector<std::string>{"j-000005"}));
  EXPECT_EQ(*manager_->PruneFinishedJobs(), 0);

  // Ids are never given twice, also when the newest job was pruned and after a restart.
  Cancel("j-000005");
  clock_.AdvanceMs(3601 * 1000);
  ASSERT_EQ(*manager_->PruneFinishedJobs(), 1);
  EXPECT_TRUE(StoredIds().empty());
  Reopen();
  EXPECT_EQ(Submit(6), "j-000006");
}

TEST_F(JobBoundsTest, PruningEndsAWaitOnThePrunedJob) {
  Reopen({0, 1});
  const std::string a = Submit(1), b = Submit(2);
  Cancel(a);
  clock_.AdvanceMs(10);
  Cancel(b);
  JobView job;
  uint64_t version = 0;
  size_t events = 0;
  std::vector<EventRecord> evs;
  ASSERT_TRUE(manager_->WaitJob(a, &version, &events, absl::ZeroDuration(), &job, &evs).ok());
  std::thread prune([&] {
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_EQ(*manager_->PruneFinishedJobs(), 1);
  });
  const absl::Time t0 = absl::Now();
  absl::Status st = manager_->WaitJob(a, &version, &events, absl::Seconds(20), &job, &evs);
  prune.join();
  EXPECT_EQ(st.message(), "job j-000001 not found");
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
}

TEST_F(JobBoundsTest, ARequestIdReturnsTheJobItCreatedAlsoAfterARestart) {
  const std::string id = Submit(1, "req-1");
  // The retry of a submit whose reply was lost: the same job, none added (the checkpoint
  // directory in use by that same job is no reason to refuse it).
  CpPlan plan;
  auto again = manager_->Submit(WithCheckpointDir(SpecJson(), "/tmp/ck-1"), &plan, "req-1");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, id);
  EXPECT_EQ(plan.world, 1);
  EXPECT_EQ(StoredIds().size(), 1u);

  Reopen();
  again = manager_->Submit(WithCheckpointDir(SpecJson(), "/tmp/ck-1"), nullptr, "req-1");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, id);
  EXPECT_EQ(StoredIds().size(), 1u);

  // Another spec under the same id is refused; another id is another job.
  auto other = manager_->Submit(WithCheckpointDir(SpecJson(), "/tmp/ck-2"), nullptr, "req-1");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(other.status().message(),
            "submit: request id \"req-1\" was already used for job j-000001 with a different "
            "spec; a new job needs a new request id");
  EXPECT_EQ(Submit(2, "req-2"), "j-000002");

  auto bad = manager_->Submit(SpecJson(), nullptr, "no spaces");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(),
            "submit: request_id must be at most 128 characters of [A-Za-z0-9._:-], got 9 "
            "characters including others");
  bad = manager_->Submit(SpecJson(), nullptr, std::string(129, 'a'));
  EXPECT_EQ(bad.status().message(),
            "submit: request_id must be at most 128 characters of [A-Za-z0-9._:-], got 129 "
            "characters");
}

TEST(RendezvousBoundsTest, AnAttemptHoldsAtMostItsKeyLimit) {
  RendezvousStore store(/*max_keys_per_attempt=*/2);
  store.Open("j-1", 1, "tok");
  ASSERT_TRUE(store.Set("j-1", 1, "tok", "a", "1").ok());
  ASSERT_TRUE(store.Set("j-1", 1, "tok", "b", "2").ok());
  absl::Status st = store.Set("j-1", 1, "tok", "c", "3");
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(st.message(),
            "rendezvous: job j-1 attempt 1 already holds 2 keys, the coordinator's limit per "
            "attempt (--max-rendezvous-keys)");
  EXPECT_TRUE(store.Set("j-1", 1, "tok", "a", "1").ok());  // a retry, not a new key
}

TEST(RendezvousBoundsTest, ACancelledGetStopsWaiting) {
  RendezvousStore store;
  store.Open("j-1", 1, "tok");
  std::atomic<bool> cancelled{false};
  std::thread cancel([&] {
    absl::SleepFor(absl::Milliseconds(100));
    cancelled = true;
  });
  const absl::Time t0 = absl::Now();
  auto v = store.Get("j-1", 1, "tok", "never", absl::Seconds(30), [&] { return cancelled.load(); });
  cancel.join();
  EXPECT_EQ(v.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(v.status().message(), "rendezvous: the wait for key \"never\" was cancelled");
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  EXPECT_EQ(store.NumWaiting(), 0u);
}

// Two workers of one slot each run a cp = 2 job: a rank that reports its checkpoint twice does
// not stand in for the other.
TEST_F(JobBoundsTest, CheckpointDoneCountsDistinctRanks) {
  for (const char* w : {"w1", "w2"}) {
    ASSERT_TRUE(manager_
                    ->RegisterWorker(
                        RegistrationFromProto(testing::OneCpuSlotWorker(w, w), "10.0.0.1"))
                    .ok());
    v1::SessionHello hello;
    hello.set_worker_id(w);
    ASSERT_TRUE(testing::OpenSession(*manager_, hello, 1).ok());
  }
  auto id = manager_->Submit(SpecJson(/*cp=*/2), nullptr);
  ASSERT_TRUE(id.ok()) << id.status();
  std::map<int64_t, std::string> worker_of;
  for (auto& [w, msg] : channel_.Take())
    if (msg.has_assignment()) worker_of[msg.assignment().ref().rank()] = w;
  ASSERT_EQ(worker_of.size(), 2u);
  auto done = [&](int64_t rank) {
    v1::WorkerMessage m;
    v1::CheckpointDone* c = m.mutable_checkpoint_done();
    c->mutable_ref()->set_job_id(*id);
    c->mutable_ref()->set_attempt(1);
    c->mutable_ref()->set_rank(rank);
    c->set_step(5);
    c->set_path("/tmp/ck/step_00000005");
    testing::Deliver(*manager_, worker_of[rank], m);
  };
  // Rank 0 twice is not both ranks.
  done(0);
  done(0);
  v1::Job job;
  ASSERT_TRUE(testing::GetJobProto(*manager_, *id, false, &job).ok());
  EXPECT_EQ(job.last_checkpoint_step(), 0);
  done(1);
  ASSERT_TRUE(testing::GetJobProto(*manager_, *id, false, &job).ok());
  EXPECT_EQ(job.last_checkpoint_step(), 5);
}

TEST_F(JobBoundsTest, EventsAreBoundedInStoreAndMemoryAndPaged) {
  const std::string id = Submit(1);
  // A cancel reason is cut to its bound.
  JobView view;
  ASSERT_TRUE(manager_->Cancel(id, std::string(5000, 'r'), &view).ok());
  EXPECT_EQ(view.record.message.size(), std::string("cancelled: ").size() + kMaxReasonBytes);
  EXPECT_EQ(view.events.size(), 2u);
  // Page tokens walk the kept events; a token that is not one is refused by name.
  JobView page;
  ASSERT_TRUE(manager_->GetJob(id, true, &page, {1, ""}).ok());
  ASSERT_EQ(page.events.size(), 1u);
  EXPECT_EQ(page.events[0].message, "submitted");
  ASSERT_EQ(page.next_events_page_token, "events-1");
  ASSERT_TRUE(manager_->GetJob(id, true, &page, {1, page.next_events_page_token}).ok());
  ASSERT_EQ(page.events.size(), 1u);
  EXPECT_EQ(page.next_events_page_token, "");
  const absl::Status bad = manager_->GetJob(id, true, &page, {1, "before-3"});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.message(), "get: events_page_token \"before-3\" is not one that Get returned");
  // The store keeps the newest kMaxEventsPerJob of a job's events.
  JobRecord rec = (*store_->LoadJobs())[0];
  for (int i = 0; i < 1200; ++i) {
    EventRecord ev{rec.job_id, 0, i, JobState::kCancelled, absl::StrCat("e", i)};
    ASSERT_TRUE(store_->SaveJob(rec, &ev).ok());
  }
  absl::StatusOr<std::vector<EventRecord>> events = store_->LoadEvents(rec.job_id);
  ASSERT_TRUE(events.ok());
  ASSERT_EQ(events->size(), static_cast<size_t>(kMaxEventsPerJob));
  EXPECT_EQ(events->back().message, "e1199");
  EXPECT_EQ(events->front().message, "e200");
}

}  // namespace
}  // namespace spindle
