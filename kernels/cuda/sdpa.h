// Causal softmax attention inside documents (the MLA core) on cuDNN's graph (backend) API, and
// the unmasked attention of queries over a different set of keys (context parallelism's cross
// piece):
// forward with softmax statistics and backward, bf16 in and out, fp32 accumulation; the GPU
// counterpart of kernels/cpu/attention.h for local attention (queries and keys are the same
// tokens).
//
// Layout: q, k [T, H, Dqk], v, out [T, H, Dv] as strided views (token stride and head stride in
// elements, innermost dimension dense; both strides 0 means dense [T, H, D]; otherwise both must
// be positive multiples of 8, and every pointer 16-byte aligned); dq, dk, dv have the strides of
// q, k, v; dout those of out. stats [H, T] fp32, dense: the natural-log log-sum-exp of each
// query's scaled, masked scores, written by the forward and read by the backward. Query i attends
// key j iff both lie in the same document and j <= i. Documents are given by cu_seqlens (host
// array, n_segments + 1 non-decreasing entries, 0 ... T; empty documents are allowed).
//
// One document (empty ones aside) is one cuDNN graph over the whole sequence. Several documents
// run as one ragged cuDNN graph (documents as batches, placed by offsets; cuDNN >= 9.6, Dqk and
// Dv multiples of 16), otherwise as one graph per document on sub-views; see sdpa.cc.
//
// An Sdpa owns the cuDNN handle, the finalized execution plans (built once per shape, cached by
// (direction, T or bucketed document count and length, H, Dqk, Dv, strides, dtype,
// deterministic) and reused; the scale is a run-time value, not part of the key; a first build
// takes ~1 s while cuDNN compiles its kernel, later ones ~50 ms) and a device workspace that
// grows to the largest plan's need (the backward keeps an fp32 dq accumulator: 400 MB at T=32K,
// H=16, Dqk=192). Not thread-safe: one Sdpa per thread or stream.
//
// Errors: head sizes and dtypes cuDNN has no kernel for come back as kUnsupported, malformed
// arguments (cu_seqlens, strides, pointers) as kInvalidArgument, and cuDNN failures (a graph no
// engine accepts, an execution error) as kCudnnError with cuDNN's own message.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "kernels/cuda/dtype.h"
#include "kernels/cuda/status.h"

namespace spindle::kernels::cuda {

struct SdpaView {
  int64_t token_stride = 0;  // elements between tokens t and t+1
  int64_t head_stride = 0;   // elements between heads h and h+1
};

struct SdpaDims {
  int64_t T = 0, H = 0, Dqk = 0, Dv = 0;  // Dqk, Dv multiples of 8, <= 256
  SdpaView q, k, v, out;                  // dq/dk/dv/dout use the same views
  int64_t Tkv = 0;  // ForwardFull / BackwardFull only: the number of keys (>= 1)
};

class Sdpa {
 public:
  // Creates the cuDNN handle on the current device. kUnsupported when cuDNN is older than 9.
  static Status Create(std::unique_ptr<Sdpa>* out);
  ~Sdpa();
  Sdpa(const Sdpa&) = delete;
  Sdpa& operator=(const Sdpa&) = delete;

  // out and stats overwritten. dtype: kBFloat16 (kFloat16 where cuDNN allows it).
  Status Forward(const void* q, const void* k, const void* v, void* out, float* stats,
                 const int32_t* cu_seqlens, int64_t n_segments, float scale,
                 const SdpaDims& dims, DType dtype, cudaStream_t stream);

  // dq, dk, dv overwritten. q, k, v, out, stats as saved by Forward.
  Status Backward(const void* q, const void* k, const void* v, const void* out,
                  const float* stats, const void* dout, void* dq, void* dk, void* dv,
                  const int32_t* cu_seqlens, int64_t n_segments, float scale,
                  const SdpaDims& dims, DType dtype, cudaStream_t stream);

  // Full (unmasked) attention of T queries over Tkv keys (dims.Tkv; k, v, dk, dv hold Tkv
  // tokens): every query attends every key, no documents. The cross piece of context-parallel
  // attention (queries of a chunk, keys of the same document's earlier chunks), whose output
  // and stats the caller merges with the causal piece's (AttentionMerge in ops.h). The backward
  // takes the merged out and stats, so its gradients are this piece's share of the merged
  // attention's. Plans are built for T and Tkv rounded up to powers of two (at least 128), so a
  // few of them serve every length; the inputs are staged through zero-padded copies in the
  // workspace (it grows to the rounded sizes' q, k, v, out and, for the backward, their
  // gradients).
  Status ForwardFull(const void* q, const void* k, const void* v, void* out, float* stats,
                     float scale, const SdpaDims& dims, DType dtype, cudaStream_t stream);
  Status BackwardFull(const void* q, const void* k, const void* v, const void* out,
                      const float* stats, const void* dout, void* dq, void* dk, void* dv,
                      float scale, const SdpaDims& dims, DType dtype, cudaStream_t stream);

  // Off by default: cuDNN's fastest backward accumulates dq with fp32 atomics, so dq may differ
  // in the last bits between identical runs. On: the backward graph writes dq from the matmul
  // itself (cuDNN's deterministic variant: ~20% slower, and its workspace holds dP, H T^2 bf16,
  // 34 GB at T=32K, H=16); dq, dk, dv are then bitwise reproducible. Several documents then go
  // one graph per document (workspace H L^2 for the longest document).
  void SetDeterministic(bool on);

  // Execution plans built so far (each costs 50-1300 ms; tests check that lengths share them).
  int64_t PlanCount() const;
  // Device bytes held for the calls (the workspace, which grows to the largest call's and stays,
  // and the ragged metadata): outside any caller's allocator.
  int64_t WorkspaceBytes() const;

 private:
  struct Impl;
  explicit Sdpa(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace spindle::kernels::cuda
