// The collectives' reduction on a device (reduce_cuda.cu), beside its CPU reference (reduce.h's
// reduce_arrays_to, which cpu_compute() runs): the same combination, element for element, in input
// order, so the results are the same bits. Compute::reduce checks the arguments and throws; the
// launcher (called by the CUDA compute's run_reduce) returns the launch's cudaError_t as an int.
// Tested by tests/compute/compute_test.cc.
// Plain types only: nvcc compiles this header, and mxddp/core.h (fmt) is host code.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace mxddp::cuda_kernels {

// The pointers travel in the kernel's parameters (no copy to the device first), so a reduction
// takes at most this many inputs and as many outputs: a local group's ranks on one device.
inline constexpr int kReduceBuffersMax = 64;

enum class ReduceElem : int { kF32, kBF16, kF64, kU8, kI32, kI64, kBool };
enum class ReduceCombine : int { kSum, kAvg, kMax };

struct ReduceLaunch {
  ReduceElem elem = ReduceElem::kF32;
  ReduceCombine combine = ReduceCombine::kSum;
  float prescale = 1.0f;
  int64_t count = 0;
  int n_inputs = 0;
  int n_outputs = 0;
  const void* inputs[kReduceBuffersMax] = {};  // [n_inputs] device pointers, each [count]
  void* outputs[kReduceBuffersMax] = {};       // [n_outputs]; each may be exactly an input
};

int launch_reduce(const ReduceLaunch& r, CUstream_st* stream);

}  // namespace mxddp::cuda_kernels
