// Helpers of the CUDA model tests (test_cuda_model.cc, test_cuda_cp.cc): a random sequence with
// documents, and the per-tensor comparison of two flat gradient buffers that each test checks
// against its own tolerances.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/model_config.h"
#include "worker/engine/batch.h"
#include "worker/engine/params.h"

namespace spindle::testing {

// Random tokens in [0, vocab - 1) with an end-of-document token (vocab - 1) about every doc
// tokens (uniform in [doc/2, 3doc/2]).
inline Batch RandomBatch(const ModelConfig& c, int64_t T, int64_t doc, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.vocab) - 2);
  std::uniform_int_distribution<int64_t> len(doc / 2, doc + doc / 2);
  std::vector<int32_t> t(T);
  int64_t next_eos = len(gen);
  for (int64_t i = 0; i < T; ++i) {
    t[i] = tok(gen);
    if (i == next_eos) {
      t[i] = static_cast<int32_t>(c.vocab) - 1;
      next_eos += len(gen);
    }
  }
  return MakeSequenceBatch(t, static_cast<int32_t>(c.vocab) - 1);
}

// One parameter tensor's gradient, `got` against `want`.
struct GradAgreement {
  std::string name;
  bool norm = false;     // a norm weight (1-D)
  double rel = 0.0;      // ||got - want|| / ||want||
  double cos = 1.0;      // cosine similarity
  double want_sq = 0.0;  // ||want||^2
};

// want and got are flat gradient buffers in P's layout.
inline std::vector<GradAgreement> CompareGradients(const ParamSet& P, const float* want,
                                                   const float* got) {
  std::vector<GradAgreement> out;
  for (int i = 0; i < P.size(); ++i) {
    const ParamInfo& p = P.info(i);
    double dd = 0, aa = 0, bb = 0, ab = 0;
    for (int64_t j = p.offset; j < p.offset + p.numel; ++j) {
      const double a = want[j], b = got[j];
      dd += (a - b) * (a - b);
      aa += a * a;
      bb += b * b;
      ab += a * b;
    }
    out.push_back({p.name, p.shape.size() == 1, std::sqrt(dd / std::max(aa, 1e-30)),
                   ab / std::sqrt(std::max(aa * bb, 1e-60)), aa});
  }
  return out;
}

// One line per tensor whose gradients in `got` are off `want` by more than `rel` (relative L2);
// empty when none is.
inline std::string GradientsAbove(const ParamSet& P, const float* want, const float* got,
                                  double rel) {
  std::string report;
  for (const GradAgreement& g : CompareGradients(P, want, got))
    if (g.rel > rel) report += "\n  " + g.name + ": rel " + std::to_string(g.rel);
  return report;
}

}  // namespace spindle::testing
