// NCCL backend of Communicator (see nccl_communicator.h).
#include "worker/engine/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <vector>

#include "absl/strings/escaping.h"
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

#define SPINDLE_NCCL_RETURN(call)                                                                 \
  do {                                                                                            \
    ncclResult_t r_ = (call);                                                                     \
    if (r_ != ncclSuccess)                                                                        \
      return absl::UnavailableError(absl::StrCat(#call, " at ", __FILE__, ":", __LINE__, ": ",    \
                                                 ncclGetErrorString(r_)));                        \
  } while (0)

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
  NcclCommunicator(int rank, int size, int device, ncclComm_t comm, cudaStream_t stream)
      : Communicator(rank, size), device_(device), comm_(comm), stream_(stream) {}
  ~NcclCommunicator() override {
    Shutdown();
    ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }
  std::string backend() const override { return "nccl"; }

 protected:
  absl::Status Sync() {
    SPINDLE_CUDA_RETURN(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  absl::Status DoAllGather(const void* in, int64_t n, CommType type, void* out) override {
    SPINDLE_CUDA_RETURN(cudaSetDevice(device_));
    SPINDLE_NCCL_RETURN(ncclAllGather(in, out, n, NcclType(type), comm_, stream_));
    return Sync();
  }
  absl::Status DoAllToAll(const void* in, int64_t n, CommType type, void* out) override {
    SPINDLE_CUDA_RETURN(cudaSetDevice(device_));
    const size_t block = static_cast<size_t>(n * CommTypeSize(type));
    SPINDLE_NCCL_RETURN(ncclGroupStart());
    for (int r = 0; r < size(); ++r) {
      SPINDLE_NCCL_RETURN(ncclSend(static_cast<const char*>(in) + r * block, n, NcclType(type), r,
                                   comm_, stream_));
      SPINDLE_NCCL_RETURN(
          ncclRecv(static_cast<char*>(out) + r * block, n, NcclType(type), r, comm_, stream_));
    }
    SPINDLE_NCCL_RETURN(ncclGroupEnd());
    return Sync();
  }
  absl::Status DoAllReduceSum(void* buf, int64_t n, CommType type) override {
    if (type == CommType::kByte) return absl::InvalidArgumentError("nccl: sum of bytes");
    SPINDLE_CUDA_RETURN(cudaSetDevice(device_));
    SPINDLE_NCCL_RETURN(ncclAllReduce(buf, buf, n, NcclType(type), ncclSum, comm_, stream_));
    return Sync();
  }
  absl::Status DoReduceScatterSum(const float* in, int64_t n, float* out) override {
    SPINDLE_CUDA_RETURN(cudaSetDevice(device_));
    SPINDLE_NCCL_RETURN(ncclReduceScatter(in, out, n, ncclFloat32, ncclSum, comm_, stream_));
    return Sync();
  }
  absl::Status DoBroadcast(void* buf, int64_t n, CommType type, int root) override {
    SPINDLE_CUDA_RETURN(cudaSetDevice(device_));
    SPINDLE_NCCL_RETURN(ncclBroadcast(buf, buf, n, NcclType(type), root, comm_, stream_));
    return Sync();
  }
  absl::Status DoBarrier() override {
    // An all-reduce of one int on the device is NCCL's barrier.
    SPINDLE_CUDA_RETURN(cudaSetDevice(device_));
    if (!barrier_buf_) SPINDLE_CUDA_RETURN(cudaMalloc(&barrier_buf_, sizeof(int32_t)));
    SPINDLE_NCCL_RETURN(ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclInt32, ncclSum, comm_,
                                      stream_));
    return Sync();
  }

 private:
  const int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  void* barrier_buf_ = nullptr;  // communicator thread only; freed with the process
};

absl::StatusOr<std::unique_ptr<Communicator>> Create(KvStore& store, const std::string& prefix,
                                                     int rank, int size, int device,
                                                     absl::Duration timeout) {
  ncclUniqueId id;
  const std::string key = absl::StrCat(prefix, "/nccl_id");
  if (rank == 0) {
    SPINDLE_NCCL_RETURN(ncclGetUniqueId(&id));
    absl::Status s = store.Set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
    if (!s.ok()) return s;
  } else {
    absl::StatusOr<std::string> v = store.Get(key, timeout);
    if (!v.ok()) return v.status();
    if (v->size() != sizeof(id))
      return absl::DataLossError(absl::StrCat("nccl: id under \"", key, "\" has ", v->size(),
                                              " bytes, expected ", sizeof(id)));
    std::memcpy(&id, v->data(), sizeof(id));
  }
  SPINDLE_CUDA_RETURN(cudaSetDevice(device));
  ncclComm_t comm;
  SPINDLE_NCCL_RETURN(ncclCommInitRank(&comm, size, id, rank));
  cudaStream_t stream;
  SPINDLE_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return std::unique_ptr<Communicator>(new NcclCommunicator(rank, size, device, comm, stream));
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
