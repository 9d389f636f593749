// mxddp fsdp_fine_grained: whether FSDP's fine-grained param gather is on, decided from the policy,
// the flag, the MXFP8 params and the recompute, as one pure function that the trainer (and a
// planner, which must predict the units before training) both call (issue 12; docs/fsdp.md).
//
// Why it can be required: with MXFP8 params and fp8_param_gather, backward gathers only the
// column-wise copy; a submodule that a *selective* recompute re-runs in backward reads the
// row-wise copy, which only the fine-grained gather (a forward-style gather per submodule) brings.
// A full recompute re-runs the whole unit's forward, so the unit-level gather covers it; core_attn
// has no weights. So it is required iff MXFP8 + fp8_param_gather and selective recompute of mlp or
// layernorm (in this GPT the layernorm's weights are BF16, so its re-run would do with the unit
// gather; the rule is the issue's, conservative there).
#pragma once

#include <optional>
#include <string>

#include <mxddp/fsdp.h>
#include <mxddp/model.h>

namespace mxddp {

struct FineGrainedParamGatherInputs {
  FineGrainedParamGatherPolicy policy = FineGrainedParamGatherPolicy::kRecomputeAware;
  // FsdpConfig::megatron_fsdp_enable_fine_grained_param_gather: nullopt = neither flag given,
  // false = --no-megatron-fsdp-enable-fine-grained-param-gather (explicitly off).
  std::optional<bool> flag;
  bool mxfp8_param_gather = false;  // MXFP8 params with fp8_param_gather
  RecomputeGranularity recompute_granularity = RecomputeGranularity::kNone;
  RecomputeModules recompute_modules;
};

struct FineGrainedParamGatherDecision {
  bool on = false;
  bool required = false;  // the policy forces it on (the flag could not turn it off)
  std::string reason;     // one line for the report and the banner, e.g. "on: --megatron-fsdp-..."
  bool operator==(const FineGrainedParamGatherDecision&) const = default;
};

// Whether a selective recompute re-runs a submodule with weights (mlp, layernorm).
bool recompute_reruns_weighted_modules(RecomputeGranularity granularity, const RecomputeModules& modules);

// The decision. Throws Error naming --no-megatron-fsdp-enable-fine-grained-param-gather and why
// the policy requires fine-grained when it is required but explicitly off.
//   kMegatron:       required iff mxfp8_param_gather; on iff required or flag == true.
//   kRecomputeAware: required iff mxfp8_param_gather and the recompute re-runs weighted modules;
//                    on iff required or flag == true.
FineGrainedParamGatherDecision decide_fine_grained_param_gather(const FineGrainedParamGatherInputs& in);

}  // namespace mxddp
