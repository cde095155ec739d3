// bench_cp: context-parallel overhead on CPU. For several sequence lengths, cp sizes and mode
// pairs (AllGather, All2All, and AllGather with MLA Ring), ranks run as threads (one OpenMP
// thread each, Gloo over 127.0.0.1) a forward+backward of the model on their zigzag shares, and
// the table gives per step and per rank: the step time, and per layer type the communication
// time and bytes sent by mode. cp = 1 is the baseline.
// Bytes are exact; times on a shared 2-core machine are indicative only (threads of all ranks
// share the cores, so compute and communication compete). See bench/CP_NOTES.md.
//
//   bench_cp [--seq 1024,4096] [--cp 2,4] [--d 128] [--layers 8] [--reps 2]
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/cp_modes.h"
#include "worker/engine/comm/gloo_communicator.h"
#include "worker/engine/comm/kv_stores.h"
#include "worker/engine/cp/cp_layout.h"
#include "worker/engine/model.h"

namespace spindle {
namespace {

std::vector<int64_t> IntList(const std::string& s) {
  std::vector<int64_t> out;
  for (absl::string_view p : absl::StrSplit(s, ',')) {
    int64_t v;
    if (absl::SimpleAtoi(p, &v)) out.push_back(v);
  }
  return out;
}

// Documents of random length (mean ~600 tokens) packed into one sequence.
std::vector<int32_t> Tokens(int64_t T) {
  std::mt19937 gen(3);
  std::uniform_int_distribution<int32_t> tok(0, 255);
  std::geometric_distribution<int> len(1.0 / 600);
  std::vector<int32_t> t(T);
  int64_t next = len(gen) + 1;
  for (int64_t i = 0; i < T; ++i) {
    t[i] = tok(gen);
    if (i == next) {
      t[i] = 256;
      next = i + len(gen) + 2;
    }
  }
  return t;
}

struct Row {
  double step_s = 0;
  CommStats stats;
};

Row Measure(const ModelConfig& cfg, int64_t T, int cp, CpMode lm, CpMode mm, int reps) {
  const Batch full = MakeSequenceBatch(Tokens(T), 256);
  MemoryKvStore store;
  std::vector<Row> rows(cp);
  std::vector<std::thread> th;
  for (int r = 0; r < cp; ++r)
    th.emplace_back([&, r] {
      omp_set_num_threads(1);
      std::unique_ptr<Communicator> comm;
      if (cp > 1) {
        GlooOptions o;
        auto c = CreateGlooCommunicator(store, "bench", r, cp, o);
        if (!c.ok()) {
          std::fprintf(stderr, "bench_cp: %s\n", std::string(c.status().message()).c_str());
          std::exit(1);
        }
        comm = std::move(*c);
      }
      auto m = Model::Create(cfg, 1);
      (*m)->SetCp({comm.get(), lm, mm, nullptr, nullptr, MlaRingPayloadFor(cfg.mla, cfg.n_heads)});
      CpBatch b = *ShardForCp(full, cp, r);
      for (int i = 0; i < reps; ++i) {
        if (comm) comm->TakeStats();
        (*m)->params().ZeroGrad();
        const auto t0 = std::chrono::steady_clock::now();
        auto s = (*m)->ForwardBackward(b, 1.0f, Recompute::None());
        if (!s.ok()) std::exit(1);
        rows[r].step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (comm) rows[r].stats = comm->TakeStats();
        if (comm) (void)comm->Barrier();
      }
    });
  for (auto& t : th) t.join();
  Row worst = rows[0];
  for (const Row& r : rows) worst.step_s = std::max(worst.step_s, r.step_s);
  return worst;  // rank 0's amounts, the slowest rank's step time
}

void Print(int64_t T, int cp, const char* mode, const Row& row, double base_s) {
  double ls = 0, ms = 0;
  int64_t lb = 0, mb = 0;
  for (const auto& [k, a] : row.stats) {
    if (k.second == CommLayer::kLightning) ls += a.seconds, lb += a.bytes;
    if (k.second == CommLayer::kMla) ms += a.seconds, mb += a.bytes;
  }
  std::printf("| %6lld | %2d | %-14s | %8.3f | %8.3f | %9.4f | %10.3f | %9.4f | %10.3f |\n",
              static_cast<long long>(T), cp, mode, row.step_s, base_s, ls, lb / 1048576.0, ms,
              mb / 1048576.0);
}

}  // namespace
}  // namespace spindle

int main(int argc, char** argv) {
  using namespace spindle;
  std::vector<int64_t> seqs = {1024, 4096}, cps = {2, 4};
  int64_t d = 128, layers = 8, reps = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--seq") seqs = IntList(argv[i + 1]);
    else if (a == "--cp") cps = IntList(argv[i + 1]);
    else if (a == "--d") absl::SimpleAtoi(argv[i + 1], &d);
    else if (a == "--layers") absl::SimpleAtoi(argv[i + 1], &layers);
    else if (a == "--reps") absl::SimpleAtoi(argv[i + 1], &reps);
  }
  ModelConfig cfg = *ModelPreset("small");
  cfg.d_model = d;
  cfg.n_heads = 4;
  cfg.ffn_dim = 3 * d;
  cfg.n_layers = layers;
  cfg.mla = {0, 64, 32, 32, 32};  // latent 64 + 32 = 96 values a token
  std::printf("model: d=%lld heads=%lld layers=%lld pattern %s, MLA latent %lld+%lld, %lld params\n",
              static_cast<long long>(cfg.d_model), static_cast<long long>(cfg.n_heads),
              static_cast<long long>(cfg.n_layers), cfg.layer_pattern.c_str(),
              static_cast<long long>(cfg.mla.kv_lora_rank),
              static_cast<long long>(cfg.mla.qk_rope_dim), static_cast<long long>(cfg.NumParams()));
  std::printf("per rank per forward+backward step (comm: seconds on the communicator thread, MiB "
              "sent by this rank)\n\n");
  std::printf("| T      | cp | mode (L/M)     | step s   | cp=1 s   | light. s  | light. MiB | mla s     | mla MiB    |\n");
  std::printf("|--------|----|----------------|----------|----------|-----------|------------|-----------|------------|\n");
  const CpMode AG = CpMode::kAllGather, A2A = CpMode::kAll2All, RING = CpMode::kRing;
  for (int64_t T : seqs) {
    const Row base = Measure(cfg, T, 1, AG, AG, static_cast<int>(reps));
    Print(T, 1, "-", base, base.step_s);
    for (int64_t cp : cps) {
      struct { const char* name; CpMode l, m;
      } modes[] = {
          {"allgather/allg", AG, AG}, {"all2all/all2al", A2A, A2A}, {"allgather/ring", AG, RING}};
      for (auto& m : modes) {
        if (m.l == A2A && cfg.n_heads % cp != 0) continue;
        Print(T, static_cast<int>(cp), m.name,
              Measure(cfg, T, static_cast<int>(cp), m.l, m.m, static_cast<int>(reps)), base.step_s);
      }
    }
  }
  return 0;
}
