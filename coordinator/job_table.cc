// The job manager's shared state: lookups and the invariants of a job's kept events (see
// job_table.h).
#include "coordinator/job_table.h"

#include <cstdio>

namespace spindle {

JobRuntime* JobTable::Find(const std::string& job_id) {
  auto it = jobs.find(job_id);
  return it == jobs.end() ? nullptr : it->second.get();
}

const JobRuntime* JobTable::Find(const std::string& job_id) const {
  auto it = jobs.find(job_id);
  return it == jobs.end() ? nullptr : it->second.get();
}

void AddEvent(JobRuntime& j, EventRecord ev) {
  j.events.push_back(std::move(ev));
  if (static_cast<int64_t>(j.events.size()) > kMaxEventsPerJob) {
    const int64_t drop = static_cast<int64_t>(j.events.size()) - kMaxEventsPerJob;
    j.events.erase(j.events.begin(), j.events.begin() + drop);
    j.events_dropped += drop;
  }
}

void LogCoordinatorLine(const std::string& line) {
  std::fprintf(stderr, "coordinator: %s\n", line.c_str());
}

}  // namespace spindle
