// cuBLASLt GEMM wrapper: row-major C = op(A) op(B) is computed as column-major
// C^T = op(B)^T op(A)^T, i.e. cuBLASLt's A is our B. Algorithms come from the heuristic once per
// shape (told each pointer's alignment) and are cached with their layouts. Timing the heuristic's
// other candidates per shape was tried and measured: no gain on the 1b step at 32K (437.5 ms
// without, 439.2 ms with), nor under sustained load (bench/cuda/NOTES.md, "The GEMMs' algorithms
// under the power cap"), so the first is kept and results stay reproducible across processes.
#include "kernels/cuda/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>

namespace spindle::kernels::cuda {
namespace {

cudaDataType_t CudaType(DType t) {
  switch (t) {
    case DType::kFloat32:
      return CUDA_R_32F;
    case DType::kBFloat16:
      return CUDA_R_16BF;
    case DType::kFloat16:
      return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int,
                       bool, int, int, int, int>;

// The largest power of two up to 256 that divides the address.
int Alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && a % align != 0) align >>= 1;
  return align;
}

constexpr int kMaxCandidates = 16;

// Without alignment hints cuBLASLt assumes 256-byte aligned pointers and may pick an algorithm
// that reads wrong data from a less aligned one (weights at odd offsets of the flat buffers).
struct Alignments {
  int a, b, c;
};
Alignments AlignmentsOf(const GemmArgs& g) {
  return {Alignment(g.A), Alignment(g.B),
          g.C_in != nullptr ? std::min(Alignment(g.C), Alignment(g.C_in)) : Alignment(g.C)};
}

// A plan's identity: the shape, layouts, types, whether C is read, each pointer's alignment and
// the candidate asked for.
Key KeyOf(const GemmArgs& g) {
  const Alignments al = AlignmentsOf(g);
  return std::make_tuple(g.trans_a, g.trans_b, g.M, g.N, g.K, g.lda, g.ldb, g.ldc,
                         static_cast<int>(g.ab_type), static_cast<int>(g.c_type), g.beta == 0.0f,
                         al.a, al.b, al.c, g.candidate);
}

// One cached plan: descriptors and the chosen algorithm.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

struct Blas::Impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::map<Key, std::unique_ptr<Plan>> plans;
  ~Impl() {
    plans.clear();
    if (workspace) cudaFree(workspace);
    if (handle) cublasLtDestroy(handle);
  }
};

Blas::Blas(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Blas::~Blas() = default;

Status Blas::Create(std::unique_ptr<Blas>* out) {
  auto impl = std::make_unique<Impl>();
  SPINDLE_CUBLAS_CHECK(cublasLtCreate(&impl->handle));
  SPINDLE_CUDA_CHECK(cudaMalloc(&impl->workspace, kWorkspaceBytes));
  out->reset(new Blas(std::move(impl)));
  return Status::Ok();
}

Status Blas::Gemm(const GemmArgs& g, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(g.M >= 0 && g.N >= 0 && g.K >= 0, "Gemm: negative size");
  if (g.M == 0 || g.N == 0) return Status::Ok();
  SPINDLE_CHECK_ARG(g.ab_type != DType::kFloat32 || g.c_type == DType::kFloat32,
                    "Gemm: fp32 inputs need an fp32 output");
  SPINDLE_CHECK_ARG(g.candidate >= 0 && g.candidate < kMaxCandidates,
                    "Gemm: candidate out of range");
  const Key key = KeyOf(g);
  auto it = impl_->plans.find(key);
  if (it == impl_->plans.end()) {
    auto plan = std::make_unique<Plan>();
    SPINDLE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    // Column-major view: C^T [N x M] = op(B)^T [N x K] * op(A)^T [K x M].
    const cublasOperation_t ta = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // applied to B^T view
    const cublasOperation_t tb = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    SPINDLE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta,
                                                        sizeof(ta)));
    SPINDLE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb,
                                                        sizeof(tb)));
    const cudaDataType_t ab = CudaType(g.ab_type), ct = CudaType(g.c_type);
    // Our B in column-major: untransposed row-major [K, N] is col-major [N x K] with ld ldb.
    SPINDLE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, ab, g.trans_b ? g.K : g.N,
                                                    g.trans_b ? g.N : g.K, g.ldb));
    SPINDLE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, ab, g.trans_a ? g.M : g.K,
                                                    g.trans_a ? g.K : g.M, g.lda));
    SPINDLE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, ct, g.N, g.M, g.ldc));
    cublasLtMatmulPreference_t pref = nullptr;
    SPINDLE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = kWorkspaceBytes;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                         sizeof(ws));
    // cuBLASLt's A is our B (column-major view); C and D are both our C.
    const Alignments al = AlignmentsOf(g);
    const uint32_t lt_a = al.b, lt_b = al.a, lt_c = al.c;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &lt_a,
                                         sizeof(lt_a));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &lt_b,
                                         sizeof(lt_b));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &lt_c,
                                         sizeof(lt_c));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &lt_c,
                                         sizeof(lt_c));
    cublasLtMatmulHeuristicResult_t results[kMaxCandidates] = {};
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(impl_->handle, plan->op, plan->a, plan->b, plan->c, plan->c,
                                       pref, g.candidate + 1, results, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    SPINDLE_CUBLAS_CHECK(st);
    if (found <= g.candidate) {
      return {StatusCode::kCublasError,
              "Gemm: cuBLASLt found " + std::to_string(found) + " algorithm(s) for M=" +
                  std::to_string(g.M) + " N=" + std::to_string(g.N) + " K=" + std::to_string(g.K) +
                  ", candidate " + std::to_string(g.candidate) + " asked for"};
    }
    plan->algo = results[g.candidate].algo;
    it = impl_->plans.emplace(key, std::move(plan)).first;
  }
  const Plan& p = *it->second;
  SPINDLE_CUBLAS_CHECK(cublasLtMatmul(impl_->handle, p.op, &g.alpha, g.B, p.a, g.A, p.b, &g.beta,
                                      g.C_in != nullptr ? g.C_in : g.C, p.c, g.C, p.c, &p.algo,
                                      impl_->workspace,
                                      kWorkspaceBytes, stream));
  return Status::Ok();
}

std::string Blas::AlgorithmName(const GemmArgs& args) const {
  const auto it = impl_->plans.find(KeyOf(args));
  if (it == impl_->plans.end()) return "";
  const cublasLtMatmulAlgo_t& algo = it->second->algo;
  std::string name;
  // Each attribute this cuBLASLt reports, as "name value".
  auto add = [&](const char* label, cublasLtMatmulAlgoConfigAttributes_t attr) {
    uint32_t v = 0;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) !=
        CUBLAS_STATUS_SUCCESS)
      return;
    name += (name.empty() ? "" : " ") + std::string(label) + " " + std::to_string(v);
  };
  add("id", CUBLASLT_ALGO_CONFIG_ID);
  add("tile", CUBLASLT_ALGO_CONFIG_TILE_ID);
  add("stages", CUBLASLT_ALGO_CONFIG_STAGES_ID);
  add("cluster", CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
  add("splitk", CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  add("swizzle", CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING);
  return name;
}

Status Blas::LinearForward(const void* x, const void* W, void* y, int64_t T, int64_t in,
                           int64_t out, DType dtype, cudaStream_t stream) {
  GemmArgs g;
  g.trans_b = true;
  g.M = T, g.N = out, g.K = in;
  g.A = x, g.lda = in, g.B = W, g.ldb = in, g.C = y, g.ldc = out;
  g.ab_type = dtype, g.c_type = dtype;
  return Gemm(g, stream);
}

Status Blas::LinearBackward(const void* x, const void* W, const void* dy, void* dx, float* dW,
                            int64_t T, int64_t in, int64_t out, DType dtype,
                            cudaStream_t stream) {
  if (dx != nullptr) {
    GemmArgs g;
    g.M = T, g.N = in, g.K = out;
    g.A = dy, g.lda = out, g.B = W, g.ldb = in, g.C = dx, g.ldc = in;
    g.ab_type = dtype, g.c_type = dtype;
    SPINDLE_RETURN_IF_ERROR(Gemm(g, stream));
  }
  GemmArgs g;
  g.trans_a = true;
  g.M = out, g.N = in, g.K = T;
  g.beta = 1.0f;
  g.A = dy, g.lda = out, g.B = x, g.ldb = in, g.C = dW, g.ldc = in;
  g.ab_type = dtype, g.c_type = DType::kFloat32;
  return Gemm(g, stream);
}

}  // namespace spindle::kernels::cuda
