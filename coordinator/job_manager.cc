// The job manager's facade: each call takes the table's mutex, runs the parts (admission,
// lifecycle, placement, worker sessions) under it, and sends what they queued once it is released
// (see job_manager.h).
#include "coordinator/job_manager.h"

#include <limits>
#include <optional>
#include <utility>

#include "common/job_spec.h"
#include "common/status.h"

namespace spindle {

JobManager::JobManager(JobStore* store, const Clock* clock, WorkerChannel* channel,
                       RendezvousStore* rendezvous, JobManagerOptions options,
                       JobManagerMetrics metrics)
    : store_(store),
      clock_(clock),
      channel_(channel),
      options_(std::move(options)),
      metrics_(metrics),
      health_(HealthOptions{options_.heartbeat_interval_ms, options_.heartbeat_timeout_ms,
                            options_.hang_timeout_ms, options_.start_timeout_ms,
                            options_.silence_timeout_ms, options_.stop_grace_ms}),
      table_(store, clock, options_.registry, options_.rendezvous_address),
      admission_(store, clock, &planner_, metrics_.jobs_submitted),
      lifecycle_(store, clock, rendezvous, &planner_, &health_, &options_, &metrics_),
      placement_(clock, rendezvous, &planner_, &admission_, &lifecycle_,
                 metrics_.scheduling_latency_seconds),
      sessions_(store, clock, rendezvous, &health_, &options_, &metrics_, &lifecycle_,
                &placement_) {}

JobManager::~JobManager() = default;

void JobManager::SetRendezvousAddress(const std::string& address) {
  absl::MutexLock l(&table_.mu);
  table_.rendezvous_address = address;
}

void JobManager::Flush(Outbox& out) {
  for (auto& [worker, msg] : out.messages) channel_->Send(worker, msg);
  out.messages.clear();
}

absl::Status JobManager::Recover() {
  ASSIGN_OR_RETURN(std::vector<JobRecord> jobs, store_->LoadJobs());
  absl::MutexLock l(&table_.mu);
  return lifecycle_.Recover(table_, std::move(jobs));
}

// --- Client API -----------------------------------------------------------------------------

absl::StatusOr<std::string> JobManager::Submit(const std::string& spec_json, CpPlan* plan_out,
                                               const std::string& request_id,
                                               const std::string& owner) {
  // Checked before the mutex (resolving the checkpoint directory reads the filesystem).
  ASSIGN_OR_RETURN(SubmitRequest req, JobAdmission::ParseSubmit(spec_json, request_id, owner));
  Outbox out;
  std::string job_id;
  {
    absl::MutexLock l(&table_.mu);
    ASSIGN_OR_RETURN(SubmitResult result, admission_.Submit(table_, req, plan_out));
    job_id = std::move(result.job_id);
    if (result.created) placement_.Schedule(table_, &out);
  }
  Flush(out);
  return job_id;
}

absl::Status JobManager::PlanSpec(const std::string& spec_json, CpPlan* plan_out) {
  ASSIGN_OR_RETURN(JobSpec spec, ParseJobSpec(spec_json));
  absl::MutexLock l(&table_.mu);
  admission_.PlanSpec(table_, spec, plan_out);
  return absl::OkStatus();
}

absl::Status JobManager::GetJob(const std::string& job_id, bool with_events, JobView* out,
                                const EventPageRequest& page) {
  absl::MutexLock l(&table_.mu);
  return lifecycle_.GetJob(table_, job_id, with_events, out, page);
}

std::vector<JobView> JobManager::ListJobs(const std::set<JobState>& states, int limit) {
  std::vector<JobView> out;
  std::string next;
  ListJobPage(states, limit > 0 ? limit : std::numeric_limits<int>::max(), "", &out, &next)
      .IgnoreError();  // the first page's token cannot be wrong
  return out;
}

absl::Status JobManager::ListJobPage(const std::set<JobState>& states, int page_size,
                                     const std::string& page_token, std::vector<JobView>* jobs,
                                     std::string* next_page_token, const std::string* owner) {
  absl::MutexLock l(&table_.mu);
  return lifecycle_.ListJobPage(table_, states, page_size, page_token, jobs, next_page_token,
                                owner);
}

absl::Status JobManager::WaitJob(const std::string& job_id, uint64_t* version, size_t* events_seen,
                                 absl::Duration max_wait, JobView* out,
                                 std::vector<EventRecord>* new_events) {
  absl::MutexLock l(&table_.mu);
  return lifecycle_.WaitJob(table_, job_id, version, events_seen, max_wait, out, new_events);
}

absl::Status JobManager::Cancel(const std::string& job_id, const std::string& reason, JobView* out,
                                const User* by) {
  Outbox box;
  {
    absl::MutexLock l(&table_.mu);
    sessions_.SyncHeardLocked(table_);
    ASSIGN_OR_RETURN(const bool cancelled,
                     lifecycle_.Cancel(table_, job_id, reason, by, out, &box));
    if (cancelled) placement_.Schedule(table_, &box);  // its devices may be free
  }
  Flush(box);
  return absl::OkStatus();
}

std::vector<WorkerView> JobManager::ListWorkers() {
  absl::MutexLock l(&table_.mu);
  return table_.registry.Views();
}

// --- Worker API -----------------------------------------------------------------------------

void JobManager::HeardFrom(const std::string& worker_id) { sessions_.HeardFrom(worker_id); }

absl::Status JobManager::CheckHello(const WorkerHello& hello) {
  absl::MutexLock l(&table_.mu);
  return sessions_.CheckHello(table_, hello);
}

absl::StatusOr<RegistrationReply> JobManager::RegisterWorker(const WorkerRegistration& reg) {
  absl::MutexLock l(&table_.mu);
  return sessions_.RegisterWorker(table_, reg);
}

absl::Status JobManager::SessionOpened(const WorkerHello& hello, uint64_t session_id) {
  Outbox out;
  {
    absl::MutexLock l(&table_.mu);
    RETURN_IF_ERROR(sessions_.SessionOpened(table_, hello, session_id, &out));
  }
  Flush(out);
  return absl::OkStatus();
}

void JobManager::SessionClosed(const std::string& worker_id, uint64_t session_id) {
  absl::MutexLock l(&table_.mu);
  sessions_.SessionClosed(table_, worker_id, session_id);
}

void JobManager::WorkerRevoked(const std::string& worker_id, const std::string& by) {
  absl::MutexLock l(&table_.mu);
  sessions_.WorkerRevoked(table_, worker_id, by);
}

void JobManager::HandleWorkerMessage(const std::string& worker_id, const WorkerReport& report) {
  Outbox out;
  {
    absl::MutexLock l(&table_.mu);
    sessions_.HandleWorkerMessage(table_, worker_id, report, &out);
  }
  Flush(out);
}

// --- Periodic work --------------------------------------------------------------------------

void JobManager::Tick() {
  Outbox out;
  {
    absl::MutexLock l(&table_.mu);
    sessions_.SyncHeardLocked(table_);
    const int64_t now = clock_->SteadyMs();
    lifecycle_.TickJobs(table_, now, &out);
    sessions_.MarkLostWorkers(table_, now, &out);
    table_.registry.FreeDrained(now);
    placement_.Schedule(table_, &out);
  }
  Flush(out);
}

absl::StatusOr<int64_t> JobManager::PruneFinishedJobs() {
  absl::MutexLock l(&table_.mu);
  return lifecycle_.PruneFinishedJobs(table_);
}

std::map<JobState, int64_t> JobManager::JobCounts() const {
  absl::MutexLock l(&table_.mu);
  std::map<JobState, int64_t> out;
  for (JobState s : kAllJobStates) out[s] = 0;
  for (const auto& [id, j] : table_.jobs) ++out[j->rec.state];
  return out;
}

std::map<std::string, int64_t> JobManager::JobWorlds() const {
  absl::MutexLock l(&table_.mu);
  std::map<std::string, int64_t> out;
  for (const auto& [id, j] : table_.jobs)
    if (!IsTerminal(j->rec.state)) out[id] = j->spec.parallel.world();
  return out;
}

std::map<std::string, double> JobManager::JobGoodputs() const {
  absl::MutexLock l(&table_.mu);
  std::map<std::string, double> out;
  const int64_t now = clock_->SteadyMs();
  for (const auto& [id, j] : table_.jobs)
    if (const std::optional<double> g = j->goodput.Goodput(now)) out[id] = *g;
  return out;
}

std::map<std::string, int64_t> JobManager::WorkerCounts() const {
  absl::MutexLock l(&table_.mu);
  return table_.registry.StateCounts();
}

std::map<std::string, int64_t> JobManager::DeviceCounts() const {
  absl::MutexLock l(&table_.mu);
  return table_.registry.DeviceCounts();
}

}  // namespace spindle
