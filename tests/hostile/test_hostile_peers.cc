// Attacks on the coordinator from peers that hold a credential, each from an independent client
// (raw gRPC stubs against an in-process coordinator on 127.0.0.1, not the CLI or the worker
// library): heartbeats listing ranks the worker was never given; a hello and a registration that
// try to take over a live worker; 4 MB strings in every field users and workers send; workers
// and streams that never read; streams that never say hello; more sessions, waiting rendezvous
// Gets, workers and slots than the limits; an absurd but well-formed model; a NUL byte in
// checkpoint.dir.
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "cli/cli.h"
#include "common/job_spec.h"
#include "common/text_bounds.h"
#include "coordinator/coordinator_server.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "planner/cp_planner.h"
#include "spindle/v1/cluster.grpc.pb.h"
#include "spindle/v1/job.grpc.pb.h"
#include "spindle/v1/rendezvous.grpc.pb.h"
#include "tests/integration/worker_test_util.h"

namespace spindle {
namespace {

using testing::ScratchDir;
using testing::WaitFor;

constexpr size_t k4MB = 4 << 20;

std::string Spec(const std::string& checkpoint_dir = "/tmp/hostile-ck", int64_t cp = 1) {
  return absl::StrCat(R"({"name": "h", "model": {"preset": "tiny"},
    "data": {"source": "synthetic:recall"}, "seq_len": 256, "parallel": {"cp": )",
                      cp, R"(}, "train": {"steps": 10}, "checkpoint": {"dir": ")", checkpoint_dir,
                      R"(", "every": 5}, "resources": "cpu", "max_restarts": 3})");
}

// One worker's Session stream from a raw stub; a thread keeps every message the coordinator
// sends unless the test asks it not to read.
class RawSession {
 public:
  RawSession(v1::ClusterService::Stub* stub, const std::string& worker_id,
             const std::string& instance_id, bool read = true) {
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    stream_ = stub->Session(&ctx_);
    v1::WorkerMessage hello;
    hello.mutable_hello()->set_worker_id(worker_id);
    hello.mutable_hello()->set_instance_id(instance_id);
    stream_->Write(hello);
    if (read) {
      reader_ = std::thread([this] {
        v1::CoordinatorMessage m;
        while (stream_->Read(&m)) {
          absl::MutexLock l(&mu_);
          got_.push_back(m);
        }
        absl::MutexLock l(&mu_);
        ended_ = true;
      });
    }
  }
  ~RawSession() {
    ctx_.TryCancel();
    if (reader_.joinable()) reader_.join();
  }
  bool Write(const v1::WorkerMessage& m) { return stream_->Write(m); }
  bool Heartbeat(int64_t seq) {
    v1::WorkerMessage m;
    m.mutable_heartbeat()->set_seq(seq);
    return Write(m);
  }
  std::vector<v1::CoordinatorMessage> Got() {
    absl::MutexLock l(&mu_);
    return got_;
  }
  bool Ended() {
    absl::MutexLock l(&mu_);
    return ended_;
  }
  bool Acked(int64_t seq) {
    for (const auto& m : Got())
      if (m.has_heartbeat_ack() && m.heartbeat_ack().seq() == seq) return true;
    return false;
  }
  std::vector<v1::Assignment> Assignments() {
    std::vector<v1::Assignment> out;
    for (const auto& m : Got())
      if (m.has_assignment()) out.push_back(m.assignment());
    return out;
  }
  int Stops() {
    int n = 0;
    for (const auto& m : Got()) n += m.has_stop();
    return n;
  }
  // The stream's status once it has ended (the reader thread saw its end).
  grpc::Status Finish() {
    if (reader_.joinable()) reader_.join();
    return stream_->Finish();
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream_;
  std::thread reader_;
  absl::Mutex mu_;
  std::vector<v1::CoordinatorMessage> got_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

class HostilePeersTest : public ::testing::Test {
 protected:
  void Start(const std::function<void(CoordinatorConfig&)>& tweak = {}) {
    CoordinatorConfig cfg;
    cfg.listen = "127.0.0.1:0";
    cfg.db_path = dir_.File("hostile.db");
    cfg.metrics_port = 0;
    cfg.manager.heartbeat_timeout_ms = 60000;
    if (tweak) tweak(cfg);
    auto s = CoordinatorServer::Start(cfg);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    // A client that accepts anything the coordinator may send, and reads only as much as it
    // asks for (no bandwidth probing growing its window): the coordinator's own limits decide.
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    channel_ = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", server_->client_port()),
                                         grpc::InsecureChannelCredentials(), args);
    jobs_ = v1::JobService::NewStub(channel_);
    cluster_ = v1::ClusterService::NewStub(channel_);
    rendezvous_ = v1::RendezvousService::NewStub(channel_);
  }

  grpc::Status Register(const std::string& id, const std::string& instance, int32_t slots = 1,
                        const std::function<void(v1::RegisterRequest&)>& tweak = {}) {
    v1::RegisterRequest req;
    req.set_worker_id(id);
    req.set_hostname(id.substr(0, 16) + ".local");
    req.set_instance_id(instance);
    v1::DeviceGroup* d = req.add_devices();
    d->set_kind("cpu");
    d->set_count(slots);
    d->set_memory_bytes(int64_t{8} << 30);
    if (tweak) tweak(req);
    v1::RegisterResponse resp;
    grpc::ClientContext ctx;
    return cluster_->Register(&ctx, req, &resp);
  }

  absl::StatusOr<std::string> Submit(const std::string& spec) {
    v1::SubmitJobRequest req;
    req.set_spec_json(spec);
    v1::SubmitJobResponse resp;
    grpc::ClientContext ctx;
    grpc::Status st = jobs_->Submit(&ctx, req, &resp);
    if (!st.ok())
      return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
    return resp.job_id();
  }

  v1::Job Get(const std::string& id, int page_size = 0, const std::string& token = "") {
    v1::GetJobRequest req;
    req.set_job_id(id);
    req.set_events_page_size(page_size);
    req.set_events_page_token(token);
    v1::Job job;
    grpc::ClientContext ctx;
    EXPECT_TRUE(jobs_->Get(&ctx, req, &job).ok());
    return job;
  }

  // A counter's value on the coordinator's /metrics; -1 when absent.
  double Metric(const std::string& name) {
    httplib::Client client("127.0.0.1", server_->metrics_port());
    auto res = client.Get("/metrics");
    if (!res || res->status != 200) return -1;
    const std::string& body = res->body;
    const size_t at = body.find("\n" + name + " ");
    if (at == std::string::npos) return -1;
    double v = -1;
    const size_t begin = at + name.size() + 2;
    absl::SimpleAtod(body.substr(begin, body.find('\n', begin) - begin), &v);
    return v;
  }

  ScratchDir dir_{"spindle-hostile"};
  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::ClusterService::Stub> cluster_;
  std::unique_ptr<v1::RendezvousService::Stub> rendezvous_;
};

v1::RunningRank* AddRunning(v1::Heartbeat* h, const std::string& job, int64_t attempt,
                            int64_t rank) {
  v1::RunningRank* r = h->add_running();
  r->mutable_ref()->set_job_id(job);
  r->mutable_ref()->set_attempt(attempt);
  r->mutable_ref()->set_rank(rank);
  return r;
}

TEST_F(HostilePeersTest, HeartbeatsWithRanksNeverGivenAreIgnoredAndCounted) {
  Start();
  ASSERT_TRUE(Register("w1", "i1").ok());
  RawSession w1(cluster_.get(), "w1", "i1");
  auto id = Submit(Spec());
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitFor([&] { return !w1.Assignments().empty(); }));
  // 1,000 ranks of the real job's attempts that never existed, 1,000 of jobs it never heard of,
  // and the one rank it did give, twice.
  for (int64_t seq = 1; seq <= 2; ++seq) {
    v1::WorkerMessage m;
    v1::Heartbeat* h = m.mutable_heartbeat();
    h->set_seq(seq);
    AddRunning(h, *id, 1, 0)->set_step(1);
    for (int i = 0; i < 1000; ++i) AddRunning(h, *id, 2 + i, i % 3);
    for (int i = 0; i < 1000; ++i) AddRunning(h, absl::StrCat("j-9", i), 1, 0);
    ASSERT_TRUE(w1.Write(m));
    // Counted where they are taken in (after the ack): 1,000 + 992 per heartbeat. A heartbeat
    // queued behind another that was not yet taken in replaces it, so the next one is sent only
    // once this one has been counted.
    ASSERT_TRUE(WaitFor([&] { return w1.Acked(seq); }));
    ASSERT_TRUE(
        WaitFor([&] { return Metric("spindle_ignored_rank_reports_total") >= 1992 * seq; }))
        << Metric("spindle_ignored_rank_reports_total");
  }
  EXPECT_EQ(Metric("spindle_ignored_rank_reports_total"), 3984);
  // Unknown jobs get at most 8 stops a heartbeat (a previous database's ranks may be real);
  // the real job none, and its attempt goes on.
  EXPECT_LE(w1.Stops(), 16);
  for (const auto& m : w1.Got())
    if (m.has_stop()) EXPECT_NE(m.stop().job_id(), *id);
  const v1::Job job = Get(*id);
  EXPECT_EQ(job.attempt(), 1);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.state(), v1::JOB_STATE_PLACED);
}

TEST_F(HostilePeersTest, HelloAndRegisterCannotTakeOverALiveWorker) {
  Start();
  ASSERT_TRUE(Register("w1", "i1").ok());
  auto w1_first = std::make_unique<RawSession>(cluster_.get(), "w1", "i1");
  RawSession& w1 = *w1_first;
  ASSERT_TRUE(w1.Heartbeat(1));
  ASSERT_TRUE(WaitFor([&] { return w1.Acked(1); }));

  // Another daemon's hello for w1: refused, and w1's stream is not cancelled first.
  RawSession thief(cluster_.get(), "w1", "other");
  const grpc::Status st = thief.Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  // A registration without an instance id, and one with another, while w1 is connected.
  EXPECT_EQ(Register("w1", "").error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(Register("w1", "other").error_code(), grpc::StatusCode::ALREADY_EXISTS);
  // A hello without an instance id does not match the stored one (the empty registration did
  // not clear it).
  RawSession empty(cluster_.get(), "w1", "");
  EXPECT_EQ(empty.Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(w1.Heartbeat(2));
  EXPECT_TRUE(WaitFor([&] { return w1.Acked(2); }));
  EXPECT_FALSE(w1.Ended());

  // Disconnected, w1 may be registered without an instance id, which still does not clear the
  // stored one: only the daemon that registered it opens its sessions.
  w1_first.reset();
  ASSERT_TRUE(WaitFor([&] { return Register("w1", "").ok(); }));
  RawSession empty_again(cluster_.get(), "w1", "");
  EXPECT_EQ(empty_again.Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  RawSession back(cluster_.get(), "w1", "i1");
  ASSERT_TRUE(back.Heartbeat(1));
  EXPECT_TRUE(WaitFor([&] { return back.Acked(1); }));
}

TEST_F(HostilePeersTest, FourMegabyteStringsInEveryUserAndWorkerField) {
  Start();
  const std::string big(k4MB, 'x');
  // Two-byte characters, so that a cut at a byte count would land inside one.
  std::string wide;
  while (wide.size() < k4MB) wide += "\xC3\xA9";  // é
  auto code = [](const absl::StatusOr<std::string>& s) { return s.status().code(); };

  // Users.
  EXPECT_EQ(code(Submit(big)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Submit(Spec(std::string(900000, 'd')))), absl::StatusCode::kInvalidArgument);
  {
    v1::SubmitJobRequest req;
    req.set_spec_json(Spec());
    req.set_request_id(big);
    v1::SubmitJobResponse resp;
    grpc::ClientContext ctx;
    EXPECT_EQ(jobs_->Submit(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    v1::PlanJobRequest req;
    req.set_spec_json(big);
    v1::PlanJobResponse resp;
    grpc::ClientContext ctx;
    EXPECT_EQ(jobs_->Plan(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  for (const bool big_token : {false, true}) {
    v1::GetJobRequest req;
    req.set_job_id(big_token ? "j-000001" : big);
    if (big_token) req.set_events_page_token(big);
    v1::Job job;
    grpc::ClientContext ctx;
    const grpc::Status st = jobs_->Get(&ctx, req, &job);
    EXPECT_TRUE(st.error_code() == grpc::StatusCode::NOT_FOUND ||
                st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_LT(st.error_message().size(), 300u);
  }
  {
    v1::ListJobsRequest req;
    req.set_page_token(big);
    v1::ListJobsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_EQ(jobs_->List(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }

  // Workers: ids are refused, every other string is cut.
  EXPECT_EQ(Register(big, "i").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Register("w0", big).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Register("w0", "i", 1, [&](v1::RegisterRequest& r) { r.set_advertise_host(big); })
                .error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // One 4 MB field a registration (two would pass the 8 MiB message limit).
  for (int field = 0; field < 3; ++field) {
    ASSERT_TRUE(Register("w1", "i1", 1, [&](v1::RegisterRequest& r) {
                  if (field == 0) r.set_hostname(big);
                  if (field == 1) r.mutable_devices(0)->set_name(big);
                  if (field == 2) r.set_metrics_address(wide);
                }).ok());
    v1::ListWorkersRequest req;
    v1::ListWorkersResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(cluster_->ListWorkers(&ctx, req, &resp).ok());
    EXPECT_LT(resp.ByteSizeLong(), 8192u);
    EXPECT_TRUE(IsValidUtf8(resp.workers(0).metrics_address()));
  }
  RawSession w1(cluster_.get(), "w1", "i1");
  auto id = Submit(Spec());
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitFor([&] { return !w1.Assignments().empty(); }));
  // The rendezvous: a 4 MB key, a 4 MB job id in the scope.
  {
    const v1::Assignment a = w1.Assignments()[0];
    for (int field = 0; field < 2; ++field) {
      v1::SetRequest set;
      set.mutable_scope()->set_job_id(field == 1 ? big : a.ref().job_id());
      set.mutable_scope()->set_attempt(a.ref().attempt());
      set.mutable_scope()->set_token(a.rendezvous_token());
      set.set_key(field == 0 ? big : "k");
      set.set_value("v");
      v1::SetResponse resp;
      grpc::ClientContext ctx;
      const grpc::Status st = rendezvous_->Set(&ctx, set, &resp);
      EXPECT_EQ(st.error_code(), field == 0 ? grpc::StatusCode::INVALID_ARGUMENT
                                            : grpc::StatusCode::FAILED_PRECONDITION);
      EXPECT_LT(st.error_message().size(), 300u);
    }
    v1::GetRequest get;
    get.mutable_scope()->set_job_id(a.ref().job_id());
    get.mutable_scope()->set_attempt(a.ref().attempt());
    get.mutable_scope()->set_token(a.rendezvous_token());
    get.set_key(big);
    v1::GetResponse resp;
    grpc::ClientContext ctx;
    EXPECT_EQ(rendezvous_->Get(&ctx, get, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  auto ref = [&](v1::RankRef* r) {
    r->set_job_id(*id);
    r->set_attempt(1);
    r->set_rank(0);
  };
  {
    v1::WorkerMessage m;
    ref(m.mutable_rank_started()->mutable_ref());
    ASSERT_TRUE(w1.Write(m));
  }
  {
    v1::WorkerMessage m;
    ref(m.mutable_note()->mutable_ref());
    m.mutable_note()->set_text(wide);
    ASSERT_TRUE(w1.Write(m));
  }
  {
    v1::WorkerMessage m;
    ref(m.mutable_checkpoint_done()->mutable_ref());
    m.mutable_checkpoint_done()->set_step(5);
    m.mutable_checkpoint_done()->set_path(wide);
    ASSERT_TRUE(w1.Write(m));
  }
  {
    v1::WorkerMessage m;
    v1::Heartbeat* h = m.mutable_heartbeat();
    h->set_seq(1);
    AddRunning(h, big, 1, 0);
    ASSERT_TRUE(w1.Write(m));
  }
  {
    v1::WorkerMessage m;
    ref(m.mutable_rank_exit()->mutable_ref());
    m.mutable_rank_exit()->set_exit_code(1);
    for (int i = 0; i < 50; ++i) m.mutable_rank_exit()->add_stderr_tail("line");
    m.mutable_rank_exit()->add_stderr_tail(wide.substr(0, 3 << 20));
    ASSERT_TRUE(w1.Write(m));
  }
  // The rank's exit restarts the job; the next attempt's assignment carries the checkpoint.
  ASSERT_TRUE(WaitFor([&] { return w1.Assignments().size() >= 2; })) << Get(*id).message();
  const v1::Assignment second = w1.Assignments()[1];
  EXPECT_LE(second.resume_path().size(), kMaxPathBytes);
  EXPECT_TRUE(IsValidUtf8(second.resume_path()));
  EXPECT_LT(second.ByteSizeLong(), 16384u);
  {
    v1::WorkerMessage m;
    m.mutable_leaving()->set_reason(big);
    ASSERT_TRUE(w1.Write(m));
  }
  ASSERT_TRUE(WaitFor([&] { return Get(*id).attempt() == 2 && Get(*id).restarts() >= 2; }))
      << Get(*id).message();
  // Cancel with a 4 MB reason.
  {
    v1::CancelJobRequest req;
    req.set_job_id(*id);
    req.set_reason(wide);
    v1::CancelJobResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(jobs_->Cancel(&ctx, req, &resp).ok());
    EXPECT_LT(resp.ByteSizeLong(), 65536u);
  }
  const v1::Job job = Get(*id, 1000);
  EXPECT_EQ(job.state(), v1::JOB_STATE_CANCELLED);
  EXPECT_LT(job.ByteSizeLong(), 65536u);
  EXPECT_LE(job.message().size(), kMaxReasonBytes + 16);
  EXPECT_TRUE(IsValidUtf8(job.message()));
  EXPECT_LE(job.last_checkpoint_path().size(), kMaxPathBytes);
  bool note = false;
  for (const v1::JobEvent& e : job.events()) {
    EXPECT_TRUE(IsValidUtf8(e.message()));
    EXPECT_LE(e.message().size(), kMaxPathBytes + 256);
    note |= e.message().rfind("rank 0: \xC3\xA9", 0) == 0;
  }
  EXPECT_TRUE(note);
}

TEST_F(HostilePeersTest, JobEventsAreBoundedAndPaged) {
  Start();
  ASSERT_TRUE(Register("w1", "i1").ok());
  RawSession w1(cluster_.get(), "w1", "i1");
  auto id = Submit(Spec());
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitFor([&] { return !w1.Assignments().empty(); }));
  for (int i = 0; i < 1100; ++i) {
    v1::WorkerMessage m;
    m.mutable_note()->mutable_ref()->set_job_id(*id);
    m.mutable_note()->mutable_ref()->set_attempt(1);
    m.mutable_note()->set_text(absl::StrCat("note ", i));
    ASSERT_TRUE(w1.Write(m));
  }
  ASSERT_TRUE(w1.Heartbeat(1));
  ASSERT_TRUE(WaitFor([&] {
    const v1::Job j = Get(*id, 1000);
    return j.events_size() > 0 && j.events(j.events_size() - 1).message() == "rank 0: note 1099";
  }));
  // The newest 1,000 are kept; pages of 300 walk them in order.
  std::vector<std::string> all;
  std::string token;
  for (int page = 0; page < 10; ++page) {
    const v1::Job j = Get(*id, 300, token);
    EXPECT_LE(j.events_size(), 300);
    for (const v1::JobEvent& e : j.events()) all.push_back(e.message());
    token = j.next_events_page_token();
    if (token.empty()) break;
  }
  ASSERT_EQ(all.size(), 1000u);
  EXPECT_EQ(all.back(), "rank 0: note 1099");
  EXPECT_EQ(all.front(), "rank 0: note 100");
  // The default page is 100.
  EXPECT_EQ(Get(*id).events_size(), 100);
}

TEST_F(HostilePeersTest, WorkerThatDoesNotReadIsDisconnected) {
  Start([](CoordinatorConfig& c) {
    c.limits.max_session_outbound = 64;
    c.limits.stream_write_timeout_ms = 1000;
  });
  ASSERT_TRUE(Register("w1", "i1").ok());
  RawSession w1(cluster_.get(), "w1", "i1", /*read=*/false);
  // Heartbeats as fast as the stream takes them, never reading their acknowledgements.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  int64_t seq = 0;
  while (std::chrono::steady_clock::now() < until && w1.Heartbeat(++seq)) {
  }
  EXPECT_LT(std::chrono::steady_clock::now(), until) << "still connected after " << seq;
  // Its id is free for its next, well-behaved session.
  RawSession again(cluster_.get(), "w1", "i1");
  ASSERT_TRUE(again.Heartbeat(1));
  EXPECT_TRUE(WaitFor([&] { return again.Acked(1); }));
}

TEST_F(HostilePeersTest, ThreeHundredWatchersThatNeverReadAreBoundedInCountAndTime) {
  Start([](CoordinatorConfig& c) {
    c.limits.max_watch_streams = 100;
    c.limits.stream_write_timeout_ms = 4000;
  });
  ASSERT_TRUE(Register("w1", "i1").ok());
  RawSession w1(cluster_.get(), "w1", "i1");
  auto id = Submit(Spec());
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitFor([&] { return !w1.Assignments().empty(); }));
  // Events enough that a watch's first update (every event) is larger than what a client that
  // does not read takes in.
  for (int i = 0; i < 300; ++i) {
    v1::WorkerMessage m;
    m.mutable_note()->mutable_ref()->set_job_id(*id);
    m.mutable_note()->mutable_ref()->set_attempt(1);
    m.mutable_note()->set_text(std::string(1900, 'n'));
    ASSERT_TRUE(w1.Write(m));
  }
  ASSERT_TRUE(WaitFor([&] { return Get(*id, 1000).events_size() >= 300; }));
  struct Watcher {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::JobUpdate>> reader;
  };
  auto watch = [&](int deadline_s) {
    auto w = std::make_unique<Watcher>();
    w->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_s));
    v1::WatchJobRequest req;
    req.set_job_id(*id);
    w->reader = jobs_->Watch(&w->ctx, req);
    return w;
  };
  // 300 watchers that never read (their calls stay open on this side until their deadline).
  std::vector<std::unique_ptr<Watcher>> watchers;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 300; ++i) watchers.push_back(watch(8));
  const auto opened = std::chrono::steady_clock::now() - start;
  // Bounded in count: one more is refused while they hold the coordinator's 100 streams.
  {
    std::unique_ptr<Watcher> probe = watch(10);
    v1::JobUpdate u;
    EXPECT_FALSE(probe->reader->Read(&u));
    const grpc::Status st = probe->reader->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  }
  // Bounded in time: past the write timeout the coordinator has ended the streams it could not
  // deliver to, and serves a reader again, while those 300 calls are still open here.
  bool served = false;
  for (int i = 0; i < 40 && !served; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    std::unique_ptr<Watcher> probe = watch(10);
    v1::JobUpdate u;
    if (probe->reader->Read(&u)) {
      served = true;
      EXPECT_GE(u.new_events_size(), 300);
    }
    probe->ctx.TryCancel();
    probe->reader->Finish();
  }
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(served);
  EXPECT_LT(took, std::chrono::seconds(12))
      << "opening the watchers took " << std::chrono::duration<double>(opened).count();
  // Each watcher was refused (it arrived while 100 streams were held; how many depends on when
  // the coordinator's threads took the calls in, some after the first streams were cut off) or
  // ends here at its deadline (a client that does not read never sees the end of its stream).
  int other = 0;
  for (auto& w : watchers) {
    const grpc::StatusCode c = w->reader->Finish().error_code();
    other += c != grpc::StatusCode::RESOURCE_EXHAUSTED &&
             c != grpc::StatusCode::DEADLINE_EXCEEDED && c != grpc::StatusCode::CANCELLED;
  }
  EXPECT_EQ(other, 0);
}

TEST_F(HostilePeersTest, SessionsRendezvousWaitsWorkersAndSlotsAreCapped) {
  Start([](CoordinatorConfig& c) {
    c.limits.max_sessions = 2;
    c.limits.max_rendezvous_waits = 2;
    c.manager.registry.max_workers = 3;
    c.manager.registry.max_slots_per_worker = 8;
  });
  const grpc::Status slots = Register("w0", "i0", 4096);
  EXPECT_EQ(slots.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(slots.error_message(),
            "register: worker w0: device count must be in [1, 8] (--max-worker-slots), got 4096");
  for (const char* w : {"w1", "w2", "w3"}) ASSERT_TRUE(Register(w, w).ok());
  const grpc::Status fourth = Register("w4", "w4");
  EXPECT_EQ(fourth.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(fourth.error_message(),
            "register: worker w4: the coordinator already holds 3 workers, its limit "
            "(--max-workers), and none of them is gone");

  RawSession s1(cluster_.get(), "w1", "w1");
  RawSession s2(cluster_.get(), "w2", "w2");
  ASSERT_TRUE(s1.Heartbeat(1) && s2.Heartbeat(1));
  ASSERT_TRUE(WaitFor([&] { return s1.Acked(1) && s2.Acked(1); }));
  RawSession s3(cluster_.get(), "w3", "w3");
  const grpc::Status third = s3.Finish();
  EXPECT_EQ(third.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(third.error_message(),
            "session: the coordinator already serves 2 worker sessions, its limit "
            "(--max-sessions)");

  // Two Gets wait for a key of the placed attempt; a third is refused at once.
  auto id = Submit(Spec());
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitFor([&] { return !s1.Assignments().empty() || !s2.Assignments().empty(); }));
  const v1::Assignment a = s1.Assignments().empty() ? s2.Assignments()[0] : s1.Assignments()[0];
  auto get = [&](grpc::ClientContext* ctx) {
    v1::GetRequest req;
    req.mutable_scope()->set_job_id(a.ref().job_id());
    req.mutable_scope()->set_attempt(a.ref().attempt());
    req.mutable_scope()->set_token(a.rendezvous_token());
    req.set_key("never");
    req.set_wait_timeout_ms(5000);
    v1::GetResponse resp;
    return rendezvous_->Get(ctx, req, &resp);
  };
  std::atomic<int> waited{0};
  std::vector<std::thread> waiting;
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  for (int i = 0; i < 2; ++i) {
    ctxs.push_back(std::make_unique<grpc::ClientContext>());
    waiting.emplace_back([&, c = ctxs.back().get()] {
      if (get(c).error_code() == grpc::StatusCode::CANCELLED) ++waited;
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  grpc::ClientContext third_get;
  const grpc::Status refused = get(&third_get);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  for (auto& c : ctxs) c->TryCancel();
  for (auto& t : waiting) t.join();
  EXPECT_EQ(waited, 2);
}

// Streams that open and never send their hello count against the sessions' limit from their
// start, and each is ended once it has waited the stream write timeout: a holder of a worker
// credential cannot hold more of the coordinator's threads than the limit, nor hold them for ever.
TEST_F(HostilePeersTest, StreamsThatNeverSayHelloAreCountedAndCutOff) {
  Start([](CoordinatorConfig& c) {
    c.limits.max_sessions = 2;
    c.limits.stream_write_timeout_ms = 8000;
  });
  ASSERT_TRUE(Register("w1", "i1").ok());
  struct Silent {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream;
  };
  std::vector<std::unique_ptr<Silent>> silent;
  for (int i = 0; i < 2; ++i) {
    auto s = std::make_unique<Silent>();
    s->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    s->stream = cluster_->Session(&s->ctx);
    silent.push_back(std::move(s));
  }
  // While they are open, a worker's session with its hello is refused. (The coordinator may take
  // the silent streams in after a first probe: a probe it serves is closed and another tried.)
  grpc::Status refused;
  for (int i = 0; i < 50 && refused.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED; ++i) {
    RawSession probe(cluster_.get(), "w1", "i1");
    probe.Heartbeat(1);  // fails when the stream was refused already
    ASSERT_TRUE(WaitFor([&] { return probe.Ended() || probe.Acked(1); }));
    if (probe.Ended()) refused = probe.Finish();
  }
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_EQ(refused.error_message(),
            "session: the coordinator already serves 2 worker sessions, its limit "
            "(--max-sessions)");
  // Past the write timeout both are ended by the coordinator (not by their own deadline)...
  for (auto& s : silent) {
    v1::CoordinatorMessage m;
    EXPECT_FALSE(s->stream->Read(&m));
    EXPECT_EQ(s->stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // ... and the worker's session opens.
  RawSession w1(cluster_.get(), "w1", "i1");
  ASSERT_TRUE(w1.Heartbeat(1));
  EXPECT_TRUE(WaitFor([&] { return w1.Acked(1); }));
}

TEST_F(HostilePeersTest, AbsurdModelIsInvalidArgumentNamingTheQuantity) {
  Start();
  for (int heads : {1, 16, 1024}) {
    for (int ffn : {176, 65536}) {
      const std::string spec = absl::StrCat(
          R"({"name": "absurd", "model": {"vocab": 32000, "d_model": 65536, "n_layers": 1024, "n_heads": )",
          heads, R"(, "ffn_dim": )", ffn,
          R"(, "mla": {"q_lora_rank": 65536, "kv_lora_rank": 65536, "qk_nope_dim": 65536,
          "qk_rope_dim": 65536, "v_head_dim": 65536}}, "data": {"source": "synthetic:recall"},
          "seq_len": 16777216, "resources": "cuda"})");
      v1::PlanJobRequest req;
      req.set_spec_json(spec);
      v1::PlanJobResponse resp;
      grpc::ClientContext ctx;
      const grpc::Status st = jobs_->Plan(&ctx, req, &resp);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << heads << " heads: " << resp.plan().memory().activations_bytes();
      EXPECT_TRUE(st.error_message().find("job spec: model: its weights") == 0 ||
                  st.error_message().find("job spec: seq_len: the activations") == 0)
          << st.error_message();
      EXPECT_EQ(Submit(spec).status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

TEST_F(HostilePeersTest, NulByteInCheckpointDirIsRefused) {
  Start();
  auto id = Submit(Spec("/tmp/hostile-ck\\u0000/../../etc"));
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(id.status().message(),
            "job spec: checkpoint.dir: must not contain control characters, got byte 0x00 at "
            "offset 15");
  auto data = Submit(absl::StrCat(R"({"name": "h", "model": {"preset": "tiny"},
    "data": {"source": "text:/tmp/a\u001b[2Jb"}, "seq_len": 256})"));
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(data.status().message(),
            "job spec: data.source: must not contain control characters, got byte 0x1b at "
            "offset 11");
}

TEST_F(HostilePeersTest, CliPrintsNoControlCharactersAPeerSent) {
  Start();
  ASSERT_TRUE(Register("w1", "i1", 1, [](v1::RegisterRequest& r) {
                r.set_hostname("evil\x1b]0;pwned\x07host");
              }).ok());
  RawSession w1(cluster_.get(), "w1", "i1");
  auto id = Submit(Spec());
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(WaitFor([&] { return !w1.Assignments().empty(); }));
  v1::WorkerMessage m;
  m.mutable_note()->mutable_ref()->set_job_id(*id);
  m.mutable_note()->mutable_ref()->set_attempt(1);
  m.mutable_note()->set_text(
      "\x1b[2J\x1b[31mall is well\r\nfake line\xC2\x9B"
      "31m");
  ASSERT_TRUE(w1.Write(m));
  ASSERT_TRUE(WaitFor([&] { return Get(*id).events_size() >= 3; }));
  const std::map<std::string, std::string> env = {
      {"SPINDLE_COORDINATOR", absl::StrCat("127.0.0.1:", server_->client_port())}};
  auto run = [&](std::vector<std::string> args, int expected = 0) {
    std::ostringstream out, err;
    const int code = RunCli(args, env, out, err, false);
    EXPECT_EQ(code, expected) << err.str();
    return out.str() + err.str();
  };
  for (const std::string& text :
       {run({"status", *id}), run({"workers"}), run({"cancel", *id, "--reason", "\x1b[1Ahidden"}),
        run({"watch", *id}, kExitJobFailed), run({"status", "j-\x1b[2J"}, kExitNotFound)}) {
    EXPECT_EQ(text.find('\x1b'), std::string::npos) << text;
    EXPECT_EQ(text.find('\x07'), std::string::npos) << text;
    EXPECT_EQ(text.find('\r'), std::string::npos) << text;
    EXPECT_EQ(text.find("\xC2\x9B"), std::string::npos) << text;
  }
  EXPECT_NE(run({"status", *id}).find("rank 0: ?[2J?[31mall is well??fake line?31m"),
            std::string::npos)
      << run({"status", *id});
}

// Every model the spec checks accept plans to sizes that did not wrap: extreme widths, layers,
// heads, sequence lengths and CP degrees, alone and together.
TEST(OverflowModel, EveryAcceptedExtremeSpecPlansToNonNegativeSizes) {
  int accepted = 0, refused = 0;
  for (int64_t d : {64, 65536})
    for (int64_t heads : {1, 32, 1024})
      for (int64_t layers : {1, 1024})
        for (int64_t mla : {16, 65536})
          for (int64_t seq : {int64_t{1} << 12, int64_t{1} << 24})
            for (int64_t cp : {1, 64})
              for (const char* res : {"cpu", "cuda"}) {
                if (d % heads != 0 || (d / heads) % 2 != 0) continue;
                const std::string spec = absl::StrCat(
                    R"({"name": "x", "model": {"vocab": 32000, "d_model": )", d,
                    R"(, "n_layers": )", layers, R"(, "n_heads": )", heads, R"(, "ffn_dim": )",
                    d * 4, R"(, "mla": {"kv_lora_rank": )", mla, R"(, "qk_nope_dim": )", mla,
                    R"(, "qk_rope_dim": )", mla, R"(, "v_head_dim": )", mla,
                    R"(}}, "data": {"source": "synthetic:recall"}, "seq_len": )", seq,
                    R"(, "parallel": {"cp": )", cp,
                    R"(, "lightning_mode": "allgather", "mla_mode": "allgather"}, "resources": ")",
                    res, R"("})");
                absl::StatusOr<JobSpec> parsed = ParseJobSpec(spec);
                if (!parsed.ok()) {
                  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
                  ++refused;
                  continue;
                }
                ++accepted;
                for (int64_t device : {int64_t{0}, int64_t{80} << 30}) {
                  const CpPlan plan = CpPlanner().Plan(*parsed, device);
                  const MemoryEstimate& e = plan.memory;
                  for (int64_t v : {e.params_bytes, e.grads_bytes, e.optimizer_bytes,
                                    e.activations_bytes, e.workspace_bytes, e.runtime_bytes,
                                    e.host_bytes, e.total_bytes, plan.max_seq_len})
                    EXPECT_GE(v, 0) << spec;
                  EXPECT_GE(e.total_bytes, e.activations_bytes) << spec;
                }
              }
  EXPECT_GT(accepted, 30);
  EXPECT_GT(refused, 10);
}

}  // namespace
}  // namespace spindle
