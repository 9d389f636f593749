// The MXFP8 codec's argument rules, shared by the CPU codec (mxfp8.cc), compute.h's entry points
// and the CUDA ones (src/cuda/kernels.cc): values 2-D f32 or bf16, data u8 of the same shape, scales u8 of
// mx_scale_shape, and all three on the codec's kind of device. Throws an Error naming the op and
// the offending view.
#pragma once

#include <string_view>

#include <mxddp/quant.h>

namespace mxddp {

void check_mx_views(const TensorView& values, const TensorView& data, const TensorView& scales,
                    const QuantizeOptions& o, std::string_view op, Device::Kind device);
// The shard codec's (mx_shard_scales, mx_shard_encode): the full shape 2-D, the shard f32 or bf16
// and inside it at offset, the scales u8 of mx_scale_shape's numel. Places are the caller's to check.
void check_mx_shard(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                    const QuantizeOptions& o, std::string_view op);

}  // namespace mxddp
