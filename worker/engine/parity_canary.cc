// The parity canary: a job's layout against the cp = 1, ep = 1 reference (see parity_canary.h).
//
// The measure, per tensor: e = max_i |g_i - g_ref_i| / max_i |g_ref_i| over the whole tensor (an
// expert shard's rows against the matching rows of the reference's whole tensor, the maxima taken
// over the world), and |loss - loss_ref| / |loss_ref| for the loss. Why the max norm per tensor:
// each tensor gets its own scale (a whole-model norm would let the large embedding and head
// gradients hide an error in a small tensor such as a Lightning norm weight, where a CP carry error
// shows first), it does not divide by the many near-zero entries that make a per-element ratio
// noise, and it bounds what the update sees: AdamW moves each element by about g / sqrt(v), sqrt(v)
// following the tensor's typical magnitude, so an error that is a fraction of the tensor's largest
// gradient moves no element by more than that fraction of its step.
//
// The bound: a tensor passes when max |g - g_ref| <= tol max |g_ref| + kParityNoiseFactor n,
// with tol from one per-precision table (ParityTolerance: 1e-3 exact fp32, 1e-1 bf16 and fp8) and
// n the reference's own rounding sensitivity: the largest change of that tensor's gradient over
// kParityPerturbedReferences reference passes whose parameters are multiplied by 1 +- 2^-17
// (random signs). The bounds alone do not hold up: some gradients are ill-conditioned by the
// model's own structure, and rounding decides them. Lightning's GroupRMSNorm makes the loss
// invariant to the scale of q and k, so the q_norm and k_norm weights' gradients are what is left
// of sums that cancel exactly in real arithmetic; a token whose attention output is nearly zero (a
// document's first token with q.k ~ 0) has a normalisation gradient ~1 / |o|; a MoE token whose two
// best experts nearly tie changes experts with a rounding. Measured on the tiny presets in the
// bf16 emulation (test_parity_canary.cc's layouts, 600 runs on fresh seeds), correct layouts gave
// e up to 1.2 on such tensors (median 0.01), so a bound of 0.1 failed about 1% of correct runs;
// their gradients move as much under the perturbed references, which keeps the worst correct run
// at 0.24 of its bound, while a layout that loses one rank's Lightning states stays above 5 times
// its bound. The perturbation is large enough above fp32 rounding (2^-24) that the perturbed
// passes take other rounding decisions throughout, as the layout's reordered sums do, and small
// enough that it moves the exact gradients (by about 2^-17 relative) far less than the fp32 bound.
#include "worker/engine/parity_canary.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "worker/engine/batch.h"
#include "worker/engine/optimizer.h"

namespace spindle {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// max |x| over n floats; NaN gives infinity (NaN never passes).
double MaxAbs(const float* x, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double a = std::abs(static_cast<double>(x[i]));
    if (std::isnan(a)) return kInf;
    m = std::max(m, a);
  }
  return m;
}

// max |a - b| over n floats; NaN gives infinity.
double MaxAbsDiff(const float* a, const float* b, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (std::isnan(d)) return kInf;
    m = std::max(m, d);
  }
  return m;
}

double RelError(double num, double den) {
  if (std::isnan(num) || std::isnan(den)) return kInf;
  if (den > 0) return num / den;
  return num > 0 ? kInf : 0.0;
}

// What the reference computed: its parameters' layout, the loss sum and the flat gradients, and
// per parameter (then the loss) the largest change the perturbed references made.
struct ReferenceRun {
  std::vector<ParamInfo> params;
  std::vector<float> grads;
  double loss_sum = 0;
  std::vector<double> noise;  // params.size() + 1
};

// The reference pass on `full` with the job's parameters (`whole`: the whole tensors of the job's
// sharded parameters, by the job's parameter index), then the perturbed passes.
absl::StatusOr<ReferenceRun> RunReference(const ReferenceBackendFactory& factory, ParamSet& job,
                                          const std::map<int, std::vector<float>>& whole,
                                          const Batch& full, float grad_scale) {
  ASSIGN_OR_RETURN(std::unique_ptr<StepBackend> ref, factory());
  // A host optimizer's state is not needed for passes without an update.
  if (Optimizer* o = ref->HostOptimizer()) o->ReleaseState();
  ParamSet& rp = ref->host_params();
  ReferenceRun out;
  for (int j = 0; j < rp.size(); ++j) {
    const ParamInfo& p = rp.info(j);
    const int i = job.Find(p.name);
    if (i < 0)
      return absl::InternalError(
          absl::StrCat("parity: the reference model has a tensor the job lacks: ", p.name));
    const float* src = job.data(i);
    int64_t n = job.info(i).numel;
    if (auto w = whole.find(i); w != whole.end()) {
      src = w->second.data();
      n = static_cast<int64_t>(w->second.size());
    }
    if (n != p.numel)
      return absl::InternalError(absl::StrCat("parity: ", p.name, " has ", n,
                                              " elements in the job and ", p.numel,
                                              " in the reference"));
    std::memcpy(rp.data(j), src, static_cast<size_t>(n) * sizeof(float));
    out.params.push_back(p);
  }
  Tensor& data = rp.flat_data();
  Tensor& g = rp.flat_grad();
  const std::vector<float> exact(data.f32(), data.f32() + data.numel());
  auto pass = [&]() -> absl::StatusOr<double> {
    RETURN_IF_ERROR(ref->UploadParams());
    ref->BeginStep(static_cast<double>(full.T));
    RETURN_IF_ERROR(ref->ZeroGrads());
    ASSIGN_OR_RETURN(LossStats s,
                     ref->ForwardBackward(full, grad_scale, Recompute::None(), nullptr));
    RETURN_IF_ERROR(ref->DownloadGrads());
    return s.loss_sum;
  };
  ASSIGN_OR_RETURN(out.loss_sum, pass());
  out.grads.assign(g.f32(), g.f32() + g.numel());
  out.noise.assign(out.params.size() + 1, 0.0);
  for (int k = 0; k < kParityPerturbedReferences; ++k) {
    // The same signs on every rank (a xorshift stream per pass), so that every rank measures the
    // same sensitivity.
    uint64_t h = 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(k);
    for (int64_t i = 0; i < data.numel(); ++i) {
      h ^= h << 13, h ^= h >> 7, h ^= h << 17;
      const double f = (h & 1) ? 1.0 + kParityPerturbation : 1.0 - kParityPerturbation;
      data.f32()[i] = static_cast<float>(exact[i] * f);
    }
    ASSIGN_OR_RETURN(const double loss_sum, pass());
    // A perturbed pass that ends in NaN or infinity widens no bound (NaN never passes).
    auto widen = [](double* noise, double d) {
      if (std::isfinite(d)) *noise = std::max(*noise, d);
    };
    for (size_t j = 0; j < out.params.size(); ++j) {
      const ParamInfo& p = out.params[j];
      widen(&out.noise[j], MaxAbsDiff(g.f32() + p.offset, out.grads.data() + p.offset, p.numel));
    }
    widen(&out.noise.back(), std::abs(loss_sum - out.loss_sum));
  }
  return out;
}

// The whole tensors of this rank's expert shards, from the shards of ranks 0..ep-1 (EP group 0,
// whose EP ranks are 0..ep-1; every EP group holds the same experts), over the host world.
absl::StatusOr<std::map<int, std::vector<float>>> GatherWholeShards(ParamSet& params,
                                                                    const ParityGang& gang) {
  std::map<int, std::vector<float>> whole;
  if (gang.ep <= 1) return whole;
  std::vector<float> all;
  for (int i = 0; i < params.size(); ++i) {
    const ParamInfo& p = params.info(i);
    if (!p.sharded()) continue;
    if (p.full_offset != (gang.rank % gang.ep) * p.numel)
      return absl::InternalError(absl::StrCat("parity: ", p.name, " shard of EP rank ",
                                              gang.rank % gang.ep, " starts at ", p.full_offset,
                                              ", not at its rank's rows"));
    all.resize(static_cast<size_t>(p.numel * gang.world));
    RETURN_IF_ERROR(gang.world_comm->AllGather(params.data(i), p.numel, CommType::kF32, all.data(),
                                               CommLayer::kOther));
    whole[i].assign(all.begin(), all.begin() + p.numel * gang.ep);
  }
  return whole;
}

// Every rank's reference, gathered: true when all ran; false when some ran out of (device) memory
// and none failed otherwise (the reference is a second model beside the job's, which a job sized
// to its device may leave no room for: that is no fault of the layout); else this rank's own
// error, or Aborted naming the first rank that failed.
absl::StatusOr<bool> ReferenceRanEverywhere(const ParityGang& gang, const absl::Status& own,
                                            int64_t* out_of_memory_rank) {
  constexpr int32_t kRan = 0, kOutOfMemory = 1, kFailed = 2;
  const int32_t mine = own.ok()                                             ? kRan
                       : own.code() == absl::StatusCode::kResourceExhausted ? kOutOfMemory
                                                                            : kFailed;
  std::vector<int32_t> all(static_cast<size_t>(gang.world), mine);
  if (gang.world_comm)
    RETURN_IF_ERROR(
        gang.world_comm->AllGather(&mine, 1, CommType::kI32, all.data(), CommLayer::kOther));
  if (mine == kFailed) return own;
  for (int64_t r = 0; r < gang.world; ++r)
    if (all[r] == kFailed)
      return absl::AbortedError(absl::StrCat(
          "parity: rank ", r, " could not run the reference (its error ends the run)"));
  for (int64_t r = 0; r < gang.world; ++r)
    if (all[r] == kOutOfMemory) {
      *out_of_memory_rank = r;
      return false;
    }
  return true;
}

// The layout pass: the job's own backend on this rank's share of `full`, the gradients summed as
// the step sums them (world, and the expert-data-parallel group for the expert shards), then
// brought to the host. Returns the world's loss sum.
absl::StatusOr<double> RunLayout(StepBackend& job, const ParityGang& gang, const Batch& full,
                                 float grad_scale) {
  job.BeginStep(static_cast<double>(full.T * gang.dp));
  RETURN_IF_ERROR(job.ZeroGrads());
  LossStats s;
  if (gang.cp > 1) {
    ASSIGN_OR_RETURN(CpBatch share, ShardForCp(full, gang.cp, gang.cp_rank, gang.shard_ulysses));
    ASSIGN_OR_RETURN(s, job.ForwardBackward(share, grad_scale, gang.recompute, nullptr));
  } else {
    ASSIGN_OR_RETURN(s, job.ForwardBackward(full, grad_scale, gang.recompute, nullptr));
  }
  Tensor& g = job.host_params().flat_grad();
  const int64_t n = g.numel();
  const int64_t expert_end = gang.ep > 1 ? job.ExpertGradEnd() : 0;
  if (gang.device_world) {
    RETURN_IF_ERROR(job.AllReduceGrads(*gang.device_world, expert_end, n));
    if (gang.expert_dp) RETURN_IF_ERROR(job.AllReduceGrads(*gang.expert_dp, 0, expert_end));
    RETURN_IF_ERROR(job.DownloadGrads());
  } else {
    RETURN_IF_ERROR(job.DownloadGrads());
    if (gang.world_comm)
      RETURN_IF_ERROR(gang.world_comm->AllReduceSum(g.f32() + expert_end, n - expert_end,
                                                    CommType::kF32, CommLayer::kGrad));
    if (gang.expert_dp)
      RETURN_IF_ERROR(
          gang.expert_dp->AllReduceSum(g.f32(), expert_end, CommType::kF32, CommLayer::kGrad));
  }
  double loss_sum = s.loss_sum;
  if (gang.world_comm)
    RETURN_IF_ERROR(gang.world_comm->AllReduceSum(&loss_sum, 1, CommType::kF64, CommLayer::kOther));
  return loss_sum;
}

}  // namespace

int64_t ParitySliceTokens(int64_t seq_len, int64_t cp, int64_t chunk_tokens) {
  const int64_t job_chunk = seq_len / (2 * cp);
  return 2 * cp * std::max<int64_t>(1, std::min(job_chunk, chunk_tokens));
}

TrainPrecision ParityPrecision(TrainPrecision job) {
  return job == TrainPrecision::kFp8 ? TrainPrecision::kBf16 : job;
}

double ParityTolerance(TrainPrecision precision, const std::string& resources) {
  switch (precision) {
    case TrainPrecision::kFp32:
      return 1e-3;
    case TrainPrecision::kAuto:
      return resources == "cuda" ? 1e-1 : 1e-3;
    case TrainPrecision::kBf16:
    case TrainPrecision::kFp8:
      return 1e-1;
  }
  return 1e-1;
}

std::string DescribeParityLayout(const ParallelSpec& parallel, const CpModes& modes) {
  std::string s = absl::StrCat("cp=", parallel.cp, " dp=", parallel.dp,
                               " ep=", std::max<int64_t>(1, parallel.ep));
  if (parallel.cp > 1) {
    absl::StrAppend(&s, " lightning=", std::string(CpModeName(modes.lightning)),
                    " mla=", std::string(CpModeName(modes.mla)));
    if (modes.lightning == CpMode::kHybrid || modes.mla == CpMode::kHybrid)
      absl::StrAppend(&s, " ulysses=", parallel.ulysses);
  }
  return s;
}

std::string ParityLayoutKey(const JobSpec& spec, const CpModes& modes) {
  return absl::StrCat(DescribeParityLayout(spec.parallel, modes), " resources=", spec.resources,
                      " precision=", std::string(TrainPrecisionName(spec.train.precision)));
}

bool ParityApplies(const ParallelSpec& parallel) { return parallel.cp > 1 || parallel.ep > 1; }

bool ParityDue(const ParallelSpec& parallel, int64_t next_step, const std::string& verified,
               const std::string& key) {
  if (parallel.verify == ParallelSpec::kVerifyOff) return false;
  if (verified != key) return true;
  return ParityApplies(parallel) && parallel.verify > 0 && next_step % parallel.verify == 0;
}

ParityResult SkippedParity(const ParallelSpec& parallel, const CpModes& modes) {
  ParityResult r;
  r.skipped = true;
  r.layout = DescribeParityLayout(parallel, modes);
  r.reason = "cp = 1 and ep = 1: the layout is the reference; nothing to verify";
  return r;
}

nlohmann::json ParityResult::ToEvent(int64_t next_step) const {
  if (skipped)
    return {{"event", "parity"},
            {"step", next_step},
            {"skipped", true},
            {"reason", reason},
            {"layout", layout}};
  nlohmann::json table = nlohmann::json::array();
  for (const ParityTensorError& e : worst)
    table.push_back(
        {{"tensor", e.name}, {"rel_error", e.rel_error}, {"noise", e.noise}, {"excess", e.excess}});
  return {{"event", "parity"},
          {"step", next_step},
          {"passed", passed},
          {"max_rel_error", max_rel_error},
          {"max_excess", max_excess},
          {"tolerance", tolerance},
          {"measure", "max|g-g_ref|/max|g_ref| per tensor, bound tolerance + 4 x noise"},
          {"layout", layout},
          {"reference", reference},
          {"tokens", tokens},
          {"tensors", tensors},
          {"loss", loss},
          {"reference_loss", reference_loss},
          {"seconds", seconds},
          {"worst", std::move(table)}};
}

std::string ParityResult::FailureMessage() const {
  std::string names;
  for (const ParityTensorError& e : worst)
    if (e.excess > 1.0)
      absl::StrAppend(&names, names.empty() ? "" : ", ", e.name,
                      absl::StrFormat(" %.3g", e.rel_error));
  return absl::StrFormat(
      "parity: the layout %s does not compute what %s computes on a %d-token slice: relative "
      "gradient errors up to %.3g, %.3g times the bound (%.3g + %g x the reference's rounding "
      "noise); worst tensors: %s",
      layout, reference, tokens, max_rel_error, max_excess, tolerance, kParityNoiseFactor, names);
}

absl::StatusOr<ParityResult> RunParityCanary(StepBackend& job, const ParityGang& gang,
                                             const std::vector<int32_t>& sequence, int32_t eos_id,
                                             const ReferenceBackendFactory& reference,
                                             const ParityOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  if (gang.world > 1 && !gang.world_comm)
    return absl::InvalidArgumentError("parity: a gang of more than one rank needs its world");
  const int64_t T = static_cast<int64_t>(sequence.size());
  if (T % (2 * gang.cp) != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("parity: a sequence of ", T,
                     " tokens does not split into 2 cp = ", 2 * gang.cp, " chunks"));
  ParityResult r;
  r.layout = gang.layout;
  r.reference = "cp=1 ep=1 on one rank";
  r.tolerance = ParityTolerance(options.precision, options.resources);
  r.tokens = ParitySliceTokens(T, gang.cp, options.chunk_tokens);
  const std::vector<int32_t> slice(sequence.begin(), sequence.begin() + r.tokens);
  const Batch full = MakeSequenceBatch(slice, eos_id);
  const double n_valid = static_cast<double>(full.NumValidTargets());
  const double world_valid = n_valid * static_cast<double>(gang.dp);

  // The job's parameters, whole, then the reference on them (each rank on its own).
  RETURN_IF_ERROR(job.DownloadParams());
  ParamSet& jp = job.host_params();
  ASSIGN_OR_RETURN(const auto whole, GatherWholeShards(jp, gang));
  absl::StatusOr<ReferenceRun> ref = RunReference(
      reference, jp, whole, full, n_valid > 0 ? static_cast<float>(1.0 / n_valid) : 0.0f);
  int64_t oom_rank = -1;
  ASSIGN_OR_RETURN(const bool ran, ReferenceRanEverywhere(gang, ref.status(), &oom_rank));
  if (!ran) {
    r.skipped = true;
    r.reason =
        absl::StrCat("the cp=1 ep=1 reference does not fit beside the job on rank ", oom_rank,
                     oom_rank == gang.rank ? absl::StrCat(" (", ref.status().message(), ")") : "",
                     "; the layout was not verified");
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }

  // The planned layout on the job's backend.
  ASSIGN_OR_RETURN(
      const double loss_sum,
      RunLayout(job, gang, full, world_valid > 0 ? static_cast<float>(1.0 / world_valid) : 0.0f));
  r.loss = world_valid > 0 ? loss_sum / world_valid : 0.0;
  r.reference_loss = n_valid > 0 ? ref->loss_sum / n_valid : 0.0;

  // Per tensor (then the loss) max |g - g_ref|, max |g_ref| and the reference's sensitivity,
  // maxima over the world: a rank sees its own expert shards only.
  Tensor& g = jp.flat_grad();
  const int64_t n = static_cast<int64_t>(ref->params.size());
  std::vector<double> mine(static_cast<size_t>(3 * (n + 1)), 0.0);
  for (int64_t j = 0; j < n; ++j) {
    const ParamInfo& p = ref->params[j];
    const ParamInfo& q = jp.info(jp.Find(p.name));
    const float* gref = ref->grads.data() + p.offset;
    const int64_t at = q.sharded() ? q.full_offset : 0;
    mine[3 * j] = MaxAbsDiff(g.f32() + q.offset, gref + at, q.numel);
    mine[3 * j + 1] = MaxAbs(gref, p.numel);
    mine[3 * j + 2] = ref->noise[j];
  }
  mine[3 * n] = std::abs(r.loss - r.reference_loss);
  if (std::isnan(mine[3 * n])) mine[3 * n] = kInf;
  mine[3 * n + 1] = std::abs(r.reference_loss);
  mine[3 * n + 2] = n_valid > 0 ? ref->noise[n] / n_valid : 0.0;  // loss sums to losses
  std::vector<double> all = mine;
  if (gang.world_comm) {
    all.resize(mine.size() * static_cast<size_t>(gang.world));
    RETURN_IF_ERROR(gang.world_comm->AllGather(mine.data(), static_cast<int64_t>(mine.size()),
                                               CommType::kF64, all.data(), CommLayer::kOther));
  }
  std::vector<ParityTensorError> rows;
  const size_t ranks = all.size() / mine.size();
  for (int64_t j = 0; j <= n; ++j) {
    double num = 0, den = 0, noise = 0;
    for (size_t w = 0; w < ranks; ++w) {
      const double* v = all.data() + w * mine.size() + 3 * j;
      num = std::max(num, v[0]);
      den = std::max(den, v[1]);
      noise = std::max(noise, v[2]);
    }
    ParityTensorError e;
    e.name = j < n ? ref->params[j].name : "loss";
    e.rel_error = RelError(num, den);
    e.noise = RelError(noise, den);
    e.excess = RelError(num, r.tolerance * den + kParityNoiseFactor * noise);
    r.max_rel_error = std::max(r.max_rel_error, e.rel_error);
    rows.push_back(std::move(e));
  }
  std::stable_sort(
      rows.begin(), rows.end(),
      [](const ParityTensorError& a, const ParityTensorError& b) { return a.excess > b.excess; });
  r.tensors = n;
  r.max_excess = rows.empty() ? 0.0 : rows.front().excess;
  r.passed = r.max_excess <= 1.0;
  rows.resize(std::min<size_t>(rows.size(), static_cast<size_t>(options.worst_tensors)));
  r.worst = std::move(rows);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace spindle
