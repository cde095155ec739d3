// Tests for common/subprocess.h with real child processes (sh, cat, sleep).
#include <signal.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/subprocess.h"
#include "gtest/gtest.h"

namespace spindle {
namespace {

TEST(SubprocessTest, RunCommandFeedsStdinAndCapturesOutput) {
  absl::StatusOr<CommandResult> r =
      RunCommand({"sh", "-c", "cat; echo oops >&2; exit 3"}, "hello\nworld\n");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 3);
  EXPECT_EQ(r->stdout_text, "hello\nworld\n");
  EXPECT_EQ(r->stderr_text, "oops\n");
}

TEST(SubprocessTest, RunCommandLargeStdinDoesNotDeadlock) {
  std::string big(4 << 20, 'x');
  for (size_t i = 0; i < big.size(); i += 97) big[i] = '\n';
  absl::StatusOr<CommandResult> r = RunCommand({"cat"}, big);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0);
  EXPECT_EQ(r->stdout_text, big);
}

TEST(SubprocessTest, RunCommandChildIgnoringStdin) {
  // The child exits without reading: no SIGPIPE for us, just its exit code.
  absl::StatusOr<CommandResult> r = RunCommand({"true"}, std::string(1 << 20, 'x'));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0);
}

TEST(SubprocessTest, RunCommandTimeout) {
  const absl::Status s = RunCommand({"sleep", "30"}, "", absl::Milliseconds(200)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.message(), "sleep did not finish within 200ms");
}

TEST(SubprocessTest, MissingProgram) {
  const absl::Status s = RunCommand({"/nonexistent/spindle-nope"}, "").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "cannot start /nonexistent/spindle-nope: No such file or directory");
  EXPECT_EQ(Subprocess::Spawn({}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SubprocessTest, SpawnRedirectsAndSetsEnvironment) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("spindle_subprocess_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  SubprocessOptions options;
  options.stdout_path = (dir / "out.txt").string();
  options.stderr_path = (dir / "err.txt").string();
  options.env = {{"SPINDLE_TEST_VAR", "v1"}, {"HOME", "/spindle-home"}};
  absl::StatusOr<std::unique_ptr<Subprocess>> child = Subprocess::Spawn(
      {"sh", "-c", "echo $SPINDLE_TEST_VAR $HOME; echo e >&2; read x || echo eof"}, options);
  ASSERT_TRUE(child.ok()) << child.status();
  absl::StatusOr<int> code = (*child)->Wait();
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  auto slurp = [](const std::filesystem::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  EXPECT_EQ(slurp(dir / "out.txt"), "v1 /spindle-home\neof\n");
  EXPECT_EQ(slurp(dir / "err.txt"), "e\n");
  std::filesystem::remove_all(dir);
}

TEST(SubprocessTest, PollSignalAndKill) {
  absl::StatusOr<std::unique_ptr<Subprocess>> child = Subprocess::Spawn({"sleep", "30"});
  ASSERT_TRUE(child.ok()) << child.status();
  absl::StatusOr<std::optional<int>> running = (*child)->Poll();
  ASSERT_TRUE(running.ok());
  EXPECT_FALSE(running->has_value());
  ASSERT_TRUE((*child)->Signal(SIGTERM).ok());
  absl::StatusOr<int> code = (*child)->Wait();
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 128 + SIGTERM);
  // Already reaped: further calls report the same code and signal nobody.
  EXPECT_EQ(*(*child)->Kill(), 128 + SIGTERM);
}

TEST(SubprocessTest, DestructorKillsAndReaps) {
  pid_t pid = 0;
  {
    absl::StatusOr<std::unique_ptr<Subprocess>> child = Subprocess::Spawn({"sleep", "30"});
    ASSERT_TRUE(child.ok()) << child.status();
    pid = (*child)->pid();
    ASSERT_EQ(::kill(pid, 0), 0);
  }
  // Reaped, not a zombie: the pid is gone.
  EXPECT_EQ(::kill(pid, 0), -1);
  EXPECT_EQ(errno, ESRCH);
}

}  // namespace
}  // namespace spindle
