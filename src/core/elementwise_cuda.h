// The elementwise kernels' launchers (elementwise_cuda.cu), beside their CPU references: the casts
// (convert_f32_to_bf16 / convert_bf16_to_f32 in dtype.cc; both use host_device.h's conversion),
// the NaN/Inf check (all_finite in tensor_view.cc), the zero count (count_zeros there), and the scale and accumulate passes whose CPU
// forms are one f32 multiply or add per element. They return the launch's cudaError_t as an int;
// cuda.h's entry points check the arguments and throw.
#pragma once

#include <cstdint>

#include <mxddp/host_device.h>

struct CUstream_st;

namespace mxddp::cuda_kernels {

int launch_f32_to_bf16(const float* in, bf16_bits* out, int64_t n, CUstream_st* stream);
int launch_bf16_to_f32(const bf16_bits* in, float* out, int64_t n, CUstream_st* stream);
// data [n] (f32, or bf16 when bf16) *= factor, in f32, rounded once for bf16.
int launch_scale(void* data, bool bf16, int64_t n, float factor, CUstream_st* stream);
// *count = the NaN and Inf elements of data [n] (f32, or bf16 when bf16).
int launch_count_nonfinite(const void* data, bool bf16, int64_t n, unsigned long long* count, CUstream_st* stream);
// *count += the +0 and -0 elements of data [n] (f32, or bf16 when bf16); the caller zeroes *count
// before the first of several runs.
int launch_count_zeros(const void* data, bool bf16, int64_t n, unsigned long long* count, CUstream_st* stream);
// main_grad [n] f32 += grad [n] (f32, or bf16 when grad_bf16).
int launch_accumulate(float* main_grad, const void* grad, bool grad_bf16, int64_t n, CUstream_st* stream);

}  // namespace mxddp::cuda_kernels
