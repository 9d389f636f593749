// ParamAndGradBuffer: allocates the param and grad buffers by the layout and gives out views.
// Both are zeroed once at construction so padding is zero (padding is reduced and gathered along
// with the real elements, and must not carry garbage, let alone NaN, into norms).
#include <vector>

#include <mxddp/buffer.h>

namespace mxddp {

namespace {

// src (host memory, f32 or dst's dtype) into dst (the compute's memory), rounded to dst's dtype.
void copy_initial_value(const TensorView& src, const TensorView& dst, const std::string& name, Compute& compute) {
  MXDDP_CHECK(src.numel() == dst.numel(), "initial value of '{}' has {} elements ({}); the param has {} ({})", name,
              src.numel(), src.shape.to_string(), dst.numel(), dst.shape.to_string());
  MXDDP_CHECK(src.device.is_cpu(), "initial value of '{}' is on {}; expected cpu", name, to_string(src.device));
  if (src.dtype == dst.dtype) {
    compute.copy_from_host(dst.data, src.data, dst.nbytes());
  } else if (src.dtype == DType::kF32 && dst.dtype == DType::kBF16) {
    const auto n = static_cast<size_t>(dst.numel());
    if (compute.place() == MemoryPlace::kHost) {
      convert_f32_to_bf16(src.data_as<const float>(), dst.data_as<bf16_bits>(), n);
    } else {  // rounded on the host, then copied
      std::vector<bf16_bits> rounded(n);
      convert_f32_to_bf16(src.data_as<const float>(), rounded.data(), n);
      compute.copy_from_host(dst.data, rounded.data(), n * sizeof(bf16_bits));
    }
  } else {
    MXDDP_FAIL("initial value of '{}' is {}; the param is {} (give {} or f32)", name, dtype_name(src.dtype),
               dtype_name(dst.dtype), dtype_name(dst.dtype));
  }
}

}  // namespace

ParamAndGradBuffer::ParamAndGradBuffer(const std::vector<ParamSpec>& params, const LayoutOptions& layout_options,
                                       const BufferOptions& options, MemoryTracker& tracker,
                                       const std::vector<TensorView>& initial_values)
    : specs_(params),
      layout_(compute_param_layout(params, layout_options)),
      options_(options),
      compute_(options.compute != nullptr ? options.compute : &cpu_compute()) {
  MXDDP_CHECK(options.param_dtype == DType::kBF16 || options.param_dtype == DType::kF32,
              "param_dtype must be bf16 or f32; got {}", dtype_name(options.param_dtype));
  MXDDP_CHECK(options.buckets_per_group >= 1, "buckets_per_group must be >= 1; got {}", options.buckets_per_group);
  MXDDP_CHECK(initial_values.empty() || initial_values.size() == params.size(),
              "got {} initial values for {} params; give one per param or none", initial_values.size(), params.size());
  MXDDP_CHECK(!options.params_in_grad_buffer || options.param_dtype == DType::kBF16,
              "params_in_grad_buffer needs bf16 params; got {}", dtype_name(options.param_dtype));
  grad_dtype_ = options.grad_reduce_in_fp32 ? DType::kF32 : options.param_dtype;
  const auto numel = static_cast<size_t>(layout_.numel);
  // Zeroed by allocate.
  grad_storage_ = compute_->allocate(numel * dtype_size_bytes(grad_dtype_), MemoryCategory::kGrads, tracker);
  if (!options.params_in_grad_buffer)
    param_storage_ = compute_->allocate(numel * dtype_size_bytes(options.param_dtype), MemoryCategory::kParams, tracker);
  for (size_t i = 0; i < initial_values.size(); ++i)
    copy_initial_value(initial_values[i], param_data(static_cast<int>(i)), specs_[i].name, *compute_);
  const int num_buckets = static_cast<int>(layout_.buckets.size());
  for (int b = 0; b < num_buckets; b += options.buckets_per_group) {
    std::vector<int> group;
    for (int k = b; k < std::min(num_buckets, b + options.buckets_per_group); ++k) group.push_back(k);
    bucket_groups_.push_back(std::move(group));
  }
}

int ParamAndGradBuffer::param_index(const std::string& name) const {
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == name) return static_cast<int>(i);
  MXDDP_FAIL("no param named '{}' in this buffer ({} params)", name, specs_.size());
}

TensorView ParamAndGradBuffer::param_buffer() const {
  const ComputeBuffer& storage = options_.params_in_grad_buffer ? grad_storage_ : param_storage_;
  return storage.view(options_.param_dtype, Shape{layout_.numel});
}

TensorView ParamAndGradBuffer::grad_buffer() const { return grad_storage_.view(grad_dtype_, Shape{layout_.numel}); }

TensorView ParamAndGradBuffer::param_view(const TensorView& whole, int param) const {
  MXDDP_CHECK(param >= 0 && param < num_params(), "param index {} out of range; valid: 0..{}", param, num_params() - 1);
  const Range r = layout_.params[static_cast<size_t>(param)].range;
  TensorView v = whole.slice(r.start, r.size());
  v.shape = specs_[static_cast<size_t>(param)].shape;
  return v;
}

Range ParamAndGradBuffer::shard_range(int bucket, int rank) const {
  MXDDP_CHECK(!layout_.shards.empty(),
              "this layout has no shards: they exist with use_distributed_optimizer or shard_unpadded_buckets");
  return layout_.shards.at(static_cast<size_t>(rank)).at(static_cast<size_t>(bucket)).range;
}

TensorView ParamAndGradBuffer::param_data(int param) const { return param_view(param_buffer(), param); }
TensorView ParamAndGradBuffer::main_grad(int param) const { return param_view(grad_buffer(), param); }

TensorView ParamAndGradBuffer::bucket_grads(int bucket) const {
  const Range r = layout_.buckets.at(static_cast<size_t>(bucket)).range;
  return grad_buffer().slice(r.start, r.size());
}

TensorView ParamAndGradBuffer::bucket_params(int bucket) const {
  const Range r = layout_.buckets.at(static_cast<size_t>(bucket)).range;
  return param_buffer().slice(r.start, r.size());
}

TensorView ParamAndGradBuffer::grad_shard(int bucket, int rank) const {
  const Range r = shard_range(bucket, rank);
  return grad_buffer().slice(r.start, r.size());
}

TensorView ParamAndGradBuffer::param_shard(int bucket, int rank) const {
  const Range r = shard_range(bucket, rank);
  return param_buffer().slice(r.start, r.size());
}

}  // namespace mxddp
