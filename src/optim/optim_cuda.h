// The optimizer kernels' launchers (optim_cuda.cu), beside their CPU reference (adamw_kernel.h;
// each element's update is optim_element.h's, shared). They return the launch's cudaError_t as an
// int; cuda.h's cuda_adamw / cuda_sgd / cuda_sum_of_squares check the arguments and throw.
#pragma once

#include <cstdint>

#include "optim_element.h"

struct CUstream_st;

namespace mxddp::cuda_kernels {

// Element types of the pointers below: f32 or bf16 grads; params f32, bf16, or none (not staged).
enum class GradKind : uint8_t { kF32, kBF16 };
enum class ParamKind : uint8_t { kNone, kF32, kBF16 };

int launch_adamw(const void* grad, GradKind grad_kind, float* main, float* exp_avg, float* exp_avg_sq, void* param,
                 ParamKind param_kind, int64_t n, const optim_kernel::AdamScalars& scalars, CUstream_st* stream);
int launch_sgd(const void* grad, GradKind grad_kind, float* main, float* momentum, void* param, ParamKind param_kind,
               int64_t n, const optim_kernel::SgdScalars& scalars, CUstream_st* stream);

// The sum of squares in f64, in a fixed order: kSumBlocks blocks each sum a fixed contiguous
// chunk (thread t the chunk's elements t, t + 256, ... in turn, then a fixed tree over the block),
// and one block sums the partials in a fixed tree. out: [kSumOfSquaresNumel] doubles on the
// device; the sum lands in out[0], the partials in out[1..].
inline constexpr int kSumBlocks = 1024;
inline constexpr int64_t kSumOfSquaresNumel = kSumBlocks + 1;
int launch_sum_of_squares(const void* grad, GradKind grad_kind, int64_t n, double* out, CUstream_st* stream);

}  // namespace mxddp::cuda_kernels
