// ModelParamStore: the model's own copies of its params when the param buffer only stages their
// all-gathers (fp8_param_gather): MXFP8 row- and column-wise data and scales for each param marked
// mxfp8, a BF16 copy for the rest. They live where the buffer's compute works (host memory or the
// rank's device) and are filled through it. After a gather lands in the param buffer, store_from()
// moves a param out of it. Without fp8_param_gather there is no store: the model reads the param
// buffer.
#pragma once

#include <array>
#include <vector>

#include <mxddp/buffer.h>
#include <mxddp/compute.h>
#include <mxddp/quant.h>

namespace mxddp {

class ModelParamStore {
 public:
  // Allocates each param's copy through buffer.compute() and fills it from the buffer's param
  // buffer (the initial params). The store must not outlive buffer.
  ModelParamStore(const ParamAndGradBuffer& buffer, Fp8Format elem, ScaleMode scale_mode, MemoryTracker& tracker);

  bool is_mxfp8(int param) const { return specs_.at(static_cast<size_t>(param)).mxfp8; }
  TensorView bf16(int param) const;  // [param shape] bf16; throws for an MXFP8 param
  Mxfp8View mxfp8(int param, QuantAxis axis) const;
  // Quantizes (MXFP8, both orientations) or copies (BF16) the param's gathered values into its copy.
  void store_from(int param, const TensorView& gathered);

 private:
  // One orientation's blocks: data u8 [M, N], scales u8 mx_scale_shape(M, N, axis).
  struct Mxfp8Blocks {
    ComputeBuffer data, scales;
  };
  const std::vector<ParamSpec>& specs_;
  Compute& compute_;
  QuantizeOptions options_;                        // axis set per orientation
  std::vector<std::array<Mxfp8Blocks, 2>> mxfp8_;  // [num params][row, col]; empty for a BF16 param
  std::vector<ComputeBuffer> bf16_;                // [num params]; empty for an MXFP8 param
};

}  // namespace mxddp
