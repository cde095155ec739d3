// Helpers shared by the control-plane tests: temporary directories, job spec JSON, a recording
// WorkerChannel, and the job manager driven in wire types through the conversions the gRPC
// services use (worker_proto.h, job_proto.h). Test-only; not thread-safe unless stated.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/job_manager.h"
#include "coordinator/job_proto.h"
#include "coordinator/worker_channel.h"
#include "coordinator/worker_proto.h"
#include "planner/plan_proto.h"
#include "spindle/v1/cluster.pb.h"
#include "spindle/v1/job.pb.h"

namespace spindle::testing {

// A fresh directory under TMPDIR, removed at destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "spindle-test-XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string File(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// A spec for the planner alone: d_model 64, 8 layers (7 Lightning, 1 MLA: "LLLLLLLM"), MLA's
// default sizes (kv_lora 32, qk_nope = qk_rope = v_head = 16: the latent is 48 values a token,
// K and V of one head 48), `heads` heads, cp and seq_len as given.
// The spec an assignment's ranks run (its PlannedJob's); an empty spec when it carries none.
inline JobSpec RunSpecOf(const v1::Assignment& a) {
  absl::StatusOr<PlannedJob> job = PlannedJobFromProto(a.job());
  return job.ok() ? job->spec : JobSpec{};
}

inline JobSpec PlannerSpec(int64_t cp, int64_t heads, int64_t seq_len) {
  JobSpec s;
  s.model.d_model = 64;
  s.model.n_heads = heads;
  s.model.n_layers = 8;
  s.seq_len = seq_len;
  s.parallel.cp = cp;
  return s;
}

// A valid tiny CPU job spec with the given world and priority.
inline std::string SpecJson(int64_t cp = 1, int64_t dp = 1, int64_t priority = 0,
                            int64_t max_restarts = 3, const std::string& extra_parallel = "") {
  return absl::StrCat(R"({"name": "t", "model": {"preset": "tiny"},
    "data": {"source": "synthetic:recall"}, "seq_len": 256,
    "parallel": {"cp": )", cp, R"(, "dp": )", dp, extra_parallel, R"(},
    "train": {"steps": 10}, "checkpoint": {"dir": "/tmp/ck", "every": 5},
    "resources": "cpu", "max_restarts": )", max_restarts, R"(, "priority": )", priority, "}");
}

// `spec` (from SpecJson) with its checkpoint directory changed to `dir`: unfinished jobs may not
// share one.
inline std::string WithCheckpointDir(std::string spec, const std::string& dir) {
  spec.replace(spec.find("\"/tmp/ck\""), 9, "\"" + dir + "\"");
  return spec;
}

// Records every command the manager sends, in its wire form. Thread-safe.
class FakeWorkerChannel : public WorkerChannel {
 public:
  bool Send(const std::string& worker_id, const WorkerCommand& command) override {
    v1::CoordinatorMessage msg;
    CommandToProto(command, &msg);
    absl::MutexLock l(&mu_);
    sent_.emplace_back(worker_id, std::move(msg));
    return true;
  }
  std::vector<std::pair<std::string, v1::CoordinatorMessage>> Take() {
    absl::MutexLock l(&mu_);
    return std::exchange(sent_, {});
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<std::string, v1::CoordinatorMessage>> sent_ ABSL_GUARDED_BY(mu_);
};

// A session's messages, as the Session handler passes them on.
// A worker's registration with one CPU slot of 8 GiB.
inline v1::RegisterRequest OneCpuSlotWorker(const std::string& worker_id,
                                            const std::string& hostname) {
  v1::RegisterRequest reg;
  reg.set_worker_id(worker_id);
  reg.set_hostname(hostname);
  v1::DeviceGroup* d = reg.add_devices();
  d->set_kind("cpu");
  d->set_count(1);
  d->set_memory_bytes(int64_t{8} << 30);
  return reg;
}

inline absl::Status OpenSession(JobManager& m, const v1::SessionHello& hello, uint64_t session) {
  return m.SessionOpened(HelloFromProto(hello), session);
}
inline void Deliver(JobManager& m, const std::string& worker_id, const v1::WorkerMessage& msg) {
  if (std::optional<WorkerReport> report = ReportFromProto(msg))
    m.HandleWorkerMessage(worker_id, *report);
}

// A job as the Get RPC returns it.
inline absl::Status GetJobProto(JobManager& m, const std::string& job_id, bool with_events,
                                v1::Job* out) {
  JobView view;
  absl::Status st = m.GetJob(job_id, with_events, &view);
  if (st.ok()) JobViewToProto(view, out);
  return st;
}

}  // namespace spindle::testing
