// The trainer's device path (resources "cuda", worker/engine/step_backend.h) without a GPU: a
// StepBackend that runs the CPU Model as its "device", with a separate host mirror, stands in for
// CudaModel. With it a backend whose memory is its own (gradients and parameters moved through
// the host mirror) must reproduce the CPU backend bit for bit (averaging, norm,
// clipping, the optimizers: AdamW, SGD with and without momentum; data parallel on the host),
// download before every checkpoint and upload on every resume, so checkpoints cross between the
// engines (AdamW's and SGD's state); evaluation on the device equals the
// CPU's; context parallelism (cp = 2, and dp = 2 x cp = 2) through the backend's SetCp and CpBatch
// forms equals the CPU trainer's CP run. Device collectives: when every rank reports a device of
// its own, the trainer sums gradients with the backend's AllReduceGrads and hands its device CP
// group to SetCp (the stand-in's "device communicator" is Gloo); ranks that share a device, or
// report none, keep the host path. Also: what the GPU path does not run fails at Create() with one
// error and writes nothing.
#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"
#include "tests/engine/cp_test_util.h"
#include "worker/engine/checkpoint.h"
#include "worker/engine/data.h"
#include "worker/engine/trainer.h"

namespace spindle {
namespace {

// The CPU Model as a device: its ParamSet is device memory, a second ParamSet (same layout) the
// host mirror, the optimizers the CPU Optimizer's loop. The counters (all instances, all threads)
// show that the trainer drove CP through the backend.
class CpuDeviceBackend final : public StepBackend {
 public:
  static std::atomic<int64_t> cp_groups_set;      // SetCp calls with a group of size > 1
  static std::atomic<int64_t> cp_passes;          // CpBatch passes of a share (layout.cp > 1)
  static std::atomic<int64_t> cp_share_targets;   // valid targets of those shares
  // What DeviceId() reports: none (no device communicators), a device per instance, or one
  // device for all; and the device collectives the trainer asked for.
  enum class Devices { kNone, kOwn, kShared };
  static std::atomic<Devices> devices;
  static std::atomic<int64_t> device_comms_created, device_grad_sums;

  static absl::StatusOr<std::unique_ptr<StepBackend>> Create(const ModelConfig& config,
                                                             uint64_t seed, int64_t /*cp*/,
                                                             int64_t /*ep*/, int64_t /*ep_rank*/) {
    auto dev = Model::Create(config, seed);
    if (!dev.ok()) return dev.status();
    auto host = Model::Create(config, seed);
    if (!host.ok()) return host.status();
    return std::unique_ptr<StepBackend>(new CpuDeviceBackend(std::move(*dev), std::move(*host)));
  }

  const ModelConfig& config() const override { return dev_->config(); }
  ParamSet& host_params() override { return host_->params(); }
  absl::Status ZeroGrads() override {
    dev_->params().ZeroGrad();
    return absl::OkStatus();
  }
  absl::StatusOr<LossStats> ForwardBackward(const Batch& b, float grad_scale,
                                            Recompute recompute, const GradReadyFn&) override {
    return dev_->ForwardBackward(b, grad_scale, recompute);
  }
  absl::StatusOr<LossStats> Forward(const Batch& b) override { return dev_->Forward(b); }
  absl::Status SetZLoss(float z_loss) override {
    dev_->SetZLoss(z_loss);
    return absl::OkStatus();
  }
  absl::Status SetCp(const CpContext& cp) override {
    if (cp.comm != nullptr && cp.comm->size() > 1) ++cp_groups_set;
    dev_->SetCp(cp);
    return absl::OkStatus();
  }
  absl::StatusOr<LossStats> ForwardBackward(const CpBatch& b, float grad_scale,
                                            Recompute recompute, const GradReadyFn&) override {
    Count(b);
    return dev_->ForwardBackward(b, grad_scale, recompute);
  }
  absl::StatusOr<LossStats> Forward(const CpBatch& b) override {
    Count(b);
    return dev_->Forward(b);
  }
  absl::StatusOr<double> GradSquaredNorm() override {
    Tensor& g = dev_->params().flat_grad();
    return kernels::cpu::SumSquares(g.f32(), g.numel());
  }
  // As CudaModel: the state an optimizer keeps comes with its first step (AdamW m and v, SGD
  // with momentum m, plain SGD none).
  absl::Status OptimizerStep(const TrainSpec& spec, double lr, float grad_scale) override {
    ParamSet& P = dev_->params();
    const bool adamw = spec.optimizer == "adamw";
    if ((adamw || spec.momentum > 0) && m_.numel() == 0) m_ = Tensor::Zeros({P.numel()});
    if (adamw && v_.numel() == 0) v_ = Tensor::Zeros({P.numel()});
    if (grad_scale != 1.0f) kernels::cpu::Scale(P.flat_grad().f32(), P.numel(), grad_scale);
    ++steps_;
    for (int i = 0; i < P.size(); ++i) {
      const ParamInfo& p = P.info(i);
      const float wd = p.weight_decay ? static_cast<float>(spec.weight_decay) : 0.0f;
      if (!adamw) {
        kernels::cpu::SgdStep(P.data(i), P.grad(i),
                              spec.momentum > 0 ? m_.f32() + p.offset : nullptr, p.numel,
                              static_cast<float>(lr), static_cast<float>(spec.momentum), wd);
        continue;
      }
      kernels::cpu::AdamWParams hp{static_cast<float>(lr),
                                   static_cast<float>(spec.beta1),
                                   static_cast<float>(spec.beta2),
                                   static_cast<float>(spec.eps),
                                   wd,
                                   steps_};
      kernels::cpu::AdamWStep(P.data(i), P.grad(i), m_.f32() + p.offset, v_.f32() + p.offset,
                              p.numel, hp);
    }
    return absl::OkStatus();
  }
  int64_t steps_taken() const override { return steps_; }
  absl::Status DownloadGrads() override {
    return Copy(dev_->params().flat_grad(), host_->params().flat_grad());
  }
  absl::Status UploadGrads() override {
    return Copy(host_->params().flat_grad(), dev_->params().flat_grad());
  }
  absl::Status DownloadParams() override {
    return Copy(dev_->params().flat_data(), host_->params().flat_data());
  }
  absl::Status UploadParams() override {
    return Copy(host_->params().flat_data(), dev_->params().flat_data());
  }
  absl::Status DownloadOptimizerState(Tensor* m, Tensor* v) override {
    for (auto [dev, host] : {std::pair{&m_, m}, {&v_, v}}) {
      if (dev->numel() == 0) continue;  // not kept: left as it is
      if (host->numel() != dev->numel()) *host = Tensor({dev->numel()});
      RETURN_IF_ERROR(Copy(*dev, *host));
    }
    return absl::OkStatus();
  }
  absl::Status UploadOptimizerState(const Tensor& m, const Tensor& v, int64_t steps) override {
    for (auto [host, dev] : {std::pair{&m, &m_}, {&v, &v_}}) {
      if (host->numel() == 0) continue;
      if (dev->numel() != host->numel()) *dev = Tensor({host->numel()});
      RETURN_IF_ERROR(Copy(*host, *dev));
    }
    steps_ = steps;
    return absl::OkStatus();
  }
  std::string DeviceId() override {
    switch (devices.load()) {
      case Devices::kOwn: return absl::StrCat("cpu-device-", instance_);
      case Devices::kShared: return "cpu-device-shared";
      case Devices::kNone: break;
    }
    return "";
  }
  // The stand-in's device communicator is Gloo over the same store (its buffers are host memory,
  // like the stand-in's device).
  absl::StatusOr<std::unique_ptr<Communicator>> CreateDeviceCommunicator(
      KvStore& store, const std::string& prefix, int rank, int size,
      absl::Duration timeout) override {
    if (devices.load() != Devices::kOwn)
      return absl::InternalError("stand-in: device communicator asked for without own devices");
    ++device_comms_created;
    GlooOptions o = testing::TestGloo();
    o.timeout = timeout;
    return CreateGlooCommunicator(store, prefix, rank, size, o);
  }
  absl::Status AllReduceGrads(Communicator& comm, int64_t begin, int64_t end) override {
    ++device_grad_sums;
    Tensor& g = dev_->params().flat_grad();
    if (end < 0) end = g.numel();
    return comm.AllReduceSum(g.f32() + begin, end - begin, CommType::kF32, CommLayer::kGrad);
  }
  nlohmann::json StepEventFields() override {
    return {{"mem_allocated_bytes", 1}, {"mem_reserved_bytes", 2}, {"mem_peak_bytes", 3}};
  }
  static constexpr double kPeakFlops = 1e9;
  double PeakFlops() const override { return kPeakFlops; }

 private:
  CpuDeviceBackend(std::unique_ptr<Model> dev, std::unique_ptr<Model> host)
      : dev_(std::move(dev)), host_(std::move(host)) {
    // The host mirror starts out different from the device, so a missing transfer shows.
    host_->params().flat_data().SetZero();
  }
  static void Count(const CpBatch& b) {
    if (b.layout.cp <= 1) return;
    ++cp_passes;
    cp_share_targets += b.local.NumValidTargets();
  }
  static absl::Status Copy(const Tensor& from, Tensor& to) {
    if (from.numel() != to.numel())
      return absl::InternalError(absl::StrCat("copy of ", from.numel(), " into ", to.numel()));
    std::memcpy(to.f32(), from.f32(), static_cast<size_t>(from.bytes()));
    return absl::OkStatus();
  }

  std::unique_ptr<Model> dev_, host_;
  Tensor m_, v_;
  int64_t steps_ = 0;
  const int64_t instance_ = next_instance++;
  static std::atomic<int64_t> next_instance;
};
std::atomic<int64_t> CpuDeviceBackend::next_instance{0};
std::atomic<CpuDeviceBackend::Devices> CpuDeviceBackend::devices{CpuDeviceBackend::Devices::kNone};
std::atomic<int64_t> CpuDeviceBackend::device_comms_created{0};
std::atomic<int64_t> CpuDeviceBackend::device_grad_sums{0};
std::atomic<int64_t> CpuDeviceBackend::cp_groups_set{0};
std::atomic<int64_t> CpuDeviceBackend::cp_passes{0};
std::atomic<int64_t> CpuDeviceBackend::cp_share_targets{0};

std::string TempDir(const std::string& tag) {
  char tmpl[] = "/tmp/spindle-device-test-XXXXXX";
  std::string d = mkdtemp(tmpl);
  return d + "/" + tag;
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

// grad_clip 0.5: several of the first steps clip (their norms are 1..6).
JobSpec Job(int64_t steps, const std::string& resources, int64_t dp = 1, int64_t micro = 1,
            int64_t cp = 1) {
  auto spec = ParseJobSpec(absl::StrCat(
      R"({"name": "d", "model": {"preset": "tiny"},
          "data": {"source": "synthetic:recall", "recall_pairs": 4, "recall_gap": 48},
          "seq_len": 192, "parallel": {"dp": )",
      dp, R"(, "cp": )", cp, R"(, "lightning_mode": "all2all", "mla_mode": "all2all"},
          "train": {"steps": )", steps,
      R"(, "lr": 3e-3, "warmup_steps": 2, "seed": 11, "grad_clip": 0.5, "weight_decay": 0.1,
          "micro_batches": )",
      micro, R"(}, "resources": ")", resources, R"("})"));
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

struct RunResult {
  std::vector<double> losses;
  std::vector<float> params;
  std::vector<nlohmann::json> steps;  // step events
  bool host_optimizer_state = false;  // the host optimizer holds state after the run
};

// The trained parameters: the device's, downloaded into the host mirror, or the CPU model's.
absl::StatusOr<std::vector<float>> TrainedParams(Trainer& t) {
  StepBackend& b = t.backend();
  RETURN_IF_ERROR(b.DownloadParams());
  ParamSet& P = b.host_params();
  return std::vector<float>(P.flat_data().f32(), P.flat_data().f32() + P.numel());
}

absl::StatusOr<RunResult> Train(const JobSpec& spec, const std::string& ckpt_dir = "",
                                int64_t stop_at = -1) {
  TrainerOptions o;
  o.spec = spec;
  o.checkpoint_dir = ckpt_dir;
  o.stop_at_step = stop_at;
  o.cuda_backend = CpuDeviceBackend::Create;
  RunResult r;
  o.on_event = [&](const nlohmann::json& e) {
    if (e["event"] == "step") r.steps.push_back(e);
  };
  auto t = Trainer::Create(std::move(o));
  if (!t.ok()) return t.status();
  RETURN_IF_ERROR((*t)->Run());
  r.losses = (*t)->losses();
  ASSIGN_OR_RETURN(r.params, TrainedParams(**t));
  r.host_optimizer_state = !(*t)->optimizer().state0().empty();
  return r;
}

TEST(DeviceTrainerTest, StepsMatchTheCpuPathBitForBit) {
  omp_set_num_threads(2);
  auto cpu = Train(Job(6, "cpu", 1, 2));
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto dev = Train(Job(6, "cuda", 1, 2));
  ASSERT_TRUE(dev.ok()) << dev.status();
  ASSERT_EQ(dev->losses.size(), 6u);
  EXPECT_EQ(dev->losses, cpu->losses);
  EXPECT_EQ(dev->params, cpu->params);
  // Model FLOPs: the step's two sequences, attention within their documents.
  const JobSpec spec = Job(6, "cuda", 1, 2);
  auto data = OpenDataSource(spec.data, spec.seq_len, spec.model.vocab, spec.train.seed);
  ASSERT_TRUE(data.ok()) << data.status();
  int clipped = 0;
  for (size_t i = 0; i < dev->steps.size(); ++i) {
    const nlohmann::json& e = dev->steps[i];
    EXPECT_EQ(e["grad_norm"], cpu->steps[i]["grad_norm"]) << "step " << i + 1;
    EXPECT_EQ(e["lr"], cpu->steps[i]["lr"]);
    clipped += e["grad_norm"].get<double>() > 0.5;
    EXPECT_EQ(e["mem_allocated_bytes"], 1) << e.dump();
    EXPECT_EQ(e["mem_peak_bytes"], 3) << e.dump();
    EXPECT_FALSE(cpu->steps[i].contains("mem_allocated_bytes"));
    double flops = 0;
    for (int64_t m = 0; m < 2; ++m) {
      const Batch b = MakeSequenceBatch((*data)->Sequence(2 * i + m), (*data)->eos_id());
      EXPECT_LT(AttentionPairs(b), 192.0 * 192.0 / 2) << "the recall data has several documents";
      flops += spec.model.TrainFlops(b.T, AttentionPairs(b));
    }
    for (const nlohmann::json* s : {&e, static_cast<const nlohmann::json*>(&cpu->steps[i])}) {
      EXPECT_NEAR((*s)["tflops"].get<double>() * 1e12 * (*s)["step_s"].get<double>(), flops,
                  1e-9 * flops)
          << s->dump();
    }
    EXPECT_NEAR(e["mfu"].get<double>(),
                e["tflops"].get<double>() * 1e12 / CpuDeviceBackend::kPeakFlops, 1e-12)
        << e.dump();
    EXPECT_FALSE(cpu->steps[i].contains("mfu")) << "the CPU engine knows no peak";
  }
  EXPECT_GE(clipped, 2) << "the clipping branch was not exercised";
}

// spec with train.optimizer = "sgd" and the given momentum (0: none).
JobSpec WithSgd(JobSpec spec, double momentum) {
  spec.train.optimizer = "sgd";
  spec.train.momentum = momentum;
  return spec;
}

TEST(DeviceTrainerTest, SgdStepsMatchTheCpuPathBitForBit) {
  omp_set_num_threads(2);
  for (const double momentum : {0.9, 0.0}) {
    SCOPED_TRACE(absl::StrCat("momentum ", momentum));
    auto cpu = Train(WithSgd(Job(5, "cpu", 1, 2), momentum));
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto dev = Train(WithSgd(Job(5, "cuda", 1, 2), momentum));
    ASSERT_TRUE(dev.ok()) << dev.status();
    ASSERT_EQ(dev->losses.size(), 5u);
    EXPECT_EQ(dev->losses, cpu->losses);
    EXPECT_EQ(dev->params, cpu->params);
    EXPECT_NE(dev->params, Train(Job(5, "cuda", 1, 2))->params) << "the same as AdamW's";
  }
}

TEST(DeviceTrainerTest, CheckpointsResumeAcrossEnginesExactly) {
  omp_set_num_threads(2);
  for (const bool sgd : {false, true}) {
    JobSpec cpu_spec = Job(6, "cpu"), dev_spec = Job(6, "cuda");
    if (sgd) cpu_spec = WithSgd(cpu_spec, 0.9), dev_spec = WithSgd(dev_spec, 0.9);
    cpu_spec.checkpoint.every = dev_spec.checkpoint.every = 3;
    auto whole = Train(cpu_spec);
    ASSERT_TRUE(whole.ok()) << whole.status();
    for (const bool device_first : {true, false}) {
      SCOPED_TRACE(absl::StrCat(sgd ? "SGD with momentum, " : "AdamW, ",
                                device_first ? "device, then CPU" : "CPU, then device"));
      const std::string dir = TempDir("ck");
      auto first = Train(device_first ? dev_spec : cpu_spec, dir, 3);
      ASSERT_TRUE(first.ok()) << first.status();
      auto rest = Train(device_first ? cpu_spec : dev_spec, dir);
      ASSERT_TRUE(rest.ok()) << rest.status();
      ASSERT_EQ(first->losses.size(), 3u);
      ASSERT_EQ(rest->losses.size(), 3u);
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(first->losses[i], whole->losses[i]) << "step " << i + 1;
        EXPECT_EQ(rest->losses[i], whole->losses[3 + i]) << "step " << i + 4;
      }
      EXPECT_EQ(rest->params, whole->params);
      // A device trainer holds the optimizer state on the host only around its checkpoints; the
      // CPU backend's optimizer is the host's, and checkpoints use it in place.
      EXPECT_EQ(first->host_optimizer_state, !device_first);
      EXPECT_EQ(rest->host_optimizer_state, device_first);
    }
  }
}

// Every rank of spec's world as a thread; rank 0's losses and step events, the parameters (equal
// on every rank).
absl::StatusOr<RunResult> WorldTrain(const JobSpec& spec) {
  const int world = static_cast<int>(spec.parallel.world());
  MemoryKvStore store;
  RunResult out;
  std::vector<std::vector<float>> params(world);
  absl::Status s = testing::RunRanks(world, [&](int rank) -> absl::Status {
    omp_set_num_threads(1);
    TrainerOptions o;
    o.spec = spec;
    o.rank = rank;
    o.world = world;
    o.store = &store;
    o.gloo = testing::TestGloo();
    o.cuda_backend = CpuDeviceBackend::Create;
    if (rank == 0) {
      o.on_event = [&](const nlohmann::json& e) {
        if (e["event"] == "step") out.steps.push_back(e);
      };
    }
    auto t = Trainer::Create(std::move(o));
    if (!t.ok()) return t.status();
    RETURN_IF_ERROR((*t)->Run());
    ASSIGN_OR_RETURN(params[rank], TrainedParams(**t));
    if (rank == 0) out.losses = (*t)->losses();
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  for (int r = 1; r < world; ++r)
    if (params[r] != params[0])
      return absl::InternalError(absl::StrCat("rank ", r, "'s parameters differ"));
  out.params = std::move(params[0]);
  return out;
}

// cp = 2 and dp = 2 x cp = 2 through the backend: the CPU trainer's CP run exactly, with every
// rank's SetCp given its group and every pass a CpBatch share (together the sequences' targets).
TEST(DeviceTrainerTest, ContextParallelMatchesTheCpuContextParallelRun) {
  for (const int64_t dp : {1, 2}) {
    SCOPED_TRACE(absl::StrCat("dp = ", dp, ", cp = 2"));
    const int64_t steps = 3, micro = 2, world = dp * 2;
    auto cpu = WorldTrain(Job(steps, "cpu", dp, micro, /*cp=*/2));
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    CpuDeviceBackend::cp_groups_set = 0;
    CpuDeviceBackend::cp_passes = 0;
    CpuDeviceBackend::cp_share_targets = 0;
    // The steps' passes alone (no parity canary before the first).
    JobSpec spec = Job(steps, "cuda", dp, micro, /*cp=*/2);
    spec.parallel.verify = ParallelSpec::kVerifyOff;
    auto dev = WorldTrain(spec);
    ASSERT_TRUE(dev.ok()) << dev.status();
    ASSERT_EQ(dev->losses.size(), static_cast<size_t>(steps));
    EXPECT_EQ(dev->losses, cpu->losses);
    EXPECT_EQ(dev->params, cpu->params);
    EXPECT_EQ(CpuDeviceBackend::cp_groups_set, world);
    EXPECT_EQ(CpuDeviceBackend::cp_passes, steps * micro * world);
    auto data = OpenDataSource(spec.data, spec.seq_len, spec.model.vocab, spec.train.seed);
    ASSERT_TRUE(data.ok()) << data.status();
    int64_t targets = 0;  // of the sequences the steps took (each replica its own)
    for (int64_t n = 0; n < steps * micro * dp; ++n)
      targets += MakeSequenceBatch((*data)->Sequence(n), (*data)->eos_id()).NumValidTargets();
    EXPECT_EQ(CpuDeviceBackend::cp_share_targets, targets);
    // Rank 0's throughput and model FLOPs are its own: half of each of its replica's sequences
    // (the job's are the sum over ranks).
    ASSERT_EQ(dev->steps.size(), static_cast<size_t>(steps));
    for (int64_t s = 0; s < steps; ++s) {
      const nlohmann::json& e = dev->steps[s];
      const double dt = e["step_s"].get<double>();
      EXPECT_NEAR(e["tokens_per_s"].get<double>() * dt, spec.seq_len * micro / 2.0, 1e-9)
          << e.dump();
      double flops = 0;
      for (int64_t m = 0; m < micro; ++m) {
        const Batch b = MakeSequenceBatch((*data)->Sequence(s * micro * dp + m), (*data)->eos_id());
        flops += spec.model.TrainFlops(b.T, AttentionPairs(b)) / 2;
      }
      EXPECT_NEAR(e["tflops"].get<double>() * 1e12 * dt, flops, 1e-9 * flops) << e.dump();
    }
  }
}

// A device per rank: the gradient sums and the CP group go through the backend's device
// communicators, with the CPU run's results; a shared device keeps the host path. The parity
// canary before the first step sums its gradients the same way (one more sum per rank) and leaves
// the results as they were.
TEST(DeviceTrainerTest, RanksWithDevicesOfTheirOwnUseDeviceCollectives) {
  const int64_t steps = 3, micro = 2, dp = 2, world = 4;
  auto cpu = WorldTrain(Job(steps, "cpu", dp, micro, /*cp=*/2));
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  struct Case {
    CpuDeviceBackend::Devices devices;
    int64_t comms, grad_sums;  // expected: world + CP groups' ranks; a sum per rank and step,
                               // and the canary's
  };
  for (const Case& c : {Case{CpuDeviceBackend::Devices::kOwn, 2 * world, (steps + 1) * world},
                        Case{CpuDeviceBackend::Devices::kShared, 0, 0}}) {
    SCOPED_TRACE(c.devices == CpuDeviceBackend::Devices::kOwn ? "own devices" : "shared device");
    CpuDeviceBackend::devices = c.devices;
    CpuDeviceBackend::device_comms_created = 0;
    CpuDeviceBackend::device_grad_sums = 0;
    CpuDeviceBackend::cp_groups_set = 0;
    auto dev = WorldTrain(Job(steps, "cuda", dp, micro, /*cp=*/2));
    CpuDeviceBackend::devices = CpuDeviceBackend::Devices::kNone;
    ASSERT_TRUE(dev.ok()) << dev.status();
    EXPECT_EQ(dev->losses, cpu->losses);
    EXPECT_EQ(dev->params, cpu->params);
    EXPECT_EQ(CpuDeviceBackend::device_comms_created, c.comms);
    EXPECT_EQ(CpuDeviceBackend::device_grad_sums, c.grad_sums);
    EXPECT_EQ(CpuDeviceBackend::cp_groups_set, world);
  }
}

TEST(DeviceTrainerTest, DataParallelMatchesTheCpuDataParallelRun) {
  auto cpu = WorldTrain(Job(4, "cpu", /*dp=*/2));
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto dev = WorldTrain(Job(4, "cuda", /*dp=*/2));
  ASSERT_TRUE(dev.ok()) << dev.status();
  ASSERT_EQ(dev->losses.size(), 4u);
  EXPECT_EQ(dev->losses, cpu->losses);
  EXPECT_EQ(dev->params, cpu->params);
}

TEST(DeviceTrainerTest, EvaluationOnTheDeviceEqualsTheCpus) {
  omp_set_num_threads(2);
  JobSpec spec = Job(2, "cuda");
  const std::string dir = TempDir("ev");
  ASSERT_TRUE(Train(spec, dir).ok());
  auto ckpt = LatestCheckpoint(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto on_cpu = EvaluateCheckpoint(spec, *ckpt, spec.data, 2);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  auto on_dev = EvaluateCheckpoint(spec, *ckpt, spec.data, 2, CpuDeviceBackend::Create);
  ASSERT_TRUE(on_dev.ok()) << on_dev.status();
  EXPECT_EQ(on_dev->loss, on_cpu->loss);
  EXPECT_EQ(on_dev->n_valid, on_cpu->n_valid);
  EXPECT_EQ(on_dev->answer_loss, on_cpu->answer_loss);
  EXPECT_GT(on_dev->n_answers, 0);
}

// resources "cuda" that this build or the GPU path cannot run: one error at Create(), no
// checkpoint directory.
TEST(DeviceTrainerTest, WhatTheGpuPathCannotRunFailsAtCreateAndWritesNothing) {
  struct Case {
    std::string name;
    std::function<void(TrainerOptions&)> edit;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"no CUDA engine", [](TrainerOptions& o) { o.cuda_backend = nullptr; },
       absl::StatusCode::kFailedPrecondition,
       "trainer: the job asks for resources \"cuda\" but this build has no CUDA engine (build "
       "with -DSPINDLE_CUDA=ON where the CUDA toolkit is installed, or run the job with "
       "resources \"cpu\")"},
      {"offload on a backend without device memory of its own",
       [](TrainerOptions& o) { o.spec.train.offload = true; },
       absl::StatusCode::kFailedPrecondition,
       "trainer: train.offload needs a backend with device memory of its own"},
      {"fp8 on a backend without FP8 GEMMs",
       [](TrainerOptions& o) { o.spec.train.precision = TrainPrecision::kFp8; },
       absl::StatusCode::kUnimplemented,
       "trainer: train.precision \"fp8\": this device backend has no FP8 GEMMs yet; use \"auto\" "
       "or \"bf16\" on the device, or resources \"cpu\", which emulates FP8"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TrainerOptions o;
    o.spec = Job(2, "cuda");
    o.checkpoint_dir = TempDir("refused");
    o.cuda_backend = CpuDeviceBackend::Create;
    c.edit(o);
    const std::string dir = o.checkpoint_dir;
    auto t = Trainer::Create(std::move(o));
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), c.code);
    EXPECT_EQ(t.status().message(), c.message);
    EXPECT_FALSE(Exists(dir));
  }
}

}  // namespace
}  // namespace spindle
