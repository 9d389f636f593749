// FullyShardedDataParallel's MXFP8 shards: after the optimizer has staged bf16(main params) into an
// MXFP8 bucket's staging shard, each rank computes the block scales its elements imply, the ranks
// MAX all-reduce them (u8; a block may straddle two ranks' shards), and each rank encodes its shard
// in both orientations with the full scales, keeping its shard of each orientation's scale array
// (gathered with the payload of that orientation). The row- and column-wise slots are per pass
// (encoding_axis): a weight read column-wise in forward has its column-wise copy in the row slot. quant.h's mx_shard_scales says why the result is
// bitwise what quantizing the whole gathered tensor gives (tests/quant/mxfp8_shard_test.cc proves
// it for every cut; tests/fsdp/fsdp_mxfp8_test.cc for the training losses). Every step runs on the
// engine's compute (the shard codec: Compute::mx_shard_scales / mx_shard_encode), host or device.
#include <optional>
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
  b.allocate(FsdpBuffer::kParamsShard, compute_, tracker_);  // zeroed: the optimizer writes params only; padding stays 0
}

QuantAxis FsdpEngine::encoding_axis(int param, QuantAxis slot_axis) const {
  if (!specs_[static_cast<size_t>(param)].mxfp8_colwise_forward) return slot_axis;
  return slot_axis == QuantAxis::kRow ? QuantAxis::kCol : QuantAxis::kRow;
}

TensorView FsdpEngine::param_scales(int param, QuantAxis slot_axis, const TensorView& array) const {
  const Shape& shape = specs_[static_cast<size_t>(param)].shape;
  return fsdp_sub(array, scale_offset_[static_cast<size_t>(param)][static_cast<size_t>(slot_axis)],
                  mx_scale_shape(shape[0], shape[1], encoding_axis(param, slot_axis)));
}

TensorView FsdpEngine::quantize_scales(int bucket, QuantAxis axis) const {
  const Bucket& b = *buckets_[static_cast<size_t>(bucket)];
  return fsdp_sub(b.quantize_scales.view(DType::kU8, Shape{static_cast<int64_t>(b.quantize_scales.size_bytes())}),
                  b.storage.quantize_scales_offset(axis), Shape{b.storage.scales_numel(axis)});
}

const FsdpStoragePlan& FsdpEngine::storage_plan(int bucket) const { return buckets_.at(static_cast<size_t>(bucket))->storage; }

TensorView FsdpEngine::mxfp8_scales_shard(int bucket, QuantAxis axis) const {
  const Bucket& b = *buckets_.at(static_cast<size_t>(bucket));
  MXDDP_CHECK(b.mxfp8, "bucket {} holds no MXFP8 params, so no scales", bucket);
  return b.scales_shard[static_cast<size_t>(axis)].view(DType::kU8, Shape{b.storage.scales_shard_numel(axis)});
}

Work FsdpEngine::start_shard_scales(int bucket) {
  Bucket& b = *buckets_[static_cast<size_t>(bucket)];
  MXDDP_ASSERT(b.mxfp8 && b.params_shard.data() && !b.quantize_scales.data());
  const TensorView staging = b.params_shard.view(config_.param_dtype, Shape{b.shard});
  // The whole arrays, for this step only: a rank's payload shard is encoded with the scales of
  // every block it touches, which lie outside its own scale shard (the arrays are split by dp
  // separately from the payloads). A param this rank holds none of contributes zeros, the MAX's
  // identity; so does the padding.
  b.allocate(FsdpBuffer::kQuantizeScales, compute_, tracker_);  // zeroed
  for (const ShardParamRange& r : layout_.shards[static_cast<size_t>(comm_.rank())][static_cast<size_t>(bucket)].params) {
    const Shape& shape = specs_[static_cast<size_t>(r.param)].shape;
    for (QuantAxis slot_axis : {QuantAxis::kRow, QuantAxis::kCol})
      compute_.mx_shard_scales(staging.slice(r.in_shard.start, r.in_shard.size()), r.in_param.start, shape,
                               param_scales(r.param, slot_axis, quantize_scales(bucket, slot_axis)),
                               {config_.mxfp8_elem, config_.mxfp8_scale_mode, encoding_axis(r.param, slot_axis)});
  }
  log_.push_back({FsdpCollective::Kind::kAllReduce, bucket});
  return comm_.all_reduce(b.quantize_scales.view(DType::kU8, Shape{static_cast<int64_t>(b.quantize_scales.size_bytes())}),
                          {.op = ReduceOp::kMax, .async_op = true});
}

void FsdpEngine::finish_shard_quantize(int bucket, const Work& scales_reduced, bool keep_staging) {
  Bucket& b = *buckets_[static_cast<size_t>(bucket)];
  scales_reduced.wait();
  const TensorView staging = b.params_shard.view(config_.param_dtype, Shape{b.shard});
  // Padding encodes as 0 (its elements are 0): every rank's gathered bytes are the same.
  compute_.zero(b.row_shard.data(), b.row_shard.size_bytes());
  compute_.zero(b.col_shard.data(), b.col_shard.size_bytes());
  for (const ShardParamRange& r : layout_.shards[static_cast<size_t>(comm_.rank())][static_cast<size_t>(bucket)].params) {
    const Shape& shape = specs_[static_cast<size_t>(r.param)].shape;
    const TensorView values = staging.slice(r.in_shard.start, r.in_shard.size());
    for (QuantAxis slot_axis : {QuantAxis::kRow, QuantAxis::kCol}) {
      const ComputeBuffer& out = slot_axis == QuantAxis::kRow ? b.row_shard : b.col_shard;
      compute_.mx_shard_encode(values, r.in_param.start, shape,
                               param_scales(r.param, slot_axis, quantize_scales(bucket, slot_axis)),
                               out.view(DType::kU8, Shape{b.shard}).slice(r.in_shard.start, r.in_shard.size()),
                               {config_.mxfp8_elem, config_.mxfp8_scale_mode, encoding_axis(r.param, slot_axis)});
    }
  }
  // Each rank keeps its shard of each orientation's whole scales (the same cut on every rank, so
  // the shards gathered with a payload slot are the whole array again).
  for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) {
    const int64_t n = b.storage.scales_shard_numel(axis);
    compute_.copy(b.scales_shard[static_cast<size_t>(axis)].data(),
                  quantize_scales(bucket, axis).slice(comm_.rank() * n, n).data, static_cast<size_t>(n));
  }
  b.quantize_scales = ComputeBuffer();
  if (!keep_staging) b.params_shard = ComputeBuffer();
}

void FsdpEngine::quantize_staged_shards(bool keep_staging) {
  // As a step does: a bucket's scales all-reduce runs while the next bucket's partial scales are
  // computed, so at most two buckets' whole scales are alive at once.
  std::optional<std::pair<int, Work>> quantizing;
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    if (!buckets_[static_cast<size_t>(b)]->mxfp8) continue;
    Work scales = start_shard_scales(b);
    if (quantizing) finish_shard_quantize(quantizing->first, quantizing->second, keep_staging);
    quantizing.emplace(b, std::move(scales));
  }
  if (quantizing) finish_shard_quantize(quantizing->first, quantizing->second, keep_staging);
}

}  // namespace mxddp
