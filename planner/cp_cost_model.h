// CpCostModel: estimates one training step of a job per rank, for each candidate CP mode of each
// layer type (DESIGN.md section 3, "The plan"), from
//   - the work: FLOPs of the dense GEMMs (6 N per token, plus a forward per recomputed layer),
//     of causal softmax attention (MLA; the pairs within documents, AttentionSpan: a synthetic
//     source's known lengths, a file's data.doc_span as measured from a sample of it
//     (common/document_span.h), or one document as long as the sequence where a file's are
//     unknown, the worst case), of the chunked Lightning kernel,
//     and the bytes of the memory-bound kernels (norms, SwiGLU, residuals, the optimizer);
//   - the device's measured rates (DeviceRates: GEMM, attention and Lightning FLOP/s and memory
//     bandwidth, for one rank alone on it), shared by the ranks that share the device's
//     cores or GPU;
//   - what each mode sends (bytes per collective, per layer, forward and backward) over the
//     link class that joins the CP group (LinkClass: the same GPU, NVLink, PCIe, loopback TCP
//     on one host, the network), at that link's bandwidth and per-message latency;
//   - overlap: Lightning AllGather's state exchange hides behind the local outputs, a Ring step's
//     block exchange behind the previous block's attention, the gradient all-reduce behind the
//     backward; All2All and MLA AllGather exchanges are exposed;
//   - on the CPU, the two host copies with which the communicator packs an all-to-all by pieces
//     (the All2All modes and the 2-D modes' Ulysses exchanges), exposed with them.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/job_spec.h"

namespace spindle {

// What one rank alone on a device achieves (FLOP/s and bytes/s). A zero rate is unknown.
struct DeviceRates {
  double gemm_flops = 0;       // dense GEMMs at the activation precision
  double attention_flops = 0;  // causal softmax attention forward + backward
  double lightning_flops = 0;  // the chunked Lightning kernel forward + backward
  double memory_bytes = 0;     // streaming elementwise kernels
  double copy_bytes = 0;       // a host memcpy on one thread, bytes copied (0: the built-in rate)
  bool known() const {
    return gemm_flops > 0 && attention_flops > 0 && lightning_flops > 0 && memory_bytes > 0;
  }
};

enum class LinkClass { kSameDevice, kNvlink, kPcie, kLoopback, kNetwork };
const char* LinkClassName(LinkClass l);
// "same-device", "nvlink", "pcie", "loopback", "network"; false for any other word.
bool ParseLinkClass(const std::string& word, LinkClass* out);

struct LinkRates {
  double bytes_per_s = 0;  // per rank, each direction
  double latency_s = 0;    // per message
};
// Nominal rates of a link class (bench/CP_NOTES.md, "Cost model"), used where nothing measured
// is known.
LinkRates DefaultLinkRates(LinkClass l);

// Where the ranks of one CP group run.
struct Topology {
  DeviceRates rates;          // of the job's device kind
  LinkClass link = LinkClass::kLoopback;
  LinkRates link_rates;       // of `link`
  // Ranks whose compute shares one device's resources (CPU ranks on the cores of one host beyond
  // what the cores hold, or ranks on one GPU): each gets 1 / sharing of the rates.
  double sharing = 1.0;
  std::string basis;  // what the rates and link are, in words (the plan shows it)
};

// The `sharing` of `ranks` CPU ranks on one host of `cores` cores, each running `threads` compute
// threads and, in a job of `world` > 1 ranks, a communicator thread (worker/engine/comm: Gloo's
// sends, receives, reductions and packing). While the compute threads leave a core spare, the
// communicators run there: 1. Once the compute threads fill the cores c = ranks x threads /
// cores >= 1 times, each core also carries ranks / cores communicators, each costing 1 / c^2 of a
// core: a whole core where the compute threads exactly fill the host (measured: 8 ranks x 2
// threads on 16 cores 1.5, 4 x 4 1.25), and less where they already time-slice the cores, for the
// scheduler gives a communicator only 1 / c of a core while it runs, and its exchanges, whose
// work does not grow with c, are a c times smaller part of the stretched step (2 ranks x 2
// threads on 2 cores ran as 2.0: this gives 2.25; bench/CP_NOTES.md, "The two 2-core misses").
// So c + 1 / (threads c). A job of one rank has no communicator: max(1, threads /
// cores). Nondecreasing in ranks and in threads.
double CoreSharing(int64_t ranks, int64_t threads, int64_t cores, int64_t world);

// Bytes one thread copies per second on a host of rates `r` (memcpy between warm buffers): its
// measured `copy_bytes`, else the reference machine's (bench/CP_NOTES.md). The CPU engine's
// communicator packs its all-to-alls by pieces at this rate (CpCostModel).
double HostCopyRate(const DeviceRates& r);

// Built-in rates where no worker measured any: a CPU core of the reference machine, or an H200
// (bench/CP_NOTES.md, "Cost model"); the link class a worker's own devices share (CPU: loopback,
// GPU: NVLink).
DeviceRates DefaultRates(const std::string& resources);
Topology DefaultTopology(const std::string& resources);

// One layer type's mode, as a candidate.
struct ModeChoice {
  CpMode mode = CpMode::kAllGather;
  int64_t ulysses = 1;  // the Ulysses degree of a 2-D mode (1 otherwise)
};
std::string ModeChoiceName(const ModeChoice& m);

// The estimate of one layer type's mode, summed over the layers of that type, per rank and step.
struct ModeCost {
  ModeChoice choice;
  double compute_s = 0;   // the layers' own compute (cores, extra rebuilds included)
  double comm_s = 0;      // link time of its collectives, with copy_s
  double exposed_s = 0;   // of comm_s, what overlap does not hide
  double copy_s = 0;      // of exposed_s, the host copies of the communicator's packing
  int64_t bytes = 0;      // sent per rank per step (forward + backward)
  int64_t memory_bytes = 0;  // extra activation and exchange memory the mode needs per rank
  double total_s() const { return compute_s + exposed_s; }
};

// The whole step with one mode per layer type.
struct StepCost {
  double shared_s = 0;     // everything outside the CP cores: GEMMs, memory-bound kernels, the
                           // LM head, the optimizer, the exposed gradient all-reduce
  double grad_comm_s = 0;  // gradient all-reduce link time (world > 1)
  ModeCost lightning, mla;
  double step_s() const { return shared_s + lightning.total_s() + mla.total_s(); }
};

// Candidate modes of one layer type for a job: the rule's modes that the heads allow, Ring for
// MLA, and each 2-D split (u, cp / u) with u | n_heads, 2 <= u < cp.
std::vector<ModeChoice> CandidateModes(const std::string& layer_type, int64_t cp,
                                       int64_t n_heads);

class CpCostModel {
 public:
  // The estimate of `spec` per rank and step with the given modes on `topo`.
  // `recompute_layers`: the leading layers that recompute (a forward more each).
  StepCost Estimate(const JobSpec& spec, const Topology& topo, const ModeChoice& lightning,
                    const ModeChoice& mla, int64_t recompute_layers) const;
  // One layer type alone (`layer_type` "lightning" or "mla").
  ModeCost EstimateLayers(const JobSpec& spec, const Topology& topo,
                          const std::string& layer_type, const ModeChoice& mode) const;
};

}  // namespace spindle
