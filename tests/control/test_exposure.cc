// The coordinator's safe default (coordinator/exposure.h): without users' credentials it serves
// only loopback addresses unless told --insecure (a TLS certificate alone is no credential), and
// /metrics binds loopback by default.
#include "coordinator/certificate_authority.h"
#include "coordinator/coordinator_server.h"
#include "coordinator/exposure.h"
#include "gtest/gtest.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

TEST(ExposureTest, ListenHost) {
  EXPECT_EQ(ListenHost("0.0.0.0:7070"), "0.0.0.0");
  EXPECT_EQ(ListenHost("[::1]:7070"), "::1");
  EXPECT_EQ(ListenHost("localhost:0"), "localhost");
}

TEST(ExposureTest, LoopbackCredentialsOrInsecure) {
  EXPECT_TRUE(CheckListenExposure({"127.0.0.1:7070", ""}, false, false).ok());
  EXPECT_TRUE(CheckListenExposure({"[::1]:7070", "localhost:7071"}, false, false).ok());
  EXPECT_TRUE(CheckListenExposure({"0.0.0.0:7070"}, /*has_credentials=*/true, false).ok());
  EXPECT_TRUE(CheckListenExposure({"0.0.0.0:7070"}, false, /*insecure=*/true).ok());
  const absl::Status st = CheckListenExposure({"127.0.0.1:7070", "[::]:7071"}, false, false);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(),
            "refusing to serve [::]:7071 (not a loopback address) without credentials: set "
            "--users_file or --token_file (TLS alone names no one), or pass --insecure to let "
            "anyone who reaches it run jobs");
}

TEST(ExposureTest, CoordinatorRefusesAnExposedPortWithoutCredentials) {
  testing::TempDir dir;
  CoordinatorConfig cfg;
  cfg.listen = "0.0.0.0:0";
  cfg.db_path = dir.File("exposed.db");
  auto refused = CoordinatorServer::Start(cfg);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.status().message(),
            "refusing to serve 0.0.0.0:0 (not a loopback address) without credentials: set "
            "--users_file or --token_file (TLS alone names no one), or pass --insecure to let "
            "anyone who reaches it run jobs");
  cfg.insecure = true;
  auto insecure = CoordinatorServer::Start(cfg);
  ASSERT_TRUE(insecure.ok()) << insecure.status();
  insecure->reset();  // closes the store for the next start
  cfg.insecure = false;
  cfg.token = "t";
  // A user token alone would let users act as workers: the workers need tokens of their own.
  auto shared = CoordinatorServer::Start(cfg);
  ASSERT_FALSE(shared.ok());
  EXPECT_EQ(shared.status().code(), absl::StatusCode::kFailedPrecondition);
  cfg.worker_tokens.push_back(WorkerToken{"", "w"});
  auto with_tokens = CoordinatorServer::Start(cfg);
  ASSERT_TRUE(with_tokens.ok()) << with_tokens.status();
}

// A server certificate authenticates the coordinator, not its callers: TLS alone (with or without
// the workers' CA) does not open an exposed client port.
TEST(ExposureTest, TlsAloneIsNoCredential) {
  testing::TempDir dir;
  CoordinatorConfig cfg;
  cfg.listen = "0.0.0.0:0";
  cfg.db_path = dir.File("tls.db");
  absl::StatusOr<CertificateAuthority> ca = CertificateAuthority::Create("ca", absl::Hours(1));
  ASSERT_TRUE(ca.ok());
  absl::StatusOr<KeyAndCertificate> server =
      ca->IssueServerCertificate({"127.0.0.1"}, absl::Hours(1));
  ASSERT_TRUE(server.ok());
  cfg.tls_cert_pem = server->cert_pem;
  cfg.tls_key_pem = server->key_pem;
  const std::string refusal =
      "refusing to serve 0.0.0.0:0 (not a loopback address) without credentials: set "
      "--users_file or --token_file (TLS alone names no one), or pass --insecure to let anyone "
      "who reaches it run jobs";
  auto tls_only = CoordinatorServer::Start(cfg);
  ASSERT_FALSE(tls_only.ok());
  EXPECT_EQ(tls_only.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(tls_only.status().message(), refusal);
  cfg.ca_cert_pem = ca->cert_pem();
  cfg.ca_key_pem = ca->key_pem();
  auto with_ca = CoordinatorServer::Start(cfg);
  ASSERT_FALSE(with_ca.ok());
  EXPECT_EQ(with_ca.status().message(), refusal);
  // Users with tokens, workers with certificates: served.
  cfg.users = {{"t-alice", {"alice", false}}};
  auto served = CoordinatorServer::Start(cfg);
  ASSERT_TRUE(served.ok()) << served.status();
}

TEST(ExposureTest, MetricsBindLoopbackByDefault) {
  EXPECT_EQ(CoordinatorConfig().metrics_host, "127.0.0.1");
}

// Exposed with a user token but no worker tokens: users could act as workers.
TEST(ExposureTest, AnExposedCoordinatorNeedsWorkerTokensBesideTheUsersToken) {
  EXPECT_TRUE(CheckWorkerCredentials({"127.0.0.1:7070"}, true, false, false).ok());
  EXPECT_TRUE(CheckWorkerCredentials({"0.0.0.0:7070"}, true, /*worker_tokens=*/true, false).ok());
  EXPECT_TRUE(CheckWorkerCredentials({"0.0.0.0:7070"}, /*user_token=*/false, false, false).ok());
  EXPECT_TRUE(CheckWorkerCredentials({"0.0.0.0:7070"}, true, false, /*insecure=*/true).ok());
  const absl::Status st =
      CheckWorkerCredentials({"127.0.0.1:7070", "0.0.0.0:7071"}, true, false, false);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(),
            "refusing to serve 0.0.0.0:7071 with one token for users and workers (any user could "
            "register as a worker and take its assignments): give the workers their own with "
            "--worker_token_file, or pass --insecure");
}

}  // namespace
}  // namespace spindle
