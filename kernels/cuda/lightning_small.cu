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

}  // namespace

bool IsSmallHead(int64_t Dh) { return Dh >= 2 && Dh <= 32 && Dh % 2 == 0; }

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
