// safetensors files: an 8-byte little-endian header length, a JSON header mapping each tensor
// name to {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, then the raw data.
// Only F32 tensors are written and read. Reading validates every offset and size against the
// file, so a truncated or corrupt file is an error naming the file, never a crash.
// Stateless functions; thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace spindle {

struct SafetensorsEntry {
  std::vector<int64_t> shape;
  const float* data = nullptr;  // write: source; read: points into SafetensorsFile::bytes
  int64_t numel = 0;
};

// Serialises the tensors (sorted by name, as the format's writers do) with optional string
// metadata into the bytes of a safetensors file.
std::string SerializeSafetensors(const std::map<std::string, SafetensorsEntry>& tensors,
                                 const std::map<std::string, std::string>& metadata);

struct SafetensorsFile {
  std::string bytes;  // the whole file; entries point into it
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;
};

// Parses bytes read from `path` (used in messages only).
absl::StatusOr<SafetensorsFile> ParseSafetensors(std::string bytes, const std::string& path);

}  // namespace spindle
