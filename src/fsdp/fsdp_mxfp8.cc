// FullyShardedDataParallel's MXFP8 shards: after the optimizer has staged bf16(main params) into an
// MXFP8 bucket's staging shard, each rank computes the block scales its elements imply, the ranks
// MAX all-reduce them (u8; a block may straddle two ranks' shards), and each rank encodes its shard
// in both orientations with the full scales. quant.h's mx_shard_scales says why the result is
// bitwise what quantizing the whole gathered tensor gives (tests/quant/mxfp8_shard_test.cc proves
// it for every cut; tests/fsdp/fsdp_mxfp8_test.cc for the training losses).
#include <cstring>
#include <utility>
#include <vector>

#include <mxddp/fsdp.h>

#include "fsdp_bucket.h"
#include "fsdp_engine.h"

namespace mxddp {

void FsdpEngine::allocate_staging(int bucket) {
  Bucket& b = *buckets_[static_cast<size_t>(bucket)];
  MXDDP_ASSERT(b.mxfp8);
  if (b.params_shard.data()) return;  // still the initial values (before the first iteration)
  b.allocate(FsdpBuffer::kParamsShard, tracker_);
  std::memset(b.params_shard.data(), 0, b.params_shard.size_bytes());  // the optimizer writes params only; padding stays 0
}

TensorView FsdpEngine::param_scales(int param, QuantAxis axis) const {
  const Shape& shape = specs_[static_cast<size_t>(param)].shape;
  const HostBuffer& scales = buckets_[static_cast<size_t>(layout_.params[static_cast<size_t>(param)].bucket)]->scales;
  return fsdp_sub(scales.view(DType::kU8, Shape{static_cast<int64_t>(scales.size_bytes())}),
                  scale_offset_[static_cast<size_t>(param)][static_cast<size_t>(axis)],
                  mx_scale_shape(shape[0], shape[1], axis));
}

Work FsdpEngine::start_shard_scales(int bucket) {
  Bucket& b = *buckets_[static_cast<size_t>(bucket)];
  MXDDP_ASSERT(b.mxfp8 && b.params_shard.data());
  const TensorView staging = b.params_shard.view(config_.param_dtype, Shape{b.shard});
  const TensorView scales = b.scales.view(DType::kU8, Shape{static_cast<int64_t>(b.scales.size_bytes())});
  // A param this rank holds none of contributes zeros, the MAX's identity.
  std::memset(b.scales.data(), 0, b.scales.size_bytes());
  for (const ShardParamRange& r : layout_.shards[static_cast<size_t>(comm_.rank())][static_cast<size_t>(bucket)].params) {
    const Shape& shape = specs_[static_cast<size_t>(r.param)].shape;
    for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol})
      mx_shard_scales(staging.slice(r.in_shard.start, r.in_shard.size()), r.in_param.start, shape,
                      param_scales(r.param, axis), {config_.mxfp8_elem, config_.mxfp8_scale_mode, axis});
  }
  log_.push_back({FsdpCollective::Kind::kAllReduce, bucket});
  return comm_.all_reduce(scales, {.op = ReduceOp::kMax, .async_op = true});
}

void FsdpEngine::finish_shard_quantize(int bucket, const Work& scales_reduced, bool keep_staging) {
  Bucket& b = *buckets_[static_cast<size_t>(bucket)];
  scales_reduced.wait();
  const TensorView staging = b.params_shard.view(config_.param_dtype, Shape{b.shard});
  // Padding encodes as 0 (its elements are 0): every rank's gathered bytes are the same.
  std::memset(b.row_shard.data(), 0, b.row_shard.size_bytes());
  std::memset(b.col_shard.data(), 0, b.col_shard.size_bytes());
  for (const ShardParamRange& r : layout_.shards[static_cast<size_t>(comm_.rank())][static_cast<size_t>(bucket)].params) {
    const Shape& shape = specs_[static_cast<size_t>(r.param)].shape;
    const TensorView values = staging.slice(r.in_shard.start, r.in_shard.size());
    for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) {
      const HostBuffer& out = axis == QuantAxis::kRow ? b.row_shard : b.col_shard;
      mx_shard_encode(values, r.in_param.start, shape, param_scales(r.param, axis),
                      out.view(DType::kU8, Shape{b.shard}).slice(r.in_shard.start, r.in_shard.size()),
                      {config_.mxfp8_elem, config_.mxfp8_scale_mode, axis});
    }
  }
  if (!keep_staging) b.params_shard = HostBuffer();
}

void FsdpEngine::quantize_staged_shards(bool keep_staging) {
  std::vector<std::pair<int, Work>> quantizing;  // every bucket's scales in flight at once
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b)
    if (buckets_[static_cast<size_t>(b)]->mxfp8) quantizing.emplace_back(b, start_shard_scales(b));
  for (auto& [b, scales] : quantizing) finish_shard_quantize(b, scales, keep_staging);
}

}  // namespace mxddp
