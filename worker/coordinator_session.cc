// CoordinatorSession (see coordinator_session.h).
#include "worker/coordinator_session.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/grpc_client.h"
#include "worker/worker_log.h"

namespace spindle {
namespace {

// Progress is only worth sending live; everything else must reach the coordinator.
bool Droppable(const v1::WorkerMessage& m) {
  return m.has_rank_progress() || m.has_heartbeat();
}

}  // namespace

CoordinatorSession::CoordinatorSession(SessionOptions options, WorkerMetrics* metrics)
    : options_(std::move(options)), metrics_(metrics) {
  ChannelOptions channel_options;
  channel_options.address = options_.coordinator_address;
  channel_options.tls_ca_file = options_.tls_ca_file;
  channel_options.client_cert_pem = options_.tls_client_cert_pem;
  channel_options.client_key_pem = options_.tls_client_key_pem;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeCoordinatorChannel(channel_options);
  if (channel.ok()) {
    stub_ = v1::ClusterService::NewStub(*channel);
  } else {
    channel_status_ = channel.status();
  }
}

CoordinatorSession::~CoordinatorSession() { Shutdown(absl::ZeroDuration()); }

void CoordinatorSession::Start(RankRunner* runner) {
  runner_ = runner;
  thread_ = std::thread([this] {
    Run();
    finished_.Notify();
  });
  // Apart from the session thread, which a stream leading nowhere (a cut link) can hold in a
  // write or a registration: the fence waits for neither.
  watchdog_ = std::thread([this] { Watchdog(); });
}

void CoordinatorSession::Watchdog() {
  for (;;) {
    FenceIfExpired();
    const absl::Duration wait =
        std::clamp(UntilFence(), absl::Milliseconds(10), absl::Milliseconds(200));
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), wait);
  }
}

void CoordinatorSession::Send(v1::WorkerMessage message) {
  absl::MutexLock lock(&mu_);
  if (!connected_ && Droppable(message)) return;
  if (outbox_.size() >= options_.max_queued_messages) {
    auto it = std::find_if(outbox_.begin(), outbox_.end(), Droppable);
    if (it != outbox_.end()) {
      outbox_.erase(it);
    } else {
      outbox_.pop_front();
    }
  }
  outbox_.push_back(std::move(message));
}

bool CoordinatorSession::connected() const {
  absl::MutexLock lock(&mu_);
  return connected_;
}

int64_t CoordinatorSession::sessions_opened() const {
  absl::MutexLock lock(&mu_);
  return sessions_opened_;
}

bool CoordinatorSession::Stopping() const {
  absl::MutexLock lock(&mu_);
  return stopping_;
}

void CoordinatorSession::Shutdown(absl::Duration flush_timeout) {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (watchdog_.joinable()) watchdog_.join();
  if (!thread_.joinable()) return;
  if (!finished_.WaitForNotificationWithTimeout(flush_timeout)) {
    absl::MutexLock lock(&mu_);
    if (context_ != nullptr) context_->TryCancel();
  }
  thread_.join();
}

absl::StatusOr<absl::Duration> CoordinatorSession::Register() {
  if (stub_ == nullptr) return channel_status_;
  v1::RegisterRequest request;
  request.set_worker_id(options_.worker_id);
  request.set_hostname(options_.hostname);
  for (const v1::DeviceGroup& d : options_.devices) *request.add_devices() = d;
  request.set_metrics_address(options_.metrics_address);
  request.set_version(options_.version);
  request.set_instance_id(options_.instance_id);
  request.set_advertise_host(options_.advertise_host);
  request.set_checkpoint_root(options_.roots.checkpoint_root);
  request.set_data_root(options_.roots.data_root);
  grpc::ClientContext context;
  AddBearerToken(&context, options_.bearer_token);
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.register_timeout));
  // Wait for the channel to connect (within the deadline) rather than fail at once while it is
  // backing off: a coordinator back from a restart is found as soon as it listens.
  context.set_wait_for_ready(true);
  v1::RegisterResponse response;
  const SteadyTime sent = std::chrono::steady_clock::now();
  const grpc::Status status = stub_->Register(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status, "register");
  {
    absl::MutexLock lock(&mu_);
    // Only the first registration starts the fence's clock. Later ones do not move it: only an
    // acknowledged heartbeat does, so a worker whose sessions keep breaking before any
    // acknowledgement (a coordinator that accepts registrations but drops every stream) still
    // stops its trainers a heartbeat timeout after its last acknowledged heartbeat.
    if (fence_timeout_ == absl::InfiniteDuration()) {
      acked_sent_ = sent;
      fenced_ = false;
    }
    fence_timeout_ = options_.loss_timeout;
    if (response.heartbeat_timeout_ms() > 0)
      fence_timeout_ =
          std::min(fence_timeout_, absl::Milliseconds(response.heartbeat_timeout_ms()));
    fence_grace_ = response.stop_grace_ms() > 0 ? absl::Milliseconds(response.stop_grace_ms())
                                                : options_.stop_grace;
  }
  return response.heartbeat_interval_ms() > 0 ? absl::Milliseconds(response.heartbeat_interval_ms())
                                              : options_.default_heartbeat;
}

absl::Duration CoordinatorSession::UntilFence() const {
  absl::MutexLock lock(&mu_);
  if (fenced_ || fence_timeout_ == absl::InfiniteDuration()) return absl::InfiniteDuration();
  return fence_timeout_ - absl::FromChrono(std::chrono::steady_clock::now() - acked_sent_);
}

bool CoordinatorSession::FenceIfExpired() {
  absl::Duration silent, grace;
  {
    absl::MutexLock lock(&mu_);
    if (fenced_ || fence_timeout_ == absl::InfiniteDuration()) return false;
    silent = absl::FromChrono(std::chrono::steady_clock::now() - acked_sent_);
    if (silent < fence_timeout_) return false;
    fenced_ = true;
    grace = fence_grace_;
    if (context_ != nullptr) context_->TryCancel();  // a stream that only looks open
  }
  const int n = runner_->StopAll(grace);
  if (metrics_ != nullptr) metrics_->OnCoordinatorLoss();
  WorkerLog(
      "no heartbeat acknowledged by the coordinator for %s: stopping %d trainer(s) "
      "(its gangs restart elsewhere)",
      absl::FormatDuration(absl::Trunc(silent, absl::Milliseconds(100))), n);
  return true;
}

void CoordinatorSession::Handle(const v1::CoordinatorMessage& message) {
  if (message.has_heartbeat_ack()) {
    absl::MutexLock lock(&mu_);
    while (!unacked_.empty() && unacked_.front().first <= message.heartbeat_ack().seq()) {
      if (unacked_.front().first == message.heartbeat_ack().seq()) {
        acked_sent_ = std::max(acked_sent_, unacked_.front().second);
        fenced_ = false;
      }
      unacked_.pop_front();
    }
    return;
  }
  if (message.has_assignment()) {
    const v1::Assignment& a = message.assignment();
    WorkerLog("assignment: job %s attempt %d rank %d", a.ref().job_id(), a.ref().attempt(),
              a.ref().rank());
    if (absl::Status s = runner_->Start(a); !s.ok()) {
      WorkerLog("cannot start rank %d of job %s: %s", a.ref().rank(), a.ref().job_id(),
                s.ToString());
    }
  } else if (message.has_stop()) {
    const v1::Stop& stop = message.stop();
    const absl::Duration grace = stop.grace_period_ms() > 0
                                     ? absl::Milliseconds(stop.grace_period_ms())
                                     : options_.stop_grace;
    const int n = runner_->Stop(stop.job_id(), stop.attempt(), grace);
    WorkerLog("stop job %s attempt %d (%s): %d rank(s)", stop.job_id(), stop.attempt(),
              stop.reason(), n);
  }
}

absl::Status CoordinatorSession::ServeStream(absl::Duration heartbeat) {
  auto context = std::make_shared<grpc::ClientContext>();
  AddBearerToken(context.get(), options_.bearer_token);
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream =
      stub_->Session(context.get());
  v1::WorkerMessage hello;
  hello.mutable_hello()->set_worker_id(options_.worker_id);
  hello.mutable_hello()->set_instance_id(options_.instance_id);
  for (v1::RunningRank& r : runner_->Running()) *hello.mutable_hello()->add_running() = std::move(r);
  {
    // Ranks that ended while the coordinator was away are listed too: their checkpoints and
    // RankExit follow right after the hello, so the coordinator adopts them and then learns how
    // they ended, instead of restarting a gang whose outcome is still in flight.
    absl::MutexLock lock(&mu_);
    for (const v1::WorkerMessage& m : outbox_) {
      if (!m.has_rank_exit()) continue;
      v1::RunningRank* r = hello.mutable_hello()->add_running();
      *r->mutable_ref() = m.rank_exit().ref();
      r->set_loss(m.rank_exit().last_loss());
      for (const v1::WorkerMessage& c : outbox_) {
        if (c.has_checkpoint_done() && c.checkpoint_done().ref().SerializeAsString() ==
                                           m.rank_exit().ref().SerializeAsString()) {
          r->set_step(std::max(r->step(), c.checkpoint_done().step()));
        }
      }
    }
  }
  if (!stream->Write(hello)) {
    return FromGrpcStatus(stream->Finish(), "session hello");
  }
  int64_t opened;
  {
    absl::MutexLock lock(&mu_);
    connected_ = true;
    stream_broken_ = false;
    context_ = context;
    opened = ++sessions_opened_;
    unacked_.clear();
  }
  if (metrics_ != nullptr) {
    metrics_->SetConnected(true);
    if (opened > 1) metrics_->OnReconnect();
  }
  WorkerLog("session open with %s as worker %s (%d running ranks)", options_.coordinator_address,
            options_.worker_id, hello.hello().running_size());

  std::thread reader([this, &stream] {
    v1::CoordinatorMessage message;
    while (stream->Read(&message)) Handle(message);
    absl::MutexLock lock(&mu_);
    stream_broken_ = true;
  });

  absl::Time next_heartbeat = absl::Now();
  int64_t seq = 0;
  bool write_failed = false;
  for (;;) {
    std::deque<v1::WorkerMessage> batch;
    bool stopping = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this, next_heartbeat]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !outbox_.empty() || stream_broken_ || stopping_ || absl::Now() >= next_heartbeat;
      };
      // Poll the clock too: the condition depends on time, not only on state changes.
      while (!ready()) {
        mu_.AwaitWithDeadline(absl::Condition(+[](CoordinatorSession* s) {
                                return !s->outbox_.empty() || s->stream_broken_ || s->stopping_;
                              }, this),
                              next_heartbeat);
      }
      if (stream_broken_) break;
      batch.swap(outbox_);
      stopping = stopping_;
    }
    while (!batch.empty()) {
      if (!stream->Write(batch.front())) {
        write_failed = true;
        break;
      }
      batch.pop_front();
    }
    if (write_failed) {
      absl::MutexLock lock(&mu_);
      for (auto it = batch.rbegin(); it != batch.rend(); ++it) {
        if (!Droppable(*it)) outbox_.push_front(std::move(*it));
      }
      break;
    }
    if (stopping) {
      absl::MutexLock lock(&mu_);
      if (outbox_.empty()) break;
      continue;
    }
    if (absl::Now() >= next_heartbeat) {
      v1::WorkerMessage hb;
      hb.mutable_heartbeat()->set_unix_ms(absl::ToUnixMillis(absl::Now()));
      hb.mutable_heartbeat()->set_seq(++seq);
      for (v1::RunningRank& r : runner_->Running()) {
        *hb.mutable_heartbeat()->add_running() = std::move(r);
      }
      {
        absl::MutexLock lock(&mu_);
        // A coordinator that answers none of them keeps the list bounded (the fence fires first).
        if (unacked_.size() >= 4096) unacked_.pop_front();
        unacked_.emplace_back(seq, std::chrono::steady_clock::now());
      }
      if (!stream->Write(hb)) {
        write_failed = true;
        break;
      }
      if (metrics_ != nullptr) metrics_->OnHeartbeat();
      next_heartbeat = absl::Now() + heartbeat;
    }
  }
  if (!write_failed && Stopping()) {
    // A graceful end: the coordinator reads everything sent before it sees the end of the stream
    // and closes its side; cancelling at once could discard the last messages (the ranks' exits)
    // unread. Bounded: a coordinator that does not answer is cancelled after a second.
    stream->WritesDone();
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stream_broken_), absl::Seconds(1));
  }
  context->TryCancel();
  reader.join();
  const grpc::Status status = stream->Finish();
  {
    absl::MutexLock lock(&mu_);
    connected_ = false;
    context_ = nullptr;
  }
  if (metrics_ != nullptr) metrics_->SetConnected(false);
  return FromGrpcStatus(status, "session");
}

void CoordinatorSession::WaitDisconnected(absl::Duration d) {
  const absl::Time until = absl::Now() + d;
  for (;;) {
    absl::MutexLock lock(&mu_);
    if (stopping_ || absl::Now() >= until) return;
    mu_.AwaitWithDeadline(absl::Condition(&stopping_), until);
  }
}

void CoordinatorSession::Run() {
  absl::Duration backoff = options_.min_backoff;
  while (!Stopping()) {
    absl::StatusOr<absl::Duration> heartbeat = Register();
    if (heartbeat.ok()) {
      const absl::Time opened = absl::Now();
      const absl::Status status = ServeStream(*heartbeat);
      if (Stopping()) break;
      WorkerLog("session to %s ended: %s", options_.coordinator_address, status.ToString());
      if (absl::Now() - opened > options_.max_backoff) backoff = options_.min_backoff;
    } else {
      WorkerLog("cannot register with %s: %s", options_.coordinator_address,
                heartbeat.status().ToString());
    }
    WaitDisconnected(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

}  // namespace spindle
