// The Trainer's in-memory checkpoint replicas (checkpoint.replicas): who holds rank 0's peer copy,
// the snapshot every replicas.every steps, and the resume from the newest replica that survives
// (see trainer.h and replica_store.h).
#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "worker/engine/trainer.h"

namespace spindle {
namespace {

// A worker's id as the ranks exchange it: a flag (the rank has a replica root), then the id.
constexpr int64_t kHostIdBytes = 128;
// Replicas travel in broadcasts of at most this many bytes each.
constexpr int64_t kChunkBytes = int64_t{256} << 20;

absl::Status BroadcastBytes(Communicator& comm, std::string* bytes, int root) {
  for (int64_t off = 0; off < static_cast<int64_t>(bytes->size()); off += kChunkBytes) {
    const int64_t n = std::min<int64_t>(kChunkBytes, static_cast<int64_t>(bytes->size()) - off);
    RETURN_IF_ERROR(
        comm.Broadcast(bytes->data() + off, n, CommType::kByte, root, CommLayer::kOther));
  }
  return absl::OkStatus();
}

// Every rank's verdict (true: fine) over the world; the lowest failing rank, or -1.
absl::StatusOr<int64_t> FirstFailing(Communicator* world, bool ok, int64_t world_size) {
  std::vector<int32_t> all(world_size, 1);
  int32_t mine = ok ? 1 : 0;
  if (world) {
    RETURN_IF_ERROR(world->AllGather(&mine, 4, CommType::kByte, all.data(), CommLayer::kOther));
  } else {
    all[0] = mine;
  }
  for (int64_t r = 0; r < world_size; ++r)
    if (!all[r]) return r;
  return -1;
}

}  // namespace

absl::Status Trainer::SetUpReplicas() {
  const int64_t world = opt_.world;
  std::vector<char> mine(kHostIdBytes, 0), all(kHostIdBytes * world, 0);
  mine[0] = opt_.replica_root.empty() ? 0 : 1;
  std::copy_n(opt_.replica_host.begin(),
              std::min<int64_t>(kHostIdBytes - 1, static_cast<int64_t>(opt_.replica_host.size())),
              mine.begin() + 1);
  if (world_comm_) {
    RETURN_IF_ERROR(world_comm_->AllGather(mine.data(), kHostIdBytes, CommType::kByte, all.data(),
                                           CommLayer::kOther));
    world_comm_->TakeStats();
  } else {
    all = mine;
  }
  std::vector<std::string> hosts;
  for (int64_t r = 0; r < world; ++r) {
    const char* p = all.data() + r * kHostIdBytes;
    if (p[0] == 0) {
      if (opt_.rank == 0)
        Emit({{"event", "note"},
              {"message", absl::StrCat("checkpoint.replicas: rank ", r,
                                       " has no replica directory (its worker keeps none, "
                                       "--replica_dir=off, or a trainer run standalone); the "
                                       "job keeps no in-memory replicas")}});
      return absl::OkStatus();
    }
    hosts.emplace_back(p + 1, std::find(p + 1, p + kHostIdBytes, '\0'));
  }
  replicas_on_ = true;
  replica_bound_ = ReplicaBoundFor(backend_->host_params(), 2);
  for (int64_t r = 1; r < world && replica_peer_ < 0; ++r)
    if (hosts[r] != hosts[0]) replica_peer_ = r;
  if (replica_peer_ < 0) {
    if (opt_.rank == 0)
      Emit({{"event", "note"},
            {"message", absl::StrCat("checkpoint.replicas: every rank runs on worker \"", hosts[0],
                                     "\": the in-memory replicas have no copy on another host")}});
    return absl::OkStatus();
  }
  if (opt_.rank == 0 || opt_.rank == replica_peer_) {
    ASSIGN_OR_RETURN(replica_comm_, CreateGlooCommunicator(*opt_.store, "replicas",
                                                           opt_.rank == 0 ? 0 : 1, 2, opt_.gloo));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Trainer::ResumeFromReplicas(ParamSet& params, bool rank0_ready) {
  const std::string& root = opt_.replica_root;
  const int64_t rank = opt_.rank, world = opt_.world;
  auto note = [this](const std::string& text) { Emit({{"event", "note"}, {"message", text}}); };
  // This rank's candidate: its worker's newest valid replica, once the root is this attempt's.
  ReplicaChoice mine;
  if (absl::Status fenced = FenceCheckpointRoot(root, opt_.attempt); fenced.ok()) {
    mine = NewestReplica(root, opt_.job_id, opt_.attempt, replica_bound_);
  } else {
    note(absl::StrCat("in-memory replicas on worker \"", opt_.replica_host,
                      "\" not used: ", fenced.message()));
  }
  for (const std::string& line : mine.refused) note(line);
  // Rank 0 names the newest complete file checkpoint; every rank its replica's step.
  int64_t file_step = 0;
  if (rank == 0 && rank0_ready) {
    const std::vector<std::string> dirs = CompleteCheckpoints(ckpt_dir_);
    if (!dirs.empty()) file_step = CheckpointStepOf(dirs.front());
  }
  std::array<int64_t, 3> me{mine.step, file_step, rank0_ready ? 1 : 0};
  std::vector<int64_t> all(3 * world, 0);
  if (world_comm_) {
    RETURN_IF_ERROR(
        world_comm_->AllGather(me.data(), 3 * 8, CommType::kByte, all.data(), CommLayer::kOther));
    world_comm_->TakeStats();
  } else {
    std::copy(me.begin(), me.end(), all.begin());
  }
  if (all[2] == 0) return false;  // rank 0 cannot use the checkpoint root: the file path says why
  const int64_t files = all[1];
  int64_t best = 0, holder = -1;
  for (int64_t r = 0; r < world; ++r)
    if (all[3 * r] > best) best = all[3 * r], holder = r;
  if (best <= 0) return false;
  if (best <= files || best < opt_.resume_step) {
    if (rank == 0)
      note(absl::StrCat("the newest in-memory replica, step ", best,
                        ", is not newer than the checkpoint of step ",
                        std::max(files, opt_.resume_step), ": resuming from the checkpoint"));
    return false;
  }
  // The holder's files to every rank, their sizes bounded first.
  CheckpointFiles got;
  CheckpointFiles& files_here = rank == holder ? mine.files : got;
  std::array<int64_t, 3> sizes{static_cast<int64_t>(mine.files.model.size()),
                               static_cast<int64_t>(mine.files.optimizer.size()),
                               static_cast<int64_t>(mine.files.state.size())};
  if (world_comm_)
    RETURN_IF_ERROR(world_comm_->Broadcast(sizes.data(), 3 * 8, CommType::kByte,
                                           static_cast<int>(holder), CommLayer::kOther));
  absl::Status own;
  if (rank != holder)
    own = CheckReplicaSizes(sizes[0], sizes[1], sizes[2], replica_bound_,
                            absl::StrCat("rank ", holder));
  auto refused = [&](int64_t r, const absl::Status& s) -> bool {
    if (rank == r)
      note(absl::StrCat("in-memory replica of step ", best, " from rank ", holder,
                        " refused on rank ", r, ": ", s.message(),
                        "; resuming from the checkpoint"));
    return false;
  };
  ASSIGN_OR_RETURN(int64_t failing, FirstFailing(world_comm_.get(), own.ok(), world));
  if (failing >= 0) return refused(failing, own);
  if (rank != holder) {
    got.model.resize(sizes[0]);
    got.optimizer.resize(sizes[1]);
    got.state.resize(sizes[2]);
  }
  if (world_comm_) {
    for (std::string* b : {&files_here.model, &files_here.optimizer, &files_here.state})
      RETURN_IF_ERROR(BroadcastBytes(*world_comm_, b, static_cast<int>(holder)));
    world_comm_->TakeStats();
  }
  // Every receiver checks what came (the holder checked its own copy) and writes it where
  // LoadCheckpoint reads it.
  const std::string load_dir = ReplicaLoadDir(root);
  if (rank != holder) {
    own = VerifyCheckpointFiles(got, absl::StrCat("the replica rank ", holder, " sent"));
    if (own.ok()) own = WriteReplicaForLoad(load_dir, got);
  }
  ASSIGN_OR_RETURN(failing, FirstFailing(world_comm_.get(), own.ok(), world));
  if (failing >= 0) {
    RemoveReplicaDir(load_dir);
    return refused(failing, own);
  }
  // Everything verified: every rank loads it. What fails now (another model or seed, an I/O
  // error) would fail the same way for a file checkpoint and ends the attempt.
  own = LoadStep(params, rank == holder ? mine.dir : load_dir);
  RemoveReplicaDir(load_dir);
  ASSIGN_OR_RETURN(failing, FirstFailing(world_comm_.get(), own.ok(), world));
  if (failing == rank) return own;
  if (failing >= 0)
    return absl::AbortedError(absl::StrCat("trainer: rank ", failing,
                                           " could not load the in-memory replica of step ", best,
                                           " (its error ends the attempt)"));
  if (rank == holder)
    note(absl::StrCat("resumed from in-memory replicas at step ", best, " (the copy on worker \"",
                      opt_.replica_host, "\", rank ", holder, "'s; the newest checkpoint is step ",
                      files, ")"));
  return true;
}

Trainer::~Trainer() {
  if (replica_thread_.joinable()) replica_thread_.join();
}

absl::Status Trainer::ReplicaSnapshot() {
  RETURN_IF_ERROR(FinishReplica());
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t rank = opt_.rank;
  // The state into rank 0's replica snapshot (the other members of its EP group gather with it).
  absl::Status taken;
  RETURN_IF_ERROR(SnapshotInto(rank == 0 ? &replica_snapshot_ : nullptr, &taken));
  if (rank != 0 && rank != replica_peer_) return absl::OkStatus();
  replica_result_ = ReplicaResult{};
  replica_result_.step = state_.step;
  replica_result_.snapshot_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const ReplicaOrigin origin{opt_.job_id, opt_.attempt};
  if (rank == 0) {
    // A failed download ends the attempt as a failed checkpoint does; the peer, waiting for the
    // replica, then sees the connection go.
    RETURN_IF_ERROR(taken);
    ASSIGN_OR_RETURN(CheckpointTensors tensors, replica_snapshot_.Tensors(backend_->host_params()));
    replica_thread_ = std::thread([this, tensors = std::move(tensors), state = state_, origin] {
      const auto t1 = std::chrono::steady_clock::now();
      ReplicaResult& r = replica_result_;
      replica_files_ =
          SerializeCheckpoint(tensors, opt_.spec.model, state, std::move(replica_files_));
      r.bytes = static_cast<int64_t>(replica_files_.model.size() + replica_files_.optimizer.size() +
                                     replica_files_.state.size());
      if (replica_comm_) {
        std::array<int64_t, 3> sizes{static_cast<int64_t>(replica_files_.model.size()),
                                     static_cast<int64_t>(replica_files_.optimizer.size()),
                                     static_cast<int64_t>(replica_files_.state.size())};
        absl::Status sent =
            replica_comm_->Broadcast(sizes.data(), 3 * 8, CommType::kByte, 0, CommLayer::kOther);
        for (std::string* b :
             {&replica_files_.model, &replica_files_.optimizer, &replica_files_.state})
          if (sent.ok()) sent = BroadcastBytes(*replica_comm_, b, 0);
        replica_comm_->TakeStats();
        if (!sent.ok())
          r.kept = absl::UnavailableError(
              absl::StrCat("the copy for rank ", replica_peer_, " was not sent: ", sent.message()));
      }
      absl::Status own =
          CommitReplica(opt_.replica_root, state.step, replica_files_, origin).status();
      if (!own.ok() && r.kept.ok()) r.kept = own;
      r.write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    });
    return absl::OkStatus();
  }
  // The peer: receives rank 0's replica of this step, its sizes bounded before any byte is held.
  replica_thread_ = std::thread([this, origin] {
    const auto t1 = std::chrono::steady_clock::now();
    ReplicaResult& r = replica_result_;
    std::array<int64_t, 3> sizes{0, 0, 0};
    absl::Status got =
        replica_comm_->Broadcast(sizes.data(), 3 * 8, CommType::kByte, 0, CommLayer::kOther);
    if (got.ok()) {
      r.fatal = CheckReplicaSizes(sizes[0], sizes[1], sizes[2], replica_bound_, "rank 0");
      if (!r.fatal.ok()) return;
      replica_files_.model.resize(sizes[0]);
      replica_files_.optimizer.resize(sizes[1]);
      replica_files_.state.resize(sizes[2]);
      for (std::string* b :
           {&replica_files_.model, &replica_files_.optimizer, &replica_files_.state})
        if (got.ok()) got = BroadcastBytes(*replica_comm_, b, 0);
    }
    replica_comm_->TakeStats();
    if (got.ok()) got = VerifyCheckpointFiles(replica_files_, "the replica rank 0 sent");
    if (got.ok()) got = CommitReplica(opt_.replica_root, r.step, replica_files_, origin).status();
    r.kept = got;
    r.bytes = sizes[0] + sizes[1] + sizes[2];
    r.write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  });
  return absl::OkStatus();
}

absl::Status Trainer::FinishReplica() {
  if (!replica_thread_.joinable()) return absl::OkStatus();
  replica_thread_.join();
  const ReplicaResult& r = replica_result_;
  RETURN_IF_ERROR(r.fatal);
  if (!r.kept.ok() && !replica_note_sent_) {
    replica_note_sent_ = true;
    Emit({{"event", "note"},
          {"message", absl::StrCat("in-memory replica of step ", r.step, " not kept on worker \"",
                                   opt_.replica_host, "\": ", r.kept.message())}});
  }
  if (opt_.rank == 0)
    Emit({{"event", "replica"},
          {"step", r.step},
          {"bytes", r.bytes},
          {"peer_rank", replica_peer_},
          {"kept", r.kept.ok()},
          {"snapshot_s", r.snapshot_s},
          {"write_s", r.write_s}});
  return absl::OkStatus();
}

}  // namespace spindle
