// FsdpEngine::Bucket: the storage of one FSDP bucket (a unit's params of one kind, or the non-unit
// params'), shared by the files that implement fsdp.h. Every buffer lives in the engine's compute
// (its communicator's: host memory, or the rank's device). Which members are allocated, their
// bytes, categories and lifetimes, are the bucket's FsdpStoragePlan (fsdp_storage_plan.h).
#pragma once

#include <array>
#include <vector>

#include <mxddp/compute.h>

#include "fsdp_engine.h"

#include "fsdp_storage_plan.h"

namespace mxddp {

struct FsdpEngine::Bucket {
  FsdpStoragePlan storage;  // what it holds
  Range range;          // in the layout
  int64_t numel = 0;    // padded: G
  int64_t shard = 0;    // G / dp
  bool mxfp8 = false;   // holds MXFP8 params only (FSDP gives a unit's MXFP8 params a bucket of their own)
  ComputeBuffer params_full;   // [G] param dtype, kParams: no_shard, optim, optim_grads
  // [G/dp] param dtype, kParams: optim_grads_params. For an MXFP8 bucket it is only the optimizer's
  // staging of bf16(main params): from construction (the initial values) to the first
  // start_iteration, and while a step or a forced sync writes it, until quantized.
  ComputeBuffer params_shard;
  ComputeBuffer row_shard, col_shard;  // [G/dp] u8, kMxfp8: this rank's row-/column-wise payloads
  // [S_axis/dp] u8, kMxfp8, per QuantAxis: this rank's shard of the orientation's scale array (each
  // param's mx_scale_shape at FsdpEngine::scale_offset_[param][axis], zero-padded to S_axis).
  std::array<ComputeBuffer, 2> scales_shard;
  // [S_row + S_col] u8, kMxfp8, while the bucket's shards are quantized: the whole arrays, row-wise
  // first; each rank's partial scales, then (MAX all-reduced) the whole tensor's.
  ComputeBuffer quantize_scales;
  // Per GatherSlot while gathered: [G] param dtype (values) or u8 (row-/column-wise), kGathered.
  std::array<ComputeBuffer, kGatherSlots> gathered;
  // Row-/column-wise slots while gathered: [S_axis] u8, the orientation's whole scale array, kGathered.
  std::array<ComputeBuffer, kGatherSlots> gathered_scales;
  ComputeBuffer grads_full;    // [G] grad dtype, kGrads: no_shard, optim (kept); optim_grads* (transient)
  ComputeBuffer grads_shard;   // [G/dp] grad dtype, kGrads: optim_grads*
  bool reduction_in_flight = false;
  // FsdpStoragePlan::grads_in_shard: a gradient went into the shard this micro-batch and the
  // bucket's reduction (nothing to move, but the point the hooks must reach) has not come yet.
  bool grads_unreduced = false;

  // The member that holds `buffer`.
  ComputeBuffer& held(FsdpBuffer buffer) {
    switch (buffer) {
      case FsdpBuffer::kParamsFull: return params_full;
      case FsdpBuffer::kParamsShard: return params_shard;
      case FsdpBuffer::kRowShard: return row_shard;
      case FsdpBuffer::kColShard: return col_shard;
      case FsdpBuffer::kRowScales: return scales_shard[static_cast<size_t>(QuantAxis::kRow)];
      case FsdpBuffer::kColScales: return scales_shard[static_cast<size_t>(QuantAxis::kCol)];
      case FsdpBuffer::kGatheredValues: return gathered[static_cast<size_t>(GatherSlot::kValues)];
      case FsdpBuffer::kGatheredRowwise: return gathered[static_cast<size_t>(GatherSlot::kRowwise)];
      case FsdpBuffer::kGatheredColwise: return gathered[static_cast<size_t>(GatherSlot::kColwise)];
      case FsdpBuffer::kGatheredRowScales: return gathered_scales[static_cast<size_t>(GatherSlot::kRowwise)];
      case FsdpBuffer::kGatheredColScales: return gathered_scales[static_cast<size_t>(GatherSlot::kColwise)];
      case FsdpBuffer::kQuantizeScales: return quantize_scales;
      case FsdpBuffer::kGradsFull: return grads_full;
      case FsdpBuffer::kGradsShard: return grads_shard;
    }
    MXDDP_FAIL("unknown FSDP buffer {}", static_cast<int>(buffer));
  }
  // Allocates `buffer` as the storage plan sizes it, in compute's memory: zeroed, except a gather's
  // output, which the all-gather overwrites whole (padding included).
  void allocate(FsdpBuffer buffer, Compute& compute, MemoryTracker& tracker) {
    const FsdpBufferPlan& plan = storage.buffer(buffer);
    held(buffer) = compute.allocate(static_cast<size_t>(plan.bytes), plan.category, tracker,
                                    /*zeroed=*/plan.category != MemoryCategory::kGathered);
  }
};

// The elements [offset, offset + shape.numel()) of a flat view, shaped.
inline TensorView fsdp_sub(const TensorView& flat, int64_t offset, const Shape& shape) {
  TensorView v = flat.slice(offset, shape.numel());
  v.shape = shape;
  return v;
}

}  // namespace mxddp
