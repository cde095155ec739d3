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
// accumulator (cuBLASLt's scale_a * scale_b). Fp8Recipe says how the scales are chosen; the one
// recipe implemented is tensorwise current scaling (torchao's default "tensorwise" recipe, as the
// PyTorch peer's --fp8 runs it): scale = fp8_max / max(amax(|x|), 1e-12) in fp32, computed per
// GEMM input from the tensor about to be multiplied, and q = fp8(x * scale). Blockwise recipes
// (1x128 activations, 128x128 weights) add a Fp8Scaling value and scales per block.
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
};

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

}  // namespace spindle::kernels::cpu
