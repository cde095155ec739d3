// The Ulysses sequence <-> head transposition (see cp_ulysses.h).
#include "worker/engine/cp/cp_ulysses.h"

#include <cstring>

#include "worker/engine/cp/cp_buffers.h"

namespace spindle {
namespace {

int64_t Width(const std::vector<UlyssesPart>& parts) {
  int64_t w = 0;
  for (const UlyssesPart& p : parts) w += p.width;
  return w;
}

// Local tokens, all heads -> send blocks per destination member (its heads).
void PackByHeads(const std::vector<UlyssesPart>& local, int64_t T, int64_t H, int64_t n,
                 float* send) {
  const int64_t Hl = H / n, block = T * Hl * Width(local);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t j = 0; j < n; ++j)
    for (int64_t t = 0; t < T; ++t) {
      float* dst = send + j * block;
      for (const UlyssesPart& p : local) {
        std::memcpy(dst + t * Hl * p.width, p.p + (t * H + j * Hl) * p.width,
                    Hl * p.width * sizeof(float));
        dst += T * Hl * p.width;
      }
    }
}

// Received blocks (member i's tokens, my heads) -> gathered tensors, run by run (UlyssesRuns).
void UnpackToGroup(const float* recv, const UlyssesGroup& g, int64_t T, int64_t Hl,
                   const std::vector<UlyssesPart>& gathered) {
  const int64_t block = T * Hl * Width(gathered);
  const std::vector<UlyssesRun> runs = UlyssesRuns(g);
#pragma omp parallel for collapse(2) schedule(static)
  for (size_t k = 0; k < runs.size(); ++k)
    for (int64_t t = 0; t < g.layout->chunk; ++t) {
      const UlyssesRun& r = runs[k];
      const float* src = recv + r.member * block;
      const int64_t lt = r.local_row + t, row = r.group_row + t;
      for (const UlyssesPart& p : gathered) {
        std::memcpy(p.p + row * Hl * p.width, src + lt * Hl * p.width,
                    Hl * p.width * sizeof(float));
        src += T * Hl * p.width;
      }
    }
}

// Gathered tensors (my heads) -> send blocks holding each member's tokens, run by run.
void PackByMembers(const std::vector<UlyssesPart>& gathered, const UlyssesGroup& g, int64_t T,
                   int64_t Hl, float* send) {
  const int64_t block = T * Hl * Width(gathered);
  const std::vector<UlyssesRun> runs = UlyssesRuns(g);
#pragma omp parallel for collapse(2) schedule(static)
  for (size_t k = 0; k < runs.size(); ++k)
    for (int64_t t = 0; t < g.layout->chunk; ++t) {
      const UlyssesRun& r = runs[k];
      float* dst = send + r.member * block;
      const int64_t lt = r.local_row + t, row = r.group_row + t;
      for (const UlyssesPart& p : gathered) {
        std::memcpy(dst + lt * Hl * p.width, p.p + row * Hl * p.width,
                    Hl * p.width * sizeof(float));
        dst += T * Hl * p.width;
      }
    }
}

// Received blocks (my tokens, member j's heads) -> local tensors, all heads.
void UnpackToTokens(const float* recv, int64_t T, int64_t H, int64_t n,
                    const std::vector<UlyssesPart>& local) {
  const int64_t Hl = H / n, block = T * Hl * Width(local);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t j = 0; j < n; ++j)
    for (int64_t t = 0; t < T; ++t) {
      const float* src = recv + j * block;
      for (const UlyssesPart& p : local) {
        std::memcpy(p.p + (t * H + j * Hl) * p.width, src + t * Hl * p.width,
                    Hl * p.width * sizeof(float));
        src += T * Hl * p.width;
      }
    }
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

absl::Status UlyssesToHeads(Communicator& comm, const UlyssesGroup& g, int64_t T, int64_t H,
                            const std::vector<UlyssesPart>& local,
                            const std::vector<UlyssesPart>& gathered, std::vector<float>& send,
                            std::vector<float>& recv, CommLayer layer) {
  const int64_t n = g.members, Hl = H / n, block = T * Hl * Width(local);
  PackByHeads(local, T, H, n, Grow(send, n * block));
  if (absl::Status s =
          comm.AllToAll(send.data(), block, CommType::kF32, Grow(recv, n * block), layer);
      !s.ok())
    return s;
  UnpackToGroup(recv.data(), g, T, Hl, gathered);
  return absl::OkStatus();
}

absl::Status UlyssesToTokens(Communicator& comm, const UlyssesGroup& g, int64_t T, int64_t H,
                             const std::vector<UlyssesPart>& gathered,
                             const std::vector<UlyssesPart>& local, std::vector<float>& send,
                             std::vector<float>& recv, CommLayer layer) {
  const int64_t n = g.members, Hl = H / n, block = T * Hl * Width(gathered);
  PackByMembers(gathered, g, T, Hl, Grow(send, n * block));
  if (absl::Status s =
          comm.AllToAll(send.data(), block, CommType::kF32, Grow(recv, n * block), layer);
      !s.ok())
    return s;
  UnpackToTokens(recv.data(), T, H, n, local);
  return absl::OkStatus();
}

void MemberBlocksToRows(const float* blocks, const UlyssesGroup& g, int64_t T, int64_t width,
                        float* rows) {
  for (const UlyssesRun& r : UlyssesRuns(g))
    std::memcpy(rows + r.group_row * width, blocks + (r.member * T + r.local_row) * width,
                r.rows * width * sizeof(float));
}

void RowsToMemberBlocks(const float* rows, const UlyssesGroup& g, int64_t T, int64_t width,
                        float* blocks) {
  for (const UlyssesRun& r : UlyssesRuns(g))
    std::memcpy(blocks + (r.member * T + r.local_row) * width, rows + r.group_row * width,
                r.rows * width * sizeof(float));
}

void CopyStrided(const float* src, int64_t stride, int64_t T, int64_t width, float* dst) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(dst + t * width, src + t * stride, width * sizeof(float));
}

}  // namespace spindle
