// Checkpoint fencing and resume: a fenced root refuses the commits of an older attempt (nothing
// written, `latest` unmoved, commits.log in lock order), also when the fence appears while the
// commit writes its files (it is read again right before the rename); a corrupt newest checkpoint
// is passed over for the previous complete one, in a note naming both, but never one older than the
// step the coordinator recorded; the ranks of an attempt that do not share the checkpoint directory
// are told so at the start; transient I/O errors are Unavailable (the gang restarts), not invalid
// input.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/engine/cp_test_util.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/checkpoint_writer.h"
#include "worker/engine/kv_store.h"
#include "worker/engine/model.h"
#include "worker/engine/trainer.h"

namespace spindle {
namespace {

std::string FreshDir(const std::string& tag) {
  char tmpl[] = "/tmp/spindle-fence-XXXXXX";
  return std::string(mkdtemp(tmpl)) + "/" + tag;
}

JobSpec Tiny(int64_t steps, int64_t every, int64_t cp = 1) {
  auto spec = ParseJobSpec(absl::StrCat(
      R"({"name": "f", "model": {"preset": "tiny"}, "data": {"source": "synthetic:copy"},
          "seq_len": 128, "parallel": {"cp": )",
      cp, R"(, "lightning_mode": "allgather", "mla_mode": "allgather"},
          "train": {"steps": )", steps, R"(, "seed": 3}, "checkpoint": {"every": )", every,
      "}}"));
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

std::vector<std::string> Lines(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(f, line);) {
    // The time of each entry varies; the rest is what the test asserts.
    const size_t t = line.find(",\"unix_ms\"");
    out.push_back(t == std::string::npos ? line : line.substr(0, t) + "}");
  }
  return out;
}

// Flips a byte inside a checkpoint's weights (its checksum then fails).
void CorruptWeights(const std::string& dir) {
  std::fstream f(dir + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(300);
  f.put('\x7f');
}

TEST(CheckpointFenceTest, AnOlderAttemptCanNeitherCommitNorPruneOnceFenced) {
  const JobSpec spec = Tiny(4, 1);
  auto model = Model::Create(spec.model, 1);
  ASSERT_TRUE(model.ok());
  ParamSet& p = (*model)->params();
  const std::string root = FreshDir("root");
  TrainState st;
  st.seed = 3;
  st.step = 1;
  ASSERT_TRUE(SaveCheckpoint(root, p, nullptr, spec.model, st, /*keep=*/1, /*attempt=*/1).ok());
  ASSERT_TRUE(FenceCheckpointRoot(root, 2).ok());
  EXPECT_TRUE(FenceCheckpointRoot(root, 2).ok()) << "the same attempt again is a no-op";
  EXPECT_EQ(*ReadFence(root), 2);
  st.step = 2;
  absl::StatusOr<std::string> old = SaveCheckpoint(root, p, nullptr, spec.model, st, 1, 1);
  ASSERT_EQ(old.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(old.status().message(),
            absl::StrCat("checkpoint: attempt 1 of the job may not write under \"", root,
                         "\": attempt 2 has taken it over"));
  // Nothing of it: no step_2, `latest` still step 1, step 1 not pruned (keep = 1).
  EXPECT_EQ(CompleteCheckpoints(root), std::vector<std::string>{root + "/step_00000001"});
  EXPECT_EQ(*LatestCheckpoint(root), root + "/step_00000001");
  const absl::Status back = FenceCheckpointRoot(root, 1);
  EXPECT_EQ(back.code(), absl::StatusCode::kAborted);
  // The new attempt commits (and prunes) as usual.
  ASSERT_TRUE(SaveCheckpoint(root, p, nullptr, spec.model, st, 1, 2).ok());
  EXPECT_EQ(CompleteCheckpoints(root), std::vector<std::string>{root + "/step_00000002"});
  EXPECT_EQ(Lines(root + "/commits.log"),
            (std::vector<std::string>{R"({"attempt":1,"commit":1})", R"({"fence":2})",
                                      R"({"attempt":2,"commit":2})"}));
}

// Where the writer lock does not hold across hosts (some shared file systems), a newer attempt's
// fence can land while an older attempt's commit is writing its files, after the commit's first
// look at the fence: the fence is read again right before the rename, so the commit is refused
// then and leaves nothing behind. The fence is written here as the other host would, without
// this host's lock, once the commit's temporary directory exists (its first check is past).
TEST(CheckpointFenceTest, AFenceWrittenDuringTheCommitIsSeenAtTheRename) {
  const JobSpec spec = Tiny(4, 1);
  auto model = Model::Create(spec.model, 1);
  ASSERT_TRUE(model.ok());
  ParamSet& p = (*model)->params();
  const std::string root = FreshDir("late");
  TrainState st;
  st.seed = 3;
  st.step = 1;
  ASSERT_TRUE(SaveCheckpoint(root, p, nullptr, spec.model, st, /*keep=*/1, /*attempt=*/1).ok());

  // Pauses after each file long enough that the fence lands before the rename whatever the load.
  CheckpointWriter writer({root, spec.model, /*keep=*/1, /*attempt=*/1,
                           /*pause_between_files_ms=*/700});
  writer.snapshot().CopyParams(p);
  absl::StatusOr<CheckpointTensors> tensors = writer.snapshot().Tensors(p);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  st.step = 2;
  writer.Start(*std::move(tensors), st);
  const std::string tmp = absl::StrCat(root, "/.tmp.step_00000002.", ::getpid());
  struct stat info;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (::stat(tmp.c_str(), &info) != 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(::stat(tmp.c_str(), &info), 0) << "the commit never started writing";
  ASSERT_FALSE(writer.Finished()) << "the commit outran the test; its pauses are too short";
  {
    std::ofstream fence(root + "/fence");
    fence << "2\n";
  }

  std::optional<CheckpointWriteResult> r = writer.Wait();
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->dir.status().code(), absl::StatusCode::kAborted) << r->dir.status();
  EXPECT_EQ(r->dir.status().message(),
            absl::StrCat("checkpoint: attempt 1 of the job may not write under \"", root,
                         "\": attempt 2 has taken it over"));
  // Nothing of it: no step_2, `latest` still step 1, step 1 not pruned (keep = 1), no temporary.
  EXPECT_EQ(CompleteCheckpoints(root), std::vector<std::string>{root + "/step_00000001"});
  EXPECT_EQ(*LatestCheckpoint(root), root + "/step_00000001");
  EXPECT_NE(::stat(tmp.c_str(), &info), 0);
  EXPECT_EQ(Lines(root + "/commits.log"),
            (std::vector<std::string>{R"({"attempt":1,"commit":1})"}));
}

// Rank 0 of an attempt resumes from the newest checkpoint that loads; a corrupt one is passed
// over, and the note names both; with none that loads, the job fails naming the newest.
TEST(CheckpointFenceTest, ACorruptNewestCheckpointResumesFromThePreviousOne) {
  const std::string root = FreshDir("resume");
  TrainerOptions o;
  o.spec = Tiny(4, 2);
  o.checkpoint_dir = root;
  o.attempt = 1;
  auto first = Trainer::Create(o);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*first)->Run().ok());
  ASSERT_EQ(CompleteCheckpoints(root).size(), 2u);  // steps 2 and 4 (keep 2)
  CorruptWeights(root + "/step_00000004");
  std::vector<nlohmann::json> notes;
  o.spec.train.steps = 6;
  o.attempt = 2;
  o.on_event = [&](const nlohmann::json& e) {
    if (e.value("event", "") == "note") notes.push_back(e);
  };
  auto second = Trainer::Create(o);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->state().step, 2);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(
      notes[0]["message"],
      absl::StrCat("checkpoint \"", root, "/step_00000004\" does not load (checkpoint: \"", root,
                   "/step_00000004/model.safetensors\" is corrupt: checksum "
                   "mismatch); resumed from the previous complete one, \"",
                   root, "/step_00000002\" (step 2)"));
  EXPECT_EQ(*ReadFence(root), 2);
  // Every checkpoint damaged: the job fails naming the newest (starting over would discard its
  // progress), and nothing is written.
  {
    std::fstream f(root + "/step_00000002/state.json", std::ios::in | std::ios::out);
    f.seekp(0);
    f.put('#');
  }
  o.attempt = 3;
  auto third = Trainer::Create(o);
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(third.status().message(),
            absl::StrCat("checkpoint: \"", root,
                         "/step_00000004/model.safetensors\" is corrupt: checksum mismatch"));
  EXPECT_EQ(CompleteCheckpoints(root).size(), 2u);
}

// The coordinator's record of the job's last checkpoint (resume_step) bounds rank 0's choice from
// below: that one or a newer complete one is resumed from, never an older one; when none of
// those loads, the attempt fails naming the recorded step (exit code 2 under spindle-train).
TEST(CheckpointFenceTest, TheCoordinatorsRecordedStepIsTheOldestResumedFrom) {
  const std::string root = FreshDir("floor");
  TrainerOptions o;
  o.spec = Tiny(6, 2);
  o.checkpoint_dir = root;
  o.attempt = 1;
  o.spec.checkpoint.keep = 3;
  auto first = Trainer::Create(o);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*first)->Run().ok());
  ASSERT_EQ(CompleteCheckpoints(root).size(), 3u);  // steps 2, 4 and 6
  EXPECT_EQ(CheckpointStepOf(root + "/step_00000004"), 4);
  EXPECT_EQ(CheckpointStepOf(root + "/latest"), -1);
  o.spec.train.steps = 8;
  // Recorded step 4, newer complete step 6: the newer one (every rank wrote it; the record lags).
  o.attempt = 2;
  o.resume_step = 4;
  auto second = Trainer::Create(o);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->state().step, 6);
  // Step 6 damaged: step 4, the recorded one, with the note naming step 6.
  CorruptWeights(root + "/step_00000006");
  o.attempt = 3;
  auto third = Trainer::Create(o);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ((*third)->state().step, 4);
  // Step 4 damaged too: step 2 still loads, but it is older than the record, so the attempt
  // fails naming the recorded step and what did not load, rather than redo steps 3 to 6.
  CorruptWeights(root + "/step_00000004");
  o.attempt = 4;
  auto fourth = Trainer::Create(o);
  ASSERT_FALSE(fourth.ok());
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(fourth.status().message().find(absl::StrCat(
                "trainer: the job's last checkpoint, step 4 (every rank completed it, as the "
                "coordinator recorded), is not in \"",
                root, "\" and no newer complete one loads (checkpoint \"", root,
                "/step_00000006\" does not load")),
            0u)
      << fourth.status();
  // A record past every checkpoint in the directory (another volume, say): the same error.
  o.attempt = 5;
  o.resume_step = 10;
  auto fifth = Trainer::Create(o);
  ASSERT_FALSE(fifth.ok());
  EXPECT_EQ(fifth.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(fifth.status().message().find("step 10"), std::string::npos) << fifth.status();
  // Without a record the newest that loads is taken, as for a standalone run: step 2.
  o.attempt = 6;
  o.resume_step = 0;
  auto sixth = Trainer::Create(o);
  ASSERT_TRUE(sixth.ok()) << sixth.status();
  EXPECT_EQ((*sixth)->state().step, 2);
}

// Ranks of one attempt whose checkpoint directories differ (a volume not shared by the job's
// hosts) are told so before any step, instead of resuming from different checkpoints.
TEST(CheckpointFenceTest, RanksThatDoNotShareTheCheckpointDirectoryAreNamed) {
  const JobSpec spec = Tiny(2, 1, /*cp=*/2);
  MemoryKvStore store;
  const std::string a = FreshDir("a"), b = FreshDir("b");
  absl::Status s = testing::RunRanks(2, [&](int rank) -> absl::Status {
    TrainerOptions o;
    o.spec = spec;
    o.rank = rank;
    o.world = 2;
    o.store = &store;
    o.gloo = testing::TestGloo();
    o.attempt = 1;
    o.checkpoint_dir = rank == 0 ? a : b;
    return Trainer::Create(std::move(o)).status();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  // Every rank names the rank that does not see the fence (rank 0's error is the first).
  EXPECT_EQ(s.message(), absl::StrCat("rank 0: checkpoint.dir \"", a,
                                      "\" is not shared: rank 1 does not see the fence rank 0 "
                                      "wrote there for attempt 1 (every host of a job needs the "
                                      "same checkpoint volume)"));
}

TEST(CheckpointFenceTest, TransientIoErrorsRestartInsteadOfFailingTheJob) {
  for (int err : {EIO, ESTALE, EACCES}) {
    const absl::Status s = CheckpointIoError("cannot open", "/ck/latest", err);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_EQ(s.message(), absl::StrCat("checkpoint: cannot open \"/ck/latest\": ", strerror(err),
                                        " (transient: the gang restarts)"));
  }
  EXPECT_EQ(CheckpointIoError("cannot open", "/ck", EROFS).code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace spindle
