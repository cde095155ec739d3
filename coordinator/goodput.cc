// A job's goodput from its rank 0's reports (see goodput.h).
#include "coordinator/goodput.h"

#include <algorithm>
#include <iterator>

namespace spindle {

void GoodputLedger::OnStart(int64_t attempt, int64_t now_ms) {
  (void)attempt;
  if (start_ms_ < 0) start_ms_ = now_ms;
}

void GoodputLedger::OnCheckpoint(int64_t step) {
  if (step <= 0) return;
  checkpoints_.insert(step);
  while (checkpoints_.size() > kMaxCheckpoints) checkpoints_.erase(checkpoints_.begin());
}

double GoodputLedger::UsefulAt(int64_t step) const {
  auto it = std::lower_bound(points_.begin(), points_.end(), std::make_pair(step, -1.0));
  if (it == points_.end()) return points_.back().second;
  if (it->first == step || it == points_.begin()) return it->second;
  const auto& [s1, u1] = *it;
  const auto& [s0, u0] = *std::prev(it);
  return u0 + (u1 - u0) * static_cast<double>(step - s0) / static_cast<double>(s1 - s0);
}

void GoodputLedger::OnProgress(int64_t attempt, int64_t step, double elapsed_s, int64_t total_steps,
                               int64_t now_ms, int64_t resumed_from) {
  // A time no trainer reports (negative, NaN, infinite, or longer than kMaxElapsedS) is ignored.
  if (attempt < attempt_ || step < 0 || !(elapsed_s >= 0 && elapsed_s <= kMaxElapsedS)) return;
  // A ledger that first hears of a job from its progress (a coordinator that restarted adopts a
  // running gang) starts its wall time where this process's steps began.
  if (start_ms_ < 0) start_ms_ = now_ms - static_cast<int64_t>(elapsed_s * 1000.0);
  if (attempt > attempt_) {
    // A new attempt: it resumed from the newest committed checkpoint before its first reported
    // step (at it, for a report of the resumed step itself, before any step ran) that the job
    // had reached; the steps after that are thrown away.
    int64_t resume = 0;
    for (auto it = checkpoints_.rbegin(); it != checkpoints_.rend(); ++it) {
      if (*it > points_.back().first) continue;
      if (*it < step || (*it == step && elapsed_s == 0)) {
        resume = *it;
        break;
      }
    }
    // A step the attempt names (an in-memory replica's) beats the inference, up to the newest
    // step the job reached (and never past the attempt's own first report).
    if (resumed_from > 0)
      resume = std::min({resumed_from, points_.back().first, std::max<int64_t>(step, 0)});
    const double useful = UsefulAt(resume);
    while (points_.size() > 1 && points_.back().first > resume) points_.pop_back();
    if (points_.back().first < resume) points_.push_back({resume, useful});
    base_useful_ = useful;
    attempt_ = attempt;
  }
  if (step > points_.back().first) {
    points_.push_back({step, std::max(points_.back().second, base_useful_ + elapsed_s)});
    // Bounded: the oldest points are merged (only steps after the newest checkpoints are ever
    // thrown away, and those are recent).
    if (points_.size() > kMaxPoints)
      points_.erase(points_.begin() + 1, points_.begin() + 1 + kMaxPoints / 2);
  }
  if (total_steps > 0 && step >= total_steps && end_ms_ < 0) end_ms_ = now_ms;
}

double GoodputLedger::WallSeconds(int64_t now_ms) const {
  if (start_ms_ < 0) return 0;
  const int64_t end = end_ms_ >= 0 ? end_ms_ : now_ms;
  return std::max<int64_t>(0, end - start_ms_) / 1000.0;
}

std::optional<double> GoodputLedger::Goodput(int64_t now_ms) const {
  const double wall = WallSeconds(now_ms);
  if (attempt_ < 0 || wall <= 0) return std::nullopt;
  return std::clamp(UsefulSeconds() / wall, 0.0, 1.0);
}

}  // namespace spindle
