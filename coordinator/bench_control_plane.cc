// bench_control_plane: latency of the coordinator's control plane with 100 simulated workers
// and a long queue. An in-process coordinator on 127.0.0.1 (real gRPC, real SQLite file with
// fsync'd commits); 100 workers hold Session streams and heartbeat every 100 ms while we time,
// over gRPC: Submit (durable insert + plan + checkpoint-directory check + schedule) of N jobs
// (default 10,000; `bench_control_plane N`), each with a checkpoint directory of its own, 50 of
// them placed and the rest queued; List of one page (the default 100 jobs) with N jobs stored;
// and the coordinator-side cost of handling one heartbeat (timed in-process around
// JobManager::HandleWorkerMessage while the 100 streams keep heartbeating). Prints p50/p99 as a
// table (bench/NOTES.md records it).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/coordinator_server.h"
#include "grpcpp/create_channel.h"
#include "spindle/v1/cluster.grpc.pb.h"
#include "spindle/v1/job.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Stats {
  double p50, p99, mean;
};
Stats Summarize(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  double sum = 0;
  for (double v : us) sum += v;
  return {us[us.size() / 2], us[std::min(us.size() - 1, us.size() * 99 / 100)], sum / us.size()};
}

}  // namespace

int main(int argc, char** argv) {
  const int kWorkers = 100, kLists = 200, kBeats = 5000;
  const int kSubmits = argc > 1 ? std::max(1, std::atoi(argv[1])) : 10000;
  const std::string dir = (std::filesystem::temp_directory_path() / "spindle-bench-cp").string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  spindle::CoordinatorConfig cfg;
  cfg.listen = "127.0.0.1:0";
  cfg.db_path = dir + "/bench.db";
  cfg.manager.heartbeat_timeout_ms = 60000;
  auto server = spindle::CoordinatorServer::Start(cfg);
  if (!server.ok()) {
    std::fprintf(stderr, "bench: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  auto ch = grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->client_port()),
                                grpc::InsecureChannelCredentials());
  auto cluster = spindle::v1::ClusterService::NewStub(ch);

  // 100 workers with one CPU slot each, heartbeating on their sessions.
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;
  for (int i = 0; i < kWorkers; ++i) {
    workers.emplace_back([&, i]() {
      const std::string id = absl::StrCat("w", i);
      spindle::v1::RegisterRequest req;
      req.set_worker_id(id);
      auto* d = req.add_devices();
      d->set_kind("cpu");
      d->set_count(1);
      d->set_memory_bytes(int64_t{8} << 30);
      spindle::v1::RegisterResponse resp;
      grpc::ClientContext rctx;
      if (!cluster->Register(&rctx, req, &resp).ok()) return;
      grpc::ClientContext ctx;
      auto stream = cluster->Session(&ctx);
      spindle::v1::WorkerMessage m;
      m.mutable_hello()->set_worker_id(id);
      stream->Write(m);
      std::thread reader([&]() {
        spindle::v1::CoordinatorMessage in;
        while (stream->Read(&in)) {
        }
      });
      while (!stop) {
        spindle::v1::WorkerMessage hb;
        hb.mutable_heartbeat()->set_unix_ms(0);
        if (!stream->Write(hb)) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      ctx.TryCancel();
      reader.join();
      stream->Finish().IgnoreError();
    });
  }
  std::this_thread::sleep_for(std::chrono::seconds(2));

  auto jobs = spindle::v1::JobService::NewStub(ch);
  std::vector<double> submit_us, list_us, beat_us;
  for (int i = 0; i < kSubmits; ++i) {
    spindle::v1::SubmitJobRequest req;
    req.set_spec_json(
        absl::StrCat(R"({"name": "b)", i,
                     R"(", "model": {"preset": "tiny"}, "data": {"source": "synthetic:recall"},
        "seq_len": 256, "parallel": {"cp": 2, "dp": 1}, "train": {"steps": 10},
        "checkpoint": {"dir": ")",
                     dir, "/ck-", i, R"("}, "resources": "cpu", "priority": )", i % 5, "}"));
    req.set_request_id(absl::StrCat("bench-", i));
    spindle::v1::SubmitJobResponse resp;
    grpc::ClientContext ctx;
    auto t0 = Clock::now();
    grpc::Status st = jobs->Submit(&ctx, req, &resp);
    submit_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    if (!st.ok()) std::fprintf(stderr, "submit: %s\n", st.error_message().c_str());
    if ((i + 1) % 2000 == 0) std::fprintf(stderr, "bench: %d jobs submitted\n", i + 1);
  }
  // The last tenth: submits into a store that already holds 90% of the jobs.
  const std::vector<double> late_submit_us(submit_us.end() - std::max(1, kSubmits / 10),
                                           submit_us.end());
  for (int i = 0; i < kLists; ++i) {
    spindle::v1::ListJobsResponse resp;
    grpc::ClientContext ctx;
    auto t0 = Clock::now();
    grpc::Status st = jobs->List(&ctx, spindle::v1::ListJobsRequest(), &resp);
    if (!st.ok() || resp.jobs_size() != std::min(kSubmits, 100))
      std::fprintf(stderr, "list: %s, %d jobs\n", st.error_message().c_str(), resp.jobs_size());
    list_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  spindle::JobManager* mgr = (*server)->manager();
  for (int i = 0; i < kBeats; ++i) {
    const spindle::WorkerReport hb = spindle::HeartbeatReport{};
    auto t0 = Clock::now();
    mgr->HandleWorkerMessage(absl::StrCat("w", i % kWorkers), hb);
    beat_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  stop = true;
  for (auto& t : workers) t.join();
  (*server)->Shutdown();

  std::printf("control plane, %d workers heartbeating every 100 ms, %d jobs stored (%d queued)\n",
              kWorkers, kSubmits, std::max(0, kSubmits - kWorkers / 2));
  std::printf("| %-44s | %6s | %8s | %8s | %8s |\n", "operation", "n", "p50 us", "p99 us",
              "mean us");
  std::printf("|%s|%s|%s|%s|%s|\n", std::string(46, '-').c_str(), std::string(8, '-').c_str(),
              std::string(10, '-').c_str(), std::string(10, '-').c_str(),
              std::string(10, '-').c_str());
  auto row = [](const std::string& name, const std::vector<double>& v) {
    Stats s = Summarize(v);
    std::printf("| %-44s | %6zu | %8.1f | %8.1f | %8.1f |\n", name.c_str(), v.size(), s.p50,
                s.p99, s.mean);
  };
  row("Submit, every one (gRPC, fsync'd SQLite)", submit_us);
  row(absl::StrCat("Submit, the last ", late_submit_us.size(), " (",
                   kSubmits - late_submit_us.size(), "+ stored)"),
      late_submit_us);
  row("List, one page of 100 (gRPC)", list_us);
  row("heartbeat handling (in-process)", beat_us);
  std::filesystem::remove_all(dir);
  return 0;
}
