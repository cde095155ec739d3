// Blockwise FP8 quantization on CUDA (fp8.h, "Blockwise scaling"): activations and output
// gradients with 1 x 128 blocks along their rows and 128 x 1 blocks for their transposed copy (a
// stored tensor, or a producer's fp32 result recomputed from its inputs and kept statistics, the
// sources of fp8_sources.cuh), and the fp32 master weights with 128 x 128 blocks, in both layouts;
// and the MoE experts' rows in moe.h's grouped layout (GatherRowsBlockwise and its SwiGLU
// namesake: each CUDA block one 128-column tile of one band of a segment, the same tile code).
//
// Scheme. A CUDA block owns one 128 x 128 tile of the input, which is exactly one block of the
// square grid, 128 row blocks and 128 column blocks: every amax it needs lies inside the tile, so
// one pass quantizes it (no grid-wide amax as under tensorwise scaling). Warp w holds rows
// 16w .. 16w + 15 of the tile, lane l columns 4l .. 4l + 3, in registers (64 values a thread):
//  - a row's amax is a shuffle reduction across the warp (its 32 lanes cover the row's 128 values);
//  - a column's amax is the max of the thread's 16 rows, then of the 8 warps through shared memory;
//  - the square block's amax is the max of everything (weights).
// The amaxes are reduced on the float's bits (amax.cuh: NaN above infinity, exact in any order),
// each scale is cpu::Pow2Scale's exponent arithmetic (frexpf, as the CPU's frexp), and each code
// is fp8_satfinite(__fmul_rn(value, 2^e)): the CPU's fp32 product and rounding. The row-major
// codes go straight out (a warp stores one row's 128 codes as 32 words); the transposed ones
// through shared memory, where a thread stores the 16 codes of each of its 4 columns as one 16-byte
// word, then out as 16-byte words along the transposed rows.
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "kernels/cuda/amax.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/fp8_sources.cuh"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/vec.cuh"

namespace spindle::kernels::cuda {
namespace {

using internal::AbsBits;
using internal::Aligned16;
using internal::CeilDiv;
using internal::FindTensor;
using internal::ToFloat;
using internal::WarpMaxBits;
using internal::fp8::GroupGateSource;
using internal::fp8::RmsSource;
using internal::fp8::StoredSource;
using internal::fp8::SwiGluSource;

constexpr int kB = static_cast<int>(kFp8BlockSize);  // the tile's side: one block of the grid
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kRowsPerWarp = kB / kWarps;  // 16
constexpr int kColsPerLane = kB / 32;      // 4
constexpr int kMaxCastTensors = 32;
static_assert(kRowsPerWarp == 16 && kColsPerLane == 4, "the tile's thread layout");

// One tensor's quantization: its sizes and outputs (null pointers: not written), and its input
// where it is a stored tensor (the weights' cast).
struct Job {
  const void* x;
  int64_t rows, cols;
  uint8_t* codes;
  float* scales;
  uint8_t* codes_t;
  float* scales_t;
  int64_t scales_ld, scales_t_ld;  // square blocks: the row strides of the two scale tensors
  // Row blocks: the rows of the kRow128 tensor `scales` ([ceil(cols / 128), scales_rows], rows
  // unless a grouped band's group holds more), and the row stride of codes_t (rows unless a band's
  // columns lie inside a wider transposed tensor).
  int64_t scales_rows, codes_t_ld;
  int e5m2;                        // 0: E4M3, 1: E5M2
  float fmax;                      // the format's largest finite value
  bool vec_load;                   // a stored source, cols % 4 == 0 and x 16-byte aligned
  bool vec_codes;                  // cols % 4 == 0 and codes 4-byte aligned
  bool vec_codes_t;                // rows % 16 == 0 and codes_t 16-byte aligned
};

__device__ __forceinline__ uint8_t ToFp8(float v, int e5m2) {
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(v, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3));
}

// cpu::Pow2Scale of the amax whose bits are `bits`: *scale = 2^e, *inverse = 2^-e.
__device__ __forceinline__ void Pow2Scale(uint32_t bits, float fmax, float* scale, float* inverse) {
  const float amax = __uint_as_float(bits);
  if (isnan(amax)) {
    *scale = amax, *inverse = amax;
    return;
  }
  int e = 126;
  if (amax > 0.0f) {
    int ea = 0, em = 0;
    const float ma = frexpf(amax, &ea), mm = frexpf(fmax, &em);
    e = min(max(em - ea - (ma > mm ? 1 : 0), -126), 126);
  }
  *scale = __int_as_float((127 + e) << 23);
  *inverse = __int_as_float((127 - e) << 23);
}

// Values (r, c .. c + 3) of a source, all inside the tensor: one at a time, or for a stored tensor
// (Job::vec_load: 16-byte aligned fp32, 8-byte aligned bf16) as one load.
template <class Source>
__device__ __forceinline__ void Load4(const Source& src, int64_t r, int64_t c, float (&v)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = src(r, c + j);
}
template <typename T>
__device__ __forceinline__ void Load4(const StoredSource<T>& src, int64_t r, int64_t c,
                                      float (&v)[4]) {
  const T* p = src.x + r * src.cols + c;
  if constexpr (sizeof(T) == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    v[0] = __uint_as_float(u.x << 16), v[1] = __uint_as_float(u.x & 0xffff0000u);
    v[2] = __uint_as_float(u.y << 16), v[3] = __uint_as_float(u.y & 0xffff0000u);
  }
}

// Quantizes tile `tile` (row-major over the tiles of the job's [rows, cols]). kSquare: one scale
// for the tile (weights); otherwise one per row for codes and one per column for codes_t.
template <class Source, bool kSquare>
__device__ void QuantizeTile(const Source& src, const Job& job, int64_t tile) {
  __shared__ uint32_t col_bits[kWarps][kB];
  __shared__ float col_scale[kB];
  __shared__ uint32_t warp_bits[kWarps];
  __shared__ __align__(16) uint8_t tcodes[kB][kB + 16];
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t rows = job.rows, cols = job.cols;
  const int64_t tiles_c = (cols + kB - 1) / kB;
  const int64_t r0 = tile / tiles_c * kB, c0 = tile % tiles_c * kB;
  const int64_t rb = r0 / kB, cb = c0 / kB;
  const int64_t R0 = r0 + warp * kRowsPerWarp, C0 = c0 + lane * kColsPerLane;

  // Load: values outside the tensor are 0 (they change no amax and are not stored).
  float v[kRowsPerWarp][kColsPerLane];
  const bool full_cols = C0 + kColsPerLane <= cols;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = R0 + i;
    if (r < rows && full_cols && job.vec_load) {
      Load4(src, r, C0, v[i]);
    } else {
#pragma unroll
      for (int j = 0; j < kColsPerLane; ++j)
        v[i][j] = r < rows && C0 + j < cols ? src(r, C0 + j) : 0.0f;
    }
  }

  // The amaxes and scales.
  float row_scale[kRowsPerWarp];
  float my_row_inverse = 0.0f;  // lane i < 16: the inverse scale of the warp's row i
  float tile_scale = 0.0f, tile_inverse = 0.0f;
  if constexpr (kSquare) {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int j = 0; j < kColsPerLane; ++j) m = max(m, AbsBits(v[i][j]));
    m = WarpMaxBits(m);
    if (lane == 0) warp_bits[warp] = m;
    __syncthreads();
    m = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = max(m, warp_bits[w]);
    Pow2Scale(m, job.fmax, &tile_scale, &tile_inverse);
    if (threadIdx.x == 0) {
      if (job.codes != nullptr) job.scales[rb * job.scales_ld + cb] = tile_inverse;
      if (job.codes_t != nullptr) job.scales_t[cb * job.scales_t_ld + rb] = tile_inverse;
    }
  } else {
    if (job.codes != nullptr) {
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        uint32_t m = 0;
#pragma unroll
        for (int j = 0; j < kColsPerLane; ++j) m = max(m, AbsBits(v[i][j]));
        m = WarpMaxBits(m);
        float inverse;
        Pow2Scale(m, job.fmax, &row_scale[i], &inverse);
        if (lane == i) my_row_inverse = inverse;
      }
      if (lane < kRowsPerWarp && R0 + lane < rows)
        job.scales[cb * job.scales_rows + R0 + lane] = my_row_inverse;
    }
    if (job.codes_t != nullptr) {
#pragma unroll
      for (int j = 0; j < kColsPerLane; ++j) {
        uint32_t m = 0;
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) m = max(m, AbsBits(v[i][j]));
        col_bits[warp][lane * kColsPerLane + j] = m;
      }
      __syncthreads();
      if (threadIdx.x < kB) {
        uint32_t m = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) m = max(m, col_bits[w][threadIdx.x]);
        float scale, inverse;
        Pow2Scale(m, job.fmax, &scale, &inverse);
        col_scale[threadIdx.x] = scale;
        if (c0 + threadIdx.x < cols) job.scales_t[rb * cols + c0 + threadIdx.x] = inverse;
      }
      __syncthreads();
    }
  }

  // The row-major codes: a thread's 4 codes of a row as one word where they are all inside.
  if (job.codes != nullptr) {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int64_t r = R0 + i;
      if (r >= rows) break;
      const float s = kSquare ? tile_scale : row_scale[i];
      uint8_t q[kColsPerLane];
#pragma unroll
      for (int j = 0; j < kColsPerLane; ++j) q[j] = ToFp8(__fmul_rn(v[i][j], s), job.e5m2);
      uint8_t* dst = job.codes + r * cols + C0;
      if (full_cols && job.vec_codes) {
        *reinterpret_cast<uint32_t*>(dst) =
            uint32_t{q[0]} | uint32_t{q[1]} << 8 | uint32_t{q[2]} << 16 | uint32_t{q[3]} << 24;
      } else {
#pragma unroll
        for (int j = 0; j < kColsPerLane; ++j)
          if (C0 + j < cols) dst[j] = q[j];
      }
    }
  }
  if (job.codes_t == nullptr) return;  // uniform over the block

    // The transposed codes: column j's 16 codes of this warp's rows as one 16-byte word in shared
    // memory, then the tile's 128 transposed rows out, 16 bytes a thread at a time.
#pragma unroll
  for (int j = 0; j < kColsPerLane; ++j) {
    const float s = kSquare ? tile_scale : col_scale[lane * kColsPerLane + j];
    uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
      w[i / 4] |= uint32_t{ToFp8(__fmul_rn(v[i][j], s), job.e5m2)} << (8 * (i % 4));
    *reinterpret_cast<uint4*>(&tcodes[lane * kColsPerLane + j][warp * kRowsPerWarp]) =
        make_uint4(w[0], w[1], w[2], w[3]);
  }
  __syncthreads();
  constexpr int kChunks = kB / 16;  // 16-byte chunks per transposed row of the tile
  for (int k = static_cast<int>(threadIdx.x); k < kB * kChunks; k += kThreads) {
    const int c = k / kChunks, r = k % kChunks * 16;
    const int64_t C = c0 + c, R = r0 + r;
    if (C >= cols || R >= rows) continue;
    uint8_t* dst = job.codes_t + C * job.codes_t_ld + R;
    if (job.vec_codes_t && R + 16 <= rows) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&tcodes[c][r]);
    } else {
      for (int i = 0; i < 16 && R + i < rows; ++i) dst[i] = tcodes[c][r + i];
    }
  }
}

template <class Source>
__global__ void __launch_bounds__(kThreads) RowBlocksKernel(Source src, Job job) {
  QuantizeTile<Source, false>(src, job, blockIdx.x);
}

// A band's rows of a source over the whole grouped tensor: local row r is row row0 + r.
template <class Source>
struct BandSource {
  Source inner;
  int64_t row0;
  __device__ float operator()(int64_t r, int64_t c) const { return inner(row0 + r, c); }
};
// The gathered rows in[src[r], :] (zeros where src[r] < 0).
template <typename T>
struct GatherSource {
  const T* x;
  const int32_t* src;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const {
    const int32_t s = src[r];
    return s < 0 ? 0.0f : ToFloat(x[static_cast<int64_t>(s) * cols + c]);
  }
};

// Grouped row blocks (moe.h): block b quantizes column tile b % tiles_c of band b / tiles_c, as a
// tensor of the band's rows whose outputs sit inside the grouped ones: its row codes at its rows,
// its row scales in its group's kRow128 tensor, its transposed codes at its columns of codes_t
// (row stride job.rows, the whole tensor's), its column scales as one block row of the segment's.
template <class Source>
__global__ void __launch_bounds__(kThreads)
    GroupedRowBlocksKernel(Source src, Job job, const Fp8RowBand* bands, int64_t tiles_c) {
  const int64_t b = blockIdx.x / tiles_c, tile = blockIdx.x % tiles_c;
  const Fp8RowBand band = bands[b];
  Job j = job;
  j.rows = band.rows;
  j.vec_load = false;
  if (job.codes != nullptr) {
    j.codes = job.codes + band.row0 * job.cols;
    j.scales = job.scales + band.group_row0 * tiles_c + (band.row0 - band.group_row0);
    j.scales_rows = band.group_rows;
  }
  if (job.codes_t != nullptr) {
    j.codes_t = job.codes_t + band.row0;
    j.codes_t_ld = job.rows;
    j.scales_t = job.scales_t + band.col_block * job.cols;
    j.vec_codes_t = job.vec_codes_t && band.row0 % 16 == 0;
  }
  QuantizeTile<BandSource<Source>, false>(BandSource<Source>{src, band.row0}, j, tile);
}

struct CastTable {
  Job t[kMaxCastTensors];
  int32_t first_tile[kMaxCastTensors + 1];
  int32_t n;
};
static_assert(sizeof(CastTable) + 64 < 4096, "kernel argument space");

__global__ void __launch_bounds__(kThreads)
    SquareBlocksKernel(const __grid_constant__ CastTable table) {
  const int b = static_cast<int>(blockIdx.x);
  const int i = FindTensor(table.first_tile, table.n, b);
  const Job& job = table.t[i];
  QuantizeTile<StoredSource<float>, true>(
      StoredSource<float>{static_cast<const float*>(job.x), job.cols}, job,
      b - table.first_tile[i]);
}

inline bool AlignedTo(const void* p, uintptr_t a) {
  return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0;
}

Job JobOf(const void* x, int64_t rows, int64_t cols, DType format, void* codes, float* scales,
          void* codes_t, float* scales_t) {
  Job j{};
  j.x = x, j.rows = rows, j.cols = cols;
  j.codes = static_cast<uint8_t*>(codes), j.scales = scales;
  j.codes_t = static_cast<uint8_t*>(codes_t), j.scales_t = scales_t;
  j.scales_ld = Fp8SquareScalesLd(cols), j.scales_t_ld = Fp8SquareScalesLd(rows);
  j.scales_rows = rows, j.codes_t_ld = rows;
  j.e5m2 = format == DType::kFp8E5M2 ? 1 : 0;
  j.fmax = Fp8MaxOf(format);
  j.vec_load = cols % 4 == 0 && Aligned16(x);
  j.vec_codes = cols % 4 == 0 && AlignedTo(codes, 4);
  j.vec_codes_t = rows % 16 == 0 && Aligned16(codes_t);
  return j;
}

Status CheckOutputs(DType format, const void* codes, const float* scales, const void* codes_t,
                    const float* scales_t, const std::string& op) {
  if (!IsFp8(format)) return internal::UnsupportedDType(format, op.c_str());
  SPINDLE_CHECK_ARG(codes != nullptr || codes_t != nullptr,
                    op + ": neither codes nor codes_t given");
  SPINDLE_CHECK_ARG(codes == nullptr || scales != nullptr, op + ": codes without scales");
  SPINDLE_CHECK_ARG(codes_t == nullptr || scales_t != nullptr, op + ": codes_t without scales_t");
  return Status::Ok();
}

// Checks the outputs and launches the 1 x 128 quantization of src's [rows, cols].
template <class Source>
Status LaunchRowBlocks(const Source& src, int64_t rows, int64_t cols, bool vec_load,
                       const Fp8BlockOutput& out, const char* op, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && cols >= 0, std::string(op) + ": negative size");
  SPINDLE_RETURN_IF_ERROR(
      CheckOutputs(out.format, out.codes, out.scales, out.codes_t, out.scales_t, op));
  const int64_t tiles = CeilDiv(rows, kB) * CeilDiv(cols, kB);
  SPINDLE_CHECK_ARG(tiles < std::numeric_limits<int32_t>::max(),
                    std::string(op) + ": tensor too large for one launch");
  if (tiles == 0) return Status::Ok();
  Job job =
      JobOf(nullptr, rows, cols, out.format, out.codes, out.scales, out.codes_t, out.scales_t);
  job.vec_load = vec_load;
  RowBlocksKernel<Source><<<tiles, kThreads, 0, stream>>>(src, job);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

// Checks and launches the grouped 1 x 128 quantization of src's [rows, cols] over n_bands bands.
template <class Source>
Status LaunchGroupedRowBlocks(const Source& src, const Fp8RowBand* bands, int64_t n_bands,
                              int64_t rows, int64_t cols, const Fp8BlockOutput& out, const char* op,
                              cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && cols > 0 && n_bands >= 0 && rows % 16 == 0,
                    std::string(op) + ": rows must be a multiple of 16, cols positive");
  SPINDLE_CHECK_ARG(n_bands == 0 || bands != nullptr, std::string(op) + ": bands is null");
  SPINDLE_RETURN_IF_ERROR(
      CheckOutputs(out.format, out.codes, out.scales, out.codes_t, out.scales_t, op));
  const int64_t tiles_c = CeilDiv(cols, kB), blocks = n_bands * tiles_c;
  SPINDLE_CHECK_ARG(blocks < std::numeric_limits<int32_t>::max(),
                    std::string(op) + ": tensor too large for one launch");
  if (blocks == 0) return Status::Ok();
  const Job job =
      JobOf(nullptr, rows, cols, out.format, out.codes, out.scales, out.codes_t, out.scales_t);
  GroupedRowBlocksKernel<Source><<<blocks, kThreads, 0, stream>>>(src, job, bands, tiles_c);
  SPINDLE_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace

Status Fp8QuantizeBlockwise(const void* x, int64_t rows, int64_t cols, DType dtype,
                            const Fp8BlockOutput& out, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows * cols == 0 || x != nullptr, "Fp8QuantizeBlockwise: x is null");
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "Fp8QuantizeBlockwise", {
    const StoredSource<scalar_t> src{static_cast<const scalar_t*>(x), cols};
    return LaunchRowBlocks(src, rows, cols, cols % 4 == 0 && Aligned16(x), out,
                           "Fp8QuantizeBlockwise", stream);
  });
  return Status::Ok();
}

Status RmsNormQuantizeBlockwise(const void* x, const void* w, const float* rstd, int64_t rows,
                                int64_t D, DType dtype, const Fp8BlockOutput& out,
                                cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows >= 0 && D > 0 && rstd != nullptr && x != nullptr && w != nullptr,
                    "RmsNormQuantizeBlockwise: bad arguments");
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "RmsNormQuantizeBlockwise", {
    const RmsSource<scalar_t> src{static_cast<const scalar_t*>(x), static_cast<const scalar_t*>(w),
                                  rstd, D};
    return LaunchRowBlocks(src, rows, D, false, out, "RmsNormQuantizeBlockwise", stream);
  });
  return Status::Ok();
}

Status SwiGluQuantizeBlockwise(const void* g, const void* u, int64_t rows, int64_t cols,
                               DType dtype, const Fp8BlockOutput& out, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows * cols == 0 || (g != nullptr && u != nullptr),
                    "SwiGluQuantizeBlockwise: bad arguments");
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "SwiGluQuantizeBlockwise", {
    const SwiGluSource<scalar_t> src{static_cast<const scalar_t*>(g),
                                     static_cast<const scalar_t*>(u), cols};
    return LaunchRowBlocks(src, rows, cols, false, out, "SwiGluQuantizeBlockwise", stream);
  });
  return Status::Ok();
}

Status GroupNormGateQuantizeBlockwise(const void* o, const void* w, const void* gate,
                                      const float* rstd, int64_t T, int64_t H, int64_t Dh,
                                      DType dtype, const Fp8BlockOutput& out, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(T >= 0 && H > 0 && Dh > 0 && rstd != nullptr && o != nullptr && w != nullptr &&
                        gate != nullptr,
                    "GroupNormGateQuantizeBlockwise: bad arguments");
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "GroupNormGateQuantizeBlockwise", {
    const GroupGateSource<scalar_t> src{static_cast<const scalar_t*>(o),
                                        static_cast<const scalar_t*>(w),
                                        static_cast<const scalar_t*>(gate),
                                        rstd,
                                        H,
                                        Dh};
    return LaunchRowBlocks(src, T, H * Dh, false, out, "GroupNormGateQuantizeBlockwise", stream);
  });
  return Status::Ok();
}

Status Fp8CastWeightsBlockwise(const Fp8BlockWeightCast* tensors, int64_t n_tensors,
                               cudaStream_t stream) {
  SPINDLE_CHECK_ARG(n_tensors >= 0 && (n_tensors == 0 || tensors != nullptr),
                    "Fp8CastWeightsBlockwise: bad tensor list");
  // Every argument is checked before anything is launched.
  for (int64_t i = 0; i < n_tensors; ++i) {
    const Fp8BlockWeightCast& w = tensors[i];
    const std::string op = "Fp8CastWeightsBlockwise: tensor " + std::to_string(i);
    SPINDLE_CHECK_ARG(w.rows >= 0 && w.cols >= 0, op + ": negative size");
    SPINDLE_CHECK_ARG(w.rows * w.cols == 0 || w.master != nullptr, op + ": master is null");
    SPINDLE_RETURN_IF_ERROR(CheckOutputs(w.format, w.codes, w.scales, w.codes_t, w.scales_t, op));
  }
  for (int64_t start = 0; start < n_tensors; start += kMaxCastTensors) {
    CastTable table{};
    int64_t tiles = 0;
    int n = 0;
    for (int64_t i = start; i < std::min(n_tensors, start + kMaxCastTensors); ++i) {
      const Fp8BlockWeightCast& w = tensors[i];
      const int64_t t = CeilDiv(w.rows, kB) * CeilDiv(w.cols, kB);
      if (t == 0) continue;  // an empty tensor has no block and no scale
      table.t[n] =
          JobOf(w.master, w.rows, w.cols, w.format, w.codes, w.scales, w.codes_t, w.scales_t);
      table.first_tile[n] = static_cast<int32_t>(tiles);
      tiles += t;
      ++n;
      SPINDLE_CHECK_ARG(tiles < std::numeric_limits<int32_t>::max(),
                        "Fp8CastWeightsBlockwise: tensors too large for one launch");
    }
    if (n == 0) continue;
    table.first_tile[n] = static_cast<int32_t>(tiles);
    table.n = n;
    SquareBlocksKernel<<<tiles, kThreads, 0, stream>>>(table);
    SPINDLE_CUDA_CHECK_LAUNCH();
  }
  return Status::Ok();
}

Status Fp8GroupedRowBands(const int64_t* offsets, int64_t G, const int64_t* segments,
                          int64_t n_segments, Fp8RowBands* out) {
  SPINDLE_CHECK_ARG(
      offsets != nullptr && segments != nullptr && G >= 0 && n_segments >= 0 && out != nullptr,
      "Fp8GroupedRowBands: bad arguments");
  SPINDLE_CHECK_ARG(segments[0] == 0 && offsets[0] == 0 && segments[n_segments] == offsets[G],
                    "Fp8GroupedRowBands: the segments must run from row 0 to the groups' end");
  out->bands.clear();
  out->col_blocks = 0;
  int64_t g = 0;
  for (int64_t s = 0; s < n_segments; ++s) {
    const int64_t s0 = segments[s], s1 = segments[s + 1];
    SPINDLE_CHECK_ARG(
        s1 >= s0, "Fp8GroupedRowBands: segment bounds decrease at segment " + std::to_string(s));
    if (s1 == s0) continue;
    while (g < G && offsets[g + 1] <= s0) ++g;  // the group holding row s0
    SPINDLE_CHECK_ARG(
        g < G && s1 <= offsets[g + 1],
        "Fp8GroupedRowBands: segment " + std::to_string(s) + " crosses a group boundary");
    for (int64_t r = s0; r < s1; r += kFp8BlockSize) {
      Fp8RowBand b;
      b.row0 = r, b.rows = std::min<int64_t>(kFp8BlockSize, s1 - r);
      b.group_row0 = offsets[g], b.group_rows = offsets[g + 1] - offsets[g];
      b.col_block = out->col_blocks++;
      out->bands.push_back(b);
    }
  }
  return Status::Ok();
}

Status GatherRowsBlockwise(const void* in, const int32_t* src, const Fp8RowBand* bands,
                           int64_t n_bands, int64_t rows, int64_t D, DType dtype,
                           const Fp8BlockOutput& out, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows == 0 || in != nullptr, "GatherRowsBlockwise: in is null");
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "GatherRowsBlockwise", {
    const auto* x = static_cast<const scalar_t*>(in);
    if (src != nullptr)
      return LaunchGroupedRowBlocks(GatherSource<scalar_t>{x, src, D}, bands, n_bands, rows, D, out,
                                    "GatherRowsBlockwise", stream);
    return LaunchGroupedRowBlocks(StoredSource<scalar_t>{x, D}, bands, n_bands, rows, D, out,
                                  "GatherRowsBlockwise", stream);
  });
  return Status::Ok();
}

Status SwiGluQuantizeGroupedBlockwise(const void* g, const void* u, const Fp8RowBand* bands,
                                      int64_t n_bands, int64_t rows, int64_t cols, DType dtype,
                                      const Fp8BlockOutput& out, cudaStream_t stream) {
  SPINDLE_CHECK_ARG(rows == 0 || (g != nullptr && u != nullptr),
                    "SwiGluQuantizeGroupedBlockwise: bad arguments");
  SPINDLE_DISPATCH_FLOAT_BF16(dtype, "SwiGluQuantizeGroupedBlockwise", {
    const SwiGluSource<scalar_t> s{static_cast<const scalar_t*>(g), static_cast<const scalar_t*>(u),
                                   cols};
    return LaunchGroupedRowBlocks(s, bands, n_bands, rows, cols, out,
                                  "SwiGluQuantizeGroupedBlockwise", stream);
  });
  return Status::Ok();
}

}  // namespace spindle::kernels::cuda
