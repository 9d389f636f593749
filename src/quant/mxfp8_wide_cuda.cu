// The wide MXFP8 quantize and dequantize kernels: mxfp8_wide.h's per-thread work, launched. The
// launchers in mxfp8_cuda.cu take them whenever wide::quantize_fits / dequantize_fits hold (the
// common case: weight matrices whose columns are a multiple of 32, on allocator-aligned storage)
// and the element kernels otherwise. Reference and check: mx_quantize / mx_dequantize, on the
// device in tests/cuda/kernels_test.cc, and thread by thread on the host in
// tests/cuda/wide_kernels_host_test.cc.
#include <cuda_runtime.h>

#include "cuda/launch_shape.h"
#include "mxfp8_wide.h"
#include "mxfp8_wide_cuda.h"

namespace mxddp::cuda_kernels {
namespace {

using namespace wide;

// Grid-stride over groups in whole warps (the stride is a multiple of 32), so every lane of a warp
// takes part in each shuffle; groups % 4 == 0, so a block's four lanes are in or out together.
template <typename T, bool E4M3>
__global__ void quantize_rows_wide_kernel(const T* __restrict__ in, uint8_t* __restrict__ data,
                                          uint8_t* __restrict__ scales, int64_t groups, bool rceil) {
  const int lane = threadIdx.x % 32;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t g0 = blockIdx.x * int64_t{blockDim.x} + threadIdx.x - lane; g0 < groups; g0 += stride) {
    const int64_t g = g0 + lane;
    const bool inside = g < groups;
    float v[kRowGroup];
    uint32_t amax = inside ? row_group_load(in, g, v) : 0u;
    amax = max_bits(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = max_bits(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    if (inside) row_group_store<E4M3>(v, amax, g, rceil, data, scales);
  }
}

// One thread block per (64-column tile, band); bands beyond the grid's y limit loop. Every thread
// stays to the end: the shuffles and barriers need them all.
template <typename T, bool E4M3>
__global__ void __launch_bounds__(kTileThreads)
    quantize_cols_wide_kernel(const T* __restrict__ in, uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
                              int64_t rows, int64_t cols, bool rceil) {
  __shared__ ColTile tile;
  const int t = threadIdx.x;
  const int64_t c0 = int64_t{blockIdx.x} * kTileCols, bands = (rows + kBlock - 1) / kBlock;
  for (int64_t band = blockIdx.y; band < bands; band += gridDim.y) {
    const int64_t r0 = band * kBlock;
    col_tile_load(in, rows, cols, r0, c0, t, tile);
    __syncthreads();
    uint32_t amax = col_tile_partial_amax(tile, t);
    amax = max_bits(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = max_bits(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    if (t % 4 == 0) col_tile_scale<E4M3>(amax, cols, band, c0, t, rceil, scales, tile);
    __syncthreads();
    col_tile_store<E4M3>(tile, rows, cols, r0, c0, t, data);
    __syncthreads();  // the next band's loads overwrite the tile
  }
}

template <typename T>
__global__ void __launch_bounds__(256)
    dequantize_wide_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales, T* __restrict__ out,
                           int64_t groups, int64_t cols, bool colwise, bool e4m3) {
  __shared__ float table[256];  // every code's value: 16 lookups per thread instead of 16 decodes
  table[threadIdx.x] = fp8::decode(static_cast<uint8_t>(threadIdx.x), fp8::spec_of(e4m3));
  __syncthreads();
  for (int64_t g = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; g < groups; g += int64_t{gridDim.x} * blockDim.x)
    dequantize_group(data, scales, table, cols, colwise, g, out);
}

template <typename T>
void quantize_typed(const T* in, uint8_t* data, uint8_t* scales, const MxShape& s, cudaStream_t stream) {
  if (!s.colwise) {
    const int64_t groups = s.rows * s.cols / kRowGroup;
    const unsigned grid = elementwise_blocks(groups);
    if (s.e4m3) quantize_rows_wide_kernel<T, true><<<grid, kElementwiseThreads, 0, stream>>>(in, data, scales, groups, s.rceil);
    else quantize_rows_wide_kernel<T, false><<<grid, kElementwiseThreads, 0, stream>>>(in, data, scales, groups, s.rceil);
  } else {
    const int64_t bands = (s.rows + kBlock - 1) / kBlock;
    const dim3 grid(static_cast<unsigned>((s.cols + kTileCols - 1) / kTileCols), static_cast<unsigned>(bands < 65535 ? bands : 65535));
    if (s.e4m3) quantize_cols_wide_kernel<T, true><<<grid, kTileThreads, 0, stream>>>(in, data, scales, s.rows, s.cols, s.rceil);
    else quantize_cols_wide_kernel<T, false><<<grid, kTileThreads, 0, stream>>>(in, data, scales, s.rows, s.cols, s.rceil);
  }
}

}  // namespace

bool mx_wide_quantize_fits(const void* in, const uint8_t* data, const MxShape& s) {
  // Column tiles index their grid's x by tile: at most 2^31 - 1 of them, far past any Shape here.
  return wide::quantize_fits(in, data, s.cols, s.colwise);
}

bool mx_wide_dequantize_fits(const uint8_t* data, const uint8_t* scales, const void* out, const MxShape& s) {
  return wide::dequantize_fits(data, scales, out, s.cols, s.colwise);
}

void launch_mx_quantize_wide(const void* in, bool in_bf16, uint8_t* data, uint8_t* scales, const MxShape& s,
                             CUstream_st* stream) {
  if (in_bf16) quantize_typed(static_cast<const bf16_bits*>(in), data, scales, s, stream);
  else quantize_typed(static_cast<const float*>(in), data, scales, s, stream);
}

void launch_mx_dequantize_wide(const uint8_t* data, const uint8_t* scales, void* out, bool out_bf16, const MxShape& s,
                               CUstream_st* stream) {
  const int64_t groups = s.rows * s.cols / kDecodeGroup;
  const unsigned grid = elementwise_blocks(groups);
  if (out_bf16)
    dequantize_wide_kernel<<<grid, 256, 0, stream>>>(data, scales, static_cast<bf16_bits*>(out), groups, s.cols, s.colwise, s.e4m3);
  else dequantize_wide_kernel<<<grid, 256, 0, stream>>>(data, scales, static_cast<float*>(out), groups, s.cols, s.colwise, s.e4m3);
}

}  // namespace mxddp::cuda_kernels
