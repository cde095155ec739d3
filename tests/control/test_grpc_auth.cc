// Bearer-token authentication over real gRPC on 127.0.0.1: every service rejects calls without
// the token (or with a wrong one) with UNAUTHENTICATED; the right token passes; health stays open.
#include <memory>

#include "coordinator/auth.h"
#include "coordinator/coordinator_server.h"
#include "coordinator/credentials.h"
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

// Users and workers with tokens of their own (--token_file, --worker_token_file): neither
// opens the other's services, a worker token bound to a worker id speaks for that worker only,
// and rendezvous keys are written once and read only with the attempt's token.
class WorkerTokenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorConfig cfg;
    cfg.listen = "127.0.0.1:0";
    cfg.db_path = dir_.File("workers.db");
    cfg.token = "user-token";
    auto tokens = ParseWorkerTokens("# workers\ncluster-token\nw1 w1-token\n\n");
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    cfg.worker_tokens = *tokens;
    auto s = CoordinatorServer::Start(cfg);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->client_port()),
                                   grpc::InsecureChannelCredentials());
  }
  static void Bearer(grpc::ClientContext* ctx, const std::string& token) {
    ctx->AddMetadata("authorization", "Bearer " + token);
  }
  grpc::Status Register(const std::string& token, const std::string& worker_id) {
    grpc::ClientContext ctx;
    Bearer(&ctx, token);
    v1::RegisterRequest req;
    req.set_worker_id(worker_id);
    req.set_hostname("h");
    req.set_instance_id("i1");
    auto* d = req.add_devices();
    d->set_kind("cpu");
    d->set_count(1);
    d->set_memory_bytes(int64_t{1} << 30);
    v1::RegisterResponse resp;
    return v1::ClusterService::NewStub(channel_)->Register(&ctx, req, &resp);
  }
  grpc::Status Session(const std::string& token, const std::string& worker_id) {
    grpc::ClientContext ctx;
    Bearer(&ctx, token);
    auto stream = v1::ClusterService::NewStub(channel_)->Session(&ctx);
    v1::WorkerMessage hello;
    hello.mutable_hello()->set_worker_id(worker_id);
    hello.mutable_hello()->set_instance_id("other-instance");
    stream->Write(hello);
    stream->WritesDone();
    v1::CoordinatorMessage m;
    while (stream->Read(&m)) {
    }
    return stream->Finish();
  }
  grpc::Status Set(const std::string& token, const std::string& attempt_token,
                   const std::string& value) {
    grpc::ClientContext ctx;
    Bearer(&ctx, token);
    v1::SetRequest req;
    req.mutable_scope()->set_job_id("j-000001");
    req.mutable_scope()->set_attempt(1);
    req.mutable_scope()->set_token(attempt_token);
    req.set_key("nccl_id");
    req.set_value(value);
    v1::SetResponse resp;
    return v1::RendezvousService::NewStub(channel_)->Set(&ctx, req, &resp);
  }
  grpc::Status Get(const std::string& token, const std::string& attempt_token) {
    grpc::ClientContext ctx;
    Bearer(&ctx, token);
    v1::GetRequest req;
    req.mutable_scope()->set_job_id("j-000001");
    req.mutable_scope()->set_attempt(1);
    req.mutable_scope()->set_token(attempt_token);
    req.set_key("nccl_id");
    v1::GetResponse resp;
    return v1::RendezvousService::NewStub(channel_)->Get(&ctx, req, &resp);
  }

  testing::TempDir dir_;
  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(WorkerTokenTest, UserTokenCannotSpeakForWorkers) {
  const std::string refused =
      "the users' token cannot call ClusterService or RendezvousService; workers and their "
      "trainers need a worker token (--worker-token-file)";
  grpc::Status st = Register("user-token", "w1");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(st.error_message(), refused);
  st = Session("user-token", "w1");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(st.error_message(), refused);
  st = Set("user-token", "t", "v");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(st.error_message(), refused);
  st = Get("user-token", "t");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(st.error_message(), refused);
  // `spindle workers` stays readable to users.
  grpc::ClientContext ctx;
  Bearer(&ctx, "user-token");
  v1::ListWorkersResponse workers;
  EXPECT_TRUE(v1::ClusterService::NewStub(channel_)
                  ->ListWorkers(&ctx, v1::ListWorkersRequest(), &workers)
                  .ok());
}

TEST_F(WorkerTokenTest, WorkerTokenCannotSubmitOrCancel) {
  auto jobs = v1::JobService::NewStub(channel_);
  const std::string refused =
      "a worker token cannot call JobService (submit, cancel, list jobs); use a user's token";
  for (const std::string token : {"cluster-token", "w1-token"}) {
    {
      grpc::ClientContext ctx;
      Bearer(&ctx, token);
      v1::SubmitJobRequest req;
      req.set_spec_json(testing::SpecJson(1, 1));
      v1::SubmitJobResponse resp;
      grpc::Status st = jobs->Submit(&ctx, req, &resp);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
      EXPECT_EQ(st.error_message(), refused);
    }
    {
      grpc::ClientContext ctx;
      Bearer(&ctx, token);
      v1::CancelJobRequest req;
      req.set_job_id("j-000001");
      v1::CancelJobResponse resp;
      grpc::Status st = jobs->Cancel(&ctx, req, &resp);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
      EXPECT_EQ(st.error_message(), refused);
    }
  }
  EXPECT_TRUE(server_->manager()->ListJobs({}, 10).empty());
}

TEST_F(WorkerTokenTest, BoundWorkerTokenSpeaksForItsWorkerOnly) {
  EXPECT_TRUE(Register("w1-token", "w1").ok());
  EXPECT_TRUE(Register("cluster-token", "w2").ok());
  grpc::Status st = Register("w1-token", "w2");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(st.error_message(), "this worker token belongs to worker w1, not to worker w2");
  st = Session("w1-token", "w2");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(st.error_message(), "this worker token belongs to worker w1, not to worker w2");
  // With the right token, but from another daemon instance than the one that registered.
  st = Session("w1-token", "w1");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(st.error_message(),
            "worker w1 was registered by another daemon instance; a session must come from the "
            "daemon that registered it");
  st = Register("not-a-token", "w1");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(st.error_message(), "invalid bearer token");
}

TEST_F(WorkerTokenTest, RendezvousKeysAreWrittenOnceAndReadByTheAttemptOnly) {
  server_->rendezvous()->Open("j-000001", 1, "attempt-secret");
  EXPECT_TRUE(Set("cluster-token", "attempt-secret", "id-1").ok());
  EXPECT_TRUE(Set("w1-token", "attempt-secret", "id-1").ok()) << "a retry of the same value";
  grpc::Status st = Set("cluster-token", "attempt-secret", "id-2");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(st.error_message(),
            "rendezvous: key \"nccl_id\" of job j-000001 attempt 1 is already set; keys are "
            "written once");
  EXPECT_TRUE(Get("cluster-token", "attempt-secret").ok());
  st = Get("cluster-token", "another-attempt's-secret");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(st.error_message(), "rendezvous: wrong token for job j-000001 attempt 1");
}

TEST(WorkerTokensTest, ParseTheFile) {
  auto t = ParseWorkerTokens("a\n  w1\tb  \n# c\n");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0].worker_id, "");
  EXPECT_EQ((*t)[0].token, "a");
  EXPECT_EQ((*t)[1].worker_id, "w1");
  EXPECT_EQ((*t)[1].token, "b");
  EXPECT_EQ(ParseWorkerTokens("a b c\n").status().message(),
            "line 1 has 3 fields; expected TOKEN or WORKER_ID TOKEN");
  EXPECT_EQ(ParseWorkerTokens("a\nw1 a\n").status().message(),
            "line 2 repeats a token of an earlier line");
  EXPECT_EQ(ParseWorkerTokens("# none\n").status().message(), "no token in it");
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
