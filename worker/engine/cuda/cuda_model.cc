// CudaModel: the hybrid Lightning/MLA model on one GPU (see cuda_model.h). The layer code follows
// worker/engine/model.cc step for step; the differences are the storage (bf16 activations, fp32
// master weights and gradients on the device), one [T, 3d] qkv GEMM with the fused q/k norm +
// RoPE kernel, residual adds folded into the GEMMs (beta = 1), and cuDNN attention for MLA.
//
// Context parallelism (see cuda_model.h) follows cp/cp_attention.cc with device buffers: All2All
// as its LightningAll2All* and MlaAll2All*, AllGather as DESIGN.md section 3 describes it. The
// blocks exchanged with rank j are token-major: [T local tokens][the views' H/cp heads, view after
// view], so a block received from rank i is rank i's two zigzag chunks of whole rows: putting them
// in stream order is 2 copies per rank, and the Lightning rows [q | k | v] of H/cp heads are
// exactly the kernel's strided layout (qkv_stride 3 * H/cp * Dh), MLA's [Q | K | V] rows cuDNN's
// strided views.
//
// The layers are split by family, each owning its saved activations (its part of a layer's Cache),
// its gradient scratch shared by the layers, and its passes: Lightning (cuda_lightning.h), MLA
// (cuda_mla.h), the dense FFN (cuda_dense_ffn.h) and the MoE FFN (cuda_moe_ffn.h). What they share,
// the configuration, stream, allocator, GEMMs, parameters, the batch and CP levels on the device,
// the FP8 helpers and the gradient scratch every family uses, is their context
// (cuda_layer_context.h), the base of CudaModel::Impl; the layer's own activations (its norms'
// outputs and the residual sum) are LayerActs. Impl keeps what is the whole model's: parameters and
// optimizer, batch upload, the layer loop with recompute and offload, the LM head and loss, memory.
//
// Memory: every buffer comes from one caching allocator (kernels/cuda/allocator.h) through DevBuf.
// Each layer that keeps its activations has a Cache of its own; the layers that recompute share
// one, and every layer's backward shares the gradient scratch (the context's Work and the
// families'). In the shared Cache and in the scratch the buffers only one attention family uses
// (CudaLightning's and CudaMla's CacheFields and WorkFields) are views of one KindArena, holding
// one family's at a time.
//
// This file: setup, the parameters, gradients and optimizer on the device, memory, the attention
// families' shared buffers, the tuning knobs and the CP entry points; the passes are in
// cuda_model_run.cc, one layer in cuda_model_layers.cc, the CP checks in cuda_model_cp.cc (their
// internals: cuda_model_impl.h).
#include "worker/engine/comm/staged_communicator.h"
#include "worker/engine/cuda/cuda_model_impl.h"

namespace spindle {

// ---- Setup -------------------------------------------------------------------------------------

CudaModel::CudaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaModel::~CudaModel() = default;

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::Create(const ModelConfig& config,
                                                             uint64_t seed, int device,
                                                             int64_t ep, int64_t ep_rank) {
  RETURN_IF_ERROR(config.Validate());
  if (const std::string shape = CudaShapeProblem(config); !shape.empty())
    return absl::InvalidArgumentError(
        absl::StrCat("cuda model: the CUDA kernels cannot run ", shape));
  auto impl = std::make_unique<Impl>();
  impl->c = config;
  impl->device = device;
  cudaDeviceProp prop;
  CUDA(cudaGetDeviceProperties(&prop, device));
  if (const std::string problem =
          kc::DeviceSupportProblem(device, prop.name, prop.major, prop.minor);
      !problem.empty())
    return absl::FailedPreconditionError(absl::StrCat("cuda model: ", problem));
  int clock_khz = 0;
  CUDA(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  impl->peak_flops = kc::DenseBf16PeakFlops(prop.name, prop.multiProcessorCount, clock_khz);
  // The host copy: weights for checkpoints and evaluation; its gradient buffer only if a host
  // all-reduce asks for it (DownloadGrads).
  ASSIGN_OR_RETURN(impl->host, Model::Create(config, seed, /*host_grads=*/false, ep, ep_rank));
  CUDA(cudaSetDevice(device));
  CUDA(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));
  KC(kc::Blas::Create(&impl->blas));
  if (config.NumLayersOfKind('M') > 0) KC(kc::Sdpa::Create(&impl->mla.sdpa));
  ParamSet& P = impl->P();
  const int64_t n = P.numel(), H = config.n_heads;
  // The optimizer state (m, v) comes with the first optimizer step or state upload: AdamW needs
  // both, SGD with momentum m only, plain SGD neither.
  for (float** b : {&impl->p, &impl->g}) CUDA(cudaMalloc(b, n * 4));
  CUDA(cudaMalloc(&impl->scalar, 2 * sizeof(double)));
  CUDA(cudaMallocHost(&impl->loss_host, sizeof(double)));
  CUDA(cudaMalloc(&impl->log_decays, std::max<int64_t>(1, config.n_layers * H) * 4));
  impl->fixed_bytes = n * 8;
  CUDA(cudaMemsetAsync(impl->g, 0, n * 4, impl->stream));
  RETURN_IF_ERROR(impl->LayOutWorkingCopy({}));

  auto idx = [&](const std::string& name) { return P.Find(name); };
  impl->embed = idx("embed.weight");
  impl->final_norm = idx("final_norm.weight");
  impl->lm_head = idx("lm_head.weight");
  for (int64_t i = 0; i < config.n_layers; ++i) {
    const std::string p = absl::StrCat("layers.", i, ".");
    LayerIdx L;
    L.kind = config.LayerKind(i);
    L.attn_norm = idx(p + "attn_norm.weight");
    L.ffn_norm = idx(p + "ffn_norm.weight");
    L.w1 = idx(p + "ffn.w1.weight");
    L.w2 = idx(p + "ffn.w2.weight");
    L.w3 = idx(p + "ffn.w3.weight");
    L.index = static_cast<int>(i);
    if (config.IsMoeLayer(i)) {
      L.moe = true;
      MoeLayerParams& m = L.moe_p;
      m.router = idx(p + "moe.router.weight");
      m.bias = idx(p + "moe.router.bias");
      m.w1 = idx(p + "moe.experts.w1.weight");
      m.w2 = idx(p + "moe.experts.w2.weight");
      m.w3 = idx(p + "moe.experts.w3.weight");
      m.s1 = idx(p + "moe.shared.w1.weight");
      m.s2 = idx(p + "moe.shared.w2.weight");
      m.s3 = idx(p + "moe.shared.w3.weight");
    }
    if (L.kind == 'L') {
      L.qkv = idx(p + "la.qkv.weight");
      L.gate = idx(p + "la.gate.weight");
      L.out = idx(p + "la.out.weight");
      L.q_norm = idx(p + "la.q_norm.weight");
      L.k_norm = idx(p + "la.k_norm.weight");
      L.out_norm = idx(p + "la.out_norm.weight");
      const std::vector<float> ld = LightningLogDecays(config, i);
      L.log_decay = impl->log_decays + i * H;
      CUDA(cudaMemcpy(L.log_decay, ld.data(), H * 4, cudaMemcpyHostToDevice));
    } else {
      L.q = idx(p + "mla.q.weight");
      L.q_a = idx(p + "mla.q_a.weight");
      L.q_a_norm = idx(p + "mla.q_a_norm.weight");
      L.q_b = idx(p + "mla.q_b.weight");
      L.kv_a = idx(p + "mla.kv_a.weight");
      L.kv_norm = idx(p + "mla.kv_norm.weight");
      L.kv_b = idx(p + "mla.kv_b.weight");
      L.mo = idx(p + "mla.out.weight");
    }
    impl->layers.push_back(L);
  }
  std::unique_ptr<CudaModel> model(new CudaModel(std::move(impl)));
  RETURN_IF_ERROR(model->UploadParams());
  return model;
}

const ModelConfig& CudaModel::config() const { return impl_->c; }
ParamSet& CudaModel::host_params() { return impl_->P(); }
cudaStream_t CudaModel::stream() const { return impl_->stream; }
float* CudaModel::device_params() { return impl_->p; }
float* CudaModel::device_grads() { return impl_->g; }
int64_t CudaModel::steps_taken() const { return impl_->steps; }

// Copies flat fp32 buffers (numel() floats each) between host and device in order on the stream,
// then waits for them (and for everything enqueued before).
absl::Status CudaModel::Impl::CopyFlat(std::initializer_list<std::pair<float*, const float*>> copies,
                                       cudaMemcpyKind kind) {
  for (const auto& [dst, src] : copies)
    if (dst != nullptr && src != nullptr)
      CUDA(cudaMemcpyAsync(dst, src, P().numel() * 4, kind, stream));
  CUDA(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

absl::Status CudaModel::UploadParams() {
  Impl& I = *impl_;
  RETURN_IF_ERROR(I.CopyFlat({{I.p, I.P().flat_data().f32()}}, cudaMemcpyHostToDevice));
  RETURN_IF_ERROR(I.FillWorkingCopy());
  RETURN_IF_ERROR(I.CastFp8Weights());
  CUDA(cudaStreamSynchronize(I.stream));
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::LayOutWorkingCopy(const std::vector<int>& none) {
  w_at.assign(static_cast<size_t>(P().size()), 0);
  for (int i : none) w_at[i] = -1;
  int64_t n = 0;
  for (int i = 0; i < P().size(); ++i) {
    if (w_at[i] < 0) continue;
    w_at[i] = n;
    n += (P().info(i).numel + 63) / 64 * 64;
  }
  CUDA(cudaStreamSynchronize(stream));  // the old copy may still be read
  if (w) cudaFree(w);
  w = nullptr;
  fixed_bytes -= w_numel * kAb;
  CUDA(cudaMalloc(&w, std::max<int64_t>(n, 1) * kAb));
  w_numel = n;
  fixed_bytes += n * kAb;
  return FillWorkingCopy();
}

absl::Status CudaModel::Impl::FillWorkingCopy() {
  for (int i = 0; i < P().size(); ++i)
    if (w_at[i] >= 0)
      KC(kc::ConvertFromFloat(p + P().info(i).offset, At(w, w_at[i]), P().info(i).numel, kAct,
                              stream));
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::CastFp8Weights() {
  if (!fp8) return absl::OkStatus();
  if (fp8_blockwise) {  // 128 x 128 blocks, both layouts (each expert's matrix on its own)
    std::vector<kc::Fp8BlockWeightCast> b;
    for (int i = 0; i < P().size(); ++i)
      if (const Fp8Block& q = fp8_w[i]; q.base != nullptr)
        b.push_back({p + P().info(i).offset, q.rows, q.cols, KDType::kFp8E4M3, q.codes(),
                     q.scales, q.codes_t(), q.scales_t});
    for (int i = 0; i < static_cast<int>(fp8_e.size()); ++i)
      if (fp8_e[i].base != nullptr) fp8_e[i].AddBlockCasts(p + P().info(i).offset, &b);
    KC(kc::Fp8CastWeightsBlockwise(b.data(), static_cast<int64_t>(b.size()), stream));
    return absl::OkStatus();
  }
  std::vector<kc::Fp8WeightCast> t;
  for (int i = 0; i < P().size(); ++i)
    if (const Fp8Block& q = fp8_w[i]; q.base != nullptr)
      t.push_back({p + P().info(i).offset, q.rows, q.cols, q.Output()});
  for (int i = 0; i < static_cast<int>(fp8_e.size()); ++i)
    if (fp8_e[i].base != nullptr) fp8_e[i].AddCasts(p + P().info(i).offset, &t);
  KC(kc::Fp8CastWeights(t.data(), static_cast<int64_t>(t.size()), stream));
  return absl::OkStatus();
}

void CudaModel::SetZLoss(float z_loss) { impl_->z_loss = z_loss; }

absl::Status CudaModel::SetPrecision(TrainPrecision precision, TrainFp8Recipe recipe) {
  Impl& I = *impl_;
  if (precision == TrainPrecision::kFp32)
    return absl::InvalidArgumentError(
        "cuda model: train.precision \"fp32\" runs on the CPU only (a GPU job: auto, bf16 or fp8)");
  const bool want = precision == TrainPrecision::kFp8;
  const bool blockwise = want && recipe == TrainFp8Recipe::kBlockwise;
  if (want == I.fp8 && blockwise == I.fp8_blockwise) return absl::OkStatus();
  if (want && I.fp8) RETURN_IF_ERROR(SetPrecision(TrainPrecision::kBf16));  // another recipe
  if (!want) {
    CUDA(cudaStreamSynchronize(I.stream));
    if (I.fp8_w_mem) cudaFree(I.fp8_w_mem);
    I.fixed_bytes -= I.fp8_fixed_bytes;
    I.fp8_w_mem = nullptr, I.fp8_fixed_bytes = 0, I.fp8 = false, I.fp8_blockwise = false;
    I.fp8_w.clear();
    I.fp8_e.clear();
    return I.LayOutWorkingCopy({});
  }
  ParamSet& P = I.P();
  if (const std::string shape = CudaFp8ShapeProblem(I.c); !shape.empty())
    return absl::InvalidArgumentError(
        absl::StrCat("cuda model: train.precision \"fp8\": ", shape));
  std::vector<int> linear = I.host->Fp8LinearWeights();
  // The MoE layers' experts [El, out, in]: one scale per expert (Fp8ExpertBlock), or blockwise
  // each expert's 128 x 128 block scales of both layouts after the codes.
  std::vector<int> experts;
  for (const LayerIdx& L : I.layers)
    if (L.moe)
      for (int i : {L.moe_p.w1, L.moe_p.w2, L.moe_p.w3})
        if (i >= 0) experts.push_back(i);
  auto expert_count = [&](int i) { return P.info(i).numel / (P.info(i).shape[1] * P.info(i).shape[2]); };
  // Blockwise: each weight's 128 x 128 block scales of both layouts after its codes.
  auto weight_bytes = [&](int i) {
    const ParamInfo& info = P.info(i);
    const int64_t rows = info.shape[0], cols = info.numel / rows;
    return Fp8Block::Bytes(info.numel) + (blockwise ? Fp8Block::SquareScaleBytes(rows, cols) : 0);
  };
  int64_t bytes = 0;
  for (int i : linear) bytes += weight_bytes(i);
  auto expert_block = [&](int i, void* at) {
    const ParamInfo& info = P.info(i);
    return Fp8ExpertBlock{at, expert_count(i), info.shape[1], info.shape[2], blockwise};
  };
  auto expert_bytes = [&](int i) {
    const Fp8ExpertBlock e = expert_block(i, nullptr);
    return Fp8ExpertBlock::Bytes(e.experts, P.info(i).numel) +
           (blockwise ? e.BlockScaleBytes() : 0);
  };
  for (int i : experts) bytes += expert_bytes(i);
  CUDA(cudaMalloc(&I.fp8_w_mem, bytes));
  I.fp8_w.assign(static_cast<size_t>(P.size()), Fp8Block{});
  I.fp8_e.assign(static_cast<size_t>(P.size()), Fp8ExpertBlock{});
  auto* at = static_cast<uint8_t*>(I.fp8_w_mem);
  for (int i : linear) {
    const ParamInfo& info = P.info(i);
    Fp8Block& q = I.fp8_w[i];
    q = {at, info.shape[0], info.numel / info.shape[0], KDType::kFp8E4M3};
    if (blockwise) q.SetScales(at + Fp8Block::Bytes(info.numel), /*weight=*/true);
    at += weight_bytes(i);
  }
  for (int i : experts) {
    I.fp8_e[i] = expert_block(i, at);
    at += expert_bytes(i);
  }
  I.fp8_fixed_bytes = bytes;
  I.fixed_bytes += bytes;
  I.fp8 = true;
  I.fp8_blockwise = blockwise;
  linear.insert(linear.end(), experts.begin(), experts.end());  // no bf16 copies of these
  RETURN_IF_ERROR(I.LayOutWorkingCopy(linear));
  RETURN_IF_ERROR(I.CastFp8Weights());
  CUDA(cudaStreamSynchronize(I.stream));
  return absl::OkStatus();
}

absl::Status CudaModel::DownloadParams() {
  Impl& I = *impl_;
  return I.CopyFlat({{I.P().flat_data().f32(), I.p}}, cudaMemcpyDeviceToHost);
}

absl::Status CudaModel::DownloadGrads() {
  Impl& I = *impl_;
  return I.CopyFlat({{I.P().flat_grad().f32(), I.g}}, cudaMemcpyDeviceToHost);
}

absl::Status CudaModel::UploadGrads() {
  Impl& I = *impl_;
  return I.CopyFlat({{I.g, I.P().flat_grad().f32()}}, cudaMemcpyHostToDevice);
}

absl::Status CudaModel::Impl::EnsureOptimizerState(bool want_m, bool want_v) {
  const int64_t n = P().numel();
  for (auto [buf, want] : {std::pair{&m, want_m}, {&v, want_v}}) {
    if (!want || *buf != nullptr) continue;
    CUDA(cudaMalloc(buf, n * 4));
    CUDA(cudaMemsetAsync(*buf, 0, n * 4, stream));
    fixed_bytes += n * 4;
  }
  return absl::OkStatus();
}

absl::Status CudaModel::DownloadOptimizerState(Tensor* m, Tensor* v) {
  Impl& I = *impl_;
  const int64_t n = I.P().numel();
  // State this optimizer does not keep (no device buffer) is left as it is.
  for (auto [host, dev] : {std::pair{m, I.m}, {v, I.v}})
    if (dev != nullptr && host->numel() != n) *host = Tensor({n});
  return I.CopyFlat({{I.m ? m->f32() : nullptr, I.m}, {I.v ? v->f32() : nullptr, I.v}},
                    cudaMemcpyDeviceToHost);
}

absl::Status CudaModel::UploadOptimizerState(const Tensor& m, const Tensor& v,
                                             int64_t steps_taken) {
  Impl& I = *impl_;
  const int64_t n = I.P().numel();
  if ((m.numel() != n && m.numel() != 0) || (v.numel() != n && v.numel() != 0))
    return absl::InvalidArgumentError(absl::StrCat("optimizer state: expected ", n,
                                                   " values per state tensor (or none), got ",
                                                   m.numel(), " and ", v.numel()));
  RETURN_IF_ERROR(I.EnsureOptimizerState(m.numel() != 0, v.numel() != 0));
  RETURN_IF_ERROR(I.CopyFlat({{I.m, m.numel() ? m.f32() : nullptr},
                              {I.v, v.numel() ? v.f32() : nullptr}},
                             cudaMemcpyHostToDevice));
  I.steps = steps_taken;
  return absl::OkStatus();
}

absl::Status CudaModel::ZeroGrads() {
  CUDA(cudaMemsetAsync(impl_->g, 0, impl_->P().numel() * 4, impl_->stream));
  return absl::OkStatus();
}

absl::StatusOr<double> CudaModel::GradSquaredNorm() {
  return GradSquaredNorm(0, impl_->P().numel());
}

absl::StatusOr<double> CudaModel::GradSquaredNorm(int64_t begin, int64_t end) {
  Impl& I = *impl_;
  if (begin < 0 || end < begin || end > I.P().numel())
    return absl::InvalidArgumentError("cuda model: a gradient range outside the flat buffer");
  DevBuf ws;
  RETURN_IF_ERROR(ws.Ensure(&I.alloc, kc::SquaredNormWorkspaceBytes()));
  KC(kc::SquaredNorm(I.g + begin, end - begin, I.scalar,
                     {ws.get(), kc::SquaredNormWorkspaceBytes()}, I.stream));
  double out = 0.0;
  CUDA(cudaMemcpyAsync(&out, I.scalar, sizeof(double), cudaMemcpyDeviceToHost, I.stream));
  CUDA(cudaStreamSynchronize(I.stream));
  return out;
}

absl::Status CudaModel::OptimizerStep(const TrainSpec& spec, double lr, float grad_scale) {
  Impl& I = *impl_;
  ParamSet& P = I.P();
  const bool adamw = spec.optimizer == "adamw";
  if (!adamw && spec.optimizer != "sgd")
    return absl::InvalidArgumentError(
        absl::StrCat("cuda model: unknown optimizer \"", spec.optimizer, "\" (adamw or sgd)"));
  RETURN_IF_ERROR(I.EnsureOptimizerState(adamw || spec.momentum > 0, adamw));
  std::vector<kc::OptimizerTensor> t;
  for (int i = 0; i < P.size(); ++i) {
    const ParamInfo& info = P.info(i);
    const float wd = info.weight_decay ? static_cast<float>(spec.weight_decay) : 0.0f;
    // State the rule does not keep stays null (plain SGD: no m; SGD: no v).
    t.push_back({I.p + info.offset, I.g + info.offset, I.m ? I.m + info.offset : nullptr,
                 I.v ? I.v + info.offset : nullptr, I.w_at[i] >= 0 ? At(I.w, I.w_at[i]) : nullptr,
                 info.numel, wd});
  }
  ++I.steps;
  const auto n_t = static_cast<int64_t>(t.size());
  if (adamw) {
    kc::AdamWHyper hp{static_cast<float>(lr), static_cast<float>(spec.beta1),
                      static_cast<float>(spec.beta2), static_cast<float>(spec.eps), I.steps,
                      grad_scale};
    KC(kc::AdamWMultiTensor(t.data(), n_t, hp, I.stream));
  } else {
    kc::SgdHyper hp{static_cast<float>(lr), static_cast<float>(spec.momentum), grad_scale};
    KC(kc::SgdMultiTensor(t.data(), n_t, hp, I.stream));
  }
  return I.CastFp8Weights();
}

DeviceMemory CudaModel::memory() const {
  const kc::AllocatorStats s = impl_->alloc.Stats();
  DeviceMemory m;
  m.allocated = static_cast<int64_t>(s.allocated);
  m.reserved = static_cast<int64_t>(s.reserved);
  m.peak_allocated = static_cast<int64_t>(s.peak_allocated);
  m.fixed = impl_->fixed_bytes;
  if (impl_->mla.sdpa) m.attention_workspace = impl_->mla.sdpa->WorkspaceBytes();
  m.offload_host = impl_->off.host_bytes;
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
    m.device_used = static_cast<int64_t>(total_b - free_b);
  return m;
}

void CudaModel::ResetPeakMemory() { impl_->alloc.ResetPeak(); }

absl::Status CudaModel::ReleaseActivationMemory() {
  CUDA(cudaStreamSynchronize(impl_->stream));
  impl_->ReleaseActivations();
  return FromKernel(impl_->alloc.EmptyCache());
}
double CudaModel::last_enqueue_seconds() const { return impl_->enqueue_seconds; }

double CudaModel::peak_flops() const { return impl_->peak_flops; }
void CudaModel::SetPoisonActivations(bool on) { impl_->alloc.SetPoison(on); }

// ---- One layer kind's buffers at a time --------------------------------------------------------

KindFields CudaModel::Impl::CacheKindFields(Cache& C, char kind) {
  return kind == 'L' ? lightning.CacheFields(C, C.lt) : mla.CacheFields(C, C.mla);
}

KindFields CudaModel::Impl::WorkKindFields(char kind) {
  return kind == 'L' ? lightning.WorkFields() : mla.WorkFields();
}

namespace {
// A buffer's place in a KindArena: its bytes rounded up to 256.
int64_t ArenaBytes(int64_t bytes) { return (bytes + 255) / 256 * 256; }
void ReleaseKinds(const KindFields& lt_fields, const KindFields& mla_fields) {
  for (const KindFields* f : {&lt_fields, &mla_fields})
    for (const auto& [buf, bytes] : *f) buf->Release();
}
}  // namespace

absl::Status CudaModel::Impl::UseKind(KindArena& a, char kind, const KindFields& lt_fields,
                                      const KindFields& mla_fields) {
  auto layout_bytes = [](const KindFields& f) {
    int64_t total = 0;
    for (const auto& [buf, bytes] : f) total += ArenaBytes(bytes);
    return total;
  };
  const int64_t need = std::max(c.NumLayersOfKind('L') > 0 ? layout_bytes(lt_fields) : 0,
                                c.NumLayersOfKind('M') > 0 ? layout_bytes(mla_fields) : 0);
  const KindFields& mine = kind == 'L' ? lt_fields : mla_fields;
  uint64_t key = static_cast<uint64_t>(need);
  for (const auto& [buf, bytes] : mine) key = key * 1000003u + static_cast<uint64_t>(bytes);
  if (a.kind == kind && a.key == key) return absl::OkStatus();
  ReleaseKinds(lt_fields, mla_fields);
  RETURN_IF_ERROR(a.mem.Ensure(&alloc, need));
  int64_t off = 0;
  for (const auto& [buf, bytes] : mine) {
    buf->View(static_cast<char*>(a.mem.get()) + off, bytes);
    off += ArenaBytes(bytes);
  }
  a.kind = kind;
  a.key = key;
  return absl::OkStatus();
}

void CudaModel::Impl::DropArena(KindArena& a, const KindFields& lt_fields,
                                const KindFields& mla_fields) {
  ReleaseKinds(lt_fields, mla_fields);
  a.mem.Release();
  a.kind = 0;
}

namespace {
// Block rows as SetHeadBlockRows and SetFfnBlockRows take them: 0 (`zero`) or a positive multiple
// of 128.
absl::Status CheckBlockRows(const char* what, const char* zero, int64_t rows) {
  if (rows >= 0 && rows % 128 == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " block rows must be 0 (", zero,
                                                 ") or a positive multiple of 128, got ", rows));
}
}  // namespace

absl::Status CudaModel::SetHeadBlockRows(int64_t rows) {
  RETURN_IF_ERROR(CheckBlockRows("LM-head", "automatic", rows));
  impl_->head_block_rows = rows;
  return absl::OkStatus();
}

absl::Status CudaModel::SetFfnBlockRows(int64_t rows) {
  RETURN_IF_ERROR(CheckBlockRows("FFN", "the default", rows));
  impl_->ffn.ffn_block_rows = rows > 0 ? rows : kCudaFfnBlockRows;
  return absl::OkStatus();
}

void CudaModel::SetKindUnion(bool on) {
  Impl& I = *impl_;
  I.kind_union = on;
  if (on) return;
  I.DropArena(I.W.arena, I.WorkKindFields('L'), I.WorkKindFields('M'));
  for (auto& C : I.caches) {
    if (C->kind_union)
      I.DropArena(C->arena, I.CacheKindFields(*C, 'L'), I.CacheKindFields(*C, 'M'));
    C->kind_union = false;
  }
}

absl::Status CudaModel::SetOffloadInputs(bool on) {
  Impl& I = *impl_;
  if (on) {
    RETURN_IF_ERROR(I.off.Create());
  } else {
    CUDA(cudaStreamSynchronize(I.stream));
    I.off.ReleaseSlots();
    I.off.FreeHost();
  }
  I.offload_inputs = on;
  return absl::OkStatus();
}

void CudaModel::SetFp8FastForward(bool on) { impl_->fp8_fast_forward = on; }

absl::Status CudaModel::SetExpertGemm(std::string_view method) {
  kc::GroupedGemmOptions o;
  if (method == "loop") {
    o.method = kc::GroupedGemmMethod::kLoop;
  } else if (method == "persistent") {
    o.method = kc::GroupedGemmMethod::kPersistent;
  } else if (method != "streams") {
    return absl::InvalidArgumentError("cuda model: expert GEMM method \"" + std::string(method) +
                                      "\": expected streams, loop or persistent");
  }
  CUDA(cudaStreamSynchronize(impl_->stream));  // the current GroupedGemm may still be in use
  impl_->expert_gemm = o;
  impl_->moe.ResetGroupedGemm();
  return absl::OkStatus();
}

namespace {
// A head-count override of the tests: >= 0 (0: the engine's rule).
absl::Status SetHeadCount(int64_t heads, const char* what, int64_t* out) {
  if (heads < 0)
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be >= 0 (0: automatic), got ", heads));
  *out = heads;
  return absl::OkStatus();
}
}  // namespace

absl::Status CudaModel::SetAttentionHeadsPerCall(int64_t heads) {
  return SetHeadCount(heads, "attention heads per call", &impl_->mla.attention_heads_per_call);
}

absl::Status CudaModel::SetMlaGradHeadsPerGroup(int64_t heads) {
  return SetHeadCount(heads, "MLA gradient heads per group", &impl_->mla.mla_grad_heads_per_group);
}

absl::Status CudaModel::SetExpertParallel(Communicator* ep) {
  Impl& I = *impl_;
  const int64_t size = ep ? ep->size() : 1;
  RETURN_IF_ERROR(I.host->SetExpertParallel(ep));  // the group's size and this rank's place
  I.moe.ep_staged.reset();
  I.moe.ep = nullptr;
  if (size <= 1) return absl::OkStatus();
  if (ep->backend() == "nccl") {
    I.moe.ep = ep;
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(I.moe.ep_staged, CreateStagedCommunicator(ep, I.device));
  I.moe.ep = I.moe.ep_staged.get();
  return absl::OkStatus();
}

int64_t CudaModel::ExpertGradEnd() const { return impl_->host->ExpertGradEnd(); }

void CudaModel::BeginStep(double tokens) { impl_->moe.BeginStep(tokens); }

absl::StatusOr<nlohmann::json> CudaModel::FinishMoeStep(Communicator* world) {
  Impl& I = *impl_;
  if (I.c.moe.experts == 0) return nlohmann::json::object();
  RETURN_IF_ERROR(I.moe.DrainLseSq());
  // The biases live in the fp32 masters on the device: moved on the host copy, then back.
  const int64_t E = I.c.moe.experts;
  std::vector<std::vector<float>> bias(I.c.n_layers);
  CUDA(cudaStreamSynchronize(I.stream));
  for (const LayerIdx& L : I.layers) {
    if (!L.moe) continue;
    bias[L.index].resize(E);
    CUDA(cudaMemcpy(bias[L.index].data(), I.Master(L.moe_p.bias), E * 4, cudaMemcpyDeviceToHost));
  }
  ASSIGN_OR_RETURN(nlohmann::json fields,
                   BalanceMoeBiases(I.c, I.moe.moe_stats, world,
                                    [&](int64_t i) { return bias[i].data(); }));
  for (const LayerIdx& L : I.layers) {
    if (!L.moe) continue;
    CUDA(cudaMemcpy(I.Master(L.moe_p.bias), bias[L.index].data(), E * 4, cudaMemcpyHostToDevice));
    std::copy(bias[L.index].begin(), bias[L.index].end(), I.P().data(L.moe_p.bias));
  }
  return fields;
}

absl::Status CudaModel::SetCp(const CpContext& cp) {
  Impl& I = *impl_;
  I.cp = cp;
  I.staged.clear();
  // Host communicators (Gloo) take device buffers through pinned staging.
  for (Communicator** c : {&I.cp.comm, &I.cp.ulysses, &I.cp.ring}) {
    if (*c == nullptr || (*c)->backend() == "nccl") continue;
    ASSIGN_OR_RETURN(std::unique_ptr<Communicator> s, CreateStagedCommunicator(*c, I.device));
    *c = s.get();
    I.staged.push_back(std::move(s));
  }
  return I.CheckCpContext();
}

absl::StatusOr<LossStats> CudaModel::ForwardBackward(const CpBatch& batch, float grad_scale,
                                                     Recompute recompute) {
  RETURN_IF_ERROR(impl_->CheckCpBatch(batch));
  return impl_->Run(batch.local, &batch, grad_scale, recompute, /*backward=*/true);
}

absl::StatusOr<LossStats> CudaModel::Forward(const CpBatch& batch) {
  RETURN_IF_ERROR(impl_->CheckCpBatch(batch));
  return impl_->Run(batch.local, &batch, 0.0f, Recompute::All(), /*backward=*/false);
}

}  // namespace spindle
