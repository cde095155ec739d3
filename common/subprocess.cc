// Subprocess and RunCommand over posix_spawn. Thread-safety: see subprocess.h.
#include "common/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace spindle {
namespace {

int ExitCodeFromWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

absl::Status ErrnoStatus(int err, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  return absl::InternalError(message);
}

// Owns a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { Close(); }
  int get() const { return fd_; }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// posix_spawn file actions, destroyed on scope exit.
class FileActions {
 public:
  FileActions() { posix_spawn_file_actions_init(&actions_); }
  ~FileActions() { posix_spawn_file_actions_destroy(&actions_); }
  FileActions(const FileActions&) = delete;
  FileActions& operator=(const FileActions&) = delete;
  posix_spawn_file_actions_t* get() { return &actions_; }

 private:
  posix_spawn_file_actions_t actions_;
};

absl::StatusOr<pid_t> SpawnProcess(const std::vector<std::string>& argv,
                                   const std::vector<std::pair<std::string, std::string>>& env,
                                   posix_spawn_file_actions_t* actions) {
  if (argv.empty()) return absl::InvalidArgumentError("cannot spawn an empty command line");
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  std::set<std::string> overridden;
  std::vector<std::string> env_storage;
  for (const auto& [key, value] : env) {
    overridden.insert(key);
    env_storage.push_back(absl::StrCat(key, "=", value));
  }
  std::vector<char*> envp;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    const std::string key = eq == nullptr ? std::string(*e) : std::string(*e, eq - *e);
    if (overridden.count(key) == 0) envp.push_back(*e);
  }
  for (std::string& s : env_storage) envp.push_back(s.data());
  envp.push_back(nullptr);

  pid_t pid = 0;
  const int err = posix_spawnp(&pid, args[0], actions, nullptr, args.data(), envp.data());
  if (err != 0) return ErrnoStatus(err, absl::StrCat("cannot start ", argv[0]));
  return pid;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Spawn(const std::vector<std::string>& argv,
                                                              const SubprocessOptions& options) {
  FileActions actions;
  posix_spawn_file_actions_addopen(
      actions.get(), STDIN_FILENO,
      options.stdin_path.empty() ? "/dev/null" : options.stdin_path.c_str(), O_RDONLY, 0);
  if (!options.stdout_path.empty()) {
    posix_spawn_file_actions_addopen(actions.get(), STDOUT_FILENO, options.stdout_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  if (!options.stderr_path.empty()) {
    posix_spawn_file_actions_addopen(actions.get(), STDERR_FILENO, options.stderr_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  absl::StatusOr<pid_t> pid = SpawnProcess(argv, options.env, actions.get());
  if (!pid.ok()) return pid.status();
  return std::unique_ptr<Subprocess>(new Subprocess(*pid));
}

Subprocess::~Subprocess() { (void)Kill(); }

absl::StatusOr<std::optional<int>> Subprocess::Reap(bool block) {
  if (exit_code_.has_value()) return exit_code_;
  int status = 0;
  pid_t r;
  do {
    r = ::waitpid(pid_, &status, block ? 0 : WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r < 0) return ErrnoStatus(errno, absl::StrCat("waitpid(", pid_, ")"));
  if (r == 0) return std::optional<int>();
  exit_code_ = ExitCodeFromWaitStatus(status);
  return exit_code_;
}

absl::StatusOr<std::optional<int>> Subprocess::Poll() { return Reap(/*block=*/false); }

absl::StatusOr<int> Subprocess::Wait() {
  absl::StatusOr<std::optional<int>> code = Reap(/*block=*/true);
  if (!code.ok()) return code.status();
  return **code;
}

absl::Status Subprocess::Signal(int signal) {
  if (exit_code_.has_value()) return absl::OkStatus();
  // An exited but unreaped child is a zombie: kill() still succeeds and does nothing.
  if (::kill(pid_, signal) != 0) return ErrnoStatus(errno, absl::StrCat("kill(", pid_, ")"));
  return absl::OkStatus();
}

absl::StatusOr<int> Subprocess::Kill() {
  if (absl::Status s = Signal(SIGKILL); !s.ok()) return s;
  return Wait();
}

absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                         const std::string& stdin_data, absl::Duration timeout) {
  // stdin is a socket so that writing to a child that stopped reading gives EPIPE via
  // MSG_NOSIGNAL instead of a process-wide SIGPIPE.
  int in_pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, in_pair) != 0) {
    return ErrnoStatus(errno, "socketpair");
  }
  Fd in_parent(in_pair[0]), in_child(in_pair[1]);
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) return ErrnoStatus(errno, "pipe2");
  Fd out_parent(out_pipe[0]), out_child(out_pipe[1]);
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) return ErrnoStatus(errno, "pipe2");
  Fd err_parent(err_pipe[0]), err_child(err_pipe[1]);

  FileActions actions;
  posix_spawn_file_actions_adddup2(actions.get(), in_child.get(), STDIN_FILENO);
  posix_spawn_file_actions_adddup2(actions.get(), out_child.get(), STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(actions.get(), err_child.get(), STDERR_FILENO);
  absl::StatusOr<pid_t> pid = SpawnProcess(argv, {}, actions.get());
  if (!pid.ok()) return pid.status();
  Subprocess child(*pid);  // killed and reaped on every early return
  in_child.Close();
  out_child.Close();
  err_child.Close();

  CommandResult result;
  size_t written = 0;
  if (stdin_data.empty()) in_parent.Close();
  const absl::Time deadline = absl::Now() + timeout;
  bool out_open = true, err_open = true;
  while (out_open || err_open) {
    pollfd fds[3];
    int n = 0;
    if (in_parent.get() >= 0) fds[n++] = {in_parent.get(), POLLOUT, 0};
    if (out_open) fds[n++] = {out_parent.get(), POLLIN, 0};
    if (err_open) fds[n++] = {err_parent.get(), POLLIN, 0};
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat(argv[0], " did not finish within ", absl::FormatDuration(timeout)));
    }
    const int ready = ::poll(fds, n, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (ready < 0 && errno != EINTR) return ErrnoStatus(errno, "poll");
    for (int i = 0; i < n && ready > 0; ++i) {
      if (fds[i].revents == 0) continue;
      if (fds[i].fd == in_parent.get()) {
        const ssize_t w = ::send(in_parent.get(), stdin_data.data() + written,
                                 stdin_data.size() - written, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) written += static_cast<size_t>(w);
        if ((w < 0 && errno != EAGAIN && errno != EINTR) || written == stdin_data.size()) {
          in_parent.Close();  // done, or the child stopped reading
        }
        continue;
      }
      char buf[16384];
      const ssize_t r = ::read(fds[i].fd, buf, sizeof(buf));
      if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      std::string* sink = fds[i].fd == out_parent.get() ? &result.stdout_text : &result.stderr_text;
      if (r > 0) {
        sink->append(buf, static_cast<size_t>(r));
      } else if (fds[i].fd == out_parent.get()) {
        out_open = false;
      } else {
        err_open = false;
      }
    }
  }
  in_parent.Close();
  // The child closed its output; it may still be running, so the deadline still applies.
  while (true) {
    absl::StatusOr<std::optional<int>> code = child.Poll();
    if (!code.ok()) return code.status();
    if (code->has_value()) {
      result.exit_code = **code;
      return result;
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(argv[0], " did not finish within ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
}

}  // namespace spindle
