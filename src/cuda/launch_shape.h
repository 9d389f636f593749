// Launch shapes the elementwise kernels share: 256 threads per block, enough blocks to fill an
// H100's 132 SMs several times over, with grid-stride loops covering the rest (so any n fits the
// grid's limits).
#pragma once

#include <cstdint>

namespace mxddp::cuda_kernels {

inline constexpr int kElementwiseThreads = 256;
inline constexpr int64_t kElementwiseBlocksMax = 132 * 8;

inline unsigned elementwise_blocks(int64_t n) {
  const int64_t blocks = (n + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<unsigned>(blocks < kElementwiseBlocksMax ? blocks : kElementwiseBlocksMax);
}

}  // namespace mxddp::cuda_kernels
