// bench_checkpoint: the step-time overhead of checkpointing, on the CPU engine. The same job (one
// rank, synthetic recall data) runs with no checkpoints, with synchronous checkpoints
// (checkpoint.async false: the step writes and fsyncs them itself) and with background ones
// (checkpoint.async true: the step snapshots the state into host memory, a thread writes it),
// every `--every` steps into a fresh directory on `--dir`'s volume. The time per step is measured
// from the first step's event to the last one's, so the checkpoints inside the run (every one but
// the final) are in it; modes alternate within each repeat and the median is shown. The table adds,
// per checkpoint, the time the step spent on it (sync: the write; async: the snapshot plus any
// wait for the previous write) and the background write's own duration. See bench/NOTES.md
// (Checkpoints).
//
//   bench_checkpoint [--preset small] [--seq 256] [--steps 151] [--every 50] [--repeats 3]
//                    [--threads 2] [--dir /var/tmp]
// The 1b measurement on a GPU (resources "cuda") is the same run through spindle-train; see the
// notes for the command.
#include <omp.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/job_spec.h"
#include "worker/engine/trainer.h"

namespace spindle {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string preset = "small";
  int64_t seq = 256, steps = 151, every = 50, repeats = 3, threads = 2;
  std::string dir = "/var/tmp";
};

// One run of a mode: seconds per step (first to last step event), and per checkpoint inside the
// run the time the step spent on it and the background write's duration.
struct Run {
  double step_s = 0;
  std::vector<double> blocking_s, write_s;
};

enum class Mode { kNone, kSync, kAsync };
const char* ModeName(Mode m) {
  return m == Mode::kNone ? "none" : m == Mode::kSync ? "sync" : "async";
}

Run RunOnce(const Options& o, Mode mode) {
  const std::string ckpt =
      mode == Mode::kNone ? "" : absl::StrCat(o.dir, "/bench-checkpoint-", ::getpid());
  if (!ckpt.empty()) std::filesystem::remove_all(ckpt);
  const std::string text = absl::StrCat(
      R"({"name": "bench", "model": {"preset": ")", o.preset,
      R"("}, "data": {"source": "synthetic:recall"}, "seq_len": )", o.seq,
      R"(, "train": {"steps": )", o.steps, R"(, "seed": 1, "recompute": false},
          "checkpoint": {"dir": ")", ckpt, R"(", "every": )", o.every, R"(, "async": )",
      mode == Mode::kAsync ? "true" : "false", "}}");
  absl::StatusOr<JobSpec> spec = ParseJobSpec(text);
  if (!spec.ok()) {
    std::fprintf(stderr, "bench_checkpoint: %s\n", std::string(spec.status().message()).c_str());
    std::exit(2);
  }
  Run run;
  std::map<int64_t, Clock::time_point> step_at;
  std::map<int64_t, double> sync_write;
  TrainerOptions t;
  t.spec = *spec;
  t.on_event = [&](const nlohmann::json& e) {
    const auto now = Clock::now();
    const std::string ev = e.value("event", "");
    if (ev == "step") step_at[e["step"].get<int64_t>()] = now;
    if (ev != "checkpoint") return;
    const int64_t step = e["step"].get<int64_t>();
    if (step >= o.steps) return;  // the final one is not inside the timed steps
    if (mode == Mode::kSync) {
      // The write is what follows the step's event.
      run.blocking_s.push_back(std::chrono::duration<double>(now - step_at[step]).count());
    } else {
      run.blocking_s.push_back(e.value("snapshot_s", 0.0) + e.value("blocked_s", 0.0));
      run.write_s.push_back(e.value("write_s", 0.0));
    }
  };
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(std::move(t));
  if (!trainer.ok()) {
    std::fprintf(stderr, "bench_checkpoint: %s\n", std::string(trainer.status().message()).c_str());
    std::exit(1);
  }
  if (absl::Status s = (*trainer)->Run(); !s.ok()) {
    std::fprintf(stderr, "bench_checkpoint: %s\n", std::string(s.message()).c_str());
    std::exit(1);
  }
  run.step_s = std::chrono::duration<double>(step_at[o.steps] - step_at[1]).count() /
               static_cast<double>(o.steps - 1);
  if (!ckpt.empty()) std::filesystem::remove_all(ckpt);
  return run;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

bool Flag(int& i, int argc, char** argv, const char* name, std::string* out) {
  if (std::strcmp(argv[i], name) != 0 || i + 1 >= argc) return false;
  *out = argv[++i];
  return true;
}

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string v;
    int64_t* ints[] = {&o.seq, &o.steps, &o.every, &o.repeats, &o.threads};
    const char* names[] = {"--seq", "--steps", "--every", "--repeats", "--threads"};
    bool known = Flag(i, argc, argv, "--preset", &o.preset) || Flag(i, argc, argv, "--dir", &o.dir);
    for (int k = 0; !known && k < 5; ++k) {
      if (Flag(i, argc, argv, names[k], &v)) {
        if (!absl::SimpleAtoi(v, ints[k]) || *ints[k] < 1) {
          std::fprintf(stderr, "bench_checkpoint: %s needs a positive integer\n", names[k]);
          return 2;
        }
        known = true;
      }
    }
    if (!known) {
      std::fprintf(stderr,
                   "usage: bench_checkpoint [--preset P] [--seq T] [--steps N] [--every K] "
                   "[--repeats R] [--threads N] [--dir DIR]\n");
      return 2;
    }
  }
  if (o.steps < 2) o.steps = 2;
  omp_set_num_threads(static_cast<int>(o.threads));
  std::map<Mode, std::vector<Run>> runs;
  for (int64_t r = 0; r < o.repeats; ++r)
    for (Mode m : {Mode::kNone, Mode::kSync, Mode::kAsync}) runs[m].push_back(RunOnce(o, m));

  std::vector<double> base_v;
  for (const Run& r : runs[Mode::kNone]) base_v.push_back(r.step_s);
  const double base = Median(base_v);
  std::printf("preset %s, seq_len %lld, %lld steps, checkpoint every %lld, %lld threads, %lld "
              "repeats (median), checkpoints on %s\n\n",
              o.preset.c_str(), static_cast<long long>(o.seq), static_cast<long long>(o.steps),
              static_cast<long long>(o.every), static_cast<long long>(o.threads),
              static_cast<long long>(o.repeats), o.dir.c_str());
  // The overhead measured end to end moves with the machine's load; the step's own time per
  // checkpoint, spread over `every` steps of the baseline, is the part the step pays itself
  // (without what a background write takes from the compute threads' cores).
  std::printf("| checkpoints | step s | overhead | step's time per checkpoint s | its share of %lld "
              "steps | background write s |\n",
              static_cast<long long>(o.every));
  std::printf("|---|---|---|---|---|---|\n");
  for (Mode m : {Mode::kNone, Mode::kSync, Mode::kAsync}) {
    std::vector<double> step, blocking, write;
    for (const Run& r : runs[m]) {
      step.push_back(r.step_s);
      blocking.insert(blocking.end(), r.blocking_s.begin(), r.blocking_s.end());
      write.insert(write.end(), r.write_s.begin(), r.write_s.end());
    }
    const double s = Median(step), b = Median(blocking);
    std::printf("| %s | %.4f | %+.2f%% | %s | %s | %s |\n", ModeName(m), s, (s / base - 1) * 100,
                m == Mode::kNone ? "-" : absl::StrFormat("%.4f", b).c_str(),
                m == Mode::kNone
                    ? "-"
                    : absl::StrFormat("%.2f%%", b / (static_cast<double>(o.every) * base) * 100)
                          .c_str(),
                m == Mode::kAsync ? absl::StrFormat("%.4f", Median(write)).c_str() : "-");
  }
  return 0;
}

}  // namespace
}  // namespace spindle

int main(int argc, char** argv) { return spindle::Main(argc, argv); }
