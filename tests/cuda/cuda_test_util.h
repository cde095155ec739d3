// Helpers of the CUDA kernel tests: GPU presence (tests skip cleanly without one), device
// buffers with dtype conversion, inputs rounded to the storage dtype so the CPU reference sees
// exactly what the GPU sees, and the one per-dtype tolerance table every comparison uses.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/dtype.h"
#include "kernels/cuda/status.h"

namespace spindle::kernels::cuda::testing {

inline bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SPINDLE_REQUIRE_GPU()                                                    \
  do {                                                                           \
    if (!::spindle::kernels::cuda::testing::HaveGpu()) {                         \
      (void)cudaGetLastError();                                                  \
      GTEST_SKIP() << "no CUDA device on this machine: CUDA tests skipped";        \
    }                                                                            \
  } while (0)

#define ASSERT_OK(expr)                                  \
  do {                                                   \
    const ::spindle::kernels::cuda::Status s_ = (expr);  \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_.message(); \
  } while (0)

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// |got - want| <= abs * peak + rel * |want|, peak = max |want| over the tensor (1 if all zero).
struct Tolerance {
  double abs, rel;
};
inline Tolerance TolFor(DType t) {
  switch (t) {
    case DType::kFloat32:
      return {2e-5, 1e-4};
    case DType::kBFloat16:
      return {1.5e-2, 1.5e-2};
    default:
      return {0, 0};
  }
}

// A new seed per call; SPINDLE_TEST_SEED=N replays a failure's printed seed instead.
inline uint32_t FreshSeed() {
  if (const char* s = std::getenv("SPINDLE_TEST_SEED"))
    return static_cast<uint32_t>(std::strtoul(s, nullptr, 10));
  return std::random_device{}();
}

inline std::vector<float> Normal(std::mt19937& rng, int64_t n, float sd = 1.0f, float mean = 0.0f) {
  std::normal_distribution<float> dist(mean, sd);
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

inline float RoundBf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// Rounds every value to what `t` stores, in place.
inline void RoundTo(DType t, std::vector<float>& x) {
  if (t == DType::kBFloat16) {
    for (float& e : x) e = RoundBf16(e);
  }
}

// An owned device allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0 && cudaMalloc(&ptr_, bytes) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Device copy of x stored as `t`.
inline DeviceBuffer Upload(const std::vector<float>& x, DType t) {
  DeviceBuffer b(x.size() * DTypeSize(t) + 16);
  if (t == DType::kBFloat16) {
    std::vector<__nv_bfloat16> h(x.size());
    for (size_t i = 0; i < x.size(); ++i) h[i] = __float2bfloat16(x[i]);
    cudaMemcpy(b.get(), h.data(), h.size() * 2, cudaMemcpyHostToDevice);
  } else {
    cudaMemcpy(b.get(), x.data(), x.size() * 4, cudaMemcpyHostToDevice);
  }
  return b;
}

template <typename T>
DeviceBuffer UploadRaw(const std::vector<T>& x) {
  DeviceBuffer b(x.size() * sizeof(T) + 16);
  cudaMemcpy(b.get(), x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice);
  return b;
}

inline std::vector<float> Download(const void* p, int64_t n, DType t) {
  std::vector<float> out(n);
  cudaDeviceSynchronize();
  if (t == DType::kBFloat16) {
    std::vector<__nv_bfloat16> h(n);
    cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost);
    for (int64_t i = 0; i < n; ++i) out[i] = __bfloat162float(h[i]);
  } else {
    cudaMemcpy(out.data(), p, n * 4, cudaMemcpyDeviceToHost);
  }
  return out;
}

// Fails (NaN included) unless got matches want within `factor` times the dtype's tolerance.
inline void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, DType t,
                        const std::string& what, double factor = 1.0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const Tolerance tol = TolFor(t);
  double peak = 0.0;
  for (float w : want) peak = std::max(peak, static_cast<double>(std::abs(w)));
  if (peak == 0.0) peak = 1.0;
  int64_t bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    const double allowed = factor * (tol.abs * peak + tol.rel * std::abs(want[i]));
    if (!(err <= allowed)) {
      worst = std::isnan(err) ? err : std::max(worst, err / allowed);
      if (++bad <= 5) {
        ADD_FAILURE() << what << " (" << DTypeName(t) << ")[" << i << "]: got " << got[i]
                      << ", want " << want[i] << " (peak " << peak << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size()
                    << " elements off, worst at " << worst << "x the tolerance";
}

// Bitwise equality (the determinism checks).
inline void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b,
                           const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  int64_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff += std::memcmp(&a[i], &b[i], 4) != 0;
  EXPECT_EQ(diff, 0) << what << ": " << diff << " values moved between two identical runs";
}

}  // namespace spindle::kernels::cuda::testing
