// Workers are who their certificates say, over real TLS handshakes on 127.0.0.1: a coordinator
// with its CA (the daemon's default) signs a joining worker's request for a bootstrap token, and
// from then on only that certificate opens Register and Session for that worker id. The attacks:
// a certificate of another CA, an expired one, one naming another worker (on Register, and on a
// Session whose hello would replace that worker's live one), no certificate, a revoked one
// (refused again after a restart; the jobs placed on it name the admin who revoked it), bootstrap
// tokens that expired or ran out of joins, a user who is not an admin revoking. Certificates are
// made here with OpenSSL (common/x509.h). ctest labels: control, hostile.
#include <chrono>
#include <memory>
#include <thread>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "common/x509.h"
#include "coordinator/certificate_authority.h"
#include "coordinator/coordinator_server.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "spindle/v1/cluster.grpc.pb.h"
#include "spindle/v1/job.grpc.pb.h"
#include "spindle/v1/rendezvous.grpc.pb.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

constexpr char kToken[] = "bootstrap-token-0123456789";
constexpr char kOneJoin[] = "one-join-token-0123456789";
constexpr char kExpired[] = "expired-token-0123456789";

struct Identity {
  std::string key_pem, cert_pem;
};

class HostileCertificatesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<CertificateAuthority> ca =
        CertificateAuthority::LoadOrCreate(dir_.File("c.db.ca.pem"), dir_.File("c.db.ca-key.pem"));
    ASSERT_TRUE(ca.ok()) << ca.status();
    ca_ = std::make_unique<CertificateAuthority>(*std::move(ca));
    Start();
  }

  void Start() {
    server_.reset();
    CoordinatorConfig cfg;
    cfg.listen = "127.0.0.1:0";
    cfg.db_path = dir_.File("c.db");
    cfg.ca_cert_pem = ca_->cert_pem();
    cfg.ca_key_pem = ca_->key_pem();
    const int64_t now = absl::ToUnixMillis(absl::Now());
    cfg.bootstrap_tokens = {
        {kToken, now + 3'600'000, 0}, {kOneJoin, now + 3'600'000, 1}, {kExpired, now - 1000, 0}};
    cfg.users = {{"root-token", {"root", true}}, {"bob-token", {"bob", false}}};
    auto s = CoordinatorServer::Start(cfg);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }
  std::string Address() const { return absl::StrCat("127.0.0.1:", server_->client_port()); }

  // A TLS channel trusting the coordinator's CA, presenting `id` when given.
  std::shared_ptr<grpc::Channel> Channel(const Identity* id = nullptr) {
    grpc::SslCredentialsOptions opts;
    opts.pem_root_certs = ca_->cert_pem();
    if (id != nullptr) {
      opts.pem_private_key = id->key_pem;
      opts.pem_cert_chain = id->cert_pem;
    }
    grpc::ChannelArguments args;
    args.SetInt("grpc.use_local_subchannel_pool", 1);  // one handshake per channel
    return grpc::CreateCustomChannel(Address(), grpc::SslCredentials(opts), args);
  }
  static void Deadline(grpc::ClientContext* ctx, int seconds = 5) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  }

  // Join as `worker_id` with `token`: a new key, a request, the certificate the CA signs.
  grpc::Status Join(const std::string& token, const std::string& worker_id, Identity* out) {
    out->key_pem = *GeneratePrivateKey();
    v1::JoinRequest req;
    req.set_bootstrap_token(token);
    req.set_csr_pem(*MakeCertificateRequest(out->key_pem, worker_id));
    v1::JoinResponse resp;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    grpc::Status st = v1::ClusterService::NewStub(Channel())->Join(&ctx, req, &resp);
    out->cert_pem = resp.certificate_pem();
    if (st.ok()) EXPECT_EQ(resp.ca_pem(), ca_->cert_pem());
    return st;
  }
  grpc::Status Register(const Identity* id, const std::string& worker_id) {
    v1::RegisterRequest req;
    req.set_worker_id(worker_id);
    req.set_hostname("h-" + worker_id);
    v1::DeviceGroup* d = req.add_devices();
    d->set_kind("cpu");
    d->set_count(1);
    d->set_memory_bytes(int64_t{8} << 30);
    v1::RegisterResponse resp;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    return v1::ClusterService::NewStub(Channel(id))->Register(&ctx, req, &resp);
  }
  grpc::Status Revoke(const std::string& user_token, const std::string& worker_id,
                      int64_t* revoked = nullptr) {
    v1::RevokeWorkerRequest req;
    req.set_worker_id(worker_id);
    v1::RevokeWorkerResponse resp;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    ctx.AddMetadata("authorization", "Bearer " + user_token);
    grpc::Status st = v1::ClusterService::NewStub(Channel())->RevokeWorker(&ctx, req, &resp);
    if (revoked != nullptr) *revoked = resp.certificates_revoked();
    return st;
  }
  // A certificate for `worker_id` signed by `ca`, valid from `not_before` for `validity`.
  static Identity Issue(const CertificateAuthority& ca, const std::string& worker_id,
                        absl::Time not_before, absl::Duration validity) {
    Identity id;
    id.key_pem = *GeneratePrivateKey();
    std::string serial;
    id.cert_pem = *ca.IssueWorkerCertificate(worker_id, *PublicKeyOf(id.key_pem), not_before,
                                             validity, &serial);
    return id;
  }

  testing::TempDir dir_;
  std::unique_ptr<CertificateAuthority> ca_;
  std::unique_ptr<CoordinatorServer> server_;
};

TEST_F(HostileCertificatesTest, AJoinedWorkerRegistersAsItselfOnly) {
  Identity w1;
  grpc::Status joined = Join(kToken, "w1", &w1);
  ASSERT_TRUE(joined.ok()) << joined.error_message();
  grpc::Status own = Register(&w1, "w1");
  EXPECT_TRUE(own.ok()) << own.error_message();

  grpc::Status other = Register(&w1, "w2");
  EXPECT_EQ(other.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(other.error_message(), "this certificate belongs to worker w1, not to worker w2");

  grpc::Status none = Register(nullptr, "w1");
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(none.error_message(),
            "worker calls need the worker's client certificate (a new worker joins with a "
            "bootstrap token first)");

  // An admin's token is no worker's certificate either.
  v1::RegisterRequest req;
  req.set_worker_id("w1");
  v1::RegisterResponse resp;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  ctx.AddMetadata("authorization", "Bearer root-token");
  EXPECT_EQ(v1::ClusterService::NewStub(Channel())->Register(&ctx, req, &resp).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);

  // The rendezvous needs no more than the attempt's own token (none is open here).
  v1::SetRequest set;
  set.mutable_scope()->set_job_id("j-000001");
  set.mutable_scope()->set_attempt(1);
  set.mutable_scope()->set_token("guess");
  set.set_key("k");
  v1::SetResponse set_resp;
  grpc::ClientContext rctx;
  Deadline(&rctx);
  EXPECT_EQ(v1::RendezvousService::NewStub(Channel())->Set(&rctx, set, &set_resp).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

// A session speaks for the worker its certificate names: another worker's certificate can
// neither open a session for it nor, by trying, end the one it has.
TEST_F(HostileCertificatesTest, ACertificateCannotOpenOrKickAnotherWorkersSession) {
  Identity w1, w2;
  ASSERT_TRUE(Join(kToken, "w1", &w1).ok());
  ASSERT_TRUE(Join(kToken, "w2", &w2).ok());
  ASSERT_TRUE(Register(&w2, "w2").ok());
  auto hello = [](const std::string& id) {
    v1::WorkerMessage m;
    m.mutable_hello()->set_worker_id(id);
    return m;
  };
  auto beat = [](int64_t seq) {
    v1::WorkerMessage m;
    m.mutable_heartbeat()->set_seq(seq);
    return m;
  };
  grpc::ClientContext live_ctx;
  Deadline(&live_ctx, 30);
  auto live = v1::ClusterService::NewStub(Channel(&w2))->Session(&live_ctx);
  ASSERT_TRUE(live->Write(hello("w2")));
  ASSERT_TRUE(live->Write(beat(1)));
  v1::CoordinatorMessage ack;
  ASSERT_TRUE(live->Read(&ack));
  EXPECT_EQ(ack.heartbeat_ack().seq(), 1);

  grpc::ClientContext thief_ctx;
  Deadline(&thief_ctx, 10);
  auto thief = v1::ClusterService::NewStub(Channel(&w1))->Session(&thief_ctx);
  thief->Write(hello("w2"));
  thief->Write(beat(1));
  v1::CoordinatorMessage m;
  EXPECT_FALSE(thief->Read(&m));
  const grpc::Status st = thief->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(st.error_message(), "this certificate belongs to worker w1, not to worker w2");

  // w2's session goes on.
  ASSERT_TRUE(live->Write(beat(2)));
  ASSERT_TRUE(live->Read(&ack));
  EXPECT_EQ(ack.heartbeat_ack().seq(), 2);
  live_ctx.TryCancel();
  live->Finish().IgnoreError();
}

TEST_F(HostileCertificatesTest, AnotherCasCertificateFailsTheHandshake) {
  absl::StatusOr<CertificateAuthority> other =
      CertificateAuthority::Create("rogue", absl::Hours(1));
  ASSERT_TRUE(other.ok());
  const Identity rogue = Issue(*other, "w1", absl::Now() - absl::Minutes(1), absl::Hours(1));
  grpc::Status st = Register(&rogue, "w1");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  // The coordinator still serves everyone else.
  Identity w1;
  ASSERT_TRUE(Join(kToken, "w1", &w1).ok());
  EXPECT_TRUE(Register(&w1, "w1").ok());
}

TEST_F(HostileCertificatesTest, AnExpiredCertificateFailsTheHandshake) {
  const Identity expired = Issue(*ca_, "w1", absl::Now() - absl::Hours(2), absl::Hours(1));
  grpc::Status st = Register(&expired, "w1");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  const Identity early = Issue(*ca_, "w1", absl::Now() + absl::Hours(1), absl::Hours(1));
  st = Register(&early, "w1");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
}

TEST_F(HostileCertificatesTest, ARevokedWorkerLosesItsSessionAtOnceAndStaysOut) {
  Identity w1;
  ASSERT_TRUE(Join(kToken, "w1", &w1).ok());
  ASSERT_TRUE(Register(&w1, "w1").ok());
  auto session_channel = Channel(&w1);
  grpc::ClientContext sctx;
  Deadline(&sctx, 30);
  auto stream = v1::ClusterService::NewStub(session_channel)->Session(&sctx);
  v1::WorkerMessage hello;
  hello.mutable_hello()->set_worker_id("w1");
  ASSERT_TRUE(stream->Write(hello));
  v1::WorkerMessage beat;
  beat.mutable_heartbeat()->set_seq(1);
  ASSERT_TRUE(stream->Write(beat));
  v1::CoordinatorMessage ack;
  ASSERT_TRUE(stream->Read(&ack));  // the session is live
  EXPECT_TRUE(ack.has_heartbeat_ack());
  // A job placed on it.
  std::string job_id;
  {
    v1::SubmitJobRequest req;
    req.set_spec_json(testing::WithCheckpointDir(testing::SpecJson(), dir_.File("ck")));
    v1::SubmitJobResponse resp;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    ctx.AddMetadata("authorization", "Bearer bob-token");
    grpc::Status st = v1::JobService::NewStub(Channel())->Submit(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    job_id = resp.job_id();
  }
  v1::CoordinatorMessage placed;
  while (stream->Read(&placed) && !placed.has_assignment()) {
  }
  ASSERT_TRUE(placed.has_assignment());
  EXPECT_EQ(placed.assignment().ref().job_id(), job_id);

  grpc::Status bob = Revoke("bob-token", "w1");
  EXPECT_EQ(bob.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(bob.error_message(), "revoke: user bob is not an admin");

  int64_t revoked = 0;
  grpc::Status root = Revoke("root-token", "w1", &revoked);
  ASSERT_TRUE(root.ok()) << root.error_message();
  EXPECT_EQ(revoked, 1);
  const auto start = std::chrono::steady_clock::now();
  v1::CoordinatorMessage m;
  while (stream->Read(&m)) {
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  stream->Finish().IgnoreError();
  // The job on it names the admin who revoked it (its restart follows once w1 is lost).
  {
    v1::GetJobRequest req;
    req.set_job_id(job_id);
    v1::Job job;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    ctx.AddMetadata("authorization", "Bearer bob-token");
    ASSERT_TRUE(v1::JobService::NewStub(Channel())->Get(&ctx, req, &job).ok());
    bool named = false;
    for (const v1::JobEvent& e : job.events()) named |= e.message() == "worker w1 revoked by root";
    EXPECT_TRUE(named) << job.DebugString();
  }

  const std::string serial = ParseCertificate(w1.cert_pem)->serial_hex;
  const std::string message = "the certificate of worker w1 (serial " + serial + ") was revoked";
  grpc::Status again = Register(&w1, "w1");
  EXPECT_EQ(again.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(again.error_message(), message);
  // The revocation is in the store: a restarted coordinator refuses the certificate too.
  Start();
  again = Register(&w1, "w1");
  EXPECT_EQ(again.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(again.error_message(), message);
  // A new bootstrap join gives the worker a new certificate.
  Identity rejoined;
  ASSERT_TRUE(Join(kToken, "w1", &rejoined).ok());
  EXPECT_TRUE(Register(&rejoined, "w1").ok());
}

TEST_F(HostileCertificatesTest, BootstrapTokensThatExpiredOrRanOutAreRefused) {
  Identity id;
  grpc::Status expired = Join(kExpired, "w1", &id);
  EXPECT_EQ(expired.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(absl::StartsWith(expired.error_message(), "join: the bootstrap token expired at "))
      << expired.error_message();
  grpc::Status unknown = Join("guessed-token-0123456789", "w1", &id);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(unknown.error_message(), "join: unknown bootstrap token");

  ASSERT_TRUE(Join(kOneJoin, "w1", &id).ok());
  grpc::Status second = Join(kOneJoin, "w2", &id);
  EXPECT_EQ(second.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(second.error_message(), "join: the bootstrap token has made all of its 1 joins");
  // Also after a restart (the joins are counted in the store).
  Start();
  second = Join(kOneJoin, "w3", &id);
  EXPECT_EQ(second.error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

TEST_F(HostileCertificatesTest, AHugeCertificateRequestIsRefusedUnread) {
  v1::JoinRequest req;
  req.set_bootstrap_token(kToken);
  req.set_csr_pem(std::string(1 << 20, 'A'));
  v1::JoinResponse resp;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status st = v1::ClusterService::NewStub(Channel())->Join(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message(), "join: the certificate request has 1048576 bytes; at most 16384");
}

TEST_F(HostileCertificatesTest, PlaintextClientsCannotTalkToTheTlsPort) {
  auto plain = grpc::CreateChannel(Address(), grpc::InsecureChannelCredentials());
  grpc::ClientContext ctx;
  Deadline(&ctx, 3);
  v1::JoinRequest req;
  req.set_bootstrap_token(kToken);
  v1::JoinResponse resp;
  EXPECT_EQ(v1::ClusterService::NewStub(plain)->Join(&ctx, req, &resp).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace spindle
