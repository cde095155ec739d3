// Job spec parsing: a valid spec round-trips through its canonical JSON; every malformed field
// gives one error naming it.
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/json_fields.h"
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

// train.recompute: false, true (every layer), a number of layers or "auto"; each round-trips.
TEST(JobSpecTest, RecomputeTakesABoolACountOrAuto) {
  auto with = [](const std::string& v) {
    return ParseJobSpec(R"({"name": "r", "model": {"preset": "tiny"}, "seq_len": 64,
      "data": {"source": "synthetic:recall"}, "train": {"recompute": )" +
                        v + "}}");
  };
  struct Case {
    std::string json;
    int64_t layers;
  };
  for (const Case& c : {Case{"false", 0}, Case{"true", 4}, Case{"0", 0}, Case{"3", 3}, Case{"4", 4},
                        Case{"\"auto\"", TrainSpec::kRecomputeAuto}}) {
    auto s = with(c.json);
    ASSERT_TRUE(s.ok()) << c.json << ": " << s.status();
    EXPECT_EQ(s->train.recompute_layers, c.layers) << c.json;
    auto again = ParseJobSpecJson(s->ToJson());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->train.recompute_layers, c.layers) << c.json;
  }
  EXPECT_EQ(with("3")->ToJson()["train"]["recompute"], 3);
  EXPECT_EQ(with("4")->ToJson()["train"]["recompute"], true);
  EXPECT_EQ(with("\"auto\"")->ToJson()["train"]["recompute"], "auto");
  EXPECT_EQ(ParseJobSpec(kValid)->ToJson()["train"]["recompute"], false);  // the default
  for (const std::string bad : {"5", "-1", "1.5", "\"some\"", "null", "[2]"}) {
    auto s = with(bad);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().message(),
              "job spec: train.recompute: must be false, true, \"auto\" or a number of layers in "
              "[0, 4], got " +
                  bad);
  }
}

// parallel.verify: "first" by default (left out of the canonical JSON), "off" or a positive number
// of steps; each round-trips; anything else is refused with one error naming the field.
TEST(JobSpecTest, VerifyIsOffFirstOrEveryNSteps) {
  auto with = [](const std::string& v) {
    return ParseJobSpec(R"({"name": "v", "model": {"preset": "tiny"}, "seq_len": 64,
      "data": {"source": "synthetic:recall"}, "parallel": {"cp": 2, "verify": )" +
                        v + "}}");
  };
  EXPECT_EQ(ParseJobSpec(kValid)->parallel.verify, ParallelSpec::kVerifyFirst);
  EXPECT_FALSE(ParseJobSpec(kValid)->ToJson()["parallel"].contains("verify"));
  struct Case {
    std::string json;
    int64_t verify;
  };
  for (const Case& c :
       {Case{"\"first\"", ParallelSpec::kVerifyFirst}, Case{"\"off\"", ParallelSpec::kVerifyOff},
        Case{"1", 1}, Case{"50", 50}, Case{"9223372036854775807", INT64_MAX}}) {
    auto s = with(c.json);
    ASSERT_TRUE(s.ok()) << c.json << ": " << s.status();
    EXPECT_EQ(s->parallel.verify, c.verify) << c.json;
    auto again = ParseJobSpecJson(s->ToJson());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->parallel.verify, c.verify) << c.json;
    EXPECT_EQ(again->ToJson(), s->ToJson());
  }
  EXPECT_FALSE(with("\"first\"")->ToJson()["parallel"].contains("verify"));
  EXPECT_EQ(with("\"off\"")->ToJson()["parallel"]["verify"], "off");
  EXPECT_EQ(with("50")->ToJson()["parallel"]["verify"], 50);
  for (const std::string bad :
       {"0", "-3", "1.5", "\"every\"", "\"First\"", "true", "null", "[1]", "9223372036854775808"}) {
    auto s = with(bad);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(s.status().message(),
              "job spec: parallel.verify: must be \"off\", \"first\" or a positive number of "
              "steps, got " +
                  bad);
  }
}

// train.z_loss: 0 by default and then left out of the canonical form; a value in [0, 1]
// round-trips; anything else is refused naming the field.
TEST(JobSpecTest, ZLossIsACoefficientInZeroOne) {
  auto with = [](const std::string& v) {
    return ParseJobSpec(R"({"name": "z", "model": {"preset": "tiny"}, "seq_len": 64,
      "data": {"source": "synthetic:recall"}, "train": {"z_loss": )" + v + "}}");
  };
  EXPECT_EQ(ParseJobSpec(kValid)->train.z_loss, 0.0);
  EXPECT_FALSE(ParseJobSpec(kValid)->ToJson()["train"].contains("z_loss"));
  auto on = with("1e-4");
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(on->train.z_loss, 1e-4);
  auto again = ParseJobSpecJson(on->ToJson());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->train.z_loss, 1e-4);
  EXPECT_TRUE(with("1").ok());
  EXPECT_TRUE(with("0").ok());
  auto neg = with("-0.5");
  ASSERT_FALSE(neg.ok());
  EXPECT_EQ(neg.status().message(),
            "job spec: train.z_loss: must be in [0, 1] (0 disables it), got -0.5");
  for (const std::string bad : {"2", "\"big\"", "null", "true"}) {
    auto s = with(bad);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.status().message().find("train.z_loss"), std::string::npos) << s.status();
  }
}

// checkpoint.replicas: {"every": n}; absent (or 0) by default and then left out of the canonical
// form; a positive count round-trips; without checkpoint.dir, with a negative count, without
// "every" or with another field, refused naming the field.
TEST(JobSpecTest, ReplicasTakeAnIntervalAndNeedACheckpointDirectory) {
  auto with = [](const std::string& checkpoint) {
    return ParseJobSpec(R"({"name": "r", "model": {"preset": "tiny"}, "seq_len": 64,
      "data": {"source": "synthetic:recall"}, "checkpoint": )" +
                        checkpoint + "}");
  };
  EXPECT_EQ(ParseJobSpec(kValid)->checkpoint.replicas_every, 0);
  EXPECT_FALSE(ParseJobSpec(kValid)->ToJson()["checkpoint"].contains("replicas"));
  auto on = with(R"({"dir": "/tmp/c", "every": 100, "replicas": {"every": 5}})");
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(on->checkpoint.replicas_every, 5);
  auto again = ParseJobSpecJson(on->ToJson());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->checkpoint.replicas_every, 5);
  EXPECT_EQ(with(R"({"dir": "/tmp/c", "replicas": {"every": 0}})")->checkpoint.replicas_every, 0);
  const std::pair<std::string, std::string> bad[] = {
      {R"({"replicas": {"every": 5}})",
       "job spec: checkpoint.replicas: needs checkpoint.dir (a restart falls back to the job's "
       "file checkpoints when no replica survives)"},
      {R"({"dir": "/tmp/c", "replicas": {"every": -1}})",
       "job spec: checkpoint.replicas.every: must be >= 0 (0: no replicas), got -1"},
      {R"({"dir": "/tmp/c", "replicas": {}})", "checkpoint.replicas.every"},
      {R"({"dir": "/tmp/c", "replicas": {"every": 2, "copies": 3}})", "checkpoint.replicas"},
      {R"({"dir": "/tmp/c", "replicas": 5})", "checkpoint.replicas"}};
  for (const auto& [spec, message] : bad) {
    auto s = with(spec);
    ASSERT_FALSE(s.ok()) << spec;
    EXPECT_NE(s.status().message().find(message), std::string::npos) << s.status();
  }
}

// train.fp8_recipe: "tensorwise" by default (left out of the canonical form), "blockwise" on an
// fp8 job round-trips (cpu or cuda); on a job that is not fp8, or any other word, refused naming
// the field.
TEST(JobSpecTest, Fp8RecipeIsTensorwiseOrBlockwiseOnFp8Jobs) {
  auto with = [](const std::string& train, const std::string& resources = "cpu") {
    return ParseJobSpec(R"({"name": "f", "model": {"preset": "tiny"}, "seq_len": 64,
      "data": {"source": "synthetic:recall"}, "resources": ")" +
                        resources + R"(", "train": )" + train + "}");
  };
  EXPECT_EQ(ParseJobSpec(kValid)->train.fp8_recipe, TrainFp8Recipe::kTensorwise);
  auto on = with(R"({"precision": "fp8", "fp8_recipe": "blockwise"})");
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(on->train.fp8_recipe, TrainFp8Recipe::kBlockwise);
  EXPECT_EQ(on->ToJson()["train"]["fp8_recipe"], "blockwise");
  auto again = ParseJobSpecJson(on->ToJson());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->train.fp8_recipe, TrainFp8Recipe::kBlockwise);
  auto tensorwise = with(R"({"precision": "fp8", "fp8_recipe": "tensorwise"})");
  ASSERT_TRUE(tensorwise.ok()) << tensorwise.status();
  EXPECT_FALSE(tensorwise->ToJson()["train"].contains("fp8_recipe"));

  auto bf16 = with(R"({"precision": "bf16", "fp8_recipe": "blockwise"})");
  ASSERT_FALSE(bf16.ok());
  EXPECT_EQ(bf16.status().message(),
            "job spec: train.fp8_recipe: \"blockwise\" scales FP8 inputs, and train.precision is "
            "\"bf16\"; set precision \"fp8\" or drop fp8_recipe");
  // On cuda the spec parses; the planner decides (a MoE model is its problem, CpPlannerTest).
  auto cuda = with(R"({"precision": "fp8", "fp8_recipe": "blockwise"})", "cuda");
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  EXPECT_EQ(cuda->train.fp8_recipe, TrainFp8Recipe::kBlockwise);
  auto word = with(R"({"precision": "fp8", "fp8_recipe": "rowwise"})");
  ASSERT_FALSE(word.ok());
  EXPECT_NE(word.status().message().find("train.fp8_recipe: must be \"tensorwise\" or "
                                         "\"blockwise\", got \"rowwise\""),
            std::string::npos)
      << word.status();
}

// parallel.elastic: absent is a fixed job; the range holds the spec's world, wait_s and batch
// have defaults, everything round-trips, and every bad value is one error naming the field.
TEST(JobSpecTest, ElasticIsARangeHoldingTheWorld) {
  auto with = [](const std::string& parallel,
                 const std::string& checkpoint = R"(, "checkpoint": {"dir": "/tmp/e"})") {
    return ParseJobSpec(R"({"name": "e", "model": {"preset": "tiny"}, "seq_len": 64,
      "data": {"source": "synthetic:recall"}, "parallel": )" +
                        parallel + checkpoint + "}");
  };
  auto fixed = ParseJobSpec(kValid);
  EXPECT_FALSE(fixed->parallel.elastic.enabled());
  EXPECT_FALSE(fixed->ToJson()["parallel"].contains("elastic"));

  auto s = with(R"({"cp": 4, "elastic": {"min_world": 2}})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->parallel.elastic.enabled());
  EXPECT_EQ(s->parallel.elastic.min_world, 2);
  EXPECT_EQ(s->parallel.elastic.max_world, 4);  // the spec's world
  EXPECT_EQ(s->parallel.elastic.wait_s, 60);
  EXPECT_EQ(s->parallel.elastic.batch, ElasticSpec::Batch::kKeep);
  auto full = with(
      R"({"cp": 2, "dp": 2, "elastic": {"min_world": 1, "max_world": 8, "wait_s": 2.5, "batch": "scale"}})");
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->parallel.elastic.max_world, 8);
  EXPECT_EQ(full->parallel.elastic.wait_s, 2.5);
  EXPECT_EQ(full->parallel.elastic.batch, ElasticSpec::Batch::kScale);
  for (const auto* spec : {&*s, &*full}) {
    auto again = ParseJobSpecJson(spec->ToJson());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->ToJson(), spec->ToJson());
  }

  struct Bad {
    std::string parallel;
    std::string error;
  };
  for (const Bad& b : {
           Bad{R"({"cp": 4, "elastic": {}})", "job spec: parallel.elastic.min_world: is required"},
           Bad{R"({"cp": 4, "elastic": 2})", "job spec: parallel.elastic: must be a JSON object"},
           Bad{R"({"cp": 4, "elastic": {"min_world": 0}})",
               "job spec: parallel.elastic.min_world: must be in [1, 4194304], got 0"},
           Bad{R"({"cp": 4, "elastic": {"min_world": 3, "max_world": 2}})",
               "job spec: parallel.elastic.max_world: must be in [min_world = 3, 4194304], got 2"},
           Bad{R"({"cp": 4, "elastic": {"min_world": 1, "max_world": 2}})",
               "job spec: parallel.elastic: the job's world dp x cp = 4 must lie in [min_world, "
               "max_world] = [1, 2] (it starts there)"},
           Bad{R"({"cp": 2, "elastic": {"min_world": 3, "max_world": 4}})",
               "job spec: parallel.elastic: the job's world dp x cp = 2 must lie in [min_world, "
               "max_world] = [3, 4] (it starts there)"},
           Bad{R"({"cp": 4, "elastic": {"min_world": 2, "wait_s": -1}})",
               "job spec: parallel.elastic.wait_s: must be in [0, 86400] seconds, got -1"},
           Bad{R"({"cp": 4, "elastic": {"min_world": 2, "batch": "grow"}})",
               "job spec: parallel.elastic.batch: must be \"keep\" or \"scale\", got \"grow\""},
           Bad{R"({"cp": 4, "elastic": {"min_world": 2, "spare": 1}})",
               "job spec: parallel.elastic.spare: unknown field"},
       }) {
    auto r = with(b.parallel);
    ASSERT_FALSE(r.ok()) << b.parallel;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << b.parallel;
    EXPECT_EQ(r.status().message(), b.error) << b.parallel;
  }
  auto no_dir = with(R"({"cp": 4, "elastic": {"min_world": 2}})", "");
  ASSERT_FALSE(no_dir.ok());
  EXPECT_EQ(no_dir.status().message(),
            "job spec: parallel.elastic: needs checkpoint.dir (a resize resumes from the job's "
            "last checkpoint)");
}

// train.offload: false by default, true on a cuda job (round-trips); a cpu job, or anything but a
// boolean, is refused naming the field.
TEST(JobSpecTest, OffloadIsABooleanForCudaJobs) {
  auto with = [](const std::string& resources, const std::string& v) {
    return ParseJobSpec(R"({"name": "o", "model": {"preset": "tiny"}, "seq_len": 64,
      "data": {"source": "synthetic:recall"}, "resources": ")" +
                        resources + R"(", "train": {"offload": )" + v + "}}");
  };
  EXPECT_FALSE(ParseJobSpec(kValid)->train.offload);
  // Left out of the canonical form when false (readable by trainers that predate it).
  EXPECT_FALSE(ParseJobSpec(kValid)->ToJson()["train"].contains("offload"));
  auto on = with("cuda", "true");
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_TRUE(on->train.offload);
  auto again = ParseJobSpecJson(on->ToJson());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->train.offload);
  EXPECT_EQ(on->ToJson()["train"]["offload"], true);
  EXPECT_TRUE(with("cpu", "false").ok());
  auto cpu = with("cpu", "true");
  ASSERT_FALSE(cpu.ok());
  EXPECT_EQ(cpu.status().message(),
            "job spec: train.offload: only resources \"cuda\" offload layer inputs to host memory "
            "(resources is \"cpu\"); remove it or set it to false");
  for (const std::string bad : {"1", "\"yes\"", "null"}) {
    auto s = with("cuda", bad);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.status().message().find("train.offload"), std::string::npos) << s.status();
  }
}

// checkpoint.async: true by default (left out of the canonical form), false round-trips (the
// synchronous path); anything but a boolean is refused naming the field.
TEST(JobSpecTest, CheckpointAsyncIsABoolean) {
  auto with = [](const std::string& v) {
    return ParseJobSpec(R"({"name": "a", "model": {"preset": "tiny"}, "seq_len": 64,
      "data": {"source": "synthetic:recall"}, "checkpoint": {"dir": "/tmp/a", "async": )" +
                        v + "}}");
  };
  EXPECT_TRUE(ParseJobSpec(kValid)->checkpoint.async);
  EXPECT_FALSE(ParseJobSpec(kValid)->ToJson()["checkpoint"].contains("async"));
  EXPECT_TRUE(with("true")->checkpoint.async);
  auto off = with("false");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->checkpoint.async);
  EXPECT_EQ(off->ToJson()["checkpoint"]["async"], false);
  auto again = ParseJobSpecJson(off->ToJson());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->checkpoint.async);
  for (const std::string bad : {"1", "\"no\"", "null"}) {
    auto s = with(bad);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.status().message().find("checkpoint.async"), std::string::npos) << s.status();
  }
}

// train.precision: "auto" by default (left out of the canonical form), "fp32" on cpu jobs only,
// "bf16" and "fp8" on both; each round-trips; every other value, a non-string, and "fp32" on a
// cuda job are refused with one error naming the field.
TEST(JobSpecTest, PrecisionIsAutoFp32Bf16OrFp8) {
  auto with = [](const std::string& resources, const std::string& v) {
    return ParseJobSpec(R"({"name": "p", "model": {"preset": "tiny"}, "seq_len": 64,
      "data": {"source": "synthetic:recall"}, "resources": ")" +
                        resources + R"(", "train": {"precision": )" + v + "}}");
  };
  EXPECT_EQ(ParseJobSpec(kValid)->train.precision, TrainPrecision::kAuto);
  EXPECT_FALSE(ParseJobSpec(kValid)->ToJson()["train"].contains("precision"));
  struct Case {
    std::string resources, json;
    TrainPrecision want;
  };
  for (const Case& c : {Case{"cpu", "\"auto\"", TrainPrecision::kAuto},
                        Case{"cuda", "\"auto\"", TrainPrecision::kAuto},
                        Case{"cpu", "\"fp32\"", TrainPrecision::kFp32},
                        Case{"cpu", "\"bf16\"", TrainPrecision::kBf16},
                        Case{"cuda", "\"bf16\"", TrainPrecision::kBf16},
                        Case{"cpu", "\"fp8\"", TrainPrecision::kFp8},
                        Case{"cuda", "\"fp8\"", TrainPrecision::kFp8}}) {
    auto s = with(c.resources, c.json);
    ASSERT_TRUE(s.ok()) << c.resources << " " << c.json << ": " << s.status();
    EXPECT_EQ(s->train.precision, c.want) << c.json;
    auto again = ParseJobSpecJson(s->ToJson());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->train.precision, c.want) << c.json;
    EXPECT_EQ(again->ToJson(), s->ToJson());
  }
  EXPECT_EQ(with("cpu", "\"fp8\"")->ToJson()["train"]["precision"], "fp8");
  for (const std::string bad : {"fp16", "FP8", "bfloat16", "", "e4m3", "fp8 "}) {
    auto s = with("cpu", "\"" + bad + "\"");
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.status().message(),
              "job spec: train.precision: must be \"auto\", \"fp32\", \"bf16\" or \"fp8\", got "
              "\"" +
                  bad + "\"");
  }
  for (const std::string bad : {"8", "true", "null", "[\"fp8\"]", "{}"}) {
    auto s = with("cpu", bad);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_TRUE(absl::StartsWith(s.status().message(), "job spec: train.precision: "))
        << s.status();
  }
  auto fp32_gpu = with("cuda", "\"fp32\"");
  ASSERT_FALSE(fp32_gpu.ok());
  EXPECT_EQ(fp32_gpu.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fp32_gpu.status().message(),
            "job spec: train.precision: \"fp32\" runs on resources \"cpu\" only (the CUDA engine "
            "stores activations in bf16); use \"auto\", \"bf16\" or \"fp8\" with resources "
            "\"cuda\"");
}

std::string Error(const std::string& text) {
  auto s = ParseJobSpec(text);
  EXPECT_FALSE(s.ok()) << text;
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(s.status().message());
}

TEST(JobSpecTest, SyntaxErrorsNameTheirLineAndColumn) {
  const auto starts = [](const std::string& text, const std::string& prefix) {
    const std::string e = Error(text);
    EXPECT_TRUE(absl::StartsWith(e, prefix)) << e;
  };
  // A trailing comma on line 3, as an edited spec often has.
  starts("{\"name\": \"x\",\n \"seq_len\": 64,\n}\n",
         "job spec: not valid JSON: parse error at line 3, column 1: syntax error while parsing "
         "object key");
  starts(R"({"name": "x", "seq_len": 6 4})",
         "job spec: not valid JSON: parse error at line 1, column 28");
  starts("", "job spec: not valid JSON: parse error at line 1, column 1");
}

TEST(JobSpecTest, ADirectoryIsNoJobSpec) {
  char tmpl[] = "/tmp/spindle-spec-test-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  auto spec = LoadJobSpec(dir);
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(spec.status().message(), "job spec: \"" + dir + "\" is a directory, not a JSON file");
  auto missing = LoadJobSpec(dir + "/none.json");
  EXPECT_EQ(missing.status().message(), "job spec: cannot open \"" + dir + "/none.json\"");
  ::rmdir(dir.c_str());
}

TEST(JobSpecTest, RepeatedKeysAreRefusedByTheirPath) {
  const std::string base = R"("model": {"preset": "tiny"}, "data": {"source": "synthetic:recall"})";
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": 64, "seq_len": 128, )" + base + "}"),
            "job spec: seq_len: appears twice");
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": 64, "train": {"lr": 1, "steps": 2, "lr": 3}, )" +
                  base + "}"),
            "job spec: train.lr: appears twice");
  // Inside arrays and after nested objects the path still points at the repeated key.
  EXPECT_EQ(Error(R"({"name": "x", "extra": [1, {"a": {"b": 1}, "c": 2, "c": 3}], )" + base + "}"),
            "job spec: extra[1].c: appears twice");
  // The same key in different objects, or in sibling objects of an array, is no repetition.
  auto j = ParseStrictJson(R"({"a": {"k": 1}, "b": [{"k": 2}, {"k": 3}], "k": 4})", "test");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ((*j)["b"][1]["k"], 3);
  EXPECT_EQ((*j)["k"], 4);
}

TEST(JobSpecTest, MalformedSpecsNameTheField) {
  const std::string base = R"("model": {"preset": "tiny"}, "data": {"source": "synthetic:recall"})";
  EXPECT_EQ(Error("{"),
            "job spec: not valid JSON: parse error at line 1, column 2: syntax error while "
            "parsing object key - unexpected end of input; expected string literal");
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
            "job spec: model.preset: unknown preset \"huge\" (known: tiny, small, 1b, tiny-moe, moe)");
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
            "job spec: parallel.lightning_mode: must be \"auto\", \"fastest\", \"allgather\", "
            "\"all2all\" or \"hybrid\", got \"ring\"");
  EXPECT_EQ(Error(R"({"name": "x y", "seq_len": 64, )" + base + "}"),
            "job spec: name: may only hold letters, digits, '-', '_' and '.', got \"x y\"");
  auto tiny = [](const std::string& model) {
    return R"({"name": "x", "seq_len": 64, "model": {"preset": "tiny", )" + model +
           R"(}, "data": {"source": "synthetic:recall"}})";
  };
  EXPECT_EQ(Error(tiny(R"("n_layers": 100000)")),
            "job spec: model.n_layers: must be in [1, 1024], got 100000");
  EXPECT_EQ(Error(tiny(R"("d_model": 1048576, "n_heads": 4)")),
            "job spec: model.d_model: must be in [1, 65536], got 1048576");
  EXPECT_EQ(Error(tiny(R"("ffn_dim": 0)")),
            "job spec: model.ffn_dim: must be in [1, 524288], got 0");
  EXPECT_EQ(Error(tiny(R"("layer_pattern": "LLLLLLLM")")),
            "job spec: model.layer_pattern: \"LLLLLLLM\" describes 8 layers, more than n_layers = "
            "4; its last 4 would never be built (give a pattern of at most 4 layers)");
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": 64, "model": {"preset": "1b", "n_layers": 4},
                      "data": {"source": "synthetic:recall"}})"),
            "job spec: model.n_layers: 4 is fewer than the 8 layers of the preset's layer_pattern "
            "\"LLLLLLLM\"; give a model.layer_pattern of at most 4 layers (\"L\" Lightning, \"M\" "
            "MLA)");
  EXPECT_EQ(Error(tiny(R"("mla": {"kv_lora_rank": 0})")),
            "job spec: model.mla.kv_lora_rank: must be in [1, 65536], got 0");
  // Integers past int64 are refused, not wrapped.
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": 18446744073709551615, )" + base + "}"),
            "job spec: seq_len: must be an integer in int64's range, got 18446744073709551615");
  EXPECT_EQ(Error(R"({"name": "x", "seq_len": 64, "train": {"seed": 18446744073709551616}, )" +
                  base + "}"),
            "job spec: train.seed: must be an integer, got 1.8446744073709552e+19");
}

// A seed takes all of uint64's range.
// The MoE fields and parallel.ep: the presets' sizes, a round trip, and one error naming the field
// for each impossible value.
TEST(JobSpecTest, MixtureOfExpertsFieldsAndExpertParallelism) {
  auto moe = ParseJobSpec(R"({"name": "m", "seq_len": 64, "model": {"preset": "moe"},
                              "data": {"source": "synthetic:recall"}, "parallel": {"dp": 4, "ep": 2}})");
  ASSERT_TRUE(moe.ok()) << moe.status();
  EXPECT_EQ(moe->model.moe.experts, 64);
  EXPECT_EQ(moe->model.moe.top_k, 8);
  // 2.16B parameters, 0.75B active (the peer's --moe 64,8,256,1024 on the 1b stack).
  EXPECT_NEAR(static_cast<double>(moe->model.NumParams()), 2.16e9, 0.01e9);
  EXPECT_NEAR(static_cast<double>(moe->model.NumActiveParams()), 0.75e9, 0.01e9);
  auto again = ParseJobSpecJson(moe->ToJson());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->ToJson(), moe->ToJson());
  EXPECT_EQ(again->parallel.ep, 2);
  const std::string head = R"({"name": "x", "seq_len": 64, "data": {"source": "synthetic:recall"}, )";
  EXPECT_EQ(Error(head + R"("model": {"preset": "tiny-moe", "moe": {"top_k": 9}}})"),
            "job spec: model.moe.top_k: must be in [1, moe.experts = 8], got 9");
  EXPECT_EQ(Error(head + R"("model": {"preset": "tiny", "moe": {"top_k": 2}}})"),
            "job spec: model.moe.top_k: is 2 but model.moe.experts is 0 (a dense model); give "
            "model.moe.experts to use experts");
  EXPECT_EQ(Error(head + R"("model": {"preset": "tiny-moe", "moe": {"first_dense": 4}}})"),
            "job spec: model.moe.first_dense: must be in [0, 3], got 4");
  EXPECT_EQ(Error(head + R"("model": {"preset": "tiny-moe", "moe": {"expert": 3}}})"),
            "job spec: model.moe.expert: unknown field");
  EXPECT_EQ(Error(head + R"("model": {"preset": "tiny-moe"}, "parallel": {"dp": 3, "ep": 3}})"),
            "job spec: parallel.ep: 3 must divide model.moe.experts = 8");
  EXPECT_EQ(Error(head + R"("model": {"preset": "tiny-moe"}, "parallel": {"dp": 2, "ep": 4}})"),
            "job spec: parallel.ep: 4 must divide the world dp x cp = 2 x 1 = 2 (the experts are "
            "sharded over ranks of the job)");
  EXPECT_EQ(Error(head + R"("model": {"preset": "tiny"}, "parallel": {"dp": 2, "ep": 2}})"),
            "job spec: parallel.ep: 2 needs a mixture-of-experts model (model.moe.experts > 0); a "
            "dense model runs with ep 1");
  EXPECT_EQ(Error(head + R"("model": {"preset": "tiny-moe"}, "parallel": {"ep": 0}})"),
            "job spec: parallel.ep: must be in [1, 4096], got 0");
}

TEST(JobSpecTest, SeedsTakeAllOfUint64) {
  auto spec = ParseJobSpec(R"({"name": "x", "seq_len": 64, "model": {"preset": "tiny"},
      "data": {"source": "synthetic:recall"}, "train": {"seed": 18446744073709551615}})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->train.seed, 18446744073709551615u);
}

// parallel.ulysses and the Ring / hybrid modes (common/cp_modes.h): what parses, how it
// round-trips, and one error naming the field and the values for every bad combination.
TEST(JobSpecTest, RingAndHybridModes) {
  auto spec = [](const std::string& parallel) {
    return absl::StrCat(R"({"name": "x", "seq_len": 256, "model": {"preset": "tiny"},
                            "data": {"source": "synthetic:recall"}, "parallel": )",
                        parallel, "}");
  };
  auto hybrid = ParseJobSpec(
      spec(R"({"cp": 8, "ulysses": 2, "lightning_mode": "hybrid", "mla_mode": "hybrid"})"));
  ASSERT_TRUE(hybrid.ok()) << hybrid.status();
  EXPECT_EQ(hybrid->parallel.ulysses, 2);
  EXPECT_EQ(hybrid->parallel.lightning_mode, CpMode::kHybrid);
  EXPECT_EQ(hybrid->parallel.mla_mode, CpMode::kHybrid);
  auto again = ParseJobSpecJson(hybrid->ToJson());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->ToJson(), hybrid->ToJson());
  EXPECT_EQ(hybrid->ToJson()["parallel"]["ulysses"], 2);
  // ulysses 1 (the default) stays out of the canonical form.
  auto ring = ParseJobSpec(spec(R"({"cp": 4, "mla_mode": "ring"})"));
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_EQ(ring->parallel.mla_mode, CpMode::kRing);
  EXPECT_FALSE(ring->ToJson()["parallel"].contains("ulysses"));
  EXPECT_EQ(ParseJobSpecJson(ring->ToJson())->parallel.mla_mode, CpMode::kRing);
  // One hybrid layer type is enough for ulysses; "ring" at cp = 1 runs unsplit.
  EXPECT_TRUE(ParseJobSpec(spec(R"({"cp": 4, "ulysses": 2, "mla_mode": "hybrid"})")).ok());
  EXPECT_TRUE(ParseJobSpec(spec(R"({"cp": 8, "ulysses": 4, "lightning_mode": "hybrid",
                                    "mla_mode": "ring"})"))
                  .ok());
  EXPECT_TRUE(ParseJobSpec(spec(R"({"cp": 1, "mla_mode": "ring"})")).ok());
  for (const auto& name : {"auto", "allgather", "all2all", "ring", "hybrid"})
    EXPECT_EQ(CpModeName(*CpModeFromName(name)), name);
  EXPECT_FALSE(CpModeFromName("zigzag").has_value());

  auto error = [&](const std::string& parallel) {
    auto s = ParseJobSpec(spec(parallel));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << parallel;
    return std::string(s.status().message());
  };
  EXPECT_EQ(error(R"({"cp": 4, "lightning_mode": "ring"})"),
            "job spec: parallel.lightning_mode: must be \"auto\", \"fastest\", \"allgather\", "
            "\"all2all\" or \"hybrid\", got \"ring\"");
  EXPECT_EQ(error(R"({"cp": 4, "mla_mode": "zigzag"})"),
            "job spec: parallel.mla_mode: must be \"auto\", \"fastest\", \"allgather\", "
            "\"all2all\", \"ring\" or \"hybrid\", got \"zigzag\"");
  EXPECT_EQ(error(R"({"cp": 4, "ulysses": "two", "mla_mode": "hybrid"})"),
            "job spec: parallel.ulysses: must be an integer, got \"two\"");
  EXPECT_EQ(error(R"({"cp": 4, "ulysses": 0, "mla_mode": "hybrid"})"),
            "job spec: parallel.ulysses: must be in [1, cp = 4], got 0");
  EXPECT_EQ(error(R"({"cp": 4, "ulysses": 8, "mla_mode": "hybrid"})"),
            "job spec: parallel.ulysses: must be in [1, cp = 4], got 8");
  EXPECT_EQ(error(R"({"cp": 4, "ulysses": 2})"),
            "job spec: parallel.ulysses: 2 is only used by the \"hybrid\" modes, but neither "
            "parallel.lightning_mode nor parallel.mla_mode is \"hybrid\"; set one of them to "
            "\"hybrid\" or remove ulysses");
  EXPECT_EQ(error(R"({"cp": 4, "ulysses": 2, "mla_mode": "ring"})"),
            "job spec: parallel.ulysses: 2 is only used by the \"hybrid\" modes, but neither "
            "parallel.lightning_mode nor parallel.mla_mode is \"hybrid\"; set one of them to "
            "\"hybrid\" or remove ulysses");
  EXPECT_EQ(error(R"({"cp": 4, "mla_mode": "hybrid"})"),
            "job spec: parallel.mla_mode: \"hybrid\" needs parallel.ulysses >= 2 (the size of its "
            "Ulysses groups), got 1");
  EXPECT_EQ(
      error(R"({"cp": 4, "lightning_mode": "hybrid"})"),
      "job spec: parallel.lightning_mode: \"hybrid\" needs parallel.ulysses >= 2 (the size of "
      "its Ulysses groups), got 1");
  EXPECT_EQ(error(R"({"cp": 8, "ulysses": 3, "mla_mode": "hybrid"})"),
            "job spec: parallel.ulysses: must divide parallel.cp, got ulysses=3 and cp=8");
  EXPECT_EQ(error(R"({"cp": 4, "ulysses": 4, "lightning_mode": "hybrid"})"),
            "job spec: parallel.ulysses: 4 with cp=4 leaves a ring of cp / ulysses = 1 group; "
            "\"hybrid\" needs at least 2 (with one group use \"all2all\")");
  // tiny has 4 heads.
  EXPECT_EQ(error(R"({"cp": 6, "ulysses": 3, "mla_mode": "hybrid"})"),
            "job spec: parallel.ulysses: must divide model.n_heads, got ulysses=3 and n_heads=4");
}

}  // namespace
}  // namespace spindle
