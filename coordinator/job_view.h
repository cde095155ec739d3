// JobView: what the job manager tells a client about one job (the client API's answer to Get,
// List, Watch and Cancel): its stored record, decoded plan, each rank's last report, the job's
// progress summarised over its ranks, and optionally one page of its events (EventPageRequest).
// job_proto.h converts it to spindle.v1.Job. Plain data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "planner/cp_planner.h"
#include "coordinator/job_store.h"
#include "coordinator/moe_summary.h"

namespace spindle {

// One rank of the current attempt, as its worker last reported it.
struct RankView {
  RankPlacement placement;
  std::string state;  // assigned | running | exited | stopped
  int64_t step = 0;
  double loss = 0, tokens_per_s = 0, lr = 0, grad_norm = 0, elapsed_s = 0, mfu = 0;
  double memory_bytes = 0;
  int32_t exit_code = 0;
  int64_t last_report_unix_ms = 0;
  MoeSummary moe;
};

// Which of a job's events a Get returns: kept events (the newest kMaxEventsPerJob) oldest first,
// from the position `page_token` names ("": the oldest kept), at most `page_size` (0: 100; more
// than 1000: 1000).
struct EventPageRequest {
  int page_size = 0;
  std::string page_token;
};
inline constexpr int kDefaultEventPageSize = 100;
inline constexpr int kMaxEventPageSize = 1000;

struct JobView {
  JobRecord record;  // record.plan: the stored encoding; `plan` is it decoded
  CpPlan plan;
  int64_t total_steps = 0;
  int64_t step = 0;          // the lowest rank's step (the final step once finished)
  double loss = 0;           // of that step
  double tokens_per_s = 0;   // summed over running ranks
  double mfu = 0;            // averaged over running ranks that report it
  double eta_s = -1;         // -1: unknown
  double goodput = -1;       // coordinator/goodput.h; -1: unknown (no step reported yet)
  MoeSummary moe;            // of the step shown (the lowest rank's)
  std::vector<RankView> ranks;
  std::vector<EventRecord> events;     // empty unless asked for; one page (JobManager::GetJob)
  std::string next_events_page_token;  // "" after the last page
};

}  // namespace spindle
