// The real spindle-coordinator daemon driven over gRPC on 127.0.0.1 by a scripted fake worker
// that implements the Session stream: a job runs to success; then the coordinator is killed with
// SIGKILL mid-job, restarted on the same database, and re-adopts the rank the worker still runs.
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <chrono>
#include <deque>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "spindle/v1/cluster.grpc.pb.h"
#include "spindle/v1/job.grpc.pb.h"

namespace spindle {
namespace {

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t n = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  close(fd);
  return ntohs(a.sin_port);
}

pid_t StartCoordinator(const std::string& db, int port) {
  pid_t pid = fork();
  if (pid == 0) {
    const std::string listen = absl::StrCat("127.0.0.1:", port);
    execl(SPINDLE_COORDINATOR_BINARY, SPINDLE_COORDINATOR_BINARY, "--listen", listen.c_str(),
          "--db", db.c_str(), "--metrics-port", "-1", "--heartbeat-timeout", "3",
          "--heartbeat-interval", "0.5", "--recovery-grace", "5", "--plaintext", nullptr);
    _exit(127);
  }
  return pid;
}

// Kills and reaps the coordinator child if the test ends early (a failed ASSERT): an orphaned
// daemon would hold the test's output open and stall the test runner.
struct ReapOnExit {
  pid_t* pid;
  ~ReapOnExit() {
    if (*pid > 0 && waitpid(*pid, nullptr, WNOHANG) == 0) {
      kill(*pid, SIGKILL);
      waitpid(*pid, nullptr, 0);
    }
  }
};

// A worker daemon stand-in: registers, holds a Session, records what the coordinator sends.
class FakeWorker {
 public:
  FakeWorker(std::shared_ptr<grpc::Channel> ch, std::string id) : ch_(ch), id_(std::move(id)) {}
  ~FakeWorker() { Close(); }

  bool Connect(const std::vector<v1::RunningRank>& running) {
    auto stub = v1::ClusterService::NewStub(ch_);
    v1::RegisterRequest req;
    req.set_worker_id(id_);
    req.set_hostname("localhost");
    auto* d = req.add_devices();
    d->set_kind("cpu");
    d->set_count(2);
    d->set_memory_bytes(int64_t{4} << 30);
    v1::RegisterResponse resp;
    grpc::ClientContext rctx;
    rctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    // Right after a coordinator restart the channel may still be noticing that the old
    // connection died: wait for it to be ready instead of failing fast.
    rctx.set_wait_for_ready(true);
    if (!stub->Register(&rctx, req, &resp).ok()) return false;
    ctx_ = std::make_unique<grpc::ClientContext>();
    stub_ = std::move(stub);
    stream_ = stub_->Session(ctx_.get());
    v1::WorkerMessage hello;
    hello.mutable_hello()->set_worker_id(id_);
    for (const auto& r : running) *hello.mutable_hello()->add_running() = r;
    if (!stream_->Write(hello)) return false;
    reader_ = std::thread([this]() {
      v1::CoordinatorMessage m;
      while (stream_->Read(&m)) {
        absl::MutexLock l(&mu_);
        received_.push_back(m);
      }
    });
    return true;
  }
  void Close() {
    if (!stream_) return;
    ctx_->TryCancel();
    reader_.join();
    stream_->Finish().IgnoreError();
    stream_.reset();
  }
  bool Send(const v1::WorkerMessage& m) {
    absl::MutexLock l(&write_mu_);
    return stream_->Write(m);
  }
  // Waits for the next coordinator message matching `pred`.
  template <typename P>
  bool WaitFor(P pred, v1::CoordinatorMessage* out, absl::Duration timeout = absl::Seconds(10)) {
    absl::MutexLock l(&mu_);
    auto ready = [&]() {
      for (const auto& m : received_)
        if (pred(m)) return true;
      return false;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) return false;
    for (auto it = received_.begin(); it != received_.end(); ++it) {
      if (pred(*it)) {
        *out = *it;
        received_.erase(it);
        return true;
      }
    }
    return false;
  }

 private:
  std::shared_ptr<grpc::Channel> ch_;
  std::string id_;
  std::unique_ptr<v1::ClusterService::Stub> stub_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream_;
  std::thread reader_;
  absl::Mutex write_mu_;
  absl::Mutex mu_;
  std::deque<v1::CoordinatorMessage> received_ ABSL_GUARDED_BY(mu_);
};

v1::WorkerMessage Progress(const v1::RankRef& ref, int64_t step) {
  v1::WorkerMessage m;
  *m.mutable_rank_progress()->mutable_ref() = ref;
  m.mutable_rank_progress()->set_step(step);
  m.mutable_rank_progress()->set_total_steps(10);
  m.mutable_rank_progress()->set_loss(4.0);
  return m;
}
v1::WorkerMessage ExitOk(const v1::RankRef& ref) {
  v1::WorkerMessage m;
  *m.mutable_rank_exit()->mutable_ref() = ref;
  return m;
}

v1::Job GetJob(const std::shared_ptr<grpc::Channel>& ch, const std::string& id) {
  v1::GetJobRequest req;
  req.set_job_id(id);
  v1::Job j;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::JobService::NewStub(ch)->Get(&ctx, req, &j);
  return j;
}

bool WaitState(const std::shared_ptr<grpc::Channel>& ch, const std::string& id, v1::JobState s) {
  for (int i = 0; i < 100; ++i) {
    if (GetJob(ch, id).state() == s) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

constexpr char kSpec[] = R"({"name": "it", "model": {"preset": "tiny"},
  "data": {"source": "synthetic:recall"}, "seq_len": 256, "parallel": {"cp": 2, "dp": 1},
  "train": {"steps": 10}, "resources": "cpu"})";

TEST(CoordinatorSessionTest, RunsJobAndReadoptsRanksAfterSigkill) {
  if (std::string(SPINDLE_COORDINATOR_BINARY).empty()) GTEST_SKIP() << "no coordinator binary";
  const std::string dir = (std::filesystem::temp_directory_path() /
                           absl::StrCat("spindle-it-", getpid())).string();
  std::filesystem::create_directories(dir);
  const std::string db = dir + "/c.db";
  const int port = FreePort();
  pid_t coord = StartCoordinator(db, port);
  ReapOnExit reap{&coord};
  auto ch = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                grpc::InsecureChannelCredentials());
  ASSERT_TRUE(ch->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));

  FakeWorker w(ch, "fake-1");
  ASSERT_TRUE(w.Connect({}));
  auto submit = [&]() {
    v1::SubmitJobRequest req;
    req.set_spec_json(kSpec);
    v1::SubmitJobResponse resp;
    grpc::ClientContext ctx;
    grpc::Status st = v1::JobService::NewStub(ch)->Submit(&ctx, req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return resp.job_id();
  };

  // 1. A job runs to success.
  const std::string a = submit();
  v1::CoordinatorMessage m;
  std::vector<v1::RankRef> refs;
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(w.WaitFor([](const auto& x) { return x.has_assignment(); }, &m));
    EXPECT_EQ(m.assignment().job().plan().world(), 2);
    // No --advertise: the worker reaches the rendezvous at the address it dials.
    EXPECT_EQ(m.assignment().rendezvous_address(), "");
    EXPECT_EQ(m.assignment().host_address(), "127.0.0.1");
    refs.push_back(m.assignment().ref());
  }
  for (const auto& ref : refs) ASSERT_TRUE(w.Send(Progress(ref, 1)));
  ASSERT_TRUE(WaitState(ch, a, v1::JOB_STATE_RUNNING));
  for (const auto& ref : refs) ASSERT_TRUE(w.Send(ExitOk(ref)));
  ASSERT_TRUE(WaitState(ch, a, v1::JOB_STATE_SUCCEEDED));

  // 2. A second job is running when the coordinator is killed.
  const std::string b = submit();
  refs.clear();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(w.WaitFor([](const auto& x) { return x.has_assignment(); }, &m));
    refs.push_back(m.assignment().ref());
  }
  for (const auto& ref : refs) ASSERT_TRUE(w.Send(Progress(ref, 4)));
  ASSERT_TRUE(WaitState(ch, b, v1::JOB_STATE_RUNNING));
  kill(coord, SIGKILL);
  waitpid(coord, nullptr, 0);
  w.Close();

  coord = StartCoordinator(db, port);
  ASSERT_TRUE(ch->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)));
  std::vector<v1::RunningRank> running;
  for (const auto& ref : refs) {
    v1::RunningRank rr;
    *rr.mutable_ref() = ref;
    rr.set_step(4);
    running.push_back(rr);
  }
  FakeWorker w2(ch, "fake-1");
  ASSERT_TRUE(w2.Connect(running));
  v1::Job jb = GetJob(ch, b);
  EXPECT_EQ(jb.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(jb.attempt(), 1);
  EXPECT_EQ(jb.restarts(), 0);
  EXPECT_EQ(GetJob(ch, a).state(), v1::JOB_STATE_SUCCEEDED);
  for (const auto& ref : refs) ASSERT_TRUE(w2.Send(Progress(ref, 5)));
  for (const auto& ref : refs) ASSERT_TRUE(w2.Send(ExitOk(ref)));
  ASSERT_TRUE(WaitState(ch, b, v1::JOB_STATE_SUCCEEDED));
  EXPECT_EQ(GetJob(ch, b).attempt(), 1);

  // 3. The worker goes silent: its gang restarts (and, with nowhere to go, waits).
  const std::string c = submit();
  for (int r = 0; r < 2; ++r)
    ASSERT_TRUE(w2.WaitFor([](const auto& x) { return x.has_assignment(); }, &m));
  w2.Close();
  ASSERT_TRUE(WaitState(ch, c, v1::JOB_STATE_RESTARTING));
  EXPECT_NE(GetJob(ch, c).message().find("worker fake-1 lost (no heartbeat for"),
            std::string::npos)
      << GetJob(ch, c).message();

  kill(coord, SIGTERM);
  int status = 0;
  waitpid(coord, &status, 0);
  coord = 0;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace spindle
