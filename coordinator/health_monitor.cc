// HealthMonitor (see health_monitor.h).
#include "coordinator/health_monitor.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace spindle {

std::string Seconds(int64_t ms) { return absl::StrFormat("%.1f s", ms / 1000.0); }

std::string HealthMonitor::Lost(const Worker& w, int64_t now) const {
  if (w.lost || now - w.last_seen_ms <= o_.heartbeat_timeout_ms) return "";
  return absl::StrCat("no heartbeat for ", Seconds(now - w.last_seen_ms));
}

std::string HealthMonitor::Hung(const std::vector<RankHealth>& ranks, int64_t now) const {
  const RankHealth* hung = nullptr;
  int64_t max_step = 0, min_live_step = std::numeric_limits<int64_t>::max();
  for (const RankHealth& r : ranks) {
    max_step = std::max(max_step, r.step);
    if (r.exited) continue;
    min_live_step = std::min(min_live_step, r.step);
    // Steps longer than the timeout (long sequences) are not hangs.
    const int64_t limit = r.step > 0 ? std::max(o_.hang_timeout_ms, kHangStepMultiple * r.step_ms)
                                     : o_.start_timeout_ms;
    if (now - r.last_progress_ms > limit && (!hung || r.step < hung->step)) hung = &r;
  }
  if (!hung) return "";
  if (min_live_step == max_step && ranks.size() > 1)
    return absl::StrCat("the gang made no progress for ", Seconds(now - hung->last_progress_ms),
                        " (every rank at step ", max_step, ")");
  return absl::StrCat("rank ", hung->rank, " on worker ", hung->worker_id, " made no progress for ",
                      Seconds(now - hung->last_progress_ms), " (step ", hung->step,
                      ", furthest rank at step ", max_step, ")");
}

std::string HealthMonitor::Silent(int64_t rank, const std::string& worker_id, int64_t silent_ms,
                                  int64_t step) const {
  if (silent_ms < o_.silence_timeout_ms) return "";
  return absl::StrCat("rank ", rank, " on worker ", worker_id,
                      " stopped responding (no output for ", Seconds(silent_ms), ", at step ", step,
                      ")");
}

int64_t HealthMonitor::DeadBy(const Worker& w, int64_t now) const {
  // A silent worker has been counting since it was last heard; a connected one counts from now
  // at the latest (its stream may break right after the stop).
  const int64_t from = w.lost || !w.connected ? w.last_seen_ms : std::max(now, w.last_seen_ms);
  return from + FenceMs();
}

int64_t HealthMonitor::FenceMs() const {
  // A worker's fence counts from a heartbeat it sent, at most one interval before the
  // coordinator's last word from it.
  return o_.heartbeat_timeout_ms + o_.stop_grace_ms + o_.heartbeat_interval_ms;
}

}  // namespace spindle
