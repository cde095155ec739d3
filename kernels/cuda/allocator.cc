// Caching device allocator: size-binned free lists over cudaMalloc, with allocated / reserved /
// peak accounting.
#include "kernels/cuda/allocator.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace spindle::kernels::cuda {

namespace {
constexpr size_t kSmallGranule = 512;
constexpr size_t kLargeGranule = 2u << 20;
constexpr size_t kLargeThreshold = 1u << 20;

std::string GiB(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(bytes) / (1u << 30));
  return buf;
}
}  // namespace

size_t CachingAllocator::RoundSize(size_t bytes) {
  const size_t g = bytes >= kLargeThreshold ? kLargeGranule : kSmallGranule;
  return (std::max<size_t>(bytes, 1) + g - 1) / g * g;
}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  (void)ReleaseCachedLocked();
}

Status CachingAllocator::Allocate(size_t bytes, void** ptr) {
  *ptr = nullptr;
  if (bytes == 0) return Status::Ok();
  const size_t size = RoundSize(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = free_.lower_bound(size);
  if (it != free_.end() && it->first <= 2 * size) {
    *ptr = it->second;
    in_use_[it->second] = it->first;
    stats_.allocated += it->first;
    free_.erase(it);
  } else {
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, size);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      SPINDLE_RETURN_IF_ERROR(ReleaseCachedLocked());
      e = cudaMalloc(&p, size);
      if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        return OutOfMemory(size);
      }
    }
    SPINDLE_CUDA_CHECK(e);
    ++stats_.cuda_mallocs;
    stats_.reserved += size;
    stats_.allocated += size;
    in_use_[p] = size;
    *ptr = p;
  }
  stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
  if (poison_) {
    // A cached block may still be read by work queued on any stream: wait for it first.
    SPINDLE_CUDA_CHECK(cudaDeviceSynchronize());
    SPINDLE_CUDA_CHECK(cudaMemset(*ptr, 0xFF, size));
    SPINDLE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return Status::Ok();
}

Status CachingAllocator::OutOfMemory(size_t size) const {
  size_t free = 0, total = 0;
  std::string device = "unknown";
  if (cudaMemGetInfo(&free, &total) == cudaSuccess) {
    device = GiB(free) + " free of " + GiB(total);
  } else {
    (void)cudaGetLastError();
  }
  return {StatusCode::kOutOfMemory,
          "CachingAllocator: out of device memory allocating " + GiB(size) +
              " (this allocator: " + GiB(stats_.allocated) + " allocated, " + GiB(stats_.reserved) +
              " reserved, peak " + GiB(stats_.peak_allocated) + "; the device: " + device +
              "); shorter sequences, recompute or a larger cp need less per GPU"};
}

Status CachingAllocator::Free(void* ptr) {
  if (ptr == nullptr) return Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = in_use_.find(ptr);
  if (it == in_use_.end()) {
    return {StatusCode::kInvalidArgument, "CachingAllocator::Free: pointer not from Allocate"};
  }
  stats_.allocated -= it->second;
  free_.emplace(it->second, ptr);
  in_use_.erase(it);
  return Status::Ok();
}

Status CachingAllocator::ReleaseCachedLocked() {
  for (auto& [size, p] : free_) {
    SPINDLE_CUDA_CHECK(cudaFree(p));
    stats_.reserved -= size;
  }
  free_.clear();
  return Status::Ok();
}

Status CachingAllocator::EmptyCache() {
  std::lock_guard<std::mutex> lock(mu_);
  return ReleaseCachedLocked();
}

AllocatorStats CachingAllocator::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingAllocator::SetPoison(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  poison_ = on;
}

void CachingAllocator::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_allocated = stats_.allocated;
}

}  // namespace spindle::kernels::cuda
