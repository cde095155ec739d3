// CoordinatorSession: the worker daemon's link to the coordinator (cluster.proto's protocol).
// It registers, holds one bidirectional Session stream, sends a hello listing the ranks still
// running (so a restarted coordinator re-adopts them), heartbeats every interval the coordinator
// asked for, relays the RankRunner's messages, and hands assignments and stops to the runner.
// When the stream breaks it re-registers with exponential backoff and keeps the trainers running.
// Fencing: the coordinator acknowledges each heartbeat; once the last acknowledged one was sent
// the heartbeat timeout ago (the one the coordinator gave at registration, or `loss_timeout` when
// shorter), the session stops every trainer (SIGTERM, then SIGKILL after the coordinator's stop
// grace) and breaks its stream, whether the stream still looks open or not: a host cut off from
// the coordinator stops its ranks before the coordinator, which declares it lost a heartbeat
// timeout after its last word from it, may start their gangs' next attempts elsewhere. Timers run
// on the steady clock.
//
// Messages produced while disconnected are queued (rank starts, checkpoints and exits; progress
// lines are dropped) and sent after the next hello. The hello lists the live ranks plus the ranks
// whose RankExit is among those queued messages (pid 0, step of their last queued checkpoint), so
// a coordinator that restarted meanwhile re-adopts them and then receives their outcome.
//
// Thread-safety: thread-safe. Send() never blocks on the network. One session thread, one fence
// watchdog thread, plus one reader thread per stream; the runner is called from the reader
// thread (and StopAll from the watchdog).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "spindle/v1/cluster.grpc.pb.h"
#include "worker/rank_runner.h"
#include "worker/worker_metrics.h"

namespace spindle {

struct SessionOptions {
  std::string coordinator_address;  // host:port
  std::string tls_ca_file;          // empty: plaintext
  // The worker's client certificate and key (PEM; worker_identity.h); empty: none.
  std::string tls_client_cert_pem;
  std::string tls_client_key_pem;
  std::string bearer_token;         // empty: no authorization metadata
  std::string worker_id;
  std::string hostname;
  std::string metrics_address;  // host:port of /metrics (":port": the coordinator names the host)
  std::string advertise_host;   // RegisterRequest.advertise_host ("": as the coordinator sees us)
  PathRoots roots;              // reported at registration (the rank runner enforces them)
  std::string version;
  std::string instance_id;  // random per daemon process: tells its reconnects from a namesake
  std::vector<v1::DeviceGroup> devices;
  absl::Duration loss_timeout = absl::Seconds(60);
  absl::Duration min_backoff = absl::Milliseconds(200);
  absl::Duration max_backoff = absl::Seconds(2);
  absl::Duration register_timeout = absl::Seconds(5);
  absl::Duration default_heartbeat = absl::Seconds(1);  // if the coordinator names none
  absl::Duration stop_grace = absl::Seconds(10);        // Stop without grace_period_ms
  size_t max_queued_messages = 10000;
};

class CoordinatorSession : public MessageSink {
 public:
  // `metrics` may be null; it must outlive the session.
  CoordinatorSession(SessionOptions options, WorkerMetrics* metrics);
  ~CoordinatorSession() override;  // Shutdown(absl::ZeroDuration())
  CoordinatorSession(const CoordinatorSession&) = delete;
  CoordinatorSession& operator=(const CoordinatorSession&) = delete;

  // Starts the session thread. `runner` must outlive the session (or its Shutdown()).
  void Start(RankRunner* runner) ABSL_LOCKS_EXCLUDED(mu_);

  // Queues a message for the coordinator.
  void Send(v1::WorkerMessage message) override ABSL_LOCKS_EXCLUDED(mu_);

  // Sends what is queued (waiting up to `flush_timeout`), closes the stream and joins.
  void Shutdown(absl::Duration flush_timeout) ABSL_LOCKS_EXCLUDED(mu_);

  bool connected() const ABSL_LOCKS_EXCLUDED(mu_);
  // Streams opened so far (1 after the first connection).
  int64_t sessions_opened() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run();
  // Registers; returns the heartbeat interval (and takes the fence timeout and grace).
  absl::StatusOr<absl::Duration> Register();
  // Opens and serves one stream until it breaks or the session stops.
  absl::Status ServeStream(absl::Duration heartbeat);
  void Handle(const v1::CoordinatorMessage& message);
  // Sleeps up to `d`, waking early on shutdown.
  void WaitDisconnected(absl::Duration d);
  // Applies the fencing rule until the session stops (its own thread).
  void Watchdog();
  bool Stopping() const ABSL_LOCKS_EXCLUDED(mu_);
  // Stops every trainer once the last acknowledged heartbeat is a fence timeout old (once per
  // lapse of acknowledgements); true when it did.
  bool FenceIfExpired() ABSL_LOCKS_EXCLUDED(mu_);
  // Time left before FenceIfExpired fires (negative: past it).
  absl::Duration UntilFence() const ABSL_LOCKS_EXCLUDED(mu_);

  const SessionOptions options_;
  WorkerMetrics* const metrics_;
  RankRunner* runner_ = nullptr;  // set by Start()
  std::unique_ptr<v1::ClusterService::Stub> stub_;
  absl::Status channel_status_;

  mutable absl::Mutex mu_;
  std::deque<v1::WorkerMessage> outbox_ ABSL_GUARDED_BY(mu_);
  bool connected_ ABSL_GUARDED_BY(mu_) = false;
  bool stream_broken_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t sessions_opened_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<grpc::ClientContext> context_ ABSL_GUARDED_BY(mu_);  // of the open stream
  // Fencing state (steady clock). `acked_sent_`: when the newest acknowledged heartbeat (or,
  // before any, the first successful registration request) was sent; `unacked_`: sequence numbers
  // and send times of this stream's heartbeats not yet acknowledged.
  using SteadyTime = std::chrono::steady_clock::time_point;
  SteadyTime acked_sent_ ABSL_GUARDED_BY(mu_);
  bool fenced_ ABSL_GUARDED_BY(mu_) = false;  // fired since the last acknowledgement
  std::deque<std::pair<int64_t, SteadyTime>> unacked_ ABSL_GUARDED_BY(mu_);
  absl::Duration fence_timeout_ ABSL_GUARDED_BY(mu_) = absl::InfiniteDuration();
  absl::Duration fence_grace_ ABSL_GUARDED_BY(mu_);

  absl::Notification finished_;
  std::thread thread_;
  std::thread watchdog_;
};

}  // namespace spindle
