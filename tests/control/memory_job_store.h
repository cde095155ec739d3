// Test stores: MemoryJobStore, the JobStore contract in memory (fast unit tests of the job
// manager, no files), and FaultInjectingJobStore, a wrapper that fails, or "crashes" at, one
// chosen write of the store it wraps (the leveldb fault-injection style): writes are counted from
// 1; at write `at` a kFail fault returns Unavailable and changes nothing, and a kCrash fault does
// the same and fails every later write too (the process is gone; the test then reopens the store).
// Test-only. Thread-safe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/job_store.h"

namespace spindle::testing {

class MemoryJobStore : public JobStore {
 public:
  absl::Status CreateJob(JobRecord* job, const EventRecord& event) override {
    absl::MutexLock l(&mu_);
    job->seq = ++last_seq_;
    job->job_id = absl::StrFormat("j-%06d", job->seq);
    jobs_[job->job_id] = *job;
    EventRecord e = event;
    e.job_id = job->job_id;
    events_[job->job_id].push_back(e);
    return absl::OkStatus();
  }
  absl::Status SaveJob(const JobRecord& job, const EventRecord* event,
                       const AttemptRecord* attempt) override {
    absl::MutexLock l(&mu_);
    if (!jobs_.count(job.job_id))
      return absl::NotFoundError(absl::StrCat("job ", job.job_id, " not stored"));
    jobs_[job.job_id] = job;
    if (event) {
      std::vector<EventRecord>& ev = events_[job.job_id];
      ev.push_back(*event);
      if (static_cast<int64_t>(ev.size()) > kMaxEventsPerJob) ev.erase(ev.begin());
    }
    if (attempt) attempts_[{attempt->job_id, attempt->attempt}] = *attempt;
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<JobRecord>> LoadJobs() override {
    absl::MutexLock l(&mu_);
    std::vector<JobRecord> out;
    for (const auto& [id, j] : jobs_) out.push_back(j);
    std::sort(out.begin(), out.end(),
              [](const JobRecord& a, const JobRecord& b) { return a.seq < b.seq; });
    return out;
  }
  absl::StatusOr<std::vector<EventRecord>> LoadEvents(const std::string& job_id) override {
    absl::MutexLock l(&mu_);
    auto it = events_.find(job_id);
    return it == events_.end() ? std::vector<EventRecord>{} : it->second;
  }
  absl::StatusOr<AttemptRecord> LoadAttempt(const std::string& job_id, int64_t attempt) override {
    absl::MutexLock l(&mu_);
    auto it = attempts_.find({job_id, attempt});
    if (it == attempts_.end())
      return absl::NotFoundError(absl::StrCat("attempt ", attempt, " of job ", job_id));
    return it->second;
  }
  absl::Status DeleteJobs(const std::vector<std::string>& job_ids) override {
    absl::MutexLock l(&mu_);
    for (const std::string& id : job_ids) {
      jobs_.erase(id);
      events_.erase(id);
      for (auto it = attempts_.begin(); it != attempts_.end();)
        it = it->first.first == id ? attempts_.erase(it) : std::next(it);
    }
    return absl::OkStatus();
  }
  absl::Status SaveWorker(const WorkerRecord& worker) override {
    absl::MutexLock l(&mu_);
    workers_[worker.worker_id] = worker;
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<WorkerRecord>> LoadWorkers() override {
    absl::MutexLock l(&mu_);
    std::vector<WorkerRecord> out;
    for (const auto& [id, w] : workers_) out.push_back(w);
    return out;
  }

 private:
  absl::Mutex mu_;
  int64_t last_seq_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, JobRecord> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<EventRecord>> events_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, int64_t>, AttemptRecord> attempts_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, WorkerRecord> workers_ ABSL_GUARDED_BY(mu_);
};

class FaultInjectingJobStore : public JobStore {
 public:
  enum class Fault { kNone, kFail, kCrash };
  // `base` is not owned.
  FaultInjectingJobStore(JobStore* base, Fault fault, int64_t at)
      : base_(base), fault_(fault), at_(at) {}

  // Writes attempted so far (the faulted ones included).
  int64_t writes() {
    absl::MutexLock l(&mu_);
    return writes_;
  }
  // True once the fault has fired.
  bool fired() {
    absl::MutexLock l(&mu_);
    return fired_;
  }

  absl::Status CreateJob(JobRecord* job, const EventRecord& event) override {
    if (absl::Status s = Write(); !s.ok()) return s;
    return base_->CreateJob(job, event);
  }
  absl::Status SaveJob(const JobRecord& job, const EventRecord* event,
                       const AttemptRecord* attempt) override {
    if (absl::Status s = Write(); !s.ok()) return s;
    return base_->SaveJob(job, event, attempt);
  }
  absl::Status DeleteJobs(const std::vector<std::string>& job_ids) override {
    if (absl::Status s = Write(); !s.ok()) return s;
    return base_->DeleteJobs(job_ids);
  }
  absl::Status SaveWorker(const WorkerRecord& worker) override {
    if (absl::Status s = Write(); !s.ok()) return s;
    return base_->SaveWorker(worker);
  }
  absl::StatusOr<std::vector<JobRecord>> LoadJobs() override { return base_->LoadJobs(); }
  absl::StatusOr<std::vector<EventRecord>> LoadEvents(const std::string& job_id) override {
    return base_->LoadEvents(job_id);
  }
  absl::StatusOr<AttemptRecord> LoadAttempt(const std::string& job_id, int64_t attempt) override {
    return base_->LoadAttempt(job_id, attempt);
  }
  absl::StatusOr<std::vector<WorkerRecord>> LoadWorkers() override { return base_->LoadWorkers(); }

 private:
  absl::Status Write() {
    absl::MutexLock l(&mu_);
    ++writes_;
    const bool now = fault_ != Fault::kNone && writes_ == at_;
    fired_ |= now;
    if (now || (fired_ && fault_ == Fault::kCrash))
      return absl::UnavailableError(absl::StrCat("injected: write ", writes_, " failed"));
    return absl::OkStatus();
  }

  JobStore* const base_;
  const Fault fault_;
  const int64_t at_;
  absl::Mutex mu_;
  int64_t writes_ ABSL_GUARDED_BY(mu_) = 0;
  bool fired_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace spindle::testing
