// Worker identity end to end with real daemons on 127.0.0.1: workers join with a bootstrap token
// (the coordinator's CA generated beside its database, or made here with the openssl CLI and
// given as files), train over mutual TLS, keep their certificate across a restart, and a revoked
// worker is cut off at once. Trainers get only their attempt's rendezvous token and the CA's
// certificate, never the worker's key. A wrong bootstrap token is one clear line and exit code 2.
#include <sys/stat.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_harness.h"
#include "tests/integration/worker_test_util.h"

namespace spindle {
namespace {

using ::spindle::testing::ClusterHarness;
using ::spindle::testing::ReadFile;
using ::spindle::testing::ScratchDir;
using ::spindle::testing::WaitFor;
using ::spindle::testing::WriteScript;
using ::testing::HasSubstr;
using ::testing::Not;

// Records its arguments and environment, then three quick steps and success.
constexpr char kRecordingTrainer[] = R"(
echo "$@" > "$SPINDLE_TEST_RECORD.args"
env > "$SPINDLE_TEST_RECORD.env"
for s in 1 2 3; do
  sleep 0.05
  echo "{\"event\":\"step\",\"step\":$s,\"total_steps\":3,\"loss\":1.5,\"tokens_per_s\":100}"
done
echo '{"event":"done","step":3}'
)";

constexpr char kSpec[] =
    R"({"name":"id","model":{"preset":"tiny"},"data":{"source":"synthetic:recall"},)"
    R"("seq_len":256,"parallel":{"cp":1},"train":{"steps":3},"resources":"cpu"})";

class ClusterIdentityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(SPINDLE_COORDINATOR_BINARY).empty() ||
        std::string(SPINDLE_WORKER_BINARY).empty() || std::string(SPINDLE_CLI_BINARY).empty()) {
      GTEST_SKIP() << "spindle-coordinator, spindle-worker or spindle not built";
    }
    ::unsetenv("SPINDLE_COORDINATOR");
    ::unsetenv("SPINDLE_TOKEN");
    ::unsetenv("SPINDLE_TLS_CA");
    trainer_ = WriteScript(dir_, "record-train.sh", kRecordingTrainer);
  }

  CommandResult Run(const std::vector<std::string>& argv) {
    absl::StatusOr<CommandResult> r = RunCommand(argv, "", absl::Seconds(60));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : CommandResult{-1, "", ""};
  }
  CommandResult Cli(std::vector<std::string> args) {
    args.insert(args.begin(), SPINDLE_CLI_BINARY);
    for (const std::string& a :
         {std::string("--coordinator"), cluster_.address(), std::string("--tls-ca"),
          cluster_.ca_file(), std::string("--token-file"), cluster_.token_file()})
      args.push_back(a);
    return Run(args);
  }
  bool RunOneJob() {
    absl::StatusOr<std::string> id = cluster_.Submit(kSpec);
    if (!id.ok()) return false;
    auto job = cluster_.WaitJob(*id, ClusterHarness::Ended, std::chrono::seconds(60));
    return job.has_value() && job->state() == v1::JOB_STATE_SUCCEEDED;
  }

  ScratchDir dir_{"spindle-certs"};
  ClusterHarness cluster_{&dir_};
  std::string trainer_;
};

TEST_F(ClusterIdentityTest, WorkersJoinTrainKeepTheirCertificateAndARevokedOneIsCutOff) {
  cluster_.UseToken("admin-token");  // --token-file: its holder is the admin "admin"
  ASSERT_TRUE(cluster_.StartCoordinator({"--heartbeat_interval=0.2", "--heartbeat_timeout=2"}))
      << cluster_.Logs();
  ASSERT_TRUE(
      cluster_.StartWorker("w0", 1, trainer_, {{"SPINDLE_TEST_RECORD", dir_.File("trainer")}}));
  ASSERT_TRUE(cluster_.WaitForWorkers(1)) << cluster_.Logs();
  EXPECT_THAT(ReadFile(dir_.File("worker-w0.log")),
              HasSubstr("worker certificate for w0 signed at join, kept in " +
                        dir_.File("work-w0/identity")));
  struct stat st;
  ASSERT_EQ(::stat(dir_.File("work-w0/identity/key.pem").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600);
  ASSERT_TRUE(RunOneJob()) << cluster_.Logs();

  // The trainer got its attempt's rendezvous token and the CA, nothing of the worker's own.
  const std::string args = ReadFile(dir_.File("trainer.args"));
  const std::string env = ReadFile(dir_.File("trainer.env"));
  EXPECT_THAT(env, HasSubstr("SPINDLE_RENDEZVOUS_TOKEN="));
  EXPECT_THAT(env, HasSubstr("SPINDLE_TLS_CA_FILE=" + cluster_.ca_file()));
  EXPECT_THAT(args, Not(HasSubstr("--token-file")));
  for (const std::string& text : {args, env}) {
    EXPECT_THAT(text, Not(HasSubstr(dir_.File("work-w0/identity")))) << text;
    EXPECT_THAT(text, Not(HasSubstr("key.pem"))) << text;
    EXPECT_THAT(text, Not(HasSubstr("bootstrap"))) << text;
  }

  // Restarted without a bootstrap token, the worker comes back with the certificate it kept.
  cluster_.KillWorker("w0");
  ASSERT_TRUE(cluster_.StartWorker("w0", 1, trainer_,
                                   {{"SPINDLE_TEST_RECORD", dir_.File("trainer")}},
                                   {"--bootstrap_token_file="}));
  ASSERT_TRUE(WaitFor(
      [&] {
        return absl::StrContains(ReadFile(dir_.File("worker-w0.log")),
                                 "worker certificate for w0 from " + dir_.File("work-w0/identity"));
      },
      std::chrono::seconds(10)))
      << cluster_.Logs();
  ASSERT_TRUE(RunOneJob()) << cluster_.Logs();

  // Revoked: the session ends at once and the worker cannot come back with that certificate.
  CommandResult r = Cli({"workers", "revoke", "w0"});
  EXPECT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_EQ(r.stdout_text, "revoked 1 certificate of worker w0; its sessions are ended\n");
  EXPECT_TRUE(WaitFor(
      [&] {
        return absl::StrContains(ReadFile(dir_.File("worker-w0.log")),
                                 "the certificate of worker w0 (serial ");
      },
      std::chrono::seconds(10)))
      << cluster_.Logs();
  EXPECT_TRUE(
      WaitFor([&] { return cluster_.WorkerState("w0") != "alive"; }, std::chrono::seconds(10)));
  r = Cli({"workers", "revoke", "w9"});
  EXPECT_EQ(r.exit_code, 4);
  EXPECT_EQ(r.stderr_text,
            "spindle: workers: worker w9 has no certificate this coordinator issued or saw\n");
}

TEST_F(ClusterIdentityTest, AWrongBootstrapTokenIsOneClearLine) {
  ASSERT_TRUE(cluster_.StartCoordinator()) << cluster_.Logs();
  std::ofstream(dir_.File("wrong-token")) << "not-the-bootstrap-token\n";
  CommandResult r =
      Run({SPINDLE_WORKER_BINARY, "--coordinator=" + cluster_.worker_address(),
           "--worker_id=w-wrong", "--work_dir=" + dir_.File("work-wrong"), "--metrics_port=-1",
           "--trainer_binary=" + trainer_, "--checkpoint_root=" + dir_.path(),
           "--data_root=" + dir_.path(), "--tls_ca_file=" + cluster_.ca_file(),
           "--bootstrap_token_file=" + dir_.File("wrong-token")});
  EXPECT_EQ(r.exit_code, 2) << r.stderr_text;
  EXPECT_THAT(r.stderr_text,
              HasSubstr("spindle-worker: worker certificate: coordinator: join: unknown bootstrap "
                        "token\n"));
}

// A CA made with the openssl CLI and given as files (as docs/deploy.md does for Kubernetes).
TEST_F(ClusterIdentityTest, ACaGivenAsFilesSignsTheWorkers) {
  const std::string cert = dir_.File("ca.pem"), key = dir_.File("ca-key.pem");
  CommandResult r = Run({"openssl",
                         "req",
                         "-x509",
                         "-newkey",
                         "ec",
                         "-pkeyopt",
                         "ec_paramgen_curve:P-256",
                         "-nodes",
                         "-days",
                         "2",
                         "-subj",
                         "/O=spindle-coordinator/CN=Spindle test CA",
                         "-keyout",
                         key,
                         "-out",
                         cert,
                         "-addext",
                         "basicConstraints=critical,CA:TRUE",
                         "-addext",
                         "keyUsage=critical,keyCertSign,cRLSign"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text << " (scripts/setup.sh installs openssl)";
  cluster_.UseCaFiles(cert, key);
  ASSERT_TRUE(cluster_.StartCoordinator()) << cluster_.Logs();
  ASSERT_TRUE(
      cluster_.StartWorker("w0", 1, trainer_, {{"SPINDLE_TEST_RECORD", dir_.File("trainer")}}));
  ASSERT_TRUE(cluster_.WaitForWorkers(1)) << cluster_.Logs();
  ASSERT_TRUE(RunOneJob()) << cluster_.Logs();
  r = Run({"openssl", "verify", "-CAfile", cert, dir_.File("work-w0/identity/cert.pem")});
  EXPECT_EQ(r.exit_code, 0) << r.stdout_text << r.stderr_text;
}

}  // namespace
}  // namespace spindle
