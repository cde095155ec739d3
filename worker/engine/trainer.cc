// The step loop (CPU model or a device StepBackend), resume and evaluation (see trainer.h).
#include "worker/engine/trainer.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cp_modes.h"
#include "common/status.h"
#include "worker/engine/batch.h"
#include "worker/engine/cpu_step_backend.h"

namespace spindle {

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(TrainerOptions options) {
  std::unique_ptr<Trainer> t(new Trainer(std::move(options)));
  const JobSpec& spec = t->opt_.spec;
  TrainerOptions& o = t->opt_;
  if (o.world != spec.parallel.world())
    return absl::InvalidArgumentError(
        absl::StrCat("trainer: --world ", o.world, " does not match the job's dp x cp = ",
                     spec.parallel.dp, " x ", spec.parallel.cp));
  if (o.rank < 0 || o.rank >= o.world)
    return absl::InvalidArgumentError(
        absl::StrCat("trainer: rank ", o.rank, " is not in a world of ", o.world));
  // GPU jobs: what the CUDA engine cannot run is refused before any peer is waited for.
  const bool on_device = spec.resources == "cuda";
  if (on_device) {
    if (!o.cuda_backend)
      return absl::FailedPreconditionError(
          "trainer: the job asks for resources \"cuda\" but this build has no CUDA engine "
          "(build with -DSPINDLE_CUDA=ON where the CUDA toolkit is installed, or run the job with "
          "resources \"cpu\")");
  }
  t->cp_ = spec.parallel.cp;
  t->dp_ = spec.parallel.dp;
  t->cp_rank_ = o.rank % t->cp_;
  t->dp_rank_ = o.rank / t->cp_;
  // The spec is planned (planner/cp_planner.h, PlannedSpec): its modes and recompute are applied
  // as they are, never decided here.
  ASSIGN_OR_RETURN(t->modes_, PlannedCpModes(spec.parallel, spec.model.n_heads));
  t->ulysses_ = spec.parallel.ulysses;
  const int64_t rc = spec.train.recompute_layers;
  if (rc == TrainSpec::kRecomputeAuto)
    return absl::FailedPreconditionError(
        "trainer: train.recompute is \"auto\"; the trainer runs planned specs (the "
        "coordinator's, or spindle-train's own plan when run standalone: PlannedSpec in "
        "planner/cp_planner.h)");
  if (rc < 0 || rc > spec.model.n_layers)
    return absl::InvalidArgumentError(absl::StrCat("trainer: recompute_layers must be in [0, ",
                                                   spec.model.n_layers, "], got ", rc));
  t->recompute_ = Recompute::First(rc);
  // Expert parallelism: groups of ep consecutive ranks share each MoE layer's experts.
  if (spec.model.moe.experts > 0 && spec.parallel.ep == 0)
    return absl::FailedPreconditionError(
        "trainer: parallel.ep is not decided; the trainer runs planned specs (PlannedSpec in "
        "planner/cp_planner.h)");
  RETURN_IF_ERROR(CheckExpertParallel(spec.parallel, spec.model));
  t->ep_ = std::max<int64_t>(1, spec.parallel.ep);
  if (spec.seq_len % (2 * t->cp_) != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "trainer: seq_len ", spec.seq_len, " is not divisible by 2 * cp = ", 2 * t->cp_));
  // The model first: a device factory refuses what its backend does not run (and fails where no
  // device is usable) before any peer is waited for.
  if (on_device) {
    if (o.inject_outliers)
      return absl::InvalidArgumentError(
          "trainer: outlier injection is an experiment of the CPU engine; this job's resources "
          "are \"cuda\"");
    ASSIGN_OR_RETURN(t->backend_, o.cuda_backend(spec.model, spec.train.seed, t->cp_, t->ep_,
                                                 o.rank % t->ep_));
  } else {
    // Sites are drawn in each rank's local tensors, and the parity canary's reference has none.
    if (o.inject_outliers && o.world > 1)
      return absl::InvalidArgumentError(absl::StrCat(
          "trainer: outlier injection runs on one rank; this run's world is ", o.world));
    ASSIGN_OR_RETURN(
        std::unique_ptr<CpuStepBackend> cpu,
        CpuStepBackend::Create(spec.model, spec.train.seed, spec.train, t->ep_, o.rank % t->ep_));
    cpu->SetOutlierInjection(o.inject_outliers);
    t->backend_ = std::move(cpu);
  }
  RETURN_IF_ERROR(t->backend_->SetOffloadInputs(spec.train.offload));
  RETURN_IF_ERROR(t->backend_->SetFp8Recipe(spec.train.fp8_recipe));
  RETURN_IF_ERROR(t->backend_->SetPrecision(spec.train.precision));
  RETURN_IF_ERROR(t->backend_->SetZLoss(static_cast<float>(spec.train.z_loss)));
  if (o.world > 1) {
    if (!o.store)
      return absl::InvalidArgumentError("trainer: world > 1 needs a rendezvous store");
    const int rank = static_cast<int>(o.rank), world = static_cast<int>(o.world);
    const std::string cp_group = absl::StrCat("cp", t->dp_rank_);
    const int cp_rank = static_cast<int>(t->cp_rank_), cp = static_cast<int>(t->cp_);
    ASSIGN_OR_RETURN(t->world_comm_, CreateGlooCommunicator(*o.store, "world", rank, world, o.gloo));
    // Device jobs whose ranks each have a device: the gradient sum and the CP group on device
    // communicators (one for both when dp = 1: the CP group is then the world, and a second
    // NCCL communicator over the same ranks would hold ~0.85 GiB of the device more);
    // otherwise the CP group is Gloo.
    bool own_devices = false;
    if (on_device) {
      ASSIGN_OR_RETURN(own_devices, t->RanksHaveOwnDevices());
    }
    if (own_devices) {
      ASSIGN_OR_RETURN(t->device_world_comm_,
                       t->backend_->CreateDeviceCommunicator(*o.store, "world/device", rank,
                                                             world, o.gloo.timeout));
      if (t->cp_ > 1 && t->cp_ != world) {
        ASSIGN_OR_RETURN(t->device_cp_comm_, t->backend_->CreateDeviceCommunicator(
                                                 *o.store, cp_group + "/device", cp_rank, cp,
                                                 o.gloo.timeout));
      }
    } else if (t->cp_ > 1) {
      ASSIGN_OR_RETURN(t->cp_comm_, CreateGlooCommunicator(*o.store, cp_group, cp_rank, cp, o.gloo));
    }
    if (t->ep_ > 1) {
      // The EP group (ranks [g * ep, (g + 1) * ep)) and, across the groups, the
      // expert-data-parallel group of the ranks holding the same experts: device communicators
      // where every rank has a device of its own, else Gloo.
      const int ep = static_cast<int>(t->ep_);
      const std::string ep_name = absl::StrCat("ep", rank / ep);
      const std::string edp_name = absl::StrCat("edp", rank % ep);
      if (own_devices) {
        ASSIGN_OR_RETURN(t->ep_comm_, t->backend_->CreateDeviceCommunicator(
                                          *o.store, ep_name + "/device", rank % ep, ep,
                                          o.gloo.timeout));
      } else {
        ASSIGN_OR_RETURN(t->ep_comm_, CreateGlooCommunicator(*o.store, ep_name, rank % ep, ep, o.gloo));
      }
      if (world > ep) {
        if (own_devices) {
          ASSIGN_OR_RETURN(t->expert_dp_comm_, t->backend_->CreateDeviceCommunicator(
                                                   *o.store, edp_name + "/device", rank / ep,
                                                   world / ep, o.gloo.timeout));
        } else {
          ASSIGN_OR_RETURN(t->expert_dp_comm_, CreateGlooCommunicator(*o.store, edp_name, rank / ep,
                                                                      world / ep, o.gloo));
        }
      }
    }
    if (t->cp_ > 1 &&
        (t->modes_.lightning == CpMode::kHybrid || t->modes_.mla == CpMode::kHybrid)) {
      // This rank's Ulysses group and its ring across the groups (cp_groups.h), on the device
      // where every rank has one, else on Gloo.
      const CpGroups g{t->cp_, t->ulysses_};
      const int64_t member = g.Member(t->cp_rank_), group = g.Group(t->cp_rank_);
      const std::string u_name = absl::StrCat(cp_group, "/ulysses", group);
      const std::string r_name = absl::StrCat(cp_group, "/ring", member);
      const int u_rank = static_cast<int>(member), u_size = static_cast<int>(g.u);
      const int r_rank = static_cast<int>(group), r_size = static_cast<int>(g.r());
      if (own_devices) {
        ASSIGN_OR_RETURN(t->ulysses_comm_,
                         t->backend_->CreateDeviceCommunicator(*o.store, u_name + "/device", u_rank,
                                                               u_size, o.gloo.timeout));
        ASSIGN_OR_RETURN(t->ring_comm_,
                         t->backend_->CreateDeviceCommunicator(*o.store, r_name + "/device", r_rank,
                                                               r_size, o.gloo.timeout));
      } else {
        ASSIGN_OR_RETURN(t->ulysses_comm_,
                         CreateGlooCommunicator(*o.store, u_name, u_rank, u_size, o.gloo));
        ASSIGN_OR_RETURN(t->ring_comm_,
                         CreateGlooCommunicator(*o.store, r_name, r_rank, r_size, o.gloo));
      }
    }
  }
  t->ckpt_dir_ = t->opt_.checkpoint_dir.empty() ? spec.checkpoint.dir : t->opt_.checkpoint_dir;
  ASSIGN_OR_RETURN(t->data_,
                   OpenDataSource(spec.data, spec.seq_len, spec.model.vocab, spec.train.seed));
  if (t->cp_ > 1) {
    Communicator* cp = t->device_cp_comm_      ? t->device_cp_comm_.get()
                       : t->device_world_comm_ ? t->device_world_comm_.get()
                                               : t->cp_comm_.get();
    const MlaRingPayload payload = MlaRingPayloadFor(
        spec.model.mla, MlaRingHeads(spec.model.n_heads, t->modes_.mla, t->ulysses_));
    RETURN_IF_ERROR(t->backend_->SetCp({cp, t->modes_.lightning, t->modes_.mla,
                                        t->ulysses_comm_.get(), t->ring_comm_.get(), payload}));
  }
  RETURN_IF_ERROR(t->backend_->SetExpertParallel(t->ep_comm_.get()));
  ParamSet& params = t->backend_->host_params();
  t->optimizer_ = t->backend_->HostOptimizer();
  if (t->optimizer_ == nullptr) {
    t->staging_optimizer_ = std::make_unique<Optimizer>(spec.train, params);
    t->optimizer_ = t->staging_optimizer_.get();
  }
  t->state_.seed = spec.train.seed;
  if (spec.checkpoint.replicas_every > 0 && !t->ckpt_dir_.empty())
    RETURN_IF_ERROR(t->SetUpReplicas());
  RETURN_IF_ERROR(t->Resume(params));
  // A device's optimizer state lives there: the host copy comes back for each checkpoint.
  if (t->staging_optimizer_) t->optimizer_->ReleaseState();
  if (!t->ckpt_dir_.empty() && spec.checkpoint.async && t->opt_.rank == 0)
    t->writer_ = std::make_unique<CheckpointWriter>(
        CheckpointWriter::Options{t->ckpt_dir_, spec.model, spec.checkpoint.keep, t->opt_.attempt,
                                  t->opt_.checkpoint_pause_ms});
  return t;
}

absl::Status Trainer::LoadStep(ParamSet& params, const std::string& dir) {
  const JobSpec& spec = opt_.spec;
  ASSIGN_OR_RETURN(state_, LoadCheckpoint(dir, params, optimizer_, spec.model));
  if (state_.seed != spec.train.seed)
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint: \"", dir, "\" was written with seed ", state_.seed,
                     ", the job has train.seed = ", spec.train.seed));
  if (state_.step > spec.train.steps)
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint: \"", dir, "\" is at step ", state_.step,
                     ", past the job's train.steps = ", spec.train.steps,
                     "; raise train.steps to train on, or give the job another checkpoint.dir"));
  RETURN_IF_ERROR(backend_->UploadParams());
  if (staging_optimizer_)
    RETURN_IF_ERROR(backend_->UploadOptimizerState(optimizer_->state0(), optimizer_->state1(),
                                                   optimizer_->steps_taken()));
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Trainer::LoadNewestValid(ParamSet& params) {
  std::string skipped;  // the newer checkpoints that did not load, for the note
  absl::Status newest;  // why the newest did not
  const int64_t floor = opt_.resume_step;
  for (const std::string& dir : CompleteCheckpoints(ckpt_dir_)) {
    if (floor > 0 && CheckpointStepOf(dir) < floor) break;  // older than the coordinator's record
    absl::Status s = LoadStep(params, dir);
    if (s.ok()) {
      if (!skipped.empty())
        Emit({{"event", "note"},
              {"message", absl::StrCat(skipped, "; resumed from the previous complete one, \"", dir,
                                       "\" (step ", state_.step, ")")}});
      return state_.step;
    }
    // Only a damaged checkpoint is passed over; a wrong model or seed, or an I/O error, is the
    // job's (or the volume's) problem and ends this attempt.
    if (s.code() != absl::StatusCode::kDataLoss) return s;
    if (newest.ok()) newest = s;
    absl::StrAppend(&skipped, skipped.empty() ? "" : "; ", "checkpoint \"", dir,
                    "\" does not load (", s.message(), ")");
    state_ = TrainState{};
    state_.seed = opt_.spec.train.seed;
  }
  // The coordinator recorded a checkpoint that no longer loads: resuming from an older one or
  // from scratch would throw away what the job is known to have done; the job fails, naming it.
  if (floor > 0)
    return absl::NotFoundError(
        absl::StrCat("trainer: the job's last checkpoint, step ", floor,
                     " (every rank completed it, as the coordinator recorded), is not in \"",
                     ckpt_dir_, "\" and no newer complete one loads",
                     skipped.empty() ? std::string() : absl::StrCat(" (", skipped, ")")));
  // Damaged checkpoints and none that loads: starting over would throw away the job's progress
  // (and prune what is left); the job fails, naming the newest.
  if (!newest.ok()) return newest;
  return 0;
}

absl::Status Trainer::Resume(ParamSet& params) {
  if (ckpt_dir_.empty()) return absl::OkStatus();
  const int64_t attempt = opt_.attempt;
  // Rank 0 writes: it creates the root, checks that it can write there and fences it.
  absl::Status ready;
  if (opt_.rank == 0) {
    ready = CheckCheckpointRoot(ckpt_dir_);
    if (ready.ok() && attempt > 0) ready = FenceCheckpointRoot(ckpt_dir_, attempt);
  }
  if (replicas_on_) {
    ASSIGN_OR_RETURN(const bool from_replica, ResumeFromReplicas(params, ready.ok()));
    if (from_replica) return absl::OkStatus();
  }
  int64_t step = 0;
  if (ready.ok() && opt_.rank == 0) {
    absl::StatusOr<int64_t> chosen = LoadNewestValid(params);
    if (chosen.ok()) step = *chosen;
    ready = chosen.status();
  }
  if (!world_comm_) return ready;
  // Rank 0's choice (or -1: rank 0 failed) to every rank; from here on rank 0's fence is on disk.
  double chosen = ready.ok() ? static_cast<double>(step) : -1.0;
  RETURN_IF_ERROR(world_comm_->Broadcast(&chosen, 1, CommType::kF64, 0, CommLayer::kOther));
  world_comm_->TakeStats();
  if (chosen < 0) {
    if (opt_.rank == 0) return ready;
    return absl::AbortedError("trainer: rank 0 could not resume (its error ends the attempt)");
  }
  // Every other rank checks the fence and loads rank 0's choice; the verdicts are gathered so
  // that all ranks end the attempt with the same error (a rank that does not share the
  // directory is named by every rank, rank 0 first, instead of its peers failing on the lost
  // connection): 0 ok, 1 no fence of this attempt, 2 the checkpoint missing, 3 superseded by a
  // newer attempt, 4 another error (the rank's own).
  step = static_cast<int64_t>(chosen);
  const std::string dir = absl::StrCat(ckpt_dir_, "/", absl::StrFormat("step_%08d", step));
  int32_t verdict = 0;
  absl::Status own;
  if (opt_.rank != 0) {
    absl::StatusOr<int64_t> fence = attempt > 0 ? ReadFence(ckpt_dir_) : absl::StatusOr<int64_t>(0);
    if (!fence.ok()) {
      own = fence.status();
      verdict = 4;
    } else if (*fence > attempt) {
      verdict = 3;
    } else if (*fence < attempt) {
      verdict = 1;
    } else if (step > 0) {
      own = LoadStep(params, dir);
      verdict = own.ok() ? 0 : own.code() == absl::StatusCode::kNotFound ? 2 : 4;
    }
  }
  std::vector<int32_t> verdicts(opt_.world, 0);
  RETURN_IF_ERROR(
      world_comm_->AllGather(&verdict, 4, CommType::kByte, verdicts.data(), CommLayer::kOther));
  world_comm_->TakeStats();
  for (int64_t r = 0; r < opt_.world; ++r) {
    const std::string volume =
        absl::StrCat("checkpoint.dir \"", ckpt_dir_, "\" is not shared: rank ", r);
    const char* remedy = " (every host of a job needs the same checkpoint volume)";
    switch (verdicts[r]) {
      case 0:
        continue;
      case 1:
        return absl::FailedPreconditionError(absl::StrCat(
            volume, " does not see the fence rank 0 wrote there for attempt ", attempt, remedy));
      case 2:
        return absl::FailedPreconditionError(
            absl::StrCat(volume, " cannot find \"", dir, "\", which rank 0 resumed from", remedy));
      case 3:
        return absl::AbortedError(absl::StrCat("trainer: attempt ", attempt,
                                               " of the job was superseded by a newer attempt"));
      default:
        if (r == opt_.rank) return own;
        return absl::AbortedError(
            absl::StrCat("trainer: rank ", r, " could not resume (its error ends the attempt)"));
    }
  }
  // With replicas the job's events say which a restart used (ResumeFromReplicas names its own).
  if (replicas_on_ && opt_.rank == 0 && step > 0)
    Emit({{"event", "note"}, {"message", absl::StrCat("resumed from checkpoint step ", step)}});
  return absl::OkStatus();
}

absl::StatusOr<bool> Trainer::RanksHaveOwnDevices() {
  constexpr int64_t kIdBytes = 64;
  const std::string id = backend_->DeviceId();
  std::vector<char> mine(kIdBytes, 0), all(kIdBytes * opt_.world, 0);
  std::copy_n(id.begin(), std::min<int64_t>(kIdBytes, static_cast<int64_t>(id.size())),
              mine.begin());
  RETURN_IF_ERROR(
      world_comm_->AllGather(mine.data(), kIdBytes, CommType::kByte, all.data(), CommLayer::kOther));
  world_comm_->TakeStats();
  std::vector<std::string> ids;
  for (int64_t r = 0; r < opt_.world; ++r) {
    const char* p = all.data() + r * kIdBytes;
    ids.emplace_back(p, std::find(p, p + kIdBytes, '\0'));
    if (ids.back().empty()) return false;  // some rank cannot build device communicators
  }
  std::sort(ids.begin(), ids.end());
  return std::adjacent_find(ids.begin(), ids.end()) == ids.end();
}

void Trainer::Emit(nlohmann::json event) {
  if (opt_.on_event) opt_.on_event(event);
}

absl::Status Trainer::Run() {
  const JobSpec& spec = opt_.spec;
  Emit({{"event", "start"},
        {"job", spec.name},
        {"rank", opt_.rank},
        {"world", opt_.world},
        {"resumed_from_step", state_.step},
        {"total_steps", spec.train.steps},
        {"params", spec.model.NumParams()},
        {"seq_len", spec.seq_len},
        {"recompute_layers", recompute_.layers},
        {"precision", std::string(TrainPrecisionName(spec.train.precision))},
        {"collectives", device_world_comm_ ? device_world_comm_->backend()
                        : world_comm_      ? world_comm_->backend()
                                           : "none"}});
  // Resumed at the job's last step (its previous attempt ended as the coordinator lost track of
  // it): nothing to train, but the job's final loss is the checkpoint's.
  if (state_.step >= spec.train.steps && state_.loss != 0)
    Emit({{"event", "step"},
          {"step", state_.step},
          {"total_steps", spec.train.steps},
          {"loss", state_.loss},
          {"resumed", true}});
  // Set once the parity canary could not run here (its reference did not fit): not retried.
  bool parity_unavailable = false;
  while (state_.step < spec.train.steps) {
    // A stop waits for the checkpoint being written.
    if (opt_.stop_at_step >= 0 && state_.step >= opt_.stop_at_step) {
      RETURN_IF_ERROR(FinishReplica());
      return ReportCheckpoint(true);
    }
    RETURN_IF_ERROR(ReportCheckpoint(false));
    if (!parity_unavailable && ParityDue(spec.parallel, state_.step + 1, state_.verified_layout,
                                         ParityLayoutKey(spec, modes_))) {
      ASSIGN_OR_RETURN(const ParityResult parity, Verify());
      if (!parity.passed) return absl::FailedPreconditionError(parity.FailureMessage());
      parity_unavailable = parity.skipped && ParityApplies(spec.parallel);
    }
    RETURN_IF_ERROR(Step());
    const bool last = state_.step == spec.train.steps;
    const bool due = spec.checkpoint.every > 0 && state_.step % spec.checkpoint.every == 0;
    if (!ckpt_dir_.empty() && (last || due)) RETURN_IF_ERROR(Checkpoint());
    const int64_t every = spec.checkpoint.replicas_every;
    if (replicas_on_ && !last && every > 0 && state_.step % every == 0)
      RETURN_IF_ERROR(ReplicaSnapshot());
  }
  RETURN_IF_ERROR(FinishReplica());
  RETURN_IF_ERROR(ReportCheckpoint(true));  // the final checkpoint is on disk before "done"
  Emit({{"event", "done"},
        {"step", state_.step},
        {"final_loss", losses_.empty() ? std::numeric_limits<double>::quiet_NaN() : losses_.back()}});
  return absl::OkStatus();
}

namespace {
// The factor the averaged gradients are multiplied by before the update: 1 unless clipping.
float ClipScale(const TrainSpec& t, double grad_norm) {
  return t.grad_clip > 0 && grad_norm > t.grad_clip
             ? static_cast<float>(t.grad_clip / (grad_norm + 1e-6))
             : 1.0f;
}
}  // namespace

absl::StatusOr<Trainer::StepBatches> Trainer::MakeStepBatches() const {
  const JobSpec& spec = opt_.spec;
  const int64_t mb = spec.train.micro_batches;
  StepBatches out;
  for (int64_t m = 0; m < mb; ++m) {
    Batch full = MakeSequenceBatch(data_->Sequence(state_.data_position + dp_rank_ * mb + m),
                                   data_->eos_id());
    out.flops += spec.model.TrainFlops(full.T, AttentionPairs(full)) / static_cast<double>(cp_);
    if (cp_ == 1) {
      out.valid_targets += static_cast<double>(full.NumValidTargets());
      out.whole.push_back(std::move(full));
      continue;
    }
    ASSIGN_OR_RETURN(CpBatch b, ShardForCp(full, cp_, cp_rank_, HybridModes() ? ulysses_ : 1));
    out.valid_targets += static_cast<double>(b.local.NumValidTargets());
    out.shares.push_back(std::move(b));
  }
  return out;
}

// One step for every backend: every rank's gradients are those of (1 / the world's valid
// targets) x its loss sum (over its CP share of each sequence when cp > 1, its whole sequences at
// cp = 1), summed over the world: in place on the device with device communicators; for host
// gradients (the CPU backend) in buckets from the end of the flat buffer, each all-reduced as
// soon as the last micro-batch's backward has moved below its start; otherwise through host
// copies after the backward. The norm of the sum decides the clip factor, which the optimizer
// applies to the gradients before its update.
absl::Status Trainer::Step() {
  const JobSpec& spec = opt_.spec;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t mb = spec.train.micro_batches;
  ASSIGN_OR_RETURN(StepBatches sb, MakeStepBatches());
  double loss_sum = 0.0, n_valid = sb.valid_targets;  // this rank's, then the world's
  if (world_comm_)
    RETURN_IF_ERROR(world_comm_->AllReduceSum(&n_valid, 1, CommType::kF64, CommLayer::kOther));
  RETURN_IF_ERROR(backend_->ZeroGrads());
  backend_->BeginStep(static_cast<double>(spec.seq_len * mb * dp_));
  const float grad_scale = n_valid > 0 ? 1.0f / static_cast<float>(n_valid) : 0.0f;
  const bool overlap = world_comm_ && !device_world_comm_ && backend_->HostGradients();
  Tensor& g = backend_->host_params().flat_grad();
  std::vector<CommHandle> pending;
  const int64_t B = std::max<int64_t>(1, opt_.grad_bucket_floats);
  // Sharded experts' gradients, [0, expert_end), are summed over the expert-data-parallel group
  // instead of the world.
  const int64_t expert_end = ep_ > 1 ? backend_->ExpertGradEnd() : 0;
  int64_t launched_to = g.numel();  // [launched_to, numel) is in flight
  auto on_ready = [&](int64_t flat_begin) {
    while (launched_to > expert_end &&
           std::max<int64_t>(expert_end, launched_to - B) >= flat_begin) {
      const int64_t begin = std::max<int64_t>(expert_end, launched_to - B);
      pending.push_back(world_comm_->AllReduceSumAsync(g.f32() + begin, launched_to - begin,
                                                       CommType::kF32, CommLayer::kGrad));
      launched_to = begin;
    }
  };
  for (int64_t m = 0; m < mb; ++m) {
    const GradReadyFn hook = overlap && m + 1 == mb ? GradReadyFn(on_ready) : nullptr;
    ASSIGN_OR_RETURN(LossStats s,
                     cp_ > 1 ? backend_->ForwardBackward(sb.shares[m], grad_scale, recompute_, hook)
                             : backend_->ForwardBackward(sb.whole[m], grad_scale, recompute_, hook));
    loss_sum += s.loss_sum;
  }
  if (overlap) {
    if (expert_dp_comm_)
      pending.push_back(expert_dp_comm_->AllReduceSumAsync(g.f32(), expert_end, CommType::kF32,
                                                           CommLayer::kGrad));
    absl::Status comm_status;
    for (CommHandle& h : pending) comm_status.Update(h.Wait());
    RETURN_IF_ERROR(comm_status);
  } else if (device_world_comm_) {
    RETURN_IF_ERROR(backend_->AllReduceGrads(*device_world_comm_, expert_end, g.numel()));
    if (expert_dp_comm_) RETURN_IF_ERROR(backend_->AllReduceGrads(*expert_dp_comm_, 0, expert_end));
  } else if (world_comm_) {
    RETURN_IF_ERROR(backend_->DownloadGrads());
    RETURN_IF_ERROR(world_comm_->AllReduceSum(g.f32() + expert_end, g.numel() - expert_end,
                                              CommType::kF32, CommLayer::kGrad));
    if (expert_dp_comm_)
      RETURN_IF_ERROR(
          expert_dp_comm_->AllReduceSum(g.f32(), expert_end, CommType::kF32, CommLayer::kGrad));
    RETURN_IF_ERROR(backend_->UploadGrads());
  }
  if (world_comm_)
    RETURN_IF_ERROR(world_comm_->AllReduceSum(&loss_sum, 1, CommType::kF64, CommLayer::kOther));
  const double loss = n_valid > 0 ? loss_sum / n_valid : 0.0;
  if (!std::isfinite(loss))
    return absl::InternalError(absl::StrCat("trainer: loss is not finite at step ", state_.step + 1));
  double sum_squares = 0.0;
  if (expert_end > 0) {
    // The EP group's ranks hold different experts: their parts of the norm add up.
    ASSIGN_OR_RETURN(double experts, backend_->GradSquaredNorm(0, expert_end));
    ASSIGN_OR_RETURN(const double rest, backend_->GradSquaredNorm(expert_end, g.numel()));
    RETURN_IF_ERROR(ep_comm_->AllReduceSum(&experts, 1, CommType::kF64, CommLayer::kOther));
    sum_squares = experts + rest;
  } else {
    ASSIGN_OR_RETURN(sum_squares, backend_->GradSquaredNorm());
  }
  const double grad_norm = std::sqrt(sum_squares);
  const double lr = ScheduledLr(spec.train, state_.step);
  RETURN_IF_ERROR(backend_->OptimizerStep(spec.train, lr, ClipScale(spec.train, grad_norm)));
  ASSIGN_OR_RETURN(nlohmann::json moe_fields, backend_->FinishMoeStep(world_comm_.get()));
  FinishStep(t0, loss, lr, grad_norm, sb.flops, std::move(moe_fields));
  return absl::OkStatus();
}

void Trainer::FinishStep(std::chrono::steady_clock::time_point t0, double loss, double lr,
                         double grad_norm, double flops, nlohmann::json extra) {
  const JobSpec& spec = opt_.spec;
  const int64_t mb = spec.train.micro_batches;
  state_.step += 1;
  state_.data_position += mb * spec.parallel.dp;
  losses_.push_back(loss);
  state_.loss = loss;
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  elapsed_s_ += dt;
  // This rank's tokens: its 1/cp share of each of its replica's sequences (the job's throughput
  // is the sum over ranks, as the coordinator and the dashboards add it up).
  const double tokens = static_cast<double>(spec.seq_len * mb) / static_cast<double>(cp_);
  nlohmann::json comm = TakeCommStats();
  nlohmann::json e = {{"event", "step"},
                      {"step", state_.step},
                      {"total_steps", spec.train.steps},
                      {"loss", loss},
                      {"tokens_per_s", tokens / dt},
                      {"step_s", dt},
                      {"lr", lr},
                      {"grad_norm", grad_norm},
                      {"elapsed_s", elapsed_s_},
                      {"tflops", flops / dt / 1e12}};
  if (!comm.empty()) e["comm"] = std::move(comm);
  e.update(backend_->StepEventFields());
  if (extra.is_object()) e.update(extra);
  if (const double peak = backend_->PeakFlops(); peak > 0) e["mfu"] = flops / dt / peak;
  Emit(std::move(e));
}

nlohmann::json Trainer::TakeCommStats() {
  nlohmann::json comm = nlohmann::json::array();
  for (Communicator* c :
       {world_comm_.get(), cp_comm_.get(), ulysses_comm_.get(), ring_comm_.get(),
        device_world_comm_.get(), device_cp_comm_.get(), ep_comm_.get(), expert_dp_comm_.get()}) {
    if (!c) continue;
    for (const auto& [key, amount] : c->TakeStats())
      comm.push_back({{"collective", CollectiveName(key.first)},
                      {"layer_type", CommLayerName(key.second)},
                      {"seconds", amount.seconds},
                      {"bytes", amount.bytes}});
  }
  return comm;
}

absl::StatusOr<ParityResult> Trainer::Verify() {
  const JobSpec& spec = opt_.spec;
  const std::string key = ParityLayoutKey(spec, modes_);
  const int64_t next_step = state_.step + 1;
  if (!ParityApplies(spec.parallel)) {
    const ParityResult r = SkippedParity(spec.parallel, modes_);
    state_.verified_layout = key;
    Emit(r.ToEvent(next_step));
    return r;
  }
  ParityGang gang;
  gang.layout = DescribeParityLayout(spec.parallel, modes_);
  gang.rank = opt_.rank;
  gang.world = opt_.world;
  gang.cp = cp_;
  gang.cp_rank = cp_rank_;
  gang.dp = dp_;
  gang.ep = ep_;
  gang.shard_ulysses = HybridModes() ? ulysses_ : 1;
  gang.modes = modes_;
  gang.recompute = recompute_;
  gang.world_comm = world_comm_.get();
  gang.device_world = device_world_comm_.get();
  gang.expert_dp = expert_dp_comm_.get();
  // The numbers the check runs at (ParityPrecision: an fp8 job's layout at bf16), on both sides.
  const TrainPrecision precision = ParityPrecision(spec.train.precision);
  // The reference: the job's engine and model at cp = 1, ep = 1.
  const StepBackendFactory device = spec.resources == "cuda" ? opt_.cuda_backend : nullptr;
  ReferenceBackendFactory reference =
      [&spec, device, precision]() -> absl::StatusOr<std::unique_ptr<StepBackend>> {
    std::unique_ptr<StepBackend> b;
    if (device) {
      ASSIGN_OR_RETURN(b, device(spec.model, spec.train.seed, /*cp=*/1, /*ep=*/1, 0));
    } else {
      ASSIGN_OR_RETURN(b, CpuStepBackend::Create(spec.model, spec.train.seed, spec.train, 1, 0));
    }
    RETURN_IF_ERROR(b->SetFp8Recipe(spec.train.fp8_recipe));
    RETURN_IF_ERROR(b->SetPrecision(precision));
    RETURN_IF_ERROR(b->SetZLoss(static_cast<float>(spec.train.z_loss)));
    return b;
  };
  ParityOptions options;
  options.precision = precision;
  options.resources = spec.resources;
  if (precision != spec.train.precision) RETURN_IF_ERROR(backend_->SetPrecision(precision));
  absl::StatusOr<ParityResult> checked = RunParityCanary(
      *backend_, gang, data_->Sequence(state_.data_position), data_->eos_id(), reference, options);
  if (precision != spec.train.precision)
    RETURN_IF_ERROR(backend_->SetPrecision(spec.train.precision));
  ASSIGN_OR_RETURN(ParityResult r, std::move(checked));
  // The canary's traffic is its own, not the next step's.
  int64_t bytes = 0;
  for (const nlohmann::json& c : TakeCommStats()) bytes += c["bytes"].get<int64_t>();
  nlohmann::json e = r.ToEvent(next_step);
  e["comm_bytes"] = bytes;
  e["precision"] = std::string(TrainPrecisionName(precision));
  if (r.passed && !r.skipped) state_.verified_layout = key;
  Emit(std::move(e));
  return r;
}

absl::Status Trainer::GatherExpertShards(const float* values, const float* state0,
                                         const float* state1, GatheredShards* out) {
  ParamSet& params = backend_->host_params();
  for (int i = 0; i < params.size(); ++i) {
    const ParamInfo& p = params.info(i);
    if (!p.sharded()) continue;
    std::array<std::vector<float>, 3>& whole = out->tensors[i];
    const float* parts[3] = {values + p.offset, state0 ? state0 + p.offset : nullptr,
                             state1 ? state1 + p.offset : nullptr};
    for (int k = 0; k < 3; ++k) {
      if (parts[k] == nullptr) continue;
      whole[k].resize(static_cast<size_t>(p.numel * ep_));
      RETURN_IF_ERROR(ep_comm_->AllGather(parts[k], p.numel, CommType::kF32, whole[k].data(),
                                          CommLayer::kOther));
    }
  }
  return absl::OkStatus();
}

namespace {
// A wait for a background write at least this long is named in a note.
constexpr double kCheckpointBlockedNoteS = 0.5;
}  // namespace

absl::Status Trainer::Checkpoint() {
  if (!opt_.spec.checkpoint.async) return CheckpointSync();
  // At most one write in flight: the previous one is reported first, the step waiting for it.
  RETURN_IF_ERROR(ReportCheckpoint(true));
  return SnapshotCheckpoint();
}

namespace {
const float* DataOrNull(Tensor& t) { return t.empty() ? nullptr : t.f32(); }
}  // namespace

// Rank 0 writes; then every rank reports the checkpoint (the coordinator counts a checkpoint as
// complete when all ranks did), the others only once rank 0 says it is on disk.
absl::Status Trainer::CheckpointSync() {
  absl::StatusOr<std::string> dir = ckpt_dir_;
  // Rank 0 writes; with sharded experts the rest of its EP group gives it their shards.
  const bool contributes = opt_.rank == 0 || (ep_ > 1 && opt_.rank < ep_);
  if (contributes) {
    // The device's parameters and optimizer state into the host copies the checkpoint code
    // writes (zeros for state the device does not keep, as the CPU optimizer has them); a host
    // optimizer is written as it is.
    absl::Status s = backend_->DownloadParams();
    if (staging_optimizer_) {
      optimizer_->AllocateState();
      if (s.ok()) s = backend_->DownloadOptimizerState(&optimizer_->state0(), &optimizer_->state1());
      optimizer_->set_steps_taken(backend_->steps_taken());
    }
    if (!s.ok()) dir = s;
  }
  // Every member of the group takes part in the gather, whatever its download gave, so that none
  // waits for another; a failed download still fails the write.
  GatheredShards gathered;
  if (ep_ > 1 && opt_.rank < ep_) {
    absl::Status s = GatherExpertShards(backend_->host_params().flat_data().f32(),
                                        DataOrNull(optimizer_->state0()),
                                        DataOrNull(optimizer_->state1()), &gathered);
    if (!s.ok()) {
      if (staging_optimizer_) optimizer_->ReleaseState();
      return s;
    }
  }
  if (opt_.rank == 0 && dir.ok())
    dir = SaveCheckpoint(ckpt_dir_, backend_->host_params(), optimizer_, opt_.spec.model, state_,
                         opt_.spec.checkpoint.keep, opt_.attempt, &gathered);
  if (staging_optimizer_) optimizer_->ReleaseState();
  if (world_comm_) {
    int32_t written = dir.ok() ? 1 : 0;
    RETURN_IF_ERROR(world_comm_->Broadcast(&written, 1, CommType::kI32, 0, CommLayer::kOther));
    if (!written && opt_.rank != 0)
      return absl::InternalError(
          absl::StrCat("trainer: rank 0 failed to write the checkpoint of step ", state_.step));
  }
  if (!dir.ok()) return dir.status();
  Emit({{"event", "checkpoint"}, {"step", state_.step}, {"path", *dir}});
  return absl::OkStatus();
}

// The state into host memory, as CheckpointSync takes it, but rank 0 copies it into its writer's
// snapshot (the device's optimizer state straight into it) and starts the write. A failed
// snapshot is told to every rank at once (one broadcast per checkpoint) and fails as a failed
// write does.
absl::Status Trainer::SnapshotCheckpoint() {
  const auto t0 = std::chrono::steady_clock::now();
  CheckpointSnapshot* snap = writer_ ? &writer_->snapshot() : nullptr;
  ParamSet& params = backend_->host_params();
  absl::Status s;
  RETURN_IF_ERROR(SnapshotInto(snap, &s));
  if (snap && s.ok()) {
    absl::StatusOr<CheckpointTensors> tensors = snap->Tensors(params);
    if (tensors.ok())
      writer_->Start(*std::move(tensors), state_);
    else
      s = tensors.status();
  }
  if (world_comm_) {
    int32_t taken = s.ok() ? 1 : 0;
    RETURN_IF_ERROR(world_comm_->Broadcast(&taken, 1, CommType::kI32, 0, CommLayer::kOther));
    if (!taken && opt_.rank != 0)
      return absl::InternalError(
          absl::StrCat("trainer: rank 0 failed to write the checkpoint of step ", state_.step));
  }
  if (!s.ok()) return s;
  ckpt_in_flight_ = state_.step;
  snapshot_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return absl::OkStatus();
}

absl::Status Trainer::SnapshotInto(CheckpointSnapshot* snap, absl::Status* taken) {
  const bool contributes = opt_.rank == 0 || (ep_ > 1 && opt_.rank < ep_);
  ParamSet& params = backend_->host_params();
  absl::Status& s = *taken;
  const float *state0 = nullptr, *state1 = nullptr;
  bool staged = false;  // the staging optimizer holds state to release
  if (contributes) {
    s = backend_->DownloadParams();
    if (staging_optimizer_ && snap) {
      snap->PrepareOptimizerState(
          params.numel(),
          {optimizer_->spec().optimizer, optimizer_->is_adamw(), backend_->steps_taken()});
      if (s.ok()) s = backend_->DownloadOptimizerState(&snap->state0(), &snap->state1());
      state0 = DataOrNull(snap->state0());
      state1 = DataOrNull(snap->state1());
    } else if (staging_optimizer_) {  // an EP peer of rank 0: its state only for the gather
      optimizer_->AllocateState();
      staged = true;
      if (s.ok())
        s = backend_->DownloadOptimizerState(&optimizer_->state0(), &optimizer_->state1());
      state0 = DataOrNull(optimizer_->state0());
      state1 = DataOrNull(optimizer_->state1());
    } else {
      state0 = DataOrNull(optimizer_->state0());
      state1 = DataOrNull(optimizer_->state1());
    }
  }
  if (ep_ > 1 && opt_.rank < ep_) {
    GatheredShards local;
    absl::Status g = GatherExpertShards(params.flat_data().f32(), state0, state1,
                                        snap ? &snap->gathered() : &local);
    if (!g.ok()) {
      if (staged) optimizer_->ReleaseState();
      return g;
    }
  }
  if (staged) optimizer_->ReleaseState();
  if (snap && s.ok()) {
    snap->CopyParams(params);
    if (!staging_optimizer_) snap->CopyOptimizer(*optimizer_);
  }
  return absl::OkStatus();
}

absl::Status Trainer::ReportCheckpoint(bool wait) {
  if (ckpt_in_flight_ < 0) return absl::OkStatus();
  int32_t code = 0;  // 0: still being written, 1: committed, 2: failed
  std::optional<CheckpointWriteResult> result;
  double blocked_s = 0;
  if (writer_ && (wait || writer_->Finished())) {
    result = writer_->Wait(&blocked_s);
    code = result && result->dir.ok() ? 1 : 2;
  }
  if (world_comm_) {
    RETURN_IF_ERROR(world_comm_->Broadcast(&code, 1, CommType::kI32, 0, CommLayer::kOther));
    world_comm_->TakeStats();  // the poll's traffic is not the next step's
  }
  if (code == 0) return absl::OkStatus();
  const int64_t step = std::exchange(ckpt_in_flight_, -1);
  if (code != 1) {
    if (result && !result->dir.ok()) return result->dir.status();
    return absl::InternalError(
        absl::StrCat("trainer: rank 0 failed to write the checkpoint of step ", step));
  }
  nlohmann::json e = {{"event", "checkpoint"},
                      {"step", step},
                      {"path", result ? *result->dir : ckpt_dir_},
                      {"snapshot_s", snapshot_s_},
                      {"blocked_s", blocked_s}};
  if (result) e["write_s"] = result->write_s;
  Emit(std::move(e));
  // The steps waited for the write (the next snapshot came first, or the job's end): the volume
  // is slower than checkpoint.every allows for.
  if (blocked_s >= kCheckpointBlockedNoteS)
    Emit({{"event", "note"},
          {"message", absl::StrFormat("training waited %.1f s for the background write of the "
                                      "checkpoint of step %d (the write took %.1f s)",
                                      blocked_s, step, result->write_s)}});
  return absl::OkStatus();
}

absl::StatusOr<EvalResult> EvaluateCheckpoint(const JobSpec& spec, const std::string& checkpoint,
                                              const DataSpec& data, int64_t n_sequences,
                                              StepBackendFactory device) {
  ASSIGN_OR_RETURN(auto source, OpenDataSource(data, spec.seq_len, spec.model.vocab, spec.train.seed));
  std::unique_ptr<Model> model;
  std::unique_ptr<StepBackend> backend;
  if (device) {
    ASSIGN_OR_RETURN(backend, device(spec.model, spec.train.seed, /*cp=*/1, /*ep=*/1, 0));
    RETURN_IF_ERROR(backend->SetFp8Recipe(spec.train.fp8_recipe));
    RETURN_IF_ERROR(backend->SetPrecision(spec.train.precision));
    RETURN_IF_ERROR(
        LoadCheckpoint(checkpoint, backend->host_params(), nullptr, spec.model).status());
    RETURN_IF_ERROR(backend->UploadParams());
  } else {
    ASSIGN_OR_RETURN(model, Model::Create(spec.model, spec.train.seed));
    model->SetNumerics(CpuNumerics(spec.train.precision, spec.train.fp8_recipe));
    RETURN_IF_ERROR(LoadCheckpoint(checkpoint, model->params(), nullptr, spec.model).status());
  }
  auto forward = [&](const Batch& b) -> absl::StatusOr<LossStats> {
    if (backend) return backend->Forward(b);
    return model->Forward(b);
  };
  EvalResult r;
  double sum = 0.0, ans_sum = 0.0;
  for (int64_t n = 0; n < n_sequences; ++n) {
    Batch b = MakeSequenceBatch(source->Sequence(n), source->eos_id());
    ASSIGN_OR_RETURN(LossStats s, forward(b));
    sum += s.loss_sum;
    r.n_valid += s.n_valid;
    // Answer tokens: keep only targets that are answers, and run again (cheap at eval sizes).
    std::vector<bool> mask = source->AnswerMask(n);
    if (!mask.empty()) {
      Batch a = b;
      for (int64_t i = 0; i < a.T; ++i)
        a.targets[i] = (i + 1 < a.T && mask[i + 1]) ? a.targets[i] : -1;
      ASSIGN_OR_RETURN(LossStats sa, forward(a));
      ans_sum += sa.loss_sum;
      r.n_answers += sa.n_valid;
    }
  }
  r.loss = r.n_valid ? sum / r.n_valid : 0.0;
  r.answer_loss = r.n_answers ? ans_sum / r.n_answers : std::numeric_limits<double>::quiet_NaN();
  return r;
}

}  // namespace spindle
