// Job spec parsing: a valid spec round-trips through its canonical JSON; every malformed field
// gives one error naming it.
#include "common/job_spec.h"

#include "gtest/gtest.h"

namespace spindle {
namespace {

constexpr char kValid[] = R"({"name": "demo", "model": {"preset": "tiny"},
  "data": {"source": "synthetic:recall"}, "seq_len": 1024,
  "parallel": {"cp": 2, "dp": 1, "lightning_mode": "allgather"},
  "train": {"steps": 10, "lr": 0.001}, "checkpoint": {"dir": "/tmp/x", "every": 5}})";

TEST(JobSpecTest, ValidSpecRoundTrips) {
  auto s = ParseJobSpec(kValid);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->model.d_model, 64);
  EXPECT_EQ(s->parallel.cp, 2);
  EXPECT_EQ(s->parallel.lightning_mode, CpMode::kAllGather);
  auto again = ParseJobSpecJson(s->ToJson());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->ToJson(), s->ToJson());
}

std::string Error(const std::string& text) {
  auto s = ParseJobSpec(text);
  EXPECT_FALSE(s.ok()) << text;
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(s.status().message());
}

TEST(JobSpecTest, MalformedSpecsNameTheField) {
  const std::string base = R"("model": {"preset": "tiny"}, "data": {"source": "synthetic:recall"})";
  EXPECT_EQ(Error("{"), "job spec: not valid JSON");
  EXPECT_EQ(Error("[]"), "job spec: must be a JSON object");
  EXPECT_EQ(Error(R"({"name": "x", )" + base + "}"), "job spec: seq_len: is required");
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": 64, "bogus": 1, )" + base + "}"),
            "job spec: bogus: unknown field");
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": 64, "train": {"lr": -1}, )" + base + "}"),
            "job spec: train.lr: must be > 0, got -1");
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": 64, "train": {"lrr": 1}, )" + base + "}"),
            "job spec: train.lrr: unknown field");
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": "long", )" + base + "}"),
            "job spec: seq_len: must be an integer, got \"long\"");
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": 64, "model": {"preset": "huge"},
                      "data": {"source": "synthetic:recall"}})"),
            "job spec: model.preset: unknown preset \"huge\" (known: tiny, small, 1b)");
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": 64, "model": {"preset": "tiny", "n_heads": 5},
                      "data": {"source": "synthetic:recall"}})"),
            "job spec: model.n_heads: must divide d_model (64), got 5");
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": 64, "model": {"preset": "tiny"},
                      "data": {"source": "ftp:x"}})"),
            "job spec: data.source: must start with \"synthetic:\", \"tokens:\" or \"text:\", "
            "got \"ftp:x\"");
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": 64, "model": {"preset": "tiny"},
                      "data": {"source": "tokens:/x.bin"}})"),
            "job spec: data.eos_id: is required for a token file");
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": 64, "parallel": {"lightning_mode": "ring"}, )" +
                  base + "}"),
            "job spec: parallel.lightning_mode: must be \"auto\", \"allgather\" or \"all2all\", "
            "got \"ring\"");
  EXPECT_EQ(Error(R"({"name": "x y", "seq_len": 64, )" + base + "}"),
            "job spec: name: may only hold letters, digits, '-', '_' and '.', got \"x y\"");
}

}  // namespace
}  // namespace spindle
