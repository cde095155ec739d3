// cuBLASLt GEMM wrapper: row-major C = op(A) op(B) is computed as column-major
// C^T = op(B)^T op(A)^T, i.e. cuBLASLt's A is our B. Algorithms come from the heuristic once per
// shape (told each pointer's alignment) and are cached with their layouts. Timing the heuristic's
// other candidates per shape was tried and measured: no gain on the 1b step at 32K (437.5 ms
// without, 439.2 ms with), nor under sustained load (bench/cuda/NOTES.md, "The GEMMs' algorithms
// under the power cap"), so the first is kept and results stay reproducible across processes.
//
// FP8: cuBLASLt's FP8 kernels need its A transposed and its B not ("TN"), both K-contiguous in
// memory. In our row-major terms: trans_b (our B [N, K] is column-major K x N with ld K;
// transposed, cuBLASLt's op(A) is N x K) and not trans_a (our A [M, K] is column-major K x M,
// cuBLASLt's B as it is), i.e. C = A B^T: the forward x W^T directly, the backward's GEMMs from
// transposed codes. The operands' types and scale pointers swap with them: cuBLASLt's A type and
// A scale are our B's. The scale pointers are set on the cached descriptor before every call.
#include "kernels/cuda/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>

namespace spindle::kernels::cuda {

cudaDataType_t CudaDataType(DType t) {
  switch (t) {
    case DType::kFloat32:
      return CUDA_R_32F;
    case DType::kBFloat16:
      return CUDA_R_16BF;
    case DType::kFloat16:
      return CUDA_R_16F;
    case DType::kFp8E4M3:
      return CUDA_R_8F_E4M3;
    case DType::kFp8E5M2:
      return CUDA_R_8F_E5M2;
  }
  return CUDA_R_32F;
}

const char* Fp8ScaleModeName(Fp8ScaleMode m) {
  switch (m) {
    case Fp8ScaleMode::kTensor:
      return "tensor";
    case Fp8ScaleMode::kRow128:
      return "1x128";
    case Fp8ScaleMode::kBlock128:
      return "128x128";
  }
  return "unknown";
}

namespace {

DType BTypeOf(const GemmArgs& g) { return g.b_type.value_or(g.ab_type); }

using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int,
                       bool, int, int, int, int, int, bool, int, int, bool>;

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
                         al.a, al.b, al.c, g.candidate, static_cast<int>(BTypeOf(g)),
                         g.fast_accum, static_cast<int>(g.a_scale_mode),
                         static_cast<int>(g.b_scale_mode), g.own_kernel);
}

bool BlockScaled(const GemmArgs& g) {
  return g.a_scale_mode != Fp8ScaleMode::kTensor || g.b_scale_mode != Fp8ScaleMode::kTensor;
}

// What a block-scaled FP8 GEMM needs on any path (see gemm.h); Ok otherwise.
Status CheckBlockScaled(const GemmArgs& g) {
  const DType a = g.ab_type, b = BTypeOf(g);
  SPINDLE_CHECK_ARG(IsFp8(a) && IsFp8(b), "Gemm: block scales need FP8 operands");
  auto known = [](Fp8ScaleMode m) {
    return m == Fp8ScaleMode::kTensor || m == Fp8ScaleMode::kRow128 ||
           m == Fp8ScaleMode::kBlock128;
  };
  SPINDLE_CHECK_ARG(known(g.a_scale_mode) && known(g.b_scale_mode), "Gemm: unknown scale mode");
  if (g.trans_a || !g.trans_b) {
    return {StatusCode::kUnsupported,
            "Gemm: FP8 operands take only trans_a = false, trans_b = true (C = A B^T, both "
            "K-contiguous); pass the transposed codes (Fp8BlockOutput::codes_t)"};
  }
  SPINDLE_CHECK_ARG(g.a_scale != nullptr && g.b_scale != nullptr,
                    "Gemm: FP8 operands need a_scale and b_scale");
  SPINDLE_CHECK_ARG(!g.fast_accum, "Gemm: no fast accumulation with block scales");
  SPINDLE_CHECK_ARG(g.lda >= g.K && g.ldb >= g.K && g.ldc >= g.N,
                    "Gemm: leading dimensions below the rows' lengths");
  SPINDLE_CHECK_ARG(g.A != nullptr && g.B != nullptr && g.C != nullptr,
                    "Gemm: null operand or output");
  SPINDLE_CHECK_ARG(g.c_type == DType::kBFloat16 || g.c_type == DType::kFloat32,
                    "Gemm: FP8 output must be bf16 or fp32");
  return Status::Ok();
}

// Whether cuBLASLt's block-scaled kernels may take the problem, by the documented limits.
bool CublasLtTakesBlockScaled(const GemmArgs& g) {
  if (g.own_kernel) return false;
  const Fp8ScaleMode a = g.a_scale_mode, b = g.b_scale_mode;
  if (a == Fp8ScaleMode::kTensor || b == Fp8ScaleMode::kTensor) return false;  // no mixing
  if (a == Fp8ScaleMode::kBlock128 && b == Fp8ScaleMode::kBlock128) return false;
  if (g.ab_type == DType::kFp8E5M2 && BTypeOf(g) == DType::kFp8E5M2) return false;
  return g.M % 4 == 0 && g.N % 16 == 0 && g.K % 16 == 0 && g.lda % 16 == 0 && g.ldb % 16 == 0 &&
         Alignment(g.A) >= 16 && Alignment(g.B) >= 16 && Alignment(g.a_scale) >= 16 &&
         Alignment(g.b_scale) >= 16;
}

// cuBLASLt's scale mode of ours.
int32_t LtScaleMode(Fp8ScaleMode m) {
  switch (m) {
    case Fp8ScaleMode::kRow128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case Fp8ScaleMode::kBlock128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    case Fp8ScaleMode::kTensor:
      break;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

// What cuBLASLt's FP8 kernels accept (see gemm.h); Ok for non-FP8 arguments.
Status CheckFp8(const GemmArgs& g) {
  const DType a = g.ab_type, b = BTypeOf(g);
  if (!IsFp8(a) && !IsFp8(b)) return Status::Ok();
  SPINDLE_CHECK_ARG(IsFp8(a) && IsFp8(b), "Gemm: an FP8 operand needs an FP8 partner");
  if (a == DType::kFp8E5M2 && b == DType::kFp8E5M2) {
    return {StatusCode::kUnsupported, "Gemm: cuBLASLt has no E5M2 x E5M2 kernel"};
  }
  if (g.trans_a || !g.trans_b) {
    return {StatusCode::kUnsupported,
            "Gemm: FP8 operands take only trans_a = false, trans_b = true (C = A B^T, both "
            "K-contiguous: cuBLASLt's TN); pass the transposed codes (Fp8Output::codes_t)"};
  }
  SPINDLE_CHECK_ARG(g.a_scale != nullptr && g.b_scale != nullptr,
                    "Gemm: FP8 operands need a_scale and b_scale");
  // Measured on an H200 with cuBLASLt 13.1: scale pointers 8 bytes past a 16-byte boundary make
  // cublasLtMatmul return CUBLAS_STATUS_NOT_SUPPORTED after the heuristic accepted the problem.
  SPINDLE_CHECK_ARG(Alignment(g.a_scale) >= 16 && Alignment(g.b_scale) >= 16,
                    "Gemm: FP8 scale pointers must be 16-byte aligned");
  // N is cuBLASLt's M (the rows of its column-major D).
  SPINDLE_CHECK_ARG(g.K % 16 == 0 && g.N % 16 == 0 && g.lda % 16 == 0 && g.ldb % 16 == 0,
                    "Gemm: FP8 needs K, N, lda and ldb multiples of 16");
  SPINDLE_CHECK_ARG(Alignment(g.A) >= 16 && Alignment(g.B) >= 16,
                    "Gemm: FP8 operands must be 16-byte aligned");
  SPINDLE_CHECK_ARG(g.c_type == DType::kBFloat16 || g.c_type == DType::kFloat32,
                    "Gemm: FP8 output must be bf16 or fp32");
  return Status::Ok();
}

// The FP8 scale pointers (cuBLASLt's A is our B) on a plan's descriptor.
Status SetScales(cublasLtMatmulDesc_t op, const GemmArgs& g) {
  const void* lt_a = g.b_scale;
  const void* lt_b = g.a_scale;
  SPINDLE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                      &lt_a, sizeof(lt_a)));
  SPINDLE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                      &lt_b, sizeof(lt_b)));
  return Status::Ok();
}

// One cached plan: descriptors and the chosen algorithm.
struct Plan {
  bool own = false;  // a block-scaled problem that runs on our own kernel
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
  const bool blocks = BlockScaled(g);
  SPINDLE_RETURN_IF_ERROR(blocks ? CheckBlockScaled(g) : CheckFp8(g));
  const bool fp8 = IsFp8(g.ab_type);
  const Key key = KeyOf(g);
  auto it = impl_->plans.find(key);
  if (it == impl_->plans.end() && blocks && !CublasLtTakesBlockScaled(g)) {
    auto plan = std::make_unique<Plan>();
    plan->own = true;
    it = impl_->plans.emplace(key, std::move(plan)).first;
  }
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
    if (blocks) {  // cuBLASLt's A is our B
      const int32_t lt_a = LtScaleMode(g.b_scale_mode), lt_b = LtScaleMode(g.a_scale_mode);
      SPINDLE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
          plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &lt_a, sizeof(lt_a)));
      SPINDLE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
          plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &lt_b, sizeof(lt_b)));
    }
    if (fp8) {
      SPINDLE_RETURN_IF_ERROR(SetScales(plan->op, g));
      const int8_t fast = g.fast_accum ? 1 : 0;
      SPINDLE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
          plan->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
    }
    const cudaDataType_t at = CudaDataType(g.ab_type), bt = CudaDataType(BTypeOf(g)),
                         ct = CudaDataType(g.c_type);
    // Our B in column-major: untransposed row-major [K, N] is col-major [N x K] with ld ldb.
    SPINDLE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, bt, g.trans_b ? g.K : g.N,
                                                    g.trans_b ? g.N : g.K, g.ldb));
    SPINDLE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, at, g.trans_a ? g.M : g.K,
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
    if (blocks && (st != CUBLAS_STATUS_SUCCESS || found <= g.candidate)) {
      // cuBLASLt has no kernel for this block-scaled problem: ours runs it.
      auto own = std::make_unique<Plan>();
      own->own = true;
      plan = std::move(own);
      it = impl_->plans.emplace(key, std::move(plan)).first;
      return Fp8BlockScaledGemmOwn(g, stream);
    }
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
  Plan& p = *it->second;
  // A plan's key holds the operands' alignments but not the scales': a call whose scale tensors
  // are less aligned than its plan's first runs on our kernel.
  if (p.own || (blocks && !CublasLtTakesBlockScaled(g))) return Fp8BlockScaledGemmOwn(g, stream);
  // The scales move from call to call (one plan serves every tensor of a shape).
  if (fp8) SPINDLE_RETURN_IF_ERROR(SetScales(p.op, g));
  const cublasStatus_t st =
      cublasLtMatmul(impl_->handle, p.op, &g.alpha, g.B, p.a, g.A, p.b, &g.beta,
                     g.C_in != nullptr ? g.C_in : g.C, p.c, g.C, p.c, &p.algo, impl_->workspace,
                     kWorkspaceBytes, stream);
  if (blocks && st == CUBLAS_STATUS_NOT_SUPPORTED) {
    // The heuristic offered an algorithm that the call then refused (nothing was enqueued): this
    // shape runs on our kernel from now on.
    p.own = true;
    return Fp8BlockScaledGemmOwn(g, stream);
  }
  SPINDLE_CUBLAS_CHECK(st);
  return Status::Ok();
}

std::string Blas::AlgorithmName(const GemmArgs& args) const {
  const auto it = impl_->plans.find(KeyOf(args));
  if (it == impl_->plans.end()) return "";
  if (it->second->own) return "own block-scaled kernel";
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

namespace {
// g's A and B from FP8 operands.
void SetFp8Operands(GemmArgs& g, const Fp8Operand& a, const Fp8Operand& b) {
  g.A = a.codes, g.ab_type = a.format, g.a_scale = a.inverse_scale;
  g.B = b.codes, g.b_type = b.format, g.b_scale = b.inverse_scale;
  g.a_scale_mode = a.scale_mode, g.b_scale_mode = b.scale_mode;
}
}  // namespace

Status Blas::LinearForwardFp8(const Fp8Operand& x, const Fp8Operand& W, void* y, DType y_type,
                              int64_t T, int64_t in, int64_t out, cudaStream_t stream) {
  GemmArgs g;
  g.trans_b = true;
  g.M = T, g.N = out, g.K = in;
  SetFp8Operands(g, x, W);
  g.lda = in, g.ldb = in, g.C = y, g.ldc = out;
  g.c_type = y_type;
  return Gemm(g, stream);
}

Status Blas::LinearBackwardFp8(const Fp8Operand& dy, const Fp8Operand& dy_t,
                               const Fp8Operand& W_t, const Fp8Operand& x_t, void* dx,
                               DType dx_type, float* dW, int64_t T, int64_t in, int64_t out,
                               cudaStream_t stream) {
  if (dx != nullptr) {  // dx = dy W = dy (W^T)^T
    GemmArgs g;
    g.trans_b = true;
    g.M = T, g.N = in, g.K = out;
    SetFp8Operands(g, dy, W_t);
    g.lda = out, g.ldb = out, g.C = dx, g.ldc = in;
    g.c_type = dx_type;
    SPINDLE_RETURN_IF_ERROR(Gemm(g, stream));
  }
  GemmArgs g;  // dW += dy^T x = (dy^T) (x^T)^T
  g.trans_b = true;
  g.M = out, g.N = in, g.K = T;
  g.beta = 1.0f;
  SetFp8Operands(g, dy_t, x_t);
  g.lda = T, g.ldb = T, g.C = dW, g.ldc = in;
  g.c_type = DType::kFloat32;
  return Gemm(g, stream);
}

}  // namespace spindle::kernels::cuda
