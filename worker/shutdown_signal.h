// ShutdownSignal: owns a signalfd for SIGTERM and SIGINT, so the daemon's main thread can wait
// for a shutdown request without a signal handler or global state. Construct it in main() before
// any other thread starts: it blocks those signals in the calling thread, and threads created
// afterwards inherit the mask (children get a clean mask from ProcessSupervisor).
//
// Thread-safety: Wait() is called by one thread; the object is otherwise immutable.
#pragma once

#include "absl/status/statusor.h"

namespace spindle {

class ShutdownSignal {
 public:
  static absl::StatusOr<ShutdownSignal> Create();
  ShutdownSignal(ShutdownSignal&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  ShutdownSignal& operator=(ShutdownSignal&&) = delete;
  ~ShutdownSignal();

  // Blocks until SIGTERM or SIGINT arrives; returns the signal number.
  int Wait();

 private:
  explicit ShutdownSignal(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace spindle
