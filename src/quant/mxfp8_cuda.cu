// MXFP8 quantize and dequantize on the device, bit-exact with mxfp8.cc (the same fp8_element.h
// arithmetic, no fused multiply-adds). Reference and check: mx_quantize / mx_dequantize,
// tests/cuda/kernels_test.cc.
//
// Row-wise: one warp per 32-element block of a row (lane k holds element k): the amax is a warp
// max over |x|'s bits (NaN and Inf sort above every finite value, as on the CPU), lane 0's scale is
// shuffled to all, and each lane writes its byte, so loads and stores are coalesced.
// Column-wise: one thread per column of a 32-row band keeps the block's 32 values in registers:
// a max, then the encode; neighbouring threads touch neighbouring columns, so both coalesce.
// These element kernels serve what the wide ones (mxfp8_wide_cuda.cu) do not take: columns not a
// multiple of 32 (8 column-wise), or views not aligned for 16-byte loads.
// The shard codec (FSDP's MXFP8 shards): a thread per block for the scales, per element for the
// encode; reference and check: mx_shard_scales / mx_shard_encode, tests/compute/compute_test.cc.
#include <cuda_runtime.h>

#include "cuda/launch_shape.h"
#include "fp8_element.h"
#include "mxfp8_cuda.h"
#include "mxfp8_wide_cuda.h"

namespace mxddp::cuda_kernels {
namespace {

constexpr int kBlock = fp8::kMxBlock;
using fp8::abs_bits;
using fp8::amax_from_bits;

__device__ inline float load_value(const float* p, int64_t i) { return p[i]; }
__device__ inline float load_value(const bf16_bits* p, int64_t i) { return bf16_to_f32(p[i]); }

template <typename T>
__global__ void quantize_rows_kernel(const T* __restrict__ in, uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
                                     MxShape s) {
  const int64_t blocks_per_row = (s.cols + kBlock - 1) / kBlock;
  const int64_t total = s.rows * blocks_per_row;
  const int lane = threadIdx.x % kBlock;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / kBlock);
  const fp8::Spec spec = fp8::spec_of(s.e4m3);
  for (int64_t b = blockIdx.x * int64_t{blockDim.x / kBlock} + threadIdx.x / kBlock; b < total; b += warps) {
    const int64_t r = b / blocks_per_row, c = (b % blocks_per_row) * kBlock + lane;
    const bool inside = c < s.cols;
    const float x = inside ? load_value(in, r * s.cols + c) : 0.0f;
    const uint32_t amax = __reduce_max_sync(0xffffffffu, abs_bits(x));
    const uint8_t scale = fp8::scale_for_amax(amax_from_bits(amax), spec, s.rceil);
    if (lane == 0) scales[b] = scale;
    if (inside) data[r * s.cols + c] = scale == fp8::kE8M0NanCode ? 0 : fp8::encode(x * fp8::e8m0_inverse(scale), spec);
  }
}

template <typename T>
__global__ void quantize_cols_kernel(const T* __restrict__ in, uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
                                     MxShape s) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= s.cols) return;
  const fp8::Spec spec = fp8::spec_of(s.e4m3);
  const int64_t bands = (s.rows + kBlock - 1) / kBlock;
  for (int64_t band = blockIdx.y; band < bands; band += gridDim.y) {
    const int64_t r0 = band * kBlock;
    const int n = static_cast<int>(s.rows - r0 < kBlock ? s.rows - r0 : kBlock);
    float x[kBlock];
    uint32_t amax = 0;
#pragma unroll
    for (int k = 0; k < kBlock; ++k) {
      x[k] = k < n ? load_value(in, (r0 + k) * s.cols + c) : 0.0f;
      amax = max(amax, abs_bits(x[k]));
    }
    const uint8_t scale = fp8::scale_for_amax(amax_from_bits(amax), spec, s.rceil);
    scales[band * s.cols + c] = scale;
    const bool nan_block = scale == fp8::kE8M0NanCode;
    const float inv = nan_block ? 0.0f : fp8::e8m0_inverse(scale);
#pragma unroll
    for (int k = 0; k < kBlock; ++k)
      if (k < n) data[(r0 + k) * s.cols + c] = nan_block ? 0 : fp8::encode(x[k] * inv, spec);
  }
}

__device__ inline void store_value(float* p, int64_t i, float v) { p[i] = v; }
__device__ inline void store_value(bf16_bits* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

template <typename T>
__global__ void dequantize_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales, T* __restrict__ out,
                                  MxShape s) {
  const fp8::Spec spec = fp8::spec_of(s.e4m3);
  const int64_t n = s.rows * s.cols, blocks_per_row = (s.cols + kBlock - 1) / kBlock;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / s.cols, c = i % s.cols;
    const uint8_t scale = s.colwise ? scales[(r / kBlock) * s.cols + c] : scales[r * blocks_per_row + c / kBlock];
    store_value(out, i, fp8::decode(data[i], spec) * fp8::e8m0_value(scale));
  }
}

// The shard codec. Scales: a thread per block of the whole tensor takes the amax of the shard's
// elements in it (at most 32: a row block's are contiguous, a column block's a column's 32 rows),
// 0 where it has none, which gives scale 0 as the CPU's zero-initialized amax does.
template <typename T>
__global__ void shard_scales_kernel(const T* __restrict__ shard, int64_t offset, int64_t n, uint8_t* __restrict__ scales,
                                    MxShape s) {
  const fp8::Spec spec = fp8::spec_of(s.e4m3);
  const int64_t blocks_per_row = (s.cols + kBlock - 1) / kBlock;
  const int64_t total = s.colwise ? ((s.rows + kBlock - 1) / kBlock) * s.cols : s.rows * blocks_per_row;
  const int64_t end = offset + n;
  for (int64_t b = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; b < total; b += int64_t{gridDim.x} * blockDim.x) {
    uint32_t amax = 0;
    if (!s.colwise) {
      const int64_t r = b / blocks_per_row, c0 = (b % blocks_per_row) * kBlock;
      const int64_t first = r * s.cols + c0, last = r * s.cols + (c0 + kBlock < s.cols ? c0 + kBlock : s.cols);
      for (int64_t i = first > offset ? first : offset; i < (last < end ? last : end); ++i)
        amax = max(amax, abs_bits(load_value(shard, i - offset)));
    } else {
      // Only the rows the shard reaches: [offset / cols, (end - 1) / cols].
      const int64_t r0 = (b / s.cols) * kBlock, c = b % s.cols;
      const int64_t r_first = offset / s.cols, r_last = n > 0 ? (end - 1) / s.cols : -1;
      for (int64_t r = r0 > r_first ? r0 : r_first; r < r0 + kBlock && r < s.rows && r <= r_last; ++r) {
        const int64_t i = r * s.cols + c;
        if (i >= offset && i < end) amax = max(amax, abs_bits(load_value(shard, i - offset)));
      }
    }
    scales[b] = fp8::scale_for_amax(amax_from_bits(amax), spec, s.rceil);
  }
}

// Encode: a thread per shard element, with its block's scale of the whole tensor; a NaN-scaled
// block stores zeros, as mx_quantize does.
template <typename T>
__global__ void shard_encode_kernel(const T* __restrict__ shard, int64_t offset, int64_t n,
                                    const uint8_t* __restrict__ scales, uint8_t* __restrict__ data, MxShape s) {
  const fp8::Spec spec = fp8::spec_of(s.e4m3);
  const int64_t blocks_per_row = (s.cols + kBlock - 1) / kBlock;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t at = offset + i, r = at / s.cols, c = at % s.cols;
    const uint8_t scale = s.colwise ? scales[(r / kBlock) * s.cols + c] : scales[r * blocks_per_row + c / kBlock];
    data[i] = scale == fp8::kE8M0NanCode ? 0 : fp8::encode(load_value(shard, i) * fp8::e8m0_inverse(scale), spec);
  }
}

}  // namespace

int launch_mx_shard_scales(const void* shard, bool shard_bf16, int64_t offset, int64_t n, uint8_t* scales,
                           const MxShape& s, CUstream_st* stream) {
  if (s.rows == 0 || s.cols == 0) return cudaSuccess;
  const int64_t total = s.colwise ? ((s.rows + kBlock - 1) / kBlock) * s.cols : s.rows * ((s.cols + kBlock - 1) / kBlock);
  const unsigned grid = elementwise_blocks(total);
  if (shard_bf16)
    shard_scales_kernel<<<grid, kElementwiseThreads, 0, stream>>>(static_cast<const bf16_bits*>(shard), offset, n, scales, s);
  else shard_scales_kernel<<<grid, kElementwiseThreads, 0, stream>>>(static_cast<const float*>(shard), offset, n, scales, s);
  return cudaGetLastError();
}

int launch_mx_shard_encode(const void* shard, bool shard_bf16, int64_t offset, int64_t n, const uint8_t* scales,
                           uint8_t* data, const MxShape& s, CUstream_st* stream) {
  if (n == 0) return cudaSuccess;
  const unsigned grid = elementwise_blocks(n);
  if (shard_bf16)
    shard_encode_kernel<<<grid, kElementwiseThreads, 0, stream>>>(static_cast<const bf16_bits*>(shard), offset, n, scales, data, s);
  else shard_encode_kernel<<<grid, kElementwiseThreads, 0, stream>>>(static_cast<const float*>(shard), offset, n, scales, data, s);
  return cudaGetLastError();
}

int launch_mx_quantize(const void* in, bool in_bf16, uint8_t* data, uint8_t* scales, const MxShape& s,
                       CUstream_st* stream) {
  if (s.rows == 0 || s.cols == 0) return cudaSuccess;
  if (mx_wide_quantize_fits(in, data, s)) {
    launch_mx_quantize_wide(in, in_bf16, data, scales, s, stream);
  } else if (!s.colwise) {
    const int64_t blocks = s.rows * ((s.cols + kBlock - 1) / kBlock);
    const unsigned grid = elementwise_blocks(blocks * kBlock);
    if (in_bf16) quantize_rows_kernel<<<grid, kElementwiseThreads, 0, stream>>>(static_cast<const bf16_bits*>(in), data, scales, s);
    else quantize_rows_kernel<<<grid, kElementwiseThreads, 0, stream>>>(static_cast<const float*>(in), data, scales, s);
  } else {
    const int64_t bands = (s.rows + kBlock - 1) / kBlock;
    const dim3 grid(static_cast<unsigned>((s.cols + kElementwiseThreads - 1) / kElementwiseThreads),
                    static_cast<unsigned>(bands < 65535 ? bands : 65535));
    if (in_bf16) quantize_cols_kernel<<<grid, kElementwiseThreads, 0, stream>>>(static_cast<const bf16_bits*>(in), data, scales, s);
    else quantize_cols_kernel<<<grid, kElementwiseThreads, 0, stream>>>(static_cast<const float*>(in), data, scales, s);
  }
  return cudaGetLastError();
}

int launch_mx_dequantize(const uint8_t* data, const uint8_t* scales, void* out, bool out_bf16, const MxShape& s,
                         CUstream_st* stream) {
  if (s.rows == 0 || s.cols == 0) return cudaSuccess;
  if (mx_wide_dequantize_fits(data, scales, out, s)) {
    launch_mx_dequantize_wide(data, scales, out, out_bf16, s, stream);
    return cudaGetLastError();
  }
  const unsigned grid = elementwise_blocks(s.rows * s.cols);
  if (out_bf16) dequantize_kernel<<<grid, kElementwiseThreads, 0, stream>>>(data, scales, static_cast<bf16_bits*>(out), s);
  else dequantize_kernel<<<grid, kElementwiseThreads, 0, stream>>>(data, scales, static_cast<float*>(out), s);
  return cudaGetLastError();
}

}  // namespace mxddp::cuda_kernels
