// The MoE token exchange (see moe_exchange.h).
#include "worker/engine/moe/moe_exchange.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cpu/moe.h"

namespace spindle {

absl::Status HostMoeRows::Gather(void* out, const void* in, const int32_t* src, int64_t rows,
                                 int64_t D) {
  kernels::cpu::GatherRows(static_cast<const float*>(in), src, static_cast<float*>(out), rows, D);
  return absl::OkStatus();
}

int64_t MoeDispatchPlan::recv_total() const {
  return std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
}

void PlanMoeGroupsAtEp1(const int64_t* counts, int64_t T, int64_t K, int64_t E, int64_t align,
                        MoeDispatchPlan* plan) {
  MoeDispatchPlan& p = *plan;
  p.T = T, p.K = K, p.E = E, p.ep = 1, p.local_experts = E, p.align = align;
  p.counts.assign(counts, counts + E);
  p.expert_counts = p.counts;
  p.expert_offsets.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e)
    p.expert_offsets[e + 1] = p.expert_offsets[e] + (counts[e] + align - 1) / align * align;
  p.send_token.clear();
  p.send_rows.assign(1, 0);
  p.recv_rows.assign(1, 0);
  p.recv_expert_row.clear();
}

void MoeExpertSegments(const MoeDispatchPlan& p, std::vector<int64_t>* out) {
  out->assign(1, 0);
  std::vector<int64_t> recv_end;  // ep > 1: source rank q's received rows end at recv_end[q]
  int64_t at = 0;
  for (int64_t r : p.recv_rows) recv_end.push_back(at += r);
  for (int64_t j = 0; j < p.local_experts; ++j) {
    const int64_t o = p.expert_offsets[j], n = p.expert_counts[j];
    size_t q = 0;
    for (int64_t r = o; p.ep > 1 && r < o + n; ++r) {
      size_t source = q;
      while (source < recv_end.size() && p.expert_src[r] >= recv_end[source]) ++source;
      if (r > o && source != q) out->push_back(r);
      q = source;
    }
    out->push_back(p.expert_offsets[j + 1]);
  }
}

absl::Status PlanMoeDispatch(const int32_t* idx, int64_t T, int64_t K, int64_t E, int64_t align,
                             Communicator* ep_comm, MoeRows& rows, MoeDispatchPlan* plan) {
  const int64_t ep = ep_comm ? ep_comm->size() : 1;
  if (E % ep != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("moe: ", E, " experts do not divide over an EP group of ", ep));
  MoeDispatchPlan& p = *plan;
  p.T = T, p.K = K, p.E = E, p.ep = ep, p.local_experts = E / ep, p.align = align;
  const int64_t n = T * K, El = p.local_experts;
  p.counts.assign(E, 0);
  p.pair_row.resize(n);
  std::vector<int64_t> offsets(E + 1);
  std::vector<int32_t> row_source(n);
  if (ep == 1) {
    // The experts read the tokens directly: one grouping, padded.
    std::vector<int64_t> counts(E, 0);
    for (int64_t i = 0; i < n; ++i) ++counts[idx[i]];
    PlanMoeGroupsAtEp1(counts.data(), T, K, E, align, &p);
    p.expert_src.resize(p.expert_rows());
    kernels::cpu::MoeGroupRows(idx, n, K, E, align, p.counts.data(), p.expert_offsets.data(),
                               p.pair_row.data(), p.expert_src.data());
    return absl::OkStatus();
  }
  // Send order: by expert, hence by owner.
  kernels::cpu::MoeGroupRows(idx, n, K, E, 1, p.counts.data(), offsets.data(), p.pair_row.data(),
                             row_source.data());
  p.send_token = std::move(row_source);
  p.send_rows.assign(ep, 0);
  for (int64_t e = 0; e < E; ++e) p.send_rows[e / El] += p.counts[e];
  // What each rank sends this one, per local expert: block q of `got` from rank q.
  std::vector<int32_t> mine(E), got(E);
  for (int64_t e = 0; e < E; ++e) mine[e] = static_cast<int32_t>(p.counts[e]);
  RETURN_IF_ERROR(rows.AllToAllCounts(*ep_comm, mine.data(), got.data(), El));
  p.recv_rows.assign(ep, 0);
  std::vector<int32_t> key;  // each received row's local expert, in arrival order
  for (int64_t q = 0; q < ep; ++q)
    for (int64_t j = 0; j < El; ++j) {
      p.recv_rows[q] += got[q * El + j];
      key.insert(key.end(), got[q * El + j], static_cast<int32_t>(j));
    }
  const int64_t R = static_cast<int64_t>(key.size());
  p.expert_counts.assign(El, 0);
  p.expert_offsets.assign(El + 1, 0);
  int64_t total = 0;
  for (int64_t i = 0; i < R; ++i) ++p.expert_counts[key[i]];
  for (int64_t j = 0; j < El; ++j) total += (p.expert_counts[j] + align - 1) / align * align;
  p.expert_src.resize(total);
  p.recv_expert_row.resize(R);
  kernels::cpu::MoeGroupRows(key.data(), R, 1, El, align, p.expert_counts.data(),
                             p.expert_offsets.data(), p.recv_expert_row.data(),
                             p.expert_src.data());
  return absl::OkStatus();
}

namespace {

std::vector<int64_t> Bytes(const std::vector<int64_t>& rows, int64_t row_bytes) {
  std::vector<int64_t> b(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) b[i] = rows[i] * row_bytes;
  return b;
}

}  // namespace

absl::Status MoeToExperts(const MoeDispatchPlan& plan, MoeRows& rows, Communicator* ep_comm,
                          const void* send, int64_t D, void* recv, void* expert_in,
                          const std::function<void()>& overlap) {
  const int64_t row_bytes = D * rows.elem_bytes();
  RETURN_IF_ERROR(rows.Fence());
  CommHandle h = ep_comm->AllToAllVAsync(send, Bytes(plan.send_rows, row_bytes), recv,
                                         Bytes(plan.recv_rows, row_bytes), CommLayer::kMoe);
  if (overlap) overlap();
  RETURN_IF_ERROR(h.Wait());
  return rows.Gather(expert_in, recv, plan.expert_src.data(), plan.expert_rows(), D);
}

absl::Status MoeDispatch(const MoeDispatchPlan& plan, MoeRows& rows, Communicator* ep_comm,
                         const void* x, int64_t D, void* send, void* recv, void* expert_in,
                         const std::function<void()>& overlap) {
  if (plan.ep == 1) {
    RETURN_IF_ERROR(rows.Gather(expert_in, x, plan.expert_src.data(), plan.expert_rows(), D));
    if (overlap) overlap();
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(rows.Gather(send, x, plan.send_token.data(), plan.T * plan.K, D));
  return MoeToExperts(plan, rows, ep_comm, send, D, recv, expert_in, overlap);
}

absl::Status MoeFromExperts(const MoeDispatchPlan& plan, MoeRows& rows, Communicator* ep_comm,
                            const void* expert_rows, int64_t D, void* scratch, void* send_order) {
  const int64_t row_bytes = D * rows.elem_bytes();
  RETURN_IF_ERROR(rows.Gather(scratch, expert_rows, plan.recv_expert_row.data(),
                              plan.recv_total(), D));
  RETURN_IF_ERROR(rows.Fence());
  return ep_comm->AllToAllV(scratch, Bytes(plan.recv_rows, row_bytes), send_order,
                            Bytes(plan.send_rows, row_bytes), CommLayer::kMoe);
}

}  // namespace spindle
