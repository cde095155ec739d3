// gRPC handlers of the coordinator (see grpc_services.h).
#include "coordinator/grpc_services.h"

#include <algorithm>
#include <deque>
#include <optional>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/host_port.h"
#include "common/text_bounds.h"
#include "coordinator/job_pages.h"
#include "coordinator/job_proto.h"
#include "coordinator/worker_proto.h"
#include "planner/plan_proto.h"

namespace spindle {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

namespace {

grpc::Status WrongPortStatus() {
  return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      "this is the coordinator's client port; workers connect to its worker port "
                      "(--worker_listen)");
}

}  // namespace

// Outbound queue of one Session stream, bounded in length and in how long its oldest message
// waits: a worker that does not read is disconnected, not buffered without end. Other threads hold
// it (the registry, a newer session replacing it, a send) and may cancel the stream at any time,
// also while its handler returns: the handler calls Ended() before it does, and the stream's
// context is touched only under the mutex and only before then (gRPC destroys the context once
// the handler has returned).
class SessionRegistry::Session {
 public:
  Session(grpc::ServerContext* ctx, const ServiceLimits& limits)
      : max_queued_(static_cast<size_t>(std::max<int64_t>(1, limits.max_session_outbound))),
        max_wait_(absl::Milliseconds(limits.stream_write_timeout_ms)),
        ctx_(ctx) {}

  bool Push(const v1::CoordinatorMessage& m) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    if (closed_) return false;
    const absl::Time now = absl::Now();
    const bool stuck = (!queue_.empty() && now - queue_.front().second > max_wait_) ||
                       (writing_ && now - write_started_ > max_wait_);
    if (queue_.size() < max_queued_ && !stuck) {
      queue_.emplace_back(m, now);
      return true;
    }
    // The worker does not read: the stream ends (the worker reconnects with a fresh one).
    closed_ = true;
    CancelStreamLocked();
    return false;
  }
  // Blocks until a message is queued or the session closes; false when closed and drained.
  bool Pop(v1::CoordinatorMessage* m) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    writing_ = false;
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return closed_ || !queue_.empty(); };
    mu_.Await(absl::Condition(&ready));
    if (queue_.empty()) return false;
    *m = std::move(queue_.front().first);
    queue_.pop_front();
    writing_ = true;
    write_started_ = absl::Now();
    return true;
  }
  void Close() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    closed_ = true;
  }
  // Closes the queue and cancels the stream (a newer session replaced this one), unless its
  // handler has ended.
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    closed_ = true;
    CancelStreamLocked();
  }
  // The handler is returning: the stream's context is not touched from now on.
  void Ended() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    closed_ = true;
    ctx_ = nullptr;
  }

 private:
  void CancelStreamLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ctx_ != nullptr) ctx_->TryCancel();
  }

  const size_t max_queued_;
  const absl::Duration max_wait_;
  absl::Mutex mu_;
  grpc::ServerContext* ctx_ ABSL_GUARDED_BY(mu_);  // null once the handler has ended
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  // Each message with the time it was queued.
  std::deque<std::pair<v1::CoordinatorMessage, absl::Time>> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // the writer holds a popped message
  absl::Time write_started_ ABSL_GUARDED_BY(mu_);
};

namespace {

// Reports one session read, waiting for the job manager (whose mutex a slow store write may hold):
// the reading thread never waits on the manager, so heartbeats keep being read and acknowledged.
// Bounded: a heartbeat replaces a queued heartbeat at the tail, a rank's progress its queued
// progress at the tail; past the limit Push fails.
class InboundReports {
 public:
  explicit InboundReports(int64_t limit)
      : limit_(static_cast<size_t>(std::max<int64_t>(1, limit))) {}

  bool Push(WorkerReport r) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    if (!queue_.empty()) {
      WorkerReport& last = queue_.back();
      if (std::holds_alternative<HeartbeatReport>(r) &&
          std::holds_alternative<HeartbeatReport>(last)) {
        last = std::move(r);
        return true;
      }
      const auto* p = std::get_if<RankProgressReport>(&r);
      const auto* q = std::get_if<RankProgressReport>(&last);
      if (p != nullptr && q != nullptr && p->ref.job_id == q->ref.job_id &&
          p->ref.attempt == q->ref.attempt && p->ref.rank == q->ref.rank) {
        last = std::move(r);
        return true;
      }
    }
    if (queue_.size() >= limit_) return false;
    queue_.push_back(std::move(r));
    return true;
  }
  // Blocks until a report is queued or the queue closes; false once closed and drained.
  bool Pop(WorkerReport* r) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return closed_ || !queue_.empty(); };
    mu_.Await(absl::Condition(&ready));
    if (queue_.empty()) return false;
    *r = std::move(queue_.front());
    queue_.pop_front();
    return true;
  }
  void Close() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    closed_ = true;
  }

 private:
  const size_t limit_;
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<WorkerReport> queue_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

bool SessionRegistry::Send(const std::string& worker_id, const WorkerCommand& command) {
  std::shared_ptr<Session> s;
  {
    absl::MutexLock l(&mu_);
    auto it = sessions_.find(worker_id);
    if (it == sessions_.end()) return false;
    s = it->second;
  }
  v1::CoordinatorMessage msg;
  CommandToProto(command, &msg);
  return s->Push(msg);
}

void SessionRegistry::Attach(const std::string& worker_id, std::shared_ptr<Session> s) {
  std::shared_ptr<Session> old;
  {
    absl::MutexLock l(&mu_);
    old = std::move(sessions_[worker_id]);
    sessions_[worker_id] = std::move(s);
  }
  if (old) old->Cancel();
}

void SessionRegistry::Detach(const std::string& worker_id, const Session* s) {
  absl::MutexLock l(&mu_);
  auto it = sessions_.find(worker_id);
  if (it != sessions_.end() && it->second.get() == s) sessions_.erase(it);
}

void SessionRegistry::End(const std::string& worker_id) {
  std::shared_ptr<Session> s;
  {
    absl::MutexLock l(&mu_);
    auto it = sessions_.find(worker_id);
    if (it == sessions_.end()) return;
    s = std::move(it->second);
    sessions_.erase(it);
  }
  s->Cancel();
}

void SessionRegistry::CloseAll() {
  std::map<std::string, std::shared_ptr<Session>> all;
  {
    absl::MutexLock l(&mu_);
    all.swap(sessions_);
  }
  for (auto& [id, s] : all) s->Cancel();
}

StreamReaper::StreamReaper(absl::Duration timeout) : timeout_(timeout) {
  thread_ = std::thread([this] {
    absl::MutexLock l(&mu_);
    while (!stop_) {
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(100));
      const absl::Time now = absl::Now();
      for (auto& [ctx, deadline] : writing_) {
        if (now < deadline) continue;
        ctx->TryCancel();
        deadline = absl::InfiniteFuture();  // once
      }
    }
  });
}

StreamReaper::~StreamReaper() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  thread_.join();
}

bool StreamReaper::Write(grpc::ServerContext* ctx, absl::FunctionRef<bool()> write) {
  {
    absl::MutexLock l(&mu_);
    writing_[ctx] = absl::Now() + timeout_;
  }
  const bool ok = write();
  absl::MutexLock l(&mu_);
  writing_.erase(ctx);
  return ok;
}

// --- JobService ------------------------------------------------------------------------------

grpc::Status JobServiceImpl::Submit(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                                    v1::SubmitJobResponse* resp) {
  User user;
  if (grpc::Status a = auth_->CheckUser(*ctx, &user); !a.ok()) return a;
  CpPlan plan;
  if (req->dry_run()) {
    absl::Status st = manager_->PlanSpec(req->spec_json(), &plan);
    if (st.ok()) PlanToProto(plan, resp->mutable_plan());
    return ToGrpc(st);
  }
  absl::StatusOr<std::string> id =
      manager_->Submit(req->spec_json(), &plan, req->request_id(), user.name);
  if (!id.ok()) return ToGrpc(id.status());
  resp->set_job_id(*id);
  PlanToProto(plan, resp->mutable_plan());
  JobView job;
  if (manager_->GetJob(*id, false, &job).ok())
    resp->set_state(static_cast<v1::JobState>(job.record.state));
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::Plan(grpc::ServerContext* ctx, const v1::PlanJobRequest* req,
                                  v1::PlanJobResponse* resp) {
  if (grpc::Status a = auth_->CheckUser(*ctx); !a.ok()) return a;
  CpPlan plan;
  absl::Status st = manager_->PlanSpec(req->spec_json(), &plan);
  if (st.ok()) PlanToProto(plan, resp->mutable_plan());
  return ToGrpc(st);
}

grpc::Status JobServiceImpl::Get(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                                 v1::Job* resp) {
  if (grpc::Status a = auth_->CheckUser(*ctx); !a.ok()) return a;
  JobView job;
  absl::Status st = manager_->GetJob(req->job_id(), true, &job,
                                     {req->events_page_size(), req->events_page_token()});
  if (st.ok()) JobViewToProto(job, resp);
  return ToGrpc(st);
}

grpc::Status JobServiceImpl::List(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                                  v1::ListJobsResponse* resp) {
  User user;
  if (grpc::Status a = auth_->CheckUser(*ctx, &user); !a.ok()) return a;
  std::set<JobState> states;
  for (int s : req->states()) {
    if (s < static_cast<int>(JobState::kQueued) || s > static_cast<int>(JobState::kRestarting))
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("list: unknown job state ", s));
    states.insert(static_cast<JobState>(s));
  }
  absl::StatusOr<int> page_size =
      ListPageSize(req->page_size() != 0 ? req->page_size() : req->limit());
  if (!page_size.ok()) return ToGrpc(page_size.status());
  std::vector<JobView> jobs;
  absl::Status st =
      manager_->ListJobPage(states, *page_size, req->page_token(), &jobs,
                            resp->mutable_next_page_token(), req->mine() ? &user.name : nullptr);
  if (!st.ok()) return ToGrpc(st);
  for (const JobView& j : jobs) JobViewToProto(j, resp->add_jobs());
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::Cancel(grpc::ServerContext* ctx, const v1::CancelJobRequest* req,
                                    v1::CancelJobResponse* resp) {
  User user;
  if (grpc::Status a = auth_->CheckUser(*ctx, &user); !a.ok()) return a;
  JobView job;
  absl::Status st = manager_->Cancel(req->job_id(), req->reason(), &job, &user);
  if (st.ok()) JobViewToProto(job, resp->mutable_job());
  return ToGrpc(st);
}

grpc::Status JobServiceImpl::Watch(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                                   grpc::ServerWriter<v1::JobUpdate>* writer) {
  if (grpc::Status a = auth_->CheckUser(*ctx); !a.ok()) return a;
  if (req->min_interval_ms() < 0)
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("watch: min_interval_ms must not be negative, got ", req->min_interval_ms()));
  {
    absl::MutexLock l(&mu_);
    if (open_watches_ >= limits_.max_watch_streams)
      return grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("watch: the coordinator already serves ", limits_.max_watch_streams,
                       " watch streams, its limit (--max-watch-streams); retry "
                       "later"));
    ++open_watches_;
  }
  absl::Cleanup release = [this] {
    absl::MutexLock l(&mu_);
    --open_watches_;
  };
  return WatchStream(ctx, *req, writer);
}

grpc::Status JobServiceImpl::WatchStream(grpc::ServerContext* ctx, const v1::WatchJobRequest& req,
                                         grpc::ServerWriter<v1::JobUpdate>* writer) {
  const absl::Duration min_interval = absl::Milliseconds(
      std::clamp<int64_t>(req.min_interval_ms() > 0 ? req.min_interval_ms() : 500,
                          limits_.min_watch_interval_ms, limits_.max_watch_interval_ms));
  // How long one wait for a change lasts: how soon a cancelled stream is noticed while idle.
  constexpr absl::Duration kPoll = absl::Milliseconds(250);
  uint64_t version = 0;
  size_t events_seen = 0;
  v1::JobState last_state = v1::JOB_STATE_UNSPECIFIED;
  while (!ctx->IsCancelled()) {
    JobView job;
    std::vector<EventRecord> events;
    const uint64_t before = version;
    absl::Status st =
        manager_->WaitJob(req.job_id(), &version, &events_seen, kPoll, &job, &events);
    if (!st.ok()) return ToGrpc(st);
    if (version == before && before != 0) continue;  // nothing new; check for cancellation
    v1::JobUpdate update;
    JobViewToProto(job, update.mutable_job());
    for (const EventRecord& e : events) EventToProto(e, update.add_new_events());
    const v1::JobState state = update.job().state();
    // A client that does not read holds this thread in Write: past the write timeout the
    // stream is cancelled (Write then returns false).
    if (!reaper_.Write(ctx, [&] { return writer->Write(update); }))
      return grpc::Status::OK;  // client went away, or did not read within the write timeout
    if (state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
        state == v1::JOB_STATE_CANCELLED)
      return grpc::Status::OK;
    // Progress-only updates at most every min_interval; a state change is not delayed further.
    // The pause ends early when the client cancels.
    if (state == last_state) {
      const absl::Time until = absl::Now() + min_interval;
      for (absl::Time now = absl::Now(); now < until && !ctx->IsCancelled(); now = absl::Now())
        absl::SleepFor(std::min(until - now, absl::Milliseconds(20)));
    }
    last_state = state;
  }
  return grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled by the client");
}

// --- ClusterService --------------------------------------------------------------------------

grpc::Status ClusterServiceImpl::Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                                          v1::RegisterResponse* resp) {
  if (grpc::Status a = auth_->CheckWorker(*ctx, req->worker_id()); !a.ok()) return a;
  if (!accepts_workers_) return WrongPortStatus();
  absl::StatusOr<RegistrationReply> reply =
      manager_->RegisterWorker(RegistrationFromProto(*req, PeerHost(ctx->peer())));
  if (!reply.ok()) return ToGrpc(reply.status());
  ReplyToProto(*reply, req->worker_id(), resp);
  return grpc::Status::OK;
}

grpc::Status ClusterServiceImpl::Session(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) {
  if (grpc::Status a = auth_->CheckWorker(*ctx, ""); !a.ok()) return a;
  if (!accepts_workers_) return WrongPortStatus();
  // Every open stream counts, also one still waiting for its hello: a holder of a worker
  // credential that opens streams and never says hello holds no more than the limit of threads.
  {
    absl::MutexLock l(&mu_);
    if (open_sessions_ >= limits_.max_sessions)
      return grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("session: the coordinator already serves ", limits_.max_sessions,
                       " worker sessions, its limit (--max-sessions)"));
    ++open_sessions_;
  }
  absl::Cleanup release = [this] {
    absl::MutexLock l(&mu_);
    --open_sessions_;
  };
  v1::WorkerMessage first;
  // A hello that does not come within the stream write timeout ends the stream (the reaper
  // cancels it, which ends the Read), so that no silent stream holds its place for ever.
  if (!reaper_.Write(ctx, [&] { return stream->Read(&first); }))
    return grpc::Status(grpc::StatusCode::CANCELLED, "session closed before its hello");
  if (!first.has_hello())
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "session: the first message must be a hello");
  const std::string worker_id = first.hello().worker_id();
  if (worker_id.size() > kMaxIdBytes)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("session: worker_id must be at most ", kMaxIdBytes,
                                     " bytes, got ", worker_id.size()));
  if (grpc::Status a = auth_->CheckWorker(*ctx, worker_id); !a.ok()) return a;
  const WorkerHello hello = HelloFromProto(first.hello());
  // Checked before this stream replaces the worker's live one: a hello that names another
  // daemon's worker is refused without disturbing it.
  if (absl::Status ok = manager_->CheckHello(hello); !ok.ok()) return ToGrpc(ok);
  uint64_t session_id;
  {
    absl::MutexLock l(&mu_);
    session_id = next_session_id_++;
  }
  auto session = std::make_shared<SessionRegistry::Session>(ctx, limits_);
  // On every return from here (the registry, or a newer session, may still hold it).
  absl::Cleanup ended = [&session] { session->Ended(); };
  {
    // One opening at a time, so that the session the registry keeps (the last attached) is the
    // one the manager opened last: two streams of a worker opening at once would otherwise leave
    // the manager with the replaced one, which closes while the other goes on.
    absl::MutexLock l(&open_mu_);
    sessions_->Attach(worker_id, session);
    // Again once attached: a revocation between the first check and the attach ended no stream
    // of this one (RevokeWorker revokes, then ends the attached one), so it is caught here.
    if (grpc::Status a = auth_->CheckWorker(*ctx, worker_id); !a.ok()) {
      sessions_->Detach(worker_id, session.get());
      return a;
    }
    manager_->HeardFrom(worker_id);
    absl::Status opened = manager_->SessionOpened(hello, session_id);
    if (!opened.ok()) {
      sessions_->Detach(worker_id, session.get());
      return ToGrpc(opened);
    }
  }
  std::thread writer([this, ctx, session, stream]() {
    v1::CoordinatorMessage m;
    while (session->Pop(&m)) {
      // Past the write timeout the stream is cancelled (Write then returns false), whether or not
      // more messages are queued behind this one: the handler, which joins this thread, ends.
      if (!reaper_.Write(ctx, [&] { return stream->Write(m); })) break;
    }
  });
  InboundReports inbound(limits_.max_session_inbound);
  std::thread processor([this, &inbound, &worker_id]() {
    WorkerReport r;
    while (inbound.Pop(&r)) manager_->HandleWorkerMessage(worker_id, r);
  });
  grpc::Status result = grpc::Status::OK;
  v1::WorkerMessage m;
  while (stream->Read(&m)) {
    // The worker's fencing counts from its last acknowledged heartbeat: acknowledged once the
    // manager has recorded the sign of life, without waiting for it to take in the rest.
    manager_->HeardFrom(worker_id);
    if (m.has_heartbeat()) {
      v1::CoordinatorMessage ack;
      ack.mutable_heartbeat_ack()->set_seq(m.heartbeat().seq());
      session->Push(ack);
    }
    if (std::optional<WorkerReport> report = ReportFromProto(m)) {
      if (!inbound.Push(*std::move(report))) {
        result =
            grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                         absl::StrCat("session: worker ", worker_id, " sent more than ",
                                      limits_.max_session_inbound,
                                      " reports the coordinator had not yet taken in; reconnect"));
        break;
      }
    }
  }
  // What was read is still taken in (a rank's exit sent just before a graceful end).
  inbound.Close();
  processor.join();
  if (result.ok())
    session->Close();  // the writer sends what is queued, then ends
  else
    session->Cancel();
  writer.join();
  sessions_->Detach(worker_id, session.get());
  manager_->SessionClosed(worker_id, session_id);
  return result;
}

grpc::Status ClusterServiceImpl::Join(grpc::ServerContext* ctx, const v1::JoinRequest* req,
                                      v1::JoinResponse* resp) {
  WorkerCertificates* certs = auth_->certificates();
  if (certs == nullptr)
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "join: this coordinator has no CA (it serves plaintext); workers "
                        "authenticate with --token-file");
  if (!accepts_workers_) return WrongPortStatus();
  absl::StatusOr<std::string> cert = certs->Join(req->bootstrap_token(), req->csr_pem());
  if (!cert.ok()) return ToGrpc(cert.status());
  resp->set_certificate_pem(*std::move(cert));
  resp->set_ca_pem(certs->ca().cert_pem());
  return grpc::Status::OK;
}

grpc::Status ClusterServiceImpl::RevokeWorker(grpc::ServerContext* ctx,
                                              const v1::RevokeWorkerRequest* req,
                                              v1::RevokeWorkerResponse* resp) {
  User user;
  if (grpc::Status a = auth_->CheckAdmin(*ctx, "revoke", &user); !a.ok()) return a;
  WorkerCertificates* certs = auth_->certificates();
  if (certs == nullptr)
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "revoke: this coordinator has no CA, so workers hold no certificates; "
                        "take the worker's token out of --worker-token-file instead");
  absl::StatusOr<int64_t> n = certs->Revoke(req->worker_id());
  if (!n.ok()) return ToGrpc(n.status());
  sessions_->End(req->worker_id());
  manager_->WorkerRevoked(req->worker_id(), user.name);
  resp->set_certificates_revoked(*n);
  return grpc::Status::OK;
}

grpc::Status ClusterServiceImpl::ListWorkers(grpc::ServerContext* ctx,
                                             const v1::ListWorkersRequest* req,
                                             v1::ListWorkersResponse* resp) {
  if (grpc::Status a = auth_->CheckAny(*ctx); !a.ok()) return a;
  for (const WorkerView& w : manager_->ListWorkers()) WorkerViewToProto(w, resp->add_workers());
  return grpc::Status::OK;
}

// --- RendezvousService -----------------------------------------------------------------------

grpc::Status RendezvousServiceImpl::Set(grpc::ServerContext* ctx, const v1::SetRequest* req,
                                        v1::SetResponse* resp) {
  if (grpc::Status a = auth_->CheckRendezvous(*ctx); !a.ok()) return a;
  const v1::RendezvousScope& s = req->scope();
  return ToGrpc(store_->Set(s.job_id(), s.attempt(), s.token(), req->key(), req->value()));
}

grpc::Status RendezvousServiceImpl::Get(grpc::ServerContext* ctx, const v1::GetRequest* req,
                                        v1::GetResponse* resp) {
  if (grpc::Status a = auth_->CheckRendezvous(*ctx); !a.ok()) return a;
  const v1::RendezvousScope& s = req->scope();
  if (req->wait_timeout_ms() < 0)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("rendezvous: wait_timeout_ms must not be negative, got ",
                                     req->wait_timeout_ms()));
  const bool waits = req->wait_timeout_ms() > 0;
  if (waits) {
    absl::MutexLock l(&mu_);
    if (waiting_gets_ >= limits_.max_rendezvous_waits)
      return grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("rendezvous: the coordinator already holds ", limits_.max_rendezvous_waits,
                       " waiting Gets, its limit (--max-rendezvous-waits); retry"));
    ++waiting_gets_;
  }
  absl::Cleanup release = [this, waits] {
    if (!waits) return;
    absl::MutexLock l(&mu_);
    --waiting_gets_;
  };
  absl::Duration timeout =
      absl::Milliseconds(std::min<int64_t>(req->wait_timeout_ms(), limits_.max_rendezvous_wait_ms));
  // Never wait past the client's own deadline.
  const auto deadline = ctx->deadline();
  const auto now = std::chrono::system_clock::now();
  if (deadline > now && deadline - now < std::chrono::hours(24 * 365))
    timeout = std::min(timeout, absl::FromChrono(deadline - now));
  absl::StatusOr<std::string> v = store_->Get(s.job_id(), s.attempt(), s.token(), req->key(),
                                              timeout, [ctx]() { return ctx->IsCancelled(); });
  if (!v.ok()) return ToGrpc(v.status());
  resp->set_value(std::move(*v));
  return grpc::Status::OK;
}

}  // namespace spindle
