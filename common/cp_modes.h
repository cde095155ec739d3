// The facts about context-parallel modes that the job spec, the planner and the engine share
// (DESIGN.md section 3), written once: which combinations of parallel.* are valid, what MLA's Ring
// level moves around the ring, and how many bytes each mode makes a rank send per layer.
// Pure functions; no thread-safety concerns.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "common/job_spec.h"
#include "common/model_config.h"

namespace spindle {

// All2All (Ulysses) gives each of the cp ranks n_heads / cp whole heads: it needs n_heads % cp
// == 0 (so cp <= n_heads). The rule, written once for the spec checks, the planner's default
// ("auto": All2All where it splits, else AllGather), its cost model's candidates and both engines.
bool All2AllSplits(int64_t n_heads, int64_t cp);
// OK when All2All splits; else FailedPrecondition naming `field` (e.g. "parallel.mla_mode"):
// "<field>: all2all needs n_heads divisible by cp, but n_heads=4 and cp=3 (4 % 3 = 1); use
// allgather or a cp that divides 4".
absl::Status CheckAll2All(std::string_view field, int64_t n_heads, int64_t cp);

// The rules of the modes that need more than cp and the head count's divisibility by cp
// (All2All's rule is CheckAll2All above; the planner and the engine's PlannedCpModes apply it):
//   - lightning_mode is never "ring" (Lightning has no Ring mode);
//   - ulysses in [1, cp]; ulysses > 1 only with a "hybrid" mode (it has no other use);
//   - a "hybrid" mode needs ulysses >= 2, cp % ulysses == 0, cp / ulysses >= 2 (with one group
//     there is no ring: that is "all2all") and n_heads % ulysses == 0.
// "ring" at cp = 1 is accepted and runs unsplit, as every forced mode does.
// InvalidArgument naming the field and the values, e.g. "parallel.ulysses: must divide
// parallel.cp, got ulysses=3 and cp=8".
absl::Status CheckCpModes(const ParallelSpec& p, int64_t n_heads);

// What MLA's Ring level (modes "ring" and "hybrid") passes to the next rank for every token of a
// block: its keys and values for the heads the rank computes, or the compressed latent
// [c_n, RoPE'd k_r] from which every rank rebuilds them with kv_b. The backward sends the
// gradient of the same thing back around the ring.
enum class MlaRingPayload { kKv, kLatent };
std::string_view MlaRingPayloadName(MlaRingPayload p);  // "kv", "latent"
// fp32 values a token of the payload: heads * (qk_nope + qk_rope + v_head) for kKv,
// kv_lora_rank + qk_rope for kLatent.
int64_t MlaRingPayloadWidth(const MlaConfig& m, MlaRingPayload p, int64_t heads);
// The payload that moves fewer bytes a token (the latent on a tie), on both engines. `heads` are
// the heads one rank computes: n_heads under "ring", n_heads / ulysses under "hybrid"
// (MlaRingHeads).
MlaRingPayload MlaRingPayloadFor(const MlaConfig& m, int64_t heads);
int64_t MlaRingHeads(int64_t n_heads, CpMode mla_mode, int64_t ulysses);

// Bytes one rank sends for one layer of `kind` ('L' or 'M') over one sequence of `seq_len` tokens,
// in the Communicator's accounting (comm/communicator.h), forward and backward apart (a layer that
// recomputes runs its forward twice). `mode` is decided (never kAuto); 0 at cp = 1 and for a
// combination CheckCpModes refuses. MLA's ring moves MlaRingPayloadFor's payload.
struct CpCommBytes {
  int64_t forward = 0;
  int64_t backward = 0;
};
CpCommBytes CpLayerCommBytes(const ModelConfig& m, char kind, CpMode mode, const ParallelSpec& p,
                             int64_t seq_len);

}  // namespace spindle
