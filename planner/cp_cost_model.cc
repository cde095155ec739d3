// Step-time estimates per CP mode (see cp_cost_model.h). Every formula names the bytes or FLOPs
// it counts; bench/CP_NOTES.md ("Cost model") derives them and compares them with measurements.
#include "planner/cp_cost_model.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/cp_modes.h"

namespace spindle {
namespace {

// Per-layer shapes, as doubles.
struct Shape {
  double T, n, T_loc, B, m;          // tokens, cp, tokens per rank, activation bytes, sequences
  double d, H, Dh, f, vocab;         // model widths
  double qk, nope, rd, v, kv;        // MLA head and latent sizes
  double span;                       // attention's document span (AttentionSpan)
  double L_L, L_M;                   // layers of each kind
  const ModelConfig& c;
  explicit Shape(const JobSpec& s) : c(s.model) {
    T = static_cast<double>(s.seq_len);
    n = static_cast<double>(s.parallel.cp);
    T_loc = T / n;
    B = s.resources == "cuda" ? 2.0 : 4.0;
    m = static_cast<double>(std::max<int64_t>(1, s.train.micro_batches));
    d = static_cast<double>(c.d_model);
    H = static_cast<double>(c.n_heads);
    Dh = static_cast<double>(c.head_dim());
    f = static_cast<double>(c.ffn_dim);
    vocab = static_cast<double>(c.vocab);
    nope = static_cast<double>(c.mla.qk_nope_dim);
    rd = static_cast<double>(c.mla.qk_rope_dim);
    qk = nope + rd;
    v = static_cast<double>(c.mla.v_head_dim);
    kv = static_cast<double>(c.mla.kv_lora_rank);
    L_L = static_cast<double>(c.NumLayersOfKind('L'));
    L_M = static_cast<double>(c.NumLayersOfKind('M'));
    const double known = AttentionSpan(s.data);
    span = known > 0 ? std::min(T, known) : T;
  }
  double LightningFlopsPerToken() const { return c.LightningFlopsPerToken(); }
  // Causal softmax attention forward + backward over one sequence: T span / 2 pairs (span = T
  // when the documents are not known, the worst case of one document).
  double AttentionFlops() const { return c.AttentionFlopsPerPair() * (T * span / 2.0); }
  // K and V rebuilt from the latent (kv_b: kv -> H (nope + v)), forward + backward, per token.
  double RebuildFlopsPerToken() const { return 6.0 * kv * H * (nope + v); }
};

// One core of the reference machine (2-core shared VM, spindle-train --probe-rates at the small
// preset's shapes; bench/CP_NOTES.md). Its memcpy measured 14 GB/s at the probe's 8 MiB and 6 at
// 64 MiB, out of the caches: the built-in copy rate is below both.
constexpr double CpuDefaultGemm = 40e9, CpuDefaultAttention = 10e9, CpuDefaultLightning = 10e9,
                 CpuDefaultMemory = 4e9, CpuDefaultCopy = 5e9;

double Rate(double r, double sharing) { return r > 0 ? r / std::max(1.0, sharing) : 0.0; }
double Time(double work, double rate) { return rate > 0 ? work / rate : 0.0; }

// Link time of `messages` messages carrying `bytes` in all.
double LinkTime(const LinkRates& l, double bytes, double messages) {
  return (l.bytes_per_s > 0 ? bytes / l.bytes_per_s : 0.0) + messages * l.latency_s;
}

// The host copies of an all-to-all by pieces over a host-memory communicator (Gloo: the CPU
// engine's): the base communicator packs every piece into one block a rank and unpacks the
// received blocks (worker/engine/comm/communicator.cc, DoAllToAllPieces), two copies of the whole
// exchanged buffer, `sent` (the bytes sent to the others, (n-1)/n of it) x n / (n-1), on the
// communicator's one thread, at one thread's memcpy rate (HostCopyRate). GPU ranks make none: NCCL
// sends the pieces where they lie, and a staged communicator copies each piece straight into its
// staging, as it does for every collective (what the same-device link's rate stands for).
double PackingCopies(const JobSpec& spec, const Topology& topo, double sent, double group) {
  if (spec.resources == "cuda" || group <= 1 || sent <= 0) return 0.0;
  return Time(2.0 * sent * group / (group - 1.0), Rate(HostCopyRate(topo.rates), topo.sharing));
}

}  // namespace

double HostCopyRate(const DeviceRates& r) {
  return r.copy_bytes > 0 ? r.copy_bytes : CpuDefaultCopy;
}

const char* LinkClassName(LinkClass l) {
  switch (l) {
    case LinkClass::kSameDevice:
      return "same-device";
    case LinkClass::kNvlink:
      return "nvlink";
    case LinkClass::kPcie:
      return "pcie";
    case LinkClass::kLoopback:
      return "loopback";
    case LinkClass::kNetwork:
      return "network";
  }
  return "?";
}

bool ParseLinkClass(const std::string& word, LinkClass* out) {
  for (LinkClass l : {LinkClass::kSameDevice, LinkClass::kNvlink, LinkClass::kPcie,
                      LinkClass::kLoopback, LinkClass::kNetwork}) {
    if (word == LinkClassName(l)) {
      *out = l;
      return true;
    }
  }
  return false;
}

LinkRates DefaultLinkRates(LinkClass l) {
  switch (l) {
    case LinkClass::kSameDevice:  // ranks sharing a GPU: host staging, then Gloo TCP on 127.0.0.1
      return {1.3e9, 80e-6};
    case LinkClass::kNvlink:  // H200 NV18, NCCL's measured ~270 GB/s (bench/cuda/NOTES.md)
      return {270e9, 10e-6};
    case LinkClass::kPcie:  // PCIe 5 x16
      return {40e9, 15e-6};
    case LinkClass::kLoopback:  // Gloo TCP on 127.0.0.1
      return {1.5e9, 60e-6};
    case LinkClass::kNetwork:  // 25 GbE
      return {2.5e9, 100e-6};
  }
  return {};
}

DeviceRates DefaultRates(const std::string& resources) {
  if (resources == "cuda")  // H200: bench/cuda/NOTES.md (GEMMs, cuDNN attention, Lightning)
    return {770e12, 450e12, 130e12, 3.0e12};
  return {CpuDefaultGemm, CpuDefaultAttention, CpuDefaultLightning, CpuDefaultMemory,
          CpuDefaultCopy};
}

double CoreSharing(int64_t ranks, int64_t threads, int64_t cores, int64_t world) {
  if (ranks < 1 || threads < 1 || cores < 1 || ranks * threads < cores) return 1.0;
  // c: how many times the compute threads fill the cores (>= 1 here).
  const double c = static_cast<double>(ranks * threads) / static_cast<double>(cores);
  // ranks / cores communicators a core, each taking 1 / c^2 of one.
  const double communicators =
      world > 1 ? static_cast<double>(ranks) / static_cast<double>(cores) / (c * c) : 0.0;
  return std::max(1.0, c + communicators);
}

Topology DefaultTopology(const std::string& resources) {
  Topology t;
  t.rates = DefaultRates(resources);
  t.link = resources == "cuda" ? LinkClass::kNvlink : LinkClass::kLoopback;
  t.link_rates = DefaultLinkRates(t.link);
  t.basis = absl::StrCat("built-in ", resources == "cuda" ? "H200" : "CPU core",
                         " rates, link ", LinkClassName(t.link));
  return t;
}

std::string ModeChoiceName(const ModeChoice& m) {
  std::string name(CpModeName(m.mode));
  if (m.mode == CpMode::kHybrid) absl::StrAppend(&name, " u=", m.ulysses);
  return name;
}

std::vector<ModeChoice> CandidateModes(const std::string& layer_type, int64_t cp,
                                       int64_t n_heads) {
  std::vector<ModeChoice> out;
  if (cp <= 1) return {{CpMode::kAllGather, 1}};
  out.push_back({CpMode::kAllGather, 1});
  if (All2AllSplits(n_heads, cp)) out.push_back({CpMode::kAll2All, 1});
  if (layer_type == "mla") out.push_back({CpMode::kRing, 1});
  for (int64_t u = 2; u < cp; ++u)
    if (cp % u == 0 && n_heads % u == 0) out.push_back({CpMode::kHybrid, u});
  return out;
}

ModeCost CpCostModel::EstimateLayers(const JobSpec& spec, const Topology& topo,
                                     const std::string& layer_type,
                                     const ModeChoice& choice) const {
  const Shape s(spec);
  ModeCost c;
  c.choice = choice;
  const double sh = topo.sharing;
  const LinkRates& link = topo.link_rates;
  const bool lightning = layer_type == "lightning";
  const double layers = lightning ? s.L_L : s.L_M;
  if (layers == 0) return c;
  const double n = s.n;
  const bool hybrid = choice.mode == CpMode::kHybrid;
  const double u = hybrid ? static_cast<double>(choice.ulysses) : 1.0;
  const double r = n / u;  // the Ring / AllGather degree of a 2-D mode
  // What each rank sends per layer (common/cp_modes.h, the engine's own accounting in fp32
  // values); a GPU moves bf16 activations, and Lightning's states stay fp32.
  ParallelSpec par = spec.parallel;
  par.ulysses = choice.ulysses;
  const CpCommBytes sent =
      CpLayerCommBytes(spec.model, lightning ? 'L' : 'M', choice.mode, par, spec.seq_len);
  const double act = s.B / 4.0;
  double fwd = static_cast<double>(sent.forward), bwd = static_cast<double>(sent.backward);
  double exposed = 0, messages = 0, memory = 0;
  double copies = 0;  // the communicator's packing, exposed with its exchange
  if (lightning) {
    const double rate = Rate(topo.rates.lightning_flops, sh);
    const double core = Time(s.LightningFlopsPerToken() * s.T_loc, rate);  // fwd + bwd
    c.compute_s = core;
    const double state = 2.0 * s.H * s.Dh * s.Dh * 4.0;  // two fp32 states per rank (its chunks)
    if (n > 1 && choice.mode != CpMode::kAll2All) {
      // The chunk states' AllGather (over the groups in a 2-D mode, of their H / u heads), hidden
      // behind the local outputs: a third of the core forward, two thirds backward.
      const double degree = hybrid ? r : n;
      const double gather = (degree - 1.0) * state / u;
      exposed += std::max(0.0, LinkTime(link, gather, degree - 1.0) - core / 3.0) +
                 std::max(0.0, LinkTime(link, gather, degree - 1.0) - 2.0 * core / 3.0);
      messages += 2.0 * (degree - 1.0);
      // The carry correction of the continuing first segments, forward and backward.
      c.compute_s += Time(3.0 * 2.0 * s.H * s.Dh * s.Dh * s.T_loc, rate);
      memory += state / u + 2.0 * degree * state / u / layers;
      // The rest of a 2-D mode's bytes are its Ulysses transposition.
      const double ulysses = (fwd - gather) * act;
      fwd = gather + ulysses, bwd = gather + ulysses;
      if (hybrid) {
        copies = PackingCopies(spec, topo, 2.0 * ulysses, u);
        exposed += LinkTime(link, 2.0 * ulysses, 4.0 * (u - 1.0));
        messages += 4.0 * (u - 1.0);
        memory += 3.0 * s.T_loc * s.d * s.B;
      }
    } else if (n > 1) {  // All2All: q, k, v out and o back; the backward the reverse
      fwd *= act, bwd *= act;
      messages = 4.0 * (n - 1.0);
      copies = PackingCopies(spec, topo, fwd + bwd, n);
      exposed = LinkTime(link, fwd + bwd, messages);
      memory = 3.0 * s.T_loc * s.d * s.B;  // head-split q, k, v kept for the backward
    }
  } else if (n == 1) {  // local causal attention alone
    c.compute_s = Time(s.AttentionFlops(),
                       Rate(topo.rates.attention_flops, sh));
  } else {
    fwd *= act, bwd *= act;
    const double rate = Rate(topo.rates.attention_flops, sh);
    const double gemm = Rate(topo.rates.gemm_flops, sh);
    const double core = Time(s.AttentionFlops() / n, rate);  // zigzag: an equal share each
    c.compute_s = core;
    const double kv_block = s.T_loc * s.H * (s.qk + s.v) * s.B;  // K and V of T_loc tokens
    // K and V rebuilt from the latent for the keys of the other ranks.
    const double rebuild = Time(s.RebuildFlopsPerToken() * (s.T - s.T_loc), gemm);
    switch (choice.mode) {
      case CpMode::kAll2All:
        messages = 4.0 * (n - 1.0);
        copies = PackingCopies(spec, topo, fwd + bwd, n);
        exposed = LinkTime(link, fwd + bwd, messages);
        memory = s.T_loc * s.H * (2.0 * s.qk + 2.0 * s.v) * s.B;
        break;
      case CpMode::kRing:
      case CpMode::kHybrid: {
        // The ring over r ranks: a block moves each step while the previous one computes (a
        // third of its attention forward, two thirds backward); the backward moves the block and
        // its gradient accumulator. A 2-D mode's Ulysses transposition around it is exposed.
        const int64_t heads = MlaRingHeads(spec.model.n_heads, choice.mode, choice.ulysses);
        const MlaRingPayload payload = MlaRingPayloadFor(spec.model.mla, heads);
        const double block = u * s.T_loc *
                             static_cast<double>(MlaRingPayloadWidth(spec.model.mla, payload,
                                                                     heads)) *
                             s.B;
        const double steps = r - 1.0, t_block = core / r;
        exposed += steps * (std::max(0.0, LinkTime(link, block, 1.0) - t_block / 3.0) +
                            std::max(0.0, LinkTime(link, 2.0 * block, 2.0) - 2.0 * t_block / 3.0));
        messages += 3.0 * steps;
        const double ulysses = std::max(0.0, fwd - steps * block);
        if (hybrid) {
          // Of it, the latent's all-gather (a plain collective) is not packed by pieces.
          const double latent =
              payload == MlaRingPayload::kLatent ? (u - 1.0) * s.T_loc * (s.kv + s.rd) * s.B : 0.0;
          copies = PackingCopies(spec, topo, 2.0 * std::max(0.0, ulysses - latent), u);
          exposed += LinkTime(link, 2.0 * ulysses, 4.0 * (u - 1.0));
          messages += 4.0 * (u - 1.0);
        }
        if (payload == MlaRingPayload::kLatent) c.compute_s += rebuild;
        memory = 2.0 * kv_block + kv_block / s.B * 4.0 +
                 (hybrid ? s.T_loc * s.H * (2.0 * s.qk + 2.0 * s.v) * s.B : 0.0);
        break;
      }
      default:  // AllGather of the latent; the backward reduce-scatters its gradient
        messages = 2.0 * (n - 1.0);
        exposed = LinkTime(link, fwd + bwd, messages);
        c.compute_s += rebuild;
        memory = n * s.T_loc * (s.kv + s.rd) * s.B + s.T * s.H * (s.qk + s.v) * s.B;
        break;
    }
  }
  c.compute_s *= layers * s.m;
  c.copy_s = copies * layers * s.m;
  c.comm_s = LinkTime(link, fwd + bwd, messages) * layers * s.m + c.copy_s;
  c.exposed_s = exposed * layers * s.m + c.copy_s;
  c.bytes = static_cast<int64_t>((fwd + bwd) * layers * s.m);
  c.memory_bytes = static_cast<int64_t>(memory * layers);
  return c;
}

StepCost CpCostModel::Estimate(const JobSpec& spec, const Topology& topo,
                               const ModeChoice& lightning, const ModeChoice& mla,
                               int64_t recompute_layers) const {
  const Shape s(spec);
  const ModelConfig& c = spec.model;
  StepCost out;
  out.lightning = EstimateLayers(spec, topo, "lightning", lightning);
  out.mla = EstimateLayers(spec, topo, "mla", mla);
  const double sh = topo.sharing;
  // Dense GEMMs: 6 per active parameter and token (the embedding is a lookup; a MoE layer's
  // top_k experts), and a forward more (2) for each recomputed layer's own weights; a recomputed
  // layer's core runs its forward again.
  const double P = static_cast<double>(c.NumActiveParams());
  const double non_embed = P - s.vocab * s.d;
  const double per_layer = (non_embed - s.vocab * s.d) / std::max(1.0, s.L_L + s.L_M);
  const double R = static_cast<double>(std::clamp<int64_t>(recompute_layers, 0, c.n_layers));
  const double gemm_flops = s.T_loc * (6.0 * non_embed + 2.0 * R * per_layer);
  double t = Time(gemm_flops, Rate(topo.rates.gemm_flops, sh));
  const double la_share = s.L_L > 0 ? R * s.L_L / (s.L_L + s.L_M) : 0.0;
  const double mla_share = R - la_share;
  if (s.L_L > 0) t += out.lightning.compute_s / (s.m * s.L_L) * la_share / 3.0;
  if (s.L_M > 0) t += out.mla.compute_s / (s.m * s.L_M) * mla_share / 3.0;
  // Memory-bound kernels, forward + backward, per token: per layer two RMSNorms, two residual
  // adds, SwiGLU and (Lightning) the group norm and gate or (MLA) RoPE and the latent norm:
  // about 48 d + 9 f elements moved; the loss reads and writes the logits three times (fp32).
  const double elems = (s.L_L + s.L_M) * (48.0 * s.d + 9.0 * s.f);
  const double mem_bytes = s.T_loc * (elems * s.B + 3.0 * 2.0 * s.vocab * 4.0);
  t += Time(mem_bytes, Rate(topo.rates.memory_bytes, sh));
  t *= s.m;
  // The optimizer once per step: AdamW reads p, g, m, v and writes p, m, v (fp32), SGD p, g
  // (and its momentum); the gradients are zeroed; a GPU also writes the bf16 working copy.
  const bool adam = spec.train.optimizer == "adamw";
  double opt_bytes = P * ((adam ? 28.0 : (spec.train.momentum > 0 ? 20.0 : 12.0)) + 4.0);
  if (spec.resources == "cuda") opt_bytes += 2.0 * P;
  t += Time(opt_bytes, Rate(topo.rates.memory_bytes, sh));
  // Gradient all-reduce over the world (ring: 2 (W-1)/W of the fp32 gradients), bucketed and
  // overlapped with the backward: what is left after the backward ends shows, and at least the
  // last bucket (a layer's).
  const double W = static_cast<double>(spec.parallel.world());
  if (W > 1) {
    out.grad_comm_s =
        LinkTime(topo.link_rates, 2.0 * (W - 1.0) / W * 4.0 * P, 2.0 * (W - 1.0) * c.n_layers);
    const double backward = 2.0 / 3.0 * (t + out.lightning.compute_s + out.mla.compute_s);
    t += std::max(out.grad_comm_s / static_cast<double>(c.n_layers),
                  out.grad_comm_s - backward);
  }
  out.shared_s = t;
  return out;
}

}  // namespace spindle
