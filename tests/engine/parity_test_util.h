// Helpers of the parity canary's tests (test_parity_canary.cc, and the broken-layout test built
// with a fault compiled into the Lightning AllGather, parity_fault_test.cc): planned tiny job
// specs at a given layout and precision, on a fresh random seed that the test prints.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"

namespace spindle::testing {

struct ParityLayout {
  const char* preset = "tiny";
  int64_t cp = 2, dp = 1, ep = 0;  // ep 0: dense (left out of the spec)
  CpMode lightning = CpMode::kAllGather, mla = CpMode::kAllGather;
  int64_t ulysses = 1;
  const char* precision = "fp32";
};

inline void PrintTo(const ParityLayout& l, std::ostream* os) {
  *os << l.preset << " cp=" << l.cp << " dp=" << l.dp << " ep=" << l.ep
      << " lightning=" << CpModeName(l.lightning) << " mla=" << CpModeName(l.mla)
      << " ulysses=" << l.ulysses << " " << l.precision;
}

// A seed drawn afresh for every run, printed; SPINDLE_PARITY_SEED=S replays a run with seed S.
inline uint64_t FreshSeed() {
  if (const char* s = std::getenv("SPINDLE_PARITY_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  const uint64_t seed = (static_cast<uint64_t>(rd()) << 16) ^ rd();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed % 1000000007));
  return seed % 1000000007;
}

// A planned job at `l`: synthetic copy data of 128-token sequences (documents cross chunk and
// rank boundaries), modes and ep decided, no recompute.
inline JobSpec ParityJob(const ParityLayout& l, uint64_t seed, int64_t steps = 1,
                         const std::string& verify = "\"first\"") {
  const std::string ep = l.ep > 0 ? absl::StrCat(R"(, "ep": )", l.ep) : "";
  const std::string ulysses = l.ulysses > 1 ? absl::StrCat(R"(, "ulysses": )", l.ulysses) : "";
  auto spec = ParseJobSpec(absl::StrCat(
      R"({"name": "parity", "model": {"preset": ")", l.preset,
      R"("}, "data": {"source": "synthetic:copy", "recall_gap": 40}, "seq_len": 128,
          "parallel": {"cp": )",
      l.cp, R"(, "dp": )", l.dp, R"(, "lightning_mode": ")", std::string(CpModeName(l.lightning)),
      R"(", "mla_mode": ")", std::string(CpModeName(l.mla)), R"(")", ep, ulysses, R"(, "verify": )",
      verify, R"(}, "train": {"steps": )", steps, R"(, "lr": 3e-3, "seed": )", seed,
      R"(, "recompute": false, "precision": ")", l.precision, R"("}})"));
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

}  // namespace spindle::testing
