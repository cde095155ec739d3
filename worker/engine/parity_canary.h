// The parity canary (parallel.verify, common/job_spec.h): before a step, a job's gang runs one
// forward and backward, with no update, of a slice of its own data at its planned layout (its CP
// group and modes, Ulysses groups, expert parallelism, the data-parallel reduction) and compares
// the loss and every tensor's gradient, after the gang's reduction, with a reference run of the
// same slice and the same parameters at cp = 1 and ep = 1 on one rank. A layout that does not
// compute what the model says (a CP mode dropping a rank's contribution, a wrong group, a
// misrouted expert shard) shows as a gradient error far above the precision's rounding, and the
// job fails before it trains.
//
// Written once for every engine over StepBackend (step_backend.h): the layout pass runs on the
// job's own backend, the reference on a second backend of the same engine built for cp = 1 and
// ep = 1 (ReferenceBackendFactory), alive only during the canary (on a GPU it holds a second copy
// of the whole model while it lives). Every rank runs the reference itself, so every rank compares
// its own gradients (its expert shards against the matching rows of the whole tensors); the
// per-tensor errors are then gathered over the world, so every rank reaches the same verdict and
// the gang fails or goes on together. The reference also runs at kParityPerturbedReferences
// rounding-level perturbations of the parameters, which measure how much each tensor's gradient
// moves with rounding alone (parity_canary.cc says why that is needed beside the bounds).
//
// The slice: the leading ParitySliceTokens() tokens of the step's first sequence (replica 0's),
// whole documents and cut ones alike, so documents cross the canary's chunk and rank boundaries as
// they do in training; every replica runs the same slice, and the gradients are averaged over the
// world's valid targets as a step averages them.
//
// State: the canary changes no parameter, optimizer state, balancing bias or data position. It
// overwrites the job backend's gradients (a step zeroes them before its passes) and starts a MoE
// step's statistics (BeginStep, which the next step starts again); its collectives' amounts stay
// in the communicators for the caller to take.
//
// Not thread-safe; called by the trainer between steps, by every rank of the gang.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "nlohmann/json.hpp"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/recompute.h"
#include "worker/engine/step_backend.h"

namespace spindle {

// Zigzag chunk length the canary aims at (tokens): the slice is 2 cp chunks of
// min(kParityChunkTokens, the job's own chunk), so that it is cheap at any seq_len, splits as the
// job's sequences do (a multiple of 16 tokens a rank where the job's chunk is) and holds chunks of
// at least the planner's minimum (CpPlanner::kMinTokensPerChunk), which the job's chunk does.
inline constexpr int64_t kParityChunkTokens = 64;

// The slice length for a job of `seq_len` tokens at `cp` (seq_len divisible by 2 cp).
int64_t ParitySliceTokens(int64_t seq_len, int64_t cp, int64_t chunk_tokens = kParityChunkTokens);

// The largest relative gradient error that passes, from one per-precision table: exact fp32 (the
// CPU's "auto" and "fp32") 1e-3; bf16 storage (the GPU's "auto", "bf16") and FP8 inputs ("fp8",
// on either engine; a job's check runs it at bf16, ParityPrecision) 1e-1.
double ParityTolerance(TrainPrecision precision, const std::string& resources);

// The numbers a job's check runs at, on both sides: the job's own, but an fp8 job's at bf16. Its
// tensorwise FP8 scales come from each rank's own tokens (by design: the GPU computes them so),
// which differ from one rank's scale over the whole slice by the FP8 grid itself: correct cp = 2
// layouts of the tiny preset differ from cp = 1 by 0.5 to 6 times a tensor's largest gradient
// (test_precision.cc bounds fp8's CP gradients by a relative L2 of 0.4, bf16's by 0.03), where a
// broken layout is lost; at bf16 the layout's own arithmetic is what differs. The scales' per-rank
// rule is the FP8 recipe's, tested by itself.
TrainPrecision ParityPrecision(TrainPrecision job);

// The layout as the event and messages name it: "cp=2 dp=1 ep=1 lightning=allgather mla=all2all"
// (with "ulysses=U" for the hybrid modes).
std::string DescribeParityLayout(const ParallelSpec& parallel, const CpModes& modes);
// What a verification covers, as checkpoints record it (TrainState::verified_layout): the layout,
// the engine and the precision.
std::string ParityLayoutKey(const JobSpec& spec, const CpModes& modes);
// Whether the layout needs verifying at all: false at cp = 1 with ep <= 1 (the layout is the
// reference).
bool ParityApplies(const ParallelSpec& parallel);
// Whether the canary runs before step `next_step` (1-based) of a job with parallel.verify
// `verify`, given the layout key the job has verified (`verified`, possibly another layout's or
// empty) and its current one: the first step at an unverified layout, and under a positive N
// every step that is a multiple of N (at a layout ParityApplies to).
bool ParityDue(const ParallelSpec& parallel, int64_t next_step, const std::string& verified,
               const std::string& key);

// The gang as the trainer built it: this rank's place in it, how the step shards and reduces.
struct ParityGang {
  std::string layout;  // DescribeParityLayout of the job
  int64_t rank = 0, world = 1;
  int64_t cp = 1, cp_rank = 0, dp = 1, ep = 1;
  // Ulysses group size the batch is sharded with (ShardForCp's `ulysses`): parallel.ulysses under
  // a hybrid mode at cp > 1, else 1.
  int64_t shard_ulysses = 1;
  CpModes modes;
  Recompute recompute;
  // The Gloo world on host buffers (parameters' expert shards, errors, the loss); null only when
  // world == 1.
  Communicator* world_comm = nullptr;
  // Where the step sums gradients on the device (StepBackend::AllReduceGrads): the world's device
  // communicator, and the expert-data-parallel group's (null when that group is one rank). Null
  // device_world: the gradients are summed on the host over world_comm and expert_dp.
  Communicator* device_world = nullptr;
  Communicator* expert_dp = nullptr;
};

// Builds the reference: a backend of the job's engine and model for cp = 1, ep = 1, with the
// job's precision set (its initial parameters are replaced).
using ReferenceBackendFactory = std::function<absl::StatusOr<std::unique_ptr<StepBackend>>()>;

struct ParityOptions {
  TrainPrecision precision = TrainPrecision::kAuto;
  std::string resources = "cpu";
  int64_t chunk_tokens = kParityChunkTokens;
  int64_t worst_tensors = 5;  // rows of the result's table
};

// One row of the comparison (parity_canary.cc explains the measure): for a tensor (or the loss)
// rel_error = max |g - g_ref| / max |g_ref|; noise = the reference's own sensitivity to
// rounding-level changes, in the same units; excess = max |g - g_ref| / (tolerance max |g_ref| +
// kParityNoiseFactor noise max |g_ref|): above 1 the tensor fails.
struct ParityTensorError {
  std::string name;  // a checkpoint tensor name, or "loss"
  double rel_error = 0;
  double noise = 0;
  double excess = 0;
};

// The rounding-sensitivity allowance: a tensor may differ from the reference by this many times
// what rounding-level perturbations of the reference move it, on top of the tolerance.
inline constexpr double kParityNoiseFactor = 4.0;
// The perturbed references' parameters: each one times 1 +- kParityPerturbation (2^-17).
inline constexpr double kParityPerturbation = 1.0 / 131072.0;
inline constexpr int kParityPerturbedReferences = 2;

struct ParityResult {
  // Nothing was compared: the layout is the reference (SkippedParity), or the reference did not
  // fit in the device's memory beside the job (ResourceExhausted on some rank).
  bool skipped = false;
  std::string reason;  // why it was skipped
  bool passed = true;
  double max_rel_error = 0;  // over every tensor and the loss
  double max_excess = 0;     // the verdict: passed iff <= 1
  double tolerance = 0;
  std::string layout;     // DescribeParityLayout
  std::string reference;  // what it was compared with
  int64_t tokens = 0;     // slice length
  int64_t tensors = 0;    // tensors compared
  double loss = 0, reference_loss = 0;
  std::vector<ParityTensorError> worst;  // the largest excesses first
  double seconds = 0;

  // {"event": "parity", "step": next_step, "passed", "max_rel_error", "max_excess",
  //  "tolerance", "measure", "layout", "reference", "tokens", "tensors", "loss",
  //  "reference_loss", "seconds", "worst": [{"tensor", "rel_error", "noise", "excess"}, ...]};
  //  skipped: {"event", "step", "skipped": true, "reason", "layout"}.
  nlohmann::json ToEvent(int64_t next_step) const;
  // One line for a failed check, naming the layout, the bound and the worst tensors.
  std::string FailureMessage() const;
};

// A result for a layout ParityApplies() does not cover.
ParityResult SkippedParity(const ParallelSpec& parallel, const CpModes& modes);

// Runs the canary on `sequence` (the step's first sequence, whole; its leading slice is used) with
// `eos_id`. Every rank of the gang calls it with the same sequence. Errors: a backend's or a
// collective's (a rank that fails names itself to the others, which end with Aborted); a
// reference that runs out of memory on any rank skips the check on every rank (a skipped result
// naming it). The verdict is the result's `passed` (when not skipped), the same on every rank.
absl::StatusOr<ParityResult> RunParityCanary(StepBackend& job, const ParityGang& gang,
                                             const std::vector<int32_t>& sequence, int32_t eos_id,
                                             const ReferenceBackendFactory& reference,
                                             const ParityOptions& options);

}  // namespace spindle
