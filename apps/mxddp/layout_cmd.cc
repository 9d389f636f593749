// `mxddp layout`: see layout_cmd.h.
#include "layout_cmd.h"

#include <cstdio>
#include <limits>

#include <nlohmann/json.hpp>

#include <mxddp/buffer.h>

#include "cli_checks.h"

namespace mxddp::app {

namespace {

// The layout lists every rank's shards, so its memory and output grow with dp; 65536 ranks is past
// the data-parallel size of the largest jobs run today.
constexpr int64_t kLayoutDpMax = 65536;

// The layout's params are the --shapes list, named p0, p1, ... in order.
std::vector<ParamSpec> param_specs(const std::string& shapes) {
  std::vector<ParamSpec> params;
  for (const Shape& shape : parse_shape_list(shapes)) params.push_back({fmt::format("p{}", params.size()), shape, false});
  return params;
}

nlohmann::json to_json(const std::vector<ParamSpec>& specs, const ParamLayout& layout) {
  using nlohmann::json;
  json j;
  j["dp"] = layout.options.dp;
  j["bucket_size"] = layout.options.bucket_size ? json(*layout.options.bucket_size) : json(nullptr);
  j["use_distributed_optimizer"] = layout.options.use_distributed_optimizer;
  j["pad_buckets_for_high_nccl_busbw"] = layout.options.pad_buckets_for_high_nccl_busbw;
  j["numel"] = layout.numel;
  j["numel_unpadded"] = layout.numel_unpadded();  // Megatron's: the buckets' numel_unpadded summed
  j["params_numel"] = layout.params_numel();       // the params' own elements
  j["params"] = json::array();
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamPlacement& p = layout.params[i];
    std::vector<int64_t> shape;
    for (int d = 0; d < specs[i].shape.ndim(); ++d) shape.push_back(specs[i].shape[d]);
    j["params"].push_back({{"index", i}, {"name", specs[i].name}, {"shape", shape},
                           {"shared_embedding", specs[i].shared_embedding}, {"start", p.range.start},
                           {"end", p.range.end}, {"bucket", p.bucket}});
  }
  j["buckets"] = json::array();
  for (const BucketPlacement& b : layout.buckets)
    j["buckets"].push_back({{"start", b.range.start}, {"end", b.range.end}, {"numel_unpadded", b.numel_unpadded},
                            {"params", b.params}});
  j["shards"] = json::array();
  for (const auto& rank_shards : layout.shards) {
    json per_bucket = json::array();
    for (const BucketShard& s : rank_shards) {
      json params = json::array();
      for (const ShardParamRange& r : s.params)
        params.push_back({{"param", r.param},
                          {"buffer", {r.in_buffer.start, r.in_buffer.end}},
                          {"param_range", {r.in_param.start, r.in_param.end}},
                          {"shard_range", {r.in_shard.start, r.in_shard.end}}});
      per_bucket.push_back({{"start", s.range.start}, {"end", s.range.end}, {"params", params}});
    }
    j["shards"].push_back(per_bucket);
  }
  return j;
}

void print_table(const std::vector<ParamSpec>& specs, const ParamLayout& layout) {
  const LayoutOptions& o = layout.options;
  std::printf("layout: dp %d, bucket_size %s, distributed optimizer %s, busbw padding %s\n", o.dp,
              o.bucket_size ? std::to_string(*o.bucket_size).c_str() : "none (one bucket)",
              o.use_distributed_optimizer ? "on" : "off", o.pad_buckets_for_high_nccl_busbw ? "on" : "off");
  std::printf("buffer: %lld elements (%lld of params, %lld of padding), numel_unpadded %lld (Megatron's: the buckets' "
              "numel_unpadded summed)\n\n",
              static_cast<long long>(layout.numel), static_cast<long long>(layout.params_numel()),
              static_cast<long long>(layout.numel - layout.params_numel()), static_cast<long long>(layout.numel_unpadded()));
  std::printf("%-6s %-8s %-16s %12s %12s %12s %7s\n", "index", "name", "shape", "numel", "start", "end", "bucket");
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamPlacement& p = layout.params[i];
    std::printf("%-6zu %-8s %-16s %12lld %12lld %12lld %7d%s\n", i, specs[i].name.c_str(),
                specs[i].shape.to_string().c_str(), static_cast<long long>(p.range.size()),
                static_cast<long long>(p.range.start), static_cast<long long>(p.range.end), p.bucket,
                specs[i].shared_embedding ? "  shared embedding" : "");
  }
  std::printf("\n%-7s %12s %12s %12s %15s %9s\n", "bucket", "start", "end", "numel", "numel_unpadded", "padding");
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const BucketPlacement& k = layout.buckets[b];
    std::printf("%-7zu %12lld %12lld %12lld %15lld %9lld\n", b, static_cast<long long>(k.range.start),
                static_cast<long long>(k.range.end), static_cast<long long>(k.range.size()),
                static_cast<long long>(k.numel_unpadded), static_cast<long long>(k.range.size() - k.numel_unpadded));
  }
  if (layout.shards.empty()) return;
  std::printf("\nshards (rank, bucket: buffer range <- param[param range])\n");
  for (size_t r = 0; r < layout.shards.size(); ++r)
    for (size_t b = 0; b < layout.shards[r].size(); ++b) {
      const BucketShard& s = layout.shards[r][b];
      std::printf("rank %zu bucket %zu [%lld, %lld):", r, b, static_cast<long long>(s.range.start),
                  static_cast<long long>(s.range.end));
      for (const ShardParamRange& p : s.params)
        std::printf(" %s[%lld, %lld)", specs[static_cast<size_t>(p.param)].name.c_str(),
                    static_cast<long long>(p.in_param.start), static_cast<long long>(p.in_param.end));
      std::printf("\n");
    }
}

}  // namespace

CLI::App* add_layout_command(CLI::App& app, LayoutArgs& args) {
  auto* cmd = app.add_subcommand("layout", "Print the parameter-and-gradient buffer layout of a param list");
  cmd->add_option("--shapes", args.shapes, "Param shapes in registration order, e.g. 95x95,95")->required();
  cmd->add_option("--dp", args.dp, "Data-parallel size")->transform(integer_in(1, kLayoutDpMax))->capture_default_str();
  cmd->add_option("--bucket-size", args.bucket_size,
                  "Bucket size in elements, 'none' (one bucket) or 'default' (max(4e7, 1e6 x dp))")
      ->capture_default_str();
  cmd->add_flag("--use-distributed-optimizer", args.use_distributed_optimizer, "Pad for the distributed optimizer and shard");
  cmd->add_flag("--pad-buckets-for-high-nccl-busbw", args.pad_buckets_for_high_nccl_busbw,
                "Pad bucket ends to lcm(dp, 128, 65536)");
  cmd->add_option("--shared-embedding", args.shared_embedding, "Index of a param that is a shared embedding (repeatable)")
      ->transform(integer_in(0, std::numeric_limits<int>::max()));
  cmd->add_flag("--json", args.json, "Print JSON instead of tables");
  return cmd;
}

void run_layout_command(const LayoutArgs& args) {
  std::vector<ParamSpec> specs = param_specs(args.shapes);
  for (int index : args.shared_embedding) {
    MXDDP_CHECK(index >= 0 && static_cast<size_t>(index) < specs.size(),
                "--shared-embedding {} is not a param index; valid: 0..{}", index, specs.size() - 1);
    specs[static_cast<size_t>(index)].shared_embedding = true;
  }
  MXDDP_CHECK(args.dp >= 1, "--dp must be >= 1; got {}", args.dp);
  LayoutOptions options;
  options.dp = args.dp;
  options.use_distributed_optimizer = args.use_distributed_optimizer;
  options.pad_buckets_for_high_nccl_busbw = args.pad_buckets_for_high_nccl_busbw;
  if (args.bucket_size == "default") options.bucket_size = default_bucket_size(args.dp, true);
  else if (args.bucket_size != "none")
    options.bucket_size = parse_integer(args.bucket_size, "--bucket-size (or 'none' or 'default')", 1,
                                        std::numeric_limits<int64_t>::max());
  const ParamLayout layout = compute_param_layout(specs, options);
  if (args.json) std::printf("%s\n", to_json(specs, layout).dump(2).c_str());
  else print_table(specs, layout);
}

}  // namespace mxddp::app
