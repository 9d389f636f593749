// The FP8 element and E8M0 scale arithmetic, shared by the CPU codec (fp8_codec.h, mxfp8.cc) and the
// CUDA kernels (mxfp8_cuda.cu): compiled for both, so the two agree bit for bit by construction. Plain
// C++ on host_device.h only (no quant.h, whose core.h nvcc cannot read).
//
// The encoder is inline and branch-free so the CPU's block loops vectorize. One formula serves
// normal and subnormal results: with the exponent clamped to the format's smallest normal
// exponent, n = round(|y| / 2^(e - mant_bits)) counts quanta, and code = ((e + bias) << mant_bits)
// + n - 2^mant_bits lands on the subnormal codes (exponent field 0) when e is clamped, and carries
// into the next binade when n reaches 2^(mant_bits + 1).
#pragma once

#include <cstdint>

#include <mxddp/host_device.h>

namespace mxddp::fp8 {

struct Spec {
  int mant_bits;
  int bias;
  int emin;      // exponent of the smallest normal
  int emax;      // exponent of the largest finite
  float max;     // largest finite
  uint8_t max_code;
  uint8_t nan_code;
  bool ieee_specials;  // E5M2: exponent all ones is Inf or NaN; E4M3: only S.1111.111 is NaN
};

// By value, for device code (which cannot refer to a host constant) and the constants below.
MXDDP_HOST_DEVICE constexpr Spec spec_of(bool e4m3) {
  return e4m3 ? Spec{3, 7, -6, 8, 448.0f, 0x7E, 0x7F, false} : Spec{2, 15, -14, 15, 57344.0f, 0x7B, 0x7E, true};
}
inline constexpr Spec kE4M3 = spec_of(true);
inline constexpr Spec kE5M2 = spec_of(false);

inline constexpr uint8_t kE8M0NanCode = 0xFF;
inline constexpr int kMxBlock = 32;  // quant.h's kMxBlockSize: the elements that share a scale

// A block's amax as a max over |x|'s bits, as the CUDA kernels take it: NaN and Inf sort above every
// finite value, and NaN or Inf anywhere makes the amax Inf, so the block's scale is NaN (mxfp8.cc's
// rule; its vectorized loops keep their own form).
MXDDP_HOST_DEVICE inline uint32_t abs_bits(float x) { return float_bits(x) & 0x7fffffffu; }
MXDDP_HOST_DEVICE inline float amax_from_bits(uint32_t bits) {
  return bits >= 0x7f800000u ? float_from_bits(0x7f800000u) : float_from_bits(bits);
}

MXDDP_HOST_DEVICE inline uint8_t encode(float y, const Spec& s) {
  const uint32_t u = float_bits(y);
  const auto sign = static_cast<int>((u >> 24) & 0x80u);
  const uint32_t abs_bits = u & 0x7fffffffu;
  // Clamped to the largest finite value first (NaN too, fixed up at the end): the quanta count
  // below then stays under 2^(mant_bits+1) + 1, so the int conversion is always defined.
  const float a = float_from_bits(abs_bits) < s.max ? float_from_bits(abs_bits) : s.max;
  const int e_raw = static_cast<int>(float_bits(a) >> 23) - 127;
  const int e_hi = e_raw < s.emax ? e_raw : s.emax;
  const int e = e_hi > s.emin ? e_hi : s.emin;
  // 2^(mant_bits - e), built from bits: exact, and within f32's normal range for both formats.
  const float inv_quantum = float_from_bits(static_cast<uint32_t>(127 + s.mant_bits - e) << 23);
  // Round to nearest even by adding and removing 2^23 (exact for 0 <= q < 2^23 in the default
  // rounding mode). std::nearbyint would do the same but stays a libm call that blocks vectorizing.
  // (The product is exact, a power of two times a float, so a fused multiply-add rounds the same.)
  const float q = a * inv_quantum;
  const int n = static_cast<int>((q + 8388608.0f) - 8388608.0f);
  int code = ((e + s.bias) << s.mant_bits) + n - (1 << s.mant_bits);
  code = abs_bits > 0x7f800000u ? s.nan_code : code;  // NaN
  return static_cast<uint8_t>(sign | code);
}

// The value of a code, from the field definitions (E4M3: no infinities, one NaN magnitude).
MXDDP_HOST_DEVICE inline float decode(uint8_t code, const Spec& s) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80) << 24;
  const int mag = code & 0x7f;
  const int exp_field = mag >> s.mant_bits;
  const int mant = mag & ((1 << s.mant_bits) - 1);
  const int exp_all_ones = (1 << (7 - s.mant_bits)) - 1;
  uint32_t bits;
  if (s.ieee_specials && exp_field == exp_all_ones) {
    bits = mant == 0 ? 0x7f800000u : 0x7fc00000u;
  } else if (!s.ieee_specials && mag == 0x7f) {
    bits = 0x7fc00000u;
  } else {
    // mant x 2^(emin - mant_bits) for subnormals, (2^mant_bits + mant) x 2^(exp - bias - mant_bits)
    // for normals: an integer below 16 times a power of two in f32's normal range, exact.
    const int quanta = exp_field == 0 ? mant : mant + (1 << s.mant_bits);
    const int exponent = (exp_field == 0 ? s.emin : exp_field - s.bias) - s.mant_bits;
    bits = float_bits(static_cast<float>(quanta) * float_from_bits(static_cast<uint32_t>(127 + exponent) << 23));
  }
  return float_from_bits(sign | bits);
}

// The E8M0 scale of a block whose largest magnitude is amax (NaN or Inf: the NaN scale). Integer
// arithmetic on amax's bits, exact for both rules because both formats' largest value is
// 1.75 x 2^emax. With amax = m x 2^e (m in [1, 2)):
//   floor: X = e - emax
//   rceil: the smallest X with m x 2^e <= 1.75 x 2^(emax + X), which is e - emax, plus one when
//          m > 1.75, i.e. when the mantissa field exceeds 0.75 x 2^23 = 0x600000.
// Zero and f32 subnormals (e <= -127) give X < -127 in both rules: clamped to byte 0.
MXDDP_HOST_DEVICE inline uint8_t scale_for_amax(float amax, const Spec& s, bool rceil) {
  const uint32_t bits = float_bits(amax) & 0x7fffffffu;
  if (bits >= 0x7f800000u) return kE8M0NanCode;
  if (bits < 0x00800000u) return 0;
  int x = static_cast<int>(bits >> 23) - 127 - s.emax;
  if (rceil && (bits & 0x7fffffu) > 0x600000u) ++x;
  x = x < -127 ? -127 : (x > 127 ? 127 : x);
  return static_cast<uint8_t>(x + 127);
}

// 2^(scale - 127), and its inverse 2^(127 - scale), built from bits (exact; 2^-127 is subnormal).
// The NaN scale (0xFF) is NaN; its inverse is never asked for (such blocks store zeros).
MXDDP_HOST_DEVICE inline float pow2_float(int exponent) {
  return exponent >= -126 ? float_from_bits(static_cast<uint32_t>(exponent + 127) << 23)
                          : float_from_bits(0x00400000u >> (-127 - exponent));
}
MXDDP_HOST_DEVICE inline float e8m0_value(uint8_t scale) {
  return scale == kE8M0NanCode ? float_from_bits(0x7fc00000u) : pow2_float(static_cast<int>(scale) - 127);
}
MXDDP_HOST_DEVICE inline float e8m0_inverse(uint8_t scale) { return pow2_float(127 - static_cast<int>(scale)); }

}  // namespace mxddp::fp8
