// Clock: the coordinator's source of time, injected so that failure detection (heartbeat and hang
// timeouts) is tested deterministically with FakeClock.
// Thread-safety: both implementations are thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace spindle {

class Clock {
 public:
  virtual ~Clock() = default;
  // Milliseconds since the Unix epoch.
  virtual int64_t NowMs() const = 0;
};

class RealClock : public Clock {
 public:
  int64_t NowMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};

// A clock that only moves when told to.
class FakeClock : public Clock {
 public:
  explicit FakeClock(int64_t start_ms = 1'700'000'000'000) : now_ms_(start_ms) {}
  int64_t NowMs() const override { return now_ms_.load(); }
  void AdvanceMs(int64_t ms) { now_ms_.fetch_add(ms); }

 private:
  std::atomic<int64_t> now_ms_;
};

}  // namespace spindle
