#include "common/path_rules.h"

#include <filesystem>

namespace spindle {

std::string DataSourceFile(const DataSpec& data) {
  for (const std::string prefix : {"tokens:", "text:"})
    if (data.source.rfind(prefix, 0) == 0) return data.source.substr(prefix.size());
  return "";
}

bool HasDotDotComponent(const std::string& path) {
  for (const auto& part : std::filesystem::path(path))
    if (part == "..") return true;
  return false;
}

bool LexicallyWithin(const std::string& path, const std::string& root) {
  const std::filesystem::path p(path), r(root);
  if (!p.is_absolute() || !r.is_absolute() || HasDotDotComponent(path)) return false;
  auto q = p.begin();
  for (auto it = r.begin(); it != r.end(); ++it) {
    if (it->empty()) continue;  // a trailing separator of the root
    if (q == p.end() || *q != *it) return false;
    ++q;
  }
  return true;
}

}  // namespace spindle
