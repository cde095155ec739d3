// safetensors serialisation and validated parsing (see safetensors.h).
#include "worker/engine/safetensors.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/json_fields.h"
#include "nlohmann/json.hpp"

namespace spindle {

std::string SafetensorsHeader(const std::map<std::string, SafetensorsEntry>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  int64_t offset = 0;
  for (const auto& [name, e] : tensors) {
    const int64_t bytes = e.numel * 4;
    header[name] = {
        {"dtype", "F32"}, {"shape", e.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');
  std::string out(8, '\0');
  const uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + h;
}

absl::StatusOr<SafetensorsIndex> ParseSafetensorsHeader(
    const std::function<std::string(uint64_t, uint64_t)>& read_at, uint64_t file_size,
    const std::string& path) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat("checkpoint: \"", path, "\" is corrupt: ", why));
  };
  if (file_size < 8) return bad("shorter than its 8-byte header length");
  const std::string len = read_at(0, 8);
  if (len.size() != 8) return bad("shorter than its 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<uint64_t>(static_cast<unsigned char>(len[i])) << (8 * i);
  if (n > file_size - 8) return bad("header length exceeds the file size");
  const std::string text = read_at(8, n);
  if (text.size() != n) return bad("header length exceeds the file size");
  // Checked before parsing: nlohmann's copies and comparisons recurse once per level.
  if (!JsonDepthWithin(text))
    return bad(absl::StrCat("header nests deeper than ", kMaxJsonDepth, " levels"));
  nlohmann::json header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) return bad("header is not a JSON object");
  SafetensorsIndex f;
  const uint64_t data_begin = 8 + n;
  const uint64_t data_size = file_size - data_begin;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) return bad("__metadata__ is not an object");
      for (auto m = it.value().begin(); m != it.value().end(); ++m)
        if (m.value().is_string()) f.metadata[m.key()] = m.value().get<std::string>();
      continue;
    }
    const auto& t = it.value();
    const std::string name = ShortText(it.key());  // for errors: a key may be the whole header
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") ||
        !t.contains("data_offsets"))
      return bad(absl::StrCat("tensor \"", name, "\" lacks dtype, shape or data_offsets"));
    if (t["dtype"] != "F32")
      return bad(absl::StrCat("tensor \"", name, "\" has dtype ", DescribeJson(t["dtype"]),
                              " (only F32 is supported)"));
    SafetensorsEntry e;
    e.numel = 1;
    const auto& shape = t["shape"];
    if (!shape.is_array()) return bad(absl::StrCat("tensor \"", name, "\" has a bad shape"));
    for (const auto& s : shape) {
      if (!s.is_number_integer() || s.get<int64_t>() < 0)
        return bad(absl::StrCat("tensor \"", name, "\" has a bad shape"));
      e.shape.push_back(s.get<int64_t>());
      // numel * 4 must not overflow (a shape that large cannot fit any file).
      constexpr int64_t kMaxNumel = std::numeric_limits<int64_t>::max() / 4;
      if (e.shape.back() != 0 && e.numel > kMaxNumel / e.shape.back())
        return bad(absl::StrCat("tensor \"", name, "\" has a shape larger than the file"));
      e.numel *= e.shape.back();
    }
    const auto& off = t["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned())
      return bad(absl::StrCat("tensor \"", name, "\" has bad data_offsets"));
    const uint64_t b = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (b > end || end > data_size || end - b != static_cast<uint64_t>(e.numel) * 4 || b % 4 != 0)
      return bad(absl::StrCat("tensor \"", name, "\" data_offsets [", b, ", ", end,
                              "] do not fit the file or the shape"));
    e.offset = data_begin + b;
    f.tensors[it.key()] = e;
  }
  return f;
}

}  // namespace spindle
