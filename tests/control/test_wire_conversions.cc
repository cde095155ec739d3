// The coordinator's own types to and from the wire (worker_proto.h, job_proto.h, plan_proto.h):
// every field of every message the job manager's API stands for is carried, checked by filling
// each wire message through reflection (so a field added to the proto and not to the conversion
// fails here) and by explicit values for the worker reports.
#include <optional>
#include <string>
#include <variant>

#include "coordinator/job_proto.h"
#include "planner/plan_proto.h"
#include "coordinator/worker_proto.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "spindle/v1/cluster.pb.h"
#include "spindle/v1/job.pb.h"

namespace spindle {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

// Sets every field of `m` (recursively; repeated fields get two entries) to a value that differs
// from its default and from the other fields'.
void FillEveryField(Message* m, int* counter) {
  const google::protobuf::Descriptor* d = m->GetDescriptor();
  const google::protobuf::Reflection* r = m->GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    const int times = f->is_repeated() ? 2 : 1;
    for (int k = 0; k < times; ++k) {
      const int v = ++*counter;
      switch (f->cpp_type()) {
        case FieldDescriptor::CPPTYPE_INT32:
          f->is_repeated() ? r->AddInt32(m, f, v) : r->SetInt32(m, f, v);
          break;
        case FieldDescriptor::CPPTYPE_INT64:
          f->is_repeated() ? r->AddInt64(m, f, v) : r->SetInt64(m, f, v);
          break;
        case FieldDescriptor::CPPTYPE_DOUBLE:
          f->is_repeated() ? r->AddDouble(m, f, v + 0.5) : r->SetDouble(m, f, v + 0.5);
          break;
        case FieldDescriptor::CPPTYPE_BOOL:
          f->is_repeated() ? r->AddBool(m, f, true) : r->SetBool(m, f, true);
          break;
        case FieldDescriptor::CPPTYPE_STRING: {
          const std::string s = "s" + std::to_string(v);
          f->is_repeated() ? r->AddString(m, f, s) : r->SetString(m, f, s);
          break;
        }
        case FieldDescriptor::CPPTYPE_ENUM: {
          // The last value: never UNSPECIFIED.
          const auto* e = f->enum_type()->value(f->enum_type()->value_count() - 1);
          f->is_repeated() ? r->AddEnum(m, f, e) : r->SetEnum(m, f, e);
          break;
        }
        case FieldDescriptor::CPPTYPE_MESSAGE:
          FillEveryField(f->is_repeated() ? r->AddMessage(m, f) : r->MutableMessage(m, f),
                         counter);
          break;
        default:
          FAIL() << "field type of " << f->full_name() << " not covered by the test";
      }
    }
  }
}

// Every field of `m` (recursively; of a repeated message, its first) is set to a non-default
// value, except Plan.ok (derived: false while the plan has problems).
void ExpectEveryFieldSet(const Message& m, const std::string& path = "") {
  const google::protobuf::Descriptor* d = m.GetDescriptor();
  const google::protobuf::Reflection* r = m.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    const std::string name = path + f->name();
    if (f->full_name() == "spindle.v1.Plan.ok") continue;
    if (f->is_repeated()) {
      EXPECT_GT(r->FieldSize(m, f), 0) << name << " is empty";
      if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && r->FieldSize(m, f) > 0)
        ExpectEveryFieldSet(r->GetRepeatedMessage(m, f, 0), name + "[0].");
      continue;
    }
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      ExpectEveryFieldSet(r->GetMessage(m, f), name + ".");
      continue;
    }
    EXPECT_TRUE(r->HasField(m, f)) << name << " is not carried";
  }
}

TEST(WireConversions, APlanRoundTripsWithEveryField) {
  v1::Plan wire;
  int counter = 0;
  FillEveryField(&wire, &counter);
  for (v1::LayerPlan& l : *wire.mutable_layers()) l.set_mode(v1::CP_MODE_ALL2ALL);
  wire.set_ok(false);  // derived: the plan has problems
  wire.mutable_memory()->set_recompute(true);  // derived: recompute_layers > 0
  CpPlan plan;
  PlanFromProto(wire, &plan);
  v1::Plan back;
  PlanToProto(plan, &back);
  std::string diff;
  google::protobuf::util::MessageDifferencer differ;
  differ.ReportDifferencesToString(&diff);
  EXPECT_TRUE(differ.Compare(wire, back)) << diff;

  absl::StatusOr<CpPlan> decoded = DecodePlan(EncodePlan(plan));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(EncodePlan(*decoded), EncodePlan(plan));
  EXPECT_EQ(DecodePlan("\xff\xff not a plan").status().code(), absl::StatusCode::kDataLoss);
}

TEST(WireConversions, ModesMapBothWays) {
  for (CpMode m : {CpMode::kAllGather, CpMode::kAll2All, CpMode::kRing, CpMode::kHybrid})
    EXPECT_EQ(CpModeFromProto(CpModeToProto(m)), m) << CpModeName(m);
  EXPECT_EQ(CpModeToProto(CpMode::kAuto), v1::CP_MODE_UNSPECIFIED);
  EXPECT_EQ(CpModeFromProto(v1::CP_MODE_UNSPECIFIED), CpMode::kAuto);
  EXPECT_EQ(CpModeFromProto(977), CpMode::kAuto);
}

TEST(WireConversions, AnAssignmentCarriesEveryField) {
  AssignmentCommand a;
  a.ref = {"j-000007", 3, 1};
  // The job as planned: a cp 2 x dp 2 spec with its decisions in place, and a plan with every
  // field set.
  absl::StatusOr<JobSpec> requested = ParseJobSpec(absl::StrCat(
      R"({"name": "w", "model": {"preset": "tiny"}, "seq_len": 1024, "resources": "cpu",
          "data": {"source": "synthetic:recall"}, "checkpoint": {"dir": "/ck", "every": 5},
          "parallel": {"cp": 2, "dp": 2, "lightning_mode": "all2all"}})"));
  ASSERT_TRUE(requested.ok()) << requested.status();
  v1::Plan wire_plan;
  int counter = 0;
  FillEveryField(&wire_plan, &counter);
  for (v1::LayerPlan& l : *wire_plan.mutable_layers()) l.set_mode(v1::CP_MODE_ALL2ALL);
  wire_plan.mutable_memory()->set_recompute_layers(2);  // of tiny's 4
  wire_plan.set_ulysses(1);
  PlannedJob planned;
  planned.requested_json = requested->ToJson().dump();
  PlanFromProto(wire_plan, &planned.plan);
  planned.spec = PlannedSpec(*requested, planned.plan);
  a.job = std::make_shared<const PlannedJob>(planned);
  a.rendezvous_address = "10.0.0.1:7071";
  a.rendezvous_token = "tok";
  a.resume_step = 50;
  a.resume_path = "/ck/step-50";
  a.device_index = 1;
  a.host_address = "10.0.0.2";
  v1::CoordinatorMessage m;
  CommandToProto(a, &m);
  ASSERT_TRUE(m.has_assignment());
  ExpectEveryFieldSet(m.assignment());
  const v1::Assignment& w = m.assignment();
  EXPECT_EQ(w.ref().job_id(), "j-000007");
  EXPECT_EQ(w.ref().attempt(), 3);
  EXPECT_EQ(w.ref().rank(), 1);
  EXPECT_EQ(w.resume_path(), "/ck/step-50");
  EXPECT_EQ(w.host_address(), "10.0.0.2");
  // The rank reads back the same job: the planned spec as given, the request, the plan.
  absl::StatusOr<PlannedJob> back = PlannedJobFromProto(w.job());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->spec.ToJson(), planned.spec.ToJson());
  EXPECT_EQ(back->spec.parallel.world(), 4);
  EXPECT_EQ(back->spec.checkpoint.dir, "/ck");
  EXPECT_EQ(back->requested_json, planned.requested_json);
  EXPECT_EQ(EncodePlan(back->plan), EncodePlan(planned.plan));

  CommandToProto(StopCommand{"j-000007", 3, "restart", 1500}, &m);
  ASSERT_TRUE(m.has_stop());
  ExpectEveryFieldSet(m.stop());
  EXPECT_EQ(m.stop().grace_period_ms(), 1500);
  EXPECT_EQ(m.stop().reason(), "restart");
}

TEST(WireConversions, EveryReportKindIsTakenIn) {
  v1::WorkerMessage m;
  int counter = 0;
  FillEveryField(m.mutable_heartbeat(), &counter);
  std::optional<WorkerReport> r = ReportFromProto(m);
  ASSERT_TRUE(r.has_value());
  const auto& hb = std::get<HeartbeatReport>(*r);
  EXPECT_EQ(hb.unix_ms, m.heartbeat().unix_ms());
  EXPECT_EQ(hb.seq, m.heartbeat().seq());
  ASSERT_EQ(hb.running.size(), 2u);
  const v1::RunningRank& rr = m.heartbeat().running(1);
  EXPECT_EQ(hb.running[1].ref.job_id, rr.ref().job_id());
  EXPECT_EQ(hb.running[1].ref.attempt, rr.ref().attempt());
  EXPECT_EQ(hb.running[1].ref.rank, rr.ref().rank());
  EXPECT_EQ(hb.running[1].step, rr.step());
  EXPECT_EQ(hb.running[1].pid, rr.pid());
  EXPECT_TRUE(hb.running[1].pulsing);
  EXPECT_EQ(hb.running[1].silent_ms, rr.silent_ms());
  EXPECT_EQ(hb.running[1].loss, rr.loss());

  FillEveryField(m.mutable_rank_progress(), &counter);
  r = ReportFromProto(m);
  const auto& p = std::get<RankProgressReport>(*r);
  const v1::RankProgress& wp = m.rank_progress();
  EXPECT_EQ(p.ref.job_id, wp.ref().job_id());
  EXPECT_EQ(p.step, wp.step());
  EXPECT_EQ(p.total_steps, wp.total_steps());
  EXPECT_EQ(p.loss, wp.loss());
  EXPECT_EQ(p.tokens_per_s, wp.tokens_per_s());
  EXPECT_EQ(p.lr, wp.lr());
  EXPECT_EQ(p.grad_norm, wp.grad_norm());
  EXPECT_EQ(p.elapsed_s, wp.elapsed_s());
  EXPECT_EQ(p.mfu, wp.mfu());
  EXPECT_EQ(p.memory_bytes, wp.memory_bytes());
  EXPECT_NE(wp.resumed_from_step(), 0);
  EXPECT_EQ(p.resumed_from_step, wp.resumed_from_step());
  EXPECT_TRUE(p.moe.present);
  EXPECT_EQ(p.moe.load_max_over_mean, wp.moe().load_max_over_mean());
  EXPECT_EQ(p.moe.bias_min, wp.moe().bias_min());
  EXPECT_EQ(p.moe.bias_max, wp.moe().bias_max());
  EXPECT_EQ(p.moe.router_z_loss, wp.moe().router_z_loss());
  EXPECT_EQ(p.moe.dispatch_bytes, wp.moe().dispatch_bytes());
  EXPECT_EQ(p.moe.dispatch_s, wp.moe().dispatch_s());

  FillEveryField(m.mutable_rank_exit(), &counter);
  r = ReportFromProto(m);
  const auto& e = std::get<RankExitReport>(*r);
  const v1::RankExit& we = m.rank_exit();
  EXPECT_EQ(e.ref.rank, we.ref().rank());
  EXPECT_EQ(e.exit_code, we.exit_code());
  EXPECT_EQ(e.signal, we.signal());
  ASSERT_EQ(e.stderr_tail.size(), 2u);
  EXPECT_EQ(e.stderr_tail[1], we.stderr_tail(1));
  EXPECT_TRUE(e.stopped);
  EXPECT_EQ(e.last_loss, we.last_loss());

  FillEveryField(m.mutable_rank_started(), &counter);
  r = ReportFromProto(m);
  EXPECT_EQ(std::get<RankStartedReport>(*r).pid, m.rank_started().pid());
  FillEveryField(m.mutable_checkpoint_done(), &counter);
  r = ReportFromProto(m);
  EXPECT_EQ(std::get<CheckpointDoneReport>(*r).step, m.checkpoint_done().step());
  EXPECT_EQ(std::get<CheckpointDoneReport>(*r).path, m.checkpoint_done().path());
  FillEveryField(m.mutable_leaving(), &counter);
  r = ReportFromProto(m);
  EXPECT_EQ(std::get<LeavingReport>(*r).reason, m.leaving().reason());
  FillEveryField(m.mutable_note(), &counter);
  r = ReportFromProto(m);
  EXPECT_EQ(std::get<RankNoteReport>(*r).text, m.note().text());
  EXPECT_EQ(std::get<RankNoteReport>(*r).ref.attempt, m.note().ref().attempt());

  // A hello on an open session, or a message of no kind, reports nothing.
  FillEveryField(m.mutable_hello(), &counter);
  EXPECT_FALSE(ReportFromProto(m).has_value());
  EXPECT_FALSE(ReportFromProto(v1::WorkerMessage()).has_value());

  v1::SessionHello h;
  FillEveryField(&h, &counter);
  const WorkerHello hello = HelloFromProto(h);
  EXPECT_EQ(hello.worker_id, h.worker_id());
  EXPECT_EQ(hello.instance_id, h.instance_id());
  ASSERT_EQ(hello.running.size(), 2u);
  EXPECT_EQ(hello.running[0].ref.job_id, h.running(0).ref().job_id());
}

TEST(WireConversions, AJobViewFillsEveryFieldOfAJob) {
  JobView v;
  v.record.job_id = "j-000002";
  v.record.name = "n";
  v.record.state = JobState::kRunning;
  v.record.priority = 3;
  v.record.spec_json = "{}";
  v.record.submitted_ms = 10;
  v.record.updated_ms = 20;
  v.record.attempt = 2;
  v.record.restarts = 1;
  v.record.max_restarts = 4;
  v.record.message = "m";
  v.record.last_checkpoint_step = 5;
  v.record.last_checkpoint_path = "/ck/5";
  v.record.owner = "alice";
  v1::Plan wire_plan;
  int counter = 0;
  FillEveryField(&wire_plan, &counter);
  for (v1::LayerPlan& l : *wire_plan.mutable_layers()) l.set_mode(v1::CP_MODE_ALLGATHER);
  PlanFromProto(wire_plan, &v.plan);
  v.total_steps = 100;
  v.step = 7;
  v.loss = 2.5;
  v.tokens_per_s = 900;
  v.mfu = 0.4;
  v.eta_s = 33;
  v.ranks.push_back({{1, "w1", 2}, "running", 7, 2.5, 450, 1e-3, 0.7, 12.5, 0.4, 1e9, 3, 99});
  v.ranks.back().moe = {true, 1.25, -0.5, 0.75, 3.5, 4096, 0.125};
  v.moe = v.ranks.back().moe;
  v.events.push_back({"j-000002", 2, 15, JobState::kPlaced, "placed"});
  v.next_events_page_token = "events-1";
  v1::Job job;
  JobViewToProto(v, &job);
  ExpectEveryFieldSet(job);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.plan().memory().recompute_layers(), wire_plan.memory().recompute_layers());
  EXPECT_EQ(job.ranks(0).worker_id(), "w1");
  EXPECT_EQ(job.ranks(0).exit_code(), 3);
  EXPECT_EQ(job.ranks(0).last_report_unix_ms(), 99);
  EXPECT_EQ(job.events(0).message(), "placed");
  EXPECT_EQ(job.events(0).state(), v1::JOB_STATE_PLACED);
}

}  // namespace
}  // namespace spindle
