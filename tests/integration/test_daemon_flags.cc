// The daemons' command lines, run for real: --help lists each daemon's own flags with their
// defaults, and flags spelled with hyphens (as the usage lines and docs write them) are accepted
// like absl's underscores, while a misspelt flag is still refused by name.
#include <string>
#include <vector>

#include "absl/strings/match.h"
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

}  // namespace
}  // namespace spindle
