// WorkerRegistry: the coordinator's workers. Registration (validation, one daemon per worker id,
// the worker's address: advertised, or the one it connects from), session bookkeeping (open,
// closed, lost, leaving, left), each worker's slots (the rank a slot runs, and a stopped rank's
// drain deadline), and the views the scheduler, `spindle workers` and the metrics take. Workers are
// persisted in the JobStore when they register and reloaded by Load() after a restart. Speaks the
// coordinator's own types; grpc_services.cc converts RegisterRequest and WorkerInfo.
// Thread-compatible: the job manager's mutex guards it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/clock.h"
#include "planner/cp_cost_model.h"
#include "coordinator/job_store.h"
#include "coordinator/scheduler.h"

namespace spindle {

// One kind of device a worker offers: "cuda" GPUs or "cpu" slots.
struct DeviceOffer {
  std::string kind;
  std::string name;
  int32_t count = 0;
  int64_t memory_bytes = 0;       // of one device
  int64_t host_memory_bytes = 0;  // the worker's host memory; 0: unknown
  DeviceRates rates;              // one rank alone on one device, as the worker measured them
  std::string link;               // between two of its devices (cp_cost_model.h's LinkClass)
  LinkRates link_rates;           // of `link` ("loopback", "same-device") as measured; 0: not
  int32_t cores = 0;              // of the host; 0: unknown
  int32_t threads_per_rank = 0;   // CPU ranks' OpenMP threads; 0: unknown
};

struct WorkerRegistration {
  std::string worker_id;
  std::string hostname;
  std::string instance_id;      // random per daemon process ("" from older workers)
  std::string advertise_host;   // "": known by `observed_host`
  std::string observed_host;    // the address the registration came from
  std::string metrics_address;  // host:port, or ":port" for the worker's address
  std::vector<DeviceOffer> devices;
  // Its --checkpoint_root and --data_root ("": not reported, by an older daemon).
  std::string checkpoint_root, data_root;
};

struct WorkerSlot {
  std::string job_id;  // empty: free
  int64_t attempt = 0;
  int64_t rank = -1;
  int64_t drain_deadline_ms = 0;  // > 0 (steady): its rank was stopped; freed at exit or then
};

struct Worker {
  WorkerRecord rec;
  DeviceOffer devices;
  std::string instance_id;
  // The address other hosts reach its ranks at: advertised, or the one it connected from.
  std::string address;
  // Where it lets jobs write checkpoints and read data, as it last registered ("": not known).
  std::string checkpoint_root, data_root;
  bool connected = false;  // its session `session_id` is open (set and cleared by the session)
  bool lost = false;       // unusable: silent past the heartbeat timeout, or left
  bool leaving = false;    // said it is shutting down; placed on no more
  bool left = false;       // shut down on purpose: its stream closed after it said so
  uint64_t session_id = 0;
  int64_t last_seen_ms = 0;       // steady clock
  int64_t last_seen_unix_ms = 0;  // the same moment on the wall clock (shown)
  std::vector<WorkerSlot> slots;

  // "alive", "leaving", "disconnected", "left" or "lost".
  std::string State() const;
  // The scheduler's view (devices for the caller to fill).
  SchedulableWorker Schedulable() const;
};

// A worker as `spindle workers` shows it.
struct WorkerView {
  std::string worker_id, hostname, address, state, metrics_address;
  DeviceOffer devices;
  int32_t slots = 0, used_slots = 0;
  std::vector<std::string> ranks;  // "job_id/attempt/rank"
  int64_t last_heartbeat_unix_ms = 0, registered_unix_ms = 0;
};

// What one peer can make the registry hold (coordinator flags --max-workers, --max-worker-slots).
struct RegistryLimits {
  // Workers held at once. A registration of a new id beyond it first forgets the worker silent the
  // longest among those lost or left that hold no rank; when there is none it is
  // ResourceExhausted.
  int64_t max_workers = 1024;
  // Devices (slots) one worker may offer.
  int32_t max_slots_per_worker = 1024;
};

class WorkerRegistry {
 public:
  using Map = std::map<std::string, std::unique_ptr<Worker>>;

  // `store` and `clock` are not owned.
  WorkerRegistry(JobStore* store, const Clock* clock, RegistryLimits limits = {})
      : store_(store), clock_(clock), limits_(limits) {}

  // Reloads the stored workers, each lost unless heard from within `grace_ms`.
  absl::Status Load(int64_t grace_ms);

  // Validates and stores a registration (InvalidArgument naming the field; AlreadyExists when
  // another daemon holds the id with a connected session; ResourceExhausted past
  // limits.max_workers) and returns the worker, its slots kept. An empty instance id keeps the one
  // stored (it never clears it).
  absl::StatusOr<Worker*> Register(const WorkerRegistration& reg);
  // What Open would refuse, changing nothing (a new session checks it before it replaces the
  // worker's current one).
  absl::Status CheckOpen(const std::string& worker_id, const std::string& instance_id) const;
  // A session opened by daemon `instance_id` (NotFound for an unregistered id; PermissionDenied
  // when another daemon instance registered it); the worker is alive.
  absl::StatusOr<Worker*> Open(const std::string& worker_id, const std::string& instance_id,
                               uint64_t session_id);
  // The worker spoke: alive, seen now.
  void Seen(Worker& w);

  Worker* Find(const std::string& worker_id);
  const Worker* Find(const std::string& worker_id) const;
  Map& workers() { return workers_; }
  const Map& workers() const { return workers_; }

  // Frees `device` of `worker_id` if it still holds (job_id, attempt).
  void Release(const std::string& worker_id, int32_t device, const std::string& job_id,
               int64_t attempt);
  // Frees the slots whose drain deadline passed.
  void FreeDrained(int64_t now);
  // The memory of the largest registered device of `kind`; 0 when none.
  int64_t LargestDeviceMemory(const std::string& kind) const;
  // The worker whose device of `kind` is the largest (the one plans are sized to), preferring
  // one that reported its rates; null when none.
  const Worker* LargestWorker(const std::string& kind) const;
  // Every registered worker as the scheduler sees it, with all its devices counted.
  std::vector<SchedulableWorker> Registered() const;

  std::vector<WorkerView> Views() const;
  // Workers by State() (every state named), and slots "used" / "free" of workers not lost.
  std::map<std::string, int64_t> StateCounts() const;
  std::map<std::string, int64_t> DeviceCounts() const;

 private:
  // Makes room for one more worker (RegistryLimits::max_workers).
  absl::Status MakeRoom(const std::string& worker_id);

  JobStore* const store_;
  const Clock* const clock_;
  const RegistryLimits limits_;
  Map workers_;
};

}  // namespace spindle
