// Lightning for small heads (Dh <= 32, e.g. the tiny preset's 16): a plain token-by-token
// recurrence, one block per head and one thread per state element S[i][j], the state in a
// register. Exact same contract as the tensor-core path (lightning.h), which needs Dh 64 or 128;
// this one is for small models and tests, where a head's state is a few hundred floats and a
// sequential sweep costs microseconds per token.
//   forward:  S_t = (t starts a segment and t > 0 ? 0 : a S_{t-1}) + k_t^T v_t, o_t = s q_t S_t,
//             S_{-1} = carry_in (or 0), end_state = S_{T-1}
//   backward: dq_t = s do_t S_t^T (forward sweep); reverse sweep with G = dS_t:
//             G += s q_t^T do_t, dk_t = G v_t, dv_t = k_t^T G, then G *= a (or 0 at a segment
//             start t > 0); d_carry_in = G after t = 0.
// Also the context-parallel carry correction for these heads (lightning.h): one thread per output
// element, with f_t = s a^(t+1):
//   forward:  o_t += f_t q_t P  (t < n)
//   backward: dq_t += f_t do_t P^T, and dP += sum_t f_t q_t^T do_t, one block per (head, row of
//             P) summing over t in a fixed order (bitwise reproducible).
#include <algorithm>

#include "kernels/cuda/lightning_common.cuh"

namespace spindle::kernels::cuda::internal::lightning {
namespace {

struct SmallArgs {
  const bf16 *q, *k, *v, *dout;
  bf16 *out, *dq, *dk, *dv;
  const float* log_decay;
  const int32_t* cu;
  int n_seg;
  const float *carry_in, *d_end_state;
  float *end_state, *d_carry_in;
  float scale;
  int T, H, Dh;
  int64_t stride;  // q, k, v (and dq, dk, dv) token stride
};

// Is t the first token of a segment other than the first one?
__device__ __forceinline__ bool ResetsAt(const int32_t* cu, int n_seg, int t) {
  return t > 0 && SegmentStart(cu, n_seg, t) == t;
}

// red[i][j] holds thread (i, j)'s term; returns the sum over i (column j) for threads j < Dh.
__device__ __forceinline__ float ColumnSum(float* red, int Dh, int j) {
  float s = 0.0f;
  for (int i = 0; i < Dh; ++i) s += red[i * (Dh + 1) + j];
  return s;
}
__device__ __forceinline__ float RowSum(float* red, int Dh, int i) {
  float s = 0.0f;
  for (int j = 0; j < Dh; ++j) s += red[i * (Dh + 1) + j];
  return s;
}

__global__ void SmallForwardKernel(SmallArgs a) {
  extern __shared__ float sm[];
  const int Dh = a.Dh, h = blockIdx.x, tid = threadIdx.x;
  const int i = tid / Dh, j = tid % Dh;
  float* qs = sm;
  float* ks = qs + Dh;
  float* vs = ks + Dh;
  float* red = vs + Dh;
  const float decay = expf(a.log_decay[h]);
  const int64_t hoff = static_cast<int64_t>(h) * Dh;
  const int64_t soff = static_cast<int64_t>(h) * Dh * Dh + i * Dh + j;
  float S = a.carry_in ? a.carry_in[soff] : 0.0f;
  for (int t = 0; t < a.T; ++t) {
    const int64_t row = t * a.stride + hoff;
    if (tid < Dh) {
      qs[tid] = __bfloat162float(a.q[row + tid]);
      ks[tid] = __bfloat162float(a.k[row + tid]);
      vs[tid] = __bfloat162float(a.v[row + tid]);
    }
    __syncthreads();
    S = (ResetsAt(a.cu, a.n_seg, t) ? 0.0f : decay * S) + ks[i] * vs[j];
    red[i * (Dh + 1) + j] = qs[i] * S;
    __syncthreads();
    if (tid < Dh)
      a.out[static_cast<int64_t>(t) * a.H * Dh + hoff + tid] =
          __float2bfloat16(a.scale * ColumnSum(red, Dh, tid));
    __syncthreads();
  }
  if (a.end_state) a.end_state[soff] = S;
}

__global__ void SmallBackwardKernel(SmallArgs a) {
  extern __shared__ float sm[];
  const int Dh = a.Dh, h = blockIdx.x, tid = threadIdx.x;
  const int i = tid / Dh, j = tid % Dh;
  float* qs = sm;
  float* ks = qs + Dh;
  float* vs = ks + Dh;
  float* ds = vs + Dh;
  float* red = ds + Dh;
  float* red2 = red + Dh * (Dh + 1);
  const float decay = expf(a.log_decay[h]);
  const int64_t hoff = static_cast<int64_t>(h) * Dh;
  const int64_t soff = static_cast<int64_t>(h) * Dh * Dh + i * Dh + j;
  // Forward sweep: dq.
  float S = a.carry_in ? a.carry_in[soff] : 0.0f;
  for (int t = 0; t < a.T; ++t) {
    const int64_t row = t * a.stride + hoff;
    if (tid < Dh) {
      ks[tid] = __bfloat162float(a.k[row + tid]);
      vs[tid] = __bfloat162float(a.v[row + tid]);
      ds[tid] = __bfloat162float(a.dout[static_cast<int64_t>(t) * a.H * Dh + hoff + tid]);
    }
    __syncthreads();
    S = (ResetsAt(a.cu, a.n_seg, t) ? 0.0f : decay * S) + ks[i] * vs[j];
    red[i * (Dh + 1) + j] = ds[j] * S;
    __syncthreads();
    if (tid < Dh) a.dq[row + tid] = __float2bfloat16(a.scale * RowSum(red, Dh, tid));
    __syncthreads();
  }
  // Reverse sweep: dk, dv.
  float Gs = a.d_end_state ? a.d_end_state[soff] : 0.0f;
  for (int t = a.T - 1; t >= 0; --t) {
    const int64_t row = t * a.stride + hoff;
    if (tid < Dh) {
      qs[tid] = __bfloat162float(a.q[row + tid]);
      ks[tid] = __bfloat162float(a.k[row + tid]);
      vs[tid] = __bfloat162float(a.v[row + tid]);
      ds[tid] = __bfloat162float(a.dout[static_cast<int64_t>(t) * a.H * Dh + hoff + tid]);
    }
    __syncthreads();
    Gs += a.scale * qs[i] * ds[j];
    red[i * (Dh + 1) + j] = Gs * vs[j];   // dk_t[i] = sum_j G[i][j] v[j]
    red2[i * (Dh + 1) + j] = ks[i] * Gs;  // dv_t[j] = sum_i k[i] G[i][j]
    __syncthreads();
    if (tid < Dh) {
      a.dk[row + tid] = __float2bfloat16(RowSum(red, Dh, tid));
      a.dv[row + tid] = __float2bfloat16(ColumnSum(red2, Dh, tid));
    }
    Gs = ResetsAt(a.cu, a.n_seg, t) ? 0.0f : decay * Gs;
    __syncthreads();
  }
  if (a.d_carry_in) a.d_carry_in[soff] = Gs;
}

struct SmallCarryArgs {
  const bf16* src;  // forward: q (stride src_stride); backward: dout
  int64_t src_stride;
  bf16* dst;  // forward: out; backward: dq (accumulated)
  int64_t dst_stride;
  const bf16 *q, *dout;  // dP: q (stride q_stride), dout (dense [n, H, Dh])
  int64_t q_stride;
  const float *P, *log_decay;
  float* dP;
  float scale;
  int n, H, Dh;
};

// dst[t, h, c] += f_t sum_r src[t, h, r] M[r][c], where M = P (forward) or P^T (backward).
template <bool kTransposeP>
__global__ void SmallCarryKernel(SmallCarryArgs a) {
  const int64_t total = static_cast<int64_t>(a.n) * a.H * a.Dh;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(e % a.Dh), h = static_cast<int>((e / a.Dh) % a.H);
    const int64_t t = e / (static_cast<int64_t>(a.Dh) * a.H);
    const float f = a.scale * expf(static_cast<float>(t + 1) * a.log_decay[h]);
    const bf16* x = a.src + t * a.src_stride + static_cast<int64_t>(h) * a.Dh;
    const float* P = a.P + static_cast<int64_t>(h) * a.Dh * a.Dh;
    float acc = 0.0f;
    for (int r = 0; r < a.Dh; ++r)
      acc += __bfloat162float(x[r]) * (kTransposeP ? P[c * a.Dh + r] : P[r * a.Dh + c]);
    bf16* y = a.dst + t * a.dst_stride + static_cast<int64_t>(h) * a.Dh + c;
    *y = __float2bfloat16(__bfloat162float(*y) + f * acc);
  }
}

constexpr int kCarryThreads = 256;

// Block (h, r): dP[h][r][c] += sum_t f_t q[t, h, r] dout[t, h, c] for every c; each thread sums
// its tokens, then the block adds the threads' partial sums in thread order.
__global__ void SmallCarryStateGradKernel(SmallCarryArgs a) {
  __shared__ float part[kCarryThreads][33];
  const int h = blockIdx.x / a.Dh, r = blockIdx.x % a.Dh, tid = threadIdx.x;
  float acc[32];
  for (int c = 0; c < 32; ++c) acc[c] = 0.0f;
  for (int64_t t = tid; t < a.n; t += kCarryThreads) {
    const float f = a.scale * expf(static_cast<float>(t + 1) * a.log_decay[h]);
    const float qv = f * __bfloat162float(a.q[t * a.q_stride + static_cast<int64_t>(h) * a.Dh + r]);
    const bf16* d = a.dout + (t * a.H + h) * static_cast<int64_t>(a.Dh);
#pragma unroll
    for (int c = 0; c < 32; ++c)
      if (c < a.Dh) acc[c] += qv * __bfloat162float(d[c]);
  }
  for (int c = 0; c < a.Dh; ++c) part[tid][c] = acc[c];
  __syncthreads();
  if (tid < a.Dh) {
    float sum = 0.0f;
    for (int i = 0; i < kCarryThreads; ++i) sum += part[i][tid];
    a.dP[(static_cast<int64_t>(h) * a.Dh + r) * a.Dh + tid] += sum;
  }
}

int CarryBlocks(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 132 * 16)));
}

}  // namespace

bool IsSmallHead(int64_t Dh) { return Dh >= 2 && Dh <= 32 && Dh % 2 == 0; }

Status SmallCarryCorrection(const void* q, const float* log_decay, const float* P, float scale,
                            const LightningDims& dims, int64_t n_tokens, void* out,
                            cudaStream_t stream) {
  SmallCarryArgs a{};
  a.src = static_cast<const bf16*>(q), a.src_stride = dims.qkv_stride;
  a.dst = static_cast<bf16*>(out), a.dst_stride = dims.H * dims.Dh;
  a.P = P, a.log_decay = log_decay, a.scale = scale;
  a.n = static_cast<int>(n_tokens), a.H = static_cast<int>(dims.H),
  a.Dh = static_cast<int>(dims.Dh);
  SmallCarryKernel<false><<<CarryBlocks(n_tokens * dims.H * dims.Dh), 256, 0, stream>>>(a);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status SmallCarryCorrectionBackward(const void* q, const float* log_decay, const float* P,
                                    float scale, const LightningDims& dims, int64_t n_tokens,
                                    const void* dout, void* dq, float* dP, cudaStream_t stream) {
  SmallCarryArgs a{};
  a.src = static_cast<const bf16*>(dout), a.src_stride = dims.H * dims.Dh;
  a.dst = static_cast<bf16*>(dq), a.dst_stride = dims.qkv_stride;
  a.q = static_cast<const bf16*>(q), a.q_stride = dims.qkv_stride;
  a.dout = static_cast<const bf16*>(dout);
  a.P = P, a.dP = dP, a.log_decay = log_decay, a.scale = scale;
  a.n = static_cast<int>(n_tokens), a.H = static_cast<int>(dims.H),
  a.Dh = static_cast<int>(dims.Dh);
  SmallCarryKernel<true><<<CarryBlocks(n_tokens * dims.H * dims.Dh), 256, 0, stream>>>(a);
  SPINDLE_CUDA_CHECK_LAUNCH();
  SmallCarryStateGradKernel<<<a.H * a.Dh, kCarryThreads, 0, stream>>>(a);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status SmallLightning(const void* q, const void* k, const void* v, const float* log_decay,
                      const int32_t* cu_seqlens, int64_t n_segments, const float* carry_in,
                      float scale, const LightningDims& dims, const void* dout,
                      const float* d_end_state, void* out, float* end_state, void* dq, void* dk,
                      void* dv, float* d_carry_in, bool backward, cudaStream_t stream) {
  SmallArgs a{};
  a.q = static_cast<const bf16*>(q), a.k = static_cast<const bf16*>(k);
  a.v = static_cast<const bf16*>(v), a.dout = static_cast<const bf16*>(dout);
  a.out = static_cast<bf16*>(out), a.dq = static_cast<bf16*>(dq);
  a.dk = static_cast<bf16*>(dk), a.dv = static_cast<bf16*>(dv);
  a.log_decay = log_decay, a.cu = cu_seqlens, a.n_seg = static_cast<int>(n_segments);
  a.carry_in = carry_in, a.d_end_state = d_end_state;
  a.end_state = end_state, a.d_carry_in = d_carry_in;
  a.scale = scale;
  a.T = static_cast<int>(dims.T), a.H = static_cast<int>(dims.H), a.Dh = static_cast<int>(dims.Dh);
  a.stride = dims.qkv_stride;
  const int threads = a.Dh * a.Dh;
  const size_t smem = (4 * a.Dh + 2 * a.Dh * (a.Dh + 1)) * sizeof(float);
  if (backward) {
    SmallBackwardKernel<<<a.H, threads, smem, stream>>>(a);
  } else {
    SmallForwardKernel<<<a.H, threads, smem, stream>>>(a);
  }
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda::internal::lightning
