// Lightning on CUDA: the chunk sweep of lightning_sweep.cu on Hopper's warpgroup MMA (wgmma), for
// Dh = 128. Same recurrence, same roles of X, Y, Z and the same per-chunk info; per chunk of 64
// tokens (see lightning_sweep.cu for the instances):
//
//   out = diag(rowW) X S + (Mask o X Y^T) Z        S = f S + (colW o Y)^T Z
//
// Three kernels: the state-only pass (WgmmaStateKernel), the main passes with the state held
// transposed as lightning_sweep.cu's SweepTKernel holds it (WgmmaTKernel: S^T by rows is the
// register A operand of O^T = S^T X^T, so no bf16 copy of the state goes through shared memory),
// and the same main passes warp-specialised (WgmmaWsKernel: a producer warpgroup feeding two
// independent consumer warpgroups through mbarriers; sweep_kernel 4, one block per SM).
// Why wgmma: the mma.sync sweep re-reads its operand fragments through ldmatrix in every warp and
// issues ~1160 instructions per warp and chunk, 180 of them HMMA (bench/cuda/NOTES.md rounds 7
// and 8); wgmma reads each 64 x N operand tile once per warpgroup straight from shared memory and
// needs one instruction for eight mma.sync. Measured, it is still slower (T = 32K, H = 16): the
// main passes 240 us against SweepTKernel's 205 at two blocks per SM, where ptxas serialises the
// wgmmas for want of registers (R 64 + O^T 32 + operands within 128), and 295 us at one block per
// SM (154 registers, no serialisation, the warpgroups waiting in lockstep); the state pass 134
// against 90 us. The warp-specialised main passes: 228 us against 191 (bench/cuda/NOTES.md round
// 10). So they run only when LightningConfig::sweep_kernel asks for them; they are kept, tested
// against the CPU on every pass, as the base for the next steps (see the notes).
//
// Layout: two warpgroups (256 threads). Each chunk tile [64 tokens, 128] sits in shared memory as
// 8 x 8 "core matrices" (8 rows x 16 bytes, 128 contiguous bytes): element (r, c) at byte
// (r / 8) * 2048 + (c / 8) * 128 + (r % 8) * 16 + (c % 8) * 2. Read with K = c it is wgmma's
// K-major layout (leading offset 128, stride offset 2048); read with K = r it is the MN-major
// layout (leading 2048, stride 128). The masked scores P [64 t, 64 s] use the same layout with
// 64 columns (row groups 1024 bytes apart).
#include "kernels/cuda/hopper.cuh"
#include "kernels/cuda/lightning_common.cuh"

namespace spindle::kernels::cuda::internal::lightning {
namespace {

constexpr int kDh = 128;
constexpr int kTileBytes = kChunk * kDh * 2;  // 16 KB

// The state-only pass: Y and Z chunk tiles in three buffers each (the next two chunks' tiles are
// requested while one is used), info (two), decay table: 98 KB, two blocks per SM.
struct WgStateLayout {
  static constexpr int kStages = 3;
  static constexpr int kY = 0;
  static constexpr int kZ = kY + kStages * kTileBytes;
  static constexpr int kInfo = kZ + kStages * kTileBytes;
  static constexpr int kDec = kInfo + 2 * static_cast<int>(sizeof(SweepInfo));
  static constexpr int kBytes = kDec + kDecayTable * 4;
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
// D (64 x 64, fp32) = A B (+ D when accumulate), A and B from shared memory, each K-major (0) or
// MN-major (1).
template <int kTransA, int kTransB>
__device__ __forceinline__ void WgmmaSS64(float (&d)[32], uint64_t da, uint64_t db,
                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}
// D (64 x 32, fp32) = A B (+ D when accumulate), A and B from shared memory, K-major.
__device__ __forceinline__ void WgmmaSS32(float (&d)[16], uint64_t da, uint64_t db,
                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db), "r"(accumulate));
}
// D (64 x 64, fp32) = A B (+ D when accumulate), A from registers (the mma.sync A fragment of each
// warp's 16 rows), B from shared memory, K-major (kTransB 0) or MN-major (1).
template <int kTransB>
__device__ __forceinline__ void WgmmaRS64(float (&d)[32], const uint32_t (&a)[4], uint64_t db,
                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(kTransB));
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
// cp.async, by kN threads (t = 0 .. kN - 1); rows >= len become zeros. Thread t copies core column
// (t / 8) % 16 of rows (t / 128) * 8 + t % 8 + 8 (kN / 128) i: a warp writes 512 contiguous bytes
// (8 rows of 4 core columns) and reads 64 contiguous bytes of each of 8 rows; offsets and trip
// count are compile-time.
template <int kN = kThreads>
__device__ __forceinline__ void LoadCoreTile(unsigned char* dst, const bf16* src, int64_t stride,
                                             int len, int t = threadIdx.x) {
  constexpr int kGroups = kN / 128;          // 8-row groups a pass
  const int g0 = kGroups == 1 ? 0 : t >> 7;  // this thread's group in a pass
  const int r8 = t & 7, cg = (t >> 3) & 15, row = g0 * 8 + r8;
  unsigned char* d = dst + g0 * 2048 + cg * 128 + r8 * 16;
  const bf16* s = src + row * stride + cg * 8;
#pragma unroll
  for (int i = 0; i < kChunk / (8 * kGroups); ++i) {
    const bool in = row + 8 * kGroups * i < len;
    CpAsync16(reinterpret_cast<bf16*>(d + i * 2048 * kGroups),
              in ? s + 8 * kGroups * i * stride : src, in ? 16 : 0);
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

// The A fragments of T^T diag(colW) for this warp's 16 rows (columns col0 + 16 wi.. of the
// core-matrix tile T [64 tokens, 128]), 4 steps of 16 tokens: ldmatrix.trans, then the weights.
__device__ __forceinline__ void ScaledTransposedA(uint32_t (&fa)[4][4], const WgPlace& w,
                                                  uint32_t tile, const float* colw) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const int t = ks * 16 + (w.lane & 7) + ((w.lane >> 4) & 1) * 8;
    const int i = w.col0 + w.wi * 16 + ((w.lane >> 3) & 1) * 8;
    Ldm4T(fa[ks], tile + CoreOffset(t, i));
    ScaleTokens(fa[ks], colw, ks * 16 + w.q2);
  }
}

// Key step k's bf16 A fragment of R (the m64 x k16 slice of the warp's 16 rows).
__device__ __forceinline__ void PackStateA(uint32_t (&a)[4], const float (&R)[64], int k) {
  a[0] = PackBf16(R[8 * k + 0], R[8 * k + 1]), a[1] = PackBf16(R[8 * k + 2], R[8 * k + 3]);
  a[2] = PackBf16(R[8 * k + 4], R[8 * k + 5]), a[3] = PackBf16(R[8 * k + 6], R[8 * k + 7]);
}

// R = S^T for this warpgroup's value rows from the block's fp32 start state (stored as S^T when
// a.transpose_start, else as S): R[4 j + e] is value row col0 + row + 8 (e >> 1), key column 8 j +
// q2 + (e & 1).
__device__ __forceinline__ void LoadStartStateWg(const WgPlace& w, float (&R)[64],
                                                 const SweepArgs& a, int h, int g) {
  const float* p0 = a.start + (static_cast<int64_t>(h) * a.G + g) * kDh * kDh;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v = w.col0 + w.row + (e >> 1) * 8, k = 8 * j + w.q2 + (e & 1);
      R[j * 4 + e] = a.transpose_start ? p0[v * kDh + k] : p0[k * kDh + v];
    }
  }
}

// Byte offset of element (r, c) in a 64-column core-matrix tile (8-row groups 1024 bytes apart).
__device__ __forceinline__ int CoreOffset64(int r, int c) {
  return (r >> 3) * 1024 + (c >> 3) * 128 + (r & 7) * 16 + (c & 7) * 2;
}

// The scores of tokens c0 .. c0 + 8 NJ - 1 (P: the warpgroup's m64 x 8 NJ accumulator) masked,
// decayed and scaled, as bf16 into the P tile (64 columns, core-matrix layout).
template <bool kReverse, int NJ>
__device__ __forceinline__ void MaskScoresToP(const float (&P)[4 * NJ], const WgPlace& w, int c0,
                                              const SweepInfo& ci, const float* dec, float scale,
                                              unsigned char* p_tile) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = w.row + 8 * hh, c = c0 + 8 * j + w.q2;
      const int s0 = ci.seg[kReverse ? c : r], s1 = ci.seg[kReverse ? c + 1 : r];
      const float v0 = MaskedScore<kReverse>(P[j * 4 + hh * 2], s0, dec, r, c, scale);
      const float v1 = MaskedScore<kReverse>(P[j * 4 + hh * 2 + 1], s1, dec, r, c + 1, scale);
      *reinterpret_cast<uint32_t*>(p_tile + CoreOffset64(r, c)) = PackBf16(v0, v1);
    }
  }
}

// The state-only pass: S = f S + (colW o Y)^T Z from zero over the block's chunks, warpgroup w
// holding state rows [64 w, 64 w + 64) (64 fp32 registers a thread); writes the block's end state
// to U and the product of f to F.
template <bool kReverse>
__global__ void __launch_bounds__(kThreads, 2) WgmmaStateKernel(SweepArgs a) {
#ifdef SPINDLE_WGMMA_DEVICE
  using L = WgStateLayout;
  constexpr int kStages = L::kStages;
  extern __shared__ __align__(128) unsigned char smem[];
  SweepInfo* infos = reinterpret_cast<SweepInfo*>(smem + L::kInfo);
  float* dec = DecayTable(smem + L::kDec);
  const uint32_t sbase = SmemAddr(smem);
  const WgPlace w;
  const BlockChunks<kDh, kReverse> b(a.chunks_per_block, a.n_chunks, a.T);
  const int g = b.g, h = b.h, count = b.count;
  // Chunk n's tiles into buffer n % kStages as one cp.async group (an empty group past the end,
  // so that every chunk has kStages - 2 groups after its own).
  auto load = [&](int n) {
    if (n < count) {
      const int c0 = b.Token0(n), len = b.Len(n);
      const int buf = (n % kStages) * kTileBytes;
      LoadCoreTile(smem + L::kY + buf, a.y + c0 * a.y_stride + b.hoff, a.y_stride, len);
      LoadCoreTile(smem + L::kZ + buf, a.z + c0 * a.z_stride + b.hoff, a.z_stride, len);
    }
    CpAsyncCommit();
  };

#pragma unroll
  for (int n = 0; n < kStages - 1; ++n) load(n);
  float S[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) S[i] = 0.0f;
  FillDecay(a.log_decay[h], dec);
  __syncthreads();  // dec
  ComputeInfo(infos[0], dec, a.cu, a.n_seg, b.Token0(0), a.T, a.scale);
  float f_prod = 1.0f;

  for (int n = 0; n < count; ++n) {
    CpAsyncWait<kStages - 2>();
    FenceProxyAsync();
    // This chunk's tiles and info are in place; every read of chunk n - 1 is done (each
    // warpgroup waited for its wgmma), so its buffers may be refilled.
    __syncthreads();
    const SweepInfo& ci = infos[n & 1];
    if (n + 1 < count)
      ComputeInfo(infos[(n + 1) & 1], dec, a.cu, a.n_seg, b.Token0(n + 1), a.T, a.scale);
    load(n + kStages - 1);
    const float* colw = kReverse ? ci.qw : ci.kw;
    const uint32_t buf = (n % kStages) * kTileBytes;
    const uint32_t ys = sbase + L::kY + buf, zs = sbase + L::kZ + buf;

    // A fragments of (colW o Y)^T for this warp's 16 state rows.
    uint32_t ya[4][4];
    ScaledTransposedA(ya, w, ys, colw);
    f_prod *= ci.f;
#pragma unroll
    for (int i = 0; i < 64; ++i) S[i] *= ci.f;
    FenceRegs(S);
    WgFence();
#pragma unroll
    for (int s = 0; s < 4; ++s) WgmmaRS128(S, ya[s], DescMN(zs + s * 4096), 1);
    WgCommit();
    WgWait();
    FenceRegs(S);
  }

  float* out = a.U + (static_cast<int64_t>(h) * a.G + g) * kDh * kDh;
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
#endif  // SPINDLE_WGMMA_DEVICE
}

// ---- The main passes with the state held transposed ------------------------------------------
// As lightning_sweep.cu's SweepTKernel, on wgmma: warpgroup w holds R = S^T for value rows
// [64 w, 64 w + 64) (every key column: the m64n128 accumulator, 64 registers a thread). Per chunk:
//   P[:, 32 w..] = X Y^T[.., 32 w..] (m64n32) -> mask, decay, scale -> bf16 into the P tile
//   O^T = R X^T (R's bf16 fragments as the register A operand), scaled by rowW per token
//   (barrier: P complete) O^T += Z^T P^T (both from shared memory), R = f R + Z^T diag(colW) Y
//   (Z^T fragments by ldmatrix.trans, scaled in registers) -> O^T through the staging tile.
// Tiles in the core-matrix layout (X, Z one buffer, Y two), P 8 KB, the staging tile 17 KB: 91 KB,
// so two blocks share an SM.
struct WgTLayout {
  static constexpr int kX = 0;
  static constexpr int kY = kX + kTileBytes;  // two buffers
  static constexpr int kZ = kY + 2 * kTileBytes;
  static constexpr int kP = kZ + kTileBytes;           // [64 t, 64 s] core matrices
  static constexpr int kO = kP + kChunk * kChunk * 2;  // staging [64, 136] bf16
  static constexpr int kInfo = kO + kChunk * (kDh + 8) * 2;
  static constexpr int kDec = kInfo + 2 * static_cast<int>(sizeof(SweepInfo));
  static constexpr int kBytes = kDec + kDecayTable * 4;
};
__device__ __forceinline__ uint64_t DescK64(uint32_t addr) { return Desc(addr, 128, 1024); }

template <bool kReverse>
__global__ void __launch_bounds__(kThreads, 2) WgmmaTKernel(SweepArgs a) {
#ifdef SPINDLE_WGMMA_DEVICE
  using L = WgTLayout;
  extern __shared__ __align__(128) unsigned char smem[];
  SweepInfo* infos = reinterpret_cast<SweepInfo*>(smem + L::kInfo);
  float* dec = DecayTable(smem + L::kDec);
  bf16* os = reinterpret_cast<bf16*>(smem + L::kO);
  const uint32_t sbase = SmemAddr(smem);
  const WgPlace w;
  const BlockChunks<kDh, kReverse> b(a.chunks_per_block, a.n_chunks, a.T);
  const int g = b.g, h = b.h, count = b.count;
  if (count <= 0) return;
  auto load = [&](int off, const bf16* src, int64_t stride, int n) {
    LoadCoreTile(smem + off, src + b.Token0(n) * stride + b.hoff, stride, b.Len(n));
  };
  auto copy_out = [&](int n) {
    CopyOutT<kDh>(os, a.out + b.Token0(n) * a.out_stride + b.hoff, a.out_stride, b.Len(n));
  };

  FillDecay(a.log_decay[h], dec);
  load(L::kX, a.x, a.x_stride, 0), load(L::kY, a.y, a.y_stride, 0), load(L::kZ, a.z, a.z_stride, 0);
  float R[64];
  LoadStartStateWg(w, R, a, h, g);
  __syncthreads();  // dec
  ComputeInfo(infos[0], dec, a.cu, a.n_seg, b.Token0(0), a.T, a.scale);

  for (int n = 0; n < count; ++n) {
    const bool more = n + 1 < count;
    CpAsyncWaitAll();
    FenceProxyAsync();
    __syncthreads();  // B1: X, Y, info; chunk n - 1's staged output; every wgmma of n - 1 done
    const SweepInfo& ci = infos[n & 1];
    if (more) ComputeInfo(infos[(n + 1) & 1], dec, a.cu, a.n_seg, b.Token0(n + 1), a.T, a.scale);
    if (n > 0) copy_out(n - 1);
    if (n > 0) load(L::kZ, a.z, a.z_stride, n);
    CpAsyncCommit();
    if (more) load(L::kY + ((n + 1) & 1) * kTileBytes, a.y, a.y_stride, n + 1);
    CpAsyncCommit();
    // Tile addresses made opaque per chunk, so that the descriptors built from them are not kept
    // live across the loop (registers are short at two blocks per SM).
    uint32_t base = sbase;
    asm volatile("" : "+r"(base));
    const uint32_t xs = base + L::kX, zs = base + L::kZ, ps = base + L::kP;
    const uint32_t ys = base + L::kY + (n & 1) * kTileBytes;
    const float* roww = kReverse ? ci.kw : ci.qw;
    const float* colw = kReverse ? ci.qw : ci.kw;

    {
      // Scores of this warpgroup's 32 tokens s, masked, into the P tile.
      float P[16];
      WgFence();
#pragma unroll
      for (int k = 0; k < 8; ++k)
        WgmmaSS32(P, DescK(xs + k * 256), DescK(ys + w.wg * 8192 + k * 256), k > 0);
      WgCommit();
      WgWait();
      FenceRegs(P);
      MaskScoresToP<kReverse, 4>(P, w, w.wg * 32, ci, dec, a.scale, smem + L::kP);
    }
    // O^T = R X^T in groups of kStepsPerGroup key steps (R's bf16 fragments stay live until their
    // wgmma is done; fewer at a time leave the registers two blocks per SM allow).
    constexpr int kStepsPerGroup = 2;
    float O[kChunk / 8][4];
    float(&Of)[32] = reinterpret_cast<float(&)[32]>(O);
#pragma unroll
    for (int k0 = 0; k0 < 8; k0 += kStepsPerGroup) {
      uint32_t ra[kStepsPerGroup][4];
#pragma unroll
      for (int kk = 0; kk < kStepsPerGroup; ++kk) PackStateA(ra[kk], R, k0 + kk);
      WgFence();
#pragma unroll
      for (int kk = 0; kk < kStepsPerGroup; ++kk) {
        const int k = k0 + kk;
        WgmmaRS64<0>(Of, ra[kk], DescK(xs + k * 256), k > 0);
      }
      WgCommit();
      WgWait();
      FenceRegs(Of);
    }
#pragma unroll
    for (int j = 0; j < kChunk / 8; ++j) {
      const float w0 = roww[8 * j + w.q2], w1 = roww[8 * j + w.q2 + 1];
      O[j][0] *= w0, O[j][1] *= w1, O[j][2] *= w0, O[j][3] *= w1;
    }
    FenceRegs(Of);
    CpAsyncWait<1>();  // this chunk's Z (the next Y may stay in flight)
    FenceProxyAsync();
    __syncthreads();  // B2: P complete; X done; Z in place; the staging tile read
    if (more) load(L::kX, a.x, a.x_stride, n + 1);
    // O^T += Z^T P^T, then O^T to the staging tile before the update needs its registers.
    WgFence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      WgmmaSS64<1, 0>(Of, DescMN(zs + w.wg * 1024 + ks * 4096), DescK64(ps + ks * 256), 1);
    WgCommit();
    WgWait();
    FenceRegs(Of);
    StageOutT<kDh>(O, os, w.col0 + w.wi * 16, w.lane);
    // R = f R + Z^T diag(colW) Y: A fragments of Z^T diag(colW) for this warp's 16 value rows, 4
    // steps of 16 tokens. (It also runs after the block's last chunk, unused: a branch around
    // wgmmas serialises them.)
    uint32_t za[4][4];
    ScaledTransposedA(za, w, zs, colw);
#pragma unroll
    for (int i = 0; i < 64; ++i) R[i] *= ci.f;
    FenceRegs(R);
    WgFence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) WgmmaRS128(R, za[ks], DescMN(ys + ks * 4096), 1);
    WgCommit();
    WgWait();
    FenceRegs(R);
  }
  __syncthreads();
  copy_out(count - 1);
#endif  // SPINDLE_WGMMA_DEVICE
}

// ---- The warp-specialised main passes (sweep_kernel 4) ---------------------------------------
// One block per SM and three warpgroups. The producer (warpgroup 0, 96 registers a thread; fewer
// spill its tile addresses) fetches each chunk's X, Y and Z tiles by cp.async into one of
// kWsStages stages, up to kWsStages chunks ahead, computes the chunk's info beside them and marks
// the stage full; the two consumers (200 registers) each hold R = S^T for 64 value rows, compute
// the whole chunk's scores themselves (twice the score work, but no barrier between them), and
// mark the stage empty once done with it. A consumer's chunk: its row weights read first; R's
// bf16 fragments packed; P = X Y^T (m64n64) issued, O^T = R X^T behind it, P masked into the
// consumer's own P tile while O^T runs; O^T scaled by rowW; O^T += Z^T P^T and R = f R + Z^T
// diag(colW) Y issued together; O^T staged (two buffers) and copied out by the consumer itself.
// Shared memory: three stages of three tiles and info, two P tiles, four staging tiles: 203 KB.
constexpr int kWsStages = 3;
constexpr int kWsThreads = 384;
struct WsLayout {
  static constexpr int kInfo = 3 * kTileBytes;  // within a stage, after X, Y, Z
  static constexpr int kStage = (kInfo + static_cast<int>(sizeof(SweepInfo)) + 127) / 128 * 128;
  static constexpr int kP = kWsStages * kStage;  // a [64, 64] P tile per consumer
  static constexpr int kO = kP + 2 * kChunk * kChunk * 2;
  static constexpr int kOTile = kChunk * (kChunk + 8) * 2;  // [64 tokens, 64 values] bf16
  static constexpr int kDec = kO + 4 * kOTile;
  static constexpr int kBar = (kDec + kDecayTable * 4 + 7) / 8 * 8;  // full[], then empty[]
  static constexpr int kBytes = kBar + 2 * kWsStages * 8;
};

#ifdef SPINDLE_WGMMA_DEVICE
__device__ __forceinline__ void WgBarrier(int id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}
#endif  // SPINDLE_WGMMA_DEVICE

template <bool kReverse>
__global__ void __launch_bounds__(kWsThreads, 1) WgmmaWsKernel(SweepArgs a) {
#ifdef SPINDLE_WGMMA_DEVICE
  using L = WsLayout;
  extern __shared__ __align__(128) unsigned char smem[];
  float* dec = DecayTable(smem + L::kDec);
  const uint32_t sbase = SmemAddr(smem);
  const uint32_t full0 = sbase + L::kBar, empty0 = full0 + kWsStages * 8;
  const BlockChunks<kDh, kReverse> b(a.chunks_per_block, a.n_chunks, a.T);
  const int g = b.g, h = b.h, count = b.count;
  if (count <= 0) return;
  auto info = [&](int s) { return reinterpret_cast<SweepInfo*>(smem + s * L::kStage + L::kInfo); };

  FillDecay(a.log_decay[h], dec);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kWsStages; ++s) MbarInit(full0 + 8 * s, 128), MbarInit(empty0 + 8 * s, 256);
  }
  __syncthreads();  // dec, barriers
  const int wg = threadIdx.x >> 7;

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 96;\n" ::: "memory");
    const int t = threadIdx.x;
    for (int n = 0; n <= count; ++n) {
      if (n < count) {
        const int s = n % kWsStages;
        if (n >= kWsStages) MbarWait(empty0 + 8 * s, ((n / kWsStages) - 1) & 1);
        unsigned char* st = smem + s * L::kStage;
        const int64_t c0 = b.Token0(n);
        const int len = b.Len(n);
        LoadCoreTile<128>(st, a.x + c0 * a.x_stride + b.hoff, a.x_stride, len, t);
        LoadCoreTile<128>(st + kTileBytes, a.y + c0 * a.y_stride + b.hoff, a.y_stride, len, t);
        LoadCoreTile<128>(st + 2 * kTileBytes, a.z + c0 * a.z_stride + b.hoff, a.z_stride, len, t);
        ComputeInfo(*info(s), dec, a.cu, a.n_seg, b.Token0(n), a.T, a.scale);
      }
      CpAsyncCommit();
      if (n >= 1) {  // chunk n - 1's copies have landed: the stage is full
        if (n < count) {
          CpAsyncWait<1>();
        } else {
          CpAsyncWait<0>();
        }
        FenceProxyAsync();
        MbarArrive(full0 + 8 * ((n - 1) % kWsStages));
      }
    }
  } else {
    // Consumers: warpgroup cw = 0, 1 holds value rows 64 cw .. 64 cw + 63.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 200;\n" ::: "memory");
    const int cw = wg - 1;
    WgPlace w;
    w.wg = cw, w.col0 = 64 * cw;
    const int tw = threadIdx.x - 128 * wg;  // 0..127 within the warpgroup
    const uint32_t ps = sbase + L::kP + cw * (kChunk * kChunk * 2);
    unsigned char* p_tile = smem + L::kP + cw * (kChunk * kChunk * 2);
    float R[64];
    LoadStartStateWg(w, R, a, h, g);

    for (int n = 0; n < count; ++n) {
      const int s = n % kWsStages;
      MbarWait(full0 + 8 * s, (n / kWsStages) & 1);
      FenceProxyAsync();
      const SweepInfo& ci = *info(s);
      uint32_t base = sbase;
      asm volatile("" : "+r"(base));
      const uint32_t xs = base + s * L::kStage, ys = xs + kTileBytes, zs = xs + 2 * kTileBytes;
      const float* roww = kReverse ? ci.kw : ci.qw;
      const float* colw = kReverse ? ci.qw : ci.kw;

      // This thread's row weights and f, read before the wgmma fences.
      float rw[kChunk / 8][2];
#pragma unroll
      for (int j = 0; j < kChunk / 8; ++j) {
        rw[j][0] = roww[8 * j + w.q2], rw[j][1] = roww[8 * j + w.q2 + 1];
      }
      const float f = ci.f;
      // P = X Y^T over all 64 tokens, then O^T = R X^T behind it; the scores are masked while
      // O^T is still running.
      uint32_t ra[8][4];
#pragma unroll
      for (int k = 0; k < 8; ++k) PackStateA(ra[k], R, k);
      float P[32];
      float O[kChunk / 8][4];
      float(&Of)[32] = reinterpret_cast<float(&)[32]>(O);
      WgFence();
#pragma unroll
      for (int k = 0; k < 8; ++k)
        WgmmaSS64<0, 0>(P, DescK(xs + k * 256), DescK(ys + k * 256), k > 0);
      WgCommit();
#pragma unroll
      for (int k = 0; k < 8; ++k) WgmmaRS64<0>(Of, ra[k], DescK(xs + k * 256), k > 0);
      WgCommit();
      WgWaitN<1>();  // the scores
      FenceRegs(P);
      MaskScoresToP<kReverse, 8>(P, w, 0, ci, dec, a.scale, p_tile);
      FenceProxyAsync();
      WgBarrier(1 + cw);  // the P tile is complete
      WgWaitN<0>();       // O^T = R X^T
      FenceRegs(Of);
#pragma unroll
      for (int j = 0; j < kChunk / 8; ++j) {
        O[j][0] *= rw[j][0], O[j][1] *= rw[j][1], O[j][2] *= rw[j][0], O[j][3] *= rw[j][1];
      }
      FenceRegs(Of);
      // O^T += Z^T P^T and R = f R + Z^T diag(colW) Y.
      uint32_t za[4][4];
      ScaledTransposedA(za, w, zs, colw);
#pragma unroll
      for (int i = 0; i < 64; ++i) R[i] *= f;
      FenceRegs(R);
      WgFence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        WgmmaSS64<1, 0>(Of, DescMN(zs + cw * 1024 + ks * 4096), DescK64(ps + ks * 256), 1);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) WgmmaRS128(R, za[ks], DescMN(ys + ks * 4096), 1);
      WgCommit();
      const int len = ci.len;
      WgWaitN<0>();
      FenceRegs(Of);
      FenceRegs(R);
      MbarArrive(empty0 + 8 * s);  // done with the stage's tiles and info
      // O^T through this consumer's staging tile (two buffers) to the output rows.
      bf16* stg = reinterpret_cast<bf16*>(smem + L::kO + (cw * 2 + (n & 1)) * L::kOTile);
      StageOutT<kChunk>(O, stg, w.wi * 16, w.lane);
      WgBarrier(1 + cw);
      {
        bf16* out = a.out + b.Token0(n) * a.out_stride + b.hoff + w.col0;
        const int r0 = tw >> 3, c = (tw & 7) * 8;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = r0 + 16 * i;
          if (r < len) {
            *reinterpret_cast<uint4*>(out + r * a.out_stride + c) =
                *reinterpret_cast<const uint4*>(stg + r * (kChunk + 8) + c);
          }
        }
      }
    }
  }
#endif  // SPINDLE_WGMMA_DEVICE
}

template <bool kReverse>
Status LaunchWgmmaWsT(const SweepArgs& a, cudaStream_t stream) {
  return LaunchOverBlocks(WgmmaWsKernel<kReverse>, a, kWsThreads, WsLayout::kBytes, stream);
}

// The state-only pass or the transposed main pass, on wgmma.
template <bool kReverse, bool kStateOnly>
Status LaunchWgmmaT(const SweepArgs& a, cudaStream_t stream) {
  auto* kernel = kStateOnly ? WgmmaStateKernel<kReverse> : WgmmaTKernel<kReverse>;
  constexpr int kSmem = kStateOnly ? WgStateLayout::kBytes : WgTLayout::kBytes;
  return LaunchOverBlocks(kernel, a, kThreads, kSmem, stream);
}

}  // namespace

bool WgmmaSweepAvailable() {
#ifdef SPINDLE_WGMMA
  return CurrentDeviceAttribute(cudaDevAttrComputeCapabilityMajor, 0) == 9 &&
         CurrentDeviceAttribute(cudaDevAttrComputeCapabilityMinor, -1) == 0;
#else
  return false;
#endif
}

// Measured slower than the mma.sync sweep so far (bench/cuda/NOTES.md, round 6): runs only when
// a config asks for it.
bool UseWgmmaSweep(int64_t Dh, const LightningConfig& config) {
  return Dh == kDh && config.sweep_kernel == 2 && config.stages != 2 && WgmmaSweepAvailable();
}

bool UseWgmmaWsSweep(int64_t Dh, const LightningConfig& config) {
  return Dh == kDh && config.sweep_kernel == 4 && WgmmaSweepAvailable();
}

Status LaunchWgmmaWs(bool reverse, const SweepArgs& a, cudaStream_t stream) {
  return reverse ? LaunchWgmmaWsT<true>(a, stream) : LaunchWgmmaWsT<false>(a, stream);
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
