// CudaModel's passes (see cuda_model.h): the batch's upload to the device and the whole model's
// forward and backward, layer after layer, with the LM head and the loss.
#include "worker/engine/cuda/cuda_model_impl.h"

namespace spindle {

// ---- Batch ---------------------------------------------------------------------------------------

absl::Status CudaModel::Impl::SetLevel(CpLevel& V, const Batch& local, const CpLayout& L) {
  V.layout = &L;
  V.T = local.T, V.cp = L.cp, V.rank = L.rank, V.chunk = L.chunk;
  const int64_t n_chunks = 2 * L.cp;
  V.chunk_has_start_host.assign(n_chunks, 0);
  V.chunk_len_host.assign(n_chunks, 0);
  for (int64_t ci = 0; ci < n_chunks; ++ci) {
    V.chunk_has_start_host[ci] = L.chunks[ci].has_start ? 1 : 0;
    V.chunk_len_host[ci] = static_cast<int32_t>(L.chunks[ci].len);
  }
  for (int slot = 0; slot < 2; ++slot) {
    const CpChunk& chunk = L.chunks[L.ChunkOf(L.rank, slot)];
    V.slot_chunk[slot] = L.ChunkOf(L.rank, slot);
    V.continues[slot] = chunk.continues;
    V.first_segment[slot] = chunk.first_segment;
    const int64_t first = V.slot_chunk[slot] * L.chunk;
    V.key_begin[slot] = first;
    if (chunk.continues) {  // the last document start before the chunk's first token
      const auto it = std::upper_bound(L.cu_seqlens.begin(), L.cu_seqlens.end(), first);
      V.key_begin[slot] = *(it - 1);
    }
    V.piece_cu_host[slot] = local.pieces[slot].cu_seqlens;
    RETURN_IF_ERROR(V.piece_cu[slot].Ensure(&alloc, V.piece_cu_host[slot].size() * 4));
    CUDA(cudaMemcpyAsync(V.piece_cu[slot].get(), V.piece_cu_host[slot].data(),
                         V.piece_cu_host[slot].size() * 4, cudaMemcpyHostToDevice, stream));
  }
  RETURN_IF_ERROR(V.chunk_has_start.Ensure(&alloc, n_chunks * 4));
  RETURN_IF_ERROR(V.chunk_len.Ensure(&alloc, n_chunks * 4));
  CUDA(cudaMemcpyAsync(V.chunk_has_start.get(), V.chunk_has_start_host.data(), n_chunks * 4,
                       cudaMemcpyHostToDevice, stream));
  CUDA(cudaMemcpyAsync(V.chunk_len.get(), V.chunk_len_host.data(), n_chunks * 4,
                       cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::Upload(const Batch& b, const CpBatch* cpb) {
  const CpLayout* layout = cpb != nullptr && cpb->layout.cp > 1 ? &cpb->layout : nullptr;
  if (b.T < 1) return absl::InvalidArgumentError("cuda model: empty batch");
  const bool split = layout != nullptr && layout->cp > 1;
  if (!split && (b.pieces.size() != 1 || b.pieces[0].begin != 0 || b.pieces[0].len != b.T))
    return absl::InvalidArgumentError(
        "cuda model: a batch must be one whole sequence (a share of a sequence needs context "
        "parallelism: SetCp and the CpBatch forms)");
  if (static_cast<int64_t>(b.ids.size()) != b.T || static_cast<int64_t>(b.targets.size()) != b.T ||
      static_cast<int64_t>(b.pos.size()) != b.T)
    return absl::InvalidArgumentError(
        absl::StrCat("cuda model: a batch of ", b.T, " tokens has ", b.ids.size(), " ids, ",
                     b.targets.size(), " targets and ", b.pos.size(), " positions"));
  if (split) {
    // This rank's two zigzag chunks of the layout's sequence, in that order (ShardForCp).
    const CpLayout& L = *layout;
    const int64_t ch = L.chunk;
    bool ok = ch > 0 && L.rank >= 0 && L.rank < L.cp && L.T_full == 2 * L.cp * ch &&
              b.T == 2 * ch && b.pieces.size() == 2 &&
              static_cast<int64_t>(b.idx.size()) == b.T && L.cu_seqlens.size() >= 2 &&
              L.cu_seqlens.front() == 0 && L.cu_seqlens.back() == L.T_full;
    for (int64_t s = 0; ok && s < 2; ++s)
      ok = b.pieces[s].begin == s * ch && b.pieces[s].len == ch;
    for (int64_t t = 0; ok && t < b.T; ++t)
      ok = b.idx[t] == L.ChunkOf(L.rank, t / ch) * ch + t % ch;
    if (!ok)
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda model: the batch (", b.T, " tokens, ", b.pieces.size(), " pieces) is not rank ",
          L.rank, "'s zigzag share of its cp=", L.cp, " layout (", L.T_full,
          " tokens in chunks of ", ch, "); build both with ShardForCp"));
    if ((cp.lightning_mode == CpMode::kHybrid || cp.mla_mode == CpMode::kHybrid) &&
        (cpb->group == nullptr || L.ulysses < 1 || cpb->group->layout.cp != L.cp / L.ulysses))
      return absl::InvalidArgumentError(
          "cuda model: a hybrid mode needs the batch's Ulysses group (ShardForCp with ulysses)");
  }
  for (int32_t id : b.ids)
    if (id < 0 || id >= c.vocab)
      return absl::InvalidArgumentError(
          absl::StrCat("cuda model: token id ", id, " outside the vocabulary [0, ", c.vocab, ")"));
  B.T = b.T;
  B.cp = split ? layout->cp : 1;
  B.rank = split ? layout->rank : 0;
  B.T_full = split ? layout->T_full : b.T;
  B.chunk = split ? layout->chunk : 0;
  B.cu_host = split ? layout->cu_seqlens : b.pieces[0].cu_seqlens;
  B.n_valid = b.NumValidTargets();
  RETURN_IF_ERROR(B.ids.Ensure(&alloc, b.T * 4));
  RETURN_IF_ERROR(B.targets.Ensure(&alloc, b.T * 4));
  RETURN_IF_ERROR(B.pos.Ensure(&alloc, b.T * 4));
  RETURN_IF_ERROR(B.cu.Ensure(&alloc, static_cast<int64_t>(B.cu_host.size()) * 4));
  CUDA(cudaMemcpyAsync(B.ids.get(), b.ids.data(), b.T * 4, cudaMemcpyHostToDevice, stream));
  CUDA(cudaMemcpyAsync(B.targets.get(), b.targets.data(), b.T * 4, cudaMemcpyHostToDevice,
                       stream));
  CUDA(cudaMemcpyAsync(B.pos.get(), b.pos.data(), b.T * 4, cudaMemcpyHostToDevice, stream));
  CUDA(cudaMemcpyAsync(B.cu.get(), B.cu_host.data(), B.cu_host.size() * 4,
                       cudaMemcpyHostToDevice, stream));
  // One workspace for every kernel that needs scratch (they run one after another).
  const int64_t T = b.T, d = c.d_model, H = c.n_heads, Dh = c.head_dim();
  const int64_t widest = std::max({d, c.mla.kv_lora_rank, std::max<int64_t>(c.mla.q_lora_rank, 1)});
  size_t need = std::max(
      {kc::LightningWorkspaceBytes({T, H, Dh, 3 * d}), kc::RmsNormBackwardWorkspaceBytes(T, widest),
       kc::QkNormRopeBackwardWorkspaceBytes(T, H, Dh),
       kc::GroupNormGateBackwardWorkspaceBytes(T, H, Dh), kc::EmbeddingBackwardWorkspaceBytes(T),
       kc::SquaredNormWorkspaceBytes()});
  if (split) {
    // The CP buffers. Per rank the widest exchange is the core's inputs (or their gradients):
    // T * H * (one head's input width).
    const int64_t qk = c.mla.qk_nope_dim + c.mla.qk_rope_dim, vd = c.mla.v_head_dim;
    const bool has_lt = c.NumLayersOfKind('L') > 0, has_m = c.NumLayersOfKind('M') > 0;
    // The layer types that exchange by all-to-all (Lightning's AllGather gathers states only):
    // All2All over the CP group, hybrid inside the Ulysses groups (as many elements a rank).
    const bool has_l = has_lt && (cp.lightning_mode == CpMode::kAll2All || LightningHybrid());
    const bool has_m_a2a = has_m && cp.mla_mode == CpMode::kAll2All;
    const bool has_m_hy = has_m && MlaHybrid();
    const int64_t in_elems =
        std::max({has_l ? T * 3 * d : int64_t{0}, has_m_a2a ? T * H * (2 * qk + vd) : int64_t{0},
                  has_m_hy ? T * H * qk : int64_t{0}});
    const int64_t out_elems =
        std::max(has_l ? T * d : int64_t{0}, has_m_a2a || has_m_hy ? T * H * vd : int64_t{0});
    RETURN_IF_ERROR(W.cp_block.Ensure(&alloc, in_elems * kAb));
    RETURN_IF_ERROR(W.cp_tmp.Ensure(&alloc, out_elems * kAb));
    // The levels and exchanges: the CP group's, and under the hybrid modes the ring of Ulysses
    // groups' and this rank's group's.
    const CpLayout& L = *layout;
    RETURN_IF_ERROR(SetLevel(B.lv, b, L));
    B.whole = {cp.comm, B.cp, UlyssesRuns(WholeCpGroup(L))};
    const bool hybrid = LightningHybrid() || MlaHybrid();
    if (hybrid) {  // the group was checked above, before anything changed
      RETURN_IF_ERROR(SetLevel(B.group_lv, cpb->group->local, cpb->group->layout));
      B.ulysses = {cp.ulysses, L.ulysses, UlyssesRuns(HybridUlyssesGroup(L))};
    }
    // The Lightning cores' workspace and chunk states.
    RETURN_IF_ERROR(lightning.SizeCpScratch(L, &need));
    // MLA's gathers, ring and key blocks.
    RETURN_IF_ERROR(mla.SizeCpScratch(L));
  }
  RETURN_IF_ERROR(W.ws.Ensure(&alloc, static_cast<int64_t>(need)));
  W.ws_bytes = static_cast<int64_t>(need);
  return absl::OkStatus();
}

// ---- Whole model ---------------------------------------------------------------------------------

absl::StatusOr<LossStats> CudaModel::Impl::HeadAndLoss(const void* x, float grad_scale,
                                                       void* dx) {
  const int64_t T = B.T, d = c.d_model, V = c.vocab;
  RETURN_IF_ERROR(Act(hf, T, d));
  RETURN_IF_ERROR(F32(rstd_f, T));
  RETURN_IF_ERROR(F32(row_loss, T));
  KC(kc::RmsNormForward(x, Wb(final_norm), hf.get(), rstd_f.f32(), T, d,
                        static_cast<float>(c.norm_eps), kAct, stream));
  // Row blocks of about 256M bf16 logits (a multiple of 128 rows: whole GEMM tiles; 8192 rows at
  // V = 32000) bound the logits whatever T is. Each block's weight-gradient GEMM reads and writes
  // the whole fp32 [V, d] gradient, so fewer, larger blocks move fewer bytes: at T = 32K, 2048-row
  // blocks moved 8.4 GB of it per step, 8192-row blocks 2.1 GB.
  const int64_t block = std::min<int64_t>(
      T, head_block_rows > 0 ? head_block_rows
                             : std::max<int64_t>(128, (int64_t{1} << 28) / V / 128 * 128));
  RETURN_IF_ERROR(Act(logits, block, V));
  if (dx) RETURN_IF_ERROR(Act(dhf, T, d));
  for (int64_t r0 = 0; r0 < T; r0 += block) {
    const int64_t rows = std::min(block, T - r0);
    const void* h = At(hf.get(), r0 * d);
    RETURN_IF_ERROR(Fwd(h, d, Wb(lm_head), logits.get(), rows, d, V, false));
    KC(kc::CrossEntropy(logits.get(), B.targets.i32() + r0, rows, V, grad_scale,
                        row_loss.f32() + r0, dx ? logits.get() : nullptr, kAct, stream,
                        z_loss));
    if (dx)
      RETURN_IF_ERROR(Bwd(h, d, Wb(lm_head), logits.get(), At(dhf.get(), r0 * d), G(lm_head),
                          rows, d, V, false));
  }
  KC(kc::SumRows(row_loss.f32(), T, scalar, stream));
  if (dx && fp8) RETURN_IF_ERROR(F32(W.grad_amax, Work::kGradAmaxes));
  if (dx)
    KC(kc::RmsNormBackward(x, Wb(final_norm), rstd_f.f32(), dhf.get(), nullptr, dx, G(final_norm),
                           T, d, kAct, Ws(), stream, GradAmax(Work::kAmaxDx)));
  // Read by the host after the step's final synchronisation (pinned: no implicit sync here).
  CUDA(cudaMemcpyAsync(loss_host, scalar, sizeof(double), cudaMemcpyDeviceToHost, stream));
  LossStats s;
  s.n_valid = B.n_valid;
  return s;
}

namespace {

// The step's passes (worker/engine/layer_passes.h) on the device: the layer inputs (a training
// step's n + 1, or offloading the ring's slots and one buffer for the head's input; a forward-only
// pass's two in turn), the offload's copies around them (see Offload), each cache's layer kind
// (the shared cache holds one kind at a time) and each recomputing MLA layer's kept attention.
class DevicePasses final : public LayerPasses {
 public:
  DevicePasses(CudaModel::Impl& m, Recompute recompute, float grad_scale, bool backward)
      : m_(m),
        T_(m.B.T),
        n_(m.c.n_layers),
        recompute_(recompute),
        grad_scale_(grad_scale),
        backward_(backward),
        offload_(backward && m.offload_inputs && m.c.n_layers > Offload::kSlots) {}

  // The caches, layer inputs, offload slots and kept attention outputs for this step.
  absl::Status Prepare() {
    CudaModel::Impl& m = m_;
    // Forward only (called with Recompute::All): one cache. Training: one cache per layer that
    // keeps its activations and one, refilled per layer, for those that recompute.
    const size_t n_caches = static_cast<size_t>(recompute_.NumCaches(n_));
    while (m.caches.size() < n_caches) m.caches.push_back(std::make_unique<Cache>());
    m.caches.resize(n_caches);
    // The cache the recomputing layers share holds one layer kind's buffers at a time.
    for (size_t k = 0; k < m.caches.size(); ++k) {
      Cache& C = *m.caches[k];
      const bool shared = m.kind_union && k == 0 && (!backward_ || recompute_.layers > 0);
      if (C.kind_union && !shared)
        m.DropArena(C.arena, m.CacheKindFields(C, 'L'), m.CacheKindFields(C, 'M'));
      C.kind_union = shared;
    }
    const int64_t n_inputs = !backward_ ? 2 : offload_ ? 1 : n_ + 1;
    if (static_cast<int64_t>(m.layer_in.size()) != n_inputs)
      m.layer_in = std::vector<DevBuf>(n_inputs);
    for (DevBuf& t : m.layer_in) RETURN_IF_ERROR(m.Act(t, T_, m.c.d_model));
    if (offload_) {
      RETURN_IF_ERROR(m.off.EnsureHost((n_ - K) * T_ * m.c.d_model * kAb));
      for (DevBuf& t : m.off.slot) RETURN_IF_ERROR(m.Act(t, T_, m.c.d_model));
    } else {
      m.off.ReleaseSlots();
    }
    if (!backward_ || recompute_.layers <= 0) {
      m.kept.clear();
    } else if (static_cast<int64_t>(m.kept.size()) != n_) {
      m.kept = std::vector<KeptForRecompute>(n_);
    }
    return absl::OkStatus();
  }

  absl::Status Embed() override {
    KC(kc::EmbeddingForward(m_.B.ids.i32(), m_.Wb(m_.embed), In(0), T_, m_.c.d_model, kAct,
                            m_.stream));
    return AfterInput(0);
  }
  absl::Status Forward(int64_t i, int64_t cache, bool keep) override {
    Cache& C = *m_.caches[cache];
    RETURN_IF_ERROR(UseKind(C, i));
    const bool swap = Keeps(i);
    if (swap && m_.fp8) RETURN_IF_ERROR(m_.F32(m_.kept[i].fp8_amax, kFp8Sites));
    if (swap) m_.kept[i].SwapInto(C);
    if (!swap && !m_.kept.empty()) m_.kept[i].Release();  // held by a step that recomputed i
    absl::Status st = BeforeInput(i + 1);
    if (st.ok()) st = m_.LayerForward(m_.layers[i], C, In(i), In(i + 1), /*ffn_kept=*/keep);
    if (swap) m_.kept[i].SwapInto(C);  // back: kept[i] holds this layer's output
    RETURN_IF_ERROR(st);
    return AfterInput(i + 1);
  }
  absl::StatusOr<LossStats> Head() override {
    if (!backward_) return m_.HeadAndLoss(In(n_), 0.0f, nullptr);
    RETURN_IF_ERROR(m_.Act(m_.dx, T_, m_.c.d_model));
    return m_.HeadAndLoss(In(n_), grad_scale_, m_.dx.get());
  }
  absl::Status Backward(int64_t i, int64_t cache, bool recomputes) override {
    Cache& C = *m_.caches[cache];
    RETURN_IF_ERROR(UseKind(C, i));
    const bool swap = Keeps(i);
    if (swap) m_.kept[i].SwapInto(C);
    absl::Status st;
    // Offloading: input i is back in its slot (see Offload).
    if (offload_ && i < n_ - K) st = m_.off.WaitCopied(m_.stream, SlotOf(i));
    // The recomputed forward needs no output: it is the next layer's input, kept.
    if (st.ok() && recomputes)
      st = m_.LayerForward(m_.layers[i], C, In(i), nullptr, /*ffn_kept=*/false, swap);
    if (st.ok()) st = m_.LayerBackward(m_.layers[i], C, In(i), m_.dx.get(), !recomputes);
    if (swap) m_.kept[i].SwapInto(C);
    RETURN_IF_ERROR(st);
    // Offloading: layer i was the last user of its slot; input i - K comes back into it.
    if (offload_ && i >= K)
      return m_.off.CopyAfter(m_.stream, SlotOf(i), In(i - K), HostIn(i - K),
                              T_ * m_.c.d_model * kAb, cudaMemcpyHostToDevice);
    return absl::OkStatus();
  }
  absl::Status EmbedBackward() override {
    KC(kc::EmbeddingBackward(m_.B.ids.i32(), m_.dx.get(), m_.G(m_.embed), T_, m_.c.d_model,
                             m_.c.vocab, kAct, m_.Ws(), m_.stream));
    return absl::OkStatus();
  }

 private:
  static constexpr int64_t K = Offload::kSlots;
  void* In(int64_t i) {
    if (!backward_) return m_.layer_in[i % 2].get();
    if (!offload_) return m_.layer_in[i].get();
    return i < n_ ? m_.off.slot[i % K].get() : m_.layer_in[0].get();
  }
  void* HostIn(int64_t i) { return At(m_.off.host, i * T_ * m_.c.d_model); }
  int SlotOf(int64_t i) const { return static_cast<int>(i % K); }
  // Offloading: before input j is written, the copy of input j - K out of its slot is done; once
  // it is written, it goes to the host unless the backward finds it in its slot.
  absl::Status BeforeInput(int64_t j) {
    if (offload_ && j >= K && j < n_) return m_.off.WaitCopied(m_.stream, SlotOf(j));
    return absl::OkStatus();
  }
  absl::Status AfterInput(int64_t j) {
    if (!offload_ || j >= n_ - K) return absl::OkStatus();
    return m_.off.CopyAfter(m_.stream, SlotOf(j), HostIn(j), In(j), T_ * m_.c.d_model * kAb,
                            cudaMemcpyDeviceToHost);
  }
  absl::Status UseKind(Cache& C, int64_t i) {
    return C.kind_union ? m_.UseKind(C.arena, m_.layers[i].kind, m_.CacheKindFields(C, 'L'),
                                     m_.CacheKindFields(C, 'M'))
                        : absl::OkStatus();
  }
  // Each recomputing MLA layer keeps its attention output from the first forward, and under FP8
  // every recomputing layer its producers' statistics and amaxes (KeptForRecompute).
  bool Keeps(int64_t i) const {
    return backward_ && recompute_.Layer(i) && (m_.layers[i].kind == 'M' || m_.fp8);
  }

  CudaModel::Impl& m_;
  const int64_t T_, n_;
  const Recompute recompute_;
  const float grad_scale_;
  const bool backward_, offload_;
};

}  // namespace

absl::StatusOr<LossStats> CudaModel::Impl::Run(const Batch& b, const CpBatch* cpb, float grad_scale,
                                               Recompute recompute, bool backward) {
  const auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(Upload(b, cpb));
  if (fp8 && B.T % 16 != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda model: train.precision \"fp8\" needs a multiple of 16 tokens per rank, got ", B.T,
        " (cuBLASLt's FP8 GEMMs)"));
  moe.moe_counting = backward;
  if (moe.moe_stats.size() < static_cast<size_t>(c.n_layers)) moe.moe_stats.resize(c.n_layers);
  DevicePasses passes(*this, recompute, grad_scale, backward);
  RETURN_IF_ERROR(passes.Prepare());
  ASSIGN_OR_RETURN(LossStats s, RunLayerPasses(passes, c.n_layers, recompute, backward));
  enqueue_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CUDA(cudaStreamSynchronize(stream));
  s.loss_sum = *loss_host;
  return s;
}

absl::StatusOr<LossStats> CudaModel::ForwardBackward(const Batch& batch, float grad_scale,
                                                     Recompute recompute) {
  return impl_->Run(batch, nullptr, grad_scale, recompute, /*backward=*/true);
}

absl::StatusOr<LossStats> CudaModel::Forward(const Batch& batch) {
  return impl_->Run(batch, nullptr, 0.0f, Recompute::All(), /*backward=*/false);
}

}  // namespace spindle
