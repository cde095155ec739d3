// The daemons' command lines (and the health check's), run for real: --help lists each one's own
// flags with their defaults, and flags spelled with hyphens (as the usage lines and docs write
// them) are accepted like absl's underscores, while a misspelt flag or a stray word is still
// refused by name.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace spindle {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct Daemon {
  std::string binary;
  std::string main_file;              // where its flags are defined
  std::vector<std::string> flags;     // some of them, as --help spells them
  std::vector<std::string> hyphened;  // flags with values, spelled with hyphens
};

std::vector<Daemon> Daemons() {
  std::vector<Daemon> out;
  if (!std::string(SPINDLE_COORDINATOR_BINARY).empty()) {
    out.push_back({SPINDLE_COORDINATOR_BINARY,
                   "coordinator/main.cc",
                   {"--listen", "--db", "--heartbeat_timeout", "--hang_timeout", "--token_file"},
                   {"--metrics-port=-1", "--heartbeat-timeout=3", "--token-file", "/nonexistent"}});
  }
  if (!std::string(SPINDLE_WORKER_BINARY).empty()) {
    out.push_back(
        {SPINDLE_WORKER_BINARY,
         "worker/worker_main.cc",
         {"--coordinator", "--slots", "--work_dir", "--metrics_port", "--kill_grace"},
         {"--work-dir=/nonexistent", "--metrics-port=-1", "--cpu-threads-per-slot", "2"}});
  }
  if (!std::string(SPINDLE_HEALTHCHECK_BINARY).empty()) {
    out.push_back({SPINDLE_HEALTHCHECK_BINARY,
                   "cli/healthcheck_main.cc",
                   {"--grpc", "--http", "--tls_ca_file", "--timeout"},
                   {"--tls-ca-file", "/nonexistent", "--timeout=2"}});
  }
  return out;
}

CommandResult RunDaemon(std::vector<std::string> argv) {
  auto r = RunCommand(argv, "", absl::Seconds(30));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : CommandResult{};
}

TEST(DaemonFlagsTest, HelpListsEachDaemonsFlagsWithDefaults) {
  const std::vector<Daemon> daemons = Daemons();
  if (daemons.empty()) GTEST_SKIP() << "no daemon binary in this build";
  for (const Daemon& d : daemons) {
    const CommandResult r = RunDaemon({d.binary, "--help"});
    EXPECT_THAT(r.stdout_text, HasSubstr("usage: spindle-")) << d.binary;
    EXPECT_THAT(r.stdout_text, HasSubstr("Flags from " + d.main_file + ":")) << d.binary;
    EXPECT_THAT(r.stdout_text, Not(HasSubstr("No flags matched"))) << d.binary;
    for (const std::string& f : d.flags) {
      EXPECT_THAT(r.stdout_text, HasSubstr("    " + f + " (")) << d.binary << " " << f;
    }
    EXPECT_THAT(r.stdout_text, HasSubstr("default: ")) << d.binary;
  }
}

TEST(DaemonFlagsTest, HyphenatedFlagsAreAcceptedAndMisspeltOnesRefused) {
  const std::vector<Daemon> daemons = Daemons();
  if (daemons.empty()) GTEST_SKIP() << "no daemon binary in this build";
  for (const Daemon& d : daemons) {
    // absl parses every flag before it handles --help: an unknown one is reported first.
    std::vector<std::string> argv = {d.binary};
    argv.insert(argv.end(), d.hyphened.begin(), d.hyphened.end());
    argv.push_back("--help");
    const CommandResult ok = RunDaemon(argv);
    EXPECT_THAT(ok.stderr_text, Not(HasSubstr("Unknown command line flag"))) << d.binary;
    EXPECT_THAT(ok.stdout_text, HasSubstr("Flags from " + d.main_file + ":")) << d.binary;

    const CommandResult bad = RunDaemon({d.binary, "--heartbeat-timout=3", "--help"});
    EXPECT_NE(bad.exit_code, 0) << d.binary;
    EXPECT_THAT(bad.stderr_text, HasSubstr("Unknown command line flag 'heartbeat_timout'"))
        << d.binary;
  }
}

// Numeric flags a typo makes meaningless are refused by name, with exit code 2, before the
// daemon opens or writes anything.
TEST(DaemonFlagsTest, MeaninglessNumbersAreRefusedByName) {
  char tmpl[] = "/tmp/spindle-flags-test-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string db = dir + "/never.db";
  struct Case {
    std::string binary;
    std::vector<std::string> args;
    std::string message;
  };
  std::vector<Case> cases;
  if (!std::string(SPINDLE_COORDINATOR_BINARY).empty()) {
    const std::string c = SPINDLE_COORDINATOR_BINARY;
    const std::string base = "--db=" + db;
    cases.push_back({c,
                     {base, "--hang-timeout=-1"},
                     "--hang-timeout must be a positive number of seconds, got -1"});
    cases.push_back({c,
                     {base, "--heartbeat-interval=0"},
                     "--heartbeat-interval must be a positive number of seconds, got 0"});
    cases.push_back({c,
                     {base, "--stop-grace=-2"},
                     "--stop-grace must be a non-negative number of seconds, got -2"});
    cases.push_back({c,
                     {base, "--metrics-port=70000"},
                     "--metrics-port must be a port, 0 (any) or -1 (off), got 70000"});
    cases.push_back(
        {c,
         {base, "--listen=127.0.0.1:70000"},
         "--listen must be HOST:PORT with a port in [0, 65535], got \"127.0.0.1:70000\""});
    cases.push_back({c,
                     {base, "--metrics-port=-1", "7070"},
                     "unexpected argument \"7070\" (every option is a --flag)"});
    const std::string junk = dir + "/junk.pem";
    std::ofstream(junk) << "not a certificate\n";
    cases.push_back({c,
                     {base, "--tls-cert=" + junk, "--tls-key=" + junk},
                     "the --tls-cert file " + junk +
                         " holds no PEM certificate (no -----BEGIN CERTIFICATE----- line)"});
  }
  if (!std::string(SPINDLE_WORKER_BINARY).empty()) {
    const std::string w = SPINDLE_WORKER_BINARY;
    const std::string base = "--coordinator=127.0.0.1:1";
    const std::string work = "--work-dir=" + dir + "/work";
    cases.push_back({w,
                     {base, work, "--cpu-threads-per-slot=-2"},
                     "--cpu-threads-per-slot must be >= 0 (0: hardware threads / slots), got -2"});
    cases.push_back(
        {w, {base, work, "--kill-grace=-1s"}, "--kill-grace must not be negative, got -1s"});
    cases.push_back({w,
                     {base, work, "--coordinator-loss-timeout=0s"},
                     "--coordinator-loss-timeout must be a positive duration, got 0"});
    cases.push_back({w,
                     {base, work, "--metrics-port=-5"},
                     "--metrics-port must be a port, 0 (any) or -1 (off), got -5"});
    cases.push_back(
        {w, {base, work, "--metrics-port=-1", "--slots=-1"}, "--slots must be >= 0, got -1"});
    cases.push_back({w,
                     {"--coordinator=localhost:7O70", work},
                     "--coordinator must be HOST:PORT with a port in [0, 65535], got "
                     "\"localhost:7O70\""});
    cases.push_back({w,
                     {base, work, "--metrics-port=-1", "--trainer-binary=" + dir},
                     "--trainer-binary: " + dir + " is not an executable file"});
  }
  if (cases.empty()) GTEST_SKIP() << "no daemon binary in this build";
  for (const Case& c : cases) {
    std::vector<std::string> argv = {c.binary};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const CommandResult r = RunDaemon(argv);
    const std::string name = c.binary.substr(c.binary.rfind('/') + 1);
    EXPECT_EQ(r.exit_code, 2) << c.message << "\n" << r.stderr_text;
    EXPECT_EQ(r.stderr_text, name + ": " + c.message + "\n") << c.message;
  }
  struct stat st;
  EXPECT_NE(::stat(db.c_str(), &st), 0) << "the coordinator created its store";
  EXPECT_NE(::stat((dir + "/work").c_str(), &st), 0) << "the worker created its work dir";
  std::filesystem::remove_all(dir);
}

// A coordinator whose port is taken exits with one line saying so (not gRPC's status dump) and
// leaves no store behind.
TEST(DaemonFlagsTest, ATakenPortIsOneLineAndLeavesNoStore) {
  if (std::string(SPINDLE_COORDINATOR_BINARY).empty()) GTEST_SKIP() << "no coordinator built";
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string taken = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  char tmpl[] = "/tmp/spindle-flags-test-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const CommandResult r = RunDaemon({SPINDLE_COORDINATOR_BINARY, "--db=" + dir + "/c.db",
                                     "--listen=" + taken, "--metrics-port=-1"});
  ::close(fd);
  EXPECT_EQ(r.exit_code, 1) << r.stderr_text;
  EXPECT_EQ(r.stderr_text, "spindle-coordinator: cannot listen on " + taken +
                               " (it is taken, is not HOST:PORT, or is not an address of this "
                               "host)\n");
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "the coordinator left files in " << dir;
  std::filesystem::remove_all(dir);
}

// A coordinator on a non-loopback address without users' credentials refuses to start, in one line
// naming --insecure, and leaves no store behind.
TEST(DaemonFlagsTest, AnExposedCoordinatorNeedsCredentialsOrInsecure) {
  if (std::string(SPINDLE_COORDINATOR_BINARY).empty()) GTEST_SKIP() << "no coordinator built";
  char tmpl[] = "/tmp/spindle-flags-test-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const CommandResult r = RunDaemon({SPINDLE_COORDINATOR_BINARY, "--db=" + dir + "/c.db",
                                     "--listen=0.0.0.0:0", "--metrics-port=-1"});
  EXPECT_EQ(r.exit_code, 2) << r.stderr_text;
  EXPECT_EQ(r.stderr_text,
            "spindle-coordinator: refusing to serve 0.0.0.0:0 (not a loopback address) without "
            "credentials: set --users_file or --token_file (TLS alone names no one), or pass "
            "--insecure to let anyone who reaches it run jobs\n");
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "the coordinator left files in " << dir;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace spindle
