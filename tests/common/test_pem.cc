// ReadPemFile: the TLS files' flags name a file that is missing, or that holds no block of the
// kind the flag promises; files that hold one come back whole.
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "common/pem.h"
#include "gtest/gtest.h"

namespace spindle {
namespace {

class PemTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/spindle-pem-test-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
  }
  void TearDown() override {
    for (const std::string& f : written_) ::unlink(f.c_str());
    ::rmdir(dir_.c_str());
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    written_.push_back(path);
    return path;
  }
  std::string dir_;
  std::vector<std::string> written_;
};

constexpr char kCert[] = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

TEST_F(PemTest, BlocksOfTheRightKindComeBackWhole) {
  const std::string cert = Write("ca.pem", std::string("subject=x\n") + kCert);
  auto got = ReadPemFile(cert, PemKind::kCertificate, "--tls-ca");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, std::string("subject=x\n") + kCert);
  for (const char* type : {"PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"}) {
    const std::string text =
        std::string("-----BEGIN ") + type + "-----\nMIIE\n-----END " + type + "-----\n";
    auto key = ReadPemFile(Write("key.pem", text), PemKind::kPrivateKey, "--tls-key");
    ASSERT_TRUE(key.ok()) << type << ": " << key.status();
    EXPECT_EQ(*key, text);
  }
}

TEST_F(PemTest, MissingAndWrongFilesAreNamed) {
  auto missing = ReadPemFile(dir_ + "/none.pem", PemKind::kCertificate, "--tls-ca");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(), "cannot read the --tls-ca file " + dir_ + "/none.pem");

  const std::string junk = Write("junk.pem", "not a certificate\n");
  auto bad_cert = ReadPemFile(junk, PemKind::kCertificate, "--tls-cert");
  EXPECT_EQ(bad_cert.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad_cert.status().message(),
            "the --tls-cert file " + junk +
                " holds no PEM certificate (no -----BEGIN CERTIFICATE----- line)");
  // A certificate where the key belongs, and an empty file.
  auto swapped = ReadPemFile(Write("cert-as-key.pem", kCert), PemKind::kPrivateKey, "--tls-key");
  EXPECT_EQ(
      swapped.status().message(),
      "the --tls-key file " + dir_ +
          "/cert-as-key.pem holds no PEM private key (no -----BEGIN ... PRIVATE KEY----- line)");
  auto empty = ReadPemFile(Write("empty.pem", ""), PemKind::kCertificate, "--tls-ca");
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace spindle
