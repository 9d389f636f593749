// Tensors across the Python boundary, by DLPack and without copies: an mxddp TensorView (host or
// device memory) handed out as a torch tensor that views the same bytes on the same device (and
// keeps their owner alive), and a caller's contiguous CPU array taken as a TensorView.
#pragma once

#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <mxddp/core.h>

namespace mxddp::python {

using TorchView = nanobind::ndarray<nanobind::pytorch>;  // on the view's device (CPU or CUDA)
using HostArray = nanobind::ndarray<nanobind::device::cpu, nanobind::c_contig>;
using AnyArray = nanobind::ndarray<nanobind::c_contig>;  // on the CPU or a CUDA device

// A torch tensor over view's bytes (f32, bf16, or u8: MXFP8's bytes) on view's device; `owner` is kept alive as long
// as the tensor.
TorchView to_torch(const TensorView& view, nanobind::handle owner);
// The array as a view (f32 or bf16, C-contiguous, on the CPU); `what` names it in errors.
TensorView from_array(const HostArray& array, const std::string& what);
// As from_array, on the array's device (the CPU or a CUDA device; any other is an Error).
TensorView from_any_array(const AnyArray& array, const std::string& what);
// Each array as from_array, named "initial value <i>" in errors.
std::vector<TensorView> to_views(const std::vector<HostArray>& arrays);
// A Shape from a dimension list (at most Shape::kMaxDims); `what` names it in errors.
Shape to_shape(const std::vector<int64_t>& dims, const std::string& what);
// "f32" / "float32" -> kF32, "bf16" / "bfloat16" -> kBF16; anything else is an Error.
DType parse_param_dtype(const std::string& name);

}  // namespace mxddp::python
