// ModelParamStore: the model's own copies of its params when the param buffer only stages their
// all-gathers (fp8_param_gather): an Mxfp8Tensor (row- and column-wise) for each param marked
// mxfp8, a BF16 copy for the rest. After a gather lands in the param buffer, store_from() moves a
// param out of it. Without fp8_param_gather there is no store: the model reads the param buffer.
#pragma once

#include <memory>
#include <vector>

#include <mxddp/buffer.h>
#include <mxddp/quant.h>

namespace mxddp {

class ModelParamStore {
 public:
  // Allocates each param's copy and fills it from `buffer`'s param buffer (the initial params).
  ModelParamStore(const ParamAndGradBuffer& buffer, Fp8Format elem, ScaleMode scale_mode, MemoryTracker& tracker);

  bool is_mxfp8(int param) const { return mxfp8_[static_cast<size_t>(param)] != nullptr; }
  TensorView bf16(int param) const;  // [param shape] bf16; throws for an MXFP8 param
  const Mxfp8Tensor& mxfp8(int param) const;
  // Quantizes (MXFP8) or copies (BF16) the param's gathered values into its copy.
  void store_from(int param, const TensorView& gathered);

 private:
  const std::vector<ParamSpec>& specs_;
  std::vector<std::unique_ptr<Mxfp8Tensor>> mxfp8_;  // [num params], null for a BF16 param
  std::vector<HostBuffer> bf16_;                      // [num params], empty for an MXFP8 param
};

}  // namespace mxddp
