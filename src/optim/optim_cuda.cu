// AdamW, SGD and the grad norm's sum of squares on a shard, on the device. AdamW runs four
// elements per thread where the shard's pointers allow (adamw_wide.h), one otherwise. The updates run
// optim_element.h's per-element code (the CPU kernels' own), compiled without fused multiply-adds,
// so a device step equals the CPU step bit for bit. Reference and check: adamw_kernel.h,
// tests/cuda/kernels_test.cc.
#include <cuda_runtime.h>

#include <type_traits>

#include "adamw_wide.h"
#include "cuda/launch_shape.h"
#include "optim_cuda.h"

namespace mxddp::cuda_kernels {
namespace {

using optim_kernel::AdamScalars;
using optim_kernel::SgdScalars;

using optim_kernel::NoStage;

// One element per thread: for shards whose pointers the wide kernel cannot take.
template <typename G, typename P>
__global__ void adamw_kernel(const G* __restrict__ grad, float* __restrict__ main, float* __restrict__ exp_avg,
                             float* __restrict__ exp_avg_sq, P* __restrict__ param, int64_t n, AdamScalars s) {
  const float decay = 1.0f - s.lr * s.weight_decay;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    wide::adamw_at(grad, main, exp_avg, exp_avg_sq, param, i, s, decay);
}

// Four elements per thread (adamw_wide.h), then the last n % 4 one per thread.
template <typename G, typename P>
__global__ void adamw_wide_kernel(const G* __restrict__ grad, float* __restrict__ main, float* __restrict__ exp_avg,
                                  float* __restrict__ exp_avg_sq, P* __restrict__ param, int64_t n, AdamScalars s) {
  const float decay = 1.0f - s.lr * s.weight_decay;
  const int64_t groups = n / wide::kAdamGroup, first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  for (int64_t g = first; g < groups; g += int64_t{gridDim.x} * blockDim.x)
    wide::adamw_group(grad, main, exp_avg, exp_avg_sq, param, g, s, decay);
  if (first < n % wide::kAdamGroup) wide::adamw_at(grad, main, exp_avg, exp_avg_sq, param, groups * wide::kAdamGroup + first, s, decay);
}

template <typename G, typename P>
__global__ void sgd_kernel(const G* __restrict__ grad, float* __restrict__ main, float* __restrict__ momentum,
                           P* __restrict__ param, int64_t n, SgdScalars s) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const optim_kernel::SgdElement e = optim_kernel::sgd_element(optim_kernel::load(grad, i), main[i], momentum[i], s);
    momentum[i] = e.momentum;
    main[i] = e.main;
    optim_kernel::store(param, i, e.main);
  }
}

// Dispatches a kernel template over the (grad, param) element types.
template <template <typename, typename> class Launch, typename... Args>
void dispatch(const void* grad, GradKind gk, void* param, ParamKind pk, Args&&... args) {
  auto with_grad = [&](auto* g) {
    using G = std::remove_pointer_t<decltype(g)>;
    if (pk == ParamKind::kF32) Launch<G, float>{}(g, static_cast<float*>(param), args...);
    else if (pk == ParamKind::kBF16) Launch<G, bf16_bits>{}(g, static_cast<bf16_bits*>(param), args...);
    else Launch<G, NoStage>{}(g, static_cast<NoStage*>(nullptr), args...);
  };
  if (gk == GradKind::kF32) with_grad(static_cast<const float*>(grad));
  else with_grad(static_cast<const bf16_bits*>(grad));
}

template <typename G, typename P>
struct AdamLaunch {
  void operator()(const G* g, P* p, float* main, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamScalars& s,
                  cudaStream_t stream) const {
    constexpr int param_bytes = std::is_same_v<P, NoStage> ? 0 : static_cast<int>(sizeof(P));
    if (wide::adamw_wide_fits(g, sizeof(G), main, exp_avg, exp_avg_sq, p, param_bytes)) {
      const int64_t groups = n / wide::kAdamGroup, tail = n % wide::kAdamGroup;
      adamw_wide_kernel<<<elementwise_blocks(groups > tail ? groups : tail), kElementwiseThreads, 0, stream>>>(
          g, main, exp_avg, exp_avg_sq, p, n, s);
    } else {
      adamw_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(g, main, exp_avg, exp_avg_sq, p, n, s);
    }
  }
};
template <typename G, typename P>
struct SgdLaunch {
  void operator()(const G* g, P* p, float* main, float* momentum, int64_t n, const SgdScalars& s, cudaStream_t stream) const {
    sgd_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(g, main, momentum, p, n, s);
  }
};

constexpr int kSumThreads = 256;

// A fixed tree over the block's kSumThreads values in shared memory; the sum ends in part[0].
__device__ void block_tree_sum(double* part) {
  for (int half = kSumThreads / 2; half > 0; half /= 2) {
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < half) part[threadIdx.x] += part[threadIdx.x + half];
  }
  __syncthreads();
}

template <typename G>
__global__ void sum_of_squares_partials(const G* __restrict__ grad, int64_t n, double* __restrict__ partials) {
  __shared__ double part[kSumThreads];
  const int64_t chunk = (n + kSumBlocks - 1) / kSumBlocks;
  const int64_t begin = blockIdx.x * chunk, end = begin + chunk < n ? begin + chunk : n;
  double acc = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kSumThreads) {
    const double g = optim_kernel::load(grad, i);
    acc += g * g;
  }
  part[threadIdx.x] = acc;
  block_tree_sum(part);
  if (threadIdx.x == 0) partials[blockIdx.x] = part[0];
}

__global__ void sum_partials(const double* __restrict__ partials, double* __restrict__ out) {
  __shared__ double part[kSumThreads];
  double acc = 0.0;
  for (int b = threadIdx.x; b < kSumBlocks; b += kSumThreads) acc += partials[b];
  part[threadIdx.x] = acc;
  block_tree_sum(part);
  if (threadIdx.x == 0) *out = part[0];
}

}  // namespace

int launch_adamw(const void* grad, GradKind grad_kind, float* main, float* exp_avg, float* exp_avg_sq, void* param,
                 ParamKind param_kind, int64_t n, const AdamScalars& scalars, CUstream_st* stream) {
  if (n == 0) return cudaSuccess;
  dispatch<AdamLaunch>(grad, grad_kind, param, param_kind, main, exp_avg, exp_avg_sq, n, scalars, stream);
  return cudaGetLastError();
}

int launch_sgd(const void* grad, GradKind grad_kind, float* main, float* momentum, void* param, ParamKind param_kind,
               int64_t n, const SgdScalars& scalars, CUstream_st* stream) {
  if (n == 0) return cudaSuccess;
  dispatch<SgdLaunch>(grad, grad_kind, param, param_kind, main, momentum, n, scalars, stream);
  return cudaGetLastError();
}

int launch_sum_of_squares(const void* grad, GradKind grad_kind, int64_t n, double* out, CUstream_st* stream) {
  if (grad_kind == GradKind::kF32)
    sum_of_squares_partials<<<kSumBlocks, kSumThreads, 0, stream>>>(static_cast<const float*>(grad), n, out + 1);
  else
    sum_of_squares_partials<<<kSumBlocks, kSumThreads, 0, stream>>>(static_cast<const bf16_bits*>(grad), n, out + 1);
  sum_partials<<<1, kSumThreads, 0, stream>>>(out + 1, out);
  return cudaGetLastError();
}

}  // namespace mxddp::cuda_kernels
