// DLPack views of mxddp's buffers and TensorViews of the caller's arrays (see views.h).
#include "views.h"

namespace nb = nanobind;

namespace mxddp::python {
namespace {

nb::dlpack::dtype dlpack_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32: return nb::dtype<float>();
    case DType::kU8: return nb::dtype<uint8_t>();  // MXFP8 data and scales, as bytes
    case DType::kBF16:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    default: MXDDP_FAIL("no torch view for dtype {}; the package hands out f32, bf16 and u8", dtype_name(dtype));
  }
}

}  // namespace

TorchView to_torch(const TensorView& view, nb::handle owner) {
  std::vector<size_t> shape;
  for (int i = 0; i < view.shape.ndim(); ++i) shape.push_back(static_cast<size_t>(view.shape[i]));
  const bool cpu = view.device.is_cpu();
  return TorchView(view.data, shape.size(), shape.data(), owner, nullptr, dlpack_dtype(view.dtype),
                   cpu ? nb::device::cpu::value : nb::device::cuda::value, cpu ? 0 : view.device.index);
}

Shape to_shape(const std::vector<int64_t>& d, const std::string& what) {
  MXDDP_CHECK(d.size() <= static_cast<size_t>(Shape::kMaxDims), "{} has {} dimensions; mxddp takes at most {}", what,
              d.size(), Shape::kMaxDims);
  return Shape(d);
}

namespace {

// The view of a C-contiguous f32 or bf16 array on `device`.
template <typename Array>
TensorView param_view(const Array& array, Device device, const std::string& what) {
  DType dtype;
  if (array.dtype() == nb::dtype<float>()) {
    dtype = DType::kF32;
  } else if (array.dtype() == nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1}) {
    dtype = DType::kBF16;
  } else {
    MXDDP_FAIL("{}: dtype (DLPack code {}, {} bits) is not taken; valid: float32, bfloat16", what,
               static_cast<int>(array.dtype().code), static_cast<int>(array.dtype().bits));
  }
  std::vector<int64_t> dims;
  for (size_t i = 0; i < array.ndim(); ++i) dims.push_back(static_cast<int64_t>(array.shape(i)));
  return TensorView{array.data(), dtype, to_shape(dims, what), device};
}

}  // namespace

TensorView from_array(const HostArray& array, const std::string& what) {
  return param_view(array, Device::cpu(), what);
}

TensorView from_any_array(const AnyArray& array, const std::string& what) {
  if (array.device_type() == nb::device::cpu::value) return param_view(array, Device::cpu(), what);
  MXDDP_CHECK(array.device_type() == nb::device::cuda::value,
              "{}: DLPack device type {} is not taken; valid: the CPU ({}), CUDA ({})", what, array.device_type(),
              nb::device::cpu::value, nb::device::cuda::value);
  return param_view(array, Device::cuda(array.device_id()), what);
}

DType parse_param_dtype(const std::string& name) {
  if (name == "f32" || name == "float32") return DType::kF32;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  MXDDP_FAIL("param dtype '{}' is not taken; valid: float32, bfloat16", name);
}

std::vector<TensorView> to_views(const std::vector<HostArray>& arrays) {
  std::vector<TensorView> views;
  for (size_t i = 0; i < arrays.size(); ++i) views.push_back(from_array(arrays[i], "initial value " + std::to_string(i)));
  return views;
}

}  // namespace mxddp::python
