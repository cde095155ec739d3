// Device buffers through pinned host staging over a host communicator (see staged_communicator.h).
#include "worker/engine/comm/staged_communicator.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace spindle {
namespace {

absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat("staged communicator: ", what, ": ", cudaGetErrorString(e)));
}

class StagedCommunicator : public Communicator {
 public:
  StagedCommunicator(Communicator* host, int device, cudaStream_t stream)
      : Communicator(host->rank(), host->size()), host_(host), device_(device), stream_(stream) {}
  ~StagedCommunicator() override {
    Shutdown();
    for (void* p : {send_, recv_})
      if (p) cudaFreeHost(p);
    if (stream_) cudaStreamDestroy(stream_);
  }
  std::string backend() const override { return host_->backend() + "+staging"; }

 protected:
  absl::Status DoAllGather(const void* in, int64_t n, CommType type, void* out) override {
    const int64_t bytes = n * CommTypeSize(type);
    RETURN_IF_ERROR(Stage(bytes, bytes * size()));
    RETURN_IF_ERROR(ToHost(send_, in, bytes));
    RETURN_IF_ERROR(host_->AllGather(send_, n, type, recv_, running_layer()));
    return ToDevice(out, recv_, bytes * size());
  }
  absl::Status DoAllToAll(const void* in, int64_t n, CommType type, void* out) override {
    const int64_t bytes = n * CommTypeSize(type) * size();
    RETURN_IF_ERROR(Stage(bytes, bytes));
    RETURN_IF_ERROR(ToHost(send_, in, bytes));
    RETURN_IF_ERROR(host_->AllToAll(send_, n, type, recv_, running_layer()));
    return ToDevice(out, recv_, bytes);
  }
  // The blocks back to back on both sides: one copy each way.
  absl::Status DoAllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                           const std::vector<int64_t>& recv_bytes) override {
    int64_t sent = 0, received = 0;
    for (int64_t b : send_bytes) sent += b;
    for (int64_t b : recv_bytes) received += b;
    RETURN_IF_ERROR(Stage(sent, received));
    RETURN_IF_ERROR(ToHost(send_, in, sent));
    RETURN_IF_ERROR(host_->AllToAllV(send_, send_bytes, recv_, recv_bytes, running_layer()));
    return ToDevice(out, recv_, received);
  }
  // Each piece straight into (or out of) its place in the host blocks: one copy a piece.
  absl::Status DoAllToAllPieces(const std::vector<CommSendPiece>& send,
                                const std::vector<CommRecvPiece>& recv, int64_t block) override {
    RETURN_IF_ERROR(Stage(block * size(), block * size()));
    std::vector<int64_t> at(size(), 0);
    for (const CommSendPiece& p : send) {
      if (p.bytes)
        RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(Host(send_, p.peer * block + at[p.peer]), p.p, p.bytes,
                                             cudaMemcpyDeviceToHost, stream_),
                             "cudaMemcpyAsync to the host"));
      at[p.peer] += p.bytes;
    }
    RETURN_IF_ERROR(Sync());
    RETURN_IF_ERROR(host_->AllToAll(send_, block, CommType::kByte, recv_, running_layer()));
    std::fill(at.begin(), at.end(), 0);
    for (const CommRecvPiece& p : recv) {
      if (p.bytes)
        RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(p.p, Host(recv_, p.peer * block + at[p.peer]), p.bytes,
                                             cudaMemcpyHostToDevice, stream_),
                             "cudaMemcpyAsync to the device"));
      at[p.peer] += p.bytes;
    }
    return Sync();
  }
  absl::Status DoAllReduceSum(void* buf, int64_t n, CommType type) override {
    const int64_t bytes = n * CommTypeSize(type);
    RETURN_IF_ERROR(Stage(bytes, 0));
    RETURN_IF_ERROR(ToHost(send_, buf, bytes));
    RETURN_IF_ERROR(host_->AllReduceSum(send_, n, type, running_layer()));
    return ToDevice(buf, send_, bytes);
  }
  absl::Status DoReduceScatterSum(const float* in, int64_t n, float* out) override {
    const int64_t bytes = n * 4;
    RETURN_IF_ERROR(Stage(bytes * size(), bytes));
    RETURN_IF_ERROR(ToHost(send_, in, bytes * size()));
    RETURN_IF_ERROR(host_->ReduceScatterSum(static_cast<const float*>(send_), n,
                                            static_cast<float*>(recv_), running_layer()));
    return ToDevice(out, recv_, bytes);
  }
  absl::Status DoBroadcast(void* buf, int64_t n, CommType type, int root) override {
    const int64_t bytes = n * CommTypeSize(type);
    RETURN_IF_ERROR(Stage(bytes, 0));
    if (rank() == root) RETURN_IF_ERROR(ToHost(send_, buf, bytes));
    RETURN_IF_ERROR(host_->Broadcast(send_, n, type, root, running_layer()));
    return rank() == root ? absl::OkStatus() : ToDevice(buf, send_, bytes);
  }
  absl::Status DoBarrier() override { return host_->Barrier(); }
  absl::Status DoSendRecv(const void* send, int to, void* recv, int from, int64_t bytes) override {
    RETURN_IF_ERROR(Stage(bytes, bytes));
    RETURN_IF_ERROR(ToHost(send_, send, bytes));
    RETURN_IF_ERROR(host_->SendRecv(send_, to, recv_, from, bytes, running_layer()));
    return ToDevice(recv, recv_, bytes);
  }
  // The buffers are device memory: a group of one runs through the host communicator too.
  bool LocalWhenAlone() const override { return false; }

 private:
  static void* Host(void* base, int64_t offset) { return static_cast<char*>(base) + offset; }

  // Pinned blocks of at least send_bytes and recv_bytes (grown, never shrunk).
  absl::Status Stage(int64_t send_bytes, int64_t recv_bytes) {
    RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "cudaSetDevice"));
    for (auto [p, have, need] : {std::tuple{&send_, &send_bytes_, send_bytes},
                                 std::tuple{&recv_, &recv_bytes_, recv_bytes}}) {
      if (need <= *have) continue;
      if (*p) cudaFreeHost(*p);
      *p = nullptr;
      *have = 0;
      RETURN_IF_ERROR(Cuda(cudaHostAlloc(p, static_cast<size_t>(need), cudaHostAllocDefault),
                           "cudaHostAlloc of the staging"));
      *have = need;
    }
    return absl::OkStatus();
  }
  absl::Status Sync() { return Cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
  absl::Status ToHost(void* dst, const void* src, int64_t bytes) {
    if (bytes > 0)
      RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_),
                           "cudaMemcpyAsync to the host"));
    return Sync();
  }
  absl::Status ToDevice(void* dst, const void* src, int64_t bytes) {
    if (bytes > 0)
      RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_),
                           "cudaMemcpyAsync to the device"));
    return Sync();
  }

  Communicator* const host_;
  const int device_;
  cudaStream_t stream_;
  // Used only on the communicator thread.
  void* send_ = nullptr;
  void* recv_ = nullptr;
  int64_t send_bytes_ = 0, recv_bytes_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateStagedCommunicator(Communicator* host,
                                                                       int device) {
  if (host == nullptr)
    return absl::InvalidArgumentError("staged communicator: no host communicator");
  RETURN_IF_ERROR(Cuda(cudaSetDevice(device), "cudaSetDevice"));
  cudaStream_t stream = nullptr;
  RETURN_IF_ERROR(
      Cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"));
  return std::unique_ptr<Communicator>(new StagedCommunicator(host, device, stream));
}

}  // namespace spindle
