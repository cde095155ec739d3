// The parity canary of a job as threads of one process (see parity_local.h).
#include "worker/engine/parity_local.h"

#include <omp.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/host_cores.h"
#include "worker/engine/comm/kv_stores.h"
#include "worker/engine/trainer.h"

namespace spindle {

JobSpec LocalParitySpec(const JobSpec& spec) {
  JobSpec s = spec;
  if (s.resources == "cuda" && s.train.precision == TrainPrecision::kAuto)
    s.train.precision = TrainPrecision::kBf16;
  s.resources = "cpu";
  s.train.offload = false;
  s.checkpoint.dir.clear();
  return s;
}

absl::StatusOr<ParityResult> VerifyLayoutInProcess(const JobSpec& planned,
                                                   const LocalParityOptions& options) {
  const JobSpec spec = LocalParitySpec(planned);
  const int64_t world = spec.parallel.world();
  if (world > kMaxLocalParityRanks)
    return absl::InvalidArgumentError(absl::StrCat("parity: the job's world of ", world,
                                                   " ranks is more than the ", kMaxLocalParityRanks,
                                                   " a local check runs as threads"));
  const int64_t threads = options.threads > 0
                              ? options.threads
                              : HostCores();
  const int per_rank = static_cast<int>(std::max<int64_t>(1, threads / world));
  MemoryKvStore store;
  std::vector<absl::StatusOr<ParityResult>> results(
      static_cast<size_t>(world), absl::UnknownError("parity: the rank did not run"));
  // Every rank's trainer lives until all ranks are done: one whose check needs no collective (a
  // layout with nothing to verify) must not close its connections while a peer still joins them.
  std::vector<std::unique_ptr<Trainer>> trainers(static_cast<size_t>(world));
  std::vector<std::thread> ranks;
  for (int64_t r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      omp_set_num_threads(per_rank);
      TrainerOptions t;
      t.spec = spec;
      t.rank = r;
      t.world = world;
      t.store = world > 1 ? &store : nullptr;
      t.gloo.hostname = "127.0.0.1";
      t.gloo.timeout = options.timeout;
      if (r == 0) t.on_event = options.on_event;
      absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(std::move(t));
      if (!trainer.ok()) {
        results[r] = trainer.status();
        return;
      }
      trainers[r] = *std::move(trainer);
      results[r] = trainers[r]->Verify();
    });
  }
  for (std::thread& t : ranks) t.join();
  trainers.clear();
  // The cause first: a rank's own error before the Aborted its peers answer it with.
  for (bool aborted : {false, true})
    for (int64_t r = 0; r < world; ++r) {
      const absl::Status& s = results[r].status();
      if (s.ok() || (s.code() == absl::StatusCode::kAborted) != aborted) continue;
      return absl::Status(s.code(),
                          world > 1 ? absl::StrCat("rank ", r, ": ", s.message()) : s.message());
    }
  return results[0];
}

}  // namespace spindle
