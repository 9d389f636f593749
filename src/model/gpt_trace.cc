// trace_gpt_micro_batch: the GPT's control flow without its arithmetic, for the memory planner.
//
// The graph (gpt_graph.h) is instantiated over Traced, an element type with no storage, and every
// kernel it calls has a Traced overload here that does nothing. So the hooks, gradient requests
// and scratch requests come out of the very code GptModel runs, in its order, and a plan cannot
// drift from the model: a new activation in the graph shows up in the plan by construction. The
// weight reads become the scratch requests GptModel::Impl::weight makes for them.
#include <mxddp/model.h>

#include "gpt_ops.h"

namespace mxddp::model {

// An element that holds nothing: the graph's arithmetic on it compiles to nothing.
struct Traced {
  constexpr Traced(double value = 0) : nonzero(value != 0) {}  // NOLINT: the graph writes Real(0), Real(1)
  friend constexpr bool operator!=(Traced a, Traced b) { return a.nonzero != b.nonzero; }
  bool nonzero;
};

// The kernels the graph calls, for Traced: no work, no memory touched.
void fill_zero(Traced*, int64_t) {}
void add_in_place(Traced*, const Traced*, int64_t) {}
void linear_forward(Operand<Traced>, Operand<Traced>, const Traced*, Traced*, int, int, int) {}
void linear_backward_weight(Operand<Traced>, Operand<Traced>, Traced*, Traced*, int, int, int) {}
void linear_backward_data(Operand<Traced>, Operand<Traced>, Traced*, int, int, int, bool) {}
void layernorm_forward(const Traced*, const Traced*, const Traced*, Traced*, Traced*, Traced*, int, int) {}
void layernorm_backward(const Traced*, const Traced*, const Traced*, const Traced*, const Traced*, Traced*, Traced*,
                        Traced*, int, int) {}
void gelu_forward(const Traced*, Traced*, int64_t) {}
void gelu_backward(const Traced*, const Traced*, Traced*, int64_t) {}
void embedding_forward(const int32_t*, const Traced*, const Traced*, Traced*, int, int, int) {}
void embedding_backward(const int32_t*, const Traced*, Traced*, Traced*, int, int, int) {}
double cross_entropy(Traced*, const int32_t*, Traced*, int, int, Traced) { return 0; }
void attention_forward(const Traced*, Traced*, Traced*, Traced*, int, int, int, int) {}
void attention_backward(const Traced*, const Traced*, const Traced*, Traced*, Traced*, int, int, int, int) {}
void gemm(Op, Op, int, int, int, Traced, const Traced*, int, const Traced*, int, Traced, Traced*, int) {}
void gemm_operands(Op, Op, int, int, int, Operand<Traced>, int, Operand<Traced>, int, Traced, Traced*, int) {}

}  // namespace mxddp::model

#include "gpt_graph.h"
#include "gpt_scratch.h"

namespace mxddp {

void trace_gpt_micro_batch(const GptConfig& config, const GptModelOptions& options, const GptTraceOptions& trace_options,
                           GptCallTrace& trace) {
  using model::Traced;
  config.validate();
  options.validate();
  const std::vector<ParamSpec> specs = gpt_param_specs(config);
  MXDDP_CHECK(trace_options.mxfp8.empty() || trace_options.mxfp8.size() == specs.size(),
              "trace_gpt_micro_batch: mxfp8 has {} entries for {} params", trace_options.mxfp8.size(), specs.size());
  MXDDP_CHECK(trace_options.micro_batch >= 1, "micro-batch size {} is not valid: at least 1", trace_options.micro_batch);
  MXDDP_CHECK(trace_options.compute_threads >= 1, "compute threads {} is not valid: at least 1",
              trace_options.compute_threads);
  // Every activation pointer is this one element: the graph passes pointers along and never
  // offsets them itself (its kernels do, and the Traced ones do nothing).
  static Traced nowhere;
  model::GptAccess<Traced> access;
  access.weight = [&](int i, model::WeightUse use) -> const Traced* {
    const ParamSpec& spec = specs[static_cast<size_t>(i)];
    const bool mxfp8 = !trace_options.mxfp8.empty() && trace_options.mxfp8[static_cast<size_t>(i)];
    trace.scratch(gpt_weight_scratch_name(spec.name, mxfp8 && use == model::WeightUse::kDataGrad), spec.shape.numel());
    return &nowhere;
  };
  // As GptModel: under BF16 compute a BF16 param (not MXFP8) is read in place, with no scratch copy.
  const bool weights_in_place = options.bf16 && trace_options.bf16_params && model::bf16_gemm_supported();
  static const uint16_t in_place_bits = 0;
  access.weight_bf16 = [&](int i, model::WeightUse) -> const uint16_t* {
    const bool mxfp8 = !trace_options.mxfp8.empty() && trace_options.mxfp8[static_cast<size_t>(i)];
    return weights_in_place && !mxfp8 ? &in_place_bits : nullptr;
  };
  access.grad = [&](int i) {
    trace.main_grad(i);
    return &nowhere;
  };
  access.grad_ready = [&](int i) { trace.grad_ready(i); };
  access.before_forward = [&](const std::vector<int>& p) { trace.before_forward(p); };
  access.after_forward = [&](const std::vector<int>& p) { trace.after_forward(p); };
  access.before_backward = [&](const std::vector<int>& p) { trace.before_backward(p); };
  access.after_backward = [&](const std::vector<int>& p) { trace.after_backward(p); };
  access.scratch = [&](const std::string& name, int64_t numel) {
    trace.scratch(name, numel);
    return &nowhere;
  };
  const int64_t threads = trace_options.compute_threads;
  access.attention_scratch_numel = [threads](int seq) {
    return model::attention_scratch_numel(seq, static_cast<int>(threads));
  };
  model::GptGraph<Traced> graph(config, std::move(access), options.recompute_granularity, options.recompute_modules,
                                options.fine_grained_param_gather);
  // No tokens: they only feed the (traced) embedding and loss.
  graph.forward(nullptr, trace_options.micro_batch, Traced(trace_options.backward ? 1 : 0));
  if (trace_options.backward) graph.backward();
}

}  // namespace mxddp
