// Trainer: the step loop of one rank, one for every engine. Builds the model from the job spec
// (a StepBackend, step_backend.h: the CPU model's CpuStepBackend, or a device's), opens the data,
// resumes from the newest complete checkpoint under the checkpoint directory (if any), then per
// step: micro-batches forward+backward, global gradient norm and clipping, the optimizer update
// at the scheduled learning rate, a progress event, and checkpoints every `checkpoint.every`
// steps and at the end (checkpoint.async, the default: the step snapshots the state into host
// memory and a background thread writes it, checkpoint_writer.h; the write is reported, as a
// "checkpoint" event with "write_s" and "blocked_s", the time the steps waited for it, at the
// first step boundary after it finished, and the final one is waited for; checkpoint.replicas:
// in-memory replicas on the rank's worker and a peer's, resumed from when newer than the file,
// trainer_replicas.cc and replica_store.h). Events are JSON objects
// handed to a callback (spindle-train prints them one per line). Not thread-safe (but for
// DrainCheckpointWrite); one trainer per process (or per thread in tests).
//
// Multi-rank (world = dp * cp > 1): rank r is CP rank r % cp of data-parallel replica r / cp.
// With expert parallelism (parallel.ep > 1, MoE models) rank r is also EP rank r % ep of EP group
// r / ep: it holds those experts, its MoE layers exchange tokens over the EP group, and the
// experts' gradients are summed over the ranks holding the same experts (the expert-data-parallel
// group) while every other gradient is summed over the world; the norm adds the EP group's expert
// parts. The balancing biases move after each update by the loads summed over the world; rank 0's
// EP group gathers the expert shards for its checkpoints, which stay whole tensors.
// Each replica takes its own micro-batches of the step's sequences; each CP rank its zigzag share
// of them (cp/cp_layout.h). Communicators are Gloo groups bootstrapped from `store`: the world
// (gradients, loss) and the replica's CP group (the model's CP collectives); with a "hybrid" mode
// also the rank's Ulysses group and ring (cp/cp_groups.h). The CUDA engine refuses the "ring" and
// "hybrid" modes at Create(). The loss and its
// token count are summed over the world; gradients are all-reduced over the world in buckets
// launched while the backward goes on; the norm, clipping and update follow the reduction, so
// every rank holds the same parameters. Rank 0 writes checkpoints; all ranks resume from the
// same step or Create() fails. Step events carry "comm": the step's collectives per (collective,
// layer type) with seconds and bytes; "tokens_per_s" and "tflops" are this rank's (its 1/cp share
// of its replica's sequences, their model FLOPs by ModelConfig::TrainFlops with attention counted
// within documents), so a job's are the sum over its ranks.
//
// The spec is planned (planner/cp_planner.h, PlannedSpec): its CP modes and recompute are applied
// as given; "auto" or "fastest" modes at cp > 1 and an "auto" recompute are refused at Create().
//
// parallel.verify (parity_canary.h): before the steps ParityDue names (by default the first step
// at a layout the job has not verified: a fresh start, or a resume from a checkpoint verified at
// another layout) every rank runs the parity canary, emits {"event": "parity", ...} and records
// the verified layout in its state (and so in its checkpoints); a mismatch ends Run() with
// FailedPrecondition naming the worst tensors. The canary's collectives are left out of the step
// events' "comm" (the parity event carries their bytes).
//
// train.precision: the backend is handed it (SetPrecision): the CPU model runs the numerics
// CpuNumerics() gives (fp32, or the emulated bf16 storage and FP8 inputs of numerics.h); a device
// backend refuses what it does not run. The start event names it ("precision").
//
// The step (one for every backend): gradients of (1 / the step's valid targets) x the loss sum,
// the norm of those, the clip factor, the optimizer at the scheduled rate. With cp > 1 the backend
// gets this rank's CP group and the decided modes (SetCp) and runs the rank's CpBatch shares; at
// cp = 1 whole sequences. Losses, token counts and gradients are summed over the world.
//
// GPU (spec.resources == "cuda"): the backend is built by TrainerOptions::cuda_backend from the
// same seed as the CPU model (same initial weights). Collectives:
// when every rank reports a device of its own (StepBackend::DeviceId, gathered over the Gloo
// world), the gradient sum runs on the device (AllReduceGrads) and the CP group is a device
// communicator (NCCL for CUDA), both from CreateDeviceCommunicator (one communicator for both
// when dp = 1, where the CP group is the world); otherwise the gradients are
// all-reduced on the host (download, Gloo, upload) and the CP group is Gloo. The start event's
// "collectives" names the gradient sum's backend. The backend is built before any peer is waited
// for, so a factory that does not run the job's cp refuses it there. Checkpoints download the
// parameters and AdamW moments into the host ParamSet and use the same format, so CPU and GPU
// runs resume each other's; a resume uploads them. Step events add the device memory
// ("mem_allocated_bytes", "mem_reserved_bytes", "mem_peak_bytes") and "mfu", the model FLOP/s
// over the device's dense bf16 peak (StepBackend::PeakFlops). Not built for the GPU, each
// refused at Create() with one error: an optimizer other than AdamW, and no factory (a build
// without the CUDA engine).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "nlohmann/json.hpp"
#include "worker/engine/batch.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/checkpoint_writer.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/data.h"
#include "worker/engine/kv_store.h"
#include "worker/engine/model.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/parity_canary.h"
#include "worker/engine/recompute.h"
#include "worker/engine/replica_store.h"
#include "worker/engine/step_backend.h"

namespace spindle {

struct TrainerOptions {
  JobSpec spec;
  int64_t rank = 0;
  int64_t world = 1;
  std::string checkpoint_dir;  // overrides spec.checkpoint.dir when non-empty
  // The cluster job's attempt (> 0): rank 0 fences the checkpoint directory for it before
  // anything is loaded, every rank checks that it sees that fence (the directory is shared), and
  // commits are refused once a newer attempt has fenced it (FenceCheckpointRoot). 0: unfenced
  // (a standalone run).
  int64_t attempt = 0;
  // The step of the last checkpoint the coordinator recorded every rank of the job completing
  // (the assignment's resume_step; 0: none known, as for a standalone run or a job submitted onto
  // a directory of an earlier one). The job resumes from it or a newer complete checkpoint, never
  // from an older one: none of those that loads ends the attempt with an error naming it.
  int64_t resume_step = 0;
  std::function<void(const nlohmann::json&)> on_event;
  // Stop (as if killed) once this many steps are completed; -1 = run to spec.train.steps.
  int64_t stop_at_step = -1;
  // world > 1: where the communicators rendezvous (not owned; used during Create() only).
  KvStore* store = nullptr;
  GlooOptions gloo;
  // Gradient all-reduce bucket size, in floats.
  int64_t grad_bucket_floats = int64_t{1} << 20;
  // Builds the model of resources "cuda" jobs: CreateCudaStepBackend
  // (worker/engine/cuda/trainer_cuda.h) in binaries linked with the CUDA engine. Null: such jobs
  // fail at Create() ("this build has no CUDA engine").
  StepBackendFactory cuda_backend = nullptr;
  // Test hook (checkpoint.async): the background writer sleeps this long after each file of a
  // checkpoint (CommitCheckpoint), so that a test can kill the process mid-write. spindle-train
  // takes it from SPINDLE_CHECKPOINT_PAUSE_MS.
  int64_t checkpoint_pause_ms = 0;
  // checkpoint.replicas (replica_store.h): this rank's replica root, the job's directory in its
  // worker's replica directory (empty: this rank keeps no replicas, as a standalone trainer), the
  // worker it runs on (ranks of different workers hold each other's copies), and the job's id,
  // which every replica records. Replicas are taken only when every rank has a root.
  std::string replica_root;
  std::string replica_host;
  std::string job_id;
  // Experiments only (bench/fp8_outlier_run.sh; spindle-train's developer flag
  // --inject-outliers): one outlier injected into each dense layer's FFN input
  // (Numerics::outliers, numerics.h), the same under every train.precision. CPU engine and
  // world 1 only: a "cuda" job or a larger world with it is refused.
  std::optional<OutlierInjection> inject_outliers;
};

class Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(TrainerOptions options);
  // Waits for a replica in flight (checkpoint.replicas).
  ~Trainer();
  absl::Status Run();
  // Runs the parity canary now, before the next step (whatever parallel.verify says), emits its
  // event and, when it passed, records the layout as verified. A mismatch is a result with
  // passed == false, not an error. Every rank of the gang calls it.
  absl::StatusOr<ParityResult> Verify();
  // Returns once no background checkpoint write is in flight. Callable from any thread (while
  // Run() goes on): a process being stopped calls it so that the write it started finishes.
  void DrainCheckpointWrite() const {
    if (writer_) writer_->Drain();
  }

  // The engine: the CPU model (CpuStepBackend, resources "cpu") or the device's.
  StepBackend& backend() { return *backend_; }
  // The host optimizer: the CPU backend's own, or for a device backend a staging copy whose state
  // exists only around checkpoint loads and saves.
  Optimizer& optimizer() { return *optimizer_; }
  const TrainState& state() const { return state_; }
  // Loss of every step this process ran.
  const std::vector<double>& losses() const { return losses_; }
  const CpModes& cp_modes() const { return modes_; }
  const Recompute& recompute() const { return recompute_; }

 private:
  Trainer(TrainerOptions options) : opt_(std::move(options)) {}
  absl::Status Step();
  // This replica's micro-batches for the step: each sequence whole (`whole`, cp = 1) or this CP
  // rank's share of it (`shares`, cp > 1), with this rank's valid targets and model FLOPs (its
  // 1/cp of each sequence's).
  struct StepBatches {
    std::vector<Batch> whole;
    std::vector<CpBatch> shares;
    double valid_targets = 0.0;
    double flops = 0.0;
  };
  absl::StatusOr<StepBatches> MakeStepBatches() const;
  // After the update: counters, the loss history and the step event ("tflops": this rank's model
  // FLOPs, `flops`, over the step's time; "mfu": the same over the device's peak, when known).
  void FinishStep(std::chrono::steady_clock::time_point t0, double loss, double lr,
                  double grad_norm, double flops, nlohmann::json extra);
  // A checkpoint of the current state: with checkpoint.async, reports the previous background
  // write (waiting for it), snapshots the state and starts its write; otherwise writes it here.
  absl::Status Checkpoint();
  absl::Status CheckpointSync();
  absl::Status SnapshotCheckpoint();
  // The state into `snap` as a checkpoint takes it (rank 0; null on the other members of rank 0's
  // EP group, which take part in the gather of its expert shards; a no-op on every other rank):
  // the device's parameters and optimizer state downloaded, the shards gathered, the values
  // copied. Returns the gather's error; `*taken` gets a failed download's (the caller tells the
  // other ranks).
  absl::Status SnapshotInto(CheckpointSnapshot* snap, absl::Status* taken);
  // Every rank: when a background write is in flight and has finished (or `wait`: once it has),
  // rank 0 tells the others how it ended (a collective), and each rank emits the checkpoint event
  // or returns the write's error as CheckpointSync would have. A no-op when none is in flight.
  absl::Status ReportCheckpoint(bool wait);
  // The whole tensors of this rank's expert shards and their optimizer state, gathered over its
  // EP group (every member calls it): the values and state at `values`, `state0` and `state1`
  // (the flat layout; null: none).
  absl::Status GatherExpertShards(const float* values, const float* state0, const float* state1,
                                  GatheredShards* out);
  void Emit(nlohmann::json event);
  // The amounts every communicator recorded since the last call, as a step event's "comm".
  nlohmann::json TakeCommStats();

  // Fences the checkpoint directory (attempt > 0), then rank 0 picks the newest checkpoint that
  // loads at or after resume_step (a corrupt newest one is skipped, in a "note" event naming
  // both) and every other rank loads that same one.
  absl::Status Resume(ParamSet& params);
  // Rank 0's choice: the step loaded into params (0: there is no checkpoint); DataLoss, the
  // newest's error, when there are some and none loads; NotFound when none at or after
  // opt_.resume_step loads.
  absl::StatusOr<int64_t> LoadNewestValid(ParamSet& params);
  absl::Status LoadStep(ParamSet& params, const std::string& dir);
  // checkpoint.replicas. SetUpReplicas (Create, every rank): whether every rank has a replica
  // root, rank 0's peer (the lowest rank on another worker) and their two-rank communicator.
  absl::Status SetUpReplicas();
  // Resume, every rank: when some rank's worker holds a valid replica newer than the newest file
  // checkpoint (and not older than resume_step), the holder sends it to every rank and all load
  // it (true). false: the file path as without replicas (none newer, or the chosen one was
  // refused by a rank: the notes say why). `rank0_ready`: rank 0's checkpoint root is usable.
  absl::StatusOr<bool> ResumeFromReplicas(ParamSet& params, bool rank0_ready);
  // After a step of a multiple of checkpoint.replicas.every: rank 0 snapshots the state into host
  // memory (as a background checkpoint does) and a thread of its own serialises it (as a
  // checkpoint of this step), sends it to the peer and keeps it in rank 0's replica root; the
  // peer's own thread receives it and keeps it in its root. The previous replica is finished
  // first (FinishReplica), so at most one is in flight.
  absl::Status ReplicaSnapshot();
  // Waits for the replica in flight (rank 0 and its peer) and reports it: rank 0's "replica"
  // event; a copy that could not be kept is a note, not an error (the file checkpoints remain);
  // a peer that sent more than a replica of the model can be ends the attempt.
  absl::Status FinishReplica();
  // Device jobs with world > 1: whether every rank has a device of its own that the backend can
  // build communicators on (DeviceIds gathered over the Gloo world).
  absl::StatusOr<bool> RanksHaveOwnDevices();

  TrainerOptions opt_;
  int64_t cp_ = 1, dp_ = 1, cp_rank_ = 0, dp_rank_ = 0;
  CpModes modes_;
  Recompute recompute_;
  // Gloo: the world (scalars, broadcasts, and the gradient sum of host copies) and the CP group.
  // Device jobs whose ranks each have a GPU: device communicators for the gradient sum and CP
  // (device_cp_comm_ only when dp > 1; with dp = 1 the world's serves the CP group).
  std::unique_ptr<Communicator> world_comm_, cp_comm_, device_world_comm_, device_cp_comm_;
  // The hybrid modes: this rank's Ulysses group and its ring across the groups (device
  // communicators where the ranks have devices of their own, else Gloo).
  std::unique_ptr<Communicator> ulysses_comm_, ring_comm_;
  int64_t ulysses_ = 1;
  // Expert parallelism (ep > 1): the EP group the tokens travel over, and the group of the ranks
  // that hold the same experts (null when that is this rank alone).
  int64_t ep_ = 1;
  std::unique_ptr<Communicator> ep_comm_, expert_dp_comm_;
  bool HybridModes() const {
    return cp_ > 1 && (modes_.lightning == CpMode::kHybrid || modes_.mla == CpMode::kHybrid);
  }
  std::string ckpt_dir_;
  std::unique_ptr<DataSource> data_;
  std::unique_ptr<StepBackend> backend_;  // CpuStepBackend, or the device's (resources "cuda")
  // On the backend's host ParamSet for "cuda": the AdamW state as of the last checkpoint/resume.
  // The optimizer checkpoints load into and save from: the backend's own when it runs on the
  // host (HostOptimizer), else staging_optimizer_, a host copy whose state exists only around
  // checkpoint loads and saves.
  Optimizer* optimizer_ = nullptr;
  std::unique_ptr<Optimizer> staging_optimizer_;
  TrainState state_;
  // checkpoint.async: rank 0's writer (its snapshot buffers and thread), and on every rank the
  // step whose background write is not yet reported (-1: none).
  std::unique_ptr<CheckpointWriter> writer_;
  int64_t ckpt_in_flight_ = -1;
  double snapshot_s_ = 0;  // how long the step took to snapshot it
  std::vector<double> losses_;
  double elapsed_s_ = 0.0;
  // checkpoint.replicas: on when every rank has a replica root; rank 0's peer (-1: every rank is
  // on rank 0's worker) and the communicator of the two; the serialised snapshot (rank 0's, or
  // the one the peer received; the buffers are reused) and the most a received one may hold.
  bool replicas_on_ = false;
  int64_t replica_peer_ = -1;
  std::unique_ptr<Communicator> replica_comm_;
  CheckpointFiles replica_files_;
  ReplicaBound replica_bound_;
  bool replica_note_sent_ = false;  // one note for copies that cannot be kept
  // The replica in flight: rank 0's snapshot (its thread reads it), the thread (sending on rank 0,
  // receiving on the peer; it alone touches replica_comm_ and replica_files_ while it runs) and
  // what it ended with.
  CheckpointSnapshot replica_snapshot_;
  struct ReplicaResult {
    int64_t step = 0;
    absl::Status kept;   // the copy could not be kept: a note
    absl::Status fatal;  // the peer sent what no replica of the model is: ends the attempt
    double snapshot_s = 0, write_s = 0;
    int64_t bytes = 0;
  };
  ReplicaResult replica_result_;
  std::thread replica_thread_;
};

// Loss of a checkpoint on `n_sequences` sequences of `data` (sequences 0..n-1), without
// training. Also reports the loss on answer tokens for synthetic tasks. On the CPU model, or on
// the backend `device` builds when non-null (checkpoints are the same for both).
struct EvalResult {
  double loss = 0.0;
  int64_t n_valid = 0;
  double answer_loss = 0.0;  // NaN when the source marks no answers
  int64_t n_answers = 0;
};
absl::StatusOr<EvalResult> EvaluateCheckpoint(const JobSpec& spec, const std::string& checkpoint,
                                              const DataSpec& data, int64_t n_sequences,
                                              StepBackendFactory device = nullptr);

}  // namespace spindle
