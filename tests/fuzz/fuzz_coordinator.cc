// Fuzz target: the coordinator's RPC handlers in process. Each input is a sequence of calls on a
// fresh coordinator (JobManager over a real SQLite file in a temporary directory, a FakeClock,
// the RendezvousStore) made through the gRPC service classes' handlers with requests parsed from
// fuzzed bytes: JobService Submit, Plan, Get, List, Cancel; ClusterService Register and
// ListWorkers; RendezvousService Set and Get. The streaming RPCs, whose handlers need a live
// stream, are driven through the JobManager calls behind them: Watch as WaitJob bounded to 1 ms
// (the first two waits of an input; later ones do not block), Session as SessionOpened (a fuzzed
// hello), HandleWorkerMessage (fuzzed messages) and SessionClosed. Ticks move the clock (failure
// detection, placement) and a restart reopens the store and recovers from it. No sequence may
// crash, throw or block.
//
// Input: records of [op: 1 byte][length: 2 bytes little-endian][payload: length bytes] (see Op);
// payloads are serialized protos except where Op says otherwise. Every input starts from worker
// "w0" registered with 4 CPU slots and its session open, so fuzzed jobs can be placed.
// Seeds: corpus/fuzz_coordinator/, written by tests/fuzz/make_coordinator_seeds.py.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/clock.h"
#include "coordinator/credentials.h"
#include "coordinator/grpc_services.h"
#include "coordinator/job_manager.h"
#include "coordinator/job_store.h"
#include "coordinator/rendezvous_store.h"
#include "coordinator/sqlite_job_store.h"
#include "coordinator/worker_proto.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/server_context.h"
#include "spindle/v1/cluster.pb.h"
#include "spindle/v1/job.pb.h"
#include "spindle/v1/rendezvous.pb.h"

namespace spindle {
namespace {

enum Op : uint8_t {
  kSubmit = 0,          // SubmitJobRequest
  kSubmitText = 1,      // the payload is spec_json (text), dry_run false
  kPlan = 2,            // PlanJobRequest
  kGet = 3,             // GetJobRequest
  kList = 4,            // ListJobsRequest
  kCancel = 5,          // CancelJobRequest
  kWatch = 6,           // WatchJobRequest: one WaitJob of 1 or 0 ms (see WaitMs)
  kRegister = 7,        // RegisterRequest
  kHello = 8,           // SessionHello: a session opens
  kMessage = 9,         // byte: worker "w<byte % 3>", then a WorkerMessage
  kClose = 10,          // byte: worker "w<byte % 3>" closes its latest session
  kRendezvousSet = 11,  // SetRequest
  kRendezvousGet = 12,  // GetRequest with wait_timeout_ms cut to 1 or 0 (see WaitMs)
  kTick = 13,           // 4 bytes little-endian: ms the clock moves (at most an hour), then Tick()
  kListWorkers = 14,    // no payload
  kRestart = 15,        // no payload: a new manager recovers from the store
  kNumOps = 16,
};

// Accepts every message; the manager's sends go nowhere.
class DropChannel : public WorkerChannel {
 public:
  bool Send(const std::string&, const WorkerCommand&) override { return true; }
};

std::string g_dir;

void RemoveDir() { std::filesystem::remove_all(std::filesystem::path(g_dir).parent_path()); }

// copy_file, retried when a signal interrupts it (libFuzzer's -timeout sends SIGALRM each second).
void CopyFile(const std::string& from, const std::string& to) {
  for (int tries = 0; tries < 100; ++tries) {
    std::error_code ec;
    std::filesystem::remove(to, ec);
    if (std::filesystem::copy_file(from, to, ec)) return;
    if (ec != std::errc::interrupted) std::abort();
  }
  std::abort();
}

// The store every input starts from: migrated, worker "w0" registered (written once by
// LLVMFuzzerInitialize and copied for each input, which is much faster than migrating).
std::string g_template;

class Coordinator {
 public:
  // A coordinator over a copy of g_template, or over a fresh store that becomes the template.
  explicit Coordinator(bool from_template = true) {
    if (from_template) CopyFile(g_template, g_dir + "/c.db");
    auto store = SqliteJobStore::Open(g_dir + "/c.db");
    if (!store.ok()) std::abort();
    store_ = std::move(*store);
    Start();
    v1::SessionHello hello;
    hello.set_worker_id("w0");
    if (from_template) {
      if (!manager_->SessionOpened(HelloFromProto(hello), ++session_).ok()) std::abort();
      return;
    }
    v1::RegisterRequest reg;
    reg.set_worker_id("w0");
    reg.set_hostname("h0");
    v1::DeviceGroup* d = reg.add_devices();
    d->set_kind("cpu");
    d->set_count(4);
    d->set_memory_bytes(int64_t{8} << 30);
    if (!manager_->RegisterWorker(RegistrationFromProto(reg, "127.0.0.1")).ok()) std::abort();
  }
  ~Coordinator() {
    manager_.reset();
    store_.reset();
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(g_dir, ec))
      std::filesystem::remove_all(e.path(), ec);
  }

  // Closes the store (SQLite folds its write-ahead log into the file) and moves it to `path`.
  void CloseAndMoveStore(const std::string& path) {
    manager_.reset();
    store_.reset();
    std::filesystem::rename(g_dir + "/c.db", path);
  }

  void Run(uint8_t op, std::string_view payload) {
    grpc::ServerContext ctx;
    const std::string bytes(payload);
    switch (op % kNumOps) {
      case kSubmit: {
        v1::SubmitJobRequest req;
        v1::SubmitJobResponse resp;
        if (req.ParseFromString(bytes)) jobs_->Submit(&ctx, &req, &resp);
        break;
      }
      case kSubmitText: {
        v1::SubmitJobRequest req;
        v1::SubmitJobResponse resp;
        req.set_spec_json(bytes);
        jobs_->Submit(&ctx, &req, &resp);
        break;
      }
      case kPlan: {
        v1::PlanJobRequest req;
        v1::PlanJobResponse resp;
        if (req.ParseFromString(bytes)) jobs_->Plan(&ctx, &req, &resp);
        break;
      }
      case kGet: {
        v1::GetJobRequest req;
        v1::Job resp;
        if (req.ParseFromString(bytes)) jobs_->Get(&ctx, &req, &resp);
        break;
      }
      case kList: {
        v1::ListJobsRequest req;
        v1::ListJobsResponse resp;
        if (req.ParseFromString(bytes)) jobs_->List(&ctx, &req, &resp);
        break;
      }
      case kCancel: {
        v1::CancelJobRequest req;
        v1::CancelJobResponse resp;
        if (req.ParseFromString(bytes)) jobs_->Cancel(&ctx, &req, &resp);
        break;
      }
      case kWatch: {
        v1::WatchJobRequest req;
        if (!req.ParseFromString(bytes)) break;
        JobView job;
        std::vector<EventRecord> events;
        manager_
            ->WaitJob(req.job_id(), &watch_version_, &watch_events_,
                      absl::Milliseconds(WaitMs(req.min_interval_ms())), &job, &events)
            .IgnoreError();
        break;
      }
      case kRegister: {
        v1::RegisterRequest req;
        v1::RegisterResponse resp;
        if (req.ParseFromString(bytes)) cluster_->Register(&ctx, &req, &resp);
        break;
      }
      case kHello: {
        v1::SessionHello hello;
        if (hello.ParseFromString(bytes))
          manager_->SessionOpened(HelloFromProto(hello), ++session_).IgnoreError();
        break;
      }
      case kMessage: {
        if (bytes.empty()) break;
        v1::WorkerMessage msg;
        std::optional<WorkerReport> report;
        if (msg.ParseFromString(bytes.substr(1)) && (report = ReportFromProto(msg)))
          manager_->HandleWorkerMessage(WorkerId(bytes[0]), *report);
        break;
      }
      case kClose:
        if (!bytes.empty()) manager_->SessionClosed(WorkerId(bytes[0]), session_);
        break;
      case kRendezvousSet: {
        v1::SetRequest req;
        v1::SetResponse resp;
        if (req.ParseFromString(bytes)) rendezvous_->Set(&ctx, &req, &resp);
        break;
      }
      case kRendezvousGet: {
        v1::GetRequest req;
        v1::GetResponse resp;
        if (!req.ParseFromString(bytes)) break;
        req.set_wait_timeout_ms(WaitMs(req.wait_timeout_ms()));
        rendezvous_->Get(&ctx, &req, &resp);
        break;
      }
      case kTick: {
        uint32_t ms = 0;
        for (size_t i = 0; i < 4 && i < bytes.size(); ++i)
          ms |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
        clock_.AdvanceMs(ms % 3'600'000);
        manager_->Tick();
        break;
      }
      case kListWorkers: {
        v1::ListWorkersRequest req;
        v1::ListWorkersResponse resp;
        cluster_->ListWorkers(&ctx, &req, &resp);
        break;
      }
      case kRestart:
        manager_.reset();
        Start();
        break;
    }
  }

 private:
  // The wait a Watch or rendezvous Get may block for: 1 ms for the first two that ask for a
  // positive wait in an input, then none, so an input costs at most 2 ms of sleeping.
  int WaitMs(int64_t asked) {
    if (asked <= 0 || waits_left_ == 0) return 0;
    --waits_left_;
    return 1;
  }
  static std::string WorkerId(char c) { return "w" + std::to_string(static_cast<uint8_t>(c) % 3); }

  void Start() {
    JobManagerOptions o;
    o.heartbeat_timeout_ms = 3000;
    o.hang_timeout_ms = 5000;
    o.start_timeout_ms = 8000;
    o.stop_grace_ms = 1000;
    o.recovery_grace_ms = 4000;
    o.rendezvous_address = "127.0.0.1:1";
    rdv_store_ = std::make_unique<RendezvousStore>();
    manager_ = std::make_unique<JobManager>(store_.get(), &clock_, &channel_, rdv_store_.get(), o);
    if (!manager_->Recover().ok()) std::abort();
    jobs_ = std::make_unique<JobServiceImpl>(manager_.get(), &auth_);
    cluster_ = std::make_unique<ClusterServiceImpl>(manager_.get(), &sessions_, &auth_);
    rendezvous_ = std::make_unique<RendezvousServiceImpl>(rdv_store_.get(), &auth_);
    watch_version_ = 0;
    watch_events_ = 0;
  }

  FakeClock clock_;
  DropChannel channel_;
  SessionRegistry sessions_;
  const Credentials auth_{"", {}};
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<RendezvousStore> rdv_store_;
  std::unique_ptr<JobManager> manager_;
  std::unique_ptr<JobServiceImpl> jobs_;
  std::unique_ptr<ClusterServiceImpl> cluster_;
  std::unique_ptr<RendezvousServiceImpl> rendezvous_;
  uint64_t session_ = 0;
  uint64_t watch_version_ = 0;
  size_t watch_events_ = 0;
  int waits_left_ = 2;
};

}  // namespace
}  // namespace spindle

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::string tmpl =
      (std::filesystem::exists("/dev/shm") ? std::string("/dev/shm") : std::string("/tmp")) +
      "/spindle-fuzz-coordinator-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) std::abort();
  spindle::g_dir = tmpl + "/run";
  spindle::g_template = tmpl + "/template.db";
  std::filesystem::create_directory(spindle::g_dir);
  std::atexit(spindle::RemoveDir);
  // Requests with invalid UTF-8 in string fields are refused by the parser; its log lines would
  // only slow the campaign down.
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  spindle::Coordinator(/*from_template=*/false).CloseAndMoveStore(spindle::g_template);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  spindle::Coordinator c;
  size_t at = 0;
  int calls = 0;
  while (at + 3 <= size && calls++ < 64) {
    const uint8_t op = data[at];
    const size_t len = std::min<size_t>(data[at + 1] | (data[at + 2] << 8), size - at - 3);
    c.Run(op, std::string_view(reinterpret_cast<const char*>(data) + at + 3, len));
    at += 3 + len;
  }
  return 0;
}
