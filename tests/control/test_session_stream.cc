// ClusterService.Session through gRPC's in-process transport, where a server's Write completes
// only once the client reads: a worker that half-closes its stream and never reads what is queued
// for it is cut off within the stream write timeout, and the worker is then disconnected, not
// holding the handler and its session for as long as its connection lives; sessions of one worker
// replacing each other while they end, or opened at once.
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "coordinator/clock.h"
#include "coordinator/credentials.h"
#include "coordinator/grpc_services.h"
#include "coordinator/job_manager.h"
#include "coordinator/rendezvous_store.h"
#include "coordinator/sqlite_job_store.h"
#include "coordinator/worker_proto.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "spindle/v1/cluster.grpc.pb.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

class SessionStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = SqliteJobStore::Open(dir_.File("session.db"));
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    JobManagerOptions options;
    options.rendezvous_address = "127.0.0.1:1";
    manager_ =
        std::make_unique<JobManager>(store_.get(), &clock_, &sessions_, &rendezvous_, options);
    ASSERT_TRUE(manager_->Recover().ok());
    ServiceLimits limits;
    limits.stream_write_timeout_ms = 500;
    cluster_ = std::make_unique<ClusterServiceImpl>(manager_.get(), &sessions_, &auth_,
                                                    /*accepts_workers=*/true, limits);
    grpc::ServerBuilder builder;
    builder.RegisterService(cluster_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::ClusterService::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
    ASSERT_TRUE(manager_
                    ->RegisterWorker(RegistrationFromProto(
                        testing::OneCpuSlotWorker("w1", "w1.local"), "127.0.0.1"))
                    .ok());
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  std::string State() {
    const std::vector<WorkerView> workers = manager_->ListWorkers();
    return workers.size() == 1 ? workers[0].state : "";
  }
  static v1::WorkerMessage Hello() {
    v1::WorkerMessage hello;
    hello.mutable_hello()->set_worker_id("w1");
    return hello;
  }

  testing::TempDir dir_;
  std::unique_ptr<JobStore> store_;
  FakeClock clock_;
  RendezvousStore rendezvous_;
  SessionRegistry sessions_;
  const Credentials auth_{"", {}};
  std::unique_ptr<JobManager> manager_;
  std::unique_ptr<ClusterServiceImpl> cluster_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::ClusterService::Stub> stub_;
};

TEST_F(SessionStreamTest, AWorkerThatHalfClosesAndDoesNotReadIsCutOffWithinTheWriteTimeout) {
  grpc::ClientContext ctx;
  // Only a bound for the test itself: the coordinator must end the stream well before it.
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto stream = stub_->Session(&ctx);
  ASSERT_TRUE(stream->Write(Hello()));
  v1::WorkerMessage heartbeat;
  heartbeat.mutable_heartbeat()->set_seq(1);
  ASSERT_TRUE(stream->Write(heartbeat));  // its acknowledgement is never read
  const absl::Time start = absl::Now();
  ASSERT_TRUE(stream->WritesDone());
  const grpc::Status st = stream->Finish();
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
  EXPECT_LT(took, absl::Seconds(5)) << "the stream ended after " << took;
  // The handler ends right after it cancelled the stream, and closes the worker's session.
  for (const absl::Time until = absl::Now() + absl::Seconds(5);
       State() != "disconnected" && absl::Now() < until;)
    absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(State(), "disconnected");
}

// Sessions of one worker replace each other while the ones replaced end on their own (the worker
// cancels them): a newer session cancels the one it replaces, also when that one's handler is
// returning at the same moment, and never touches a stream whose handler has returned.
TEST_F(SessionStreamTest, SessionsReplacingEachOtherWhileTheyEnd) {
  std::vector<std::thread> workers;
  for (int t = 0; t < 4; ++t) {
    workers.emplace_back([this] {
      for (int i = 0; i < 200; ++i) {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
        auto stream = stub_->Session(&ctx);
        stream->Write(Hello());
        ctx.TryCancel();
        stream->Finish().IgnoreError();
      }
    });
  }
  for (std::thread& t : workers) t.join();
  // Every handler has ended (or ends now): the worker's last session is closed.
  for (const absl::Time until = absl::Now() + absl::Seconds(5);
       State() != "disconnected" && absl::Now() < until;)
    absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(State(), "disconnected");
}

// Two sessions of one worker open at once, again and again: whichever the coordinator takes last
// replaces the other, and is the worker's session for the job manager too (alive while it is
// open), not disconnected when the replaced one's handler ends after it.
TEST_F(SessionStreamTest, OfTwoSessionsOpenedAtOnceTheOneThatStaysIsTheWorkersSession) {
  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> rw;
  };
  for (int i = 0; i < 100; ++i) {
    Stream a, b;
    for (Stream* s : {&a, &b}) {
      s->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
      s->rw = stub_->Session(&s->ctx);
    }
    std::thread open_a([&] { a.rw->Write(Hello()); });
    b.rw->Write(Hello());
    open_a.join();
    auto beat = [](Stream* s, int64_t seq) {
      v1::WorkerMessage heartbeat;
      heartbeat.mutable_heartbeat()->set_seq(seq);
      v1::CoordinatorMessage ack;
      return s->rw->Write(heartbeat) && s->rw->Read(&ack) && ack.has_heartbeat_ack();
    };
    // Once each has answered a heartbeat or ended, both were taken in (and one replaced);
    // then only one answers.
    for (Stream* s : {&a, &b}) beat(s, 1);
    int open = 0;
    for (Stream* s : {&a, &b}) open += beat(s, 2);
    ASSERT_EQ(open, 1) << "iteration " << i;
    // Give the replaced session's handler time to end, then the worker is alive on the other.
    absl::SleepFor(absl::Milliseconds(20));
    ASSERT_EQ(State(), "alive") << "iteration " << i;
    for (Stream* s : {&a, &b}) {
      s->ctx.TryCancel();
      s->rw->Finish().IgnoreError();
    }
  }
}

}  // namespace
}  // namespace spindle
