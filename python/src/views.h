// Tensors across the Python boundary, by DLPack and without copies: an mxddp TensorView handed out
// as a torch tensor that views the same bytes (and keeps their owner alive), and a caller's
// contiguous CPU array taken as a TensorView.
#pragma once

#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <mxddp/core.h>

namespace mxddp::python {

using TorchView = nanobind::ndarray<nanobind::pytorch, nanobind::device::cpu>;
using HostArray = nanobind::ndarray<nanobind::device::cpu, nanobind::c_contig>;

// A torch tensor over view's bytes (f32 or bf16); `owner` is kept alive as long as the tensor.
TorchView to_torch(const TensorView& view, nanobind::handle owner);
// The array as a view (f32 or bf16, C-contiguous, on the CPU); `what` names it in errors.
TensorView from_array(const HostArray& array, const std::string& what);
// Each array as from_array, named "initial value <i>" in errors.
std::vector<TensorView> to_views(const std::vector<HostArray>& arrays);
// A Shape from a dimension list (at most Shape::kMaxDims); `what` names it in errors.
Shape to_shape(const std::vector<int64_t>& dims, const std::string& what);
// "f32" / "float32" -> kF32, "bf16" / "bfloat16" -> kBF16; anything else is an Error.
DType parse_param_dtype(const std::string& name);

}  // namespace mxddp::python
