// The communicator thread, handles and per-collective accounting (see communicator.h).
#include "worker/engine/comm/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace spindle {

const char* CollectiveName(Collective c) {
  switch (c) {
    case Collective::kAllGather: return "all_gather";
    case Collective::kAllToAll: return "all_to_all";
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kBarrier: return "barrier";
    case Collective::kSendRecv:
      return "send_recv";
  }
  return "unknown";
}

const char* CommLayerName(CommLayer l) {
  switch (l) {
    case CommLayer::kLightning: return "lightning";
    case CommLayer::kMla: return "mla";
    case CommLayer::kMoe: return "moe";
    case CommLayer::kGrad: return "grad";
    case CommLayer::kOther: return "other";
  }
  return "other";
}

int64_t CommTypeSize(CommType t) {
  switch (t) {
    case CommType::kF64: return 8;
    case CommType::kByte: return 1;
    default: return 4;
  }
}

absl::Status CommHandle::Wait() {
  if (!state_) return absl::OkStatus();
  state_->done.WaitForNotification();
  return state_->status;
}

Communicator::Communicator(int rank, int size)
    : rank_(rank), size_(size), thread_([this] { Loop(); }) {}

Communicator::~Communicator() { Shutdown(); }

void Communicator::Shutdown() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void Communicator::Loop() {
  for (;;) {
    Task task;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(
          +[](Communicator* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) {
            return c->stopping_ || !c->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping, nothing left
      task = std::move(queue_.front());
      queue_.erase(queue_.begin());
    }
    const auto t0 = std::chrono::steady_clock::now();
    running_layer_ = task.layer;
    absl::Status s = task.fn();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      absl::MutexLock l(&mu_);
      CommAmount& a = stats_[{task.collective, task.layer}];
      a.seconds += dt;
      a.bytes += task.bytes;
      a.calls += 1;
    }
    task.state->status = std::move(s);
    task.state->done.Notify();
  }
}

CommHandle Communicator::Enqueue(Collective c, CommLayer layer, int64_t bytes,
                                 std::function<absl::Status()> fn) {
  CommHandle h;
  h.state_ = std::make_shared<CommHandle::State>();
  absl::MutexLock l(&mu_);
  if (stopping_) {
    h.state_->status = absl::FailedPreconditionError("communicator: shut down");
    h.state_->done.Notify();
    return h;
  }
  queue_.push_back(Task{c, layer, bytes, std::move(fn), h.state_});
  return h;
}

CommHandle Communicator::AllGatherAsync(const void* in, int64_t n, CommType type, void* out,
                                        CommLayer layer) {
  const int64_t nb = n * CommTypeSize(type);
  return Enqueue(Collective::kAllGather, layer, (size_ - 1) * nb, [=, this]() {
    if (size_ == 1 && LocalWhenAlone()) {
      if (nb) std::memmove(out, in, nb);
      return absl::OkStatus();
    }
    return DoAllGather(in, n, type, out);
  });
}

CommHandle Communicator::AllToAllAsync(const void* in, int64_t n, CommType type, void* out,
                                       CommLayer layer) {
  const int64_t nb = n * CommTypeSize(type);
  return Enqueue(Collective::kAllToAll, layer, (size_ - 1) * nb, [=, this]() {
    if (size_ == 1 && LocalWhenAlone()) {
      if (nb) std::memmove(out, in, nb);
      return absl::OkStatus();
    }
    return DoAllToAll(in, n, type, out);
  });
}

namespace {
// Adds each piece's bytes to its peer's total in `totals` (one a rank); an error names a peer out
// of range.
template <typename Piece>
absl::Status AddPeerTotals(const std::vector<Piece>& pieces, const char* what,
                           std::vector<int64_t>* totals) {
  const int size = static_cast<int>(totals->size());
  for (const Piece& p : pieces) {
    if (p.peer < 0 || p.peer >= size || p.bytes < 0)
      return absl::InvalidArgumentError(absl::StrCat("all-to-all by pieces: a ", what, " piece of ",
                                                     p.bytes, " bytes for rank ", p.peer,
                                                     " in a group of ", size));
    (*totals)[p.peer] += p.bytes;
  }
  return absl::OkStatus();
}
}  // namespace

CommHandle Communicator::AllToAllPiecesAsync(std::vector<CommSendPiece> send,
                                             std::vector<CommRecvPiece> recv, CommLayer layer) {
  int64_t out_bytes = 0;
  for (const CommSendPiece& p : send)
    if (p.peer != rank_) out_bytes += p.bytes;
  return Enqueue(
      Collective::kAllToAll, layer, out_bytes,
      [this, send = std::move(send), recv = std::move(recv)]() -> absl::Status {
        std::vector<int64_t> sent(size_, 0), received(size_, 0);
        absl::Status s = AddPeerTotals(send, "send", &sent);
        if (s.ok()) s = AddPeerTotals(recv, "receive", &received);
        if (!s.ok()) return s;
        for (int r = 0; r < size_; ++r)
          if (sent[r] != sent[0] || received[r] != sent[0])
            return absl::InvalidArgumentError(absl::StrCat(
                "all-to-all by pieces: every rank's total must be the same, but this rank sends "
                "rank 0 ",
                sent[0], " bytes, rank ", r, " ", sent[r], " and receives ", received[r],
                " from rank ", r));
        if (size_ == 1 && LocalWhenAlone()) {
          // The k-th send piece is the k-th receive piece.
          for (size_t i = 0; i < send.size(); ++i) {
            const int64_t got = i < recv.size() ? recv[i].bytes : -1;
            if (send[i].bytes != got)
              return absl::InvalidArgumentError(absl::StrCat("all-to-all by pieces: send piece ", i,
                                                             " has ", send[i].bytes,
                                                             " bytes, its receive piece ", got));
            if (got) std::memmove(recv[i].p, send[i].p, got);
          }
          return absl::OkStatus();
        }
        return DoAllToAllPieces(send, recv, sent[0]);
      });
}

absl::Status Communicator::DoAllToAllPieces(const std::vector<CommSendPiece>& send,
                                            const std::vector<CommRecvPiece>& recv, int64_t block) {
  // The blocks are kept from call to call: a fresh buffer would be zeroed and page-faulted in
  // every exchange, several times the cost of the copies themselves.
  const size_t bytes = static_cast<size_t>(block * size_);
  if (pack_in_.size() < bytes) pack_in_.resize(bytes);
  if (pack_out_.size() < bytes) pack_out_.resize(bytes);
  char* in = pack_in_.data();
  char* out = pack_out_.data();
  std::vector<int64_t> at(size_, 0);
  for (const CommSendPiece& p : send) {
    if (p.bytes) std::memcpy(in + p.peer * block + at[p.peer], p.p, p.bytes);
    at[p.peer] += p.bytes;
  }
  if (absl::Status s = DoAllToAll(in, block, CommType::kByte, out); !s.ok()) return s;
  std::fill(at.begin(), at.end(), 0);
  for (const CommRecvPiece& p : recv) {
    if (p.bytes) std::memcpy(p.p, out + p.peer * block + at[p.peer], p.bytes);
    at[p.peer] += p.bytes;
  }
  return absl::OkStatus();
}

CommHandle Communicator::AllToAllVAsync(const void* in, std::vector<int64_t> send_bytes, void* out,
                                        std::vector<int64_t> recv_bytes, CommLayer layer) {
  int64_t out_bytes = 0;
  for (size_t r = 0; r < send_bytes.size(); ++r)
    if (static_cast<int>(r) != rank_) out_bytes += send_bytes[r];
  return Enqueue(Collective::kAllToAll, layer, out_bytes,
                 [this, in, out, send = std::move(send_bytes),
                  recv = std::move(recv_bytes)]() -> absl::Status {
                   if (static_cast<int>(send.size()) != size_ ||
                       static_cast<int>(recv.size()) != size_)
                     return absl::InvalidArgumentError(absl::StrCat(
                         "all-to-all of sized blocks: ", send.size(), " send and ", recv.size(),
                         " receive sizes in a group of ", size_));
                   for (int r = 0; r < size_; ++r)
                     if (send[r] < 0 || recv[r] < 0)
                       return absl::InvalidArgumentError(
                           absl::StrCat("all-to-all of sized blocks: a negative size for rank ", r));
                   if (size_ == 1 && LocalWhenAlone()) {
                     if (send[0] != recv[0])
                       return absl::InvalidArgumentError(absl::StrCat(
                           "all-to-all of sized blocks: a group of one sends ", send[0],
                           " bytes and receives ", recv[0]));
                     if (send[0]) std::memmove(out, in, send[0]);
                     return absl::OkStatus();
                   }
                   return DoAllToAllV(in, send, out, recv);
                 });
}

absl::Status Communicator::DoAllToAllV(const void* in, const std::vector<int64_t>& send_bytes,
                                       void* out, const std::vector<int64_t>& recv_bytes) {
  int64_t mine = 0;
  for (int64_t b : send_bytes) mine = std::max(mine, b);
  std::vector<int64_t> largest(size_);
  if (absl::Status s = DoAllGather(&mine, 1, CommType::kF64 /*8 bytes*/, largest.data()); !s.ok())
    return s;
  int64_t block = 0;
  for (int64_t b : largest) block = std::max(block, b);
  std::vector<char> packed(static_cast<size_t>(block * size_)), received(packed.size());
  const char* src = static_cast<const char*>(in);
  for (int r = 0; r < size_; ++r) {
    if (send_bytes[r]) std::memcpy(packed.data() + r * block, src, send_bytes[r]);
    src += send_bytes[r];
  }
  if (block > 0) {
    absl::Status s = DoAllToAll(packed.data(), block, CommType::kByte, received.data());
    if (!s.ok()) return s;
  }
  char* dst = static_cast<char*>(out);
  for (int r = 0; r < size_; ++r) {
    if (recv_bytes[r]) std::memcpy(dst, received.data() + r * block, recv_bytes[r]);
    dst += recv_bytes[r];
  }
  return absl::OkStatus();
}

CommHandle Communicator::AllReduceSumAsync(void* buf, int64_t n, CommType type, CommLayer layer) {
  const int64_t bytes = 2 * (size_ - 1) * n * CommTypeSize(type) / size_;
  return Enqueue(Collective::kAllReduce, layer, bytes, [=, this]() {
    return size_ == 1 && LocalWhenAlone() ? absl::OkStatus() : DoAllReduceSum(buf, n, type);
  });
}

CommHandle Communicator::ReduceScatterSumAsync(const float* in, int64_t n, float* out,
                                               CommLayer layer) {
  return Enqueue(Collective::kReduceScatter, layer, (size_ - 1) * n * 4, [=, this]() {
    if (size_ == 1 && LocalWhenAlone()) {
      if (n) std::memmove(out, in, n * 4);
      return absl::OkStatus();
    }
    return DoReduceScatterSum(in, n, out);
  });
}

CommHandle Communicator::BroadcastAsync(void* buf, int64_t n, CommType type, int root,
                                        CommLayer layer) {
  const int64_t bytes = rank_ == root ? n * CommTypeSize(type) : 0;
  return Enqueue(Collective::kBroadcast, layer, size_ > 1 ? bytes : 0, [=, this]() {
    return size_ == 1 && LocalWhenAlone() ? absl::OkStatus() : DoBroadcast(buf, n, type, root);
  });
}

CommHandle Communicator::SendRecvAsync(const void* send, int to, void* recv, int from,
                                       int64_t bytes, CommLayer layer) {
  return Enqueue(
      Collective::kSendRecv, layer, to != rank_ ? bytes : 0, [=, this]() -> absl::Status {
        if (to < 0 || to >= size_ || from < 0 || from >= size_ || bytes < 0)
          return absl::InvalidArgumentError(absl::StrCat("send-recv: ", bytes, " bytes to rank ",
                                                         to, " and from rank ", from,
                                                         " in a group of ", size_));
        if ((to == rank_) != (from == rank_))
          return absl::InvalidArgumentError(absl::StrCat(
              "send-recv: rank ", rank_, " sends to rank ", to, " but receives from rank ", from,
              "; a rank that sends to itself receives from itself"));
        if (bytes == 0) return absl::OkStatus();
        if (to == rank_ && LocalWhenAlone()) {
          std::memmove(recv, send, bytes);
          return absl::OkStatus();
        }
        return DoSendRecv(send, to, recv, from, bytes);
      });
}

absl::Status Communicator::Barrier() {
  return Enqueue(Collective::kBarrier, CommLayer::kOther, 0, [this]() {
           return size_ == 1 && LocalWhenAlone() ? absl::OkStatus() : DoBarrier();
         }).Wait();
}

CommStats Communicator::TakeStats() {
  absl::MutexLock l(&mu_);
  CommStats s = std::move(stats_);
  stats_.clear();
  return s;
}

}  // namespace spindle
