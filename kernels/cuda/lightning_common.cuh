// Private building blocks of the CUDA Lightning kernels: the 64-token chunk grid and its masks,
// the WMMA tile helpers of the CP carry kernels, the pieces the chunk sweeps share (operand
// fetches, tile loads, a block's chunks, per-chunk info, masked scores, the transposed sweeps'
// output staging; lightning_sweep.cu, lightning_wgmma.cu), and the launchers each .cu file
// exports to the others (lightning_sweep.cu, lightning_state.cu, lightning_fwd.cu,
// lightning_bwd.cu).
//
// Chunk c covers tokens [64c, min(64c + 64, T)). Inside a chunk, token i belongs to the segment
// starting at seg[i] (absolute index). With c0 = 64c:
//   cond(i) = seg[i] < c0 || seg[i] == 0   the state entering the chunk reaches token i
//   qw[i]   = cond(i) ? scale * a^(i+1) : 0 weight of q_i S_in in o_i (and of q_i^T do_i in dS_in)
//   kw[j]   = seg[j] == seg[last] ? a^(last-j) : 0   weight of k_j^T v_j in the chunk's end state
//   f       = cond(last) ? a^len : 0       S_out = f S_in + sum_j kw[j] k_j^T v_j
//   M[i,j]  = j <= i && seg[i] <= c0 + j   intra-chunk mask, score weight scale * a^(i-j)
// (segment 0 counts as continuing from the carry-in, hence seg[i] == 0 in cond). The sweeps'
// SweepInfo keeps seg relative to c0 (see there).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/lightning.h"

namespace spindle::kernels::cuda::internal::lightning {

namespace wmma = nvcuda::wmma;

constexpr int kChunk = 64;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Shared-memory pitches (elements) of the WMMA carry kernels. Padding keeps 16-row tile starts
// 32-byte aligned.
template <int DH>
struct Pitch {
  static constexpr int kRow = DH + 8;  // bf16 [64, DH] and [DH, DH] buffers
  static constexpr int kRowsBytes = kChunk * kRow * 2;
  static constexpr int kStateBytes = DH * kRow * 2;
  static constexpr int kScratchBytes = kWarps * 256 * 4;
  static constexpr int kOutTiles = DH / 32;  // 16 x 16 output tiles per warp of a [64, DH] output
};

// Start of the segment holding token t: the largest cu[s] <= t (0 when cu is null).
__device__ __forceinline__ int SegmentStart(const int32_t* cu, int n_seg, int t) {
  if (cu == nullptr) return 0;
  int lo = 0, hi = n_seg - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return cu[lo];
}

// The decay table, kDecayTable floats with `dec` at its middle: dec[n] = a^n for 0 <= n <= 64
// and dec[n] = 0 for -64 <= n < 0, so that dec[r - c] is a score's decay and causal mask at once.
// Call once per block (then sync); needs at least kDecayTable threads.
constexpr int kDecayTable = 2 * kChunk + 1;
__device__ __forceinline__ float* DecayTable(unsigned char* at) {
  return reinterpret_cast<float*>(at) + kChunk;
}
__device__ __forceinline__ void FillDecay(float log_a, float* dec) {
  const int n = static_cast<int>(threadIdx.x) - kChunk;
  if (n <= kChunk) dec[n] = n >= 0 ? expf(static_cast<float>(n) * log_a) : 0.0f;
}

// Copies `len` rows of DH bf16 from global (row stride `stride`) into smem rows of pitch kRow;
// rows >= len are zeroed. 16-byte vectors.
template <int DH>
__device__ __forceinline__ void LoadRows(bf16* dst, const bf16* src, int64_t stride, int len) {
  constexpr int kVec = DH / 8;
  for (int idx = threadIdx.x; idx < kChunk * kVec; idx += kThreads) {
    const int r = idx / kVec, c = (idx % kVec) * 8;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < len) val = *reinterpret_cast<const uint4*>(src + r * stride + c);
    *reinterpret_cast<uint4*>(dst + r * Pitch<DH>::kRow + c) = val;
  }
}

// acc row r (of the 16-row tile starting at chunk row row0) *= w[row0 + r], via a per-warp
// 16x16 fp32 scratch.
__device__ __forceinline__ void ScaleAccRows(Acc& acc, float* scratch, const float* w, int row0) {
  wmma::store_matrix_sync(scratch, acc, 16, wmma::mem_row_major);
  __syncwarp();
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < 256; e += 32) scratch[e] *= w[row0 + e / 16];
  __syncwarp();
  wmma::load_matrix_sync(acc, scratch, 16, wmma::mem_row_major);
  __syncwarp();
}

// Writes a 16x16 fp32 tile as bf16 to dst (row pitch ld), rows r with row0 + r < len only;
// adds the existing values first when `accumulate`.
__device__ __forceinline__ void StoreAccBf16(const Acc& acc, float* scratch, bf16* dst, int64_t ld,
                                             int row0, int len, bool accumulate) {
  wmma::store_matrix_sync(scratch, acc, 16, wmma::mem_row_major);
  __syncwarp();
  const int lane = threadIdx.x & 31;
  const int r = lane >> 1, c = (lane & 1) * 8;
  if (row0 + r < len) {
    bf16* p = dst + r * ld + c;
    const float* s = scratch + r * 16 + c;
    alignas(16) bf16 vals[8];
    if (accumulate) {
      const uint4 old = *reinterpret_cast<const uint4*>(p);
      const bf16* o = reinterpret_cast<const bf16*>(&old);
#pragma unroll
      for (int e = 0; e < 8; ++e) vals[e] = __float2bfloat16(s[e] + __bfloat162float(o[e]));
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) vals[e] = __float2bfloat16(s[e]);
    }
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(vals);
  }
  __syncwarp();
}

// c += sum over k steps of A(k) B(k); a/b advance by a_step/b_step elements per 16-wide k step.
template <typename FA, typename FB>
__device__ __forceinline__ void Mma(Acc& c, const bf16* a, int lda, int a_step, const bf16* b,
                                    int ldb, int b_step, int k_steps) {
  FA fa;
  FB fb;
  for (int kk = 0; kk < k_steps; ++kk) {
    wmma::load_matrix_sync(fa, a + kk * a_step, lda);
    wmma::load_matrix_sync(fb, b + kk * b_step, ldb);
    wmma::mma_sync(c, fa, fb, c);
  }
}

// ---- Pieces of the chunk sweeps (lightning_sweep.cu, lightning_wgmma.cu) -----------------------

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void Ldm4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
// ldmatrix.x4.trans at a shared-memory address (or a generic pointer into shared memory).
__device__ __forceinline__ void Ldm4T(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void Ldm4T(uint32_t (&r)[4], const bf16* p) { Ldm4T(r, SmemAddr(p)); }
// 16-byte async copy; src_bytes 0 writes zeros (rows past the sequence end).
__device__ __forceinline__ void CpAsync16(bf16* dst, const bf16* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(dst)), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncWaitAll() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}
// Closes the cp.async group of the copies issued since the last commit; CpAsyncWait<N> waits
// until at most the N most recent groups are still in flight.
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// Both bf16 halves of v times w (lo, hi), rounded once to bf16.
__device__ __forceinline__ uint32_t ScaleBf16x2(uint32_t v, float w_lo, float w_hi) {
  const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&v);
  const float2 f = __bfloat1622float2(b);
  return PackBf16(f.x * w_lo, f.y * w_hi);
}

// ---- The transposed sweeps' output staging (lightning_sweep.cu, lightning_wgmma.cu) ----------
// A warp's O^T (16 value rows from v0, 64 tokens; m16n8 accumulator tiles O[j] over tokens 8 j..)
// goes to a [64, DH] bf16 staging tile of pitch DH + 8 by stmatrix.trans, and the tile to global
// memory with 16-byte stores.
__device__ __forceinline__ void Stm4T(bf16* p, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(SmemAddr(p)),
      "r"(r0), "r"(r1), "r"(r2), "r"(r3)
      : "memory");
}

// The warp's O^T (value rows v0.., 64 tokens) as bf16 into the staging tile os[token][value]:
// each 8 x 8 accumulator block stored transposed by stmatrix.trans.
template <int DH>
__device__ __forceinline__ void StageOutT(const float (&O)[kChunk / 8][4], bf16* os, int v0,
                                          int lane) {
  const int m = lane >> 3, r = lane & 7;  // the matrix whose row `r` this lane addresses
#pragma unroll
  for (int jp = 0; jp < kChunk / 16; ++jp) {
    const int j = 2 * jp + (m >> 1), vb = m & 1;
    Stm4T(os + (8 * j + r) * (DH + 8) + v0 + 8 * vb, PackBf16(O[2 * jp][0], O[2 * jp][1]),
          PackBf16(O[2 * jp][2], O[2 * jp][3]), PackBf16(O[2 * jp + 1][0], O[2 * jp + 1][1]),
          PackBf16(O[2 * jp + 1][2], O[2 * jp + 1][3]));
  }
}

// The staging tile's rows below len to out (the chunk's first row of the head), 16-byte stores.
template <int DH>
__device__ __forceinline__ void CopyOutT(const bf16* os, bf16* out, int64_t stride, int len) {
  constexpr int kVec = DH / 8, kRowsPerPass = kThreads / kVec;
  const int r0 = threadIdx.x / kVec, c = (threadIdx.x % kVec) * 8;
#pragma unroll
  for (int i = 0; i < kChunk / kRowsPerPass; ++i) {
    const int r = r0 + i * kRowsPerPass;
    if (r < len) {
      *reinterpret_cast<uint4*>(out + r * stride + c) =
          *reinterpret_cast<const uint4*>(os + r * (DH + 8) + c);
    }
  }
}

// Per-chunk quantities, computed by threads 0..63 without a barrier (see the top of this file).
struct SweepInfo {
  // The start of token i's segment relative to the chunk, max(start - c0, -1) (127 past the
  // chunk's end): tokens r and c share a segment, c <= r, when seg[r] <= c.
  int8_t seg[kChunk];
  float qw[kChunk];
  float kw[kChunk];
  float f;
  int len;
};

__device__ __forceinline__ void ComputeInfo(SweepInfo& ci, const float* dec, const int32_t* cu,
                                            int n_seg, int c0, int T, float scale) {
  const int i = threadIdx.x;
  if (i >= kChunk) return;
  const int len = min(kChunk, T - c0);
  const int last = len - 1;
  const bool in = i < len;
  const int s = in ? SegmentStart(cu, n_seg, c0 + i) : 0x7fffffff;
  const int sl = SegmentStart(cu, n_seg, c0 + last);
  ci.seg[i] = in ? static_cast<int8_t>(max(s - c0, -1)) : int8_t{127};
  ci.qw[i] = in && (s < c0 || s == 0) ? scale * dec[i + 1] : 0.0f;
  ci.kw[i] = in && s == sl ? dec[last - i] : 0.0f;
  if (i == 0) {
    ci.f = (sl < c0 || sl == 0) ? dec[len] : 0.0f;
    ci.len = len;
  }
}

// The state-only passes' token weights (into kw, or qw when kReverse). A block's end state is
// sum_t w_t y_t^T z_t over its tokens, each token's decay to the block's end taken at once, so the
// sweep needs no f S per chunk. Forward, the end is the block's last token L: w_t = a^(L - t) for
// t in L's segment (start s_last), else 0. Reverse, the end is the token before the block's first,
// F - 1: w_t = scale a^(t - F + 1) for t in F - 1's segment (a start before F, or 0), else 0. The
// same tokens and weights as the products of the chunks' kw (qw) and f. Threads 0..63.
template <bool kReverse>
__device__ __forceinline__ void ComputeStateWeights(SweepInfo& ci, float log_a, const int32_t* cu,
                                                    int n_seg, int c0, int T, float scale,
                                                    int first, int last, int s_last) {
  const int i = threadIdx.x, t = c0 + i;
  if (i >= kChunk) return;
  float w = 0.0f;
  if (t < T) {
    const int s = SegmentStart(cu, n_seg, t);
    if (kReverse && (s < first || s == 0))
      w = scale * expf(static_cast<float>(t - first + 1) * log_a);
    if (!kReverse && s == s_last) w = expf(static_cast<float>(last - t) * log_a);
  }
  (kReverse ? ci.qw : ci.kw)[i] = w;
}

// [64, DH] rows of src (row stride `stride`) into a padded tile; rows >= len become zeros. Thread
// t copies the 16-byte vector t % (DH / 8) of rows t / (DH / 8) + i * rows-per-pass: the trip
// count and the per-thread offsets are compile-time, so a vector costs a few instructions (a
// strided loop cost ~25-28: ptxas keeps its index arithmetic and remainder branches; main sweep
// 298 -> 289 us, state pass 111 -> 101 at T = 32K). kOpaqueStride: the stride is opaque to the
// compiler at each call, so the rows' offsets are recomputed per call instead of kept in
// registers across the sweep's loop; the fused dk / dv sweep, at its 128-register limit, needs
// that (436 us with the strided loop, 451 with the offsets kept, 411 with them recomputed), while
// the main sweep is faster keeping them (190 against 196 us).
template <int DH, bool kOpaqueStride = false>
__device__ __forceinline__ void LoadTileAsync(bf16* dst, const bf16* src, int64_t stride, int len) {
  constexpr int kVec = DH / 8, kRowsPerPass = kThreads / kVec, kPasses = kChunk / kRowsPerPass;
  static_assert(kThreads % kVec == 0 && kChunk % kRowsPerPass == 0, "tile split");
  if constexpr (kOpaqueStride) asm volatile("" : "+l"(stride));
  const int r0 = threadIdx.x / kVec, c = (threadIdx.x % kVec) * 8;
  bf16* d = dst + r0 * (DH + 8) + c;
  const bf16* s = src + r0 * stride + c;
  if (len == kChunk) {  // every chunk but a sequence's last: no row test
    const int64_t step = kRowsPerPass * stride;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) CpAsync16(d + i * kRowsPerPass * (DH + 8), s + i * step, 16);
    return;
  }
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const bool in = r0 + i * kRowsPerPass < len;
    CpAsync16(d + i * kRowsPerPass * (DH + 8), in ? s + i * kRowsPerPass * stride : src,
              in ? 16 : 0);
  }
}

// The chunks a block sweeps: head blockIdx.y, the chunks_per_block chunks of block blockIdx.x
// (fewer at the end), walked in order or reversed; the n-th walked chunk's first token, length and
// tile loads (kOpaqueStride: see LoadTileAsync).
template <int DH, bool kReverse, bool kOpaqueStride = false>
struct BlockChunks {
  int g, h, first, count, T;
  int64_t hoff;  // the head's first column
  __device__ BlockChunks(int chunks_per_block, int n_chunks, int T_)
      : g(blockIdx.x),
        h(blockIdx.y),
        first(g * chunks_per_block),
        count(min(chunks_per_block, n_chunks - first)),
        T(T_),
        hoff(static_cast<int64_t>(h) * DH) {}
  __device__ int Token0(int n) const {
    return (kReverse ? first + count - 1 - n : first + n) * kChunk;
  }
  __device__ int Len(int n) const { return min(kChunk, T - Token0(n)); }
  // The n-th chunk's [64, DH] tile of src (row stride `stride`, this head's columns) into dst.
  __device__ void Load(bf16* dst, const bf16* src, int64_t stride, int n) const {
    LoadTileAsync<DH, kOpaqueStride>(dst, src + Token0(n) * stride + hoff, stride, Len(n));
  }
};

// A 16-token step's A fragment (its columns are tokens t0 + {0, 1} in registers 0, 1 and
// t0 + {8, 9} in 2, 3, t0 = 16 step + (lane & 3) * 2) times the per-token weights w, rounded once.
__device__ __forceinline__ void ScaleTokens(uint32_t (&fa)[4], const float* w, int t0) {
  const float u0 = w[t0], u1 = w[t0 + 1], u2 = w[t0 + 8], u3 = w[t0 + 9];
  fa[0] = ScaleBf16x2(fa[0], u0, u1), fa[1] = ScaleBf16x2(fa[1], u0, u1);
  fa[2] = ScaleBf16x2(fa[2], u2, u3), fa[3] = ScaleBf16x2(fa[3], u2, u3);
}

// The score x of row token r and column token c of a chunk under the causal mask (transposed when
// kReverse) and the documents, decayed and scaled; 0 where masked. `seg` is seg[r] (seg[c] when
// kReverse); the causal mask is the decay table's zeros, so there is no branch.
template <bool kReverse>
__device__ __forceinline__ float MaskedScore(float x, int seg, const float* dec, int r, int c,
                                             float scale) {
  const float m = dec[kReverse ? c - r : r - c];
  return seg <= (kReverse ? r : c) ? x * scale * m : 0.0f;
}

// ---- Launchers shared between the .cu files ---------------------------------------------------------

// The chunk sweep (lightning_sweep.cu): per (head, block of chunks), in chunk order or reversed,
//   out = diag(rowW) X S + (Mask o X Y^T) Z,   S = f S + (colW o Y)^T Z
// with rowW, colW = qw, kw (forward) or kw, qw (reverse, transposed mask). Main passes start from
// start[h, g] (transposed when transpose_start) and write out; the state-only pass starts from
// zero and writes the block's end state to U [H, G, Dh, Dh] and the product of f to F [H, G]
// (nullable). X and out are unused by the state-only pass.
struct SweepArgs {
  const bf16 *x, *y, *z;
  int64_t x_stride, y_stride, z_stride;
  bf16* out;
  int64_t out_stride;
  const float* start;
  bool transpose_start;
  float* U;
  float* F;
  const float* log_decay;
  const int32_t* cu;
  int n_seg, T, H;
  float scale;
  int chunks_per_block, n_chunks, G;
  int stages;  // main passes: 1 = one buffer per tile; otherwise Y double-buffered
  bool wgmma;  // run the wgmma sweep (lightning_wgmma.cu; Dh = 128 on sm_90a)
  bool wgmma_ws;          // main passes: the warp-specialised wgmma sweep (lightning_wgmma.cu)
  bool transposed_state;  // main passes at Dh = 128: the sweep holding the state transposed
};
Status LaunchSweep(int dh, bool reverse, bool state_only, const SweepArgs& a,
                   cudaStream_t stream);
// Whether a config's main passes take the sweep holding the state transposed where it runs
// (Dh = 128): when asked for, and by default (sweep_kernel and stages both 0).
inline bool UseTransposedSweep(const LightningConfig& config) {
  return config.sweep_kernel == 3 || (config.sweep_kernel == 0 && config.stages == 0);
}
// The wgmma sweep (lightning_wgmma.cu): whether this build and device run it, whether a call
// with this head size and config should, and its launcher (same arguments as LaunchSweep's).
bool WgmmaSweepAvailable();
bool UseWgmmaSweep(int64_t Dh, const LightningConfig& config);
Status LaunchWgmmaSweep(bool reverse, bool state_only, const SweepArgs& a, cudaStream_t stream);
// The warp-specialised wgmma main passes (sweep_kernel 4; lightning_wgmma.cu).
bool UseWgmmaWsSweep(int64_t Dh, const LightningConfig& config);
Status LaunchWgmmaWs(bool reverse, const SweepArgs& a, cudaStream_t stream);

// The fused dk / dv reverse sweep (lightning_sweep.cu): per (head, block of chunks), from the
// block's state gradient dS [H, G, Dh, Dh] (as the dv sweep carries it), writes dk and dv.
struct DkDvArgs {
  const bf16 *q, *k, *v, *dout;
  int64_t qkv_stride, dout_stride;  // dk, dv have q's stride
  bf16 *dk, *dv;
  const float* dS;
  const float* log_decay;
  const int32_t* cu;
  int n_seg, T, H;
  float scale;
  int chunks_per_block, n_chunks, G;
  bool transposed_dk;  // Dh = 128: dk from the registers' dS (DkDvKernel's kTransposedDk)
};
Status LaunchDkDv(int dh, const DkDvArgs& a, cudaStream_t stream);

// Launches a sweep-shaped kernel: one block per (block of chunks g < a.G, head h < a.H), `smem`
// bytes of dynamic shared memory.
template <typename Args>
Status LaunchOverBlocks(void (*kernel)(Args), const Args& a, int threads, int smem,
                        cudaStream_t stream) {
  SPINDLE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<dim3(a.G, a.H), threads, smem, stream>>>(a);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

// Scan over blocks g of X (element (g, h, e) at g * stride_g + h * stride_h + e, e < E):
// forward: out_g = carry; carry = in_g + f_g carry (carry starts at init or 0);
// reverse: the same from g = G-1 down. The final carry goes to final_out (nullable; += when
// accumulate_final). f_g = F[h * G + g] when F is set, else doc_start[g] ? 0 : a_h^length[g].
struct ScanArgs {
  const float* in;
  float* out;
  int64_t stride_g, stride_h;
  int G, H;
  int64_t E;
  const float* F;
  const int32_t* doc_start;
  const int32_t* length;
  const float* log_decay;
  const float* init;
  float* final_out;
  bool accumulate_final, reverse;
};
Status LaunchScan(const ScanArgs& a, cudaStream_t stream);

// Blocks of chunks and the workspace carve-up shared by forward and backward.
struct Plan {
  int n_chunks, chunks_per_block, G;
  size_t state_bytes;  // one [H, G, Dh, Dh] fp32 buffer, 256-byte aligned
  size_t f_bytes;      // [H, G] fp32, aligned
};
Plan MakePlan(int64_t T, int64_t H, int64_t Dh, const LightningConfig& config);
// An attribute of the current device, or `fallback` when there is no usable device (e.g. a size
// query on a machine without one; MakePlan then plans for 132 SMs).
int CurrentDeviceAttribute(cudaDeviceAttr attr, int fallback);
// What every pass of one call shares: the sweep's sizes, decays, documents, the plan's blocks and
// the config's kernel choice (each pass then sets its tiles, states and output), and the scan's
// strides over the plan's [H, G, Dh, Dh] block states with block decays F.
SweepArgs BaseSweepArgs(const Plan& plan, const LightningDims& dims, const LightningConfig& config,
                        const float* log_decay, const int32_t* cu_seqlens, int64_t n_segments,
                        float scale);
ScanArgs BaseScanArgs(const Plan& plan, const LightningDims& dims, const float* F);
// What a call with no tokens does with a state: dst = src, or zeros when src is null; nothing
// when dst is null ([H, Dh, Dh] fp32).
Status PassStateThrough(float* dst, const float* src, int64_t H, int64_t Dh, cudaStream_t stream);

// Small heads (Dh <= 32, even): the token-by-token path of lightning_small.cu.
bool IsSmallHead(int64_t Dh);
Status SmallLightning(const void* q, const void* k, const void* v, const float* log_decay,
                      const int32_t* cu_seqlens, int64_t n_segments, const float* carry_in,
                      float scale, const LightningDims& dims, const void* dout,
                      const float* d_end_state, void* out, float* end_state, void* dq, void* dk,
                      void* dv, float* d_carry_in, bool backward, cudaStream_t stream);
// Its carry correction and that correction's backward (see lightning.h).
Status SmallCarryCorrection(const void* q, const float* log_decay, const float* P, float scale,
                            const LightningDims& dims, int64_t n_tokens, void* out,
                            cudaStream_t stream);
Status SmallCarryCorrectionBackward(const void* q, const float* log_decay, const float* P,
                                    float scale, const LightningDims& dims, int64_t n_tokens,
                                    const void* dout, void* dq, float* dP, cudaStream_t stream);
Status CheckCommon(const void* q, const void* k, const void* v, const LightningDims& d,
                   DType dtype, const char* op);

}  // namespace spindle::kernels::cuda::internal::lightning
