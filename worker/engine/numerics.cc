// The CPU model's emulated number formats: weight working copies, FP8 GEMM inputs and bf16
// stores (see numerics.h).
#include "worker/engine/numerics.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "kernels/cpu/bf16.h"

namespace spindle {

namespace k = kernels::cpu;

Numerics CpuNumerics(TrainPrecision precision, TrainFp8Recipe recipe) {
  Numerics n;
  switch (precision) {
    case TrainPrecision::kAuto:
    case TrainPrecision::kFp32:
      break;
    case TrainPrecision::kBf16:
      n.bf16_storage = true;
      break;
    case TrainPrecision::kFp8:
      n.bf16_storage = true;
      n.fp8 = k::Fp8Recipe{};
      if (recipe == TrainFp8Recipe::kBlockwise) n.fp8->scaling = k::Fp8Scaling::kBlockwise;
      break;
  }
  return n;
}

OutlierSite OutlierPosition(const OutlierInjection& o, int64_t layer, int64_t rows, int64_t cols) {
  // splitmix64 of (seed, layer)
  uint64_t z = o.seed + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(layer) + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  OutlierSite s;
  if (rows > 0) s.row = static_cast<int64_t>((z & 0xFFFFFFFFull) % static_cast<uint64_t>(rows));
  if (cols > 0) s.col = static_cast<int64_t>((z >> 32) % static_cast<uint64_t>(cols));
  return s;
}

void NumericsEmulator::Set(const Numerics& n, std::vector<int> linear_weights,
                           std::vector<int> expert_weights) {
  n_ = n;
  linear_ = std::move(linear_weights);
  experts_ = std::move(expert_weights);
  is_linear_.clear();
  is_expert_.clear();
  working_ = Tensor();
  fp8_ = Tensor();
}

void NumericsEmulator::RefreshWeights(ParamSet& params) {
  if (n_.exact()) return;
  const int64_t total = params.numel();
  const float* master = params.flat_data().f32();
  if (n_.bf16_storage) {
    if (working_.numel() != total) working_ = Tensor({total});
    std::memcpy(working_.f32(), master, static_cast<size_t>(total) * sizeof(float));
    k::RoundToBf16(working_.f32(), total);
  }
  if (n_.fp8) {
    if (fp8_.numel() != total) fp8_ = Tensor::Zeros({total});
    is_linear_.assign(static_cast<size_t>(params.size()), 0);
    weight_inverse_scale_.assign(static_cast<size_t>(params.size()), 1.0f);
    for (int i : linear_) {
      const ParamInfo& p = params.info(i);
      is_linear_[i] = 1;
      if (blockwise()) {  // each [out, in] matrix (of a stack) in 128 x 128 blocks
        const int64_t cols = p.shape.empty() ? p.numel : p.shape.back();
        const int64_t rows = p.shape.size() >= 2 ? p.shape[p.shape.size() - 2] : 1;
        for (int64_t m = 0; m < p.numel; m += rows * cols)
          k::QuantizeSquareBlocks(master + p.offset + m, rows, cols, n_.fp8->weights,
                                  fp8_.f32() + p.offset + m);
        continue;
      }
      const k::Fp8Scale s =
          k::QuantizeTensorwise(master + p.offset, p.numel, n_.fp8->weights, fp8_.f32() + p.offset);
      weight_inverse_scale_[i] = s.inverse;
    }
    // Each expert's [out, in] matrix on its own: one scale per expert, or its 128 x 128 blocks.
    is_expert_.assign(static_cast<size_t>(params.size()), 0);
    expert_inverse_scale_.assign(static_cast<size_t>(params.size()), {});
    for (int i : experts_) {
      const ParamInfo& p = params.info(i);
      is_expert_[i] = 1;
      const int64_t rows = p.shape.size() == 3 ? p.shape[1] : 1;
      const int64_t cols = p.shape.empty() ? p.numel : p.shape.back();
      std::vector<float>& inverse = expert_inverse_scale_[i];
      for (int64_t m = 0; m < p.numel; m += rows * cols) {
        const float* w = master + p.offset + m;
        float* q = fp8_.f32() + p.offset + m;
        if (blockwise()) {
          k::QuantizeSquareBlocks(w, rows, cols, n_.fp8->weights, q);
          inverse.push_back(1.0f);
        } else {
          inverse.push_back(k::QuantizeTensorwise(w, rows * cols, n_.fp8->weights, q).inverse);
        }
      }
    }
  }
}

const float* NumericsEmulator::Weight(ParamSet& params, int i) const {
  if (!n_.bf16_storage) return params.data(i);
  return working_.f32() + params.info(i).offset;
}

GemmOperand NumericsEmulator::LinearWeight(ParamSet& params, int i, bool fp8) const {
  if (fp8 && n_.fp8 && static_cast<size_t>(i) < is_linear_.size() && is_linear_[i])
    return {fp8_.f32() + params.info(i).offset, weight_inverse_scale_[i]};
  return {Weight(params, i), 1.0f};
}

GemmOperand NumericsEmulator::ExpertWeight(ParamSet& params, int i, int64_t expert) const {
  const ParamInfo& p = params.info(i);
  const int64_t matrix = p.shape.size() == 3 ? p.shape[1] * p.shape[2] : p.numel;
  if (n_.fp8 && static_cast<size_t>(i) < is_expert_.size() && is_expert_[i])
    return {fp8_.f32() + p.offset + expert * matrix, expert_inverse_scale_[i][expert]};
  return {Weight(params, i) + expert * matrix, 1.0f};
}

GemmOperand NumericsEmulator::Quantize(const float* const* parts, int count, int64_t rows,
                                       int64_t cols, k::Fp8Format f, Fp8Copy& slot,
                                       GemmOperand* out, const std::vector<int64_t>* bounds) const {
  const int64_t n = rows * cols;
  if (slot.values.numel() < count * n) slot.values = Tensor({count * n});
  if (blockwise()) {
    if (slot.columns.numel() < count * n) slot.columns = Tensor({count * n});
    // Down the columns the parts are apart (a column is one part's), and so are the segments of
    // `bounds`; along the rows the parts are one joint row of count x cols values.
    for (int i = 0; i < count; ++i) {
      if (bounds == nullptr) {
        k::QuantizeColumnBlocks(parts[i], rows, cols, f, slot.columns.f32() + i * n);
        continue;
      }
      // Segment s is [bounds[s], bounds[s + 1]), the first from row 0 and the last to `rows`
      // whatever the bounds say, each clamped to the rows.
      int64_t r0 = 0;
      for (size_t s = 0; s <= bounds->size(); ++s) {
        const int64_t r1 = s < bounds->size() ? std::clamp<int64_t>((*bounds)[s], r0, rows) : rows;
        if (r1 > r0)
          k::QuantizeColumnBlocks(parts[i] + r0 * cols, r1 - r0, cols, f,
                                  slot.columns.f32() + i * n + r0 * cols);
        r0 = r1;
      }
    }
    if (count == 1) {
      k::QuantizeRowBlocks(parts[0], rows, cols, f, slot.values.f32());
    } else {
      if (slot.joint.numel() < 2 * count * n) slot.joint = Tensor({2 * count * n});
      float* joint = slot.joint.f32();
      float* quantized = joint + count * n;
      const int64_t width = count * cols;
      for (int64_t r = 0; r < rows; ++r)
        for (int i = 0; i < count; ++i)
          std::memcpy(joint + r * width + i * cols, parts[i] + r * cols,
                      static_cast<size_t>(cols) * sizeof(float));
      k::QuantizeRowBlocks(joint, rows, width, f, quantized);
      for (int64_t r = 0; r < rows; ++r)
        for (int i = 0; i < count; ++i)
          std::memcpy(slot.values.f32() + i * n + r * cols, quantized + r * width + i * cols,
                      static_cast<size_t>(cols) * sizeof(float));
    }
    slot.inverse_scale = 1.0f;
    for (int i = 0; i < count; ++i)
      out[i] = {slot.values.f32() + i * n, 1.0f, slot.columns.f32() + i * n};
    return out[0];
  }
  float amax = 0.0f;
  for (int i = 0; i < count; ++i) {
    const float a = k::AbsMax(parts[i], n);
    amax = std::isnan(a) || std::isnan(amax) ? NAN : std::max(amax, a);
  }
  const k::Fp8Scale s = k::TensorwiseScale(amax, f);
  slot.inverse_scale = s.inverse;
  for (int i = 0; i < count; ++i) {
    k::QuantizeScaled(parts[i], n, s.scale, f, slot.values.f32() + i * n);
    out[i] = {slot.values.f32() + i * n, s.inverse};
  }
  return out[0];
}

GemmOperand NumericsEmulator::Activation(const float* x, int64_t rows, int64_t cols,
                                         Fp8Copy& slot) const {
  if (!n_.fp8) return {x, 1.0f};
  GemmOperand op;
  return Quantize(&x, 1, rows, cols, n_.fp8->activations, slot, &op);
}

GemmOperand NumericsEmulator::FfnInput(int64_t layer, const float* x, int64_t rows, int64_t cols,
                                       Fp8Copy& slot) const {
  if (!n_.outliers || rows <= 0 || cols <= 0) return Activation(x, rows, cols, slot);
  const int64_t n = rows * cols;
  if (slot.injected.numel() < n) slot.injected = Tensor({n});
  float* y = slot.injected.f32();
  std::memcpy(y, x, static_cast<size_t>(n) * sizeof(float));
  const OutlierSite s = OutlierPosition(*n_.outliers, layer, rows, cols);
  y[s.row * cols + s.col] *= n_.outliers->factor;
  if (!n_.fp8) Store(y, n);  // the GEMM reads the stored input
  return Activation(y, rows, cols, slot);
}

GemmOperand NumericsEmulator::GroupedActivation(const float* x, int64_t rows, int64_t cols,
                                                const std::vector<int64_t>& bounds,
                                                Fp8Copy& slot) const {
  if (!n_.fp8) return {x, 1.0f};
  GemmOperand op;
  return Quantize(&x, 1, rows, cols, n_.fp8->activations, slot, &op, &bounds);
}

GemmOperand NumericsEmulator::GroupedGradient(const float* dy, int64_t rows, int64_t cols,
                                              const std::vector<int64_t>& bounds,
                                              Fp8Copy& slot) const {
  if (!n_.fp8) return {dy, 1.0f};
  GemmOperand op;
  return Quantize(&dy, 1, rows, cols, n_.fp8->gradients, slot, &op, &bounds);
}

void NumericsEmulator::FfnInputGradient(int64_t layer, float* dx, int64_t rows,
                                        int64_t cols) const {
  if (!n_.outliers || rows <= 0 || cols <= 0) return;
  const OutlierSite s = OutlierPosition(*n_.outliers, layer, rows, cols);
  dx[s.row * cols + s.col] *= n_.outliers->factor;
}

GemmOperand NumericsEmulator::Gradient(const float* dy, int64_t rows, int64_t cols,
                                       Fp8Copy& slot) const {
  if (!n_.fp8) return {dy, 1.0f};
  GemmOperand op;
  return Quantize(&dy, 1, rows, cols, n_.fp8->gradients, slot, &op);
}

void NumericsEmulator::JointGradients(const std::vector<const float*>& parts, int64_t rows,
                                      int64_t cols, Fp8Copy& slot,
                                      std::vector<GemmOperand>* out) const {
  out->resize(parts.size());
  if (!n_.fp8) {
    for (size_t i = 0; i < parts.size(); ++i) (*out)[i] = {parts[i], 1.0f};
    return;
  }
  Quantize(parts.data(), static_cast<int>(parts.size()), rows, cols, n_.fp8->gradients, slot,
           out->data());
}

void NumericsEmulator::Store(float* x, int64_t n) const {
  if (n_.bf16_storage) k::RoundToBf16(x, n);
}

}  // namespace spindle
