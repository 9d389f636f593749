// mxddp data-parallel fields: the config fields DdpConfig and FsdpConfig have in common, described
// once (config_fields.h). Megatron reads them from one DistributedDataParallelConfig whichever
// wrapper it builds, and mxddp keeps that: both configs' describe_fields() begin with this
// description, `mxddp train` registers each shared flag once (with DdpConfig's fields) and
// copy_shared_data_parallel_fields gives its value to FsdpConfig, and the report and the checkpoint
// manifest write the field in each config's section under the same name.
//
// Adding a shared field: a member of that name and type in both configs, then one line here.
#pragma once

#include <cstddef>
#include <string_view>
#include <tuple>
#include <utility>

#include <mxddp/config_fields.h>

namespace mxddp {

// The shared fields of C (DdpConfig or FsdpConfig), in the same order for both.
template <typename C>
constexpr auto describe_shared_data_parallel_fields() {
  return std::tuple{
      ConfigField<C, bool>{"grad_reduce_in_fp32", "", "Keep and reduce gradients in FP32 (the GPT needs it)",
                           &C::grad_reduce_in_fp32},
      ConfigField<C, bool>{"overlap_grad_reduce", "--overlap-grad-reduce",
                           "Reduce gradients during backward (DDP: each bucket group as its last gradient is in; "
                           "FSDP: each unit at its post-backward)",
                           &C::overlap_grad_reduce},
      ConfigField<C, DType>{"param_dtype", "", "The model params' dtype (bf16)", &C::param_dtype},
      ConfigField<C, bool>{"overlap_param_gather", "--overlap-param-gather",
                           "Gather params as forward needs them (DDP: group by group in the forward pre-hooks; FSDP: "
                           "asynchronously, prefetching units within the budget)",
                           &C::overlap_param_gather},
      ConfigField<C, Fp8Format>{"mxfp8_elem", "--mxfp8-elem", "MXFP8 element format: e4m3 or e5m2", &C::mxfp8_elem},
      ConfigField<C, ScaleMode>{"mxfp8_scale_mode", "--mxfp8-scale-mode", "MXFP8 scale rule: rceil or floor",
                                &C::mxfp8_scale_mode},
  };
}

// Whether C's field `name` is one of the shared ones.
template <typename C>
constexpr bool is_shared_data_parallel_field(std::string_view name) {
  return std::apply([name](const auto&... field) { return ((field.name == name) || ...); },
                    describe_shared_data_parallel_fields<C>());
}

// Sets every shared field of `to` to its value in `from` (e.g. FsdpConfig's from the DdpConfig the
// shared flags set).
template <typename From, typename To>
void copy_shared_data_parallel_fields(const From& from, To& to) {
  constexpr auto source = describe_shared_data_parallel_fields<From>();
  constexpr auto target = describe_shared_data_parallel_fields<To>();
  [&]<size_t... I>(std::index_sequence<I...>) {
    ((std::get<I>(target).of(to) = std::get<I>(source).of(from)), ...);
  }(std::make_index_sequence<std::tuple_size_v<decltype(source)>>{});
}

}  // namespace mxddp
