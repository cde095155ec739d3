// StagedCommunicator: device buffers through pinned host staging over Gloo. Three ranks are
// threads sharing one GPU, each with its own Gloo communicator over an in-memory store wrapped in
// a staged one. Every collective runs on device buffers filled with (rank, index) tags, so each
// received element proves its sender and place; the all-to-all by pieces scatters into places that
// are not one block a rank; the host communicator records each collective under the caller's
// layer type; a group of one runs on device buffers too. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cuda_test_util.h"
#include "tests/engine/cp_test_util.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/comm/kv_stores.h"
#include "worker/engine/comm/staged_communicator.h"

namespace spindle {
namespace {

// A device buffer of n floats, set from and read back into host vectors.
class Dev {
 public:
  explicit Dev(int64_t n) : n_(n) { ok_ = cudaMalloc(&p_, n * 4 + 4) == cudaSuccess; }
  ~Dev() {
    if (ok_) cudaFree(p_);
  }
  float* get() const { return static_cast<float*>(p_); }
  void Set(const std::vector<float>& v) {
    ASSERT_EQ(cudaMemcpy(p_, v.data(), v.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<float> Get() const {
    std::vector<float> v(n_);
    EXPECT_EQ(cudaMemcpy(v.data(), p_, n_ * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }

 private:
  int64_t n_;
  void* p_ = nullptr;
  bool ok_ = false;
};

float Tag(int rank, int64_t i) { return static_cast<float>(rank * 1000 + i); }

absl::Status RankBody(Communicator& c, Communicator& host) {
  const int r = c.rank(), n = c.size();
  constexpr int64_t k = 5;
  std::vector<float> mine(k);
  for (int64_t i = 0; i < k; ++i) mine[i] = Tag(r, i);

  // All-gather: block j is rank j's.
  Dev in(k), out(n * k);
  in.Set(mine);
  if (absl::Status s = c.AllGather(in.get(), k, CommType::kF32, out.get(), CommLayer::kMla);
      !s.ok())
    return s;
  std::vector<float> got = out.Get();
  for (int j = 0; j < n; ++j)
    for (int64_t i = 0; i < k; ++i) EXPECT_EQ(got[j * k + i], Tag(j, i)) << "all-gather";

  // All-to-all: block j of rank r's input is Tag(r, j * k + i); rank r receives Tag(j, r k + i).
  std::vector<float> blocks(n * k);
  for (int64_t i = 0; i < n * k; ++i) blocks[i] = Tag(r, i);
  Dev a2a_in(n * k), a2a_out(n * k);
  a2a_in.Set(blocks);
  if (absl::Status s =
          c.AllToAll(a2a_in.get(), k, CommType::kF32, a2a_out.get(), CommLayer::kLightning);
      !s.ok())
    return s;
  got = a2a_out.Get();
  for (int j = 0; j < n; ++j)
    for (int64_t i = 0; i < k; ++i) EXPECT_EQ(got[j * k + i], Tag(j, r * k + i)) << "all-to-all";

  // All-to-all by pieces: two pieces for each peer, the second received before the first.
  Dev pin(n * 2 * k), pout(n * 2 * k);
  std::vector<float> src(n * 2 * k);
  for (int64_t i = 0; i < n * 2 * k; ++i) src[i] = Tag(r, i);
  pin.Set(src);
  std::vector<CommSendPiece> send;
  std::vector<CommRecvPiece> recv;
  for (int j = 0; j < n; ++j) {
    send.push_back({j, pin.get() + j * 2 * k, 4 * 3});
    send.push_back({j, pin.get() + j * 2 * k + 3, 4 * (2 * k - 3)});
    recv.push_back({j, pout.get() + j * 2 * k + (2 * k - 3), 4 * 3});
    recv.push_back({j, pout.get() + j * 2 * k, 4 * (2 * k - 3)});
  }
  if (absl::Status s = c.AllToAllPieces(send, recv, CommLayer::kMla); !s.ok()) return s;
  got = pout.Get();
  for (int j = 0; j < n; ++j) {
    for (int64_t i = 0; i < 3; ++i)
      EXPECT_EQ(got[j * 2 * k + 2 * k - 3 + i], Tag(j, r * 2 * k + i)) << "pieces, first";
    for (int64_t i = 0; i < 2 * k - 3; ++i)
      EXPECT_EQ(got[j * 2 * k + i], Tag(j, r * 2 * k + 3 + i)) << "pieces, second";
  }

  // All-reduce and reduce-scatter sums.
  Dev sum(k);
  sum.Set(mine);
  if (absl::Status s = c.AllReduceSum(sum.get(), k, CommType::kF32, CommLayer::kGrad); !s.ok())
    return s;
  got = sum.Get();
  for (int64_t i = 0; i < k; ++i) {
    float want = 0;
    for (int j = 0; j < n; ++j) want += Tag(j, i);
    EXPECT_EQ(got[i], want) << "all-reduce";
  }
  Dev rs_out(k);
  if (absl::Status s = c.ReduceScatterSum(a2a_in.get(), k, rs_out.get(), CommLayer::kMla); !s.ok())
    return s;
  got = rs_out.Get();
  for (int64_t i = 0; i < k; ++i) {
    float want = 0;
    for (int j = 0; j < n; ++j) want += Tag(j, r * k + i);
    EXPECT_EQ(got[i], want) << "reduce-scatter";
  }

  // Broadcast from the last rank, and one step of a ring (send to the next, from the previous).
  Dev bc(k);
  bc.Set(mine);
  if (absl::Status s = c.Broadcast(bc.get(), k, CommType::kF32, n - 1, CommLayer::kOther); !s.ok())
    return s;
  got = bc.Get();
  for (int64_t i = 0; i < k; ++i) EXPECT_EQ(got[i], Tag(n - 1, i)) << "broadcast";
  Dev ring(k);
  if (absl::Status s =
          c.SendRecv(in.get(), (r + 1) % n, ring.get(), (r + n - 1) % n, k * 4, CommLayer::kMla);
      !s.ok())
    return s;
  got = ring.Get();
  for (int64_t i = 0; i < k; ++i) EXPECT_EQ(got[i], Tag((r + n - 1) % n, i)) << "send-recv";

  // The host communicator recorded them under the callers' layer types.
  const CommStats stats = host.TakeStats();
  EXPECT_EQ(stats.count({Collective::kAllToAll, CommLayer::kLightning}), 1u);
  EXPECT_EQ(stats.count({Collective::kSendRecv, CommLayer::kMla}), 1u);
  EXPECT_EQ(stats.count({Collective::kAllReduce, CommLayer::kGrad}), 1u);
  return absl::OkStatus();
}

TEST(StagedCommunicator, EveryCollectiveOnDeviceBuffers) {
  SPINDLE_REQUIRE_GPU();
  for (int n : {3, 1}) {
    SCOPED_TRACE(::testing::Message() << n << " ranks");
    MemoryKvStore store;
    absl::Status st = testing::RunRanks(n, [&](int rank) -> absl::Status {
      if (cudaSetDevice(0) != cudaSuccess) return absl::InternalError("cudaSetDevice");
      auto host = CreateGlooCommunicator(store, "staged", rank, n, testing::TestGloo());
      if (!host.ok()) return host.status();
      auto c = CreateStagedCommunicator(host->get(), 0);
      if (!c.ok()) return c.status();
      EXPECT_EQ((*c)->rank(), rank);
      EXPECT_EQ((*c)->size(), n);
      EXPECT_EQ((*c)->backend(), (*host)->backend() + "+staging");
      return RankBody(**c, **host);
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

TEST(StagedCommunicator, RefusesNoHostCommunicator) {
  SPINDLE_REQUIRE_GPU();
  auto c = CreateStagedCommunicator(nullptr, 0);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace spindle
