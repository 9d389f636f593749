// mxddp buffer: where every parameter and gradient lives.
//
// Owns: ParamLayout, the Megatron-compatible placement of params in one contiguous buffer (a pure
// function of the param list, the options and the data-parallel size, so it is identical on every
// rank), and ParamAndGradBuffer, which allocates the param and grad buffers by that layout and
// hands out per-param views into them.
//
// The layout rule (units are elements):
//   - Params are placed in reverse registration order (about the order backward produces grads).
//   - With the distributed optimizer, each param starts on a multiple of 64 elements, and a bucket
//     ends on a multiple of lcm(dp, 128) (lcm(dp, 128, 65536) with pad_buckets_for_high_nccl_busbw),
//     so every bucket splits into dp equal shards. Without it, nothing is padded.
//   - A bucket closes once it holds at least bucket_size elements; no bucket_size: one bucket.
//   - With the distributed optimizer, a param marked shared_embedding gets a bucket of its own
//     (with or without bucket_size); the bucket closed before it counts, as Megatron's
//     numel_unpadded, up to the shared param's padded start. Without the distributed optimizer it
//     shares a bucket like any param (as Megatron does).
//   - With param_unit (FSDP), a bucket also closes where the unit changes.
//   - Rank r's shard of a bucket [o, o + G) is [o + r*G/dp, o + (r+1)*G/dp), whatever the param
//     boundaries are. An unpadded bucket (shard_unpadded_buckets) is cut at o + floor(r*G/dp), so
//     its shards differ in size by at most one element (for a padded bucket it is the cut above).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <mxddp/compute.h>
#include <mxddp/core.h>
#include <mxddp/memory.h>

namespace mxddp {

// ----------------------------------------------------------------------------------------------
// Layout
// ----------------------------------------------------------------------------------------------

struct ParamSpec {
  std::string name;
  Shape shape;
  bool shared_embedding = false;  // e.g. a token embedding tied to the LM head
  bool mxfp8 = false;             // a 2-D weight kept as MXFP8 with fp8_param_gather
  // MXFP8 only: the forward product reduces over dim 0 (HF Conv1D's W [in, out]) where nn.Linear's
  // (W [out, in]) reduces over dim 1, so the forward reads the column-wise copy and the data
  // gradient the row-wise one. FSDP gathers each pass's copy (fsdp_engine.h); DDP keeps both.
  bool mxfp8_colwise_forward = false;
};

struct LayoutOptions {
  int dp = 1;                             // data-parallel size
  std::optional<int64_t> bucket_size;     // elements; nullopt = one bucket
  bool use_distributed_optimizer = false;
  bool pad_buckets_for_high_nccl_busbw = false;
  // [num params] or empty. FSDP's units: a bucket never holds params of two units (-1 is the
  // non-unit params), so each unit's buckets are gathered and released on their own.
  std::vector<int> param_unit;
  // [num params] or empty: the order the walk places params in (a permutation of the indices);
  // empty is reverse registration order, the rule's. FSDP reorders within a unit so that a unit's
  // MXFP8 params and its others form a bucket each (Megatron-FSDP keys buckets by unit and dtype).
  std::vector<int> param_order;
  // false leaves ParamLayout::shards empty: a memory plan needs only their sizes (a bucket's / dp),
  // and dp x buckets of them is the one part of a layout that grows with dp.
  bool compute_shards = true;
  // Without the distributed optimizer: cut the (unpadded) buckets into dp shards all the same. Nothing
  // is reduce-scattered or gathered by them; a replicated optimizer over DDP owns its rank's shard for
  // the global grad norm and for checkpoints, so every element is counted and saved on exactly one rank.
  bool shard_unpadded_buckets = false;
};

// Megatron's default bucket size: max(40,000,000, 1,000,000 x dp) elements when gradient reduction
// overlaps backward; nullopt (one bucket) when it does not.
std::optional<int64_t> default_bucket_size(int dp, bool overlap_grad_reduce);

// A half-open element range [start, end).
struct Range {
  int64_t start = 0;
  int64_t end = 0;
  int64_t size() const { return end - start; }
  bool operator==(const Range&) const = default;
};

struct ParamPlacement {
  Range range;  // in the buffer
  int bucket = 0;
};

struct BucketPlacement {
  Range range;                 // in the buffer, padded
  int64_t numel_unpadded = 0;  // from the bucket start to the end of its last param (param-start padding included)
  std::vector<int> params;     // registration indices, in buffer order
};

// The part of one param inside one rank's shard of one bucket.
struct ShardParamRange {
  int param = 0;       // registration index
  Range in_buffer;     // the elements' place in the buffer
  Range in_param;      // the same elements' place in the (flattened) param
  Range in_shard;      // and in the shard (0 = the shard's first element)
};

struct BucketShard {
  Range range;                          // in the buffer
  std::vector<ShardParamRange> params;  // in buffer order; padding belongs to no param
};

struct ParamLayout {
  LayoutOptions options;
  std::vector<ParamPlacement> params;   // [num params], by registration index
  std::vector<BucketPlacement> buckets; // [num buckets], in buffer order
  // [dp][num buckets]; filled with the distributed optimizer or options.shard_unpadded_buckets (else
  // nothing is sharded), unless options.compute_shards is false.
  std::vector<std::vector<BucketShard>> shards;
  int64_t numel = 0;  // the whole buffer, padding included

  // Megatron's _ParamAndGradBuffer.numel_unpadded: the sum of the buckets' numel_unpadded, so the
  // padding before a param's start inside a bucket counts (only bucket-end padding does not).
  int64_t numel_unpadded() const;
  // Sum of the params' elements: no padding at all.
  int64_t params_numel() const;
};

// Throws Error for an empty param list, an empty or duplicated name, dp < 1, bucket_size < 1, or a
// param with zero elements.
ParamLayout compute_param_layout(const std::vector<ParamSpec>& params, const LayoutOptions& options);

// ----------------------------------------------------------------------------------------------
// The buffers
// ----------------------------------------------------------------------------------------------

struct BufferOptions {
  DType param_dtype = DType::kBF16;  // bf16 or f32
  bool grad_reduce_in_fp32 = true;   // grads in f32; else in param_dtype
  int buckets_per_group = 1;         // buckets whose collectives are dispatched together
  // No param buffer of its own: the (bf16) param buffer is a view of the grad buffer's first
  // numel x 2 bytes (the first half of f32 grads, all of bf16 grads). For MXFP8 param gathers,
  // which stage through it while no gradients live there.
  bool params_in_grad_buffer = false;
  // Where both buffers live and are zeroed (compute.h); nullptr: cpu_compute(), host memory.
  Compute* compute = nullptr;
};

// The param buffer and the grad buffer of one rank, laid out by a ParamLayout, both charged to
// the tracker (params, grads). Padding is zero in both.
//   param buffer: [layout.numel] param_dtype (with params_in_grad_buffer: the grad buffer's bytes)
//   grad buffer:  [layout.numel] f32 (grad_reduce_in_fp32) or param_dtype
class ParamAndGradBuffer {
 public:
  // initial_values: one view per param (f32, or param_dtype), copied (and rounded) into place;
  // empty leaves params at zero.
  ParamAndGradBuffer(const std::vector<ParamSpec>& params, const LayoutOptions& layout_options,
                     const BufferOptions& options, MemoryTracker& tracker,
                     const std::vector<TensorView>& initial_values = {});

  const ParamLayout& layout() const { return layout_; }
  const std::vector<ParamSpec>& params() const { return specs_; }
  const BufferOptions& options() const { return options_; }
  Compute& compute() const { return *compute_; }  // where the buffers are
  int num_params() const { return static_cast<int>(specs_.size()); }
  // Registration index of a param name; throws if unknown.
  int param_index(const std::string& name) const;

  TensorView param_data(int param) const;  // [param shape] param_dtype, in the param buffer
  TensorView main_grad(int param) const;   // [param shape] grad dtype, in the grad buffer
  TensorView param_buffer() const;         // [numel]
  TensorView grad_buffer() const;          // [numel]
  TensorView bucket_grads(int bucket) const;  // [bucket size] of the grad buffer
  TensorView bucket_params(int bucket) const; // [bucket size] of the param buffer
  // This rank's shard of a bucket, in the grad and the param buffer.
  TensorView grad_shard(int bucket, int rank) const;
  TensorView param_shard(int bucket, int rank) const;

  // Bucket groups: consecutive buckets, buckets_per_group at a time. [num groups][buckets]
  const std::vector<std::vector<int>>& bucket_groups() const { return bucket_groups_; }

 private:
  TensorView param_view(const TensorView& whole, int param) const;  // the param's slice, shaped
  Range shard_range(int bucket, int rank) const;

  std::vector<ParamSpec> specs_;
  ParamLayout layout_;
  BufferOptions options_;
  DType grad_dtype_;
  Compute* compute_;
  ComputeBuffer param_storage_;
  ComputeBuffer grad_storage_;
  std::vector<std::vector<int>> bucket_groups_;
};

}  // namespace mxddp
