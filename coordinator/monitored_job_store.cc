// MonitoredJobStore (see monitored_job_store.h).
#include "coordinator/monitored_job_store.h"

#include "absl/strings/str_cat.h"
#include "common/metrics.h"

namespace spindle {

void MonitoredJobStore::Begin() {
  absl::MutexLock l(&mu_);
  if (in_flight_++ == 0) oldest_start_ = absl::Now();
}

absl::Status MonitoredJobStore::End(absl::Status s) {
  absl::MutexLock l(&mu_);
  if (--in_flight_ > 0) oldest_start_ = absl::Now();  // the others started no earlier than now
  failing_ = !s.ok();
  if (!s.ok()) {
    ++error_count_;
    last_error_ = std::string(s.message());
    if (errors_ != nullptr) errors_->Increment();
  }
  return s;
}

bool MonitoredJobStore::Healthy() const { return Problem().empty(); }

std::string MonitoredJobStore::Problem() const {
  absl::MutexLock l(&mu_);
  if (in_flight_ > 0 && absl::Now() - oldest_start_ > stall_limit_)
    return absl::StrCat(
        "a store write has been running for ",
        absl::FormatDuration(absl::Trunc(absl::Now() - oldest_start_, absl::Milliseconds(100))));
  if (failing_) return absl::StrCat("the last store write failed: ", last_error_);
  return "";
}

int64_t MonitoredJobStore::errors() const {
  absl::MutexLock l(&mu_);
  return error_count_;
}

absl::Status MonitoredJobStore::CreateJob(JobRecord* job, const EventRecord& event) {
  Begin();
  return End(base_->CreateJob(job, event));
}

absl::Status MonitoredJobStore::SaveJob(const JobRecord& job, const EventRecord* event,
                                        const AttemptRecord* attempt) {
  Begin();
  return End(base_->SaveJob(job, event, attempt));
}

absl::Status MonitoredJobStore::DeleteJobs(const std::vector<std::string>& job_ids) {
  Begin();
  return End(base_->DeleteJobs(job_ids));
}

absl::Status MonitoredJobStore::SaveWorker(const WorkerRecord& worker) {
  Begin();
  return End(base_->SaveWorker(worker));
}

}  // namespace spindle
