// JobSpec: the training job description of DESIGN.md section 5. One JSON file feeds
// `spindle submit`, `spindle plan` and the standalone `spindle-train`. Parsing rejects unknown
// fields, fields given twice and impossible values with one error that names the field (e.g.
// "job spec: train.lr: must be > 0, got -1"), and syntax errors by line and column. Plain data;
// no thread-safety concerns.
//
// Example:
//   {"name": "recall", "model": {"preset": "tiny"},
//    "data": {"source": "synthetic:recall"}, "seq_len": 4096,
//    "parallel": {"cp": 1, "dp": 1, "lightning_mode": "auto", "mla_mode": "auto",
//                 "verify": "first"},
//    (2-D modes: "parallel": {"cp": 8, "ulysses": 2, "lightning_mode": "hybrid",
//                             "mla_mode": "hybrid"}; see ParallelSpec)
//    "train": {"steps": 200, "lr": 3e-3, "warmup_steps": 20, "schedule": "cosine",
//              "optimizer": "adamw", "grad_clip": 1.0, "seed": 1, "recompute": "auto",
//              "precision": "auto"},
//    "checkpoint": {"dir": "/tmp/ckpt", "every": 50, "async": true, "replicas": {"every": 5}},
//    "resources": "cpu", "max_restarts": 3, "priority": 0}
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "nlohmann/json.hpp"

namespace spindle {

enum class DataKind { kSynthetic, kTokens, kText };

struct DataSpec {
  std::string source;  // "synthetic:<task>", "tokens:<path>" or "text:<path>"
  DataKind kind = DataKind::kSynthetic;
  std::string task;        // synthetic task name ("recall", "copy")
  std::string path;        // token or text file
  int64_t token_bytes = 2; // tokens: 2 (uint16) or 4 (uint32), little-endian
  int64_t eos_id = -1;     // tokens: required; text and synthetic: fixed by the source
  // Synthetic recall: pairs per document and the distance (tokens) between the pairs and queries.
  int64_t recall_pairs = 8;
  int64_t recall_gap = 1024;
  // Files: the document length that counts their attention work, sum(L^2) / sum(L) over the
  // documents L as the job's sequences cut them (a token sees doc_span / 2 earlier keys of its
  // document on average); 0: unknown (the planner then counts one document a sequence, the worst
  // case). `spindle submit`, `spindle plan` and a standalone `spindle-train` measure it from a
  // bounded sample of the file when the spec leaves it out (common/document_span.h); a spec may
  // give it for a file the submitting host cannot read. JSON "data.doc_span", tokens, >= 1; only
  // for tokens: and text: sources (a synthetic source's documents are known).
  double doc_span = 0;
};

// The document length that counts a synthetic source's attention work, E[D^2] / E[D] over its
// documents D (a token sees span / 2 earlier keys of its document on average), from the
// generator's formats (worker/engine/data.cc): recall documents are 4 pairs + gap + 3 tokens, copy
// documents 2 m + 2 with m uniform in [gap / 2, gap] (at least 8). 0 for files.
double SyntheticAttentionSpan(const DataSpec& d);
// The document length the planner counts attention with: SyntheticAttentionSpan for synthetic
// sources, data.doc_span for files (0: unknown).
double AttentionSpan(const DataSpec& d);

// How a layer type runs under context parallelism (DESIGN.md section 3). kRing is MLA's only;
// kHybrid is Ulysses over groups of parallel.ulysses ranks combined with Ring (MLA) or with the
// AllGather of chunk states (Lightning) across the groups. kAuto and kFastest exist only in specs:
// the planner resolves them (the design card's rule, or the cost model's fastest estimate).
enum class CpMode { kAuto, kAllGather, kAll2All, kRing, kHybrid, kFastest };
// "auto", "allgather", "all2all", "ring", "hybrid", "fastest"; CpModeFromName is its inverse
// (nullopt for any other name).
std::string_view CpModeName(CpMode m);
std::optional<CpMode> CpModeFromName(std::string_view name);

// parallel: cp ranks share each sequence (zigzag chunks), dp replicas. `ulysses` (u) is the size
// of the Ulysses groups of the 2-D "hybrid" modes: the CP group splits into r = cp / u groups of
// u consecutive CP ranks (cp/cp_groups.h). Valid (CheckCpModes in common/cp_modes.h, applied
// when the spec is parsed): u = 1 unless a mode is "hybrid"; a "hybrid" mode needs u >= 2,
// u dividing cp with r = cp / u >= 2, and u dividing model.n_heads. "ring" is MLA's only.
//
// `verify` (JSON "parallel.verify") says when the parity canary (worker/engine/parity_canary.h)
// checks the layout against a cp = 1, ep = 1 reference before a step: kVerifyOff ("off") never;
// kVerifyFirst ("first", the default) before the first step the job runs at a layout it has not
// verified yet (a fresh start, or a resume from a checkpoint verified at another layout); a
// positive N before those steps and before every step whose number is a multiple of N.
// parallel.elastic: the job may run at any world (dp x cp ranks) in [min_world, max_world]
// instead of only the one its cp x dp names (which must lie in that range and is where it starts).
// When a rank's worker is lost and no replacement can be placed within `wait_s` seconds, the
// coordinator re-plans the job at the largest world it can place now (planner/planned_job.h's
// ReplanForWorld: cp, dp, modes, ulysses, ep) and resumes from the last checkpoint; once devices
// are free for a larger world (up to max_world), it grows at the job's next checkpoint.
// `batch` says what a resize does to the tokens of a step (dp x micro_batches x seq_len; cp never
// changes them):
//   kKeep ("keep", the default): kept as submitted; a world whose dp differs runs
//         micro_batches = dp x micro_batches (submitted) / dp', and worlds whose dp' does not
//         divide that product are not used. The loss curve is the fixed-layout run's.
//   kScale ("scale"): micro_batches stays; the step's tokens follow dp'.
// An elastic job needs checkpoint.dir (a resize resumes from the last checkpoint).
struct ElasticSpec {
  enum class Batch { kKeep, kScale };
  int64_t min_world = 0;  // 0: not elastic (the JSON object absent)
  int64_t max_world = 0;
  double wait_s = 60;
  Batch batch = Batch::kKeep;
  bool enabled() const { return min_world > 0; }
};
// "keep" / "scale".
std::string_view ElasticBatchName(ElasticSpec::Batch b);

struct ParallelSpec {
  static constexpr int64_t kVerifyOff = 0;
  static constexpr int64_t kVerifyFirst = -1;
  int64_t cp = 1;
  int64_t dp = 1;
  CpMode lightning_mode = CpMode::kAuto;
  CpMode mla_mode = CpMode::kAuto;
  int64_t ulysses = 1;
  int64_t ep = 0;
  int64_t verify = kVerifyFirst;
  ElasticSpec elastic;
  int64_t world() const { return cp * dp; }
};

// train.precision: the number formats a step computes in (DESIGN.md section 4).
//   "auto" (default): fp32 on resources "cpu"; bf16 activations (fp32 master weights, gradients
//          and accumulation) on "cuda".
//   "fp32": everything fp32; resources "cpu" only.
//   "bf16": "cuda": as "auto". "cpu": fp32 arithmetic with the CUDA engine's storage roundings
//          emulated (worker/engine/numerics.h), to compare the two engines element by element.
//   "fp8":  the blocks' linear layers take FP8 inputs (kernels/cpu/fp8.h's recipe); the rest as
//          "bf16". "cpu": emulated, the reference of the GPU's FP8 kernels.
enum class TrainPrecision { kAuto, kFp32, kBf16, kFp8 };
std::string_view TrainPrecisionName(TrainPrecision p);

// train.fp8_recipe, how an "fp8" job's GEMM inputs are scaled (kernels/cpu/fp8.h):
//   "tensorwise" (default): one scale per tensor from its current amax.
//   "blockwise": DeepSeek-V3's: power-of-two scales per 1 x 128 block of activations and output
//                gradients (128 x 1 for the weight gradient's copies) and per 128 x 128 block of
//                weights. "cpu" emulates it; "cuda" runs it for the dense linears and the MoE
//                experts alike.
enum class TrainFp8Recipe { kTensorwise, kBlockwise };
std::string_view TrainFp8RecipeName(TrainFp8Recipe r);

struct TrainSpec {
  int64_t steps = 100;
  int64_t micro_batches = 1;  // sequences per rank per step (gradient accumulation)
  double lr = 3e-3;
  double min_lr = 0.0;      // cosine floor
  int64_t warmup_steps = 0;
  std::string schedule = "cosine";  // "cosine" | "constant"
  std::string optimizer = "adamw";  // "adamw" | "sgd"
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double momentum = 0.0;  // sgd
  double grad_clip = 1.0; // 0 disables clipping
  // z-loss of the LM head (PaLM): each valid token's objective adds z_loss * logsumexp(logits)^2,
  // which keeps the logits' normaliser near 1 (bf16 and FP8 logits lose less). The reported
  // loss stays the cross-entropy. 0 disables it; at most 1.
  double z_loss = 0.0;
  uint64_t seed = 1;
  // Activation recompute: the first `recompute_layers` layers keep only their input (on the GPU
  // also each MLA layer's attention output) through the forward and re-run the rest of the layer
  // before its backward: less memory, ~1/3 more GEMMs in those layers. JSON "recompute": false
  // (0), true (every layer), a number of layers, or "auto" (kRecomputeAuto): the planner picks the
  // fewest recomputed layers whose memory estimate fits the device (RecomputeLayersFor).
  static constexpr int64_t kRecomputeAuto = -1;
  int64_t recompute_layers = 0;
  // Layer-input offload (resources "cuda" only): between the forward and the backward the layers'
  // inputs wait in pinned host memory, the device keeping kCudaOffloadSlots of them; the copies
  // overlap the compute. Frees (n_layers - kCudaOffloadSlots) x seq_len / cp x d_model bf16 a rank
  // for the same pinned host memory. JSON "offload": false (default) or true.
  bool offload = false;
  TrainPrecision precision = TrainPrecision::kAuto;  // JSON "precision"; see TrainPrecision
  TrainFp8Recipe fp8_recipe = TrainFp8Recipe::kTensorwise;  // JSON "fp8_recipe" (fp8 jobs)
};

struct CheckpointSpec {
  std::string dir;     // empty: no checkpoints
  int64_t every = 0;   // steps between checkpoints; 0: only at the end
  int64_t keep = 2;    // complete checkpoints kept
  // true: the step snapshots the state into host memory and a background thread writes it
  // (worker/engine/checkpoint_writer.h); false: the step writes it itself (the synchronous path).
  bool async = true;
  // "replicas": {"every": n}: in-memory snapshots every n steps (0, or no "replicas": none), so
  // that a gang restarting after a rank death resumes from the newest snapshot instead of the
  // last file checkpoint (worker/engine/replica_store.h). Each snapshot is the state a file
  // checkpoint of that step holds, in the same format (every rank holds the same parameters and
  // optimizer state; expert shards are gathered as for a file): rank 0 keeps one copy in its
  // worker's replica directory (RAM: tmpfs) and sends one to the first rank on another worker,
  // which keeps it in its worker's; each newer complete snapshot replaces the older one, so a
  // worker holds at most two per job (the newest complete one and the one being written). A
  // restart resumes from the newest snapshot any rank's worker still holds when it is newer than
  // the newest file checkpoint, else from the file as without replicas. Needs checkpoint.dir.
  int64_t replicas_every = 0;
};

struct JobSpec {
  std::string name;
  ModelConfig model;
  DataSpec data;
  int64_t seq_len = 4096;
  ParallelSpec parallel;
  TrainSpec train;
  CheckpointSpec checkpoint;
  std::string resources = "cpu";  // "cpu" | "cuda"
  int64_t max_restarts = 3;
  int64_t priority = 0;  // higher runs first

  nlohmann::json ToJson() const;  // canonical form; ParseJobSpec(ToJson()) round-trips
};

// The rules of parallel.ep against the model and the world (ParallelSpec); ep = 0, not decided
// yet, passes. InvalidArgument naming parallel.ep otherwise.
absl::Status CheckExpertParallel(const ParallelSpec& p, const ModelConfig& m);

// The largest job spec text accepted (InvalidArgument beyond it).
inline constexpr size_t kMaxJobSpecBytes = 1 << 20;

absl::StatusOr<JobSpec> ParseJobSpec(std::string_view json_text);
absl::StatusOr<JobSpec> ParseJobSpecJson(const nlohmann::json& j);
absl::StatusOr<JobSpec> LoadJobSpec(const std::string& path);

// How many specs this process has parsed (each ParseJobSpecJson call, ParseJobSpec's and
// LoadJobSpec's included), for tests that show a path parses its spec once. Thread-safe.
int64_t JobSpecParsesForTesting();

}  // namespace spindle
