// CpPlanner: decides, per layer type, how a job runs under context parallelism (DESIGN.md
// section 3), estimates per-rank memory, and lists every reason the job cannot run. Used by the
// coordinator at submit time, by the Plan RPC, by `spindle plan` offline and by spindle-train run
// standalone (without a coordinator), which resolves its own spec with it.
//
// Mode rule per layer type ("lightning", "mla"): when the spec says "auto", All2All if
// cp <= n_heads and n_heads % cp == 0, else AllGather. cp == 1 needs no communication; the
// mode is then reported as AllGather ("cp=1: no sequence split"). A forced All2All with
// n_heads % cp != 0 is a problem naming the layer type, cp and heads. The forced modes "ring"
// (MLA) and "hybrid" (Ulysses groups of parallel.ulysses ranks) are checked by CheckCpModes
// (common/cp_modes.h) and run on resources "cpu" only; the plan names MLA's ring payload
// (MlaRingPayloadFor) and, per layer type, the bytes a rank sends per step (CpLayerCommBytes).
//
// Thread-safety: stateless; Plan() is const and may be called from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/job_spec.h"
#include "planner/cp_cost_model.h"

namespace spindle {

struct LayerModePlan {
  std::string layer_type;  // "lightning" or "mla"
  int64_t num_layers = 0;
  CpMode mode = CpMode::kAllGather;  // never kAuto or kFastest
  std::string reason;                // one line
  bool forced = false;               // the spec chose the mode
  // Bytes one rank sends for these layers per optimizer step: micro_batches x (each layer's
  // forward, twice for a recomputing layer, and backward), CpLayerCommBytes.
  int64_t comm_bytes_per_step = 0;
  std::string ring_payload;  // MLA ring / hybrid: "kv" or "latent"; empty otherwise
};

// One candidate mode of one layer type, as the cost model estimates it (cp_cost_model.h).
struct ModeEstimate {
  std::string layer_type;
  ModeCost cost;
  double step_s = 0;  // the whole step with this mode (the other layer type as chosen)
  bool rule = false, fastest = false, chosen = false;
};

// Per-rank memory estimate in bytes. See EstimateMemory() for the formula.
struct MemoryEstimate {
  int64_t params_bytes = 0;
  int64_t grads_bytes = 0;
  int64_t optimizer_bytes = 0;
  int64_t activations_bytes = 0;
  int64_t workspace_bytes = 0;
  // CUDA: what the device holds outside Spindle's allocator: the CUDA context and libraries,
  // NCCL's buffers (world > 1), and cuDNN's attention workspace (its fp32 dQ accumulator, which
  // grows with the tokens).
  int64_t runtime_bytes = 0;
  // train.precision's own copies (see EstimateMemory): FP8 weights, activations and gradient
  // scratch; on "cpu" the emulation's copies (held in fp32).
  int64_t precision_bytes = 0;
  int64_t total_bytes = 0;          // all of the above
  // train.offload: the pinned host memory holding the offloaded layer inputs (not in total_bytes).
  int64_t host_bytes = 0;
  int64_t device_memory_bytes = 0;  // what it was checked against; 0: not checked
  int64_t recompute_layers = 0;     // the first this many layers recompute (never auto)
};

// One candidate expert-parallel degree of a MoE job (parallel.ep left to the planner, or given):
// the per-rank memory with it, and the token exchange's bytes and link time per step (forward and
// backward, dispatch and return, at the router's balanced load).
struct ExpertParallelEstimate {
  int64_t ep = 1;
  int64_t memory_bytes = 0;
  int64_t dispatch_bytes = 0;
  double dispatch_s = 0;
  bool fits = false;  // within the device (false when no device is known)
  bool chosen = false;
};

struct CpPlan {
  int64_t cp = 1;
  int64_t dp = 1;
  int64_t world = 1;
  int64_t ulysses = 1;  // parallel.ulysses, or the Ulysses degree "fastest" chose
  // MoE models: parallel.ep, or the planner's choice (the smallest degree dividing the experts and
  // the world whose estimate fits the device; 1 when no device is known), with every candidate.
  int64_t ep = 1;
  std::string ep_reason;
  std::vector<ExpertParallelEstimate> ep_estimates;
  int64_t tokens_per_rank = 0;
  std::vector<LayerModePlan> layers;  // "lightning" then "mla"
  MemoryEstimate memory;              // memory.recompute_layers: train.recompute resolved
  std::vector<std::string> problems;  // every reason the job cannot run; empty: it can
  std::vector<std::string> warnings;
  // With a device: the longest seq_len (a multiple of 2 cp x 1024 tokens) whose estimate, every
  // layer recomputing and this plan's cp and modes, fits it; 0 without a device or when none does.
  int64_t max_seq_len = 0;
  // The same with train.offload, for a cuda job that does not offload (0 otherwise): how much
  // longer the offload would let it be.
  int64_t max_seq_len_offload = 0;
  // cp > 1: every candidate of each layer type; the step estimate of the chosen modes, and what
  // the estimate rests on.
  std::vector<ModeEstimate> estimates;
  double step_s = 0;
  std::string cost_basis;
  bool ok() const { return problems.empty(); }
  // The decided mode of a layer type ("lightning" or "mla").
  CpMode ModeOf(const std::string& layer_type) const;
};

// Per-rank memory, in bytes, of training `spec` (B = 4 bytes per activation element on "cpu",
// 2 on "cuda"; P = ModelConfig::NumParams(); T = seq_len / cp tokens per rank; d = d_model,
// H = n_heads, f = ffn_dim):
//   (P: the parameters a rank holds, its 1 / parallel.ep of the MoE layers' experts)
//   params      4 P (fp32 master weights); 6 P on "cuda" (and the bf16 working copy)
//   grads       4 P  (fp32)
//   optimizer   8 P for AdamW (m, v fp32); 4 P for SGD with momentum; 0 for plain SGD
//   activations T * B * (4 d + sum over layers of a_layer)      without recompute
//               T * B * (4 d + R d + shared + sum over the others of a_layer)
//                                                    when the first R layers recompute: `shared`
//                                                    is the one cache they share, the larger of
//                                                    their kinds' a_layer on "cuda" (one kind at a
//                                                    time), both kinds' together on "cpu"; on
//                                                    "cuda" their FFN runs in token blocks
//                                                    (kCudaFfnBlockRows) and each recomputing MLA
//                                                    layer keeps its attention output and its
//                                                    norms' statistics (and under fp8 each
//                                                    recomputing Lightning layer its norms' and
//                                                    group norm's: T (2 + H) fp32)
//     a_layer (common) = 4 d (norm inputs/outputs) + 3 f (W1 x, W3 x, SwiGLU product); a MoE
//                        layer's FFN instead: router logits, weights and choices (E + 2K + 1,
//                        fp32), the shared expert's 3 S, and its experts' rows at the worst load
//                        the router allows (dropless: rows = T K at ep 1; at ep > 1 every token of
//                        the EP group may choose this rank, ep T min(K, E / ep) rows) of
//                        2 d + 3 F each, with the K d outputs returned (ep > 1)
//     Lightning        += 9 d (qkv, normed q/k, output, normed output, gate, gated output)
//     MLA              += H (qk_nope + qk_rope) * 2 + (kv_lora + qk_rope) * 2
//                         + H (qk_nope + v_head) + H v_head + 2 H (softmax stats, fp32)
//                         and, in AllGather mode, the gathered latents of the whole sequence:
//                         cp * T * (kv_lora + qk_rope); in Ring mode its own block, W values
//                         (W = the payload's width, MlaRingPayloadWidth); in hybrid mode the
//                         head-split Q, block, output and statistics of its group's u T tokens:
//                         H (qk + v_head + 1) + u W (on "cuda" with W the keys' and values', also
//                         the group's latent rows: + u (kv_lora + qk_rope))
//     Lightning hybrid += 3 d (the head-split q, k, v of the group's tokens)
//     CUDA All2All     += each layer's head-split core inputs (and MLA's output) over the sequence
//   workspace   min(T, 4096) * vocab * 4 (cross-entropy block, fp32) + 64 MiB
//               + T * B * (d + the kinds' own gradient scratch: the larger on "cuda", 11 d on
//                 "cpu"; Lightning's 5 d, MLA's CudaMlaGradBytesPerToken / B, at cp = 1 and
//                 under MLA All2All by CudaMlaGradHeadsPerGroup's head groups) + the FFN
//                 gradients ([T, 3 f], or a block on "cuda")
//               + CP exchange blocks (CUDA All2All: T * B * (widest core input + output
//                 width)); Lightning AllGather states 2 * 2cp * H * Dh * Dh * 4; Lightning
//                 hybrid: the same for 2r chunks of H/u heads, and the exchange blocks
//                 T * 4 * 4 d; MLA ring (r = cp, u = 1) and hybrid: the ring's blocks and
//                 accumulators and one block's rebuilt keys, values and their gradients,
//                 u T * 4 * (5 W + 3 H/u (qk + v_head) + H/u), and under hybrid the exchange
//                 blocks T * 4 * H (2 qk + v_head)
//   runtime     "cuda": 0.6 GiB (CUDA context and libraries) + cuDNN's attention workspace: the
//               fp32 dQ accumulator of one group of g heads over the sequence, seq_len * g * qk *
//               4 (g = CudaAttentionHeadsPerCall of H / cp heads), or under MLA AllGather the
//               larger of a zigzag chunk's (chunk * g * (qk * 4 + 8), its g of H) and the cross
//               piece's staging: L * H * ((2 qk + 2 v) * 2 + qk * 4 + 8) + a 32K key block's k,
//               v, dk, dv, L = one zigzag chunk rounded up to a power of two
//               + with world > 1, NCCL: 1.3 GiB, and 0.85 GiB more when dp > 1 and cp > 1
//   precision   train.precision "fp8" on "cuda": the FP8 GEMM inputs of the blocks' linear layers,
//               1 byte an element: the weights with the transposed copy the backward's GEMMs take
//               (cuBLASLt's FP8 GEMMs read both operands K-major), 2 L (L = the blocks' linear
//               weight elements: ModelConfig minus embedding, norms and LM head), in place of
//               their 2 L of bf16 working copy (so 0 net); the activations
//               the backward keeps, T per element of each kept layer's inputs (their transposes;
//               Lightning: normed input, gated output; MLA: normed input, normed q_a output and
//               latent, attention output; FFN: normed input, SwiGLU output), the recomputing
//               layers one shared layer's (the larger kind); their row-major codes in one scratch,
//               T times the widest input (d, f or H v_head); and one output gradient in both
//               layouts, 2 T times the widest projection output. Less the bf16 activations FP8
//               leaves unwritten in the kept layers, 2 T (3 d + f) a Lightning layer (h, y, h2,
//               a) and 2 T (d + f) an MLA layer (h2, a): negative where those outweigh the codes.
//               "cpu": the emulation (worker/engine/numerics.h) holds its copies in fp32: bf16
//               and fp8 a 4 P working copy; fp8 also 4 L of FP8 weights, 4 T per kept activation
//               input element (no transposed copy) and 4 T (2 * widest + 3 d) of gradient copies.
//   MoE workspace: the backward's scratch of those rows (2 d + 3 F each, and the exchange's
//               send and receive rows, K d + rows d), the router's logits gradient and the
//               shared expert's 3 S a token
// train.offload ("cuda", n_layers > kCudaOffloadSlots = S): the activations hold S layer inputs
// instead of n_layers, T * B * (n_layers - S) * d less; host_bytes is that much pinned memory.
// `recompute_layers` is the number of leading layers that recompute (spec.train.recompute_layers
// once resolved; never kRecomputeAuto).
MemoryEstimate EstimateMemory(const JobSpec& spec, const std::vector<LayerModePlan>& layers,
                              int64_t recompute_layers);

// train.recompute "auto": the fewest leading layers to recompute so that the estimate fits in
// kRecomputeAutoFill of `device_memory_bytes` (the rest covers the estimate's error and the
// allocator's fragmentation); every layer when none fits that or no device is known (0 bytes).
inline constexpr double kRecomputeAutoFill = 0.9;
int64_t RecomputeLayersFor(const JobSpec& spec, const std::vector<LayerModePlan>& layers,
                           int64_t device_memory_bytes);

class CpPlanner {
 public:
  // Zigzag chunks (seq_len / (2 cp) tokens) shorter than this are rejected when cp > 1.
  static constexpr int64_t kMinTokensPerChunk = 16;

  // Plans `spec`. `device_memory_bytes` is the memory of the largest device the job could run
  // on (GPU memory, or host memory per CPU slot); 0 when unknown (no worker registered): the
  // memory estimate is then not checked and a warning says so. `topology` (null: the built-in
  // DefaultTopology of the job's resources) is what the cost model estimates with.
  //
  // Modes: "auto" is the design card's rule; "fastest" the candidate the cost model estimates
  // fastest (both layer types together, one Ulysses degree for both 2-D modes); a forced mode is
  // kept. With cp > 1 a warning names a rule pick estimated 20% or more slower than the fastest.
  //
  // MoE models: parallel.ep as given, or (absent) the smallest degree whose estimate fits the
  // device, every candidate in CpPlan::ep_estimates.
  CpPlan Plan(const JobSpec& spec, int64_t device_memory_bytes,
              const Topology* topology = nullptr) const;

 private:
  // Plan() once the modes' "fastest" and the experts' parallelism are resolved.
  CpPlan PlanDense(const JobSpec& spec, int64_t device_memory_bytes, const Topology& topo) const;
};

// The spec with `plan`'s decisions in place of what the spec left open: each layer type's mode
// (never "auto" or "fastest"), parallel.ulysses, parallel.ep (MoE models) and train.recompute as
// a number of layers. The
// job is planned once (by the coordinator, or by spindle-train run standalone) and its ranks run
// this spec as given: the trainer decides nothing again.
JobSpec PlannedSpec(const JobSpec& spec, const CpPlan& plan);
// Whether `spec` leaves nothing to decide: no "fastest" mode, no "auto" mode with cp > 1 (cp = 1
// splits nothing), a number of recomputing layers, and for a MoE model parallel.ep.
bool IsPlanned(const JobSpec& spec);

// "1.50 GiB", "12.0 MiB", "512 B".
std::string FormatBytes(int64_t bytes);

}  // namespace spindle
