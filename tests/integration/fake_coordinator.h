// FakeCoordinator: an in-process ClusterService on 127.0.0.1 for worker daemon tests. It records
// every Register and WorkerMessage, and lets a test push CoordinatorMessages down the open
// Session stream. It can be shut down and started again on the same port (a coordinator
// restart).
// Thread-safety: thread-safe; gRPC handler threads and the test thread share it under mu_.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "spindle/v1/cluster.grpc.pb.h"

namespace spindle::testing {

class FakeCoordinator : public v1::ClusterService::Service {
 public:
  grpc::Status Register(grpc::ServerContext* context, const v1::RegisterRequest* request,
                        v1::RegisterResponse* response) override {
    absl::MutexLock lock(&mu_);
    registers_.push_back(*request);
    auto auth = context->client_metadata().find("authorization");
    last_authorization_ =
        auth == context->client_metadata().end() ? "" : std::string(auth->second.data(), auth->second.size());
    response->set_worker_id(request->worker_id());
    response->set_heartbeat_interval_ms(100);
    // Long enough that a coordinator restart in a test is not a coordinator loss (the worker
    // fences at min(this, its --coordinator_loss_timeout) without acknowledgements).
    response->set_heartbeat_timeout_ms(10000);
    return grpc::Status::OK;
  }

  grpc::Status Session(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) override {
    v1::WorkerMessage message;
    if (!stream->Read(&message) || !message.has_hello()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "first message must be hello");
    }
    {
      absl::MutexLock lock(&mu_);
      messages_.push_back(message);
      ++sessions_;
      // A coordinator that takes registrations but breaks every stream before acknowledging.
      if (drop_sessions_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "dropped");
      stream_ = stream;
    }
    while (stream->Read(&message)) {
      absl::MutexLock lock(&mu_);
      messages_.push_back(message);
      // Heartbeats are acknowledged as the coordinator does (the worker fences without them),
      // unless a test silences the coordinator.
      if (message.has_heartbeat() && ack_heartbeats_) {
        v1::CoordinatorMessage ack;
        ack.mutable_heartbeat_ack()->set_seq(message.heartbeat().seq());
        stream->Write(ack);
      }
    }
    absl::MutexLock lock(&mu_);
    stream_ = nullptr;
    return grpc::Status::OK;
  }

  // Writes `message` to the open session; false when there is none.
  bool Send(const v1::CoordinatorMessage& message) {
    absl::MutexLock lock(&mu_);
    return stream_ != nullptr && stream_->Write(message);
  }

  // Stops (or resumes) acknowledging heartbeats: a coordinator the worker no longer hears.
  void AckHeartbeats(bool ack) {
    absl::MutexLock lock(&mu_);
    ack_heartbeats_ = ack;
  }

  // Ends every new session right after its hello (or stops doing so).
  void DropSessions(bool drop) {
    absl::MutexLock lock(&mu_);
    drop_sessions_ = drop;
  }

  std::vector<v1::WorkerMessage> Messages() {
    absl::MutexLock lock(&mu_);
    return messages_;
  }
  std::vector<v1::WorkerMessage> Of(v1::WorkerMessage::KindCase kind) {
    std::vector<v1::WorkerMessage> out;
    for (auto& m : Messages()) {
      if (m.kind_case() == kind) out.push_back(std::move(m));
    }
    return out;
  }
  std::vector<v1::RegisterRequest> Registers() {
    absl::MutexLock lock(&mu_);
    return registers_;
  }
  std::string LastAuthorization() {
    absl::MutexLock lock(&mu_);
    return last_authorization_;
  }
  bool HasSession() {
    absl::MutexLock lock(&mu_);
    return stream_ != nullptr;
  }
  int sessions() {
    absl::MutexLock lock(&mu_);
    return sessions_;
  }
  void Clear() {
    absl::MutexLock lock(&mu_);
    messages_.clear();
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::RegisterRequest> registers_ ABSL_GUARDED_BY(mu_);
  bool ack_heartbeats_ ABSL_GUARDED_BY(mu_) = true;
  bool drop_sessions_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<v1::WorkerMessage> messages_ ABSL_GUARDED_BY(mu_);
  std::string last_authorization_ ABSL_GUARDED_BY(mu_);
  grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream_
      ABSL_GUARDED_BY(mu_) = nullptr;
  int sessions_ ABSL_GUARDED_BY(mu_) = 0;
};

// A gRPC server on 127.0.0.1 hosting `services`. Port 0 picks a free port.
class LoopbackServer {
 public:
  LoopbackServer(std::vector<grpc::Service*> services, int port = 0) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(),
                             &port_);
    for (grpc::Service* s : services) builder.RegisterService(s);
    server_ = builder.BuildAndStart();
  }
  ~LoopbackServer() { Shutdown(); }
  void Shutdown() {
    if (server_ == nullptr) return;
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    server_->Wait();
    server_.reset();
  }
  bool ok() const { return server_ != nullptr && port_ > 0; }
  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace spindle::testing
