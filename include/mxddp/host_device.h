// What the CUDA kernels share with their CPU references: the scalar bf16 conversions and a float's
// bits. Compiled for both host and device when nvcc reads this header, so a kernel and its CPU
// reference round alike by construction. Plain C++ with no other mxddp header: the .cu files include
// it without core.h (whose fmt does not compile under nvcc).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MXDDP_HOST_DEVICE __host__ __device__
#else
#define MXDDP_HOST_DEVICE
#endif

namespace mxddp {

// A float's bits and back (memcpy on the host, which compilers turn into a register move; the
// intrinsics on the device).
MXDDP_HOST_DEVICE inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
MXDDP_HOST_DEVICE inline float float_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Scalar conversions. Narrowing rounds to nearest, ties to even; overflow goes to Inf; NaN stays
// NaN (quietened, sign kept); subnormals are produced and consumed exactly.
using bf16_bits = uint16_t;

MXDDP_HOST_DEVICE inline float bf16_to_f32(bf16_bits h) { return float_from_bits(uint32_t{h} << 16); }

MXDDP_HOST_DEVICE inline bf16_bits f32_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_bits>((u >> 16) | 0x0040u);  // NaN
  // Round to nearest even: add 0x7fff plus the lowest kept bit, then truncate. Overflow carries
  // into the exponent and lands on Inf, which is the correct rounding.
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_bits>(u >> 16);
}

}  // namespace mxddp
