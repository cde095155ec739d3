// safetensors headers (worker/engine/safetensors.h): what SafetensorsHeader writes parses back to
// the same shapes and back-to-back offsets, and every malformed header is a DataLoss error that
// names the file and the problem. The data itself is streamed by the checkpoint code (its tests
// are in test_trainer.cc and test_device_trainer.cc).
#include <cstring>
#include <map>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "worker/engine/safetensors.h"

namespace spindle {
namespace {

// A file held in memory, read the way the checkpoint reader reads (fewer bytes at its end).
struct MemFile {
  std::string bytes;
  std::string Read(uint64_t off, uint64_t n) const {
    if (off >= bytes.size()) return "";
    return bytes.substr(off, std::min<uint64_t>(n, bytes.size() - off));
  }
};

absl::StatusOr<SafetensorsIndex> Parse(const MemFile& f) {
  return ParseSafetensorsHeader([&f](uint64_t o, uint64_t n) { return f.Read(o, n); },
                                f.bytes.size(), "x.safetensors");
}

TEST(SafetensorsTest, HeaderRoundTripsShapesOffsetsAndMetadata) {
  std::mt19937 rng(std::random_device{}());
  std::map<std::string, SafetensorsEntry> tensors;
  int64_t total = 0;
  for (int i = 0; i < 7; ++i) {
    SafetensorsEntry e;
    e.shape = {1 + static_cast<int64_t>(rng() % 9), 1 + static_cast<int64_t>(rng() % 5)};
    e.numel = e.shape[0] * e.shape[1];
    total += e.numel;
    tensors["t" + std::to_string(rng() % 1000) + "_" + std::to_string(i)] = e;
  }
  const std::string header = SafetensorsHeader(tensors, {{"format", "pt"}});
  EXPECT_EQ(header.size() % 8, 0u);
  MemFile f{header + std::string(static_cast<size_t>(total) * 4, '\0')};
  auto idx = Parse(f);
  ASSERT_TRUE(idx.ok()) << idx.status();
  EXPECT_EQ(idx->metadata.at("format"), "pt");
  ASSERT_EQ(idx->tensors.size(), tensors.size());
  uint64_t next = header.size();  // data back to back in name order
  for (const auto& [name, e] : tensors) {
    const SafetensorsEntry& got = idx->tensors.at(name);
    EXPECT_EQ(got.shape, e.shape) << name;
    EXPECT_EQ(got.numel, e.numel) << name;
    EXPECT_EQ(got.offset, next) << name;
    next += static_cast<uint64_t>(e.numel) * 4;
  }
  EXPECT_EQ(next, f.bytes.size());
}

TEST(SafetensorsTest, EveryMalformedHeaderIsOneErrorNamingIt) {
  std::map<std::string, SafetensorsEntry> one;
  one["w"] = {{2, 3}, nullptr, 6, 0};
  const std::string good = SafetensorsHeader(one, {}) + std::string(24, '\0');
  auto length_field = [](uint64_t n) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return s;
  };
  auto with_header = [&](const std::string& json) { return length_field(json.size()) + json; };
  const struct {
    std::string bytes, why;
  } cases[] = {
      {"abc", "shorter than its 8-byte header length"},
      {length_field(1000) + "{}", "header length exceeds the file size"},
      {with_header("[1, 2]"), "header is not a JSON object"},
      {with_header("{\"w\": {\"dtype\": \"F32\"}}"),
       "tensor \"w\" lacks dtype, shape or data_offsets"},
      {with_header("{\"w\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [0, 4]}}") +
           std::string(4, '\0'),
       "tensor \"w\" has dtype \"F16\" (only F32 is supported)"},
      {with_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [-2], \"data_offsets\": [0, 8]}}"),
       "tensor \"w\" has a bad shape"},
      {with_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}") +
           std::string(4, '\0'),
       "tensor \"w\" data_offsets [0, 8] do not fit the file or the shape"},
      {with_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 8]}}") +
           std::string(8, '\0'),
       "tensor \"w\" data_offsets [0, 8] do not fit the file or the shape"},
      {good.substr(0, good.size() - 4),
       "tensor \"w\" data_offsets [0, 24] do not fit the file or the shape"},
      // Refused before parsing: nlohmann recurses once per level when it copies or compares.
      {with_header(std::string(100000, '[') + std::string(100000, ']')),
       "header nests deeper than 64 levels"},
      // Dimensions whose product overflows int64 (it used to, silently).
      {with_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [4611686018427387904, 4], "
                   "\"data_offsets\": [0, 0]}}"),
       "tensor \"w\" has a shape larger than the file"},
      {with_header("{\"w\": {\"dtype\": \"F32\", \"shape\": 2, \"data_offsets\": [0, 8]}}") +
           std::string(8, '\0'),
       "tensor \"w\" has a bad shape"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.why);
    auto idx = Parse(MemFile{c.bytes});
    ASSERT_FALSE(idx.ok());
    EXPECT_EQ(idx.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(idx.status().message(), "checkpoint: \"x.safetensors\" is corrupt: " + c.why);
  }
  EXPECT_TRUE(Parse(MemFile{good}).ok());
}

}  // namespace
}  // namespace spindle
