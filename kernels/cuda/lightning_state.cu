// Lightning on CUDA, pass 1 and the scans: per-block end states (forward) and state gradients
// (reverse), the scan over blocks that turns them into every block's start state, and the CP
// state scan across ranks' chunks built on the same scan.
#include <algorithm>
#include <string>

#include "kernels/cuda/lightning_common.cuh"

namespace spindle::kernels::cuda::internal::lightning {
namespace {

template <int DH, bool kReverse>
__global__ void __launch_bounds__(kThreads) StateKernel(StateArgs a) {
  using P = Pitch<DH>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* xs = reinterpret_cast<bf16*>(smem);
  bf16* ys = reinterpret_cast<bf16*>(smem + P::kRowsBytes);
  auto& ci = *reinterpret_cast<ChunkInfo*>(smem + 2 * P::kRowsBytes);
  float* dec = reinterpret_cast<float*>(smem + 2 * P::kRowsBytes + sizeof(ChunkInfo));

  const int g = blockIdx.x, h = blockIdx.y, warp = threadIdx.x >> 5;
  FillDecay(a.log_decay[h], dec);
  const int first = g * a.chunks_per_block;
  const int count = min(a.chunks_per_block, a.n_chunks - first);
  Acc S[P::kStateTiles];
  for (int i = 0; i < P::kStateTiles; ++i) wmma::fill_fragment(S[i], 0.0f);
  float f_prod = 1.0f;
  for (int n = 0; n < count; ++n) {
    const int c = kReverse ? first + count - 1 - n : first + n;
    const int c0 = c * kChunk;
    __syncthreads();  // previous chunk's MMAs are done with xs, ys; dec is filled
    SetupChunk(ci, dec, a.cu, a.n_seg, c0, a.T, a.scale);
    LoadRows<DH>(xs, a.x + static_cast<int64_t>(c0) * a.x_stride + h * DH, a.x_stride, ci.len);
    LoadRows<DH>(ys, a.y + static_cast<int64_t>(c0) * a.y_stride + h * DH, a.y_stride, ci.len);
    __syncthreads();
    ScaleRowsInPlace<DH>(xs, kReverse ? ci.qw : ci.kw);
    __syncthreads();
    const float f = ci.f;
    f_prod *= f;
    for (int i = 0; i < P::kStateTiles; ++i) {
      const int idx = warp * P::kStateTiles + i;
      const int tr = idx / (DH / 16), tc = idx % (DH / 16);
      for (int e = 0; e < S[i].num_elements; ++e) S[i].x[e] *= f;
      // S[tr, tc] += X^T[tr rows, tokens] Y[tokens, tc cols].
      Mma<FragAT, FragB>(S[i], xs + tr * 16, P::kRow, 16 * P::kRow, ys + tc * 16, P::kRow,
                         16 * P::kRow, kChunk / 16);
    }
  }
  float* out = a.U + (static_cast<int64_t>(h) * a.G + g) * DH * DH;
  for (int i = 0; i < P::kStateTiles; ++i) {
    const int idx = warp * P::kStateTiles + i;
    const int tr = idx / (DH / 16), tc = idx % (DH / 16);
    wmma::store_matrix_sync(out + tr * 16 * DH + tc * 16, S[i], DH, wmma::mem_row_major);
  }
  if (threadIdx.x == 0 && a.F != nullptr) a.F[h * a.G + g] = f_prod;
}

__global__ void ScanKernel(ScanArgs a) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= a.H * a.E) return;
  const int h = static_cast<int>(idx / a.E);
  const int64_t e = idx % a.E;
  float carry = a.init != nullptr ? a.init[h * a.E + e] : 0.0f;
  const float log_a = a.log_decay != nullptr ? a.log_decay[h] : 0.0f;
  for (int n = 0; n < a.G; ++n) {
    const int g = a.reverse ? a.G - 1 - n : n;
    const float f = a.F != nullptr ? a.F[h * a.G + g]
                                   : (a.doc_start[g] != 0
                                          ? 0.0f
                                          : expf(static_cast<float>(a.length[g]) * log_a));
    const int64_t off = g * a.stride_g + h * a.stride_h + e;
    const float u = a.in[off];
    a.out[off] = carry;
    carry = u + f * carry;
  }
  if (a.final_out != nullptr) {
    if (a.accumulate_final) {
      a.final_out[h * a.E + e] += carry;
    } else {
      a.final_out[h * a.E + e] = carry;
    }
  }
}

template <int DH, bool kReverse>
Status LaunchStateT(const StateArgs& a, cudaStream_t stream) {
  using P = Pitch<DH>;
  constexpr int kSmem = 2 * P::kRowsBytes + kInfoBytes;
  SPINDLE_CUDA_CHECK(cudaFuncSetAttribute(StateKernel<DH, kReverse>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  StateKernel<DH, kReverse><<<dim3(a.G, a.H), kThreads, kSmem, stream>>>(a);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

size_t Align256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

Status LaunchState(int dh, bool reverse, const StateArgs& a, cudaStream_t stream) {
  if (dh == 64) return reverse ? LaunchStateT<64, true>(a, stream) : LaunchStateT<64, false>(a, stream);
  if (dh == 128) {
    return reverse ? LaunchStateT<128, true>(a, stream) : LaunchStateT<128, false>(a, stream);
  }
  return {StatusCode::kUnsupported, "Lightning: unsupported head size Dh=" + std::to_string(dh)};
}

Status LaunchScan(const ScanArgs& a, cudaStream_t stream) {
  const int64_t n = a.H * a.E;
  if (n == 0) return Status::Ok();
  ScanKernel<<<CeilDiv(n, 256), 256, 0, stream>>>(a);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Plan MakePlan(int64_t T, int64_t H, int64_t Dh, const LightningConfig& config) {
  Plan p{};
  p.n_chunks = static_cast<int>(CeilDiv(std::max<int64_t>(T, 1), kChunk));
  int cpb = config.chunks_per_block;
  if (cpb <= 0) {
    // Enough blocks for several waves on a big GPU; fewer, longer blocks cut pass-1 work and
    // state traffic.
    const int64_t work = p.n_chunks * H;
    cpb = 1;
    while (cpb < 16 && work / (cpb * 2) >= 132 * 6) cpb *= 2;
  }
  p.chunks_per_block = std::clamp(cpb, 1, 64);
  p.G = static_cast<int>(CeilDiv(p.n_chunks, p.chunks_per_block));
  p.state_bytes = Align256(static_cast<size_t>(H) * p.G * Dh * Dh * 4);
  p.f_bytes = Align256(static_cast<size_t>(H) * p.G * 4);
  return p;
}

Status CheckCommon(const void* q, const void* k, const void* v, const LightningDims& d,
                   DType dtype, const char* op) {
  if (dtype != DType::kBFloat16) return UnsupportedDType(dtype, op);
  if (d.Dh != 64 && d.Dh != 128) {
    return {StatusCode::kUnsupported,
            std::string(op) + ": unsupported head size Dh=" + std::to_string(d.Dh) +
                " (built for 64 and 128)"};
  }
  const auto misaligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) != 0; };
  if (d.T < 0 || d.H <= 0 || d.qkv_stride % 8 != 0 || misaligned(q) || misaligned(k) ||
      misaligned(v)) {
    return {StatusCode::kInvalidArgument,
            std::string(op) + ": needs T >= 0, H > 0, qkv_stride % 8 == 0 (got " +
                std::to_string(d.qkv_stride) + ") and 16-byte aligned q, k, v"};
  }
  if (d.T >= (int64_t{1} << 31)) return {StatusCode::kInvalidArgument, std::string(op) + ": T too large"};
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda::internal::lightning

namespace spindle::kernels::cuda {

using internal::lightning::LaunchScan;
using internal::lightning::ScanArgs;

size_t LightningWorkspaceBytes(const LightningDims& dims, const LightningConfig& config) {
  const auto p = internal::lightning::MakePlan(dims.T, dims.H, dims.Dh, config);
  return 2 * p.state_bytes + p.f_bytes;
}

Status LightningStateScan(const float* S, const int32_t* doc_start, const int32_t* length,
                          const float* log_decay, int64_t C, int64_t H, int64_t Dh, float* P,
                          cudaStream_t stream) {
  SPINDLE_CHECK_ARG(C >= 0 && H > 0 && Dh > 0 && S != P, "LightningStateScan: bad arguments");
  ScanArgs a{};
  a.in = S, a.out = P;
  a.E = Dh * Dh, a.stride_h = Dh * Dh, a.stride_g = H * Dh * Dh;
  a.G = static_cast<int>(C), a.H = static_cast<int>(H);
  a.doc_start = doc_start, a.length = length, a.log_decay = log_decay;
  return LaunchScan(a, stream);
}

Status LightningStateScanBackward(const float* dP, const int32_t* doc_start,
                                  const int32_t* length, const float* log_decay, int64_t C,
                                  int64_t H, int64_t Dh, float* dS, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(C >= 0 && H > 0 && Dh > 0 && dP != dS,
                    "LightningStateScanBackward: bad arguments");
  ScanArgs a{};
  a.in = dP, a.out = dS;
  a.E = Dh * Dh, a.stride_h = Dh * Dh, a.stride_g = H * Dh * Dh;
  a.G = static_cast<int>(C), a.H = static_cast<int>(H);
  a.doc_start = doc_start, a.length = length, a.log_decay = log_decay;
  a.reverse = true;
  return LaunchScan(a, stream);
}

}  // namespace spindle::kernels::cuda
