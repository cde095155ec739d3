// What a user can get wrong, against the real daemons on 127.0.0.1 (spindle-coordinator,
// spindle-worker, the `spindle` binary): an unknown job id, a malformed spec, an impossible plan
// and a job that can never fit are each answered with one clear line (CLI) and one status with the
// same message (gRPC), and queue nothing; a request without the bearer token is refused, on the
// client and the worker side. TLS: with a certificate and key (made here with the `openssl` CLI)
// both coordinator ports speak TLS only; the CLI and a worker connect with the CA, plaintext
// clients and a worker without the CA do not.
#include <stdlib.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
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
using ::spindle::testing::WriteScript;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// Three quick steps, then success.
constexpr char kQuickTrainer[] = R"(
for s in 1 2 3; do
  sleep 0.05
  echo "{\"event\":\"step\",\"step\":$s,\"total_steps\":3,\"loss\":1.5,\"tokens_per_s\":100}"
done
echo '{"event":"done","step":3}'
)";

std::string Spec(int cp, const std::string& extra_parallel = "") {
  return absl::StrCat(
      R"({"name":"api","model":{"preset":"tiny"},"data":{"source":"synthetic:recall"},)",
      R"("seq_len":256,"parallel":{"cp":)", cp, extra_parallel,
      R"(},"train":{"steps":3},"resources":"cpu"})");
}

class ClusterApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(SPINDLE_COORDINATOR_BINARY).empty() ||
        std::string(SPINDLE_WORKER_BINARY).empty() || std::string(SPINDLE_CLI_BINARY).empty()) {
      GTEST_SKIP() << "spindle-coordinator, spindle-worker or spindle not built";
    }
    // The CLI reads these; the tests pass everything on the command line.
    ::unsetenv("SPINDLE_COORDINATOR");
    ::unsetenv("SPINDLE_TOKEN");
    ::unsetenv("SPINDLE_TLS_CA");
    trainer_ = WriteScript(dir_, "quick-train.sh", kQuickTrainer);
  }

  std::string WriteSpec(const std::string& name, const std::string& text) {
    const std::string path = dir_.File(name);
    std::ofstream(path) << text;
    return path;
  }

  // Runs `spindle args...`; exit code, stdout and stderr.
  CommandResult Cli(std::vector<std::string> args) {
    args.insert(args.begin(), SPINDLE_CLI_BINARY);
    absl::StatusOr<CommandResult> r = RunCommand(args, "", absl::Seconds(60));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : CommandResult{-1, "", ""};
  }

  // Runs the openssl CLI; fails the test on a non-zero exit.
  void OpenSsl(std::vector<std::string> args) {
    args.insert(args.begin(), "openssl");
    absl::StatusOr<CommandResult> r = RunCommand(args, "", absl::Seconds(60));
    ASSERT_TRUE(r.ok()) << r.status() << " (scripts/setup.sh installs the openssl package)";
    ASSERT_EQ(r->exit_code, 0) << absl::StrJoin(args, " ") << "\n" << r->stderr_text;
  }

  // A CA and a server certificate for 127.0.0.1 signed by it, as PEM files in the scratch
  // directory: <prefix>ca.pem, <prefix>server.pem, <prefix>server.key.
  void MakeCertificates(const std::string& prefix) {
    const std::string ca_key = dir_.File(prefix + "ca.key"), ca = dir_.File(prefix + "ca.pem");
    const std::string key = dir_.File(prefix + "server.key"),
                      csr = dir_.File(prefix + "server.csr");
    const std::string cert = dir_.File(prefix + "server.pem"), ext = dir_.File(prefix + "san.ext");
    std::ofstream(ext) << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
    OpenSsl({"req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
             "-days", "2", "-subj", "/CN=Spindle test CA " + prefix});
    OpenSsl({"req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj",
             "/CN=127.0.0.1"});
    OpenSsl({"x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out",
             cert, "-days", "2", "-extfile", ext});
  }

  ScratchDir dir_{"spindle-api"};
  ClusterHarness cluster_{&dir_};
  std::string trainer_;
};

TEST_F(ClusterApiTest, EveryMistakeIsOneClearErrorAndQueuesNothing) {
  cluster_.UsePlaintext();
  cluster_.UseToken("api-token");
  ASSERT_TRUE(cluster_.StartCoordinator({"--heartbeat_interval=0.2", "--heartbeat_timeout=2"}))
      << cluster_.Logs();
  ASSERT_TRUE(cluster_.StartWorker("w0", 1, trainer_));
  ASSERT_TRUE(cluster_.StartWorker("w1", 1, trainer_));
  ASSERT_TRUE(cluster_.WaitForWorkers(2)) << cluster_.Logs();
  const std::vector<std::string> conn = {"--coordinator", cluster_.address(), "--token-file",
                                         cluster_.token_file()};
  auto cli = [&](std::vector<std::string> args) {
    args.insert(args.end(), conn.begin(), conn.end());
    return Cli(args);
  };
  auto stub = v1::JobService::NewStub(
      grpc::CreateChannel(cluster_.address(), grpc::InsecureChannelCredentials()));

  // Unknown job id: CLI exit 4 and one line per command; gRPC NOT_FOUND.
  for (const char* command : {"status", "cancel", "watch"}) {
    CommandResult r = cli({command, "j-000099"});
    EXPECT_EQ(r.exit_code, 4) << command;
    EXPECT_EQ(r.stderr_text, absl::StrCat("spindle: ", command, ": job j-000099 not found\n"));
    EXPECT_EQ(r.stdout_text, "");
  }
  {
    grpc::ClientContext ctx;
    cluster_.Authorize(&ctx);
    v1::GetJobRequest req;
    req.set_job_id("j-000099");
    v1::Job job;
    grpc::Status st = stub->Get(&ctx, req, &job);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(st.error_message(), "job j-000099 not found");
  }

  // Malformed specs: the CLI names the problem before calling; the coordinator says the same.
  struct BadSpec {
    std::string text;
    std::string message;
  };
  const BadSpec bad_specs[] = {
      {R"({"name": "x", "model": {"preset": "tiny"},)", "job spec: not valid JSON"},
      {absl::StrCat(Spec(1).substr(0, Spec(1).size() - 1), R"(,"colour":"red"})"),
       "job spec: colour: unknown field"},
      {Spec(0), "job spec: parallel.cp: must be in [1, 1024], got 0"},
  };
  for (const BadSpec& bad : bad_specs) {
    CommandResult r = cli({"submit", WriteSpec("bad.json", bad.text)});
    EXPECT_EQ(r.exit_code, 2) << bad.text;
    EXPECT_THAT(r.stderr_text, StartsWith("spindle: submit: " + bad.message)) << bad.text;
    EXPECT_EQ(std::count(r.stderr_text.begin(), r.stderr_text.end(), '\n'), 1) << r.stderr_text;
    grpc::ClientContext ctx;
    cluster_.Authorize(&ctx);
    v1::SubmitJobRequest req;
    req.set_spec_json(bad.text);
    v1::SubmitJobResponse resp;
    grpc::Status st = stub->Submit(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad.text;
    EXPECT_THAT(st.error_message(), StartsWith(bad.message));
    EXPECT_EQ(r.stderr_text, "spindle: submit: " + st.error_message() + "\n");
  }

  // Impossible plans: a CP degree the MLA heads cannot split, and a gang larger than the cluster.
  struct Impossible {
    std::string spec;
    std::string message;
  };
  const Impossible impossible[] = {
      {Spec(8, R"(,"mla_mode":"all2all")"),
       "job cannot run: parallel.mla_mode: all2all needs n_heads divisible by cp, but n_heads=4 "
       "and cp=8 (4 % 8 = 4); use allgather or a cp that divides 4"},
      {Spec(4),
       "job needs 4 cpu devices (world = dp*cp) but the 2 registered cpu workers have 2 in "
       "total"},
  };
  for (const Impossible& bad : impossible) {
    CommandResult r = cli({"submit", WriteSpec("impossible.json", bad.spec)});
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_EQ(r.stderr_text, "spindle: submit: " + bad.message + "\n");
    grpc::ClientContext ctx;
    cluster_.Authorize(&ctx);
    v1::SubmitJobRequest req;
    req.set_spec_json(bad.spec);
    v1::SubmitJobResponse resp;
    grpc::Status st = stub->Submit(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(st.error_message(), bad.message);
  }
  // `spindle plan` shows the same problem and exits 2.
  // (cp = 4 plans fine, but the two registered workers could never place its 4 ranks.)
  CommandResult plan = cli({"plan", dir_.File("impossible.json")});
  EXPECT_EQ(plan.exit_code, 2) << plan.stdout_text << plan.stderr_text;
  EXPECT_THAT(plan.stdout_text,
              HasSubstr("problems (1):\n  - job needs 4 cpu devices (world = dp*cp) but the 2 "
                        "registered cpu workers have 2 in total\n"));
  plan = cli({"plan", WriteSpec("cp8.json", impossible[0].spec)});
  EXPECT_EQ(plan.exit_code, 2);
  EXPECT_THAT(
      plan.stdout_text,
      HasSubstr("problems (1):\n  - parallel.mla_mode: all2all needs n_heads divisible by "
                "cp, but n_heads=4 and cp=8 (4 % 8 = 4); use allgather or a cp that divides "
                "4\n"));

  // None of it queued a job; a good spec still runs to the end.
  CommandResult list = cli({"list", "--output", "json"});
  EXPECT_EQ(list.exit_code, 0);
  EXPECT_EQ(list.stdout_text, "{\"jobs\":[]}\n");
  CommandResult ok = cli({"submit", WriteSpec("good.json", Spec(2)), "--wait"});
  EXPECT_EQ(ok.exit_code, 0) << ok.stdout_text << ok.stderr_text << cluster_.Logs();
  EXPECT_THAT(ok.stdout_text, StartsWith("submitted j-000001 (")) << ok.stdout_text;
  EXPECT_THAT(ok.stdout_text, HasSubstr("j-000001 succeeded")) << ok.stdout_text;
  // Cancelling it now changes nothing, and says so.
  CommandResult late = cli({"cancel", "j-000001"});
  EXPECT_EQ(late.exit_code, 0) << late.stderr_text;
  EXPECT_EQ(late.stdout_text, "j-000001 had already succeeded; nothing to cancel\n");
  CommandResult status = cli({"status", "j-000001", "--output", "json"});
  EXPECT_THAT(status.stdout_text, HasSubstr("\"state\":\"JOB_STATE_SUCCEEDED\""));
}

TEST_F(ClusterApiTest, RequestsWithoutTheTokenAreRefused) {
  cluster_.UsePlaintext();
  cluster_.UseToken("api-token");
  ASSERT_TRUE(cluster_.StartCoordinator({"--heartbeat_interval=0.2", "--heartbeat_timeout=2"}))
      << cluster_.Logs();
  ASSERT_TRUE(cluster_.StartWorker("w0", 1, trainer_));
  // A worker without the token (the empty --token_file overrides the harness's).
  ASSERT_TRUE(cluster_.StartWorker("w-no-token", 1, trainer_, {}, {"--token_file="}));
  ASSERT_TRUE(cluster_.WaitForWorkers(1)) << cluster_.Logs();

  const std::string spec = WriteSpec("good.json", Spec(1));
  CommandResult r = Cli({"submit", spec, "--coordinator", cluster_.address()});
  EXPECT_EQ(r.exit_code, 4);
  EXPECT_EQ(r.stderr_text,
            "spindle: submit: not authenticated: missing authorization metadata (expected "
            "\"Bearer <token>\") (set SPINDLE_TOKEN or --token-file)\n");
  r = Cli({"list", "--coordinator", cluster_.address(), "--token", "wrong"});
  EXPECT_EQ(r.exit_code, 4);
  EXPECT_EQ(r.stderr_text,
            "spindle: warning: --token shows the token to every user of this host (process list, "
            "shell history); set SPINDLE_TOKEN or use --token-file\n"
            "spindle: list: not authenticated: invalid bearer token (set SPINDLE_TOKEN or "
            "--token-file)\n");
  r = Cli({"workers", "--coordinator", cluster_.address()});
  EXPECT_EQ(r.exit_code, 4);

  auto channel = grpc::CreateChannel(cluster_.address(), grpc::InsecureChannelCredentials());
  {
    grpc::ClientContext ctx;
    v1::SubmitJobRequest req;
    req.set_spec_json(Spec(1));
    v1::SubmitJobResponse resp;
    grpc::Status st = v1::JobService::NewStub(channel)->Submit(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(st.error_message(), "missing authorization metadata (expected \"Bearer <token>\")");
  }
  // With the token everything works, and the worker without it never joined.
  r = Cli({"workers", "--coordinator", cluster_.address(), "--token-file", cluster_.token_file(),
           "--output", "json"});
  EXPECT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("\"worker_id\":\"w0\""));
  EXPECT_THAT(r.stdout_text, ::testing::Not(HasSubstr("w-no-token")));
  EXPECT_THAT(ReadFile(dir_.File("worker-w-no-token.log")), HasSubstr("missing authorization"));
  r = Cli({"submit", spec, "--wait", "--coordinator", cluster_.address(), "--token-file",
           cluster_.token_file()});
  EXPECT_EQ(r.exit_code, 0) << r.stdout_text << r.stderr_text << cluster_.Logs();
  EXPECT_THAT(r.stdout_text, HasSubstr("j-000001 succeeded"));
}

// Users and workers hold different tokens: a worker daemon given the users' token is refused,
// the one with the worker token runs a two-rank job whose trainers meet through the rendezvous
// service with the worker token, and the worker token cannot submit.
TEST_F(ClusterApiTest, WorkersAndUsersHoldDifferentTokens) {
  if (std::string(SPINDLE_TRAIN_BINARY).empty()) GTEST_SKIP() << "spindle-train not built";
  cluster_.UsePlaintext();
  cluster_.UseToken("user-token");
  cluster_.UseWorkerToken("worker-token");
  ASSERT_TRUE(cluster_.StartCoordinator({"--heartbeat_interval=0.2", "--heartbeat_timeout=2"}))
      << cluster_.Logs();
  ASSERT_TRUE(
      cluster_.StartWorker("w0", 2, SPINDLE_TRAIN_BINARY, {}, {"--advertise_host=127.0.0.1"}));
  ASSERT_TRUE(
      cluster_.StartWorker("w-user", 1, trainer_, {}, {"--token_file=" + cluster_.token_file()}));
  ASSERT_TRUE(cluster_.WaitForWorkers(1)) << cluster_.Logs();
  const std::string spec = WriteSpec(
      "dp2.json",
      R"({"name":"dp2","model":{"preset":"tiny"},"data":{"source":"synthetic:recall"},)"
      R"("seq_len":128,"parallel":{"cp":1,"dp":2},"train":{"steps":2},"resources":"cpu"})");
  CommandResult r = Cli({"submit", spec, "--coordinator", cluster_.address(), "--token-file",
                         cluster_.worker_token_file()});
  EXPECT_EQ(r.exit_code, 4);
  EXPECT_EQ(r.stderr_text,
            "spindle: submit: a worker token cannot call JobService (submit, cancel, list jobs); "
            "use a user's token\n");
  r = Cli({"submit", spec, "--wait", "--coordinator", cluster_.address(), "--token-file",
           cluster_.token_file()});
  EXPECT_EQ(r.exit_code, 0) << r.stdout_text << r.stderr_text << cluster_.Logs();
  EXPECT_THAT(r.stdout_text, HasSubstr("j-000001 succeeded"));
  EXPECT_EQ(cluster_.WorkerState("w-user"), "");
  EXPECT_THAT(ReadFile(dir_.File("worker-w-user.log")),
              HasSubstr("the users' token cannot call ClusterService or RendezvousService"));
}

TEST_F(ClusterApiTest, TlsOnBothPortsWithTheCaOnly) {
  MakeCertificates("");
  MakeCertificates("other-");
  cluster_.UsePlaintext();  // workers with tokens; TLS with the given certificate
  cluster_.UseTls(dir_.File("ca.pem"), dir_.File("server.pem"), dir_.File("server.key"));
  cluster_.UseSeparateWorkerPort();
  ASSERT_TRUE(cluster_.StartCoordinator({"--heartbeat_interval=0.2", "--heartbeat_timeout=2"}))
      << cluster_.Logs();
  ASSERT_NE(cluster_.address(), cluster_.worker_address());
  ASSERT_THAT(ReadFile(dir_.File("coordinator-1.log")), HasSubstr(", TLS"));
  ASSERT_TRUE(cluster_.StartWorker("w0", 1, trainer_));
  // A worker without the CA dials the same worker port in plaintext.
  ASSERT_TRUE(cluster_.StartWorker("w-plain", 1, trainer_, {}, {"--tls_ca_file="}));
  ASSERT_TRUE(cluster_.WaitForWorkers(1)) << cluster_.Logs();

  const std::string ca = dir_.File("ca.pem");
  const std::string spec = WriteSpec("good.json", Spec(1));
  // The CLI with the CA: workers, submit, watch to the end.
  CommandResult r =
      Cli({"workers", "--coordinator", cluster_.address(), "--tls-ca", ca, "--output", "json"});
  EXPECT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("\"worker_id\":\"w0\""));
  r = Cli({"submit", spec, "--wait", "--coordinator", cluster_.address(), "--tls-ca", ca});
  EXPECT_EQ(r.exit_code, 0) << r.stdout_text << r.stderr_text << cluster_.Logs();
  EXPECT_THAT(r.stdout_text, HasSubstr("j-000001 succeeded"));

  // Plaintext clients fail on both ports, and so does a CLI trusting another CA.
  for (const std::string& address : {cluster_.address(), cluster_.worker_address()}) {
    r = Cli({"list", "--coordinator", address, "--timeout", "3"});
    EXPECT_EQ(r.exit_code, 3) << address << ": " << r.stdout_text;
    EXPECT_THAT(r.stderr_text,
                StartsWith("spindle: list: cannot reach the coordinator at " + address + ": "));
    auto plain = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    v1::ListWorkersResponse resp;
    EXPECT_EQ(v1::ClusterService::NewStub(plain)
                  ->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp)
                  .error_code(),
              grpc::StatusCode::UNAVAILABLE)
        << address;
  }
  r = Cli({"list", "--coordinator", cluster_.address(), "--tls-ca", dir_.File("other-ca.pem"),
           "--timeout", "3"});
  EXPECT_EQ(r.exit_code, 3) << r.stdout_text;
  r = Cli({"list", "--coordinator", cluster_.address(), "--tls-ca", dir_.File("missing.pem")});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.stderr_text,
            "spindle: cannot read the --tls-ca file " + dir_.File("missing.pem") + "\n");

  // The plaintext worker never registered.
  r = Cli({"workers", "--coordinator", cluster_.address(), "--tls-ca", ca, "--output", "json"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.stdout_text, ::testing::Not(HasSubstr("w-plain")));
}

}  // namespace
}  // namespace spindle
