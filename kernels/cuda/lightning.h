// Lightning (linear) attention on CUDA: chunked forward and backward with per-head decay,
// document resets, carry-in and end-state, plus the context-parallel helpers (state prefix scan
// across CP chunks, the fused carry correction and their backwards). Same math and contracts as
// kernels/cpu/lightning.h, which is the reference:
//     S_t = a_h S_{t-1} + k_t^T v_t,  o_t = scale * q_t S_t,  S reset at each segment start
// (cu_seqlens), carry_in flowing into segment 0, end_state = the state after token T-1.
//
// Storage: q, k, v, out and their gradients bf16 ([T, H, Dh] views; q, k, v, dq, dk, dv with token
// stride qkv_stride, out and dout dense); log_decay [H], states [H, Dh, Dh] and their gradients
// fp32. Dh is 64 or 128 (tensor cores), or even and <= 32 (a token-by-token path for small
// models, lightning_small.cu). qkv_stride must be a multiple of 8 and pointers 16-byte aligned.
//
// Algorithm: the sequence is cut into 64-token chunks on a fixed grid (documents may start
// inside a chunk: masks handle them); a block owns `chunks_per_block` consecutive chunks of one
// head. Pass 1 computes each block's end state from a zero start (and the decay through it), a
// scan over blocks gives every block its start state, and the main pass runs the block's chunks
// in order on tensor cores (mma.sync, bf16 in, fp32 accumulate), the running state in registers.
// The backward runs pass 1 forward (states; skipped when the forward kept them for it) and in
// reverse (state gradients), then two main sweeps: dq forward, and dk with dv in one reverse
// sweep (lightning_sweep.cu). One launch per pass covers all heads and chunks; the result for
// given sizes and config on a given GPU model is bitwise reproducible (automatic blocks follow the
// device's SM count).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/dtype.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/status.h"

namespace spindle::kernels::cuda {

struct LightningDims {
  int64_t T, H, Dh;
  int64_t qkv_stride;  // token stride of q, k, v (and of dq, dk, dv), in elements
};

struct LightningConfig {
  // 64-token chunks per block, 1..64; 0 picks from T, H and the device's SM count.
  int chunks_per_block = 0;
  // Main sweeps: 1 = one buffer per chunk tile (three barriers a chunk), 2 = the next chunk's Y
  // tile prefetched into a second buffer (two barriers a chunk; faster, bench/cuda/NOTES.md
  // round 7); 0 picks 2. Two blocks share an SM either way.
  int stages = 0;
  // Backward: dk and dv from two reverse sweeps instead of the fused one (for comparison).
  bool separate_dk_dv = false;
  // Sweeps other than the fused dk/dv one: 1 = mma.sync; 2 = wgmma where it runs (Dh = 128, an
  // sm_90 device, a build for sm_90a, stages other than 2; mma.sync elsewhere; its main passes hold
  // the state transposed; slower so far, bench/cuda/NOTES.md rounds 6 and 8); 3 = the main
  // passes at Dh = 128 on the mma.sync sweep that holds the state transposed (no bf16 state copy
  // in shared memory; Y double-buffered whatever `stages` says; round 8); 4 = the main passes on
  // the warp-specialised wgmma sweep where it runs (Dh = 128, sm_90 device and sm_90a build; one
  // block per SM, so automatic blocks are twice as long; slower so far, round 10). 0 picks 3 when
  // stages is 0 too, else 1.
  int sweep_kernel = 0;
};
// Whether this build and the current device run the wgmma sweep (see LightningConfig).
bool LightningWgmmaAvailable();

// Workspace for LightningForward / LightningBackward (the backward needs more; this covers both).
size_t LightningWorkspaceBytes(const LightningDims& dims, const LightningConfig& config = {});
// The forward's block start states and block decays, kept for the backward so it skips its own
// pass 1 forward and scan (`saved` below); 0 on the token path (Dh <= 32), which keeps none.
size_t LightningSavedBytes(const LightningDims& dims, const LightningConfig& config = {});

// All pointers are device pointers; cu_seqlens has n_segments + 1 entries (0 ... T).
Status LightningForward(const void* q, const void* k, const void* v, const float* log_decay,
                        const int32_t* cu_seqlens, int64_t n_segments, const float* carry_in,
                        float scale, const LightningDims& dims, void* out, float* end_state,
                        DType dtype, Workspace ws, cudaStream_t stream,
                        const LightningConfig& config = {}, float* saved = nullptr);

// dq, dk, dv overwritten; d_carry_in (nullable) overwritten with the gradient w.r.t. the carry-in
// (independent of its value, as on CPU); d_end_state nullable = zeros. saved (nullable): what the
// LightningForward of the same q, k, v, documents, carry-in and config kept (same results, less
// work); ignored on the token path.
Status LightningBackward(const void* q, const void* k, const void* v, const float* log_decay,
                         const int32_t* cu_seqlens, int64_t n_segments, const float* carry_in,
                         float scale, const LightningDims& dims, const void* dout,
                         const float* d_end_state, void* dq, void* dk, void* dv,
                         float* d_carry_in, DType dtype, Workspace ws, cudaStream_t stream,
                         const LightningConfig& config = {}, const float* saved = nullptr);

// ---- Context parallelism (AllGather mode) ---------------------------------------------------------
// Prefix scan over the 2*cp gathered chunk states, all heads in one launch:
//   P_0 = 0;  P_c = S_{c-1} + (doc_start[c-1] ? 0 : a_h^length[c-1]) P_{c-1}.
// S, P: [C, H, Dh, Dh] fp32 (must not alias); doc_start, length: [C] int32 device arrays
// (doc_start[c] != 0 when a document starts at some token of chunk c, its first included).
Status LightningStateScan(const float* S, const int32_t* doc_start, const int32_t* length,
                          const float* log_decay, int64_t C, int64_t H, int64_t Dh, float* P,
                          cudaStream_t stream);
// Its backward: dS_c = G_{c+1} with G_c = dP_c + f_c G_{c+1}, G_C = 0 (dS overwritten).
Status LightningStateScanBackward(const float* dP, const int32_t* doc_start,
                                  const int32_t* length, const float* log_decay, int64_t C,
                                  int64_t H, int64_t Dh, float* dS, cudaStream_t stream);

// Whether the carry correction and its backward run for head size Dh: the sizes Lightning itself
// runs (64 and 128 on tensor cores; even sizes up to 32 on the token path).
bool LightningSupportsHeadDim(int64_t Dh);
// out_t += a_h^(t+1) * scale * q_t P_h for t < n_tokens (one fused launch), see
// cpu::LightningCarryCorrection. P [H, Dh, Dh] fp32.
Status LightningCarryCorrection(const void* q, const float* log_decay, const float* P,
                                float scale, const LightningDims& dims, int64_t n_tokens,
                                void* out, DType dtype, cudaStream_t stream);
// dq_t += a^(t+1) scale dout_t P^T (accumulated into bf16 dq); dP += sum_t a^(t+1) scale
// q_t^T dout_t (fp32, accumulated). Workspace: LightningWorkspaceBytes({n_tokens, H, Dh, ...}).
Status LightningCarryCorrectionBackward(const void* q, const float* log_decay, const float* P,
                                        float scale, const LightningDims& dims, int64_t n_tokens,
                                        const void* dout, void* dq, float* dP, DType dtype,
                                        Workspace ws, cudaStream_t stream,
                                        const LightningConfig& config = {});

}  // namespace spindle::kernels::cuda
