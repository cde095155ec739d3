// Communicator: the engine's one interface to collectives (DESIGN.md section 3), with a Gloo
// backend (CPU, TCP; gloo_communicator.h) and an NCCL backend (GPU; nccl_communicator.h, built
// only with CUDA). Every collective runs on the communicator's own thread, in issue order, so a
// caller can start one (the *Async forms), do local work, and Wait() for it; the synchronous forms
// are Async + Wait. Ranks must issue the same collectives in the same order.
//
// Accounting: every collective is recorded under (collective, layer type) with the seconds it ran
// on the communicator thread (queueing excluded) and the bytes this rank sends under the standard
// algorithms: all-gather (n-1)*in, all-to-all (n-1)/n*in (by pieces or blocks of their own
// sizes: those for the other ranks), all-reduce 2(n-1)/n*buf (ring), reduce-scatter (n-1)/n*in, broadcast buf at the root,
// send-recv the bytes sent (0 to itself), barrier 0. TakeStats() returns and resets them (the
// trainer emits them per step).
//
// Buffers are raw host pointers for Gloo and device pointers for NCCL; they must stay valid and
// untouched until the collective's handle is waited on. Errors (peer gone, timeout) come back as
// absl::Status from Wait(); no exception leaves this interface.
//
// Thread-safety: all methods are thread-safe; collectives issued from several threads run in the
// order they were enqueued (which then must match across ranks).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace spindle {

enum class Collective {
  kAllGather,
  kAllToAll,
  kAllReduce,
  kReduceScatter,
  kBroadcast,
  kBarrier,
  kSendRecv
};
const char* CollectiveName(Collective c);

// What a collective serves, for the metrics' layer_type label.
enum class CommLayer { kLightning, kMla, kMoe, kGrad, kOther };
const char* CommLayerName(CommLayer l);

enum class CommType { kF32, kF64, kI32, kByte };
int64_t CommTypeSize(CommType t);

struct CommAmount {
  double seconds = 0.0;
  int64_t bytes = 0;
  int64_t calls = 0;
};
using CommStats = std::map<std::pair<Collective, CommLayer>, CommAmount>;

// One contiguous piece of an all-to-all by pieces: `bytes` at `p` to or from rank `peer`.
struct CommSendPiece {
  int peer;
  const void* p;
  int64_t bytes;
};
struct CommRecvPiece {
  int peer;
  void* p;
  int64_t bytes;
};

// A started collective. Wait() blocks until it finished and returns its status (once; later
// calls return the same status). A default-constructed handle is already done with OK.
class CommHandle {
 public:
  CommHandle() = default;
  absl::Status Wait();
  bool valid() const { return state_ != nullptr; }

 private:
  friend class Communicator;
  struct State {
    absl::Notification done;
    absl::Status status;
  };
  std::shared_ptr<State> state_;
};

class Communicator {
 public:
  virtual ~Communicator();
  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual std::string backend() const = 0;

  // out[r * n + i] = in_r[i]: every rank's n elements, in rank order.
  CommHandle AllGatherAsync(const void* in, int64_t n, CommType type, void* out, CommLayer layer);
  // Block j of `in` (n elements each) goes to rank j; block i of `out` came from rank i.
  CommHandle AllToAllAsync(const void* in, int64_t n, CommType type, void* out, CommLayer layer);
  // An all-to-all whose data to and from each rank lie in several pieces: the k-th piece this rank
  // lists for rank j in `send` is the k-th piece rank j lists for this rank in `recv`, of the same
  // size, so an exchange can gather from and scatter to places that are not one block a rank.
  // Every rank sends every other the same number of bytes in all (InvalidArgument otherwise, and
  // for a peer out of range); send and receive pieces must not overlap.
  CommHandle AllToAllPiecesAsync(std::vector<CommSendPiece> send, std::vector<CommRecvPiece> recv,
                                 CommLayer layer);
  // An all-to-all whose blocks have sizes of their own: send_bytes[j] bytes of `in` (the blocks
  // back to back in rank order) go to rank j, and recv_bytes[i] bytes from rank i land in `out`
  // (back to back in rank order). Rank i's recv_bytes[j] must be rank j's send_bytes[i] (callers
  // exchange the sizes first, as the MoE dispatch does). InvalidArgument for vectors that are not
  // size() long or a negative size.
  CommHandle AllToAllVAsync(const void* in, std::vector<int64_t> send_bytes, void* out,
                            std::vector<int64_t> recv_bytes, CommLayer layer);
  // Elementwise sum over ranks, in place. Every rank receives bitwise the same result.
  CommHandle AllReduceSumAsync(void* buf, int64_t n, CommType type, CommLayer layer);
  // out[i] = sum over ranks of in_r[rank * n + i]: `in` holds size() blocks of n floats.
  CommHandle ReduceScatterSumAsync(const float* in, int64_t n, float* out, CommLayer layer);
  CommHandle BroadcastAsync(void* buf, int64_t n, CommType type, int root, CommLayer layer);
  // Point to point, one step of a ring: sends `bytes` at `send` to rank `to` and receives `bytes`
  // from rank `from` into `recv` (send and recv must not overlap). Rank `to` issues, at the same
  // place in its sequence, a SendRecv with from == this rank, and rank `from` one with to == this
  // rank, both of `bytes`; every rank of the communicator issues the same number of SendRecvs
  // (backends number them to match the pairs). to == from == rank() copies (a group of one).
  // InvalidArgument for a peer out of range, a negative size, or only one of to and from being
  // this rank.
  CommHandle SendRecvAsync(const void* send, int to, void* recv, int from, int64_t bytes,
                           CommLayer layer);

  absl::Status AllGather(const void* in, int64_t n, CommType type, void* out, CommLayer layer) {
    return AllGatherAsync(in, n, type, out, layer).Wait();
  }
  absl::Status AllToAll(const void* in, int64_t n, CommType type, void* out, CommLayer layer) {
    return AllToAllAsync(in, n, type, out, layer).Wait();
  }
  absl::Status AllToAllPieces(std::vector<CommSendPiece> send, std::vector<CommRecvPiece> recv,
                              CommLayer layer) {
    return AllToAllPiecesAsync(std::move(send), std::move(recv), layer).Wait();
  }
  absl::Status AllToAllV(const void* in, std::vector<int64_t> send_bytes, void* out,
                         std::vector<int64_t> recv_bytes, CommLayer layer) {
    return AllToAllVAsync(in, std::move(send_bytes), out, std::move(recv_bytes), layer).Wait();
  }
  absl::Status AllReduceSum(void* buf, int64_t n, CommType type, CommLayer layer) {
    return AllReduceSumAsync(buf, n, type, layer).Wait();
  }
  absl::Status ReduceScatterSum(const float* in, int64_t n, float* out, CommLayer layer) {
    return ReduceScatterSumAsync(in, n, out, layer).Wait();
  }
  absl::Status Broadcast(void* buf, int64_t n, CommType type, int root, CommLayer layer) {
    return BroadcastAsync(buf, n, type, root, layer).Wait();
  }
  absl::Status SendRecv(const void* send, int to, void* recv, int from, int64_t bytes,
                        CommLayer layer) {
    return SendRecvAsync(send, to, recv, from, bytes, layer).Wait();
  }
  absl::Status Barrier();

  // Returns the amounts recorded since the last call and resets them.
  CommStats TakeStats();

 protected:
  Communicator(int rank, int size);
  // Stops the communicator thread after the queued collectives ran. Backends call it first thing
  // in their destructor, before their own state goes away.
  void Shutdown();

  // The backend's blocking collectives, called only on the communicator thread. Exceptions must
  // not escape them. Sizes are in elements of `type`.
  virtual absl::Status DoAllGather(const void* in, int64_t n, CommType type, void* out) = 0;
  virtual absl::Status DoAllToAll(const void* in, int64_t n, CommType type, void* out) = 0;
  // By default through DoAllToAll: the pieces packed into one block a rank in host memory and
  // unpacked after (host-memory backends; the blocks are kept for the next call, up to the
  // largest exchange's size); `block` is each rank's total in bytes.
  virtual absl::Status DoAllToAllPieces(const std::vector<CommSendPiece>& send,
                                        const std::vector<CommRecvPiece>& recv, int64_t block);
  // By default through DoAllGather of each rank's largest block and DoAllToAll of blocks padded
  // to the largest of all, in host memory (host-memory backends may do better: Gloo does).
  virtual absl::Status DoAllToAllV(const void* in, const std::vector<int64_t>& send_bytes,
                                   void* out, const std::vector<int64_t>& recv_bytes);
  virtual absl::Status DoAllReduceSum(void* buf, int64_t n, CommType type) = 0;
  virtual absl::Status DoReduceScatterSum(const float* in, int64_t n, float* out) = 0;
  virtual absl::Status DoBroadcast(void* buf, int64_t n, CommType type, int root) = 0;
  virtual absl::Status DoBarrier() = 0;
  // to and from are valid peers, not both this rank when LocalWhenAlone(); bytes > 0.
  virtual absl::Status DoSendRecv(const void* send, int to, void* recv, int from,
                                  int64_t bytes) = 0;
  // Whether a group of one is served here without the backend (host memmove for the copying
  // collectives, nothing for the others). True for host-memory backends; NCCL says false: its
  // buffers are device memory, and NCCL runs a group of one itself.
  virtual bool LocalWhenAlone() const { return true; }
  // The layer type of the collective running now (on the communicator thread only): what a
  // backend that forwards to another communicator records there.
  CommLayer running_layer() const { return running_layer_; }

 private:
  CommHandle Enqueue(Collective c, CommLayer layer, int64_t bytes, std::function<absl::Status()> fn);
  void Loop();

  const int rank_, size_;
  struct Task {
    Collective collective;
    CommLayer layer;
    int64_t bytes;
    std::function<absl::Status()> fn;
    std::shared_ptr<CommHandle::State> state;
  };
  absl::Mutex mu_;
  std::vector<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  CommStats stats_ ABSL_GUARDED_BY(mu_);
  CommLayer running_layer_ = CommLayer::kOther;  // the communicator thread's
  std::vector<char> pack_in_, pack_out_;  // DoAllToAllPieces' blocks (the communicator thread's)
  std::thread thread_;
};

}  // namespace spindle
