// ModelConfig: the sizes of the DESIGN.md section 2 hybrid model (Lightning + MLA layers) and the
// named presets `tiny`, `small` and `1b`. Shared by the engine (to build the model), the
// coordinator (to plan and estimate memory) and the CLI. Plain data; no thread-safety concerns.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace spindle {

struct MlaConfig {
  int64_t q_lora_rank = 0;  // 0: q = Wq x; otherwise q = Wq_b RMSNorm(Wq_a x)
  int64_t kv_lora_rank = 32;
  int64_t qk_nope_dim = 16;
  int64_t qk_rope_dim = 16;
  int64_t v_head_dim = 16;
};

// The mixture-of-experts FFN (DESIGN.md section 2): with experts > 0 every layer from index
// first_dense on runs a sigmoid-routed MoE of `experts` SwiGLU experts of width expert_ffn, top_k
// of them a token, plus a shared SwiGLU of width shared_ffn (0: none), in place of the dense FFN.
// bias_rate is the aux-loss-free balancing bias's step, z_loss the router z-loss coefficient.
struct MoeConfig {
  int64_t experts = 0;  // 0: a dense model
  int64_t top_k = 0;
  int64_t expert_ffn = 0;
  int64_t shared_ffn = 0;
  double bias_rate = 1e-3;
  double z_loss = 0.0;
  int64_t first_dense = 0;
};

// The most experts a layer may have.
inline constexpr int64_t kMaxExperts = 4096;

// The largest layer count and head count a model may have, and the bound on its widths (d_model,
// the MLA ranks and head sizes; ffn_dim up to 8 times it).
inline constexpr int64_t kMaxLayers = 1024;
inline constexpr int64_t kMaxHeads = 1024;
inline constexpr int64_t kMaxModelWidth = 65536;

struct ModelConfig {
  std::string preset;  // empty when every size was given explicitly
  int64_t vocab = 257;
  int64_t d_model = 64;
  int64_t n_layers = 4;
  int64_t n_heads = 4;  // Lightning and MLA heads; Lightning head size is d_model / n_heads
  int64_t ffn_dim = 176;
  std::string layer_pattern = "LLLLLLLM";  // repeats over n_layers: L = Lightning, M = MLA
  MlaConfig mla;
  MoeConfig moe;
  double rope_theta = 10000.0;
  double norm_eps = 1e-6;

  int64_t head_dim() const { return d_model / n_heads; }
  // 'L' or 'M' for layer i.
  char LayerKind(int64_t i) const { return layer_pattern[i % layer_pattern.size()]; }
  int64_t NumLayersOfKind(char kind) const;
  // Whether layer i runs the MoE FFN (else the dense one), and how many layers do.
  bool IsMoeLayer(int64_t i) const { return moe.experts > 0 && i >= moe.first_dense; }
  int64_t NumMoeLayers() const;
  // Total parameter count (embedding and LM head included; every expert).
  int64_t NumParams() const;
  // The parameters one token runs through: NumParams with top_k of each MoE layer's experts.
  int64_t NumActiveParams() const;
  // Forward+backward FLOPs per token for a sequence of seq_len tokens that is one document (6N,
  // N the active parameters, for the matmuls plus the attention terms).
  double TrainFlopsPerToken(int64_t seq_len) const;
  // Forward+backward FLOPs of `tokens` tokens whose causal softmax attention spans
  // `attention_pairs` query-key pairs (sum over documents of L^2 / 2, AttentionPairs in
  // worker/engine/batch.h): what model FLOP utilisation counts.
  double TrainFlops(int64_t tokens, double attention_pairs) const;
  // Its parts: forward + backward FLOPs of one Lightning layer's chunked kernel (chunk 64) per
  // token, and of one MLA layer's softmax attention per causal query-key pair.
  double LightningFlopsPerToken() const;
  double AttentionFlopsPerPair() const;
  absl::Status Validate() const;
  nlohmann::json ToJson() const;
};

// Why the CUDA engine's kernels cannot run this config (empty when they can): Lightning head
// sizes (d_model / n_heads) 64 and 128 (tensor cores) or even ones up to 32 (the token path), in
// every context-parallel mode; MLA attention on cuDNN with qk (nope + rope) and v head sizes that
// are multiples of 8, at most 256. The planner refuses other shapes for resources "cuda" before
// a job is submitted, and the CUDA engine before any device work.
std::string CudaShapeProblem(const ModelConfig& c);

// The linear weights train.precision "fp8" runs as FP8 GEMMs, by tensor name (DESIGN.md's
// checkpoint names) with their [out, in] shape: each Lightning layer's qkv, gate and out
// projections, each MLA layer's q_a and kv_a down-projections and output projection, and each
// dense FFN's w1, w2 and w3 (MLA's q / q_b and kv_b up-projections, the MoE shared experts, the
// embedding, the norms and the LM head stay in bf16, the MoE routers in fp32; the MoE experts'
// stacked weights run in FP8 too, but each expert with its own scale, so both engines quantize
// them apart from this list). The one list the planner's memory estimate, the engines' FP8 weight copies and
// the shape check below all take.
struct LinearWeight {
  std::string name;
  int64_t out = 0, in = 0;
};
std::vector<LinearWeight> Fp8LinearWeights(const ModelConfig& c);

// Why train.precision "fp8" cannot run this config on "cuda" (empty when it can): cuBLASLt's FP8
// GEMMs need both dimensions of every Fp8LinearWeights weight, and of every expert of a MoE layer
// (whose stacked weights the CUDA engine quantizes with a scale per expert), to be multiples of
// 16. Checked by
// the planner (so `spindle plan` and Submit refuse it) and by the CUDA engine.
std::string CudaFp8ShapeProblem(const ModelConfig& c);

// The CUDA engine's MLA AllGather walks the gathered keys of a cross piece in blocks of this many
// rows (rebuilt per block from the latent), so its scratch follows this, not the sequence; the
// planner's memory estimate counts the same blocks.
inline constexpr int64_t kCudaMlaKeyBlock = 32768;

// The CUDA engine runs a layer's FFN over blocks of this many tokens wherever its [T, ffn_dim]
// activations are not kept for a backward (the FFN gradients, and the FFN of a layer that
// recomputes), so that scratch follows this, not the sequence; the planner counts the same.
inline constexpr int64_t kCudaFfnBlockRows = 32768;

// cuDNN's attention backward accumulates dQ in fp32 over every query of a call (T x heads x qk x 4
// bytes, outside Spindle's allocator). Heads are independent in attention, so the CUDA engine
// runs a long sequence's backward in groups of heads: CudaAttentionHeadsPerCall is the most heads,
// dividing `heads`, whose accumulator stays within kCudaDqAccumulatorBytes (at least one), or
// all of them when T is not a multiple of 4 (a group's statistics must stay 16-byte aligned).
// At 32K tokens and 16 heads of qk 192 that is all 16; at 128K, 8; at 256K, 4; from about 700K on,
// one head a call. The planner counts the same.
inline constexpr int64_t kCudaDqAccumulatorBytes = int64_t{1} << 30;
int64_t CudaAttentionHeadsPerCall(int64_t T, int64_t heads, int64_t qk);

// MLA's backward on one GPU (cp = 1) also takes the projections' gradients in those head groups
// when that holds less: each group's Q, K and kv_b output are copied into buffers of the group's
// width (cuDNN's gradients take their inputs' strides), its dQ, dK and dV go back through q_b and
// kv_b into fp32 sums over the groups, and only one group's gradients exist at a time.
// CudaMlaGradBytesPerToken is that scratch per token with `group_heads` heads a group (n_heads: one
// group, no copies and no fp32 sums); CudaMlaGradHeadsPerGroup the group the engine uses over T
// tokens: CudaAttentionHeadsPerCall's where it needs fewer bytes than one group, else n_heads. For
// the 1b model: one group up to 128K tokens (30.8 KB a token), groups of 4 heads at 256K (26.0 KB),
// of 2 from 384K (20.9 KB), of one from about 700K on (18.3 KB). At 256K, groups of 4, 2 and 1
// head take the same step time as one group (bench/cuda/NOTES.md). The planner counts the same.
// Under CP in MLA's All2All mode (all2all_cp > 1) the attention backward runs in the exchange's
// core and each rank's heads come back as one block of the received gradients, which the groups
// then are: n_heads / cp heads, read from the block without copies of the inputs
// (group_copies false), used where that holds less than one group (1b: 26.0 KB a token at cp =
// 2, 18.4 at cp = 8).
int64_t CudaMlaGradBytesPerToken(const ModelConfig& c, int64_t group_heads,
                                 bool group_copies = true);
int64_t CudaMlaGradHeadsPerGroup(const ModelConfig& c, int64_t T, int64_t all2all_cp = 1);

// With train.offload the CUDA engine keeps this many layer inputs on the device (a ring the
// others pass through on their way to and from pinned host memory), plus the head's input; the
// planner counts the same.
inline constexpr int64_t kCudaOffloadSlots = 3;

// `tiny` (CI-sized), `small` (the CPU peer's default size), `1b` (the GPU peer's size), and their
// mixture-of-experts forms `tiny-moe` (tiny with 8 experts of width 32, top 2, a shared expert of
// 32) and `moe` (1b with 64 experts of width 256, top 8, a shared expert of 1024: the peer's
// --moe 64,8,256,1024).
absl::StatusOr<ModelConfig> ModelPreset(std::string_view name);

// Parses the job spec's "model" object: {"preset": "tiny", ...overrides} or every size given
// explicitly. Errors name the offending field as "model.<field>".
absl::StatusOr<ModelConfig> ModelConfigFromJson(const nlohmann::json& j);

}  // namespace spindle
