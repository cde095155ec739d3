// Inline PTX of Hopper's asynchronous units shared by the sm_90a kernels (lightning_wgmma.cu,
// moe_gemm_sm90.cu): the warpgroup MMA's fence / commit / wait, the async-proxy fence, shared
// memory mbarriers (init, arrive, arrive with an expected transaction count, parity wait) and
// the tensor memory accelerator's tiled loads (cp.async.bulk.tensor, completing on an mbarrier).
// Every helper exists only where the compiler targets sm_90a (SPINDLE_WGMMA_DEVICE); the kernels
// that use them compile to empty bodies elsewhere and report themselves unavailable.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SPINDLE_WGMMA_DEVICE 1
#endif

namespace spindle::kernels::cuda::internal {

#ifdef SPINDLE_WGMMA_DEVICE
__device__ __forceinline__ void WgFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N of this warpgroup's committed wgmma groups are still pending.
template <int N>
__device__ __forceinline__ void WgWaitN() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void WgWait() { WgWaitN<0>(); }
// Generic-proxy writes to shared memory (cp.async, st.shared) made visible to wgmma's reads.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accumulator reads and writes across wgmma's issue and wait.
template <int N>
__device__ __forceinline__ void FenceRegs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// ---- mbarriers (shared-memory addresses)
__device__ __forceinline__ void MbarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes mbarrier.init visible to the other threads and to the async proxy (TMA's complete_tx).
__device__ __forceinline__ void FenceMbarInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives and raises the phase's expected transaction count by `bytes` (the producer's arrival
// before the TMA loads that complete them).
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Waits until the phase of parity `parity` has completed (a fresh barrier counts the phase before
// its first, parity 1, as completed).
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra.uni WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// MbarWait that gives up after ~2^34 clocks (about 10 s; a pipeline's waits take microseconds)
// with a trap, so a protocol fault ends the kernel with a launch error instead of hanging the
// stream.
__device__ __forceinline__ bool MbarTryWait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void MbarWaitBounded(uint32_t bar, uint32_t parity) {
  if (MbarTryWait(bar, parity)) return;
  const long long t0 = clock64();
  while (!MbarTryWait(bar, parity)) {
    if (clock64() - t0 > (1ll << 34)) __trap();
  }
}

// ---- TMA tiled loads: the box at coordinates (c0 innermost, c1, c2) of the tensor map at
// generic address `map` (a __grid_constant__ kernel parameter) into shared memory at `dst`,
// completing `box bytes` transactions on mbarrier `bar`. Out-of-bounds elements are zeros.
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const void* map, uint32_t bar, int c0,
                                          int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%3, %4}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void TmaLoad3d(uint32_t dst, const void* map, uint32_t bar, int c0,
                                          int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void TmaPrefetchMap(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
#endif  // SPINDLE_WGMMA_DEVICE

}  // namespace spindle::kernels::cuda::internal
