// Gloo backend of Communicator (see gloo_communicator.h). Gloo reports failures by throwing;
// every Gloo call is wrapped here and its exception turned into an absl::Status.
#include "worker/engine/comm/gloo_communicator.h"

#include <signal.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/alltoall.h"
#include "gloo/alltoallv.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"

namespace spindle {
namespace {

// Gloo's TCP transport writes without MSG_NOSIGNAL: a write to a peer that went away would end
// the whole process with SIGPIPE instead of failing with EPIPE for the collective to report. So
// a process that makes a Gloo communicator ignores SIGPIPE (unless it installed a handler).
void IgnoreSigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL)
    ::signal(SIGPIPE, SIG_IGN);
}

// gloo::rendezvous::Store over a KvStore. Gloo expects failures as exceptions.
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(KvStore& store, absl::Duration timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = store_.Set(key, std::string(data.begin(), data.end()));
    if (!s.ok()) throw gloo::IoException(std::string(s.message()));
  }
  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> v = store_.Get(key, timeout_);
    if (!v.ok()) throw gloo::IoException(std::string(v.status().message()));
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, ToChrono(timeout_)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    for (const std::string& k : keys) {
      absl::StatusOr<std::string> v = store_.Get(k, absl::Milliseconds(t.count()));
      if (!v.ok()) throw gloo::IoException(std::string(v.status().message()));
    }
  }

 private:
  static std::chrono::milliseconds ToChrono(absl::Duration d) {
    return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
  }
  KvStore& store_;
  const absl::Duration timeout_;
};

// Runs a Gloo call, converting its exceptions. An I/O failure inside a collective means a peer's
// connection broke or went silent, which is how the other ranks see a rank that died or a host
// that vanished: the message says so before Gloo's own words.
template <typename F>
absl::Status Guard(const char* what, F&& f) {
  try {
    f();
    return absl::OkStatus();
  } catch (const gloo::IoException& e) {
    if (std::strcmp(what, "rendezvous") == 0)
      return absl::UnavailableError(absl::StrCat("gloo ", what, ": ", e.what()));
    return absl::UnavailableError(
        absl::StrCat("gloo ", what, ": lost contact with another rank (it stopped, or its host or ",
                     "the network failed): ", e.what()));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("gloo ", what, ": ", e.what()));
  } catch (...) {
    return absl::UnavailableError(absl::StrCat("gloo ", what, ": unknown error"));
  }
}

uint8_t* Bytes(const void* p) { return static_cast<uint8_t*>(const_cast<void*>(p)); }

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(int rank, int size, std::shared_ptr<gloo::Context> ctx,
                   std::chrono::milliseconds timeout)
      : Communicator(rank, size), ctx_(std::move(ctx)), timeout_(timeout) {}
  ~GlooCommunicator() override { Shutdown(); }
  std::string backend() const override { return "gloo"; }

 protected:
  absl::Status DoAllGather(const void* in, int64_t n, CommType type, void* out) override {
    const size_t nb = static_cast<size_t>(n * CommTypeSize(type));
    return Guard("all-gather", [&] {
      gloo::AllgatherOptions o(ctx_);
      o.setInput(Bytes(in), nb);
      o.setOutput(Bytes(out), nb * size());
      o.setTimeout(timeout_);
      gloo::allgather(o);
    });
  }
  absl::Status DoAllToAll(const void* in, int64_t n, CommType type, void* out) override {
    const size_t nb = static_cast<size_t>(n * CommTypeSize(type)) * size();
    return Guard("all-to-all", [&] {
      gloo::AlltoallOptions o(ctx_);
      o.setInput(Bytes(in), nb);
      o.setOutput(Bytes(out), nb);
      o.setTimeout(timeout_);
      gloo::alltoall(o);
    });
  }
  absl::Status DoAllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                           const std::vector<int64_t>& recv_bytes) override {
    return Guard("all-to-all", [&] {
      gloo::AlltoallvOptions o(ctx_);
      o.setInput<uint8_t>(Bytes(in), send_bytes);
      o.setOutput<uint8_t>(Bytes(out), recv_bytes);
      o.setTimeout(timeout_);
      gloo::alltoallv(o);
    });
  }
  absl::Status DoAllReduceSum(void* buf, int64_t n, CommType type) override {
    return Guard("all-reduce", [&] {
      gloo::AllreduceOptions o(ctx_);
      using Fn = void (*)(void*, const void*, const void*, size_t);
      switch (type) {
        case CommType::kF32:
          o.setOutput(static_cast<float*>(buf), n);
          o.setReduceFunction(static_cast<Fn>(&gloo::sum<float>));
          break;
        case CommType::kF64:
          o.setOutput(static_cast<double*>(buf), n);
          o.setReduceFunction(static_cast<Fn>(&gloo::sum<double>));
          break;
        case CommType::kI32:
          o.setOutput(static_cast<int32_t*>(buf), n);
          o.setReduceFunction(static_cast<Fn>(&gloo::sum<int32_t>));
          break;
        case CommType::kByte:
          throw gloo::InvalidOperationException("sum of bytes is not supported");
      }
      o.setTimeout(timeout_);
      gloo::allreduce(o);
    });
  }
  // All-to-all of the blocks, then a local sum: the same bytes on the wire as a ring
  // reduce-scatter, and no size restriction.
  absl::Status DoReduceScatterSum(const float* in, int64_t n, float* out) override {
    scratch_.resize(static_cast<size_t>(n) * size());
    absl::Status s = DoAllToAll(in, n, CommType::kF32, scratch_.data());
    if (!s.ok()) return s;
    const int p = size();
    const float* src = scratch_.data();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      float acc = 0.0f;
      for (int r = 0; r < p; ++r) acc += src[r * n + i];  // rank order: same on every rank
      out[i] = acc;
    }
    return absl::OkStatus();
  }
  absl::Status DoBroadcast(void* buf, int64_t n, CommType type, int root) override {
    const size_t nb = static_cast<size_t>(n * CommTypeSize(type));
    return Guard("broadcast", [&] {
      gloo::BroadcastOptions o(ctx_);
      o.setOutput(Bytes(buf), nb);
      o.setRoot(root);
      o.setTimeout(timeout_);
      gloo::broadcast(o);
    });
  }
  // Unbound buffers on a slot of our own (above Gloo's collective prefixes), numbered by the
  // SendRecvs this communicator ran: the pair's two calls have the same number.
  absl::Status DoSendRecv(const void* send, int to, void* recv, int from, int64_t bytes) override {
    const uint64_t slot = (uint64_t{kSendRecvSlotPrefix} << 56) | (uint64_t{send_recvs_++} << 24);
    return Guard("send-recv", [&] {
      auto in = ctx_->createUnboundBuffer(recv, static_cast<size_t>(bytes));
      auto out = ctx_->createUnboundBuffer(const_cast<void*>(send), static_cast<size_t>(bytes));
      in->recv(from, slot);
      out->send(to, slot);
      if (!in->waitRecv(timeout_))
        throw gloo::IoException(absl::StrCat("receive from rank ", from, " aborted"));
      if (!out->waitSend(timeout_))
        throw gloo::IoException(absl::StrCat("send to rank ", to, " aborted"));
    });
  }
  absl::Status DoBarrier() override {
    return Guard("barrier", [&] {
      gloo::BarrierOptions o(ctx_);
      o.setTimeout(timeout_);
      gloo::barrier(o);
    });
  }

 private:
  std::shared_ptr<gloo::Context> ctx_;
  const std::chrono::milliseconds timeout_;
  std::vector<float> scratch_;  // reduce-scatter staging, communicator thread only
  static constexpr uint8_t kSendRecvSlotPrefix = 0x20;
  uint32_t send_recvs_ = 0;  // communicator thread only
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(KvStore& store,
                                                                     const std::string& prefix,
                                                                     int rank, int size,
                                                                     const GlooOptions& options) {
  if (size < 1 || rank < 0 || rank >= size)
    return absl::InvalidArgumentError(
        absl::StrCat("gloo: rank ", rank, " is not in a group of size ", size));
  IgnoreSigpipe();
  const auto timeout = std::chrono::milliseconds(absl::ToInt64Milliseconds(options.timeout));
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  absl::Status s = Guard("rendezvous", [&] {
    gloo::transport::tcp::attr attr(options.hostname.c_str());
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->setTimeout(timeout);
    GlooStoreAdapter adapter(store, options.timeout);
    gloo::rendezvous::PrefixStore prefixed(prefix, adapter);
    ctx->connectFullMesh(prefixed, dev);
  });
  if (!s.ok())
    return absl::Status(s.code(), absl::StrCat("communicator \"", prefix, "\" (rank ", rank, " of ",
                                               size, "): ", s.message()));
  return std::unique_ptr<Communicator>(new GlooCommunicator(rank, size, ctx, timeout));
}

}  // namespace spindle
