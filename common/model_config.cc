// Model sizes, presets and their JSON form (see model_config.h).
#include "common/model_config.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/json_fields.h"
#include "common/status.h"

namespace spindle {

int64_t ModelConfig::NumLayersOfKind(char kind) const {
  int64_t n = 0;
  for (int64_t i = 0; i < n_layers; ++i) n += LayerKind(i) == kind;
  return n;
}

int64_t ModelConfig::NumMoeLayers() const {
  return moe.experts > 0 ? std::max<int64_t>(0, n_layers - moe.first_dense) : 0;
}

namespace {

// The parameters of one MoE FFN with `experts` of its experts counted: the router and its bias,
// those experts and the shared expert.
int64_t MoeFfnParams(const ModelConfig& c, int64_t experts) {
  const int64_t d = c.d_model;
  return c.moe.experts * d + c.moe.experts + experts * 3 * d * c.moe.expert_ffn +
         3 * d * c.moe.shared_ffn;
}

}  // namespace

int64_t ModelConfig::NumActiveParams() const {
  const int64_t moe_layers = NumMoeLayers();
  return NumParams() -
         moe_layers * (MoeFfnParams(*this, moe.experts) - MoeFfnParams(*this, moe.top_k));
}

int64_t ModelConfig::NumParams() const {
  const int64_t d = d_model, H = n_heads, Dh = head_dim();
  int64_t n = 2 * vocab * d + d;  // embedding, LM head, final norm
  const int64_t common = 2 * d;  // the two norms
  const int64_t la = 3 * d * d + d * d + d * d + 2 * Dh + d;
  const int64_t qk = mla.qk_nope_dim + mla.qk_rope_dim;
  int64_t ml = d * (mla.kv_lora_rank + mla.qk_rope_dim) + mla.kv_lora_rank +
               mla.kv_lora_rank * H * (mla.qk_nope_dim + mla.v_head_dim) + H * mla.v_head_dim * d;
  ml += mla.q_lora_rank > 0 ? d * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * H * qk
                            : d * H * qk;
  n += n_layers * common + NumLayersOfKind('L') * la + NumLayersOfKind('M') * ml;
  const int64_t moe_layers = NumMoeLayers();
  n += (n_layers - moe_layers) * 3 * d * ffn_dim + moe_layers * MoeFfnParams(*this, moe.experts);
  return n;
}

double ModelConfig::TrainFlopsPerToken(int64_t seq_len) const {
  const double T = static_cast<double>(seq_len);
  return seq_len > 0 ? TrainFlops(seq_len, T * T / 2.0) / T : 0.0;
}

double ModelConfig::LightningFlopsPerToken() const {
  // Intra-chunk QK^T, PV and the state read/update, x3 for forward + backward.
  const double Dh = static_cast<double>(head_dim());
  return 3.0 * 2.0 * n_heads * (64.0 * Dh * 2.0 + Dh * Dh * 2.0);
}

double ModelConfig::AttentionFlopsPerPair() const {
  // QK^T and PV over each pair, x3 for forward + backward.
  const double qk = static_cast<double>(mla.qk_nope_dim + mla.qk_rope_dim);
  return 3.0 * 2.0 * n_heads * (qk + mla.v_head_dim);
}

double ModelConfig::TrainFlops(int64_t tokens, double attention_pairs) const {
  const double non_embed = static_cast<double>(NumActiveParams() - vocab * d_model);
  return static_cast<double>(tokens) *
             (6.0 * non_embed + NumLayersOfKind('L') * LightningFlopsPerToken()) +
         NumLayersOfKind('M') * AttentionFlopsPerPair() * attention_pairs;
}

absl::Status ModelConfig::Validate() const {
  auto err = [](const std::string& field, const std::string& msg) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: model.", field, ": ", msg));
  };
  // Sizes past these bounds are typing mistakes (the largest published models are far inside
  // them); the bounds also keep every size product, and the planner's work, small.
  auto in = [&](const char* field, int64_t v, int64_t lo, int64_t hi) {
    return v >= lo && v <= hi
               ? absl::OkStatus()
               : err(field, absl::StrCat("must be in [", lo, ", ", hi, "], got ", v));
  };
  RETURN_IF_ERROR(in("vocab", vocab, 2, (int64_t{1} << 31) - 1));
  RETURN_IF_ERROR(in("d_model", d_model, 1, kMaxModelWidth));
  RETURN_IF_ERROR(in("n_layers", n_layers, 1, kMaxLayers));
  RETURN_IF_ERROR(in("n_heads", n_heads, 1, kMaxHeads));
  if (d_model % n_heads != 0)
    return err("n_heads", absl::StrCat("must divide d_model (", d_model, "), got ", n_heads));
  if (head_dim() % 2 != 0)
    return err("n_heads",
               absl::StrCat("head size d_model/n_heads must be even for RoPE, got ", head_dim()));
  RETURN_IF_ERROR(in("ffn_dim", ffn_dim, 1, kMaxModelWidth * 8));
  if (layer_pattern.empty()) return err("layer_pattern", "must not be empty");
  if (static_cast<int64_t>(layer_pattern.size()) > n_layers)
    return err(
        "layer_pattern",
        absl::StrCat("\"", ShortText(layer_pattern), "\" describes ", layer_pattern.size(),
                     " layers, more than n_layers = ", n_layers, "; its last ",
                     static_cast<int64_t>(layer_pattern.size()) - n_layers,
                     " would never be built (give a pattern of at most ", n_layers, " layers)"));
  for (char c : layer_pattern)
    if (c != 'L' && c != 'M')
      return err("layer_pattern",
                 absl::StrCat("may only hold 'L' and 'M', got \"", ShortText(layer_pattern), "\""));
  if (NumLayersOfKind('M') > 0) {
    RETURN_IF_ERROR(in("mla.q_lora_rank", mla.q_lora_rank, 0, kMaxModelWidth));
    RETURN_IF_ERROR(in("mla.kv_lora_rank", mla.kv_lora_rank, 1, kMaxModelWidth));
    RETURN_IF_ERROR(in("mla.qk_nope_dim", mla.qk_nope_dim, 0, kMaxModelWidth));
    RETURN_IF_ERROR(in("mla.qk_rope_dim", mla.qk_rope_dim, 2, kMaxModelWidth));
    if (mla.qk_rope_dim % 2 != 0)
      return err("mla.qk_rope_dim", absl::StrCat("must be even, got ", mla.qk_rope_dim));
    RETURN_IF_ERROR(in("mla.v_head_dim", mla.v_head_dim, 1, kMaxModelWidth));
  }
  if (moe.experts == 0) {
    for (const auto& [field, v] : {std::pair<const char*, int64_t>{"moe.top_k", moe.top_k},
                                   {"moe.expert_ffn", moe.expert_ffn},
                                   {"moe.shared_ffn", moe.shared_ffn},
                                   {"moe.first_dense", moe.first_dense}})
      if (v != 0)
        return err(field, absl::StrCat("is ", v, " but model.moe.experts is 0 (a dense model); ",
                                       "give model.moe.experts to use experts"));
  } else {
    RETURN_IF_ERROR(in("moe.experts", moe.experts, 1, kMaxExperts));
    if (moe.top_k < 1 || moe.top_k > moe.experts)
      return err("moe.top_k", absl::StrCat("must be in [1, moe.experts = ", moe.experts,
                                           "], got ", moe.top_k));
    RETURN_IF_ERROR(in("moe.expert_ffn", moe.expert_ffn, 1, kMaxModelWidth * 8));
    RETURN_IF_ERROR(in("moe.shared_ffn", moe.shared_ffn, 0, kMaxModelWidth * 8));
    RETURN_IF_ERROR(in("moe.first_dense", moe.first_dense, 0, n_layers - 1));
    if (!(moe.bias_rate >= 0.0 && moe.bias_rate <= 1.0))
      return err("moe.bias_rate", absl::StrCat("must be in [0, 1], got ", moe.bias_rate));
    if (!(moe.z_loss >= 0.0 && moe.z_loss <= 1.0))
      return err("moe.z_loss", absl::StrCat("must be in [0, 1], got ", moe.z_loss));
  }
  if (!(rope_theta > 1.0)) return err("rope_theta", "must be > 1");
  if (!(norm_eps > 0.0)) return err("norm_eps", "must be > 0");
  return absl::OkStatus();
}

nlohmann::json ModelConfig::ToJson() const {
  nlohmann::json j = {{"vocab", vocab},
                      {"d_model", d_model},
                      {"n_layers", n_layers},
                      {"n_heads", n_heads},
                      {"ffn_dim", ffn_dim},
                      {"layer_pattern", layer_pattern},
                      {"rope_theta", rope_theta},
                      {"norm_eps", norm_eps},
                      {"mla",
                       {{"q_lora_rank", mla.q_lora_rank},
                        {"kv_lora_rank", mla.kv_lora_rank},
                        {"qk_nope_dim", mla.qk_nope_dim},
                        {"qk_rope_dim", mla.qk_rope_dim},
                        {"v_head_dim", mla.v_head_dim}}}};
  if (moe.experts > 0)
    j["moe"] = {{"experts", moe.experts},       {"top_k", moe.top_k},
                {"expert_ffn", moe.expert_ffn}, {"shared_ffn", moe.shared_ffn},
                {"bias_rate", moe.bias_rate},   {"z_loss", moe.z_loss},
                {"first_dense", moe.first_dense}};
  if (!preset.empty()) j["preset"] = preset;
  return j;
}

absl::StatusOr<ModelConfig> ModelPreset(std::string_view name) {
  if (name == "tiny-moe" || name == "moe") {
    ASSIGN_OR_RETURN(ModelConfig c, ModelPreset(name == "moe" ? "1b" : "tiny"));
    c.preset = std::string(name);
    c.moe = name == "moe" ? MoeConfig{64, 8, 256, 1024} : MoeConfig{8, 2, 32, 32};
    return c;
  }
  ModelConfig c;
  c.preset = std::string(name);
  if (name == "tiny") {
    c.vocab = 257, c.d_model = 64, c.n_layers = 4, c.n_heads = 4, c.ffn_dim = 176;
    c.layer_pattern = "LLLM";
    c.mla = {0, 32, 16, 16, 16};
  } else if (name == "small") {  // the CPU peer's default size
    c.vocab = 257, c.d_model = 256, c.n_layers = 8, c.n_heads = 4, c.ffn_dim = 704;
    c.layer_pattern = "LLLLLLLM";
    c.mla = {0, 128, 32, 32, 64};
  } else if (name == "1b") {  // the GPU peer's default size
    c.vocab = 32000, c.d_model = 2048, c.n_layers = 16, c.n_heads = 16, c.ffn_dim = 5632;
    c.layer_pattern = "LLLLLLLM";
    c.mla = {768, 512, 128, 64, 128};
  } else {
    return absl::InvalidArgumentError(absl::StrCat("job spec: model.preset: unknown preset \"",
                                                   ShortText(name), "\" (known: tiny, small, 1b, tiny-moe, moe)"));
  }
  return c;
}

int64_t CudaAttentionHeadsPerCall(int64_t T, int64_t heads, int64_t qk) {
  if (heads <= 1 || T % 4 != 0) return std::max<int64_t>(1, heads);
  const int64_t per_head = T * qk * 4;
  for (int64_t g = heads; g > 1; --g)
    if (heads % g == 0 && g * per_head <= kCudaDqAccumulatorBytes) return g;
  return 1;
}

int64_t CudaMlaGradBytesPerToken(const ModelConfig& c, int64_t group_heads, bool group_copies) {
  const MlaConfig& m = c.mla;
  const int64_t H = c.n_heads, qk = m.qk_nope_dim + m.qk_rope_dim,
                kvw = m.qk_nope_dim + m.v_head_dim;
  const int64_t kv = m.kv_lora_rank, rd = m.qk_rope_dim, qr = m.q_lora_rank;
  // dO, the latent's gradients [d c_n | d k_r] and d c_n, d c, and q_a's dqa_n and dqa (bf16).
  const int64_t common = H * m.v_head_dim + (kv + rd) + 2 * kv + 2 * qr;
  // dQ, dK and kv_b's output gradient over every head.
  if (group_heads >= H) return 2 * (common + H * (2 * qk + kvw));
  // A group's gradients (and copies of its Q, K and kv_b's output); the fp32 sums of the latent's
  // gradients and of q_a's output gradient (without a q LoRA: the normed input's).
  return 2 * (common + (group_copies ? 2 : 1) * group_heads * (2 * qk + kvw)) +
         4 * (kv + rd + (qr > 0 ? qr : c.d_model));
}

int64_t CudaMlaGradHeadsPerGroup(const ModelConfig& c, int64_t T, int64_t all2all_cp) {
  const int64_t H = c.n_heads;
  if (all2all_cp > 1) {
    const int64_t g = H / all2all_cp;
    return CudaMlaGradBytesPerToken(c, g, false) < CudaMlaGradBytesPerToken(c, H) ? g : H;
  }
  const int64_t g = CudaAttentionHeadsPerCall(T, H, c.mla.qk_nope_dim + c.mla.qk_rope_dim);
  return g < H && CudaMlaGradBytesPerToken(c, g) < CudaMlaGradBytesPerToken(c, H) ? g : H;
}

std::string CudaShapeProblem(const ModelConfig& c) {
  const int64_t Dh = c.head_dim();
  if (c.NumLayersOfKind('L') > 0 && Dh != 64 && Dh != 128 && !(Dh % 2 == 0 && Dh <= 32))
    return absl::StrCat("Lightning head size d_model/n_heads = ", Dh,
                        " (the CUDA kernels take 64, 128, or an even size up to 32)");
  if (c.NumLayersOfKind('M') > 0) {
    const int64_t qk = c.mla.qk_nope_dim + c.mla.qk_rope_dim, vd = c.mla.v_head_dim;
    for (const auto& [what, n] :
         {std::pair<const char*, int64_t>{"qk_nope_dim + qk_rope_dim", qk}, {"v_head_dim", vd}})
      if (n % 8 != 0 || n > 256)
        return absl::StrCat("MLA head size ", what, " = ", n,
                            " (cuDNN attention takes multiples of 8 up to 256)");
  }
  return "";
}

std::vector<LinearWeight> Fp8LinearWeights(const ModelConfig& c) {
  std::vector<LinearWeight> out;
  const int64_t d = c.d_model, H = c.n_heads;
  const MlaConfig& m = c.mla;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = absl::StrCat("layers.", i, ".");
    if (c.LayerKind(i) == 'L') {
      out.push_back({p + "la.qkv.weight", 3 * d, d});
      out.push_back({p + "la.gate.weight", d, d});
      out.push_back({p + "la.out.weight", d, d});
    } else {
      if (m.q_lora_rank > 0) out.push_back({p + "mla.q_a.weight", m.q_lora_rank, d});
      out.push_back({p + "mla.kv_a.weight", m.kv_lora_rank + m.qk_rope_dim, d});
      out.push_back({p + "mla.out.weight", d, H * m.v_head_dim});
    }
    if (!c.IsMoeLayer(i)) {
      out.push_back({p + "ffn.w1.weight", c.ffn_dim, d});
      out.push_back({p + "ffn.w2.weight", d, c.ffn_dim});
      out.push_back({p + "ffn.w3.weight", c.ffn_dim, d});
    }
  }
  return out;
}

std::string CudaFp8ShapeProblem(const ModelConfig& c) {
  for (const LinearWeight& w : Fp8LinearWeights(c))
    if (w.out % 16 != 0 || w.in % 16 != 0)
      return absl::StrCat(w.name, " is ", w.out, " x ", w.in,
                          ", and cuBLASLt's FP8 GEMMs need widths that are multiples of 16");
  // The experts' grouped GEMMs (each expert [expert_ffn, d_model] and its transpose).
  if (c.moe.experts > 0 && (c.moe.expert_ffn % 16 != 0 || c.d_model % 16 != 0))
    return absl::StrCat("the experts are ", c.moe.expert_ffn, " x ", c.d_model,
                        " (moe.expert_ffn x d_model), and cuBLASLt's FP8 GEMMs need widths that "
                        "are multiples of 16");
  return "";
}

absl::StatusOr<ModelConfig> ModelConfigFromJson(const nlohmann::json& j) {
  JsonFields f(j, "job spec", "model");
  RETURN_IF_ERROR(f.CheckObject());
  ModelConfig c;
  std::string preset;
  RETURN_IF_ERROR(f.ReadString("preset", &preset));
  if (!preset.empty()) {
    ASSIGN_OR_RETURN(c, ModelPreset(preset));
  } else {
    for (const char* key : {"vocab", "d_model", "n_layers", "n_heads", "ffn_dim"})
      if (!f.Has(key)) return f.Error(key, "is required when no preset is given");
  }
  RETURN_IF_ERROR(f.ReadInt("vocab", &c.vocab));
  RETURN_IF_ERROR(f.ReadInt("d_model", &c.d_model));
  RETURN_IF_ERROR(f.ReadInt("n_layers", &c.n_layers));
  RETURN_IF_ERROR(f.ReadInt("n_heads", &c.n_heads));
  RETURN_IF_ERROR(f.ReadInt("ffn_dim", &c.ffn_dim));
  RETURN_IF_ERROR(f.ReadString("layer_pattern", &c.layer_pattern));
  RETURN_IF_ERROR(f.ReadDouble("rope_theta", &c.rope_theta));
  RETURN_IF_ERROR(f.ReadDouble("norm_eps", &c.norm_eps));
  if (const nlohmann::json* m = f.Sub("mla")) {
    JsonFields mf(*m, "job spec", "model.mla");
    RETURN_IF_ERROR(mf.CheckObject());
    RETURN_IF_ERROR(mf.ReadInt("q_lora_rank", &c.mla.q_lora_rank));
    RETURN_IF_ERROR(mf.ReadInt("kv_lora_rank", &c.mla.kv_lora_rank));
    RETURN_IF_ERROR(mf.ReadInt("qk_nope_dim", &c.mla.qk_nope_dim));
    RETURN_IF_ERROR(mf.ReadInt("qk_rope_dim", &c.mla.qk_rope_dim));
    RETURN_IF_ERROR(mf.ReadInt("v_head_dim", &c.mla.v_head_dim));
    RETURN_IF_ERROR(mf.Finish());
  }
  if (const nlohmann::json* m = f.Sub("moe")) {
    JsonFields mf(*m, "job spec", "model.moe");
    RETURN_IF_ERROR(mf.CheckObject());
    RETURN_IF_ERROR(mf.ReadInt("experts", &c.moe.experts));
    RETURN_IF_ERROR(mf.ReadInt("top_k", &c.moe.top_k));
    RETURN_IF_ERROR(mf.ReadInt("expert_ffn", &c.moe.expert_ffn));
    RETURN_IF_ERROR(mf.ReadInt("shared_ffn", &c.moe.shared_ffn));
    RETURN_IF_ERROR(mf.ReadDouble("bias_rate", &c.moe.bias_rate));
    RETURN_IF_ERROR(mf.ReadDouble("z_loss", &c.moe.z_loss));
    RETURN_IF_ERROR(mf.ReadInt("first_dense", &c.moe.first_dense));
    RETURN_IF_ERROR(mf.Finish());
  }
  RETURN_IF_ERROR(f.Finish());
  if (!f.Has("layer_pattern") && static_cast<int64_t>(c.layer_pattern.size()) > c.n_layers &&
      c.n_layers >= 1)
    return f.Error(
        "n_layers",
        absl::StrCat(c.n_layers, " is fewer than the ", c.layer_pattern.size(), " layers of the ",
                     preset.empty() ? "default" : "preset's", " layer_pattern \"", c.layer_pattern,
                     "\"; give a model.layer_pattern of at most ", c.n_layers,
                     " layers (\"L\" Lightning, \"M\" MLA)"));
  RETURN_IF_ERROR(c.Validate());
  return c;
}

}  // namespace spindle
