// The `spindle` CLI: usage errors, bad specs, unreachable coordinator, offline plan and exit
// codes, end to end against a real coordinator on 127.0.0.1 for submit/list/status/cancel.
#include "cli/cli.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_split.h"
#include "common/job_spec.h"
#include "coordinator/coordinator_server.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

struct Result {
  int code;
  std::string out, err;
};

Result RunSpindle(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
  std::ostringstream out, err;
  int code = RunCli(args, env, out, err, false);
  return {code, out.str(), err.str()};
}

class CliTest : public ::testing::Test {
 protected:
  std::string WriteSpec(const std::string& name, const std::string& text) {
    std::string path = dir_.File(name);
    std::ofstream(path) << text;
    return path;
  }
  // A coordinator with token "tok" over the SQLite file `db` in the test's directory, and the
  // environment that points the CLI at it.
  std::unique_ptr<CoordinatorServer> StartCoordinator(const std::string& db,
                                                      std::map<std::string, std::string>* env) {
    CoordinatorConfig cfg;
    cfg.listen = "127.0.0.1:0";
    cfg.db_path = dir_.File(db);
    cfg.token = "tok";
    auto server = CoordinatorServer::Start(cfg);
    EXPECT_TRUE(server.ok()) << server.status();
    if (!server.ok()) return nullptr;
    *env = {{"SPINDLE_COORDINATOR", absl::StrCat("127.0.0.1:", (*server)->client_port())},
            {"SPINDLE_TOKEN", "tok"}};
    return *std::move(server);
  }
  testing::TempDir dir_;
};

TEST_F(CliTest, HelpDocumentsExitCodes) {
  Result r = RunSpindle({"--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("3  coordinator unreachable"), std::string::npos);
  EXPECT_NE(r.out.find("SPINDLE_COORDINATOR"), std::string::npos);
}

TEST_F(CliTest, UsageErrors) {
  Result r = RunSpindle({});
  EXPECT_EQ(r.code, kExitUsage);
  r = RunSpindle({"frobnicate"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err, "spindle: unknown command \"frobnicate\" (run spindle --help for the list)\n");
  r = RunSpindle({"list", "--bogus"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err, "spindle: unknown flag --bogus (run spindle --help)\n");
  r = RunSpindle({"list", "--output", "yaml"});
  EXPECT_EQ(r.err, "spindle: --output must be text or json, got \"yaml\" (run spindle --help)\n");
  r = RunSpindle({"workers", "w1"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err, "spindle: workers: takes no arguments, got \"w1\" (run spindle --help)\n");
  r = RunSpindle({"list", "--coordinator", "127.0.0.1:70700"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err,
            "spindle: --coordinator must be HOST:PORT with a port in [0, 65535], got "
            "\"127.0.0.1:70700\" (run spindle --help)\n");
  r = RunSpindle({"status"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err, "spindle: status: expected exactly one JOB_ID (spindle status JOB_ID)\n");
  r = RunSpindle({"submit", dir_.File("missing.json")});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err, "spindle: submit: cannot read job spec " + dir_.File("missing.json") + "\n");
  std::filesystem::create_directories(dir_.File("specs"));
  r = RunSpindle({"plan", dir_.File("specs"), "--offline"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err,
            "spindle: plan: cannot read job spec " + dir_.File("specs") + ": it is a directory\n");
  r = RunSpindle({"list", "--tls-ca", dir_.File("missing.pem")});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err, "spindle: cannot read the --tls-ca file " + dir_.File("missing.pem") + "\n");
  const std::string junk = WriteSpec("junk.pem", "not a certificate\n");
  r = RunSpindle({"list", "--tls-ca", junk});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err, "spindle: the --tls-ca file " + junk +
                       " holds no PEM certificate (no -----BEGIN CERTIFICATE----- line)\n");
}

TEST_F(CliTest, BadSpecNamesTheField) {
  std::string path = WriteSpec("bad.json", R"({"name": "x", "model": {"preset": "tiny"},
      "data": {"source": "synthetic:recall"}, "seq_len": 256, "train": {"lr": -1}})");
  Result r = RunSpindle({"submit", path, "--coordinator", "127.0.0.1:1"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err.rfind("spindle: submit: job spec: train.lr", 0), 0u) << r.err;
}

TEST_F(CliTest, UnreachableCoordinator) {
  Result r = RunSpindle({"list", "--timeout", "2"}, {{"SPINDLE_COORDINATOR", "127.0.0.1:1"}});
  EXPECT_EQ(r.code, kExitUnreachable);
  EXPECT_EQ(r.err.rfind("spindle: list: cannot reach the coordinator at 127.0.0.1:1: ", 0), 0u)
      << r.err;
}

TEST_F(CliTest, PlanOfflineListsProblemsAndExitsTwo) {
  std::string good = WriteSpec("good.json", testing::SpecJson(2, 1));
  Result r = RunSpindle({"plan", good, "--offline"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("  lightning    3 layers  all2all    default: cp=2 <= n_heads=4 and 4 % 2 == 0"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("ok: the job can run"), std::string::npos);
  std::string bad = WriteSpec("bad.json", testing::SpecJson(8, 1, 0, 3,
                                                            R"(, "mla_mode": "all2all")"));
  r = RunSpindle({"plan", bad, "--coordinator", "127.0.0.1:1"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_NE(r.err.find("unreachable; planning offline"), std::string::npos);
  EXPECT_NE(r.out.find("problems (1):\n  - parallel.mla_mode: all2all needs n_heads divisible "
                       "by cp, but n_heads=4 and cp=8"),
            std::string::npos)
      << r.out;
  r = RunSpindle({"plan", bad, "--offline", "--output", "json"});
  EXPECT_NE(r.out.find("\"ok\":false"), std::string::npos) << r.out;
}

#ifndef SPINDLE_TRAIN_BINARY
#define SPINDLE_TRAIN_BINARY ""
#endif
#ifndef SPINDLE_TRAIN_FAULT_BINARY
#define SPINDLE_TRAIN_FAULT_BINARY ""
#endif

// plan --verify: after the plan, the plan's layout is checked on this machine by spindle-train
// --verify-only (SPINDLE_TRAIN_BINARY), which prints the parity table (exit code 0), or, with a
// trainer built with a broken Lightning AllGather, the failing tensors (exit code 2). A trainer
// that cannot be run, a plan with problems and --verify on another command are named.
TEST_F(CliTest, PlanVerifyChecksThePlannedLayoutThroughTheTrainer) {
  if (std::string(SPINDLE_TRAIN_BINARY).empty()) GTEST_SKIP() << "spindle-train is not built";
  const std::string spec =
      WriteSpec("verify.json", testing::SpecJson(2, 1, 0, 3, R"(, "lightning_mode": "allgather")"));
  const std::map<std::string, std::string> env = {{"SPINDLE_TRAIN_BINARY", SPINDLE_TRAIN_BINARY}};
  Result r = RunSpindle({"plan", spec, "--offline", "--verify"}, env);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("ok: the job can run\nparity: passed: cp=2 dp=1 ep=1 lightning=allgather "
                       "mla=all2all against cp=1 ep=1 on one rank on a 256-token slice of the "
                       "job's data (checked here on the CPU engine)\n"),
            std::string::npos)
      << r.out;
  EXPECT_NE(
      r.out.find("  tensor                                 rel error       noise     / bound\n"),
      std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("<- over"), std::string::npos) << r.out;
  // JSON: the plan's line, then the trainer's parity line.
  r = RunSpindle({"plan", spec, "--offline", "--verify", "--output", "json"}, env);
  EXPECT_EQ(r.code, 0) << r.err;
  const std::vector<std::string> lines = absl::StrSplit(r.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u) << r.out;
  const nlohmann::json parity = nlohmann::json::parse(lines[1]);
  EXPECT_EQ(parity["event"], "parity");
  EXPECT_EQ(parity["passed"], true);
  // A layout that does not compute the model.
  if (!std::string(SPINDLE_TRAIN_FAULT_BINARY).empty()) {
    r = RunSpindle({"plan", spec, "--offline", "--verify"},
                   {{"SPINDLE_TRAIN_BINARY", SPINDLE_TRAIN_FAULT_BINARY}});
    EXPECT_EQ(r.code, kExitUsage) << r.err;
    EXPECT_NE(r.out.find("parity: FAILED: cp=2 dp=1 ep=1 lightning=allgather mla=all2all"),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find(".la."), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("<- over"), std::string::npos) << r.out;
  }
  r = RunSpindle({"plan", spec, "--offline", "--verify"},
                 {{"SPINDLE_TRAIN_BINARY", dir_.File("no-such-trainer")}});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err.rfind("spindle: plan --verify: cannot run " + dir_.File("no-such-trainer"), 0),
            0u)
      << r.err;
  EXPECT_NE(r.err.find("set SPINDLE_TRAIN_BINARY to the spindle-train binary"), std::string::npos)
      << r.err;
  // A plan with problems is not verified.
  const std::string bad =
      WriteSpec("bad.json", testing::SpecJson(8, 1, 0, 3, R"(, "mla_mode": "all2all")"));
  r = RunSpindle({"plan", bad, "--offline", "--verify"}, env);
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.out.find("parity:"), std::string::npos) << r.out;
  r = RunSpindle({"list", "--verify"}, env);
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err, "spindle: list: --verify applies to plan only\n");
}

// The Ring and hybrid modes: their groups, reasons and bytes per step in the plan.
TEST_F(CliTest, PlanShowsTheRingAndHybridModes) {
  std::string spec =
      WriteSpec("hybrid.json", testing::SpecJson(8, 1, 0, 3,
                                                 R"(, "ulysses": 2, "lightning_mode": "hybrid",
                                          "mla_mode": "hybrid")"));
  Result r = RunSpindle({"plan", spec, "--offline"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("  hybrid modes: Ulysses groups of 2 ranks x 4 groups\n"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("  mla          1 layers  hybrid u=2  forced by the spec (parallel.mla_mode "
                       "= hybrid): Ulysses over groups of 2 ranks, Ring across the 4 groups"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("sends 144.0 KiB per rank and step (the ring moves latent)"),
            std::string::npos)
      << r.out;
  r = RunSpindle({"plan", spec, "--offline", "--output", "json"});
  EXPECT_NE(r.out.find("\"ulysses\":\"2\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"mode\":\"CP_MODE_HYBRID\""), std::string::npos) << r.out;
}

// --device-memory plans offline against a device of that size, which also sizes recompute "auto"
// (the 1b model at 128K tokens on an H200-sized GPU: 8 of 16 layers), and names the longest
// seq_len that fits, with and without the layer inputs offloaded.
TEST_F(CliTest, PlanAgainstAGivenDeviceSizesAutoRecompute) {
  std::string spec = WriteSpec("long.json", R"({"name": "long", "model": {"preset": "1b"},
      "data": {"source": "synthetic:recall"}, "seq_len": 131072,
      "train": {"recompute": "auto"}, "resources": "cuda"})");
  Result r = RunSpindle({"plan", spec, "--device-memory", "139.8"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(
      r.out.find("memory per rank (estimate, the first 8 of 16 layers recompute): 121.80 GiB"),
      std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("  device memory: 139.80 GiB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  longest seq_len that fits it with every layer recomputing (this cp and "
                       "modes): 761856 (1112064 with train.offload = true)\n"),
            std::string::npos)
      << r.out;
  r = RunSpindle({"plan", spec, "--offline"});
  EXPECT_NE(r.out.find("every layer recomputes"), std::string::npos) << r.out;
  r = RunSpindle({"plan", spec, "--device-memory", "0"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_NE(r.err.find("--device-memory must be a positive number of GiB, got \"0\""),
            std::string::npos)
      << r.err;
}

// Every example job spec under examples/ is valid and plans without problems on the devices it
// is for: a "cuda" job on one H200 (139.8 GiB), a "cpu" job offline (no memory limit); the GPU
// examples are the long-context jobs measured in bench/RESULTS_GPU.md.
TEST_F(CliTest, EveryExampleJobPlansOnItsDevice) {
  const std::filesystem::path examples = std::filesystem::path(SPINDLE_SOURCE_DIR) / "examples";
  int cuda_jobs = 0, cpu_jobs = 0;
  for (const auto& entry : std::filesystem::directory_iterator(examples)) {
    if (entry.path().extension() != ".json") continue;
    std::ifstream in(entry.path());
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const bool cuda = text.find("\"resources\": \"cuda\"") != std::string::npos;
    (cuda ? cuda_jobs : cpu_jobs) += 1;
    Result r = cuda ? RunSpindle({"plan", entry.path().string(), "--device-memory", "139.8"})
                    : RunSpindle({"plan", entry.path().string(), "--offline"});
    EXPECT_EQ(r.code, 0) << entry.path() << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("ok: the job can run"), std::string::npos) << entry.path() << "\n"
                                                                    << r.out;
  }
  EXPECT_GE(cuda_jobs, 2);
  EXPECT_GE(cpu_jobs, 1);
}

TEST_F(CliTest, EndToEndAgainstCoordinator) {
  std::map<std::string, std::string> env;
  auto server = StartCoordinator("cli.db", &env);
  ASSERT_NE(server, nullptr);
  std::string spec = WriteSpec("job.json", testing::SpecJson(2, 1));
  Result r = RunSpindle({"submit", spec}, env);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.substr(0, 28), "submitted j-000001 (queued)\n");
  r = RunSpindle({"list"}, env);
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("j-000001"), std::string::npos);
  r = RunSpindle({"status", "j-000001", "--output", "json"}, env);
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("\"state\":\"JOB_STATE_QUEUED\""), std::string::npos) << r.out;
  r = RunSpindle({"status", "j-000042"}, env);
  EXPECT_EQ(r.code, kExitNotFound);
  EXPECT_EQ(r.err, "spindle: status: job j-000042 not found\n");
  r = RunSpindle({"cancel", "j-000001"}, env);
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, "j-000001 cancelled\n");
  r = RunSpindle({"watch", "j-000001"}, env);
  EXPECT_EQ(r.code, kExitJobFailed);
  EXPECT_NE(r.out.find("j-000001 cancelled: cancelled by admin"), std::string::npos) << r.out;
  env["SPINDLE_TOKEN"] = "nope";
  r = RunSpindle({"list"}, env);
  EXPECT_EQ(r.code, kExitNotFound);
  EXPECT_EQ(r.err,
            "spindle: list: not authenticated: invalid bearer token (set SPINDLE_TOKEN or "
            "--token-file)\n");

  // From a file (which wins over SPINDLE_TOKEN); on the command line it works, with a warning.
  const std::string token_file = dir_.File("token");
  std::ofstream(token_file) << "tok\n";
  r = RunSpindle({"list", "--token-file", token_file}, env);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  r = RunSpindle({"list", "--token", "tok"}, env);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err,
            "spindle: warning: --token shows the token to every user of this host (process list, "
            "shell history); set SPINDLE_TOKEN or use --token-file\n");
  r = RunSpindle({"list", "--token-file", dir_.File("missing")}, env);
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err, "spindle: --token-file: cannot read " + dir_.File("missing") + "\n");
}

// An elastic spec: `spindle plan` lists the layout each world of its range would take, and
// `spindle status` the range beside the world the job runs at.
TEST_F(CliTest, PlanAndStatusShowTheElasticRange) {
  const std::string spec = WriteSpec("elastic.json", R"({"name": "el", "model": {"preset": "tiny"},
      "data": {"source": "synthetic:recall"}, "seq_len": 1024,
      "parallel": {"cp": 4, "elastic": {"min_world": 2, "wait_s": 30}},
      "checkpoint": {"dir": "/tmp/el-cli"}})");
  Result r = RunSpindle({"plan", spec, "--offline"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(
      r.out.find("elastic: world 2..4; after a lost worker it waits 30 s for a replacement, "
                 "then resumes at the largest world it can place; grows at a checkpoint "
                 "(batch \"keep\")\n"
                 "  world 4: as planned above\n"
                 "  world 3: does not run (no layout of world 3 runs: cp x dp 3 x 1: seq_len: "
                 "1024 is not divisible by 2*cp = 6"),
      std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("  world 2: world 4 -> 2: cp x dp 4 x 1 -> 2 x 1; tokens per step kept at "
                       "1024 (parallel.elastic.batch \"keep\")\n"),
            std::string::npos)
      << r.out;

  std::map<std::string, std::string> env;
  auto server = StartCoordinator("el.db", &env);
  ASSERT_NE(server, nullptr);
  r = RunSpindle({"submit", spec}, env);
  ASSERT_EQ(r.code, 0) << r.err;
  r = RunSpindle({"status", "j-000001"}, env);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(", world 4 (cp=4 dp=1), elastic 2..4 (submitted at 4, batch \"keep\")\n"),
            std::string::npos)
      << r.out;
}

TEST_F(CliTest, SubmitMakesRelativePathsAbsolute) {
  CoordinatorConfig cfg;
  cfg.listen = "127.0.0.1:0";
  cfg.db_path = dir_.File("paths.db");
  auto server = CoordinatorServer::Start(cfg);
  ASSERT_TRUE(server.ok()) << server.status();
  std::map<std::string, std::string> env = {
      {"SPINDLE_COORDINATOR", absl::StrCat("127.0.0.1:", (*server)->client_port())}};
  std::string spec = testing::SpecJson(1, 1);
  spec.replace(spec.find("/tmp/ck"), 7, "runs/../ck");
  spec.replace(spec.find("synthetic:recall"), 16, "text:corpus.txt");
  Result r = RunSpindle({"submit", WriteSpec("rel.json", spec)}, env);
  ASSERT_EQ(r.code, 0) << r.err;
  JobView job;
  ASSERT_TRUE((*server)->manager()->GetJob("j-000001", false, &job).ok());
  const std::string cwd = std::filesystem::current_path().string();
  auto stored = nlohmann::json::parse(job.record.spec_json);
  EXPECT_EQ(stored["checkpoint"]["dir"], cwd + "/ck");
  EXPECT_EQ(stored["data"]["source"], "text:" + cwd + "/corpus.txt");
}

// An FP8 job on "cuda" whose widths cuBLASLt's FP8 GEMMs cannot take is refused by `spindle plan`
// (exit 2) and by the coordinator at submit, each naming the width: before placement, never at
// the trainer's start.
TEST_F(CliTest, Fp8ShapeJobIsRefusedByPlanAndSubmitNamingTheWidth) {
  std::string spec = testing::SpecJson(1, 1);
  spec.replace(spec.find(R"({"preset": "tiny"})"), 18, R"({"preset": "tiny", "d_model": 72})");
  spec.replace(spec.find(R"("resources": "cpu")"), 18, R"("resources": "cuda")");
  spec.replace(spec.find(R"("train": {"steps": 10})"), 22,
               R"("train": {"steps": 10, "precision": "fp8"})");
  const std::string path = WriteSpec("fp8.json", spec);
  const std::string width =
      "train.precision: \"fp8\" on resources \"cuda\": layers.0.la.qkv.weight is 216 x 72, and "
      "cuBLASLt's FP8 GEMMs need widths that are multiples of 16";
  Result r = RunSpindle({"plan", path, "--offline"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_NE(r.out.find(width), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("ok: the job can run"), std::string::npos) << r.out;

  CoordinatorConfig cfg;
  cfg.listen = "127.0.0.1:0";
  cfg.db_path = dir_.File("fp8.db");
  auto server = CoordinatorServer::Start(cfg);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::map<std::string, std::string> env = {
      {"SPINDLE_COORDINATOR", absl::StrCat("127.0.0.1:", (*server)->client_port())}};
  r = RunSpindle({"plan", path}, env);
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_NE(r.out.find(width), std::string::npos) << r.out;
  r = RunSpindle({"submit", path}, env);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("job cannot run: " + width), std::string::npos) << r.err;
  JobView job;
  EXPECT_FALSE((*server)->manager()->GetJob("j-000001", false, &job).ok()) << "nothing stored";
}

// `spindle plan` and `spindle submit` parse the spec once in the CLI's process (the plan, its
// documents, --verify's planned spec and the request all come from that one parse).
TEST_F(CliTest, PlanAndSubmitParseTheSpecOnce) {
  const std::string path = WriteSpec("once.json", testing::SpecJson(2, 1));
  int64_t before = JobSpecParsesForTesting();
  Result r = RunSpindle({"plan", path, "--offline"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(JobSpecParsesForTesting() - before, 1);
  before = JobSpecParsesForTesting();
  r = RunSpindle({"submit", path, "--coordinator", "127.0.0.1:1"});
  EXPECT_NE(r.code, 0);  // nobody listens; the spec was parsed before trying
  EXPECT_EQ(JobSpecParsesForTesting() - before, 1);
}

// The CLI measures the documents of a data file it can read (data.doc_span, a sample of the
// file) and sends them with the spec, so that the coordinator's plan counts attention over them;
// a file it cannot read is named and left to the planner's worst case.
TEST_F(CliTest, SubmitAndPlanMeasureTheDataFilesDocuments) {
  CoordinatorConfig cfg;
  cfg.listen = "127.0.0.1:0";
  cfg.db_path = dir_.File("docs.db");
  auto server = CoordinatorServer::Start(cfg);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::map<std::string, std::string> env = {
      {"SPINDLE_COORDINATOR", absl::StrCat("127.0.0.1:", (*server)->client_port())}};
  // Paragraphs of 30 letters: 30 + '\n' + EOS = 32 tokens, 8 to a sequence of 256.
  std::string text;
  for (int i = 0; i < 64; ++i) text += std::string(30, 'a' + i % 26) + "\n\n";
  std::ofstream(dir_.File("corpus.txt")) << text;
  std::string spec = testing::SpecJson(2, 1);
  spec.replace(spec.find("synthetic:recall"), 16, "text:" + dir_.File("corpus.txt"));
  const std::string path = WriteSpec("docs.json", spec);
  Result r = RunSpindle({"plan", path, "--offline"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("attention over documents of span 32 tokens (data.doc_span)"),
            std::string::npos)
      << r.out;
  r = RunSpindle({"submit", path}, env);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  JobView job;
  ASSERT_TRUE((*server)->manager()->GetJob("j-000001", false, &job).ok());
  EXPECT_EQ(nlohmann::json::parse(job.record.spec_json)["data"]["doc_span"], 32.0);

  std::string unreadable = testing::SpecJson(2, 1);
  unreadable.replace(unreadable.find("synthetic:recall"), 16, "text:" + dir_.File("none.txt"));
  unreadable = testing::WithCheckpointDir(unreadable, "/tmp/ck-other");
  r = RunSpindle({"submit", WriteSpec("none.json", unreadable)}, env);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("spindle: submit: documents not measured (data: cannot open \"" +
                       dir_.File("none.txt") + "\""),
            std::string::npos)
      << r.err;
  ASSERT_TRUE((*server)->manager()->GetJob("j-000002", false, &job).ok());
  EXPECT_FALSE(nlohmann::json::parse(job.record.spec_json)["data"].contains("doc_span"));
}

}  // namespace
}  // namespace spindle
