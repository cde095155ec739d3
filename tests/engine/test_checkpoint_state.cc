// state.json of a checkpoint as untrusted text: nesting is refused before parsing, and every
// field the loader reads must have the type it is read as, so a corrupt file is one DataLoss
// error naming it, never a thrown exception or a stack overflow.
#include <string>

#include "gtest/gtest.h"
#include "worker/engine/checkpoint.h"

namespace spindle {
namespace {

constexpr char kPath[] = "/ck/step_00000001/state.json";

std::string Error(const std::string& text) {
  auto st = ParseCheckpointState(text, kPath);
  EXPECT_EQ(st.status().code(), absl::StatusCode::kDataLoss) << text.substr(0, 200);
  return std::string(st.status().message());
}

TEST(CheckpointStateTest, AValidStateParses) {
  auto st = ParseCheckpointState(
      R"({"step": 3, "data_position": 6, "seed": 1, "rng_counter": 0, "optimizer_steps": 3,
          "model": {"vocab": 257}, "files": {"model.safetensors": {"bytes": 8, "crc32": 1}}})",
      kPath);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ((*st)["step"], 3);
}

TEST(CheckpointStateTest, DeepNestingIsRefusedBeforeParsing) {
  EXPECT_EQ(Error(std::string(100000, '[') + std::string(100000, ']')),
            "checkpoint: \"/ck/step_00000001/state.json\" is corrupt: nests deeper than 64 levels");
  EXPECT_EQ(Error(R"({"step": 1, "files": {}, "model": )" + std::string(100000, '{')),
            "checkpoint: \"/ck/step_00000001/state.json\" is corrupt: nests deeper than 64 levels");
}

TEST(CheckpointStateTest, FieldsOfTheWrongTypeAreNamed) {
  const std::string prefix = "checkpoint: \"/ck/step_00000001/state.json\" is corrupt";
  EXPECT_EQ(Error("not json"), prefix);
  EXPECT_EQ(Error(R"({"step": 1, "model": {}})"), prefix);
  EXPECT_EQ(Error(R"({"step": 1, "files": {}, "model": []})"), prefix + ": model is not an object");
  EXPECT_EQ(Error(R"({"step": "1", "files": {}, "model": {}})"),
            prefix + ": step is not an integer");
  EXPECT_EQ(Error(R"({"step": 1, "seed": 1.5, "files": {}, "model": {}})"),
            prefix + ": seed is not an integer");
  EXPECT_EQ(Error(R"({"step": 1, "files": [], "model": {}})"), prefix + ": files is not an object");
  EXPECT_EQ(Error(R"({"step": 1, "files": {"model.safetensors": 5}, "model": {}})"),
            prefix + ": files.model.safetensors is not an object");
  EXPECT_EQ(Error(R"({"step": 1, "files": {"model.safetensors": {"bytes": "8"}}, "model": {}})"),
            prefix + ": files.model.safetensors.bytes is not an unsigned integer");
  EXPECT_EQ(Error(R"({"step": 1, "files": {"m": {"crc32": -1}}, "model": {}})"),
            prefix + ": files.m.crc32 is not an unsigned integer");
}

}  // namespace
}  // namespace spindle
