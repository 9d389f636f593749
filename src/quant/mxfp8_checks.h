// The MXFP8 codec's argument rules, shared by the CPU codec (mxfp8.cc) and the CUDA entry points
// (src/cuda/kernels.cc): values 2-D f32 or bf16, data u8 of the same shape, scales u8 of
// mx_scale_shape, and all three on the codec's kind of device. Throws an Error naming the op and
// the offending view.
#pragma once

#include <string_view>

#include <mxddp/quant.h>

namespace mxddp {

void check_mx_views(const TensorView& values, const TensorView& data, const TensorView& scales,
                    const QuantizeOptions& o, std::string_view op, Device::Kind device);

}  // namespace mxddp
