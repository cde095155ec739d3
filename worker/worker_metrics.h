// WorkerMetrics: the worker daemon's Prometheus series (DESIGN.md section 6), fed from the
// trainers' progress lines and from the daemon's own events. Every per-rank series carries the
// labels {job_id, rank} (not `job`: Prometheus reserves that label for the scrape job and would
// rename ours to `exported_job`):
//   spindle_tokens_per_second             gauge
//   spindle_step_seconds                  histogram
//   spindle_loss                          gauge
//   spindle_mfu                           gauge (ratio 0..1)
//   spindle_training_step                 gauge (last completed step)
//   spindle_device_memory_bytes{kind}     gauge, kind = allocated | reserved | peak
//   spindle_host_rss_bytes                gauge (the trainer process's resident memory)
//   spindle_host_pinned_bytes             gauge (pinned host memory of the trainer: train.offload)
//   spindle_comm_seconds_total{collective, layer_type}  counter
//   spindle_comm_bytes_total{collective, layer_type}    counter
//   spindle_restarts_total                counter (attempts after the first started here)
//   spindle_parity_max_rel_error          gauge (the parity canary's largest relative gradient
//                                         error against cp = 1, ep = 1, of its last check)
// Mixture-of-experts jobs, per MoE layer ({job_id, rank, layer}):
//   spindle_moe_expert_load_ratio         gauge (max over mean tokens per expert in the last step)
//   spindle_moe_router_bias{bound}        gauge, bound = min | max (the balancing biases' range)
//   spindle_moe_router_z_loss             gauge (mean logsumexp(router logits)^2 of the step)
// (the token exchange's bytes and seconds are spindle_comm_*{layer_type="moe"})
// Worker-level:
//   spindle_worker_running_ranks          gauge
//   spindle_worker_slots                  gauge (GPUs or CPU slots offered)
//   spindle_worker_heartbeats_total       counter (heartbeats sent)
//   spindle_worker_trainer_exits_total{reason}  counter, reason = success | error | signal |
//                                         stopped | launch_failed
//   spindle_worker_coordinator_connected  gauge (1 while the session stream is up)
//   spindle_worker_session_reconnects_total  counter
//   spindle_worker_coordinator_loss_total counter (times every trainer was killed because the
//                                         coordinator was unreachable past the loss timeout)
//   spindle_worker_resident_memory_bytes  gauge (the daemon's own RSS, refreshed per scrape)
// Per-rank series of a job are dropped when more than `max_jobs` other jobs have run since.
//
// Thread-safety: thread-safe; the per-rank bookkeeping is guarded by mu_, metric children are
// themselves thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "worker/trainer_event.h"

namespace spindle {

class WorkerMetrics {
 public:
  // Registers every family in `registry` (not owned; must outlive this object).
  static absl::StatusOr<std::unique_ptr<WorkerMetrics>> Create(MetricsRegistry* registry,
                                                               size_t max_jobs = 16);

  // A step line (or any event carrying metrics) of rank `rank` of job `job`. `trainer_pid` > 0
  // lets the daemon read the trainer's RSS when the line has no host_rss_bytes.
  void OnTrainerEvent(const std::string& job, int64_t rank, const TrainerEvent& event,
                      pid_t trainer_pid) ABSL_LOCKS_EXCLUDED(mu_);
  // A trainer for (job, attempt, rank) was started.
  void OnRankStarted(const std::string& job, int64_t attempt, int64_t rank)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `reason`: success | error | signal | stopped | launch_failed.
  void OnTrainerExit(const std::string& reason);

  void SetRunningRanks(int64_t n) { running_ranks_->Set(static_cast<double>(n)); }
  void SetSlots(int64_t n) { slots_->Set(static_cast<double>(n)); }
  void SetDeviceMemory(int64_t bytes) { device_capacity_->Set(static_cast<double>(bytes)); }
  void OnHeartbeat() { heartbeats_->Increment(); }
  void SetConnected(bool connected) { connected_->Set(connected ? 1.0 : 0.0); }
  void OnReconnect() { reconnects_->Increment(); }
  void OnCoordinatorLoss() { coordinator_loss_->Increment(); }
  // Refreshes the daemon's RSS gauge (call before each scrape).
  void RefreshSelf();

 private:
  struct RankState {
    std::optional<int64_t> last_step;
    std::optional<double> last_elapsed_s;
    absl::flat_hash_set<std::pair<std::string, std::string>> comm_labels;
    absl::flat_hash_set<int64_t> moe_layers;
  };

  WorkerMetrics() = default;
  void TouchJob(const std::string& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropJob(const std::string& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  size_t max_jobs_ = 16;
  Family<Gauge>* tokens_per_second_ = nullptr;
  Family<Histogram>* step_seconds_ = nullptr;
  Family<Gauge>* loss_ = nullptr;
  Family<Gauge>* mfu_ = nullptr;
  Family<Gauge>* moe_load_ = nullptr;
  Family<Gauge>* moe_bias_ = nullptr;
  Family<Gauge>* moe_z_ = nullptr;
  Family<Gauge>* step_ = nullptr;
  Family<Gauge>* device_memory_ = nullptr;
  Family<Gauge>* host_rss_ = nullptr;
  Family<Gauge>* host_pinned_ = nullptr;
  Family<Counter>* comm_seconds_ = nullptr;
  Family<Counter>* comm_bytes_ = nullptr;
  Family<Counter>* restarts_ = nullptr;
  Family<Gauge>* parity_ = nullptr;
  Family<Counter>* exits_ = nullptr;
  Gauge* running_ranks_ = nullptr;
  Gauge* slots_ = nullptr;
  Gauge* device_capacity_ = nullptr;
  Counter* heartbeats_ = nullptr;
  Gauge* connected_ = nullptr;
  Counter* reconnects_ = nullptr;
  Counter* coordinator_loss_ = nullptr;
  Gauge* self_rss_ = nullptr;

  absl::Mutex mu_;
  // (job, rank) -> what is needed to derive step times and to drop the series later.
  absl::flat_hash_map<std::pair<std::string, int64_t>, RankState> ranks_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> jobs_ ABSL_GUARDED_BY(mu_);  // least recently started first
};

}  // namespace spindle
