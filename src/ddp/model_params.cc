// ModelParamStore: see model_params.h.
#include "model_params.h"

#include <cstring>

namespace mxddp {

ModelParamStore::ModelParamStore(const ParamAndGradBuffer& buffer, Fp8Format elem, ScaleMode scale_mode,
                                 MemoryTracker& tracker)
    : specs_(buffer.params()) {
  mxfp8_.resize(specs_.size());
  bf16_.resize(specs_.size());
  for (size_t p = 0; p < specs_.size(); ++p) {
    const ParamSpec& spec = specs_[p];
    if (spec.mxfp8)
      mxfp8_[p] = std::make_unique<Mxfp8Tensor>(spec.shape[0], spec.shape[1], elem, scale_mode, tracker);
    else
      bf16_[p] = HostBuffer(static_cast<size_t>(spec.shape.numel()) * 2, MemoryCategory::kParams, tracker);
    store_from(static_cast<int>(p), buffer.param_data(static_cast<int>(p)));
  }
}

TensorView ModelParamStore::bf16(int param) const {
  const ParamSpec& spec = specs_.at(static_cast<size_t>(param));
  MXDDP_CHECK(!is_mxfp8(param), "param '{}' is kept as MXFP8: read it with mxfp8_param({})", spec.name, param);
  return bf16_[static_cast<size_t>(param)].view(DType::kBF16, spec.shape);
}

const Mxfp8Tensor& ModelParamStore::mxfp8(int param) const {
  MXDDP_CHECK(is_mxfp8(param), "param '{}' is not an MXFP8 param (mark it mxfp8 and turn on fp8_param_gather)",
              specs_.at(static_cast<size_t>(param)).name);
  return *mxfp8_[static_cast<size_t>(param)];
}

void ModelParamStore::store_from(int param, const TensorView& gathered) {
  const auto p = static_cast<size_t>(param);
  if (mxfp8_[p]) mxfp8_[p]->quantize_from(gathered);
  else std::memcpy(bf16_[p].data(), gathered.data, gathered.nbytes());
}

}  // namespace mxddp
