// TrainerEvent: one progress line of `spindle-train`'s stdout, parsed. The trainer prints one JSON
// object per line; lines that are not JSON objects with an "event" field are not events (they are
// ignored by the daemon, so the trainer may print other text too).
//
// Fields the daemon reads (every one optional except "event"; unknown fields are ignored):
//   "event":            "start" | "step" | "checkpoint" | "done" | "note" | "pulse" | "parity"
//                       (other names: kOther); "note": "message" belongs in the job's events;
//                       "pulse": the trainer is alive (--pulse-ms); "parity": the parity
//                       canary's verdict (worker/engine/parity_canary.h), fields below
//   "step":             int, the step just completed (checkpoint: the step saved; start: the
//                       step training starts from, 0 or the resumed checkpoint's step)
//   "total_steps":      int
//   "resumed_from_step": int, start events: the checkpoint's or in-memory replica's step the
//                       rank resumed from (0: none); sent with each progress report
//   "loss":             float
//   "tokens_per_s":     float, this rank's throughput (the job's is the sum over its ranks)
//   "lr", "grad_norm":  float
//   "elapsed_s":        float, seconds since the trainer started
//   "step_time_s" (or "step_s", as spindle-train prints it):
//                       float, wall time of this step (when absent the daemon uses the change of
//                       elapsed_s since the previous step line divided by the steps between them)
//   "mfu":              float in [0, 1], model FLOP utilisation
//   "mem_allocated_bytes", "mem_reserved_bytes", "mem_peak_bytes": int, device memory
//   "host_rss_bytes":   int (when absent the daemon reads the trainer's RSS from /proc)
//   "host_pinned_bytes": int, pinned host memory the trainer holds (train.offload's layer inputs)
//   "comm":             [{"collective": "all_gather", "layer_type": "lightning",
//                         "seconds": float, "bytes": int}, ...]: communication done during THIS
//                       step (increments, not running totals), one entry per (collective,
//                       layer_type); layer_type is e.g. "lightning", "mla", "grad" (gradient
//                       all-reduce), "other"
//   "moe":              {"layers": [int], "load_max_over_mean": [float], "bias_min": [float],
//                        "bias_max": [float], "router_lse_sq": [float]}: a MoE job's layers
//                       after the step, one entry each (Model::FinishMoeStep)
//   "path":             string, checkpoint directory (checkpoint events)
//   parity events:      "passed" (bool), "skipped" (bool), "max_rel_error", "max_excess",
//                       "tolerance" (numbers), "layout", "reference", "reason" (strings),
//                       "worst": [{"tensor": string, "rel_error": number, "excess": number}]
//   "message":          string, free text
//
// Plain data; no thread-safety concerns.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace spindle {

enum class TrainerEventKind { kStart, kStep, kCheckpoint, kDone, kNote, kPulse, kParity, kOther };

struct CommStat {
  std::string collective;
  std::string layer_type;
  double seconds = 0.0;
  double bytes = 0.0;
};

// One MoE layer after a step: its max/mean expert load, its balancing biases' range and the mean
// logsumexp(router logits)^2 over its tokens.
struct MoeLayerStat {
  int64_t layer = 0;
  double load_max_over_mean = 0, bias_min = 0, bias_max = 0, router_lse_sq = 0;
};

// One row of a parity event's table of worst tensors.
struct ParityTensorStat {
  std::string tensor;
  double rel_error = 0, excess = 0;
};

struct TrainerEvent {
  TrainerEventKind kind = TrainerEventKind::kOther;
  std::string name;  // the "event" string as printed
  std::optional<int64_t> step;
  std::optional<int64_t> total_steps;
  std::optional<int64_t> resumed_from_step;  // start events
  std::optional<double> loss;
  std::optional<double> tokens_per_s;
  std::optional<double> lr;
  std::optional<double> grad_norm;
  std::optional<double> elapsed_s;
  std::optional<double> step_time_s;
  std::optional<double> mfu;
  std::optional<double> mem_allocated_bytes;
  std::optional<double> mem_reserved_bytes;
  std::optional<double> mem_peak_bytes;
  std::optional<double> host_rss_bytes;
  std::optional<double> host_pinned_bytes;
  std::vector<CommStat> comm;
  std::vector<MoeLayerStat> moe;
  std::string path;
  std::string message;
  // Parity events.
  std::optional<bool> passed;
  bool skipped = false;
  std::optional<double> max_rel_error, max_excess, tolerance;
  std::string layout, reference, reason;
  std::vector<ParityTensorStat> worst;
};

// Parses one stdout line. InvalidArgument when the line is not a JSON object with a string
// "event" field, or when a known field has the wrong type (the message names the field).
absl::StatusOr<TrainerEvent> ParseTrainerEvent(std::string_view line);

}  // namespace spindle
