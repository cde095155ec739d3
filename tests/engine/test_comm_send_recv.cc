// The communicator's point-to-point SendRecv on the Gloo backend, ranks as threads: ring steps in
// both directions and pairwise swaps with (sender, step, index) patterns so that every received
// element proves who sent it and when, several exchanges in flight while the caller works,
// accounting, a group of one, and the refusals of bad peers.
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "tests/engine/cp_test_util.h"

namespace spindle {
namespace {

using testing::RunRanks;
using testing::TestGloo;

int32_t Tag(int rank, int step, int i) { return rank * 1000000 + step * 10000 + i; }

class SendRecvRingTest : public ::testing::TestWithParam<int> {};

// Each rank passes what it last received to the next rank, so after s steps it holds the block
// of rank (me - s): the ring attention's traffic. Then the same backwards, async and overlapped.
TEST_P(SendRecvRingTest, BlocksTravelTheRing) {
  const int P = GetParam();
  MemoryKvStore store;
  const int n = 37;
  absl::Status s = RunRanks(P, [&](int rank) -> absl::Status {
    auto comm = CreateGlooCommunicator(store, "ring", rank, P, TestGloo());
    if (!comm.ok()) return comm.status();
    Communicator& c = **comm;
    const int next = (rank + 1) % P, prev = (rank + P - 1) % P;
    std::vector<int32_t> cur(n), got(n, -1);
    for (int i = 0; i < n; ++i) cur[i] = Tag(rank, 0, i);
    for (int step = 1; step < P; ++step) {
      if (auto st = c.SendRecv(cur.data(), next, got.data(), prev, n * 4, CommLayer::kMla);
          !st.ok())
        return st;
      const int owner = (rank - step + P) % P;
      for (int i = 0; i < n; ++i) EXPECT_EQ(got[i], Tag(owner, 0, i)) << "step " << step;
      cur.swap(got);
    }
    // Backwards, two exchanges in flight at once (as the ring backward's block and its
    // accumulator), each with its own step tag; the caller works meanwhile.
    std::vector<int32_t> a(n), b(n), ra(n, -1), rb(n, -1);
    for (int i = 0; i < n; ++i) {
      a[i] = Tag(rank, 1, i);
      b[i] = Tag(rank, 2, i);
    }
    CommHandle ha = c.SendRecvAsync(a.data(), prev, ra.data(), next, n * 4, CommLayer::kMla);
    CommHandle hb = c.SendRecvAsync(b.data(), prev, rb.data(), next, (n - 5) * 4, CommLayer::kMla);
    double busy = 0.0;
    for (int i = 0; i < 100000; ++i) busy += i * 1e-9;
    EXPECT_GT(busy, 0.0);
    if (auto st = ha.Wait(); !st.ok()) return st;
    if (auto st = hb.Wait(); !st.ok()) return st;
    for (int i = 0; i < n; ++i) EXPECT_EQ(ra[i], Tag(next, 1, i));
    for (int i = 0; i < n - 5; ++i) EXPECT_EQ(rb[i], Tag(next, 2, i));
    for (int i = n - 5; i < n; ++i) EXPECT_EQ(rb[i], -1) << "past the bytes asked for";
    // Accounting: every exchange sent its bytes to another rank.
    const CommStats stats = c.TakeStats();
    const auto it = stats.find({Collective::kSendRecv, CommLayer::kMla});
    if (it == stats.end()) return absl::InternalError("no send_recv recorded");
    EXPECT_EQ(it->second.calls, P - 1 + 2);
    EXPECT_EQ(it->second.bytes, (P - 1) * n * 4 + n * 4 + (n - 5) * 4);
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
}

INSTANTIATE_TEST_SUITE_P(Sizes, SendRecvRingTest, ::testing::Values(2, 3, 4, 8));

// Ranks 2k and 2k+1 swap (to == from == the partner), then a zero-byte exchange.
TEST(SendRecvTest, PairsSwap) {
  const int P = 4, n = 19;
  MemoryKvStore store;
  absl::Status s = RunRanks(P, [&](int rank) -> absl::Status {
    auto comm = CreateGlooCommunicator(store, "pairs", rank, P, TestGloo());
    if (!comm.ok()) return comm.status();
    const int partner = rank ^ 1;
    std::vector<int32_t> out(n), in(n, -1);
    for (int i = 0; i < n; ++i) out[i] = Tag(rank, 3, i);
    if (auto st =
            (*comm)->SendRecv(out.data(), partner, in.data(), partner, n * 4, CommLayer::kOther);
        !st.ok())
      return st;
    for (int i = 0; i < n; ++i) EXPECT_EQ(in[i], Tag(partner, 3, i));
    return (*comm)->SendRecv(out.data(), partner, in.data(), partner, 0, CommLayer::kOther);
  });
  ASSERT_TRUE(s.ok()) << s;
}

TEST(SendRecvTest, GroupOfOneCopiesAndBadPeersAreRefused) {
  MemoryKvStore store;
  auto comm = CreateGlooCommunicator(store, "one", 0, 1, TestGloo());
  ASSERT_TRUE(comm.ok()) << comm.status();
  Communicator& c = **comm;
  std::vector<int32_t> out = {1, 2, 3}, in(3, 0);
  ASSERT_TRUE(c.SendRecv(out.data(), 0, in.data(), 0, 12, CommLayer::kMla).ok());
  EXPECT_EQ(in, out);
  const CommStats stats = c.TakeStats();
  EXPECT_EQ(stats.at({Collective::kSendRecv, CommLayer::kMla}).bytes, 0);

  const absl::Status far = c.SendRecv(out.data(), 1, in.data(), 0, 12, CommLayer::kMla);
  EXPECT_EQ(far.code(), absl::StatusCode::kInvalidArgument) << far;
  EXPECT_EQ(far.message(), "send-recv: 12 bytes to rank 1 and from rank 0 in a group of 1");
  const absl::Status negative = c.SendRecv(out.data(), 0, in.data(), 0, -4, CommLayer::kMla);
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument) << negative;
}

TEST(SendRecvTest, SendingToItselfMeansReceivingFromItself) {
  MemoryKvStore store;
  absl::Status s = RunRanks(2, [&](int rank) -> absl::Status {
    auto comm = CreateGlooCommunicator(store, "self", rank, 2, TestGloo());
    if (!comm.ok()) return comm.status();
    int32_t out = rank, in = -1;
    const absl::Status st = (*comm)->SendRecv(&out, rank, &in, 1 - rank, 4, CommLayer::kOther);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_EQ(st.message(), absl::StrCat("send-recv: rank ", rank, " sends to rank ", rank,
                                         " but receives from rank ", 1 - rank,
                                         "; a rank that sends to itself receives from itself"));
    // The refusal changed nothing: the pair still swaps. (This also keeps each rank's end of
    // the connections open until its peer has finished connecting.)
    if (auto swap = (*comm)->SendRecv(&out, 1 - rank, &in, 1 - rank, 4, CommLayer::kOther);
        !swap.ok())
      return swap;
    EXPECT_EQ(in, 1 - rank);
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace spindle
