// Helpers for the context-parallel tests: run one function per rank on its own thread, each rank
// with its own Gloo communicators over 127.0.0.1 bootstrapped from one in-memory store; and the
// refusals every communicator's all-to-all by pieces must give.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/engine/comm/communicator.h"
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

// 96 tokens, EOS = 256: documents [0, 4) (shorter than any chunk at cp <= 4), [4, 71) (longer
// than a rank's share), [71, 80), [80, 96) (cut by the sequence end). At cp = 8 the chunks are 6
// tokens, so [71, 80) and [80, 96) cross chunk boundaries too.
inline std::vector<int32_t> PackedTokens(uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> tok(0, 255);
  std::vector<int32_t> t(96);
  for (auto& x : t) x = tok(gen);
  for (int i : {3, 70, 79}) t[i] = 256;
  return t;
}

inline GlooOptions TestGloo() {
  GlooOptions o;
  o.hostname = "127.0.0.1";
  o.timeout = absl::Seconds(60);
  return o;
}

// The pieces tests' lists (`in` and `out`: `world` blocks of n int32, host or device memory): to
// and from each peer j its block j as three pieces, the block's tail after its first `a` elements,
// then those first `a`, then an empty one.
struct PieceLists {
  std::vector<CommSendPiece> send;
  std::vector<CommRecvPiece> recv;
};
inline PieceLists BlockPieces(const int32_t* in, int32_t* out, int n, int a, int world) {
  PieceLists l;
  for (int j = 0; j < world; ++j) {
    l.send.push_back({j, in + j * n + a, (n - a) * 4});
    l.send.push_back({j, in + j * n, a * 4});
    l.send.push_back({j, in + j * n, 0});
    l.recv.push_back({j, out + j * n + a, (n - a) * 4});
    l.recv.push_back({j, out + j * n, a * 4});
    l.recv.push_back({j, out + j * n, 0});
  }
  return l;
}

// AllToAllPieces on a group of `world` ranks refuses, as InvalidArgument naming the problem, the
// valid lists `send` / `recv` (BlockPieces) changed two ways: the receiver expecting 4 bytes less
// from the last rank (unequal totals), and a piece sent to rank `world`.
inline void ExpectPiecesRefused(Communicator& c, const std::vector<CommSendPiece>& send,
                                const std::vector<CommRecvPiece>& recv, int world) {
  std::vector<CommRecvPiece> short_recv = recv;
  short_recv[3 * (world - 1)].bytes -= 4;
  const absl::Status bad = c.AllToAllPieces(send, short_recv, CommLayer::kOther);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.message().find("every rank's total must be the same"), std::string::npos) << bad;
  std::vector<CommSendPiece> stray = send;
  stray[0].peer = world;
  const absl::Status out_of_range = c.AllToAllPieces(stray, recv, CommLayer::kOther);
  EXPECT_EQ(out_of_range.code(), absl::StatusCode::kInvalidArgument) << out_of_range;
  EXPECT_NE(out_of_range.message().find("for rank " + std::to_string(world)), std::string::npos)
      << out_of_range;
}

}  // namespace spindle::testing
