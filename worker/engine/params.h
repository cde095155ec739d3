// ParamSet: every model parameter lives in one flat fp32 buffer, with its gradient in a second
// flat buffer of the same layout. Each parameter is a named view (DESIGN.md checkpoint name,
// shape, offset). One flat buffer makes the optimizer, gradient clipping, bucketed all-reduce and
// checkpointing single loops. A parameter may be a shard of a larger tensor (expert parallelism:
// a rank holds a range of a layer's stacked experts): its view is the shard, its full_shape and
// full_offset say where it lies in the tensor the checkpoint names. Not thread-safe.
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
  // The whole tensor this parameter is a shard of (shape itself when it is whole), and the
  // shard's first element in it: initial values and checkpoints are those of the whole tensor.
  std::vector<int64_t> full_shape;
  int64_t full_offset = 0;
  bool sharded() const { return full_shape != shape; }
};

class ParamSet {
 public:
  // Declares a parameter; returns its index. Only before Allocate().
  int Add(std::string name, std::vector<int64_t> shape, ParamInit init, float init_std = 0.02f);
  // Declares rows [row_begin, row_begin + rows) of the tensor `full_shape` (split along its first
  // dimension) as this rank's parameter.
  int AddShard(std::string name, std::vector<int64_t> full_shape, int64_t row_begin, int64_t rows,
               ParamInit init, float init_std = 0.02f);
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
