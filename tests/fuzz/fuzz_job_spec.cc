// Fuzz target: the job spec parser (ParseJobSpec), as the coordinator runs it on every Submit and
// Plan. Any input must give a spec or an error status, never a crash, a stack overflow or an
// exception; an error message stays short (it never echoes the input), and a parsed spec
// round-trips through its canonical JSON.
// Seeds: corpus/fuzz_job_spec/ (the examples/ specs and variations).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/job_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<spindle::JobSpec> spec = spindle::ParseJobSpec(text);
  if (!spec.ok()) {
    // The longest message quotes a few short pieces of the input (64 bytes each at most).
    if (spec.status().message().size() > 1024) std::abort();
    return 0;
  }
  absl::StatusOr<spindle::JobSpec> again = spindle::ParseJobSpecJson(spec->ToJson());
  if (!again.ok() || again->ToJson() != spec->ToJson()) std::abort();
  return 0;
}
