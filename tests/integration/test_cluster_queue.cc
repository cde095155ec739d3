// 200 queued jobs on 8 spindle-worker daemons of one CPU slot each (real coordinator, real
// workers, a scripted half-second trainer): while 8 blocker jobs hold every slot, 200 jobs with
// mixed priorities are queued; when the blockers end, the coordinator places the 200 strictly by
// priority, then submission order, never more than 8 at a time, and every job succeeds at its
// first attempt.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_harness.h"
#include "tests/integration/worker_test_util.h"

namespace spindle {
namespace {

using ::spindle::testing::ClusterHarness;
using ::spindle::testing::ReadFile;
using ::spindle::testing::ScratchDir;
using ::spindle::testing::WaitFor;
using ::spindle::testing::WriteScript;

constexpr int kWorkers = 8;
constexpr int kJobs = 200;

// Environment: QUEUE_HOLD (blockers run while that file exists), QUEUE_LOG (queued jobs append
// "start|end <job id> <unix ns>").
constexpr char kQueueTrainer[] = R"sh(
spec=""; id=""
while [ $# -gt 0 ]; do
  case $1 in
    --planned-job) spec=$2; shift ;;
    --job-id) id=$2; shift ;;
  esac
  shift
done
echo '{"event":"start","step":0,"total_steps":2}'
if grep -q blocker "$spec"; then
  echo '{"event":"step","step":1,"total_steps":2,"loss":1,"tokens_per_s":1}'
  while [ -f "$QUEUE_HOLD" ]; do sleep 0.05; done
else
  echo "start $id $(date +%s%N)" >> "$QUEUE_LOG"
  sleep 0.5
  echo "{\"event\":\"step\",\"step\":1,\"total_steps\":2,\"loss\":1,\"tokens_per_s\":1}"
  echo "end $id $(date +%s%N)" >> "$QUEUE_LOG"
fi
echo '{"event":"step","step":2,"total_steps":2,"loss":1,"tokens_per_s":1}'
echo '{"event":"done","step":2}'
)sh";

std::string Spec(const std::string& name, int64_t priority) {
  return absl::StrCat(
      R"({"name":")", name,
      R"(","model":{"preset":"tiny"},"data":{"source":"synthetic:recall"},"seq_len":256,)",
      R"("train":{"steps":2},"resources":"cpu","max_restarts":0,"priority":)", priority, "}");
}

class ClusterQueueTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(SPINDLE_COORDINATOR_BINARY).empty() ||
        std::string(SPINDLE_WORKER_BINARY).empty()) {
      GTEST_SKIP() << "spindle-coordinator or spindle-worker not built";
    }
    trainer_ = WriteScript(dir_, "queue-train.sh", kQueueTrainer);
  }

  std::vector<v1::Job> ListJobs(const std::vector<v1::JobState>& states) {
    auto stub = v1::JobService::NewStub(
        grpc::CreateChannel(cluster_.address(), cluster_.ClientCredentials()));
    v1::ListJobsRequest req;
    for (v1::JobState s : states) req.add_states(s);
    std::vector<v1::Job> jobs;
    do {  // every page
      v1::ListJobsResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      if (!stub->List(&ctx, req, &resp).ok()) return {};
      jobs.insert(jobs.end(), resp.jobs().begin(), resp.jobs().end());
      req.set_page_token(resp.next_page_token());
    } while (!req.page_token().empty());
    return jobs;
  }

  ScratchDir dir_{"spindle-queue"};
  ClusterHarness cluster_{&dir_};
  std::string trainer_;
};

TEST_F(ClusterQueueTest, TwoHundredJobsRunInPriorityThenSubmissionOrder) {
  const std::string hold = dir_.File("hold"), log = dir_.File("starts.log");
  { std::ofstream(hold) << "1"; }
  ASSERT_TRUE(cluster_.StartCoordinator({"--heartbeat_interval=1", "--heartbeat_timeout=15"}))
      << cluster_.Logs();
  for (int i = 0; i < kWorkers; ++i) {
    ASSERT_TRUE(cluster_.StartWorker(absl::StrCat("w", i), 1, trainer_,
                                     {{"QUEUE_HOLD", hold}, {"QUEUE_LOG", log}}));
  }
  ASSERT_TRUE(cluster_.WaitForWorkers(kWorkers)) << cluster_.Logs();

  // Blockers take every slot, so the 200 queue up behind them.
  std::vector<std::string> blockers;
  for (int i = 0; i < kWorkers; ++i) {
    absl::StatusOr<std::string> id = cluster_.Submit(Spec(absl::StrCat("blocker-", i), 100));
    ASSERT_TRUE(id.ok()) << id.status();
    blockers.push_back(*id);
  }
  for (const std::string& id : blockers) {
    ASSERT_TRUE(
        cluster_
            .WaitJob(
                id, [](const v1::Job& j) { return j.step() >= 1; }, std::chrono::seconds(60))
            .has_value())
        << cluster_.Logs();
  }

  // Priorities -3..3 in a scrambled pattern, so that every priority has ties in submission order.
  struct Queued {
    std::string id;
    int64_t priority;
    int index;
  };
  std::vector<Queued> queued;
  for (int i = 0; i < kJobs; ++i) {
    const int64_t priority = (i * 37) % 7 - 3;
    absl::StatusOr<std::string> id = cluster_.Submit(Spec(absl::StrFormat("q-%03d", i), priority));
    ASSERT_TRUE(id.ok()) << i << ": " << id.status();
    queued.push_back({*id, priority, i});
  }
  EXPECT_EQ(ListJobs({v1::JOB_STATE_QUEUED}).size(), static_cast<size_t>(kJobs));
  EXPECT_FALSE(std::filesystem::exists(log)) << "a queued job started while every slot was held";

  const auto released = std::chrono::steady_clock::now();
  std::filesystem::remove(hold);
  ASSERT_TRUE(WaitFor(
      [&] {
        return ListJobs({v1::JOB_STATE_SUCCEEDED, v1::JOB_STATE_FAILED, v1::JOB_STATE_CANCELLED})
                   .size() == static_cast<size_t>(kJobs + kWorkers);
      },
      std::chrono::seconds(240)))
      << cluster_.Logs();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - released).count();

  std::vector<Queued> expected = queued;
  std::stable_sort(expected.begin(), expected.end(),
                   [](const Queued& a, const Queued& b) { return a.priority > b.priority; });

  // The coordinator placed them in exactly that order (event times, ties within a millisecond).
  int64_t last_placed_ms = 0;
  std::string last_id;
  for (const Queued& q : expected) {
    std::optional<v1::Job> job = cluster_.Get(q.id);
    ASSERT_TRUE(job.has_value()) << q.id;
    ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << q.id << "\n"
                                                     << ClusterHarness::Events(*job);
    EXPECT_EQ(job->attempt(), 1) << q.id;
    int64_t placed_ms = 0;
    for (const v1::JobEvent& e : job->events()) {
      if (e.state() == v1::JOB_STATE_PLACED && placed_ms == 0) placed_ms = e.unix_ms();
    }
    ASSERT_GT(placed_ms, 0) << q.id << "\n" << ClusterHarness::Events(*job);
    EXPECT_GE(placed_ms, last_placed_ms) << q.id << " (priority " << q.priority << ", #" << q.index
                                         << ") was placed before " << last_id;
    last_placed_ms = placed_ms;
    last_id = q.id;
  }

  // The trainers started in that order too, up to the races between the 8 slots: no job started
  // more than kWorkers places away from its turn. Never more than kWorkers ran at once.
  std::map<std::string, int> turn;
  for (size_t i = 0; i < expected.size(); ++i) turn[expected[i].id] = static_cast<int>(i);
  std::vector<std::pair<int64_t, int>> edges;  // (unix ns, +1 start / -1 end)
  std::vector<std::string> started;
  for (absl::string_view line : absl::StrSplit(ReadFile(log), '\n', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    ASSERT_EQ(f.size(), 3u) << line;
    int64_t ns = 0;
    ASSERT_TRUE(absl::SimpleAtoi(f[2], &ns)) << line;
    edges.emplace_back(ns, f[0] == "start" ? 1 : -1);
    if (f[0] == "start") started.push_back(f[1]);
  }
  ASSERT_EQ(started.size(), static_cast<size_t>(kJobs));
  int max_displacement = 0;
  for (size_t pos = 0; pos < started.size(); ++pos) {
    ASSERT_TRUE(turn.count(started[pos])) << started[pos];
    max_displacement = std::max(max_displacement, std::abs(turn[started[pos]] - int(pos)));
  }
  EXPECT_LE(max_displacement, kWorkers);
  std::sort(edges.begin(), edges.end());
  int running = 0, max_running = 0;
  for (const auto& [ns, delta] : edges) max_running = std::max(max_running, running += delta);
  EXPECT_LE(max_running, kWorkers);
  EXPECT_GE(max_running, 2);
  std::printf(
      "200 jobs on %d slots: %.1f s after release, at most %d at once, largest start "
      "displacement %d\n",
      kWorkers, seconds, max_running, max_displacement);
}

}  // namespace
}  // namespace spindle
