// ClusterService.Session through gRPC's in-process transport, where a server's Write completes
// only once the client reads: a worker that half-closes its stream and never reads what is queued
// for it is cut off within the stream write timeout, and the worker is then disconnected, not
// holding the handler and its session for as long as its connection lives.
#include <chrono>
#include <memory>
#include <string>

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

TEST(SessionStreamTest, AWorkerThatHalfClosesAndDoesNotReadIsCutOffWithinTheWriteTimeout) {
  testing::TempDir dir;
  auto store = SqliteJobStore::Open(dir.File("session.db"));
  ASSERT_TRUE(store.ok()) << store.status();
  FakeClock clock;
  RendezvousStore rendezvous;
  SessionRegistry sessions;
  const Credentials auth("", {});
  JobManagerOptions options;
  options.rendezvous_address = "127.0.0.1:1";
  JobManager manager(store->get(), &clock, &sessions, &rendezvous, options);
  ASSERT_TRUE(manager.Recover().ok());
  ServiceLimits limits;
  limits.stream_write_timeout_ms = 500;
  ClusterServiceImpl cluster(&manager, &sessions, &auth, /*accepts_workers=*/true, limits);
  grpc::ServerBuilder builder;
  builder.RegisterService(&cluster);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = v1::ClusterService::NewStub(server->InProcessChannel(grpc::ChannelArguments()));

  v1::RegisterRequest reg;
  reg.set_worker_id("w1");
  reg.set_hostname("w1.local");
  v1::DeviceGroup* d = reg.add_devices();
  d->set_kind("cpu");
  d->set_count(1);
  d->set_memory_bytes(int64_t{8} << 30);
  ASSERT_TRUE(manager.RegisterWorker(RegistrationFromProto(reg, "127.0.0.1")).ok());

  grpc::ClientContext ctx;
  // Only a bound for the test itself: the coordinator must end the stream well before it.
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto stream = stub->Session(&ctx);
  v1::WorkerMessage hello;
  hello.mutable_hello()->set_worker_id("w1");
  ASSERT_TRUE(stream->Write(hello));
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
  std::string state;
  for (const absl::Time until = absl::Now() + absl::Seconds(5); absl::Now() < until;
       absl::SleepFor(absl::Milliseconds(10))) {
    ASSERT_EQ(manager.ListWorkers().size(), 1u);
    if ((state = manager.ListWorkers()[0].state) == "disconnected") break;
  }
  EXPECT_EQ(state, "disconnected");
  server->Shutdown();
}

}  // namespace
}  // namespace spindle
