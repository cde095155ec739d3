// The CUDA model's mixture-of-experts FFN family (cuda_moe_ffn.h; the CPU model's moe/moe_ffn.h,
// whose arithmetic and bf16 roundings this follows): the router in fp32 on the masters, the
// exchange planned on the host from the router's choices (moe/moe_exchange.h, the same code as the
// CPU's, its row maps uploaded once a pass), the experts as grouped GEMMs (kernels/cuda/moe.h), the
// shared expert, and the weighted combine. The plan's row counts are the GEMMs' group sizes, so
// each MoE layer's forward waits once for the host: at ep = 1 the choices are grouped on the
// device (kc::MoeGroupRows) and only the E group sizes come back, while the shared expert runs;
// at ep > 1 the choices come back and the host plans the exchange (the counts cross the EP group
// there anyway). The router's statistics stay on the device until the step's end. Under fp8 the
// experts' GEMMs read FP8 codes: tensorwise with one scale per expert and per rows tensor;
// blockwise (train.fp8_recipe) in kernels/cuda/moe.h's grouped layout, whose column blocks
// restart at each (expert, source rank) segment of the plan (MoeExpertSegments, the CPU's).
#include "worker/engine/cuda/cuda_moe_ffn.h"

#include <numeric>

namespace spindle {
namespace cuda_model_detail {

namespace {

// The exchange's row gathers on the device: the plan's maps are uploaded once (Upload) and a
// gather with a map's host pointer uses its device copy; another host pointer is uploaded first.
class DeviceMoeRows final : public MoeRows {
 public:
  DeviceMoeRows(kc::CachingAllocator* alloc, cudaStream_t* stream)
      : alloc_(alloc), stream_(stream) {}
  int64_t elem_bytes() const override { return kAb; }

  // The maps of `p` into `C`'s device buffers, known by their host pointers from now on.
  absl::Status Upload(const MoeDispatchPlan& p, MoeDevCache& C) {
    known_.clear();
    const std::pair<const std::vector<int32_t>*, DevBuf*> maps[] = {
        {&p.expert_src, &C.expert_src},
        {&p.pair_row, &C.pair_row},
        {&p.send_token, &C.send_token},
        {&p.recv_expert_row, &C.recv_expert_row}};
    for (const auto& [host, dev] : maps) {
      RETURN_IF_ERROR(dev->Ensure(alloc_, static_cast<int64_t>(host->size()) * 4));
      if (!host->empty())
        CUDA(cudaMemcpyAsync(dev->get(), host->data(), host->size() * 4, cudaMemcpyHostToDevice,
                             *stream_));
      known_.push_back({host->data(), dev->i32()});
    }
    return absl::OkStatus();
  }

  absl::Status Gather(void* out, const void* in, const int32_t* src, int64_t rows,
                      int64_t D) override {
    if (rows == 0) return absl::OkStatus();
    const int32_t* dev = nullptr;
    for (const auto& [h, d] : known_)
      if (h == src) dev = d;
    if (dev == nullptr) {
      RETURN_IF_ERROR(scratch_.Ensure(alloc_, rows * 4));
      CUDA(cudaMemcpyAsync(scratch_.get(), src, rows * 4, cudaMemcpyHostToDevice, *stream_));
      dev = scratch_.i32();
    }
    return FromKernel(kc::GatherRows(in, dev, out, rows, D, kAct, *stream_));
  }
  absl::Status Fence() override {
    CUDA(cudaStreamSynchronize(*stream_));
    return absl::OkStatus();
  }
  // The counts through device memory: the EP group's communicator takes device buffers.
  absl::Status AllToAllCounts(Communicator& comm, const int32_t* mine, int32_t* got,
                              int64_t n) override {
    const int64_t bytes = n * comm.size() * 4;
    RETURN_IF_ERROR(counts_.Ensure(alloc_, 2 * bytes));
    int32_t* send = counts_.i32();
    int32_t* recv = send + n * comm.size();
    CUDA(cudaMemcpyAsync(send, mine, bytes, cudaMemcpyHostToDevice, *stream_));
    CUDA(cudaStreamSynchronize(*stream_));
    RETURN_IF_ERROR(comm.AllToAll(send, n, CommType::kI32, recv, CommLayer::kMoe));
    CUDA(cudaMemcpyAsync(got, recv, bytes, cudaMemcpyDeviceToHost, *stream_));
    CUDA(cudaStreamSynchronize(*stream_));
    return absl::OkStatus();
  }

 private:
  kc::CachingAllocator* alloc_;
  cudaStream_t* stream_;
  std::vector<std::pair<const int32_t*, const int32_t*>> known_;
  DevBuf scratch_, counts_;
};

}  // namespace

CudaMoeFfn::~CudaMoeFfn() {
  if (moe_counts_host) cudaFreeHost(moe_counts_host);
  if (moe_counts_ready) cudaEventDestroy(moe_counts_ready);
}

void CudaMoeFfn::BeginStep(double tokens) {
  moe_stats.assign(c.n_layers, MoeLayerStats{});
  moe_lse_sq_layer.clear();
  zloss_scale = tokens > 0 ? static_cast<float>(c.moe.z_loss / tokens) : 0.0f;
}

void CudaMoeFfn::Release() {
  MoeDevWork& mw = W;
  for (DevBuf* b : {&mw.send, &mw.recv, &mw.y, &mw.dye, &mw.da, &mw.dg, &mw.du, &mw.dxe, &mw.dw,
                    &mw.dlogits, &mw.acc, &mw.sda, &mw.sdg, &mw.sdu, &mw.group_counts,
                    &mw.group_offsets, &mw.group_ws, &mw.lse_sq_ws, &mw.q_dye.mem, &mw.q_dg.mem,
                    &mw.q_du.mem})
    b->Release();
}

absl::Status CudaMoeFfn::Forward(const LayerIdx& L, LayerActs& A, MoeDevCache& M, void* y,
                                 MoeLayerStats* stats, bool transposes) {
  const MoeConfig& m = c.moe;
  const MoeLayerParams& p = L.moe_p;
  MoeDevWork& X = W;
  const int64_t T = B.T, d = c.d_model, E = m.experts, K = m.top_k, F = m.expert_ffn,
                S = m.shared_ffn;
  if (cx.host->ep() > 1 && ep == nullptr)
    return absl::FailedPreconditionError(
        absl::StrCat("cuda model: the experts are sharded over ", cx.host->ep(),
                     " ranks; SetExpertParallel gives their group"));
  if (!moe_rows) moe_rows = std::make_unique<DeviceMoeRows>(&cx.alloc, &cx.stream);
  if (!moe_gemm) KC(kc::GroupedGemm::Create(cx.expert_gemm, &moe_gemm));
  // Router: z = h2 Wr^T in fp32 on the master weights, then the choices.
  RETURN_IF_ERROR(cx.F32(M.h32, T * d));
  RETURN_IF_ERROR(cx.F32(M.logits, T * E));
  RETURN_IF_ERROR(cx.F32(M.weights, T * K));
  RETURN_IF_ERROR(cx.F32(M.lse, T));
  RETURN_IF_ERROR(M.idx.Ensure(&cx.alloc, T * K * 4));
  KC(kc::CastRows(M.h32.get(), KDType::kFloat32, d, A.h2.get(), kAct, d, T, d, cx.stream));
  {
    kc::GemmArgs a;
    a.trans_b = true;
    a.M = T, a.N = E, a.K = d;
    a.A = M.h32.get(), a.lda = d, a.B = cx.Master(p.router), a.ldb = d, a.C = M.logits.get(),
    a.ldc = E;
    a.ab_type = KDType::kFloat32, a.c_type = KDType::kFloat32;
    KC(cx.blas->Gemm(a, cx.stream));
  }
  KC(kc::MoeRouterForward(M.logits.f32(), cx.Master(p.bias), M.idx.i32(), M.weights.f32(),
                          M.lse.f32(), T, E, K, cx.stream));
  // The tokens to their experts; the shared expert runs meanwhile (while the group sizes reach
  // the host at ep = 1, while the rows travel at ep > 1).
  RETURN_IF_ERROR(cx.Act(X.y, T, d));
  for (DevBuf* b : {&M.sg, &M.su, &M.sa}) RETURN_IF_ERROR(cx.Act(*b, T, std::max<int64_t>(S, 1)));
  absl::Status shared_status;
  auto shared = [&] {
    if (S == 0) {
      shared_status = FromCuda(cudaMemsetAsync(X.y.get(), 0, T * d * kAb, cx.stream), "memset");
      return;
    }
    absl::Status s = cx.Fwd(A.h2.get(), d, cx.Wb(p.s1), M.sg.get(), T, d, S, false);
    if (s.ok()) s = cx.Fwd(A.h2.get(), d, cx.Wb(p.s3), M.su.get(), T, d, S, false);
    if (s.ok())
      s = FromKernel(kc::SwiGluForward(M.sg.get(), M.su.get(), M.sa.get(), T * S, kAct, cx.stream));
    if (s.ok()) s = cx.Fwd(M.sa.get(), S, cx.Wb(p.s2), X.y.get(), T, S, d, false);
    shared_status = s;
  };
  if (stats) RETURN_IF_ERROR(CountLseSq(L, M.lse.f32(), T));
  DeviceMoeRows& rows = static_cast<DeviceMoeRows&>(*moe_rows);
  // Under fp8 every expert's rows are padded to a multiple of 16 (the FP8 GEMMs' and the
  // transposed codes' alignment) by the grouping itself; in bf16 under the persistent grouped
  // GEMM to a multiple of 64 (its weight gradient's 64-row K-blocks stay within a group). The
  // padding rows are zeros in every buffer the GEMMs read: the gathers write zeros for them (xe,
  // and dye at ep > 1), dye is cleared before the combine's backward at ep = 1, and g, u, a, da,
  // dg, du follow from those zeros.
  const int64_t align = cx.fp8 ? 16 : moe_gemm->persistent_kernel() ? 64 : 1;
  if (cx.host->ep() == 1) {
    // Grouped on the device: the host waits only for the E group sizes.
    RETURN_IF_ERROR(GroupOnDevice(M, align, shared));
    RETURN_IF_ERROR(shared_status);
    const int64_t R = M.plan.expert_rows();
    if (cx.fp8_blockwise) {
      // The gather quantizes in 1 x 128 row blocks and 128-token column blocks per segment:
      // every scale is its block's own, so no amax pass.
      RETURN_IF_ERROR(PlanBlocks(M));
      RETURN_IF_ERROR(
          QuantizeRows(M, M.q_xe, KDType::kFp8E4M3, A.h2.get(), M.expert_src.i32(), d, transposes));
    } else if (cx.fp8) {
      // The gather quantizes (both layouts) at h2's amax: every token's row is among them.
      RETURN_IF_ERROR(M.q_xe.Ensure(&cx.alloc, R, d, KDType::kFp8E4M3));
      const kc::Fp8Output q = M.q_xe.Output();
      KC(kc::Fp8AbsMax(A.h2.get(), T * d, kAct, q.amax, cx.stream));
      KC(kc::GatherRowsFp8(A.h2.get(), M.expert_src.i32(), R, d, kAct, q, cx.stream));
    } else {
      RETURN_IF_ERROR(cx.Act(M.xe, R, d));
      KC(kc::GatherRows(A.h2.get(), M.expert_src.i32(), M.xe.get(), R, d, kAct, cx.stream));
    }
  } else {
    // Planned on the host: the choices come back once, the counts cross the EP group.
    M.idx_host.resize(T * K);
    CUDA(cudaMemcpyAsync(M.idx_host.data(), M.idx.get(), T * K * 4, cudaMemcpyDeviceToHost,
                         cx.stream));
    CUDA(cudaStreamSynchronize(cx.stream));
    RETURN_IF_ERROR(PlanMoeDispatch(M.idx_host.data(), T, K, E, align, ep, rows, &M.plan));
    RETURN_IF_ERROR(rows.Upload(M.plan, M));
    RETURN_IF_ERROR(cx.Act(M.xe, M.plan.expert_rows(), d));
    RETURN_IF_ERROR(cx.Act(X.send, T * K, d));
    RETURN_IF_ERROR(cx.Act(X.recv, M.plan.recv_total(), d));
    RETURN_IF_ERROR(MoeDispatch(M.plan, rows, ep, A.h2.get(), d, X.send.get(), X.recv.get(),
                                M.xe.get(), shared));
    RETURN_IF_ERROR(shared_status);
    if (cx.fp8_blockwise) {  // the received rows, in the blocks of their segments
      RETURN_IF_ERROR(PlanBlocks(M));
      RETURN_IF_ERROR(
          QuantizeRows(M, M.q_xe, KDType::kFp8E4M3, M.xe.get(), nullptr, d, transposes));
    } else if (cx.fp8) {  // rows from other ranks: their own amax
      RETURN_IF_ERROR(M.q_xe.Ensure(&cx.alloc, M.plan.expert_rows(), d, KDType::kFp8E4M3));
      KC(kc::Fp8Quantize(M.xe.get(), M.plan.expert_rows(), d, kAct, M.q_xe.Output(), cx.stream));
    }
  }
  const MoeDispatchPlan& plan = M.plan;
  const int64_t R = plan.expert_rows();
  if (stats) {
    if (stats->load.size() != static_cast<size_t>(E)) stats->load.assign(E, 0.0);
    for (int64_t e = 0; e < E; ++e) stats->load[e] += static_cast<double>(plan.counts[e]);
    stats->tokens += T;
  }
  // The experts over their rows.
  const int64_t El = plan.local_experts;
  for (DevBuf* b : {&M.g, &M.u}) RETURN_IF_ERROR(cx.Act(*b, R, F));
  RETURN_IF_ERROR(cx.Act(M.ye, R, d));
  const int64_t* off = plan.expert_offsets.data();
  if (cx.fp8) {
    const kc::Fp8Operand xq = RowsOperand(M.q_xe);
    KC(moe_gemm->ForwardFp8(xq, cx.fp8_e[p.w1].Forward(), M.g.get(), kAct, off, El, F, d,
                            cx.stream));
    KC(moe_gemm->ForwardFp8(xq, cx.fp8_e[p.w3].Forward(), M.u.get(), kAct, off, El, F, d,
                            cx.stream));
    if (cx.fp8_blockwise) {  // from g and u in one pass, in the bands of the experts' rows
      RETURN_IF_ERROR(
          M.q_a.EnsureGrouped(&cx.alloc, R, F, KDType::kFp8E4M3, M.row_bands.col_blocks));
      KC(kc::SwiGluQuantizeGroupedBlockwise(
          M.g.get(), M.u.get(), static_cast<const kc::Fp8RowBand*>(M.bands.get()),
          static_cast<int64_t>(M.row_bands.bands.size()), R, F, kAct,
          LayerContext::QBlockOut(M.q_a, transposes), cx.stream));
    } else {
      RETURN_IF_ERROR(M.q_a.Ensure(&cx.alloc, R, F, KDType::kFp8E4M3));
      KC(kc::SwiGluForwardFp8(M.g.get(), M.u.get(), nullptr, R, F, kAct, M.q_a.Output(),
                              cx.stream));
    }
    KC(moe_gemm->ForwardFp8(RowsOperand(M.q_a), cx.fp8_e[p.w2].Forward(), M.ye.get(), kAct, off, El,
                            d, F, cx.stream));
  } else {
    RETURN_IF_ERROR(cx.Act(M.a, R, F));
    KC(moe_gemm->Forward(M.xe.get(), cx.Wb(p.w1), M.g.get(), off, El, F, d, kAct, cx.stream));
    KC(moe_gemm->Forward(M.xe.get(), cx.Wb(p.w3), M.u.get(), off, El, F, d, kAct, cx.stream));
    KC(kc::SwiGluForward(M.g.get(), M.u.get(), M.a.get(), R * F, kAct, cx.stream));
    KC(moe_gemm->Forward(M.a.get(), cx.Wb(p.w2), M.ye.get(), off, El, d, F, kAct, cx.stream));
  }
  // Back to the tokens, weighted, onto the shared expert's output (one rounding), then y.
  const void* Y = M.ye.get();
  if (plan.ep > 1) {
    RETURN_IF_ERROR(cx.Act(M.returned, T * K, d));
    RETURN_IF_ERROR(MoeFromExperts(plan, rows, ep, M.ye.get(), d, X.recv.get(), M.returned.get()));
    Y = M.returned.get();
  }
  KC(kc::MoeCombine(Y, kAct, M.pair_row.i32(), M.weights.f32(), X.y.get(), kAct, T, K, d,
                    /*accumulate=*/true, cx.stream));
  if (y != nullptr)
    CUDA(cudaMemcpyAsync(y, X.y.get(), T * d * kAb, cudaMemcpyDeviceToDevice, cx.stream));
  return absl::OkStatus();
}

absl::Status CudaMoeFfn::ExpertsBackwardFp8(const LayerIdx& L, MoeDevCache& M) {
  const MoeLayerParams& p = L.moe_p;
  MoeDevWork& X = W;
  const int64_t d = c.d_model, F = c.moe.expert_ffn;
  const MoeDispatchPlan& plan = M.plan;
  const int64_t R = plan.expert_rows(), El = plan.local_experts;
  const int64_t* off = plan.expert_offsets.data();
  constexpr KDType kE5 = KDType::kFp8E5M2;
  // The output gradients' codes (E5M2): at ep = 1 the combine's backward took their amax; rows
  // that came from other ranks take their own. Blockwise: each block its own scale, in the bands
  // of the forward's rows (the padding rows are zeros).
  if (cx.fp8_blockwise) {
    RETURN_IF_ERROR(QuantizeRows(M, X.q_dye, kE5, X.dye.get(), nullptr, d, true));
  } else {
    KC(plan.ep > 1 ? kc::Fp8Quantize(X.dye.get(), R, d, kAct, X.q_dye.Output(), cx.stream)
                   : kc::Fp8QuantizeFromAmax(X.dye.get(), R, d, kAct, X.q_dye.Output(), cx.stream));
  }
  KC(moe_gemm->BackwardDataFp8(RowsOperand(X.q_dye), cx.fp8_e[p.w2].Transposed(), X.da.get(), kAct,
                               off, El, d, F, cx.stream));
  RETURN_IF_ERROR(WeightGrad(M, X.q_dye, M.q_a, cx.G(p.w2), d, F));
  KC(kc::SwiGluBackward(M.g.get(), M.u.get(), X.da.get(), X.dg.get(), X.du.get(), R * F, kAct,
                        cx.stream));
  const std::pair<Fp8Act*, int> parts[] = {{&X.q_dg, p.w1}, {&X.q_du, p.w3}};
  const DevBuf* grads[] = {&X.dg, &X.du};
  for (int i = 0; i < 2; ++i) {
    Fp8Act& q = *parts[i].first;
    const int w = parts[i].second;
    if (cx.fp8_blockwise) {
      RETURN_IF_ERROR(QuantizeRows(M, q, kE5, grads[i]->get(), nullptr, F, true));
    } else {
      RETURN_IF_ERROR(q.Ensure(&cx.alloc, R, F, kE5));
      KC(kc::Fp8Quantize(grads[i]->get(), R, F, kAct, q.Output(), cx.stream));
    }
    KC(moe_gemm->BackwardDataFp8(RowsOperand(q), cx.fp8_e[w].Transposed(), X.dxe.get(), kAct, off,
                                 El, F, d, cx.stream, /*accumulate=*/i == 1));
    RETURN_IF_ERROR(WeightGrad(M, q, M.q_xe, cx.G(w), F, d));
  }
  return absl::OkStatus();
}

absl::Status CudaMoeFfn::PlanBlocks(MoeDevCache& M) {
  const MoeDispatchPlan& plan = M.plan;
  MoeExpertSegments(plan, &M.segments);
  KC(kc::Fp8GroupedRowBands(plan.expert_offsets.data(), plan.local_experts, M.segments.data(),
                            static_cast<int64_t>(M.segments.size()) - 1, &M.row_bands));
  const std::vector<kc::Fp8RowBand>& b = M.row_bands.bands;
  const int64_t bytes = static_cast<int64_t>(b.size() * sizeof(kc::Fp8RowBand));
  RETURN_IF_ERROR(M.bands.Ensure(&cx.alloc, std::max<int64_t>(bytes, 1)));
  if (bytes > 0)
    CUDA(cudaMemcpyAsync(M.bands.get(), b.data(), bytes, cudaMemcpyHostToDevice, cx.stream));
  return absl::OkStatus();
}

absl::Status CudaMoeFfn::QuantizeRows(MoeDevCache& M, Fp8Act& q, KDType f, const void* x,
                                      const int32_t* src, int64_t cols, bool transposes) {
  const int64_t R = M.plan.expert_rows();
  RETURN_IF_ERROR(q.EnsureGrouped(&cx.alloc, R, cols, f, M.row_bands.col_blocks));
  KC(kc::GatherRowsBlockwise(x, src, static_cast<const kc::Fp8RowBand*>(M.bands.get()),
                             static_cast<int64_t>(M.row_bands.bands.size()), R, cols, kAct,
                             LayerContext::QBlockOut(q, transposes), cx.stream));
  return absl::OkStatus();
}

kc::Fp8Operand CudaMoeFfn::RowsOperand(const Fp8Act& q) const {
  if (cx.fp8_blockwise) return {q.codes(), q.format, q.scales, kc::Fp8ScaleMode::kRow128};
  return {q.codes(), q.format, q.inverse_scale()};
}

kc::Fp8Operand CudaMoeFfn::ColumnsOperand(const Fp8Act& q) const {
  if (cx.fp8_blockwise) return {q.codes_t(), q.format, q.scales_t, kc::Fp8ScaleMode::kRow128};
  return {q.codes_t(), q.format, q.inverse_scale()};
}

absl::Status CudaMoeFfn::WeightGrad(const MoeDevCache& M, const Fp8Act& dC, const Fp8Act& A,
                                    float* dB, int64_t N, int64_t K) {
  const MoeDispatchPlan& plan = M.plan;
  const bool blocks = cx.fp8_blockwise;
  KC(moe_gemm->BackwardWeightFp8(ColumnsOperand(dC), ColumnsOperand(A), dB,
                                 plan.expert_offsets.data(), plan.local_experts, N, K, cx.stream,
                                 blocks ? M.segments.data() : nullptr,
                                 blocks ? static_cast<int64_t>(M.segments.size()) - 1 : 0));
  return absl::OkStatus();
}

absl::Status CudaMoeFfn::GroupOnDevice(MoeDevCache& M, int64_t align,
                                       const std::function<void()>& overlap) {
  const MoeConfig& m = c.moe;
  MoeDevWork& X = W;
  const int64_t T = B.T, E = m.experts, K = m.top_k, n = T * K;
  const int64_t capacity = n + E * (align - 1);
  if (moe_counts_host == nullptr)
    CUDA(cudaMallocHost(&moe_counts_host, kc::kMoeMaxExperts * sizeof(int64_t)));
  if (moe_counts_ready == nullptr)
    CUDA(cudaEventCreateWithFlags(&moe_counts_ready, cudaEventDisableTiming));
  RETURN_IF_ERROR(X.group_counts.Ensure(&cx.alloc, E * 8));
  RETURN_IF_ERROR(X.group_offsets.Ensure(&cx.alloc, (E + 1) * 8));
  const size_t ws = kc::MoeGroupRowsWorkspaceBytes(n, E);
  RETURN_IF_ERROR(X.group_ws.Ensure(&cx.alloc, static_cast<int64_t>(ws)));
  RETURN_IF_ERROR(M.pair_row.Ensure(&cx.alloc, n * 4));
  RETURN_IF_ERROR(M.expert_src.Ensure(&cx.alloc, capacity * 4));
  KC(kc::MoeGroupRows(M.idx.i32(), n, K, E, align, static_cast<int64_t*>(X.group_counts.get()),
                      static_cast<int64_t*>(X.group_offsets.get()), M.pair_row.i32(),
                      M.expert_src.i32(), capacity, moe_counts_host,
                      kc::Workspace{X.group_ws.get(), ws}, cx.stream));
  CUDA(cudaEventRecord(moe_counts_ready, cx.stream));
  if (overlap) overlap();
  CUDA(cudaEventSynchronize(moe_counts_ready));
  // The plan's host part (its row maps are the device's, above).
  MoeDispatchPlan& plan = M.plan;
  PlanMoeGroupsAtEp1(moe_counts_host, T, K, E, align, &plan);
  plan.pair_row.clear();
  plan.expert_src.clear();
  if (plan.expert_offsets[E] > capacity)
    return absl::InternalError(absl::StrCat("cuda model: the experts' group sizes add up to ",
                                            plan.expert_offsets[E], " rows, past the ", capacity,
                                            " that ", n, " choices can fill"));
  return absl::OkStatus();
}

absl::Status CudaMoeFfn::CountLseSq(const LayerIdx& L, const float* lse, int64_t T) {
  constexpr int64_t kSlots = 256;
  if (moe_lse_sq_layer.size() >= static_cast<size_t>(kSlots)) RETURN_IF_ERROR(DrainLseSq());
  RETURN_IF_ERROR(moe_lse_sq.Ensure(&cx.alloc, kSlots * sizeof(double)));
  const size_t ws = kc::SquaredNormWorkspaceBytes();
  RETURN_IF_ERROR(W.lse_sq_ws.Ensure(&cx.alloc, static_cast<int64_t>(ws)));
  double* slot = static_cast<double*>(moe_lse_sq.get()) + moe_lse_sq_layer.size();
  KC(kc::SquaredNorm(lse, T, slot, kc::Workspace{W.lse_sq_ws.get(), ws}, cx.stream));
  moe_lse_sq_layer.push_back(L.index);
  return absl::OkStatus();
}

absl::Status CudaMoeFfn::DrainLseSq() {
  if (moe_lse_sq_layer.empty()) return absl::OkStatus();
  std::vector<double> sums(moe_lse_sq_layer.size());
  CUDA(cudaMemcpyAsync(sums.data(), moe_lse_sq.get(), sums.size() * sizeof(double),
                       cudaMemcpyDeviceToHost, cx.stream));
  CUDA(cudaStreamSynchronize(cx.stream));
  if (moe_stats.size() < static_cast<size_t>(c.n_layers)) moe_stats.resize(c.n_layers);
  for (size_t i = 0; i < sums.size(); ++i) moe_stats[moe_lse_sq_layer[i]].zloss_sum += sums[i];
  moe_lse_sq_layer.clear();
  return absl::OkStatus();
}

absl::Status CudaMoeFfn::Backward(const LayerIdx& L, LayerActs& A, MoeDevCache& M, const void* dy) {
  const MoeConfig& m = c.moe;
  const MoeLayerParams& p = L.moe_p;
  MoeDevWork& X = W;
  const int64_t T = B.T, d = c.d_model, E = m.experts, K = m.top_k, F = m.expert_ffn,
                S = m.shared_ffn;
  const MoeDispatchPlan& plan = M.plan;
  DeviceMoeRows& rows = static_cast<DeviceMoeRows&>(*moe_rows);
  if (plan.ep > 1) RETURN_IF_ERROR(rows.Upload(plan, M));  // at ep = 1 the maps are on the device
  const int64_t R = plan.expert_rows(), El = plan.local_experts;
  // The combine's backward: each pair's output gradient (weighted) and its weight's gradient.
  RETURN_IF_ERROR(cx.F32(X.dw, T * K));
  RETURN_IF_ERROR(cx.Act(X.dye, R, d));
  // Tensorwise fp8: the combine's backward reduces dye's amax into q_dye (blockwise needs none).
  const bool dye_amax = cx.fp8 && !cx.fp8_blockwise;
  if (dye_amax) RETURN_IF_ERROR(X.q_dye.Ensure(&cx.alloc, R, d, KDType::kFp8E5M2));
  if (plan.ep > 1) {
    RETURN_IF_ERROR(cx.Act(X.send, T * K, d));
    RETURN_IF_ERROR(cx.Act(X.recv, plan.recv_total(), d));
    KC(kc::MoeCombineBackward(dy, M.returned.get(), M.pair_row.i32(), M.weights.f32(), X.send.get(),
                              X.dw.f32(), T, K, d, kAct, cx.stream));
  } else {
    CUDA(cudaMemsetAsync(X.dye.get(), 0, std::max<int64_t>(R, 1) * d * kAb, cx.stream));
    KC(kc::MoeCombineBackward(dy, M.ye.get(), M.pair_row.i32(), M.weights.f32(), X.dye.get(),
                              X.dw.f32(), T, K, d, kAct, cx.stream,
                              dye_amax ? X.q_dye.Output().amax : nullptr));
  }
  // The shared expert's backward while the gradients travel to the experts: W.dh.
  RETURN_IF_ERROR(cx.Act(cx.W.dh, T, d));
  for (DevBuf* b : {&X.sda, &X.sdg, &X.sdu})
    RETURN_IF_ERROR(cx.Act(*b, T, std::max<int64_t>(S, 1)));
  absl::Status shared_status;
  auto shared = [&] {
    if (S == 0) {
      shared_status = FromCuda(cudaMemsetAsync(cx.W.dh.get(), 0, T * d * kAb, cx.stream), "memset");
      return;
    }
    absl::Status s =
        cx.Bwd(M.sa.get(), S, cx.Wb(p.s2), dy, X.sda.get(), cx.G(p.s2), T, S, d, false);
    if (s.ok())
      s = FromKernel(kc::SwiGluBackward(M.sg.get(), M.su.get(), X.sda.get(), X.sdg.get(),
                                        X.sdu.get(), T * S, kAct, cx.stream));
    if (s.ok())
      s = cx.Bwd(A.h2.get(), d, cx.Wb(p.s1), X.sdg.get(), cx.W.dh.get(), cx.G(p.s1), T, d, S,
                 false);
    if (s.ok())
      s = cx.Bwd(A.h2.get(), d, cx.Wb(p.s3), X.sdu.get(), cx.W.dh.get(), cx.G(p.s3), T, d, S, true);
    shared_status = s;
  };
  if (plan.ep > 1) {
    RETURN_IF_ERROR(
        MoeToExperts(plan, rows, ep, X.send.get(), d, X.recv.get(), X.dye.get(), shared));
  } else {
    shared();
  }
  RETURN_IF_ERROR(shared_status);
  // The experts' backward.
  for (DevBuf* b : {&X.da, &X.dg, &X.du}) RETURN_IF_ERROR(cx.Act(*b, R, F));
  RETURN_IF_ERROR(cx.Act(X.dxe, R, d));
  const int64_t* off = plan.expert_offsets.data();
  if (cx.fp8) {
    RETURN_IF_ERROR(ExpertsBackwardFp8(L, M));
  } else {
    KC(moe_gemm->BackwardData(X.dye.get(), cx.Wb(p.w2), X.da.get(), off, El, d, F, kAct,
                              cx.stream));
    KC(moe_gemm->BackwardWeight(X.dye.get(), M.a.get(), cx.G(p.w2), off, El, d, F, kAct,
                                cx.stream));
    KC(kc::SwiGluBackward(M.g.get(), M.u.get(), X.da.get(), X.dg.get(), X.du.get(), R * F, kAct,
                          cx.stream));
    KC(moe_gemm->BackwardData(X.dg.get(), cx.Wb(p.w1), X.dxe.get(), off, El, F, d, kAct,
                              cx.stream));
    KC(moe_gemm->BackwardData(X.du.get(), cx.Wb(p.w3), X.dxe.get(), off, El, F, d, kAct, cx.stream,
                              /*accumulate=*/true));
    KC(moe_gemm->BackwardWeight(X.dg.get(), M.xe.get(), cx.G(p.w1), off, El, F, d, kAct,
                                cx.stream));
    KC(moe_gemm->BackwardWeight(X.du.get(), M.xe.get(), cx.G(p.w3), off, El, F, d, kAct,
                                cx.stream));
  }
  // The input gradient in fp32: the shared expert's, each token's K rows, the router's; rounded
  // once into W.dh.
  RETURN_IF_ERROR(cx.F32(X.acc, T * d));
  KC(kc::CastRows(X.acc.get(), KDType::kFloat32, d, cx.W.dh.get(), kAct, d, T, d, cx.stream));
  const void* dX = X.dxe.get();
  if (plan.ep > 1) {
    RETURN_IF_ERROR(MoeFromExperts(plan, rows, ep, X.dxe.get(), d, X.recv.get(), X.send.get()));
    dX = X.send.get();
  }
  KC(kc::MoeCombine(dX, kAct, M.pair_row.i32(), nullptr, X.acc.get(), KDType::kFloat32, T, K, d,
                    /*accumulate=*/true, cx.stream));
  RETURN_IF_ERROR(cx.F32(X.dlogits, T * E));
  KC(kc::MoeRouterBackward(M.logits.f32(), M.idx.i32(), X.dw.f32(), M.lse.f32(), zloss_scale,
                           X.dlogits.f32(), T, E, K, cx.stream));
  {
    kc::GemmArgs a;  // acc += dlogits Wr
    a.M = T, a.N = d, a.K = E, a.beta = 1.0f;
    a.A = X.dlogits.get(), a.lda = E, a.B = cx.Master(p.router), a.ldb = d, a.C = X.acc.get(),
    a.ldc = d;
    a.ab_type = KDType::kFloat32, a.c_type = KDType::kFloat32;
    KC(cx.blas->Gemm(a, cx.stream));
    kc::GemmArgs b;  // dWr += dlogits^T h32
    b.trans_a = true;
    b.M = E, b.N = d, b.K = T, b.beta = 1.0f;
    b.A = X.dlogits.get(), b.lda = E, b.B = M.h32.get(), b.ldb = d, b.C = cx.G(p.router), b.ldc = d;
    b.ab_type = KDType::kFloat32, b.c_type = KDType::kFloat32;
    KC(cx.blas->Gemm(b, cx.stream));
  }
  KC(kc::CastRows(cx.W.dh.get(), kAct, d, X.acc.get(), KDType::kFloat32, d, T, d, cx.stream));
  return absl::OkStatus();
}

}  // namespace cuda_model_detail
}  // namespace spindle
