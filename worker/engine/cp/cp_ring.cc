// The ring loop of MLA's Ring level, for every backend (see cp_ring.h).
#include "worker/engine/cp/cp_ring.h"

#include "common/status.h"

namespace spindle {

bool RingChunkSees(const CpLayout& L, int64_t qc, int64_t kc) {
  if (kc > qc) return false;
  if (kc == qc) return true;
  return L.doc[kc * L.chunk + L.chunk - 1] == L.doc[qc * L.chunk];
}

bool RingBlockVisible(const CpLayout& L, int64_t q_rank, int64_t k_rank) {
  for (int qs = 0; qs < 2; ++qs)
    for (int ks = 0; ks < 2; ++ks)
      if (RingChunkSees(L, L.ChunkOf(q_rank, qs), L.ChunkOf(k_rank, ks))) return true;
  return false;
}

namespace {

struct Peers {
  int64_t R, me;
  int next, prev;
};

Peers PeersOf(const CpLayout& L) {
  return {L.cp, L.rank, static_cast<int>((L.rank + 1) % L.cp),
          static_cast<int>((L.rank + L.cp - 1) % L.cp)};
}

}  // namespace

absl::Status RingForward(const CpLayout& L, Communicator& comm, RingBlockOps& ops,
                         const void* own) {
  const Peers p = PeersOf(L);
  ASSIGN_OR_RETURN(const RingBuffers buf, ops.Buffers(/*backward=*/false));
  const void* cur = own;
  for (int64_t step = 0; step < p.R; ++step) {
    const int64_t owner = (p.me - step + p.R) % p.R;
    // The block to send is complete and the one two steps back is no longer read.
    RETURN_IF_ERROR(ops.Fence());
    CommHandle h;
    void* nxt = nullptr;
    if (step + 1 < p.R) {
      nxt = buf.block[step % 2];
      h = comm.SendRecvAsync(cur, p.next, nxt, p.prev, ops.block_bytes(), CommLayer::kMla);
    }
    absl::Status st;
    if (step == 0 || RingBlockVisible(L, p.me, owner)) st = ops.Forward(cur, owner, step == 0);
    // The exchange in flight reads `cur`: wait for it whatever happened here.
    const absl::Status sent = h.Wait();
    RETURN_IF_ERROR(st);
    RETURN_IF_ERROR(sent);
    if (nxt) cur = nxt;
  }
  return absl::OkStatus();
}

absl::Status RingBackward(const CpLayout& L, Communicator& comm, RingBlockOps& ops, const void* own,
                          void* d_own) {
  const Peers p = PeersOf(L);
  ASSIGN_OR_RETURN(const RingBuffers buf, ops.Buffers(/*backward=*/true));
  // acc[out]: the accumulator this rank sends next; acc[1 - out] receives the one it gets.
  int out = 0;
  CommHandle acc_h;  // the accumulator exchange in flight
  const void* cur = own;
  absl::Status st;
  for (int64_t step = 0; step < p.R && st.ok(); ++step) {
    const int64_t owner = (p.me - step + p.R) % p.R;
    st = ops.Fence();
    if (!st.ok()) break;
    CommHandle h;
    void* nxt = nullptr;
    if (step + 1 < p.R) {
      nxt = buf.block[step % 2];
      h = comm.SendRecvAsync(cur, p.next, nxt, p.prev, ops.block_bytes(), CommLayer::kMla);
    }
    // This rank's queries' share of the block's gradient: into d_own on the diagonal, into the
    // accumulator to send on step 1 (nothing received yet), else beside the received one.
    void* share = step == 0 ? d_own : step == 1 ? buf.acc[out] : buf.share;
    const bool visible = step == 0 || RingBlockVisible(L, p.me, owner);
    if (visible) {
      st = ops.Backward(cur, owner, step == 0, share);
    } else if (step == 1) {
      st = ops.ZeroGrad(share);
    }
    if (st.ok() && step >= 1) {
      if (step >= 2) {
        // The accumulator of this block arrived in acc[1 - out] during the step.
        st = acc_h.Wait();
        out = 1 - out;
        if (st.ok() && visible) st = ops.AddGrad(buf.acc[out], buf.share);
      }
      if (st.ok()) st = ops.Fence();
      if (st.ok())
        acc_h = comm.SendRecvAsync(buf.acc[out], p.next, buf.acc[1 - out], p.prev, ops.grad_bytes(),
                                   CommLayer::kMla);
    }
    // The exchanges in flight read this step's buffers: wait for them whatever happened here.
    if (absl::Status sent = h.Wait(); st.ok()) st = sent;
    if (nxt) cur = nxt;
  }
  if (absl::Status sent = acc_h.Wait(); st.ok()) st = sent;
  RETURN_IF_ERROR(st);
  // The accumulator of this rank's own block, back from its trip.
  if (p.R > 1) RETURN_IF_ERROR(ops.AddGrad(d_own, buf.acc[1 - out]));
  return absl::OkStatus();
}

}  // namespace spindle
