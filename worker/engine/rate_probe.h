// Rate probe: what this process's CPU kernels achieve, for the planner's cost model
// (planner/cp_cost_model.h): dense GEMM, causal softmax attention and chunked Lightning FLOP/s
// (forward + backward, counted as ModelConfig::TrainFlops counts them) and the bandwidth of a
// streaming elementwise kernel, at the shapes of `ProbeShape` on the OpenMP threads this process
// runs with; and what one thread copies (memcpy), as the communicator packs an all-to-all by
// pieces on its own thread, of a buffer the size of one exchange of q, k, v and o at those
// shapes. Each kernel runs until `seconds_each` has passed (at least twice) after a warm-up;
// the fastest run counts. Not thread-safe (it uses every OpenMP thread).
#pragma once

#include <cstdint>

#include "nlohmann/json.hpp"

namespace spindle {

struct ProbeShape {
  int64_t tokens = 1024;
  int64_t d_model = 256;
  int64_t ffn_dim = 704;
  int64_t heads = 4;        // Lightning head size d_model / heads
  int64_t qk_dim = 64;      // MLA query/key head size
  int64_t v_dim = 64;
};

struct MeasuredRates {
  double gemm_flops = 0;
  double attention_flops = 0;
  double lightning_flops = 0;
  double memory_bytes = 0;
  double copy_bytes = 0;  // bytes copied per second
  nlohmann::json ToJson() const;
};

MeasuredRates MeasureCpuRates(const ProbeShape& shape, double seconds_each = 0.05);

}  // namespace spindle
