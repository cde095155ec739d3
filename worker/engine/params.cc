// ParamSet: flat parameter and gradient buffers with named views (see params.h).
#include "worker/engine/params.h"

#include "worker/engine/rng.h"

namespace spindle {

int ParamSet::Add(std::string name, std::vector<int64_t> shape, ParamInit init, float init_std) {
  ParamInfo p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.numel = 1;
  for (int64_t s : p.shape) p.numel *= s;
  p.offset = total_;
  // Keep every parameter 16-float aligned so vector loops start aligned.
  total_ += (p.numel + 15) / 16 * 16;
  p.init = init;
  p.init_std = init_std;
  p.weight_decay = init == ParamInit::kNormal && p.shape.size() == 2;
  by_name_[p.name] = static_cast<int>(params_.size());
  params_.push_back(std::move(p));
  return static_cast<int>(params_.size()) - 1;
}

void ParamSet::Allocate(uint64_t seed) {
  data_ = Tensor::Zeros({total_});
  grad_ = Tensor::Zeros({total_});
  for (int i = 0; i < size(); ++i) {
    const ParamInfo& p = params_[i];
    float* d = data(i);
    switch (p.init) {
      case ParamInit::kOnes:
        for (int64_t j = 0; j < p.numel; ++j) d[j] = 1.0f;
        break;
      case ParamInit::kZeros:
        break;
      case ParamInit::kNormal: {
        Rng rng(HashCombine(seed, HashName(p.name)));
        for (int64_t j = 0; j < p.numel; ++j) d[j] = static_cast<float>(rng.Normal()) * p.init_std;
        break;
      }
    }
  }
}

int ParamSet::Find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : it->second;
}

}  // namespace spindle
