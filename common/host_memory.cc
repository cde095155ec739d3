// Host memory from /proc/meminfo (see host_memory.h).
#include "common/host_memory.h"

#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace spindle {

int64_t MeminfoBytes(std::string_view meminfo, std::string_view field) {
  const absl::string_view text(meminfo.data(), meminfo.size()), name(field.data(), field.size());
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, name) || !absl::ConsumePrefix(&line, ":")) continue;
    line = absl::StripAsciiWhitespace(line);
    const bool kb = absl::ConsumeSuffix(&line, "kB");
    int64_t v = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &v) || v < 0) return 0;
    return kb ? v * 1024 : v;
  }
  return 0;
}

int64_t HostMemoryBytes(std::string_view field) {
  std::ifstream in("/proc/meminfo");
  if (!in) return 0;
  std::stringstream text;
  text << in.rdbuf();
  return MeminfoBytes(text.str(), field);
}

}  // namespace spindle
