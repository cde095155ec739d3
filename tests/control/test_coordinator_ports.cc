// CoordinatorServer with a separate worker port, over real gRPC on 127.0.0.1: clients get
// JobService and ClusterService.ListWorkers on the client port (so `spindle workers` works),
// workers get Register/Session/Rendezvous on the worker port only, and a worker that dials the
// client port is told which port to use.
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "coordinator/coordinator_server.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "spindle/v1/cluster.grpc.pb.h"
#include "spindle/v1/job.grpc.pb.h"
#include "spindle/v1/rendezvous.grpc.pb.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

class CoordinatorPortsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorConfig cfg;
    cfg.listen = "127.0.0.1:0";
    cfg.worker_listen = "127.0.0.1:0";
    cfg.db_path = dir_.File("ports.db");
    auto s = CoordinatorServer::Start(cfg);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    ASSERT_NE(server_->client_port(), server_->worker_port());
    client_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->client_port()),
                                  grpc::InsecureChannelCredentials());
    worker_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->worker_port()),
                                  grpc::InsecureChannelCredentials());
  }

  static v1::RegisterRequest Registration() {
    v1::RegisterRequest req;
    req.set_worker_id("w1");
    req.set_hostname("localhost");
    v1::DeviceGroup* g = req.add_devices();
    g->set_kind("cpu");
    g->set_count(2);
    g->set_name("cpu");
    return req;
  }

  testing::TempDir dir_;
  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> client_;
  std::shared_ptr<grpc::Channel> worker_;
};

TEST_F(CoordinatorPortsTest, WorkersRegisterOnTheWorkerPortAndClientsListThemOnTheClientPort) {
  {
    grpc::ClientContext ctx;
    v1::RegisterResponse resp;
    grpc::Status st = v1::ClusterService::NewStub(worker_)->Register(&ctx, Registration(), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  grpc::ClientContext ctx;
  v1::ListWorkersResponse resp;
  grpc::Status st =
      v1::ClusterService::NewStub(client_)->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(resp.workers_size(), 1);
  EXPECT_EQ(resp.workers(0).worker_id(), "w1");
  EXPECT_EQ(resp.workers(0).slots(), 2);
}

TEST_F(CoordinatorPortsTest, TheClientPortRefusesWorkersWithTheReason) {
  const std::string want =
      "this is the coordinator's client port; workers connect to its worker port "
      "(--worker_listen)";
  {
    grpc::ClientContext ctx;
    v1::RegisterResponse resp;
    grpc::Status st = v1::ClusterService::NewStub(client_)->Register(&ctx, Registration(), &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(st.error_message(), want);
  }
  {
    grpc::ClientContext ctx;
    auto stream = v1::ClusterService::NewStub(client_)->Session(&ctx);
    v1::WorkerMessage hello;
    hello.mutable_hello()->set_worker_id("w1");
    stream->Write(hello);
    stream->WritesDone();
    v1::CoordinatorMessage m;
    while (stream->Read(&m)) {
    }
    grpc::Status st = stream->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(st.error_message(), want);
  }
  {
    // The rendezvous is not served on the client port at all.
    grpc::ClientContext ctx;
    v1::SetRequest req;
    req.set_key("k");
    v1::SetResponse resp;
    EXPECT_EQ(v1::RendezvousService::NewStub(client_)->Set(&ctx, req, &resp).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
  {
    // And jobs are not served on the worker port.
    grpc::ClientContext ctx;
    v1::ListJobsResponse resp;
    EXPECT_EQ(
        v1::JobService::NewStub(worker_)->List(&ctx, v1::ListJobsRequest(), &resp).error_code(),
        grpc::StatusCode::UNIMPLEMENTED);
  }
}

// A second coordinator (its own store) on a port the first holds is refused instead of sharing
// the port: gRPC's default SO_REUSEPORT would have let both bind and split the connections.
TEST_F(CoordinatorPortsTest, ASecondCoordinatorOnATakenPortIsRefused) {
  for (const bool worker_port : {false, true}) {
    CoordinatorConfig cfg;
    const std::string taken =
        absl::StrCat("127.0.0.1:", worker_port ? server_->worker_port() : server_->client_port());
    cfg.listen = worker_port ? "127.0.0.1:0" : taken;
    cfg.worker_listen = worker_port ? taken : "127.0.0.1:0";
    cfg.db_path = dir_.File(worker_port ? "second-w.db" : "second-c.db");
    auto second = CoordinatorServer::Start(cfg);
    ASSERT_FALSE(second.ok()) << taken;
    EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(second.status().message(),
              "cannot listen on " + taken +
                  " (it is taken, is not HOST:PORT, or is not an address of this host)");
    // It leaves no store of its own behind.
    for (const char* suffix : {"", "-wal", "-shm", ".lock"})
      EXPECT_FALSE(std::filesystem::exists(cfg.db_path + suffix)) << cfg.db_path << suffix;
  }
  // The first one still answers its clients.
  grpc::ClientContext ctx;
  v1::ListWorkersResponse resp;
  const grpc::Status st =
      v1::ClusterService::NewStub(client_)->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
}

}  // namespace
}  // namespace spindle
