// The coordinator's bounds at the transport (real gRPC on 127.0.0.1, an in-process coordinator):
// List pages, Watch clamps its update interval both ways, ends a stream the client cancels and
// caps concurrent streams; rendezvous Get stops waiting for a cancelled call and waits at most
// its bound; an attempt's rendezvous keys are capped; a Submit's request id passes through.
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "coordinator/coordinator_server.h"
#include "coordinator/worker_proto.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "spindle/v1/cluster.pb.h"
#include "spindle/v1/job.grpc.pb.h"
#include "spindle/v1/rendezvous.grpc.pb.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

using testing::SpecJson;
using testing::WithCheckpointDir;

class ServiceLimitsTest : public ::testing::Test {
 protected:
  void Start(ServiceLimits limits = {}) {
    CoordinatorConfig cfg;
    cfg.listen = "127.0.0.1:0";
    cfg.db_path = dir_.File("limits.db");
    cfg.manager.heartbeat_timeout_ms = 60000;
    cfg.limits = limits;
    auto s = CoordinatorServer::Start(cfg);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->client_port()),
                                   grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel_);
  }
  void TearDown() override {
    stop_progress_ = true;
    if (progress_.joinable()) progress_.join();
  }

  // A job running on a one-slot worker "w1" that reports progress every `every` from now on.
  std::string RunningJob(std::chrono::milliseconds every) {
    JobManager* m = server_->manager();
    EXPECT_TRUE(m->RegisterWorker(RegistrationFromProto(
                                      testing::OneCpuSlotWorker("w1", "w1.local"), "127.0.0.1"))
                    .ok());
    v1::SessionHello hello;
    hello.set_worker_id("w1");
    EXPECT_TRUE(testing::OpenSession(*m, hello, 1).ok());
    auto id = m->Submit(SpecJson(), nullptr);
    EXPECT_TRUE(id.ok()) << id.status();
    v1::WorkerMessage started;
    v1::RankRef* ref = started.mutable_rank_started()->mutable_ref();
    ref->set_job_id(*id);
    ref->set_attempt(1);
    testing::Deliver(*m, "w1", started);
    progress_ = std::thread([this, m, job = *id, every] {
      for (int64_t step = 1; !stop_progress_; ++step) {
        v1::WorkerMessage p;
        p.mutable_rank_progress()->mutable_ref()->set_job_id(job);
        p.mutable_rank_progress()->mutable_ref()->set_attempt(1);
        p.mutable_rank_progress()->set_step(step % 9 + 1);
        p.mutable_rank_progress()->set_total_steps(10);
        testing::Deliver(*m, "w1", p);
        std::this_thread::sleep_for(every);
      }
    });
    return *id;
  }

  // Reads updates until one shows the job RUNNING at a step, so the stream's next progress
  // update waits for the interval; false when the stream ended first.
  static bool ReadUntilProgress(grpc::ClientReader<v1::JobUpdate>* r) {
    v1::JobUpdate u;
    while (r->Read(&u))
      if (u.job().state() == v1::JOB_STATE_RUNNING && u.job().step() > 0) return true;
    return false;
  }

  testing::TempDir dir_;
  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::atomic<bool> stop_progress_{false};
  std::thread progress_;
};

TEST_F(ServiceLimitsTest, ListPagesAtTheDefaultPageSize) {
  Start();
  for (int i = 0; i < 130; ++i)
    ASSERT_TRUE(server_->manager()
                    ->Submit(WithCheckpointDir(SpecJson(), absl::StrCat("/tmp/ck-", i)), nullptr)
                    .ok());
  v1::ListJobsRequest req;
  v1::ListJobsResponse first, second;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(jobs_->List(&ctx, req, &first).ok());
  }
  EXPECT_EQ(first.jobs_size(), 100);
  EXPECT_EQ(first.jobs(0).job_id(), "j-000130");
  ASSERT_FALSE(first.next_page_token().empty());
  req.set_page_token(first.next_page_token());
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(jobs_->List(&ctx, req, &second).ok());
  }
  EXPECT_EQ(second.jobs_size(), 30);
  EXPECT_EQ(second.jobs(29).job_id(), "j-000001");
  EXPECT_TRUE(second.next_page_token().empty());

  v1::ListJobsRequest bad;
  bad.set_page_size(-5);
  v1::ListJobsResponse resp;
  grpc::ClientContext ctx;
  grpc::Status st = jobs_->List(&ctx, bad, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message(), "list: page_size must not be negative, got -5");
}

TEST_F(ServiceLimitsTest, SubmitWithARequestIdTwiceIsOneJob) {
  Start();
  v1::SubmitJobRequest req;
  req.set_spec_json(SpecJson());
  req.set_request_id("cli-0123456789abcdef");
  v1::SubmitJobResponse a, b;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(jobs_->Submit(&ctx, req, &a).ok());
  }
  grpc::ClientContext ctx;
  ASSERT_TRUE(jobs_->Submit(&ctx, req, &b).ok());
  EXPECT_EQ(a.job_id(), b.job_id());
  EXPECT_EQ(server_->manager()->ListJobs({}, 0).size(), 1u);
}

TEST_F(ServiceLimitsTest, WatchUpdatesAtMostEveryMinimumInterval) {
  Start();  // min_watch_interval_ms = 100
  const std::string id = RunningJob(std::chrono::milliseconds(2));
  v1::WatchJobRequest req;
  req.set_job_id(id);
  req.set_min_interval_ms(1);  // would be 1000 updates a second
  grpc::ClientContext ctx;
  auto reader = jobs_->Watch(&ctx, req);
  ASSERT_TRUE(ReadUntilProgress(reader.get()));
  int updates = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1000);
  v1::JobUpdate u;
  while (std::chrono::steady_clock::now() < until && reader->Read(&u)) ++updates;
  ctx.TryCancel();
  reader->Finish().IgnoreError();
  EXPECT_GE(updates, 3);
  EXPECT_LE(updates, 12);
}

TEST_F(ServiceLimitsTest, WatchUpdatesAtLeastEveryMaximumInterval) {
  ServiceLimits limits;
  limits.max_watch_interval_ms = 300;
  Start(limits);
  const std::string id = RunningJob(std::chrono::milliseconds(20));
  v1::WatchJobRequest req;
  req.set_job_id(id);
  req.set_min_interval_ms(3'600'000);  // an hour
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto reader = jobs_->Watch(&ctx, req);
  ASSERT_TRUE(ReadUntilProgress(reader.get()));
  const auto t0 = std::chrono::steady_clock::now();
  v1::JobUpdate u;
  ASSERT_TRUE(reader->Read(&u));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  ctx.TryCancel();
  reader->Finish().IgnoreError();
}

TEST_F(ServiceLimitsTest, ACancelledWatchEndsAndStreamsAreCapped) {
  ServiceLimits limits;
  limits.max_watch_streams = 1;
  limits.max_watch_interval_ms = 60000;
  Start(limits);
  const std::string id = RunningJob(std::chrono::milliseconds(20));
  v1::WatchJobRequest req;
  req.set_job_id(id);
  req.set_min_interval_ms(60000);
  auto first = std::make_unique<grpc::ClientContext>();
  auto reader = jobs_->Watch(first.get(), req);
  ASSERT_TRUE(ReadUntilProgress(reader.get()));  // the server now pauses up to a minute

  {
    grpc::ClientContext ctx;
    auto second = jobs_->Watch(&ctx, req);
    v1::JobUpdate u;
    EXPECT_FALSE(second->Read(&u));
    grpc::Status st = second->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_EQ(st.error_message(),
              "watch: the coordinator already serves 1 watch streams, its limit "
              "(--max-watch-streams); retry later");
  }

  first->TryCancel();
  reader->Finish().IgnoreError();
  // The cancelled stream's slot is free within a moment, not after the minute.
  bool watched = false;
  for (int i = 0; i < 30 && !watched; ++i) {
    grpc::ClientContext ctx;
    auto again = jobs_->Watch(&ctx, req);
    v1::JobUpdate u;
    watched = again->Read(&u);
    ctx.TryCancel();
    again->Finish().IgnoreError();
    if (!watched) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(watched);

  grpc::ClientContext ctx;
  v1::WatchJobRequest negative;
  negative.set_job_id(id);
  negative.set_min_interval_ms(-1);
  auto r = jobs_->Watch(&ctx, negative);
  v1::JobUpdate u;
  EXPECT_FALSE(r->Read(&u));
  grpc::Status st = r->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message(), "watch: min_interval_ms must not be negative, got -1");
}

TEST_F(ServiceLimitsTest, RendezvousGetStopsForACancelledCallAndWaitsAtMostItsBound) {
  ServiceLimits limits;
  limits.max_rendezvous_wait_ms = 300;
  limits.max_rendezvous_keys = 1;
  Start(limits);
  auto rdzv = v1::RendezvousService::NewStub(channel_);
  server_->rendezvous()->Open("j-000009", 1, "tok");
  v1::GetRequest get;
  get.mutable_scope()->set_job_id("j-000009");
  get.mutable_scope()->set_attempt(1);
  get.mutable_scope()->set_token("tok");
  get.set_key("never");
  get.set_wait_timeout_ms(3'600'000);

  // An hour asked, 300 ms waited.
  {
    grpc::ClientContext ctx;
    v1::GetResponse resp;
    const auto t0 = std::chrono::steady_clock::now();
    grpc::Status st = rdzv->Get(&ctx, get, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_EQ(st.error_message(), "rendezvous: key \"never\" was not set within 300ms");
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  }

  // A cancelled call stops waiting on the server.
  server_.reset();
  limits.max_rendezvous_wait_ms = 60000;
  Start(limits);
  rdzv = v1::RendezvousService::NewStub(channel_);
  server_->rendezvous()->Open("j-000009", 1, "tok");
  grpc::ClientContext ctx;
  std::thread call([&] {
    v1::GetResponse resp;
    EXPECT_EQ(rdzv->Get(&ctx, get, &resp).error_code(), grpc::StatusCode::CANCELLED);
  });
  auto waiting = [&](size_t n) {
    for (int i = 0; i < 100; ++i) {
      if (server_->rendezvous()->NumWaiting() == n) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  };
  EXPECT_TRUE(waiting(1));
  ctx.TryCancel();
  call.join();
  EXPECT_TRUE(waiting(0));

  // One key per attempt here: a second is refused, naming the limit.
  v1::SetRequest set;
  *set.mutable_scope() = get.scope();
  set.set_key("a");
  v1::SetResponse sresp;
  {
    grpc::ClientContext c;
    ASSERT_TRUE(rdzv->Set(&c, set, &sresp).ok());
  }
  set.set_key("b");
  grpc::ClientContext c;
  grpc::Status st = rdzv->Set(&c, set, &sresp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(st.error_message(),
            "rendezvous: job j-000009 attempt 1 already holds 1 keys, the coordinator's limit "
            "per attempt (--max-rendezvous-keys)");
}

}  // namespace
}  // namespace spindle
