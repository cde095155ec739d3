// A caching device allocator: freed blocks are kept in size-binned free lists and handed out
// again instead of going back to cudaFree, so the step loop allocates without synchronising.
// Lives in kernels/cuda so kernels' tests and benchmarks use the same allocator as the engine.
//
// Sizes are rounded up to 512 bytes (small) or 2 MiB (>= 1 MiB requests); a cached block is
// reused for a request of the same rounded size or up to twice as large.
// Stream semantics: blocks are assumed to be used on one stream (or callers synchronise before
// freeing a block that another stream still reads). Thread-safe (one mutex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>

#include "kernels/cuda/status.h"

namespace spindle::kernels::cuda {

struct AllocatorStats {
  size_t allocated = 0;       // bytes handed out and not yet freed (rounded sizes)
  size_t reserved = 0;        // bytes held from cudaMalloc (allocated + cached)
  size_t peak_allocated = 0;  // high-water mark of `allocated`
  int64_t cuda_mallocs = 0;   // calls to cudaMalloc so far
};

class CachingAllocator {
 public:
  CachingAllocator() = default;
  ~CachingAllocator();  // returns every cached block; blocks still allocated are leaked
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // *ptr = a block of at least `bytes` (256-byte aligned; nullptr for 0 bytes). On
  // cudaErrorMemoryAllocation the cache is released and cudaMalloc tried once more; if that fails
  // too, kOutOfMemory names the request, this allocator's use and the device's free memory, and
  // nothing changes but the released cache.
  Status Allocate(size_t bytes, void** ptr);
  // Returns a block from Allocate to the cache. Null is ignored.
  Status Free(void* ptr);
  // Gives every cached (free) block back to the device.
  Status EmptyCache();
  AllocatorStats Stats() const;
  void ResetPeak();
  // While on, every block handed out is first filled with 0xFF bytes (NaN in fp32 and bf16) and
  // the device synchronised, so a kernel that reads memory no kernel wrote shows as NaN instead of
  // as stale values of an earlier use. For tests; off by default.
  void SetPoison(bool on);

  static size_t RoundSize(size_t bytes);

 private:
  Status ReleaseCachedLocked();
  Status OutOfMemory(size_t size) const;  // the kOutOfMemory status of a failed request

  mutable std::mutex mu_;
  std::multimap<size_t, void*> free_;           // rounded size -> cached block
  std::unordered_map<void*, size_t> in_use_;    // block -> rounded size
  AllocatorStats stats_;
  bool poison_ = false;
};

}  // namespace spindle::kernels::cuda
