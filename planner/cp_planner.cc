// CP mode decisions, memory estimate and preflight problems (see cp_planner.h).
#include "planner/cp_planner.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cp_modes.h"
#include "common/size_checks.h"

namespace spindle {
namespace {

std::string ModeWord(CpMode m) { return std::string(CpModeName(m)); }

// What the forced ring modes move, for the reason line.
std::string RingDetail(const JobSpec& spec, CpMode mode) {
  const ParallelSpec& par = spec.parallel;
  std::string s;
  if (mode == CpMode::kHybrid)
    s = absl::StrCat(": Ulysses over groups of ", par.ulysses, " ranks, Ring across the ",
                     spec.parallel.cp / std::max<int64_t>(1, par.ulysses), " groups");
  const MlaConfig& m = spec.model.mla;
  const int64_t heads = MlaRingHeads(spec.model.n_heads, mode, par.ulysses);
  const MlaRingPayload pl = MlaRingPayloadFor(m, heads);
  const MlaRingPayload other =
      pl == MlaRingPayload::kKv ? MlaRingPayload::kLatent : MlaRingPayload::kKv;
  auto what = [](MlaRingPayload p) {
    return p == MlaRingPayload::kKv ? std::string("K and V") : std::string("the latent");
  };
  s += absl::StrCat(s.empty() ? ": " : "; ", "the ring moves ", what(pl), " (",
                    MlaRingPayloadWidth(m, pl, heads), " values a token; ", what(other), ": ",
                    MlaRingPayloadWidth(m, other, heads), ")");
  return s;
}

// The design card's rule ("auto"): All2All when cp <= n_heads and n_heads % cp == 0, else
// AllGather (also at cp = 1, where no mode communicates).
ModeChoice RuleMode(int64_t cp, int64_t heads) {
  if (cp > 1 && All2AllSplits(heads, cp)) return {CpMode::kAll2All, 1};
  return {CpMode::kAllGather, 1};
}

// Decides the mode of one layer type; appends a problem when a forced mode is impossible.
LayerModePlan DecideMode(const JobSpec& spec, const std::string& layer_type, int64_t num_layers,
                         CpMode requested, std::vector<std::string>* problems) {
  const int64_t cp = std::max<int64_t>(1, spec.parallel.cp), heads = spec.model.n_heads;
  LayerModePlan p;
  p.layer_type = layer_type;
  p.num_layers = num_layers;
  const std::string field = absl::StrCat("parallel.", layer_type, "_mode");
  if (requested != CpMode::kAuto && requested != CpMode::kFastest) {
    p.forced = true;
    p.mode = requested;
    if (requested == CpMode::kRing || requested == CpMode::kHybrid) {
      std::string detail;
      if (requested == CpMode::kHybrid && layer_type == "lightning")
        detail = absl::StrCat(": Ulysses over groups of ", spec.parallel.ulysses,
                              " ranks, the chunk states all-gathered across the ",
                              cp / std::max<int64_t>(1, spec.parallel.ulysses), " groups");
      else if (layer_type == "mla")
        detail = RingDetail(spec, requested);
      p.reason =
          absl::StrCat("forced by the spec (", field, " = ", ModeWord(requested), ")", detail);
      if (layer_type == "mla" && cp > 1)
        p.ring_payload = std::string(MlaRingPayloadName(MlaRingPayloadFor(
            spec.model.mla, MlaRingHeads(heads, requested, spec.parallel.ulysses))));
    } else if (absl::Status a2a = CheckAll2All(field, heads, cp);
               requested == CpMode::kAll2All && !a2a.ok()) {
      problems->push_back(std::string(a2a.message()));
      p.reason = absl::StrCat("forced by the spec, but n_heads=", heads, " % cp=", cp, " != 0");
    } else {
      p.reason = absl::StrCat("forced by the spec (", field, " = ", ModeWord(requested), ")");
    }
    return p;
  }
  p.mode = RuleMode(cp, heads).mode;
  if (cp == 1) {
    p.reason = "cp=1: no sequence split, no CP communication";
  } else if (p.mode == CpMode::kAll2All) {
    p.reason = absl::StrCat("default: cp=", cp, " <= n_heads=", heads, " and ", heads, " % ", cp,
                            " == 0");
  } else if (cp > heads) {
    p.reason = absl::StrCat("default: cp=", cp, " > n_heads=", heads, ", all2all impossible");
  } else {
    p.reason = absl::StrCat("default: n_heads=", heads, " is not divisible by cp=", cp, " (",
                            heads, " % ", cp, " = ", heads % cp, ")");
  }
  return p;
}

// Largest cp the memory hint tries.
constexpr int64_t kMaxHintCp = 64;
// The CUDA context, cuBLAS and cuDNN with their plans, on an H200: device memory in use beyond
// the allocator's peak and cuDNN's attention workspace (bench/cuda/NOTES.md, "What the device
// holds besides the allocator").
constexpr int64_t kCudaRuntimeBytes = int64_t{600} << 20;
// NCCL's buffers on the device once every collective of a step has run: the first communicator
// of a rank, and each further one over the same ranks (measured on two H200s over NVLink, cp = 2;
// `bench_cp_cuda --comm_only`, bench/cuda/NOTES.md "NCCL's device memory, and the rest"). A rank of
// a cuda job with world > 1 holds one (the world's, which is also the CP group's when dp = 1), two
// when both dp and cp exceed 1.
constexpr int64_t kNcclFirstCommBytes = int64_t{1331} << 20;  // 1.3 GiB
constexpr int64_t kNcclMoreCommBytes = int64_t{870} << 20;    // 0.85 GiB

// train.precision's copies of a plan (EstimateMemory's "precision" term). R: the recomputing
// layers (the first R); P: this rank's parameters; moe_rows: the expert rows a token brings a rank
// at the worst load (0 for a dense model).
int64_t PrecisionBytes(const JobSpec& spec, bool mla_allgather, int64_t T, int64_t R, int64_t P,
                       int64_t moe_rows) {
  const TrainPrecision p = spec.train.precision;
  const bool cuda = spec.resources == "cuda";
  if (p == TrainPrecision::kAuto || p == TrainPrecision::kFp32) return 0;
  if (cuda && p == TrainPrecision::kBf16) return 0;  // the engine's own storage
  const ModelConfig& m = spec.model;
  if (!cuda && p == TrainPrecision::kBf16) return 4 * P;
  const int64_t d = m.d_model, H = m.n_heads, f = m.ffn_dim, fe = m.moe.expert_ffn;
  const int64_t ep = std::max<int64_t>(1, spec.parallel.ep);
  const MlaConfig& a = m.mla;
  const int64_t qk = a.qk_nope_dim + a.qk_rope_dim;
  // Per token, each layer's activation inputs to its FP8 GEMMs, without its FFN's: Lightning's
  // normed input and gated output, MLA's normed input, q_a's and kv_a's outputs and its attention
  // output; and the FFN's: the dense FFN's normed input and SwiGLU output, or the MoE experts'
  // rows and their SwiGLU output.
  const int64_t attn_l = 2 * d;
  const int64_t attn_m = d + a.q_lora_rank + (mla_allgather ? 0 : a.kv_lora_rank) + H * a.v_head_dim;
  const int64_t ffn_dense = d + f, ffn_moe = moe_rows * (d + fe);
  // The kept layers' inputs, and the largest recomputing layer's (one at a time); the CUDA engine
  // counts the MoE experts' FFN apart (below), the CPU emulation like the dense FFN's.
  int64_t inputs = 0, recomputing = 0, moe_kept = 0;
  for (int64_t i = 0; i < m.n_layers; ++i) {
    const bool moe = m.IsMoeLayer(i);
    const int64_t n = (m.LayerKind(i) == 'M' ? attn_m : attn_l) +
                      (moe ? (cuda ? 0 : ffn_moe) : ffn_dense);
    if (i < R) {
      recomputing = std::max(recomputing, n);
    } else {
      inputs += n;
      moe_kept += moe ? 1 : 0;
    }
  }
  inputs += recomputing;
  // The widest output gradient a projection quantizes.
  const int64_t widest = std::max(
      {3 * d, f, H * qk, H * (a.qk_nope_dim + a.v_head_dim), a.kv_lora_rank + a.qk_rope_dim});
  // The MoE experts' output gradients (the combine's and SwiGLU's two): the shared scratch.
  const int64_t moe_grads = m.NumMoeLayers() > 0 ? moe_rows * (d + 2 * fe) : 0;
  if (cuda) {
    // The weights' codes in both layouts (2 L) replace their bf16 working copies (2 L), and so do
    // the experts' (Fp8ExpertBlock). The kept inputs' transposed codes (their row-major codes
    // live in one scratch of the widest input, read only by the forward's GEMMs), both layouts of
    // one output gradient and of the experts' output gradients; less the bf16 buffers no kernel
    // writes under FP8 in a kept layer: Lightning's h, y, h2 and a, MLA's h2 and a (a MoE
    // layer's h2 stays bf16). The experts' rows and SwiGLU output are codes in both layouts in
    // place of their bf16 copies, but under ep > 1 the received bf16 rows stay beside theirs.
    const int64_t widest_in = std::max({d, f, H * a.v_head_dim});
    int64_t unwritten = 0;
    for (int64_t i = R; i < m.n_layers; ++i)
      unwritten += (m.LayerKind(i) == 'L' ? 3 * d : d) + (m.IsMoeLayer(i) ? 0 : f);
    const int64_t moe_inputs = ep > 1 ? 2 * moe_rows * d * moe_kept : 0;
    // Blockwise: a 4-byte scale per 128 values of each layout of every activation and output
    // gradient kept above (both layouts' scales of each kept input, whose row-major codes share
    // the scratch, and of the one output gradient: 8 / 128 bytes a value), the weights' 128 x 128
    // block scales (both layouts, a row of blocks padded to 4, as the engine lays them out), and
    // the bf16 [T, d] output of the norms whose only reader is an FP8 GEMM (their statistics feed
    // the quantizer, Work::norm_y). MoE layers (cuda/cuda_moe_ffn.cc, kernels/cuda/moe.h's grouped
    // layout): each local expert's 128 x 128 block scales of w1, w2 and w3 in both layouts; the
    // scales of the experts' rows and SwiGLU output of every MoE layer holding them (the kept
    // ones, and the one recomputing at a time) and of the three output gradients (the scratch):
    // 4 bytes per 1 x 128 row block, and per 128-token column block, the column blocks restarting
    // at each (expert, source rank) segment (at most rows / 128 + segments of them).
    int64_t blockwise = 0;
    if (spec.train.fp8_recipe == TrainFp8Recipe::kBlockwise) {
      auto blocks = [](int64_t n) { return (n + 127) / 128; };
      auto padded = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
      auto square = [&](int64_t rows, int64_t cols) {  // kBlock128 floats of [rows, cols]
        return blocks(rows) * ((blocks(cols) + 3) / 4 * 4);
      };
      for (const LinearWeight& w : Fp8LinearWeights(m))
        blockwise += padded(4 * square(w.out, w.in)) + padded(4 * square(w.in, w.out));
      blockwise += (T * inputs + T * widest) / 16 + 2 * T * d;
      if (m.NumMoeLayers() > 0) {
        const int64_t local = m.moe.experts / ep, rows = T * moe_rows, segments = local * ep;
        auto rows_scales = [&](int64_t cols) {
          return 4 * rows * blocks(cols) + 4 * cols * (blocks(rows) + segments);
        };
        blockwise += m.NumMoeLayers() * 3 *
                     (padded(4 * local * square(fe, d)) + padded(4 * local * square(d, fe)));
        int64_t moe_recomputing = 0;  // 1 if a recomputing layer is a MoE layer
        for (int64_t i = 0; i < std::min(R, m.n_layers); ++i)
          moe_recomputing = std::max<int64_t>(moe_recomputing, m.IsMoeLayer(i) ? 1 : 0);
        blockwise += (moe_kept + moe_recomputing) * (rows_scales(d) + rows_scales(fe)) +
                     rows_scales(d) + 2 * rows_scales(fe);
      }
    }
    return T * inputs + T * widest_in + 2 * T * widest + 2 * T * moe_grads +
           T * moe_inputs - 2 * T * unwritten + blockwise;
  }
  // The CPU emulation holds fp32 values: a bf16-rounded working copy and an FP8-rounded copy of
  // every parameter, the quantized inputs, and the output gradients' (the widest twice, Lightning's
  // joint q | k | v, the experts'); the blockwise recipe keeps a second copy of each activation and
  // gradient in column blocks for the weight gradients.
  const int64_t copies = spec.train.fp8_recipe == TrainFp8Recipe::kBlockwise ? 2 : 1;
  return 8 * P + copies * 4 * T * (inputs + 2 * widest + 3 * d + moe_grads);
}

// The smallest power of two >= n (n >= 1).
int64_t NextPow2(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}
// cuDNN pads full-attention plans to powers of two; a key block already is one.
static_assert((kCudaMlaKeyBlock & (kCudaMlaKeyBlock - 1)) == 0);

// The fewest leading layers, from `from` up to every layer, to recompute for the estimate to fit
// in `budget` bytes; -1 when none does.
int64_t FewestRecomputeLayersFitting(const JobSpec& spec, const std::vector<LayerModePlan>& layers,
                                     int64_t from, double budget) {
  for (int64_t r = from; r <= spec.model.n_layers; ++r)
    if (static_cast<double>(EstimateMemory(spec, layers, r).total_bytes) <= budget) return r;
  return -1;
}

// The longest seq_len, a multiple of 2 cp x 1024 tokens, whose estimate with every layer
// recomputing fits `device_memory_bytes` (the estimate grows with seq_len); 0 when the shortest
// does not.
int64_t LongestSeqLenFitting(const JobSpec& spec, const std::vector<LayerModePlan>& layers,
                             int64_t device_memory_bytes) {
  const int64_t step = 2 * std::max<int64_t>(1, spec.parallel.cp) * 1024;
  constexpr int64_t kMaxSteps = int64_t{1} << 22;
  JobSpec s = spec;
  auto fits = [&](int64_t steps) {
    s.seq_len = steps * step;
    return EstimateMemory(s, layers, s.model.n_layers).total_bytes <= device_memory_bytes;
  };
  if (!fits(1)) return 0;
  if (fits(kMaxSteps)) return kMaxSteps * step;
  int64_t lo = 1, hi = kMaxSteps;
  while (hi - lo > 1) {  // fits(lo), not fits(hi)
    const int64_t mid = lo + (hi - lo) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo * step;
}

// What would make a plan that does not fit its device fit, as a suffix for its memory problem:
// recomputing more leading layers (the fewest that fit), else (cuda) offloading the layer inputs
// with the fewest recomputed layers that then fit, else a larger cp with every layer
// recomputing (the smallest up to kMaxHintCp that plans without problems and fits, in the spec's
// CP modes or, where the spec leaves both to the planner, with both layer types in AllGather mode,
// which holds less), else what every layer recomputing would still need.
std::string MemoryHint(const CpPlanner& planner, const JobSpec& spec, const CpPlan& plan,
                       int64_t device_memory_bytes) {
  const int64_t n = spec.model.n_layers;
  if (const int64_t r =
          FewestRecomputeLayersFitting(spec, plan.layers, plan.memory.recompute_layers + 1,
                                       static_cast<double>(device_memory_bytes));
      r >= 0) {
    const int64_t bytes = EstimateMemory(spec, plan.layers, r).total_bytes;
    if (r == n)
      return absl::StrCat("; with every layer recomputing it fits (", FormatBytes(bytes),
                          "): train.recompute = true or \"auto\"");
    return absl::StrCat("; recomputing the first ", r, " of ", n, " layers fits (",
                        FormatBytes(bytes), "): train.recompute = ", r, " or \"auto\"");
  }
  if (spec.resources == "cuda" && !spec.train.offload) {
    JobSpec o = spec;
    o.train.offload = true;
    if (const int64_t r = FewestRecomputeLayersFitting(o, plan.layers, 0,
                                                       static_cast<double>(device_memory_bytes));
        r >= 0) {
      const MemoryEstimate e = EstimateMemory(o, plan.layers, r);
      std::string with = "train.offload = true";
      if (r == n) {
        with += " and every layer recomputing";
      } else if (r > 0) {
        absl::StrAppend(&with, " and the first ", r, " of ", n, " layers recomputing");
      }
      return absl::StrCat("; with ", with, " it fits (", FormatBytes(e.total_bytes), ", and ",
                          FormatBytes(e.host_bytes), " of pinned host memory)");
    }
  }
  JobSpec s = spec;
  s.train.recompute_layers = n;
  const bool modes_free =
      spec.parallel.lightning_mode == CpMode::kAuto && spec.parallel.mla_mode == CpMode::kAuto;
  for (int64_t cp = std::max<int64_t>(1, spec.parallel.cp) + 1; cp <= kMaxHintCp; ++cp) {
    s.parallel.cp = cp;
    for (const bool allgather : {false, true}) {
      if (allgather && !modes_free) continue;
      s.parallel.lightning_mode = allgather ? CpMode::kAllGather : spec.parallel.lightning_mode;
      s.parallel.mla_mode = allgather ? CpMode::kAllGather : spec.parallel.mla_mode;
      const CpPlan p = planner.Plan(s, 0);
      if (!p.problems.empty() || p.memory.total_bytes > device_memory_bytes) continue;
      return absl::StrCat(
          "; parallel.cp = ", cp,
          allgather ? " with parallel.lightning_mode = parallel.mla_mode = \"allgather\" and"
                    : " with",
          " every layer recomputing fits (", FormatBytes(p.memory.total_bytes), " per rank)");
    }
  }
  return absl::StrCat("; with every layer recomputing it still needs ",
                      FormatBytes(EstimateMemory(spec, plan.layers, n).total_bytes), " per rank");
}

}  // namespace

CpMode CpPlan::ModeOf(const std::string& layer_type) const {
  for (const LayerModePlan& l : layers)
    if (l.layer_type == layer_type) return l.mode;
  return CpMode::kAllGather;
}

JobSpec PlannedSpec(const JobSpec& spec, const CpPlan& plan) {
  JobSpec run = spec;
  run.parallel.lightning_mode = plan.ModeOf("lightning");
  run.parallel.mla_mode = plan.ModeOf("mla");
  run.parallel.ulysses = plan.ulysses;
  if (spec.model.moe.experts > 0) run.parallel.ep = plan.ep;
  run.train.recompute_layers = plan.memory.recompute_layers;
  return run;
}

bool IsPlanned(const JobSpec& spec) {
  auto decided = [&](CpMode m) {
    return m != CpMode::kFastest && (m != CpMode::kAuto || spec.parallel.cp == 1);
  };
  return decided(spec.parallel.lightning_mode) && decided(spec.parallel.mla_mode) &&
         spec.train.recompute_layers != TrainSpec::kRecomputeAuto &&
         (spec.model.moe.experts == 0 || spec.parallel.ep > 0);
}

MemoryEstimate EstimateMemory(const JobSpec& spec, const std::vector<LayerModePlan>& layers,
                              int64_t recompute_layers) {
  const ModelConfig& m = spec.model;
  const int64_t cp = std::max<int64_t>(1, spec.parallel.cp);
  const int64_t ep = std::max<int64_t>(1, spec.parallel.ep);
  // This rank's parameters: its 1 / ep of the experts.
  const int64_t expert_params = m.NumMoeLayers() * m.moe.experts * 3 * m.d_model * m.moe.expert_ffn;
  const int64_t P = m.NumParams() - expert_params + expert_params / ep;
  const int64_t T = std::max<int64_t>(1, spec.seq_len / cp);
  const int64_t B = spec.resources == "cuda" ? 2 : 4;
  const int64_t d = m.d_model, H = m.n_heads, f = m.ffn_dim, Dh = m.head_dim();
  const MlaConfig& a = m.mla;
  const int64_t qk = a.qk_nope_dim + a.qk_rope_dim;  // one MLA head's query / key width
  // One zigzag chunk's tokens (each rank holds two).
  const int64_t chunk = std::max<int64_t>(1, spec.seq_len / (2 * cp));

  MemoryEstimate e;
  const int64_t R = std::clamp<int64_t>(recompute_layers, 0, m.n_layers);
  e.recompute_layers = R;
  // fp32 master weights; the CUDA engine also keeps a bf16 working copy.
  e.params_bytes = (spec.resources == "cuda" ? 6 : 4) * P;
  e.grads_bytes = 4 * P;
  if (spec.train.optimizer == "adamw") {
    e.optimizer_bytes = 8 * P;
  } else if (spec.train.momentum != 0.0) {
    e.optimizer_bytes = 4 * P;
  }

  bool mla_allgather = false, lightning_allgather = false;
  CpMode mla_mode = CpMode::kAllGather, lightning_mode = CpMode::kAllGather;
  for (const LayerModePlan& l : layers) {
    if (l.layer_type == "mla") mla_allgather = l.mode == CpMode::kAllGather && cp > 1;
    if (l.layer_type == "lightning") lightning_allgather = l.mode == CpMode::kAllGather && cp > 1;
    if (l.layer_type == "mla" && cp > 1) mla_mode = l.mode;
    if (l.layer_type == "lightning" && cp > 1) lightning_mode = l.mode;
  }
  // Ulysses groups of the hybrid modes (u = 1 otherwise, where nothing below applies).
  const int64_t u = std::clamp<int64_t>(spec.parallel.ulysses, 1, cp);
  const bool mla_ring = mla_mode == CpMode::kRing || mla_mode == CpMode::kHybrid;
  const int64_t mla_u = mla_mode == CpMode::kHybrid ? u : 1;
  const int64_t mla_heads = H / mla_u;
  const int64_t ring_w =
      mla_ring ? MlaRingPayloadWidth(a, MlaRingPayloadFor(a, mla_heads), mla_heads) : 0;
  const int64_t common = 4 * d + 3 * f;
  int64_t per_l = common + 9 * d;
  int64_t per_m = common + H * qk * 2 + (a.kv_lora_rank + a.qk_rope_dim) * 2 +
                  H * (a.qk_nope_dim + a.v_head_dim) + H * a.v_head_dim + 2 * H;
  if (mla_allgather) per_m += cp * (a.kv_lora_rank + a.qk_rope_dim);
  if (mla_mode == CpMode::kRing) per_m += ring_w;
  if (mla_mode == CpMode::kHybrid) per_m += H * (qk + a.v_head_dim + 1) + u * ring_w;
  const bool cuda = spec.resources == "cuda";
  // The hybrid Lightning layers keep the group's q, k, v (the CUDA engine counts them as
  // All2All's, below).
  if (lightning_mode == CpMode::kHybrid && !cuda) per_l += 3 * d;
  const bool cuda_mla_allgather = mla_allgather && cuda;
  // The CUDA engine's MLA Ring and hybrid keep only their level's block (bf16; hybrid: the Ulysses
  // group's) and rebuild keys per key block from a latent block as AllGather does; a hybrid layer
  // passing keys and values keeps the group's latent rows beside them (its backward's kv_b input).
  const bool cuda_mla_ring = cuda && cp > 1 && mla_ring;
  if (cuda_mla_ring && mla_mode == CpMode::kHybrid &&
      MlaRingPayloadFor(a, mla_heads) == MlaRingPayload::kKv)
    per_m += u * (a.kv_lora_rank + a.qk_rope_dim);
  // CUDA All2All (cp > 1): each layer keeps its core's head-split inputs over the whole sequence
  // (T_full x width / cp = T x width: Lightning q|k|v; MLA Q|K|V and its output).
  const int64_t mla_core_in = H * (2 * qk + a.v_head_dim);
  const bool cuda_cp = cuda && cp > 1;
  const bool l_all2all = cuda_cp && !lightning_allgather;
  const bool m_all2all = cuda_cp && mla_mode == CpMode::kAll2All;
  const bool m_hybrid = cuda_cp && mla_mode == CpMode::kHybrid;
  if (l_all2all) per_l += 3 * d;
  if (m_all2all) per_m += mla_core_in + H * a.v_head_dim;
  // The CUDA engine runs the FFN of a recomputed layer, and every FFN backward, in blocks of
  // kCudaFfnBlockRows tokens: those [T, 3 ffn_dim] activations and gradients follow the block.
  const int64_t ffn_rows = cuda ? std::min<int64_t>(T, kCudaFfnBlockRows) : T;
  const int64_t nl = m.NumLayersOfKind('L'), nm = m.NumLayersOfKind('M');
  // The recomputed layers (the first R) by kind; the others keep their whole cache.
  int64_t rl = 0, rm = 0;
  for (int64_t i = 0; i < R; ++i) (m.LayerKind(i) == 'M' ? rm : rl) += 1;
  int64_t per_token = 4 * d + (nl - rl) * per_l + (nm - rm) * per_m;
  // MoE layers: their FFN's activations in place of the dense FFN's 3 f (elements of B bytes a
  // token), at the worst load the router allows.
  const MoeConfig& moe = m.moe;
  int64_t moe_rows = 0, moe_delta = 0;  // rows a token brings a rank; elements a token over 3 f
  if (moe.experts > 0) {
    moe_rows = ep > 1 ? ep * std::min(moe.top_k, moe.experts / ep) : moe.top_k;
    moe_delta = (4 * (moe.experts + 2 * moe.top_k + 1) + B - 1) / B + 3 * moe.shared_ffn +
                moe_rows * (2 * d + 3 * moe.expert_ffn) + (ep > 1 ? moe.top_k * d : 0) - 3 * f;
    int64_t kept_moe = 0, recomputed_moe = 0;
    for (int64_t i = 0; i < m.n_layers; ++i)
      if (m.IsMoeLayer(i)) (i < R ? recomputed_moe : kept_moe) += 1;
    per_token += kept_moe * moe_delta + (recomputed_moe > 0 ? std::max<int64_t>(0, moe_delta) : 0);
  }
  int64_t ffn_block_bytes = 0;
  if (R > 0) {
    // One cache, refilled layer by layer, holds the recomputed kinds' buffers: the CUDA engine
    // keeps one kind's at a time in memory both use (its KindArena), the CPU engine both kinds'.
    int64_t layer = 0;
    if (rl > 0) layer = per_l;
    if (rm > 0) layer = rl == 0 ? per_m : cuda ? std::max(per_l, per_m) : layer + per_m - common;
    per_token += R * d + layer - 3 * f;
    ffn_block_bytes = ffn_rows * B * 3 * f;
    // The CUDA engine: each recomputed MLA layer keeps its attention output and statistics (and
    // under All2All its head-split output) for the backward, so the recompute skips the attention,
    // and its norms' statistics (two fp32 a token); under FP8 each recomputing Lightning layer
    // keeps its norms' and its group norm's (H fp32 a token), so that the recompute quantizes in
    // one pass.
    if (cuda) {
      per_token += rm * (H * a.v_head_dim * (m_all2all ? 2 : 1) + 2 * H + 4);
      if (spec.train.precision == TrainPrecision::kFp8) per_token += rl * (4 + 2 * H);
    }
  }
  // train.offload: the layers' inputs but kCudaOffloadSlots wait in pinned host memory.
  if (cuda && spec.train.offload && m.n_layers > kCudaOffloadSlots) {
    const int64_t host_inputs = (m.n_layers - kCudaOffloadSlots) * d;
    per_token -= host_inputs;
    e.host_bytes = T * B * host_inputs;
  }
  e.activations_bytes = T * B * per_token + ffn_block_bytes;
  // Logit blocks, plus the backward's gradient scratch shared by all layers: the FFN's three
  // [T, F] (or block) and the normed input's [T, d], and each kind's own (Lightning: five [T, d];
  // MLA: the attention's and the projections' gradients, on one GPU or under MLA All2All by groups
  // of heads where that holds less, CudaMlaGradBytesPerToken), both kinds' on the CPU, the larger
  // on CUDA (one kind at a time).
  const int64_t work_l = nl > 0 ? B * 5 * d : 0;
  const int64_t mla_group = mla_allgather || cuda_mla_ring ? H : CudaMlaGradHeadsPerGroup(m, T, cp);
  const int64_t work_m = nm > 0 ? CudaMlaGradBytesPerToken(m, mla_group, cp == 1) : 0;
  const int64_t work_kinds = cuda ? std::max(work_l, work_m) : B * 11 * d;
  e.workspace_bytes = std::min<int64_t>(T, 4096) * m.vocab * 4 + (int64_t{64} << 20) +
                      T * (B * d + work_kinds) + ffn_rows * B * 3 * f;
  if (moe.experts > 0)
    e.workspace_bytes += T * (B * (moe_rows * (2 * d + 3 * moe.expert_ffn) +
                                   (ep > 1 ? moe.top_k * d + moe_rows * d : 0) + 3 * moe.shared_ffn) +
                              4 * (moe.experts + moe.top_k));
  if (lightning_allgather) e.workspace_bytes += 2 * 2 * cp * H * Dh * Dh * 4;
  if (lightning_mode == CpMode::kHybrid)
    e.workspace_bytes += 2 * 2 * (cp / u) * (H / u) * Dh * Dh * 4 + T * 4 * 4 * d;
  if (mla_ring && !cuda_mla_ring) {
    const int64_t Hl = mla_heads;
    e.workspace_bytes += mla_u * T * 4 * (5 * ring_w + 3 * Hl * (qk + a.v_head_dim) + Hl);
    if (mla_u > 1) e.workspace_bytes += T * 4 * H * (2 * qk + a.v_head_dim);
  }
  // CUDA All2All: one block as wide as the widest core input (the exchange's local side, and the
  // core's input gradients; received gradients land in the layer's cp_full) and one output-wide
  // block.
  if (l_all2all || m_all2all || m_hybrid) {
    const int64_t in_w =
        std::max({l_all2all && nl > 0 ? 3 * d : 0, m_all2all && nm > 0 ? mla_core_in : 0,
                  m_hybrid && nm > 0 ? H * qk : 0});
    const int64_t out_w = std::max(l_all2all && nl > 0 ? d : 0,
                                   (m_all2all || m_hybrid) && nm > 0 ? H * a.v_head_dim : 0);
    e.workspace_bytes += T * B * (in_w + out_w);
  }
  // The chunk of the level MLA attends over: the CP group's, or the ring of Ulysses groups'.
  const int64_t mla_chunk = cuda_mla_ring ? mla_u * chunk : chunk;
  if (cuda_mla_allgather || cuda_mla_ring) {
    // Keys, kv_b's output, their gradients and the latent's gradient rows for the larger of a
    // chunk and a key block; the cross piece's output and dq for one query block, its fp32
    // running output for the chunk (Ring: both local chunks); AllGather's fp32 gather /
    // reduce-scatter blocks, or the ring's two bf16 blocks in flight and four fp32 gradient
    // blocks (hybrid: the group's, and the latent's gather and reduce-scatter in the group).
    const int64_t rows = std::max<int64_t>(mla_chunk, kCudaMlaKeyBlock);
    const int64_t qrows = std::min<int64_t>(mla_chunk, kCudaMlaKeyBlock);
    const int64_t kvw = a.qk_nope_dim + a.v_head_dim;
    const int64_t w = a.kv_lora_rank + a.qk_rope_dim;
    e.workspace_bytes += rows * (2 * H * qk + 2 * H * kvw + w) * B +
                         qrows * H * (a.v_head_dim + qk) * B +
                         (cuda_mla_ring ? 2 : 1) * mla_chunk * H * a.v_head_dim * 4 +
                         (cuda_mla_ring ? mla_u * T * w * (2 * B + 4 * 4) : 2 * 4 * cp * T * w);
    if (m_hybrid) e.workspace_bytes += 2 * 4 * mla_u * T * w;
  }
  if (cuda) {
    // Outside the allocator: the CUDA context with cuBLAS's and cuDNN's handles and plans (~0.6
    // GiB measured), NCCL's buffers, and cuDNN's attention workspace (Sdpa::WorkspaceBytes),
    // which grows to its largest call's: the causal backward's fp32 dQ accumulator over the
    // rank's tokens with one group of heads (CudaAttentionHeadsPerCall; one GPU: of H, All2All:
    // the whole sequence with H / cp heads), under MLA AllGather over a zigzag chunk (with its
    // statistics), or the cross piece's
    // backward, which stages zero-padded copies of a query block's q, out, dout and dq (bf16;
    // the block rounded up to a power of two, as its plans are) beside their fp32 dQ accumulator
    // and statistics, and a key block's k, v, dk, dv.
    const int64_t v = a.v_head_dim;
    int64_t attention = 0;
    if (nm > 0 && (mla_allgather || cuda_mla_ring)) {
      const int64_t L = NextPow2(std::max<int64_t>(128, std::min(mla_chunk, kCudaMlaKeyBlock)));
      const int64_t cross =
          L * H * ((2 * qk + 2 * v) * 2 + qk * 4 + 2 * 4) + kCudaMlaKeyBlock * H * (qk + v) * 2 * 2;
      attention = std::max(
          mla_chunk * CudaAttentionHeadsPerCall(mla_chunk, H, qk) * (qk * 4 + 2 * 4), cross);
    } else if (nm > 0) {
      const int64_t Tf = T * cp, heads = H / cp;  // All2All: the whole sequence, H / cp heads
      attention = Tf * CudaAttentionHeadsPerCall(Tf, heads, qk) * qk * 4;
    }
    e.runtime_bytes = kCudaRuntimeBytes + attention;
    // NCCL, counted as if every rank had a GPU of its own (ranks that share one use Gloo).
    if (spec.parallel.world() > 1) {
      e.runtime_bytes += kNcclFirstCommBytes;
      if (spec.parallel.cp > 1 && spec.parallel.dp > 1) e.runtime_bytes += kNcclMoreCommBytes;
      // The hybrid modes' Ulysses group and ring.
      if (lightning_mode == CpMode::kHybrid || mla_mode == CpMode::kHybrid)
        e.runtime_bytes += 2 * kNcclMoreCommBytes;
    }
  }
  e.precision_bytes = PrecisionBytes(spec, mla_allgather || cuda_mla_ring, T, R, P, moe_rows);
  e.total_bytes = e.params_bytes + e.grads_bytes + e.optimizer_bytes + e.activations_bytes +
                  e.workspace_bytes + e.runtime_bytes + e.precision_bytes;
  return e;
}

namespace {

// "fastest": the pair of modes (Lightning, MLA) the cost model estimates fastest among those the
// job's resources run, a layer type not asking for "fastest" keeping its own; both 2-D modes
// share one Ulysses degree.
std::pair<ModeChoice, ModeChoice> ChooseFastest(const JobSpec& spec, const Topology& topo) {
  const CpCostModel model;
  const int64_t cp = std::max<int64_t>(1, spec.parallel.cp), heads = spec.model.n_heads;
  const int64_t recompute = std::max<int64_t>(0, spec.train.recompute_layers);
  auto options = [&](const std::string& type, CpMode requested) {
    std::vector<ModeChoice> out;
    if (requested != CpMode::kFastest) {
      out.push_back(requested == CpMode::kAuto ? RuleMode(cp, heads)
                                               : ModeChoice{requested, spec.parallel.ulysses});
      return out;
    }
    return CandidateModes(type, cp, heads);
  };
  std::pair<ModeChoice, ModeChoice> best;
  double best_s = -1;
  for (const ModeChoice& l : options("lightning", spec.parallel.lightning_mode)) {
    for (const ModeChoice& m : options("mla", spec.parallel.mla_mode)) {
      if (l.mode == CpMode::kHybrid && m.mode == CpMode::kHybrid && l.ulysses != m.ulysses)
        continue;
      const double t = model.Estimate(spec, topo, l, m, recompute).step_s();
      if (best_s < 0 || t < best_s) best_s = t, best = {l, m};
    }
  }
  return best;
}

// What attention's work counts documents as, for the cost basis (cp_cost_model.h, AttentionSpan).
std::string DocumentsBasis(const JobSpec& spec) {
  const double span = AttentionSpan(spec.data);
  if (span <= 0)
    return "; documents unknown (no data.doc_span): attention counted as one a sequence";
  const double counted = std::min(span, static_cast<double>(spec.seq_len));
  return absl::StrFormat(
      "; attention over documents of span %.0f tokens (%s)", counted,
      spec.data.kind == DataKind::kSynthetic ? spec.data.source : std::string("data.doc_span"));
}

// Every candidate of each layer type, estimated with the other type as the plan chose it; marks
// the rule's pick, the fastest and the chosen, and warns when the rule's pick is estimated 20% or
// more slower on its layers than the fastest.
void EstimateModes(const JobSpec& spec, const Topology& topo, int64_t recompute_layers,
                   CpPlan* plan) {
  const CpCostModel model;
  plan->cost_basis = absl::StrCat(topo.basis, DocumentsBasis(spec));
  const LayerModePlan* layer[2] = {&plan->layers[0], &plan->layers[1]};
  const std::string types[2] = {"lightning", "mla"};
  const int64_t cp = std::max<int64_t>(1, spec.parallel.cp);
  std::vector<ModeChoice> candidates[2];
  for (int i = 0; i < 2; ++i) candidates[i] = CandidateModes(types[i], cp, spec.model.n_heads);
  auto step = [&](const ModeChoice& l, const ModeChoice& m) {
    return model.Estimate(spec, topo, l, m, recompute_layers).step_s();
  };
  ModeChoice chosen[2], rule[2];
  for (int i = 0; i < 2; ++i) {
    chosen[i] = {layer[i]->mode, layer[i]->mode == CpMode::kHybrid ? plan->ulysses : 1};
    rule[i] = RuleMode(cp, spec.model.n_heads);
  }
  plan->step_s = step(chosen[0], chosen[1]);
  if (cp == 1) return;
  for (int i = 0; i < 2; ++i) {
    double fastest = -1, rule_s = 0, fastest_layers = 0, rule_layers = 0;
    size_t first = plan->estimates.size();
    for (const ModeChoice& c : candidates[i]) {
      ModeEstimate e;
      e.layer_type = types[i];
      e.cost = model.EstimateLayers(spec, topo, types[i], c);
      e.step_s = i == 0 ? step(c, chosen[1]) : step(chosen[0], c);
      e.rule = c.mode == rule[i].mode && c.ulysses == rule[i].ulysses;
      e.chosen = c.mode == chosen[i].mode && c.ulysses == chosen[i].ulysses;
      if (e.rule) rule_s = e.step_s, rule_layers = e.cost.total_s();
      if (fastest < 0 || e.step_s < fastest) fastest = e.step_s, fastest_layers = e.cost.total_s();
      plan->estimates.push_back(e);
    }
    for (size_t k = first; k < plan->estimates.size(); ++k)
      plan->estimates[k].fastest = plan->estimates[k].step_s == fastest;
    // The rule's pick against the fastest, on the layers of this type (their compute and
    // exposed communication): what the mode changes.
    if (layer[i]->num_layers > 0 && fastest_layers > 0 && rule_layers >= 1.2 * fastest_layers) {
      const ModeEstimate* f = nullptr;
      for (size_t k = first; k < plan->estimates.size(); ++k)
        if (plan->estimates[k].fastest) f = &plan->estimates[k];
      plan->warnings.push_back(absl::StrFormat(
          "%s: the default rule's %s is estimated %.0f%% slower on these layers than %s (%.3g s "
          "against %.3g s a step; the whole step %.4g s against %.4g s); \"%s_mode\": "
          "\"fastest\" picks it",
          types[i], ModeChoiceName(rule[i]), 100.0 * (rule_layers / fastest_layers - 1.0),
          ModeChoiceName(f->cost.choice), rule_layers, fastest_layers, rule_s, fastest,
          types[i]));
    }
  }
}

}  // namespace

namespace {

// The MoE token exchange of one step at `c.ep`: each MoE layer's forward sends T K rows of d
// (dispatch) and receives as many back (return), the backward the same for the gradients, a
// recomputed layer's forward again; (ep - 1) / ep of them leave the rank at the router's balanced
// load, over the link that joins the ranks (two all-to-alls a pass, each a message per peer).
void MoeDispatchEstimate(const JobSpec& spec, const Topology& topo, int64_t recompute_layers,
                         ExpertParallelEstimate* c) {
  const ModelConfig& m = spec.model;
  if (c->ep <= 1) return;
  const int64_t T = spec.seq_len / std::max<int64_t>(1, spec.parallel.cp);
  const int64_t B = spec.resources == "cuda" ? 2 : 4;
  const int64_t row_bytes = m.moe.top_k * m.d_model * B;
  int64_t passes = 0;  // row exchanges a step
  for (int64_t i = 0; i < m.n_layers; ++i)
    if (m.IsMoeLayer(i)) passes += (i < recompute_layers ? 2 : 1) * 2 + 2;
  passes *= spec.train.micro_batches;
  c->dispatch_bytes = passes * T * row_bytes * (c->ep - 1) / c->ep;
  const LinkRates& l = topo.link_rates;
  c->dispatch_s = (l.bytes_per_s > 0 ? static_cast<double>(c->dispatch_bytes) / l.bytes_per_s : 0.0) +
                  static_cast<double>(passes * (c->ep - 1)) * l.latency_s;
}

}  // namespace

CpPlan CpPlanner::Plan(const JobSpec& spec, int64_t device_memory_bytes,
                       const Topology* topology) const {
  const Topology fallback = DefaultTopology(spec.resources);
  const Topology& topo = topology ? *topology : fallback;
  if (spec.parallel.lightning_mode == CpMode::kFastest ||
      spec.parallel.mla_mode == CpMode::kFastest) {
    // Resolved by the cost model, then planned as if the spec had forced those modes.
    const auto [l, m] = ChooseFastest(spec, topo);
    JobSpec resolved = spec;
    resolved.parallel.lightning_mode = l.mode;
    resolved.parallel.mla_mode = m.mode;
    resolved.parallel.ulysses = l.mode == CpMode::kHybrid   ? l.ulysses
                                : m.mode == CpMode::kHybrid ? m.ulysses
                                                            : 1;
    CpPlan plan = Plan(resolved, device_memory_bytes, &topo);
    const CpMode requested[2] = {spec.parallel.lightning_mode, spec.parallel.mla_mode};
    for (int i = 0; i < 2 && i < static_cast<int>(plan.layers.size()); ++i) {
      if (requested[i] != CpMode::kFastest) continue;
      LayerModePlan& lp = plan.layers[i];
      lp.forced = false;
      lp.reason = absl::StrCat(
          "fastest by the cost model: ",
          ModeChoiceName({lp.mode, lp.mode == CpMode::kHybrid ? plan.ulysses : 1}),
          absl::StrFormat(", %.4g s a step", plan.step_s));
    }
    return plan;
  }
  if (spec.model.moe.experts > 0) {
    // Expert parallelism: every degree dividing the experts and the world, estimated; the spec's,
    // or the smallest that fits the device.
    const int64_t world = spec.parallel.world();
    std::vector<ExpertParallelEstimate> cands;
    for (int64_t ep = 1; ep <= std::min(world, spec.model.moe.experts); ++ep) {
      if (world % ep != 0 || spec.model.moe.experts % ep != 0) continue;
      JobSpec s = spec;
      s.parallel.ep = ep;
      ExpertParallelEstimate c;
      c.ep = ep;
      std::vector<std::string> ignored;  // the plan below reports them
      const std::vector<LayerModePlan> layers = {
          DecideMode(s, "lightning", s.model.NumLayersOfKind('L'), s.parallel.lightning_mode,
                     &ignored),
          DecideMode(s, "mla", s.model.NumLayersOfKind('M'), s.parallel.mla_mode, &ignored)};
      const int64_t r = s.train.recompute_layers == TrainSpec::kRecomputeAuto
                            ? RecomputeLayersFor(s, layers, device_memory_bytes)
                            : s.train.recompute_layers;
      c.memory_bytes = EstimateMemory(s, layers, r).total_bytes;
      c.fits = device_memory_bytes > 0 && c.memory_bytes <= device_memory_bytes;
      MoeDispatchEstimate(s, topo, r, &c);
      cands.push_back(c);
    }
    if (spec.parallel.ep == 0) {
      int64_t pick = 1;
      std::string why = "no device known: the smallest (memory not checked)";
      if (device_memory_bytes > 0) {
        pick = cands.empty() ? 1 : cands.back().ep;
        why = "none fits the device: the largest";
        for (const ExpertParallelEstimate& c : cands)
          if (c.fits) {
            pick = c.ep;
            why = "the smallest whose estimate fits the device";
            break;
          }
      }
      JobSpec resolved = spec;
      resolved.parallel.ep = pick;
      CpPlan plan = Plan(resolved, device_memory_bytes, &topo);
      plan.ep_reason = why;
      plan.ep_estimates = std::move(cands);
      for (ExpertParallelEstimate& c : plan.ep_estimates) c.chosen = c.ep == pick;
      return plan;
    }
    CpPlan plan = PlanDense(spec, device_memory_bytes, topo);
    plan.ep = spec.parallel.ep;
    plan.ep_reason = "parallel.ep as the spec gives it";
    plan.ep_estimates = std::move(cands);
    for (ExpertParallelEstimate& c : plan.ep_estimates) c.chosen = c.ep == plan.ep;
    if (absl::Status st = CheckExpertParallel(spec.parallel, spec.model); !st.ok())
      plan.problems.push_back(std::string(st.message()));
    return plan;
  }
  return PlanDense(spec, device_memory_bytes, topo);
}

CpPlan CpPlanner::PlanDense(const JobSpec& spec, int64_t device_memory_bytes,
                            const Topology& topo) const {
  CpPlan plan;
  const ModelConfig& m = spec.model;
  plan.cp = spec.parallel.cp;
  plan.dp = spec.parallel.dp;
  plan.world = spec.parallel.world();
  const int64_t cp = std::max<int64_t>(1, plan.cp);
  plan.tokens_per_rank = spec.seq_len / cp;

  plan.ulysses = spec.parallel.ulysses;
  // The combinations of parallel.* the spec parser checks, for specs built in code (the memory
  // hint's, a planner test's).
  if (absl::Status s = CheckCpModes(spec.parallel, m.n_heads); !s.ok())
    plan.problems.push_back(std::string(s.message()));
  plan.layers.push_back(DecideMode(spec, "lightning", m.NumLayersOfKind('L'),
                                   spec.parallel.lightning_mode, &plan.problems));
  plan.layers.push_back(
      DecideMode(spec, "mla", m.NumLayersOfKind('M'), spec.parallel.mla_mode, &plan.problems));

  // The CUDA engine runs both modes for both layer types, on the shapes its kernels take.
  if (spec.resources == "cuda") {
    const std::string shape = CudaShapeProblem(m);
    if (!shape.empty())
      plan.problems.push_back(absl::StrCat("model: resources \"cuda\" cannot run ", shape,
                                           "; use resources \"cpu\" or another shape"));
    const std::string fp8 =
        spec.train.precision == TrainPrecision::kFp8 ? CudaFp8ShapeProblem(m) : "";
    if (!fp8.empty())
      plan.problems.push_back(absl::StrCat("train.precision: \"fp8\" on resources \"cuda\": ",
                                           fp8, "; use \"bf16\" or another shape"));
    if (spec.train.precision == TrainPrecision::kFp8 && (spec.seq_len / cp) % 16 != 0)
      plan.problems.push_back(absl::StrCat(
          "train.precision: \"fp8\" on resources \"cuda\" needs a multiple of 16 tokens per "
          "rank (cuBLASLt's FP8 GEMMs), but seq_len / cp = ",
          spec.seq_len / cp, "; use \"bf16\" or a seq_len divisible by 16 cp"));
  }
  // Every sequence is laid out as 2 cp zigzag chunks, also at cp = 1.
  const int64_t chunks = 2 * cp;
  if (spec.seq_len % chunks != 0) {
    plan.problems.push_back(absl::StrCat("seq_len: ", spec.seq_len, " is not divisible by 2*cp = ",
                                         chunks, " (zigzag chunks need equal sizes)"));
  } else if (cp > 1 && spec.seq_len / chunks < kMinTokensPerChunk) {
    plan.problems.push_back(absl::StrCat("seq_len: ", spec.seq_len, " gives ",
                                         spec.seq_len / chunks, " tokens per chunk with cp=", cp,
                                         "; at least ", kMinTokensPerChunk, " are needed"));
  }

  const bool auto_recompute = spec.train.recompute_layers == TrainSpec::kRecomputeAuto;
  const int64_t recompute_layers = auto_recompute
                                       ? RecomputeLayersFor(spec, plan.layers, device_memory_bytes)
                                       : spec.train.recompute_layers;
  plan.memory = EstimateMemory(spec, plan.layers, recompute_layers);
  plan.memory.device_memory_bytes = device_memory_bytes;
  // ParseJobSpec bounds every size (common/size_checks.h) so that no term above can wrap; a spec
  // built without it that still does is a problem, never a negative size that looks like room.
  if (const MemoryEstimate& e = plan.memory;
      std::min({e.params_bytes, e.grads_bytes, e.optimizer_bytes, e.activations_bytes,
                e.workspace_bytes, e.runtime_bytes, e.host_bytes, e.total_bytes}) < 0 ||
      e.total_bytes > kMaxSpecBytes) {
    plan.problems.push_back(
        absl::StrCat("memory: the estimate for this model at seq_len ", spec.seq_len,
                     " does not fit in 64 bits (more than ", kMaxSpecBytes >> 50,
                     " PiB per rank); reduce seq_len, n_layers or the model's widths"));
    return plan;
  }
  if (spec.seq_len % chunks == 0) {
    for (LayerModePlan& l : plan.layers) {
      const char kind = l.layer_type == "mla" ? 'M' : 'L';
      const CpCommBytes b = CpLayerCommBytes(m, kind, l.mode, spec.parallel, spec.seq_len);
      int64_t bytes = 0;
      for (int64_t i = 0; i < m.n_layers; ++i)
        if (m.LayerKind(i) == kind)
          bytes += b.forward * (i < plan.memory.recompute_layers ? 2 : 1) + b.backward;
      l.comm_bytes_per_step = bytes * spec.train.micro_batches;
    }
  }
  if (auto_recompute && device_memory_bytes <= 0)
    plan.warnings.push_back("train.recompute \"auto\": no device known, every layer recomputes");
  if (device_memory_bytes > 0) {
    plan.max_seq_len = LongestSeqLenFitting(spec, plan.layers, device_memory_bytes);
    if (spec.resources == "cuda" && !spec.train.offload) {
      JobSpec o = spec;
      o.train.offload = true;
      plan.max_seq_len_offload = LongestSeqLenFitting(o, plan.layers, device_memory_bytes);
    }
    if (plan.memory.total_bytes > device_memory_bytes) {
      plan.problems.push_back(absl::StrCat(
          "memory: estimated ", FormatBytes(plan.memory.total_bytes), " per rank exceeds the ",
          FormatBytes(device_memory_bytes), " of one ", spec.resources, " device",
          MemoryHint(*this, spec, plan, device_memory_bytes)));
    }
  } else {
    plan.warnings.push_back("no device known: memory estimate not checked against a device");
  }
  if (spec.seq_len > 0 && spec.seq_len % chunks == 0 && plan.layers.size() == 2)
    EstimateModes(spec, topo, recompute_layers, &plan);
  return plan;
}

int64_t RecomputeLayersFor(const JobSpec& spec, const std::vector<LayerModePlan>& layers,
                           int64_t device_memory_bytes) {
  const int64_t n = spec.model.n_layers;
  if (device_memory_bytes <= 0) return n;
  const int64_t r = FewestRecomputeLayersFitting(
      spec, layers, 0, kRecomputeAutoFill * static_cast<double>(device_memory_bytes));
  return r >= 0 ? r : n;
}

std::string FormatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / (1 << 30));
  if (bytes >= (int64_t{1} << 20)) return absl::StrFormat("%.1f MiB", b / (1 << 20));
  if (bytes >= (int64_t{1} << 10)) return absl::StrFormat("%.1f KiB", b / (1 << 10));
  return absl::StrCat(bytes, " B");
}

}  // namespace spindle
