// Element types and reduce ops: sizes, names, and the f16 conversions (bf16's are inline in
// core.h because they are two lines and sit in every hot loop).
#include <mxddp/core.h>

#include <bit>

namespace mxddp {

size_t dtype_size_bytes(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64: return 8;
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kE4M3:
    case DType::kE5M2:
    case DType::kE8M0:
    case DType::kU8:
    case DType::kBool: return 1;
  }
  MXDDP_FAIL("unknown dtype value {}", static_cast<int>(dtype));
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kE4M3: return "e4m3";
    case DType::kE5M2: return "e5m2";
    case DType::kE8M0: return "e8m0";
    case DType::kU8: return "u8";
    case DType::kF64: return "f64";
    case DType::kI64: return "i64";
    case DType::kI32: return "i32";
    case DType::kBool: return "bool";
  }
  MXDDP_FAIL("unknown dtype value {}", static_cast<int>(dtype));
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  MXDDP_FAIL("unknown reduce op {}", static_cast<int>(op));
}

DType parse_dtype(std::string_view name) {
  for (DType d : kAllDTypes)
    if (dtype_name(d) == name) return d;
  MXDDP_FAIL("unknown dtype '{}'; valid: f32, bf16, f16, e4m3, e5m2, e8m0, u8, f64, i64, i32, bool", name);
}

float f16_to_f32(f16_bits h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // Inf, or NaN with its payload kept
  } else if (exp != 0) {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;  // signed zero
  } else {
    // Subnormal: value = mant * 2^-24. Normalize so the leading one becomes the implicit bit.
    const int shift = std::countl_zero(mant) - 21;  // mant has its top bit at 9 - (shift - 1)
    mant = (mant << shift) & 0x3ffu;
    bits = sign | (static_cast<uint32_t>(127 - 15 + 1 - shift) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

f16_bits f32_to_f16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<f16_bits>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x47800000u) return static_cast<f16_bits>(sign | 0x7c00u);  // >= 2^16: Inf
  const int exp = static_cast<int>(abs >> 23) - 127;
  if (exp >= -14) {
    // Normal range: drop 13 mantissa bits with round-to-nearest-even; a carry out of the
    // mantissa correctly bumps the exponent (and 65520 and up reach Inf).
    uint32_t r = abs - (uint32_t{127 - 15} << 23);
    r += 0xfffu + ((r >> 13) & 1u);
    return static_cast<f16_bits>(sign | (r >> 13));
  }
  if (exp < -25) return sign;  // below half the smallest subnormal: rounds to zero
  // Subnormal: value / 2^-24 with round-to-nearest-even on the shifted-out bits.
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  const int shift = -exp - 14 + 13;  // 14..24 bits shifted out
  const uint32_t kept = mant >> shift;
  const uint32_t rest = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  const uint32_t rounded = kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
  return static_cast<f16_bits>(sign | rounded);  // rounded may reach 0x400: the smallest normal
}

void convert_bf16_to_f32(const bf16_bits* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(in[i]);
}

void convert_f32_to_bf16(const float* in, bf16_bits* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = f32_to_bf16(in[i]);
}

}  // namespace mxddp
