// RendezvousStore (the trainer's KvStore) against an in-process RendezvousService on 127.0.0.1:
// scope and tokens on every call, waiting Gets, exact error codes, and riding out a coordinator
// restart.
#include "worker/rendezvous_store.h"

#include <stdlib.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "spindle/v1/rendezvous.grpc.pb.h"
#include "tests/integration/fake_coordinator.h"
#include "tests/integration/worker_test_util.h"

namespace spindle {
namespace {

using ::spindle::testing::LoopbackServer;
using ::spindle::testing::ScratchDir;
using ::testing::HasSubstr;

// Keys per (job, attempt); only attempt 1 of job "j-1" with token "tok" and bearer "s3cret" is live.
class FakeRendezvous : public v1::RendezvousService::Service {
 public:
  grpc::Status Set(grpc::ServerContext* context, const v1::SetRequest* request,
                   v1::SetResponse*) override {
    if (grpc::Status s = Check(context, request->scope()); !s.ok()) return s;
    absl::MutexLock lock(&mu_);
    values_[request->key()] = request->value();
    return grpc::Status::OK;
  }
  grpc::Status Get(grpc::ServerContext* context, const v1::GetRequest* request,
                   v1::GetResponse* response) override {
    if (grpc::Status s = Check(context, request->scope()); !s.ok()) return s;
    absl::MutexLock lock(&mu_);
    auto present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return values_.contains(request->key());
    };
    if (request->wait_timeout_ms() > 0) {
      mu_.AwaitWithTimeout(absl::Condition(&present),
                           absl::Milliseconds(request->wait_timeout_ms()));
    }
    if (!present()) {
      return request->wait_timeout_ms() > 0
                 ? grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                "key \"" + request->key() + "\" was not set in time")
                 : grpc::Status(grpc::StatusCode::NOT_FOUND, "no key \"" + request->key() + "\"");
    }
    response->set_value(values_[request->key()]);
    return grpc::Status::OK;
  }

 private:
  grpc::Status Check(grpc::ServerContext* context, const v1::RendezvousScope& scope) {
    auto auth = context->client_metadata().find("authorization");
    if (auth == context->client_metadata().end() ||
        std::string(auth->second.data(), auth->second.size()) != "Bearer s3cret") {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or bad bearer token");
    }
    if (scope.job_id() != "j-1" || scope.attempt() != 1) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("job ", scope.job_id(), " attempt ", scope.attempt(),
                                       " is not running"));
    }
    if (scope.token() != "tok") {
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "bad rendezvous token");
    }
    return grpc::Status::OK;
  }

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

RendezvousOptions Options(const std::string& address) {
  RendezvousOptions o;
  o.address = address;
  o.job_id = "j-1";
  o.attempt = 1;
  o.rendezvous_token = "tok";
  o.bearer_token = "s3cret";
  return o;
}

TEST(RendezvousStoreTest, SetThenGetAndWaitingGet) {
  FakeRendezvous service;
  LoopbackServer server({&service});
  ASSERT_TRUE(server.ok());
  auto store = RendezvousStore::Connect(Options(server.address()));
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->Set("nccl_id", std::string("\x00\x01\xff", 3)).ok());
  absl::StatusOr<std::string> v = (*store)->Get("nccl_id", absl::Seconds(1));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, std::string("\x00\x01\xff", 3));

  // A Get that waits for a later Set by another rank.
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto other = RendezvousStore::Connect(Options(server.address()));
    ASSERT_TRUE(other.ok());
    ASSERT_TRUE((*other)->Set("rank1", "addr1").ok());
  });
  v = (*store)->Get("rank1", absl::Seconds(5));
  setter.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "addr1");
}

TEST(RendezvousStoreTest, ErrorsKeepTheirCodesAndNameTheKey) {
  FakeRendezvous service;
  LoopbackServer server({&service});
  ASSERT_TRUE(server.ok());
  auto store = RendezvousStore::Connect(Options(server.address()));
  ASSERT_TRUE(store.ok());
  // Never set: DEADLINE_EXCEEDED after the timeout, naming the key.
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::string> v = (*store)->Get("missing", absl::Milliseconds(400));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(350));
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("\"missing\""));
  // Zero timeout: NOT_FOUND at once.
  EXPECT_EQ((*store)->Get("missing", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kNotFound);

  RendezvousOptions wrong_token = Options(server.address());
  wrong_token.rendezvous_token = "nope";
  auto bad = RendezvousStore::Connect(wrong_token);
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ((*bad)->Set("k", "v").code(), absl::StatusCode::kPermissionDenied);

  RendezvousOptions old_attempt = Options(server.address());
  old_attempt.attempt = 2;
  auto stale = RendezvousStore::Connect(old_attempt);
  ASSERT_TRUE(stale.ok());
  absl::Status s = (*stale)->Set("k", "v");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "rendezvous Set(\"k\"): job j-1 attempt 2 is not running");

  RendezvousOptions no_bearer = Options(server.address());
  no_bearer.bearer_token.clear();
  auto anon = RendezvousStore::Connect(no_bearer);
  ASSERT_TRUE(anon.ok());
  EXPECT_EQ((*anon)->Get("k", absl::Seconds(1)).status().code(),
            absl::StatusCode::kUnauthenticated);

  RendezvousOptions empty;
  EXPECT_EQ(RendezvousStore::Connect(empty).status().message(), "rendezvous: address is empty");
}

TEST(RendezvousStoreTest, BearerTokenFileAndTrainerEnvironment) {
  FakeRendezvous service;
  LoopbackServer server({&service});
  ASSERT_TRUE(server.ok());
  ScratchDir dir;
  { std::ofstream(dir.File("token")) << "  s3cret\n"; }
  ::setenv("SPINDLE_RENDEZVOUS_TOKEN", "tok", 1);
  RendezvousOptions o;
  o.address = server.address();
  o.job_id = "j-1";
  o.attempt = 1;
  o.bearer_token_file = dir.File("token");
  auto store = RendezvousStore::Connect(WithTrainerEnvironment(o));
  ::unsetenv("SPINDLE_RENDEZVOUS_TOKEN");
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE((*store)->Set("a", "b").ok());
  o.bearer_token_file = dir.File("missing");
  EXPECT_EQ(RendezvousStore::Connect(o).status().code(), absl::StatusCode::kNotFound);
}

TEST(RendezvousStoreTest, GetRidesOutACoordinatorRestart) {
  auto service = std::make_unique<FakeRendezvous>();
  auto server = std::make_unique<LoopbackServer>(std::vector<grpc::Service*>{service.get()});
  ASSERT_TRUE(server->ok());
  const int port = server->port();
  auto store = RendezvousStore::Connect(Options(server->address()));
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Set("warm", "up").ok());
  server->Shutdown();
  // The coordinator comes back 1 s later (state lost, as the rendezvous namespace is rebuilt)
  // and a peer sets the key; the waiting Get sees it.
  FakeRendezvous service2;
  std::unique_ptr<LoopbackServer> server2;
  std::thread restart([&] {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    server2 = std::make_unique<LoopbackServer>(std::vector<grpc::Service*>{&service2}, port);
    auto peer = RendezvousStore::Connect(Options(server2->address()));
    ASSERT_TRUE(peer.ok());
    ASSERT_TRUE((*peer)->Set("after", "restart").ok());
  });
  absl::StatusOr<std::string> v = (*store)->Get("after", absl::Seconds(15));
  restart.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "restart");
}

}  // namespace
}  // namespace spindle
