// Limits on JSON from outside a process: nesting depth is refused before anything recurses
// (a 100,000-deep job spec used to overflow the stack), and errors quote at most a short piece
// of the input, never a whole array, object or long string.
#include <string>

#include "common/job_spec.h"
#include "common/json_fields.h"
#include "gtest/gtest.h"

namespace spindle {
namespace {

std::string Nested(int depth, char open = '[', char close = ']') {
  return std::string(depth, open) + std::string(depth, close);
}

TEST(JsonLimitsTest, AHundredThousandNestedArraysAreRefusedByTheLimit) {
  auto spec = ParseJobSpec(Nested(100000));
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(spec.status().message(), "job spec: nesting deeper than 64 levels");
  // Inside a field, where the value's description used to recurse through it.
  spec = ParseJobSpec("{\"name\": " + Nested(100000) + "}");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(spec.status().message(), "job spec: nesting deeper than 64 levels");
  // Objects count as arrays do; unterminated nesting too (the parse never starts).
  std::string objects;
  for (int i = 0; i < 100000; ++i) objects += "{\"a\":";
  EXPECT_EQ(ParseJobSpec(objects).status().message(), "job spec: nesting deeper than 64 levels");
}

TEST(JsonLimitsTest, SixtyFourLevelsAreAllowedAndSixtyFiveAreNot) {
  auto ok = ParseStrictJson(Nested(64), "test");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(JsonDepthWithin(Nested(64)));
  EXPECT_FALSE(JsonDepthWithin(Nested(65)));
  auto deep = ParseStrictJson(Nested(65, '[', ']'), "test");
  EXPECT_EQ(deep.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(deep.status().message(), "test: nesting deeper than 64 levels");
  // Siblings do not add up: depth is the deepest open level, not the number of brackets.
  std::string wide = "[";
  for (int i = 0; i < 1000; ++i) wide += Nested(60) + ",";
  wide += "1]";
  EXPECT_TRUE(ParseStrictJson(wide, "test").ok());
}

TEST(JsonLimitsTest, BracketsInsideStringsDoNotCount) {
  const std::string brackets(1000, '[');
  auto j = ParseStrictJson("{\"a\": \"" + brackets + "\", \"b\": \"\\\"" + brackets + "\"}", "t");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ((*j)["b"], "\"" + brackets);
  // An escaped backslash ends before the closing quote: what follows is outside the string.
  EXPECT_FALSE(JsonDepthWithin("[\"\\\\\"" + Nested(100)));
}

TEST(JsonLimitsTest, ErrorsQuoteAShortPieceOfTheInput) {
  const std::string base = R"("model": {"preset": "tiny"}, "data": {"source": "synthetic:recall"})";
  auto err = [&](const std::string& fields) {
    return std::string(ParseJobSpec("{\"name\": \"x\", " + fields + base + "}").status().message());
  };
  EXPECT_EQ(err(R"("seq_len": ")" + std::string(100000, 'x') + "\", "),
            "job spec: seq_len: must be an integer, got \"" + std::string(63, 'x') + "...");
  EXPECT_EQ(err(R"("seq_len": {"a": [1, 2], "b": 3}, )"),
            "job spec: seq_len: must be an integer, got {\"a\":[1,2],\"b\":3}");
  EXPECT_EQ(err(R"("seq_len": 64, "train": {"lr": [1]}, )"),
            "job spec: train.lr: must be a number, got [1]");
  std::string ones = "[";  // compact already: its dump is the same text
  for (int i = 0; i < 50000; ++i) ones += "1,";
  ones += "1]";
  EXPECT_EQ(err(R"("seq_len": )" + ones + ", "),
            "job spec: seq_len: must be an integer, got " + ones.substr(0, 64) + "...");
  EXPECT_EQ(err("\"" + std::string(100000, 'k') + "\": 1, \"seq_len\": 64, "),
            "job spec: " + std::string(64, 'k') + "...: unknown field");
  EXPECT_EQ(
      err(R"("seq_len": 64, "resources": ")" + std::string(100000, 'r') + "\", "),
      "job spec: resources: must be \"cpu\" or \"cuda\", got \"" + std::string(64, 'r') + "...\"");
  // A syntax error quotes the token it stopped in, which for an unterminated string is the
  // rest of the input.
  EXPECT_EQ(ParseJobSpec("{\"name\": \"" + std::string(100000, 'a')).status().message(),
            "job spec: not valid JSON: parse error at line 1, column 100011: syntax error while "
            "parsing value - invalid string: missing closing quote; last read: '\"" +
                std::string(63, 'a') + "...'");
  // What follows the token is kept.
  EXPECT_EQ(ParseJobSpec("{\"name\": 1x}").status().message(),
            "job spec: not valid JSON: parse error at line 1, column 11: syntax error while "
            "parsing object - invalid literal; last read: '1x'; expected '}'");
  // A cut never splits a UTF-8 character: 63 ASCII bytes, then a 2-byte character.
  EXPECT_EQ(ShortText(std::string(63, 'a') + "\xc3\xa9" + "bbb"), std::string(63, 'a') + "...");
  EXPECT_EQ(ShortText("short"), "short");
}

}  // namespace
}  // namespace spindle
