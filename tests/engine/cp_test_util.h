// Helpers for the context-parallel tests: run one function per rank on its own thread, each rank
// with its own Gloo communicators over 127.0.0.1 bootstrapped from one in-memory store.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/comm/kv_stores.h"

namespace spindle::testing {

// Runs fn(rank) on `world` threads and returns the first non-OK status (rank order).
inline absl::Status RunRanks(int world, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> st(world);
  std::vector<std::thread> th;
  for (int r = 0; r < world; ++r) th.emplace_back([&, r] { st[r] = fn(r); });
  for (auto& t : th) t.join();
  for (int r = 0; r < world; ++r)
    if (!st[r].ok()) return absl::Status(st[r].code(), absl::StrCat("rank ", r, ": ", st[r].message()));
  return absl::OkStatus();
}

inline GlooOptions TestGloo() {
  GlooOptions o;
  o.hostname = "127.0.0.1";
  o.timeout = absl::Seconds(60);
  return o;
}

}  // namespace spindle::testing
