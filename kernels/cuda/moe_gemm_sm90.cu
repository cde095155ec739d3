// GroupedGemmMethod::kPersistent (moe_gemm_sm90.h): one persistent bf16 GEMM launch over every
// group of the experts' grouped GEMMs, on Hopper's TMA and warpgroup MMA (sm_90a).
//
// Tiles: 128 x 128 outputs, K-blocks of 64, bf16 in, fp32 accumulation. A CTA is one producer
// warpgroup (one thread issues every TMA load) and two consumer warpgroups, each owning 64 rows of
// the tile (a m64n128k16 wgmma accumulator, 64 fp32 registers a thread); 6 stages of A and B
// (32 KB a stage, 192 KB). Why this tile: the preset's outputs are 512 (W1 | W3) or 2048 / 256
// (W2) wide, all multiples of 128, and groups are multiples of 64 rows of ~2-4K, so a 128-row tile
// wastes at most 64 rows a group (~2%), where 128 x 256 would idle half its width on W2's
// backward-data (256 = one tile) and double the registers (128 a thread, past what two consumer
// warpgroups keep without spills next to the epilogue). Six stages: the preset's shortest
// reduction (W2's forward, K = 256) is 4 K-blocks a tile, so the producer holds a whole next tile
// while the consumers run their epilogue (stores straight from registers, no staging).
//
// Operands: every tile comes by TMA with the 128-byte swizzle into 1024-byte aligned buffers:
//  - K-major (the reduction contiguous: A and W of the forward, dC of the backward-data): one
//    box of 64 (K) x 128 rows, 128-byte rows; wgmma descriptor leading offset unused (16), stride
//    offset 1024 (8 rows), +32 bytes a k16 step. A consumer's 64 rows start 8 KB in.
//  - MN-major (the output index contiguous: W read as [N, K] by the backward-data, dC and A of
//    the weight gradient): two boxes of 64 (MN) x 64 (K), 8 KB each, read with the transpose bit;
//    descriptor leading offset 8192 (the next 64 MN values), stride offset 1024 (the next 8 K
//    rows), +2048 bytes a k16 step.
// Rows past a group's end (the next group's, or TMA's zero fill past the tensor) are multiplied
// but never stored; columns past N or K are TMA zeros and never stored. The weight gradient's
// K-blocks are 64 rows of one group (offsets multiples of 64), so no block crosses a group.
//
// Scheduling: a tiny kernel turns the offsets (a kernel argument) into the device table of
// offsets and tile prefix sums; CTA i takes tiles i, i + grid, ... in (group, m-tile, n-tile)
// order, walking the table with a cursor. Each output element is written by one tile, once: the
// results are bitwise reproducible.
//
// Pipeline: full[s] (one arrival, the producer's expect_tx, plus 32 KB of TMA transactions) and
// empty[s] (one arrival per consumer warpgroup, after the wgmma reading stage s completed: each
// consumer keeps one K-block's wgmma group in flight and releases the stage before it). The waits
// are bounded (MbarWaitBounded): a fault in the protocol traps (a launch error) after ~10 s
// instead of hanging the stream.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/hopper.cuh"
#include "kernels/cuda/moe_gemm_sm90.h"

namespace spindle::kernels::cuda::internal {
namespace {

constexpr int kBM = 128, kBN = 128, kBK = 64;
constexpr int kStages = 6;
constexpr int kThreads = 384;              // producer warpgroup, two consumer warpgroups
constexpr int kBoxBytes = 64 * 64 * 2;     // a 64 x 64 bf16 box: 64 rows of 128 bytes
constexpr int kTileBytes = kBM * kBK * 2;  // 16 KB
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kBarOffset = kStages * kStageBytes;
constexpr int kSmemBytes = kBarOffset + 2 * kStages * 8 + 1024;  // + the 1024-byte alignment
constexpr int kMaxGroups = 1024;
constexpr int kTableStride = kMaxGroups + 1;

constexpr int kForward = static_cast<int>(PersistentRole::kForward);
constexpr int kBackwardData = static_cast<int>(PersistentRole::kBackwardData);
constexpr int kBackwardWeight = static_cast<int>(PersistentRole::kBackwardWeight);

struct GemmParams {
  int G = 0, N = 0, K = 0;
  int n_tiles = 0;   // tiles along the output's columns: ceil(N / 128) forward, else ceil(K / 128)
  int k_blocks = 0;  // forward and backward-data: 64-wide blocks of the reduction (K, N)
  int accumulate = 0;
  int total = 0;  // tiles of every group
  void* c = nullptr;
  const int32_t* table = nullptr;  // offsets [G + 1], then tile starts at kTableStride
};

struct OffsetsParam {
  int32_t v[kMaxGroups + 1];
};

// table[g] = offsets[g] (g <= G), table[kTableStride + g] = the tiles of groups before g.
__global__ void TileTableKernel(const OffsetsParam off, int G, int role, int n_tiles, int m_tiles_w,
                                int32_t* table) {
  __shared__ int32_t s[kMaxGroups];
  const int g = threadIdx.x;  // kMaxGroups threads
  int count = 0;
  if (g < G) {
    const int m = off.v[g + 1] - off.v[g];
    count =
        role == kBackwardWeight ? (m > 0 ? m_tiles_w * n_tiles : 0) : (m + kBM - 1) / kBM * n_tiles;
  }
  s[g] = count;
  __syncthreads();
  for (int d = 1; d < kMaxGroups; d <<= 1) {  // inclusive scan
    const int x = g >= d ? s[g - d] : 0;
    __syncthreads();
    s[g] += x;
    __syncthreads();
  }
  if (g < G) {
    table[g] = off.v[g];
    table[kTableStride + g + 1] = s[g];
  }
  if (g == 0) {
    table[G] = off.v[G];
    table[kTableStride] = 0;
  }
}

#ifdef SPINDLE_WGMMA_DEVICE
// Descriptor of a 128-byte-swizzled operand (the swizzle's 1024-byte pattern aligned, base offset
// 0): start, leading and stride byte offsets, each encoded as (x & 0x3FFFF) >> 4.
__device__ __forceinline__ uint64_t Sw128Desc(uint32_t addr, uint32_t lead, uint32_t stride) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lead & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((stride & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ uint64_t DescKMajor(uint32_t addr) { return Sw128Desc(addr, 16, 1024); }
__device__ __forceinline__ uint64_t DescMNMajor(uint32_t addr) {
  return Sw128Desc(addr, kBoxBytes, 1024);
}
// Encoded descriptor steps of one k16 slice: 32 bytes along a K-major row, 16 rows of 128 bytes
// of an MN-major box.
constexpr uint64_t kStepKMajor = 32 >> 4;
constexpr uint64_t kStepMNMajor = 2048 >> 4;

// D (64 x 128, fp32) += A B, both from shared memory; kTransA / kTransB 1: MN-major.
template <int kTransA, int kTransB>
__device__ __forceinline__ void Wgmma128(float (&d)[64], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(da), "l"(db), "r"(1), "n"(kTransA), "n"(kTransB));
}

struct Tile {
  int g = 0;
  int m0 = 0;       // first output row (a global row; the weight gradient: an index into N)
  int n0 = 0;       // first output column
  int row_end = 0;  // rows at or past it are not stored
  int k_blocks = 0;
  int r0 = 0;  // the weight gradient: the group's first row (its reduction)
};

// Tile t, with g a cursor that only moves forward (a CTA's tiles ascend).
template <int kRole>
__device__ __forceinline__ Tile DecodeTile(const GemmParams& p, int t, int& g) {
  const int32_t* off = p.table;
  const int32_t* start = p.table + kTableStride;
  while (start[g + 1] <= t) ++g;
  const int local = t - start[g];
  const int mt = local / p.n_tiles, nt = local % p.n_tiles;
  Tile x;
  x.g = g;
  x.n0 = nt * kBN;
  if (kRole == kBackwardWeight) {
    x.m0 = mt * kBM;
    x.row_end = p.N;
    x.r0 = off[g];
    x.k_blocks = (off[g + 1] - off[g]) / kBK;
  } else {
    x.m0 = off[g] + mt * kBM;
    x.row_end = off[g + 1];
    x.k_blocks = p.k_blocks;
  }
  return x;
}
#endif  // SPINDLE_WGMMA_DEVICE

template <int kRole>
__global__ void __launch_bounds__(kThreads, 1)
    PersistentGemmKernel(const __grid_constant__ CUtensorMap map_a,
                         const __grid_constant__ CUtensorMap map_b, const GemmParams p) {
#ifdef SPINDLE_WGMMA_DEVICE
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = (static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + 1023u) & ~1023u;
  const uint32_t full0 = base + kBarOffset, empty0 = full0 + kStages * 8;
  const int wg = threadIdx.x >> 7;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(full0 + 8 * s, 1);
      MbarInit(empty0 + 8 * s, 2);
    }
    FenceMbarInit();
  }
  __syncthreads();

  if (wg == 0) {
    // ---- Producer: one thread issues every load.
    if (threadIdx.x != 0) return;
    TmaPrefetchMap(&map_a);
    TmaPrefetchMap(&map_b);
    int stage = 0, g = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < p.total; t += gridDim.x) {
      const Tile x = DecodeTile<kRole>(p, t, g);
      for (int kb = 0; kb < x.k_blocks; ++kb) {
        MbarWaitBounded(empty0 + 8 * stage, phase ^ 1);
        const uint32_t full = full0 + 8 * stage;
        const uint32_t sa = base + stage * kStageBytes, sb = sa + kTileBytes;
        MbarArriveExpectTx(full, kStageBytes);
        if (kRole == kForward) {
          TmaLoad2d(sa, &map_a, full, kb * kBK, x.m0);       // A [rows, K]: (k, row)
          TmaLoad3d(sb, &map_b, full, kb * kBK, x.n0, x.g);  // W [G, N, K]: (k, n, g)
        } else if (kRole == kBackwardData) {
          TmaLoad2d(sa, &map_a, full, kb * kBK, x.m0);  // dC [rows, N]: (n, row)
          for (int h = 0; h < 2; ++h)                   // W [G, N, K]: (k, n, g)
            TmaLoad3d(sb + h * kBoxBytes, &map_b, full, x.n0 + 64 * h, kb * kBK, x.g);
        } else {
          const int r = x.r0 + kb * kBK;
          for (int h = 0; h < 2; ++h) {
            TmaLoad2d(sa + h * kBoxBytes, &map_a, full, x.m0 + 64 * h, r);  // dC: (n, row)
            TmaLoad2d(sb + h * kBoxBytes, &map_b, full, x.n0 + 64 * h, r);  // A: (k, row)
          }
        }
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    return;
  }

  // ---- Consumers: warpgroup cw owns rows [64 cw, 64 cw + 64) of each tile.
  const int cw = wg - 1;
  const int tid = threadIdx.x & 127, wi = tid >> 5, lane = tid & 31;
  constexpr int kTransA = kRole == kBackwardWeight ? 1 : 0;
  constexpr int kTransB = kRole == kForward ? 0 : 1;
  constexpr uint64_t kStepA = kTransA ? kStepMNMajor : kStepKMajor;
  constexpr uint64_t kStepB = kTransB ? kStepMNMajor : kStepKMajor;
  int stage = 0, g = 0;
  uint32_t phase = 0;
  for (int t = blockIdx.x; t < p.total; t += gridDim.x) {
    const Tile x = DecodeTile<kRole>(p, t, g);
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    int prev = 0;
    for (int kb = 0; kb < x.k_blocks; ++kb) {
      MbarWaitBounded(full0 + 8 * stage, phase);
      const uint32_t sa = base + stage * kStageBytes + cw * kBoxBytes;
      const uint32_t sb = base + stage * kStageBytes + kTileBytes;
      const uint64_t da = kTransA ? DescMNMajor(sa) : DescKMajor(sa);
      const uint64_t db = kTransB ? DescMNMajor(sb) : DescKMajor(sb);
      FenceRegs(acc);
      WgFence();
#pragma unroll
      for (int k = 0; k < kBK / 16; ++k)
        Wgmma128<kTransA, kTransB>(acc, da + k * kStepA, db + k * kStepB);
      WgCommit();
      WgWaitN<1>();  // the previous K-block's wgmmas are done: release its stage
      if (kb > 0 && tid == 0) MbarArrive(empty0 + 8 * prev);
      prev = stage;
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    WgWaitN<0>();
    if (x.k_blocks > 0 && tid == 0) MbarArrive(empty0 + 8 * prev);
    FenceRegs(acc);

    // ---- Epilogue: accumulator (row wi * 16 + lane / 4 + 8 h, column 8 j + 2 (lane % 4) + e)
    // at acc[4 j + 2 h + e]; predicated on the group's rows and the output's columns.
    const int row_in = cw * 64 + wi * 16 + (lane >> 2), q2 = (lane & 3) * 2;
    const int cols = kRole == kForward ? p.N : p.K;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = x.m0 + row_in + 8 * h;
      if (r >= x.row_end) continue;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = x.n0 + 8 * j + q2;
        if (col >= cols) continue;
        const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
        if (kRole == kBackwardWeight) {
          float2* o = reinterpret_cast<float2*>(static_cast<float*>(p.c) +
                                                (static_cast<int64_t>(x.g) * p.N + r) * p.K + col);
          const float2 old = *o;
          *o = make_float2(old.x + v0, old.y + v1);
        } else {
          __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(
              static_cast<bf16*>(p.c) + static_cast<int64_t>(r) * cols + col);
          if (kRole == kBackwardData && p.accumulate) {
            const float2 old = __bfloat1622float2(*o);
            *o = __floats2bfloat162_rn(old.x + v0, old.y + v1);
          } else {
            *o = __floats2bfloat162_rn(v0, v1);
          }
        }
      }
    }
  }
#endif  // SPINDLE_WGMMA_DEVICE
}

Status Unsupported(const std::string& why) {
  return Status(StatusCode::kUnsupported, "persistent grouped GEMM: " + why);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

PersistentGroupedGemm::~PersistentGroupedGemm() {
  if (table_ != nullptr) cudaFree(table_);
}

Status PersistentGroupedGemm::Create(std::unique_ptr<PersistentGroupedGemm>* out) {
#ifndef SPINDLE_WGMMA
  (void)out;
  return Unsupported("this build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES without 90)");
#else
  int dev = 0, major = 0, minor = 0, sms = 0;
  SPINDLE_CUDA_CHECK(cudaGetDevice(&dev));
  SPINDLE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  SPINDLE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  SPINDLE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (major != 9 || minor != 0) {
    return Unsupported("needs compute capability 9.0 (sm_90a code), the device has " +
                       std::to_string(major) + "." + std::to_string(minor));
  }
  void* encode = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  SPINDLE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &encode, 12000,
                                                      cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || encode == nullptr)
    return Unsupported("the driver has no cuTensorMapEncodeTiled");
  std::unique_ptr<PersistentGroupedGemm> p(new PersistentGroupedGemm());
  p->sms_ = sms;
  p->encode_ = encode;
  SPINDLE_CUDA_CHECK(cudaMalloc(&p->table_, 2 * kTableStride * sizeof(int32_t)));
  *out = std::move(p);
  return Status::Ok();
#endif
}

Status PersistentGroupedGemm::Supports(const PersistentGemmArgs& a) const {
  constexpr int64_t kMaxInt = (int64_t{1} << 31) - 2 * kBM;
  if (a.offsets == nullptr || a.G < 0 || a.G > kMaxGroups)
    return Unsupported("needs 0..1024 groups and their offsets");
  if (a.N <= 0 || a.K <= 0 || a.N % 8 != 0 || a.K % 8 != 0 || a.N > kMaxInt || a.K > kMaxInt)
    return Unsupported("needs N and K positive multiples of 8 (16-byte rows for TMA), got N " +
                       std::to_string(a.N) + ", K " + std::to_string(a.K));
  if (a.offsets[0] < 0 || a.offsets[a.G] > kMaxInt) return Unsupported("needs the rows below 2^31");
  if (a.G > 0 && a.N * a.K * a.G > (int64_t{1} << 38))
    return Unsupported("the weights are too large for one tensor map");
  if (!Aligned16(a.a) || !Aligned16(a.b) || !Aligned16(a.c))
    return Unsupported("needs 16-byte aligned operands");
  if (a.role == PersistentRole::kBackwardWeight) {
    for (int64_t g = 0; g <= a.G; ++g) {
      if (a.offsets[g] % kBK != 0)
        return Unsupported(
            "the weight gradient needs every group offset at a multiple of 64 "
            "(MoeGroupRows with align 64); offset " +
            std::to_string(g) + " is " + std::to_string(a.offsets[g]));
    }
  }
  return Status::Ok();
}

namespace {

using EncodeFn = PFN_cuTensorMapEncodeTiled_v12000;

// A bf16 tensor map of `rank` dims (innermost first, rows contiguous), 128-byte swizzle, zeros
// out of bounds.
Status EncodeMap(void* encode, CUtensorMap* map, const void* ptr, int rank, const uint64_t* dims,
                 const uint32_t* box) {
  cuuint64_t gdim[3], gstride[2];
  cuuint32_t gbox[3], estride[3] = {1, 1, 1};
  uint64_t stride = 2;
  for (int i = 0; i < rank; ++i) {
    gdim[i] = dims[i];
    gbox[i] = box[i];
    if (i > 0) gstride[i - 1] = stride;
    stride *= dims[i];
  }
  const CUresult r = reinterpret_cast<EncodeFn>(encode)(
      map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, static_cast<cuuint32_t>(rank), const_cast<void*>(ptr),
      gdim, gstride, gbox, estride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return Unsupported("cuTensorMapEncodeTiled failed with error " + std::to_string(r));
  return Status::Ok();
}

}  // namespace

Status PersistentGroupedGemm::Run(const PersistentGemmArgs& a, cudaStream_t stream) {
  SPINDLE_RETURN_IF_ERROR(Supports(a));
  const int64_t G = a.G, N = a.N, K = a.K;
  const int64_t* off = a.offsets;
  const bool weight = a.role == PersistentRole::kBackwardWeight;
  const int64_t out_cols = a.role == PersistentRole::kForward ? N : K;
  const int64_t n_tiles = (out_cols + kBN - 1) / kBN, m_tiles_w = (N + kBM - 1) / kBM;
  int64_t total = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = off[g + 1] - off[g];
    total += weight ? (m > 0 ? m_tiles_w * n_tiles : 0) : (m + kBM - 1) / kBM * n_tiles;
  }
  if (total == 0) return Status::Ok();
  if (total > (int64_t{1} << 31) - 1) return Unsupported("too many tiles");
  const uint64_t rows = static_cast<uint64_t>(off[G]);

  CUtensorMap map_a, map_b;
  switch (a.role) {
    case PersistentRole::kForward: {
      const uint64_t da[2] = {uint64_t(K), rows}, db[3] = {uint64_t(K), uint64_t(N), uint64_t(G)};
      const uint32_t ba[2] = {64, 128}, bb[3] = {64, 128, 1};
      SPINDLE_RETURN_IF_ERROR(EncodeMap(encode_, &map_a, a.a, 2, da, ba));
      SPINDLE_RETURN_IF_ERROR(EncodeMap(encode_, &map_b, a.b, 3, db, bb));
      break;
    }
    case PersistentRole::kBackwardData: {
      const uint64_t da[2] = {uint64_t(N), rows}, db[3] = {uint64_t(K), uint64_t(N), uint64_t(G)};
      const uint32_t ba[2] = {64, 128}, bb[3] = {64, 64, 1};
      SPINDLE_RETURN_IF_ERROR(EncodeMap(encode_, &map_a, a.a, 2, da, ba));
      SPINDLE_RETURN_IF_ERROR(EncodeMap(encode_, &map_b, a.b, 3, db, bb));
      break;
    }
    case PersistentRole::kBackwardWeight: {
      const uint64_t da[2] = {uint64_t(N), rows}, db[2] = {uint64_t(K), rows};
      const uint32_t box[2] = {64, 64};
      SPINDLE_RETURN_IF_ERROR(EncodeMap(encode_, &map_a, a.a, 2, da, box));
      SPINDLE_RETURN_IF_ERROR(EncodeMap(encode_, &map_b, a.b, 2, db, box));
      break;
    }
  }

  OffsetsParam op;
  for (int64_t g = 0; g <= G; ++g) op.v[g] = static_cast<int32_t>(off[g]);
  TileTableKernel<<<1, kMaxGroups, 0, stream>>>(op, static_cast<int>(G), static_cast<int>(a.role),
                                                static_cast<int>(n_tiles),
                                                static_cast<int>(m_tiles_w), table_);
  SPINDLE_CUDA_CHECK_LAUNCH();

  GemmParams p;
  p.G = static_cast<int>(G), p.N = static_cast<int>(N), p.K = static_cast<int>(K);
  p.n_tiles = static_cast<int>(n_tiles);
  p.k_blocks = static_cast<int>(((a.role == PersistentRole::kForward ? K : N) + kBK - 1) / kBK);
  p.accumulate = a.accumulate ? 1 : 0;
  p.total = static_cast<int>(total);
  p.c = a.c;
  p.table = table_;
  auto* kernel = a.role == PersistentRole::kForward        ? PersistentGemmKernel<kForward>
                 : a.role == PersistentRole::kBackwardData ? PersistentGemmKernel<kBackwardData>
                                                           : PersistentGemmKernel<kBackwardWeight>;
  SPINDLE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const int grid = static_cast<int>(std::min<int64_t>(sms_, total));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(map_a, map_b, p);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda::internal
