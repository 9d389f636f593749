// The wide MXFP8 kernels' launchers (mxfp8_wide_cuda.cu), which mxfp8_cuda.cu's launch_mx_quantize
// and launch_mx_dequantize take when the tensor fits them (mxfp8_wide.h says what fits and why).
#pragma once

#include <cstdint>

#include "mxfp8_cuda.h"

namespace mxddp::cuda_kernels {

// in: [rows, cols] f32 or bf16; data: [rows, cols] u8; scales: mx_scale_shape's u8.
bool mx_wide_quantize_fits(const void* in, const uint8_t* data, const MxShape& shape);
bool mx_wide_dequantize_fits(const uint8_t* data, const uint8_t* scales, const void* out, const MxShape& shape);
// Launch only what *_fits accepted; the launch's error is the caller's to read.
void launch_mx_quantize_wide(const void* in, bool in_bf16, uint8_t* data, uint8_t* scales, const MxShape& shape,
                             CUstream_st* stream);
void launch_mx_dequantize_wide(const uint8_t* data, const uint8_t* scales, void* out, bool out_bf16,
                               const MxShape& shape, CUstream_st* stream);

}  // namespace mxddp::cuda_kernels
