// A store that stalls or fails under a running coordinator (an in-process one on 127.0.0.1, its
// SQLite store wrapped by a fault-injecting one): a 15 s stall of one write fences no trainer (a
// real spindle-worker running a real spindle-train rank keeps its heartbeats acknowledged), health
// says NOT_SERVING meanwhile without waiting behind the write, and the job ends as it would have;
// a terminal transition whose write fails is tried again until it is stored, counted in
// spindle_store_errors_total, with health NOT_SERVING while writes fail.
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cli/healthcheck.h"
#include "common/status.h"
#include "common/subprocess.h"
#include "coordinator/coordinator_server.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "spindle/v1/cluster.grpc.pb.h"
#include "spindle/v1/job.grpc.pb.h"
#include "tests/integration/worker_test_util.h"

namespace spindle {
namespace {

using testing::ScratchDir;
using testing::WaitFor;

// Passes everything to `base`; a write may be made to stall (once) or to fail (while set).
class UnreliableStore : public JobStore {
 public:
  explicit UnreliableStore(JobStore* base) : base_(base) {}

  void StallNextWrite(absl::Duration d) {
    absl::MutexLock l(&mu_);
    stall_ = d;
  }
  void FailWrites(bool fail) {
    absl::MutexLock l(&mu_);
    fail_ = fail;
  }
  bool stalling() {
    absl::MutexLock l(&mu_);
    return stalling_;
  }

  absl::Status CreateJob(JobRecord* job, const EventRecord& event) override {
    RETURN_IF_ERROR(Fault());
    return base_->CreateJob(job, event);
  }
  absl::Status SaveJob(const JobRecord& job, const EventRecord* event,
                       const AttemptRecord* attempt) override {
    RETURN_IF_ERROR(Fault());
    return base_->SaveJob(job, event, attempt);
  }
  absl::StatusOr<std::vector<JobRecord>> LoadJobs() override { return base_->LoadJobs(); }
  absl::StatusOr<std::vector<EventRecord>> LoadEvents(const std::string& id) override {
    return base_->LoadEvents(id);
  }
  absl::StatusOr<AttemptRecord> LoadAttempt(const std::string& id, int64_t attempt) override {
    return base_->LoadAttempt(id, attempt);
  }
  absl::Status DeleteJobs(const std::vector<std::string>& ids) override {
    RETURN_IF_ERROR(Fault());
    return base_->DeleteJobs(ids);
  }
  absl::Status SaveWorker(const WorkerRecord& w) override {
    RETURN_IF_ERROR(Fault());
    return base_->SaveWorker(w);
  }
  absl::StatusOr<std::vector<WorkerRecord>> LoadWorkers() override { return base_->LoadWorkers(); }

 private:
  absl::Status Fault() {
    absl::Duration stall;
    {
      absl::MutexLock l(&mu_);
      if (fail_) return absl::UnavailableError("injected: the disk is gone");
      stall = stall_;
      stall_ = absl::ZeroDuration();
      stalling_ = stall > absl::ZeroDuration();
    }
    if (stall > absl::ZeroDuration()) {
      absl::SleepFor(stall);  // a disk that does not answer (an fsync on a stalled volume)
      absl::MutexLock l(&mu_);
      stalling_ = false;
    }
    return absl::OkStatus();
  }

  JobStore* const base_;
  absl::Mutex mu_;
  absl::Duration stall_ ABSL_GUARDED_BY(mu_);
  bool fail_ ABSL_GUARDED_BY(mu_) = false;
  bool stalling_ ABSL_GUARDED_BY(mu_) = false;
};

std::string TinySpec(const std::string& ckpt, int steps) {
  return absl::StrCat(
      R"({"name":"tiny","model":{"preset":"tiny"},"data":{"source":"synthetic:recall"},)",
      R"("seq_len":256,"parallel":{"cp":1,"dp":1},"train":{"steps":)", steps,
      R"(},"checkpoint":{"dir":")", ckpt, R"(","every":0},"resources":"cpu","max_restarts":2})");
}

class StoreFaultsTest : public ::testing::Test {
 protected:
  void Start() {
    CoordinatorConfig cfg;
    cfg.listen = "127.0.0.1:0";
    cfg.db_path = dir_.File("store.db");
    cfg.metrics_port = 0;
    cfg.manager.heartbeat_interval_ms = 500;
    cfg.manager.heartbeat_timeout_ms = 3000;
    cfg.manager.stop_grace_ms = 2000;
    cfg.store_stall_ms = 1000;
    cfg.wrap_store = [this](JobStore* base) {
      auto s = std::make_unique<UnreliableStore>(base);
      store_ = s.get();
      return s;
    };
    auto s = CoordinatorServer::Start(cfg);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    channel_ = grpc::CreateChannel(address(), grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel_);
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", server_->client_port()); }

  absl::StatusOr<ServingStatus> Health() {
    GrpcHealthOptions o;
    o.address = address();
    o.timeout = absl::Seconds(1);
    return CheckGrpcHealth(o);
  }
  double Metric(const std::string& name) {
    httplib::Client client("127.0.0.1", server_->metrics_port());
    auto res = client.Get("/metrics");
    if (!res || res->status != 200) return -1;
    const size_t at = res->body.find("\n" + name + " ");
    if (at == std::string::npos) return -1;
    const size_t begin = at + name.size() + 2;
    double v = -1;
    absl::SimpleAtod(res->body.substr(begin, res->body.find('\n', begin) - begin), &v);
    return v;
  }
  v1::Job Get(const std::string& id) {
    v1::GetJobRequest req;
    req.set_job_id(id);
    v1::Job job;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    jobs_->Get(&ctx, req, &job);
    return job;
  }
  absl::StatusOr<std::string> Submit(const std::string& spec) {
    v1::SubmitJobRequest req;
    req.set_spec_json(spec);
    v1::SubmitJobResponse resp;
    grpc::ClientContext ctx;
    grpc::Status st = jobs_->Submit(&ctx, req, &resp);
    if (!st.ok()) return absl::UnknownError(st.error_message());
    return resp.job_id();
  }

  ScratchDir dir_{"spindle-hostile-store"};
  UnreliableStore* store_ = nullptr;
  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
};

TEST_F(StoreFaultsTest, FifteenSecondStallFencesNoTrainerAndTheJobEndsAsItWouldHave) {
  if (std::string(SPINDLE_WORKER_BINARY).empty() || std::string(SPINDLE_TRAIN_BINARY).empty())
    GTEST_SKIP() << "spindle-worker or spindle-train not built";
  Start();
  SubprocessOptions options;
  options.stderr_path = dir_.File("worker.log");
  auto worker = Subprocess::Spawn(
      {SPINDLE_WORKER_BINARY, "--coordinator=" + address(), "--worker_id=w1", "--slots=1",
       "--work_dir=" + dir_.File("work"), "--metrics_port=-1", "--kill_grace=2s",
       "--coordinator_loss_timeout=60s", "--cpu_threads_per_slot=1",
       std::string("--trainer_binary=") + SPINDLE_TRAIN_BINARY, "--checkpoint_root=" + dir_.path(),
       "--data_root=" + dir_.path()},
      options);
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto id = Submit(TinySpec(dir_.File("ck"), 4000));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitFor([&] { return Get(*id).step() > 0; }, std::chrono::seconds(60)))
      << testing::ReadFile(dir_.File("worker.log"));
  const int64_t before = Get(*id).step();

  // The next write (a second job's submission) stalls 15 s, holding the job manager's mutex.
  store_->StallNextWrite(absl::Seconds(15));
  std::thread submitter([&] { Submit(TinySpec(dir_.File("ck2"), 10)).IgnoreError(); });
  ASSERT_TRUE(WaitFor([&] { return store_->stalling(); }));
  const auto stall_began = std::chrono::steady_clock::now();
  // Health answers at once, and says the store is not serving.
  EXPECT_TRUE(WaitFor([&] {
    absl::StatusOr<ServingStatus> h = Health();
    return h.ok() && *h == ServingStatus::kNotServing;
  }));
  submitter.join();
  EXPECT_GE(std::chrono::steady_clock::now() - stall_began, std::chrono::seconds(14));
  EXPECT_TRUE(WaitFor([&] {
    absl::StatusOr<ServingStatus> h = Health();
    return h.ok() && *h == ServingStatus::kServing;
  }));

  // The trainer went on through the stall (the worker was never without an acknowledgement for
  // its 3 s heartbeat timeout), and the job ends as it would have: one attempt, no restart.
  const std::string log = testing::ReadFile(dir_.File("worker.log"));
  EXPECT_EQ(log.find("no heartbeat acknowledged"), std::string::npos) << log;
  EXPECT_GT(Get(*id).step(), before);
  ASSERT_TRUE(WaitFor([&] { return Get(*id).state() == v1::JOB_STATE_SUCCEEDED; },
                      std::chrono::seconds(240)))
      << Get(*id).message();
  const v1::Job job = Get(*id);
  EXPECT_EQ(job.attempt(), 1);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.step(), 4000);
  EXPECT_EQ(Metric("spindle_store_errors_total"), 0);
  (*worker)->Kill().IgnoreError();
}

TEST_F(StoreFaultsTest, FailedTerminalWriteIsRetriedAndCounted) {
  Start();
  auto cluster = v1::ClusterService::NewStub(channel_);
  {
    v1::RegisterRequest req;
    req.set_worker_id("w1");
    req.set_hostname("w1.local");
    req.set_instance_id("i1");
    v1::DeviceGroup* d = req.add_devices();
    d->set_kind("cpu");
    d->set_count(1);
    d->set_memory_bytes(int64_t{8} << 30);
    v1::RegisterResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(cluster->Register(&ctx, req, &resp).ok());
  }
  grpc::ClientContext ctx;
  auto stream = cluster->Session(&ctx);
  v1::WorkerMessage hello;
  hello.mutable_hello()->set_worker_id("w1");
  hello.mutable_hello()->set_instance_id("i1");
  ASSERT_TRUE(stream->Write(hello));
  auto id = Submit(TinySpec(dir_.File("ck"), 10));
  ASSERT_TRUE(id.ok()) << id.status();
  v1::CoordinatorMessage m;
  ASSERT_TRUE(stream->Read(&m));
  ASSERT_TRUE(m.has_assignment());
  auto report = [&](auto fill) {
    v1::WorkerMessage w;
    fill(w);
    ASSERT_TRUE(stream->Write(w));
  };
  auto ref = [&](v1::RankRef* r) {
    r->set_job_id(*id);
    r->set_attempt(1);
  };
  report([&](v1::WorkerMessage& w) { ref(w.mutable_rank_started()->mutable_ref()); });
  ASSERT_TRUE(WaitFor([&] { return Get(*id).state() == v1::JOB_STATE_RUNNING; }));

  store_->FailWrites(true);
  report([&](v1::WorkerMessage& w) {
    ref(w.mutable_rank_exit()->mutable_ref());
    w.mutable_rank_exit()->set_exit_code(0);
  });
  ASSERT_TRUE(WaitFor([&] { return Metric("spindle_store_errors_total") >= 1; }));
  EXPECT_TRUE(WaitFor([&] {
    absl::StatusOr<ServingStatus> h = Health();
    return h.ok() && *h == ServingStatus::kNotServing;
  }));
  // Not stored, so not shown: the job is as the store holds it.
  EXPECT_EQ(Get(*id).state(), v1::JOB_STATE_RUNNING);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_GE(Metric("spindle_store_errors_total"), 2);  // tried again at each tick

  store_->FailWrites(false);
  EXPECT_TRUE(WaitFor([&] { return Get(*id).state() == v1::JOB_STATE_SUCCEEDED; }))
      << Get(*id).message();
  EXPECT_EQ(Get(*id).message(), "all 1 ranks finished");
  EXPECT_TRUE(WaitFor([&] {
    absl::StatusOr<ServingStatus> h = Health();
    return h.ok() && *h == ServingStatus::kServing;
  }));
  ctx.TryCancel();
}

}  // namespace
}  // namespace spindle
