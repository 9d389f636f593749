// GptModel: the f32 GptGraph over a DistributedDataParallel. This file is the model's side of the
// DDP protocol: where weights come from (the bf16 param, or an MXFP8 param dequantized in the
// orientation the product needs), where gradients go (main_grad, accumulated), when they are
// reported, and which params a module's forward pre-hook asks for.
#include <chrono>
#include <cstring>

#include <mxddp/model.h>
#include <mxddp/quant.h>

#include "gpt_graph.h"
#include "gpt_scratch.h"
#include "step_profile.h"

namespace mxddp {

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

}  // namespace

std::string gpt_weight_scratch_name(const std::string& param_name, bool colwise) {
  // The param's role, its name without the layer: layers take turns using the same weight scratch.
  std::string name = "w/";
  constexpr std::string_view kLayers = "decoder.layers.";
  if (!param_name.starts_with(kLayers)) name += param_name;
  else name.append("layer.").append(param_name, param_name.find('.', kLayers.size()) + 1);
  if (colwise) name += "/col";
  return name;
}

std::string_view recompute_granularity_name(RecomputeGranularity g) {
  switch (g) {
    case RecomputeGranularity::kNone: return "none";
    case RecomputeGranularity::kFull: return "full";
    case RecomputeGranularity::kSelective: return "selective";
  }
  return "?";
}

RecomputeGranularity parse_recompute_granularity(std::string_view name) {
  for (RecomputeGranularity g : {RecomputeGranularity::kFull, RecomputeGranularity::kSelective})
    if (recompute_granularity_name(g) == name) return g;
  MXDDP_FAIL("--recompute-granularity '{}' is not valid: full or selective (leave the flag out for no recompute)", name);
}

std::string_view recompute_module_name(RecomputeModule m) {
  switch (m) {
    case RecomputeModule::kCoreAttn: return "core_attn";
    case RecomputeModule::kMlp: return "mlp";
    case RecomputeModule::kLayernorm: return "layernorm";
  }
  return "?";
}

RecomputeModule parse_recompute_module(std::string_view name) {
  for (RecomputeModule m : {RecomputeModule::kCoreAttn, RecomputeModule::kMlp, RecomputeModule::kLayernorm})
    if (recompute_module_name(m) == name) return m;
  // Megatron's other module names are for parts this GPT does not have (MoE, MLA).
  const bool megatron_only = name == "moe" || name == "moe_act" || name == "shared_experts" || name == "mla_up_proj";
  MXDDP_FAIL("--recompute-modules '{}' is not valid: core_attn, mlp or layernorm{}", name,
             megatron_only ? " (Megatron's MoE and MLA modules are not in this GPT)" : "");
}

std::string recompute_modules_names(const RecomputeModules& modules) {
  std::string names;
  for (RecomputeModule m : modules) names += fmt::format("{}{}", names.empty() ? "" : " ", recompute_module_name(m));
  return names;
}

void GptModelOptions::validate() const {
  const bool selective = recompute_granularity == RecomputeGranularity::kSelective;
  MXDDP_CHECK(!selective || !recompute_modules.empty(),
              "--recompute-granularity selective needs at least one of --recompute-modules core_attn, mlp, layernorm");
  // Megatron ignores the modules without selective; a list that does nothing is more likely a
  // forgotten --recompute-granularity than an intent.
  MXDDP_CHECK(selective || recompute_modules.empty(),
              "--recompute-modules {} is only for --recompute-granularity selective, and the granularity is {}; valid: "
              "add --recompute-granularity selective, or leave --recompute-modules out",
              recompute_modules_names(recompute_modules),
              recompute_granularity == RecomputeGranularity::kFull ? "full (every layer re-runs whole)"
                                                                   : "none (the flag is not given)");
}

struct GptModel::Impl {
  DataParallel& ddp;
  GlobalMemoryBuffer& pool;
  GptConfig config;
  std::vector<ParamSpec> specs;
  std::vector<std::string> weight_key;        // [param] scratch name of its f32 copy (forward)
  std::vector<std::string> weight_key_dgrad;  // [param] ... of its column-wise copy (MXFP8 only)
  std::vector<bool> is_mxfp8;                 // [param]
  GptTimings timings;
  model::GemmDType gemm_dtype = model::GemmDType::kF32;  // the products' compute dtype (options.bf16)
  // BF16 compute on a CPU that multiplies BF16 natively: BF16 params are read in place.
  bool bf16_weights_in_place = false;
  std::unique_ptr<model::GptGraph<float>> graph;

  Impl(DataParallel& d, GlobalMemoryBuffer& p, const GptConfig& c) : ddp(d), pool(p), config(c) {}

  const float* weight(int i, model::WeightUse use) {
    const model::profile::Scope timed(model::profile::Part::kWeights);
    const ParamSpec& spec = specs[static_cast<size_t>(i)];
    const bool dgrad = is_mxfp8[static_cast<size_t>(i)] && use == model::WeightUse::kDataGrad;
    TensorView out = pool.get_tensor(spec.shape, DType::kF32, (dgrad ? weight_key_dgrad : weight_key)[static_cast<size_t>(i)]);
    if (is_mxfp8[static_cast<size_t>(i)]) {
      const Mxfp8View q = ddp.mxfp8_param(i, dgrad ? QuantAxis::kCol : QuantAxis::kRow);
      mx_dequantize(q.data, q.scales, out, q.options);
    } else {
      const TensorView p = ddp.param(i);
      if (p.dtype == DType::kBF16) convert_bf16_to_f32(p.data_as<const bf16_bits>(), out.data_as<float>(), static_cast<size_t>(p.numel()));
      else std::memcpy(out.data, p.data, static_cast<size_t>(p.numel()) * sizeof(float));
    }
    return out.data_as<const float>();
  }

  // A BF16 param's own bits for a BF16 product (no f32 copy, no rounding): what rounding weight()'s
  // copy would give back. MXFP8 params and f32 params take weight().
  const uint16_t* weight_bf16(int i) {
    if (!bf16_weights_in_place || is_mxfp8[static_cast<size_t>(i)]) return nullptr;
    const TensorView p = ddp.param(i);
    return p.dtype == DType::kBF16 ? p.data_as<const bf16_bits>() : nullptr;
  }
};

GptModel::GptModel(DataParallel& ddp, GlobalMemoryBuffer& scratch, const GptConfig& config,
                   const GptModelOptions& options)
    : impl_(std::make_unique<Impl>(ddp, scratch, config)) {
  config.validate();
  options.validate();
  // Its kernels read and write the params, grads and scratch directly, on the CPU.
  MXDDP_CHECK(ddp.compute().device().is_cpu(),
              "the reference GPT computes on the CPU, but its data-parallel buffers are on {}; give it a "
              "communicator on host memory",
              to_string(ddp.compute().device()));
  MXDDP_CHECK(scratch.compute().device().is_cpu(),
              "the reference GPT computes on the CPU, but its global memory buffer is on {}; give it one on "
              "host memory (GlobalMemoryBufferOptions::compute null)",
              to_string(scratch.compute().device()));
  Impl& m = *impl_;
  m.specs = ddp.params();
  if (options.bf16) m.gemm_dtype = model::GemmDType::kBF16;
  m.bf16_weights_in_place = options.bf16 && model::bf16_gemm_supported();
  const std::vector<ParamSpec> expected = gpt_param_specs(config);
  MXDDP_CHECK(m.specs.size() == expected.size(), "the DDP holds {} params but a GPT of {} has {}", m.specs.size(),
              config.describe(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i)
    MXDDP_CHECK(m.specs[i].name == expected[i].name && m.specs[i].shape == expected[i].shape,
                "param {} of the DDP is '{}' {}, but the GPT's is '{}' {}", i, m.specs[i].name,
                m.specs[i].shape.to_string(), expected[i].name, expected[i].shape.to_string());
  MXDDP_CHECK(ddp.grad_dtype() == DType::kF32,
              "the GPT accumulates weight gradients into main_grad with sgemm (beta = 1), so it needs f32 "
              "gradients: grad_reduce_in_fp32 must be true");
  MXDDP_CHECK(ddp.param_dtype() == DType::kBF16 || ddp.param_dtype() == DType::kF32,
              "param dtype {} is not supported by the GPT; valid: bf16, f32", dtype_name(ddp.param_dtype()));
  for (const ParamSpec& s : m.specs) {
    m.weight_key.push_back(gpt_weight_scratch_name(s.name, false));
    m.weight_key_dgrad.push_back(gpt_weight_scratch_name(s.name, true));
  }
  for (int i = 0; i < ddp.num_params(); ++i) m.is_mxfp8.push_back(ddp.is_mxfp8(i));

  model::GptAccess<float> access;
  access.weight = [&m](int i, model::WeightUse use) { return m.weight(i, use); };
  access.weight_bf16 = [&m](int i, model::WeightUse) { return m.weight_bf16(i); };
  access.grad = [&m](int i) { return m.ddp.main_grad(i).data_as<float>(); };
  access.grad_ready = [&m](int i) { m.ddp.grad_ready(i); };
  // The pre-hooks may wait for param gathers: that time is exposed communication.
  access.before_forward = [&m](const std::vector<int>& params) {
    const auto t0 = Clock::now();
    m.ddp.before_forward(params);
    m.timings.param_wait_ms += ms_since(t0);
  };
  access.after_forward = [&m](const std::vector<int>& params) { m.ddp.after_forward(params); };
  access.before_backward = [&m](const std::vector<int>& params) {
    const auto t0 = Clock::now();
    m.ddp.before_backward(params);
    m.timings.param_wait_ms += ms_since(t0);
  };
  access.after_backward = [&m](const std::vector<int>& params) { m.ddp.after_backward(params); };
  access.scratch = [&m](const std::string& name, int64_t numel) {
    return m.pool.get_tensor(Shape{numel}, DType::kF32, name).data_as<float>();
  };
  m.graph = std::make_unique<model::GptGraph<float>>(config, std::move(access), options.recompute_granularity,
                                                     options.recompute_modules, options.fine_grained_param_gather);
}

GptModel::~GptModel() = default;

double GptModel::forward_backward(const int32_t* tokens, int micro_batch, float loss_scale) {
  MXDDP_CHECK(micro_batch >= 1, "micro-batch size {} is not valid: at least 1", micro_batch);
  MXDDP_CHECK(loss_scale != 0.0f, "loss scale 0 would make every gradient zero");
  Impl& m = *impl_;
  const int n = micro_batch * m.config.seq_length;
  const model::ScopedGemmDType compute_dtype(m.gemm_dtype);
  model::profile::begin_micro_batch();
  const double wait0 = m.timings.param_wait_ms;
  auto t0 = Clock::now();
  const double loss = m.graph->forward(tokens, micro_batch, loss_scale / static_cast<float>(n));
  m.timings.forward_ms += ms_since(t0) - (m.timings.param_wait_ms - wait0);
  const double wait1 = m.timings.param_wait_ms;
  t0 = Clock::now();
  m.graph->backward();
  m.timings.backward_ms += ms_since(t0) - (m.timings.param_wait_ms - wait1);
  return loss / n;
}

double GptModel::evaluate(const int32_t* tokens, int micro_batch) {
  MXDDP_CHECK(micro_batch >= 1, "micro-batch size {} is not valid: at least 1", micro_batch);
  const model::ScopedGemmDType compute_dtype(impl_->gemm_dtype);
  const double loss = impl_->graph->forward(tokens, micro_batch, 0.0f);
  impl_->ddp.release_gathered_params();  // no backward follows
  return loss / (micro_batch * impl_->config.seq_length);
}

const GptConfig& GptModel::config() const { return impl_->config; }
const GptTimings& GptModel::timings() const { return impl_->timings; }
void GptModel::reset_timings() { impl_->timings = {}; }

}  // namespace mxddp
