// compute_param_layout: the Megatron-compatible layout rule (see buffer.h), a pure function.
// The walk mirrors the rule as a user reads it: place params in reverse order, pad starts, close
// buckets at the threshold or around a shared embedding, pad bucket ends; then cut each bucket
// into dp shards and intersect the shards with the params.
#include <set>

#include <mxddp/buffer.h>

namespace mxddp {

namespace {

constexpr int64_t kParamStartAlignment = 64;        // elements: 128 bytes of bf16
constexpr int64_t kBucketEndAlignment = 128;        // lcm'd with dp
constexpr int64_t kHighBusbwBucketAlignment = 65536;

void validate(const std::vector<ParamSpec>& params, const LayoutOptions& options) {
  MXDDP_CHECK(!params.empty(), "a layout needs at least one param; got an empty list");
  MXDDP_CHECK(options.dp >= 1, "dp must be >= 1; got {}", options.dp);
  MXDDP_CHECK(!options.bucket_size || *options.bucket_size >= 1,
              "bucket_size must be >= 1 element (or none for one bucket); got {}", options.bucket_size.value_or(0));
  MXDDP_CHECK(options.param_unit.empty() || options.param_unit.size() == params.size(),
              "param_unit names a unit for {} params; the list has {}", options.param_unit.size(), params.size());
  if (!options.param_order.empty()) {
    MXDDP_CHECK(options.param_order.size() == params.size(), "param_order lists {} params; the layout has {}",
                options.param_order.size(), params.size());
    std::vector<bool> seen(params.size(), false);
    for (int i : options.param_order) {
      MXDDP_CHECK(i >= 0 && i < static_cast<int>(params.size()) && !seen[static_cast<size_t>(i)],
                  "param_order is not a permutation of 0..{}: {} is out of range or repeated", params.size() - 1, i);
      seen[static_cast<size_t>(i)] = true;
    }
  }
  std::set<std::string> names;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    MXDDP_CHECK(!p.name.empty(), "param {} has an empty name", i);
    MXDDP_CHECK(names.insert(p.name).second, "param name '{}' appears twice (indices must map to unique names)", p.name);
    MXDDP_CHECK(p.shape.numel() > 0, "param '{}' has shape {} with no elements", p.name, p.shape.to_string());
  }
}

// Cuts each bucket into dp shards and records which part of which param each shard holds.
// A padded bucket divides evenly; an unpadded one is cut at floor(r * G / dp), which is the same
// cut wherever G divides by dp.
void compute_shards(ParamLayout& layout) {
  const int dp = layout.options.dp;
  layout.shards.assign(static_cast<size_t>(dp), {});
  for (const BucketPlacement& bucket : layout.buckets) {
    const int64_t size = bucket.range.size();
    MXDDP_ASSERT(!layout.options.use_distributed_optimizer || size % dp == 0);
    // floor(size * r / dp), without forming size * r (which could overflow for a huge bucket).
    auto cut = [&](int r) { return bucket.range.start + size / dp * r + size % dp * r / dp; };
    for (int r = 0; r < dp; ++r) {
      BucketShard shard;
      shard.range = {cut(r), cut(r + 1)};
      for (int p : bucket.params) {
        const Range pr = layout.params[static_cast<size_t>(p)].range;
        const int64_t lo = std::max(pr.start, shard.range.start);
        const int64_t hi = std::min(pr.end, shard.range.end);
        if (lo >= hi) continue;
        shard.params.push_back({p, {lo, hi}, {lo - pr.start, hi - pr.start},
                                {lo - shard.range.start, hi - shard.range.start}});
      }
      layout.shards[static_cast<size_t>(r)].push_back(std::move(shard));
    }
  }
}

}  // namespace

std::optional<int64_t> default_bucket_size(int dp, bool overlap_grad_reduce) {
  MXDDP_CHECK(dp >= 1, "dp must be >= 1; got {}", dp);
  if (!overlap_grad_reduce) return std::nullopt;
  return std::max<int64_t>(40'000'000, int64_t{1'000'000} * dp);
}

// As Megatron's buffer: per_bucket_numel_unpadded summed, each counted from the bucket's start, so the
// 64-element alignment of param starts inside a bucket is part of it.
int64_t ParamLayout::numel_unpadded() const {
  int64_t n = 0;
  for (const BucketPlacement& b : buckets) n += b.numel_unpadded;
  return n;
}

int64_t ParamLayout::params_numel() const {
  int64_t n = 0;
  for (const ParamPlacement& p : params) n += p.range.size();
  return n;
}

ParamLayout compute_param_layout(const std::vector<ParamSpec>& params, const LayoutOptions& options) {
  validate(params, options);
  ParamLayout layout;
  layout.options = options;
  layout.params.resize(params.size());
  const bool padded = options.use_distributed_optimizer;
  int64_t bucket_end_alignment = 1;
  if (padded) {
    bucket_end_alignment = lcm(options.dp, kBucketEndAlignment);
    if (options.pad_buckets_for_high_nccl_busbw) bucket_end_alignment = lcm(bucket_end_alignment, kHighBusbwBucketAlignment);
  }

  BucketPlacement open;  // the bucket being filled
  int64_t cursor = 0;    // next free element
  int64_t last_param_end = 0;
  // unpadded_end: where the bucket's contents end, as Megatron counts them (its numel_unpadded).
  auto close_bucket = [&](int64_t unpadded_end) {
    open.range.end = round_up(unpadded_end, bucket_end_alignment);
    open.numel_unpadded = unpadded_end - open.range.start;
    cursor = open.range.end;
    layout.buckets.push_back(std::move(open));
    open = BucketPlacement{};
    open.range.start = cursor;
  };

  for (size_t k = 0; k < params.size(); ++k) {
    const int i = options.param_order.empty() ? static_cast<int>(params.size() - 1 - k) : options.param_order[k];
    const ParamSpec& spec = params[static_cast<size_t>(i)];
    // With the distributed optimizer a shared embedding gets a bucket of its own (Megatron's
    // _does_param_require_new_bucket; without it, it shares one). Megatron closes the bucket
    // before it at the shared param's padded start, so that bucket's numel_unpadded counts the
    // start padding. A new FSDP unit also starts a bucket; that one counts to its last param's end.
    const bool own_bucket = spec.shared_embedding && padded;
    const bool new_unit = !options.param_unit.empty() && !open.params.empty() &&
                          options.param_unit[static_cast<size_t>(i)] != options.param_unit[static_cast<size_t>(open.params.back())];
    if (own_bucket && !open.params.empty()) close_bucket(round_up(cursor, kParamStartAlignment));
    else if (new_unit) close_bucket(last_param_end);
    const int64_t start = padded ? round_up(cursor, kParamStartAlignment) : cursor;
    const int64_t end = checked_add(start, spec.shape.numel(), fmt::format("buffer layout: end of param {}", i));
    layout.params[static_cast<size_t>(i)] = {{start, end}, static_cast<int>(layout.buckets.size())};
    open.params.push_back(i);
    last_param_end = end;
    cursor = end;
    const bool full = options.bucket_size && end - open.range.start >= *options.bucket_size;
    if (full || own_bucket) close_bucket(last_param_end);
  }
  if (!open.params.empty()) close_bucket(last_param_end);
  layout.numel = cursor;
  if ((padded || options.shard_unpadded_buckets) && options.compute_shards) compute_shards(layout);
  return layout;
}

}  // namespace mxddp
