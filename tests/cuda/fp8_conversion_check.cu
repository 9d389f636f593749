// The device's FP8 conversion (cvt.rn.satfinite.{e4m3,e5m2}x2.f32, which the wide MXFP8 kernels
// encode with) against fp8::encode on every one of the 2^32 floats, on the GPU: the host test
// (wide_kernels_host_test.cc) can only check cuda_fp8.h's software model of the instruction.
#include <cuda_runtime.h>

#include "fp8_conversion_check.h"
#include "quant/mxfp8_wide.h"

namespace mxddp::testing {
namespace {

// Pairs (u, u + 2^31) of bit patterns, u over [0, 2^31): every float once. A NaN must give a NaN
// code (encode's sign and payload rule is not the hardware's, and no NaN reaches the kernels'
// encode); everything else, Inf included, the encoder's byte.
template <bool E4M3>
__global__ void count_mismatches(unsigned long long* mismatches) {
  const fp8::Spec spec = fp8::spec_of(E4M3);
  unsigned long long bad = 0;
  for (uint64_t u = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; u < (uint64_t{1} << 31);
       u += uint64_t{gridDim.x} * blockDim.x) {
    const float xs[2] = {float_from_bits(static_cast<uint32_t>(u)), float_from_bits(static_cast<uint32_t>(u) | 0x80000000u)};
    const uint32_t pair = cuda_kernels::wide::encode2<E4M3>(xs[0], xs[1]);
    for (int k = 0; k < 2; ++k) {
      const auto got = static_cast<uint8_t>(pair >> (8 * k));
      const bool nan_in = (float_bits(xs[k]) & 0x7fffffffu) > 0x7f800000u;
      const float back = fp8::decode(got, spec);
      bad += nan_in ? !(back != back) : got != fp8::encode(xs[k], spec);
    }
  }
  if (bad != 0) atomicAdd(mismatches, bad);
}

}  // namespace

int64_t fp8_conversion_mismatches(bool e4m3) {
  unsigned long long* count = nullptr;
  if (cudaMalloc(&count, sizeof *count) != cudaSuccess) return -1;
  cudaMemset(count, 0, sizeof *count);
  if (e4m3) count_mismatches<true><<<132 * 16, 256>>>(count);
  else count_mismatches<false><<<132 * 16, 256>>>(count);
  unsigned long long host = 0;
  const bool ok = cudaGetLastError() == cudaSuccess && cudaMemcpy(&host, count, sizeof host, cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(count);
  return ok ? static_cast<int64_t>(host) : -1;
}

}  // namespace mxddp::testing
