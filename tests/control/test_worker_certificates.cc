// The coordinator's CA and the workers' certificates without a network: keys, requests and
// certificates made and read back with OpenSSL; the CA kept beside the database; bootstrap tokens
// that expire or run out of joins; revocations that survive a restart (real SQLite file).
#include <sys/stat.h>

#include <fstream>
#include <memory>

#include "common/x509.h"
#include "coordinator/certificate_authority.h"
#include "coordinator/clock.h"
#include "coordinator/sqlite_job_store.h"
#include "coordinator/worker_certificates.h"
#include "gtest/gtest.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

using testing::TempDir;

constexpr char kToken[] = "join-token-0123456789";

TEST(X509Test, RequestSignedByTheCaReadsBack) {
  absl::StatusOr<CertificateAuthority> ca = CertificateAuthority::Create("test CA", absl::Hours(1));
  ASSERT_TRUE(ca.ok()) << ca.status();
  absl::StatusOr<std::string> key = GeneratePrivateKey();
  ASSERT_TRUE(key.ok()) << key.status();
  absl::StatusOr<std::string> csr = MakeCertificateRequest(*key, "w-17");
  ASSERT_TRUE(csr.ok()) << csr.status();
  absl::StatusOr<CertificateRequestInfo> req = ParseCertificateRequest(*csr);
  ASSERT_TRUE(req.ok()) << req.status();
  EXPECT_EQ(req->common_name, "w-17");
  EXPECT_EQ(req->public_key_pem, *PublicKeyOf(*key));

  std::string serial;
  absl::StatusOr<std::string> cert = ca->IssueWorkerCertificate(
      "w-17", req->public_key_pem, absl::Now() - absl::Minutes(1), absl::Hours(1), &serial);
  ASSERT_TRUE(cert.ok()) << cert.status();
  absl::StatusOr<CertificateInfo> info = ParseCertificate(*cert);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->common_names, std::vector<std::string>{"w-17"});
  EXPECT_EQ(info->organizations, std::vector<std::string>{kWorkerOrganization});
  EXPECT_EQ(info->serial_hex, serial);
  EXPECT_EQ(serial.size(), 32u);
  EXPECT_TRUE(CheckCertificate(*cert, ca->cert_pem(), *key).ok());

  // Another key, another CA: each named.
  absl::StatusOr<std::string> other_key = GeneratePrivateKey();
  absl::Status wrong_key = CheckCertificate(*cert, ca->cert_pem(), *other_key);
  EXPECT_EQ(wrong_key.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(wrong_key.message(), "the private key does not belong to the certificate");
  absl::StatusOr<CertificateAuthority> other =
      CertificateAuthority::Create("other", absl::Hours(1));
  absl::Status wrong_ca = CheckCertificate(*cert, other->cert_pem(), "");
  EXPECT_EQ(wrong_ca.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(wrong_ca.message(),
            "the certificate does not verify against the CA: unable to get local issuer "
            "certificate");

  // A request whose signature is not its key's is refused.
  std::string tampered = *csr;
  tampered[tampered.size() / 2] = tampered[tampered.size() / 2] == 'A' ? 'B' : 'A';
  EXPECT_FALSE(ParseCertificateRequest(tampered).ok());
  EXPECT_EQ(ParseCertificateRequest("junk").status().message(),
            "the certificate request is not a PEM CERTIFICATE REQUEST");
}

TEST(CertificateAuthorityTest, GeneratedOnceBesideTheDatabaseThenLoaded) {
  TempDir dir;
  const std::string cert = dir.File("spindle.db.ca.pem"), key = dir.File("spindle.db.ca-key.pem");
  absl::StatusOr<CertificateAuthority> first = CertificateAuthority::LoadOrCreate(cert, key);
  ASSERT_TRUE(first.ok()) << first.status();
  struct stat st;
  ASSERT_EQ(::stat(key.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600);
  absl::StatusOr<CertificateAuthority> again = CertificateAuthority::LoadOrCreate(cert, key);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->cert_pem(), first->cert_pem());
  EXPECT_EQ(again->key_pem(), first->key_pem());

  // A certificate without its key, or with another key, is refused by name.
  ::unlink(key.c_str());
  absl::StatusOr<CertificateAuthority> half = CertificateAuthority::LoadOrCreate(cert, key);
  EXPECT_EQ(half.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(half.status().message(), "the CA needs both its certificate and its key: " + cert +
                                         " exists, " + key + " does not");
  std::ofstream(key) << *GeneratePrivateKey();
  absl::StatusOr<CertificateAuthority> mismatched = CertificateAuthority::LoadOrCreate(cert, key);
  EXPECT_EQ(mismatched.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mismatched.status().message(),
            cert + " and " + key +
                ": not a usable CA: the private key does not belong to the certificate");
}

TEST(BootstrapTokensTest, ParsesAndNamesTheBadLine) {
  absl::StatusOr<std::vector<BootstrapToken>> t = ParseBootstrapTokens(
      "# comment\njoin-token-0123456789 2026-12-31T00:00:00Z 3\n\nsecond-token-0123456 "
      "2027-01-01T00:00:00Z\n");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0].max_joins, 3);
  EXPECT_EQ((*t)[0].expires_unix_ms, 1798675200000);
  EXPECT_EQ((*t)[1].max_joins, 0);
  EXPECT_EQ(ParseBootstrapTokens("short 2026-12-31T00:00:00Z\n").status().message(),
            "line 1: the token is shorter than 16 characters");
  EXPECT_EQ(ParseBootstrapTokens("join-token-0123456789 tomorrow\n").status().message(),
            "line 1: \"tomorrow\" is not an RFC 3339 time (e.g. 2026-12-31T00:00:00Z)");
  EXPECT_EQ(
      ParseBootstrapTokens("join-token-0123456789 2026-12-31T00:00:00Z -1\n").status().message(),
      "line 1: MAX_JOINS must be a number >= 0, got \"-1\"");
  EXPECT_EQ(ParseBootstrapTokens("\n# none\n").status().message(), "no token in it");
}

class WorkerCertificatesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<CertificateAuthority> ca =
        CertificateAuthority::Create("test CA", absl::Hours(24));
    ASSERT_TRUE(ca.ok()) << ca.status();
    ca_ = std::make_unique<CertificateAuthority>(*std::move(ca));
    Reopen();
  }
  void Reopen() {
    certs_.reset();
    store_.reset();
    auto s = SqliteJobStore::Open(dir_.File("c.db"));
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
    std::vector<BootstrapToken> tokens = {{kToken, clock_.NowMs() + 60'000, 2}};
    certs_ =
        std::make_unique<WorkerCertificates>(*ca_, tokens, store_.get(), &clock_, absl::Hours(1));
    ASSERT_TRUE(certs_->Load().ok());
  }
  // A request for `worker_id` on a new key.
  static std::string Request(const std::string& worker_id) {
    return *MakeCertificateRequest(*GeneratePrivateKey(), worker_id);
  }

  TempDir dir_;
  FakeClock clock_{1'800'000'000'000};
  std::unique_ptr<CertificateAuthority> ca_;
  std::unique_ptr<SqliteJobStore> store_;
  std::unique_ptr<WorkerCertificates> certs_;
};

TEST_F(WorkerCertificatesTest, TokensExpireAndRunOutOfJoinsAcrossRestarts) {
  absl::StatusOr<std::string> cert = certs_->Join(kToken, Request("w1"));
  ASSERT_TRUE(cert.ok()) << cert.status();
  EXPECT_EQ(*certs_->WorkerOf(*cert), "w1");

  absl::StatusOr<std::string> unknown = certs_->Join("not-a-token-0123456", Request("w2"));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(unknown.status().message(), "join: unknown bootstrap token");
  absl::StatusOr<std::string> bad_id = certs_->Join(kToken, Request("w 2/.."));
  EXPECT_EQ(bad_id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad_id.status().message(),
            "join: the request names worker \"w 2/..\": a worker id in a certificate is 1 to 253 "
            "characters of A-Z, a-z, 0-9, '.', '_' and '-'");

  // The second join is the token's last, also after a restart; refused ones count none.
  Reopen();
  ASSERT_TRUE(certs_->Join(kToken, Request("w2")).ok());
  Reopen();
  absl::StatusOr<std::string> third = certs_->Join(kToken, Request("w3"));
  EXPECT_EQ(third.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(third.status().message(), "join: the bootstrap token has made all of its 2 joins");

  // Past its expiry the token is refused whatever joins it has left.
  clock_.AdvanceMs(60'000);
  absl::StatusOr<std::string> late = certs_->Join(kToken, Request("w4"));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(late.status().message(), "join: the bootstrap token expired at 2027-01-15T08:01:00Z");
}

TEST_F(WorkerCertificatesTest, RevocationEndsEveryCertificateOfTheWorkerAndIsKept) {
  absl::StatusOr<std::string> first = certs_->Join(kToken, Request("w1"));
  absl::StatusOr<std::string> other = certs_->Join(kToken, Request("w2"));
  ASSERT_TRUE(first.ok() && other.ok());
  // A certificate the CA signed outside Join (an operator holding the key) is recorded when seen.
  std::string serial;
  absl::StatusOr<std::string> outside = ca_->IssueWorkerCertificate(
      "w1", *PublicKeyOf(*GeneratePrivateKey()), absl::Now(), absl::Hours(1), &serial);
  ASSERT_TRUE(outside.ok());
  EXPECT_EQ(*certs_->WorkerOf(*outside), "w1");

  absl::StatusOr<int64_t> n = certs_->Revoke("w1");
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 2);
  Reopen();
  for (const std::string& cert : {*first, *outside}) {
    absl::StatusOr<std::string> who = certs_->WorkerOf(cert);
    EXPECT_EQ(who.status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(who.status().message(), "the certificate of worker w1 (serial " +
                                          ParseCertificate(cert)->serial_hex + ") was revoked");
  }
  EXPECT_EQ(*certs_->WorkerOf(*other), "w2");
  EXPECT_EQ(certs_->Revoke("w9").status().message(),
            "worker w9 has no certificate this coordinator issued or saw");
  // An id no certificate can hold (4 MB, say) is refused without being echoed.
  absl::StatusOr<int64_t> huge = certs_->Revoke(std::string(4 << 20, 'w'));
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(huge.status().message(),
            "revoke: a worker id in a certificate is 1 to 253 characters of A-Z, a-z, 0-9, '.', "
            "'_' and '-'");
  EXPECT_EQ(certs_->Revoke("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(WorkerCertificatesTest, OnlyWorkerCertificatesNameAWorker) {
  absl::StatusOr<std::string> none = certs_->WorkerOf("");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(none.status().message(),
            "worker calls need the worker's client certificate (a new worker joins with a "
            "bootstrap token first)");
  // The server's certificate, from the same CA, is not a worker's.
  absl::StatusOr<KeyAndCertificate> server =
      ca_->IssueServerCertificate({"localhost", "127.0.0.1"}, absl::Hours(1));
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::string> who = certs_->WorkerOf(server->cert_pem);
  EXPECT_EQ(who.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(who.status().message(),
            "the client certificate is not a worker's (one CN and O=spindle-workers)");
}

}  // namespace
}  // namespace spindle
