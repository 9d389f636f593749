// ModelParamStore: see model_params.h.
#include "model_params.h"

namespace mxddp {

ModelParamStore::ModelParamStore(const ParamAndGradBuffer& buffer, Fp8Format elem, ScaleMode scale_mode,
                                 MemoryTracker& tracker)
    : specs_(buffer.params()), compute_(buffer.compute()), options_{.elem = elem, .scale_mode = scale_mode} {
  mxfp8_.resize(specs_.size());
  bf16_.resize(specs_.size());
  for (size_t p = 0; p < specs_.size(); ++p) {
    const ParamSpec& spec = specs_[p];
    if (spec.mxfp8) {
      // Every MXFP8 byte is charged as kMxfp8, as quant.h's Mxfp8Tensor charges its own.
      const auto numel = static_cast<size_t>(spec.shape.numel());
      for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) {
        const Shape scales = mx_scale_shape(spec.shape[0], spec.shape[1], axis);
        Mxfp8Blocks& blocks = mxfp8_[p][static_cast<size_t>(axis)];
        blocks.data = compute_.allocate(numel, MemoryCategory::kMxfp8, tracker);
        blocks.scales = compute_.allocate(static_cast<size_t>(scales.numel()), MemoryCategory::kMxfp8, tracker);
      }
    } else {
      bf16_[p] = compute_.allocate(static_cast<size_t>(spec.shape.numel()) * 2, MemoryCategory::kParams, tracker);
    }
    store_from(static_cast<int>(p), buffer.param_data(static_cast<int>(p)));
  }
}

TensorView ModelParamStore::bf16(int param) const {
  const ParamSpec& spec = specs_.at(static_cast<size_t>(param));
  MXDDP_CHECK(!spec.mxfp8, "param '{}' is kept as MXFP8: read it with mxfp8_param({})", spec.name, param);
  return bf16_[static_cast<size_t>(param)].view(DType::kBF16, spec.shape);
}

Mxfp8View ModelParamStore::mxfp8(int param, QuantAxis axis) const {
  const ParamSpec& spec = specs_.at(static_cast<size_t>(param));
  MXDDP_CHECK(spec.mxfp8, "param '{}' is not an MXFP8 param (mark it mxfp8 and turn on fp8_param_gather)", spec.name);
  const Mxfp8Blocks& blocks = mxfp8_[static_cast<size_t>(param)][static_cast<size_t>(axis)];
  QuantizeOptions options = options_;
  options.axis = axis;
  return {.data = blocks.data.view(DType::kU8, spec.shape),
          .scales = blocks.scales.view(DType::kU8, mx_scale_shape(spec.shape[0], spec.shape[1], axis)),
          .options = options};
}

void ModelParamStore::store_from(int param, const TensorView& gathered) {
  if (!is_mxfp8(param)) {
    compute_.copy(bf16_[static_cast<size_t>(param)].data(), gathered.data, gathered.nbytes());
    return;
  }
  for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) compute_.mx_quantize(gathered, mxfp8(param, axis));
}

}  // namespace mxddp
