// Lightning on CUDA: the one chunk-sweep kernel behind every Lightning pass. A block owns one head
// and `chunks_per_block` consecutive 64-token chunks and walks them in order (or in reverse),
// carrying a DH x DH fp32 state in registers. Per chunk, with X, Y, Z three [64, DH] bf16 tiles:
//
//   out  = diag(rowW) X S + (Mask o X Y^T) Z        (skipped in the state-only pass)
//   S    = f S + (colW o Y)^T Z
//
// Every Lightning quantity is one instance (see lightning_common.cuh for qw, kw, f and the mask):
//   forward            X=q,  Y=k,  Z=v,  S,     rowW=qw, colW=kw, causal mask       -> out
//   dq                 X=dO, Y=v,  Z=k,  S^T,   rowW=qw, colW=kw, causal mask       -> dq
//   dk   (reverse)     X=v,  Y=dO, Z=q,  dS^T,  rowW=kw, colW=qw, transposed mask   -> dk
//   dv   (reverse)     X=k,  Y=q,  Z=dO, dS,    rowW=kw, colW=qw, transposed mask   -> dv
// and the pass-1 end states are the state-only instances (forward: Y=k, Z=v; reverse: Y=q, Z=dO).
//
// Implementation: 8 warps, mma.sync m16n8k16 (bf16 in, fp32 accumulate) with operands from padded
// shared memory through ldmatrix; the scores never leave registers except one bf16 exchange
// between the two warps sharing 16 rows, and 16 x 16 score blocks the causal mask zeroes whole
// are neither computed nor read; chunk tiles arrive by cp.async (X for the next chunk while the
// current one finishes); two block barriers per chunk: Y has two buffers, so the next chunk's Y
// and this chunk's Z are fetched at the start of the chunk (115,456 bytes of shared memory at
// DH=128, two blocks per SM; stages == 1 keeps one Y buffer and a third barrier, 98 KB). The
// state-only passes keep three Y / Z buffers, fetch two chunks ahead and need one barrier per
// chunk; they weight each token by its decay to the block's end (ComputeStateWeights), so their
// state is never scaled by f. The per-warp steps (scores, X S, scores x Z, the state update) are
// device functions shared with the other kernels here: the main passes' sweep that holds the
// state transposed (Dh = 128, the default there: no bf16 state copy through shared memory, see
// SweepTKernel) and the fused dk / dv reverse sweep, which walks the dk and dv instances of one
// chunk together over one dS.
#include "kernels/cuda/lightning_common.cuh"

namespace spindle::kernels::cuda::internal::lightning {
namespace {

__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// ---- Operand fetches (lane-dependent addresses; `pitch` in elements) ---------------------------------
// A fragment (16 x 16) of a row-major [m][k] tile at (m0, k0).
__device__ __forceinline__ void LoadA(uint32_t (&a)[4], const bf16* base, int pitch, int m0,
                                      int k0, int lane) {
  Ldm4(a, base + (m0 + (lane & 15)) * pitch + k0 + (lane >> 4) * 8);
}
// A fragment of A = T^T where T is stored row-major [k][m].
__device__ __forceinline__ void LoadAT(uint32_t (&a)[4], const bf16* base, int pitch, int m0,
                                       int k0, int lane) {
  Ldm4T(a, base + (k0 + (lane & 7) + ((lane >> 4) & 1) * 8) * pitch + m0 + ((lane >> 3) & 1) * 8);
}
// B fragments of two n-tiles (n0, n0 + 8) x k16 from storage [n][k] (B = stored^T): b[0..1] for
// the first tile, b[2..3] for the second.
__device__ __forceinline__ void LoadBNK(uint32_t (&b)[4], const bf16* base, int pitch, int n0,
                                        int k0, int lane) {
  Ldm4(b, base + (n0 + (lane & 7) + ((lane >> 4) & 1) * 8) * pitch + k0 + ((lane >> 3) & 1) * 8);
}
// The same from storage [k][n] (B stored as is).
__device__ __forceinline__ void LoadBKN(uint32_t (&b)[4], const bf16* base, int pitch, int n0,
                                        int k0, int lane) {
  Ldm4T(b, base + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * pitch + n0 + ((lane >> 4) & 1) * 8);
}

template <int DH, int kYBufs, int kZBufs>
struct SweepLayout {
  static constexpr int kPitch = DH + 8;           // bf16 [64, DH] tiles and the [DH, DH] state
  static constexpr int kAPitch = kChunk + 8;      // bf16 [64, 64] masked scores
  static constexpr int kTile = kChunk * kPitch;   // elements
  // Byte offsets: Y (kYBufs times), Z (kZBufs times), info x2, decay table | X, bf16 state,
  // scores (main passes only).
  static constexpr int kY = 0;
  static constexpr int kZ = kY + kYBufs * kTile * 2;
  static constexpr int kInfo = kZ + kZBufs * kTile * 2;
  static constexpr int kDec = kInfo + 2 * static_cast<int>(sizeof(SweepInfo));
  static constexpr int kStateOnlyBytes = (kDec + kDecayTable * 4 + 127) / 128 * 128;
  static constexpr int kX = kStateOnlyBytes;
  static constexpr int kS = kX + kTile * 2;
  static constexpr int kA = kS + DH * kPitch * 2;
  static constexpr int kMainBytes = kA + kChunk * kAPitch * 2;
  // Warp tiling of the state: 16 rows x kSCols columns per warp.
  static constexpr int kRowTiles = DH / 16;
  static constexpr int kColGroups = kWarps / kRowTiles;
  static constexpr int kSCols = DH / kColGroups;
  static constexpr int kSNT = kSCols / 8;  // n-tiles of 8
};
// Output tiling: 16 rows x DH/2 columns per warp (two warps per 16-row group), kONT<DH> n-tiles.
template <int DH>
constexpr int kONT = DH / 16;

// ---- Per-warp pieces of a chunk step ----------------------------------------------------------------
// A warp owns output rows orow0 + {qr, qr + 8} and columns ocol0 + 8 j + qc + {0, 1} (16 rows x
// DH/2 columns), the score half of those rows over tokens acol0 .. acol0 + 31, and state rows
// srow0 + {qr, qr + 8}, columns scol0 + 8 j + qc + {0, 1}.
template <int DH>
struct WarpPlace {
  using L = SweepLayout<DH, 1, 1>;
  int lane, qr, qc, orow0, ocol0, acol0, srow0, scol0;
  __device__ WarpPlace() {
    const int warp = threadIdx.x >> 5;
    lane = threadIdx.x & 31, qr = lane >> 2, qc = (lane & 3) * 2;
    orow0 = (warp >> 1) * 16, ocol0 = (warp & 1) * (DH / 2), acol0 = (warp & 1) * 32;
    srow0 = (warp % L::kRowTiles) * 16, scol0 = (warp / L::kRowTiles) * L::kSCols;
  }
};

// Whether the 16 x 16 score block (rows 16 rb.., tokens 16 cb..) can hold an unmasked score: on
// or below the diagonal (on or above it for the transposed mask). The other blocks are neither
// computed nor read.
template <bool kReverse>
__device__ __forceinline__ bool LiveScoreBlock(int rb, int cb) {
  return kReverse ? cb >= rb : cb <= rb;
}

// The warp's part of Mask o X Y^T (decayed, scaled; transposed mask when kReverse), as bf16 into
// the exchange tile ab (live blocks only).
template <int DH, bool kReverse>
__device__ __forceinline__ void ScoresToTile(const WarpPlace<DH>& w, const bf16* xs, const bf16* ys,
                                             bf16* ab, const SweepInfo& ci, const float* dec,
                                             float scale) {
  using L = SweepLayout<DH, 1, 1>;
  const bool live0 = LiveScoreBlock<kReverse>(w.orow0 / 16, w.acol0 / 16);
  const bool live1 = LiveScoreBlock<kReverse>(w.orow0 / 16, w.acol0 / 16 + 1);
  if (!live0 && !live1) return;
  float A[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) A[j][0] = A[j][1] = A[j][2] = A[j][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < DH / 16; ++ks) {
    uint32_t fa[4];
    LoadA(fa, xs, L::kPitch, w.orow0, ks * 16, w.lane);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      if (!(np == 0 ? live0 : live1)) continue;
      uint32_t fb[4];
      LoadBNK(fb, ys, L::kPitch, w.acol0 + np * 16, ks * 16, w.lane);
      Mma(A[2 * np], fa, fb[0], fb[1]);
      Mma(A[2 * np + 1], fa, fb[2], fb[3]);
    }
  }
  const int r0 = w.orow0 + w.qr;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (!(j < 2 ? live0 : live1)) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = r0 + (e >> 1) * 8, c = w.acol0 + 8 * j + w.qc + (e & 1);
      A[j][e] = MaskedScore<kReverse>(A[j][e], ci.seg[kReverse ? c : r], dec, r, c, scale);
    }
    const int r = r0, c = w.acol0 + 8 * j + w.qc;
    *reinterpret_cast<uint32_t*>(ab + r * L::kAPitch + c) = PackBf16(A[j][0], A[j][1]);
    *reinterpret_cast<uint32_t*>(ab + (r + 8) * L::kAPitch + c) = PackBf16(A[j][2], A[j][3]);
  }
}

// O = diag(roww) X S with the bf16 state sb as stored ([DH, DH], S[i][j] at row i), or X S^T
// when kStateT.
template <int DH, bool kStateT>
__device__ __forceinline__ void InterChunk(const WarpPlace<DH>& w, float (&O)[DH / 16][4],
                                           const bf16* xs, const bf16* sb, const float* roww) {
  using L = SweepLayout<DH, 1, 1>;
#pragma unroll
  for (int j = 0; j < kONT<DH>; ++j) O[j][0] = O[j][1] = O[j][2] = O[j][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < DH / 16; ++ks) {
    uint32_t fa[4];
    LoadA(fa, xs, L::kPitch, w.orow0, ks * 16, w.lane);
#pragma unroll
    for (int np = 0; np < kONT<DH> / 2; ++np) {
      uint32_t fb[4];
      if constexpr (kStateT) {
        LoadBNK(fb, sb, L::kPitch, w.ocol0 + np * 16, ks * 16, w.lane);
      } else {
        LoadBKN(fb, sb, L::kPitch, w.ocol0 + np * 16, ks * 16, w.lane);
      }
      Mma(O[2 * np], fa, fb[0], fb[1]);
      Mma(O[2 * np + 1], fa, fb[2], fb[3]);
    }
  }
  const float w0 = roww[w.orow0 + w.qr], w1 = roww[w.orow0 + w.qr + 8];
#pragma unroll
  for (int j = 0; j < kONT<DH>; ++j) O[j][0] *= w0, O[j][1] *= w0, O[j][2] *= w1, O[j][3] *= w1;
}

// O += (masked scores) Z, the scores from the exchange tile (its live blocks).
template <int DH, bool kReverse>
__device__ __forceinline__ void IntraChunk(const WarpPlace<DH>& w, float (&O)[DH / 16][4],
                                           const bf16* ab, const bf16* zs) {
  using L = SweepLayout<DH, 1, 1>;
#pragma unroll
  for (int ks = 0; ks < kChunk / 16; ++ks) {
    if (!LiveScoreBlock<kReverse>(w.orow0 / 16, ks)) continue;
    uint32_t fa[4];
    LoadA(fa, ab, L::kAPitch, w.orow0, ks * 16, w.lane);
#pragma unroll
    for (int np = 0; np < kONT<DH> / 2; ++np) {
      uint32_t fb[4];
      LoadBKN(fb, zs, L::kPitch, w.ocol0 + np * 16, ks * 16, w.lane);
      Mma(O[2 * np], fa, fb[0], fb[1]);
      Mma(O[2 * np + 1], fa, fb[2], fb[3]);
    }
  }
}

// The chunk's output rows below len as bf16 (out points at the chunk's first row of the head).
template <int DH>
__device__ __forceinline__ void StoreOut(const WarpPlace<DH>& w, const float (&O)[DH / 16][4],
                                         bf16* out, int64_t stride, int len) {
  const int r0 = w.orow0 + w.qr, r1 = r0 + 8;
#pragma unroll
  for (int j = 0; j < DH / 16; ++j) {
    const int c = w.ocol0 + 8 * j + w.qc;
    if (r0 < len) *reinterpret_cast<uint32_t*>(out + r0 * stride + c) = PackBf16(O[j][0], O[j][1]);
    if (r1 < len) *reinterpret_cast<uint32_t*>(out + r1 * stride + c) = PackBf16(O[j][2], O[j][3]);
  }
}

// One 16-token step of a state update: S (NT n-tiles from column n0) += fa times the step's rows
// of the tile bs (stored [token][column]); fa is the step's colW-scaled A fragment.
template <int DH, int NT>
__device__ __forceinline__ void UpdateStep(float (&S)[NT][4], const uint32_t (&fa)[4],
                                           const bf16* bs, int n0, int ks, int lane) {
#pragma unroll
  for (int np = 0; np < NT / 2; ++np) {
    uint32_t fb[4];
    LoadBKN(fb, bs, DH + 8, n0 + np * 16, ks * 16, lane);
    Mma(S[2 * np], fa, fb[0], fb[1]);
    Mma(S[2 * np + 1], fa, fb[2], fb[3]);
  }
}

// S = f S + (colw o Y)^T Z on the warp's state tile (S += (colw o Y)^T Z when !kDecay).
template <int DH, bool kDecay = true>
__device__ __forceinline__ void UpdateState(const WarpPlace<DH>& w,
                                            float (&S)[SweepLayout<DH, 1, 1>::kSNT][4],
                                            const bf16* ys, const bf16* zs, const float* colw,
                                            float f) {
  using L = SweepLayout<DH, 1, 1>;
  if constexpr (kDecay) {
#pragma unroll
    for (int j = 0; j < L::kSNT; ++j) S[j][0] *= f, S[j][1] *= f, S[j][2] *= f, S[j][3] *= f;
  }
#pragma unroll
  for (int ks = 0; ks < kChunk / 16; ++ks) {
    uint32_t fa[4];
    LoadAT(fa, ys, L::kPitch, w.srow0, ks * 16, w.lane);
    ScaleTokens(fa, colw, ks * 16 + w.qc);
    UpdateStep<DH>(S, fa, zs, w.scol0, ks, w.lane);
  }
}

// The warp's state tile as bf16 into sb.
template <int DH>
__device__ __forceinline__ void StateToTile(const WarpPlace<DH>& w,
                                            const float (&S)[SweepLayout<DH, 1, 1>::kSNT][4],
                                            bf16* sb) {
  using L = SweepLayout<DH, 1, 1>;
#pragma unroll
  for (int j = 0; j < L::kSNT; ++j) {
    const int r = w.srow0 + w.qr, c = w.scol0 + 8 * j + w.qc;
    *reinterpret_cast<uint32_t*>(sb + r * L::kPitch + c) = PackBf16(S[j][0], S[j][1]);
    *reinterpret_cast<uint32_t*>(sb + (r + 8) * L::kPitch + c) = PackBf16(S[j][2], S[j][3]);
  }
}

// The warp's state tile from a [DH, DH] fp32 start state (read transposed when `transpose`).
template <int DH>
__device__ __forceinline__ void LoadStartState(const WarpPlace<DH>& w,
                                               float (&S)[SweepLayout<DH, 1, 1>::kSNT][4],
                                               const float* p0, bool transpose) {
  using L = SweepLayout<DH, 1, 1>;
#pragma unroll
  for (int j = 0; j < L::kSNT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = w.srow0 + w.qr + (e >> 1) * 8, c = w.scol0 + 8 * j + w.qc + (e & 1);
      S[j][e] = transpose ? p0[c * DH + r] : p0[r * DH + c];
    }
  }
}

// kBufs: Y buffers. Main passes: 1 fetches the next chunk's X once the scores and X S are done
// and its Y and Z after a third barrier; 2 fetches the next chunk's Y into the second buffer at
// the start of the chunk and the chunk's own Z then too (waited for at the second barrier), so
// no third barrier. State-only passes: 3 Y and Z buffers, two chunks ahead, one barrier a chunk.
template <int DH, bool kReverse, bool kStateOnly, int kBufs>
__global__ void __launch_bounds__(kThreads, 2) SweepKernel(SweepArgs a) {
  static_assert(kStateOnly ? kBufs == 3 : kBufs == 1 || kBufs == 2, "Y/Z buffers");
  constexpr int kZBufs = kStateOnly ? kBufs : 1;
  using L = SweepLayout<DH, kBufs, kZBufs>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* ys0 = reinterpret_cast<bf16*>(smem + L::kY);
  bf16* zs0 = reinterpret_cast<bf16*>(smem + L::kZ);
  SweepInfo* infos = reinterpret_cast<SweepInfo*>(smem + L::kInfo);
  float* dec = DecayTable(smem + L::kDec);
  bf16* xs = reinterpret_cast<bf16*>(smem + L::kX);
  bf16* sb = reinterpret_cast<bf16*>(smem + L::kS);
  bf16* ab = reinterpret_cast<bf16*>(smem + L::kA);

  const BlockChunks<DH, kReverse> b(a.chunks_per_block, a.n_chunks, a.T);
  const int g = b.g, h = b.h, count = b.count;
  const WarpPlace<DH> w;

  FillDecay(a.log_decay[h], dec);
  // Chunk n's tile of Y or Z (Y: buffer n % kBufs, Z: n % kZBufs).
  auto load_y = [&](int n) { b.Load(ys0 + (n % kBufs) * L::kTile, a.y, a.y_stride, n); };
  auto load_z = [&](int n) { b.Load(zs0 + (n % kZBufs) * L::kTile, a.z, a.z_stride, n); };
  auto load_yz = [&](int n) { load_y(n), load_z(n); };
  // The first chunks' tiles (chunk 0's X too).
  load_yz(0);
  if constexpr (!kStateOnly) b.Load(xs, a.x, a.x_stride, 0);
  if constexpr (kBufs == 3) {
    CpAsyncCommit();
    if (count > 1) load_yz(1);
    CpAsyncCommit();
  }

  float S[L::kSNT][4];
  const int64_t state_off = (static_cast<int64_t>(h) * a.G + g) * DH * DH;
  if constexpr (kStateOnly) {
#pragma unroll
    for (int j = 0; j < L::kSNT; ++j) S[j][0] = S[j][1] = S[j][2] = S[j][3] = 0.0f;
  } else {
    LoadStartState<DH>(w, S, a.start + state_off, a.transpose_start);
    StateToTile<DH>(w, S, sb);
  }
  // The state-only passes weight each token by its decay to the block's end (ComputeStateWeights).
  const int first = b.first * kChunk, last = min(a.T, (b.first + count) * kChunk) - 1;
  const int s_last = kStateOnly ? SegmentStart(a.cu, a.n_seg, last) : 0;
  auto info = [&](int n) {
    if constexpr (kStateOnly) {
      ComputeStateWeights<kReverse>(infos[n & 1], a.log_decay[h], a.cu, a.n_seg, b.Token0(n), a.T,
                                    a.scale, first, last, s_last);
    } else {
      ComputeInfo(infos[n & 1], dec, a.cu, a.n_seg, b.Token0(n), a.T, a.scale);
    }
  };
  __syncthreads();  // dec
  info(0);

  for (int n = 0; n < count; ++n) {
    const int c0 = b.Token0(n);
    if constexpr (kBufs == 3) {
      CpAsyncWait<1>();  // one group per chunk: chunk n + 1's may stay in flight
    } else {
      CpAsyncWaitAll();
    }
    __syncthreads();  // B1: this chunk's tiles, info and the bf16 state are in place
    const SweepInfo& ci = infos[n & 1];
    bf16* ys = ys0 + (n % kBufs) * L::kTile;
    bf16* zs = zs0 + (n % kZBufs) * L::kTile;
    if (n + 1 < count) info(n + 1);
    // The tiles fetched now go where chunk n - 1's were, which every warp finished before this
    // chunk's first barrier.
    if constexpr (kBufs == 3) {
      if (n + 2 < count) load_yz(n + 2);
      CpAsyncCommit();  // possibly empty: keeps one group per chunk
    } else if constexpr (kBufs == 2) {
      if (n > 0) load_z(n);  // chunk 0's came with its X and Y
      CpAsyncCommit();
      if (n + 1 < count) load_y(n + 1);
      CpAsyncCommit();
    }
    const float* roww = kReverse ? ci.kw : ci.qw;
    const float* colw = kReverse ? ci.qw : ci.kw;

    // State: S = f S + (colW o Y)^T Z (the main passes skip it after their last chunk); the
    // state-only passes' S += (colW o Y)^T Z, colW already the decay to the block's end.
    if constexpr (kStateOnly) {
      UpdateState<DH, false>(w, S, ys, zs, colw, 1.0f);
    } else {
      float O[kONT<DH>][4];
      ScoresToTile<DH, kReverse>(w, xs, ys, ab, ci, dec, a.scale);
      InterChunk<DH, false>(w, O, xs, sb, roww);
      if constexpr (kBufs == 2) CpAsyncWait<1>();  // this chunk's Z (the next Y may stay)
      __syncthreads();  // B2: scores exchanged; every warp is done with X and the bf16 state
      if (n + 1 < count) b.Load(xs, a.x, a.x_stride, n + 1);
      IntraChunk<DH, kReverse>(w, O, ab, zs);
      StoreOut<DH>(w, O, a.out + static_cast<int64_t>(c0) * a.out_stride + b.hoff, a.out_stride,
                   ci.len);
      if (n + 1 < count) {
        UpdateState<DH>(w, S, ys, zs, colw, ci.f);
        StateToTile<DH>(w, S, sb);
      }
      if constexpr (kBufs == 1) {
        __syncthreads();  // B3: every warp is done with Y and Z
        if (n + 1 < count) load_yz(n + 1);
      }
    }
  }

  if constexpr (kStateOnly) {
    float* out = a.U + state_off;
#pragma unroll
    for (int j = 0; j < L::kSNT; ++j) {
      const int r = w.srow0 + w.qr, c = w.scol0 + 8 * j + w.qc;
      *reinterpret_cast<float2*>(out + r * DH + c) = make_float2(S[j][0], S[j][1]);
      *reinterpret_cast<float2*>(out + (r + 8) * DH + c) = make_float2(S[j][2], S[j][3]);
    }
    // The product of the chunks' f: the decay over the block when one segment runs through it.
    if (threadIdx.x == 0 && a.F != nullptr) {
      a.F[h * a.G + g] = s_last < first || s_last == 0
                             ? expf(static_cast<float>(last - first + 1) * a.log_decay[h])
                             : 0.0f;
    }
  }
}

// ---- The main sweep with the state held transposed (Dh = 128) ----------------------------------
// The main passes' recurrence with each warp holding 16 rows of R = S^T (value rows v0 = 16 warp
// .. v0 + 15, every key column: 64 fp32 registers) instead of 16 rows of S. The inter-chunk
// product then runs transposed, O^T = R X^T, with R's bf16 fragments as the A operand straight
// from registers (an m16n8 accumulator tile is laid out as an m16k8 A half), so no bf16 copy of
// the state goes through shared memory. O^T += Z^T (Mask o X Y^T)^T and the update
// R = f R + Z^T diag(colW) Y share each 16-token step's Z^T fragment, and every warp does the same
// intra-chunk work (all 64 tokens of its value rows). The output leaves through a staging tile
// (stmatrix.trans) and is copied out with 16-byte stores at the start of the next chunk. Tiles and
// barriers as SweepKernel's stages == 2: Y double-buffered, two barriers a chunk.
struct SweepTLayout {
  static constexpr int DH = 128;
  using L = SweepLayout<DH, 1, 1>;
  static constexpr int kY = 0;  // two buffers
  static constexpr int kZ = kY + 2 * L::kTile * 2;
  static constexpr int kX = kZ + L::kTile * 2;
  static constexpr int kO = kX + L::kTile * 2;  // output staging [64, DH]
  static constexpr int kA = kO + L::kTile * 2;
  static constexpr int kInfo = kA + kChunk * L::kAPitch * 2;
  static constexpr int kDec = kInfo + 2 * static_cast<int>(sizeof(SweepInfo));
  static constexpr int kBytes = kDec + kDecayTable * 4;
};

// O^T[v0.., t] = roww[t] sum_k R[v, k] X[t, k]: R's bf16 fragments as A, X from its tile as B.
template <int DH>
__device__ __forceinline__ void InterChunkT(float (&O)[kChunk / 8][4], const float (&R)[DH / 8][4],
                                            const bf16* xs, const float* roww, int lane) {
  using L = SweepLayout<DH, 1, 1>;
#pragma unroll
  for (int j = 0; j < kChunk / 8; ++j) O[j][0] = O[j][1] = O[j][2] = O[j][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < DH / 16; ++kk) {
    const uint32_t fa[4] = {
        PackBf16(R[2 * kk][0], R[2 * kk][1]), PackBf16(R[2 * kk][2], R[2 * kk][3]),
        PackBf16(R[2 * kk + 1][0], R[2 * kk + 1][1]), PackBf16(R[2 * kk + 1][2], R[2 * kk + 1][3])};
#pragma unroll
    for (int nb = 0; nb < kChunk / 16; ++nb) {
      uint32_t fb[4];
      LoadBNK(fb, xs, L::kPitch, nb * 16, kk * 16, lane);
      Mma(O[2 * nb], fa, fb[0], fb[1]);
      Mma(O[2 * nb + 1], fa, fb[2], fb[3]);
    }
  }
  const int qc = (lane & 3) * 2;
#pragma unroll
  for (int j = 0; j < kChunk / 8; ++j) {
    const float w0 = roww[8 * j + qc], w1 = roww[8 * j + qc + 1];
    O[j][0] *= w0, O[j][1] *= w1, O[j][2] *= w0, O[j][3] *= w1;
  }
}

// O^T += Z^T (masked scores)^T over the exchange tile's live blocks and, when `update`,
// R = f R + Z^T diag(colw) Y, one Z^T fragment per 16-token step for both.
template <int DH, bool kReverse>
__device__ __forceinline__ void IntraAndUpdateT(float (&O)[kChunk / 8][4], float (&R)[DH / 8][4],
                                                const bf16* zs, const bf16* ab, const bf16* ys,
                                                const float* colw, float f, bool update, int v0,
                                                int lane) {
  using L = SweepLayout<DH, 1, 1>;
  if (update) {
#pragma unroll
    for (int j = 0; j < DH / 8; ++j) R[j][0] *= f, R[j][1] *= f, R[j][2] *= f, R[j][3] *= f;
  }
  const int qc = (lane & 3) * 2;
#pragma unroll
  for (int ks = 0; ks < kChunk / 16; ++ks) {
    uint32_t fa[4];
    LoadAT(fa, zs, L::kPitch, v0, ks * 16, lane);
#pragma unroll
    for (int nb = 0; nb < kChunk / 16; ++nb) {
      if (!LiveScoreBlock<kReverse>(nb, ks)) continue;
      uint32_t fb[4];
      LoadBNK(fb, ab, L::kAPitch, nb * 16, ks * 16, lane);
      Mma(O[2 * nb], fa, fb[0], fb[1]);
      Mma(O[2 * nb + 1], fa, fb[2], fb[3]);
    }
    if (!update) continue;
    ScaleTokens(fa, colw, ks * 16 + qc);
    UpdateStep<DH>(R, fa, ys, 0, ks, lane);
  }
}

template <bool kReverse>
__global__ void __launch_bounds__(kThreads, 2) SweepTKernel(SweepArgs a) {
  constexpr int DH = 128;
  using L = SweepLayout<DH, 1, 1>;
  using T = SweepTLayout;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* ys0 = reinterpret_cast<bf16*>(smem + T::kY);
  bf16* zs = reinterpret_cast<bf16*>(smem + T::kZ);
  bf16* xs = reinterpret_cast<bf16*>(smem + T::kX);
  bf16* os = reinterpret_cast<bf16*>(smem + T::kO);
  bf16* ab = reinterpret_cast<bf16*>(smem + T::kA);
  SweepInfo* infos = reinterpret_cast<SweepInfo*>(smem + T::kInfo);
  float* dec = DecayTable(smem + T::kDec);

  const BlockChunks<DH, kReverse> b(a.chunks_per_block, a.n_chunks, a.T);
  const int g = b.g, h = b.h, count = b.count;
  if (count <= 0) return;
  const WarpPlace<DH> w;  // its state rows srow0.. are this warp's value rows of R = S^T
  // Chunk n's output rows (its info buffer is refilled for chunk n + 2 before they are copied).
  auto copy_out = [&](int n) {
    CopyOutT<DH>(os, a.out + b.Token0(n) * a.out_stride + b.hoff, a.out_stride, b.Len(n));
  };

  FillDecay(a.log_decay[h], dec);
  b.Load(ys0, a.y, a.y_stride, 0), b.Load(zs, a.z, a.z_stride, 0), b.Load(xs, a.x, a.x_stride, 0);
  // R[j][e]: value row srow0 + qr + 8 (e >> 1), key column 8 j + qc + (e & 1); R = S^T, so the
  // start state is read the other way round.
  float R[DH / 8][4];
  LoadStartState<DH>(w, R, a.start + (static_cast<int64_t>(h) * a.G + g) * DH * DH,
                     !a.transpose_start);
  __syncthreads();  // dec
  ComputeInfo(infos[0], dec, a.cu, a.n_seg, b.Token0(0), a.T, a.scale);

  for (int n = 0; n < count; ++n) {
    const bool more = n + 1 < count;
    CpAsyncWaitAll();
    __syncthreads();  // B1: X and Y of this chunk, info, the previous chunk's staged output
    const SweepInfo& ci = infos[n & 1];
    if (more) ComputeInfo(infos[(n + 1) & 1], dec, a.cu, a.n_seg, b.Token0(n + 1), a.T, a.scale);
    if (n > 0) copy_out(n - 1);
    // Z of this chunk (chunk 0's came with its X and Y) and Y of the next, into the buffer chunk
    // n - 1's Y left (read for the last time before B1).
    if (n > 0) b.Load(zs, a.z, a.z_stride, n);
    CpAsyncCommit();
    if (more) b.Load(ys0 + ((n + 1) & 1) * L::kTile, a.y, a.y_stride, n + 1);
    CpAsyncCommit();
    const bf16* ys = ys0 + (n & 1) * L::kTile;
    const float* roww = kReverse ? ci.kw : ci.qw;
    const float* colw = kReverse ? ci.qw : ci.kw;
    float O[kChunk / 8][4];
    ScoresToTile<DH, kReverse>(w, xs, ys, ab, ci, dec, a.scale);
    InterChunkT<DH>(O, R, xs, roww, w.lane);
    CpAsyncWait<1>();  // this chunk's Z (the next Y may stay in flight)
    __syncthreads();   // B2: scores exchanged; X done; the staging tile read
    if (more) b.Load(xs, a.x, a.x_stride, n + 1);
    IntraAndUpdateT<DH, kReverse>(O, R, zs, ab, ys, colw, ci.f, more, w.srow0, w.lane);
    StageOutT<DH>(O, os, w.srow0, w.lane);
  }
  __syncthreads();
  copy_out(count - 1);
}

template <bool kReverse>
Status LaunchSweepTT(const SweepArgs& a, cudaStream_t stream) {
  return LaunchOverBlocks(SweepTKernel<kReverse>, a, kThreads, SweepTLayout::kBytes, stream);
}

// ---- The fused dk / dv reverse sweep --------------------------------------------------------
// One reverse pass over a block's chunks carrying dS (the state gradient, as the dv sweep does):
//   dk = diag(kw) V dS^T + (Mask^T o V dO^T) Q
//   dv = diag(kw) K dS   + (Mask^T o K Q^T) dO,       dS = f dS + (qw o Q)^T dO
// Four tiles per chunk (q, k, v, dO) instead of six, one state update instead of two. Shared
// memory at DH=128: 4 tiles, the bf16 state, the score tile, info: 115,348 bytes, so two blocks
// still share an SM. Five barriers per chunk; the next chunk's v is fetched once the dk scores
// are done, k and q once the dv scores and the state update (in registers) are, dO last.
template <int DH>
struct DkDvLayout {
  using L = SweepLayout<DH, 1, 1>;
  static constexpr int kQ = 0;
  static constexpr int kO = kQ + L::kTile * 2;
  static constexpr int kV = kO + L::kTile * 2;
  static constexpr int kK = kV + L::kTile * 2;
  static constexpr int kS = kK + L::kTile * 2;
  static constexpr int kA = kS + DH * L::kPitch * 2;
  static constexpr int kInfo = kA + kChunk * L::kAPitch * 2;
  static constexpr int kDec = kInfo + 2 * static_cast<int>(sizeof(SweepInfo));
  static constexpr int kBytes = kDec + kDecayTable * 4;
};

// kTransposedDk (Dh = 128, the default there): dk's half runs as the transposed sweep does. The
// warp's 16 rows of dS are the A operand of dk^T = dS V^T straight from registers; dk^T +=
// Q^T (Mask^T o V dO^T)^T and the update dS = f dS + (qw o Q)^T dO share each step's Q^T
// fragment; dk leaves through the V tile as staging (V is done by then, so the next chunk's V is
// fetched with K and Q). dv keeps the bf16 copy of dS (dv^T would need dS^T by rows).
template <int DH, bool kTransposedDk>
__global__ void __launch_bounds__(kThreads, 2) DkDvKernel(DkDvArgs a) {
  using L = SweepLayout<DH, 1, 1>;
  using D = DkDvLayout<DH>;
  static_assert(!kTransposedDk || L::kColGroups == 1, "dk^T needs whole rows of dS per warp");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem + D::kQ);
  bf16* os = reinterpret_cast<bf16*>(smem + D::kO);
  bf16* vs = reinterpret_cast<bf16*>(smem + D::kV);
  bf16* ks = reinterpret_cast<bf16*>(smem + D::kK);
  bf16* sb = reinterpret_cast<bf16*>(smem + D::kS);
  bf16* ab = reinterpret_cast<bf16*>(smem + D::kA);
  SweepInfo* infos = reinterpret_cast<SweepInfo*>(smem + D::kInfo);
  float* dec = DecayTable(smem + D::kDec);

  // Compile-time tile loads with the stride opaque per call (see LoadTileAsync).
  const BlockChunks<DH, /*kReverse=*/true, /*kOpaqueStride=*/true> b(a.chunks_per_block,
                                                                    a.n_chunks, a.T);
  const int g = b.g, h = b.h, count = b.count;
  if (count <= 0) return;
  const WarpPlace<DH> w;

  FillDecay(a.log_decay[h], dec);
  b.Load(qs, a.q, a.qkv_stride, 0), b.Load(os, a.dout, a.dout_stride, 0);
  b.Load(vs, a.v, a.qkv_stride, 0), b.Load(ks, a.k, a.qkv_stride, 0);
  float S[L::kSNT][4];
  LoadStartState<DH>(w, S, a.dS + (static_cast<int64_t>(h) * a.G + g) * DH * DH, false);
  StateToTile<DH>(w, S, sb);
  __syncthreads();  // dec
  ComputeInfo(infos[0], dec, a.cu, a.n_seg, b.Token0(0), a.T, a.scale);

  for (int n = 0; n < count; ++n) {
    const int c0 = b.Token0(n);
    const bool more = n + 1 < count;
    CpAsyncWaitAll();
    __syncthreads();  // B1: this chunk's tiles, info and the bf16 state are in place
    const SweepInfo& ci = infos[n & 1];
    if (more) ComputeInfo(infos[(n + 1) & 1], dec, a.cu, a.n_seg, b.Token0(n + 1), a.T, a.scale);
    const int64_t row = static_cast<int64_t>(c0) * a.qkv_stride + b.hoff;
    // dk (X = v, Y = dO, Z = q, state dS^T).
    ScoresToTile<DH, true>(w, vs, os, ab, ci, dec, a.scale);
    if constexpr (kTransposedDk) {
      float OT[kChunk / 8][4];
      InterChunkT<DH>(OT, S, vs, ci.kw, w.lane);
      __syncthreads();  // B2: scores exchanged; v done
      IntraAndUpdateT<DH, true>(OT, S, qs, ab, os, ci.qw, ci.f, more, w.srow0, w.lane);
      StageOutT<DH>(OT, vs, w.srow0, w.lane);
      __syncthreads();  // B3: dk staged in the v tile; every warp is done with the score tile
      CopyOutT<DH>(vs, a.dk + row, a.qkv_stride, ci.len);
    } else {
      float O[kONT<DH>][4];
      InterChunk<DH, true>(w, O, vs, sb, ci.kw);
      __syncthreads();  // B2: scores exchanged; v done
      if (more) b.Load(vs, a.v, a.qkv_stride, n + 1);
      IntraChunk<DH, true>(w, O, ab, qs);
      StoreOut<DH>(w, O, a.dk + row, a.qkv_stride, ci.len);
      __syncthreads();  // B3: every warp is done with the score tile
    }
    // dv (X = k, Y = q, Z = dO, state dS, read from the bf16 copy), and the state update in
    // registers (the transposed dk did it already), the last use of q.
    float O[kONT<DH>][4];
    ScoresToTile<DH, true>(w, ks, qs, ab, ci, dec, a.scale);
    if constexpr (!kTransposedDk) {
      if (more) UpdateState<DH>(w, S, qs, os, ci.qw, ci.f);
    }
    InterChunk<DH, false>(w, O, ks, sb, ci.kw);
    __syncthreads();  // B4: scores exchanged; k, q, the bf16 state (and the staged dk) done
    if (more) {
      b.Load(ks, a.k, a.qkv_stride, n + 1), b.Load(qs, a.q, a.qkv_stride, n + 1);
      if constexpr (kTransposedDk) b.Load(vs, a.v, a.qkv_stride, n + 1);
    }
    IntraChunk<DH, true>(w, O, ab, os);
    StoreOut<DH>(w, O, a.dv + row, a.qkv_stride, ci.len);
    if (more) StateToTile<DH>(w, S, sb);
    __syncthreads();  // B5: every warp is done with dO and the score tile
    if (more) b.Load(os, a.dout, a.dout_stride, n + 1);
  }
}

template <int DH, bool kReverse, bool kStateOnly, int kBufs>
Status LaunchSweepT(const SweepArgs& a, cudaStream_t stream) {
  using L = SweepLayout<DH, kBufs, kStateOnly ? kBufs : 1>;
  constexpr int kSmem = kStateOnly ? L::kStateOnlyBytes : L::kMainBytes;
  return LaunchOverBlocks(SweepKernel<DH, kReverse, kStateOnly, kBufs>, a, kThreads, kSmem, stream);
}

template <int DH>
Status LaunchSweepDh(const SweepArgs& a, bool reverse, bool state_only, cudaStream_t stream) {
  if (state_only) {
    return reverse ? LaunchSweepT<DH, true, true, 3>(a, stream)
                   : LaunchSweepT<DH, false, true, 3>(a, stream);
  }
  if (a.stages != 1) {
    return reverse ? LaunchSweepT<DH, true, false, 2>(a, stream)
                   : LaunchSweepT<DH, false, false, 2>(a, stream);
  }
  return reverse ? LaunchSweepT<DH, true, false, 1>(a, stream)
                 : LaunchSweepT<DH, false, false, 1>(a, stream);
}

template <int DH, bool kTransposedDk>
Status LaunchDkDvT(const DkDvArgs& a, cudaStream_t stream) {
  return LaunchOverBlocks(DkDvKernel<DH, kTransposedDk>, a, kThreads, DkDvLayout<DH>::kBytes,
                          stream);
}

}  // namespace

Status LaunchDkDv(int dh, const DkDvArgs& a, cudaStream_t stream) {
  if (dh == 64) return LaunchDkDvT<64, false>(a, stream);
  if (dh == 128) {
    return a.transposed_dk ? LaunchDkDvT<128, true>(a, stream) : LaunchDkDvT<128, false>(a, stream);
  }
  return {StatusCode::kUnsupported, "Lightning: unsupported head size Dh=" + std::to_string(dh)};
}

Status LaunchSweep(int dh, bool reverse, bool state_only, const SweepArgs& a,
                   cudaStream_t stream) {
  if (a.wgmma_ws && !state_only) return LaunchWgmmaWs(reverse, a, stream);  // Dh = 128 only
  if (a.wgmma) return LaunchWgmmaSweep(reverse, state_only, a, stream);  // Dh = 128 only
  if (a.transposed_state && dh == 128 && !state_only) {
    return reverse ? LaunchSweepTT<true>(a, stream) : LaunchSweepTT<false>(a, stream);
  }
  if (dh == 64) return LaunchSweepDh<64>(a, reverse, state_only, stream);
  if (dh == 128) return LaunchSweepDh<128>(a, reverse, state_only, stream);
  return {StatusCode::kUnsupported, "Lightning: unsupported head size Dh=" + std::to_string(dh)};
}

}  // namespace spindle::kernels::cuda::internal::lightning
