// `spindle plan --verify`: the parity canary of a planned job (parallel.verify, DESIGN-level
// description in README.md) on this machine, without a cluster. The CLI does not link the engine:
// it writes the planned spec (the plan it just printed, its decisions written in) to a temporary
// file, runs `spindle-train --verify-only --job FILE`, reads the {"event": "parity"} line the
// trainer prints, and renders it. Stateless; blocking (a child process).
#pragma once

#include <map>
#include <optional>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace spindle {

// The trainer binary that runs the check: $SPINDLE_TRAIN_BINARY from `env`, else spindle-train
// beside this program (or in the build tree's worker/ beside its cli/), else "spindle-train" on
// PATH.
std::string VerifyTrainerBinary(const std::map<std::string, std::string>& env);

struct ParityCheck {
  int trainer_exit_code = 0;
  std::optional<nlohmann::json> event;  // the trainer's parity line, when it printed one
  std::string trainer_error;            // its stderr, trimmed (what it said when it failed)
};

// Runs `trainer` --verify-only on `planned_spec_json`. Errors: the trainer could not be started
// (NotFound names the binary and SPINDLE_TRAIN_BINARY) or ran past `timeout` (DeadlineExceeded).
absl::StatusOr<ParityCheck> RunParityCheck(const std::string& trainer,
                                           const std::string& planned_spec_json,
                                           absl::Duration timeout);

// The human form of a parity line: the verdict, the layout against its reference, and the table
// of the worst tensors (relative error, the reference's rounding noise, the share of the bound).
void PrintParity(const nlohmann::json& event, std::ostream& out);
// Whether a parity line says the layout passed or had nothing to verify.
bool ParityOk(const nlohmann::json& event);

}  // namespace spindle
