// spindle-train as a user runs it: every bad input (malformed spec, missing, truncated or
// out-of-vocabulary data, corrupt or mismatched checkpoint, unknown flag) ends with exit code 2,
// exactly one line on stderr naming the problem, and nothing written to the checkpoint directory.
// Jobs with resources "cuda" run only where they can: without the CUDA engine, or at a cp > 1 that
// does not divide n_heads (MLA has no allgather mode on CUDA), they are rejected the same way; on
// a CUDA build without a GPU they fail with one line (exit 1). --verify-only checks a job's layout
// in one process and prints one passing parity line (exit 0), or the skipped line where there is
// nothing to verify, writing no checkpoint; the same binary built with a broken Lightning
// AllGather (SPINDLE_TRAIN_FAULT_BINARY, tests/CMakeLists.txt) prints a failing line and exits 2
// with one line naming the worst tensors.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/subprocess.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

#ifndef SPINDLE_TRAIN_BINARY
#define SPINDLE_TRAIN_BINARY ""
#endif
#ifndef SPINDLE_TRAIN_FAULT_BINARY
#define SPINDLE_TRAIN_FAULT_BINARY ""
#endif

namespace spindle {
namespace {

class TrainBinaryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(SPINDLE_TRAIN_BINARY).empty()) GTEST_SKIP() << "spindle-train is not built";
    char tmpl[] = "/tmp/spindle-train-test-XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string p = dir_ + "/" + name;
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }
  std::string Job(const std::string& data, const std::string& model = R"({"preset": "tiny"})") {
    return Write("job.json", R"({"name": "j", "model": )" + model + R"(, "data": )" + data +
                                 R"(, "seq_len": 64, "train": {"steps": 2},
                                 "checkpoint": {"dir": ")" + dir_ + R"(/ckpt", "every": 1}})");
  }
  CommandResult Run(std::vector<std::string> args, const char* binary = SPINDLE_TRAIN_BINARY) {
    args.insert(args.begin(), binary);
    auto r = RunCommand(args, "", absl::Seconds(120));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : CommandResult{};
  }
  bool CheckpointDirExists() {
    struct stat st;
    return stat((dir_ + "/ckpt").c_str(), &st) == 0;
  }
  // One line on stderr, containing `what`; exit code 2; no checkpoint written.
  void ExpectRejected(const CommandResult& r, const std::string& what) {
    EXPECT_EQ(r.exit_code, 2) << r.stderr_text;
    EXPECT_EQ(std::count(r.stderr_text.begin(), r.stderr_text.end(), '\n'), 1) << r.stderr_text;
    EXPECT_NE(r.stderr_text.find(what), std::string::npos) << r.stderr_text;
    EXPECT_TRUE(r.stdout_text.empty()) << r.stdout_text;
  }
  std::string dir_;
};

TEST_F(TrainBinaryTest, BadInputsAreRejectedWithOneLineAndWriteNothing) {
  ExpectRejected(Run({"--job", Write("bad.json", R"({"name": "j", "seq_len": 64})")}),
                 "job spec: model: is required");
  ExpectRejected(Run({"--job", Job(R"({"source": "tokens:)" + dir_ + R"(/none.bin", "eos_id": 0})")}),
                 "none.bin");
  Write("odd.bin", std::string("\x01\x00\x02", 3));
  ExpectRejected(Run({"--job", Job(R"({"source": "tokens:)" + dir_ + R"(/odd.bin", "eos_id": 0})")}),
                 "is truncated");
  Write("oov.bin", std::string("\x01\x00\xff\x7f", 4));
  ExpectRejected(Run({"--job", Job(R"({"source": "tokens:)" + dir_ + R"(/oov.bin", "eos_id": 0})")}),
                 "token 32767 at index 1 is outside the vocabulary (model.vocab = 257)");
  // A usage mistake names the flag on the first line; the usage text follows it.
  CommandResult flag = Run({"--job", Job(R"({"source": "synthetic:recall"})"), "--bogus", "1"});
  EXPECT_EQ(flag.exit_code, 2);
  EXPECT_EQ(flag.stderr_text.substr(0, flag.stderr_text.find('\n')),
            "spindle-train: unknown flag --bogus");
  // Numbers out of range are named with their bound.
  const std::string recall = Job(R"({"source": "synthetic:recall"})");
  for (const auto& [args, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--threads", "-1"}, "--threads must be >= 0, got -1"},
           {{"--stop-at-step", "0"}, "--stop-at-step must be >= 1, got 0"},
           {{"--world", "0"}, "--world must be >= 1, got 0"},
           {{"--rank", "-2"}, "--rank must be >= 0, got -2"},
           {{"--threads", "two"}, "--threads must be an integer, got \"two\""},
           {{"--inject-outliers", "0.5"},
            "--inject-outliers must be a number in [1, 1e6], got \"0.5\""},
           {{"--inject-outliers", "nan"},
            "--inject-outliers must be a number in [1, 1e6], got \"nan\""}}) {
    std::vector<std::string> argv = {"--job", recall};
    argv.insert(argv.end(), args.begin(), args.end());
    CommandResult r = Run(argv);
    EXPECT_EQ(r.exit_code, 2) << message;
    EXPECT_EQ(r.stderr_text, "spindle-train: " + message + "\n");
    EXPECT_TRUE(r.stdout_text.empty()) << r.stdout_text;
  }
  EXPECT_FALSE(CheckpointDirExists());
}

// A checkpoint directory that cannot be written is found before the first step, not at the first
// checkpoint (which in a real job may be hours in).
TEST_F(TrainBinaryTest, UnwritableCheckpointDirIsRejectedBeforeTraining) {
  Write("afile", "not a directory");
  const std::string job = Write("job.json", R"({"name": "j", "model": {"preset": "tiny"},
      "data": {"source": "synthetic:copy"}, "seq_len": 64, "train": {"steps": 50},
      "checkpoint": {"dir": ")" + dir_ + R"(/afile/ckpt", "every": 40}})");
  ExpectRejected(Run({"--job", job}), "checkpoint: cannot create directory \"" + dir_ +
                                          "/afile/ckpt\": Not a directory");
}

TEST_F(TrainBinaryTest, CorruptOrMismatchedCheckpointIsRejectedAndLeftAlone) {
  const std::string job = Job(R"({"source": "synthetic:recall", "recall_gap": 16})");
  CommandResult ok = Run({"--job", job, "--stop-at-step", "1"});
  ASSERT_EQ(ok.exit_code, 0) << ok.stderr_text;
  ASSERT_TRUE(CheckpointDirExists());
  // Another model size resuming from this checkpoint directory.
  const std::string other =
      Job(R"({"source": "synthetic:recall", "recall_gap": 16})", R"({"preset": "tiny", "ffn_dim": 128})");
  ExpectRejected(Run({"--job", other}), "was written for a different model: model.ffn_dim is 176");
  // A flipped byte in the model file.
  const std::string model = dir_ + "/ckpt/step_00000001/model.safetensors";
  {
    std::fstream f(model, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(300);
    f.put('\x55');
  }
  struct stat before;
  ASSERT_EQ(stat(model.c_str(), &before), 0);
  ExpectRejected(Run({"--job", Job(R"({"source": "synthetic:recall", "recall_gap": 16})")}),
                 "model.safetensors\" is corrupt: checksum mismatch");
  ExpectRejected(Run({"--eval", "--job", job, "--checkpoint", dir_ + "/ckpt"}),
                 "checksum mismatch");
  // Nothing new was written: still exactly one checkpoint, the corrupt file untouched.
  int steps = 0;
  if (DIR* d = opendir((dir_ + "/ckpt").c_str())) {
    while (dirent* e = readdir(d)) steps += std::string(e->d_name).rfind("step_", 0) == 0;
    closedir(d);
  }
  EXPECT_EQ(steps, 1);
  struct stat after;
  ASSERT_EQ(stat(model.c_str(), &after), 0);
  EXPECT_EQ(after.st_mtime, before.st_mtime);
  EXPECT_EQ(after.st_size, before.st_size);
}

// A checkpoint that cannot be written (here under a file-size limit, as on a full disk) fails the
// run with the cause named and leaves no partial files behind; the next writer also removes what a
// writer killed mid-checkpoint left.
TEST_F(TrainBinaryTest, AFailedCheckpointWriteLeavesNoPartialFiles) {
  const std::string job = Job(R"({"source": "synthetic:recall", "recall_gap": 16})");
  const std::string ckpt = dir_ + "/ckpt";
  auto entries = [&] {
    std::set<std::string> out;
    if (DIR* d = opendir(ckpt.c_str())) {
      while (dirent* e = readdir(d))
        if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") out.insert(e->d_name);
      closedir(d);
    }
    return out;
  };
  // SIGXFSZ ignored (kept through exec), so a write past 64 KiB fails with EFBIG.
  auto limited = RunCommand({"bash", "-c", "trap '' XFSZ; ulimit -f 64; exec \"$0\" --job \"$1\"",
                             SPINDLE_TRAIN_BINARY, job},
                            "", absl::Seconds(120));
  ASSERT_TRUE(limited.ok()) << limited.status();
  EXPECT_EQ(limited->exit_code, 1) << limited->stderr_text;
  EXPECT_NE(limited->stderr_text.find("model.safetensors\": File too large"), std::string::npos)
      << limited->stderr_text;
  EXPECT_EQ(entries(), std::set<std::string>({".writer.lock"}));

  ASSERT_EQ(mkdir((ckpt + "/.tmp.step_00000009.999999").c_str(), 0755), 0);
  Write("ckpt/.tmp.step_00000009.999999/model.safetensors", std::string(4096, 'x'));
  Write("ckpt/.latest.999999", "step_00000009");
  CommandResult ok = Run({"--job", job});
  EXPECT_EQ(ok.exit_code, 0) << ok.stderr_text;
  EXPECT_EQ(entries(),
            std::set<std::string>(
                {".writer.lock", "commits.log", "latest", "step_00000001", "step_00000002"}));
}

// SIGTERM (a worker stopping the rank) while a background checkpoint write is in flight: the
// write finishes (its checkpoint is complete and `latest`), then the process ends by SIGTERM.
TEST_F(TrainBinaryTest, SigtermLetsTheCheckpointWriteInFlightFinish) {
  const std::string job = Write("job.json", R"({"name": "j", "model": {"preset": "tiny"},
                      "data": {"source": "synthetic:recall", "recall_gap": 16}, "seq_len": 64,
                      "train": {"steps": 100000}, "checkpoint": {"dir": ")" +
                                                dir_ + R"(/ckpt", "every": 5}})");
  SubprocessOptions o;
  o.stdout_path = dir_ + "/out";
  o.stderr_path = dir_ + "/err";
  // Each file of a checkpoint takes 700 ms to write: 2.1 s in flight.
  o.env = {{"SPINDLE_CHECKPOINT_PAUSE_MS", "700"}};
  auto p = Subprocess::Spawn({SPINDLE_TRAIN_BINARY, "--job", job}, o);
  ASSERT_TRUE(p.ok()) << p.status();
  auto in_flight = [&] {
    if (DIR* d = opendir((dir_ + "/ckpt").c_str())) {
      while (dirent* e = readdir(d)) {
        if (std::string(e->d_name).rfind(".tmp.step_00000005.", 0) == 0) {
          closedir(d);
          return true;
        }
      }
      closedir(d);
    }
    return false;
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!in_flight() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(in_flight());
  ASSERT_TRUE((*p)->Signal(SIGTERM).ok());
  absl::StatusOr<int> code = (*p)->Wait();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 128 + SIGTERM);
  std::ifstream latest(dir_ + "/ckpt/latest");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step_00000005");
  struct stat st;
  EXPECT_EQ(stat((dir_ + "/ckpt/step_00000005/state.json").c_str(), &st), 0);
}

TEST_F(TrainBinaryTest, CudaJobsRunOnlyWhereTheyCan) {
  auto cuda_job = [&](int cp, const std::string& model) {
    return Write("cuda.json", absl::StrCat(R"({"name": "j", "model": )", model, R"(,
        "data": {"source": "synthetic:recall", "recall_gap": 16}, "seq_len": 192,
        "parallel": {"cp": )",
                                           cp, R"(}, "train": {"steps": 2},
        "checkpoint": {"dir": ")",
                                           dir_, R"(/ckpt", "every": 1}, "resources": "cuda"})"));
  };
  // 2 heads of 48: a Lightning head size the CUDA kernels do not run.
  CommandResult dh48 = Run({"--job", cuda_job(1, R"({"preset": "tiny", "d_model": 96,
                            "n_heads": 2})")});
  // Refused by the plan, before any engine is asked, with or without the CUDA engine.
  ExpectRejected(dh48,
                 "spindle-train: the job cannot run: model: resources \"cuda\" cannot run "
                 "Lightning head size d_model/n_heads = 48 (the CUDA kernels take 64, 128, or an "
                 "even size up to 32); use resources \"cpu\"");
  EXPECT_FALSE(CheckpointDirExists());
  CommandResult one = Run({"--job", cuda_job(1, R"({"preset": "tiny"})")});
#ifdef SPINDLE_TRAIN_HAS_CUDA_ENGINE
  if (one.exit_code == 0) {
    // A GPU is present: the job trained, with device memory in its step events.
    EXPECT_NE(one.stdout_text.find("\"mem_peak_bytes\""), std::string::npos) << one.stdout_text;
    EXPECT_TRUE(CheckpointDirExists());
  } else {
    EXPECT_EQ(one.exit_code, 1) << one.stderr_text;
    EXPECT_EQ(std::count(one.stderr_text.begin(), one.stderr_text.end(), '\n'), 1)
        << one.stderr_text;
    EXPECT_NE(one.stderr_text.find("but no CUDA device is usable here"), std::string::npos)
        << one.stderr_text;
    EXPECT_TRUE(one.stdout_text.empty()) << one.stdout_text;
    EXPECT_FALSE(CheckpointDirExists());
  }
#else
  ExpectRejected(one, "spindle-train: trainer: the job asks for resources \"cuda\" but this "
                      "build has no CUDA engine");
  EXPECT_FALSE(CheckpointDirExists());
#endif
}

// A tiny job at cp = 4 in the hybrid modes (Ulysses groups of 2) and dp = 2 (eight ranks as
// threads), with a checkpoint directory that the check must leave alone.
std::string VerifyJob(TrainBinaryTest* t, const std::string& parallel,
                      const std::string& resources = "cpu") {
  (void)t;
  return absl::StrCat(R"({"name": "v", "model": {"preset": "tiny"},
      "data": {"source": "synthetic:copy", "recall_gap": 40}, "seq_len": 256,
      "parallel": )",
                      parallel, R"(, "train": {"steps": 5, "seed": 11},
      "checkpoint": {"dir": "CKPT", "every": 1}, "resources": ")",
                      resources, R"("})");
}

nlohmann::json OneEventLine(const CommandResult& r) {
  EXPECT_EQ(std::count(r.stdout_text.begin(), r.stdout_text.end(), '\n'), 1) << r.stdout_text;
  return nlohmann::json::parse(r.stdout_text, nullptr, false);
}

TEST_F(TrainBinaryTest, VerifyOnlyChecksTheLayoutAndTrainsNothing) {
  auto job = [&](const std::string& parallel, const std::string& resources = "cpu") {
    std::string text = VerifyJob(this, parallel, resources);
    text.replace(text.find("CKPT"), 4, dir_ + "/ckpt");
    return Write("verify.json", text);
  };
  CommandResult ok = Run(
      {"--verify-only", "--job", job(R"({"cp": 4, "dp": 2, "ulysses": 2, "lightning_mode": "hybrid",
                                  "mla_mode": "hybrid"})")});
  EXPECT_EQ(ok.exit_code, 0) << ok.stderr_text;
  nlohmann::json e = OneEventLine(ok);
  EXPECT_EQ(e["event"], "parity");
  EXPECT_EQ(e["passed"], true) << e.dump();
  EXPECT_EQ(e["layout"], "cp=4 dp=2 ep=1 lightning=hybrid mla=hybrid ulysses=2");
  EXPECT_EQ(e["tolerance"], 1e-3);
  EXPECT_LE(e["max_excess"].get<double>(), 1.0);
  EXPECT_EQ(e["tokens"], 256);  // 2 x 4 chunks of the job's 32 tokens
  EXPECT_FALSE(CheckpointDirExists());
  // A GPU job's layout, checked on the CPU engine with its bf16 storage emulated.
  CommandResult gpu = Run({"--verify-only", "--job", job(R"({"cp": 2})", "cuda")});
  EXPECT_EQ(gpu.exit_code, 0) << gpu.stderr_text;
  e = OneEventLine(gpu);
  EXPECT_EQ(e["passed"], true) << e.dump();
  EXPECT_EQ(e["layout"], "cp=2 dp=1 ep=1 lightning=all2all mla=all2all");
  EXPECT_EQ(e["tolerance"], 0.1);
  // cp = 1, ep = 1: nothing to verify.
  CommandResult one = Run({"--verify-only", "--job", job(R"({"cp": 1, "dp": 2})")});
  EXPECT_EQ(one.exit_code, 0) << one.stderr_text;
  e = OneEventLine(one);
  EXPECT_EQ(e["skipped"], true) << e.dump();
  // A plan that cannot run is refused as a training run would be.
  ExpectRejected(Run({"--verify-only", "--job", job(R"({"cp": 3, "mla_mode": "all2all"})")}),
                 "all2all needs n_heads divisible by cp");
  EXPECT_FALSE(CheckpointDirExists());
}

TEST_F(TrainBinaryTest, VerifyOnlyFailsABrokenLayoutWithExitCode2) {
  if (std::string(SPINDLE_TRAIN_FAULT_BINARY).empty())
    GTEST_SKIP() << "the broken-layout spindle-train is not built";
  std::string text = VerifyJob(this, R"({"cp": 2, "lightning_mode": "allgather"})");
  text.replace(text.find("CKPT"), 4, dir_ + "/ckpt");
  CommandResult bad =
      Run({"--verify-only", "--job", Write("bad.json", text)}, SPINDLE_TRAIN_FAULT_BINARY);
  EXPECT_EQ(bad.exit_code, 2) << bad.stderr_text;
  nlohmann::json e = OneEventLine(bad);
  EXPECT_EQ(e["passed"], false) << e.dump();
  EXPECT_GT(e["max_excess"].get<double>(), 1.0);
  EXPECT_EQ(std::count(bad.stderr_text.begin(), bad.stderr_text.end(), '\n'), 1) << bad.stderr_text;
  EXPECT_EQ(bad.stderr_text.rfind("spindle-train: parity: the layout cp=2 dp=1 ep=1 "
                                  "lightning=allgather mla=all2all does not compute what cp=1 "
                                  "ep=1 on one rank computes",
                                  0),
            0u)
      << bad.stderr_text;
  EXPECT_NE(bad.stderr_text.find(".la."), std::string::npos) << bad.stderr_text;
  EXPECT_FALSE(CheckpointDirExists());
}

}  // namespace
}  // namespace spindle
