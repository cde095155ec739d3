// NCCL backend of Communicator (see nccl_communicator.h).
#include "worker/engine/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace spindle {
namespace {

#define SPINDLE_CUDA_RETURN(call)                                                                 \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess)                                                                        \
      return absl::InternalError(absl::StrCat(#call, " at ", __FILE__, ":", __LINE__, ": ",       \
                                              cudaGetErrorString(e_)));                           \
  } while (0)

#define SPINDLE_RETURN_IF_ERROR(expr)   \
  do {                                  \
    absl::Status s_ = (expr);           \
    if (!s_.ok()) return s_;            \
  } while (0)

// An NCCL result as a status: argument and usage errors are the caller's (InvalidArgument), the
// rest (network, remote, internal) mean the group is unusable (Unavailable).
absl::Status NcclStatus(ncclResult_t r, const char* call, ncclComm_t comm) {
  if (r == ncclSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat("nccl: ", call, ": ", ncclGetErrorString(r));
  const char* last = ncclGetLastError(comm);
  if (last && *last) absl::StrAppend(&msg, " (", last, ")");
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) return absl::InvalidArgumentError(msg);
  return absl::UnavailableError(msg);
}

#define SPINDLE_NCCL_RETURN(call, comm) SPINDLE_RETURN_IF_ERROR(NcclStatus((call), #call, (comm)))

ncclDataType_t NcclType(CommType t) {
  switch (t) {
    case CommType::kF32: return ncclFloat32;
    case CommType::kF64: return ncclFloat64;
    case CommType::kI32: return ncclInt32;
    case CommType::kByte: return ncclUint8;
  }
  return ncclUint8;
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device, ncclComm_t comm, cudaStream_t stream,
                   absl::Duration timeout)
      : Communicator(rank, size), device_(device), comm_(comm), stream_(stream),
        timeout_(timeout) {}
  ~NcclCommunicator() override {
    Shutdown();
    cudaSetDevice(device_);
    if (aborted_) {
      // ncclCommAbort already freed the communicator.
    } else {
      ncclCommDestroy(comm_);
    }
    if (barrier_buf_) cudaFree(barrier_buf_);
    cudaStreamDestroy(stream_);
  }
  std::string backend() const override { return "nccl"; }

 protected:
  bool LocalWhenAlone() const override { return false; }

  absl::Status DoAllGather(const void* in, int64_t n, CommType type, void* out) override {
    SPINDLE_RETURN_IF_ERROR(Check("all-gather", n, type, size()));
    SPINDLE_RETURN_IF_ERROR(CheckBuffer("all-gather input", in, n * CommTypeSize(type)));
    SPINDLE_RETURN_IF_ERROR(CheckBuffer("all-gather output", out, n * size() * CommTypeSize(type)));
    if (n == 0) return absl::OkStatus();
    SPINDLE_NCCL_RETURN(ncclAllGather(in, out, n, NcclType(type), comm_, stream_), comm_);
    return Sync("all-gather");
  }
  absl::Status DoAllToAll(const void* in, int64_t n, CommType type, void* out) override {
    SPINDLE_RETURN_IF_ERROR(Check("all-to-all", n, type, size()));
    const int64_t block = n * CommTypeSize(type);
    SPINDLE_RETURN_IF_ERROR(CheckBuffer("all-to-all input", in, block * size()));
    SPINDLE_RETURN_IF_ERROR(CheckBuffer("all-to-all output", out, block * size()));
    if (n == 0) return absl::OkStatus();
    SPINDLE_NCCL_RETURN(ncclGroupStart(), comm_);
    absl::Status s;
    for (int r = 0; r < size() && s.ok(); ++r) {
      s = NcclStatus(ncclSend(static_cast<const char*>(in) + r * block, n, NcclType(type), r,
                              comm_, stream_),
                     "ncclSend", comm_);
      if (s.ok())
        s = NcclStatus(
            ncclRecv(static_cast<char*>(out) + r * block, n, NcclType(type), r, comm_, stream_),
            "ncclRecv", comm_);
    }
    // The group is closed whatever happened inside it, or this thread's next call joins it.
    absl::Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd", comm_);
    SPINDLE_RETURN_IF_ERROR(s);
    SPINDLE_RETURN_IF_ERROR(end);
    return Sync("all-to-all");
  }
  // One group: a send and a receive per peer with a block (empty blocks are skipped on both sides).
  absl::Status DoAllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                           const std::vector<int64_t>& recv_bytes) override {
    int64_t sent = 0, received = 0;
    for (int64_t b : send_bytes) sent += b;
    for (int64_t b : recv_bytes) received += b;
    SPINDLE_RETURN_IF_ERROR(CheckBuffer("all-to-all input", in, sent));
    SPINDLE_RETURN_IF_ERROR(CheckBuffer("all-to-all output", out, received));
    if (sent == 0 && received == 0) return absl::OkStatus();
    SPINDLE_NCCL_RETURN(ncclGroupStart(), comm_);
    absl::Status s;
    int64_t at_send = 0, at_recv = 0;
    for (int r = 0; r < size() && s.ok(); ++r) {
      if (send_bytes[r] > 0)
        s = NcclStatus(ncclSend(static_cast<const char*>(in) + at_send, send_bytes[r], ncclUint8, r,
                                comm_, stream_),
                       "ncclSend", comm_);
      if (s.ok() && recv_bytes[r] > 0)
        s = NcclStatus(ncclRecv(static_cast<char*>(out) + at_recv, recv_bytes[r], ncclUint8, r,
                                comm_, stream_),
                       "ncclRecv", comm_);
      at_send += send_bytes[r];
      at_recv += recv_bytes[r];
    }
    absl::Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd", comm_);
    SPINDLE_RETURN_IF_ERROR(s);
    SPINDLE_RETURN_IF_ERROR(end);
    return Sync("all-to-all");
  }
  // One group of sends and receives, each peer's in the listed order (NCCL matches a pair's
  // operations in order).
  absl::Status DoAllToAllPieces(const std::vector<CommSendPiece>& send,
                                const std::vector<CommRecvPiece>& recv, int64_t block) override {
    SPINDLE_RETURN_IF_ERROR(Check("all-to-all by pieces", block, CommType::kByte, size()));
    for (const CommSendPiece& p : send)
      SPINDLE_RETURN_IF_ERROR(CheckBuffer("all-to-all send piece", p.p, p.bytes));
    for (const CommRecvPiece& p : recv)
      SPINDLE_RETURN_IF_ERROR(CheckBuffer("all-to-all receive piece", p.p, p.bytes));
    if (block == 0) return absl::OkStatus();
    SPINDLE_NCCL_RETURN(ncclGroupStart(), comm_);
    absl::Status s;
    for (int r = 0; r < size() && s.ok(); ++r) {
      for (size_t i = 0; i < send.size() && s.ok(); ++i)
        if (send[i].peer == r && send[i].bytes > 0)
          s = NcclStatus(ncclSend(send[i].p, send[i].bytes, ncclUint8, r, comm_, stream_),
                         "ncclSend", comm_);
      for (size_t i = 0; i < recv.size() && s.ok(); ++i)
        if (recv[i].peer == r && recv[i].bytes > 0)
          s = NcclStatus(ncclRecv(recv[i].p, recv[i].bytes, ncclUint8, r, comm_, stream_),
                         "ncclRecv", comm_);
    }
    absl::Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd", comm_);
    SPINDLE_RETURN_IF_ERROR(s);
    SPINDLE_RETURN_IF_ERROR(end);
    return Sync("all-to-all by pieces");
  }
  absl::Status DoAllReduceSum(void* buf, int64_t n, CommType type) override {
    if (type == CommType::kByte) return absl::InvalidArgumentError("nccl: sum of bytes");
    SPINDLE_RETURN_IF_ERROR(Check("all-reduce", n, type, 1));
    SPINDLE_RETURN_IF_ERROR(CheckBuffer("all-reduce buffer", buf, n * CommTypeSize(type)));
    if (n == 0) return absl::OkStatus();
    SPINDLE_NCCL_RETURN(ncclAllReduce(buf, buf, n, NcclType(type), ncclSum, comm_, stream_),
                        comm_);
    return Sync("all-reduce");
  }
  absl::Status DoReduceScatterSum(const float* in, int64_t n, float* out) override {
    SPINDLE_RETURN_IF_ERROR(Check("reduce-scatter", n, CommType::kF32, size()));
    SPINDLE_RETURN_IF_ERROR(CheckBuffer("reduce-scatter input", in, n * size() * 4));
    SPINDLE_RETURN_IF_ERROR(CheckBuffer("reduce-scatter output", out, n * 4));
    if (n == 0) return absl::OkStatus();
    SPINDLE_NCCL_RETURN(ncclReduceScatter(in, out, n, ncclFloat32, ncclSum, comm_, stream_),
                        comm_);
    return Sync("reduce-scatter");
  }
  absl::Status DoBroadcast(void* buf, int64_t n, CommType type, int root) override {
    SPINDLE_RETURN_IF_ERROR(Check("broadcast", n, type, 1));
    if (root < 0 || root >= size())
      return absl::InvalidArgumentError(
          absl::StrCat("nccl: broadcast root ", root, " is not in a group of size ", size()));
    SPINDLE_RETURN_IF_ERROR(CheckBuffer("broadcast buffer", buf, n * CommTypeSize(type)));
    if (n == 0) return absl::OkStatus();
    SPINDLE_NCCL_RETURN(ncclBroadcast(buf, buf, n, NcclType(type), root, comm_, stream_), comm_);
    return Sync("broadcast");
  }
  absl::Status DoSendRecv(const void* send, int to, void* recv, int from, int64_t bytes) override {
    SPINDLE_RETURN_IF_ERROR(Check("send-recv", bytes, CommType::kByte, 1));
    SPINDLE_RETURN_IF_ERROR(CheckBuffer("send-recv send buffer", send, bytes));
    SPINDLE_RETURN_IF_ERROR(CheckBuffer("send-recv receive buffer", recv, bytes));
    SPINDLE_NCCL_RETURN(ncclGroupStart(), comm_);
    absl::Status s =
        NcclStatus(ncclSend(send, bytes, ncclUint8, to, comm_, stream_), "ncclSend", comm_);
    if (s.ok())
      s = NcclStatus(ncclRecv(recv, bytes, ncclUint8, from, comm_, stream_), "ncclRecv", comm_);
    absl::Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd", comm_);
    SPINDLE_RETURN_IF_ERROR(s);
    SPINDLE_RETURN_IF_ERROR(end);
    return Sync("send-recv");
  }
  absl::Status DoBarrier() override {
    // An all-reduce of one int on the device is NCCL's barrier.
    SPINDLE_RETURN_IF_ERROR(Usable());
    if (!barrier_buf_) SPINDLE_CUDA_RETURN(cudaMalloc(&barrier_buf_, sizeof(int32_t)));
    SPINDLE_NCCL_RETURN(
        ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclInt32, ncclSum, comm_, stream_), comm_);
    return Sync("barrier");
  }

 private:
  absl::Status Usable() {
    if (aborted_)
      return absl::FailedPreconditionError(
          "nccl: the communicator was aborted after an earlier failure");
    SPINDLE_CUDA_RETURN(cudaSetDevice(device_));
    return absl::OkStatus();
  }
  // Sizes: n >= 0 and the largest buffer (n * blocks elements) fits in int64 bytes.
  absl::Status Check(const char* what, int64_t n, CommType type, int blocks) {
    SPINDLE_RETURN_IF_ERROR(Usable());
    if (n < 0)
      return absl::InvalidArgumentError(absl::StrCat("nccl: ", what, " of ", n, " elements"));
    if (n > std::numeric_limits<int64_t>::max() / CommTypeSize(type) / blocks)
      return absl::InvalidArgumentError(
          absl::StrCat("nccl: ", what, " of ", n, " elements overflows the byte count"));
    return absl::OkStatus();
  }
  // A buffer of `bytes` bytes must be device (or managed) memory this GPU can use: a host pointer
  // handed to NCCL would fault on the device, not fail.
  absl::Status CheckBuffer(const char* what, const void* p, int64_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    if (p == nullptr) return absl::InvalidArgumentError(absl::StrCat("nccl: ", what, " is null"));
    cudaPointerAttributes a{};
    SPINDLE_CUDA_RETURN(cudaPointerGetAttributes(&a, p));
    if (a.type == cudaMemoryTypeManaged) return absl::OkStatus();
    if (a.type != cudaMemoryTypeDevice)
      return absl::InvalidArgumentError(
          absl::StrCat("nccl: ", what, " is not device memory (CUDA memory type ",
                       static_cast<int>(a.type), ")"));
    if (a.device != device_)
      return absl::InvalidArgumentError(absl::StrCat("nccl: ", what, " is on device ", a.device,
                                                     ", the communicator on device ", device_));
    return absl::OkStatus();
  }
  // Waits for the stream; a peer that is gone shows as an NCCL async error or as the timeout, and
  // either aborts the communicator (its stream work is cancelled) so the thread never hangs.
  absl::Status Sync(const char* what) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto limit = absl::ToChronoNanoseconds(timeout_);
    for (int spin = 0;; ++spin) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady)
        return absl::InternalError(
            absl::StrCat("nccl: ", what, ": stream: ", cudaGetErrorString(e)));
      ncclResult_t async = ncclSuccess;
      SPINDLE_NCCL_RETURN(ncclCommGetAsyncError(comm_, &async), comm_);
      if (async != ncclSuccess && async != ncclInProgress) {
        absl::Status s = NcclStatus(async, what, comm_);
        Abort();
        return absl::UnavailableError(s.message());
      }
      if (std::chrono::steady_clock::now() - t0 > limit) {
        Abort();
        return absl::DeadlineExceededError(
            absl::StrCat("nccl: ", what, " (rank ", rank(), " of ", size(),
                         ") did not finish within ", absl::FormatDuration(timeout_)));
      }
      if (spin < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    return absl::OkStatus();
  }
  void Abort() {
    ncclCommAbort(comm_);
    aborted_ = true;
  }

  const int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  const absl::Duration timeout_;
  bool aborted_ = false;         // communicator thread only (and the destructor after Shutdown)
  void* barrier_buf_ = nullptr;  // communicator thread only; freed in the destructor
};

absl::StatusOr<std::unique_ptr<Communicator>> Create(KvStore& store, const std::string& prefix,
                                                     int rank, int size, int device,
                                                     absl::Duration timeout) {
  int devices = 0;
  SPINDLE_CUDA_RETURN(cudaGetDeviceCount(&devices));
  if (device < 0 || device >= devices)
    return absl::InvalidArgumentError(
        absl::StrCat("nccl: device ", device, " is not one of the ", devices, " visible"));
  SPINDLE_CUDA_RETURN(cudaSetDevice(device));
  ncclUniqueId id;
  const std::string key = absl::StrCat(prefix, "/nccl_id");
  if (rank == 0) {
    SPINDLE_NCCL_RETURN(ncclGetUniqueId(&id), nullptr);
    SPINDLE_RETURN_IF_ERROR(
        store.Set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id))));
  } else {
    absl::StatusOr<std::string> v = store.Get(key, timeout);
    if (!v.ok()) return v.status();
    if (v->size() != sizeof(id))
      return absl::DataLossError(absl::StrCat("nccl: id under \"", key, "\" has ", v->size(),
                                              " bytes, expected ", sizeof(id)));
    std::memcpy(&id, v->data(), sizeof(id));
  }
  ncclComm_t comm;
  {
    absl::Status s = NcclStatus(ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank",
                                nullptr);
    if (!s.ok())
      return absl::Status(s.code(), absl::StrCat("communicator \"", prefix, "\" (rank ", rank,
                                                 " of ", size, "): ", s.message()));
  }
  cudaStream_t stream;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    ncclCommDestroy(comm);
    return absl::InternalError(absl::StrCat("nccl: cudaStreamCreate: ", cudaGetErrorString(e)));
  }
  return std::unique_ptr<Communicator>(
      new NcclCommunicator(rank, size, device, comm, stream, timeout));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(KvStore& store,
                                                                     const std::string& prefix,
                                                                     int rank, int size, int device,
                                                                     absl::Duration timeout) {
  if (size < 1 || rank < 0 || rank >= size)
    return absl::InvalidArgumentError(
        absl::StrCat("nccl: rank ", rank, " is not in a group of size ", size));
  return Create(store, prefix, rank, size, device, timeout);
}

}  // namespace spindle
