// The GPT-2 124M parameter list in a real model's registration order (wte, wpe, 12 blocks, ln_f;
// the LM head tied to wte, marked shared), for benchmarks that need a realistic param list.
#pragma once

#include <vector>

#include <mxddp/buffer.h>

namespace mxddp::bench {

// layers_in_backward_order: the registration indices of each layer's params, in the order backward
// finishes them (ln_f and the tied head first, the embeddings last).
inline std::vector<ParamSpec> gpt2_124m_params(std::vector<std::vector<int>>* layers_in_backward_order = nullptr) {
  const int64_t d = 768, vocab = 50257, ctx = 1024;
  std::vector<ParamSpec> p;
  auto add = [&](std::string name, Shape shape, bool shared = false) {
    p.push_back({std::move(name), shape, shared});
    return static_cast<int>(p.size() - 1);
  };
  std::vector<std::vector<int>> layers;  // forward order
  layers.push_back({add("wte", Shape{vocab, d}, true), add("wpe", Shape{ctx, d})});
  for (int l = 0; l < 12; ++l) {
    const std::string h = fmt::format("h.{}.", l);
    layers.push_back({add(h + "ln_1.weight", Shape{d}), add(h + "ln_1.bias", Shape{d}),
                      add(h + "attn.c_attn.weight", Shape{d, 3 * d}), add(h + "attn.c_attn.bias", Shape{3 * d}),
                      add(h + "attn.c_proj.weight", Shape{d, d}), add(h + "attn.c_proj.bias", Shape{d}),
                      add(h + "ln_2.weight", Shape{d}), add(h + "ln_2.bias", Shape{d}),
                      add(h + "mlp.c_fc.weight", Shape{d, 4 * d}), add(h + "mlp.c_fc.bias", Shape{4 * d}),
                      add(h + "mlp.c_proj.weight", Shape{4 * d, d}), add(h + "mlp.c_proj.bias", Shape{d})});
  }
  layers.push_back({add("ln_f.weight", Shape{d}), add("ln_f.bias", Shape{d})});
  if (layers_in_backward_order) layers_in_backward_order->assign(layers.rbegin(), layers.rend());
  return p;
}

}  // namespace mxddp::bench
