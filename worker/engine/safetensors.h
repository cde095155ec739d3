// safetensors files: an 8-byte little-endian header length, a JSON header mapping each tensor
// name to {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, then the raw data.
// Only F32 tensors are written and read. The functions here deal with the header only, so that
// callers stream the data straight from and into their own buffers (a 1B-parameter model's
// checkpoint is 12 GB: it is never held in memory a second time). Parsing validates every offset
// and size against the file size, so a truncated or corrupt file is an error naming the file,
// never a crash. Stateless functions; thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace spindle {

struct SafetensorsEntry {
  std::vector<int64_t> shape;
  const float* data = nullptr;  // writing: the source values
  int64_t numel = 0;
  uint64_t offset = 0;          // reading: where the values start, in bytes from the file start
};

// The bytes before the data: the length field and the JSON header (tensors sorted by name, as the
// format's writers do, laid out back to back in that order; optional string metadata), padded
// with spaces so the data starts 8-byte aligned. The data follows: each tensor's numel * 4 bytes
// in name order.
std::string SafetensorsHeader(const std::map<std::string, SafetensorsEntry>& tensors,
                              const std::map<std::string, std::string>& metadata);

struct SafetensorsIndex {
  std::map<std::string, SafetensorsEntry> tensors;  // offset and shape set, data null
  std::map<std::string, std::string> metadata;
};

// Parses a header. `read_at(offset, n)` returns n bytes of the file from offset (or fewer at its
// end); file_size bounds every tensor. DataLoss errors name `path`.
absl::StatusOr<SafetensorsIndex> ParseSafetensorsHeader(
    const std::function<std::string(uint64_t, uint64_t)>& read_at, uint64_t file_size,
    const std::string& path);

}  // namespace spindle
