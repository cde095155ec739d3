// Communicator tests on the Gloo backend with ranks as threads: buffers filled with (rank, index)
// patterns so that every received element proves which rank sent it and from where; sums,
// broadcasts, concurrent communicators, async overlap, accounting and error conversion.
#include <cstdint>
#include <filesystem>
#include <vector>

#include "gtest/gtest.h"
#include "tests/engine/cp_test_util.h"

namespace spindle {
namespace {

using testing::RunRanks;
using testing::TestGloo;

// A value naming (sender rank, block, element): exact in int32.
int32_t Tag(int rank, int block, int i) { return rank * 1000000 + block * 10000 + i; }

class CommPatternTest : public ::testing::TestWithParam<int> {};

TEST_P(CommPatternTest, EveryElementComesFromWhereItShould) {
  const int P = GetParam();
  MemoryKvStore store;
  const int n = 37;  // odd on purpose
  absl::Status s = RunRanks(P, [&](int rank) -> absl::Status {
    auto comm = CreateGlooCommunicator(store, "pattern", rank, P, TestGloo());
    if (!comm.ok()) return comm.status();
    Communicator& c = **comm;
    EXPECT_EQ(c.rank(), rank);
    EXPECT_EQ(c.size(), P);
    // All-gather: block r of the output is rank r's input.
    std::vector<int32_t> in(n), out(n * P, -1);
    for (int i = 0; i < n; ++i) in[i] = Tag(rank, 0, i);
    if (auto st = c.AllGather(in.data(), n, CommType::kI32, out.data(), CommLayer::kOther); !st.ok())
      return st;
    for (int r = 0; r < P; ++r)
      for (int i = 0; i < n; ++i) EXPECT_EQ(out[r * n + i], Tag(r, 0, i)) << "all-gather r=" << r;
    // All-to-all: block j of my input (tagged with me and j) lands in block `me` of rank j.
    std::vector<int32_t> a_in(n * P), a_out(n * P, -1);
    for (int j = 0; j < P; ++j)
      for (int i = 0; i < n; ++i) a_in[j * n + i] = Tag(rank, j, i);
    if (auto st = c.AllToAll(a_in.data(), n, CommType::kI32, a_out.data(), CommLayer::kOther);
        !st.ok())
      return st;
    for (int src = 0; src < P; ++src)
      for (int i = 0; i < n; ++i)
        EXPECT_EQ(a_out[src * n + i], Tag(src, rank, i)) << "all-to-all from " << src;
    // Reduce-scatter: out[i] = sum over ranks r of (r + 1) * (block me, element i) values.
    std::vector<float> rs_in(n * P), rs_out(n, -1.0f);
    for (int j = 0; j < P; ++j)
      for (int i = 0; i < n; ++i) rs_in[j * n + i] = static_cast<float>((rank + 1) * (j * 100 + i));
    if (auto st = c.ReduceScatterSum(rs_in.data(), n, rs_out.data(), CommLayer::kOther); !st.ok())
      return st;
    const float ranks_sum = P * (P + 1) / 2.0f;
    for (int i = 0; i < n; ++i) EXPECT_EQ(rs_out[i], ranks_sum * (rank * 100 + i));
    // All-reduce in fp32, fp64 and int32.
    std::vector<float> f(n);
    std::vector<double> d(n);
    std::vector<int32_t> k(n);
    for (int i = 0; i < n; ++i) {
      f[i] = static_cast<float>(rank * 3 + i);
      d[i] = 0.5 * rank + i;
      k[i] = Tag(rank, 0, i);
    }
    if (auto st = c.AllReduceSum(f.data(), n, CommType::kF32, CommLayer::kGrad); !st.ok()) return st;
    if (auto st = c.AllReduceSum(d.data(), n, CommType::kF64, CommLayer::kOther); !st.ok()) return st;
    if (auto st = c.AllReduceSum(k.data(), n, CommType::kI32, CommLayer::kOther); !st.ok()) return st;
    const int rs = P * (P - 1) / 2;
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(f[i], static_cast<float>(3 * rs + P * i));
      EXPECT_EQ(d[i], 0.5 * rs + P * i);
      EXPECT_EQ(k[i], 1000000 * rs + P * i);
    }
    // Broadcast from the last rank.
    std::vector<int32_t> b(n);
    for (int i = 0; i < n; ++i) b[i] = Tag(rank, 7, i);
    if (auto st = c.Broadcast(b.data(), n, CommType::kI32, P - 1, CommLayer::kOther); !st.ok())
      return st;
    for (int i = 0; i < n; ++i) EXPECT_EQ(b[i], Tag(P - 1, 7, i));
    if (auto st = c.Barrier(); !st.ok()) return st;
    // Accounting: bytes this rank sent, per (collective, layer).
    CommStats stats = c.TakeStats();
    EXPECT_EQ((stats[{Collective::kAllGather, CommLayer::kOther}].bytes), (P - 1) * n * 4);
    EXPECT_EQ((stats[{Collective::kAllToAll, CommLayer::kOther}].bytes), (P - 1) * n * 4);
    EXPECT_EQ((stats[{Collective::kReduceScatter, CommLayer::kOther}].bytes), (P - 1) * n * 4);
    EXPECT_EQ((stats[{Collective::kAllReduce, CommLayer::kGrad}].calls), 1);
    EXPECT_EQ((stats[{Collective::kAllReduce, CommLayer::kOther}].calls), 2);
    EXPECT_TRUE(c.TakeStats().empty());
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
}

// All-to-all by pieces: each rank sends peer j its block j as two pieces in reverse order (the
// block's tail first); the receiver puts the first piece from rank i after the second, so block i
// of the output is rank i's block `me` whole again, and a third, empty piece changes nothing.
// Unequal totals and a peer out of range (asked of every rank: each checks its own pieces) are
// refused before anything moves.
TEST_P(CommPatternTest, PiecesLandWhereTheReceiverListsThem) {
  const int P = GetParam();
  MemoryKvStore store;
  const int n = 37, a = 12;  // pieces of n - a and a elements
  absl::Status s = RunRanks(P, [&](int rank) -> absl::Status {
    auto comm = CreateGlooCommunicator(store, "pieces", rank, P, TestGloo());
    if (!comm.ok()) return comm.status();
    Communicator& c = **comm;
    std::vector<int32_t> in(n * P), out(n * P, -1);
    for (int j = 0; j < P; ++j)
      for (int i = 0; i < n; ++i) in[j * n + i] = Tag(rank, j, i);
    const testing::PieceLists l = testing::BlockPieces(in.data(), out.data(), n, a, P);
    if (auto st = c.AllToAllPieces(l.send, l.recv, CommLayer::kLightning); !st.ok()) return st;
    for (int src = 0; src < P; ++src)
      for (int i = 0; i < n; ++i)
        EXPECT_EQ(out[src * n + i], Tag(src, rank, i)) << "from " << src << " element " << i;
    EXPECT_EQ((c.TakeStats()[{Collective::kAllToAll, CommLayer::kLightning}].bytes),
              (P - 1) * n * 4);
    const std::vector<int32_t> before = out;
    testing::ExpectPiecesRefused(c, l.send, l.recv, P);
    EXPECT_EQ(out, before);
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
}

// The packing's blocks are kept from one exchange to the next: exchanges that shrink and grow on
// one communicator each deliver their own round's values, none of an earlier, larger one.
TEST_P(CommPatternTest, PiecesOfSuccessiveExchangesOfOtherSizes) {
  const int P = GetParam();
  MemoryKvStore store;
  absl::Status s = RunRanks(P, [&](int rank) -> absl::Status {
    auto comm = CreateGlooCommunicator(store, "rounds", rank, P, TestGloo());
    if (!comm.ok()) return comm.status();
    Communicator& c = **comm;
    int round = 0;
    for (int n : {37, 5, 101, 37}) {
      ++round;
      std::vector<int32_t> in(n * P), out(n * P, -1);
      for (int j = 0; j < P; ++j)
        for (int i = 0; i < n; ++i) in[j * n + i] = Tag(rank, j, i) + round * 100000;
      const testing::PieceLists l = testing::BlockPieces(in.data(), out.data(), n, n / 3, P);
      if (auto st = c.AllToAllPieces(l.send, l.recv, CommLayer::kMla); !st.ok()) return st;
      for (int src = 0; src < P; ++src)
        for (int i = 0; i < n; ++i)
          EXPECT_EQ(out[src * n + i], Tag(src, rank, i) + round * 100000)
              << "round " << round << " from " << src << " element " << i;
    }
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
}

INSTANTIATE_TEST_SUITE_P(Sizes, CommPatternTest, ::testing::Values(1, 2, 3, 4));

// Two communicators over one store (world and a sub-group) run collectives at the same time, and
// an async all-gather overlaps with the caller's work.
TEST(CommTest, GroupsAndAsyncOverlap) {
  const int P = 4;
  MemoryKvStore store;
  absl::Status s = RunRanks(P, [&](int rank) -> absl::Status {
    auto world = CreateGlooCommunicator(store, "world", rank, P, TestGloo());
    if (!world.ok()) return world.status();
    const int group = rank / 2;
    auto sub = CreateGlooCommunicator(store, absl::StrCat("cp", group), rank % 2, 2, TestGloo());
    if (!sub.ok()) return sub.status();
    std::vector<float> big(1 << 16, static_cast<float>(rank));
    CommHandle h = (*world)->AllReduceSumAsync(big.data(), big.size(), CommType::kF32,
                                               CommLayer::kGrad);
    int32_t mine = Tag(rank, 0, 0), got[2] = {-1, -1};
    CommHandle g = (*sub)->AllGatherAsync(&mine, 1, CommType::kI32, got, CommLayer::kLightning);
    if (auto st = g.Wait(); !st.ok()) return st;
    EXPECT_EQ(got[0], Tag(group * 2, 0, 0));
    EXPECT_EQ(got[1], Tag(group * 2 + 1, 0, 0));
    if (auto st = h.Wait(); !st.ok()) return st;
    EXPECT_EQ(big[12345], 6.0f);
    EXPECT_TRUE(h.Wait().ok());  // waiting twice is fine
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
}

TEST(CommTest, RendezvousTimeoutIsAStatusNamingTheGroup) {
  MemoryKvStore store;
  GlooOptions o = TestGloo();
  o.timeout = absl::Milliseconds(300);
  auto comm = CreateGlooCommunicator(store, "lonely", 0, 2, o);
  ASSERT_FALSE(comm.ok());
  EXPECT_NE(comm.status().message().find("communicator \"lonely\" (rank 0 of 2)"),
            std::string::npos)
      << comm.status();
}

// A rank whose peer goes away mid-job (here: closes its communicator instead of joining the
// all-reduce) gets a status that names the lost peer as the cause, not only Gloo's socket error.
TEST(CommTest, APeerThatGoesAwayIsNamedAsTheCause) {
  MemoryKvStore store;
  GlooOptions o = TestGloo();
  o.timeout = absl::Seconds(10);
  absl::Status rank0;
  absl::Status s = RunRanks(2, [&](int rank) -> absl::Status {
    auto c = CreateGlooCommunicator(store, "gone", rank, 2, o);
    if (!c.ok()) return c.status();
    if (rank == 1) return absl::OkStatus();  // its communicator closes here
    float x[1024] = {};
    rank0 = (*c)->AllReduceSum(x, 1024, CommType::kF32, CommLayer::kGrad);
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(rank0.code(), absl::StatusCode::kUnavailable) << rank0;
  EXPECT_EQ(rank0.message().rfind("gloo all-reduce: lost contact with another rank (it stopped, "
                                  "or its host or the network failed): ",
                                  0),
            0u)
      << rank0;
}

TEST(CommTest, FileStoreRoundTripAndTimeout) {
  const std::string dir = ::testing::TempDir() + "/spindle_file_store_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);  // no keys left from an earlier run of this process id
  FileKvStore store(dir);
  ASSERT_TRUE(store.Set("a/b c", "value\0x").ok());
  auto v = store.Get("a/b c", absl::Seconds(1));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "value");
  auto missing = store.Get("nope", absl::Milliseconds(20));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded);
  // Two processes' worth of ranks (threads here) through files.
  absl::Status s = RunRanks(2, [&](int rank) -> absl::Status {
    FileKvStore mine(dir);
    auto c = CreateGlooCommunicator(mine, "files", rank, 2, TestGloo());
    if (!c.ok()) return c.status();
    int32_t x = rank + 5;
    return (*c)->AllReduceSum(&x, 1, CommType::kI32, CommLayer::kOther);
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace spindle
