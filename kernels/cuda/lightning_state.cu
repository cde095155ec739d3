// Lightning on CUDA: the scan over blocks that turns pass 1's per-block end states (forward) and
// state gradients (reverse) into every block's start state, the plan, the argument checks, and
// the CP state scan across ranks' chunks built on the same scan.
#include <algorithm>
#include <string>

#include "kernels/cuda/lightning_common.cuh"

namespace spindle::kernels::cuda::internal::lightning {
namespace {

__global__ void ScanKernel(ScanArgs a) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= a.H * a.E) return;
  const int h = static_cast<int>(idx / a.E);
  const int64_t e = idx % a.E;
  float carry = a.init != nullptr ? a.init[h * a.E + e] : 0.0f;
  const float log_a = a.log_decay != nullptr ? a.log_decay[h] : 0.0f;
  // Eight blocks' inputs are loaded before any is used: the loop is latency-bound otherwise (in
  // and out may alias, so the compiler cannot hoist the loads past the stores itself; every
  // element is read and written by this thread only).
  constexpr int kBatch = 8;
  for (int n0 = 0; n0 < a.G; n0 += kBatch) {
    float u[kBatch], f[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int n = n0 + j;
      if (n >= a.G) break;
      const int g = a.reverse ? a.G - 1 - n : n;
      f[j] = a.F != nullptr ? a.F[h * a.G + g]
                            : (a.doc_start[g] != 0 ? 0.0f
                                                   : expf(static_cast<float>(a.length[g]) * log_a));
      u[j] = a.in[g * a.stride_g + h * a.stride_h + e];
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int n = n0 + j;
      if (n >= a.G) break;
      const int g = a.reverse ? a.G - 1 - n : n;
      a.out[g * a.stride_g + h * a.stride_h + e] = carry;
      carry = u[j] + f[j] * carry;
    }
  }
  if (a.final_out != nullptr) {
    if (a.accumulate_final) {
      a.final_out[h * a.E + e] += carry;
    } else {
      a.final_out[h * a.E + e] = carry;
    }
  }
}

size_t Align256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

Status LaunchScan(const ScanArgs& a, cudaStream_t stream) {
  const int64_t n = a.H * a.E;
  if (n == 0) return Status::Ok();
  ScanKernel<<<CeilDiv(n, 256), 256, 0, stream>>>(a);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

int CurrentDeviceAttribute(cudaDeviceAttr attr, int fallback) {
  int dev = 0, value = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&value, attr, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return fallback;
  }
  return value;
}

Plan MakePlan(int64_t T, int64_t H, int64_t Dh, const LightningConfig& config) {
  Plan p{};
  p.n_chunks = static_cast<int>(CeilDiv(std::max<int64_t>(T, 1), kChunk));
  int cpb = config.chunks_per_block;
  if (cpb <= 0) {
    // Blocks run their chunks in sequence; two blocks share an SM, one with the warp-specialised
    // sweep. Pick the chunks per block that minimise waves x chunks per block, plus about two
    // chunks' worth of fixed cost per block (start state, pass-1 output, scan steps); ties go to
    // longer blocks.
    const int64_t slots = (config.sweep_kernel == 4 ? 1 : 2) *
                          CurrentDeviceAttribute(cudaDevAttrMultiProcessorCount, 132);
    int64_t best = -1;
    for (int c = 1; c <= 64; c *= 2) {
      const int64_t blocks = H * CeilDiv(p.n_chunks, c);
      const int64_t cost = CeilDiv(blocks, slots) * (c + 2);
      if (best < 0 || cost <= best) best = cost, cpb = c;
    }
  }
  p.chunks_per_block = std::clamp(cpb, 1, 64);
  p.G = static_cast<int>(CeilDiv(p.n_chunks, p.chunks_per_block));
  p.state_bytes = Align256(static_cast<size_t>(H) * p.G * Dh * Dh * 4);
  p.f_bytes = Align256(static_cast<size_t>(H) * p.G * 4);
  return p;
}

SweepArgs BaseSweepArgs(const Plan& plan, const LightningDims& dims, const LightningConfig& config,
                        const float* log_decay, const int32_t* cu_seqlens, int64_t n_segments,
                        float scale) {
  SweepArgs sa{};
  sa.log_decay = log_decay, sa.cu = cu_seqlens, sa.n_seg = static_cast<int>(n_segments);
  sa.T = static_cast<int>(dims.T), sa.H = static_cast<int>(dims.H), sa.scale = scale;
  sa.chunks_per_block = plan.chunks_per_block, sa.n_chunks = plan.n_chunks, sa.G = plan.G;
  sa.stages = config.stages, sa.wgmma = UseWgmmaSweep(dims.Dh, config);
  sa.wgmma_ws = UseWgmmaWsSweep(dims.Dh, config);
  sa.transposed_state = UseTransposedSweep(config);
  return sa;
}

ScanArgs BaseScanArgs(const Plan& plan, const LightningDims& dims, const float* F) {
  ScanArgs sc{};
  sc.stride_g = dims.Dh * dims.Dh, sc.stride_h = plan.G * dims.Dh * dims.Dh;
  sc.E = dims.Dh * dims.Dh, sc.G = plan.G, sc.H = static_cast<int>(dims.H), sc.F = F;
  return sc;
}

Status PassStateThrough(float* dst, const float* src, int64_t H, int64_t Dh, cudaStream_t stream) {
  if (dst == nullptr) return Status::Ok();
  if (src != nullptr) {
    SPINDLE_CUDA_CHECK(
        cudaMemcpyAsync(dst, src, H * Dh * Dh * 4, cudaMemcpyDeviceToDevice, stream));
  } else {
    SPINDLE_CUDA_CHECK(cudaMemsetAsync(dst, 0, H * Dh * Dh * 4, stream));
  }
  return Status::Ok();
}

Status CheckCommon(const void* q, const void* k, const void* v, const LightningDims& d,
                   DType dtype, const char* op) {
  if (dtype != DType::kBFloat16) return UnsupportedDType(dtype, op);
  if (!LightningSupportsHeadDim(d.Dh)) {
    return {StatusCode::kUnsupported,
            std::string(op) + ": unsupported head size Dh=" + std::to_string(d.Dh) +
                " (built for 64, 128 and even sizes up to 32)"};
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

size_t LightningSavedBytes(const LightningDims& dims, const LightningConfig& config) {
  if (internal::lightning::IsSmallHead(dims.Dh)) return 0;
  const auto p = internal::lightning::MakePlan(dims.T, dims.H, dims.Dh, config);
  return p.state_bytes + p.f_bytes;
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
