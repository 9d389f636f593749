// decide_fine_grained_param_gather: the policies of fsdp_fine_grained.h.
#include <mxddp/fsdp_fine_grained.h>

namespace mxddp {

bool recompute_reruns_weighted_modules(RecomputeGranularity granularity, const RecomputeModules& modules) {
  return granularity == RecomputeGranularity::kSelective &&
         (modules.contains(RecomputeModule::kMlp) || modules.contains(RecomputeModule::kLayernorm));
}

FineGrainedParamGatherDecision decide_fine_grained_param_gather(const FineGrainedParamGatherInputs& in) {
  const std::string_view policy = fine_grained_param_gather_policy_name(in.policy);
  const bool reruns = recompute_reruns_weighted_modules(in.recompute_granularity, in.recompute_modules);
  bool required = false;
  std::string why;
  switch (in.policy) {
    case FineGrainedParamGatherPolicy::kMegatron:
      required = in.mxfp8_param_gather;
      why = "MXFP8 params with --fp8-param-gather";
      break;
    case FineGrainedParamGatherPolicy::kRecomputeAware:
      required = in.mxfp8_param_gather && reruns;
      why = fmt::format("MXFP8 params with --fp8-param-gather and selective recompute of {} (a re-run submodule "
                        "reads its row-wise weights, which only the fine-grained gather brings in backward)",
                        recompute_modules_names(in.recompute_modules));
      break;
  }
  if (required) {
    MXDDP_CHECK(in.flag != false,
                "--no-megatron-fsdp-enable-fine-grained-param-gather is not valid here: the {} policy requires the "
                "fine-grained param gather for {}; valid: leave the flag out or give "
                "--megatron-fsdp-enable-fine-grained-param-gather{}",
                policy, why,
                in.policy == FineGrainedParamGatherPolicy::kRecomputeAware
                    ? ", or recompute without mlp and layernorm"
                    : ", or --fine-grained-param-gather-policy recompute-aware without selective recompute of mlp or "
                      "layernorm");
    return {.on = true, .required = true, .reason = fmt::format("on: required by the {} policy for {}", policy, why)};
  }
  if (in.flag == true)
    return {.on = true, .required = false,
            .reason = fmt::format("on: --megatron-fsdp-enable-fine-grained-param-gather ({} policy: not required)", policy)};
  return {.on = false, .required = false,
          .reason = fmt::format("off: {} ({} policy: not required)",
                                in.flag == false ? "--no-megatron-fsdp-enable-fine-grained-param-gather"
                                                 : "the flag is not given",
                                policy)};
}

}  // namespace mxddp
