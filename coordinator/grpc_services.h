// The coordinator's gRPC services (sync API; gRPC's thread pool runs the handlers): JobService
// for clients, ClusterService (worker sessions) and RendezvousService for workers. They only
// translate between the wire and JobManager / RendezvousStore; all state lives there.
//
// Sessions: each open Session stream has an outbound queue drained by its own writer thread, so
// JobManager's Send never blocks, and an inbound queue of reports drained by its own thread into
// the JobManager, so the handler thread that reads never waits for the manager (whose mutex store
// writes hold): it records each message as a sign of life (JobManager::HeardFrom) and acknowledges
// each heartbeat at once. Both queues are bounded (ServiceLimits), and so is each write: a worker
// that does not take a message within the stream write timeout is cut off, also while what was
// queued drains after its side of the stream ended. A new session of the same worker cancels the
// previous one, once its hello has been checked; sessions open one at a time.
// Thread-safety: all classes are thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/credentials.h"
#include "coordinator/job_manager.h"
#include "coordinator/rendezvous_store.h"
#include "coordinator/service_limits.h"
#include "coordinator/worker_channel.h"
#include "spindle/v1/cluster.grpc.pb.h"
#include "spindle/v1/job.grpc.pb.h"
#include "spindle/v1/rendezvous.grpc.pb.h"

namespace spindle {

// The open Session streams, as the WorkerChannel the manager sends through.
class SessionRegistry : public WorkerChannel {
 public:
  class Session;  // one open stream's outbound queue

  bool Send(const std::string& worker_id, const WorkerCommand& command) override
      ABSL_LOCKS_EXCLUDED(mu_);
  // Makes `s` the worker's session; cancels the one it replaces.
  void Attach(const std::string& worker_id, std::shared_ptr<Session> s) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets `s` if it is still the worker's session.
  void Detach(const std::string& worker_id, const Session* s) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the worker's session, if it has one (its certificate was revoked).
  void End(const std::string& worker_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Closes every session (daemon shutdown).
  void CloseAll() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
};

// Cancels a server stream whose Write has not completed within `timeout` (a client that does not
// read holds the writing thread otherwise); one thread watches every stream in Write. A Session's
// wait for its first message (Read) is bounded the same way.
class StreamReaper {
 public:
  explicit StreamReaper(absl::Duration timeout);
  ~StreamReaper();
  StreamReaper(const StreamReaper&) = delete;
  StreamReaper& operator=(const StreamReaper&) = delete;
  // Runs `write` (a Write, or a Read, on ctx's stream) and returns its result; cancels ctx once
  // it has run longer than the timeout, which makes the Write (or Read) return false.
  bool Write(grpc::ServerContext* ctx, absl::FunctionRef<bool()> write) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const absl::Duration timeout_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::map<grpc::ServerContext*, absl::Time> writing_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

class JobServiceImpl final : public v1::JobService::Service {
 public:
  JobServiceImpl(JobManager* manager, const Credentials* auth, ServiceLimits limits = {})
      : manager_(manager),
        auth_(auth),
        limits_(limits),
        reaper_(absl::Milliseconds(limits.stream_write_timeout_ms)) {}
  grpc::Status Submit(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                      v1::SubmitJobResponse* resp) override;
  grpc::Status Plan(grpc::ServerContext* ctx, const v1::PlanJobRequest* req,
                    v1::PlanJobResponse* resp) override;
  grpc::Status Get(grpc::ServerContext* ctx, const v1::GetJobRequest* req, v1::Job* resp) override;
  grpc::Status List(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                    v1::ListJobsResponse* resp) override;
  grpc::Status Cancel(grpc::ServerContext* ctx, const v1::CancelJobRequest* req,
                      v1::CancelJobResponse* resp) override;
  grpc::Status Watch(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                     grpc::ServerWriter<v1::JobUpdate>* writer) override;

 private:
  grpc::Status WatchStream(grpc::ServerContext* ctx, const v1::WatchJobRequest& req,
                           grpc::ServerWriter<v1::JobUpdate>* writer);

  JobManager* const manager_;
  const Credentials* const auth_;
  const ServiceLimits limits_;
  StreamReaper reaper_;
  absl::Mutex mu_;
  int open_watches_ ABSL_GUARDED_BY(mu_) = 0;
};

class ClusterServiceImpl final : public v1::ClusterService::Service {
 public:
  // `accepts_workers` false: the instance on a client-only port (the coordinator was given a
  // separate worker port); it answers ListWorkers (for `spindle workers`) and refuses Register
  // and Session with FAILED_PRECONDITION naming the worker port.
  ClusterServiceImpl(JobManager* manager, SessionRegistry* sessions, const Credentials* auth,
                     bool accepts_workers = true, ServiceLimits limits = {})
      : manager_(manager),
        sessions_(sessions),
        auth_(auth),
        accepts_workers_(accepts_workers),
        limits_(limits),
        reaper_(absl::Milliseconds(limits.stream_write_timeout_ms)) {}
  grpc::Status Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                        v1::RegisterResponse* resp) override;
  grpc::Status Session(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) override;
  grpc::Status ListWorkers(grpc::ServerContext* ctx, const v1::ListWorkersRequest* req,
                           v1::ListWorkersResponse* resp) override;
  // Join answers on the worker port only; RevokeWorker on either.
  grpc::Status Join(grpc::ServerContext* ctx, const v1::JoinRequest* req,
                    v1::JoinResponse* resp) override;
  grpc::Status RevokeWorker(grpc::ServerContext* ctx, const v1::RevokeWorkerRequest* req,
                            v1::RevokeWorkerResponse* resp) override;

 private:
  JobManager* const manager_;
  SessionRegistry* const sessions_;
  const Credentials* const auth_;
  const bool accepts_workers_;
  const ServiceLimits limits_;
  StreamReaper reaper_;  // the sessions' writes
  // Held while a session is attached to the registry and opened in the manager, so that both take
  // a worker's sessions in the same order.
  absl::Mutex open_mu_;
  absl::Mutex mu_;
  uint64_t next_session_id_ ABSL_GUARDED_BY(mu_) = 1;
  int open_sessions_ ABSL_GUARDED_BY(mu_) = 0;
};

class RendezvousServiceImpl final : public v1::RendezvousService::Service {
 public:
  RendezvousServiceImpl(RendezvousStore* store, const Credentials* auth, ServiceLimits limits = {})
      : store_(store), auth_(auth), limits_(limits) {}
  grpc::Status Set(grpc::ServerContext* ctx, const v1::SetRequest* req,
                   v1::SetResponse* resp) override;
  grpc::Status Get(grpc::ServerContext* ctx, const v1::GetRequest* req,
                   v1::GetResponse* resp) override;

 private:
  RendezvousStore* const store_;
  const Credentials* const auth_;
  const ServiceLimits limits_;
  absl::Mutex mu_;
  int waiting_gets_ ABSL_GUARDED_BY(mu_) = 0;
};

// absl::Status -> grpc::Status with the same code and message.
grpc::Status ToGrpc(const absl::Status& s);

}  // namespace spindle
