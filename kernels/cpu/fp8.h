// FP8 in software: exact conversions between fp32 and the two OCP FP8 formats, and the scaled
// quantization of a tensor that an FP8 GEMM's inputs go through. The CPU engine uses it to
// emulate FP8 training (worker/engine/numerics.h), and the GPU's quantize kernels are tested
// against it.
//
// Formats (OCP 8-bit floating point, as CUDA's __nv_fp8_e4m3 / __nv_fp8_e5m2):
//   E4M3 ("fn"): bias 7, no infinities; largest finite 448, smallest normal 2^-6, smallest
//                subnormal 2^-9; NaN is S.1111.111 (0x7F / 0xFF).
//   E5M2:        bias 15, IEEE-like; largest finite 57344, smallest normal 2^-14, smallest
//                subnormal 2^-16; +-inf 0x7C / 0xFC, NaN exponent 31 with a non-zero mantissa.
// fp32 -> FP8 rounds to nearest, ties to even, through the subnormals; a value whose rounding
// exceeds the largest finite, or an infinity, saturates to +-largest finite (CUDA's
// __NV_SATFINITE); NaN becomes NaN (S.1111111, 0x7F with the input's sign, in both formats).
// Every FP8 value converts to fp32 exactly and back to the same code (but NaN, which stays NaN,
// and -0, which stays -0).
//
// Scaling: an FP8 GEMM multiplies codes and applies each operand's inverse scale to the fp32
// accumulator (cuBLASLt's scale_a * scale_b). Fp8Recipe says how the scales are chosen:
// - tensorwise current scaling (torchao's default "tensorwise" recipe, as the PyTorch peer's
//   --fp8 runs it): scale = fp8_max / max(amax(|x|), 1e-12) in fp32, computed per GEMM input from
//   the tensor about to be multiplied, and q = fp8(x * scale);
// - blockwise (DeepSeek-V3's recipe, train.fp8_recipe "blockwise"): one scale per block of
//   kFp8Block values, 1 x 128 along the reduced dimension for activations and output gradients,
//   128 x 1 (along the tokens) for the copies the weight gradient's GEMM reads, 128 x 128 for
//   weights; one outlier then flattens its block's values only, not the tensor's. The scales are
//   powers of two (Pow2Scale), so a block-scaled value q / scale is exactly representable and
//   a GEMM over such values differs from one applying the scales to per-block partial sums only
//   in the order of its additions. Blocks at a matrix's edge are partial.
// Stateless; every function may be called from any thread.
#pragma once

#include <cstdint>

namespace spindle::kernels::cpu {

enum class Fp8Format { kE4M3, kE5M2 };

const char* Fp8FormatName(Fp8Format f);  // "e4m3", "e5m2"
float Fp8Max(Fp8Format f);               // largest finite value: 448 or 57344

// fp32 -> FP8 code and back (see the header comment for rounding, saturation and NaN).
uint8_t FloatToFp8(float x, Fp8Format f);
float Fp8ToFloat(uint8_t code, Fp8Format f);
// The FP8 value nearest x, as fp32: Fp8ToFloat(FloatToFp8(x, f), f).
float RoundToFp8(float x, Fp8Format f);

enum class Fp8Scaling {
  kTensorwise,  // one scale per tensor, from the tensor's current amax
  kBlockwise,   // one power-of-two scale per block (kFp8Block), from the block's amax
};
const char* Fp8ScalingName(Fp8Scaling s);  // "tensorwise", "blockwise"

// The side of a block of blockwise scaling.
inline constexpr int64_t kFp8Block = 128;

// Which formats the GEMM inputs of an FP8 linear layer y = x W^T take, and how they are scaled.
// The forward multiplies x and W; the backward dy W (input gradient) and dy^T x (weight
// gradient), with the same quantized x and W (under tensorwise scaling a transposed copy holds
// the same values).
struct Fp8Recipe {
  Fp8Scaling scaling = Fp8Scaling::kTensorwise;
  Fp8Format activations = Fp8Format::kE4M3;  // x
  Fp8Format weights = Fp8Format::kE4M3;      // W
  Fp8Format gradients = Fp8Format::kE5M2;    // dy
};

// max |x[i]| over n values; NaN when any is NaN; 0 for n = 0.
float AbsMax(const float* x, int64_t n);

// A tensor's scale and the inverse that its GEMM applies to the accumulator.
struct Fp8Scale {
  float scale = 1.0f;    // x * scale is quantized
  float inverse = 1.0f;  // 1 / scale (fp32), the GEMM's dequantization factor
};
// Tensorwise current scaling: scale = Fp8Max(f) / max(amax, 1e-12f), both in fp32.
Fp8Scale TensorwiseScale(float amax, Fp8Format f);

// q[i] = RoundToFp8(x[i] * scale, f) (the product in fp32), the FP8 values held as fp32. q may
// alias x.
void QuantizeScaled(const float* x, int64_t n, float scale, Fp8Format f, float* q);

// The whole tensorwise quantization of x [n] into q [n] (may alias x): amax, scale, values.
// Returns the scale.
Fp8Scale QuantizeTensorwise(const float* x, int64_t n, Fp8Format f, float* q);

// Blockwise scaling's scale for a block of absolute maximum amax: the largest power of two s
// with amax * s <= Fp8Max(f), within [2^-126, 2^126] (2^126 for an all-zero block); NaN for a
// NaN amax.
Fp8Scale Pow2Scale(float amax, Fp8Format f);

// Blockwise quantization of the row-major matrix x [rows, cols] into out [rows, cols] (may not
// alias x), as the values a block-scaled GEMM multiplies: out = RoundToFp8(x * s) / s with s the
// Pow2Scale of x's block. Blocks of 1 x kFp8Block along a row (activations and output gradients
// as the forward and the input gradient read them), of kFp8Block x 1 down a column (as the
// weight gradient reads them), or kFp8Block x kFp8Block (weights).
void QuantizeRowBlocks(const float* x, int64_t rows, int64_t cols, Fp8Format f, float* out);
void QuantizeColumnBlocks(const float* x, int64_t rows, int64_t cols, Fp8Format f, float* out);
void QuantizeSquareBlocks(const float* x, int64_t rows, int64_t cols, Fp8Format f, float* out);

}  // namespace spindle::kernels::cpu
