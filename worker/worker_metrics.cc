// WorkerMetrics (see worker_metrics.h).
#include "worker/worker_metrics.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace spindle {
namespace {

MetricLabels RankLabels(const std::string& job, int64_t rank) {
  return {{"job_id", job}, {"rank", absl::StrCat(rank)}};
}

template <typename T>
T* Child(Family<T>* family, const MetricLabels& labels) {
  absl::StatusOr<T*> child = family->Add(labels);
  return child.ok() ? *child : nullptr;
}

void SetGauge(Family<Gauge>* family, const MetricLabels& labels, std::optional<double> value) {
  if (!value.has_value()) return;
  if (Gauge* g = Child(family, labels)) g->Set(*value);
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerMetrics>> WorkerMetrics::Create(MetricsRegistry* registry,
                                                                     size_t max_jobs) {
  std::unique_ptr<WorkerMetrics> m(new WorkerMetrics());
  m->max_jobs_ = std::max<size_t>(1, max_jobs);
  const std::vector<std::string> rank_labels = {"job_id", "rank"};
  ASSIGN_OR_RETURN(
      m->tokens_per_second_,
      registry->GaugeFamily("spindle_tokens_per_second",
                            "Training throughput reported by the rank's trainer.", rank_labels));
  ASSIGN_OR_RETURN(m->step_seconds_, registry->HistogramFamily(
                                         "spindle_step_seconds", "Wall time of one optimizer step.",
                                         rank_labels, ExponentialBuckets(0.005, 2.0, 16)));
  ASSIGN_OR_RETURN(m->loss_, registry->GaugeFamily("spindle_loss",
                                                   "Training loss of the last step.", rank_labels));
  ASSIGN_OR_RETURN(
      m->mfu_, registry->GaugeFamily(
                   "spindle_mfu", "Model FLOP utilisation (0..1) of the last step.", rank_labels));
  const std::vector<std::string> layer_labels = {"job_id", "rank", "layer"};
  ASSIGN_OR_RETURN(m->moe_load_,
                   registry->GaugeFamily("spindle_moe_expert_load_ratio",
                                         "A MoE layer's max over mean tokens per expert in the last "
                                         "step (1: even).",
                                         layer_labels));
  ASSIGN_OR_RETURN(m->moe_bias_, registry->GaugeFamily(
                                     "spindle_moe_router_bias",
                                     "The range (bound min or max) of a MoE layer's balancing "
                                     "biases after the last step.",
                                     {"job_id", "rank", "layer", "bound"}));
  ASSIGN_OR_RETURN(m->moe_z_, registry->GaugeFamily(
                                  "spindle_moe_router_z_loss",
                                  "A MoE layer's mean logsumexp(router logits)^2 in the last step "
                                  "(what the router z-loss penalises).",
                                  layer_labels));
  ASSIGN_OR_RETURN(m->step_, registry->GaugeFamily("spindle_training_step",
                                                   "Last completed optimizer step.", rank_labels));
  ASSIGN_OR_RETURN(m->device_memory_,
                   registry->GaugeFamily("spindle_device_memory_bytes",
                                         "Device memory of the trainer by kind (allocated, "
                                         "reserved, peak).",
                                         {"job_id", "rank", "kind"}));
  ASSIGN_OR_RETURN(m->host_rss_, registry->GaugeFamily(
                                     "spindle_host_rss_bytes",
                                     "Resident host memory of the trainer process.", rank_labels));
  ASSIGN_OR_RETURN(m->host_pinned_,
                   registry->GaugeFamily("spindle_host_pinned_bytes",
                                         "Pinned host memory of the trainer (the layer inputs it "
                                         "offloads, train.offload).",
                                         rank_labels));
  ASSIGN_OR_RETURN(m->comm_seconds_, registry->CounterFamily(
                                         "spindle_comm_seconds_total",
                                         "Time spent in collectives by collective and layer type.",
                                         {"job_id", "rank", "collective", "layer_type"}));
  ASSIGN_OR_RETURN(m->comm_bytes_, registry->CounterFamily(
                                       "spindle_comm_bytes_total",
                                       "Bytes moved by collectives by collective and layer type.",
                                       {"job_id", "rank", "collective", "layer_type"}));
  ASSIGN_OR_RETURN(m->restarts_,
                   registry->CounterFamily("spindle_restarts_total",
                                           "Restarted attempts of the rank started on this worker.",
                                           rank_labels));
  ASSIGN_OR_RETURN(m->parity_,
                   registry->GaugeFamily("spindle_parity_max_rel_error",
                                         "The parity canary's largest relative gradient error "
                                         "(max |g - g_ref| / max |g_ref| over tensors) of the "
                                         "job's layout against cp = 1, ep = 1, last check.",
                                         rank_labels));
  ASSIGN_OR_RETURN(m->exits_,
                   registry->CounterFamily("spindle_worker_trainer_exits_total",
                                           "Trainer process exits by reason.", {"reason"}));
  for (const char* reason : {"success", "error", "signal", "stopped", "launch_failed"}) {
    RETURN_IF_ERROR(m->exits_->Add({{"reason", reason}}).status());
  }
  ASSIGN_OR_RETURN(auto* running, registry->GaugeFamily("spindle_worker_running_ranks",
                                                        "Trainer processes running now."));
  ASSIGN_OR_RETURN(m->running_ranks_, running->Add({}));
  ASSIGN_OR_RETURN(auto* slots, registry->GaugeFamily("spindle_worker_slots",
                                                      "GPUs or CPU slots this worker offers."));
  ASSIGN_OR_RETURN(m->slots_, slots->Add({}));
  ASSIGN_OR_RETURN(auto* capacity,
                   registry->GaugeFamily("spindle_worker_device_memory_bytes",
                                         "Memory of one device this worker offers (a GPU's, or "
                                         "one CPU slot's share of host memory)."));
  ASSIGN_OR_RETURN(m->device_capacity_, capacity->Add({}));
  ASSIGN_OR_RETURN(auto* heartbeats,
                   registry->CounterFamily("spindle_worker_heartbeats_total",
                                           "Heartbeats sent to the coordinator."));
  ASSIGN_OR_RETURN(m->heartbeats_, heartbeats->Add({}));
  ASSIGN_OR_RETURN(auto* connected,
                   registry->GaugeFamily("spindle_worker_coordinator_connected",
                                         "1 while the session stream to the coordinator is up."));
  ASSIGN_OR_RETURN(m->connected_, connected->Add({}));
  ASSIGN_OR_RETURN(auto* reconnects,
                   registry->CounterFamily("spindle_worker_session_reconnects_total",
                                           "Session streams opened after the first."));
  ASSIGN_OR_RETURN(m->reconnects_, reconnects->Add({}));
  ASSIGN_OR_RETURN(auto* loss,
                   registry->CounterFamily("spindle_worker_coordinator_loss_total",
                                           "Times all trainers were killed because the "
                                           "coordinator was unreachable past the loss timeout."));
  ASSIGN_OR_RETURN(m->coordinator_loss_, loss->Add({}));
  ASSIGN_OR_RETURN(auto* self_rss,
                   registry->GaugeFamily("spindle_worker_resident_memory_bytes",
                                         "Resident memory of the worker daemon itself."));
  ASSIGN_OR_RETURN(m->self_rss_, self_rss->Add({}));
  return m;
}

void WorkerMetrics::OnTrainerEvent(const std::string& job, int64_t rank, const TrainerEvent& event,
                                   pid_t trainer_pid) {
  const MetricLabels labels = RankLabels(job, rank);
  absl::MutexLock lock(&mu_);
  TouchJob(job);
  RankState& state = ranks_[{job, rank}];
  if (event.kind == TrainerEventKind::kStart) {
    state.last_step = event.step;
    state.last_elapsed_s = event.elapsed_s;
  }
  if (event.kind == TrainerEventKind::kParity && !event.skipped) {
    SetGauge(parity_, labels, event.max_rel_error);
    return;
  }
  if (event.kind != TrainerEventKind::kStep) return;
  SetGauge(tokens_per_second_, labels, event.tokens_per_s);
  SetGauge(loss_, labels, event.loss);
  SetGauge(mfu_, labels, event.mfu);
  if (event.step) SetGauge(step_, labels, static_cast<double>(*event.step));
  std::optional<double> step_time = event.step_time_s;
  if (!step_time && event.elapsed_s && state.last_elapsed_s && event.step && state.last_step &&
      *event.step > *state.last_step) {
    step_time = (*event.elapsed_s - *state.last_elapsed_s) /
                static_cast<double>(*event.step - *state.last_step);
  }
  if (step_time && *step_time >= 0) {
    if (Histogram* h = Child(step_seconds_, labels)) h->Observe(*step_time);
  }
  if (event.step) state.last_step = event.step;
  if (event.elapsed_s) state.last_elapsed_s = event.elapsed_s;
  const std::pair<const char*, const std::optional<double>*> memory[] = {
      {"allocated", &event.mem_allocated_bytes},
      {"reserved", &event.mem_reserved_bytes},
      {"peak", &event.mem_peak_bytes}};
  for (const auto& [kind, value] : memory) {
    SetGauge(device_memory_, {{"job_id", job}, {"rank", absl::StrCat(rank)}, {"kind", kind}},
             *value);
  }
  if (event.host_rss_bytes) {
    SetGauge(host_rss_, labels, event.host_rss_bytes);
  } else if (trainer_pid > 0) {
    absl::StatusOr<int64_t> rss = ReadRssBytes(trainer_pid);
    if (rss.ok() && *rss > 0) SetGauge(host_rss_, labels, static_cast<double>(*rss));
  }
  if (event.host_pinned_bytes) SetGauge(host_pinned_, labels, event.host_pinned_bytes);
  for (const MoeLayerStat& l : event.moe) {
    const std::string layer = absl::StrCat(l.layer);
    const MetricLabels ll = {{"job_id", job}, {"rank", absl::StrCat(rank)}, {"layer", layer}};
    SetGauge(moe_load_, ll, l.load_max_over_mean);
    SetGauge(moe_z_, ll, l.router_lse_sq);
    for (const auto& [bound, v] : {std::pair<const char*, double>{"min", l.bias_min},
                                   {"max", l.bias_max}}) {
      MetricLabels bl = ll;
      bl["bound"] = bound;
      SetGauge(moe_bias_, bl, v);
    }
    state.moe_layers.insert(l.layer);
  }
  for (const CommStat& c : event.comm) {
    const MetricLabels comm_labels = {{"job_id", job},
                                      {"rank", absl::StrCat(rank)},
                                      {"collective", c.collective},
                                      {"layer_type", c.layer_type}};
    Counter* seconds = Child(comm_seconds_, comm_labels);
    Counter* bytes = Child(comm_bytes_, comm_labels);
    if (seconds == nullptr || bytes == nullptr) continue;
    seconds->Increment(c.seconds);
    bytes->Increment(c.bytes);
    state.comm_labels.insert({c.collective, c.layer_type});
  }
}

void WorkerMetrics::OnRankStarted(const std::string& job, int64_t attempt, int64_t rank) {
  const MetricLabels labels = RankLabels(job, rank);
  absl::MutexLock lock(&mu_);
  TouchJob(job);
  RankState& state = ranks_[{job, rank}];
  state.last_step.reset();
  state.last_elapsed_s.reset();
  Counter* restarts = Child(restarts_, labels);
  if (restarts != nullptr && attempt > 1) restarts->Increment();
}

void WorkerMetrics::OnTrainerExit(const std::string& reason) {
  Counter* c = Child(exits_, {{"reason", reason}});
  if (c != nullptr) c->Increment();
}

void WorkerMetrics::RefreshSelf() { UpdateRssGauge(self_rss_).IgnoreError(); }

void WorkerMetrics::TouchJob(const std::string& job) {
  auto it = std::find(jobs_.begin(), jobs_.end(), job);
  if (it != jobs_.end()) {
    if (it + 1 == jobs_.end()) return;
    jobs_.erase(it);
  }
  jobs_.push_back(job);
  while (jobs_.size() > max_jobs_) {
    const std::string oldest = jobs_.front();
    jobs_.pop_front();
    DropJob(oldest);
  }
}

void WorkerMetrics::DropJob(const std::string& job) {
  for (auto it = ranks_.begin(); it != ranks_.end();) {
    if (it->first.first != job) {
      ++it;
      continue;
    }
    const MetricLabels labels = RankLabels(job, it->first.second);
    const std::string rank = absl::StrCat(it->first.second);
    for (Family<Gauge>* g : {tokens_per_second_, loss_, mfu_, step_, host_rss_, parity_}) {
      g->Remove(labels).IgnoreError();
    }
    step_seconds_->Remove(labels).IgnoreError();
    restarts_->Remove(labels).IgnoreError();
    for (const char* kind : {"allocated", "reserved", "peak"}) {
      device_memory_->Remove({{"job_id", job}, {"rank", rank}, {"kind", kind}}).IgnoreError();
    }
    for (const auto& [collective, layer_type] : it->second.comm_labels) {
      const MetricLabels comm_labels = {
          {"job_id", job}, {"rank", rank}, {"collective", collective}, {"layer_type", layer_type}};
      comm_seconds_->Remove(comm_labels).IgnoreError();
      comm_bytes_->Remove(comm_labels).IgnoreError();
    }
    for (int64_t l : it->second.moe_layers) {
      const MetricLabels ll = {{"job_id", job}, {"rank", rank}, {"layer", absl::StrCat(l)}};
      moe_load_->Remove(ll).IgnoreError();
      moe_z_->Remove(ll).IgnoreError();
      for (const char* bound : {"min", "max"}) {
        MetricLabels bl = ll;
        bl["bound"] = bound;
        moe_bias_->Remove(bl).IgnoreError();
      }
    }
    ranks_.erase(it++);
  }
}

}  // namespace spindle
