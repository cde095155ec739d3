// Clock: the coordinator's source of time, injected so that failure detection (heartbeat and hang
// timeouts) is tested deterministically with FakeClock. Two readings: the wall clock, for what is
// recorded and shown (submit times, events), and a steady clock, for every timer (liveness, hangs,
// fencing and drain deadlines), so that a wall-clock jump (NTP, an operator) restarts nothing.
// Thread-safety: both implementations are thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace spindle {

class Clock {
 public:
  virtual ~Clock() = default;
  // Milliseconds since the Unix epoch (wall clock: may jump).
  virtual int64_t NowMs() const = 0;
  // Milliseconds since an arbitrary origin; never jumps, never goes back.
  virtual int64_t SteadyMs() const = 0;
};

class RealClock : public Clock {
 public:
  int64_t NowMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  int64_t SteadyMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

// A clock that only moves when told to.
class FakeClock : public Clock {
 public:
  explicit FakeClock(int64_t start_ms = 1'700'000'000'000) : now_ms_(start_ms) {}
  int64_t NowMs() const override { return now_ms_.load(); }
  int64_t SteadyMs() const override { return steady_ms_.load(); }
  // Time passes: both readings move.
  void AdvanceMs(int64_t ms) {
    now_ms_.fetch_add(ms);
    steady_ms_.fetch_add(ms);
  }
  // The wall clock is set forward (or back, ms < 0); the steady clock does not move.
  void JumpWallMs(int64_t ms) { now_ms_.fetch_add(ms); }

 private:
  std::atomic<int64_t> now_ms_;
  std::atomic<int64_t> steady_ms_{1'000'000};
};

}  // namespace spindle
