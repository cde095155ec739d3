// WorkerRegistry (see worker_registry.h).
#include "coordinator/worker_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/text_bounds.h"
#include "coordinator/worker_proto.h"
#include "spindle/v1/cluster.pb.h"

namespace spindle {
namespace {

// WorkerRecord.devices: a RegisterRequest holding only the device group.
std::string EncodeDevices(const DeviceOffer& d) {
  v1::RegisterRequest r;
  OfferToProto(d, r.add_devices());
  return r.SerializeAsString();
}

DeviceOffer DecodeDevices(const std::string& bytes) {
  v1::RegisterRequest r;
  if (!r.ParseFromString(bytes) || r.devices_size() == 0) return {};
  return OfferFromProto(r.devices(0));
}

absl::Status CheckRegistration(const WorkerRegistration& reg, const RegistryLimits& limits) {
  if (reg.worker_id.empty())
    return absl::InvalidArgumentError("register: worker_id must not be empty");
  if (reg.worker_id.size() > kMaxIdBytes || !IsValidUtf8(reg.worker_id))
    return absl::InvalidArgumentError(absl::StrCat("register: worker_id must be UTF-8 of at most ",
                                                   kMaxIdBytes, " bytes, got ",
                                                   reg.worker_id.size(), " bytes"));
  if (reg.instance_id.size() > kMaxIdBytes)
    return absl::InvalidArgumentError(absl::StrCat("register: instance_id must be at most ",
                                                   kMaxIdBytes, " bytes, got ",
                                                   reg.instance_id.size()));
  if (reg.devices.size() != 1)
    return absl::InvalidArgumentError(
        absl::StrCat("register: worker ", reg.worker_id,
                     " must advertise exactly one device group (GPUs or "
                     "CPU slots), got ",
                     reg.devices.size()));
  const DeviceOffer& g = reg.devices[0];
  if (g.kind != "cuda" && g.kind != "cpu")
    return absl::InvalidArgumentError(absl::StrCat("register: worker ", reg.worker_id,
                                                   ": device kind must be \"cuda\" or \"cpu\", "
                                                   "got \"",
                                                   g.kind, "\""));
  if (g.count < 1 || g.count > limits.max_slots_per_worker)
    return absl::InvalidArgumentError(
        absl::StrCat("register: worker ", reg.worker_id, ": device count must be in [1, ",
                     limits.max_slots_per_worker, "] (--max-worker-slots), got ", g.count));
  for (auto [name, rate] : {std::pair<const char*, double>{"gemm_flops", g.rates.gemm_flops},
                            {"attention_flops", g.rates.attention_flops},
                            {"lightning_flops", g.rates.lightning_flops},
                            {"memory_bytes", g.rates.memory_bytes},
                            {"copy_bytes", g.rates.copy_bytes}}) {
    if (!(rate >= 0 && rate < 1e18))  // NaN fails too
      return absl::InvalidArgumentError(
          absl::StrCat("register: worker ", reg.worker_id, ": rates.", name,
                       " must be a non-negative rate below 1e18, got ", rate));
  }
  if (!(g.link_rates.bytes_per_s >= 0 && g.link_rates.bytes_per_s < 1e18) ||
      !(g.link_rates.latency_s >= 0 && g.link_rates.latency_s <= 10))
    return absl::InvalidArgumentError(absl::StrCat(
        "register: worker ", reg.worker_id,
        ": link_bytes_per_s must be a non-negative rate below 1e18 and link_latency_s in [0, 10] "
        "seconds, got ",
        g.link_rates.bytes_per_s, " and ", g.link_rates.latency_s));
  LinkClass link;
  if (!g.link.empty() && !ParseLinkClass(g.link, &link))
    return absl::InvalidArgumentError(absl::StrCat(
        "register: worker ", reg.worker_id,
        ": link must be \"same-device\", \"nvlink\", \"pcie\", \"loopback\" or empty, got \"",
        g.link.substr(0, 64), "\""));
  if (g.cores < 0 || g.cores > 65536 || g.threads_per_rank < 0 || g.threads_per_rank > 65536)
    return absl::InvalidArgumentError(
        absl::StrCat("register: worker ", reg.worker_id,
                     ": cores and threads_per_rank must be in [0, 65536], got ", g.cores, " and ",
                     g.threads_per_rank));
  if (reg.advertise_host.size() > 255 ||
      reg.advertise_host.find_first_of(" /\t\n") != std::string::npos)
    return absl::InvalidArgumentError(
        absl::StrCat("register: worker ", reg.worker_id,
                     ": advertise_host must be a host name or address, got \"",
                     reg.advertise_host.substr(0, 64), "\""));
  return absl::OkStatus();
}

}  // namespace

std::string Worker::State() const {
  if (left) return "left";
  if (lost) return "lost";
  if (!connected) return "disconnected";
  return leaving ? "leaving" : "alive";
}

SchedulableWorker Worker::Schedulable() const {
  SchedulableWorker sw;
  sw.worker_id = rec.worker_id;
  sw.kind = devices.kind;
  sw.device_memory_bytes = devices.memory_bytes;
  sw.host_memory_bytes = devices.host_memory_bytes;
  return sw;
}

absl::Status WorkerRegistry::Load(int64_t grace_ms) {
  ASSIGN_OR_RETURN(std::vector<WorkerRecord> records, store_->LoadWorkers());
  const int64_t now = clock_->SteadyMs();
  for (WorkerRecord& rec : records) {
    auto w = std::make_unique<Worker>();
    w->devices = DecodeDevices(rec.devices);
    w->slots.resize(std::max(0, w->devices.count));
    w->last_seen_ms = now + grace_ms;
    w->last_seen_unix_ms = clock_->NowMs();
    w->rec = std::move(rec);
    workers_[w->rec.worker_id] = std::move(w);
  }
  return absl::OkStatus();
}

absl::StatusOr<Worker*> WorkerRegistry::Register(const WorkerRegistration& reg) {
  RETURN_IF_ERROR(CheckRegistration(reg, limits_));
  const DeviceOffer& g = reg.devices[0];
  const std::string address = reg.advertise_host.empty() ? reg.observed_host : reg.advertise_host;
  // Two daemons given one --worker-id would take each other's slots and ranks: while one is
  // connected, another daemon (another host or process) may not take its id; its own reconnect
  // may.
  if (auto it = workers_.find(reg.worker_id); it != workers_.end()) {
    const Worker& w = *it->second;
    // A registration without an instance id is not the daemon that registered with one.
    const bool other_process = !w.instance_id.empty() && w.instance_id != reg.instance_id;
    if (w.connected && !w.lost && (w.rec.hostname != reg.hostname || other_process))
      return absl::AlreadyExistsError(
          absl::StrCat("worker id ", reg.worker_id, " is in use by ",
                       w.rec.hostname == reg.hostname ? "another connected worker daemon on host "
                                                      : "the connected worker on host ",
                       w.rec.hostname, "; give each worker daemon its own --worker-id"));
  }
  if (!workers_.count(reg.worker_id)) RETURN_IF_ERROR(MakeRoom(reg.worker_id));
  WorkerRecord rec;
  rec.worker_id = reg.worker_id;
  rec.hostname = reg.hostname;
  rec.devices = EncodeDevices(g);
  rec.metrics_address = reg.metrics_address;
  // A worker that does not know its own address gives only the port (":9401").
  if (!rec.metrics_address.empty() && rec.metrics_address[0] == ':')
    rec.metrics_address = absl::StrCat(
        address.find(':') != std::string::npos ? absl::StrCat("[", address, "]") : address,
        rec.metrics_address);
  rec.registered_ms = clock_->NowMs();
  RETURN_IF_ERROR(store_->SaveWorker(rec));
  auto& w = workers_[rec.worker_id];
  if (!w) w = std::make_unique<Worker>();
  w->rec = rec;
  // A registration without an instance id (an older daemon, or anyone holding a worker token)
  // does not unbind the id from the daemon that registered it.
  if (!reg.instance_id.empty()) w->instance_id = reg.instance_id;
  w->address = address;
  w->checkpoint_root = reg.checkpoint_root;
  w->data_root = reg.data_root;
  w->devices = g;
  if (static_cast<int32_t>(w->slots.size()) < g.count) w->slots.resize(g.count);
  while (static_cast<int32_t>(w->slots.size()) > g.count && w->slots.back().job_id.empty())
    w->slots.pop_back();
  Seen(*w);
  w->lost = w->leaving = w->left = false;
  return w.get();
}

absl::Status WorkerRegistry::MakeRoom(const std::string& worker_id) {
  if (static_cast<int64_t>(workers_.size()) < limits_.max_workers) return absl::OkStatus();
  // Forget the worker silent the longest of those that are gone and hold nothing (its row stays
  // in the store; it registers again like a new one).
  Map::iterator oldest = workers_.end();
  for (auto it = workers_.begin(); it != workers_.end(); ++it) {
    const Worker& w = *it->second;
    if (!w.lost && !w.left) continue;
    bool holds = false;
    for (const WorkerSlot& s : w.slots) holds |= !s.job_id.empty();
    if (holds) continue;
    if (oldest == workers_.end() || w.last_seen_ms < oldest->second->last_seen_ms) oldest = it;
  }
  if (oldest == workers_.end())
    return absl::ResourceExhaustedError(absl::StrCat(
        "register: worker ", worker_id, ": the coordinator already holds ", workers_.size(),
        " workers, its limit (--max-workers), and none of them is gone"));
  workers_.erase(oldest);
  return absl::OkStatus();
}

absl::Status WorkerRegistry::CheckOpen(const std::string& worker_id,
                                       const std::string& instance_id) const {
  const Worker* w = Find(worker_id);
  if (w == nullptr)
    return absl::NotFoundError(absl::StrCat("worker ", BoundedUtf8(worker_id, kMaxIdBytes),
                                            " is not registered; call Register first"));
  // A session speaks for the daemon that registered the id: no other process (which may hold a
  // worker token too) takes over its session, its assignments and their rendezvous tokens.
  if (!w->instance_id.empty() && instance_id != w->instance_id)
    return absl::PermissionDeniedError(absl::StrCat(
        "worker ", worker_id,
        " was registered by another daemon instance; a session must come from the daemon that "
        "registered it"));
  return absl::OkStatus();
}

absl::StatusOr<Worker*> WorkerRegistry::Open(const std::string& worker_id,
                                             const std::string& instance_id, uint64_t session_id) {
  RETURN_IF_ERROR(CheckOpen(worker_id, instance_id));
  Worker* w = Find(worker_id);
  w->connected = true;
  w->lost = w->leaving = w->left = false;
  w->session_id = session_id;
  Seen(*w);
  return w;
}

void WorkerRegistry::Seen(Worker& w) {
  w.last_seen_ms = clock_->SteadyMs();
  w.last_seen_unix_ms = clock_->NowMs();
}

Worker* WorkerRegistry::Find(const std::string& worker_id) {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : it->second.get();
}

const Worker* WorkerRegistry::Find(const std::string& worker_id) const {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : it->second.get();
}

void WorkerRegistry::Release(const std::string& worker_id, int32_t device,
                             const std::string& job_id, int64_t attempt) {
  Worker* w = Find(worker_id);
  if (w == nullptr || device < 0 || device >= static_cast<int32_t>(w->slots.size())) return;
  WorkerSlot& s = w->slots[device];
  if (s.job_id == job_id && s.attempt == attempt) s = {};
}

void WorkerRegistry::FreeDrained(int64_t now) {
  for (auto& [id, w] : workers_)
    for (WorkerSlot& s : w->slots)
      if (s.drain_deadline_ms > 0 && now >= s.drain_deadline_ms) s = {};
}

int64_t WorkerRegistry::LargestDeviceMemory(const std::string& kind) const {
  int64_t memory = 0;
  for (const auto& [id, w] : workers_)
    if (w->devices.kind == kind) memory = std::max(memory, w->devices.memory_bytes);
  return memory;
}

const Worker* WorkerRegistry::LargestWorker(const std::string& kind) const {
  const Worker* best = nullptr;
  for (const auto& [id, w] : workers_) {
    if (w->devices.kind != kind) continue;
    auto key = [](const Worker* x) {
      return std::make_pair(x->devices.memory_bytes, x->devices.rates.known());
    };
    if (best == nullptr || key(w.get()) > key(best)) best = w.get();
  }
  return best;
}

std::vector<SchedulableWorker> WorkerRegistry::Registered() const {
  std::vector<SchedulableWorker> out;
  for (const auto& [id, w] : workers_) {
    SchedulableWorker sw = w->Schedulable();
    sw.total_devices = w->devices.count;
    out.push_back(std::move(sw));
  }
  return out;
}

std::vector<WorkerView> WorkerRegistry::Views() const {
  std::vector<WorkerView> out;
  for (const auto& [id, w] : workers_) {
    WorkerView v;
    v.worker_id = id;
    v.hostname = w->rec.hostname;
    v.address = w->address;
    v.state = w->State();
    v.metrics_address = w->rec.metrics_address;
    v.devices = w->devices;
    v.slots = static_cast<int32_t>(w->slots.size());
    for (const WorkerSlot& s : w->slots) {
      if (s.job_id.empty()) continue;
      ++v.used_slots;
      v.ranks.push_back(absl::StrCat(s.job_id, "/", s.attempt, "/", s.rank));
    }
    v.last_heartbeat_unix_ms = w->last_seen_unix_ms;
    v.registered_unix_ms = w->rec.registered_ms;
    out.push_back(std::move(v));
  }
  return out;
}

std::map<std::string, int64_t> WorkerRegistry::StateCounts() const {
  std::map<std::string, int64_t> out{
      {"alive", 0}, {"leaving", 0}, {"disconnected", 0}, {"left", 0}, {"lost", 0}};
  for (const auto& [id, w] : workers_) ++out[w->State()];
  return out;
}

std::map<std::string, int64_t> WorkerRegistry::DeviceCounts() const {
  std::map<std::string, int64_t> out{{"used", 0}, {"free", 0}};
  for (const auto& [id, w] : workers_) {
    if (w->lost) continue;
    for (const WorkerSlot& s : w->slots) ++out[s.job_id.empty() ? "free" : "used"];
  }
  return out;
}

}  // namespace spindle
