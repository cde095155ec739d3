// Host memory from /proc/meminfo and the cgroup's limit (see host_memory.h).
#include "common/host_memory.h"

#include <algorithm>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace spindle {
namespace {

// A v1 cgroup without a limit reports LONG_MAX rounded down to a page; anything this large is no
// limit.
constexpr int64_t kNoLimit = int64_t{1} << 60;

std::string ReadFile(const char* path) {
  std::ifstream in(path);
  if (!in) return "";
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The cgroup's memory limit (v2 at /sys/fs/cgroup, else v1's memory controller); 0 when there
// is none. `usage` (nullable) gets its working set when there is a limit: its usage less the
// inactive file cache, which the kernel reclaims before it kills anything, as container runtimes
// count it.
int64_t CgroupLimit(int64_t* usage) {
  int64_t limit = CgroupBytes(ReadFile("/sys/fs/cgroup/memory.max"));
  const bool v2 = limit > 0;
  if (!v2) limit = CgroupBytes(ReadFile("/sys/fs/cgroup/memory/memory.limit_in_bytes"));
  if (usage == nullptr || limit <= 0) return limit;
  *usage = v2 ? CgroupBytes(ReadFile("/sys/fs/cgroup/memory.current")) -
                    MemoryStatValue(ReadFile("/sys/fs/cgroup/memory.stat"), "inactive_file")
              : CgroupBytes(ReadFile("/sys/fs/cgroup/memory/memory.usage_in_bytes")) -
                    MemoryStatValue(ReadFile("/sys/fs/cgroup/memory/memory.stat"),
                                    "total_inactive_file");
  *usage = std::max<int64_t>(0, *usage);
  return limit;
}

// The rest of the first line of `text` that starts with `key` then `sep`, without surrounding
// spaces; nullopt when no line does.
std::optional<absl::string_view> ValueOf(std::string_view text, std::string_view key,
                                         absl::string_view sep) {
  const absl::string_view all(text.data(), text.size()), name(key.data(), key.size());
  for (absl::string_view line : absl::StrSplit(all, '\n')) {
    if (absl::ConsumePrefix(&line, name) && absl::ConsumePrefix(&line, sep))
      return absl::StripAsciiWhitespace(line);
  }
  return std::nullopt;
}

// `bytes` capped by `cap` where both are known (> 0).
int64_t Capped(int64_t bytes, int64_t cap) {
  if (cap <= 0) return bytes;
  if (bytes <= 0) return cap;
  return std::min(bytes, cap);
}

}  // namespace

int64_t MeminfoBytes(std::string_view meminfo, std::string_view field) {
  std::optional<absl::string_view> value = ValueOf(meminfo, field, ":");
  if (!value) return 0;
  const bool kb = absl::ConsumeSuffix(&*value, "kB");
  int64_t v = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*value), &v) || v < 0) return 0;
  return kb ? v * 1024 : v;
}

int64_t MemoryStatValue(std::string_view stat, std::string_view key) {
  const std::optional<absl::string_view> value = ValueOf(stat, key, " ");
  int64_t v = 0;
  return value && absl::SimpleAtoi(*value, &v) && v > 0 ? v : 0;
}

int64_t CgroupBytes(std::string_view text) {
  const absl::string_view t =
      absl::StripAsciiWhitespace(absl::string_view(text.data(), text.size()));
  int64_t v = 0;
  if (!absl::SimpleAtoi(t, &v) || v <= 0 || v >= kNoLimit) return 0;
  return v;
}

int64_t HostMemoryLimitBytes() {
  return Capped(MeminfoBytes(ReadFile("/proc/meminfo"), "MemTotal"), CgroupLimit(nullptr));
}

int64_t HostMemoryAvailableBytes() {
  int64_t usage = 0;
  const int64_t limit = CgroupLimit(&usage);
  const int64_t available = MeminfoBytes(ReadFile("/proc/meminfo"), "MemAvailable");
  if (limit <= 0) return available;
  return Capped(available, std::max<int64_t>(1, limit - usage));
}

}  // namespace spindle
