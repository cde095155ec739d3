// ParamSet: every model parameter lives in one flat fp32 buffer, with its gradient in a second
// flat buffer of the same layout. Each parameter is a named view (DESIGN.md checkpoint name,
// shape, offset). One flat buffer makes the optimizer, gradient clipping, bucketed all-reduce and
// checkpointing single loops. Not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/engine/tensor.h"

namespace spindle {

enum class ParamInit { kNormal, kOnes, kZeros };

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in elements, into the flat buffers
  int64_t numel = 0;
  ParamInit init = ParamInit::kNormal;
  float init_std = 0.02f;
  bool weight_decay = true;  // matrices decay; norm weights do not
};

class ParamSet {
 public:
  // Declares a parameter; returns its index. Only before Allocate().
  int Add(std::string name, std::vector<int64_t> shape, ParamInit init, float init_std = 0.02f);
  // Allocates the flat buffers (gradients zeroed) and initialises from `seed`: every
  // parameter draws from its own stream, so the result does not depend on declaration order.
  // With `grads` false the gradient buffer comes, zeroed, with its first use (flat_grad() or
  // grad()): for a host copy of a model whose gradients live on a device and may never be needed
  // here. That first use must not race with another.
  void Allocate(uint64_t seed, bool grads = true);

  float* data(int i) { return data_.f32() + params_[i].offset; }
  float* grad(int i) { return flat_grad().f32() + params_[i].offset; }
  const ParamInfo& info(int i) const { return params_[i]; }
  int size() const { return static_cast<int>(params_.size()); }
  int64_t numel() const { return total_; }
  // -1 when absent.
  int Find(const std::string& name) const;

  Tensor& flat_data() { return data_; }
  Tensor& flat_grad() {
    if (grad_.numel() != total_) grad_ = Tensor::Zeros({total_});
    return grad_;
  }
  void ZeroGrad() { grad_.SetZero(); }

 private:
  std::vector<ParamInfo> params_;
  std::unordered_map<std::string, int> by_name_;
  int64_t total_ = 0;
  Tensor data_, grad_;
};

}  // namespace spindle
