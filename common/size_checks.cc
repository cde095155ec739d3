// Size bounds of a job spec (see size_checks.h).
#include "common/size_checks.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/job_spec.h"

namespace spindle {
namespace {

std::string Magnitude(double bytes) {
  return absl::StrFormat("about 2^%.1f bytes", std::log2(std::max(1.0, bytes)));
}

}  // namespace

absl::Status CheckSpecSizes(const JobSpec& spec) {
  const ModelConfig& m = spec.model;
  const MlaConfig& a = m.mla;
  const double d = static_cast<double>(m.d_model), H = static_cast<double>(m.n_heads);
  const double f = static_cast<double>(m.ffn_dim), layers = static_cast<double>(m.n_layers);
  const double qk = static_cast<double>(a.qk_nope_dim + a.qk_rope_dim);
  const double v = static_cast<double>(a.v_head_dim);
  const double latent = static_cast<double>(a.kv_lora_rank + a.qk_rope_dim);
  const double limit = static_cast<double>(kMaxSpecBytes);

  // Weights: every layer as wide as its widest kind (Lightning's 5 d^2, MLA's projections), the
  // FFN, the embedding and the LM head; fp32 weights, gradients and two optimizer moments.
  const double lightning = 5 * d * d;
  const double q = a.q_lora_rank > 0 ? a.q_lora_rank * (d + H * qk) : H * qk * d;
  const double mla = q + latent * d + H * (a.qk_nope_dim + v) * a.kv_lora_rank + d * H * v;
  const double weights =
      layers * (std::max(lightning, mla) + 3 * d * f) + 2 * static_cast<double>(m.vocab) * d;
  if (weights * 16 > limit)
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: model: its weights with their gradients and optimizer state would take ",
        Magnitude(weights * 16), ", more than the ", kMaxSpecBytes >> 50,
        " PiB any plan is sized to; reduce the model's widths or n_layers"));

  // Activations of one sequence: seq_len tokens x every layer x the widest value a token has in
  // any layer (the FFN's, the attention heads' queries, keys and values, the latent), with room
  // for the handful of such tensors a layer keeps and 4 bytes each.
  const double widest = std::max(
      {d, f, H * qk, H * (a.qk_nope_dim + v), H * v, latent, static_cast<double>(a.q_lora_rank)});
  const double tokens = static_cast<double>(spec.seq_len);
  const double activations = tokens * (layers + 1) * widest * 64;
  if (activations > limit)
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: seq_len: the activations of one sequence of ", spec.seq_len, " tokens through ",
        m.n_layers, " layers as wide as ", static_cast<int64_t>(widest), " values would take ",
        Magnitude(activations), ", more than the ", kMaxSpecBytes >> 50,
        " PiB any plan is sized to; reduce seq_len, n_layers or the model's widths"));
  // Logits of one sequence (the LM head's output rows, fp32, and their gradient).
  const double logits = tokens * static_cast<double>(m.vocab) * 8;
  if (logits > limit)
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: model.vocab: the logits of one sequence of ", spec.seq_len,
                     " tokens would take ", Magnitude(logits), ", more than the ",
                     kMaxSpecBytes >> 50, " PiB any plan is sized to"));
  return absl::OkStatus();
}

}  // namespace spindle
