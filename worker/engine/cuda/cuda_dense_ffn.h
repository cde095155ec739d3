// The CUDA model's dense FFN family: SwiGLU(h2 W1^T, h2 W3^T) W2^T of a layer's normed residual
// h2 (the CPU model's model.cc step for step), with the whole sequence's hidden layer kept in the
// layer's cache for the backward or passed block by block and recomputed there
// (cuda_dense_ffn.cc).
#pragma once

#include "worker/engine/cuda/cuda_layer_context.h"

namespace spindle {
namespace cuda_model_detail {

// One layer's saved FFN activations: g, u, a, the w1 and w3 outputs and SwiGLU, [T, F] in a cache
// kept for the backward, a block of ffn_block_rows rows otherwise (CudaDenseFfn::Forward); under
// FP8 the codes of a (q_a; the bf16 a is not written).
struct DenseFfnCache {
  DevBuf g, u, a;
  Fp8Act q_a;
};

// The dense FFN's gradient scratch, shared by the layers: [ffn_block_rows, F] (the whole sequence
// under FP8) gradients of a, g and u.
struct DenseFfnWork {
  DevBuf da, dg, du;
};

struct CudaDenseFfn {
  explicit CudaDenseFfn(LayerContext& cx) : cx(cx), c(cx.c), B(cx.B) {}

  // x_out = x_mid + SwiGLU(h2 W1^T, h2 W3^T) W2^T, with h2 = norm(x_mid) in A. With ffn_kept the
  // whole sequence's g, u and a stay in C for the backward; otherwise they pass through
  // [ffn_block_rows, F] buffers block by block, and without x_out nothing runs at all (the
  // backward recomputes each block).
  absl::Status Forward(const LayerIdx& L, LayerActs& A, DenseFfnCache& C, void* x_out,
                       bool ffn_kept);
  // dx: the gradient of x_out. Writes the context's W.dh, the gradient of h2, block by block over
  // [ffn_block_rows, F] gradient buffers, the weight gradients accumulated over the blocks;
  // without ffn_kept each block's g, u, a are recomputed first.
  absl::Status Backward(const LayerIdx& L, LayerActs& A, DenseFfnCache& C, const void* dx,
                        bool ffn_kept);
  // The shared scratch back to the allocator.
  void Release() {
    for (DevBuf* b : {&W.da, &W.dg, &W.du}) b->Release();
  }

  int64_t ffn_block_rows = kCudaFfnBlockRows;  // see CudaModel::SetFfnBlockRows

 private:
  // n rows of the FFN's hidden layer: g = h W1^T, u = h W3^T, a = SwiGLU(g, u). Under FP8 (one
  // block of the whole sequence) from the codes of A.h2 into those of C.a instead.
  // transposes: see QOut; requantize: see Requantizes.
  absl::Status Hidden(const LayerIdx& L, LayerActs& A, DenseFfnCache& C, bool transposes,
                      bool requantize, const void* h, void* g, void* u, void* a, int64_t n);

  LayerContext& cx;
  const ModelConfig& c;
  const BatchDev& B;
  DenseFfnWork W;
};

}  // namespace cuda_model_detail
}  // namespace spindle
