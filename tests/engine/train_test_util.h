// Helpers shared by the trainer tests of the CPU engine (tests/engine) and the CUDA engine
// (tests/cuda): the loss a model would reach by learning only token frequencies.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>

#include "worker/engine/batch.h"
#include "worker/engine/data.h"

namespace spindle::testing {

// Entropy (nats per target) of the unigram distribution of the targets of the first n
// sequences: the loss of a model that predicts token frequencies.
inline double UnigramLoss(const DataSource& data, int64_t n) {
  std::map<int32_t, double> counts;
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    Batch b = MakeSequenceBatch(data.Sequence(i), data.eos_id());
    for (int32_t t : b.targets)
      if (t >= 0) counts[t] += 1, total += 1;
  }
  double h = 0;
  for (auto& [t, c] : counts) h -= c / total * std::log(c / total);
  return h;
}

}  // namespace spindle::testing
