// NcclCommunicator on device buffers: ranks are threads of this process, rank r on GPU r, so the
// group size is bounded by the visible GPUs (sizes above it skip with the reason; one GPU cannot
// hold two NCCL ranks). Every collective of the Communicator interface runs on buffers filled
// with (rank, block, index) tags so each received element proves where it came from, as does the
// all-to-all by pieces; then the per-(collective, layer) accounting, and the error paths: bad
// sizes, roots, host pointers, summing bytes, bad ranks and devices, and a rendezvous nobody
// answers all come back as statuses.
// Skips cleanly where no GPU is present (CI builds it with nvcc and no device).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "tests/engine/cp_test_util.h"
#include "worker/engine/comm/kv_stores.h"
#include "worker/engine/comm/nccl_communicator.h"

namespace spindle {
namespace {

int VisibleGpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

#define REQUIRE_GPUS(p)                                                                       \
  do {                                                                                        \
    const int have_ = VisibleGpus();                                                          \
    if (have_ == 0) GTEST_SKIP() << "no CUDA device on this machine: NCCL tests skipped";     \
    if (have_ < (p))                                                                          \
      GTEST_SKIP() << (p) << " NCCL ranks need " << (p) << " GPUs (one rank per GPU); "      \
                   << have_ << " visible";                                                    \
  } while (0)

constexpr absl::Duration kTimeout = absl::Seconds(60);

using testing::RunRanks;

// A device buffer of T (freed on scope exit), filled from and read back into host vectors.
template <typename T>
class DevBuf {
 public:
  explicit DevBuf(size_t n) : n_(n) {
    if (cudaMalloc(&p_, n * sizeof(T) + 1) != cudaSuccess) p_ = nullptr;
  }
  ~DevBuf() {
    if (p_) cudaFree(p_);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  T* get() const { return p_; }
  bool Put(const std::vector<T>& v) {
    return p_ && v.size() == n_ &&
           cudaMemcpy(p_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess;
  }
  std::vector<T> Get() const {
    std::vector<T> v(n_);
    if (!p_ || cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess)
      v.clear();
    return v;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

// A value naming (sender rank, block, element): exact in int32, float (< 2^24) and double.
int32_t Tag(int rank, int block, int i) { return rank * 1000000 + block * 10000 + i; }

#define RETURN_IF_ERROR(expr)    \
  do {                           \
    absl::Status s_ = (expr);    \
    if (!s_.ok()) return s_;     \
  } while (0)
#define CHECK_CUDA(expr)                                                                \
  do {                                                                                  \
    if (!(expr)) return absl::InternalError(absl::StrCat(#expr, ": ",                   \
                                                         cudaGetErrorString(cudaGetLastError()))); \
  } while (0)

class NcclPatternTest : public ::testing::TestWithParam<int> {};

TEST_P(NcclPatternTest, EveryElementComesFromWhereItShould) {
  const int P = GetParam();
  REQUIRE_GPUS(P);
  MemoryKvStore store;
  const int n = 37;  // odd on purpose
  absl::Mutex report_mu;
  absl::Status s = RunRanks(P, [&](int rank) -> absl::Status {
    if (cudaSetDevice(rank) != cudaSuccess) return absl::InternalError("cudaSetDevice");
    auto comm = CreateNcclCommunicator(store, "pattern", rank, P, /*device=*/rank, kTimeout);
    if (!comm.ok()) return comm.status();
    Communicator& c = **comm;
    EXPECT_EQ(c.backend(), "nccl");
    EXPECT_EQ(c.rank(), rank);
    EXPECT_EQ(c.size(), P);

    // All-gather (int32 and fp64): block r of the output is rank r's input.
    {
      std::vector<int32_t> in(n);
      std::vector<double> din(n);
      for (int i = 0; i < n; ++i) {
        in[i] = Tag(rank, 0, i);
        din[i] = Tag(rank, 1, i) + 0.25;
      }
      DevBuf<int32_t> d_in(n), d_out(n * P);
      DevBuf<double> dd_in(n), dd_out(n * P);
      CHECK_CUDA(d_in.Put(in) && d_out.Put(std::vector<int32_t>(n * P, -1)));
      CHECK_CUDA(dd_in.Put(din) && dd_out.Put(std::vector<double>(n * P, -1)));
      RETURN_IF_ERROR(c.AllGather(d_in.get(), n, CommType::kI32, d_out.get(), CommLayer::kLightning));
      // The async form, waited on after the caller's own work.
      CommHandle h = c.AllGatherAsync(dd_in.get(), n, CommType::kF64, dd_out.get(), CommLayer::kMla);
      RETURN_IF_ERROR(h.Wait());
      EXPECT_TRUE(h.Wait().ok());  // waiting twice is fine
      const std::vector<int32_t> out = d_out.Get();
      const std::vector<double> dout = dd_out.Get();
      CHECK_CUDA(out.size() == size_t(n * P) && dout.size() == size_t(n * P));
      for (int r = 0; r < P; ++r)
        for (int i = 0; i < n; ++i) {
          EXPECT_EQ(out[r * n + i], Tag(r, 0, i)) << "all-gather i32 r=" << r << " i=" << i;
          EXPECT_EQ(dout[r * n + i], Tag(r, 1, i) + 0.25) << "all-gather f64 r=" << r << " i=" << i;
        }
    }
    // All-to-all (int32 and bytes): block j of my input, tagged (me, j), lands in block `me` of
    // rank j.
    {
      std::vector<int32_t> in(n * P);
      std::vector<uint8_t> bin(n * P);
      for (int j = 0; j < P; ++j)
        for (int i = 0; i < n; ++i) {
          in[j * n + i] = Tag(rank, j, i);
          bin[j * n + i] = static_cast<uint8_t>(rank * 64 + j * 8 + i % 8);
        }
      DevBuf<int32_t> d_in(n * P), d_out(n * P);
      DevBuf<uint8_t> db_in(n * P), db_out(n * P);
      CHECK_CUDA(d_in.Put(in) && d_out.Put(std::vector<int32_t>(n * P, -1)));
      CHECK_CUDA(db_in.Put(bin) && db_out.Put(std::vector<uint8_t>(n * P, 0xff)));
      RETURN_IF_ERROR(c.AllToAll(d_in.get(), n, CommType::kI32, d_out.get(), CommLayer::kLightning));
      RETURN_IF_ERROR(c.AllToAll(db_in.get(), n, CommType::kByte, db_out.get(), CommLayer::kMla));
      const std::vector<int32_t> out = d_out.Get();
      const std::vector<uint8_t> bout = db_out.Get();
      CHECK_CUDA(out.size() == size_t(n * P) && bout.size() == size_t(n * P));
      for (int src = 0; src < P; ++src)
        for (int i = 0; i < n; ++i) {
          EXPECT_EQ(out[src * n + i], Tag(src, rank, i)) << "all-to-all from " << src << " i=" << i;
          EXPECT_EQ(bout[src * n + i], static_cast<uint8_t>(src * 64 + rank * 8 + i % 8))
              << "all-to-all bytes from " << src << " i=" << i;
        }
    }
    // Reduce-scatter: out[i] = sum over ranks r of (r + 1) * (my block, element i) values.
    {
      std::vector<float> in(n * P);
      for (int j = 0; j < P; ++j)
        for (int i = 0; i < n; ++i) in[j * n + i] = static_cast<float>((rank + 1) * (j * 100 + i));
      DevBuf<float> d_in(n * P), d_out(n);
      CHECK_CUDA(d_in.Put(in) && d_out.Put(std::vector<float>(n, -1.0f)));
      RETURN_IF_ERROR(c.ReduceScatterSum(d_in.get(), n, d_out.get(), CommLayer::kMla));
      const std::vector<float> out = d_out.Get();
      CHECK_CUDA(out.size() == size_t(n));
      const float ranks_sum = P * (P + 1) / 2.0f;
      for (int i = 0; i < n; ++i) EXPECT_EQ(out[i], ranks_sum * (rank * 100 + i)) << "i=" << i;
    }
    // All-reduce in fp32 (a large odd buffer: NCCL's multi-chunk path), fp64 and int32.
    {
      const int big = (1 << 20) + 3;
      std::vector<float> f(big);
      std::vector<double> d(n);
      std::vector<int32_t> k(n);
      for (int i = 0; i < big; ++i) f[i] = static_cast<float>(rank * 3 + (i % 4096));
      for (int i = 0; i < n; ++i) {
        d[i] = 0.5 * rank + i;
        k[i] = Tag(rank, 0, i);
      }
      DevBuf<float> df(big);
      DevBuf<double> dd(n);
      DevBuf<int32_t> dk(n);
      CHECK_CUDA(df.Put(f) && dd.Put(d) && dk.Put(k));
      RETURN_IF_ERROR(c.AllReduceSum(df.get(), big, CommType::kF32, CommLayer::kGrad));
      RETURN_IF_ERROR(c.AllReduceSum(dd.get(), n, CommType::kF64, CommLayer::kOther));
      RETURN_IF_ERROR(c.AllReduceSum(dk.get(), n, CommType::kI32, CommLayer::kOther));
      f = df.Get();
      d = dd.Get();
      k = dk.Get();
      CHECK_CUDA(f.size() == size_t(big) && d.size() == size_t(n) && k.size() == size_t(n));
      const int rs = P * (P - 1) / 2;
      int bad = 0;
      for (int i = 0; i < big; ++i) bad += f[i] != static_cast<float>(3 * rs + P * (i % 4096));
      EXPECT_EQ(bad, 0) << "fp32 all-reduce elements wrong";
      for (int i = 0; i < n; ++i) {
        EXPECT_EQ(d[i], 0.5 * rs + P * i);
        EXPECT_EQ(k[i], 1000000 * rs + P * i);
      }
    }
    // Broadcast from the last rank.
    {
      std::vector<int32_t> b(n);
      for (int i = 0; i < n; ++i) b[i] = Tag(rank, 7, i);
      DevBuf<int32_t> db(n);
      CHECK_CUDA(db.Put(b));
      RETURN_IF_ERROR(c.Broadcast(db.get(), n, CommType::kI32, P - 1, CommLayer::kOther));
      b = db.Get();
      CHECK_CUDA(b.size() == size_t(n));
      for (int i = 0; i < n; ++i) EXPECT_EQ(b[i], Tag(P - 1, 7, i)) << "broadcast i=" << i;
    }
    RETURN_IF_ERROR(c.Barrier());

    // Accounting: calls, bytes this rank sent, and time per (collective, layer). The group of one
    // runs through NCCL as well, so every entry has measured time.
    CommStats stats = c.TakeStats();
    auto at = [&](Collective col, CommLayer l) { return stats[{col, l}]; };
    EXPECT_EQ(at(Collective::kAllGather, CommLayer::kLightning).calls, 1);
    EXPECT_EQ(at(Collective::kAllGather, CommLayer::kLightning).bytes, (P - 1) * n * 4);
    EXPECT_EQ(at(Collective::kAllGather, CommLayer::kMla).bytes, (P - 1) * n * 8);
    EXPECT_EQ(at(Collective::kAllToAll, CommLayer::kLightning).bytes, (P - 1) * n * 4);
    EXPECT_EQ(at(Collective::kAllToAll, CommLayer::kMla).bytes, (P - 1) * n * 1);
    EXPECT_EQ(at(Collective::kReduceScatter, CommLayer::kMla).bytes, (P - 1) * n * 4);
    EXPECT_EQ(at(Collective::kAllReduce, CommLayer::kGrad).calls, 1);
    EXPECT_EQ(at(Collective::kAllReduce, CommLayer::kGrad).bytes,
              2 * (P - 1) * int64_t((1 << 20) + 3) * 4 / P);
    EXPECT_EQ(at(Collective::kAllReduce, CommLayer::kOther).calls, 2);
    EXPECT_EQ(at(Collective::kBroadcast, CommLayer::kOther).bytes,
              P > 1 && rank == P - 1 ? n * 4 : 0);
    EXPECT_EQ(at(Collective::kBarrier, CommLayer::kOther).calls, 1);
    EXPECT_EQ(at(Collective::kBarrier, CommLayer::kOther).bytes, 0);
    for (const auto& [key, amount] : stats) {
      EXPECT_GT(amount.seconds, 0.0) << CollectiveName(key.first) << "/" << CommLayerName(key.second);
      EXPECT_LT(amount.seconds, 30.0) << CollectiveName(key.first);
    }
    EXPECT_EQ(stats.size(), 9u);
    EXPECT_TRUE(c.TakeStats().empty());
    {
      absl::MutexLock l(&report_mu);
      for (const auto& [key, amount] : stats)
        std::printf("rank %d %-14s %-9s calls=%lld bytes=%lld us=%.1f\n", rank,
                    CollectiveName(key.first), CommLayerName(key.second),
                    static_cast<long long>(amount.calls), static_cast<long long>(amount.bytes),
                    amount.seconds * 1e6);
    }
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
}

// The all-to-all by pieces (what the CUDA engine's CP exchange runs): each rank sends every peer
// its block as two pieces in reverse order plus an empty one, and receives them where its own list
// says; the byte accounting counts what leaves for other ranks; unequal totals and a peer out of
// range are refused before anything moves.
TEST_P(NcclPatternTest, PiecesLandWhereTheReceiverListsThem) {
  const int P = GetParam();
  REQUIRE_GPUS(P);
  MemoryKvStore store;
  const int n = 37, a = 12;  // pieces of n - a and a elements
  absl::Status s = RunRanks(P, [&](int rank) -> absl::Status {
    if (cudaSetDevice(rank) != cudaSuccess) return absl::InternalError("cudaSetDevice");
    auto comm = CreateNcclCommunicator(store, "pieces", rank, P, /*device=*/rank, kTimeout);
    if (!comm.ok()) return comm.status();
    Communicator& c = **comm;
    std::vector<int32_t> in(n * P);
    for (int j = 0; j < P; ++j)
      for (int i = 0; i < n; ++i) in[j * n + i] = Tag(rank, j, i);
    DevBuf<int32_t> d_in(n * P), d_out(n * P);
    CHECK_CUDA(d_in.Put(in) && d_out.Put(std::vector<int32_t>(n * P, -1)));
    const testing::PieceLists l = testing::BlockPieces(d_in.get(), d_out.get(), n, a, P);
    RETURN_IF_ERROR(c.AllToAllPieces(l.send, l.recv, CommLayer::kLightning));
    const std::vector<int32_t> out = d_out.Get();
    CHECK_CUDA(out.size() == size_t(n * P));
    for (int from = 0; from < P; ++from)
      for (int i = 0; i < n; ++i)
        EXPECT_EQ(out[from * n + i], Tag(from, rank, i)) << "from " << from << " element " << i;
    EXPECT_EQ((c.TakeStats()[{Collective::kAllToAll, CommLayer::kLightning}].bytes),
              (P - 1) * n * 4);
    testing::ExpectPiecesRefused(c, l.send, l.recv, P);
    EXPECT_EQ(d_out.Get(), out);  // the refused calls moved nothing
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
}

INSTANTIATE_TEST_SUITE_P(Ranks, NcclPatternTest, ::testing::Values(1, 2, 4, 8),
                         [](const auto& info) { return absl::StrCat("world", info.param); });

// Bad arguments come back as statuses (the communicator stays usable after them).
TEST(NcclCommTest, BadArgumentsAreStatuses) {
  REQUIRE_GPUS(1);
  MemoryKvStore store;
  auto comm = CreateNcclCommunicator(store, "errors", 0, 1, 0, kTimeout);
  ASSERT_TRUE(comm.ok()) << comm.status();
  Communicator& c = **comm;
  DevBuf<float> d(64);
  ASSERT_NE(d.get(), nullptr);
  std::vector<float> host(64, 1.0f);
  auto expect_invalid = [](const absl::Status& s, const std::string& words) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(words), std::string::npos) << s;
  };
  expect_invalid(c.AllGather(d.get(), -1, CommType::kF32, d.get(), CommLayer::kOther),
                 "all-gather of -1 elements");
  expect_invalid(c.AllToAll(d.get(), -5, CommType::kI32, d.get(), CommLayer::kOther), "-5");
  expect_invalid(c.AllReduceSum(d.get(), -1, CommType::kF32, CommLayer::kOther), "-1");
  expect_invalid(c.ReduceScatterSum(d.get(), -2, d.get(), CommLayer::kOther), "-2");
  expect_invalid(c.Broadcast(d.get(), -3, CommType::kF32, 0, CommLayer::kOther), "-3");
  expect_invalid(c.AllReduceSum(d.get(), std::numeric_limits<int64_t>::max() / 2, CommType::kF32,
                                CommLayer::kOther),
                 "overflows");
  expect_invalid(c.Broadcast(d.get(), 4, CommType::kF32, 1, CommLayer::kOther), "root 1");
  expect_invalid(c.Broadcast(d.get(), 4, CommType::kF32, -1, CommLayer::kOther), "root -1");
  expect_invalid(c.AllReduceSum(d.get(), 4, CommType::kByte, CommLayer::kOther), "sum of bytes");
  expect_invalid(c.AllReduceSum(host.data(), 64, CommType::kF32, CommLayer::kOther),
                 "not device memory");
  expect_invalid(c.AllGather(host.data(), 8, CommType::kF32, d.get(), CommLayer::kOther),
                 "all-gather input is not device memory");
  expect_invalid(c.AllToAll(d.get(), 8, CommType::kF32, host.data(), CommLayer::kOther),
                 "all-to-all output is not device memory");
  expect_invalid(c.AllReduceSum(nullptr, 8, CommType::kF32, CommLayer::kOther), "null");
  // Still usable, and a zero-size collective is fine.
  EXPECT_TRUE(c.AllReduceSum(d.get(), 0, CommType::kF32, CommLayer::kOther).ok());
  ASSERT_TRUE(d.Put(std::vector<float>(64, 2.0f)));
  EXPECT_TRUE(c.AllReduceSum(d.get(), 64, CommType::kF32, CommLayer::kOther).ok());
  EXPECT_EQ(d.Get(), std::vector<float>(64, 2.0f));
  EXPECT_TRUE(c.Barrier().ok());
}

TEST(NcclCommTest, BadGroupsAndDevicesAreStatuses) {
  REQUIRE_GPUS(1);
  MemoryKvStore store;
  for (auto [rank, size] : {std::pair{1, 1}, {-1, 2}, {0, 0}}) {
    auto c = CreateNcclCommunicator(store, "bad", rank, size, 0, kTimeout);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  }
  auto dev = CreateNcclCommunicator(store, "dev", 0, 1, VisibleGpus(), kTimeout);
  ASSERT_FALSE(dev.ok());
  EXPECT_NE(dev.status().message().find("is not one of the"), std::string::npos) << dev.status();
  // Rank 1 of 2 with no rank 0 publishing the id: the rendezvous times out with a status.
  auto lonely = CreateNcclCommunicator(store, "lonely", 1, 2, 0, absl::Milliseconds(200));
  ASSERT_FALSE(lonely.ok());
  EXPECT_EQ(lonely.status().code(), absl::StatusCode::kDeadlineExceeded) << lonely.status();
  // A corrupt id is refused, not handed to NCCL.
  ASSERT_TRUE(store.Set("corrupt/nccl_id", "short").ok());
  auto corrupt = CreateNcclCommunicator(store, "corrupt", 1, 2, 0, kTimeout);
  ASSERT_FALSE(corrupt.ok());
  EXPECT_EQ(corrupt.status().code(), absl::StatusCode::kDataLoss) << corrupt.status();
}

// Rendezvous through the file store (standalone multi-process runs), with one rank per GPU.
TEST(NcclCommTest, FileStoreRendezvous) {
  const int P = VisibleGpus();
  REQUIRE_GPUS(1);
  const std::string dir =
      ::testing::TempDir() + "/spindle_nccl_file_store_" + std::to_string(getpid());
  absl::Status s = RunRanks(P, [&](int rank) -> absl::Status {
    FileKvStore mine(dir);
    if (cudaSetDevice(rank) != cudaSuccess) return absl::InternalError("cudaSetDevice");
    auto c = CreateNcclCommunicator(mine, "files", rank, P, rank, kTimeout);
    if (!c.ok()) return c.status();
    DevBuf<int32_t> x(1);
    CHECK_CUDA(x.Put({rank + 5}));
    RETURN_IF_ERROR((*c)->AllReduceSum(x.get(), 1, CommType::kI32, CommLayer::kOther));
    EXPECT_EQ(x.Get(), std::vector<int32_t>{5 * P + P * (P - 1) / 2});
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace spindle
