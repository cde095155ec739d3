// Gang placement policy (see scheduler.h).
#include "coordinator/scheduler.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "planner/cp_planner.h"

namespace spindle {
namespace {

bool Eligible(const SchedulableJob& job, const SchedulableWorker& w) {
  return w.kind == job.kind &&
         (job.memory_bytes_per_rank == 0 || w.device_memory_bytes == 0 ||
          w.device_memory_bytes >= job.memory_bytes_per_rank);
}

// How many of the job's ranks the worker's host memory holds beside `pinned` bytes (any number
// when the job pins none or the worker's host memory is unknown).
int64_t HostRankRoom(const SchedulableJob& job, const SchedulableWorker& w, int64_t pinned) {
  if (job.host_bytes_per_rank <= 0 || w.host_memory_bytes <= 0) return job.world;
  const double room =
      kHostPinFill * static_cast<double>(w.host_memory_bytes) - static_cast<double>(pinned);
  return room <= 0 ? 0 : static_cast<int64_t>(room / static_cast<double>(job.host_bytes_per_rank));
}

// The ranks of `job` the worker can take now: free devices, within its host memory.
int64_t Room(const SchedulableJob& job, const SchedulableWorker& w) {
  return std::min<int64_t>(static_cast<int64_t>(w.free_devices.size()),
                           HostRankRoom(job, w, w.host_pinned_bytes));
}

}  // namespace

std::vector<GangPlacement> ScheduleGangs(std::vector<SchedulableJob> jobs,
                                         std::vector<SchedulableWorker> workers) {
  std::stable_sort(jobs.begin(), jobs.end(), [](const SchedulableJob& a, const SchedulableJob& b) {
    if (a.priority != b.priority) return a.priority > b.priority;
    return a.seq < b.seq;
  });
  std::vector<GangPlacement> out;
  std::set<std::string> blocked_kinds;
  for (const SchedulableJob& job : jobs) {
    if (blocked_kinds.count(job.kind)) continue;
    std::vector<SchedulableWorker*> cands;
    int64_t free_total = 0;
    for (SchedulableWorker& w : workers) {
      if (!Eligible(job, w) || Room(job, w) <= 0) continue;
      cands.push_back(&w);
      free_total += Room(job, w);
    }
    if (free_total < job.world) {
      blocked_kinds.insert(job.kind);
      continue;
    }
    // Best fit on a single worker when possible.
    SchedulableWorker* single = nullptr;
    for (SchedulableWorker* w : cands) {
      if (Room(job, *w) < job.world) continue;
      if (!single || w->free_devices.size() < single->free_devices.size() ||
          (w->free_devices.size() == single->free_devices.size() &&
           w->worker_id < single->worker_id))
        single = w;
    }
    std::vector<SchedulableWorker*> order;
    if (single) {
      order.push_back(single);
    } else {
      order = cands;
      std::stable_sort(order.begin(), order.end(),
                       [&job](const SchedulableWorker* a, const SchedulableWorker* b) {
                         if (Room(job, *a) != Room(job, *b)) return Room(job, *a) > Room(job, *b);
                         return a->worker_id < b->worker_id;
                       });
    }
    GangPlacement p;
    p.job_id = job.job_id;
    int64_t rank = 0;
    for (SchedulableWorker* w : order) {
      std::sort(w->free_devices.begin(), w->free_devices.end());
      const size_t room = static_cast<size_t>(Room(job, *w));
      size_t take = 0;
      while (rank < job.world && take < room) {
        p.ranks.push_back({rank++, w->worker_id, w->free_devices[take++]});
      }
      w->free_devices.erase(w->free_devices.begin(), w->free_devices.begin() + take);
      w->host_pinned_bytes += static_cast<int64_t>(take) * job.host_bytes_per_rank;
      if (rank == job.world) break;
    }
    out.push_back(std::move(p));
  }
  return out;
}

absl::Status CheckCanEverFit(const SchedulableJob& job,
                             const std::vector<SchedulableWorker>& registered) {
  if (registered.empty()) return absl::OkStatus();
  int64_t of_kind = 0, of_kind_devices = 0, fitting_devices = 0, host_fitting = 0;
  int64_t max_memory = 0, max_host = 0;
  for (const SchedulableWorker& w : registered) {
    if (w.kind != job.kind) continue;
    ++of_kind;
    of_kind_devices += w.total_devices;
    max_memory = std::max(max_memory, w.device_memory_bytes);
    max_host = std::max(max_host, w.host_memory_bytes);
    if (!Eligible(job, w)) continue;
    fitting_devices += w.total_devices;
    host_fitting += std::min<int64_t>(w.total_devices, HostRankRoom(job, w, 0));
  }
  if (of_kind == 0)
    return absl::FailedPreconditionError(absl::StrCat(
        "job needs ", job.kind, " devices but no ", job.kind, " worker is registered (",
        registered.size(), " worker", registered.size() == 1 ? "" : "s", " of another kind)"));
  if (fitting_devices < job.world) {
    if (fitting_devices < of_kind_devices)
      return absl::FailedPreconditionError(absl::StrCat(
          "job needs ", job.world, " ", job.kind, " devices (world = dp*cp) with at least ",
          FormatBytes(job.memory_bytes_per_rank), " each, but the registered ", job.kind,
          " workers have only ", fitting_devices, " such devices (largest device: ",
          FormatBytes(max_memory), ")"));
    return absl::FailedPreconditionError(absl::StrCat(
        "job needs ", job.world, " ", job.kind, " devices (world = dp*cp) but the ", of_kind,
        " registered ", job.kind, " worker", of_kind == 1 ? " has" : "s have", " ",
        of_kind_devices, " in total"));
  }
  if (host_fitting < job.world)
    return absl::FailedPreconditionError(absl::StrCat(
        "job needs ", job.world,
        job.world == 1 ? " rank (world = dp*cp) that pins " : " ranks (world = dp*cp) that pin ",
        FormatBytes(job.host_bytes_per_rank),
        " of host memory each (train.offload), but the registered ", job.kind,
        " workers' host memory holds only ", host_fitting, " such ranks (at most ",
        static_cast<int>(kHostPinFill * 100), "% of a worker's, the largest ",
        FormatBytes(max_host), "); set train.offload to false or add host memory"));
  return absl::OkStatus();
}

}  // namespace spindle
