// ProcessSupervisor (see process_supervisor.h). The supervisor thread forks the children itself:
// PR_SET_PDEATHSIG follows the thread that forked, and this thread lives as long as the children.
#include "worker/process_supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "worker/output_lines.h"

extern char** environ;

namespace spindle {
namespace {

constexpr absl::Duration kPollInterval = absl::Milliseconds(100);

void CloseFd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

absl::Status ErrnoStatus(int err, absl::string_view what) {
  const std::string msg = absl::StrCat(what, ": ", strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case EMFILE:
    case ENFILE:
    case EAGAIN:
    case ENOMEM:
      return absl::ResourceExhaustedError(msg);
    default:
      return absl::FailedPreconditionError(msg);
  }
}

// Environment of the child: the daemon's, with `extra` entries replacing same-named ones.
std::vector<std::string> ChildEnvironment(const std::vector<std::string>& extra) {
  absl::flat_hash_map<std::string, size_t> index;
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string entry(*e);
    std::string name = entry.substr(0, entry.find('='));
    if (index.contains(name)) continue;
    index[name] = env.size();
    env.push_back(std::move(entry));
  }
  for (const std::string& entry : extra) {
    std::string name = entry.substr(0, entry.find('='));
    auto it = index.find(name);
    if (it != index.end()) {
      env[it->second] = entry;
    } else {
      index[name] = env.size();
      env.push_back(entry);
    }
  }
  return env;
}

// In the forked child: only async-signal-safe calls until execve.
[[noreturn]] void ExecChild(pid_t parent, int null_fd, int out_fd, int err_fd, int status_fd,
                            const char* dir, char* const* argv, char* const* envp) {
  auto fail = [status_fd](int stage) {
    int report[2] = {errno, stage};
    ssize_t ignored = ::write(status_fd, report, sizeof(report));
    (void)ignored;
    ::_exit(127);
  };
  if (::setpgid(0, 0) != 0) fail(1);
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) fail(2);
  if (::getppid() != parent) ::_exit(127);  // the daemon already died
  // Signal state is inherited across exec: give the trainer a clean one.
  struct sigaction dfl;
  memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig == SIGKILL || sig == SIGSTOP) continue;
    ::sigaction(sig, &dfl, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  const int targets[3] = {STDIN_FILENO, STDOUT_FILENO, STDERR_FILENO};
  const int sources[3] = {null_fd, out_fd, err_fd};
  for (int i = 0; i < 3; ++i) {
    if (sources[i] == targets[i]) {
      if (::fcntl(targets[i], F_SETFD, 0) != 0) fail(3);
    } else if (::dup2(sources[i], targets[i]) < 0) {
      fail(3);
    }
  }
  if (dir != nullptr && ::chdir(dir) != 0) fail(4);
  // Close everything else except the status pipe (close-on-exec), whatever its number.
  if (status_fd > 3) ::close_range(3, status_fd - 1, 0);
  ::close_range(status_fd + 1, ~0U, 0);
  ::execve(argv[0], argv, envp);
  fail(5);
  ::_exit(127);
}

}  // namespace

std::string ProcessExit::Describe() const {
  if (term_signal > 0) {
    const char* abbrev = sigabbrev_np(term_signal);
    return absl::StrCat("killed by signal ", term_signal,
                        abbrev != nullptr ? absl::StrCat(" (SIG", abbrev, ")") : "");
  }
  return absl::StrCat("exit code ", exit_code);
}

struct ProcessSupervisor::Child {
  ProcessId id = 0;
  pid_t pid = 0;
  int out_fd = -1;
  int err_fd = -1;
  int pid_fd = -1;  // pidfd: readable when the child exits (-1 if the kernel has none)
  int log_fd = -1;
  LineSplitter out_lines;
  LineSplitter err_lines;
  TailBuffer tail;
  absl::Time started;
  bool stop_requested = false;
  std::optional<absl::Time> kill_at;
  bool killed = false;

  Child(size_t max_line, size_t tail_lines)
      : out_lines(max_line), err_lines(max_line), tail(tail_lines) {}
};

struct ProcessSupervisor::Request {
  enum class Kind { kLaunch, kStop, kStopAll } kind;
  ProcessSpec spec;
  ProcessId id = 0;
  absl::Duration grace;
  std::function<void(const LaunchedProcess&)> on_launched;
  absl::StatusOr<LaunchedProcess> result = absl::UnknownError("not run");
  absl::Notification done;
};

ProcessSupervisor::ProcessSupervisor(ProcessSupervisorOptions options, ProcessObserver* observer)
    : options_(options), observer_(observer) {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  null_fd_ = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  thread_ = std::thread([this] { Loop(); });
}

ProcessSupervisor::~ProcessSupervisor() {
  Shutdown();
  CloseFd(wake_fd_);
  CloseFd(null_fd_);
}

void ProcessSupervisor::Wake() {
  const uint64_t one = 1;
  ssize_t ignored = ::write(wake_fd_, &one, sizeof(one));
  (void)ignored;
}

absl::StatusOr<LaunchedProcess> ProcessSupervisor::Launch(
    const ProcessSpec& spec, std::function<void(const LaunchedProcess&)> on_launched) {
  if (spec.argv.empty() || spec.argv[0].empty()) {
    return absl::InvalidArgumentError("process spec: argv is empty");
  }
  auto request = std::make_shared<Request>();
  request->kind = Request::Kind::kLaunch;
  request->spec = spec;
  request->on_launched = std::move(on_launched);
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return absl::UnavailableError("process supervisor is shutting down");
    request->id = next_id_++;
    requests_.push_back(request);
  }
  Wake();
  request->done.WaitForNotification();
  return request->result;
}

absl::Status ProcessSupervisor::Stop(ProcessId id, std::optional<absl::Duration> grace) {
  auto request = std::make_shared<Request>();
  request->kind = Request::Kind::kStop;
  request->id = id;
  request->grace = grace.value_or(options_.kill_grace);
  {
    absl::MutexLock lock(&mu_);
    if (!live_.contains(id)) return absl::NotFoundError(absl::StrCat("no running process ", id));
    requests_.push_back(std::move(request));
  }
  Wake();
  return absl::OkStatus();
}

void ProcessSupervisor::StopAll(std::optional<absl::Duration> grace) {
  auto request = std::make_shared<Request>();
  request->kind = Request::Kind::kStopAll;
  request->grace = grace.value_or(options_.kill_grace);
  {
    absl::MutexLock lock(&mu_);
    requests_.push_back(std::move(request));
  }
  Wake();
}

void ProcessSupervisor::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (!shutting_down_) {
      shutting_down_ = true;
      auto request = std::make_shared<Request>();
      request->kind = Request::Kind::kStopAll;
      request->grace = options_.kill_grace;
      requests_.push_back(std::move(request));
    }
  }
  Wake();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

size_t ProcessSupervisor::running() const {
  absl::MutexLock lock(&mu_);
  return live_.size();
}

bool ProcessSupervisor::IsRunning(ProcessId id) const {
  absl::MutexLock lock(&mu_);
  return live_.contains(id);
}

void ProcessSupervisor::HandleRequests() {
  std::deque<std::shared_ptr<Request>> requests;
  {
    absl::MutexLock lock(&mu_);
    requests.swap(requests_);
  }
  for (auto& request : requests) {
    switch (request->kind) {
      case Request::Kind::kLaunch:
        DoLaunch(*request);
        request->done.Notify();
        break;
      case Request::Kind::kStop:
        DoStop(request->id, request->grace);
        break;
      case Request::Kind::kStopAll:
        for (auto& child : children_) DoStop(child->id, request->grace);
        break;
    }
  }
}

void ProcessSupervisor::DoLaunch(Request& request) {
  const ProcessSpec& spec = request.spec;
  // Everything the child needs is built before fork: it may not allocate.
  std::vector<std::string> env = ChildEnvironment(spec.extra_env);
  std::vector<char*> argv;
  for (const std::string& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const char* dir = spec.working_dir.empty() ? nullptr : spec.working_dir.c_str();

  int out[2], err[2], status[2];
  if (::pipe2(out, O_CLOEXEC) != 0) {
    request.result = ErrnoStatus(errno, "pipe");
    return;
  }
  if (::pipe2(err, O_CLOEXEC) != 0) {
    request.result = ErrnoStatus(errno, "pipe");
    ::close(out[0]);
    ::close(out[1]);
    return;
  }
  if (::pipe2(status, O_CLOEXEC) != 0) {
    request.result = ErrnoStatus(errno, "pipe");
    for (int fd : {out[0], out[1], err[0], err[1]}) ::close(fd);
    return;
  }
  int log_fd = -1;
  if (!spec.stderr_log_path.empty()) {
    log_fd = ::open(spec.stderr_log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ExecChild(parent, null_fd_, out[1], err[1], status[1], dir, argv.data(), envp.data());
  }
  const int fork_errno = errno;
  ::close(out[1]);
  ::close(err[1]);
  ::close(status[1]);
  if (pid < 0) {
    request.result = ErrnoStatus(fork_errno, "fork");
    for (int fd : {out[0], err[0], status[0], log_fd}) {
      if (fd >= 0) ::close(fd);
    }
    return;
  }
  // Also set the group from the parent side, so a Stop() racing the child's setpgid still works.
  ::setpgid(pid, pid);
  int report[2] = {0, 0};
  ssize_t n;
  do {
    n = ::read(status[0], report, sizeof(report));
  } while (n < 0 && errno == EINTR);
  ::close(status[0]);
  if (n == static_cast<ssize_t>(sizeof(report))) {
    int ignored;
    ::waitpid(pid, &ignored, 0);
    ::close(out[0]);
    ::close(err[0]);
    if (log_fd >= 0) ::close(log_fd);
    static constexpr const char* kStages[] = {"",      "setpgid", "prctl",
                                              "dup2",  "chdir",   "execute"};
    const int stage = report[1] >= 1 && report[1] <= 5 ? report[1] : 5;
    request.result = ErrnoStatus(
        report[0], stage == 4 ? absl::StrCat("cannot enter directory ", spec.working_dir)
                              : absl::StrCat("cannot ", kStages[stage], " ", spec.argv[0]));
    return;
  }
  ::fcntl(out[0], F_SETFL, O_NONBLOCK);
  ::fcntl(err[0], F_SETFL, O_NONBLOCK);
  auto child = std::make_unique<Child>(options_.max_line_bytes, options_.stderr_tail_lines);
  child->id = request.id;
  child->pid = pid;
  child->out_fd = out[0];
  child->err_fd = err[0];
  child->log_fd = log_fd;
  child->started = absl::Now();
  const long pid_fd = ::syscall(SYS_pidfd_open, pid, 0);
  child->pid_fd = pid_fd >= 0 ? static_cast<int>(pid_fd) : -1;
  if (child->pid_fd >= 0) ::fcntl(child->pid_fd, F_SETFD, FD_CLOEXEC);
  {
    absl::MutexLock lock(&mu_);
    live_.insert(request.id);
  }
  request.result = LaunchedProcess{request.id, pid};
  children_.push_back(std::move(child));
  if (request.on_launched) request.on_launched(*request.result);
}

void ProcessSupervisor::DoStop(ProcessId id, absl::Duration grace) {
  for (auto& child : children_) {
    if (child->id != id) continue;
    const absl::Time deadline = absl::Now() + grace;
    child->stop_requested = true;
    if (!child->kill_at.has_value() || deadline < *child->kill_at) child->kill_at = deadline;
    if (!child->killed) {
      if (grace <= absl::ZeroDuration()) {
        ::kill(-child->pid, SIGKILL);
        child->killed = true;
      } else {
        ::kill(-child->pid, SIGTERM);
      }
    }
    return;
  }
}

void ProcessSupervisor::ReadPipe(Child& child, bool is_stdout) {
  int& fd = is_stdout ? child.out_fd : child.err_fd;
  if (fd < 0) return;
  char buf[16384];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {  // EOF or error: the stream is over
      if (is_stdout) {
        child.out_lines.Flush([&](std::string_view line) { observer_->OnStdoutLine(child.id, line); });
      } else {
        child.err_lines.Flush([&](std::string_view line) { child.tail.Push(line); });
      }
      CloseFd(fd);
      return;
    }
    const std::string_view bytes(buf, static_cast<size_t>(n));
    if (is_stdout) {
      child.out_lines.Append(bytes,
                             [&](std::string_view line) { observer_->OnStdoutLine(child.id, line); });
    } else {
      if (child.log_fd >= 0) {
        ssize_t ignored = ::write(child.log_fd, buf, static_cast<size_t>(n));
        (void)ignored;
      }
      child.err_lines.Append(bytes, [&](std::string_view line) { child.tail.Push(line); });
    }
  }
}

bool ProcessSupervisor::TryReap(Child& child) {
  int wstatus = 0;
  pid_t r;
  do {
    r = ::waitpid(child.pid, &wstatus, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == 0) return false;
  ProcessExit exit;
  exit.pid = child.pid;
  if (r > 0 && WIFEXITED(wstatus)) {
    exit.exit_code = WEXITSTATUS(wstatus);
  } else if (r > 0 && WIFSIGNALED(wstatus)) {
    exit.term_signal = WTERMSIG(wstatus);
  }
  // Whatever is left in the pipes was written before the exit; members of the group that outlive
  // the leader are killed so they cannot hold the pipes (or a GPU) forever.
  ::kill(-child.pid, SIGKILL);
  ReadPipe(child, /*is_stdout=*/true);
  ReadPipe(child, /*is_stdout=*/false);
  child.out_lines.Flush([&](std::string_view line) { observer_->OnStdoutLine(child.id, line); });
  child.err_lines.Flush([&](std::string_view line) { child.tail.Push(line); });
  CloseFd(child.out_fd);
  CloseFd(child.err_fd);
  CloseFd(child.pid_fd);
  CloseFd(child.log_fd);
  exit.stop_requested = child.stop_requested;
  exit.killed_after_grace = child.killed;
  exit.run_time = absl::Now() - child.started;
  exit.stderr_tail = child.tail.Lines();
  {
    absl::MutexLock lock(&mu_);
    live_.erase(child.id);
  }
  observer_->OnExit(child.id, exit);
  return true;
}

void ProcessSupervisor::Loop() {
  std::vector<pollfd> fds;
  for (;;) {
    HandleRequests();
    {
      absl::MutexLock lock(&mu_);
      if (shutting_down_ && children_.empty() && requests_.empty()) break;
    }
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    absl::Time next = absl::Now() + kPollInterval;
    for (auto& child : children_) {
      if (child->out_fd >= 0) fds.push_back({child->out_fd, POLLIN, 0});
      if (child->err_fd >= 0) fds.push_back({child->err_fd, POLLIN, 0});
      if (child->pid_fd >= 0) fds.push_back({child->pid_fd, POLLIN, 0});
      if (child->kill_at.has_value() && !child->killed) next = std::min(next, *child->kill_at);
    }
    const int timeout_ms = static_cast<int>(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(next - absl::Now()) + 1));
    ::poll(fds.data(), fds.size(), timeout_ms);
    uint64_t counter;
    while (::read(wake_fd_, &counter, sizeof(counter)) > 0) {
    }
    for (auto& child : children_) {
      ReadPipe(*child, /*is_stdout=*/true);
      ReadPipe(*child, /*is_stdout=*/false);
    }
    const absl::Time now = absl::Now();
    for (auto& child : children_) {
      if (child->kill_at.has_value() && !child->killed && now >= *child->kill_at) {
        ::kill(-child->pid, SIGKILL);
        child->killed = true;
      }
    }
    for (size_t i = 0; i < children_.size();) {
      if (TryReap(*children_[i])) {
        children_.erase(children_.begin() + static_cast<ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }
}

}  // namespace spindle
