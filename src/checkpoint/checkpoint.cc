// save_checkpoint / load_checkpoint: see checkpoint.h. The manifest's format and the checks a
// checkpoint must pass are in manifest.h, shared with inspect_checkpoint (inspect.cc).
//
// Every step that can fail on one rank is followed by agree(): the ranks learn together whether
// any of them failed, so they never split into some that committed and some that did not, and
// never wait at a barrier for a rank that has already thrown.
#include <algorithm>
#include <charconv>
#include <array>
#include <chrono>
#include <exception>
#include <cstring>
#include <filesystem>
#include <random>
#include <variant>
#include <unistd.h>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <mxddp/checkpoint.h>
#include <mxddp/fsdp.h>

#include "agreed.h"
#include "file_io.h"
#include "manifest.h"
#include "safetensors.h"

namespace mxddp {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using ckpt::rank_file_name;
using ckpt::slice_name;
using ckpt::agreed;

json shape_json(const Shape& s) {
  json j = json::array();
  for (int d = 0; d < s.ndim(); ++d) j.push_back(s[d]);
  return j;
}

// A described config (config_fields.h) as a JSON object: every field under its name.
template <typename Config>
json fields_json(const Config& config) {
  json j = json::object();
  for (const auto& [name, value] : field_values(config))
    std::visit([&j, key = std::string(name)](const auto& v) { j[key] = v; }, value);
  return j;
}

// Informational on load except optimizer.optimizer (read_manifest): every described field of the
// optimizer's and the DDP's (with DDP) or FSDP's (with FSDP) config, under the names the report uses.
json config_json(const DistributedOptimizer& opt) {
  json j = {{"optimizer", fields_json(opt.config())}, {"data_parallel", opt.data_parallel().describe()}};
  // What the layout was computed from; a load recomputes its own and reshards to it.
  if (const auto* ddp = dynamic_cast<const DistributedDataParallel*>(&opt.data_parallel()))
    j["ddp"] = fields_json(ddp->config());
  if (const auto* fsdp = dynamic_cast<const FullyShardedDataParallel*>(&opt.data_parallel()))
    j["fsdp"] = fields_json(fsdp->config());
  return j;
}

// The element format of the DataParallel's MXFP8 params (DDP's or FSDP's config).
Fp8Format mxfp8_elem(const DataParallel& dp) {
  if (const auto* ddp = dynamic_cast<const DistributedDataParallel*>(&dp)) return ddp->config().mxfp8_elem;
  if (const auto* fsdp = dynamic_cast<const FullyShardedDataParallel*>(&dp)) return fsdp->config().mxfp8_elem;
  MXDDP_FAIL("a checkpoint of MXFP8 params needs DDP or FSDP to name their element format; got '{}'", dp.describe());
}

// This rank's file: every slice of its shards, for the main params, each state and the model.
// The model slices are cast from the main params here rather than copied from where the optimizer
// stages them: that memory is grad memory under MXFP8 reuse (zeroed once quantized), and after a
// forced param sync the model params are exactly this cast in every mode.
std::vector<char> encode_rank_file(const DistributedOptimizer& opt, const std::string& save_id) {
  const DataParallel& dp = opt.data_parallel();
  const int rank = dp.communicator().rank();
  const DType model_dtype = dp.param_dtype();
  MXDDP_CHECK(model_dtype == DType::kBF16 || model_dtype == DType::kF32,
              "checkpoints store model params as bf16 or f32; this model's are {}", dtype_name(model_dtype));
  std::vector<ckpt::TensorToWrite> tensors;
  std::vector<std::vector<bf16_bits>> model_bf16;  // [owned slices] kept alive until encoded
  // Host memory is read in place; a device's main params and states are copied to the host first
  // (through the data-parallel object's compute), kept alive until encoded.
  std::vector<std::vector<float>> from_device;
  auto on_host = [&](const TensorView& v) -> const float* {
    if (v.device.is_cpu()) return v.data_as<const float>();
    std::vector<float>& copy = from_device.emplace_back(static_cast<size_t>(v.numel()));
    dp.compute().copy_to_host(copy.data(), v.data, v.nbytes());
    return copy.data();
  };
  for (int b = 0; b < opt.num_buckets(); ++b) {
    const float* bucket_main = on_host(opt.main_params(b));
    std::vector<const float*> bucket_state;
    for (int s = 0; s < opt.state_count(); ++s) bucket_state.push_back(on_host(opt.state(s, b)));
    for (const ShardParamRange& r : opt.bucket(b).owned) {
      const std::string& name = dp.params()[static_cast<size_t>(r.param)].name;
      const int64_t n = r.in_shard.size();
      tensors.push_back({slice_name("main", name, r.in_param), DType::kF32, n, bucket_main + r.in_shard.start});
      for (int s = 0; s < opt.state_count(); ++s)
        tensors.push_back({slice_name(opt.state_name(s), name, r.in_param), DType::kF32, n,
                           bucket_state[static_cast<size_t>(s)] + r.in_shard.start});
      const float* main = bucket_main + r.in_shard.start;
      if (model_dtype == DType::kF32) {
        tensors.push_back({slice_name("model", name, r.in_param), DType::kF32, n, main});
      } else {
        std::vector<bf16_bits>& cast = model_bf16.emplace_back(static_cast<size_t>(n));
        convert_f32_to_bf16(main, cast.data(), static_cast<size_t>(n));
        tensors.push_back({slice_name("model", name, r.in_param), DType::kBF16, n, cast.data()});
      }
    }
  }
  return ckpt::encode_safetensors(
      tensors, {{"format", ckpt::kManifestFormat}, {"rank", std::to_string(rank)}, {"save_id", save_id}});
}

void publish(const std::string& partial, const std::string& dir, bool overwrite) {
  const fs::path target(dir);
  if (fs::exists(target)) {
    MXDDP_CHECK(overwrite, "'{}' already exists; pass overwrite to replace it", dir);
    const std::string old = dir + ".old";
    fs::remove_all(old);
    fs::rename(target, old);
    fs::rename(partial, target);
    fs::remove_all(old);
  } else {
    fs::rename(partial, target);
  }
  ckpt::fsync_directory(fs::absolute(target).parent_path().string());
}

// Removes D.partial (on rank 0) when a save fails after creating it, as from a full disk or a
// file-size limit, so that a failed save leaves nothing; by then every rank has stopped writing,
// since agreed() throws on every rank only after all of them ran.
class RemovePartialOnFailure {
 public:
  RemovePartialOnFailure(std::string partial, bool owner) : partial_(std::move(partial)), owner_(owner) {}
  ~RemovePartialOnFailure() {
    if (!owner_ || std::uncaught_exceptions() == exceptions_) return;
    std::error_code ec;
    fs::remove_all(partial_, ec);
  }

 private:
  std::string partial_;
  bool owner_;
  int exceptions_ = std::uncaught_exceptions();
};

}  // namespace

void save_checkpoint(const std::string& dir, DistributedOptimizer& opt, const SaveOptions& options) {
  Communicator& comm = opt.data_parallel().communicator();
  const DataParallel& buf = opt.data_parallel();
  const std::string partial = dir + ".partial";
  opt.force_param_sync();
  agreed(comm, "checkpoint save (preparing the directory)", [&] {
    if (comm.rank() != 0) return;
    ckpt::recover_interrupted_publish(dir);  // D is then the newest intact copy, before D.partial is cleared
    MXDDP_CHECK(options.overwrite || !fs::exists(dir), "'{}' already exists; pass overwrite to replace it", dir);
    fs::remove_all(partial);
    fs::create_directories(partial);
  });
  const RemovePartialOnFailure remove_partial_on_failure(partial, comm.rank() == 0);
  // One id for this save, in the manifest and in every rank file, so that a rank file from another
  // save (of the same model, with its CRC fixed in the manifest) is caught.
  uint64_t save_id = 0;
  if (comm.rank() == 0) save_id = (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}() ^
                                  static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  broadcast_host(comm, TensorView{&save_id, DType::kU8, Shape{8}, Device::cpu()}, {.root = 0});
  const std::string save_id_text = fmt::format("{:016x}", save_id);
  // Each rank writes its file and shares (size, crc) with the others.
  int64_t info[2] = {0, 0};  // bytes, crc32
  agreed(comm, "checkpoint save (writing rank files)", [&] {
    const std::vector<char> bytes = encode_rank_file(opt, save_id_text);
    ckpt::write_file_atomic((fs::path(partial) / rank_file_name(comm.rank())).string(), bytes);
    info[0] = static_cast<int64_t>(bytes.size());
    info[1] = ckpt::crc32_of(bytes);
  });
  std::vector<int64_t> infos(static_cast<size_t>(2 * comm.size()));
  all_gather_host(comm, TensorView{info, DType::kU8, Shape{16}, Device::cpu()},
                        TensorView{infos.data(), DType::kU8, Shape{16 * comm.size()}, Device::cpu()});
  agreed(comm, "checkpoint save (manifest)", [&] {
    if (comm.rank() != 0) return;
    json m = config_json(opt);
    m["format"] = ckpt::kManifestFormat;
    m["version"] = ckpt::kManifestVersion;
    m["step"] = opt.step_count();
    m["save_id"] = save_id_text;
    m["model_dtype"] = dtype_name(buf.param_dtype());
    m["model_config"] = ckpt::config_fields_json(options.model_config);
    m["dp"] = comm.size();
    m["state_names"] = json::array();
    for (int s = 0; s < opt.state_count(); ++s) m["state_names"].push_back(opt.state_name(s));
    m["layout"] = {{"numel", buf.layout().numel}, {"buckets", json::array()}};
    for (const BucketPlacement& b : buf.layout().buckets) m["layout"]["buckets"].push_back({b.range.start, b.range.end});
    m["params"] = json::array();
    for (size_t p = 0; p < buf.params().size(); ++p) {
      json slices = json::array();
      for (int r = 0; r < comm.size(); ++r)
        for (const BucketShard& shard : buf.layout().shards[static_cast<size_t>(r)])
          for (const ShardParamRange& sp : shard.params)
            if (sp.param == static_cast<int>(p))
              slices.push_back({{"file", rank_file_name(r)}, {"start", sp.in_param.start}, {"end", sp.in_param.end}});
      const ParamSpec& spec = buf.params()[p];
      json param = {{"name", spec.name}, {"shape", shape_json(spec.shape)}, {"shared_embedding", spec.shared_embedding},
                    {"slices", slices}, {"step", opt.param_step(static_cast<int>(p))}};
      // An MXFP8 param trains as MXFP8 but is saved, like the others, as model_dtype (cast from
      // its main params); this says what it was, for inspect.
      if (buf.is_mxfp8(static_cast<int>(p))) param["mxfp8_elem"] = fp8_format_name(mxfp8_elem(buf));
      m["params"].push_back(std::move(param));
    }
    m["files"] = json::array();
    for (int r = 0; r < comm.size(); ++r)
      m["files"].push_back({{"name", rank_file_name(r)}, {"bytes", infos[static_cast<size_t>(2 * r)]},
                            {"crc32", static_cast<uint32_t>(infos[static_cast<size_t>(2 * r + 1)])}});
    m["metadata"] = options.metadata;
    const std::string text = ckpt::seal_manifest(std::move(m));
    ckpt::write_file_atomic((fs::path(partial) / "manifest.json").string(), std::vector<char>(text.begin(), text.end()));
    publish(partial, dir, options.overwrite);
  });
}

namespace {

// Throws with every problem the shared checks found, naming the checkpoint.
void check_no_problems(const std::string& dir, const std::vector<std::string>& problems) {
  MXDDP_CHECK(problems.empty(), "checkpoint '{}' is damaged: {}", dir, fmt::join(problems, "; "));
}

}  // namespace

int64_t checkpoint_metadata_count(const std::map<std::string, std::string>& metadata, const std::string& key,
                                  const std::string& dir) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) {
    std::vector<std::string> keys;  // (a loop: views::keys does not build with clang on libstdc++ 12)
    for (const auto& entry : metadata) keys.push_back(entry.first);
    MXDDP_FAIL("checkpoint '{}' has no '{}' in its metadata (keys: [{}]); it was not saved by mxddp train or "
               "mxddp.torch", dir, key, fmt::join(keys, ", "));
  }
  const std::string& text = it->second;
  int64_t value = -1;
  // Digits only (from_chars takes no sign or spaces here: the first check), and within int64.
  const bool digits = !text.empty() && text[0] >= '0' && text[0] <= '9';
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value, 10);
  MXDDP_CHECK(digits && ec == std::errc() && end == text.data() + text.size(),
              "checkpoint '{}' has {} '{}' in its metadata; expected a non-negative integer", dir, key,
              text.substr(0, 64));
  return value;
}

std::map<std::string, std::string> load_checkpoint(const std::string& requested_dir, DistributedOptimizer& opt,
                                                   const LoadOptions& options) {
  const std::string dir = ckpt::checkpoint_to_read(requested_dir);
  Communicator& comm = opt.data_parallel().communicator();
  const DataParallel& buf = opt.data_parallel();
  const size_t num_buckets = buf.layout().buckets.size();
  // Staging: [bucket] main and [state][bucket], shard-sized, padding zero. Nothing live changes
  // until every rank has everything.
  std::vector<std::vector<float>> main(num_buckets);
  std::vector<std::vector<std::vector<float>>> state(static_cast<size_t>(opt.state_count()), main);
  std::map<std::string, std::string> metadata;
  int64_t step = 0;
  std::vector<int64_t> param_steps;  // [param], -1 where the save did not record one
  // Reads and checks everything into the staging above; changes nothing live.
  const auto stage = [&] {
    const ckpt::Manifest m = ckpt::read_manifest(dir);  // checksum first, then structure
    if (!options.model_config.empty()) {
      const std::string differences = ckpt::model_config_differences(m.model_config, options.model_config);
      MXDDP_CHECK(differences.empty(), "checkpoint '{}' was saved from another model: {}; load it into the model it "
                  "was saved from", dir, differences);
    }
    MXDDP_CHECK(m.params.size() == buf.params().size(), "'{}' holds {} params; this model has {}", dir,
                m.params.size(), buf.params().size());
    for (size_t p = 0; p < m.params.size(); ++p) {
      const ParamSpec& spec = buf.params()[p];
      MXDDP_CHECK(m.params[p].name == spec.name && m.params[p].shape == spec.shape &&
                      m.params[p].shared_embedding == spec.shared_embedding,
                  "param {} of '{}' is '{}' {}{}; this model's is '{}' {}{}", p, dir, m.params[p].name,
                  m.params[p].shape.to_string(), m.params[p].shared_embedding ? " (shared embedding)" : "", spec.name,
                  spec.shape.to_string(), spec.shared_embedding ? " (shared embedding)" : "");
    }
    // read_manifest checked the state names against the saved optimizer's: the name decides.
    MXDDP_CHECK(m.optimizer == optimizer_name(opt.config().optimizer),
                "'{}' was saved by optimizer '{}' with state [{}]; this optimizer is '{}' with state [{}]", dir,
                m.optimizer, fmt::join(m.state_names, ", "), optimizer_name(opt.config().optimizer),
                fmt::join(optimizer_state_names(opt.config().optimizer), ", "));
    check_no_problems(dir, ckpt::coverage_problems(m));
    if (comm.rank() == 0) check_no_problems(dir, ckpt::unlisted_rank_file_problems(dir, m));
    // The files that hold the slices this rank's shards need, each checked whole when first used.
    std::map<std::string, ckpt::RankFile> files;
    auto file = [&](const std::string& name) -> const ckpt::RankFile& {
      if (!files.count(name)) {
        const auto entry = std::find_if(m.files.begin(), m.files.end(), [&](const auto& f) { return f.name == name; });
        MXDDP_ASSERT(entry != m.files.end());  // read_manifest checked every slice's file is listed
        std::vector<std::string> problems;
        files[name] = ckpt::check_rank_file(dir, m, *entry, problems);
        check_no_problems(dir, problems);
      }
      return files[name];
    };
    for (size_t b = 0; b < num_buckets; ++b) {
      const OptimizerBucket& bucket = opt.bucket(static_cast<int>(b));
      main[b].assign(static_cast<size_t>(bucket.numel), 0.0f);
      for (auto& s : state) s[b].assign(static_cast<size_t>(bucket.numel), 0.0f);
      for (const ShardParamRange& need : bucket.update) {
        const std::string& name = buf.params()[static_cast<size_t>(need.param)].name;
        int64_t covered = 0;
        for (const ckpt::ManifestSlice& slice : m.params[static_cast<size_t>(need.param)].slices) {
          const Range& have = slice.range;
          const int64_t lo = std::max(have.start, need.in_param.start), hi = std::min(have.end, need.in_param.end);
          if (lo >= hi) continue;
          const ckpt::RankFile& rank_file = file(slice.file);
          auto copy = [&](std::string_view kind, std::vector<float>& dst) {
            // check_rank_file verified that this tensor exists, is f32 and has have.size() elements.
            const ckpt::TensorEntry& t = rank_file.tensors.at(slice_name(kind, name, have));
            std::memcpy(dst.data() + (need.in_shard.start + lo - need.in_param.start),
                        rank_file.bytes.data() + t.offset + static_cast<size_t>(lo - have.start) * sizeof(float),
                        static_cast<size_t>(hi - lo) * sizeof(float));
          };
          copy("main", main[b]);
          for (int s = 0; s < opt.state_count(); ++s) copy(opt.state_name(s), state[static_cast<size_t>(s)][b]);
          covered += hi - lo;
        }
        MXDDP_CHECK(covered == need.in_param.size(), "'{}' covers {} of the {} elements [{}, {}) of '{}' this rank needs",
                    dir, covered, need.in_param.size(), need.in_param.start, need.in_param.end, name);
      }
    }
    // Every listed file is checked by some rank, also those no rank needs (a load at another dp,
    // a rank holding only padding): file i by rank i % size unless that rank read it above, so a
    // load at the saved dp reads nothing twice. A load accepts what inspect accepts, no more.
    for (size_t i = static_cast<size_t>(comm.rank()); i < m.files.size(); i += static_cast<size_t>(comm.size())) {
      if (files.count(m.files[i].name)) continue;
      std::vector<std::string> problems;
      ckpt::check_rank_file(dir, m, m.files[i], problems);
      check_no_problems(dir, problems);
    }
    for (const std::string& key : options.count_metadata) checkpoint_metadata_count(m.metadata, key, dir);
    step = m.step;
    for (const ckpt::ManifestParam& p : m.params) param_steps.push_back(p.step);
    metadata = m.metadata;
  };
  agreed(comm, "checkpoint load", stage);
  // Commit: every rank has everything. Through the compute: the buffers may be a device's.
  Compute& compute = buf.compute();
  for (size_t b = 0; b < num_buckets; ++b) {
    compute.copy_from_host(opt.main_params(static_cast<int>(b)).data, main[b].data(), main[b].size() * sizeof(float));
    for (int s = 0; s < opt.state_count(); ++s)
      compute.copy_from_host(opt.state(s, static_cast<int>(b)).data, state[static_cast<size_t>(s)][b].data(),
                             main[b].size() * sizeof(float));
  }
  opt.set_step_count(step);  // every param's count too, then each one's own where the save has it
  for (size_t p = 0; p < param_steps.size(); ++p)
    if (param_steps[p] >= 0) opt.set_param_step(static_cast<int>(p), param_steps[p]);
  opt.force_param_sync();
  return metadata;
}

}  // namespace mxddp
