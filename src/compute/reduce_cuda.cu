// The collectives' reduction on a device: one element per thread, grid-stride; each thread reads
// the element of every input in order and writes the result to every output, so an output that is
// an input is safe. The arithmetic is reduce_arrays_to's (src/compute/reduce.cc and
// reduce_simd.inc): floats accumulate in f32 (f64 in f64) from input 0, times prescale when it is
// not 1, adding each next input (times prescale) or taking the NaN-propagating max; avg divides by
// the input count; bf16 rounds once (host_device.h). Integers add in their unsigned twin, u8 through
// a u32 sum truncated to its low byte; bool ors the bytes. Built with -fmad=false: a fused
// multiply-add would round the prescaled sum differently from the CPU.
#include <cuda_runtime.h>

#include <type_traits>

#include <mxddp/host_device.h>

#include "cuda/launch_shape.h"
#include "reduce_cuda.h"

namespace mxddp::cuda_kernels {
namespace {

// The kernel's view of a launch: the pointer lists by value, in the parameter space.
struct Lists {
  const void* inputs[kReduceBuffersMax];
  void* outputs[kReduceBuffersMax];
};

__device__ inline float load_f(const float* p, int64_t i) { return p[i]; }
__device__ inline float load_f(const bf16_bits* p, int64_t i) { return bf16_to_f32(p[i]); }
__device__ inline void store_f(float* p, int64_t i, float v) { p[i] = v; }
__device__ inline void store_f(bf16_bits* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }
template <typename A>
__device__ inline A max_nan(A acc, A x) { return (x > acc || x != x) ? x : acc; }

// f32 and bf16 (T the storage, the sum in f32), and f64 (in f64).
template <typename T, typename A>
__global__ void reduce_float_kernel(Lists l, int n_in, int n_out, int64_t count, ReduceCombine op, float prescale) {
  const bool scaled = prescale != 1.0f;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    A acc;
    if constexpr (std::is_same_v<A, double>) {
      // reduce_scalar<double>: every input times the prescale (exact when it is 1).
      const A scale = prescale;
      acc = static_cast<const A*>(l.inputs[0])[i] * scale;
      for (int k = 1; k < n_in; ++k) {
        const A x = static_cast<const A*>(l.inputs[k])[i];
        acc = op == ReduceCombine::kMax ? max_nan(acc, x) : acc + x * scale;
      }
    } else {
      acc = load_f(static_cast<const T*>(l.inputs[0]), i);
      if (scaled) acc = acc * prescale;
      for (int k = 1; k < n_in; ++k) {
        const A x = load_f(static_cast<const T*>(l.inputs[k]), i);
        if (op == ReduceCombine::kMax) acc = max_nan(acc, x);
        else acc = acc + (scaled ? x * prescale : x);
      }
    }
    if (op == ReduceCombine::kAvg) acc = acc / static_cast<A>(n_in);
    for (int j = 0; j < n_out; ++j) {
      if constexpr (std::is_same_v<A, double>) static_cast<A*>(l.outputs[j])[i] = acc;
      else store_f(static_cast<T*>(l.outputs[j]), i, acc);
    }
  }
}

// u8, i32, i64 (T; U its unsigned accumulator, u32 for u8) and bool (T = bool, read as bytes).
template <typename T, typename U>
__global__ void reduce_integer_kernel(Lists l, int n_in, int n_out, int64_t count, ReduceCombine op) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    if constexpr (std::is_same_v<T, bool>) {
      uint8_t any = 0;
      for (int k = 0; k < n_in; ++k) any |= static_cast<const uint8_t*>(l.inputs[k])[i];
      for (int j = 0; j < n_out; ++j) static_cast<uint8_t*>(l.outputs[j])[i] = any != 0;
    } else {
      // max compares the signed values; sum wraps in the unsigned twin.
      T acc = static_cast<const T*>(l.inputs[0])[i];
      U sum = static_cast<U>(acc);
      for (int k = 1; k < n_in; ++k) {
        const T x = static_cast<const T*>(l.inputs[k])[i];
        if (op == ReduceCombine::kMax) acc = x > acc ? x : acc;
        else sum = static_cast<U>(sum + static_cast<U>(x));
      }
      const T out = op == ReduceCombine::kMax ? acc : static_cast<T>(sum);
      for (int j = 0; j < n_out; ++j) static_cast<T*>(l.outputs[j])[i] = out;
    }
  }
}

}  // namespace

int launch_reduce(const ReduceLaunch& r, CUstream_st* stream) {
  if (r.count == 0) return cudaSuccess;
  Lists l;
  for (int k = 0; k < kReduceBuffersMax; ++k) {
    l.inputs[k] = r.inputs[k];
    l.outputs[k] = r.outputs[k];
  }
  const unsigned blocks = elementwise_blocks(r.count);
  const auto floats = [&](auto kernel) {
    kernel<<<blocks, kElementwiseThreads, 0, stream>>>(l, r.n_inputs, r.n_outputs, r.count, r.combine, r.prescale);
  };
  const auto integers = [&](auto kernel) {
    kernel<<<blocks, kElementwiseThreads, 0, stream>>>(l, r.n_inputs, r.n_outputs, r.count, r.combine);
  };
  switch (r.elem) {
    case ReduceElem::kF32: floats(reduce_float_kernel<float, float>); break;
    case ReduceElem::kBF16: floats(reduce_float_kernel<bf16_bits, float>); break;
    case ReduceElem::kF64: floats(reduce_float_kernel<double, double>); break;
    case ReduceElem::kU8: integers(reduce_integer_kernel<uint8_t, uint32_t>); break;
    case ReduceElem::kI32: integers(reduce_integer_kernel<int32_t, uint32_t>); break;
    case ReduceElem::kI64: integers(reduce_integer_kernel<int64_t, uint64_t>); break;
    case ReduceElem::kBool: integers(reduce_integer_kernel<bool, uint32_t>); break;
  }
  return cudaGetLastError();
}

}  // namespace mxddp::cuda_kernels
