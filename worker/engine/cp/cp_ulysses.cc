// The Ulysses sequence <-> head transposition (see cp_ulysses.h).
#include "worker/engine/cp/cp_ulysses.h"

#include <cstring>

#include "common/status.h"
#include "worker/engine/cp/cp_buffers.h"

namespace spindle {
namespace {

// p advanced by n elements of `eb` bytes.
void* At(void* p, int64_t n, int64_t eb) { return static_cast<char*>(p) + n * eb; }
const void* At(const void* p, int64_t n, int64_t eb) {
  return static_cast<const char*>(p) + n * eb;
}

// Whether the gathered views are exactly the rows of one block: the tensors side by side from
// views[0].p, each head dense.
bool OneRowBlock(const std::vector<UlyssesView>& views, int64_t Hl, int64_t row, int64_t eb) {
  int64_t off = 0;
  for (const UlyssesView& v : views) {
    if (v.p != At(views[0].p, off, eb) || v.token_stride != row || v.head_stride != v.width)
      return false;
    off += Hl * v.width;
  }
  return true;
}

std::vector<UlyssesView> LocalViews(const std::vector<UlyssesPart>& parts, int64_t H) {
  std::vector<UlyssesView> v;
  for (const UlyssesPart& p : parts) v.push_back({p.p, H * p.width, p.width, p.width});
  return v;
}

std::vector<UlyssesView> GatheredViews(const std::vector<UlyssesPart>& parts, int64_t Hl) {
  std::vector<UlyssesView> v;
  for (const UlyssesPart& p : parts) v.push_back({p.p, Hl * p.width, p.width, p.width});
  return v;
}

int64_t RunRow(const UlyssesRun& r, int64_t T, bool grouped) {
  return grouped ? r.group_row : r.member * T + r.local_row;
}

}  // namespace

int64_t UlyssesGroup::Row(int64_t i, int64_t t) const {
  const CpLayout& L = *layout;
  const int64_t s = L.StreamIndex(first_rank + i, t);
  // The group's tokens are super-chunks j and 2r-1-j of n chunks each (cp_groups.h).
  const int64_t super = members * L.chunk, r = L.cp / members;
  return ZigzagSlot(r, s / super) * super + s % super;
}

std::vector<UlyssesRun> UlyssesRuns(const UlyssesGroup& g) {
  const int64_t ch = g.layout->chunk;
  std::vector<UlyssesRun> runs;
  for (int64_t i = 0; i < g.members; ++i)
    for (int64_t slot = 0; slot < 2; ++slot)
      runs.push_back({i, slot * ch, g.Row(i, slot * ch), ch});
  return runs;
}

UlyssesGroup WholeCpGroup(const CpLayout& L) { return {&L, L.cp, 0}; }

UlyssesGroup HybridUlyssesGroup(const CpLayout& L) {
  const CpGroups g = L.groups();
  return {&L, g.u, g.Rank(g.Group(L.rank), 0)};
}

UlyssesComm MakeUlyssesComm(Communicator* comm, const UlyssesGroup& g) {
  return {comm, g.members, UlyssesRuns(g)};
}

int64_t UlyssesRowWidth(int64_t heads_per_member, const std::vector<UlyssesView>& views) {
  int64_t row = 0;
  for (const UlyssesView& v : views) row += heads_per_member * v.width;
  return row;
}

absl::Status UlyssesPackByHeads(CpCopies& cc, int64_t T, int64_t H, int64_t n,
                                const std::vector<UlyssesView>& local, void* send) {
  const int64_t Hl = H / n, row = UlyssesRowWidth(Hl, local), eb = cc.elem_bytes();
  int64_t off = 0;
  for (const UlyssesView& v : local) {
    void* dst = At(send, off, eb);
    if (v.head_stride == v.width) {
      // Each member's heads are one run of the token's row: one copy for all members, the member
      // as the "head" index (the source's head stride is H/n heads, the block's T rows).
      RETURN_IF_ERROR(
          cc.CopyRows(dst, row, T * row, v.p, v.token_stride, Hl * v.width, T, n, Hl * v.width));
    } else {
      for (int64_t j = 0; j < n; ++j)
        RETURN_IF_ERROR(cc.CopyRows(At(dst, j * T * row, eb), row, v.width,
                                    At(v.p, j * Hl * v.head_stride, eb), v.token_stride,
                                    v.head_stride, T, Hl, v.width));
    }
    off += Hl * v.width;
  }
  return absl::OkStatus();
}

absl::Status UlyssesUnpackToTokens(CpCopies& cc, const void* recv, int64_t T, int64_t H, int64_t n,
                                   const std::vector<UlyssesView>& local, int64_t j0, int64_t j1) {
  const int64_t Hl = H / n, row = UlyssesRowWidth(Hl, local), eb = cc.elem_bytes();
  if (j1 < 0) j1 = n;
  int64_t off = 0;
  for (const UlyssesView& v : local) {
    const void* src = At(recv, j0 * T * row + off, eb);
    if (v.head_stride == v.width) {
      RETURN_IF_ERROR(cc.CopyRows(v.p, v.token_stride, Hl * v.width, src, row, T * row, T, j1 - j0,
                                  Hl * v.width));
    } else {
      for (int64_t j = 0; j < j1 - j0; ++j)
        RETURN_IF_ERROR(cc.CopyRows(At(v.p, j * Hl * v.head_stride, eb), v.token_stride,
                                    v.head_stride, At(src, j * T * row, eb), row, v.width, T, Hl,
                                    v.width));
    }
    off += Hl * v.width;
  }
  return absl::OkStatus();
}

absl::Status UlyssesCopyRuns(CpCopies& cc, const UlyssesComm& u, int64_t T, const void* src,
                             bool src_grouped, void* dst, bool dst_grouped, int64_t row_bytes) {
  for (const UlyssesRun& r : u.runs)
    RETURN_IF_ERROR(cc.Copy(At(dst, RunRow(r, T, dst_grouped), row_bytes),
                            At(src, RunRow(r, T, src_grouped), row_bytes), r.rows * row_bytes));
  return absl::OkStatus();
}

absl::Status UlyssesExchange(CpCopies& cc, const UlyssesComm& u, int64_t T, const void* send,
                             bool send_grouped, void* recv, bool recv_grouped, int64_t row_bytes,
                             CommLayer layer) {
  std::vector<CommSendPiece> out;
  std::vector<CommRecvPiece> in;
  for (const UlyssesRun& r : u.runs) {
    const int peer = static_cast<int>(r.member);
    out.push_back({peer, At(send, RunRow(r, T, send_grouped), row_bytes), r.rows * row_bytes});
    in.push_back({peer, At(recv, RunRow(r, T, recv_grouped), row_bytes), r.rows * row_bytes});
  }
  RETURN_IF_ERROR(cc.Fence());
  return u.comm->AllToAllPieces(std::move(out), std::move(in), layer);
}

absl::Status UlyssesToHeads(CpCopies& cc, const UlyssesComm& u, int64_t T, int64_t H,
                            const std::vector<UlyssesView>& local,
                            const std::vector<UlyssesView>& gathered, void* send, void* recv,
                            CommLayer layer) {
  const int64_t n = u.members, Hl = H / n, row = UlyssesRowWidth(Hl, local);
  const int64_t eb = cc.elem_bytes();
  RETURN_IF_ERROR(UlyssesPackByHeads(cc, T, H, n, local, send));
  if (OneRowBlock(gathered, Hl, row, eb))
    return UlyssesExchange(cc, u, T, send, false, gathered[0].p, true, row * eb, layer);
  RETURN_IF_ERROR(UlyssesExchange(cc, u, T, send, false, recv, true, row * eb, layer));
  int64_t off = 0;
  for (const UlyssesView& v : gathered) {
    RETURN_IF_ERROR(cc.CopyRows(v.p, v.token_stride, v.head_stride, At(recv, off, eb), row, v.width,
                                n * T, Hl, v.width));
    off += Hl * v.width;
  }
  return absl::OkStatus();
}

absl::Status UlyssesToTokens(CpCopies& cc, const UlyssesComm& u, int64_t T, int64_t H,
                             const std::vector<UlyssesView>& gathered,
                             const std::vector<UlyssesView>& local, void* send, void* recv,
                             CommLayer layer) {
  const int64_t n = u.members, Hl = H / n, row = UlyssesRowWidth(Hl, gathered);
  const int64_t eb = cc.elem_bytes();
  const void* rows = gathered[0].p;
  if (!OneRowBlock(gathered, Hl, row, eb)) {
    int64_t off = 0;
    for (const UlyssesView& v : gathered) {
      RETURN_IF_ERROR(cc.CopyRows(At(send, off, eb), row, v.width, v.p, v.token_stride,
                                  v.head_stride, n * T, Hl, v.width));
      off += Hl * v.width;
    }
    rows = send;
  }
  RETURN_IF_ERROR(UlyssesExchange(cc, u, T, rows, true, recv, false, row * eb, layer));
  return UlyssesUnpackToTokens(cc, recv, T, H, n, local);
}

absl::Status UlyssesToHeads(Communicator& comm, const UlyssesGroup& g, int64_t T, int64_t H,
                            const std::vector<UlyssesPart>& local,
                            const std::vector<UlyssesPart>& gathered, std::vector<float>& send,
                            std::vector<float>& recv, CommLayer layer) {
  HostCopies cc;
  const int64_t n = g.members, Hl = H / n;
  const std::vector<UlyssesView> lv = LocalViews(local, H);
  const int64_t elems = n * T * UlyssesRowWidth(Hl, lv);
  return UlyssesToHeads(cc, MakeUlyssesComm(&comm, g), T, H, lv, GatheredViews(gathered, Hl),
                        Grow(send, elems), Grow(recv, elems), layer);
}

absl::Status UlyssesToTokens(Communicator& comm, const UlyssesGroup& g, int64_t T, int64_t H,
                             const std::vector<UlyssesPart>& gathered,
                             const std::vector<UlyssesPart>& local, std::vector<float>& send,
                             std::vector<float>& recv, CommLayer layer) {
  HostCopies cc;
  const int64_t n = g.members, Hl = H / n;
  const std::vector<UlyssesView> lv = LocalViews(local, H);
  const int64_t elems = n * T * UlyssesRowWidth(Hl, lv);
  return UlyssesToTokens(cc, MakeUlyssesComm(&comm, g), T, H, GatheredViews(gathered, Hl), lv,
                         Grow(send, elems), Grow(recv, elems), layer);
}

void MemberBlocksToRows(const float* blocks, const UlyssesGroup& g, int64_t T, int64_t width,
                        float* rows) {
  HostCopies cc;
  UlyssesCopyRuns(cc, MakeUlyssesComm(nullptr, g), T, blocks, false, rows, true,
                  width * static_cast<int64_t>(sizeof(float)))
      .IgnoreError();  // host copies do not fail
}

void RowsToMemberBlocks(const float* rows, const UlyssesGroup& g, int64_t T, int64_t width,
                        float* blocks) {
  HostCopies cc;
  UlyssesCopyRuns(cc, MakeUlyssesComm(nullptr, g), T, rows, true, blocks, false,
                  width * static_cast<int64_t>(sizeof(float)))
      .IgnoreError();  // host copies do not fail
}

void CopyStrided(const float* src, int64_t stride, int64_t T, int64_t width, float* dst) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(dst + t * width, src + t * stride, width * sizeof(float));
}

}  // namespace spindle
