// MonitoredJobStore: a JobStore that passes every call to the store it wraps and watches its
// writes, so that a failing or stalled store is visible without waiting behind it: each failed
// write counts in spindle_store_errors_total, and Healthy() (read by the coordinator's health
// service, never blocked by a write in progress) is false while the last write failed or a write
// has been running longer than the stall limit.
// Thread-safety: thread-safe; its own mutex is never held across a call into the wrapped store.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/job_store.h"

namespace spindle {

class Counter;

class MonitoredJobStore : public JobStore {
 public:
  // `base` and `errors` (may be null) are not owned and must outlive this store.
  MonitoredJobStore(JobStore* base, Counter* errors, absl::Duration stall_limit)
      : base_(base), errors_(errors), stall_limit_(stall_limit) {}

  // True unless the last finished write failed or a write has run past the stall limit.
  bool Healthy() const ABSL_LOCKS_EXCLUDED(mu_);
  // Why not Healthy ("" when healthy).
  std::string Problem() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t errors() const ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status CreateJob(JobRecord* job, const EventRecord& event) override;
  absl::Status SaveJob(const JobRecord& job, const EventRecord* event = nullptr,
                       const AttemptRecord* attempt = nullptr) override;
  absl::StatusOr<std::vector<JobRecord>> LoadJobs() override { return base_->LoadJobs(); }
  absl::StatusOr<std::vector<EventRecord>> LoadEvents(const std::string& job_id) override {
    return base_->LoadEvents(job_id);
  }
  absl::StatusOr<AttemptRecord> LoadAttempt(const std::string& job_id, int64_t attempt) override {
    return base_->LoadAttempt(job_id, attempt);
  }
  absl::Status DeleteJobs(const std::vector<std::string>& job_ids) override;
  absl::Status SaveWorker(const WorkerRecord& worker) override;
  absl::StatusOr<std::vector<WorkerRecord>> LoadWorkers() override { return base_->LoadWorkers(); }

 private:
  // Brackets one write of the wrapped store.
  void Begin() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status End(absl::Status s) ABSL_LOCKS_EXCLUDED(mu_);

  JobStore* const base_;
  Counter* const errors_;
  const absl::Duration stall_limit_;
  mutable absl::Mutex mu_;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time oldest_start_ ABSL_GUARDED_BY(mu_);  // of the writes in flight (approximately)
  bool failing_ ABSL_GUARDED_BY(mu_) = false;
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  int64_t error_count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace spindle
