// Bearer-token authentication over real gRPC on 127.0.0.1: every service rejects calls without
// the token (or with a wrong one) with UNAUTHENTICATED; the right token passes; health stays open.
#include <memory>

#include "coordinator/auth.h"
#include "coordinator/coordinator_server.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "spindle/v1/cluster.grpc.pb.h"
#include "spindle/v1/job.grpc.pb.h"
#include "spindle/v1/rendezvous.grpc.pb.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorConfig cfg;
    cfg.listen = "127.0.0.1:0";
    cfg.db_path = dir_.File("auth.db");
    cfg.token = "s3cret-token";
    auto s = CoordinatorServer::Start(cfg);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->client_port()),
                                   grpc::InsecureChannelCredentials());
  }

  void Auth(grpc::ClientContext* ctx, const std::string& header) {
    if (!header.empty()) ctx->AddMetadata("authorization", header);
  }

  testing::TempDir dir_;
  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(AuthTest, EveryServiceRequiresTheToken) {
  auto jobs = v1::JobService::NewStub(channel_);
  auto cluster = v1::ClusterService::NewStub(channel_);
  auto rdzv = v1::RendezvousService::NewStub(channel_);
  struct Case {
    std::string header;
    grpc::StatusCode want;
    std::string message;
  };
  const Case cases[] = {
      {"", grpc::StatusCode::UNAUTHENTICATED,
       "missing authorization metadata (expected \"Bearer <token>\")"},
      {"Bearer wrong", grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token"},
      {"s3cret-token", grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token"},
      {"Bearer s3cret-token", grpc::StatusCode::OK, ""},
  };
  for (const Case& c : cases) {
    {
      grpc::ClientContext ctx;
      Auth(&ctx, c.header);
      v1::ListJobsResponse resp;
      grpc::Status st = jobs->List(&ctx, v1::ListJobsRequest(), &resp);
      EXPECT_EQ(st.error_code(), c.want) << c.header;
      EXPECT_EQ(st.error_message(), c.message);
    }
    {
      grpc::ClientContext ctx;
      Auth(&ctx, c.header);
      v1::ListWorkersResponse resp;
      EXPECT_EQ(cluster->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).error_code(), c.want);
    }
    {
      grpc::ClientContext ctx;
      Auth(&ctx, c.header);
      v1::SetRequest req;
      req.mutable_scope()->set_job_id("j-000001");
      req.mutable_scope()->set_attempt(1);
      req.set_key("k");
      v1::SetResponse resp;
      grpc::Status st = rdzv->Set(&ctx, req, &resp);
      // With the right token the call reaches the store, which knows no such attempt.
      EXPECT_EQ(st.error_code(), c.want == grpc::StatusCode::OK
                                     ? grpc::StatusCode::FAILED_PRECONDITION
                                     : c.want);
    }
    {
      grpc::ClientContext ctx;
      Auth(&ctx, c.header);
      auto stream = cluster->Session(&ctx);
      v1::WorkerMessage hello;
      hello.mutable_hello()->set_worker_id("nobody");
      stream->Write(hello);
      stream->WritesDone();
      v1::CoordinatorMessage m;
      while (stream->Read(&m)) {
      }
      grpc::Status st = stream->Finish();
      EXPECT_EQ(st.error_code(), c.want == grpc::StatusCode::OK ? grpc::StatusCode::NOT_FOUND
                                                                : c.want);
      if (c.want == grpc::StatusCode::OK)
        EXPECT_EQ(st.error_message(), "worker nobody is not registered; call Register first");
    }
  }
}

TEST_F(AuthTest, HealthServiceStaysOpen) {
  grpc::ClientContext ctx;
  grpc::ByteBuffer resp;
  // grpc.health.v1.Health/Check with an empty request.
  grpc::GenericStub stub(channel_);
  grpc::ByteBuffer req;
  grpc::Slice empty("");
  req = grpc::ByteBuffer(&empty, 1);
  grpc::Status result;
  bool done = false;
  absl::Mutex mu;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                 [&](grpc::Status st) {
                   absl::MutexLock l(&mu);
                   result = st;
                   done = true;
                 });
  absl::MutexLock l(&mu);
  mu.Await(absl::Condition(&done));
  EXPECT_TRUE(result.ok()) << result.error_message();
}

TEST(ConstantTimeEqualsTest, Basics) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

}  // namespace
}  // namespace spindle
