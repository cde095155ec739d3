// Lightning on CUDA: the backward main pass and LightningBackward. Per head and block of chunks:
// a forward sweep carries the state S (from the forward scan) and writes dq; a reverse sweep
// carries the state gradient dS (from the reverse scan) and writes dk and dv.
#include "kernels/cuda/lightning_common.cuh"

namespace spindle::kernels::cuda::internal::lightning {
namespace {

struct BwdArgs {
  const bf16 *q, *k, *v, *dout;
  int64_t stride;  // q, k, v, dq, dk, dv
  bf16 *dq, *dk, *dv;
  const float* log_decay;
  const int32_t* cu;
  int n_seg, T, H;
  float scale;
  int chunks_per_block, n_chunks, G;
  const float* P;   // [H, G, DH, DH] state entering each block
  const float* dE;  // [H, G, DH, DH] state gradient leaving each block
};

template <int DH>
__global__ void __launch_bounds__(kThreads) BwdKernel(BwdArgs a) {
  using P = Pitch<DH>;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* p = smem;
  bf16* qs = reinterpret_cast<bf16*>(p);
  bf16* ks = qs + kChunk * P::kRow;
  bf16* vs = ks + kChunk * P::kRow;
  bf16* gs = vs + kChunk * P::kRow;  // dout
  bf16* xd = gs + kChunk * P::kRow;  // kw * k (sweep 1) or qw * q (sweep 2)
  p += 5 * P::kRowsBytes;
  bf16* sb = reinterpret_cast<bf16*>(p);  // S (sweep 1) or dS (sweep 2), bf16
  p += P::kStateBytes;
  float* af = reinterpret_cast<float*>(p);
  p += P::kScoreFBytes;
  float* bf = reinterpret_cast<float*>(p);
  p += P::kScoreFBytes;
  bf16* ab = reinterpret_cast<bf16*>(p);
  p += P::kScoreBBytes;
  bf16* bb = reinterpret_cast<bf16*>(p);
  p += P::kScoreBBytes;
  float* scratch = reinterpret_cast<float*>(p) + (threadIdx.x >> 5) * 256;
  p += P::kScratchBytes;
  auto& ci = *reinterpret_cast<ChunkInfo*>(p);
  float* dec = reinterpret_cast<float*>(p + sizeof(ChunkInfo));

  const int g = blockIdx.x, h = blockIdx.y, warp = threadIdx.x >> 5;
  const int64_t ldo = static_cast<int64_t>(a.H) * DH;
  FillDecay(a.log_decay[h], dec);
  const int first = g * a.chunks_per_block;
  const int count = min(a.chunks_per_block, a.n_chunks - first);
  const int orow = warp / 2, ocol0 = (warp % 2) * P::kOutTiles;
  const int64_t state_off = (static_cast<int64_t>(h) * a.G + g) * DH * DH;

  Acc S[P::kStateTiles];
  auto load_state = [&](const float* src) {
    for (int i = 0; i < P::kStateTiles; ++i) {
      const int idx = warp * P::kStateTiles + i;
      const int tr = idx / (DH / 16), tc = idx % (DH / 16);
      wmma::load_matrix_sync(S[i], src + tr * 16 * DH + tc * 16, DH, wmma::mem_row_major);
    }
    StateToSmem<DH>(S, scratch, sb);
  };
  // S = f S + X^T Y over the chunk, then its bf16 copy.
  auto advance_state = [&](const bf16* x, const bf16* y, float f) {
    for (int i = 0; i < P::kStateTiles; ++i) {
      const int idx = warp * P::kStateTiles + i;
      const int tr = idx / (DH / 16), tc = idx % (DH / 16);
      for (int e = 0; e < S[i].num_elements; ++e) S[i].x[e] *= f;
      Mma<FragAT, FragB>(S[i], x + tr * 16, P::kRow, 16 * P::kRow, y + tc * 16, P::kRow,
                         16 * P::kRow, kChunk / 16);
    }
    StateToSmem<DH>(S, scratch, sb);
  };
  // Two 16x16 score tiles per warp: dst = X Y^T over DH.
  auto scores = [&](const bf16* x, const bf16* y, float* dst) {
    for (int t = 2 * warp; t < 2 * warp + 2; ++t) {
      const int tr = t / 4, tc = t % 4;
      Acc s;
      wmma::fill_fragment(s, 0.0f);
      Mma<FragA, FragBT>(s, x + tr * 16 * P::kRow, P::kRow, 16, y + tc * 16 * P::kRow, P::kRow,
                         16, DH / 16);
      wmma::store_matrix_sync(dst + tr * 16 * P::kScoreF + tc * 16, s, P::kScoreF,
                              wmma::mem_row_major);
    }
  };

  // ---- Sweep 1 (forward): dq = diag(qw) dO S^T + Bm K, Bm = mask(dO V^T).
  load_state(a.P + state_off);
  for (int n = 0; n < count; ++n) {
    const int c0 = (first + n) * kChunk;
    __syncthreads();
    SetupChunk(ci, dec, a.cu, a.n_seg, c0, a.T, a.scale);
    const int64_t base = static_cast<int64_t>(c0) * a.stride + h * DH;
    LoadRows<DH>(ks, a.k + base, a.stride, ci.len);
    LoadRows<DH>(vs, a.v + base, a.stride, ci.len);
    LoadRows<DH>(gs, a.dout + static_cast<int64_t>(c0) * ldo + h * DH, ldo, ci.len);
    __syncthreads();
    scores(gs, vs, bf);
    Acc O[P::kOutTiles];
    for (int i = 0; i < P::kOutTiles; ++i) {
      wmma::fill_fragment(O[i], 0.0f);
      // dO [rows, Dv] times S^T [Dv, Dk]: S^T as col-major B from the row-major S.
      Mma<FragA, FragBT>(O[i], gs + orow * 16 * P::kRow, P::kRow, 16,
                         sb + (ocol0 + i) * 16 * P::kRow, P::kRow, 16, DH / 16);
    }
    ScaleRowsTo<DH>(xd, ks, ci.kw);
    __syncthreads();
    MaskScores(bf, bb, ci, dec, c0, a.scale);
    for (int i = 0; i < P::kOutTiles; ++i) ScaleAccRows(O[i], scratch, ci.qw, orow * 16);
    __syncthreads();
    for (int i = 0; i < P::kOutTiles; ++i) {
      Mma<FragA, FragB>(O[i], bb + orow * 16 * P::kScoreB, P::kScoreB, 16, ks + (ocol0 + i) * 16,
                        P::kRow, 16 * P::kRow, kChunk / 16);
      StoreAccBf16(O[i], scratch, a.dq + base + orow * 16 * a.stride + (ocol0 + i) * 16, a.stride,
                   orow * 16, ci.len, false);
    }
    if (n + 1 < count) advance_state(xd, vs, ci.f);
  }

  // ---- Sweep 2 (reverse): dk = diag(kw) V dS^T + Bm^T Q, dv = diag(kw) K dS + Am^T dO,
  // dS_in = f dS + (qw Q)^T dO.
  __syncthreads();
  load_state(a.dE + state_off);
  for (int n = count - 1; n >= 0; --n) {
    const int c0 = (first + n) * kChunk;
    __syncthreads();
    SetupChunk(ci, dec, a.cu, a.n_seg, c0, a.T, a.scale);
    const int64_t base = static_cast<int64_t>(c0) * a.stride + h * DH;
    LoadRows<DH>(qs, a.q + base, a.stride, ci.len);
    LoadRows<DH>(ks, a.k + base, a.stride, ci.len);
    LoadRows<DH>(vs, a.v + base, a.stride, ci.len);
    LoadRows<DH>(gs, a.dout + static_cast<int64_t>(c0) * ldo + h * DH, ldo, ci.len);
    __syncthreads();
    scores(qs, ks, af);
    scores(gs, vs, bf);
    Acc O[P::kOutTiles];
    for (int i = 0; i < P::kOutTiles; ++i) {
      wmma::fill_fragment(O[i], 0.0f);
      // V [rows, Dv] times dS^T [Dv, Dk].
      Mma<FragA, FragBT>(O[i], vs + orow * 16 * P::kRow, P::kRow, 16,
                         sb + (ocol0 + i) * 16 * P::kRow, P::kRow, 16, DH / 16);
      ScaleAccRows(O[i], scratch, ci.kw, orow * 16);
    }
    ScaleRowsTo<DH>(xd, qs, ci.qw);
    __syncthreads();
    MaskScores(af, ab, ci, dec, c0, a.scale);
    MaskScores(bf, bb, ci, dec, c0, a.scale);
    __syncthreads();
    for (int i = 0; i < P::kOutTiles; ++i) {
      // Bm^T [j, i] as col-major A from the row-major Bm.
      Mma<FragAT, FragB>(O[i], bb + orow * 16, P::kScoreB, 16 * P::kScoreB,
                         qs + (ocol0 + i) * 16, P::kRow, 16 * P::kRow, kChunk / 16);
      StoreAccBf16(O[i], scratch, a.dk + base + orow * 16 * a.stride + (ocol0 + i) * 16, a.stride,
                   orow * 16, ci.len, false);
    }
    for (int i = 0; i < P::kOutTiles; ++i) {
      wmma::fill_fragment(O[i], 0.0f);
      // K [rows, Dk] times dS [Dk, Dv].
      Mma<FragA, FragB>(O[i], ks + orow * 16 * P::kRow, P::kRow, 16, sb + (ocol0 + i) * 16,
                        P::kRow, 16 * P::kRow, DH / 16);
      ScaleAccRows(O[i], scratch, ci.kw, orow * 16);
      Mma<FragAT, FragB>(O[i], ab + orow * 16, P::kScoreB, 16 * P::kScoreB,
                         gs + (ocol0 + i) * 16, P::kRow, 16 * P::kRow, kChunk / 16);
      StoreAccBf16(O[i], scratch, a.dv + base + orow * 16 * a.stride + (ocol0 + i) * 16, a.stride,
                   orow * 16, ci.len, false);
    }
    if (n > 0) {
      __syncthreads();  // every warp is done reading sb
      advance_state(xd, gs, ci.f);
    }
  }
}

template <int DH>
Status LaunchBwd(const BwdArgs& a, cudaStream_t stream) {
  using P = Pitch<DH>;
  constexpr int kSmem = 5 * P::kRowsBytes + P::kStateBytes + 2 * P::kScoreFBytes +
                        2 * P::kScoreBBytes + P::kScratchBytes + kInfoBytes;
  SPINDLE_CUDA_CHECK(
      cudaFuncSetAttribute(BwdKernel<DH>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  BwdKernel<DH><<<dim3(a.G, a.H), kThreads, kSmem, stream>>>(a);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace
}  // namespace spindle::kernels::cuda::internal::lightning

namespace spindle::kernels::cuda {

using namespace internal::lightning;  // NOLINT: the private pieces of this op
using internal::bf16;

Status LightningBackward(const void* q, const void* k, const void* v, const float* log_decay,
                         const int32_t* cu_seqlens, int64_t n_segments, const float* carry_in,
                         float scale, const LightningDims& dims, const void* dout,
                         const float* d_end_state, void* dq, void* dk, void* dv,
                         float* d_carry_in, DType dtype, Workspace ws, cudaStream_t stream,
                         const LightningConfig& config) {
  SPINDLE_RETURN_IF_ERROR(CheckCommon(q, k, v, dims, dtype, "LightningBackward"));
  SPINDLE_RETURN_IF_ERROR(CheckCommon(dq, dk, dv, dims, dtype, "LightningBackward"));
  const int64_t H = dims.H, Dh = dims.Dh;
  if (dims.T == 0 || n_segments == 0) {
    if (d_carry_in != nullptr) {
      if (d_end_state != nullptr) {
        SPINDLE_CUDA_CHECK(cudaMemcpyAsync(d_carry_in, d_end_state, H * Dh * Dh * 4,
                                           cudaMemcpyDeviceToDevice, stream));
      } else {
        SPINDLE_CUDA_CHECK(cudaMemsetAsync(d_carry_in, 0, H * Dh * Dh * 4, stream));
      }
    }
    return Status::Ok();
  }
  const Plan plan = MakePlan(dims.T, H, Dh, config);
  SPINDLE_CHECK_ARG(ws.data != nullptr && ws.bytes >= LightningWorkspaceBytes(dims, config),
                    "LightningBackward: workspace too small");
  float* U = static_cast<float*>(ws.data);
  float* dU = reinterpret_cast<float*>(static_cast<char*>(ws.data) + plan.state_bytes);
  float* F = reinterpret_cast<float*>(static_cast<char*>(ws.data) + 2 * plan.state_bytes);
  const int T = static_cast<int>(dims.T);

  StateArgs sa{};
  sa.log_decay = log_decay, sa.cu = cu_seqlens, sa.n_seg = static_cast<int>(n_segments);
  sa.T = T, sa.H = static_cast<int>(H), sa.scale = scale;
  sa.chunks_per_block = plan.chunks_per_block, sa.n_chunks = plan.n_chunks, sa.G = plan.G;
  sa.x = static_cast<const bf16*>(k), sa.x_stride = dims.qkv_stride;
  sa.y = static_cast<const bf16*>(v), sa.y_stride = dims.qkv_stride;
  sa.U = U, sa.F = F;
  SPINDLE_RETURN_IF_ERROR(LaunchState(static_cast<int>(Dh), false, sa, stream));
  sa.x = static_cast<const bf16*>(q), sa.x_stride = dims.qkv_stride;
  sa.y = static_cast<const bf16*>(dout), sa.y_stride = H * Dh;
  sa.U = dU, sa.F = nullptr;
  SPINDLE_RETURN_IF_ERROR(LaunchState(static_cast<int>(Dh), true, sa, stream));

  ScanArgs sc{};
  sc.stride_g = Dh * Dh, sc.stride_h = plan.G * Dh * Dh, sc.E = Dh * Dh;
  sc.G = plan.G, sc.H = static_cast<int>(H), sc.F = F;
  sc.in = U, sc.out = U, sc.init = carry_in;
  SPINDLE_RETURN_IF_ERROR(LaunchScan(sc, stream));
  sc.in = dU, sc.out = dU, sc.init = d_end_state, sc.final_out = d_carry_in, sc.reverse = true;
  SPINDLE_RETURN_IF_ERROR(LaunchScan(sc, stream));

  BwdArgs ba{};
  ba.q = static_cast<const bf16*>(q), ba.k = static_cast<const bf16*>(k);
  ba.v = static_cast<const bf16*>(v), ba.dout = static_cast<const bf16*>(dout);
  ba.stride = dims.qkv_stride;
  ba.dq = static_cast<bf16*>(dq), ba.dk = static_cast<bf16*>(dk), ba.dv = static_cast<bf16*>(dv);
  ba.log_decay = log_decay, ba.cu = cu_seqlens, ba.n_seg = static_cast<int>(n_segments);
  ba.T = T, ba.H = static_cast<int>(H), ba.scale = scale;
  ba.chunks_per_block = plan.chunks_per_block, ba.n_chunks = plan.n_chunks, ba.G = plan.G;
  ba.P = U, ba.dE = dU;
  return Dh == 64 ? LaunchBwd<64>(ba, stream) : LaunchBwd<128>(ba, stream);
}

}  // namespace spindle::kernels::cuda
