// Loopback link rates over Gloo (see link_probe.h).
#include "worker/engine/link_probe.h"

#include <algorithm>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/comm/kv_stores.h"

namespace spindle {
namespace {

struct RankTimes {
  absl::Status status;
  std::vector<double> pings, rounds;  // seconds of each exchange
};

// One rank's side: connect, then the exchanges (the peer is the other rank).
RankTimes RunRank(KvStore& store, int rank, const LinkProbeOptions& o) {
  RankTimes out;
  GlooOptions gloo;
  gloo.hostname = "127.0.0.1";
  gloo.timeout = o.timeout;
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      CreateGlooCommunicator(store, "link-probe", rank, 2, gloo);
  if (!comm.ok()) {
    out.status = comm.status();
    return out;
  }
  Communicator& c = **comm;
  const int peer = 1 - rank;
  auto timed = [&](const void* send, void* recv, int64_t bytes, std::vector<double>* into) {
    const absl::Time t0 = absl::Now();
    absl::Status s = c.SendRecv(send, peer, recv, peer, bytes, CommLayer::kOther);
    into->push_back(absl::ToDoubleSeconds(absl::Now() - t0));
    return s;
  };
  uint64_t ping = static_cast<uint64_t>(rank), pong = 0;
  std::vector<unsigned char> send(static_cast<size_t>(o.bytes), static_cast<unsigned char>(rank));
  std::vector<unsigned char> recv(send.size());
  out.status = c.Barrier();
  for (int i = 0; out.status.ok() && i < o.pings; ++i)
    out.status = timed(&ping, &pong, sizeof(ping), &out.pings);
  for (int i = 0; out.status.ok() && i < o.rounds; ++i) {
    out.status = c.Barrier();  // both ranks start the round together
    if (out.status.ok()) out.status = timed(send.data(), recv.data(), o.bytes, &out.rounds);
  }
  if (out.status.ok() && (pong != static_cast<uint64_t>(peer) || recv.front() != peer))
    out.status = absl::InternalError("link probe: the exchange delivered the wrong bytes");
  return out;
}

}  // namespace

nlohmann::json MeasuredLink::ToJson() const {
  return {{"bytes_per_s", bytes_per_s}, {"latency_s", latency_s}};
}

absl::StatusOr<MeasuredLink> MeasureLoopbackLink(const LinkProbeOptions& o) {
  if (o.bytes < 1024 || o.bytes > (int64_t{256} << 20) || o.rounds < 1 || o.rounds > 1000 ||
      o.pings < 1 || o.pings > 1000)
    return absl::InvalidArgumentError(
        absl::StrCat("link probe: bytes must be in [1 KiB, 256 MiB] and rounds and pings in [1, "
                     "1000], got ",
                     o.bytes, ", ", o.rounds, " and ", o.pings));
  MemoryKvStore store;
  RankTimes other;
  std::thread peer([&] { other = RunRank(store, 1, o); });
  RankTimes mine = RunRank(store, 0, o);
  peer.join();
  if (!mine.status.ok()) return mine.status;
  if (!other.status.ok()) return other.status;
  // The fastest counts, as in the kernel rate probe: what the link does when nothing else runs.
  MeasuredLink m;
  m.latency_s = *std::min_element(mine.pings.begin(), mine.pings.end());
  const double fastest = *std::min_element(mine.rounds.begin(), mine.rounds.end());
  m.bytes_per_s = static_cast<double>(o.bytes) / std::max(1e-9, fastest);
  return m;
}

}  // namespace spindle
