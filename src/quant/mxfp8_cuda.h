// The MXFP8 kernels' launchers (mxfp8_cuda.cu), beside their CPU reference (mxfp8.cc's
// mx_quantize / mx_dequantize / mx_shard_scales / mx_shard_encode; both use fp8_element.h's
// arithmetic). They return the launch's cudaError_t as an int; cuda.h's entry points of the same
// names (cuda_mx_quantize, ...) check the views and throw.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace mxddp::cuda_kernels {

struct MxShape {
  int64_t rows = 0, cols = 0;  // the [rows, cols] tensor
  bool e4m3 = true;            // else E5M2
  bool rceil = true;           // else floor
  bool colwise = false;        // blocks of 32 rows of a column, else 32 columns of a row
};

// in: [rows, cols] f32 (or bf16 when in_bf16); data: [rows, cols] u8; scales: mx_scale_shape's u8.
int launch_mx_quantize(const void* in, bool in_bf16, uint8_t* data, uint8_t* scales, const MxShape& shape,
                       CUstream_st* stream);
// out: [rows, cols] f32 (or bf16 when out_bf16).
int launch_mx_dequantize(const uint8_t* data, const uint8_t* scales, void* out, bool out_bf16, const MxShape& shape,
                         CUstream_st* stream);

// The shard codec (mxfp8.cc's mx_shard_scales / mx_shard_encode): shard is the flat elements
// [offset, offset + n) of the [rows, cols] tensor, f32 (or bf16 when shard_bf16).
// scales: the whole tensor's mx_scale_shape u8, every entry written (0 where the shard has none).
int launch_mx_shard_scales(const void* shard, bool shard_bf16, int64_t offset, int64_t n, uint8_t* scales,
                           const MxShape& shape, CUstream_st* stream);
// scales: the whole tensor's (in); data: [n] u8 (out).
int launch_mx_shard_encode(const void* shard, bool shard_bf16, int64_t offset, int64_t n, const uint8_t* scales,
                           uint8_t* data, const MxShape& shape, CUstream_st* stream);

}  // namespace mxddp::cuda_kernels
