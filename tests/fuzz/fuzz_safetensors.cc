// Fuzz target: the safetensors header reader (ParseSafetensorsHeader), which every checkpoint
// load runs on model.safetensors and optimizer.safetensors. The input is a whole file; any input
// must give an index whose every tensor lies inside the file, or a DataLoss error.
// Seeds: corpus/fuzz_safetensors/ (files as SafetensorsHeader writes them, and a few corrupt ones).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "worker/engine/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string file(reinterpret_cast<const char*>(data), size);
  auto read_at = [&file](uint64_t offset, uint64_t n) -> std::string {
    if (offset >= file.size()) return "";
    return file.substr(offset, n);
  };
  auto index = spindle::ParseSafetensorsHeader(read_at, file.size(), "fuzz.safetensors");
  if (!index.ok()) {
    if (index.status().code() != absl::StatusCode::kDataLoss) std::abort();
    if (index.status().message().size() > 1024) std::abort();
    return 0;
  }
  for (const auto& [name, e] : index->tensors) {
    int64_t numel = 1;
    for (int64_t d : e.shape) numel *= d;
    if (numel != e.numel || e.offset > file.size() ||
        static_cast<uint64_t>(e.numel) * 4 > file.size() - e.offset)
      std::abort();
  }
  return 0;
}
