// Causal attention on cuDNN's backend graph API. cuDNN's native SDPA operation has no causal
// flag in the versions we run (9.14 on the GPU machine), so the graphs here are the decomposed
// flash-attention graphs that cuDNN's fused attention engine recognizes; the node sequence,
// virtual-tensor types and strides follow what cudnn_frontend (v1.14 - v1.23) emits for
// sdpa(causal, generate_stats) and sdpa_backward(causal) on cuDNN 9.10 - 9.20:
//
//   forward:  S = Q K^T (fp32) ; S *= scale ; S = select(S, -inf, row >= col) with row, col from
//             GEN_INDEX ; M = max_j S ; E = exp(S - M) ; Z = sum_j E ; stats = M + log Z ;
//             P = E / Z (bf16) ; O = P V
//   backward: Dsum = sum_d dO * O (fp32, kept in the workspace) ; S = Q K^T * scale ;
//             [padding mask, see below] ; S -= stats ; causal select ; P = exp(S) ;
//             dV = P^T dO ; dP = dO V^T ; dS = (dP - Dsum) * P * scale ; dK = dS^T Q ;
//             dQ = dS K into an fp32 accumulator in the workspace, then IDENTITY into dq
//             (deterministic mode: dQ = dS K written directly, no accumulator; cuDNN then keeps
//             dP in its workspace, H L^2 bf16 per batch: 34 GB at L = 32K, H = 16)
//
// Tensors are [B, H, S, D] views: Q with strides (_, head, token, 1); K and V enter transposed
// ([B,H,D,S], strides (_, head, 1, token)). Scalars (scale, -inf, 1) are by-value tensors whose
// values travel in the variant pack, so the scale is not part of the plan key. cuDNN <= 9.15
// needs a padding mask with seq-len tensors (= L) in a dense backward when L % 128 != 0 (a known
// bug, worked around the same way by cudnn_frontend); the two int32 lengths live in a small
// device buffer owned by the plan.
//
// Unmasked graphs (ForwardFull / BackwardFull): the same graphs with queries and keys of
// different lengths and no causal select, planned for lengths rounded up to powers of two (at
// least 128) with the real lengths as run-time seq lengths of the padding mask, so a few plans
// serve every call; the inputs go through dense zero-padded staging copies in the workspace and
// the results come back from it. The padding mask also makes cuDNN run a faster backward kernel
// for these graphs (measured on an H200 in bench/RESULTS_GPU.md).
//
// Documents. One document (empty ones aside) is one dense graph over all T tokens, B = 1, stats
// [1,H,T,1] written in place: the fast path. Several documents take one of two routes:
//  - ragged (the default; cuDNN >= 9.6, Dqk and Dv multiples of 16, not the deterministic
//    backward): one graph with B = documents rounded up to a power of two (the extra ones empty)
//    and S = the longest document rounded up to a power of two (at least 64), as PyTorch's
//    nested-tensor path builds it: int32 ragged offsets (document start * token stride) on every
//    q/k/v/out-shaped tensor, per-document lengths feeding a padding mask and the matmul
//    overrides. Offsets and lengths are run-time data in a small device buffer, uploaded only
//    when cu_seqlens changes, so a handful of plans serve every batch. cuDNN takes ragged stats
//    only token-major ([T, H]), so they go through a workspace copy, transposed to and from the
//    caller's [H, T] with one strided copy per head; the backward's row sums and dQ accumulator
//    are ragged too (cudnn_frontend's max_total_seq_len layout), sized by T, not B * S.
//  - per document (otherwise, or with SPINDLE_SDPA_PER_DOCUMENT=1): one dense graph per document
//    on sub-views of the caller's buffers, a plan per distinct length (~50 ms to build once
//    cuDNN has compiled the kernel), stats through a dense [H, L] staging buffer. A one-token
//    document has out = v, stats = scale q.k, dq = dk = 0, dv = dout: its forward runs the
//    two-token graph on a zero-padded staging copy (the causal mask keeps the padding token out
//    of the first row), its backward is a memset and a copy.
//
// Engines: heuristics mode A, then the fallback list; the first engine config whose execution
// plan finalizes is kept. If no engine takes a graph, one alternative spelling of it (integer
// index arithmetic, io-typed K view) is tried before giving up; the error then lists every
// attempt. SPINDLE_SDPA_LOG=1 prints each plan build (engine, workspace, time, rejections) to
// stderr.
#include "kernels/cuda/sdpa.h"

#include <cudnn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/ops.h"

namespace spindle::kernels::cuda {
namespace {

// ---- errors -----------------------------------------------------------------------------------

std::string LastCudnnMessage() {
  char buf[2048] = {0};
  cudnnGetLastErrorString(buf, sizeof(buf));
  return buf;
}

Status CudnnStatus(cudnnStatus_t st, const std::string& expr, const char* file, int line) {
  std::string msg = std::string(cudnnGetErrorString(st)) + " from " + expr + " at " + file + ":" +
                    std::to_string(line);
  const std::string detail = LastCudnnMessage();
  if (!detail.empty()) msg += " (" + detail + ")";
  return {StatusCode::kCudnnError, msg};
}

Status Unsupported(const std::string& what) { return {StatusCode::kUnsupported, what}; }

}  // namespace
}  // namespace spindle::kernels::cuda

// Evaluates a cudnnStatus_t expression; returns a kCudnnError Status naming it, with
// cudnnGetErrorString and cuDNN's last detailed message, when it is not CUDNN_STATUS_SUCCESS.
#define SPINDLE_CUDNN_CHECK(expr)                                                              \
  do {                                                                                         \
    const cudnnStatus_t spindle_cudnn_st_ = (expr);                                            \
    if (spindle_cudnn_st_ != CUDNN_STATUS_SUCCESS) {                                           \
      return ::spindle::kernels::cuda::CudnnStatus(spindle_cudnn_st_, #expr, __FILE__,         \
                                                   __LINE__);                                  \
    }                                                                                          \
  } while (0)

namespace spindle::kernels::cuda {
namespace {

constexpr int64_t kAlign = 256;
int64_t AlignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

bool LogEnabled() {
  static const bool on = [] {
    const char* e = std::getenv("SPINDLE_SDPA_LOG");
    return e != nullptr && e[0] != '\0' && e[0] != '0';
  }();
  return on;
}

// ---- descriptors and the graph builder ------------------------------------------------------------

struct DescDeleter {
  void operator()(void* d) const {
    if (d != nullptr) cudnnBackendDestroyDescriptor(static_cast<cudnnBackendDescriptor_t>(d));
  }
};
using DescPtr = std::unique_ptr<void, DescDeleter>;

using Dims = std::vector<int64_t>;

struct TensorRef {
  cudnnBackendDescriptor_t desc = nullptr;
  int64_t uid = 0;
};

// Fixed uids of the tensors the variant pack carries; virtual tensors count up from kUidVirtual.
enum : int64_t {
  kUidQ = 1,
  kUidK,
  kUidV,
  kUidO,
  kUidStats,
  kUidDO,
  kUidDQ,
  kUidDK,
  kUidDV,
  kUidDsum,     // workspace: sum_d dO * O, fp32 [1,H,L,1]
  kUidDqAccum,  // workspace: fp32 dQ accumulator [1,H,L,Dqk]
  kUidSeqQ,     // device int32: plan-owned (padding workaround) or per call (unmasked graphs)
  kUidSeqKv,
  kUidScale,  // by value
  kUidOne,
  kUidNegInf,
  kUidNegInfPad,
  kUidRaggedQ,  // ragged path: int32 [B+1] element offsets of each document's first token
  kUidRaggedK,
  kUidRaggedV,
  kUidRaggedO,
  kUidRaggedStats,
  kUidVirtual = 100,
};

// Builds backend descriptors, keeping each alive in `keep`. The first failure is recorded with
// the node and attribute it came from; every later call is then a no-op, so the graph code reads
// top to bottom without a check per line.
class GraphBuilder {
 public:
  explicit GraphBuilder(std::vector<DescPtr>* keep) : keep_(keep) {}

  const Status& status() const { return status_; }
  bool ok() const { return status_.ok(); }
  const std::vector<cudnnBackendDescriptor_t>& ops() const { return ops_; }
  // Uids of the non-virtual tensors created so far: what the variant pack must carry.
  const std::vector<int64_t>& io_uids() const { return io_uids_; }

  TensorRef Tensor(const char* name, int64_t uid, const Dims& dims, const Dims& strides,
                   cudnnDataType_t type, bool is_virtual, bool by_value = false,
                   const TensorRef* ragged = nullptr) {
    TensorRef t;
    t.uid = uid != 0 ? uid : next_uid_++;
    cudnnBackendDescriptor_t d = Create(CUDNN_BACKEND_TENSOR_DESCRIPTOR, name);
    const int64_t alignment = 16;
    const bool yes = true;
    Set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, name,
        "CUDNN_ATTR_TENSOR_DATA_TYPE");
    Set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, static_cast<int64_t>(dims.size()),
        dims.data(), name, "CUDNN_ATTR_TENSOR_DIMENSIONS");
    Set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, static_cast<int64_t>(strides.size()),
        strides.data(), name, "CUDNN_ATTR_TENSOR_STRIDES");
    Set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &t.uid, name,
        "CUDNN_ATTR_TENSOR_UNIQUE_ID");
    Set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, name,
        "CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT");
    if (is_virtual) {
      Set(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes, name,
          "CUDNN_ATTR_TENSOR_IS_VIRTUAL");
    }
    if (by_value) {
      Set(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes, name,
          "CUDNN_ATTR_TENSOR_IS_BY_VALUE");
    }
    if (ragged != nullptr) {
      Set(d, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ragged->desc,
          name, "CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC");
    }
    Finalize(d, name);
    t.desc = d;
    if (!is_virtual) io_uids_.push_back(t.uid);
    return t;
  }

  TensorRef Virtual(const char* name, const Dims& dims, const Dims& strides, cudnnDataType_t type,
                    const TensorRef* ragged = nullptr) {
    return Tensor(name, 0, dims, strides, type, /*is_virtual=*/true, false, ragged);
  }

  TensorRef Scalar(const char* name, int64_t uid) {
    // Rank 4 like every other tensor of the graph (cuDNN rejects rank-mismatched operands).
    return Tensor(name, uid, {1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, /*is_virtual=*/false,
                  /*by_value=*/true);
  }

  // y = mode(x[, b][, t]); axis only for GEN_INDEX.
  void Pointwise(const char* name, cudnnPointwiseMode_t mode, cudnnDataType_t compute,
                 const TensorRef& x, const TensorRef& y, const TensorRef* b = nullptr,
                 const TensorRef* t = nullptr, int64_t axis = -1) {
    cudnnBackendDescriptor_t pw = Create(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, name);
    Set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, name,
        "CUDNN_ATTR_POINTWISE_MODE");
    Set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &compute, name,
        "CUDNN_ATTR_POINTWISE_MATH_PREC");
    if (mode == CUDNN_POINTWISE_GEN_INDEX) {
      Set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, name,
          "CUDNN_ATTR_POINTWISE_AXIS");
    }
    Finalize(pw, name);
    cudnnBackendDescriptor_t op = Create(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, name);
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw,
        name, "CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR");
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x.desc, name,
        "CUDNN_ATTR_OPERATION_POINTWISE_XDESC");
    if (b != nullptr) {
      Set(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b->desc,
          name, "CUDNN_ATTR_OPERATION_POINTWISE_BDESC");
    }
    if (t != nullptr) {
      Set(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t->desc,
          name, "CUDNN_ATTR_OPERATION_POINTWISE_TDESC");
    }
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y.desc, name,
        "CUDNN_ATTR_OPERATION_POINTWISE_YDESC");
    const float one = 1.0f;
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one, name,
        "CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1");
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one, name,
        "CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2");
    Finalize(op, name);
    AddOp(op);
  }

  void Reduce(const char* name, cudnnReduceTensorOp_t mode, const TensorRef& x,
              const TensorRef& y) {
    cudnnBackendDescriptor_t r = Create(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, name);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    Set(r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, name,
        "CUDNN_ATTR_REDUCTION_COMP_TYPE");
    Set(r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, name,
        "CUDNN_ATTR_REDUCTION_OPERATOR");
    Finalize(r, name);
    cudnnBackendDescriptor_t op = Create(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, name);
    Set(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &r, name,
        "CUDNN_ATTR_OPERATION_REDUCTION_DESC");
    Set(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x.desc, name,
        "CUDNN_ATTR_OPERATION_REDUCTION_XDESC");
    Set(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y.desc, name,
        "CUDNN_ATTR_OPERATION_REDUCTION_YDESC");
    Finalize(op, name);
    AddOp(op);
  }

  // c = a b over the last two dimensions; optional per-batch M/N/K overrides (int32 tensors).
  void Matmul(const char* name, const TensorRef& a, const TensorRef& b, const TensorRef& c,
              const TensorRef* m_override = nullptr, const TensorRef* n_override = nullptr,
              const TensorRef* k_override = nullptr) {
    cudnnBackendDescriptor_t mm = Create(CUDNN_BACKEND_MATMUL_DESCRIPTOR, name);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    Set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, name,
        "CUDNN_ATTR_MATMUL_COMP_TYPE");
    Finalize(mm, name);
    cudnnBackendDescriptor_t op = Create(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, name);
    Set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a.desc, name,
        "CUDNN_ATTR_OPERATION_MATMUL_ADESC");
    Set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b.desc, name,
        "CUDNN_ATTR_OPERATION_MATMUL_BDESC");
    Set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c.desc, name,
        "CUDNN_ATTR_OPERATION_MATMUL_CDESC");
    Set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm, name,
        "CUDNN_ATTR_OPERATION_MATMUL_DESC");
    if (m_override != nullptr) {
      Set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
          &m_override->desc, name, "CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC");
    }
    if (n_override != nullptr) {
      Set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
          &n_override->desc, name, "CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC");
    }
    if (k_override != nullptr) {
      Set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
          &k_override->desc, name, "CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC");
    }
    Finalize(op, name);
    AddOp(op);
  }

  // A view of x with y's dims and strides (no data movement).
  void Reshape(const char* name, const TensorRef& x, const TensorRef& y) {
    cudnnBackendDescriptor_t op = Create(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, name);
    Set(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x.desc, name,
        "CUDNN_ATTR_OPERATION_RESHAPE_XDESC");
    Set(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y.desc, name,
        "CUDNN_ATTR_OPERATION_RESHAPE_YDESC");
    Finalize(op, name);
    AddOp(op);
  }

  cudnnBackendDescriptor_t Create(cudnnBackendDescriptorType_t type, const char* node) {
    if (!ok()) return nullptr;
    cudnnBackendDescriptor_t d = nullptr;
    const cudnnStatus_t st = cudnnBackendCreateDescriptor(type, &d);
    if (st != CUDNN_STATUS_SUCCESS) {
      Fail(st, std::string("cudnnBackendCreateDescriptor(") + std::to_string(type) + ") for '" +
                   node + "'");
      return nullptr;
    }
    keep_->emplace_back(d);
    return d;
  }

  void Set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t attr,
           cudnnBackendAttributeType_t type, int64_t n, const void* value, const char* node,
           const char* attr_name) {
    if (!ok()) return;
    const cudnnStatus_t st = cudnnBackendSetAttribute(d, attr, type, n, value);
    if (st != CUDNN_STATUS_SUCCESS) {
      Fail(st, std::string("cudnnBackendSetAttribute(") + attr_name + ") for '" + node + "'");
    }
  }

  void Finalize(cudnnBackendDescriptor_t d, const char* node) {
    if (!ok()) return;
    const cudnnStatus_t st = cudnnBackendFinalize(d);
    if (st != CUDNN_STATUS_SUCCESS) {
      Fail(st, std::string("cudnnBackendFinalize for '") + node + "'");
    }
  }

 private:
  void AddOp(cudnnBackendDescriptor_t op) {
    if (ok()) ops_.push_back(op);
  }
  void Fail(cudnnStatus_t st, const std::string& what) {
    std::string msg = std::string(cudnnGetErrorString(st)) + " from " + what;
    const std::string detail = LastCudnnMessage();
    if (!detail.empty()) msg += " (" + detail + ")";
    status_ = Status(StatusCode::kCudnnError, msg);
  }

  std::vector<DescPtr>* keep_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  std::vector<int64_t> io_uids_;
  int64_t next_uid_ = kUidVirtual;
  Status status_;
};

// ---- the two graphs ----------------------------------------------------------------------------

// One graph: direction, sizes and views. Dense graphs (B = 1) cover one sequence of L tokens;
// ragged graphs cover B documents of at most L tokens each, placed by per-document offsets and
// lengths that are run-time data (so one plan serves every document mix with the same B and L).
struct GraphSpec {
  bool backward = false;
  bool ragged = false;
  int64_t B = 1, L = 0, H = 0, Dqk = 0, Dv = 0;
  SdpaView q, k, v, o;
  cudnnDataType_t io = CUDNN_DATA_BFLOAT16;
  bool deterministic = false;       // backward only
  bool padding_workaround = false;  // dense backward only: seq-len padding mask (cuDNN <= 9.15)
  // Dense only: keys (0: L, the queries' length) and the causal mask; a graph with causal false
  // lets every query attend every key (ForwardFull / BackwardFull).
  int64_t Lkv = 0;
  bool causal = true;
  int variant = 0;  // 0: cudnn_frontend's spelling; 1: the alternative tried when 0 finds no engine

  std::vector<int64_t> Key() const {
    return {backward,
            ragged,
            B,
            L,
            H,
            Dqk,
            Dv,
            q.token_stride,
            q.head_stride,
            k.token_stride,
            k.head_stride,
            v.token_stride,
            v.head_stride,
            o.token_stride,
            o.head_stride,
            static_cast<int64_t>(io),
            deterministic,
            Lkv,
            causal};
  }
  int64_t KeyLen() const { return Lkv > 0 ? Lkv : L; }
};

// Batch stride of a [1, H, L, D] view (one batch: any value past the last element works); ragged
// tensors take their batch offsets from the offset tensor, so their batch stride is a placeholder.
int64_t BatchStride(const GraphSpec& s, const SdpaView& v, int64_t D) {
  if (s.ragged) return INT32_MAX;
  return std::max({std::max(s.L, s.KeyLen()) * v.token_stride, s.H * v.head_stride, D});
}

// What a finished plan needs at execution time.
struct Plan {
  std::vector<DescPtr> keep;  // tensors, operations, graph, engine config, plan
  cudnnBackendDescriptor_t plan = nullptr;
  std::vector<int64_t> uids;  // non-virtual tensors of the graph (variant pack order)
  int64_t engine_ws = 0;      // cuDNN's own workspace
  GraphSpec spec;             // what was built (variant included)
  int32_t* seqlen_dev = nullptr;  // {L, Lkv} for the dense padding workaround
  int64_t engine_index = -1;
  ~Plan() {
    keep.clear();
    if (seqlen_dev != nullptr) cudaFree(seqlen_dev);
  }
};

// Tensors the two graphs share: inputs, scalars, and for ragged graphs the offsets and lengths.
struct Common {
  TensorRef Q, Kt, V, O, stats, scale, neg_inf, seq_q, seq_kv, neg_inf_pad;
  TensorRef rag_q, rag_k, rag_v, rag_o, rag_stats;
  const TensorRef *mq = nullptr, *mkv = nullptr;  // matmul M/N/K overrides (seq lengths)
  const TensorRef *rq = nullptr, *rk = nullptr, *rv = nullptr, *ro = nullptr, *rs = nullptr;
  Dims rows, rows_st, sq, sq_st, q_st, k_st, v_st, o_st;
};

void BuildCommon(const GraphSpec& s, GraphBuilder& g, Common& c, bool v_transposed) {
  const int64_t B = s.B, L = s.L, Lk = s.KeyLen(), H = s.H, Dqk = s.Dqk, Dv = s.Dv;
  const cudnnDataType_t F = CUDNN_DATA_FLOAT, I = CUDNN_DATA_INT32;
  if (s.ragged) {
    const Dims od = {B + 1, 1, 1, 1}, os = {1, 1, 1, 1};
    c.rag_q = g.Tensor("ragged offsets q", kUidRaggedQ, od, os, I, false);
    c.rag_k = g.Tensor("ragged offsets k", kUidRaggedK, od, os, I, false);
    c.rag_v = g.Tensor("ragged offsets v", kUidRaggedV, od, os, I, false);
    c.rag_o = g.Tensor("ragged offsets o", kUidRaggedO, od, os, I, false);
    c.rag_stats = g.Tensor("ragged offsets stats", kUidRaggedStats, od, os, I, false);
    c.rq = &c.rag_q, c.rk = &c.rag_k, c.rv = &c.rag_v, c.ro = &c.rag_o, c.rs = &c.rag_stats;
  }
  c.q_st = {BatchStride(s, s.q, Dqk), s.q.head_stride, s.q.token_stride, 1};
  c.k_st = {BatchStride(s, s.k, Dqk), s.k.head_stride, s.k.token_stride, 1};
  c.v_st = {BatchStride(s, s.v, Dv), s.v.head_stride, s.v.token_stride, 1};
  c.o_st = {BatchStride(s, s.o, Dv), s.o.head_stride, s.o.token_stride, 1};
  c.Q = g.Tensor("Q", kUidQ, {B, H, L, Dqk}, c.q_st, s.io, false, false, c.rq);
  c.Kt = g.Tensor("K^T", kUidK, {B, H, Dqk, Lk}, {c.k_st[0], c.k_st[1], 1, c.k_st[2]}, s.io, false,
                  false, c.rk);
  if (v_transposed) {
    c.V = g.Tensor("V^T", kUidV, {B, H, Dv, Lk}, {c.v_st[0], c.v_st[1], 1, c.v_st[2]}, s.io, false,
                   false, c.rv);
  } else {
    c.V = g.Tensor("V", kUidV, {B, H, Lk, Dv}, c.v_st, s.io, false, false, c.rv);
  }
  c.O = g.Tensor("O", kUidO, {B, H, L, Dv}, c.o_st, s.io, false, false, c.ro);
  c.rows = {B, H, L, 1};
  // Dense stats: [H, L] per batch. Ragged stats: token-major [T, H] (what cuDNN supports with
  // ragged offsets), transposed to and from the caller's [H, T] around the graph.
  c.rows_st = s.ragged ? Dims{L * H, 1, H, 1} : Dims{H * L, L, 1, 1};
  c.sq = {B, H, L, Lk};
  c.sq_st = {H * L * Lk, L * Lk, Lk, 1};
  c.stats = g.Tensor("stats", kUidStats, c.rows, c.rows_st, F, false, false, c.rs);
  c.scale = g.Scalar("attn_scale", kUidScale);
  // Every non-virtual tensor must appear in some operation: the unmasked graphs have no -inf.
  if (s.causal) c.neg_inf = g.Scalar("-inf", kUidNegInf);
  if (s.ragged || s.padding_workaround) {
    c.seq_q = g.Tensor("seq_len_q", kUidSeqQ, {B, 1, 1, 1}, {1, 1, 1, 1}, I, false);
    c.seq_kv = g.Tensor("seq_len_kv", kUidSeqKv, {B, 1, 1, 1}, {1, 1, 1, 1}, I, false);
    c.neg_inf_pad = g.Scalar("-inf (padding)", kUidNegInfPad);
    c.mq = &c.seq_q;
    c.mkv = &c.seq_kv;
  }
}

// select(x, -inf, row < seq_q && col < seq_kv): cudnn_frontend's padding mask.
TensorRef PaddingMask(GraphBuilder& g, const Common& c, const TensorRef& x) {
  const cudnnDataType_t I = CUDNN_DATA_INT32, Bo = CUDNN_DATA_BOOLEAN;
  const TensorRef row = g.Virtual("padding row index", c.sq, c.sq_st, I);
  g.Pointwise("gen_row_idx_padding", CUDNN_POINTWISE_GEN_INDEX, I, x, row, nullptr, nullptr, 2);
  const TensorRef col = g.Virtual("padding col index", c.sq, c.sq_st, I);
  g.Pointwise("gen_col_idx_padding", CUDNN_POINTWISE_GEN_INDEX, I, x, col, nullptr, nullptr, 3);
  const TensorRef rin = g.Virtual("row<seq_q", c.sq, c.sq_st, Bo);
  g.Pointwise("lt_row_sq_padding", CUDNN_POINTWISE_CMP_LT, Bo, row, rin, &c.seq_q);
  const TensorRef cin = g.Virtual("col<seq_kv", c.sq, c.sq_st, Bo);
  g.Pointwise("lt_col_skv_padding", CUDNN_POINTWISE_CMP_LT, Bo, col, cin, &c.seq_kv);
  const TensorRef inside = g.Virtual("inside", c.sq, c.sq_st, Bo);
  g.Pointwise("and_row_col_padding", CUDNN_POINTWISE_LOGICAL_AND, Bo, rin, inside, &cin);
  const TensorRef y = g.Virtual("padding-masked S", c.sq, c.sq_st, CUDNN_DATA_FLOAT);
  g.Pointwise("select_padding", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, x, y,
              &c.neg_inf_pad, &inside);
  return y;
}

// select(x, -inf, row >= col): the causal (top-left diagonal) mask.
TensorRef CausalMask(const GraphSpec& s, GraphBuilder& g, const Common& c, const TensorRef& x) {
  // Index arithmetic: cudnn_frontend leaves GEN_INDEX at the graph's fp32 compute type.
  const cudnnDataType_t index_compute = s.variant == 0 ? CUDNN_DATA_FLOAT : CUDNN_DATA_INT32;
  const TensorRef row = g.Virtual("row index", c.sq, c.sq_st, CUDNN_DATA_INT32);
  g.Pointwise("gen_row_index", CUDNN_POINTWISE_GEN_INDEX, index_compute, x, row, nullptr, nullptr,
              2);
  const TensorRef col = g.Virtual("col index", c.sq, c.sq_st, CUDNN_DATA_INT32);
  g.Pointwise("gen_col_index", CUDNN_POINTWISE_GEN_INDEX, index_compute, x, col, nullptr, nullptr,
              3);
  const TensorRef keep = g.Virtual("row>=col", c.sq, c.sq_st, CUDNN_DATA_BOOLEAN);
  g.Pointwise("causal row>=col", CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, keep, &col);
  const TensorRef y = g.Virtual("causal-masked S", c.sq, c.sq_st, CUDNN_DATA_FLOAT);
  g.Pointwise("causal select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, x, y, &c.neg_inf,
              &keep);
  return y;
}

void BuildForward(const GraphSpec& s, GraphBuilder& g) {
  const cudnnDataType_t F = CUDNN_DATA_FLOAT;
  Common c;
  BuildCommon(s, g, c, /*v_transposed=*/false);
  const TensorRef S = g.Virtual("S", c.sq, c.sq_st, F);
  g.Matmul("bmm1 Q K^T", c.Q, c.Kt, S, c.mq, c.mkv);
  TensorRef S1 = g.Virtual("S*scale", c.sq, c.sq_st, F);
  g.Pointwise("attn_scale", CUDNN_POINTWISE_MUL, F, S, S1, &c.scale);
  if (s.ragged || s.padding_workaround) S1 = PaddingMask(g, c, S1);
  const TensorRef S2 = s.causal ? CausalMask(s, g, c, S1) : S1;
  // Row statistics inside the graph are [H, L] per batch even when the stats output is ragged.
  const Dims rows_st = {s.H * s.L, s.L, 1, 1};
  const TensorRef M = g.Virtual("row max", c.rows, rows_st, F);
  g.Reduce("row max", CUDNN_REDUCE_TENSOR_MAX, S2, M);
  const TensorRef S3 = g.Virtual("S-max", c.sq, c.sq_st, F);
  g.Pointwise("sub max", CUDNN_POINTWISE_SUB, F, S2, S3, &M);
  const TensorRef E = g.Virtual("exp", c.sq, c.sq_st, F);
  g.Pointwise("exp", CUDNN_POINTWISE_EXP, F, S3, E);
  const TensorRef Z = g.Virtual("sum exp", c.rows, rows_st, F);
  g.Reduce("sum exp", CUDNN_REDUCE_TENSOR_ADD, E, Z);
  const TensorRef logZ = g.Virtual("log sum exp", c.rows, rows_st, F);
  g.Pointwise("log", CUDNN_POINTWISE_LOG, F, Z, logZ);
  g.Pointwise("stats = max + log", CUDNN_POINTWISE_ADD, F, M, c.stats, &logZ);
  const TensorRef P = g.Virtual("P", c.sq, c.sq_st, s.io);
  g.Pointwise("div", CUDNN_POINTWISE_DIV, F, E, P, &Z);
  g.Matmul("bmm2 P V", P, c.V, c.O, c.mq, nullptr, c.mkv);
}

void BuildBackward(const GraphSpec& s, GraphBuilder& g) {
  const int64_t B = s.B, L = s.L, Lk = s.KeyLen(), H = s.H, Dqk = s.Dqk, Dv = s.Dv;
  const cudnnDataType_t F = CUDNN_DATA_FLOAT;
  Common c;
  BuildCommon(s, g, c, /*v_transposed=*/true);
  const Dims qd = {B, H, L, Dqk}, vd = {B, H, L, Dv}, kd = {B, H, Lk, Dqk}, kvd = {B, H, Lk, Dv};
  // The transposed view [Lk, L] of an [L, Lk] score.
  const Dims sq_t = {B, H, Lk, L}, sq_t_st = {H * L * Lk, L * Lk, 1, Lk};
  const TensorRef dO = g.Tensor("dO", kUidDO, vd, c.o_st, s.io, false, false, c.ro);
  const TensorRef dQ = g.Tensor("dQ", kUidDQ, qd, c.q_st, s.io, false, false, c.rq);
  const TensorRef dK = g.Tensor("dK", kUidDK, kd, c.k_st, s.io, false, false, c.rk);
  const TensorRef dV = g.Tensor("dV", kUidDV, kvd, c.v_st, s.io, false, false, c.rv);
  const TensorRef one = g.Scalar("one", kUidOne);

  // Dsum = sum_d dO * O (times the inverse dropout scale, 1 here), kept in the workspace with
  // the stats' layout.
  const TensorRef dOO = g.Virtual("dO*O", vd, {H * L * Dv, L * Dv, H * Dv, 1}, F);
  g.Pointwise("mul dO O", CUDNN_POINTWISE_MUL, F, dO, dOO, &c.O);
  const TensorRef rowsum = g.Virtual("sum dO*O", c.rows, {H * L, L, 1, 1}, F);
  g.Reduce("sum dO*O", CUDNN_REDUCE_TENSOR_ADD, dOO, rowsum);
  const TensorRef dsum = g.Tensor("Dsum", kUidDsum, c.rows, c.rows_st, F, false, false, c.rs);
  g.Pointwise("scale dropout inv", CUDNN_POINTWISE_MUL, F, rowsum, dsum, &one);

  // P recomputed from the saved stats.
  const TensorRef S = g.Virtual("S", c.sq, c.sq_st, F);
  g.Matmul("Q K^T", c.Q, c.Kt, S, c.mq, c.mkv);
  TensorRef S1 = g.Virtual("S*scale", c.sq, c.sq_st, F);
  g.Pointwise("attn_scale", CUDNN_POINTWISE_MUL, F, S, S1, &c.scale);
  if (s.ragged || s.padding_workaround) S1 = PaddingMask(g, c, S1);
  const TensorRef S2 = g.Virtual("S-stats", c.sq, c.sq_st, F);
  g.Pointwise("sub stats", CUDNN_POINTWISE_SUB, F, S1, S2, &c.stats);
  const TensorRef S3 = s.causal ? CausalMask(s, g, c, S2) : S2;
  const TensorRef P = g.Virtual("P", c.sq, c.sq_st, F);
  g.Pointwise("exp", CUDNN_POINTWISE_EXP, F, S3, P);

  // dV = P^T dO
  const TensorRef Pt = g.Virtual("P^T", sq_t, sq_t_st, s.io);
  g.Reshape("reshape P", P, Pt);
  g.Matmul("P^T dO", Pt, dO, dV, c.mkv, nullptr, c.mq);

  // dS = (dO V^T - Dsum) * P * scale
  const TensorRef dP = g.Virtual("dP", c.sq, c.sq_st, F);
  g.Matmul("dO V^T", dO, c.V, dP, c.mq, c.mkv);
  const TensorRef dP1 = g.Virtual("dP-Dsum", c.sq, c.sq_st, F);
  g.Pointwise("sub Dsum", CUDNN_POINTWISE_SUB, F, dP, dP1, &dsum);
  const TensorRef dP2 = g.Virtual("(dP-Dsum)*P", c.sq, c.sq_st, F);
  g.Pointwise("mul P", CUDNN_POINTWISE_MUL, F, dP1, dP2, &P);
  const TensorRef dS = g.Virtual("dS", c.sq, c.sq_st, F);
  g.Pointwise("dS attn_scale", CUDNN_POINTWISE_MUL, F, dP2, dS, &c.scale);

  // dK = dS^T Q
  const TensorRef dSt = g.Virtual("dS^T", sq_t, sq_t_st, s.io);
  g.Reshape("reshape dS", dS, dSt);
  g.Matmul("dS^T Q", dSt, c.Q, dK, c.mkv, nullptr, c.mq);

  // dQ = dS K
  const TensorRef Kv = g.Virtual("K", kd, c.k_st, s.variant == 0 ? F : s.io, c.rk);
  g.Reshape("reshape K", c.Kt, Kv);
  if (s.deterministic) {
    g.Matmul("dS K", dS, Kv, dQ, c.mq, nullptr, c.mkv);
  } else {
    // The fp32 accumulator: dense [H, L, Dqk]; ragged: dQ's own layout and offsets.
    const Dims acc_st = s.ragged ? c.q_st : Dims{H * L * Dqk, L * Dqk, Dqk, 1};
    const TensorRef acc = g.Tensor("dQ accumulator", kUidDqAccum, qd, acc_st, F, false, false, c.rq);
    g.Matmul("dS K", dS, Kv, acc, c.mq, nullptr, c.mkv);
    g.Pointwise("identity dQ", CUDNN_POINTWISE_IDENTITY, F, acc, dQ);
  }
}

// Engine global index of an engine config (for the log), -1 when it cannot be read.
int64_t EngineIndex(cudnnBackendDescriptor_t cfg) {
  cudnnBackendDescriptor_t engine = nullptr;
  if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &engine) !=
      CUDNN_STATUS_SUCCESS) {
    return -1;
  }
  int64_t n = 0, index = -1;
  if (cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                               &n, &engine) != CUDNN_STATUS_SUCCESS ||
      cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n,
                               &index) != CUDNN_STATUS_SUCCESS) {
    index = -1;
  }
  cudnnBackendDestroyDescriptor(engine);
  return index;
}

std::string Describe(const GraphSpec& s) {
  return std::string(s.backward ? "backward" : "forward") +
         (s.ragged ? " ragged B=" + std::to_string(s.B) : std::string()) +
         " L=" + std::to_string(s.L) +
         (s.Lkv > 0 ? " Lkv=" + std::to_string(s.Lkv) : std::string()) + (s.causal ? "" : " full") +
         " H=" + std::to_string(s.H) + " Dqk=" + std::to_string(s.Dqk) +
         " Dv=" + std::to_string(s.Dv) + (s.deterministic ? " deterministic" : "") +
         (s.padding_workaround ? " +padding-mask" : "") + " variant " + std::to_string(s.variant);
}

// Builds the graph of `s`, asks the heuristics for engine configs and keeps the first one whose
// execution plan finalizes. On failure the Status lists what was tried.
Status BuildPlan(cudnnHandle_t handle, const GraphSpec& s, std::unique_ptr<Plan>* out) {
  const auto t0 = std::chrono::steady_clock::now();
  (void)LastCudnnMessage();  // drop any stale message
  auto plan = std::make_unique<Plan>();
  GraphBuilder g(&plan->keep);
  if (s.backward) {
    BuildBackward(s, g);
  } else {
    BuildForward(s, g);
  }
  SPINDLE_RETURN_IF_ERROR(g.status());

  cudnnBackendDescriptor_t graph = g.Create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "graph");
  g.Set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "graph",
        "CUDNN_ATTR_OPERATIONGRAPH_HANDLE");
  g.Set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
        static_cast<int64_t>(g.ops().size()), g.ops().data(), "graph",
        "CUDNN_ATTR_OPERATIONGRAPH_OPS");
  g.Finalize(graph, "operation graph");
  SPINDLE_RETURN_IF_ERROR(g.status());

  std::string tried;
  for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    const char* mode_name = mode == CUDNN_HEUR_MODE_A ? "heuristics A" : "fallback list";
    std::vector<DescPtr> heur_keep;
    GraphBuilder h(&heur_keep);
    cudnnBackendDescriptor_t heur = h.Create(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, mode_name);
    h.Set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph,
          mode_name, "CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH");
    h.Set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, mode_name,
          "CUDNN_ATTR_ENGINEHEUR_MODE");
    h.Finalize(heur, mode_name);
    int64_t count = 0;
    if (h.ok()) {
      const cudnnStatus_t st = cudnnBackendGetAttribute(
          heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
      if (st != CUDNN_STATUS_SUCCESS) {
        tried += std::string("; ") + mode_name + ": result count: " + cudnnGetErrorString(st) +
                 " " + LastCudnnMessage();
        continue;
      }
    } else {
      tried += std::string("; ") + mode_name + ": " + h.status().message();
      continue;
    }
    if (count <= 0) {
      tried += std::string("; ") + mode_name + ": no engine configs";
      continue;
    }
    std::vector<cudnnBackendDescriptor_t> cfgs(count, nullptr);
    for (auto& c : cfgs) c = h.Create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config");
    SPINDLE_RETURN_IF_ERROR(h.status());
    int64_t got = 0;
    SPINDLE_CUDNN_CHECK(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                                                 cfgs.data()));
    for (int64_t i = 0; i < got; ++i) {
      cudnnBackendDescriptor_t exec = nullptr;
      SPINDLE_CUDNN_CHECK(
          cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &exec));
      DescPtr exec_owner(exec);
      cudnnStatus_t st = cudnnBackendSetAttribute(exec, CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                                                  CUDNN_TYPE_HANDLE, 1, &handle);
      if (st == CUDNN_STATUS_SUCCESS) {
        st = cudnnBackendSetAttribute(exec, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                      CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i]);
      }
      if (st == CUDNN_STATUS_SUCCESS) st = cudnnBackendFinalize(exec);
      const int64_t engine = EngineIndex(cfgs[i]);
      if (st != CUDNN_STATUS_SUCCESS) {
        const std::string why = LastCudnnMessage();
        tried += std::string("; ") + mode_name + " config " + std::to_string(i) + " (engine " +
                 std::to_string(engine) + "): " + cudnnGetErrorString(st) +
                 (why.empty() ? "" : " " + why);
        continue;
      }
      int64_t ws = 0, n = 0;
      SPINDLE_CUDNN_CHECK(cudnnBackendGetAttribute(exec, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                   CUDNN_TYPE_INT64, 1, &n, &ws));
      plan->plan = exec;
      plan->keep.push_back(std::move(exec_owner));
      for (auto& d : heur_keep) plan->keep.push_back(std::move(d));  // the engine config
      plan->engine_ws = ws;
      plan->engine_index = engine;
      plan->spec = s;
      plan->uids = g.io_uids();
      if (s.padding_workaround && s.causal) {
        const int32_t lens[2] = {static_cast<int32_t>(s.L), static_cast<int32_t>(s.KeyLen())};
        SPINDLE_CUDA_CHECK(cudaMalloc(&plan->seqlen_dev, sizeof(lens)));
        SPINDLE_CUDA_CHECK(
            cudaMemcpy(plan->seqlen_dev, lens, sizeof(lens), cudaMemcpyHostToDevice));
      }
      if (LogEnabled()) {
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        std::fprintf(stderr,
                     "[sdpa] plan %s: %s config %lld of %lld, engine %lld, workspace %lld B, "
                     "%.1f ms%s\n",
                     Describe(s).c_str(), mode_name, static_cast<long long>(i),
                     static_cast<long long>(got), static_cast<long long>(engine),
                     static_cast<long long>(ws), ms,
                     tried.empty() ? "" : (", rejected before: " + tried.substr(2)).c_str());
      }
      *out = std::move(plan);
      return Status::Ok();
    }
  }
  return {StatusCode::kCudnnError,
          "Sdpa: no cuDNN engine accepted the " + Describe(s) + " graph" +
              (tried.empty() ? std::string() : ": " + tried.substr(2))};
}

// Device pointers of one graph execution, by uid.
struct ExecArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const void* stats = nullptr;
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  void* dsum = nullptr;      // backward: fp32 row sums, the stats' layout
  void* dq_accum = nullptr;  // backward, non-deterministic: fp32 dQ accumulator
  void* engine_ws = nullptr;
  const int32_t* meta = nullptr;     // ragged: seq lengths, then offsets (RaggedMeta)
  const int32_t* seqlens = nullptr;  // unmasked graphs: {queries, keys} of this call
};

// Where the ragged graphs' run-time data sits in the metadata buffer (int32 elements; every
// piece 64-byte aligned): seq lengths [B], then offsets [B+1] of q, k, v, out and stats.
struct RaggedMeta {
  int64_t seq = 0, q = 0, k = 0, v = 0, o = 0, stats = 0, total = 0;
  explicit RaggedMeta(int64_t B) {
    const int64_t lens = (B + 15) / 16 * 16, offs = (B + 1 + 15) / 16 * 16;
    q = lens, k = q + offs, v = k + offs, o = v + offs, stats = o + offs, total = stats + offs;
  }
};

// Resolved, validated arguments of one call.
struct Call {
  SdpaDims d;
  cudnnDataType_t io = CUDNN_DATA_BFLOAT16;
  int64_t esz = 2;
};

Status CheckView(const char* what, SdpaView* v, int64_t H, int64_t D) {
  if (v->token_stride == 0 && v->head_stride == 0) {
    v->head_stride = D;
    v->token_stride = H * D;
  }
  SPINDLE_CHECK_ARG(v->token_stride > 0 && v->head_stride > 0 && v->token_stride % 8 == 0 &&
                        v->head_stride % 8 == 0,
                    std::string("Sdpa: view ") + what + " strides (token " +
                        std::to_string(v->token_stride) + ", head " +
                        std::to_string(v->head_stride) +
                        ") must both be positive multiples of 8 elements, or both 0 (dense)");
  return Status::Ok();
}

// Each named pointer is set and 16-byte aligned; the first that is not is named.
Status CheckPtrs(std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  for (const auto& [what, p] : ptrs) {
    SPINDLE_CHECK_ARG(p != nullptr, std::string("Sdpa: ") + what + " is null");
    SPINDLE_CHECK_ARG(reinterpret_cast<uintptr_t>(p) % 16 == 0,
                      std::string("Sdpa: ") + what + " is not 16-byte aligned");
  }
  return Status::Ok();
}
// The pointers of a forward call, and of a backward call (the forward's and the gradients').
Status CheckForwardPtrs(const void* q, const void* k, const void* v, const void* out,
                        const float* stats) {
  return CheckPtrs({{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"stats", stats}});
}
Status CheckBackwardPtrs(const void* q, const void* k, const void* v, const void* out,
                         const float* stats, const void* dout, const void* dq, const void* dk,
                         const void* dv) {
  SPINDLE_RETURN_IF_ERROR(CheckForwardPtrs(q, k, v, out, stats));
  return CheckPtrs({{"dout", dout}, {"dq", dq}, {"dk", dk}, {"dv", dv}});
}

Status Validate(const SdpaDims& dims, DType dtype, const int32_t* cu, int64_t n_segments,
                float scale, Call* call) {
  call->d = dims;
  SdpaDims& d = call->d;
  if (dtype == DType::kBFloat16) {
    call->io = CUDNN_DATA_BFLOAT16;
  } else if (dtype == DType::kFloat16) {
    call->io = CUDNN_DATA_HALF;
  } else {
    return Unsupported(std::string("Sdpa: dtype ") + DTypeName(dtype) +
                       " unsupported (bfloat16 or float16)");
  }
  if (d.Dqk <= 0 || d.Dqk % 8 != 0 || d.Dqk > 256) {
    return Unsupported("Sdpa: head size Dqk=" + std::to_string(d.Dqk) +
                       " unsupported (a multiple of 8, at most 256)");
  }
  if (d.Dv <= 0 || d.Dv % 8 != 0 || d.Dv > 256) {
    return Unsupported("Sdpa: head size Dv=" + std::to_string(d.Dv) +
                       " unsupported (a multiple of 8, at most 256)");
  }
  SPINDLE_CHECK_ARG(d.T >= 0 && d.H >= 1, "Sdpa: T=" + std::to_string(d.T) +
                                              ", H=" + std::to_string(d.H) + " out of range");
  SPINDLE_CHECK_ARG(std::isfinite(scale), "Sdpa: scale is not finite");
  SPINDLE_RETURN_IF_ERROR(CheckView("q", &d.q, d.H, d.Dqk));
  SPINDLE_RETURN_IF_ERROR(CheckView("k", &d.k, d.H, d.Dqk));
  SPINDLE_RETURN_IF_ERROR(CheckView("v", &d.v, d.H, d.Dv));
  SPINDLE_RETURN_IF_ERROR(CheckView("out", &d.out, d.H, d.Dv));
  SPINDLE_CHECK_ARG(cu != nullptr && n_segments >= 1,
                    "Sdpa: cu_seqlens must hold n_segments + 1 >= 2 entries (n_segments=" +
                        std::to_string(n_segments) + ")");
  SPINDLE_CHECK_ARG(cu[0] == 0, "Sdpa: cu_seqlens[0]=" + std::to_string(cu[0]) + " must be 0");
  SPINDLE_CHECK_ARG(cu[n_segments] == d.T, "Sdpa: cu_seqlens[n_segments]=" +
                                               std::to_string(cu[n_segments]) +
                                               " must equal T=" + std::to_string(d.T));
  for (int64_t i = 0; i < n_segments; ++i) {
    SPINDLE_CHECK_ARG(cu[i + 1] >= cu[i], "Sdpa: cu_seqlens must be non-decreasing (entry " +
                                              std::to_string(i + 1) + ")");
  }
  call->esz = 2;
  return Status::Ok();
}

const char* Offset(const void* p, int64_t elements, int64_t esz) {
  return static_cast<const char*>(p) + elements * esz;
}
char* Offset(void* p, int64_t elements, int64_t esz) {
  return static_cast<char*>(p) + elements * esz;
}

int64_t NextPow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

// The planned length of an unmasked graph's side of n tokens.
int64_t FullBucket(int64_t n) { return std::max<int64_t>(128, NextPow2(n)); }

// Elements from a view's first element to one past its last one, over T tokens.
int64_t Span(const SdpaView& v, int64_t T, int64_t H, int64_t D) {
  return (T - 1) * v.token_stride + (H - 1) * v.head_stride + D;
}

// Bytes of the fp32 buffers a dense backward graph over L tokens keeps in the workspace.
int64_t DenseAuxBytes(const GraphSpec& s) {
  if (!s.backward) return 0;
  return AlignUp(s.H * s.L * 4) + (s.deterministic ? 0 : AlignUp(s.H * s.L * s.Dqk * 4));
}

// A dense graph's workspace region: [engine workspace | Dsum | dQ accumulator].
int64_t DenseRegionBytes(const Plan& p) { return AlignUp(p.engine_ws) + DenseAuxBytes(p.spec); }

void SetDenseRegion(const Plan& p, char* region, ExecArgs* a) {
  a->engine_ws = region;
  if (!p.spec.backward) return;
  char* aux = region + AlignUp(p.engine_ws);
  a->dsum = aux;
  if (!p.spec.deterministic) a->dq_accum = aux + AlignUp(p.spec.H * p.spec.L * 4);
}

// One document of a call: first token and length.
struct Doc {
  int64_t start, len;
};

}  // namespace

// ---- Sdpa ---------------------------------------------------------------------------------------

struct Sdpa::Impl {
  cudnnHandle_t handle = nullptr;
  std::map<std::vector<int64_t>, std::unique_ptr<Plan>> plans;
  std::map<std::vector<int64_t>, Status> failed;  // graphs no engine took: not rebuilt per call
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  int32_t* full_lens = nullptr;  // the unmasked graphs' run-time lengths {T, Tkv}
  int32_t* meta = nullptr;  // ragged metadata on the device, and what it holds
  int64_t meta_capacity = 0;
  std::vector<int32_t> meta_host;
  bool deterministic = false;
  bool ragged = true;  // several documents: one ragged graph (else one graph per document)
  size_t version = 0;

  ~Impl() {
    plans.clear();
    if (workspace != nullptr) cudaFree(workspace);
    if (meta != nullptr) cudaFree(meta);
    if (full_lens != nullptr) cudaFree(full_lens);
    if (handle != nullptr) cudnnDestroy(handle);
  }

  GraphSpec Dense(bool backward, int64_t L, const Call& c, SdpaView q, SdpaView k, SdpaView v,
                  SdpaView o) const {
    GraphSpec s;
    s.backward = backward;
    s.L = L;
    s.H = c.d.H;
    s.Dqk = c.d.Dqk;
    s.Dv = c.d.Dv;
    s.q = q, s.k = k, s.v = v, s.o = o;
    s.io = c.io;
    s.deterministic = backward && deterministic;
    s.padding_workaround = backward && version <= 91500 && L % 128 != 0;
    return s;
  }

  // Dense, unmasked: L queries against Lkv keys.
  // Unmasked graphs run on dense staging copies whose lengths are T and Tkv rounded up to
  // buckets (FullBucket), with the real lengths as run-time seq lengths of the padding mask: a
  // handful of plans serve every length (a plan build costs 50-1300 ms). The padding mask also
  // makes cuDNN pick a faster backward kernel for this graph (16K x 48K, H=16, qk 192, v 128 on
  // an H200: 44 ms instead of 67 ms; the causal graphs are not faster with it).
  GraphSpec Full(bool backward, const Call& c) const {
    const int64_t H = c.d.H, Dqk = c.d.Dqk, Dv = c.d.Dv;
    const SdpaView qk{H * Dqk, Dqk}, v{H * Dv, Dv};
    GraphSpec s = Dense(backward, FullBucket(c.d.T), c, qk, qk, v, v);
    s.Lkv = FullBucket(c.d.Tkv);
    s.causal = false;
    s.padding_workaround = true;
    return s;
  }

  // The staging of an unmasked call (bytes, each piece aligned): q, k, v, out, stats; and for the
  // backward dout, dq, dk, dv. Followed by the plan's dense region.
  struct FullStaging {
    int64_t q = 0, k = 0, v = 0, o = 0, stats = 0, dout = 0, dq = 0, dk = 0, dv = 0, total = 0;
    FullStaging() = default;
    FullStaging(const GraphSpec& s, int64_t esz) {
      const int64_t L = s.L, Lk = s.Lkv, H = s.H;
      int64_t at = 0;
      auto take = [&](int64_t bytes) {
        const int64_t here = at;
        at += AlignUp(bytes);
        return here;
      };
      q = take(L * H * s.Dqk * esz), k = take(Lk * H * s.Dqk * esz), v = take(Lk * H * s.Dv * esz);
      o = take(L * H * s.Dv * esz), stats = take(H * L * 4);
      if (s.backward) {
        dout = take(L * H * s.Dv * esz), dq = take(L * H * s.Dqk * esz);
        dk = take(Lk * H * s.Dqk * esz), dv = take(Lk * H * s.Dv * esz);
      }
      total = at;
    }
  };

  // The start both directions of an unmasked call share: its plan, the workspace (staging,
  // then the plan's dense region), q, k, v staged, {T, Tkv} uploaded (stream-ordered: earlier
  // graphs read theirs). *a gets the staged q, k, v, out and stats, the lengths and the region.
  Status StartFull(bool backward, const Call& c, DType dtype, const void* q, const void* k,
                   const void* v, cudaStream_t stream, Plan** p, FullStaging* st, ExecArgs* a);

  GraphSpec Ragged(bool backward, int64_t B, int64_t L, const Call& c) const {
    GraphSpec s = Dense(backward, L, c, c.d.q, c.d.k, c.d.v, c.d.out);
    s.ragged = true;
    s.B = B;
    s.padding_workaround = false;  // the ragged graphs always carry the padding mask
    return s;
  }

  // Several documents go through one ragged graph when cuDNN has what that needs: ragged stats
  // and accumulators (9.6), head sizes that are multiples of 16 (cudnn_frontend's condition for
  // ragged accumulators), int32 offsets, and a non-deterministic backward (the deterministic
  // one keeps an O(B H L^2) workspace).
  bool UseRagged(const Call& c, bool backward) const {
    const SdpaDims& d = c.d;
    return ragged && version >= 90600 && d.Dqk % 16 == 0 && d.Dv % 16 == 0 &&
           !(backward && deterministic) && Span(d.q, d.T, d.H, d.Dqk) < INT32_MAX &&
           Span(d.k, d.T, d.H, d.Dqk) < INT32_MAX && Span(d.v, d.T, d.H, d.Dv) < INT32_MAX &&
           Span(d.out, d.T, d.H, d.Dv) < INT32_MAX && d.T * d.H < INT32_MAX;
  }

  // The cached plan of `spec`, built (both spellings tried) on first use.
  Status GetPlan(GraphSpec spec, Plan** out) {
    const std::vector<int64_t> key = spec.Key();
    auto it = plans.find(key);
    if (it != plans.end()) {
      *out = it->second.get();
      return Status::Ok();
    }
    auto f = failed.find(key);
    if (f != failed.end()) return f->second;
    std::unique_ptr<Plan> plan;
    Status first = BuildPlan(handle, spec, &plan);
    if (!first.ok()) {
      spec.variant = 1;
      const Status second = BuildPlan(handle, spec, &plan);
      if (!second.ok()) {
        Status both(StatusCode::kCudnnError, first.message() + " || " + second.message());
        if (LogEnabled()) std::fprintf(stderr, "[sdpa] %s\n", both.message().c_str());
        failed.emplace(key, both);
        return both;
      }
      if (LogEnabled()) {
        std::fprintf(stderr, "[sdpa] first spelling failed (%s); variant 1 built\n",
                     first.message().c_str());
      }
    }
    *out = plan.get();
    plans.emplace(key, std::move(plan));
    return Status::Ok();
  }

  Status EnsureWorkspace(int64_t bytes, cudaStream_t stream) {
    if (bytes <= workspace_bytes) return Status::Ok();
    if (workspace != nullptr) {
      SPINDLE_CUDA_CHECK(cudaStreamSynchronize(stream));  // queued work may still read it
      SPINDLE_CUDA_CHECK(cudaFree(workspace));
      workspace = nullptr;
      workspace_bytes = 0;
    }
    const int64_t want = (bytes + (1 << 20) - 1) / (1 << 20) * (1 << 20);
    SPINDLE_CUDA_CHECK(cudaMalloc(&workspace, want));
    workspace_bytes = want;
    return Status::Ok();
  }

  // Uploads the ragged metadata of `docs` (padded to B documents) unless the device already
  // holds exactly that. Stream-ordered: earlier graphs on the stream read the old contents first.
  Status UploadMeta(const std::vector<Doc>& docs, int64_t B, const Call& c, cudaStream_t stream) {
    const RaggedMeta rm(B);
    std::vector<int32_t> h(rm.total, 0);
    const SdpaDims& d = c.d;
    const int64_t end = docs.back().start + docs.back().len;
    for (int64_t b = 0; b <= B; ++b) {
      const int64_t t = b < static_cast<int64_t>(docs.size()) ? docs[b].start : end;
      if (b < B) {
        h[rm.seq + b] = b < static_cast<int64_t>(docs.size()) ? static_cast<int32_t>(docs[b].len)
                                                              : 0;
      }
      h[rm.q + b] = static_cast<int32_t>(t * d.q.token_stride);
      h[rm.k + b] = static_cast<int32_t>(t * d.k.token_stride);
      h[rm.v + b] = static_cast<int32_t>(t * d.v.token_stride);
      h[rm.o + b] = static_cast<int32_t>(t * d.out.token_stride);
      h[rm.stats + b] = static_cast<int32_t>(t * d.H);
    }
    if (h == meta_host) return Status::Ok();
    if (rm.total > meta_capacity) {
      if (meta != nullptr) {
        SPINDLE_CUDA_CHECK(cudaStreamSynchronize(stream));
        SPINDLE_CUDA_CHECK(cudaFree(meta));
        meta = nullptr;
        meta_capacity = 0;
      }
      const int64_t want = std::max<int64_t>(rm.total, 1024);
      SPINDLE_CUDA_CHECK(cudaMalloc(&meta, want * 4));
      meta_capacity = want;
    }
    // Pageable source: the copy is staged before the call returns, so `h` may go away.
    SPINDLE_CUDA_CHECK(
        cudaMemcpyAsync(meta, h.data(), rm.total * 4, cudaMemcpyHostToDevice, stream));
    meta_host = std::move(h);
    return Status::Ok();
  }

  // Runs one plan.
  Status Execute(const Plan& p, const ExecArgs& a, float scale, cudaStream_t stream) {
    float scale_v = scale, one_v = 1.0f, neg_inf_v = -INFINITY;
    const RaggedMeta rm(p.spec.B);
    auto meta_at = [&](int64_t off) { return const_cast<int32_t*>(a.meta + off); };
    std::vector<void*> ptrs;
    ptrs.reserve(p.uids.size());
    for (const int64_t uid : p.uids) {
      void* ptr = nullptr;
      switch (uid) {
        case kUidQ: ptr = const_cast<void*>(a.q); break;
        case kUidK: ptr = const_cast<void*>(a.k); break;
        case kUidV: ptr = const_cast<void*>(a.v); break;
        case kUidO: ptr = const_cast<void*>(a.o); break;
        case kUidStats: ptr = const_cast<void*>(a.stats); break;
        case kUidDO: ptr = const_cast<void*>(a.dout); break;
        case kUidDQ: ptr = a.dq; break;
        case kUidDK: ptr = a.dk; break;
        case kUidDV: ptr = a.dv; break;
        case kUidDsum: ptr = a.dsum; break;
        case kUidDqAccum: ptr = a.dq_accum; break;
        case kUidSeqQ:
        case kUidSeqKv:
          ptr = p.spec.ragged ? meta_at(rm.seq)
                : a.seqlens   ? const_cast<int32_t*>(a.seqlens) + (uid - kUidSeqQ)
                              : p.seqlen_dev + (uid - kUidSeqQ);
          break;
        case kUidRaggedQ: ptr = meta_at(rm.q); break;
        case kUidRaggedK: ptr = meta_at(rm.k); break;
        case kUidRaggedV: ptr = meta_at(rm.v); break;
        case kUidRaggedO: ptr = meta_at(rm.o); break;
        case kUidRaggedStats: ptr = meta_at(rm.stats); break;
        case kUidScale: ptr = &scale_v; break;
        case kUidOne: ptr = &one_v; break;
        case kUidNegInf:
        case kUidNegInfPad: ptr = &neg_inf_v; break;
        default: break;
      }
      ptrs.push_back(ptr);
    }
    cudnnBackendDescriptor_t vp = nullptr;
    SPINDLE_CUDNN_CHECK(cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp));
    DescPtr vp_owner(vp);
    void* ws = a.engine_ws;
    SPINDLE_CUDNN_CHECK(cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
                                                 CUDNN_TYPE_INT64,
                                                 static_cast<int64_t>(p.uids.size()),
                                                 p.uids.data()));
    SPINDLE_CUDNN_CHECK(cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                                 CUDNN_TYPE_VOID_PTR,
                                                 static_cast<int64_t>(ptrs.size()), ptrs.data()));
    SPINDLE_CUDNN_CHECK(cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                                                 CUDNN_TYPE_VOID_PTR, 1, &ws));
    SPINDLE_CUDNN_CHECK(cudnnBackendFinalize(vp));
    if (a.dq_accum != nullptr && version < 90600) {
      // cuDNN before 9.6 expects a zeroed dQ accumulator (cudnn_frontend clears it likewise);
      // later versions clear it inside the engine. Only dense graphs get here.
      SPINDLE_CUDA_CHECK(cudaMemsetAsync(a.dq_accum, 0, p.spec.H * p.spec.L * p.spec.Dqk * 4,
                                         stream));
    }
    SPINDLE_CUDNN_CHECK(cudnnBackendExecute(handle, p.plan, vp));
    return Status::Ok();
  }

  // [T, H] <-> [H, T] fp32, one strided copy per head.
  static Status StatsToHeadMajor(float* dst, const float* src, int64_t T, int64_t H,
                                 cudaStream_t stream) {
    for (int64_t h = 0; h < H; ++h) {
      SPINDLE_CUDA_CHECK(cudaMemcpy2DAsync(dst + h * T, 4, src + h, H * 4, 4, T,
                                           cudaMemcpyDeviceToDevice, stream));
    }
    return Status::Ok();
  }
  static Status StatsToTokenMajor(float* dst, const float* src, int64_t T, int64_t H,
                                  cudaStream_t stream) {
    for (int64_t h = 0; h < H; ++h) {
      SPINDLE_CUDA_CHECK(cudaMemcpy2DAsync(dst + h, H * 4, src + h * T, 4, 4, T,
                                           cudaMemcpyDeviceToDevice, stream));
    }
    return Status::Ok();
  }

  Status RaggedForward(const ExecArgs& user, const std::vector<Doc>& docs, int64_t max_len,
                       float scale, const Call& c, cudaStream_t stream);
  Status RaggedBackward(const ExecArgs& user, const std::vector<Doc>& docs, int64_t max_len,
                        float scale, const Call& c, cudaStream_t stream);
  Status PerDocumentForward(const ExecArgs& user, const std::vector<Doc>& docs, float scale,
                            const Call& c, cudaStream_t stream);
  Status PerDocumentBackward(const ExecArgs& user, const std::vector<Doc>& docs, float scale,
                             const Call& c, cudaStream_t stream);
};

// Ragged: B = documents rounded up to a power of two (the extra ones empty), L = the longest
// document rounded up to a power of two (at least 64), so a few plans serve every batch.
// Workspace: [stats [T, H] | engine workspace].
Status Sdpa::Impl::RaggedForward(const ExecArgs& user, const std::vector<Doc>& docs,
                                 int64_t max_len, float scale, const Call& c,
                                 cudaStream_t stream) {
  const int64_t T = c.d.T, H = c.d.H;
  const int64_t B = NextPow2(static_cast<int64_t>(docs.size()));
  Plan* p = nullptr;
  SPINDLE_RETURN_IF_ERROR(GetPlan(Ragged(false, B, std::max<int64_t>(64, NextPow2(max_len)), c), &p));
  const int64_t stats_bytes = AlignUp(T * H * 4);
  SPINDLE_RETURN_IF_ERROR(EnsureWorkspace(stats_bytes + AlignUp(p->engine_ws), stream));
  SPINDLE_RETURN_IF_ERROR(UploadMeta(docs, B, c, stream));
  char* ws = static_cast<char*>(workspace);
  float* stage = reinterpret_cast<float*>(ws);
  ExecArgs a = user;
  a.stats = stage;
  a.engine_ws = ws + stats_bytes;
  a.meta = meta;
  SPINDLE_RETURN_IF_ERROR(Execute(*p, a, scale, stream));
  return StatsToHeadMajor(const_cast<float*>(static_cast<const float*>(user.stats)), stage, T, H,
                          stream);
}

// Workspace: [stats [T, H] | Dsum [T, H] | dQ accumulator (q's layout, fp32) | engine workspace].
Status Sdpa::Impl::RaggedBackward(const ExecArgs& user, const std::vector<Doc>& docs,
                                  int64_t max_len, float scale, const Call& c,
                                  cudaStream_t stream) {
  const int64_t T = c.d.T, H = c.d.H;
  const int64_t B = NextPow2(static_cast<int64_t>(docs.size()));
  Plan* p = nullptr;
  SPINDLE_RETURN_IF_ERROR(GetPlan(Ragged(true, B, std::max<int64_t>(64, NextPow2(max_len)), c), &p));
  const int64_t stats_bytes = AlignUp(T * H * 4);
  const int64_t acc_bytes = AlignUp(Span(c.d.q, T, H, c.d.Dqk) * 4);
  SPINDLE_RETURN_IF_ERROR(
      EnsureWorkspace(2 * stats_bytes + acc_bytes + AlignUp(p->engine_ws), stream));
  SPINDLE_RETURN_IF_ERROR(UploadMeta(docs, B, c, stream));
  char* ws = static_cast<char*>(workspace);
  float* stage = reinterpret_cast<float*>(ws);
  SPINDLE_RETURN_IF_ERROR(
      StatsToTokenMajor(stage, static_cast<const float*>(user.stats), T, H, stream));
  ExecArgs a = user;
  a.stats = stage;
  a.dsum = ws + stats_bytes;
  a.dq_accum = ws + 2 * stats_bytes;
  a.engine_ws = ws + 2 * stats_bytes + acc_bytes;
  a.meta = meta;
  return Execute(*p, a, scale, stream);
}

// One dense graph per document on sub-views; stats through a dense [H, L] staging buffer.
// One-token documents: the two-token graph on zero-padded dense copies (the causal mask keeps
// the padding token out of the first row). Workspace: [staging | one-token scratch | region].
Status Sdpa::Impl::PerDocumentForward(const ExecArgs& user, const std::vector<Doc>& docs,
                                      float scale, const Call& c, cudaStream_t stream) {
  const SdpaDims& d = c.d;
  const int64_t T = d.T, H = d.H, esz = c.esz;
  std::vector<Plan*> doc_plan(docs.size(), nullptr);
  int64_t max_len = 2, region = 0;
  bool any_single = false;
  for (size_t i = 0; i < docs.size(); ++i) {
    if (docs[i].len == 1) {
      any_single = true;
      continue;
    }
    max_len = std::max(max_len, docs[i].len);
    SPINDLE_RETURN_IF_ERROR(GetPlan(Dense(false, docs[i].len, c, d.q, d.k, d.v, d.out),
                                    &doc_plan[i]));
    region = std::max(region, DenseRegionBytes(*doc_plan[i]));
  }
  const SdpaView pq{H * d.Dqk, d.Dqk}, pv{H * d.Dv, d.Dv};
  const int64_t sq_bytes = AlignUp(2 * H * d.Dqk * esz), sv_bytes = AlignUp(2 * H * d.Dv * esz);
  int64_t single_bytes = 0;
  Plan* pair_plan = nullptr;
  if (any_single) {
    SPINDLE_RETURN_IF_ERROR(GetPlan(Dense(false, 2, c, pq, pq, pv, pv), &pair_plan));
    region = std::max(region, DenseRegionBytes(*pair_plan));
    single_bytes = 2 * sq_bytes + 2 * sv_bytes + AlignUp(H * 2 * 4);
  }
  const int64_t staging = AlignUp(H * max_len * 4);
  SPINDLE_RETURN_IF_ERROR(EnsureWorkspace(staging + single_bytes + region, stream));
  char* ws = static_cast<char*>(workspace);
  float* stage = reinterpret_cast<float*>(ws);
  char* single = ws + staging;
  char* graph_region = ws + staging + single_bytes;
  float* stats = const_cast<float*>(static_cast<const float*>(user.stats));

  for (size_t i = 0; i < docs.size(); ++i) {
    const int64_t s0 = docs[i].start, L = docs[i].len;
    if (L >= 2) {
      ExecArgs a;
      a.q = Offset(user.q, s0 * d.q.token_stride, esz);
      a.k = Offset(user.k, s0 * d.k.token_stride, esz);
      a.v = Offset(user.v, s0 * d.v.token_stride, esz);
      a.o = Offset(user.o, s0 * d.out.token_stride, esz);
      a.stats = stage;
      SetDenseRegion(*doc_plan[i], graph_region, &a);
      SPINDLE_RETURN_IF_ERROR(Execute(*doc_plan[i], a, scale, stream));
      SPINDLE_CUDA_CHECK(cudaMemcpy2DAsync(stats + s0, T * 4, stage, L * 4, L * 4, H,
                                           cudaMemcpyDeviceToDevice, stream));
      continue;
    }
    char* sq = single;
    char* sk = sq + sq_bytes;
    char* sv = sk + sq_bytes;
    char* so = sv + sv_bytes;
    float* sst = reinterpret_cast<float*>(so + sv_bytes);
    SPINDLE_CUDA_CHECK(cudaMemsetAsync(single, 0, 2 * sq_bytes + sv_bytes, stream));
    const int64_t rq = d.Dqk * esz, rv = d.Dv * esz;
    SPINDLE_CUDA_CHECK(cudaMemcpy2DAsync(sq, rq, Offset(user.q, s0 * d.q.token_stride, esz),
                                         d.q.head_stride * esz, rq, H, cudaMemcpyDeviceToDevice,
                                         stream));
    SPINDLE_CUDA_CHECK(cudaMemcpy2DAsync(sk, rq, Offset(user.k, s0 * d.k.token_stride, esz),
                                         d.k.head_stride * esz, rq, H, cudaMemcpyDeviceToDevice,
                                         stream));
    SPINDLE_CUDA_CHECK(cudaMemcpy2DAsync(sv, rv, Offset(user.v, s0 * d.v.token_stride, esz),
                                         d.v.head_stride * esz, rv, H, cudaMemcpyDeviceToDevice,
                                         stream));
    ExecArgs a;
    a.q = sq, a.k = sk, a.v = sv, a.o = so, a.stats = sst;
    SetDenseRegion(*pair_plan, graph_region, &a);
    SPINDLE_RETURN_IF_ERROR(Execute(*pair_plan, a, scale, stream));
    SPINDLE_CUDA_CHECK(cudaMemcpy2DAsync(const_cast<char*>(Offset(user.o, s0 * d.out.token_stride, esz)),
                                         d.out.head_stride * esz, so, rv, rv, H,
                                         cudaMemcpyDeviceToDevice, stream));
    SPINDLE_CUDA_CHECK(cudaMemcpy2DAsync(stats + s0, T * 4, sst, 2 * 4, 4, H,
                                         cudaMemcpyDeviceToDevice, stream));
  }
  return Status::Ok();
}

// One dense graph per document; a one-token document has p = 1: dv = dout, dq = dk = 0.
Status Sdpa::Impl::PerDocumentBackward(const ExecArgs& user, const std::vector<Doc>& docs,
                                       float scale, const Call& c, cudaStream_t stream) {
  const SdpaDims& d = c.d;
  const int64_t T = d.T, H = d.H, esz = c.esz;
  std::vector<Plan*> doc_plan(docs.size(), nullptr);
  int64_t max_len = 1, region = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    if (docs[i].len < 2) continue;
    max_len = std::max(max_len, docs[i].len);
    SPINDLE_RETURN_IF_ERROR(GetPlan(Dense(true, docs[i].len, c, d.q, d.k, d.v, d.out),
                                    &doc_plan[i]));
    region = std::max(region, DenseRegionBytes(*doc_plan[i]));
  }
  const int64_t staging = AlignUp(H * max_len * 4);
  SPINDLE_RETURN_IF_ERROR(EnsureWorkspace(staging + region, stream));
  char* ws = static_cast<char*>(workspace);
  float* stage = reinterpret_cast<float*>(ws);
  char* graph_region = ws + staging;
  const float* stats = static_cast<const float*>(user.stats);

  for (size_t i = 0; i < docs.size(); ++i) {
    const int64_t s0 = docs[i].start, L = docs[i].len;
    if (L == 1) {
      const int64_t rq = d.Dqk * esz, rv = d.Dv * esz;
      SPINDLE_CUDA_CHECK(cudaMemset2DAsync(Offset(user.dq, s0 * d.q.token_stride, esz),
                                           d.q.head_stride * esz, 0, rq, H, stream));
      SPINDLE_CUDA_CHECK(cudaMemset2DAsync(Offset(user.dk, s0 * d.k.token_stride, esz),
                                           d.k.head_stride * esz, 0, rq, H, stream));
      SPINDLE_CUDA_CHECK(cudaMemcpy2DAsync(Offset(user.dv, s0 * d.v.token_stride, esz),
                                           d.v.head_stride * esz,
                                           Offset(user.dout, s0 * d.out.token_stride, esz),
                                           d.out.head_stride * esz, rv, H,
                                           cudaMemcpyDeviceToDevice, stream));
      continue;
    }
    SPINDLE_CUDA_CHECK(cudaMemcpy2DAsync(stage, L * 4, stats + s0, T * 4, L * 4, H,
                                         cudaMemcpyDeviceToDevice, stream));
    ExecArgs a;
    a.q = Offset(user.q, s0 * d.q.token_stride, esz);
    a.k = Offset(user.k, s0 * d.k.token_stride, esz);
    a.v = Offset(user.v, s0 * d.v.token_stride, esz);
    a.o = Offset(user.o, s0 * d.out.token_stride, esz);
    a.dout = Offset(user.dout, s0 * d.out.token_stride, esz);
    a.dq = Offset(user.dq, s0 * d.q.token_stride, esz);
    a.dk = Offset(user.dk, s0 * d.k.token_stride, esz);
    a.dv = Offset(user.dv, s0 * d.v.token_stride, esz);
    a.stats = stage;
    SetDenseRegion(*doc_plan[i], graph_region, &a);
    SPINDLE_RETURN_IF_ERROR(Execute(*doc_plan[i], a, scale, stream));
  }
  return Status::Ok();
}

Sdpa::Sdpa(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Sdpa::~Sdpa() = default;

void Sdpa::SetDeterministic(bool on) { impl_->deterministic = on; }

int64_t Sdpa::PlanCount() const { return static_cast<int64_t>(impl_->plans.size()); }

int64_t Sdpa::WorkspaceBytes() const { return impl_->workspace_bytes + impl_->meta_capacity * 4; }

Status Sdpa::Create(std::unique_ptr<Sdpa>* out) {
  const size_t version = cudnnGetVersion();
  if (version < 90000) {
    return Unsupported("Sdpa: cuDNN " + std::to_string(version) +
                       " is older than 9.0 (the graph API this code uses)");
  }
  auto impl = std::make_unique<Impl>();
  impl->version = version;
  // SPINDLE_SDPA_PER_DOCUMENT=1: several documents always take the one-graph-per-document route
  // (tests compare both routes).
  const char* per_doc = std::getenv("SPINDLE_SDPA_PER_DOCUMENT");
  impl->ragged = per_doc == nullptr || per_doc[0] == '\0' || per_doc[0] == '0';
  SPINDLE_CUDNN_CHECK(cudnnCreate(&impl->handle));
  out->reset(new Sdpa(std::move(impl)));
  return Status::Ok();
}

namespace {

// The non-empty documents of cu_seqlens and the longest length.
std::vector<Doc> Documents(const int32_t* cu, int64_t n_segments, int64_t* max_len) {
  std::vector<Doc> docs;
  *max_len = 0;
  for (int64_t i = 0; i < n_segments; ++i) {
    const int64_t len = cu[i + 1] - cu[i];
    if (len == 0) continue;
    docs.push_back({cu[i], len});
    *max_len = std::max(*max_len, len);
  }
  return docs;
}

}  // namespace

Status Sdpa::Forward(const void* q, const void* k, const void* v, void* out, float* stats,
                     const int32_t* cu_seqlens, int64_t n_segments, float scale,
                     const SdpaDims& dims, DType dtype, cudaStream_t stream) {
  Call c;
  SPINDLE_RETURN_IF_ERROR(Validate(dims, dtype, cu_seqlens, n_segments, scale, &c));
  SPINDLE_RETURN_IF_ERROR(CheckForwardPtrs(q, k, v, out, stats));
  const SdpaDims& d = c.d;
  if (d.T == 0) return Status::Ok();
  Impl& m = *impl_;
  SPINDLE_CUDNN_CHECK(cudnnSetStream(m.handle, stream));
  ExecArgs a;
  a.q = q, a.k = k, a.v = v, a.o = out, a.stats = stats;
  int64_t max_len = 0;
  const std::vector<Doc> docs = Documents(cu_seqlens, n_segments, &max_len);
  if (docs.size() == 1) {  // one document spanning all T tokens: the fast path
    Plan* p = nullptr;
    SPINDLE_RETURN_IF_ERROR(m.GetPlan(m.Dense(false, d.T, c, d.q, d.k, d.v, d.out), &p));
    SPINDLE_RETURN_IF_ERROR(m.EnsureWorkspace(DenseRegionBytes(*p), stream));
    SetDenseRegion(*p, static_cast<char*>(m.workspace), &a);
    return m.Execute(*p, a, scale, stream);
  }
  if (m.UseRagged(c, false)) return m.RaggedForward(a, docs, max_len, scale, c, stream);
  return m.PerDocumentForward(a, docs, scale, c, stream);
}

Status Sdpa::Backward(const void* q, const void* k, const void* v, const void* out,
                      const float* stats, const void* dout, void* dq, void* dk, void* dv,
                      const int32_t* cu_seqlens, int64_t n_segments, float scale,
                      const SdpaDims& dims, DType dtype, cudaStream_t stream) {
  Call c;
  SPINDLE_RETURN_IF_ERROR(Validate(dims, dtype, cu_seqlens, n_segments, scale, &c));
  SPINDLE_RETURN_IF_ERROR(CheckBackwardPtrs(q, k, v, out, stats, dout, dq, dk, dv));
  const SdpaDims& d = c.d;
  if (d.T == 0) return Status::Ok();
  Impl& m = *impl_;
  SPINDLE_CUDNN_CHECK(cudnnSetStream(m.handle, stream));
  ExecArgs a;
  a.q = q, a.k = k, a.v = v, a.o = out, a.stats = stats, a.dout = dout;
  a.dq = dq, a.dk = dk, a.dv = dv;
  int64_t max_len = 0;
  const std::vector<Doc> docs = Documents(cu_seqlens, n_segments, &max_len);
  if (docs.size() == 1) {
    Plan* p = nullptr;
    SPINDLE_RETURN_IF_ERROR(m.GetPlan(m.Dense(true, d.T, c, d.q, d.k, d.v, d.out), &p));
    SPINDLE_RETURN_IF_ERROR(m.EnsureWorkspace(DenseRegionBytes(*p), stream));
    SetDenseRegion(*p, static_cast<char*>(m.workspace), &a);
    return m.Execute(*p, a, scale, stream);
  }
  if (m.UseRagged(c, true)) return m.RaggedBackward(a, docs, max_len, scale, c, stream);
  return m.PerDocumentBackward(a, docs, scale, c, stream);
}

namespace {

// Validates a ForwardFull / BackwardFull call: the common checks with one segment of T queries,
// plus the key count.
Status ValidateFull(const SdpaDims& dims, DType dtype, float scale, Call* c) {
  const int32_t cu[2] = {0, static_cast<int32_t>(std::min<int64_t>(dims.T, INT32_MAX))};
  SPINDLE_CHECK_ARG(dims.T <= INT32_MAX, "Sdpa: T=" + std::to_string(dims.T) + " too large");
  SPINDLE_RETURN_IF_ERROR(Validate(dims, dtype, cu, 1, scale, c));
  SPINDLE_CHECK_ARG(dims.Tkv >= 1 || dims.T == 0,
                    "Sdpa: full attention needs at least one key (Tkv=" + std::to_string(dims.Tkv) +
                        ", T=" + std::to_string(dims.T) + ")");
  return Status::Ok();
}

}  // namespace

namespace {

// [n, H, D] strided view <-> dense [n, H, D] staging (CopyRows), and zeroed rows [n, rows).
Status StageIn(char* dst, const void* src, const SdpaView& v, int64_t n, int64_t rows, int64_t H,
               int64_t D, DType dt, cudaStream_t stream) {
  const int64_t esz = 2;
  SPINDLE_RETURN_IF_ERROR(
      CopyRows(dst, H * D, D, src, v.token_stride, v.head_stride, n, H, D, dt, stream));
  if (rows > n)
    SPINDLE_CUDA_CHECK(cudaMemsetAsync(dst + n * H * D * esz, 0, (rows - n) * H * D * esz, stream));
  return Status::Ok();
}
Status StageOut(void* dst, const SdpaView& v, const char* src, int64_t n, int64_t H, int64_t D,
                DType dt, cudaStream_t stream) {
  return CopyRows(dst, v.token_stride, v.head_stride, src, H * D, D, n, H, D, dt, stream);
}

}  // namespace

Status Sdpa::Impl::StartFull(bool backward, const Call& c, DType dtype, const void* q,
                             const void* k, const void* v, cudaStream_t stream, Plan** p,
                             FullStaging* st, ExecArgs* a) {
  const SdpaDims& d = c.d;
  SPINDLE_CUDNN_CHECK(cudnnSetStream(handle, stream));
  SPINDLE_RETURN_IF_ERROR(GetPlan(Full(backward, c), p));
  const GraphSpec& s = (*p)->spec;
  *st = FullStaging(s, c.esz);
  SPINDLE_RETURN_IF_ERROR(EnsureWorkspace(st->total + DenseRegionBytes(**p), stream));
  char* ws = static_cast<char*>(workspace);
  SPINDLE_RETURN_IF_ERROR(StageIn(ws + st->q, q, d.q, d.T, s.L, d.H, d.Dqk, dtype, stream));
  SPINDLE_RETURN_IF_ERROR(StageIn(ws + st->k, k, d.k, d.Tkv, s.Lkv, d.H, d.Dqk, dtype, stream));
  SPINDLE_RETURN_IF_ERROR(StageIn(ws + st->v, v, d.v, d.Tkv, s.Lkv, d.H, d.Dv, dtype, stream));
  if (full_lens == nullptr) SPINDLE_CUDA_CHECK(cudaMalloc(&full_lens, 64));
  const int32_t lens[2] = {static_cast<int32_t>(d.T), static_cast<int32_t>(d.Tkv)};
  // Pageable source: the copy is staged before the call returns.
  SPINDLE_CUDA_CHECK(
      cudaMemcpyAsync(full_lens, lens, sizeof(lens), cudaMemcpyHostToDevice, stream));
  *a = ExecArgs{};
  a->q = ws + st->q, a->k = ws + st->k, a->v = ws + st->v, a->o = ws + st->o;
  a->stats = ws + st->stats, a->seqlens = full_lens;
  SetDenseRegion(**p, ws + st->total, a);
  return Status::Ok();
}

Status Sdpa::ForwardFull(const void* q, const void* k, const void* v, void* out, float* stats,
                         float scale, const SdpaDims& dims, DType dtype, cudaStream_t stream) {
  Call c;
  SPINDLE_RETURN_IF_ERROR(ValidateFull(dims, dtype, scale, &c));
  SPINDLE_RETURN_IF_ERROR(CheckForwardPtrs(q, k, v, out, stats));
  const SdpaDims& d = c.d;
  if (d.T == 0) return Status::Ok();
  Impl& m = *impl_;
  Plan* p = nullptr;
  Impl::FullStaging st;
  ExecArgs a;
  SPINDLE_RETURN_IF_ERROR(m.StartFull(false, c, dtype, q, k, v, stream, &p, &st, &a));
  const GraphSpec& s = p->spec;
  char* ws = static_cast<char*>(m.workspace);
  SPINDLE_RETURN_IF_ERROR(m.Execute(*p, a, scale, stream));
  SPINDLE_RETURN_IF_ERROR(StageOut(out, d.out, ws + st.o, d.T, d.H, d.Dv, dtype, stream));
  SPINDLE_CUDA_CHECK(cudaMemcpy2DAsync(stats, d.T * 4, ws + st.stats, s.L * 4, d.T * 4, d.H,
                                       cudaMemcpyDeviceToDevice, stream));
  return Status::Ok();
}

Status Sdpa::BackwardFull(const void* q, const void* k, const void* v, const void* out,
                          const float* stats, const void* dout, void* dq, void* dk, void* dv,
                          float scale, const SdpaDims& dims, DType dtype, cudaStream_t stream) {
  Call c;
  SPINDLE_RETURN_IF_ERROR(ValidateFull(dims, dtype, scale, &c));
  SPINDLE_RETURN_IF_ERROR(CheckBackwardPtrs(q, k, v, out, stats, dout, dq, dk, dv));
  const SdpaDims& d = c.d;
  if (d.T == 0) return Status::Ok();
  Impl& m = *impl_;
  Plan* p = nullptr;
  Impl::FullStaging st;
  ExecArgs a;
  SPINDLE_RETURN_IF_ERROR(m.StartFull(true, c, dtype, q, k, v, stream, &p, &st, &a));
  const GraphSpec& s = p->spec;
  char* ws = static_cast<char*>(m.workspace);
  // Every staged value is finite (padded rows zero, padded stats 0): the padding mask turns the
  // padded scores into exact zeros of P and dS only if nothing there is NaN.
  SPINDLE_RETURN_IF_ERROR(StageIn(ws + st.o, out, d.out, d.T, s.L, d.H, d.Dv, dtype, stream));
  SPINDLE_RETURN_IF_ERROR(StageIn(ws + st.dout, dout, d.out, d.T, s.L, d.H, d.Dv, dtype, stream));
  SPINDLE_CUDA_CHECK(cudaMemsetAsync(ws + st.stats, 0, d.H * s.L * 4, stream));
  SPINDLE_CUDA_CHECK(cudaMemcpy2DAsync(ws + st.stats, s.L * 4, stats, d.T * 4, d.T * 4, d.H,
                                       cudaMemcpyDeviceToDevice, stream));
  a.dout = ws + st.dout, a.dq = ws + st.dq, a.dk = ws + st.dk, a.dv = ws + st.dv;
  SPINDLE_RETURN_IF_ERROR(m.Execute(*p, a, scale, stream));
  SPINDLE_RETURN_IF_ERROR(StageOut(dq, d.q, ws + st.dq, d.T, d.H, d.Dqk, dtype, stream));
  SPINDLE_RETURN_IF_ERROR(StageOut(dk, d.k, ws + st.dk, d.Tkv, d.H, d.Dqk, dtype, stream));
  return StageOut(dv, d.v, ws + st.dv, d.Tkv, d.H, d.Dv, dtype, stream);
}

}  // namespace spindle::kernels::cuda
