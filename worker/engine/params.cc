// ParamSet: flat parameter and gradient buffers with named views (see params.h).
#include "worker/engine/params.h"

#include <algorithm>

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
  p.weight_decay = init == ParamInit::kNormal && p.shape.size() >= 2;
  p.full_shape = p.shape;
  by_name_[p.name] = static_cast<int>(params_.size());
  params_.push_back(std::move(p));
  return static_cast<int>(params_.size()) - 1;
}

int ParamSet::AddShard(std::string name, std::vector<int64_t> full_shape, int64_t row_begin,
                       int64_t rows, ParamInit init, float init_std) {
  std::vector<int64_t> shape = full_shape;
  shape[0] = rows;
  const int i = Add(std::move(name), std::move(shape), init, init_std);
  ParamInfo& p = params_[i];
  p.full_offset = row_begin * (p.numel / std::max<int64_t>(1, rows));
  p.full_shape = std::move(full_shape);
  return i;
}

namespace {

// p[0, n) = value, in parallel (first touch of fresh pages included) above a small size.
void Fill(float* p, int64_t n, float value) {
#pragma omp parallel for schedule(static) if (n > (int64_t{1} << 16))
  for (int64_t i = 0; i < n; ++i) p[i] = value;
}

}  // namespace

void ParamSet::Allocate(uint64_t seed, bool grads) {
  // Each value depends on (seed, parameter name, index) only: element j of a normal tensor is
  // the Normal() drawn at counter 2j of its counter-based Rng. So the fill runs in parallel and
  // gives the same bits for any thread count (a 1B-parameter model: ~20 ns per value serially).
  data_ = Tensor({total_});
  Fill(data_.f32(), total_, 0.0f);  // also the padding between parameters
  grad_ = Tensor();
  if (grads) {
    grad_ = Tensor({total_});
    Fill(grad_.f32(), total_, 0.0f);
  }
  for (int i = 0; i < size(); ++i) {
    const ParamInfo& p = params_[i];
    float* d = data(i);
    switch (p.init) {
      case ParamInit::kOnes:
        Fill(d, p.numel, 1.0f);
        break;
      case ParamInit::kZeros:
        break;
      case ParamInit::kNormal: {
        const uint64_t key = HashCombine(seed, HashName(p.name));
        const float scale = p.init_std;
#pragma omp parallel for schedule(static) if (p.numel > (int64_t{1} << 14))
        for (int64_t j = 0; j < p.numel; ++j)
          d[j] = static_cast<float>(
                     Rng(key, 2 * static_cast<uint64_t>(p.full_offset + j)).Normal()) *
                 scale;
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
