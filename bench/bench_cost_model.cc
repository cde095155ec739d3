// bench_cost_model: the planner's cost model (planner/cp_cost_model.h) against measured step
// times on this machine. For each configuration it runs the job's cp ranks as spindle-train
// processes over Gloo on 127.0.0.1 (a file store), takes the median step time of the steps after
// the first two, and prints it beside the estimate:
//   - CPU jobs: the kernel rates measured at the job's shapes (spindle-train --probe-rates, one
//     rank alone on its threads), link loopback at the rates that probe measured (its link line,
//     as a worker reports them), ranks sharing the cores (CoreSharing) when ranks x threads fill
//     them; the cores are those this process may run on (its CPU affinity: under taskset, the
//     ones it names), and ranks whose threads are more than them wait passively
//     (OMP_WAIT_POLICY=passive unless set, as a worker starts them: common/host_cores.h);
//   - CUDA jobs: every rank on the one GPU (sharing = cp), the planner's built-in rates of an
//     H200, link same-device (Gloo through host staging) at the rates spindle-train --probe-link
//     measured.
// The link column shows the rate used (GB/s per rank and direction).
// Prints a table; asserts nothing.
//
//   bench_cost_model --train build/worker/spindle-train [--steps 8]
//                    [--configs PRESET:SEQ:CP:LMODE:MMODE[:RESOURCES[:THREADS[:ULYSSES]]],...]
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/host_cores.h"
#include "common/job_spec.h"
#include "common/subprocess.h"
#include "nlohmann/json.hpp"
#include "planner/cp_cost_model.h"

namespace {

using spindle::CpMode;

struct Config {
  std::string preset;
  int64_t seq = 0, cp = 1;
  std::string lmode = "allgather", mmode = "allgather";
  std::string resources = "cpu";
  int64_t ulysses = 1;
};

std::string JobJson(const Config& c, int64_t steps) {
  nlohmann::json j = {
      {"name", "cost-model"},
      {"model", {{"preset", c.preset}}},
      {"data", {{"source", "synthetic:recall"}}},
      {"seq_len", c.seq},
      {"parallel",
       {{"cp", c.cp}, {"lightning_mode", c.lmode}, {"mla_mode", c.mmode}, {"ulysses", c.ulysses}}},
      {"train", {{"steps", steps}, {"recompute", false}}},
      {"resources", c.resources}};
  return j.dump();
}

// Median step_s of rank 0's step events after the first two.
double MedianStep(const std::string& out) {
  std::vector<double> s;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.value("event", "") == "step" && j.value("step", 0) > 2)
      s.push_back(j.value("step_s", 0.0));
  }
  if (s.empty()) return 0;
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string train, configs =
                         "small:2048:1:allgather:allgather,small:4096:1:allgather:allgather,"
                         "small:4096:2:allgather:allgather,small:4096:2:all2all:all2all,"
                         "small:4096:2:allgather:all2all,small:8192:2:allgather:allgather,"
                         "small:8192:2:all2all:all2all,small:4096:4:allgather:allgather,"
                         "small:4096:4:all2all:all2all";
  int64_t steps = 8;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--train") train = v;
    if (a == "--configs") configs = v;
    if (a == "--steps") absl::SimpleAtoi(v, &steps);
  }
  if (train.empty()) {
    std::fprintf(stderr, "usage: bench_cost_model --train PATH/spindle-train [--steps N] "
                         "[--configs PRESET:SEQ:CP:LMODE:MMODE[:RESOURCES[:THREADS[:U]]],...]\n");
    return 2;
  }
  const std::string dir = (std::filesystem::temp_directory_path() /
                           absl::StrCat("bench-cost-model-", ::getpid()))
                              .string();
  std::filesystem::create_directories(dir);
  const int64_t cores = spindle::HostCores();
  const bool own_policy = std::getenv("OMP_WAIT_POLICY") != nullptr;
  std::printf("%lld cores; links at the rates spindle-train measured; OMP_WAIT_POLICY %s\n\n",
              static_cast<long long>(cores),
              own_policy ? std::getenv("OMP_WAIT_POLICY")
                         : "passive where the ranks' threads exceed the cores, else unset");
  std::printf(
      "| preset | seq | cp | res. | threads | lightning | mla | sharing | link GB/s | "
      "estimated s | measured s | error |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (absl::string_view item : absl::StrSplit(configs, ',')) {
    std::vector<std::string> f = absl::StrSplit(item, ':');
    if (f.size() < 5) continue;
    Config c{f[0], 0, 1, f[3], f[4]};
    const std::string resources = f.size() > 5 ? f[5] : "cpu";
    int64_t threads = 1;
    if (f.size() > 6) absl::SimpleAtoi(f[6], &threads);
    if (f.size() > 7) absl::SimpleAtoi(f[7], &c.ulysses);
    c.resources = resources;
    absl::SimpleAtoi(f[1], &c.seq);
    absl::SimpleAtoi(f[2], &c.cp);
    const std::string job = absl::StrCat(dir, "/job.json");
    std::ofstream(job) << JobJson(c, steps);
    auto spec = spindle::LoadJobSpec(job);
    if (!spec.ok()) {
      std::fprintf(stderr, "%s\n", spec.status().ToString().c_str());
      continue;
    }
    spindle::Topology topo = spindle::DefaultTopology(resources);
    topo.link =
        resources == "cuda" ? spindle::LinkClass::kSameDevice : spindle::LinkClass::kLoopback;
    topo.link_rates = spindle::DefaultLinkRates(topo.link);
    auto probe =
        resources == "cuda"
            ? spindle::RunCommand({train, "--probe-link"}, "")
            : spindle::RunCommand(
                  {train, "--probe-rates", "--job", job, "--threads", absl::StrCat(threads)}, "");
    if (!probe.ok() || probe->exit_code != 0) {
      std::fprintf(stderr, "probe failed\n");
      continue;
    }
    for (absl::string_view line : absl::StrSplit(probe->stdout_text, '\n')) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_object()) continue;
      if (j.value("event", "") == "rates")
        topo.rates = {j.value("gemm_flops", 0.0), j.value("attention_flops", 0.0),
                      j.value("lightning_flops", 0.0), j.value("memory_bytes", 0.0),
                      j.value("copy_bytes", 0.0)};
      if (j.value("event", "") == "link" && j.value("bytes_per_s", 0.0) > 0)
        topo.link_rates = {j.value("bytes_per_s", 0.0), j.value("latency_s", 0.0)};
    }
    topo.sharing = resources == "cuda" ? static_cast<double>(c.cp)
                                       : spindle::CoreSharing(c.cp, threads, cores, c.cp);
    auto mode = [&](const std::string& m) {
      return spindle::ModeChoice{spindle::CpModeFromName(m).value_or(CpMode::kAllGather),
                                 c.ulysses};
    };
    const double est = spindle::CpCostModel()
                           .Estimate(*spec, topo, mode(c.lmode), mode(c.mmode), 0)
                           .step_s();
    // The ranks, over a fresh file store.
    const std::string store = absl::StrCat(dir, "/store-", c.seq, "-", c.cp, "-", c.lmode, "-",
                                           c.mmode);
    std::filesystem::remove_all(store);
    std::filesystem::create_directories(store);
    std::vector<std::unique_ptr<spindle::Subprocess>> ranks;
    const std::string out0 = absl::StrCat(dir, "/rank0.out");
    const bool passive =
        resources != "cuda" && !own_policy && spindle::PassiveWaitForRanks(c.cp, threads, cores);
    for (int64_t r = 0; r < c.cp; ++r) {
      spindle::SubprocessOptions o;
      if (passive) o.env.push_back({"OMP_WAIT_POLICY", "passive"});
      o.stdout_path = r == 0 ? out0 : "/dev/null";
      o.stderr_path = absl::StrCat(dir, "/rank", r, ".err");
      auto p = spindle::Subprocess::Spawn(
          {train, "--job", job, "--rank", absl::StrCat(r), "--world", absl::StrCat(c.cp),
           "--file-store", store, "--threads", absl::StrCat(threads)},
          o);
      if (p.ok()) ranks.push_back(std::move(*p));
    }
    for (auto& p : ranks) p->Wait().IgnoreError();
    std::ifstream in(out0);
    const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const double measured = MedianStep(out);
    std::printf(
        "| %s | %lld | %lld | %s | %lld | %s | %s | %.3g | %.2f | %.3f | %.3f | %+.0f%% |\n",
        c.preset.c_str(), static_cast<long long>(c.seq), static_cast<long long>(c.cp),
        resources.c_str(), static_cast<long long>(threads), c.lmode.c_str(), c.mmode.c_str(),
        topo.sharing, topo.link_rates.bytes_per_s / 1e9, est, measured,
        measured > 0 ? 100.0 * (est / measured - 1.0) : 0.0);
    std::fflush(stdout);
  }
  std::filesystem::remove_all(dir);
  return 0;
}
