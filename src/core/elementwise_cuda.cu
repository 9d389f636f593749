// The elementwise kernels on the device: the f32 <-> bf16 casts, scale, the NaN/Inf and zero counts and the
// accumulation of a grad into main_grad. One element per thread, grid-stride; each element goes
// through the CPU's own arithmetic (host_device.h; one f32 multiply or add, no fused multiply-add),
// so the results are bit-exact. References and checks: elementwise_cuda.h, tests/cuda/kernels_test.cc.
#include <cuda_runtime.h>

#include "cuda/launch_shape.h"
#include "elementwise_cuda.h"

namespace mxddp::cuda_kernels {
namespace {

// for (i in this thread's share of [0, n)) body(i)
template <typename Body>
__device__ void grid_stride(int64_t n, Body body) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) body(i);
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ in, bf16_bits* __restrict__ out, int64_t n) {
  grid_stride(n, [&](int64_t i) { out[i] = f32_to_bf16(in[i]); });
}

__global__ void bf16_to_f32_kernel(const bf16_bits* __restrict__ in, float* __restrict__ out, int64_t n) {
  grid_stride(n, [&](int64_t i) { out[i] = bf16_to_f32(in[i]); });
}

__global__ void scale_f32_kernel(float* __restrict__ x, int64_t n, float factor) {
  grid_stride(n, [&](int64_t i) { x[i] = x[i] * factor; });
}

__global__ void scale_bf16_kernel(bf16_bits* __restrict__ x, int64_t n, float factor) {
  grid_stride(n, [&](int64_t i) { x[i] = f32_to_bf16(bf16_to_f32(x[i]) * factor); });
}

// all_finite's tests: f32 by its bits (exponent all ones), bf16 likewise.
__global__ void count_nonfinite_kernel(const void* __restrict__ data, bool bf16, int64_t n, unsigned long long* count) {
  unsigned long long mine = 0;
  if (bf16) {
    const auto* x = static_cast<const bf16_bits*>(data);
    grid_stride(n, [&](int64_t i) { mine += (x[i] & 0x7f80u) == 0x7f80u; });
  } else {
    const auto* x = static_cast<const float*>(data);
    grid_stride(n, [&](int64_t i) { mine += (float_bits(x[i]) & 0x7f800000u) == 0x7f800000u; });
  }
  if (mine != 0) atomicAdd(count, mine);
}

// count_zeros' test: +0 and -0 by their bits, as the CPU's.
__global__ void count_zeros_kernel(const void* __restrict__ data, bool bf16, int64_t n, unsigned long long* count) {
  unsigned long long mine = 0;
  if (bf16) {
    const auto* x = static_cast<const bf16_bits*>(data);
    grid_stride(n, [&](int64_t i) { mine += (x[i] & 0x7fffu) == 0; });
  } else {
    const auto* x = static_cast<const float*>(data);
    grid_stride(n, [&](int64_t i) { mine += (float_bits(x[i]) & 0x7fffffffu) == 0; });
  }
  if (mine != 0) atomicAdd(count, mine);
}

template <typename G>
__global__ void accumulate_kernel(float* __restrict__ main_grad, const G* __restrict__ grad, int64_t n) {
  grid_stride(n, [&](int64_t i) {
    if constexpr (sizeof(G) == 2) main_grad[i] = main_grad[i] + bf16_to_f32(grad[i]);
    else main_grad[i] = main_grad[i] + grad[i];
  });
}

}  // namespace

int launch_f32_to_bf16(const float* in, bf16_bits* out, int64_t n, CUstream_st* stream) {
  if (n == 0) return cudaSuccess;
  f32_to_bf16_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

int launch_bf16_to_f32(const bf16_bits* in, float* out, int64_t n, CUstream_st* stream) {
  if (n == 0) return cudaSuccess;
  bf16_to_f32_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

int launch_scale(void* data, bool bf16, int64_t n, float factor, CUstream_st* stream) {
  if (n == 0) return cudaSuccess;
  if (bf16) scale_bf16_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(static_cast<bf16_bits*>(data), n, factor);
  else scale_f32_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(static_cast<float*>(data), n, factor);
  return cudaGetLastError();
}

int launch_count_nonfinite(const void* data, bool bf16, int64_t n, unsigned long long* count, CUstream_st* stream) {
  const cudaError_t zeroed = cudaMemsetAsync(count, 0, sizeof *count, stream);
  if (zeroed != cudaSuccess || n == 0) return zeroed;
  count_nonfinite_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(data, bf16, n, count);
  return cudaGetLastError();
}

int launch_count_zeros(const void* data, bool bf16, int64_t n, unsigned long long* count, CUstream_st* stream) {
  if (n == 0) return cudaSuccess;
  count_zeros_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(data, bf16, n, count);
  return cudaGetLastError();
}

int launch_accumulate(float* main_grad, const void* grad, bool grad_bf16, int64_t n, CUstream_st* stream) {
  if (n == 0) return cudaSuccess;
  if (grad_bf16)
    accumulate_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(main_grad, static_cast<const bf16_bits*>(grad), n);
  else
    accumulate_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(main_grad, static_cast<const float*>(grad), n);
  return cudaGetLastError();
}

}  // namespace mxddp::cuda_kernels
