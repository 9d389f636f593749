// The FP8 element encoder, inline and branch-free so the block loops vectorize. One formula
// serves normal and subnormal results: with the exponent clamped to the format's smallest normal
// exponent, n = round(|y| / 2^(e - mant_bits)) counts quanta, and code = ((e + bias) << mant_bits)
// + n - 2^mant_bits lands on the subnormal codes (exponent field 0) when e is clamped, and carries
// into the next binade when n reaches 2^(mant_bits + 1).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

#include <mxddp/quant.h>

namespace mxddp::fp8 {

struct Spec {
  int mant_bits;
  int bias;
  int emin;      // exponent of the smallest normal
  int emax;      // exponent of the largest finite
  float max;     // largest finite
  uint8_t max_code;
  uint8_t nan_code;
};

inline constexpr Spec kE4M3{3, 7, -6, 8, 448.0f, 0x7E, 0x7F};
inline constexpr Spec kE5M2{2, 15, -14, 15, 57344.0f, 0x7B, 0x7E};
inline const Spec& spec(Fp8Format f) { return f == Fp8Format::kE4M3 ? kE4M3 : kE5M2; }
template <Fp8Format F>
inline constexpr const Spec& kSpec = F == Fp8Format::kE4M3 ? kE4M3 : kE5M2;

inline uint8_t encode(float y, const Spec& s) {
  const uint32_t u = std::bit_cast<uint32_t>(y);
  const auto sign = static_cast<int>((u >> 24) & 0x80u);
  const uint32_t abs_bits = u & 0x7fffffffu;
  // Clamped to the largest finite value first (NaN too, fixed up at the end): the quanta count
  // below then stays under 2^(mant_bits+1) + 1, so the int conversion is always defined.
  const float a = std::bit_cast<float>(abs_bits) < s.max ? std::bit_cast<float>(abs_bits) : s.max;
  const int e = std::max(std::min(static_cast<int>(std::bit_cast<uint32_t>(a) >> 23) - 127, s.emax), s.emin);
  // 2^(mant_bits - e), built from bits: exact, and within f32's normal range for both formats.
  const float inv_quantum = std::bit_cast<float>(static_cast<uint32_t>(127 + s.mant_bits - e) << 23);
  // Round to nearest even by adding and removing 2^23 (exact for 0 <= q < 2^23 in the default
  // rounding mode). std::nearbyint would do the same but stays a libm call that blocks vectorizing.
  const float q = a * inv_quantum;
  const int n = static_cast<int>((q + 8388608.0f) - 8388608.0f);
  int code = ((e + s.bias) << s.mant_bits) + n - (1 << s.mant_bits);
  code = abs_bits > 0x7f800000u ? s.nan_code : code;  // NaN
  return static_cast<uint8_t>(sign | code);
}

}  // namespace mxddp::fp8
