// Lightning on CUDA: the chunk sweep of lightning_sweep.cu on Hopper's warpgroup MMA (wgmma), for
// Dh = 128. Same recurrence, same roles of X, Y, Z and the same per-chunk info; per chunk of 64
// tokens (see lightning_sweep.cu for the instances):
//
//   out = diag(rowW) X S + (Mask o X Y^T) Z        S = f S + (colW o Y)^T Z
//
// Why: every warp of the mma.sync sweep re-reads its operand fragments through ldmatrix (~570 KB
// per chunk and block, bench/cuda/NOTES.md round 4) and waits on them (round 7); wgmma reads each
// 64 x N operand tile once per warpgroup straight from shared memory, and takes the masked scores
// from registers. Measured it is slower than the mma.sync sweep (round 6: main sweep 306-311
// against 289 us, state pass 134 against 101 us at T = 32K, H = 16; the mma.sync kernels have
// since gone to 205 and 90 us, rounds 7 and 8): it issues about as many instructions per chunk as
// the mma.sync sweep (tile loads, the bf16 state copy, masks, the scaling of Y^T) and its warps
// wait in lockstep at one block per SM. (Round 8's transposed state, which drops the bf16 state
// copy, fits wgmma too: S^T by rows is the register A operand of O^T = S^T X^T.) So it runs only
// when LightningConfig::sweep_kernel asks for it; it is kept, tested against the CPU on every pass,
// as the base for the Lightning speed target's next step (TMA loads and warp specialisation).
//
// Layout: two warpgroups (256 threads, one block per SM). Each chunk tile [64 tokens, 128] sits in
// shared memory as 8 x 8 "core matrices" (8 rows x 16 bytes, 128 contiguous bytes): element
// (r, c) at byte (r / 8) * 2048 + (c / 8) * 128 + (r % 8) * 16 + (c % 8) * 2. Read with K = c it
// is wgmma's K-major layout (leading offset 128, stride offset 2048); read with K = r it is the
// MN-major layout (leading 2048, stride 128). The bf16 state S [i, j] uses the same layout.
// Both warpgroups compute the chunk's scores P = X Y^T (64 x 64); warpgroup w owns output columns
// [64 w, 64 w + 64) and state rows [64 w, 64 w + 64) (64 fp32 registers a thread). Per chunk:
//   wgmma P = X Y^T and O = X S[:, cols] -> mask P, scale O's rows -> wgmma O += P Z[:, cols]
//   (P from registers) and S_rows = f S_rows + (colW o Y)[:, rows]^T Z (A from ldmatrix.trans,
//   scaled in registers) -> store O, write the bf16 state for the next chunk.
// X, Y and Z rotate through three buffers, the bf16 state through two: one block barrier per
// chunk, 210 KB of shared memory (one block per SM; the state-only pass, 98 KB and 128 registers,
// runs two).
#include "kernels/cuda/lightning_common.cuh"

namespace spindle::kernels::cuda::internal::lightning {
namespace {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SPINDLE_WGMMA_DEVICE 1
#endif

constexpr int kDh = 128;
constexpr int kTileBytes = kChunk * kDh * 2;  // 16 KB
constexpr int kStateBytes = kDh * kDh * 2;    // 32 KB

// Chunk tiles in flight: the sweep is a serial chain per block at one block per SM, so the next
// chunks' tiles must be requested well ahead of their use (DRAM latency is about one chunk's work).
template <bool kStateOnly>
struct WgLayout {
  static constexpr int kStages = 3;
  // Byte offsets: X, Y, Z (kStages buffers each; no X in the state-only pass), the bf16 state
  // (two; none in the state-only pass), info (two), decay table.
  static constexpr int kX = 0;
  static constexpr int kY = kX + (kStateOnly ? 0 : kStages * kTileBytes);
  static constexpr int kZ = kY + kStages * kTileBytes;
  static constexpr int kS = kZ + kStages * kTileBytes;
  static constexpr int kInfo = kS + (kStateOnly ? 0 : 2 * kStateBytes);
  static constexpr int kDec = kInfo + 2 * static_cast<int>(sizeof(SweepInfo));
  static constexpr int kBytes = kDec + 65 * 4;
};

// Byte offset of element (r, c) in a core-matrix tile.
__device__ __forceinline__ int CoreOffset(int r, int c) {
  return (r >> 3) * 2048 + (c >> 3) * 128 + (r & 7) * 16 + (c & 7) * 2;
}

// Shared-memory matrix descriptors of the core-matrix layout (no swizzle).
__device__ __forceinline__ uint64_t Desc(uint32_t addr, uint32_t lead, uint32_t stride) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFF) |
         (static_cast<uint64_t>((lead >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((stride >> 4) & 0x3FFF) << 32);
}
__device__ __forceinline__ uint64_t DescK(uint32_t addr) { return Desc(addr, 128, 2048); }
__device__ __forceinline__ uint64_t DescMN(uint32_t addr) { return Desc(addr, 2048, 128); }

#ifdef SPINDLE_WGMMA_DEVICE
__device__ __forceinline__ void WgFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgWait() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
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

// D (64 x 64, fp32) = A B (+ D when accumulate), A from shared memory (K-major), B from shared
// memory, K-major (kTransB 0) or MN-major (1).
template <int kTransB>
__device__ __forceinline__ void WgmmaSS64(float (&d)[32], uint64_t da, uint64_t db,
                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, %35;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(accumulate), "n"(kTransB));
}
// D (64 x 64, fp32) = A B (+ D when accumulate), A from registers (the mma.sync A fragment of each
// warp's 16 rows), B from shared memory (MN-major).
__device__ __forceinline__ void WgmmaRS64(float (&d)[32], const uint32_t (&a)[4], uint64_t db,
                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
// D (64 x 128, fp32) = A B (+ D when accumulate), A from registers (the mma.sync A fragment of each
// warp's 16 rows), B from shared memory (MN-major).
__device__ __forceinline__ void WgmmaRS128(float (&d)[64], const uint32_t (&a)[4], uint64_t db,
                                           int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, "
      "%63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
#endif  // SPINDLE_WGMMA_DEVICE

// Rows [0, len) of a [64, 128] chunk (row stride `stride`) into the core-matrix layout by
// cp.async; rows >= len become zeros. Thread t copies core column (t / 8) % 16 of rows
// (t / 128) * 8 + t % 8 + 16 i: a warp writes 512 contiguous bytes (8 rows of 4 core columns)
// and reads 64 contiguous bytes of each of 8 rows; offsets and trip count are compile-time.
__device__ __forceinline__ void LoadCoreTile(unsigned char* dst, const bf16* src, int64_t stride,
                                             int len) {
  const int t = threadIdx.x, r8 = t & 7, cg = (t >> 3) & 15, row = (t >> 7) * 8 + r8;
  unsigned char* d = dst + (t >> 7) * 2048 + cg * 128 + r8 * 16;
  const bf16* s = src + row * stride + cg * 8;
#pragma unroll
  for (int i = 0; i < kChunk / 16; ++i) {
    const bool in = row + 16 * i < len;
    CpAsync16(reinterpret_cast<bf16*>(d + i * 4096), in ? s + 16 * i * stride : src, in ? 16 : 0);
  }
}

// Thread placement: warp wi (0..3) of warpgroup wg holds accumulator rows wi * 16 + g8 + {0, 8}
// and columns 8 j + q2 + {0, 1} of each 8-column tile j (wgmma's fp32 accumulator layout).
struct WgPlace {
  int wg, wi, lane, g8, q2, row, col0;
  __device__ WgPlace() {
    const int tid = threadIdx.x;
    wg = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
    g8 = lane >> 2, q2 = (lane & 3) * 2;
    row = wi * 16 + g8;  // P and O rows row, row + 8; state rows col0 + row, col0 + row + 8
    col0 = wg * 64;      // O columns and state rows of this warpgroup
  }
};

// The warpgroup's fp32 state rows as bf16 into the core-matrix state tile at dst.
__device__ __forceinline__ void StateToCore(const WgPlace& w, const float (&S)[64],
                                            unsigned char* dst) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = w.col0 + w.row + 8 * hh, c = 8 * j + w.q2;
      *reinterpret_cast<uint32_t*>(dst + CoreOffset(i, c)) =
          PackBf16(S[j * 4 + hh * 2], S[j * 4 + hh * 2 + 1]);
    }
  }
}

template <bool kReverse, bool kStateOnly>
__global__ void __launch_bounds__(kThreads, kStateOnly ? 2 : 1) WgmmaSweepKernel(SweepArgs a) {
#ifdef SPINDLE_WGMMA_DEVICE
  using L = WgLayout<kStateOnly>;
  constexpr int kStages = L::kStages;
  extern __shared__ __align__(128) unsigned char smem[];
  SweepInfo* infos = reinterpret_cast<SweepInfo*>(smem + L::kInfo);
  float* dec = reinterpret_cast<float*>(smem + L::kDec);
  const uint32_t sbase = SmemAddr(smem);
  const WgPlace w;
  const int g = blockIdx.x, h = blockIdx.y;
  const int first = g * a.chunks_per_block;
  const int count = min(a.chunks_per_block, a.n_chunks - first);
  auto chunk_of = [&](int n) { return kReverse ? first + count - 1 - n : first + n; };
  const int64_t hoff = static_cast<int64_t>(h) * kDh;
  // Chunk n's tiles into buffer n % kStages as one cp.async group (an empty group past the end,
  // so that every chunk has kStages - 2 groups after its own).
  auto load = [&](int n) {
    if (n < count) {
      const int c0 = chunk_of(n) * kChunk, len = min(kChunk, a.T - c0);
      const int buf = (n % kStages) * kTileBytes;
      if constexpr (!kStateOnly)
        LoadCoreTile(smem + L::kX + buf, a.x + c0 * a.x_stride + hoff, a.x_stride, len);
      LoadCoreTile(smem + L::kY + buf, a.y + c0 * a.y_stride + hoff, a.y_stride, len);
      LoadCoreTile(smem + L::kZ + buf, a.z + c0 * a.z_stride + hoff, a.z_stride, len);
    }
    CpAsyncCommit();
  };

#pragma unroll
  for (int n = 0; n < kStages - 1; ++n) load(n);
  float S[64];
  const int64_t state_off = (static_cast<int64_t>(h) * a.G + g) * kDh * kDh;
  if constexpr (kStateOnly) {
#pragma unroll
    for (int i = 0; i < 64; ++i) S[i] = 0.0f;
  } else {
    const float* p0 = a.start + state_off;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = w.col0 + w.row + (e >> 1) * 8, c = 8 * j + w.q2 + (e & 1);
        S[j * 4 + e] = a.transpose_start ? p0[c * kDh + i] : p0[i * kDh + c];
      }
    }
    StateToCore(w, S, smem + L::kS);
  }
  FillDecay(a.log_decay[h], dec);
  __syncthreads();  // dec
  ComputeInfo(infos[0], dec, a.cu, a.n_seg, chunk_of(0) * kChunk, a.T, a.scale);
  float f_prod = 1.0f;
  // The score weights of this thread's 32 elements when no document starts inside the chunk:
  // the causal (or transposed) mask, the decay and the scale, the same for every such chunk.
  float wt[32];
  if constexpr (!kStateOnly) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = w.row + (e >> 1) * 8, c = 8 * j + w.q2 + (e & 1);
        wt[j * 4 + e] =
            (kReverse ? c >= r : c <= r) ? a.scale * dec[kReverse ? c - r : r - c] : 0.0f;
      }
    }
  }

  for (int n = 0; n < count; ++n) {
    const int c0 = chunk_of(n) * kChunk;
    const bool more = n + 1 < count;
    const bool update = kStateOnly || more;  // the main passes skip the last chunk's update
    CpAsyncWait<kStages - 2>();
    FenceProxyAsync();
    // This chunk's tiles, info and bf16 state are in place; every read of chunk n - 1 is done
    // (each warpgroup waited for its wgmma), so its buffers may be refilled.
    __syncthreads();
    const SweepInfo& ci = infos[n & 1];
    if (more)
      ComputeInfo(infos[(n + 1) & 1], dec, a.cu, a.n_seg, chunk_of(n + 1) * kChunk, a.T, a.scale);
    load(n + kStages - 1);
    const float* roww = kReverse ? ci.kw : ci.qw;
    const float* colw = kReverse ? ci.qw : ci.kw;
    const uint32_t buf = (n % kStages) * kTileBytes;
    const uint32_t xs = sbase + L::kX + buf, ys = sbase + L::kY + buf, zs = sbase + L::kZ + buf;
    const uint32_t sb = sbase + L::kS + (n & 1) * kStateBytes;

    // A fragments of (colW o Y)^T for this warp's 16 state rows, 4 steps of 16 tokens.
    uint32_t ya[4][4];
    if (update) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const int t = ks * 16 + (w.lane & 7) + ((w.lane >> 4) & 1) * 8;
        const int i = w.col0 + w.wi * 16 + ((w.lane >> 3) & 1) * 8;
        Ldm4T(ya[ks], ys + CoreOffset(t, i));
        const int t0 = ks * 16 + w.q2;
        const float u0 = colw[t0], u1 = colw[t0 + 1], u2 = colw[t0 + 8], u3 = colw[t0 + 9];
        ya[ks][0] = ScaleBf16x2(ya[ks][0], u0, u1), ya[ks][1] = ScaleBf16x2(ya[ks][1], u0, u1);
        ya[ks][2] = ScaleBf16x2(ya[ks][2], u2, u3), ya[ks][3] = ScaleBf16x2(ya[ks][3], u2, u3);
      }
    }

    float O[32];
    uint32_t pa[4][4];
    if constexpr (!kStateOnly) {
      // The first k step overwrites the accumulators (nothing else may define them between
      // wgmma's fence and its wait, or ptxas serialises the wgmmas).
      float P[32];
      WgFence();
#pragma unroll
      for (int s = 0; s < 8; ++s) WgmmaSS64<0>(P, DescK(xs + s * 256), DescK(ys + s * 256), s > 0);
#pragma unroll
      for (int s = 0; s < 8; ++s)
        WgmmaSS64<1>(O, DescK(xs + s * 256), DescMN(sb + w.wg * 1024 + s * 4096), s > 0);
      WgCommit();
      WgWait();
      FenceRegs(P);
      FenceRegs(O);
      // Mask, decay and scale the scores; pack them as the A fragments of 4 token steps.
      if (ci.one_segment) {
#pragma unroll
        for (int i = 0; i < 32; ++i) P[i] *= wt[i];
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = w.row + (e >> 1) * 8, c = 8 * j + w.q2 + (e & 1);
            const bool keep = kReverse ? ci.seg[c] <= c0 + r : ci.seg[r] <= c0 + c;
            P[j * 4 + e] = keep ? P[j * 4 + e] * wt[j * 4 + e] : 0.0f;
          }
        }
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        pa[s][0] = PackBf16(P[8 * s + 0], P[8 * s + 1]);
        pa[s][1] = PackBf16(P[8 * s + 2], P[8 * s + 3]);
        pa[s][2] = PackBf16(P[8 * s + 4], P[8 * s + 5]);
        pa[s][3] = PackBf16(P[8 * s + 6], P[8 * s + 7]);
      }
      const float w0 = roww[w.row], w1 = roww[w.row + 8];
#pragma unroll
      for (int j = 0; j < 8; ++j)
        O[j * 4] *= w0, O[j * 4 + 1] *= w0, O[j * 4 + 2] *= w1, O[j * 4 + 3] *= w1;
      FenceRegs(O);
    }
    if (update) {
      f_prod *= ci.f;
#pragma unroll
      for (int i = 0; i < 64; ++i) S[i] *= ci.f;
      FenceRegs(S);
    }
    WgFence();
    if constexpr (!kStateOnly) {
#pragma unroll
      for (int s = 0; s < 4; ++s) WgmmaRS64(O, pa[s], DescMN(zs + w.wg * 1024 + s * 4096), 1);
    }
    if (update) {
#pragma unroll
      for (int s = 0; s < 4; ++s) WgmmaRS128(S, ya[s], DescMN(zs + s * 4096), 1);
    }
    WgCommit();
    WgWait();
    FenceRegs(S);
    if constexpr (!kStateOnly) {
      FenceRegs(O);
      bf16* out = a.out + static_cast<int64_t>(c0) * a.out_stride + hoff;
      const int r0 = w.row, r1 = w.row + 8;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int c = w.col0 + 8 * j + w.q2;
        if (r0 < ci.len)
          *reinterpret_cast<uint32_t*>(out + r0 * a.out_stride + c) =
              PackBf16(O[j * 4], O[j * 4 + 1]);
        if (r1 < ci.len)
          *reinterpret_cast<uint32_t*>(out + r1 * a.out_stride + c) =
              PackBf16(O[j * 4 + 2], O[j * 4 + 3]);
      }
      if (more) StateToCore(w, S, smem + L::kS + ((n + 1) & 1) * kStateBytes);
    }
  }

  if constexpr (kStateOnly) {
    float* out = a.U + state_off;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = w.col0 + w.row + 8 * hh, c = 8 * j + w.q2;
        *reinterpret_cast<float2*>(out + i * kDh + c) =
            make_float2(S[j * 4 + hh * 2], S[j * 4 + hh * 2 + 1]);
      }
    }
    if (threadIdx.x == 0 && a.F != nullptr) a.F[h * a.G + g] = f_prod;
  }
#endif  // SPINDLE_WGMMA_DEVICE
}

template <bool kReverse, bool kStateOnly>
Status LaunchWgmmaT(const SweepArgs& a, cudaStream_t stream) {
  auto* kernel = WgmmaSweepKernel<kReverse, kStateOnly>;
  constexpr int kSmem = WgLayout<kStateOnly>::kBytes;
  SPINDLE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  kernel<<<dim3(a.G, a.H), kThreads, kSmem, stream>>>(a);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace

bool WgmmaSweepAvailable() {
#ifdef SPINDLE_WGMMA
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

// Measured slower than the mma.sync sweep so far (bench/cuda/NOTES.md, round 6): runs only when
// a config asks for it.
bool UseWgmmaSweep(int64_t Dh, const LightningConfig& config) {
  return Dh == kDh && config.sweep_kernel == 2 && config.stages != 2 && WgmmaSweepAvailable();
}

Status LaunchWgmmaSweep(bool reverse, bool state_only, const SweepArgs& a, cudaStream_t stream) {
  if (state_only)
    return reverse ? LaunchWgmmaT<true, true>(a, stream) : LaunchWgmmaT<false, true>(a, stream);
  return reverse ? LaunchWgmmaT<true, false>(a, stream) : LaunchWgmmaT<false, false>(a, stream);
}

}  // namespace spindle::kernels::cuda::internal::lightning

namespace spindle::kernels::cuda {
bool LightningWgmmaAvailable() { return internal::lightning::WgmmaSweepAvailable(); }
}  // namespace spindle::kernels::cuda
