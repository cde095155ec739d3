// In-memory checkpoint replicas (checkpoint.replicas; worker/engine/replica_store.h and the
// Trainer's use of them): the store keeps the newest complete replica only, ignores incomplete
// ones and refuses corrupt ones and those of another job or of the resuming attempt itself;
// received sizes are bounded by the model's; two ranks on different workers hold rank 0's copy
// and its peer copy, and a gang that lost rank 0's worker resumes from the peer's copy with the
// losses of an uninterrupted run; a corrupt replica is refused in a note and the file checkpoint
// is used.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "tests/engine/cp_test_util.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/kv_store.h"
#include "worker/engine/replica_store.h"
#include "worker/engine/trainer.h"

namespace spindle {
namespace {

std::string FreshDir(const std::string& tag) {
  char tmpl[] = "/tmp/spindle-replicas-XXXXXX";
  return std::string(mkdtemp(tmpl)) + "/" + tag;
}

JobSpec Tiny(int64_t steps, int64_t every, int64_t replicas_every, const std::string& ckpt) {
  auto spec = ParseJobSpec(absl::StrCat(
      R"({"name": "r", "model": {"preset": "tiny"}, "data": {"source": "synthetic:copy"},
          "seq_len": 128, "parallel": {"cp": 2, "lightning_mode": "allgather",
          "mla_mode": "allgather"}, "train": {"steps": )",
      steps, R"(, "seed": 3}, "checkpoint": {"dir": ")", ckpt, R"(", "every": )", every,
      R"(, "replicas": {"every": )", replicas_every, "}}}"));
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

// A replica's files for a two-tensor "model" at `step` (values depend on the step).
CheckpointFiles Files(int64_t step, std::vector<float>* keep) {
  keep->assign(12, static_cast<float>(step));
  CheckpointTensors t;
  t.model["a"] = {{2, 3}, keep->data(), 6};
  t.optimizer["exp_avg.a"] = {{2, 3}, keep->data() + 6, 6};
  t.optimizer_name = "adamw";
  TrainState st;
  st.step = step;
  st.data_position = step * 2;
  return SerializeCheckpoint(t, *ModelPreset("tiny"), st);
}

void FlipByte(const std::string& path, std::streamoff at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(at);
  f.put('\x7f');
}

// Large enough for the test's replicas.
const ReplicaBound kBound{1 << 20, 1 << 20, 1 << 20};

TEST(ReplicaStoreTest, TheNewestCompleteReplicaWinsAndTheBadOnesAreRefused) {
  const std::string root = FreshDir("root");
  std::vector<float> v4, v8;
  ASSERT_TRUE(CommitReplica(root, 4, Files(4, &v4), {"job", 1}).ok());
  ASSERT_TRUE(CommitReplica(root, 8, Files(8, &v8), {"job", 1}).ok());
  // Bounded: the newer complete replica replaced the older one.
  EXPECT_EQ(CompleteCheckpoints(root), std::vector<std::string>{root + "/step_00000008"});
  // An incomplete one (no state.json: a writer that died) is no candidate.
  std::filesystem::create_directories(root + "/step_00000012");
  std::ofstream(root + "/step_00000012/model.safetensors") << "partial";
  ReplicaChoice c = NewestReplica(root, "job", 2, kBound);
  EXPECT_EQ(c.step, 8);
  EXPECT_EQ(c.dir, root + "/step_00000008");
  EXPECT_TRUE(c.refused.empty());
  EXPECT_EQ(c.files.model, Files(8, &v8).model);
  // Another job's, or one the resuming attempt took itself (or a later one), is refused.
  c = NewestReplica(root, "other", 2, kBound);
  EXPECT_EQ(c.step, 0);
  ASSERT_EQ(c.refused.size(), 1u);
  EXPECT_EQ(c.refused[0], absl::StrCat("in-memory replica of step 8 (\"", root,
                                       "/step_00000008\") refused: it belongs to job \"job\", "
                                       "not \"other\""));
  c = NewestReplica(root, "job", 1, kBound);
  EXPECT_EQ(c.step, 0);
  ASSERT_EQ(c.refused.size(), 1u);
  EXPECT_TRUE(absl::StrContains(c.refused[0], "taken by attempt 1, not an earlier attempt than 1"))
      << c.refused[0];
  // One larger than a replica of the model can be is refused before it is read.
  const ReplicaBound small{64, 1 << 20, 1 << 20};
  c = NewestReplica(root, "job", 2, small);
  EXPECT_EQ(c.step, 0);
  ASSERT_EQ(c.refused.size(), 1u);
  EXPECT_EQ(c.refused[0], absl::StrCat("in-memory replica of step 8 (\"", root,
                                       "/step_00000008\") refused: model.safetensors holds ",
                                       Files(8, &v8).model.size(),
                                       " bytes; a replica of this model has at most 64"));
  // A corrupt one (a flipped byte in its weights) is refused by its checksum.
  FlipByte(root + "/step_00000008/model.safetensors", 100);
  c = NewestReplica(root, "job", 2, kBound);
  EXPECT_EQ(c.step, 0);
  ASSERT_EQ(c.refused.size(), 1u);
  EXPECT_EQ(c.refused[0], absl::StrCat("in-memory replica of step 8 (\"", root,
                                       "/step_00000008\") refused: checkpoint: ", root,
                                       "/step_00000008: model.safetensors is corrupt: checksum "
                                       "mismatch"));
  // A newer attempt has fenced the root: an older attempt can no longer replace the replica.
  ASSERT_TRUE(FenceCheckpointRoot(root, 3).ok());
  absl::StatusOr<std::string> late = CommitReplica(root, 12, Files(12, &v8), {"job", 2});
  EXPECT_EQ(late.status().code(), absl::StatusCode::kAborted);
}

TEST(ReplicaStoreTest, ReceivedSizesAreBoundedByTheModel) {
  ParamSet params;
  params.Add("w", {4, 8}, ParamInit::kNormal);
  params.Add("b", {8}, ParamInit::kZeros);
  params.Allocate(1);
  const ReplicaBound b = ReplicaBoundFor(params, 2);
  EXPECT_GE(b.model, 40 * 4);
  EXPECT_LT(b.model, 40 * 4 + 8192);
  EXPECT_GE(b.optimizer, 2 * 40 * 4);
  EXPECT_TRUE(CheckReplicaSizes(b.model, b.optimizer, 100, b, "rank 0").ok());
  absl::Status s = CheckReplicaSizes(b.model + 1, 0, 100, b, "rank 0");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), absl::StrCat("replica: rank 0 sent a model.safetensors of ", b.model + 1,
                                      " bytes; a replica of this model has at most ", b.model));
  EXPECT_FALSE(CheckReplicaSizes(0, -1, 0, b, "rank 0").ok());
  EXPECT_FALSE(CheckReplicaSizes(0, 0, int64_t{1} << 40, b, "rank 0").ok());
}

struct RankRun {
  std::vector<double> losses;
  std::vector<std::string> notes;
  int64_t resumed = -1;
};

// One attempt of a cp = 2 job: rank r keeps its replicas in roots[r] on worker hosts[r].
absl::Status RunAttempt(const JobSpec& spec, int64_t attempt, int64_t stop_at,
                        const std::vector<std::string>& roots,
                        const std::vector<std::string>& hosts, std::vector<RankRun>* runs) {
  MemoryKvStore store;
  runs->assign(2, RankRun{});
  return testing::RunRanks(2, [&](int rank) -> absl::Status {
    TrainerOptions o;
    o.spec = spec;
    o.rank = rank;
    o.world = 2;
    o.store = &store;
    o.gloo = testing::TestGloo();
    o.attempt = attempt;
    o.stop_at_step = stop_at;
    o.job_id = "job";
    if (!roots.empty()) {
      o.replica_root = roots[rank];
      o.replica_host = hosts[rank];
    }
    RankRun& run = (*runs)[rank];
    o.on_event = [&run](const nlohmann::json& e) {
      if (e.value("event", "") == "note") run.notes.push_back(e["message"]);
    };
    ASSIGN_OR_RETURN(auto t, Trainer::Create(std::move(o)));
    run.resumed = t->state().step;
    RETURN_IF_ERROR(t->Run());
    run.losses = t->losses();
    return absl::OkStatus();
  });
}

std::string Joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) absl::StrAppend(&out, l, "\n");
  return out;
}

// Rank 0's worker is lost after step 10: the new attempt's rank 0 runs on a third worker with no
// replicas, and rank 1's worker still holds the peer copy of step 8 (file checkpoints: only at the
// end). Both ranks resume from it and train steps 9..12 with the losses of an uninterrupted run.
TEST(TrainerReplicasTest, ALostWorkersRankResumesFromThePeerCopyWithTheUninterruptedLosses) {
  const std::string ckpt = FreshDir("ckpt");
  const JobSpec spec = Tiny(12, 0, 4, ckpt);
  const std::vector<std::string> roots = {FreshDir("wa"), FreshDir("wb")};
  std::vector<RankRun> first;
  ASSERT_TRUE(RunAttempt(spec, 1, 10, roots, {"wa", "wb"}, &first).ok());
  ASSERT_EQ(first[0].losses.size(), 10u);
  // Rank 0 holds its own copy, rank 1 the peer copy: step 8 each (step 4 replaced).
  for (const std::string& root : roots)
    EXPECT_EQ(CompleteCheckpoints(root), std::vector<std::string>{root + "/step_00000008"});
  EXPECT_TRUE(CompleteCheckpoints(ckpt).empty());

  std::vector<RankRun> second;
  const std::vector<std::string> after = {FreshDir("wc"), roots[1]};
  ASSERT_TRUE(RunAttempt(spec, 2, -1, after, {"wc", "wb"}, &second).ok());
  EXPECT_EQ(second[0].resumed, 8);
  EXPECT_EQ(second[1].resumed, 8);
  EXPECT_EQ(Joined(second[1].notes),
            "resumed from in-memory replicas at step 8 (the copy on worker \"wb\", rank 1's; the "
            "newest checkpoint is step 0)\n");

  // The uninterrupted run (no replicas, its own directory).
  std::vector<RankRun> ref;
  ASSERT_TRUE(RunAttempt(Tiny(12, 0, 0, FreshDir("ref")), 1, -1, {}, {}, &ref).ok());
  ASSERT_EQ(ref[0].losses.size(), 12u);
  ASSERT_EQ(second[0].losses.size(), 4u);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(second[0].losses[i], ref[0].losses[8 + i]) << "step " << 9 + i;
  for (int i = 0; i < 10; ++i) EXPECT_EQ(first[0].losses[i], ref[0].losses[i]) << "step " << i + 1;
}

// The only replica newer than the file checkpoint (step 6) is corrupt: it is refused in a note
// naming the checksum, and the gang resumes from the file, saying so.
TEST(TrainerReplicasTest, ACorruptReplicaIsRefusedAndTheFileCheckpointUsed) {
  const std::string ckpt = FreshDir("ckpt");
  const JobSpec spec = Tiny(12, 6, 4, ckpt);
  const std::vector<std::string> roots = {FreshDir("wa"), FreshDir("wb")};
  std::vector<RankRun> first;
  ASSERT_TRUE(RunAttempt(spec, 1, 10, roots, {"wa", "wb"}, &first).ok());
  FlipByte(roots[1] + "/step_00000008/optimizer.safetensors", 200);
  std::vector<RankRun> second;
  ASSERT_TRUE(RunAttempt(spec, 2, 6, {FreshDir("wc"), roots[1]}, {"wc", "wb"}, &second).ok());
  EXPECT_EQ(second[0].resumed, 6);
  EXPECT_EQ(second[1].resumed, 6);
  EXPECT_EQ(Joined(second[1].notes),
            absl::StrCat("in-memory replica of step 8 (\"", roots[1],
                         "/step_00000008\") refused: checkpoint: ", roots[1],
                         "/step_00000008: optimizer.safetensors is corrupt: checksum mismatch\n"));
  EXPECT_EQ(Joined(second[0].notes), "resumed from checkpoint step 6\n");
}

}  // namespace
}  // namespace spindle
