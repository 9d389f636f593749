// The one table of the HF GPT-2 interop: which GPT2LMHeadModel tensor each of mxddp's GPT params
// is (gpt_param_specs order), and whether its layout is the transpose (HF's Conv1D stores a linear
// weight [in, out]; mxddp's is [out, in]). Import and export both read it, so they cannot drift.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <mxddp/model.h>

namespace mxddp::hf {

inline constexpr double kLayerNormEps = 1e-5;  // mxddp's LayerNorm (src/model/row_kernels.h)
inline constexpr std::string_view kPrefix = "transformer.";  // GPT2LMHeadModel's body

struct Gpt2Tensor {
  std::string name;        // without kPrefix: "h.0.attn.c_attn.weight"
  bool transposed = false; // HF's [in, out] for mxddp's [out, in]
};

// One per param of gpt_param_specs(config), in that order.
inline std::vector<Gpt2Tensor> gpt2_tensors(const GptConfig& config) {
  std::vector<Gpt2Tensor> out = {{"wte.weight"}, {"wpe.weight"}};
  // LayerParam's order: ln1, qkv, proj, ln2, fc1, fc2, each weight then bias.
  static constexpr const char* kLayer[kLayerParamCount] = {"ln_1.weight",      "ln_1.bias",       "attn.c_attn.weight",
                                                           "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
                                                           "ln_2.weight",      "ln_2.bias",       "mlp.c_fc.weight",
                                                           "mlp.c_fc.bias",    "mlp.c_proj.weight", "mlp.c_proj.bias"};
  for (int l = 0; l < config.num_layers; ++l)
    for (int k = 0; k < kLayerParamCount; ++k) {
      const std::string_view name = kLayer[k];
      const bool linear_weight = name.ends_with(".weight") && !name.starts_with("ln_");
      out.push_back({"h." + std::to_string(l) + "." + std::string(name), linear_weight});
    }
  out.push_back({"ln_f.weight"});
  out.push_back({"ln_f.bias"});
  return out;
}

// GELU's tanh approximation under the names transformers gives it (activations.py): gelu_new,
// gelu_pytorch_tanh, gelu_python_tanh and gelu_fast compute 0.5 x (1 + tanh(sqrt(2/pi) (x +
// 0.044715 x^3))), mxddp's GELU; "gelu" is the exact erf form.
inline bool is_tanh_gelu(std::string_view name) {
  return name == "gelu_new" || name == "gelu_pytorch_tanh" || name == "gelu_python_tanh" || name == "gelu_fast";
}

// [rows, cols] -> [cols, rows], row-major.
inline std::vector<float> transpose(const std::vector<float>& in, int64_t rows, int64_t cols) {
  std::vector<float> out(in.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[static_cast<size_t>(c * rows + r)] = in[static_cast<size_t>(r * cols + c)];
  return out;
}

}  // namespace mxddp::hf
