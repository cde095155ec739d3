// The lines of the coordinator's credential files (worker tokens, bootstrap tokens, users): each
// line that is neither blank nor a '#' comment, split on spaces and tabs, with its 1-based number
// for the parsers' errors. Pure function; thread-safe.
#pragma once

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace spindle {

struct CredentialLine {
  int number = 0;
  std::vector<std::string> fields;
};

inline std::vector<CredentialLine> CredentialLines(const std::string& text) {
  std::vector<CredentialLine> out;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    out.push_back({number, absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty())});
  }
  return out;
}

}  // namespace spindle
