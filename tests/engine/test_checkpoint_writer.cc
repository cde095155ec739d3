// The background checkpoint writer: a snapshot of fresh random parameters and optimizer state
// written in the background loads back equal, even though the live buffers change while it is
// written; one write is in flight at a time (the previous checkpoint stays `latest` until it
// commits) and the snapshot buffers are reused from one checkpoint to the next; a failed write
// reports the error the synchronous path gives; and the trainer's asynchronous checkpoints hold
// the same bytes as its synchronous ones.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/checkpoint_writer.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/trainer.h"

namespace spindle {
namespace {

std::string FreshDir(const std::string& tag) {
  char tmpl[] = "/tmp/spindle-writer-XXXXXX";
  return std::string(mkdtemp(tmpl)) + "/" + tag;
}

JobSpec Tiny(int64_t steps, int64_t every, bool async) {
  auto spec = ParseJobSpec(absl::StrCat(
      R"({"name": "w", "model": {"preset": "tiny"}, "data": {"source": "synthetic:copy"},
          "seq_len": 64, "train": {"steps": )",
      steps, R"(, "seed": 5}, "checkpoint": {"every": )", every, R"(, "async": )",
      async ? "true" : "false", "}}"));
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

void Randomize(Tensor& t, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = d(rng);
}

std::vector<float> Values(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// A model and its AdamW optimizer with every value fresh from `rng`.
struct RandomState {
  explicit RandomState(std::mt19937& rng, const JobSpec& spec)
      : model(*Model::Create(spec.model, spec.train.seed)), opt(spec.train, model->params()) {
    Randomize(model->params().flat_data(), rng);
    Randomize(opt.state0(), rng);
    Randomize(opt.state1(), rng);
    opt.set_steps_taken(17);
  }
  std::unique_ptr<Model> model;
  Optimizer opt;
};

CheckpointWriter::Options WriterOptions(const std::string& root, const JobSpec& spec,
                                        int64_t pause_ms = 0) {
  return {root, spec.model, /*keep=*/3, /*attempt=*/0, pause_ms};
}

TEST(CheckpointWriterTest, RandomStateRoundTripsWhileTheLiveBuffersChange) {
  const JobSpec spec = Tiny(1, 1, true);
  std::mt19937 rng(1234);
  RandomState live(rng, spec);
  const std::vector<float> values = Values(live.model->params().flat_data());
  const std::vector<float> m = Values(live.opt.state0()), v = Values(live.opt.state1());
  const std::string root = FreshDir("ck");
  TrainState state;
  state.step = 9;
  state.data_position = 27;
  state.seed = spec.train.seed;
  state.rng_counter = 41;
  state.loss = 2.5;
  {
    CheckpointWriter writer(WriterOptions(root, spec, /*pause_ms=*/50));
    CheckpointSnapshot& snap = writer.snapshot();
    snap.CopyParams(live.model->params());
    snap.CopyOptimizer(live.opt);
    auto tensors = snap.Tensors(live.model->params());
    ASSERT_TRUE(tensors.ok()) << tensors.status();
    writer.Start(*std::move(tensors), state);
    // The step goes on: the live buffers change while the snapshot is written.
    Randomize(live.model->params().flat_data(), rng);
    Randomize(live.opt.state0(), rng);
    Randomize(live.opt.state1(), rng);
    std::optional<CheckpointWriteResult> r = writer.Wait();
    ASSERT_TRUE(r.has_value());
    ASSERT_TRUE(r->dir.ok()) << r->dir.status();
    EXPECT_EQ(r->step, 9);
    EXPECT_EQ(*r->dir, root + "/step_00000009");
    EXPECT_FALSE(writer.Wait().has_value());  // taken once
  }
  RandomState loaded(rng, spec);
  auto st =
      LoadCheckpoint(root + "/step_00000009", loaded.model->params(), &loaded.opt, spec.model);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(Values(loaded.model->params().flat_data()), values);
  EXPECT_EQ(Values(loaded.opt.state0()), m);
  EXPECT_EQ(Values(loaded.opt.state1()), v);
  EXPECT_EQ(loaded.opt.steps_taken(), 17);
  EXPECT_EQ(st->step, 9);
  EXPECT_EQ(st->data_position, 27);
  EXPECT_EQ(st->rng_counter, 41u);
  EXPECT_EQ(st->loss, 2.5);
  EXPECT_EQ(ReadFile(root + "/latest"), "step_00000009\n");
}

TEST(CheckpointWriterTest, OneWriteInFlightAndTheBuffersAreReused) {
  const JobSpec spec = Tiny(1, 1, true);
  std::mt19937 rng(99);
  RandomState live(rng, spec);
  const std::string root = FreshDir("ck");
  // Long enough pauses that the test sees the write in flight whatever the load.
  CheckpointWriter writer(WriterOptions(root, spec, /*pause_ms=*/500));
  const float* buffers[2] = {nullptr, nullptr};
  for (int64_t step : {1, 2}) {
    CheckpointSnapshot& snap = writer.snapshot();
    snap.CopyParams(live.model->params());
    snap.CopyOptimizer(live.opt);
    auto tensors = snap.Tensors(live.model->params());
    ASSERT_TRUE(tensors.ok()) << tensors.status();
    buffers[step - 1] = tensors->model.begin()->second.data;
    TrainState state;
    state.step = step;
    state.seed = spec.train.seed;
    writer.Start(*std::move(tensors), state);
    EXPECT_TRUE(writer.pending());
    EXPECT_FALSE(writer.Finished());  // the first pause alone outlasts this check
    // While it is written the previous checkpoint is the latest (none before the first).
    EXPECT_EQ(LatestCheckpoint(root).ok() ? *LatestCheckpoint(root) : "none",
              step == 1 ? "none" : root + "/step_00000001");
    double waited = 0;
    std::optional<CheckpointWriteResult> r = writer.Wait(&waited);
    ASSERT_TRUE(r.has_value());
    ASSERT_TRUE(r->dir.ok()) << r->dir.status();
    EXPECT_GT(waited, 0.0);
    EXPECT_GE(r->write_s, 1.4);  // three pauses of 500 ms
    EXPECT_FALSE(writer.pending());
    EXPECT_EQ(*LatestCheckpoint(root), absl::StrCat(root, "/step_0000000", step));
    Randomize(live.model->params().flat_data(), rng);
  }
  EXPECT_EQ(buffers[0], buffers[1]);  // no allocation after the first snapshot
  EXPECT_GT(writer.snapshot().bytes(), 0);
}

TEST(CheckpointWriterTest, AFailedWriteReportsTheSynchronousError) {
  const JobSpec spec = Tiny(1, 1, true);
  std::mt19937 rng(7);
  RandomState live(rng, spec);
  // The root is a file: nothing can be written under it.
  const std::string dir = FreshDir("x");
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  const std::string root = dir + "/file";
  std::ofstream(root) << "not a directory";
  TrainState state;
  state.step = 3;
  state.seed = spec.train.seed;
  auto sync = SaveCheckpoint(root, live.model->params(), &live.opt, spec.model, state, 2);
  ASSERT_FALSE(sync.ok());
  CheckpointWriter writer(WriterOptions(root, spec));
  writer.snapshot().CopyParams(live.model->params());
  writer.snapshot().CopyOptimizer(live.opt);
  auto tensors = writer.snapshot().Tensors(live.model->params());
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  writer.Start(*std::move(tensors), state);
  std::optional<CheckpointWriteResult> r = writer.Wait();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->dir.status(), sync.status());
}

TEST(CheckpointWriterTest, ASnapshotOfAnotherModelIsRefused) {
  const JobSpec spec = Tiny(1, 1, true);
  std::mt19937 rng(8);
  RandomState live(rng, spec);
  CheckpointWriter writer(WriterOptions(FreshDir("ck"), spec));
  auto none = writer.snapshot().Tensors(live.model->params());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(none.status().message(),
            absl::StrCat("checkpoint: the snapshot holds 0 values, the model ",
                         live.model->params().numel()));
}

// The trainer's background checkpoints hold exactly what its synchronous ones do, are reported
// as checkpoint events with their timings, and the final one is on disk when Run() returns.
TEST(CheckpointWriterTest, TrainerAsyncCheckpointsEqualSyncOnes) {
  std::string dirs[2];
  std::vector<nlohmann::json> events[2];
  for (int async = 0; async < 2; ++async) {
    dirs[async] = FreshDir(async ? "async" : "sync");
    TrainerOptions o;
    o.spec = Tiny(4, 2, async == 1);
    o.spec.checkpoint.keep = 5;
    o.checkpoint_dir = dirs[async];
    o.on_event = [&events, async](const nlohmann::json& e) {
      if (e["event"] == "checkpoint") events[async].push_back(e);
    };
    auto t = Trainer::Create(std::move(o));
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_TRUE((*t)->Run().ok());
  }
  for (int64_t step : {2, 4}) {
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      const std::string name = absl::StrCat("/step_0000000", step, "/", f);
      const std::string sync = ReadFile(dirs[0] + name);
      EXPECT_FALSE(sync.empty()) << name;
      EXPECT_EQ(ReadFile(dirs[1] + name), sync) << name;
    }
  }
  ASSERT_EQ(events[1].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(events[1][i]["step"], 2 * (i + 1));
    EXPECT_EQ(events[1][i]["path"], absl::StrCat(dirs[1], "/step_0000000", 2 * (i + 1)));
    EXPECT_TRUE(events[1][i].contains("write_s"));
    EXPECT_TRUE(events[1][i].contains("blocked_s"));
  }
  EXPECT_EQ(ReadFile(dirs[1] + "/latest"), "step_00000004\n");
}

}  // namespace
}  // namespace spindle
