// Job spec parsing, validation and canonical JSON (see job_spec.h).
#include "common/job_spec.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/cp_modes.h"
#include "common/json_fields.h"
#include "common/size_checks.h"
#include "common/status.h"
#include "common/text_bounds.h"

namespace spindle {
namespace {

// lightning_mode: auto, allgather, all2all, hybrid; mla_mode also ring.
absl::StatusOr<CpMode> ParseCpMode(JsonFields& f, const std::string& key) {
  std::string s = "auto";
  RETURN_IF_ERROR(f.ReadString(key, &s));
  const bool mla = key == "mla_mode";
  const std::optional<CpMode> m = CpModeFromName(s);
  if (m && (mla || *m != CpMode::kRing)) return *m;
  return f.Error(key,
                 absl::StrCat(mla ? "must be \"auto\", \"fastest\", \"allgather\", \"all2all\", "
                                    "\"ring\" or \"hybrid\""
                                  : "must be \"auto\", \"fastest\", \"allgather\", \"all2all\" or "
                                    "\"hybrid\"",
                              ", got \"", ShortText(s), "\""));
}

absl::StatusOr<TrainPrecision> ParsePrecision(JsonFields& f) {
  std::string s = "auto";
  RETURN_IF_ERROR(f.ReadString("precision", &s));
  if (s == "auto") return TrainPrecision::kAuto;
  if (s == "fp32") return TrainPrecision::kFp32;
  if (s == "bf16") return TrainPrecision::kBf16;
  if (s == "fp8") return TrainPrecision::kFp8;
  return f.Error("precision", absl::StrCat("must be \"auto\", \"fp32\", \"bf16\" or \"fp8\", "
                                           "got \"",
                                           ShortText(s), "\""));
}

absl::StatusOr<TrainFp8Recipe> ParseFp8Recipe(JsonFields& f) {
  std::string s = "tensorwise";
  RETURN_IF_ERROR(f.ReadString("fp8_recipe", &s));
  if (s == "tensorwise") return TrainFp8Recipe::kTensorwise;
  if (s == "blockwise") return TrainFp8Recipe::kBlockwise;
  return f.Error("fp8_recipe", absl::StrCat("must be \"tensorwise\" or \"blockwise\", got \"",
                                            ShortText(s), "\""));
}

// parallel.verify: "off", "first" or a positive number of steps (at most the int64 range JSON
// integers are read in).
absl::StatusOr<int64_t> ParseVerify(const JsonFields& f, const nlohmann::json& v) {
  if (v.is_string()) {
    if (v.get<std::string>() == "off") return ParallelSpec::kVerifyOff;
    if (v.get<std::string>() == "first") return ParallelSpec::kVerifyFirst;
  } else if (v.is_number_unsigned()) {
    const uint64_t n = v.get<uint64_t>();
    if (n >= 1 && n <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return static_cast<int64_t>(n);
  } else if (v.is_number_integer() && v.get<int64_t>() >= 1) {
    return v.get<int64_t>();
  }
  return f.Error("verify", absl::StrCat("must be \"off\", \"first\" or a positive number of "
                                        "steps, got ",
                                        DescribeJson(v)));
}

// parallel.elastic (see ElasticSpec); `world` is the spec's dp x cp.
absl::Status ParseElastic(const nlohmann::json& v, int64_t world, ElasticSpec* e) {
  JsonFields ef(v, "job spec", "parallel.elastic");
  RETURN_IF_ERROR(ef.CheckObject());
  e->max_world = world;
  RETURN_IF_ERROR(ef.ReadInt("min_world", &e->min_world, /*required=*/true));
  RETURN_IF_ERROR(ef.ReadInt("max_world", &e->max_world));
  RETURN_IF_ERROR(ef.ReadDouble("wait_s", &e->wait_s));
  std::string batch = "keep";
  RETURN_IF_ERROR(ef.ReadString("batch", &batch));
  RETURN_IF_ERROR(ef.Finish());
  constexpr int64_t kMaxWorld = 1024 * 4096;  // parallel.cp x parallel.dp at most
  if (e->min_world < 1 || e->min_world > kMaxWorld)
    return ef.Error("min_world",
                    absl::StrCat("must be in [1, ", kMaxWorld, "], got ", e->min_world));
  if (e->max_world < e->min_world || e->max_world > kMaxWorld)
    return ef.Error("max_world", absl::StrCat("must be in [min_world = ", e->min_world, ", ",
                                              kMaxWorld, "], got ", e->max_world));
  if (world < e->min_world || world > e->max_world)
    return ef.Error("", absl::StrCat("the job's world dp x cp = ", world,
                                     " must lie in [min_world, max_world] = [", e->min_world, ", ",
                                     e->max_world, "] (it starts there)"));
  if (!(e->wait_s >= 0 && e->wait_s <= 86400))
    return ef.Error("wait_s", absl::StrCat("must be in [0, 86400] seconds, got ", e->wait_s));
  if (batch == "keep") {
    e->batch = ElasticSpec::Batch::kKeep;
  } else if (batch == "scale") {
    e->batch = ElasticSpec::Batch::kScale;
  } else {
    return ef.Error("batch",
                    absl::StrCat("must be \"keep\" or \"scale\", got \"", ShortText(batch), "\""));
  }
  return absl::OkStatus();
}

nlohmann::json VerifyJson(int64_t verify) {
  if (verify == ParallelSpec::kVerifyOff) return "off";
  if (verify == ParallelSpec::kVerifyFirst) return "first";
  return verify;
}

// train.recompute: false, true, a number of layers in [0, n_layers], or "auto".
absl::StatusOr<int64_t> ParseRecompute(const JsonFields& f, const nlohmann::json& v,
                                       int64_t n_layers) {
  if (v.is_boolean()) return v.get<bool>() ? n_layers : 0;
  if (v.is_string() && v.get<std::string>() == "auto") return TrainSpec::kRecomputeAuto;
  if (v.is_number_integer()) {  // signed or unsigned
    const bool in_range = v.is_number_unsigned()
                              ? v.get<uint64_t>() <= static_cast<uint64_t>(n_layers)
                              : v.get<int64_t>() >= 0 && v.get<int64_t>() <= n_layers;
    if (in_range) return v.get<int64_t>();
  }
  return f.Error("recompute",
                 absl::StrCat("must be false, true, \"auto\" or a number of layers in [0, ",
                              n_layers, "], got ", DescribeJson(v)));
}

// A path a trainer opens: at most kMaxPathBytes, no control characters (a NUL byte would end the
// path early where the system reads it, naming another place than the one checked).
absl::Status CheckPathText(const JsonFields& f, const std::string& key, const std::string& path) {
  if (path.size() > kMaxPathBytes)
    return f.Error(key,
                   absl::StrCat("must be at most ", kMaxPathBytes, " bytes, got ", path.size()));
  for (size_t i = 0; i < path.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(path[i]);
    if (c < 0x20 || c == 0x7F)
      return f.Error(key, absl::StrCat("must not contain control characters, got byte 0x",
                                       absl::Hex(c, absl::kZeroPad2), " at offset ", i));
  }
  return absl::OkStatus();
}

absl::Status ParseData(const nlohmann::json& j, DataSpec* d) {
  JsonFields f(j, "job spec", "data");
  RETURN_IF_ERROR(f.CheckObject());
  RETURN_IF_ERROR(f.ReadString("source", &d->source, /*required=*/true));
  RETURN_IF_ERROR(f.ReadInt("token_bytes", &d->token_bytes));
  RETURN_IF_ERROR(f.ReadInt("eos_id", &d->eos_id));
  RETURN_IF_ERROR(f.ReadInt("recall_pairs", &d->recall_pairs));
  RETURN_IF_ERROR(f.ReadInt("recall_gap", &d->recall_gap));
  RETURN_IF_ERROR(f.ReadDouble("doc_span", &d->doc_span));
  RETURN_IF_ERROR(f.Finish());
  RETURN_IF_ERROR(CheckPathText(f, "source", d->source));
  const std::string& s = d->source;
  if (absl::StartsWith(s, "synthetic:")) {
    d->kind = DataKind::kSynthetic;
    d->task = s.substr(10);
    if (d->task != "recall" && d->task != "copy")
      return f.Error("source", absl::StrCat("unknown synthetic task \"", ShortText(d->task),
                                            "\" (known: recall, copy)"));
  } else if (absl::StartsWith(s, "tokens:")) {
    d->kind = DataKind::kTokens;
    d->path = s.substr(7);
    if (!f.Has("eos_id")) return f.Error("eos_id", "is required for a token file");
  } else if (absl::StartsWith(s, "text:")) {
    d->kind = DataKind::kText;
    d->path = s.substr(5);
  } else {
    return f.Error("source", absl::StrCat("must start with \"synthetic:\", \"tokens:\" or "
                                          "\"text:\", got \"",
                                          ShortText(s), "\""));
  }
  if (d->kind != DataKind::kSynthetic && d->path.empty()) return f.Error("source", "names no file");
  if (d->token_bytes != 2 && d->token_bytes != 4)
    return f.Error("token_bytes", absl::StrCat("must be 2 or 4, got ", d->token_bytes));
  if (d->kind == DataKind::kTokens && d->eos_id < 0)
    return f.Error("eos_id", absl::StrCat("must be >= 0, got ", d->eos_id));
  if (d->recall_pairs < 1 || d->recall_pairs > 64)
    return f.Error("recall_pairs", absl::StrCat("must be in [1, 64], got ", d->recall_pairs));
  if (d->recall_gap < 0)
    return f.Error("recall_gap", absl::StrCat("must be >= 0, got ", d->recall_gap));
  if (f.Has("doc_span")) {
    if (d->kind == DataKind::kSynthetic)
      return f.Error("doc_span",
                     "is for tokens: and text: sources (a synthetic source's "
                     "documents are known)");
    if (!(d->doc_span >= 1 && d->doc_span <= 1e15))
      return f.Error("doc_span", absl::StrCat("must be a document length in [1, 1e15] tokens, got ",
                                              d->doc_span));
  }
  return absl::OkStatus();
}

nlohmann::json RecomputeJson(int64_t layers, int64_t n_layers) {
  if (layers == TrainSpec::kRecomputeAuto) return "auto";
  if (layers == 0) return false;
  if (layers == n_layers) return true;
  return layers;
}

}  // namespace

double SyntheticAttentionSpan(const DataSpec& d) {
  if (d.kind != DataKind::kSynthetic) return 0;
  if (d.task == "recall") return 4.0 * static_cast<double>(d.recall_pairs) +
                                 static_cast<double>(d.recall_gap) + 3.0;
  // Copy: len = 2 m + 2 with m = max(8, h + u), u uniform in [0, h], h = gap / 2: the u with
  // h + u < 8 give m = 8, the rest m over [max(8, h), 2 h]. Sums in closed form (doubles: the gap
  // is unbounded).
  const double h = static_cast<double>(d.recall_gap / 2);
  const double eights = h < 8 ? std::min(h, 7 - h) + 1 : 0;
  const double a = std::max(8.0, h), b = 2 * h;
  const double n = b >= a ? b - a + 1 : 0;
  const double sm = n > 0 ? (a + b) * n / 2 : 0;
  const double sm2 = n > 0 ? b * (b + 1) * (2 * b + 1) / 6 - (a - 1) * a * (2 * a - 1) / 6 : 0;
  const double sum = 2 * sm + 2 * n + 18 * eights;
  const double sum_sq = 4 * sm2 + 8 * sm + 4 * n + 324 * eights;
  return sum_sq / sum;
}

double AttentionSpan(const DataSpec& d) {
  return d.kind == DataKind::kSynthetic ? SyntheticAttentionSpan(d) : d.doc_span;
}

std::string_view TrainFp8RecipeName(TrainFp8Recipe r) {
  return r == TrainFp8Recipe::kBlockwise ? "blockwise" : "tensorwise";
}

std::string_view TrainPrecisionName(TrainPrecision p) {
  switch (p) {
    case TrainPrecision::kAuto:
      return "auto";
    case TrainPrecision::kFp32:
      return "fp32";
    case TrainPrecision::kBf16:
      return "bf16";
    case TrainPrecision::kFp8:
      return "fp8";
  }
  return "auto";
}

std::string_view CpModeName(CpMode m) {
  switch (m) {
    case CpMode::kAuto:
      return "auto";
    case CpMode::kAllGather:
      return "allgather";
    case CpMode::kAll2All:
      return "all2all";
    case CpMode::kRing:
      return "ring";
    case CpMode::kHybrid:
      return "hybrid";
    case CpMode::kFastest:
      return "fastest";
  }
  return "auto";
}

std::optional<CpMode> CpModeFromName(std::string_view name) {
  for (CpMode m :
       {CpMode::kAuto, CpMode::kAllGather, CpMode::kAll2All, CpMode::kRing, CpMode::kHybrid,
        CpMode::kFastest})
    if (name == CpModeName(m)) return m;
  return std::nullopt;
}

namespace {
// JobSpecParsesForTesting's count: the one process-wide value of this file, a monotone counter
// that nothing but tests reads.
std::atomic<int64_t>& SpecParses() {
  static std::atomic<int64_t> parses{0};
  return parses;
}
}  // namespace

int64_t JobSpecParsesForTesting() { return SpecParses().load(std::memory_order_relaxed); }

absl::StatusOr<JobSpec> ParseJobSpecJson(const nlohmann::json& j) {
  SpecParses().fetch_add(1, std::memory_order_relaxed);
  JsonFields f(j, "job spec", "");
  RETURN_IF_ERROR(f.CheckObject());
  JobSpec s;
  RETURN_IF_ERROR(f.ReadString("name", &s.name, /*required=*/true));
  if (s.name.empty() || s.name.size() > 128) return f.Error("name", "must be 1-128 characters");
  for (char c : s.name)
    if (!(isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.'))
      return f.Error("name", absl::StrCat("may only hold letters, digits, '-', '_' and '.', got \"",
                                          s.name, "\""));

  const nlohmann::json* model = f.Sub("model");
  if (!model) return f.Error("model", "is required");
  ASSIGN_OR_RETURN(s.model, ModelConfigFromJson(*model));

  const nlohmann::json* data = f.Sub("data");
  if (!data) return f.Error("data", "is required");
  RETURN_IF_ERROR(ParseData(*data, &s.data));

  RETURN_IF_ERROR(f.ReadInt("seq_len", &s.seq_len, /*required=*/true));
  if (s.seq_len < 2 || s.seq_len > (int64_t{1} << 24))
    return f.Error("seq_len", absl::StrCat("must be in [2, 16777216], got ", s.seq_len));

  if (const nlohmann::json* p = f.Sub("parallel")) {
    JsonFields pf(*p, "job spec", "parallel");
    RETURN_IF_ERROR(pf.CheckObject());
    RETURN_IF_ERROR(pf.ReadInt("cp", &s.parallel.cp));
    RETURN_IF_ERROR(pf.ReadInt("dp", &s.parallel.dp));
    ASSIGN_OR_RETURN(s.parallel.lightning_mode, ParseCpMode(pf, "lightning_mode"));
    ASSIGN_OR_RETURN(s.parallel.mla_mode, ParseCpMode(pf, "mla_mode"));
    RETURN_IF_ERROR(pf.ReadInt("ulysses", &s.parallel.ulysses));
    RETURN_IF_ERROR(pf.ReadInt("ep", &s.parallel.ep));
    if (const nlohmann::json* v = pf.Sub("verify")) {
      ASSIGN_OR_RETURN(s.parallel.verify, ParseVerify(pf, *v));
    }
    const nlohmann::json* elastic = pf.Sub("elastic");  // read below, once cp and dp are
    RETURN_IF_ERROR(pf.Finish());
    if (s.parallel.cp < 1 || s.parallel.cp > 1024)
      return pf.Error("cp", absl::StrCat("must be in [1, 1024], got ", s.parallel.cp));
    if (s.parallel.dp < 1 || s.parallel.dp > 4096)
      return pf.Error("dp", absl::StrCat("must be in [1, 4096], got ", s.parallel.dp));
    if (elastic != nullptr)
      RETURN_IF_ERROR(ParseElastic(*elastic, s.parallel.world(), &s.parallel.elastic));
    if (pf.Has("ep") && (s.parallel.ep < 1 || s.parallel.ep > kMaxExperts))
      return pf.Error("ep", absl::StrCat("must be in [1, ", kMaxExperts, "], got ", s.parallel.ep));
  }

  if (const nlohmann::json* t = f.Sub("train")) {
    JsonFields tf(*t, "job spec", "train");
    TrainSpec& tr = s.train;
    RETURN_IF_ERROR(tf.CheckObject());
    RETURN_IF_ERROR(tf.ReadInt("steps", &tr.steps));
    RETURN_IF_ERROR(tf.ReadInt("micro_batches", &tr.micro_batches));
    RETURN_IF_ERROR(tf.ReadDouble("lr", &tr.lr));
    RETURN_IF_ERROR(tf.ReadDouble("min_lr", &tr.min_lr));
    RETURN_IF_ERROR(tf.ReadInt("warmup_steps", &tr.warmup_steps));
    RETURN_IF_ERROR(tf.ReadString("schedule", &tr.schedule));
    RETURN_IF_ERROR(tf.ReadString("optimizer", &tr.optimizer));
    RETURN_IF_ERROR(tf.ReadDouble("weight_decay", &tr.weight_decay));
    RETURN_IF_ERROR(tf.ReadDouble("beta1", &tr.beta1));
    RETURN_IF_ERROR(tf.ReadDouble("beta2", &tr.beta2));
    RETURN_IF_ERROR(tf.ReadDouble("eps", &tr.eps));
    RETURN_IF_ERROR(tf.ReadDouble("momentum", &tr.momentum));
    RETURN_IF_ERROR(tf.ReadDouble("grad_clip", &tr.grad_clip));
    RETURN_IF_ERROR(tf.ReadDouble("z_loss", &tr.z_loss));
    RETURN_IF_ERROR(tf.ReadUint("seed", &tr.seed));
    if (const nlohmann::json* rc = tf.Sub("recompute")) {
      ASSIGN_OR_RETURN(tr.recompute_layers, ParseRecompute(tf, *rc, s.model.n_layers));
    }
    RETURN_IF_ERROR(tf.ReadBool("offload", &tr.offload));
    ASSIGN_OR_RETURN(tr.precision, ParsePrecision(tf));
    ASSIGN_OR_RETURN(tr.fp8_recipe, ParseFp8Recipe(tf));
    RETURN_IF_ERROR(tf.Finish());
    if (tr.steps < 1) return tf.Error("steps", absl::StrCat("must be >= 1, got ", tr.steps));
    if (tr.micro_batches < 1)
      return tf.Error("micro_batches", absl::StrCat("must be >= 1, got ", tr.micro_batches));
    if (!(tr.lr > 0)) return tf.Error("lr", absl::StrCat("must be > 0, got ", tr.lr));
    if (tr.min_lr < 0 || tr.min_lr > tr.lr)
      return tf.Error("min_lr", absl::StrCat("must be in [0, lr], got ", tr.min_lr));
    if (tr.warmup_steps < 0)
      return tf.Error("warmup_steps", absl::StrCat("must be >= 0, got ", tr.warmup_steps));
    if (tr.schedule != "cosine" && tr.schedule != "constant")
      return tf.Error("schedule", absl::StrCat("must be \"cosine\" or \"constant\", got \"",
                                               ShortText(tr.schedule), "\""));
    if (tr.optimizer != "adamw" && tr.optimizer != "sgd")
      return tf.Error("optimizer", absl::StrCat("must be \"adamw\" or \"sgd\", got \"",
                                                ShortText(tr.optimizer), "\""));
    if (tr.weight_decay < 0) return tf.Error("weight_decay", "must be >= 0");
    if (!(tr.beta1 >= 0 && tr.beta1 < 1)) return tf.Error("beta1", "must be in [0, 1)");
    if (!(tr.beta2 >= 0 && tr.beta2 < 1)) return tf.Error("beta2", "must be in [0, 1)");
    if (!(tr.eps > 0)) return tf.Error("eps", "must be > 0");
    if (!(tr.momentum >= 0 && tr.momentum < 1)) return tf.Error("momentum", "must be in [0, 1)");
    if (tr.grad_clip < 0) return tf.Error("grad_clip", "must be >= 0 (0 disables clipping)");
    if (!(tr.z_loss >= 0.0 && tr.z_loss <= 1.0))
      return tf.Error("z_loss", absl::StrCat("must be in [0, 1] (0 disables it), got ", tr.z_loss));
  }

  if (const nlohmann::json* c = f.Sub("checkpoint")) {
    JsonFields cf(*c, "job spec", "checkpoint");
    RETURN_IF_ERROR(cf.CheckObject());
    RETURN_IF_ERROR(cf.ReadString("dir", &s.checkpoint.dir));
    RETURN_IF_ERROR(cf.ReadInt("every", &s.checkpoint.every));
    RETURN_IF_ERROR(cf.ReadInt("keep", &s.checkpoint.keep));
    RETURN_IF_ERROR(cf.ReadBool("async", &s.checkpoint.async));
    if (const nlohmann::json* r = cf.Sub("replicas")) {
      JsonFields rf(*r, "job spec", "checkpoint.replicas");
      RETURN_IF_ERROR(rf.CheckObject());
      RETURN_IF_ERROR(rf.ReadInt("every", &s.checkpoint.replicas_every, /*required=*/true));
      RETURN_IF_ERROR(rf.Finish());
      if (s.checkpoint.replicas_every < 0)
        return rf.Error("every", absl::StrCat("must be >= 0 (0: no replicas), got ",
                                              s.checkpoint.replicas_every));
    }
    RETURN_IF_ERROR(cf.Finish());
    RETURN_IF_ERROR(CheckPathText(cf, "dir", s.checkpoint.dir));
    if (s.checkpoint.every < 0)
      return cf.Error("every", absl::StrCat("must be >= 0, got ", s.checkpoint.every));
    if (s.checkpoint.keep < 1)
      return cf.Error("keep", absl::StrCat("must be >= 1, got ", s.checkpoint.keep));
  }

  RETURN_IF_ERROR(f.ReadString("resources", &s.resources));
  if (s.resources != "cpu" && s.resources != "cuda")
    return f.Error("resources", absl::StrCat("must be \"cpu\" or \"cuda\", got \"",
                                             ShortText(s.resources), "\""));
  RETURN_IF_ERROR(f.ReadInt("max_restarts", &s.max_restarts));
  if (s.max_restarts < 0 || s.max_restarts > 1000)
    return f.Error("max_restarts", absl::StrCat("must be in [0, 1000], got ", s.max_restarts));
  RETURN_IF_ERROR(f.ReadInt("priority", &s.priority));
  RETURN_IF_ERROR(f.Finish());

  // Cross-field rules that need no cluster knowledge.
  if (absl::Status st = CheckCpModes(s.parallel, s.model.n_heads); !st.ok())
    return absl::InvalidArgumentError(absl::StrCat("job spec: ", st.message()));
  RETURN_IF_ERROR(CheckExpertParallel(s.parallel, s.model));
  if (s.parallel.elastic.enabled() && s.checkpoint.dir.empty())
    return absl::InvalidArgumentError(
        "job spec: parallel.elastic: needs checkpoint.dir (a resize resumes from the job's last "
        "checkpoint)");
  if (s.checkpoint.replicas_every > 0 && s.checkpoint.dir.empty())
    return absl::InvalidArgumentError(
        "job spec: checkpoint.replicas: needs checkpoint.dir (a restart falls back to the job's "
        "file checkpoints when no replica survives)");
  if (s.train.offload && s.resources != "cuda")
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: train.offload: only resources \"cuda\" offload layer inputs to host memory "
        "(resources is \"",
        s.resources, "\"); remove it or set it to false"));
  if (s.train.fp8_recipe != TrainFp8Recipe::kTensorwise &&
      s.train.precision != TrainPrecision::kFp8)
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: train.fp8_recipe: \"", std::string(TrainFp8RecipeName(s.train.fp8_recipe)),
        "\" scales FP8 inputs, and train.precision is \"",
        std::string(TrainPrecisionName(s.train.precision)),
        "\"; set precision \"fp8\" or drop fp8_recipe"));
  if (s.train.precision == TrainPrecision::kFp32 && s.resources == "cuda")
    return absl::InvalidArgumentError(
        "job spec: train.precision: \"fp32\" runs on resources \"cpu\" only (the CUDA engine "
        "stores activations in bf16); use \"auto\", \"bf16\" or \"fp8\" with resources "
        "\"cuda\"");
  if (s.data.kind != DataKind::kTokens && s.model.vocab < 257)
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: model.vocab: must be >= 257 for byte-token data (\"",
                     ShortText(s.data.source), "\"), got ", s.model.vocab));
  if (s.data.kind == DataKind::kTokens && s.data.eos_id >= s.model.vocab)
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: data.eos_id: ", s.data.eos_id,
                     " is outside the vocabulary (model.vocab = ", s.model.vocab, ")"));
  // Every size the planner and the trainer derive from the spec fits in 64 bits.
  RETURN_IF_ERROR(CheckSpecSizes(s));
  return s;
}

std::string_view ElasticBatchName(ElasticSpec::Batch b) {
  return b == ElasticSpec::Batch::kScale ? "scale" : "keep";
}

absl::Status CheckExpertParallel(const ParallelSpec& p, const ModelConfig& m) {
  if (p.ep == 0 || p.ep == 1) return absl::OkStatus();
  auto err = [&p](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: parallel.ep: ", p.ep, " ", why));
  };
  if (m.moe.experts == 0)
    return err("needs a mixture-of-experts model (model.moe.experts > 0); a dense model runs "
               "with ep 1");
  if (m.moe.experts % p.ep != 0)
    return err(absl::StrCat("must divide model.moe.experts = ", m.moe.experts));
  if (p.world() % p.ep != 0)
    return err(absl::StrCat("must divide the world dp x cp = ", p.dp, " x ", p.cp, " = ",
                            p.world(), " (the experts are sharded over ranks of the job)"));
  return absl::OkStatus();
}

absl::StatusOr<JobSpec> ParseJobSpec(std::string_view json_text) {
  if (json_text.size() > kMaxJobSpecBytes)
    return absl::InvalidArgumentError(absl::StrCat("job spec: must be at most ", kMaxJobSpecBytes,
                                                   " bytes, got ", json_text.size()));
  ASSIGN_OR_RETURN(nlohmann::json j, ParseStrictJson(json_text, "job spec"));
  return ParseJobSpecJson(j);
}

absl::StatusOr<JobSpec> LoadJobSpec(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: \"", path, "\" is a directory, not a JSON file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("job spec: cannot open \"", path, "\""));
  std::stringstream ss;
  ss << in.rdbuf();
  auto spec = ParseJobSpec(ss.str());
  if (!spec.ok())
    return absl::Status(spec.status().code(), absl::StrCat(path, ": ", spec.status().message()));
  return spec;
}

nlohmann::json JobSpec::ToJson() const {
  nlohmann::json data_j = {{"source", data.source}};
  if (data.kind == DataKind::kTokens) {
    data_j["token_bytes"] = data.token_bytes;
    data_j["eos_id"] = data.eos_id;
  }
  if (data.kind == DataKind::kSynthetic) {
    data_j["recall_pairs"] = data.recall_pairs;
    data_j["recall_gap"] = data.recall_gap;
  }
  if (data.doc_span > 0) data_j["doc_span"] = data.doc_span;
  nlohmann::json model_j = model.ToJson();
  nlohmann::json j = {
      {"name", name},
      {"model", model_j},
      {"data", data_j},
      {"seq_len", seq_len},
      {"parallel",
       {{"cp", parallel.cp},
        {"dp", parallel.dp},
        {"lightning_mode", std::string(CpModeName(parallel.lightning_mode))},
        {"mla_mode", std::string(CpModeName(parallel.mla_mode))}}},
      {"train",
       {{"steps", train.steps},
        {"micro_batches", train.micro_batches},
        {"lr", train.lr},
        {"min_lr", train.min_lr},
        {"warmup_steps", train.warmup_steps},
        {"schedule", train.schedule},
        {"optimizer", train.optimizer},
        {"weight_decay", train.weight_decay},
        {"beta1", train.beta1},
        {"beta2", train.beta2},
        {"eps", train.eps},
        {"momentum", train.momentum},
        {"grad_clip", train.grad_clip},
        {"seed", train.seed},
        {"recompute", RecomputeJson(train.recompute_layers, model.n_layers)}}},
      {"checkpoint",
       {{"dir", checkpoint.dir}, {"every", checkpoint.every}, {"keep", checkpoint.keep}}},
      {"resources", resources},
      {"max_restarts", max_restarts},
      {"priority", priority}};
  // Written only when set, so a spec that does not offload stays readable by trainers that
  // predate the field (a cluster upgraded one daemon at a time).
  if (train.offload) j["train"]["offload"] = true;
  if (train.z_loss != 0.0) j["train"]["z_loss"] = train.z_loss;
  // Only the 2-D modes use it: the canonical form of every other job stays as it was.
  if (parallel.ulysses != 1) j["parallel"]["ulysses"] = parallel.ulysses;
  if (parallel.ep > 0) j["parallel"]["ep"] = parallel.ep;
  // Written only when not the default, as the fields above.
  if (parallel.verify != ParallelSpec::kVerifyFirst)
    j["parallel"]["verify"] = VerifyJson(parallel.verify);
  if (parallel.elastic.enabled())
    j["parallel"]["elastic"] = {{"min_world", parallel.elastic.min_world},
                                {"max_world", parallel.elastic.max_world},
                                {"wait_s", parallel.elastic.wait_s},
                                {"batch", std::string(ElasticBatchName(parallel.elastic.batch))}};
  if (train.precision != TrainPrecision::kAuto)
    j["train"]["precision"] = std::string(TrainPrecisionName(train.precision));
  if (train.fp8_recipe != TrainFp8Recipe::kTensorwise)
    j["train"]["fp8_recipe"] = std::string(TrainFp8RecipeName(train.fp8_recipe));
  if (!checkpoint.async) j["checkpoint"]["async"] = false;
  if (checkpoint.replicas_every > 0)
    j["checkpoint"]["replicas"] = {{"every", checkpoint.replicas_every}};
  return j;
}

}  // namespace spindle
