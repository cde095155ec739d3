// Fuzz target: the worker Session stream of the coordinator, through the real streaming handler.
// One coordinator lives across inputs, as a daemon does: a grpc::Server (reached through its
// in-process channel) serving the real ClusterServiceImpl with its SessionRegistry, JobServiceImpl
// and RendezvousServiceImpl over a real JobManager on a SQLite file in a temporary directory, with
// worker tokens (w0..w3 each bound to its own, one cluster-wide) and a users' token, and a
// FakeClock that only the inputs move. Every 256 inputs it is torn down and a fresh one starts on
// an empty store (so jobs and workers do not pile up without end); everything else carries over
// from one input to the next: registered workers, jobs, their attempts, the clock.
//
// Each input is a sequence of at most 48 operations (see Op): register a worker, open a Session
// stream as some worker (a good hello, a wrong instance id, an unregistered or oversized id, no
// hello at all, a token that is missing, a user's or another worker's), write WorkerMessages
// (heartbeats listing real or made-up ranks, rank started/progress/exit/checkpoint-done/note,
// leaving, or any bytes that parse as a WorkerMessage) whose fields are chosen from real
// assignments, extreme numbers, long, non-UTF-8 or control-character strings, pause and resume
// reading, half-close, cancel, submit and cancel small jobs, and move the clock and Tick. Every
// stream is read by a thread of its own, and every wait on the server is bounded.
//
// Checked after each operation and input (a broken one aborts, naming what broke):
//  - every message the coordinator sends is within the gRPC message limit; heartbeat acks repeat
//    the heartbeats' seqs in order (a prefix of those sent); assignments name an existing job, an
//    attempt >= 1, a rank inside the world and a slot of the worker; stops carry bounded UTF-8;
//  - a stream without the right worker credential, without a hello first, or naming a worker
//    never registered is refused with the matching code and receives nothing;
//  - a synchronising heartbeat is acknowledged or its stream ends within 5 s (no stream blocks);
//    a half-closed stream ends within 5 s;
//  - after every stream of a worker but one has ended, the one left (acknowledged) is the
//    worker's session: ListWorkers shows it alive (or leaving);
//  - ListWorkers answers within 5 s and names only workers that registered, with used slots
//    within their slots; every job is in a valid state, with restarts <= max_restarts and a
//    placed gang on registered workers; Get with events answers for the jobs the input touched;
//  - once every stream of the input is closed, no worker stays alive: every session handler
//    ended and told the job manager.
//
// libFuzzer's own leak check after each input is off unless asked for (LLVMFuzzerInitialize says
// why). An input whose failure depends on what earlier inputs left in the coordinator may not
// fail again alone; the target's checks name what broke either way.
//
// Input: bytes read front to back by Input (a byte or a little-endian integer; 0 past the end);
// the first byte of each operation picks it (modulo kNumOps), its arguments follow.
// Seeds: corpus/fuzz_session/, written by tests/fuzz/make_seeds.py.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/message_limits.h"
#include "common/text_bounds.h"
#include "coordinator/clock.h"
#include "coordinator/credentials.h"
#include "coordinator/grpc_services.h"
#include "coordinator/job_manager.h"
#include "coordinator/rendezvous_store.h"
#include "coordinator/service_limits.h"
#include "coordinator/sqlite_job_store.h"
#include "planner/plan_proto.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/client_context.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"
#include "nlohmann/json.hpp"
#include "spindle/v1/cluster.grpc.pb.h"
#include "spindle/v1/job.grpc.pb.h"

namespace spindle {
namespace {

constexpr int kWorkerIds = 4;     // w0..w3
constexpr int kStreamSlots = 6;   // streams one input holds at once
constexpr int kMaxOps = 48;       // operations per input
constexpr int kResetEvery = 256;  // inputs between fresh coordinators
constexpr int kMaxSubmits = 2;    // jobs one input may submit
constexpr int kKeptAssignments = 16;
// Every wait on the coordinator: a reply, an ack, the end of a stream.
constexpr absl::Duration kBound = absl::Seconds(5);

[[noreturn]] void Broken(const std::string& what) {
  std::fprintf(stderr, "fuzz_session: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}
#define EXPECT_OR_ABORT(cond, ...)                               \
  do {                                                           \
    if (!(cond)) Broken(absl::StrCat(#cond, ": ", __VA_ARGS__)); \
  } while (0)

std::string WorkerId(int i) { return absl::StrCat("w", i); }
std::string TokenOf(int i) { return absl::StrCat("tok-w", i); }
constexpr char kClusterToken[] = "tok-cluster";
constexpr char kUserToken[] = "tok-user";

// Reads an input front to back; 0 past its end.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool done() const { return at_ >= size_; }
  uint8_t U8() { return at_ < size_ ? data_[at_++] : 0; }
  // Little-endian; the bytes are read in order (one statement each).
  uint16_t U16() {
    const uint16_t low = U8();
    return static_cast<uint16_t>(low | (U8() << 8));
  }
  uint32_t U32() {
    const uint32_t low = U16();
    return low | (static_cast<uint32_t>(U16()) << 16);
  }
  uint64_t U64() {
    const uint64_t low = U32();
    return low | (static_cast<uint64_t>(U32()) << 32);
  }
  std::string Bytes(size_t n) {
    n = std::min(n, size_ - std::min(at_, size_));
    std::string s(reinterpret_cast<const char*>(data_) + at_, n);
    at_ += n;
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

// A string a worker might send: empty, short, at and past the bounds, huge, not UTF-8, control
// characters, or bytes from the input.
std::string FuzzString(Input& in) {
  switch (in.U8() % 12) {
    case 0:
      return "";
    case 1:
      return "x";
    case 2:
      return "/tmp/fuzz-session/step_00000005";
    case 3:
      return "\xff\xfe not UTF-8 \xc3";
    case 4:
      return std::string(kMaxNoteBytes - 1, 'a') + "\xc3\xa9";  // a character cut by the bound
    case 5:
      return std::string(70000, 'b');
    case 6:
      return std::string(1 << 20, 'c');
    case 7:  // past the gRPC message limit: the coordinator refuses the message, and no more
      return (in.U8() == 0xff) ? std::string((8 << 20) + 16, 'd') : std::string(300, 'd');
    case 8:
      return "\x1b[2J\r\n\t\x7f\xc2\x9b escape";
    case 9:
      return std::string("nul\0inside", 10);
    default:
      return in.Bytes(in.U8());
  }
}

int64_t FuzzInt(Input& in, int64_t real = 1) {
  switch (in.U8() % 10) {
    case 0:
      return 0;
    case 1:
      return 1;
    case 2:
      return -1;
    case 3:
      return std::numeric_limits<int64_t>::max();
    case 4:
      return std::numeric_limits<int64_t>::min();
    case 5:
      return in.U8();
    case 6:
      return static_cast<int64_t>(in.U32());
    case 7:
      return static_cast<int64_t>(in.U64());
    case 8:
      return real + 1;
    default:
      return real;
  }
}

double FuzzDouble(Input& in) {
  switch (in.U8() % 9) {
    case 0:
      return 0;
    case 1:
      return std::nan("");
    case 2:
      return std::numeric_limits<double>::infinity();
    case 3:
      return -std::numeric_limits<double>::infinity();
    case 4:
      return 1e308;
    case 5:
      return -0.0;
    case 6:
      return std::numeric_limits<double>::denorm_min();
    case 7:
      return -1.5;
    default:
      return in.U8() / 16.0;
  }
}

// An assignment a stream received (what real rank references are made from).
struct Assigned {
  std::string job_id;
  int64_t attempt = 0;
  int64_t rank = 0;
  int64_t world = 0;
};

// The coordinator under test, built once per kResetEvery inputs.
class Daemon {
 public:
  explicit Daemon(const std::string& dir) : dir_(dir) {
    SqliteJobStore::RemoveFiles(DbPath());
    auto store = SqliteJobStore::Open(DbPath());
    if (!store.ok()) Broken(absl::StrCat("store: ", store.status().ToString()));
    store_ = std::move(*store);
    std::vector<WorkerToken> tokens = {{"", kClusterToken}};
    for (int i = 0; i < kWorkerIds; ++i) tokens.push_back({WorkerId(i), TokenOf(i)});
    auth_ = std::make_unique<Credentials>(kUserToken, tokens);
    JobManagerOptions o;
    o.heartbeat_interval_ms = 500;
    o.heartbeat_timeout_ms = 3000;
    o.hang_timeout_ms = 5000;
    o.silence_timeout_ms = 2000;
    o.start_timeout_ms = 8000;
    o.stop_grace_ms = 1000;
    o.recovery_grace_ms = 4000;
    o.rendezvous_address = "127.0.0.1:1";
    manager_ = std::make_unique<JobManager>(store_.get(), &clock_, &sessions_, &rendezvous_, o);
    if (!manager_->Recover().ok()) Broken("recover");
    // Small queues, few sessions and a short write timeout, so that an input reaches every limit:
    // a reader that pauses fills the outbound queue (through the in-process transport a server's
    // Write completes only once the client reads) and is cut off after 250 ms, a sixth open
    // stream exceeds the sessions.
    ServiceLimits limits;
    limits.max_sessions = 5;
    limits.max_session_outbound = 16;
    limits.max_session_inbound = 16;
    limits.stream_write_timeout_ms = 250;
    jobs_ = std::make_unique<JobServiceImpl>(manager_.get(), auth_.get(), limits);
    cluster_ = std::make_unique<ClusterServiceImpl>(manager_.get(), &sessions_, auth_.get(),
                                                    /*accepts_workers=*/true, limits);
    rdv_ = std::make_unique<RendezvousServiceImpl>(&rendezvous_, auth_.get(), limits);
    grpc::ServerBuilder b;
    b.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
    b.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
    b.RegisterService(jobs_.get());
    b.RegisterService(cluster_.get());
    b.RegisterService(rdv_.get());
    server_ = b.BuildAndStart();
    if (!server_) Broken("server did not start");
    // The client takes anything up to 64 MiB, so that an oversized message from the server
    // would be seen rather than refused by the client.
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    channel_ = server_->InProcessChannel(args);
    cluster_stub_ = v1::ClusterService::NewStub(channel_);
    job_stub_ = v1::JobService::NewStub(channel_);
  }
  ~Daemon() {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    server_->Wait();
    sessions_.CloseAll();
    server_.reset();
    rdv_.reset();
    cluster_.reset();
    jobs_.reset();
    manager_.reset();
    store_.reset();
    SqliteJobStore::RemoveFiles(DbPath());
  }

  std::string DbPath() const { return dir_ + "/session.db"; }
  FakeClock& clock() { return clock_; }
  JobManager& manager() { return *manager_; }
  v1::ClusterService::Stub* cluster() { return cluster_stub_.get(); }
  v1::JobService::Stub* jobs() { return job_stub_.get(); }

 private:
  const std::string dir_;
  FakeClock clock_;
  std::unique_ptr<JobStore> store_;
  RendezvousStore rendezvous_;
  SessionRegistry sessions_;
  std::unique_ptr<Credentials> auth_;
  std::unique_ptr<JobManager> manager_;
  std::unique_ptr<JobServiceImpl> jobs_;
  std::unique_ptr<ClusterServiceImpl> cluster_;
  std::unique_ptr<RendezvousServiceImpl> rdv_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ClusterService::Stub> cluster_stub_;
  std::unique_ptr<v1::JobService::Stub> job_stub_;
};

void Bearer(grpc::ClientContext* ctx, const std::string& token) {
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
}

std::chrono::system_clock::time_point Deadline(absl::Duration d = kBound) {
  return absl::ToChronoTime(absl::Now() + d);
}

// What a client expects of a stream from how it opened it.
enum class Opening {
  kGoodHello,      // the worker's credential and a hello naming it
  kBadCredential,  // no token, a user's token, or another worker's
  kNoHello,        // the first message is not a hello
  kNothing,        // the stream half-closes before its first message
  kUnregistered,   // a hello naming a worker that never registered (or no worker)
  kOversizedId,    // a worker id past kMaxIdBytes
  kWrongInstance,  // an instance id other than the one the worker registered with
};

// One Session stream from the worker side, read by a thread of its own.
class Stream {
 public:
  Stream(v1::ClusterService::Stub* stub, const std::string& token, std::string worker_id,
         Opening opening)
      : worker_id_(std::move(worker_id)), opening_(opening) {
    Bearer(&ctx_, token);
    // A last resort only: every wait of the target is bounded well below it.
    ctx_.set_deadline(Deadline(absl::Seconds(120)));
    stream_ = stub->Session(&ctx_);
    reader_ = std::thread([this] { Read(); });
  }
  ~Stream() { Close(); }

  const std::string& worker_id() const { return worker_id_; }
  Opening opening() const { return opening_; }

  // Writes `m`; a heartbeat after the first message is expected to be acknowledged.
  bool Write(const v1::WorkerMessage& m) {
    if (half_closed_) return false;
    const bool counted = first_written_ && m.has_heartbeat();
    if (counted) {
      absl::MutexLock l(&mu_);
      sent_seqs_.push_back(m.heartbeat().seq());
    }
    // A message the server cannot take (a string that is not UTF-8, more than the message
    // limit) ends the stream where it arrives.
    v1::WorkerMessage copy;
    const bool readable = m.ByteSizeLong() <= static_cast<size_t>(kMaxGrpcMessageBytes) &&
                          copy.ParseFromString(m.SerializeAsString());
    if (!first_written_) first_unreadable_ = !readable;
    first_written_ = true;
    // A failed write stays counted: its ack may come or not, the acks remain a prefix.
    return stream_->Write(m);
  }
  bool half_closed() const { return half_closed_; }
  void HalfClose() {
    if (half_closed_) return;
    half_closed_ = true;
    stream_->WritesDone();
  }
  void Pause(bool paused) {
    absl::MutexLock l(&mu_);
    paused_ = paused;
  }
  // Waits (bounded) until the ack of the last heartbeat written arrives or the stream ends.
  // True when acknowledged.
  bool WaitAcked() {
    absl::MutexLock l(&mu_);
    paused_ = false;
    const size_t want = sent_seqs_.size();
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ended_ || acked_ >= want; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&done), kBound))
      Broken(absl::StrCat("a heartbeat of worker ", worker_id_, "'s stream was neither ",
                          "acknowledged nor its stream ended within ", absl::FormatDuration(kBound),
                          " (", acked_, " of ", want, " acked)"));
    if (acked_ >= want && want > 0) ever_acked_ = true;
    return acked_ >= want && want > 0;
  }
  bool WaitEnded(absl::Duration d) {
    absl::MutexLock l(&mu_);
    paused_ = false;
    return mu_.AwaitWithTimeout(absl::Condition(&ended_), d);
  }
  bool ended() {
    absl::MutexLock l(&mu_);
    return ended_;
  }
  bool ever_acked() const { return ever_acked_; }
  bool first_unreadable() const { return first_unreadable_; }
  // Messages received since the last call.
  std::vector<v1::CoordinatorMessage> TakeNew() {
    absl::MutexLock l(&mu_);
    std::vector<v1::CoordinatorMessage> out;
    out.swap(fresh_);
    return out;
  }
  int64_t received() {
    absl::MutexLock l(&mu_);
    return received_;
  }
  // Cancels (unless ended), joins the reader and returns the stream's status.
  grpc::Status Close() {
    if (closed_) return status_;
    closed_ = true;
    if (!ended()) ctx_.TryCancel();
    {
      absl::MutexLock l(&mu_);
      paused_ = false;
    }
    reader_.join();
    status_ = stream_->Finish();
    return status_;
  }

 private:
  void Read() {
    v1::CoordinatorMessage m;
    for (;;) {
      {
        absl::MutexLock l(&mu_);
        auto go = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !paused_; };
        mu_.Await(absl::Condition(&go));
      }
      if (!stream_->Read(&m)) break;
      // The client accepts up to 64 MiB: what the server sent must be within its own limit.
      const size_t bytes = m.ByteSizeLong();
      if (bytes > static_cast<size_t>(kMaxGrpcMessageBytes))
        Broken(absl::StrCat("the coordinator sent a message of ", bytes, " bytes"));
      absl::MutexLock l(&mu_);
      ++received_;
      if (m.has_heartbeat_ack()) {
        if (acked_ >= sent_seqs_.size() || sent_seqs_[acked_] != m.heartbeat_ack().seq())
          Broken(absl::StrCat("worker ", worker_id_, "'s stream: ack ", acked_, " is seq ",
                              m.heartbeat_ack().seq(), ", heartbeats sent: ", sent_seqs_.size(),
                              acked_ < sent_seqs_.size()
                                  ? absl::StrCat(", expected seq ", sent_seqs_[acked_])
                                  : std::string()));
        ++acked_;
      } else {
        fresh_.push_back(m);
      }
    }
    absl::MutexLock l(&mu_);
    ended_ = true;
  }

  const std::string worker_id_;
  const Opening opening_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream_;
  std::thread reader_;
  bool first_written_ = false;  // writer thread (the target's) only
  bool first_unreadable_ = false;
  bool half_closed_ = false;
  bool closed_ = false;
  bool ever_acked_ = false;
  grpc::Status status_;
  absl::Mutex mu_;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<int64_t> sent_seqs_ ABSL_GUARDED_BY(mu_);
  size_t acked_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t received_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<v1::CoordinatorMessage> fresh_ ABSL_GUARDED_BY(mu_);
};

// What the target knows of the coordinator, across inputs (until a reset).
struct Knowledge {
  std::set<std::string> registered;             // ids whose Register succeeded
  std::map<std::string, int32_t> slots;         // the most slots each registered with
  std::map<std::string, std::string> instance;  // the instance id each last registered with
  std::deque<Assigned> assigned;                // the latest assignments received
  int64_t jobs_submitted = 0;
  int64_t seq = 0;  // heartbeat seqs
};

enum Op : uint8_t {
  kRegister = 0,    // worker, variant, slots
  kOpen = 1,        // slot, worker, variant, then hello's running list
  kHeartbeat = 2,   // slot, running list
  kStarted = 3,     // slot, ref
  kProgress = 4,    // slot, ref, numbers
  kExit = 5,        // slot, ref, code, signal, tail
  kCheckpoint = 6,  // slot, ref, step, path
  kNote = 7,        // slot, ref, text
  kLeaving = 8,     // slot, reason
  kRaw = 9,         // slot, length (u16), bytes parsed as a WorkerMessage
  kSync = 10,       // slot: a heartbeat, then its ack or the stream's end
  kPause = 11,      // slot: the reader stops reading
  kResume = 12,     // slot: it reads again
  kHalfClose = 13,  // slot: WritesDone, then the stream must end
  kCancel = 14,     // slot: the worker cancels the stream
  kSubmit = 15,     // cp, dp, steps, max_restarts
  kTick = 16,       // how far the clock moves, then Tick()
  kCancelJob = 17,  // which job
  kNumOps = 18,
};

class Session {
 public:
  Session(Daemon& d, Knowledge& k) : d_(d), k_(k) {}

  void Run(Input& in) {
    for (int ops = 0; ops < kMaxOps && !in.done(); ++ops) Do(in);
    Finish();
  }

 private:
  void Do(Input& in) {
    const uint8_t op = in.U8() % kNumOps;
    switch (op) {
      case kRegister:
        Register(in);
        break;
      case kOpen:
        Open(in);
        break;
      case kSubmit:
        Submit(in);
        break;
      case kTick:
        Tick(in);
        break;
      case kCancelJob:
        CancelJob(in);
        break;
      default: {
        std::unique_ptr<Stream>& s = streams_[in.U8() % kStreamSlots];
        if (s == nullptr) break;
        if (op == kCancel) {
          Close(&s);
          break;
        }
        OnStream(op, *s, in);
        Absorb(*s);
      }
    }
  }

  // --- Operations ---------------------------------------------------------------------------

  void Register(Input& in) {
    const int w = in.U8() % kWorkerIds;
    const uint8_t variant = in.U8();
    const int32_t slots = static_cast<int32_t>(in.U8() % 6);  // 0: refused
    const std::string token = WorkerToken(w, variant & 3);
    v1::RegisterRequest req;
    req.set_worker_id(WorkerId(w));
    req.set_hostname((variant & 4) ? "other-host" : "host");
    req.set_instance_id((variant & 8) ? "" : ((variant & 16) ? "i-b" : "i-a"));
    req.set_advertise_host((variant & 32) ? "10.0.0.7" : "127.0.0.1");
    v1::DeviceGroup* g = req.add_devices();
    g->set_kind((variant & 64) ? "cuda" : "cpu");
    g->set_count(slots);
    g->set_memory_bytes(int64_t{8} << 30);
    if (variant & 128) *req.add_devices() = *g;  // two groups of one kind
    grpc::ClientContext ctx;
    Bearer(&ctx, token);
    ctx.set_deadline(Deadline());
    v1::RegisterResponse resp;
    const grpc::Status st = d_.cluster()->Register(&ctx, req, &resp);
    EXPECT_OR_ABORT(st.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED,
                    "Register did not answer within ", absl::FormatDuration(kBound));
    if (!GoodToken(w, variant & 3))
      EXPECT_OR_ABORT(!st.ok(), "Register of ", WorkerId(w), " with token \"", token,
                      "\" was accepted");
    if (!st.ok()) return;
    k_.registered.insert(WorkerId(w));
    k_.slots[WorkerId(w)] = std::max(k_.slots[WorkerId(w)], slots);
    if (!req.instance_id().empty()) k_.instance[WorkerId(w)] = req.instance_id();
  }

  void Open(Input& in) {
    const int slot = in.U8() % kStreamSlots;
    const int w = in.U8() % kWorkerIds;
    const uint8_t variant = in.U8();
    const uint8_t token_choice = (variant & 7) < 5 ? 0 : (variant & 3);  // mostly the right one
    std::string id = WorkerId(w);
    Opening opening = GoodToken(w, token_choice) ? Opening::kGoodHello : Opening::kBadCredential;
    std::string instance = k_.instance.count(id) ? k_.instance[id] : "i-a";
    bool hello = true;
    switch ((variant >> 3) % 10) {
      case 0:
        hello = false;
        Demote(&opening, Opening::kNoHello);
        break;
      case 1:
        Demote(&opening, Opening::kNothing);
        break;
      case 2:
        instance = "i-wrong";
        // Refused only when the worker registered with an instance id (one without binds none).
        if (k_.instance.count(id)) Demote(&opening, Opening::kWrongInstance);
        break;
      case 3:
        id = std::string(kMaxIdBytes + 1, 'w');
        Demote(&opening, Opening::kOversizedId);
        break;
      case 4:
        id = "";
        Demote(&opening, Opening::kUnregistered);
        break;
      default:
        break;
    }
    if (opening == Opening::kGoodHello && !k_.registered.count(id))
      opening = Opening::kUnregistered;
    v1::WorkerMessage first;
    if (hello) {
      v1::SessionHello* h = first.mutable_hello();
      h->set_worker_id(id);
      h->set_instance_id(instance);
      AddRunning(in, h->mutable_running());
    } else {
      first.mutable_heartbeat()->set_seq(++k_.seq);
    }
    Close(&streams_[slot]);  // a stream already in the slot is cancelled first
    auto s = std::make_unique<Stream>(d_.cluster(), WorkerToken(w, token_choice), id, opening);
    if (opening == Opening::kNothing) {
      s->HalfClose();
    } else {
      s->Write(first);
      // Half the openings are synchronised (a heartbeat, then its ack or the stream's end); the
      // others leave the handler running while the next operations come.
      if (variant & 128) Sync(*s);
    }
    streams_[slot] = std::move(s);
  }

  void OnStream(uint8_t op, Stream& s, Input& in) {
    v1::WorkerMessage m;
    switch (op) {
      case kHeartbeat: {
        v1::Heartbeat* h = m.mutable_heartbeat();
        h->set_seq(NextSeq(in));
        h->set_unix_ms(FuzzInt(in));
        AddRunning(in, h->mutable_running());
        s.Write(m);
        break;
      }
      case kStarted: {
        v1::RankStarted* r = m.mutable_rank_started();
        Ref(in, r->mutable_ref());
        r->set_pid(FuzzInt(in));
        s.Write(m);
        break;
      }
      case kProgress: {
        v1::RankProgress* p = m.mutable_rank_progress();
        Ref(in, p->mutable_ref());
        p->set_step(FuzzInt(in, 2));
        p->set_total_steps(FuzzInt(in, 3));
        p->set_loss(FuzzDouble(in));
        p->set_tokens_per_s(FuzzDouble(in));
        p->set_lr(FuzzDouble(in));
        p->set_grad_norm(FuzzDouble(in));
        p->set_elapsed_s(FuzzDouble(in));
        p->set_mfu(FuzzDouble(in));
        p->set_memory_bytes(FuzzDouble(in));
        if (in.U8() & 1) {
          v1::MoeStatus* moe = p->mutable_moe();
          moe->set_load_max_over_mean(FuzzDouble(in));
          moe->set_bias_min(FuzzDouble(in));
          moe->set_bias_max(FuzzDouble(in));
          moe->set_router_z_loss(FuzzDouble(in));
          moe->set_dispatch_bytes(FuzzDouble(in));
          moe->set_dispatch_s(FuzzDouble(in));
        }
        s.Write(m);
        break;
      }
      case kExit: {
        v1::RankExit* e = m.mutable_rank_exit();
        Ref(in, e->mutable_ref());
        const uint8_t code = in.U8();
        e->set_exit_code(code < 128 ? code % 4 : static_cast<int32_t>(FuzzInt(in)));
        e->set_signal((code & 1) ? 0 : static_cast<int32_t>(in.U8() % 40));
        e->set_stopped(code & 2);
        e->set_last_loss(FuzzDouble(in));
        for (int lines = in.U8() % 24; lines > 0; --lines) e->add_stderr_tail(FuzzString(in));
        s.Write(m);
        break;
      }
      case kCheckpoint: {
        v1::CheckpointDone* c = m.mutable_checkpoint_done();
        Ref(in, c->mutable_ref());
        c->set_step(FuzzInt(in, 5));
        c->set_path(FuzzString(in));
        s.Write(m);
        break;
      }
      case kNote: {
        v1::RankNote* n = m.mutable_note();
        Ref(in, n->mutable_ref());
        n->set_text(FuzzString(in));
        s.Write(m);
        break;
      }
      case kLeaving:
        m.mutable_leaving()->set_reason(FuzzString(in));
        s.Write(m);
        break;
      case kRaw:
        // Anything that parses: several kinds at once, unknown fields, a second hello.
        if (m.ParseFromString(in.Bytes(in.U16() % 4096))) s.Write(m);
        break;
      case kSync:
        Sync(s);
        break;
      case kPause:
        s.Pause(true);
        break;
      case kResume:
        s.Pause(false);
        break;
      case kHalfClose:
        s.HalfClose();
        if (!s.WaitEnded(kBound))
          Broken(absl::StrCat("worker ", s.worker_id(), "'s stream did not end within ",
                              absl::FormatDuration(kBound), " of its half-close"));
        break;
    }
  }

  void Submit(Input& in) {
    const int cp = 1 + in.U8() % 2, dp = 1 + in.U8() % 2;
    const int steps = 1 + in.U8() % 4, max_restarts = in.U8() % 3;
    if (submits_++ >= kMaxSubmits) return;
    const std::string spec = absl::StrCat(
        R"({"name": "f", "model": {"preset": "tiny"}, "data": {"source": "synthetic:recall"},)",
        R"( "seq_len": 256, "parallel": {"cp": )", cp, R"(, "dp": )", dp, R"(},)",
        R"( "train": {"steps": )", steps, R"(}, "checkpoint": {"dir": "/tmp/fuzz-session/)",
        ++k_.jobs_submitted, R"(", "every": 1}, "resources": "cpu", "max_restarts": )",
        max_restarts, "}");
    v1::SubmitJobRequest req;
    req.set_spec_json(spec);
    v1::SubmitJobResponse resp;
    grpc::ClientContext ctx;
    Bearer(&ctx, kUserToken);
    ctx.set_deadline(Deadline());
    const grpc::Status st = d_.jobs()->Submit(&ctx, req, &resp);
    EXPECT_OR_ABORT(st.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED,
                    "Submit did not answer within ", absl::FormatDuration(kBound));
    if (st.ok()) touched_.insert(resp.job_id());
  }

  void Tick(Input& in) {
    static constexpr int64_t kSteps[] = {0, 100, 600, 2100, 3100, 5100, 9000, 60000};
    const uint8_t b = in.U8();
    d_.clock().AdvanceMs(b < 200 ? kSteps[b % 8] : in.U16());
    d_.manager().Tick();
  }

  void CancelJob(Input& in) {
    v1::CancelJobRequest req;
    const uint8_t b = in.U8();
    if (!k_.assigned.empty() && b < 200)
      req.set_job_id(k_.assigned[b % k_.assigned.size()].job_id);
    else if (!touched_.empty())
      req.set_job_id(*touched_.begin());
    req.set_reason(FuzzString(in));
    v1::CancelJobResponse resp;
    grpc::ClientContext ctx;
    Bearer(&ctx, kUserToken);
    ctx.set_deadline(Deadline());
    const grpc::Status st = d_.jobs()->Cancel(&ctx, req, &resp);
    EXPECT_OR_ABORT(st.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED,
                    "Cancel did not answer within ", absl::FormatDuration(kBound));
  }

  // --- Pieces of messages -------------------------------------------------------------------

  // The token a worker's call carries: its own (0), the cluster's (1), another worker's (2), a
  // user's or none (3).
  static std::string WorkerToken(int w, uint8_t choice) {
    switch (choice & 3) {
      case 0:
        return TokenOf(w);
      case 1:
        return kClusterToken;
      case 2:
        return TokenOf((w + 1) % kWorkerIds);
      default:
        return (w & 1) ? kUserToken : "";
    }
  }
  static bool GoodToken(int, uint8_t choice) { return (choice & 3) <= 1; }
  static void Demote(Opening* o, Opening to) {
    if (*o == Opening::kGoodHello) *o = to;
  }

  int64_t NextSeq(Input& in) {
    const uint8_t b = in.U8();
    return b < 224 ? ++k_.seq : FuzzInt(in);  // mostly increasing; repeats and extremes too
  }

  // A rank reference: a real assignment as received, one of its neighbours, or made up.
  void Ref(Input& in, v1::RankRef* r) {
    const uint8_t sel = in.U8();
    if (!k_.assigned.empty() && sel < 160) {
      const Assigned& a = k_.assigned[(sel >> 2) % k_.assigned.size()];
      r->set_job_id(a.job_id);
      r->set_attempt(a.attempt);
      r->set_rank(a.rank);
      switch (sel & 3) {
        case 0:
          break;
        case 1:
          r->set_attempt(FuzzInt(in, a.attempt));
          break;
        case 2:
          r->set_rank(FuzzInt(in, a.rank));
          break;
        case 3:
          r->set_rank(a.world);
          break;
      }
      return;
    }
    switch (sel % 4) {
      case 0:
        r->set_job_id("j-999999");
        break;
      case 1:
        r->set_job_id(touched_.empty() ? "j-000001" : *touched_.rbegin());
        break;
      case 2:
        r->set_job_id(FuzzString(in));
        break;
      default:
        r->set_job_id(in.Bytes(in.U8() % 160));
        break;
    }
    r->set_attempt(FuzzInt(in));
    r->set_rank(FuzzInt(in, 0));
  }

  void AddRunning(Input& in, google::protobuf::RepeatedPtrField<v1::RunningRank>* running) {
    const uint8_t n = in.U8();
    for (int i = 0; i < (n < 250 ? n % 4 : 40); ++i) {
      v1::RunningRank* r = running->Add();
      Ref(in, r->mutable_ref());
      r->set_step(FuzzInt(in, 1));
      r->set_pid(FuzzInt(in));
      const uint8_t p = in.U8();
      r->set_pulsing(p & 1);
      r->set_silent_ms(p < 128 ? (p & 1) * 100 : FuzzInt(in, 2500));
      r->set_loss(FuzzDouble(in));
    }
  }

  // A heartbeat, then its ack or the end of the stream (bounded).
  void Sync(Stream& s) {
    v1::WorkerMessage hb;
    hb.mutable_heartbeat()->set_seq(++k_.seq);
    if (s.half_closed()) return;
    if (s.Write(hb)) {
      s.WaitAcked();
    } else if (!s.WaitEnded(kBound)) {
      Broken(absl::StrCat("a write on worker ", s.worker_id(), "'s stream failed, and the stream ",
                          "did not end within ", absl::FormatDuration(kBound)));
    }
    Absorb(s);
  }

  // --- Checks -------------------------------------------------------------------------------

  // Checks what the stream received since the last call, and keeps its assignments.
  void Absorb(Stream& s) {
    for (const v1::CoordinatorMessage& m : s.TakeNew()) {
      EXPECT_OR_ABORT(s.opening() == Opening::kGoodHello,
                      "a stream opened without a good hello received ", m.ShortDebugString());
      if (m.has_assignment()) {
        const v1::Assignment& a = m.assignment();
        // The job as planned, whole: its spec parses, leaves nothing to decide and names the
        // gang the rank belongs to.
        const absl::StatusOr<PlannedJob> job = PlannedJobFromProto(a.job());
        EXPECT_OR_ABORT(job.ok(), "assignment's planned job: ", job.status().ToString());
        const int64_t world = job->spec.parallel.world();
        EXPECT_OR_ABORT(a.ref().attempt() >= 1 && world >= 1 && a.ref().rank() >= 0 &&
                            a.ref().rank() < world && world == a.job().plan().world(),
                        "assignment ", a.ref().ShortDebugString(), " world ", world);
        EXPECT_OR_ABORT(job->spec.resources == "cpu" && a.device_index() >= 0 &&
                            a.device_index() < k_.slots[s.worker_id()],
                        "assignment to ", s.worker_id(), " on device ", job->spec.resources, " ",
                        a.device_index(), " (it registered at most ", k_.slots[s.worker_id()],
                        " slots)");
        EXPECT_OR_ABORT(k_.registered.count(s.worker_id()), "assignment to unregistered worker ",
                        s.worker_id());
        k_.assigned.push_back({a.ref().job_id(), a.ref().attempt(), a.ref().rank(), world});
        if (k_.assigned.size() > kKeptAssignments) k_.assigned.pop_front();
        touched_.insert(a.ref().job_id());
      } else if (m.has_stop()) {
        const v1::Stop& st = m.stop();
        EXPECT_OR_ABORT(IsValidUtf8(st.job_id()) && st.job_id().size() <= kMaxIdBytes,
                        "stop names job \"", st.job_id().substr(0, 200), "\"");
        EXPECT_OR_ABORT(IsValidUtf8(st.reason()) && st.reason().size() <= 8 * kMaxNoteBytes,
                        "stop reason of ", st.reason().size(), " bytes");
      } else {
        Broken(absl::StrCat("unknown message from the coordinator: ", m.ShortDebugString()));
      }
    }
  }

  // Closes `p`'s stream (or, with null, nothing) and checks how a refused one ended.
  void Close(std::unique_ptr<Stream>* p) {
    if (p == nullptr || *p == nullptr) return;
    Stream& s = **p;
    Absorb(s);
    const bool ended_by_server = s.ended();
    const grpc::Status st = s.Close();
    if (ended_by_server) CheckRefusal(s, st);
    p->reset();
  }

  void CheckRefusal(Stream& s, const grpc::Status& st) {
    using C = grpc::StatusCode;
    const C code = st.error_code();
    auto refused_with = [&](std::initializer_list<C> codes) {
      EXPECT_OR_ABORT(!s.ever_acked() && s.received() == 0, "a refused stream of ", s.worker_id(),
                      " was served");
      for (C c : codes)
        if (code == c) return;
      // A first message the server could not read: no hello came.
      if (s.first_unreadable() &&
          (code == C::CANCELLED || code == C::RESOURCE_EXHAUSTED || code == C::INTERNAL))
        return;
      Broken(absl::StrCat("stream of ", s.worker_id().substr(0, 16), " (opening ",
                          static_cast<int>(s.opening()), ") ended with ", code, ": ",
                          st.error_message()));
    };
    // The handler's order: the credential, the sessions limit (RESOURCE_EXHAUSTED; a stream
    // counts from its start), the first message, the id's size, the credential for that id, the
    // registration.
    switch (s.opening()) {
      case Opening::kBadCredential:
        // Another worker's token passes until a hello names a worker (an empty id names none).
        refused_with({C::UNAUTHENTICATED, C::PERMISSION_DENIED, C::FAILED_PRECONDITION,
                      C::INVALID_ARGUMENT, C::CANCELLED, C::NOT_FOUND, C::RESOURCE_EXHAUSTED});
        break;
      case Opening::kNoHello:
        refused_with({C::FAILED_PRECONDITION, C::RESOURCE_EXHAUSTED});
        break;
      case Opening::kNothing:
        refused_with({C::CANCELLED, C::RESOURCE_EXHAUSTED});
        break;
      case Opening::kUnregistered:
        refused_with({C::NOT_FOUND, C::RESOURCE_EXHAUSTED});
        break;
      case Opening::kOversizedId:
        refused_with({C::INVALID_ARGUMENT, C::RESOURCE_EXHAUSTED});
        break;
      case Opening::kWrongInstance:
        refused_with({C::PERMISSION_DENIED, C::RESOURCE_EXHAUSTED});
        break;
      case Opening::kGoodHello:
        break;
    }
  }

  // After the input: every stream synchronised; the one left of each worker is its session;
  // then all closed, and no worker stays alive.
  void Finish() {
    for (auto& p : streams_)
      if (p && !p->ended()) Sync(*p);
    // A session replaced by a newer one is cancelled: wait for those ends.
    std::map<std::string, std::vector<Stream*>> live;
    const absl::Time until = absl::Now() + kBound;
    for (;;) {
      live.clear();
      for (auto& p : streams_)
        if (p && p->ever_acked() && !p->ended()) live[p->worker_id()].push_back(p.get());
      bool one_each = true;
      for (auto& [id, v] : live) one_each &= v.size() == 1;
      if (one_each) break;
      if (absl::Now() > until) Broken("two acknowledged streams of one worker are both still open");
      absl::SleepFor(absl::Milliseconds(1));
    }
    CheckCluster();
    for (auto& [id, v] : live) {
      Sync(*v[0]);
      if (!v[0]->ever_acked() || v[0]->ended()) continue;
      // The heartbeat brought a lost worker back; its processing follows its ack.
      WaitWorker(
          id, [](const std::string& state) { return state == "alive" || state == "leaving"; },
          "its session is open and acknowledged its heartbeat");
    }
    for (auto& p : streams_) Close(&p);
    for (const std::string& id : k_.registered)
      WaitWorker(
          id, [](const std::string& state) { return state != "alive" && state != "leaving"; },
          "every stream of the input has ended");
    CheckJobs();
  }

  v1::ListWorkersResponse ListWorkers() {
    v1::ListWorkersResponse resp;
    grpc::ClientContext ctx;
    Bearer(&ctx, kClusterToken);
    ctx.set_deadline(Deadline());
    const grpc::Status st = d_.cluster()->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp);
    EXPECT_OR_ABORT(st.ok(), "ListWorkers: ", st.error_code(), " ", st.error_message());
    return resp;
  }

  template <typename Pred>
  void WaitWorker(const std::string& id, Pred pred, const char* because) {
    const absl::Time until = absl::Now() + kBound;
    std::string state;
    for (;;) {
      state = "(absent)";
      const v1::ListWorkersResponse workers = ListWorkers();
      for (const v1::WorkerInfo& w : workers.workers())
        if (w.worker_id() == id) state = w.state();
      if (pred(state)) return;
      if (absl::Now() > until) break;
      absl::SleepFor(absl::Milliseconds(1));
    }
    Broken(absl::StrCat("worker ", id, " is ", state, " though ", because));
  }

  void CheckCluster() {
    const v1::ListWorkersResponse workers = ListWorkers();
    for (const v1::WorkerInfo& w : workers.workers()) {
      EXPECT_OR_ABORT(k_.registered.count(w.worker_id()), "ListWorkers names worker \"",
                      w.worker_id().substr(0, 200), "\", which never registered");
      static const std::set<std::string> kStates = {"alive", "leaving", "disconnected", "left",
                                                    "lost"};
      EXPECT_OR_ABORT(kStates.count(w.state()), "worker state ", w.state());
      EXPECT_OR_ABORT(w.used_slots() >= 0 && w.used_slots() <= w.slots(), "worker ", w.worker_id(),
                      " uses ", w.used_slots(), " of ", w.slots(), " slots");
    }
  }

  void CheckJobs() {
    std::string token;
    int pages = 0;
    do {
      v1::ListJobsRequest req;
      req.set_page_size(1000);
      req.set_page_token(token);
      v1::ListJobsResponse resp;
      grpc::ClientContext ctx;
      Bearer(&ctx, kUserToken);
      ctx.set_deadline(Deadline());
      const grpc::Status st = d_.jobs()->List(&ctx, req, &resp);
      EXPECT_OR_ABORT(st.ok(), "List: ", st.error_code(), " ", st.error_message());
      for (const v1::Job& j : resp.jobs()) CheckJob(j);
      token = resp.next_page_token();
      EXPECT_OR_ABORT(++pages < 100, "List pages do not end");
    } while (!token.empty());
    for (const std::string& id : touched_) {
      if (id.empty()) continue;
      v1::GetJobRequest req;
      req.set_job_id(id);
      req.set_events_page_size(1000);
      v1::Job j;
      grpc::ClientContext ctx;
      Bearer(&ctx, kUserToken);
      ctx.set_deadline(Deadline());
      const grpc::Status st = d_.jobs()->Get(&ctx, req, &j);
      EXPECT_OR_ABORT(st.ok(), "Get ", id, ": ", st.error_code(), " ", st.error_message());
      CheckJob(j);
      for (const v1::JobEvent& e : j.events())
        EXPECT_OR_ABORT(e.message().size() <= 16 * kMaxNoteBytes, "an event of ",
                        e.message().size(), " bytes");
    }
  }

  void CheckJob(const v1::Job& j) {
    EXPECT_OR_ABORT(j.state() >= v1::JOB_STATE_QUEUED && j.state() <= v1::JOB_STATE_RESTARTING,
                    "job ", j.job_id(), " in state ", j.state());
    EXPECT_OR_ABORT(j.restarts() >= 0 && j.restarts() <= j.max_restarts(), "job ", j.job_id(),
                    " restarted ", j.restarts(), " times of ", j.max_restarts());
    EXPECT_OR_ABORT(j.attempt() >= 0, "job ", j.job_id(), " attempt ", j.attempt());
    if (j.state() == v1::JOB_STATE_PLACED || j.state() == v1::JOB_STATE_RUNNING) {
      EXPECT_OR_ABORT(j.ranks_size() > 0, "job ", j.job_id(), " placed without ranks");
      for (const v1::RankStatus& r : j.ranks())
        EXPECT_OR_ABORT(k_.registered.count(r.worker_id()) && r.device_index() >= 0 &&
                            r.device_index() < k_.slots[r.worker_id()],
                        "job ", j.job_id(), " rank ", r.rank(), " on ", r.worker_id(), " device ",
                        r.device_index());
    }
  }

  Daemon& d_;
  Knowledge& k_;
  std::unique_ptr<Stream> streams_[kStreamSlots];
  std::set<std::string> touched_;  // jobs this input submitted or was assigned
  int submits_ = 0;
};

std::string g_dir;
std::unique_ptr<Daemon> g_daemon;
std::unique_ptr<Knowledge> g_knowledge;
int g_inputs = 0;

void RemoveDir() {
  g_daemon.reset();
  std::error_code ec;
  std::filesystem::remove_all(g_dir, ec);
}

}  // namespace
}  // namespace spindle

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // libFuzzer's leak check after an input whose mallocs and frees do not balance: gRPC's own
  // threads free what an input allocated after it returns, so the check would run (a whole-heap
  // scan) after most inputs and find nothing. Off unless asked for; LeakSanitizer still checks
  // the process at exit.
  bool asked = false;
  for (int i = 1; i < *argc; ++i) asked |= std::string((*argv)[i]).rfind("-detect_leaks=", 0) == 0;
  if (!asked) {
    static std::vector<char*> args;
    args.assign(*argv, *argv + *argc);
    static char off[] = "-detect_leaks=0";
    args.insert(args.begin() + 1, off);
    args.push_back(nullptr);
    *argc += 1;
    *argv = args.data();
  }
  std::string dir =
      (std::filesystem::exists("/dev/shm") ? std::string("/dev/shm") : std::string("/tmp")) +
      "/spindle-fuzz-session-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) std::abort();
  spindle::g_dir = dir;
  std::atexit(spindle::RemoveDir);
  // Messages with invalid UTF-8 in string fields: protobuf logs each one it serializes or refuses.
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace spindle;
  if (g_inputs++ % kResetEvery == 0) {
    g_daemon.reset();
    g_daemon = std::make_unique<Daemon>(g_dir);
    g_knowledge = std::make_unique<Knowledge>();
  }
  Input in(data, size);
  Session(*g_daemon, *g_knowledge).Run(in);
  return 0;
}
