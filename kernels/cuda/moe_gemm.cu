// The experts' grouped GEMMs (GroupedGemm, moe.h): one GEMM per non-empty group, issued as
// cuBLASLt calls (Blas::Gemm: its plans, FP8 operands and checks) on the caller's stream, spread
// over several streams, or as one cuBLAS grouped batched call (cublasGemmGroupedBatchedEx,
// bf16 / fp32 only). bench_kernels_cuda --moe measures the three against a dense GEMM of the same
// FLOPs; bench/cuda/NOTES.md ("MoE kernels") has the numbers behind the default.
//
// Streams: the caller's stream records an event that the side streams wait on; groups go to the
// stream with the fewest FLOPs so far (the caller's first), each stream with its own Blas (its own
// cuBLASLt workspace: split-K algorithms write theirs); the caller's stream then waits on an event
// of every side stream. Results do not depend on the stream a group runs on (each group's GEMM
// writes its own rows or its own expert's gradient; the blockwise weight gradient's segments of
// one expert run in order on one stream).
//
// Persistent (kPersistent): bf16 Forward, BackwardData and BackwardWeight go to our one-launch
// Hopper kernel (moe_gemm_sm90.h) when it takes the call (device, sizes, alignment, and the weight
// gradient's 64-row group offsets); everything else runs as kStreams.
//
// Grouped batched: cuBLAS takes host arrays of sizes and device arrays of pointers; the pointers
// travel as a kernel argument (kPtrChunk groups a launch) into a device table owned here, in
// stream order, so nothing synchronises the host.
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_gemm_sm90.h"

namespace spindle::kernels::cuda {
namespace {

constexpr int kMaxStreams = 16;
constexpr int kPtrChunk = 128;  // 3 x 128 pointers: 3 KB of kernel arguments
constexpr size_t kCublasWorkspaceBytes = 32u << 20;

struct PtrChunk {
  const void* a[kPtrChunk];
  const void* b[kPtrChunk];
  void* c[kPtrChunk];
  int n;
};

// table: [3][kMaxGroups] pointers (A, B, C), chunk written at `first`.
__global__ void WritePointersKernel(PtrChunk chunk, int64_t first, int64_t max_groups,
                                    void** table) {
  const int i = threadIdx.x;
  if (i >= chunk.n) return;
  table[first + i] = const_cast<void*>(chunk.a[i]);
  table[max_groups + first + i] = const_cast<void*>(chunk.b[i]);
  table[2 * max_groups + first + i] = chunk.c[i];
}

const char* At(const void* p, int64_t bytes) { return static_cast<const char*>(p) + bytes; }
char* At(void* p, int64_t bytes) { return static_cast<char*>(p) + bytes; }

Status CheckGroups(const int64_t* offsets, int64_t G, int64_t N, int64_t K, const char* op) {
  SPINDLE_CHECK_ARG(offsets != nullptr && G >= 0 && G <= GroupedGemm::kMaxGroups && N > 0 && K > 0,
                    std::string(op) + ": bad sizes");
  SPINDLE_CHECK_ARG(offsets[0] >= 0, std::string(op) + ": negative offset");
  for (int64_t g = 0; g < G; ++g) {
    SPINDLE_CHECK_ARG(offsets[g + 1] >= offsets[g],
                      std::string(op) + ": offsets decrease at group " + std::to_string(g));
  }
  return Status::Ok();
}

Status CheckFp8Groups(const int64_t* offsets, int64_t G, const char* op) {
  for (int64_t g = 0; g <= G; ++g) {
    SPINDLE_CHECK_ARG(offsets[g] % 16 == 0,
                      std::string(op) +
                          ": FP8 needs every group's rows at a multiple of 16 "
                          "(MoeGroupRows with align 16); offset " +
                          std::to_string(g) + " is " + std::to_string(offsets[g]));
  }
  return Status::Ok();
}

// An activation's or gradient's scale pointer for group g's GEMM (rows from `row0`, K values a
// row): the tensor's one scale, or its group's kRow128 tensor in the grouped layout.
const float* GroupRowScales(const Fp8Operand& x, int64_t row0, int64_t K) {
  return x.scale_mode == Fp8ScaleMode::kRow128 ? x.inverse_scale + row0 * Fp8Blocks(K)
                                               : x.inverse_scale;
}

}  // namespace

const char* GroupedGemmMethodName(GroupedGemmMethod m) {
  switch (m) {
    case GroupedGemmMethod::kLoop:
      return "cuBLASLt loop";
    case GroupedGemmMethod::kStreams:
      return "cuBLASLt on streams";
    case GroupedGemmMethod::kGroupedBatched:
      return "cuBLAS grouped batched";
    case GroupedGemmMethod::kPersistent:
      return "persistent wgmma";
  }
  return "unknown";
}

struct GroupedGemm::Impl {
  GroupedGemmOptions options;
  std::vector<std::unique_ptr<Blas>> blas;  // [0]: the caller's stream; [l]: side[l - 1]
  std::vector<cudaStream_t> side;
  cudaEvent_t fork = nullptr;
  std::vector<cudaEvent_t> done;
  cublasHandle_t cublas = nullptr;
  void* cublas_workspace = nullptr;
  void** table = nullptr;  // [3][kMaxGroups] device pointers
  // kPersistent on a device that runs it; null elsewhere (every call then runs as kStreams).
  std::unique_ptr<internal::PersistentGroupedGemm> persistent;

  ~Impl() {
    for (cudaStream_t s : side) cudaStreamDestroy(s);
    for (cudaEvent_t e : done) cudaEventDestroy(e);
    if (fork != nullptr) cudaEventDestroy(fork);
    if (cublas != nullptr) cublasDestroy(cublas);
    if (cublas_workspace != nullptr) cudaFree(cublas_workspace);
    if (table != nullptr) cudaFree(table);
  }

  // Runs every GEMM of `gs` (one per non-empty group; or per segment, `lane_key` then naming
  // each GEMM's group: consecutive GEMMs of one key accumulate into one output and run in order
  // on one stream).
  Status Run(const std::vector<GemmArgs>& gs, cudaStream_t stream,
             const std::vector<int64_t>* lane_key = nullptr) {
    if (gs.empty()) return Status::Ok();
    bool fp8 = false;
    for (const GemmArgs& g : gs) fp8 |= IsFp8(g.ab_type);
    switch (options.method) {
      case GroupedGemmMethod::kLoop:
        for (const GemmArgs& g : gs) SPINDLE_RETURN_IF_ERROR(blas[0]->Gemm(g, stream));
        return Status::Ok();
      case GroupedGemmMethod::kGroupedBatched:
        // cuBLAS's grouped batched GEMM takes one type for A, B and C: FP8 and the weight
        // gradient (bf16 in, fp32 out) run on streams.
        if (!fp8 && gs[0].ab_type == gs[0].c_type) return RunGroupedBatched(gs, stream);
        [[fallthrough]];
      case GroupedGemmMethod::kStreams:
      case GroupedGemmMethod::kPersistent:  // the calls the persistent kernel did not take
        return RunStreams(gs, stream, lane_key);
    }
    return Status::Ok();
  }

  // Runs `a` on the persistent kernel when the method asks for it and the kernel takes the call
  // (*done true); otherwise leaves *done false for the cuBLASLt path (a refusal enqueues nothing).
  Status TryPersistent(const internal::PersistentGemmArgs& a, DType dtype, cudaStream_t stream,
                       bool* done) {
    *done = false;
    if (options.method != GroupedGemmMethod::kPersistent || persistent == nullptr ||
        dtype != DType::kBFloat16 || !persistent->Supports(a).ok()) {
      return Status::Ok();
    }
    const Status s = persistent->Run(a, stream);
    if (s.code() == StatusCode::kUnsupported) return Status::Ok();  // e.g. a tensor map refused
    *done = true;
    return s;
  }

  Status RunStreams(const std::vector<GemmArgs>& gs, cudaStream_t stream,
                    const std::vector<int64_t>* lane_key = nullptr) {
    const int lanes = static_cast<int>(std::min<size_t>(blas.size(), gs.size()));
    if (lanes <= 1) {
      for (const GemmArgs& g : gs) SPINDLE_RETURN_IF_ERROR(blas[0]->Gemm(g, stream));
      return Status::Ok();
    }
    SPINDLE_CUDA_CHECK(cudaEventRecord(fork, stream));
    for (int l = 1; l < lanes; ++l) SPINDLE_CUDA_CHECK(cudaStreamWaitEvent(side[l - 1], fork, 0));
    std::vector<double> load(lanes, 0.0);
    int l = 0;
    for (size_t i = 0; i < gs.size(); ++i) {
      const GemmArgs& g = gs[i];
      const bool same_output = lane_key != nullptr && i > 0 && (*lane_key)[i] == (*lane_key)[i - 1];
      if (!same_output)
        l = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      load[l] += static_cast<double>(g.M) * g.N * g.K + 1.0;
      SPINDLE_RETURN_IF_ERROR(blas[l]->Gemm(g, l == 0 ? stream : side[l - 1]));
    }
    for (int l = 1; l < lanes; ++l) {
      SPINDLE_CUDA_CHECK(cudaEventRecord(done[l - 1], side[l - 1]));
      SPINDLE_CUDA_CHECK(cudaStreamWaitEvent(stream, done[l - 1], 0));
    }
    return Status::Ok();
  }

  Status RunGroupedBatched(const std::vector<GemmArgs>& gs, cudaStream_t stream) {
    const int64_t n = static_cast<int64_t>(gs.size());
    const GemmArgs& f = gs[0];
    SPINDLE_CHECK_ARG(f.ab_type != DType::kFloat32 || f.c_type == DType::kFloat32,
                      "GroupedGemm: fp32 inputs need an fp32 output");
    for (int64_t first = 0; first < n; first += kPtrChunk) {
      PtrChunk chunk{};
      chunk.n = static_cast<int>(std::min<int64_t>(kPtrChunk, n - first));
      for (int i = 0; i < chunk.n; ++i) {
        // cuBLAS is column-major: our row-major C = op(A) op(B) is its C^T = op(B)^T op(A)^T.
        chunk.a[i] = gs[first + i].B;
        chunk.b[i] = gs[first + i].A;
        chunk.c[i] = gs[first + i].C;
      }
      WritePointersKernel<<<1, kPtrChunk, 0, stream>>>(chunk, first, GroupedGemm::kMaxGroups,
                                                       table);
      SPINDLE_CUDA_CHECK_LAUNCH();
    }
    std::vector<cublasOperation_t> ta(n), tb(n);
    std::vector<int> m(n), nn(n), k(n), lda(n), ldb(n), ldc(n), size(n, 1);
    std::vector<float> alpha(n), beta(n);
    for (int64_t i = 0; i < n; ++i) {
      const GemmArgs& g = gs[i];
      ta[i] = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
      tb[i] = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
      m[i] = static_cast<int>(g.N), nn[i] = static_cast<int>(g.M), k[i] = static_cast<int>(g.K);
      lda[i] = static_cast<int>(g.ldb), ldb[i] = static_cast<int>(g.lda);
      ldc[i] = static_cast<int>(g.ldc);
      alpha[i] = g.alpha, beta[i] = g.beta;
    }
    SPINDLE_CUBLAS_CHECK(cublasSetStream(cublas, stream));
    SPINDLE_CUBLAS_CHECK(cublasSetWorkspace(cublas, cublas_workspace, kCublasWorkspaceBytes));
    void** t = table;
    SPINDLE_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
        cublas, ta.data(), tb.data(), m.data(), nn.data(), k.data(), alpha.data(),
        const_cast<const void* const*>(t), CudaDataType(f.ab_type), lda.data(),
        const_cast<const void* const*>(t + GroupedGemm::kMaxGroups), CudaDataType(f.ab_type),
        ldb.data(), beta.data(), t + 2 * GroupedGemm::kMaxGroups, CudaDataType(f.c_type), ldc.data(),
        static_cast<int>(n), size.data(), CUBLAS_COMPUTE_32F));
    return Status::Ok();
  }
};

GroupedGemm::GroupedGemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GroupedGemm::~GroupedGemm() = default;

const GroupedGemmOptions& GroupedGemm::options() const { return impl_->options; }

bool GroupedGemm::persistent_kernel() const { return impl_->persistent != nullptr; }

Status GroupedGemm::Create(const GroupedGemmOptions& options, std::unique_ptr<GroupedGemm>* out) {
  SPINDLE_CHECK_ARG(options.streams >= 1 && options.streams <= kMaxStreams,
                    "GroupedGemm: streams must be in 1..16");
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  // kGroupedBatched falls back to streams for FP8.
  const int lanes = options.method == GroupedGemmMethod::kLoop ? 1 : options.streams;
  for (int l = 0; l < lanes; ++l) {
    std::unique_ptr<Blas> b;
    SPINDLE_RETURN_IF_ERROR(Blas::Create(&b));
    impl->blas.push_back(std::move(b));
    if (l == 0) continue;
    cudaStream_t s = nullptr;
    SPINDLE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    impl->side.push_back(s);
    cudaEvent_t e = nullptr;
    SPINDLE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    impl->done.push_back(e);
  }
  SPINDLE_CUDA_CHECK(cudaEventCreateWithFlags(&impl->fork, cudaEventDisableTiming));
  if (options.method == GroupedGemmMethod::kPersistent) {
    const Status s = internal::PersistentGroupedGemm::Create(&impl->persistent);
    if (!s.ok() && s.code() != StatusCode::kUnsupported) return s;  // unsupported: kStreams
  }
  if (options.method == GroupedGemmMethod::kGroupedBatched) {
    SPINDLE_CUBLAS_CHECK(cublasCreate(&impl->cublas));
    SPINDLE_CUDA_CHECK(cudaMalloc(&impl->cublas_workspace, kCublasWorkspaceBytes));
    SPINDLE_CUDA_CHECK(cudaMalloc(&impl->table, 3 * kMaxGroups * sizeof(void*)));
  }
  out->reset(new GroupedGemm(std::move(impl)));
  return Status::Ok();
}

Status GroupedGemm::Forward(const void* A, const void* B, void* C, const int64_t* offsets,
                            int64_t G, int64_t N, int64_t K, DType dtype, cudaStream_t stream) {
  SPINDLE_RETURN_IF_ERROR(CheckGroups(offsets, G, N, K, "GroupedGemm::Forward"));
  bool done = false;
  SPINDLE_RETURN_IF_ERROR(impl_->TryPersistent(
      {internal::PersistentRole::kForward, A, B, C, offsets, G, N, K}, dtype, stream, &done));
  if (done) return Status::Ok();
  const int64_t es = DTypeSize(dtype);
  std::vector<GemmArgs> gs;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = offsets[g + 1] - offsets[g];
    if (m == 0) continue;
    GemmArgs a;
    a.trans_b = true;
    a.M = m, a.N = N, a.K = K;
    a.A = At(A, offsets[g] * K * es), a.lda = K;
    a.B = At(B, g * N * K * es), a.ldb = K;
    a.C = At(C, offsets[g] * N * es), a.ldc = N;
    a.ab_type = dtype, a.c_type = dtype;
    gs.push_back(a);
  }
  return impl_->Run(gs, stream);
}

Status GroupedGemm::BackwardData(const void* dC, const void* B, void* dA, const int64_t* offsets,
                                 int64_t G, int64_t N, int64_t K, DType dtype, cudaStream_t stream,
                                 bool accumulate) {
  SPINDLE_RETURN_IF_ERROR(CheckGroups(offsets, G, N, K, "GroupedGemm::BackwardData"));
  bool done = false;
  SPINDLE_RETURN_IF_ERROR(impl_->TryPersistent(
      {internal::PersistentRole::kBackwardData, dC, B, dA, offsets, G, N, K, accumulate}, dtype,
      stream, &done));
  if (done) return Status::Ok();
  const int64_t es = DTypeSize(dtype);
  std::vector<GemmArgs> gs;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = offsets[g + 1] - offsets[g];
    if (m == 0) continue;
    GemmArgs a;  // dA_g [m, K] = dC_g [m, N] B_g [N, K]
    a.M = m, a.N = K, a.K = N;
    a.beta = accumulate ? 1.0f : 0.0f;
    a.A = At(dC, offsets[g] * N * es), a.lda = N;
    a.B = At(B, g * N * K * es), a.ldb = K;
    a.C = At(dA, offsets[g] * K * es), a.ldc = K;
    a.ab_type = dtype, a.c_type = dtype;
    gs.push_back(a);
  }
  return impl_->Run(gs, stream);
}

Status GroupedGemm::BackwardWeight(const void* dC, const void* A, float* dB, const int64_t* offsets,
                                   int64_t G, int64_t N, int64_t K, DType dtype,
                                   cudaStream_t stream) {
  SPINDLE_RETURN_IF_ERROR(CheckGroups(offsets, G, N, K, "GroupedGemm::BackwardWeight"));
  bool done = false;
  SPINDLE_RETURN_IF_ERROR(impl_->TryPersistent(
      {internal::PersistentRole::kBackwardWeight, dC, A, dB, offsets, G, N, K}, dtype, stream,
      &done));
  if (done) return Status::Ok();
  const int64_t es = DTypeSize(dtype);
  std::vector<GemmArgs> gs;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = offsets[g + 1] - offsets[g];
    if (m == 0) continue;
    GemmArgs a;  // dB_g [N, K] += dC_g^T [N, m] A_g [m, K]
    a.trans_a = true;
    a.M = N, a.N = K, a.K = m;
    a.beta = 1.0f;
    a.A = At(dC, offsets[g] * N * es), a.lda = N;
    a.B = At(A, offsets[g] * K * es), a.ldb = K;
    a.C = dB + g * N * K, a.ldc = K;
    a.ab_type = dtype, a.c_type = DType::kFloat32;
    gs.push_back(a);
  }
  return impl_->Run(gs, stream);
}

Status GroupedGemm::ForwardFp8(const Fp8Operand& A, const Fp8Experts& B, void* C, DType c_type,
                               const int64_t* offsets, int64_t G, int64_t N, int64_t K,
                               cudaStream_t stream) {
  SPINDLE_RETURN_IF_ERROR(CheckGroups(offsets, G, N, K, "GroupedGemm::ForwardFp8"));
  SPINDLE_RETURN_IF_ERROR(CheckFp8Groups(offsets, G, "GroupedGemm::ForwardFp8"));
  const int64_t es = DTypeSize(c_type);
  std::vector<GemmArgs> gs;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = offsets[g + 1] - offsets[g];
    if (m == 0) continue;
    GemmArgs a;
    a.trans_b = true;
    a.M = m, a.N = N, a.K = K;
    a.A = At(A.codes, offsets[g] * K), a.lda = K;
    a.ab_type = A.format, a.a_scale = GroupRowScales(A, offsets[g], K);
    a.B = At(B.codes, g * N * K), a.ldb = K;
    a.b_type = B.format, a.b_scale = B.inverse_scales + g * B.scale_stride;
    a.a_scale_mode = A.scale_mode, a.b_scale_mode = B.scale_mode;
    a.C = At(C, offsets[g] * N * es), a.ldc = N;
    a.c_type = c_type;
    gs.push_back(a);
  }
  return impl_->Run(gs, stream);
}

Status GroupedGemm::BackwardDataFp8(const Fp8Operand& dC, const Fp8Experts& B_t, void* dA,
                                    DType da_type, const int64_t* offsets, int64_t G, int64_t N,
                                    int64_t K, cudaStream_t stream, bool accumulate) {
  SPINDLE_RETURN_IF_ERROR(CheckGroups(offsets, G, N, K, "GroupedGemm::BackwardDataFp8"));
  SPINDLE_RETURN_IF_ERROR(CheckFp8Groups(offsets, G, "GroupedGemm::BackwardDataFp8"));
  const int64_t es = DTypeSize(da_type);
  std::vector<GemmArgs> gs;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = offsets[g + 1] - offsets[g];
    if (m == 0) continue;
    GemmArgs a;  // dA_g [m, K] = dC_g [m, N] (B_t_g [K, N])^T
    a.trans_b = true;
    a.M = m, a.N = K, a.K = N;
    a.beta = accumulate ? 1.0f : 0.0f;
    a.A = At(dC.codes, offsets[g] * N), a.lda = N;
    a.ab_type = dC.format, a.a_scale = GroupRowScales(dC, offsets[g], N);
    a.B = At(B_t.codes, g * N * K), a.ldb = N;
    a.b_type = B_t.format, a.b_scale = B_t.inverse_scales + g * B_t.scale_stride;
    a.a_scale_mode = dC.scale_mode, a.b_scale_mode = B_t.scale_mode;
    a.C = At(dA, offsets[g] * K * es), a.ldc = K;
    a.c_type = da_type;
    gs.push_back(a);
  }
  return impl_->Run(gs, stream);
}

Status GroupedGemm::BackwardWeightFp8(const Fp8Operand& dC_t, const Fp8Operand& A_t, float* dB,
                                      const int64_t* offsets, int64_t G, int64_t N, int64_t K,
                                      cudaStream_t stream, const int64_t* segments,
                                      int64_t n_segments) {
  SPINDLE_RETURN_IF_ERROR(CheckGroups(offsets, G, N, K, "GroupedGemm::BackwardWeightFp8"));
  SPINDLE_RETURN_IF_ERROR(CheckFp8Groups(offsets, G, "GroupedGemm::BackwardWeightFp8"));
  const int64_t rows = offsets[G];
  if (dC_t.scale_mode != Fp8ScaleMode::kTensor || A_t.scale_mode != Fp8ScaleMode::kTensor) {
    // Block scales along the tokens: one GEMM per segment, on its column blocks.
    SPINDLE_CHECK_ARG(dC_t.scale_mode == Fp8ScaleMode::kRow128 &&
                          A_t.scale_mode == Fp8ScaleMode::kRow128 && segments != nullptr,
                      "GroupedGemm::BackwardWeightFp8: block scales need both operands in 1 x "
                      "128 blocks along the tokens and the segments");
    Fp8RowBands bands;
    SPINDLE_RETURN_IF_ERROR(Fp8GroupedRowBands(offsets, G, segments, n_segments, &bands));
    std::vector<GemmArgs> gs;
    std::vector<int64_t> key;
    int64_t g = 0, block = 0;
    for (int64_t s = 0; s < n_segments; ++s) {
      const int64_t s0 = segments[s], m = segments[s + 1] - s0;
      if (m == 0) continue;
      while (offsets[g + 1] <= s0) ++g;  // Fp8GroupedRowBands checked that a group holds it
      GemmArgs a;  // dB_g [N, K] += (dC_t [N, s0 : s0 + m]) (A_t [K, s0 : s0 + m])^T
      a.trans_b = true;
      a.M = N, a.N = K, a.K = m;
      a.beta = 1.0f;
      a.A = At(dC_t.codes, s0), a.lda = rows;
      a.ab_type = dC_t.format, a.a_scale = dC_t.inverse_scale + block * N;
      a.B = At(A_t.codes, s0), a.ldb = rows;
      a.b_type = A_t.format, a.b_scale = A_t.inverse_scale + block * K;
      a.a_scale_mode = a.b_scale_mode = Fp8ScaleMode::kRow128;
      a.C = dB + g * N * K, a.ldc = K;
      a.c_type = DType::kFloat32;
      gs.push_back(a);
      key.push_back(g);
      block += (m + kFp8BlockSize - 1) / kFp8BlockSize;
    }
    return impl_->Run(gs, stream, &key);
  }
  std::vector<GemmArgs> gs;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = offsets[g + 1] - offsets[g];
    if (m == 0) continue;
    GemmArgs a;  // dB_g [N, K] += (dC_t_g [N, m]) (A_t_g [K, m])^T, columns of the transposes
    a.trans_b = true;
    a.M = N, a.N = K, a.K = m;
    a.beta = 1.0f;
    a.A = At(dC_t.codes, offsets[g]), a.lda = rows;
    a.ab_type = dC_t.format, a.a_scale = dC_t.inverse_scale;
    a.B = At(A_t.codes, offsets[g]), a.ldb = rows;
    a.b_type = A_t.format, a.b_scale = A_t.inverse_scale;
    a.C = dB + g * N * K, a.ldc = K;
    a.c_type = DType::kFloat32;
    gs.push_back(a);
  }
  return impl_->Run(gs, stream);
}

}  // namespace spindle::kernels::cuda
