// Which finished jobs the retention policy removes (see retention.h).
#include "coordinator/retention.h"

#include <algorithm>
#include <tuple>

namespace spindle {

std::vector<std::string> JobsToPrune(const RetentionPolicy& policy,
                                     std::vector<FinishedJob> finished, int64_t now_ms) {
  // Most recently finished first.
  std::sort(finished.begin(), finished.end(), [](const FinishedJob& a, const FinishedJob& b) {
    return std::tie(a.finished_ms, a.seq) > std::tie(b.finished_ms, b.seq);
  });
  std::vector<std::string> out;
  for (size_t i = 0; i < finished.size(); ++i) {
    const bool too_many =
        policy.max_finished_jobs > 0 && static_cast<int64_t>(i) >= policy.max_finished_jobs;
    const bool too_old =
        policy.max_age_ms > 0 && now_ms - finished[i].finished_ms > policy.max_age_ms;
    if (too_many || too_old) out.push_back(finished[i].job_id);
  }
  return out;
}

}  // namespace spindle
