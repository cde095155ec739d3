// TestNetwork: hosts for multi-host tests, as network namespaces this process creates. Each host
// is a namespace with a loopback and one `eth0` whose veth peer sits on a bridge in a namespace of
// its own, so the hosts reach each other only through that bridge. Addresses come from the
// benchmarking range 198.18.0.0/15 (RFC 2544), a /24 per test process, and are assigned inside
// the namespaces only: no address of this machine changes and no traffic leaves the namespaces.
// Cut(i) takes host i's port on the bridge down (its packets vanish, as with a pulled cable) and
// Restore(i) brings it back. Everything is deleted by the destructor; namespaces a killed test
// left behind (named after a process that no longer runs) are deleted by the next Create() and by
// RemoveStaleNamespaces(), which a ctest cleanup fixture runs.
// Thread-safety: owned by one test thread; Cut/Restore may be called from a fault thread.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/subprocess.h"

namespace spindle::testing {

inline constexpr char kNamespacePrefix[] = "spindle-t";

// Runs `ip` with `args`; the error names the command and what it printed.
inline absl::Status Ip(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"ip"};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<CommandResult> r = RunCommand(argv, "", absl::Seconds(20));
  if (!r.ok()) return r.status();
  if (r->exit_code != 0)
    return absl::InternalError(absl::StrCat("ip ", absl::StrJoin(args, " "), ": ", r->stderr_text));
  return absl::OkStatus();
}

// Deletes every namespace named "<prefix><pid>-..." whose process is gone.
inline void RemoveStaleNamespaces() {
  absl::StatusOr<CommandResult> r = RunCommand({"ip", "netns", "list"}, "", absl::Seconds(20));
  if (!r.ok() || r->exit_code != 0) return;
  for (absl::string_view line : absl::StrSplit(r->stdout_text, '\n')) {
    const std::string name(line.substr(0, line.find(' ')));
    if (name.rfind(kNamespacePrefix, 0) != 0) continue;
    const std::string rest = name.substr(sizeof(kNamespacePrefix) - 1);
    int pid = 0;
    if (!absl::SimpleAtoi(rest.substr(0, rest.find('-')), &pid)) continue;
    if (pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM)) continue;  // still running
    Ip({"netns", "delete", name}).IgnoreError();
  }
}

class TestNetwork {
 public:
  // `hosts` namespaces, host i at Address(i). Unavailable (the test skips) when namespaces
  // cannot be created here (no privileges, no iproute2).
  static absl::StatusOr<std::unique_ptr<TestNetwork>> Create(int hosts) {
    RemoveStaleNamespaces();
    auto net = std::unique_ptr<TestNetwork>(new TestNetwork());
    const std::string probe = absl::StrCat(kNamespacePrefix, ::getpid(), "-probe");
    if (absl::Status s = Ip({"netns", "add", probe}); !s.ok())
      return absl::UnavailableError(
          absl::StrCat("cannot create network namespaces: ", s.message()));
    Ip({"netns", "delete", probe}).IgnoreError();
    net->subnet_ = absl::StrCat("198.18.", ::getpid() % 250, ".");
    const std::string br = net->Namespace(-1);
    auto step = [&](const std::vector<std::string>& args) -> absl::Status { return Ip(args); };
    net->created_.push_back(br);
    absl::Status s = step({"netns", "add", br});
    if (s.ok()) s = step({"-n", br, "link", "set", "lo", "up"});
    if (s.ok()) s = step({"-n", br, "link", "add", "br0", "type", "bridge"});
    if (s.ok()) s = step({"-n", br, "link", "set", "br0", "up"});
    for (int i = 0; s.ok() && i < hosts; ++i) {
      const std::string ns = net->Namespace(i);
      net->created_.push_back(ns);
      const std::string port = absl::StrCat("h", i);
      s = step({"netns", "add", ns});
      if (s.ok()) s = step({"-n", ns, "link", "set", "lo", "up"});
      if (s.ok())
        s = step(
            {"-n", br, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns});
      if (s.ok()) s = step({"-n", br, "link", "set", port, "master", "br0"});
      if (s.ok()) s = step({"-n", br, "link", "set", port, "up"});
      if (s.ok()) s = step({"-n", ns, "addr", "add", net->Address(i) + "/24", "dev", "eth0"});
      if (s.ok()) s = step({"-n", ns, "link", "set", "eth0", "up"});
    }
    if (!s.ok()) return s;  // the destructor deletes what was made
    net->hosts_ = hosts;
    return net;
  }

  ~TestNetwork() {
    for (auto it = created_.rbegin(); it != created_.rend(); ++it)
      Ip({"netns", "delete", *it}).IgnoreError();
  }
  TestNetwork(const TestNetwork&) = delete;
  TestNetwork& operator=(const TestNetwork&) = delete;

  int hosts() const { return hosts_; }
  // Host i's namespace (i = -1: the bridge's).
  std::string Namespace(int i) const {
    return absl::StrCat(kNamespacePrefix, ::getpid(), i < 0 ? "-br" : absl::StrCat("-h", i));
  }
  std::string Address(int i) const { return absl::StrCat(subnet_, i + 1); }
  // argv run inside host i (`ip netns exec` execs it: the pid is the program's).
  std::vector<std::string> On(int i, const std::vector<std::string>& argv) const {
    std::vector<std::string> out = {"ip", "netns", "exec", Namespace(i)};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }
  absl::Status Cut(int i) {
    return Ip({"-n", Namespace(-1), "link", "set", absl::StrCat("h", i), "down"});
  }
  absl::Status Restore(int i) {
    return Ip({"-n", Namespace(-1), "link", "set", absl::StrCat("h", i), "up"});
  }

 private:
  TestNetwork() = default;
  int hosts_ = 0;
  std::string subnet_;
  std::vector<std::string> created_;
};

}  // namespace spindle::testing
