// A fixture for the unit tests of the job manager's parts (job_admission.h, job_lifecycle.h,
// job_placement.h, worker_sessions.h): the four parts wired over one JobTable as JobManager wires
// them, without the facade, over an in-memory store whose writes a test can refuse, a FakeClock,
// a real RendezvousStore and a counter for every metric. Like the JobManager around each call into
// a part, the fixture holds the table's mutex, here for the whole test. Commands the parts queue
// collect in `out`. Test-only; not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "coordinator/clock.h"
#include "coordinator/health_monitor.h"
#include "coordinator/job_admission.h"
#include "coordinator/job_lifecycle.h"
#include "coordinator/job_manager_options.h"
#include "coordinator/job_placement.h"
#include "coordinator/job_table.h"
#include "coordinator/rendezvous_store.h"
#include "coordinator/worker_sessions.h"
#include "gtest/gtest.h"
#include "planner/cp_planner.h"
#include "tests/control/memory_job_store.h"

namespace spindle::testing {

// A MemoryJobStore whose writes fail (Unavailable, changing nothing) while refuse_writes is set.
class RefusableJobStore : public MemoryJobStore {
 public:
  bool refuse_writes = false;

  absl::Status CreateJob(JobRecord* job, const EventRecord& event) override {
    return refuse_writes ? Refused() : MemoryJobStore::CreateJob(job, event);
  }
  absl::Status SaveJob(const JobRecord& job, const EventRecord* event,
                       const AttemptRecord* attempt) override {
    return refuse_writes ? Refused() : MemoryJobStore::SaveJob(job, event, attempt);
  }
  absl::Status DeleteJobs(const std::vector<std::string>& job_ids) override {
    return refuse_writes ? Refused() : MemoryJobStore::DeleteJobs(job_ids);
  }
  absl::Status SaveWorker(const WorkerRecord& worker) override {
    return refuse_writes ? Refused() : MemoryJobStore::SaveWorker(worker);
  }

 private:
  static absl::Status Refused() { return absl::UnavailableError("store refuses writes"); }
};

// A tiny CPU job (the "tiny" preset: 4 layers) of world cp x dp on `dir`, with `max_restarts`.
inline std::string TinyJob(int64_t cp = 1, int64_t dp = 1, const std::string& dir = "/tmp/ck",
                           int64_t max_restarts = 3, const std::string& recompute = "false") {
  return absl::StrCat(R"({"name": "t", "model": {"preset": "tiny"}, "seq_len": 256,
    "data": {"source": "synthetic:recall"}, "parallel": {"cp": )",
                      cp, R"(, "dp": )", dp, R"(}, "train": {"steps": 10, "recompute": )",
                      recompute, R"(}, "checkpoint": {"dir": ")", dir,
                      R"(", "every": 5}, "resources": "cpu", "max_restarts": )", max_restarts, "}");
}

class JobPartsTest : public ::testing::Test {
 protected:
  static JobManagerOptions Options() {
    JobManagerOptions o;
    o.heartbeat_interval_ms = 1000;
    o.heartbeat_timeout_ms = 3000;
    o.hang_timeout_ms = 5000;
    o.start_timeout_ms = 8000;
    o.stop_grace_ms = 1000;
    o.recovery_grace_ms = 4000;
    o.rendezvous_address = "198.18.0.1:7";
    return o;
  }

  // Registers worker `id` with `slots` CPU slots of `memory` bytes, reached at `address`
  // (loopback: it shares the coordinator's host), and opens its session.
  Worker& AddWorker(const std::string& id, int32_t slots, const std::string& address = "127.0.0.1",
                    int64_t memory = int64_t{8} << 30) {
    WorkerRegistration reg;
    reg.worker_id = id;
    reg.hostname = id + ".local";
    reg.observed_host = address;
    reg.devices.push_back({"cpu", "cpu", slots, memory, int64_t{64} << 30});
    EXPECT_TRUE(sessions.RegisterWorker(table, reg).ok());
    WorkerHello hello;
    hello.worker_id = id;
    EXPECT_TRUE(sessions.SessionOpened(table, hello, ++session, &out).ok());
    return *table.registry.Find(id);
  }
  // Submits `spec` as `owner`; "" when admission refused it (the test fails then).
  std::string Submit(const std::string& spec, const std::string& owner = "") {
    absl::StatusOr<SubmitRequest> req = JobAdmission::ParseSubmit(spec, "", owner);
    EXPECT_TRUE(req.ok()) << req.status();
    if (!req.ok()) return "";
    absl::StatusOr<SubmitResult> r = admission.Submit(table, *req, nullptr);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->job_id : "";
  }
  // Submits `spec` and places it on the registered workers; the assignments stay in `out`.
  JobRuntime& SubmitAndPlace(const std::string& spec) {
    const std::string id = Submit(spec);
    placement.Schedule(table, &out);
    JobRuntime& j = Job(id);
    EXPECT_EQ(j.rec.state, JobState::kPlaced) << j.rec.message;
    return j;
  }
  JobRuntime& Job(const std::string& id) { return *table.Find(id); }

  // Commands queued since the last call, of one kind, as (worker, command).
  template <typename Command>
  std::vector<std::pair<std::string, Command>> Take() {
    std::vector<std::pair<std::string, Command>> taken;
    for (const auto& [worker, command] : out.messages)
      if (const auto* c = std::get_if<Command>(&command)) taken.emplace_back(worker, *c);
    out.messages.clear();
    return taken;
  }
  // The job's events' messages, oldest first.
  static std::vector<std::string> Events(const JobRuntime& j) {
    std::vector<std::string> m;
    for (const EventRecord& e : j.events) m.push_back(e.message);
    return m;
  }

  RefusableJobStore store;
  FakeClock clock;
  RendezvousStore rendezvous;
  JobManagerOptions options = Options();
  Counter submitted, lost, left, rank_failed, hang, recovery, ignored;
  JobManagerMetrics metrics{nullptr, &lost,     &left,      &rank_failed,
                            &hang,   &recovery, &submitted, &ignored};
  CpPlanner planner;
  HealthMonitor health{HealthOptions{options.heartbeat_interval_ms, options.heartbeat_timeout_ms,
                                     options.hang_timeout_ms, options.start_timeout_ms,
                                     options.silence_timeout_ms, options.stop_grace_ms}};
  JobTable table{&store, &clock, options.registry, options.rendezvous_address};
  JobAdmission admission{&store, &clock, &planner, metrics.jobs_submitted};
  JobLifecycle lifecycle{&store, &clock, &rendezvous, &planner, &health, &options, &metrics};
  JobPlacement placement{&clock, &rendezvous, &planner, &admission, &lifecycle, nullptr};
  WorkerSessions sessions{&store,   &clock,   &rendezvous, &health,
                          &options, &metrics, &lifecycle,  &placement};
  absl::MutexLock lock{&table.mu};
  Outbox out;
  uint64_t session = 0;
};

}  // namespace spindle::testing
