// Numerics: the number formats the CPU model emulates (train.precision), and the one place where
// the model's tensors are rounded to them.
//
// bf16 storage: wherever the CUDA engine (cuda/cuda_model.cc) stores a tensor in bf16 (the
// residual stream and its gradient, every norm, projection, attention and FFN activation and
// activation gradient, the logits and their gradient, and the working copy of every weight), the
// CPU model rounds the fp32 tensor it has just produced to the nearest bf16 (Store, Weight). What
// the CUDA engine keeps in fp32 stays fp32 here: master weights, weight gradients, optimizer
// state, norm statistics (rstd), attention log-sum-exp, Lightning states, GEMM accumulation.
// Kernel-internal roundings (cuDNN's bf16 probabilities, a fused kernel's order of operations)
// are not emulated.
//
// FP8 (an Fp8Recipe): the blocks' linear layers (every projection of a layer but MLA's per-head
// ones; not the embedding, the LM head or the attention cores) and the MoE experts (below) multiply
// FP8 inputs: the activation x and weight W in the forward, the output gradient dy with the same W
// and x in the backward, each quantized with its own tensorwise scale and multiplied as codes, the
// inverse scales applied to the fp32 accumulator (GemmOperand) as cuBLASLt does. That is the FFN's
// w1, w3 and w2, Lightning's qkv, gate and out, and MLA's q_a, kv_a and out; MLA's q (or q_b) and
// kv_b stay bf16, because the GPU runs their backward by groups of heads (and kv_b, under
// AllGather, over gathered latent rows), which one tensorwise scale per GEMM input does not follow.
// Activations are quantized where the GPU fuses the cast into the producing kernel, from its fp32
// result before any bf16 store: the attention and FFN RMSNorm outputs, SwiGLU's output and the
// Lightning group norm + gate output; MLA's attention output, which no kernel of ours produces,
// from its stored bf16. Output gradients are quantized from their stored bf16 values; weights from
// the fp32 masters once per pass (RefreshWeights: the values the GPU's cast after each optimizer
// step produces).
//
// Under the blockwise recipe (train.fp8_recipe "blockwise", kernels/cpu/fp8.h) each operand holds
// its block-scaled values (power-of-two scales, so exactly the products a block-scaled GEMM sums;
// the operand's inverse_scale is 1): activations and output gradients in 1 x 128 blocks along their
// rows, plus a second copy in 128 x 1 blocks down their columns that the weight gradient's GEMM
// reads (GemmOperand::wgrad_values; the contraction there runs over the tokens), weights in
// 128 x 128 blocks. Jointly quantized gradients (Lightning's q, k, v) form their row blocks along
// the joint row, as the GPU holds the Lightning q, k and v gradients in one [T, 3d] buffer.
//
// The MoE experts (moe/moe_ffn.h) under FP8: their grouped GEMMs (w1 and w3 on the expert input
// rows, w2 on SwiGLU's output, and the backward's on the output gradient of each) multiply FP8
// inputs as the dense linears do, E4M3 forward and E5M2 gradients; the router (fp32) and the
// shared expert (bf16, as the GPU runs it) stay outside the recipe. Each expert's matrix of a
// stacked [El, out, in] weight is quantized on its own (ExpertWeight): tensorwise one scale per
// expert, as the CUDA engine's Fp8ExpertBlock; blockwise 128 x 128 blocks within the expert's
// matrix. The activations and gradients are the rows the rank's experts hold, [R, cols] for all
// its local experts together (GroupedActivation, GroupedGradient):
// - Tensorwise: one scale over all R rows, as the CUDA engine (cuda/cuda_moe_ffn.cc) quantizes
//   them: the gathered inputs from the stored bf16 h2 (the dense FFN's norm quantizes its fp32
//   output instead), at h2's amax at ep = 1 (every token is among the rows, so it is the rows'
//   amax) and at the received rows' own amax at ep > 1; SwiGLU's output from its fp32 result
//   before the bf16 store (SwiGluForwardFp8); the output gradients (the combine's, w1's and
//   w3's, each on its own) from their stored bf16. The scale then depends on ep: a rank knows
//   the amax of the rows it holds, which are its own tokens' at ep = 1 and the rows every EP
//   rank routes to its experts at ep > 1 (one scale per grouped GEMM input).
// - Blockwise: rows in 1 x 128 blocks, each row's own and so the same at every ep; the weight
//   gradient's 128 x 1 copies in blocks that start afresh at each boundary of `bounds`: the
//   caller's segments of rows, one per (expert, source rank), the rows one rank sends to one
//   expert in its token order. These are the same rows in the same order at every ep (at ep = 1
//   the rank's rows of the expert), so under blockwise scaling every FP8 value of the MoE FFN is
//   the same at any ep for the same tokens per rank; only the GEMMs' summation order differs.
//   (MoeExpertSegments, moe/moe_exchange.h, gives the CPU and the CUDA engine the same
//   segments from their plans; cuda/cuda_moe_ffn.cc quantizes in them.)
// What the emulation cannot match: the CUDA engine pads each expert's rows to a multiple of 16
// (zero rows, which change no amax and no product); cuBLASLt's fast-accumulation FP8 forward and
// the grouped GEMMs' summation order are not emulated. Without bf16 storage one expert that every
// token chooses is the dense FFN bit for bit (tests/engine/test_moe_fp8.cc).
//
// Outlier injection (Numerics::outliers, experiments only: bench/fp8_outlier_run.sh and
// spindle-train's developer flag --inject-outliers, no job-spec field): in each dense layer one
// value of the FFN's input (the FFN norm's output h2 [T, d], which w1 and w3 read and FP8
// quantizes) is multiplied by a factor, at a token and a channel fixed per layer by a seed, as an
// LLM's massive activations sit at one channel of one token (FfnInput). The forward multiplies it
// before any rounding, and the backward multiplies that element's gradient by the same factor
// (FfnInputGradient), under every precision alike: the multiplication is part of the model, so
// bf16 and both FP8 recipes train the same model and differ only in their roundings. Not
// thread-safe; one per model.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "common/job_spec.h"
#include "kernels/cpu/fp8.h"
#include "worker/engine/params.h"
#include "worker/engine/tensor.h"

namespace spindle {

// One injected outlier per dense layer (see the header comment; experiments only).
struct OutlierInjection {
  float factor = 1000.0f;  // the value at the layer's site is multiplied by it
  uint64_t seed = 0;       // picks each layer's site
};

struct Numerics {
  bool bf16_storage = false;                   // round to bf16 where the CUDA engine stores bf16
  std::optional<kernels::cpu::Fp8Recipe> fp8;  // the blocks' linear layers on FP8 inputs
  std::optional<OutlierInjection> outliers;    // experiments: not a rounding (exact() ignores it)
  bool exact() const { return !bf16_storage && !fp8.has_value(); }
};

// Where layer `layer`'s injected outlier sits in its FFN input [rows, cols]: a row (token) and a
// column (channel) from a hash of (seed, layer), the same for every pass over the same shape.
struct OutlierSite {
  int64_t row = 0, col = 0;
};
OutlierSite OutlierPosition(const OutlierInjection& o, int64_t layer, int64_t rows, int64_t cols);

// The CPU model's numerics for a job's train.precision: "auto" and "fp32": exact fp32; "bf16":
// bf16 storage; "fp8": bf16 storage and the Fp8Recipe of train.fp8_recipe (tensorwise or
// blockwise scaling), as the GPU's fp8 job stores bf16 around its FP8 GEMMs.
Numerics CpuNumerics(TrainPrecision precision,
                     TrainFp8Recipe recipe = TrainFp8Recipe::kTensorwise);

// One input of a GEMM: the values it multiplies and the factor its products carry (an FP8
// tensor's inverse scale, its values then being FP8 codes held as fp32; 1 otherwise).
struct GemmOperand {
  const float* values = nullptr;
  float inverse_scale = 1.0f;
  // Blockwise FP8: the same tensor in blocks down its columns, which the weight gradient's GEMM
  // reads instead of `values` (same layout); null: that GEMM reads `values`.
  const float* wgrad_values = nullptr;
  // The operand starting `elements` further into the same tensor (same scale).
  GemmOperand At(int64_t elements) const {
    return {values + elements, inverse_scale,
            wgrad_values == nullptr ? nullptr : wgrad_values + elements};
  }
  // As the weight gradient's GEMM reads it.
  GemmOperand ForWeightGradient() const {
    return wgrad_values == nullptr ? *this : GemmOperand{wgrad_values, inverse_scale};
  }
};

// The FP8 values of a tensor, kept while its GEMMs need them.
struct Fp8Copy {
  Tensor injected;  // the input with its injected outlier (Numerics::outliers), before rounding
  Tensor values;
  Tensor columns;  // blockwise: the weight gradient's copy (blocks down the columns)
  Tensor joint;    // blockwise joint gradients: the parts side by side in one row, scratch
  float inverse_scale = 1.0f;
};

class NumericsEmulator {
 public:
  // `linear_weights`: the parameters that are the blocks' linear layers' weights;
  // `expert_weights`: the MoE layers' stacked expert weights [El, out, in].
  void Set(const Numerics& n, std::vector<int> linear_weights,
           std::vector<int> expert_weights = {});
  const Numerics& numerics() const { return n_; }

  // Rebuilds the weights' working copies from the masters in `params` (call before each pass;
  // nothing to do for exact numerics).
  void RefreshWeights(ParamSet& params);
  // The working copy of parameter i (bf16-rounded with bf16 storage, else the master).
  const float* Weight(ParamSet& params, int i) const;
  // Parameter i as a GEMM input: its FP8 copy when FP8 applies to it, else Weight(). `fp8`
  // false: the working copy even under FP8 (a GEMM the recipe does not cover).
  GemmOperand LinearWeight(ParamSet& params, int i, bool fp8 = true) const;
  // Expert `expert` [out, in] of the stacked expert weight i [El, out, in] as a GEMM input: its
  // FP8 values and that expert's scale under FP8 (i one of Set's expert_weights), else its
  // working copy.
  GemmOperand ExpertWeight(ParamSet& params, int i, int64_t expert) const;

  // x [rows, cols] as an activation GEMM input: quantized into `slot` under FP8, else x itself.
  GemmOperand Activation(const float* x, int64_t rows, int64_t cols, Fp8Copy& slot) const;
  // Layer `layer`'s FFN input x [rows, cols] as a GEMM input: with Numerics::outliers, x with the
  // layer's outlier multiplied in (a copy, slot.injected), then as Activation() takes it (rounded
  // to bf16 under bf16 storage without FP8, as the stored input the GEMM then reads); without,
  // Activation(x).
  GemmOperand FfnInput(int64_t layer, const float* x, int64_t rows, int64_t cols,
                       Fp8Copy& slot) const;
  // The rows x [rows, cols] that the MoE experts' grouped GEMMs read (see the header comment) as
  // one GEMM input: quantized into `slot` under FP8 (tensorwise one scale over all rows;
  // blockwise the weight gradient's column blocks restart at each of `bounds`, ascending row
  // offsets from 0 to rows, repeats allowed), else x itself. An expert's operand is At() its
  // first row.
  GemmOperand GroupedActivation(const float* x, int64_t rows, int64_t cols,
                                const std::vector<int64_t>& bounds, Fp8Copy& slot) const;
  // The same for an output gradient dy [rows, cols] of the experts' GEMMs (E5M2).
  GemmOperand GroupedGradient(const float* dy, int64_t rows, int64_t cols,
                              const std::vector<int64_t>& bounds, Fp8Copy& slot) const;
  // The gradient dx [rows, cols] of that input, in place: the outlier's element times the factor
  // (the chain rule through the multiplication); nothing without Numerics::outliers.
  void FfnInputGradient(int64_t layer, float* dx, int64_t rows, int64_t cols) const;
  // dy [rows, cols] as an output-gradient GEMM input: quantized into `slot` under FP8, else dy.
  GemmOperand Gradient(const float* dy, int64_t rows, int64_t cols, Fp8Copy& slot) const;
  // Several output gradients [rows, cols each] quantized as one tensor [rows, parts x cols] (one
  // scale; blockwise, row blocks along the joint row), as the GPU holds the Lightning q, k and v
  // gradients in one [T, 3d] buffer: out[i] is parts[i]'s operand.
  void JointGradients(const std::vector<const float*>& parts, int64_t rows, int64_t cols,
                      Fp8Copy& slot, std::vector<GemmOperand>* out) const;

  // A tensor [n] just produced, as the CUDA engine stores it: bf16-rounded in place with bf16
  // storage, else left as is.
  void Store(float* x, int64_t n) const;

 private:
  // `bounds` (nullable): the segments of rows whose column blocks are formed apart (blockwise).
  GemmOperand Quantize(const float* const* parts, int count, int64_t rows, int64_t cols,
                       kernels::cpu::Fp8Format f, Fp8Copy& slot, GemmOperand* out,
                       const std::vector<int64_t>* bounds = nullptr) const;
  bool blockwise() const {
    return n_.fp8 && n_.fp8->scaling == kernels::cpu::Fp8Scaling::kBlockwise;
  }

  Numerics n_;
  std::vector<int> linear_, experts_;
  std::vector<char> is_linear_, is_expert_;  // by parameter index, after RefreshWeights
  std::vector<float> weight_inverse_scale_;  // by parameter index (FP8)
  // By parameter index: each expert's inverse scale of a stacked expert weight (FP8).
  std::vector<std::vector<float>> expert_inverse_scale_;
  Tensor working_;                           // [params.numel()]: bf16 copies (bf16 storage)
  Tensor fp8_;  // [params.numel()]: FP8 codes of the linear weights (FP8)
};

}  // namespace spindle
