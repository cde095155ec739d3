// JobManager state machine against a FakeClock, a recording worker channel and a real SQLite
// file: placement, progress, success, restarts (rank exit, lost worker, hang), cancel, fatal
// exits, running out of restarts and recovery after a coordinator restart.
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "planner/cp_planner.h"
#include "coordinator/job_manager.h"
#include "coordinator/sqlite_job_store.h"
#include "coordinator/worker_proto.h"
#include "gtest/gtest.h"
#include "spindle/v1/cluster.pb.h"
#include "spindle/v1/job.pb.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

using testing::RunSpecOf;
using testing::FakeWorkerChannel;
using testing::SpecJson;
using testing::TempDir;
using testing::WithCheckpointDir;

class JobManagerTest : public ::testing::Test {
 protected:
  void SetUp() override { Reopen(); }

  void Reopen() {
    manager_.reset();
    store_.reset();
    auto s = SqliteJobStore::Open(dir_.File("c.db"));
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
    JobManagerOptions o;
    o.heartbeat_timeout_ms = 3000;
    o.hang_timeout_ms = 5000;
    o.start_timeout_ms = 8000;
    o.stop_grace_ms = 1000;
    o.recovery_grace_ms = 4000;
    o.rendezvous_address = "127.0.0.1:1";
    manager_ = std::make_unique<JobManager>(store_.get(), &clock_, &channel_, &rendezvous_, o);
    ASSERT_TRUE(manager_->Recover().ok());
  }

  // `slots` CPU slots with 8 GiB each.
  static v1::DeviceGroup CpuSlots(int slots) {
    v1::DeviceGroup d;
    d.set_kind("cpu");
    d.set_count(slots);
    d.set_memory_bytes(int64_t{8} << 30);
    return d;
  }
  // A worker of `slots` CPU slots with 8 GiB each.
  void AddWorker(const std::string& id, int slots, bool open_session = true,
                 std::vector<v1::RankRef> running = {}) {
    Register(id, CpuSlots(slots), open_session, running);
  }
  // Registration of worker `id` from `hostname` (the process `instance_id`) with `devices`.
  static v1::RegisterRequest RegisterRequest(const std::string& id, const std::string& hostname,
                                             const v1::DeviceGroup& devices,
                                             const std::string& instance_id = "") {
    v1::RegisterRequest req;
    req.set_worker_id(id);
    req.set_hostname(hostname);
    req.set_instance_id(instance_id);
    *req.add_devices() = devices;
    return req;
  }
  // A GPU worker: `gpus` of 150 GiB and `host_gib` of host memory.
  void AddGpuWorker(const std::string& id, int gpus, int64_t host_gib) {
    v1::DeviceGroup d;
    d.set_kind("cuda");
    d.set_count(gpus);
    d.set_memory_bytes(int64_t{150} << 30);
    d.set_host_memory_bytes(host_gib << 30);
    Register(id, d, /*open_session=*/true, {});
  }
  void Register(const std::string& id, const v1::DeviceGroup& devices, bool open_session,
                const std::vector<v1::RankRef>& running) {
    ASSERT_TRUE(manager_
                    ->RegisterWorker(RegistrationFromProto(
                        RegisterRequest(id, id + ".local", devices), "127.0.0.1"))
                    .ok());
    if (open_session) Hello(id, running);
  }
  void Hello(const std::string& id, const std::vector<v1::RankRef>& running,
             const std::string& instance_id = "") {
    v1::SessionHello h;
    h.set_worker_id(id);
    h.set_instance_id(instance_id);
    for (const auto& r : running) {
      auto* rr = h.add_running();
      *rr->mutable_ref() = r;
      rr->set_step(3);
    }
    ASSERT_TRUE(testing::OpenSession(*manager_, h, ++session_).ok());
  }

  std::string Submit(const std::string& spec) {
    CpPlan plan;
    auto id = manager_->Submit(spec, &plan);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : "";
  }

  v1::Job Get(const std::string& id) {
    v1::Job j;
    EXPECT_TRUE(testing::GetJobProto(*manager_, id, true, &j).ok());
    return j;
  }

  static v1::RankRef Ref(const std::string& job, int64_t attempt, int64_t rank) {
    v1::RankRef r;
    r.set_job_id(job);
    r.set_attempt(attempt);
    r.set_rank(rank);
    return r;
  }
  void Progress(const std::string& worker, const v1::RankRef& ref, int64_t step, double mfu = 0) {
    v1::WorkerMessage m;
    auto* p = m.mutable_rank_progress();
    *p->mutable_ref() = ref;
    p->set_step(step);
    p->set_total_steps(10);
    p->set_loss(5.0 - step * 0.1);
    p->set_tokens_per_s(1000);
    p->set_mfu(mfu);
    p->set_memory_bytes(static_cast<double>((int64_t{1} << 30) * (ref.rank() + 1)));
    testing::Deliver(*manager_, worker, m);
  }
  void Exit(const std::string& worker, const v1::RankRef& ref, int code, bool stopped = false,
            const std::string& last_line = "") {
    v1::WorkerMessage m;
    auto* e = m.mutable_rank_exit();
    *e->mutable_ref() = ref;
    e->set_exit_code(code);
    e->set_stopped(stopped);
    if (!last_line.empty()) e->add_stderr_tail(last_line);
    testing::Deliver(*manager_, worker, m);
  }
  void Checkpoint(const std::string& worker, const v1::RankRef& ref, int64_t step) {
    v1::WorkerMessage m;
    auto* c = m.mutable_checkpoint_done();
    *c->mutable_ref() = ref;
    c->set_step(step);
    c->set_path("/tmp/ck/step-" + std::to_string(step));
    testing::Deliver(*manager_, worker, m);
  }
  void Heartbeat(const std::string& worker) {
    v1::WorkerMessage m;
    m.mutable_heartbeat()->set_unix_ms(clock_.NowMs());
    testing::Deliver(*manager_, worker, m);
  }
  // `seconds` of one-second ticks, `worker` heartbeating each.
  void TickSeconds(const std::string& worker, int seconds) {
    for (int i = 0; i < seconds; ++i) {
      clock_.AdvanceMs(1000);
      Heartbeat(worker);
      manager_->Tick();
    }
  }

  // Assignments sent since the last call, as (worker, assignment).
  std::vector<std::pair<std::string, v1::Assignment>> Assignments(
      std::vector<std::pair<std::string, v1::Stop>>* stops = nullptr) {
    std::vector<std::pair<std::string, v1::Assignment>> out;
    for (auto& [w, m] : channel_.Take()) {
      if (m.has_assignment()) out.emplace_back(w, m.assignment());
      if (m.has_stop() && stops) stops->emplace_back(w, m.stop());
    }
    return out;
  }

  // The coordinator restarts and w1 (one slot) comes back without the job's rank; past the
  // recovery grace the job restarts. Returns the assignments sent.
  std::vector<std::pair<std::string, v1::Assignment>> RestartCoordinatorWithoutTheRank() {
    Reopen();
    AddWorker("w1", 1, true, {});
    clock_.AdvanceMs(4500);  // past the 4 s recovery grace
    Heartbeat("w1");
    manager_->Tick();
    return Assignments();
  }

  TempDir dir_;
  FakeClock clock_;
  FakeWorkerChannel channel_;
  RendezvousStore rendezvous_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<JobManager> manager_;
  uint64_t session_ = 0;
};

TEST_F(JobManagerTest, PlacesRunsAndSucceeds) {
  const std::string id = Submit(SpecJson(2, 1));
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(Get(id).message(), "waiting for 2 free cpu devices");
  AddWorker("w1", 4);
  auto as = Assignments();
  ASSERT_EQ(as.size(), 2u);
  EXPECT_EQ(as[0].first, "w1");
  const v1::Assignment& a = as[1].second;
  EXPECT_EQ(a.ref().job_id(), id);
  EXPECT_EQ(a.ref().attempt(), 1);
  EXPECT_EQ(a.ref().rank(), 1);
  const JobSpec run = RunSpecOf(a);
  EXPECT_EQ(run.parallel.world(), 2);
  EXPECT_EQ(run.parallel.cp, 2);
  EXPECT_EQ(run.parallel.lightning_mode, CpMode::kAll2All);
  EXPECT_EQ(a.rendezvous_address(), "127.0.0.1:1");
  EXPECT_EQ(run.checkpoint.dir, "/tmp/ck");
  EXPECT_EQ(run.resources, "cpu");
  EXPECT_EQ(a.job().plan().cp(), 2);
  EXPECT_EQ(rendezvous_.NumOpen(), 1u);
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_PLACED);

  Progress("w1", Ref(id, 1, 0), 1, 0.25);
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_PLACED);
  Progress("w1", Ref(id, 1, 1), 1, 0.35);
  v1::Job j = Get(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(j.ranks(1).state(), "running");
  EXPECT_DOUBLE_EQ(j.tokens_per_s(), 2000);  // the ranks' sum
  EXPECT_DOUBLE_EQ(j.ranks(1).mfu(), 0.35);
  EXPECT_DOUBLE_EQ(j.mfu(), 0.30);  // the ranks' mean
  EXPECT_DOUBLE_EQ(j.ranks(1).memory_bytes(), double(int64_t{2} << 30));
  // Rank 0 a step ahead: the job shows the step every rank has reached, with that step's loss.
  Progress("w1", Ref(id, 1, 0), 2);
  j = Get(id);
  EXPECT_EQ(j.step(), 1);
  EXPECT_DOUBLE_EQ(j.loss(), 4.9);
  Progress("w1", Ref(id, 1, 1), 2);
  j = Get(id);
  EXPECT_EQ(j.step(), 2);
  EXPECT_DOUBLE_EQ(j.loss(), 4.8);
  Exit("w1", Ref(id, 1, 0), 0);
  Exit("w1", Ref(id, 1, 1), 0);
  j = Get(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(j.message(), "all 2 ranks finished");
  EXPECT_EQ(rendezvous_.NumOpen(), 0u);
  EXPECT_EQ(manager_->DeviceCounts()["free"], 4);
}

TEST_F(JobManagerTest, RankFailureRestartsFromLastCompleteCheckpoint) {
  AddWorker("w1", 2);
  const std::string id = Submit(SpecJson(2, 1));
  ASSERT_EQ(Assignments().size(), 2u);
  Progress("w1", Ref(id, 1, 0), 5);
  Progress("w1", Ref(id, 1, 1), 5);
  Checkpoint("w1", Ref(id, 1, 0), 5);
  EXPECT_EQ(Get(id).last_checkpoint_step(), 0);  // not complete until every rank wrote it
  Checkpoint("w1", Ref(id, 1, 1), 5);
  EXPECT_EQ(Get(id).last_checkpoint_step(), 5);
  Exit("w1", Ref(id, 1, 1), 1, false, "RuntimeError: boom");
  v1::Job j = Get(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_RESTARTING);
  EXPECT_EQ(j.message(),
            "rank 1 on worker w1 exited with code 1: RuntimeError: boom; restart 1/3 from "
            "checkpoint step 5");
  std::vector<std::pair<std::string, v1::Stop>> stops;
  EXPECT_TRUE(Assignments(&stops).empty());  // rank 0's device is still draining
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_EQ(stops[0].second.attempt(), 1);
  Exit("w1", Ref(id, 1, 0), -1, true);  // the stopped rank exits: its device frees
  auto as = Assignments();
  ASSERT_EQ(as.size(), 2u);
  EXPECT_EQ(as[0].second.ref().attempt(), 2);
  EXPECT_EQ(as[0].second.resume_step(), 5);
  EXPECT_EQ(as[0].second.resume_path(), "/tmp/ck/step-5");
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_PLACED);
  // Late progress of the old attempt is ignored (and the stale rank told to stop).
  Progress("w1", Ref(id, 1, 0), 6);
  EXPECT_EQ(Get(id).ranks(0).step(), 0);
}

TEST_F(JobManagerTest, ExitCodeTwoFailsWithoutRestart) {
  AddWorker("w1", 1);
  const std::string id = Submit(SpecJson());
  Exit("w1", Ref(id, 1, 0), 2, false, "job spec: data.path: no such file");
  v1::Job j = Get(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(j.message(),
            "rank 0 on worker w1 exited with code 2: job spec: data.path: no such file (invalid "
            "input; not restarted)");
  EXPECT_EQ(j.restarts(), 0);
}

TEST_F(JobManagerTest, OutOfRestartsFails) {
  AddWorker("w1", 1);
  const std::string id = Submit(SpecJson(1, 1, 0, /*max_restarts=*/1));
  Exit("w1", Ref(id, 1, 0), 1);
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_PLACED);  // device freed at exit: re-placed at once
  EXPECT_EQ(Get(id).attempt(), 2);
  Exit("w1", Ref(id, 2, 0), 1);
  v1::Job j = Get(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(j.message(), "rank 0 on worker w1 exited with code 1; out of restarts (1/1)");
}

TEST_F(JobManagerTest, LostWorkerRestartsGangElsewhere) {
  AddWorker("w1", 2);
  const std::string id = Submit(SpecJson(2, 1));
  ASSERT_EQ(Assignments().size(), 2u);
  AddWorker("w2", 2);
  clock_.AdvanceMs(2000);
  Heartbeat("w2");
  manager_->Tick();
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_PLACED);
  clock_.AdvanceMs(1500);  // w1 silent for 3.5 s > 3 s
  Heartbeat("w2");
  manager_->Tick();
  // Fenced: w1's rank may still run (cut off, it stops itself a heartbeat timeout after its
  // last acknowledged heartbeat, then takes up to the stop grace): the next attempt waits until
  // 3 s + 1 s + 1 s (a heartbeat interval of margin) after w1 was last heard.
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_RESTARTING);
  EXPECT_TRUE(Assignments().empty());
  clock_.AdvanceMs(1400);  // 4.9 s
  Heartbeat("w2");
  manager_->Tick();
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_RESTARTING);
  clock_.AdvanceMs(100);  // 5 s
  Heartbeat("w2");
  manager_->Tick();
  v1::Job j = Get(id);
  EXPECT_EQ(j.attempt(), 2);
  EXPECT_EQ(j.ranks(0).worker_id(), "w2");
  EXPECT_EQ(j.restarts(), 1);
  ASSERT_GE(j.events_size(), 3);
  bool found = false;
  for (const auto& e : j.events())
    found |= e.message() ==
             "worker w1 lost (no heartbeat for 3.5 s) with rank 0; restart 1/3 from scratch";
  EXPECT_TRUE(found) << j.DebugString();
  EXPECT_EQ(manager_->WorkerCounts()["lost"], 1);
}

// The coordinator pauses past the heartbeat timeout (a long stall): the workers, their sessions
// still open, are marked lost and the gang restarts. The next message on the session brings the
// worker back: the old attempt's rank is stopped, its slot drains until that rank exits, and then
// the gang's new attempt is placed there.
TEST_F(JobManagerTest, ALostWorkerThatSpeaksAgainIsBack) {
  AddWorker("w1", 1);
  const std::string id = Submit(SpecJson());
  ASSERT_EQ(Assignments().size(), 1u);
  Progress("w1", Ref(id, 1, 0), 1);
  clock_.AdvanceMs(3500);  // nothing heard for 3.5 s > 3 s
  manager_->Tick();
  EXPECT_EQ(manager_->WorkerCounts()["lost"], 1);
  EXPECT_EQ(Get(id).restarts(), 1);
  EXPECT_TRUE(Assignments().empty());
  // w1 heartbeats, still running attempt 1's rank.
  v1::WorkerMessage hb;
  hb.mutable_heartbeat()->set_unix_ms(clock_.NowMs());
  *hb.mutable_heartbeat()->add_running()->mutable_ref() = Ref(id, 1, 0);
  testing::Deliver(*manager_, "w1", hb);
  EXPECT_EQ(manager_->WorkerCounts()["lost"], 0);
  EXPECT_EQ(manager_->WorkerCounts()["alive"], 1);
  std::vector<std::pair<std::string, v1::Stop>> stops;
  manager_->Tick();
  EXPECT_TRUE(Assignments(&stops).empty()) << "placed on a slot still running attempt 1";
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_EQ(stops[0].first, "w1");
  EXPECT_EQ(stops[0].second.attempt(), 1);
  // Heartbeats listing the draining rank repeat no stop; its exit frees the slot.
  testing::Deliver(*manager_, "w1", hb);
  EXPECT_TRUE(Assignments(&stops).empty());
  EXPECT_EQ(stops.size(), 1u);
  Exit("w1", Ref(id, 1, 0), 143, /*stopped=*/true);
  manager_->Tick();
  auto placed = Assignments();
  ASSERT_EQ(placed.size(), 1u);
  EXPECT_EQ(placed[0].first, "w1");
  EXPECT_EQ(placed[0].second.ref().attempt(), 2);
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_PLACED);
}

// A worker lost while its session stays open registers again (a registration clears the loss)
// and goes on heartbeating on that session: it is alive there and jobs are placed on it, not
// taken for disconnected for as long as it heartbeats.
TEST_F(JobManagerTest, ALostWorkerThatRegistersAgainOnItsOpenSessionIsAlive) {
  AddWorker("w1", 1);
  clock_.AdvanceMs(3500);
  manager_->Tick();
  ASSERT_EQ(manager_->WorkerCounts()["lost"], 1);
  AddWorker("w1", 1, /*open_session=*/false);
  v1::WorkerMessage hb;
  hb.mutable_heartbeat()->set_seq(1);
  testing::Deliver(*manager_, "w1", hb);
  EXPECT_EQ(manager_->WorkerCounts()["alive"], 1);
  EXPECT_EQ(manager_->WorkerCounts()["disconnected"], 0);
  const std::string id = Submit(SpecJson());
  const auto placed = Assignments();
  ASSERT_EQ(placed.size(), 1u);
  EXPECT_EQ(placed[0].first, "w1");
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_PLACED);
  // Its session closing is what disconnects it.
  manager_->SessionClosed("w1", session_);
  EXPECT_EQ(manager_->WorkerCounts()["disconnected"], 1);
}

// A second daemon on another host given the same worker id is refused while the first is
// connected; once the first is lost, the id is free to take.
TEST_F(JobManagerTest, AWorkerIdInUseOnAnotherHostIsRefused) {
  AddWorker("w1", 2);
  const v1::RegisterRequest req = RegisterRequest("w1", "other.local", CpuSlots(1));
  const absl::Status refused =
      manager_->RegisterWorker(RegistrationFromProto(req, "127.0.0.1")).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(refused.message(),
            "worker id w1 is in use by the connected worker on host w1.local; give each "
            "worker daemon its own --worker-id");
  auto workers = manager_->ListWorkers();
  ASSERT_EQ(workers.size(), 1u);
  EXPECT_EQ(workers[0].slots, 2);
  // The first one's own reconnect is no conflict.
  AddWorker("w1", 2);
  clock_.AdvanceMs(3500);
  manager_->Tick();
  EXPECT_EQ(manager_->WorkerCounts()["lost"], 1);
  EXPECT_TRUE(manager_->RegisterWorker(RegistrationFromProto(req, "127.0.0.1")).ok());
}

// On one host, daemons are told apart by their instance ids: the same process re-registers, a
// second one with the id is refused while the first is connected.
TEST_F(JobManagerTest, ASecondDaemonOnTheSameHostIsRefused) {
  v1::RegisterRequest req = RegisterRequest("w1", "w1.local", CpuSlots(1), "a1");
  ASSERT_TRUE(manager_->RegisterWorker(RegistrationFromProto(req, "127.0.0.1")).ok());
  Hello("w1", {}, "a1");
  ASSERT_TRUE(manager_->RegisterWorker(RegistrationFromProto(req, "127.0.0.1")).ok())
      << "its own reconnect";
  req.set_instance_id("b2");
  const absl::Status refused =
      manager_->RegisterWorker(RegistrationFromProto(req, "127.0.0.1")).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(refused.message(),
            "worker id w1 is in use by another connected worker daemon on host "
            "w1.local; give each worker daemon its own --worker-id");
  // Once the first one's session has closed, the second takes the id.
  manager_->SessionClosed("w1", session_);
  EXPECT_TRUE(manager_->RegisterWorker(RegistrationFromProto(req, "127.0.0.1")).ok());
}

// A session is bound to the daemon instance that registered: another process naming the same
// worker id (and holding a worker token) cannot open it and take the worker's assignments.
TEST_F(JobManagerTest, ASessionComesFromTheInstanceThatRegistered) {
  ASSERT_TRUE(manager_
                  ->RegisterWorker(RegistrationFromProto(
                      RegisterRequest("w1", "w1.local", CpuSlots(1), "a1"), "127.0.0.1"))
                  .ok());
  for (const std::string other : {"b2", ""}) {
    v1::SessionHello h;
    h.set_worker_id("w1");
    h.set_instance_id(other);
    const absl::Status refused = testing::OpenSession(*manager_, h, ++session_);
    EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << other;
    EXPECT_EQ(refused.message(),
              "worker w1 was registered by another daemon instance; a session must come from "
              "the daemon that registered it");
  }
  EXPECT_EQ(manager_->WorkerCounts()["alive"], 0);
  Hello("w1", {}, "a1");
}

// A worker's session closes (the daemon was killed) and a rank on another worker then fails in
// its collective: the restart names the vanished worker first, then the failed rank.
TEST_F(JobManagerTest, RankFailureAfterAPeerWorkerDisconnectedNamesThatWorker) {
  AddWorker("w1", 1);
  AddWorker("w2", 1);
  const uint64_t w2_session = session_;
  const std::string id = Submit(SpecJson(2, 1));
  ASSERT_EQ(Assignments().size(), 2u);
  const v1::Job placed = Get(id);
  const int gone = placed.ranks(0).worker_id() == "w2" ? 0 : 1;
  const std::string survivor = placed.ranks(1 - gone).worker_id();
  ASSERT_EQ(placed.ranks(gone).worker_id(), "w2");
  Progress("w1", Ref(id, 1, 1 - gone), 3);
  Progress("w2", Ref(id, 1, gone), 3);
  manager_->SessionClosed("w2", w2_session);
  Exit(survivor, Ref(id, 1, 1 - gone), 1, false, "spindle-train: gloo all-to-all: lost contact");
  v1::Job j = Get(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_RESTARTING);
  EXPECT_EQ(j.message(),
            absl::StrCat("worker w2 disconnected with rank ", gone, "; then rank ", 1 - gone,
                         " on worker w1 exited with code 1: spindle-train: "
                         "gloo all-to-all: lost contact; restart 1/3 from scratch"));
  EXPECT_EQ(j.restarts(), 1);
  // w2 comes back running nothing: its slot, draining the stopped rank, is free at once and the
  // gang is placed again without waiting for the drain deadline.
  Hello("w2", {});
  const auto as = Assignments();
  ASSERT_EQ(as.size(), 2u);
  for (const auto& [worker, a] : as) EXPECT_EQ(a.ref().attempt(), 2) << worker;
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_PLACED);
}

// A worker that shuts down says so first (Leaving): its gang restarts at once naming the
// shutdown, nothing is placed on it again, and once its stream closes it counts as "left", not
// lost, and stays so past the heartbeat timeout.
TEST_F(JobManagerTest, AWorkerShuttingDownRestartsItsGangElsewhereAndLeaves) {
  AddWorker("w1", 1);
  AddWorker("w2", 1);
  const uint64_t w2_session = session_;
  const std::string id = Submit(SpecJson(2, 1));
  ASSERT_EQ(Assignments().size(), 2u);
  AddWorker("w3", 1);
  const int on_w2 = Get(id).ranks(0).worker_id() == "w2" ? 0 : 1;
  v1::WorkerMessage bye;
  bye.mutable_leaving()->set_reason("received signal 15");
  testing::Deliver(*manager_, "w2", bye);
  v1::Job j = Get(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_RESTARTING);
  EXPECT_EQ(j.message(), absl::StrCat("worker w2 is shutting down (received signal 15) with rank ",
                                      on_w2, "; restart 1/3 from scratch"));
  EXPECT_EQ(manager_->WorkerCounts()["leaving"], 1);
  // The stopped ranks exit; the gang is placed again, on w1 and w3.
  Exit("w2", Ref(id, 1, on_w2), -1, true);
  Exit("w1", Ref(id, 1, 1 - on_w2), -1, true);
  const auto as = Assignments();
  ASSERT_EQ(as.size(), 2u);
  for (const auto& [worker, a] : as) {
    EXPECT_NE(worker, "w2");
    EXPECT_EQ(a.ref().attempt(), 2);
  }
  manager_->SessionClosed("w2", w2_session);
  for (int i = 0; i < 5; ++i) {  // past the 3 s heartbeat timeout
    clock_.AdvanceMs(1000);
    Heartbeat("w1");
    Heartbeat("w3");
    manager_->Tick();
  }
  EXPECT_EQ(manager_->WorkerCounts()["left"], 1);
  EXPECT_EQ(manager_->WorkerCounts()["lost"], 0);
  j = Get(id);
  EXPECT_EQ(j.attempt(), 2);
  EXPECT_EQ(j.restarts(), 1);
  bool listed = false;
  for (const WorkerView& w : manager_->ListWorkers())
    if (w.worker_id == "w2") listed = w.state == "left";
  EXPECT_TRUE(listed);
}

// An unfinished job's checkpoint directory is refused to a second job (however the path is
// spelled), which would resume from the first one's checkpoints; once the first job ended, the
// directory is free to continue from.
TEST_F(JobManagerTest, TwoUnfinishedJobsMayNotShareACheckpointDirectory) {
  AddWorker("w1", 1);
  const std::string a = Submit(SpecJson());
  CpPlan plan;
  auto b = manager_->Submit(WithCheckpointDir(SpecJson(), "/tmp//ck/"), &plan);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b.status().message(),
            "job cannot run: checkpoint.dir \"/tmp//ck/\" is in use by job " + a +
                " (placed); two jobs on one directory would resume from each other's checkpoints");
  EXPECT_EQ(manager_->ListJobs({}, 100).size(), 1u);  // nothing queued
  // `spindle plan` names it among the problems.
  CpPlan planned;
  ASSERT_TRUE(manager_->PlanSpec(SpecJson(), &planned).ok());
  EXPECT_FALSE(planned.ok());
  ASSERT_EQ(planned.problems.size(), 1);
  EXPECT_EQ(planned.problems[0],
            std::string(b.status().message())
                .replace(b.status().message().find("/tmp//ck/"), 9, "/tmp/ck"));
  // A symbolic link to the directory's parent is the same place.
  const std::string link = ::testing::TempDir() + "/spindle-ck-link-" + std::to_string(getpid());
  std::filesystem::remove(link);
  std::filesystem::create_directory_symlink("/tmp", link);
  auto c = manager_->Submit(WithCheckpointDir(SpecJson(), link + "/ck"), &plan);
  std::filesystem::remove(link);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_EQ(manager_->ListJobs({}, 100).size(), 1u);
  EXPECT_TRUE(manager_->Submit(WithCheckpointDir(SpecJson(), "/tmp/ck2"), &plan).ok());
  Exit("w1", Ref(a, 1, 0), 0);
  ASSERT_EQ(Get(a).state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_TRUE(manager_->Submit(SpecJson(), &plan).ok());
}

// Nor may one unfinished job's checkpoint directory lie inside another's (either way round):
// the outer job's pruning and resume would meet the inner job's checkpoints. A sibling that only
// shares a prefix of the name is no neighbour; a finished job frees its directory.
TEST_F(JobManagerTest, TwoUnfinishedJobsMayNotUseNestedCheckpointDirectories) {
  AddWorker("w1", 1);
  const std::string a = Submit(SpecJson());  // /tmp/ck
  CpPlan plan;
  auto inner = manager_->Submit(WithCheckpointDir(SpecJson(), "/tmp/ck/inner"), &plan);
  EXPECT_EQ(inner.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(inner.status().message(),
            "job cannot run: checkpoint.dir \"/tmp/ck/inner\" is inside \"/tmp/ck\", the "
            "checkpoint.dir of job " +
                a + " (placed); nested checkpoint directories would mix the two jobs' checkpoints");
  auto outer = manager_->Submit(WithCheckpointDir(SpecJson(), "/tmp"), &plan);
  EXPECT_EQ(outer.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(outer.status().message(),
            "job cannot run: checkpoint.dir \"/tmp\" is around \"/tmp/ck\", the checkpoint.dir "
            "of job " +
                a + " (placed); nested checkpoint directories would mix the two jobs' checkpoints");
  EXPECT_EQ(manager_->Submit(WithCheckpointDir(SpecJson(), "/"), &plan).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(manager_->ListJobs({}, 100).size(), 1u);
  EXPECT_TRUE(manager_->Submit(WithCheckpointDir(SpecJson(), "/tmp/ckx"), &plan).ok());
  EXPECT_TRUE(manager_->Submit(WithCheckpointDir(SpecJson(), "/tmp/c"), &plan).ok());
  Exit("w1", Ref(a, 1, 0), 0);
  ASSERT_EQ(Get(a).state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_TRUE(manager_->Submit(WithCheckpointDir(SpecJson(), "/tmp/ck/inner"), &plan).ok());
}

TEST_F(JobManagerTest, HungRankIsDetected) {
  AddWorker("w1", 2);
  const std::string id = Submit(SpecJson(2, 1));
  Progress("w1", Ref(id, 1, 0), 1);
  Progress("w1", Ref(id, 1, 1), 1);
  for (int i = 2; i <= 7; ++i) {
    clock_.AdvanceMs(1000);
    Progress("w1", Ref(id, 1, 0), i);  // rank 1 stays at step 1
    Heartbeat("w1");
    manager_->Tick();
  }
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_RESTARTING);
  EXPECT_EQ(Get(id).message(),
            "rank 1 on worker w1 made no progress for 6.0 s (step 1, furthest rank at step 7); "
            "restart 1/3 from scratch");
}

// Steps longer than the hang timeout (5 s here) are not hangs: a rank may take three of its own
// last step time (its first step counted from its start) before it is declared hung.
TEST_F(JobManagerTest, StepsLongerThanTheHangTimeoutAreNotHangs) {
  AddWorker("w1", 1);
  const std::string id = Submit(SpecJson(1, 1));
  TickSeconds("w1", 7);  // set-up and the first step (within the start timeout)
  Progress("w1", Ref(id, 1, 0), 1);
  TickSeconds("w1", 20);  // within 3 x 7 s
  Progress("w1", Ref(id, 1, 0), 2);
  TickSeconds("w1", 20);
  Progress("w1", Ref(id, 1, 0), 3);
  TickSeconds("w1", 59);  // within 3 x 20 s
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_RUNNING) << Get(id).message();
  TickSeconds("w1", 2);
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_RESTARTING);
  EXPECT_EQ(Get(id).message(),
            "rank 0 on worker w1 made no progress for 61.0 s (step 3, furthest rank at step 3); "
            "restart 1/3 from scratch");
}

// Every rank stuck at one step (one holds the others in a collective): no rank is blamed.
TEST_F(JobManagerTest, GangStuckAtOneStepIsReportedWithoutBlamingARank) {
  AddWorker("w1", 2);
  const std::string id = Submit(SpecJson(2, 1));
  Progress("w1", Ref(id, 1, 0), 4);
  Progress("w1", Ref(id, 1, 1), 4);
  TickSeconds("w1", 7);
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_RESTARTING);
  EXPECT_EQ(Get(id).message(),
            "the gang made no progress for 6.0 s (every rank at step 4); restart 1/3 from "
            "scratch");
}

TEST_F(JobManagerTest, CancelStopsEveryRank) {
  AddWorker("w1", 1);
  AddWorker("w2", 1);
  const std::string id = Submit(SpecJson(2, 1));
  ASSERT_EQ(Assignments().size(), 2u);
  JobView out;
  ASSERT_TRUE(manager_->Cancel(id, "no longer needed", &out).ok());
  EXPECT_EQ(out.record.state, JobState::kCancelled);
  EXPECT_EQ(out.record.message, "cancelled: no longer needed");
  std::vector<std::pair<std::string, v1::Stop>> stops;
  Assignments(&stops);
  ASSERT_EQ(stops.size(), 2u);
  EXPECT_NE(stops[0].first, stops[1].first);
  // Cancelling again is not an error; unknown ids are.
  ASSERT_TRUE(manager_->Cancel(id, "", &out).ok());
  absl::Status st = manager_->Cancel("j-999999", "", &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(st.message(), "job j-999999 not found");
}

TEST_F(JobManagerTest, SubmitRejectsBadSpecsAndJobsThatNeverFit) {
  CpPlan plan;
  auto bad = manager_->Submit("{\"name\": 3}", &plan);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  AddWorker("w1", 4);
  auto big = manager_->Submit(SpecJson(4, 2), &plan);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(big.status().message(),
            "job needs 8 cpu devices (world = dp*cp) but the 1 registered cpu worker has 4 in "
            "total");
  auto impossible = manager_->Submit(
      SpecJson(8, 1, 0, 3, R"(, "lightning_mode": "all2all")"), &plan);
  EXPECT_EQ(impossible.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(impossible.status().message(),
            "job cannot run: parallel.lightning_mode: all2all needs n_heads divisible by cp, but "
            "n_heads=4 and cp=8 (4 % 8 = 4); use allgather or a cp that divides 4");
}

// A spec nesting 100,000 arrays (200 KB, well under gRPC's message limit) used to overflow the
// coordinator's stack; Submit and Plan refuse it by the limit, and the manager keeps serving.
TEST_F(JobManagerTest, SubmitAndPlanRefuseDeeplyNestedSpecsByTheLimit) {
  AddWorker("w1", 4);
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string deep_field = "{\"name\": " + deep + "}";
  for (const std::string& spec : {deep, deep_field}) {
    CpPlan plan;
    auto id = manager_->Submit(spec, &plan);
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(id.status().message(), "job spec: nesting deeper than 64 levels");
    absl::Status planned = manager_->PlanSpec(spec, &plan);
    EXPECT_EQ(planned.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(planned.message(), "job spec: nesting deeper than 64 levels");
  }
  CpPlan plan;
  auto ok = manager_->Submit(SpecJson(), &plan);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, "j-000001");
}

// A job that offloads its layer inputs (train.offload: 45.5 GiB pinned a rank for 917,504 tokens
// of the 1b model) is refused while no registered worker's host memory holds a rank, and placed
// on the worker whose does; the plan carries the pinned bytes.
TEST_F(JobManagerTest, OffloadingJobsGoWhereTheHostMemoryHoldsThem) {
  const std::string spec = R"({"name": "o", "model": {"preset": "1b"}, "seq_len": 917504,
      "data": {"source": "synthetic:recall"}, "resources": "cuda",
      "train": {"steps": 10, "recompute": true, "offload": true}})";
  AddGpuWorker("g1", 2, 48);
  CpPlan plan;
  auto refused = manager_->Submit(spec, &plan);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.status().message(),
            "job needs 1 rank (world = dp*cp) that pins 45.50 GiB of host memory each "
            "(train.offload), but the registered cuda workers' host memory holds only 0 such "
            "ranks (at most 80% of a worker's, the largest 48.00 GiB); set train.offload to "
            "false or add host memory");
  EXPECT_TRUE(manager_->ListJobs({}, 0).empty());
  AddGpuWorker("g2", 2, 64);
  const std::string id = Submit(spec);
  EXPECT_EQ(Get(id).plan().memory().host_bytes(), int64_t{13} * 917504 * 2048 * 2);
  auto as = Assignments();
  ASSERT_EQ(as.size(), 1u);
  EXPECT_EQ(as[0].first, "g2");
  // g2's other GPU stays free for a job that pins nothing, not for a second offloading rank.
  const std::string second = Submit(spec);
  EXPECT_TRUE(Assignments().empty());
  EXPECT_EQ(Get(second).state(), v1::JOB_STATE_QUEUED);
}

// A plan against the registered workers names what Submit would refuse, and stores nothing.
TEST_F(JobManagerTest, PlanNamesWhyTheRegisteredWorkersCanNeverRunTheJob) {
  CpPlan plan;
  ASSERT_TRUE(manager_->PlanSpec(SpecJson(4, 2), &plan).ok());
  EXPECT_EQ(plan.problems.size(), 0) << "no worker registered yet: the job may wait for one";
  AddWorker("w1", 4);
  plan = CpPlan{};
  ASSERT_TRUE(manager_->PlanSpec(SpecJson(4, 2), &plan).ok());
  ASSERT_EQ(plan.problems.size(), 1);
  EXPECT_EQ(plan.problems[0],
            "job needs 8 cpu devices (world = dp*cp) but the 1 registered cpu worker has 4 in "
            "total");
  plan = CpPlan{};
  ASSERT_TRUE(manager_->PlanSpec(SpecJson(4, 1), &plan).ok());
  EXPECT_EQ(plan.problems.size(), 0);
  EXPECT_TRUE(manager_->ListJobs({}, 0).empty());
}

TEST_F(JobManagerTest, SubmitRejectsRelativePaths) {
  CpPlan plan;
  std::string spec = SpecJson(1, 1);
  spec.replace(spec.find("/tmp/ck"), 7, "ck/run1");
  auto relative_dir = manager_->Submit(spec, &plan);
  EXPECT_EQ(relative_dir.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(relative_dir.status().message(),
            "job spec: checkpoint.dir: must be an absolute path (`spindle submit` makes relative "
            "paths absolute), got \"ck/run1\"");
  spec = SpecJson(1, 1);
  spec.replace(spec.find("synthetic:recall"), 16, "text:corpus.txt");
  auto relative_data = manager_->Submit(spec, &plan);
  EXPECT_EQ(relative_data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(relative_data.status().message(),
            "job spec: data.source: the file must be an absolute path (`spindle submit` makes "
            "relative paths absolute), got \"text:corpus.txt\"");
  EXPECT_TRUE(manager_->ListJobs({}, 0).empty());
}

TEST_F(JobManagerTest, PriorityOrderWithGangs) {
  AddWorker("w1", 2);
  const std::string a = Submit(SpecJson(2, 1, 0));  // placed at once
  const std::string b = Submit(WithCheckpointDir(SpecJson(1, 1, 0), "/tmp/ck-b"));
  const std::string c = Submit(WithCheckpointDir(SpecJson(2, 1, 9), "/tmp/ck-c"));
  const std::string d = Submit(WithCheckpointDir(SpecJson(1, 1, 9), "/tmp/ck-d"));
  Assignments();
  Exit("w1", Ref(a, 1, 0), 0);
  // One device free: c (priority 9, 2 ranks) is first in line and blocks everything after it.
  EXPECT_EQ(Get(c).state(), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(Get(d).state(), v1::JOB_STATE_QUEUED);
  Exit("w1", Ref(a, 1, 1), 0);
  EXPECT_EQ(Get(c).state(), v1::JOB_STATE_PLACED);
  Exit("w1", Ref(c, 1, 0), 0);
  Exit("w1", Ref(c, 1, 1), 0);
  EXPECT_EQ(Get(d).state(), v1::JOB_STATE_PLACED);
  EXPECT_EQ(Get(b).state(), v1::JOB_STATE_PLACED);
}

TEST_F(JobManagerTest, RecoveryReadoptsReportedRanksAndRestartsTheRest) {
  AddWorker("w1", 1);
  AddWorker("w2", 1);
  const std::string a = Submit(SpecJson(1, 1));
  const std::string b = Submit(WithCheckpointDir(SpecJson(1, 1), "/tmp/ck-b"));
  auto as = Assignments();
  ASSERT_EQ(as.size(), 2u);
  const std::string wa = Get(a).ranks(0).worker_id(), wb = Get(b).ranks(0).worker_id();
  Progress(wa, Ref(a, 1, 0), 3);
  Progress(wb, Ref(b, 1, 0), 3);
  Checkpoint(wb, Ref(b, 1, 0), 2);
  EXPECT_EQ(Get(a).state(), v1::JOB_STATE_RUNNING);

  Reopen();  // the coordinator restarts
  EXPECT_EQ(Get(a).state(), v1::JOB_STATE_RUNNING);
  // Before the workers report, each job shows the step of its last complete checkpoint.
  EXPECT_EQ(Get(a).step(), 0);
  EXPECT_EQ(Get(b).step(), 2);
  EXPECT_EQ(Get(a).attempt(), 1);
  EXPECT_EQ(rendezvous_.NumOpen(), 2u);
  AddWorker(wa, 1, true, {Ref(a, 1, 0)});  // wa still runs a's rank
  clock_.AdvanceMs(2000);
  Heartbeat(wa);
  manager_->Tick();
  EXPECT_EQ(Get(a).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Get(a).ranks(0).step(), 3);
  clock_.AdvanceMs(2500);  // past the 4 s recovery grace; wb never came back
  Heartbeat(wa);
  manager_->Tick();
  EXPECT_EQ(Get(a).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Get(a).attempt(), 1);
  v1::Job jb = Get(b);
  EXPECT_EQ(jb.restarts(), 1);
  EXPECT_EQ(jb.state(), v1::JOB_STATE_RESTARTING) << jb.message();
  EXPECT_EQ(jb.message(),
            "coordinator restarted and rank 0 on worker " + wb +
                " was not re-adopted within 4.0 s; restart 1/3 from checkpoint step 2");
}

TEST_F(JobManagerTest, ReconnectingWorkerWithoutTheRankRestartsGang) {
  AddWorker("w1", 1);
  const std::string id = Submit(SpecJson());
  Progress("w1", Ref(id, 1, 0), 2);
  Hello("w1", {});  // the worker restarted and lost its trainer
  v1::Job j = Get(id);
  EXPECT_EQ(j.attempt(), 2);
  EXPECT_EQ(j.restarts(), 1);
}

// train.recompute "auto" is decided at submit time against the registered devices (8 GiB CPU
// slots here), sent with every assignment, and kept when a restarted coordinator re-plans the job
// with no worker registered yet (which alone would recompute every layer).
TEST_F(JobManagerTest, AutoRecomputeIsDecidedAtSubmitAndKeptAcrossARestart) {
  AddWorker("w1", 1);
  std::string spec;
  int64_t want = -1;
  for (int64_t T = 1024; T <= (int64_t{1} << 24) && want < 0; T += T / 8 / 64 * 64) {
    spec = absl::StrCat(R"({"name": "t", "model": {"preset": "tiny"}, "seq_len": )", T,
                        R"(, "data": {"source": "synthetic:recall"},
                        "train": {"steps": 10, "recompute": "auto"}, "resources": "cpu"})");
    const int64_t r =
        CpPlanner().Plan(*ParseJobSpec(spec), int64_t{8} << 30).memory.recompute_layers;
    if (r > 0 && r < 4) want = r;  // some layers recompute, not all (tiny has 4)
  }
  ASSERT_GT(want, 0) << "no sequence length from 1K to 16M recomputes some but not all layers";
  const std::string id = Submit(spec);
  auto as = Assignments();
  ASSERT_EQ(as.size(), 1u);
  EXPECT_EQ(RunSpecOf(as[0].second).train.recompute_layers, want);
  EXPECT_EQ(Get(id).plan().memory().recompute_layers(), want);

  as = RestartCoordinatorWithoutTheRank();
  ASSERT_EQ(as.size(), 1u) << Get(id).message();
  EXPECT_EQ(as[0].second.ref().attempt(), 2);
  EXPECT_EQ(RunSpecOf(as[0].second).train.recompute_layers, want);
}

// A job is planned once, at submit; a restarted coordinator reads the planned job back instead of
// planning again. The stored decision is changed here to the mode the planner did not pick, so
// that any re-decision (by the planner, on a cluster that may differ) would show.
TEST_F(JobManagerTest, AFastestJobKeepsItsModesAcrossACoordinatorRestart) {
  const std::string id = Submit(R"({"name": "t", "model": {"preset": "tiny"}, "seq_len": 1024,
      "data": {"source": "synthetic:recall"}, "parallel": {"cp": 2, "mla_mode": "fastest"},
      "train": {"steps": 10}, "resources": "cpu"})");
  absl::StatusOr<std::vector<JobRecord>> recs = store_->LoadJobs();
  ASSERT_TRUE(recs.ok() && recs->size() == 1u);
  JobRecord rec = recs->at(0);
  absl::StatusOr<PlannedJob> planned = DecodePlannedJob(rec.plan);
  ASSERT_TRUE(planned.ok()) << planned.status();
  const CpMode picked = planned->spec.parallel.mla_mode;
  ASSERT_NE(picked, CpMode::kFastest);
  const CpMode other = picked == CpMode::kRing ? CpMode::kAllGather : CpMode::kRing;
  planned->spec.parallel.mla_mode = other;
  rec.plan = EncodePlannedJob(*planned);
  ASSERT_TRUE(store_->SaveJob(rec).ok());

  Reopen();
  AddWorker("w1", 2);
  auto as = Assignments();
  ASSERT_EQ(as.size(), 2u) << Get(id).message();
  for (const auto& [worker, a] : as) {
    const JobSpec run = RunSpecOf(a);
    EXPECT_EQ(run.parallel.mla_mode, other) << "re-decided after the restart";
    EXPECT_EQ(run.parallel.lightning_mode, planned->spec.parallel.lightning_mode);
  }
}

// "auto" submitted before any worker registered is planned with every layer recomputing, then
// sized to the device the job is placed on; that decision stays across a coordinator restart.
TEST_F(JobManagerTest, AutoRecomputeWithoutDevicesIsDecidedAtPlacement) {
  const std::string id = Submit(R"({"name": "t", "model": {"preset": "tiny"}, "seq_len": 1024,
      "data": {"source": "synthetic:recall"}, "train": {"steps": 10, "recompute": "auto"},
      "resources": "cpu"})");
  EXPECT_EQ(Get(id).plan().memory().recompute_layers(), 4);
  EXPECT_EQ(Get(id).plan().memory().device_memory_bytes(), 0);
  AddWorker("w1", 1);  // 8 GiB: 1024 tokens of tiny need no recompute
  auto as = Assignments();
  ASSERT_EQ(as.size(), 1u);
  EXPECT_EQ(RunSpecOf(as[0].second).train.recompute_layers, 0);
  EXPECT_EQ(Get(id).plan().memory().recompute_layers(), 0);
  EXPECT_EQ(Get(id).plan().memory().device_memory_bytes(), int64_t{8} << 30);

  as = RestartCoordinatorWithoutTheRank();
  ASSERT_EQ(as.size(), 1u) << Get(id).message();
  EXPECT_EQ(as[0].second.ref().attempt(), 2);
  EXPECT_EQ(RunSpecOf(as[0].second).train.recompute_layers, 0);
}

// A rank that runs out of device memory (exit code 3): a job with recompute "auto" restarts with
// more layers recomputing (half of those still keeping theirs, at least two), which the plan and a
// restarted coordinator keep; a job with a fixed recompute restarts as it was.
TEST_F(JobManagerTest, OutOfMemoryRestartsAnAutoRecomputeJobWithMoreLayersRecomputing) {
  AddWorker("w1", 1);
  auto spec = [](const std::string& recompute) {
    return absl::StrCat(R"({"name": "t", "model": {"preset": "tiny"}, "seq_len": 1024,
        "data": {"source": "synthetic:recall"}, "train": {"steps": 10, "recompute": )",
                        recompute, R"(}, "resources": "cpu", "max_restarts": 5})");
  };
  const std::string id = Submit(spec("\"auto\""));
  auto as = Assignments();
  ASSERT_EQ(as.size(), 1u);
  EXPECT_EQ(RunSpecOf(as[0].second).train.recompute_layers, 0);  // 1024 tokens of tiny fit 8 GiB
  const int64_t want[] = {2, 4, 4};               // tiny has 4 layers
  for (int64_t attempt = 1; attempt <= 3; ++attempt) {
    Exit("w1", Ref(id, attempt, 0), 3, false,
         "spindle-train: CachingAllocator: out of device memory");
    v1::Job j = Get(id);
    EXPECT_EQ(j.plan().memory().recompute_layers(), want[attempt - 1]);
    // The restart's event says so, once per change (none once every layer recomputes).
    const std::string said = absl::StrCat(
        "rank 0 on worker w1 exited with code 3: spindle-train: CachingAllocator: out of device "
        "memory; train.recompute \"auto\": ",
        want[attempt - 1], " of 4 layers recompute from now on; restart ", attempt, "/5");
    bool found = false;
    for (const v1::JobEvent& e : j.events()) found |= e.message().find(said) != std::string::npos;
    EXPECT_EQ(found, attempt < 3) << "attempt " << attempt << ": " << said;
    as = Assignments();
    ASSERT_EQ(as.size(), 1u) << j.message();
    EXPECT_EQ(as[0].second.ref().attempt(), attempt + 1);
    EXPECT_EQ(RunSpecOf(as[0].second).train.recompute_layers, want[attempt - 1]);
  }
  as = RestartCoordinatorWithoutTheRank();
  ASSERT_EQ(as.size(), 1u) << Get(id).message();
  EXPECT_EQ(RunSpecOf(as[0].second).train.recompute_layers, 4);

  const std::string fixed = Submit(spec("1"));
  Exit("w1", Ref(id, 5, 0), 0);
  Exit("w1", Ref(id, 5, 0), 0);
  as = Assignments();
  ASSERT_EQ(as.size(), 1u);
  EXPECT_EQ(as[0].second.ref().job_id(), fixed);
  Exit("w1", Ref(fixed, 1, 0), 3, false, "out of device memory");
  as = Assignments();
  ASSERT_EQ(as.size(), 1u);
  EXPECT_EQ(RunSpecOf(as[0].second).train.recompute_layers, 1);
  EXPECT_EQ(Get(fixed).plan().memory().recompute_layers(), 1);
}

TEST_F(JobManagerTest, UnexpectedRunningRankIsStopped) {
  AddWorker("w1", 1, true, {Ref("j-000077", 4, 0)});
  std::vector<std::pair<std::string, v1::Stop>> stops;
  Assignments(&stops);
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_EQ(stops[0].second.job_id(), "j-000077");
  EXPECT_EQ(stops[0].second.attempt(), 4);
}

// A wall-clock jump (NTP, an operator) restarts nothing: liveness and hang timers run on the
// steady clock.
TEST_F(JobManagerTest, AWallClockJumpRestartsNothing) {
  AddWorker("w1", 1);
  const std::string id = Submit(SpecJson());
  ASSERT_EQ(Assignments().size(), 1u);
  Progress("w1", Ref(id, 1, 0), 1);
  clock_.JumpWallMs(60'000);
  manager_->Tick();
  clock_.JumpWallMs(-120'000);
  manager_->Tick();
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Get(id).restarts(), 0);
  EXPECT_EQ(manager_->WorkerCounts()["alive"], 1);
  // Real time still counts: silent past the heartbeat timeout, the worker is lost.
  clock_.AdvanceMs(3500);
  manager_->Tick();
  EXPECT_EQ(manager_->WorkerCounts()["lost"], 1);
}

// The gang's ranks all report their exit after the stop: the next attempt need not wait for the
// fence deadline.
TEST_F(JobManagerTest, ARestartWaitsOnlyUntilEveryStoppedRankExited) {
  AddWorker("w1", 1);
  AddWorker("w2", 1);
  AddWorker("w3", 1);
  const std::string id = Submit(SpecJson(2, 1));
  auto as = Assignments();
  ASSERT_EQ(as.size(), 2u);
  const std::string w0 = as[0].first, w1 = as[1].first;
  Exit(w1, Ref(id, 1, 1), 1);  // rank 1 fails; rank 0 is stopped
  EXPECT_TRUE(Assignments().empty()) << "placed while rank 0 of attempt 1 may still train";
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_RESTARTING);
  Exit(w0, Ref(id, 1, 0), -1, /*stopped=*/true);
  as = Assignments();
  ASSERT_EQ(as.size(), 2u);
  EXPECT_EQ(as[0].second.ref().attempt(), 2);
}

// A rank whose trainer pulses and has been silent for the silence timeout (a frozen process)
// restarts its gang, named, whatever the hang timeout.
TEST_F(JobManagerTest, ASilentPulsingRankRestartsItsGang) {
  AddWorker("w1", 2);
  const std::string id = Submit(SpecJson(2, 1));
  ASSERT_EQ(Assignments().size(), 2u);
  Progress("w1", Ref(id, 1, 0), 3);
  Progress("w1", Ref(id, 1, 1), 3);
  auto heartbeat = [&](int64_t silent_ms) {
    v1::WorkerMessage hb;
    for (int r = 0; r < 2; ++r) {
      v1::RunningRank* rr = hb.mutable_heartbeat()->add_running();
      *rr->mutable_ref() = Ref(id, 1, r);
      rr->set_pulsing(true);
      rr->set_silent_ms(r == 1 ? silent_ms : 200);
    }
    testing::Deliver(*manager_, "w1", hb);
  };
  heartbeat(4900);
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_RUNNING);
  heartbeat(5000);
  v1::Job j = Get(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_RESTARTING);
  EXPECT_EQ(j.message(),
            "rank 1 on worker w1 stopped responding (no output for 5.0 s, at step 3); restart "
            "1/3 from scratch");
}

// An assignment the worker never acknowledged (its stream broke first) is sent again when its
// session reopens, instead of restarting the gang.
TEST_F(JobManagerTest, AnUnacknowledgedAssignmentIsSentAgainOnReconnect) {
  AddWorker("w1", 1);
  const std::string id = Submit(SpecJson());
  ASSERT_EQ(Assignments().size(), 1u);
  manager_->SessionClosed("w1", session_);
  Hello("w1", {});
  auto as = Assignments();
  ASSERT_EQ(as.size(), 1u);
  EXPECT_EQ(as[0].second.ref().attempt(), 1);
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_PLACED);
  EXPECT_EQ(Get(id).restarts(), 0);
  // Once started, a rank missing from a hello restarts the gang as before.
  v1::WorkerMessage started;
  *started.mutable_rank_started()->mutable_ref() = Ref(id, 1, 0);
  testing::Deliver(*manager_, "w1", started);
  manager_->SessionClosed("w1", session_);
  Hello("w1", {});
  EXPECT_EQ(Get(id).restarts(), 1);
}

// Workers are known by the address they connect from (or advertise); the assignment carries it
// for Gloo and names no rendezvous address when none was configured; /metrics given as a port
// gets the host.
TEST_F(JobManagerTest, WorkersAreKnownByTheAddressTheyConnectFrom) {
  v1::RegisterRequest req = RegisterRequest("w1", "h1", CpuSlots(1));
  req.set_metrics_address(":9401");
  absl::StatusOr<RegistrationReply> reply =
      manager_->RegisterWorker(RegistrationFromProto(req, "198.18.0.2"));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->observed_host, "198.18.0.2");
  EXPECT_EQ(reply->stop_grace_ms, 1000);
  Hello("w1", {});
  req = RegisterRequest("w2", "h2", CpuSlots(1));
  req.set_advertise_host("node2.example");
  ASSERT_TRUE(manager_->RegisterWorker(RegistrationFromProto(req, "198.18.0.3")).ok());
  Hello("w2", {});
  std::map<std::string, WorkerView> workers;
  for (const WorkerView& w : manager_->ListWorkers()) workers[w.worker_id] = w;
  EXPECT_EQ(workers["w1"].address, "198.18.0.2");
  EXPECT_EQ(workers["w1"].metrics_address, "198.18.0.2:9401");
  EXPECT_EQ(workers["w2"].address, "node2.example");
  manager_->SetRendezvousAddress("");
  const std::string id = Submit(SpecJson(2, 1));
  std::map<std::string, v1::Assignment> by_worker;
  for (auto& [w, a] : Assignments()) by_worker[w] = a;
  ASSERT_EQ(by_worker.size(), 2u);
  EXPECT_EQ(by_worker["w1"].host_address(), "198.18.0.2");
  EXPECT_EQ(by_worker["w2"].host_address(), "node2.example");
  EXPECT_EQ(by_worker["w1"].rendezvous_address(), "");
  EXPECT_EQ(Get(id).state(), v1::JOB_STATE_PLACED);
}

// A gang across a worker that reached the coordinator over loopback and one on another host
// cannot meet: refused at placement in one line naming both.
TEST_F(JobManagerTest, AGangAcrossALoopbackWorkerAndARemoteOneFailsAtPlacement) {
  ASSERT_TRUE(manager_
                  ->RegisterWorker(
                      RegistrationFromProto(RegisterRequest("w1", "h1", CpuSlots(1)), "127.0.0.1"))
                  .ok());
  Hello("w1", {});
  ASSERT_TRUE(manager_
                  ->RegisterWorker(
                      RegistrationFromProto(RegisterRequest("w2", "h2", CpuSlots(1)), "198.18.0.3"))
                  .ok());
  Hello("w2", {});
  const std::string id = Submit(SpecJson(2, 1));
  v1::Job j = Get(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(j.message(),
            "cannot place the job across workers w1 and w2: w1's address 127.0.0.1 (it reaches "
            "the coordinator over loopback) cannot be reached from w2 at 198.18.0.3; start w1 "
            "with --advertise-host=<an address the other hosts reach>, or connect it to the "
            "coordinator's network address");
  EXPECT_TRUE(Assignments().empty());
}

// A rank's note (a corrupt checkpoint passed over on resume, say) is one of the job's events.
TEST_F(JobManagerTest, ARankNoteIsAJobEvent) {
  AddWorker("w1", 1);
  const std::string id = Submit(SpecJson());
  ASSERT_EQ(Assignments().size(), 1u);
  v1::WorkerMessage m;
  *m.mutable_note()->mutable_ref() = Ref(id, 1, 0);
  m.mutable_note()->set_text("checkpoint \"/tmp/ck/step_00000010\" does not load");
  testing::Deliver(*manager_, "w1", m);
  const v1::Job j = Get(id);
  EXPECT_EQ(j.events(j.events_size() - 1).message(),
            "rank 0: checkpoint \"/tmp/ck/step_00000010\" does not load");
  Reopen();  // persisted
  const v1::Job again = Get(id);
  EXPECT_EQ(again.events(again.events_size() - 1).message(),
            "rank 0: checkpoint \"/tmp/ck/step_00000010\" does not load");
}

// A finished job shows the step and loss it ended at after the coordinator restarts, its ranks
// long gone.
TEST_F(JobManagerTest, AFinishedJobKeepsItsFinalStepAndLossAcrossARestart) {
  AddWorker("w1", 1);
  const std::string id = Submit(SpecJson());
  ASSERT_EQ(Assignments().size(), 1u);
  Progress("w1", Ref(id, 1, 0), 10);
  Exit("w1", Ref(id, 1, 0), 0);
  ASSERT_EQ(Get(id).state(), v1::JOB_STATE_SUCCEEDED);
  Reopen();
  const v1::Job j = Get(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(j.step(), 10);
  EXPECT_DOUBLE_EQ(j.loss(), 5.0 - 10 * 0.1);
}

// A coordinator restarted while a rank runs learns its loss from the worker's hello, and the
// loss of its last step from its exit, even when it missed every progress line.
TEST_F(JobManagerTest, ARestartedCoordinatorTakesTheLossFromTheHelloAndTheExit) {
  AddWorker("w1", 1);
  const std::string id = Submit(SpecJson());
  ASSERT_EQ(Assignments().size(), 1u);
  Progress("w1", Ref(id, 1, 0), 4);
  Reopen();
  v1::SessionHello h;
  h.set_worker_id("w1");
  v1::RunningRank* rr = h.add_running();
  *rr->mutable_ref() = Ref(id, 1, 0);
  rr->set_step(6);
  rr->set_loss(2.5);
  v1::RegisterRequest req = RegisterRequest("w1", "w1.local", CpuSlots(1));
  ASSERT_TRUE(manager_->RegisterWorker(RegistrationFromProto(req, "127.0.0.1")).ok());
  ASSERT_TRUE(testing::OpenSession(*manager_, h, ++session_).ok());
  EXPECT_EQ(Get(id).step(), 6);
  EXPECT_DOUBLE_EQ(Get(id).loss(), 2.5);
  v1::WorkerMessage m;
  *m.mutable_rank_exit()->mutable_ref() = Ref(id, 1, 0);
  m.mutable_rank_exit()->set_last_loss(1.25);
  testing::Deliver(*manager_, "w1", m);
  const v1::Job j = Get(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(j.step(), 10);
  EXPECT_DOUBLE_EQ(j.loss(), 1.25);
}

}  // namespace
}  // namespace spindle
