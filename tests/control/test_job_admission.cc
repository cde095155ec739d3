// JobAdmission on its own (tests/control/job_parts.h): the checks made before the table is
// locked, a job stored QUEUED with nothing placed, idempotent request ids, refusals of jobs the
// registered workers can never hold and of overlapping checkpoint directories, planning at submit
// (recompute "auto", the topology plans are sized to) and the plan's decisions taken.
#include <unistd.h>

#include <filesystem>
#include <string>

#include "common/job_spec.h"
#include "coordinator/job_admission.h"
#include "gtest/gtest.h"
#include "planner/plan_proto.h"
#include "tests/control/job_parts.h"
#include "tests/control/test_util.h"

namespace spindle {
namespace {

using testing::TinyJob;

class JobAdmissionTest : public testing::JobPartsTest {};

TEST_F(JobAdmissionTest, ParseSubmitChecksTheRequestIdTheSpecAndItsPaths) {
  EXPECT_EQ(JobAdmission::ParseSubmit(TinyJob(), std::string(129, 'r'), "").status().message(),
            "submit: request_id must be at most 128 characters of [A-Za-z0-9._:-], got 129 "
            "characters");
  EXPECT_EQ(JobAdmission::ParseSubmit(TinyJob(), "a b", "").status().message(),
            "submit: request_id must be at most 128 characters of [A-Za-z0-9._:-], got 3 "
            "characters including others");
  EXPECT_EQ(JobAdmission::ParseSubmit(TinyJob(1, 1, "ck"), "", "").status().message(),
            "job spec: checkpoint.dir: must be an absolute path (`spindle submit` makes relative "
            "paths absolute), got \"ck\"");
  EXPECT_EQ(JobAdmission::ParseSubmit("{", "", "").status().code(),
            absl::StatusCode::kInvalidArgument);

  absl::StatusOr<SubmitRequest> req = JobAdmission::ParseSubmit(TinyJob(2), "r-1.a:b_c", "alice");
  ASSERT_TRUE(req.ok()) << req.status();
  EXPECT_EQ(req->canonical_spec, ParseJobSpec(TinyJob(2))->ToJson().dump());
  EXPECT_EQ(req->spec.parallel.cp, 2);
  EXPECT_EQ(req->checkpoint_place, JobAdmission::SamePlace("/tmp/ck"));
  EXPECT_EQ(req->request_id, "r-1.a:b_c");
  EXPECT_EQ(req->owner, "alice");
}

TEST_F(JobAdmissionTest, SamePlaceNormalisesAndResolvesLinks) {
  testing::TempDir dir;
  const std::string real = std::filesystem::weakly_canonical(dir.File("real")).string();
  std::filesystem::create_directory(real);
  ASSERT_EQ(symlink(real.c_str(), dir.File("link").c_str()), 0);
  EXPECT_EQ(JobAdmission::SamePlace(dir.File("link") + "//ck/"), real + "/ck");
  EXPECT_EQ(JobAdmission::SamePlace(real + "/a/../ck"), real + "/ck");
  EXPECT_EQ(JobAdmission::SamePlace("/"), "/");
}

TEST_F(JobAdmissionTest, SubmitStoresTheJobQueuedAndPlacesNothing) {
  AddWorker("w1", 2);
  out.messages.clear();
  const std::string id = Submit(TinyJob(2), "alice");
  ASSERT_EQ(id, "j-000001");
  const JobRuntime& j = Job(id);
  EXPECT_EQ(j.rec.state, JobState::kQueued);
  EXPECT_EQ(j.rec.message, "waiting for 2 free cpu devices");
  EXPECT_EQ(j.rec.owner, "alice");
  EXPECT_EQ(Events(j), std::vector<std::string>{"submitted by alice"});
  EXPECT_GT(j.version, 0u);
  EXPECT_EQ(j.queued_since_ms, clock.SteadyMs());
  // Durable: the store holds what the table holds.
  absl::StatusOr<std::vector<JobRecord>> stored = store.LoadJobs();
  ASSERT_TRUE(stored.ok());
  ASSERT_EQ(stored->size(), 1u);
  EXPECT_EQ((*stored)[0].state, JobState::kQueued);
  EXPECT_EQ((*stored)[0].plan, j.rec.plan);
  EXPECT_EQ(submitted.Value(), 1);
  // Placing is not admission's: no command, no slot taken, no rendezvous scope.
  EXPECT_TRUE(out.messages.empty());
  EXPECT_EQ(table.registry.DeviceCounts()["free"], 2);
  EXPECT_EQ(rendezvous.NumOpen(), 0u);
  EXPECT_TRUE(j.ranks.empty());
}

TEST_F(JobAdmissionTest, ARefusedWriteAdmitsNothing) {
  store.refuse_writes = true;
  absl::StatusOr<SubmitRequest> req = JobAdmission::ParseSubmit(TinyJob(), "r-1", "");
  ASSERT_TRUE(req.ok());
  EXPECT_EQ(admission.Submit(table, *req, nullptr).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(table.jobs.empty());
  EXPECT_EQ(table.index.ByRequestId("r-1"), "");
  EXPECT_EQ(submitted.Value(), 0);
}

TEST_F(JobAdmissionTest, ARequestIdReturnsItsJobAndRefusesAnotherSpec) {
  absl::StatusOr<SubmitRequest> req = JobAdmission::ParseSubmit(TinyJob(2), "r-1", "");
  ASSERT_TRUE(req.ok());
  CpPlan first;
  absl::StatusOr<SubmitResult> a = admission.Submit(table, *req, &first);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->created);
  CpPlan again;
  absl::StatusOr<SubmitResult> b = admission.Submit(table, *req, &again);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_FALSE(b->created);
  EXPECT_EQ(b->job_id, a->job_id);
  EXPECT_EQ(EncodePlan(again), EncodePlan(first));  // the stored plan, not a new one
  EXPECT_EQ(table.jobs.size(), 1u);
  EXPECT_EQ(submitted.Value(), 1);

  absl::StatusOr<SubmitRequest> other = JobAdmission::ParseSubmit(TinyJob(1), "r-1", "");
  ASSERT_TRUE(other.ok());
  absl::StatusOr<SubmitResult> c = admission.Submit(table, *other, nullptr);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(c.status().message(),
            "submit: request id \"r-1\" was already used for job j-000001 with a different "
            "spec; a new job needs a new request id");
}

TEST_F(JobAdmissionTest, RefusesAJobTheRegisteredWorkersCanNeverHold) {
  AddWorker("w1", 1);
  absl::StatusOr<SubmitRequest> req = JobAdmission::ParseSubmit(TinyJob(2), "", "");
  ASSERT_TRUE(req.ok());
  const std::string why =
      "job needs 2 cpu devices (world = dp*cp) but the 1 registered cpu worker has 1 in total";
  absl::StatusOr<SubmitResult> r = admission.Submit(table, *req, nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.status().message(), why);
  EXPECT_TRUE(table.jobs.empty());
  EXPECT_TRUE(store.LoadJobs()->empty());
  // PlanSpec says the same among the plan's problems, storing nothing.
  CpPlan plan;
  admission.PlanSpec(table, req->spec, &plan);
  EXPECT_EQ(plan.problems, std::vector<std::string>{why});
  EXPECT_TRUE(store.LoadJobs()->empty());
}

TEST_F(JobAdmissionTest, CheckpointDirectoriesOfUnfinishedJobsDoNotOverlap) {
  const std::string id = Submit(TinyJob(1, 1, "/tmp/parts-a"));
  auto refusal = [&](const std::string& dir) {
    absl::StatusOr<SubmitRequest> req = JobAdmission::ParseSubmit(TinyJob(1, 1, dir), "", "");
    EXPECT_TRUE(req.ok());
    return std::string(admission.Submit(table, *req, nullptr).status().message());
  };
  EXPECT_EQ(refusal("/tmp//parts-a/"),
            "job cannot run: checkpoint.dir \"/tmp//parts-a/\" is in use by job j-000001 "
            "(queued); two jobs on one directory would resume from each other's checkpoints");
  EXPECT_EQ(refusal("/tmp/parts-a/inner"),
            "job cannot run: checkpoint.dir \"/tmp/parts-a/inner\" is inside \"/tmp/parts-a\", "
            "the checkpoint.dir of job j-000001 (queued); nested checkpoint directories would "
            "mix the two jobs' checkpoints");
  EXPECT_EQ(refusal("/tmp"),
            "job cannot run: checkpoint.dir \"/tmp\" is around \"/tmp/parts-a\", the "
            "checkpoint.dir of job j-000001 (queued); nested checkpoint directories would mix "
            "the two jobs' checkpoints");
  EXPECT_EQ(refusal("/tmp/parts-ab"), "") << "a sibling whose name starts alike is free";
  // A finished job's directory is free again.
  Job(id).rec.state = JobState::kSucceeded;
  EXPECT_EQ(refusal("/tmp/parts-a/inner"), "");
}

TEST_F(JobAdmissionTest, RecomputeAutoWithoutADeviceIsLeftToPlacement) {
  const std::string none = Submit(TinyJob(1, 1, "/tmp/parts-a", 3, "\"auto\""));
  // Every layer of tiny, until a device is known (the placement decides it: Replan).
  EXPECT_EQ(Job(none).planned->plan.memory.device_memory_bytes, 0);
  EXPECT_EQ(Job(none).spec.train.recompute_layers, 4);
  AddWorker("w1", 1);  // 8 GiB: 256 tokens of tiny need no recompute
  const std::string sized = Submit(TinyJob(1, 1, "/tmp/parts-b", 3, "\"auto\""));
  EXPECT_EQ(Job(sized).planned->plan.memory.device_memory_bytes, int64_t{8} << 30);
  EXPECT_EQ(Job(sized).spec.train.recompute_layers, 0);
  const std::string fixed = Submit(TinyJob(1, 1, "/tmp/parts-c", 3, "1"));
  EXPECT_EQ(Job(fixed).spec.train.recompute_layers, 1);
}

TEST_F(JobAdmissionTest, PlansAreSizedToTheLargestRegisteredWorker) {
  const JobSpec two = *ParseJobSpec(TinyJob(2));
  const JobSpec four = *ParseJobSpec(TinyJob(2, 2));
  EXPECT_EQ(admission.TopologyLocked(table, two).basis, DefaultTopology("cpu").basis);
  AddWorker("w1", 2);
  AddWorker("w2", 2, "127.0.0.1", int64_t{16} << 30);
  const Topology on_one = admission.TopologyLocked(table, two);
  EXPECT_NE(on_one.basis.find("(worker w2 reported none)"), std::string::npos) << on_one.basis;
  EXPECT_NE(on_one.link, LinkClass::kNetwork);
  EXPECT_EQ(admission.TopologyLocked(table, four).link, LinkClass::kNetwork);
  EXPECT_EQ(admission.PlanLocked(table, two).memory.device_memory_bytes, int64_t{16} << 30);
}

// A worker's measured link rates ("loopback" or "same-device", from its start-up probe) are what
// plans of gangs on that worker cost their exchanges at, and the basis says so; a gang that spans
// workers meets over the network at its nominal rates.
TEST_F(JobAdmissionTest, AWorkersMeasuredLinkRatesItsOwnGangs) {
  const JobSpec two = *ParseJobSpec(TinyJob(2));
  const JobSpec four = *ParseJobSpec(TinyJob(2, 2));
  Worker& w = AddWorker("w1", 2);
  const Topology nominal = admission.TopologyLocked(table, two);
  EXPECT_EQ(nominal.link, LinkClass::kLoopback);
  EXPECT_EQ(nominal.link_rates.bytes_per_s, DefaultLinkRates(LinkClass::kLoopback).bytes_per_s);
  EXPECT_EQ(nominal.basis.find("measured by worker w1 ("), std::string::npos) << nominal.basis;

  w.devices.link = "loopback";
  w.devices.link_rates = {0.5e9, 200e-6};
  const Topology measured = admission.TopologyLocked(table, two);
  EXPECT_EQ(measured.link_rates.bytes_per_s, 0.5e9);
  EXPECT_EQ(measured.link_rates.latency_s, 200e-6);
  EXPECT_NE(measured.basis.find(", link loopback measured by worker w1 (0.5 GB/s, 200 us a "
                                "message)"),
            std::string::npos)
      << measured.basis;
  // A slower link makes the same job's exchanges, and so its plan, slower.
  EXPECT_GT(admission.PlanLocked(table, two).step_s,
            planner.Plan(two, int64_t{8} << 30, &nominal).step_s);

  const Topology spanning = admission.TopologyLocked(table, four);
  EXPECT_EQ(spanning.link, LinkClass::kNetwork);
  EXPECT_EQ(spanning.link_rates.bytes_per_s, DefaultLinkRates(LinkClass::kNetwork).bytes_per_s);
  EXPECT_EQ(spanning.basis.find("measured by worker w1 ("), std::string::npos) << spanning.basis;
}

TEST_F(JobAdmissionTest, TheJobTakesThePlansDecisions) {
  absl::StatusOr<SubmitRequest> req = JobAdmission::ParseSubmit(TinyJob(2), "", "");
  ASSERT_TRUE(req.ok());
  CpPlan plan;
  absl::StatusOr<SubmitResult> r = admission.Submit(table, *req, &plan);
  ASSERT_TRUE(r.ok()) << r.status();
  const JobRuntime& j = Job(r->job_id);
  EXPECT_NE(plan.ModeOf("lightning"), CpMode::kAuto);
  ASSERT_NE(j.planned, nullptr);
  EXPECT_EQ(EncodePlan(j.planned->plan), EncodePlan(plan));
  EXPECT_EQ(j.memory_per_rank, plan.memory.total_bytes);
  EXPECT_EQ(j.host_bytes_per_rank, plan.memory.host_bytes);
  // The store keeps the planned job whole; the spec the ranks run carries the decided modes in
  // place of "auto", and the request stays as it was sent.
  EXPECT_EQ(j.rec.plan, EncodePlannedJob(*j.planned));
  EXPECT_EQ(j.spec.parallel.lightning_mode, plan.ModeOf("lightning"));
  EXPECT_EQ(j.spec.parallel.mla_mode, plan.ModeOf("mla"));
  EXPECT_TRUE(IsPlanned(j.spec));
  EXPECT_EQ(req->spec.parallel.lightning_mode, CpMode::kAuto);
  EXPECT_EQ(j.planned->requested_json, req->canonical_spec);
}

// Workers report their roots at registration; a job whose checkpoint directory or data file no
// worker of its kind accepts is refused at submit (and shown by Plan), naming the roots. With no
// worker of the kind, or one that reported no roots, the worker's own check at start decides.
TEST_F(JobAdmissionTest, PathsNoWorkerAcceptsAreRefusedNamingTheRoots) {
  const std::string job = R"({"name": "t", "model": {"preset": "tiny"}, "seq_len": 256,
      "data": {"source": "tokens:/data/corpus.bin", "eos_id": 0}, "train": {"steps": 10},
      "checkpoint": {"dir": "/ckpt/run-1", "every": 5}, "resources": "cpu"})";
  absl::StatusOr<SubmitRequest> req = JobAdmission::ParseSubmit(job, "", "");
  ASSERT_TRUE(req.ok()) << req.status();
  EXPECT_TRUE(admission.CheckPathsAcceptedLocked(table, req->spec).ok()) << "no worker: unknown";
  Worker& w1 = AddWorker("w1", 1);
  w1.checkpoint_root = "/var/lib/spindle/checkpoints";
  w1.data_root = "/data";
  Worker& w2 = AddWorker("w2", 1);
  w2.checkpoint_root = "/ckpt";
  w2.data_root = "/var/lib/spindle/data";
  const absl::Status refused = admission.CheckPathsAcceptedLocked(table, req->spec);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.message(),
            "job cannot run: no cpu worker lets it use checkpoint.dir /ckpt/run-1 and "
            "data.source file /data/corpus.bin: w1 (--checkpoint_root "
            "/var/lib/spindle/checkpoints), w2 (--data_root /var/lib/spindle/data); put them under "
            "a worker's roots, or start workers with roots that hold them");
  const size_t jobs = table.jobs.size();
  EXPECT_EQ(admission.Submit(table, *req, nullptr).status(), refused);
  EXPECT_EQ(table.jobs.size(), jobs) << "a refused submit changes nothing";
  CpPlan plan;
  admission.PlanSpec(table, req->spec, &plan);
  EXPECT_NE(std::find(plan.problems.begin(), plan.problems.end(), std::string(refused.message())),
            plan.problems.end());
  // One worker holding both is enough; so is one that reported no roots.
  w2.data_root = "/data/";
  EXPECT_TRUE(admission.CheckPathsAcceptedLocked(table, req->spec).ok());
  w2.data_root = "/var/lib/spindle/data";
  w1.checkpoint_root.clear();
  EXPECT_TRUE(admission.CheckPathsAcceptedLocked(table, req->spec).ok());
}

}  // namespace
}  // namespace spindle
