// The CUDA model's Lightning attention family: one layer's Lightning attention block (the qkv
// projection, q/k norm + RoPE, the linear-attention core, the group norm + gate and the output
// projection), following worker/engine/model.cc step for step, and the core under context
// parallelism: All2All (the whole sequence for H/cp heads), AllGather (chunk states gathered and
// scanned) and hybrid (AllGather across the Ulysses groups), as DESIGN.md section 3 describes them
// (cuda_lightning.cc).
#pragma once

#include "kernels/cuda/lightning.h"
#include "worker/engine/cuda/cuda_layer_context.h"

namespace spindle {
namespace cuda_model_detail {

// One layer's saved Lightning activations (names as in model.cc).
struct LightningCache {
  DevBuf qkv_raw, qkv_n, rstd_q, rstd_k, gate, o, y, rstd_o;
  DevBuf lstates;  // cp = 1: the forward's block states, kept for the backward
  // CP (AllGather and hybrid): the carry-ins P of this rank's two chunks, [2, H, Dh, Dh] fp32.
  DevBuf cp_P;
  // FP8: the codes of the group norm + gate's output y, the output projection's input (the bf16 y
  // is then not written).
  Fp8Act q_y;
};

// Lightning's gradient scratch, shared by the layers: the gradients of y (then of o, in place),
// of the gate and of q | k | v (a KindArena's fields: see Fields); CP (AllGather and hybrid): this
// rank's two chunk states (or their carry-in gradients), every rank's as gathered, the 2cp of
// them in stream order, and their scan.
struct LightningWork {
  DevBuf dy, dgate, dqkv;
  DevBuf cp_state_send, cp_state_recv, cp_state_stream, cp_state_scan;
};

struct CudaLightning {
  explicit CudaLightning(LayerContext& cx) : cx(cx), c(cx.c), B(cx.B) {}

  // A.x_mid = x_in + the attention block of A.h (under FP8 of its codes A.q_h).
  // transposes: see QOut; requantize: see Requantizes.
  absl::Status Forward(const LayerIdx& L, LayerActs& A, LightningCache& C, const void* x_in,
                       bool transposes, bool requantize);
  // dout: gradient of the block output [T, d]; writes the context's W.dh (gradient of the normed
  // input).
  absl::Status Backward(const LayerIdx& L, LayerActs& A, LightningCache& C, const void* dout);
  // The buffers of a layer's cache and of the scratch that an MLA layer never uses, with the bytes
  // the layer code asks for at the current batch and CP mode (KindArena).
  KindFields CacheFields(LayerActs& A, LightningCache& C);
  KindFields WorkFields();
  // Under CP, once Upload set the levels of layout L: the workspace the cores need (into *need)
  // and the chunk states' scratch.
  absl::Status SizeCpScratch(const CpLayout& L, size_t* need);
  // The shared scratch back to the allocator.
  void Release() {
    for (DevBuf* b : {&W.dy, &W.dgate, &W.dqkv}) b->Release();
  }

 private:
  // All2All: q, k, v of this rank's tokens (all heads, in C.qkv_n) -> the whole sequence for H/cp
  // heads (A.cp_full) -> the core with the whole sequence's documents -> outputs back into C.o.
  absl::Status CoreForward(const LayerIdx& L, LayerActs& A, LightningCache& C);
  absl::Status CoreBackward(const LayerIdx& L, LayerActs& A, LightningCache& C);
  // send: this rank's two [H, Dh, Dh] fp32 blocks -> W.cp_state_stream: the level's 2cp in stream
  // order, gathered over `comm` (the level's).
  absl::Status GatherStates(const CpLevel& V, Communicator& comm, const float* send, int64_t H);
  // The AllGather core on level V: q | k | v rows [V.T, 3 H Dh] at qkv for H heads of decays
  // log_decay; out [V.T, H Dh] overwritten; P [2, H, Dh, Dh] receives the local chunks' carry-ins.
  absl::Status StatesForward(const CpLevel& V, Communicator& comm, const void* qkv, int64_t H,
                             const float* log_decay, void* out, float* P);
  // Its backward from dout [V.T, H Dh]: dqkv [V.T, 3 H Dh] overwritten.
  absl::Status StatesBackward(const CpLevel& V, Communicator& comm, const void* qkv, int64_t H,
                              const float* log_decay, const float* P, const void* dout, void* dqkv);
  absl::Status AllGatherForward(const LayerIdx& L, LightningCache& C);
  absl::Status AllGatherBackward(const LayerIdx& L, LightningCache& C);
  // Hybrid: q, k, v to this rank's Ulysses group's tokens for its H/u heads (A.cp_full), the
  // AllGather core across the groups, outputs back (C.o); the backward mirrors it into W.dqkv.
  absl::Status HybridForward(const LayerIdx& L, LayerActs& A, LightningCache& C);
  absl::Status HybridBackward(const LayerIdx& L, LayerActs& A, LightningCache& C);

  LayerContext& cx;
  const ModelConfig& c;
  const BatchDev& B;
  LightningWork W;
};

}  // namespace cuda_model_detail
}  // namespace spindle
