// ShutdownSignal (see shutdown_signal.h).
#include "worker/shutdown_signal.h"

#include <signal.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"

namespace spindle {

absl::StatusOr<ShutdownSignal> ShutdownSignal::Create() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  if (int err = pthread_sigmask(SIG_BLOCK, &set, nullptr); err != 0) {
    return absl::InternalError(absl::StrCat("pthread_sigmask: ", strerror(err)));
  }
  const int fd = signalfd(-1, &set, SFD_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrCat("signalfd: ", strerror(errno)));
  return ShutdownSignal(fd);
}

ShutdownSignal::~ShutdownSignal() {
  if (fd_ >= 0) ::close(fd_);
}

int ShutdownSignal::Wait() {
  signalfd_siginfo info;
  for (;;) {
    const ssize_t n = ::read(fd_, &info, sizeof(info));
    if (n == static_cast<ssize_t>(sizeof(info))) return static_cast<int>(info.ssi_signo);
    if (n < 0 && errno != EINTR) return SIGTERM;
  }
}

}  // namespace spindle
