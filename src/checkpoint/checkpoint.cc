// save_checkpoint / load_checkpoint / inspect_checkpoint: see checkpoint.h.
//
// Every step that can fail on one rank is followed by agree(): the ranks learn together whether
// any of them failed, so they never split into some that committed and some that did not, and
// never wait at a barrier for a rank that has already thrown.
#include <array>
#include <cstring>
#include <filesystem>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <mxddp/checkpoint.h>

#include "file_io.h"
#include "safetensors.h"

namespace mxddp {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "mxddp-checkpoint";
constexpr int kVersion = 1;

std::string rank_file_name(int rank) { return fmt::format("rank_{:05d}.safetensors", rank); }
std::string slice_name(std::string_view kind, const std::string& param, const Range& r) {
  return fmt::format("{}/{}/{}-{}", kind, param, r.start, r.end);
}

// Runs fn on every rank; if it threw on any rank, every rank throws (the failing one its own
// error, the others an error quoting it), having done nothing further. The failing rank's message
// travels to every rank: whichever rank's error a launcher shows, the root cause is in it.
template <typename Fn>
void agreed(Communicator& comm, std::string_view what, Fn&& fn) {
  std::exception_ptr failure;
  std::string message;
  try {
    fn();
  } catch (const std::exception& e) {
    failure = std::current_exception();
    message = e.what();
  } catch (...) {
    failure = std::current_exception();
    message = "unknown exception";
  }
  float failed_rank_plus_one = failure ? static_cast<float>(comm.rank() + 1) : 0.0f;
  comm.all_reduce(TensorView{&failed_rank_plus_one, DType::kF32, Shape{1}, Device::cpu()}, {.op = ReduceOp::kMax});
  if (failed_rank_plus_one == 0.0f) return;
  const int root = static_cast<int>(failed_rank_plus_one) - 1;
  constexpr size_t kMessageBytesMax = 4096;
  std::array<char, kMessageBytesMax> text{};  // the root's message, NUL-padded
  if (comm.rank() == root) std::memcpy(text.data(), message.data(), std::min(message.size(), kMessageBytesMax - 1));
  comm.broadcast(TensorView{text.data(), DType::kU8, Shape{static_cast<int64_t>(text.size())}, Device::cpu()},
                 {.root = root});
  if (failure) std::rethrow_exception(failure);
  MXDDP_FAIL("{} failed on rank {}: {}; nothing was changed", what, root, text.data());
}

json shape_json(const Shape& s) {
  json j = json::array();
  for (int d = 0; d < s.ndim(); ++d) j.push_back(s[d]);
  return j;
}

Shape shape_from_json(const json& j) {
  MXDDP_CHECK(j.is_array() && j.size() <= static_cast<size_t>(Shape::kMaxDims), "bad shape {}", j.dump());
  std::vector<int64_t> d = j.get<std::vector<int64_t>>();
  switch (d.size()) {
    case 0: return Shape{};
    case 1: return Shape{d[0]};
    case 2: return Shape{d[0], d[1]};
    case 3: return Shape{d[0], d[1], d[2]};
    case 4: return Shape{d[0], d[1], d[2], d[3]};
    case 5: return Shape{d[0], d[1], d[2], d[3], d[4]};
    default: return Shape{d[0], d[1], d[2], d[3], d[4], d[5]};
  }
}

json config_json(const DistributedOptimizer& opt) {
  const OptimizerConfig& o = opt.config();
  json j = {{"optimizer", {{"optimizer", o.optimizer}, {"lr", o.lr}, {"weight_decay", o.weight_decay},
                           {"adam_beta1", o.adam_beta1}, {"adam_beta2", o.adam_beta2}, {"adam_eps", o.adam_eps},
                           {"sgd_momentum", o.sgd_momentum}, {"clip_grad", o.clip_grad}}},
            {"data_parallel", opt.data_parallel().describe()}};
  // What the layout was computed from; a load recomputes its own and reshards to it.
  if (const auto* ddp = dynamic_cast<const DistributedDataParallel*>(&opt.data_parallel())) {
    const DdpConfig& d = ddp->config();
    j["ddp"] = {{"grad_reduce_in_fp32", d.grad_reduce_in_fp32}, {"overlap_grad_reduce", d.overlap_grad_reduce},
                {"use_distributed_optimizer", d.use_distributed_optimizer},
                {"bucket_size", d.bucket_size ? json(*d.bucket_size) : json(nullptr)},
                {"pad_buckets_for_high_nccl_busbw", d.pad_buckets_for_high_nccl_busbw},
                {"average_in_collective", d.average_in_collective},
                {"overlap_param_gather", d.overlap_param_gather}, {"param_dtype", dtype_name(d.param_dtype)}};
  }
  return j;
}

// This rank's file: every slice of its shards, for the main params, each state and the model.
// The model slices are cast from the main params here rather than copied from where the optimizer
// stages them: that memory is grad memory under MXFP8 reuse (zeroed once quantized), and after a
// forced param sync the model params are exactly this cast in every mode.
std::vector<char> encode_rank_file(const DistributedOptimizer& opt) {
  const DataParallel& dp = opt.data_parallel();
  const int rank = dp.communicator().rank();
  const DType model_dtype = dp.param_dtype();
  MXDDP_CHECK(model_dtype == DType::kBF16 || model_dtype == DType::kF32,
              "checkpoints store model params as bf16 or f32; this model's are {}", dtype_name(model_dtype));
  std::vector<ckpt::TensorToWrite> tensors;
  std::vector<std::vector<bf16_bits>> model_bf16;  // [owned slices] kept alive until encoded
  for (int b = 0; b < opt.num_buckets(); ++b) {
    for (const ShardParamRange& r : opt.bucket(b).owned) {
      const std::string& name = dp.params()[static_cast<size_t>(r.param)].name;
      const int64_t n = r.in_shard.size();
      tensors.push_back({slice_name("main", name, r.in_param), DType::kF32, n,
                         opt.main_params(static_cast<int>(b)).data_as<const float>() + r.in_shard.start});
      for (int s = 0; s < opt.state_count(); ++s)
        tensors.push_back({slice_name(opt.state_name(s), name, r.in_param), DType::kF32, n,
                           opt.state(s, static_cast<int>(b)).data_as<const float>() + r.in_shard.start});
      const float* main = opt.main_params(static_cast<int>(b)).data_as<const float>() + r.in_shard.start;
      if (model_dtype == DType::kF32) {
        tensors.push_back({slice_name("model", name, r.in_param), DType::kF32, n, main});
      } else {
        std::vector<bf16_bits>& cast = model_bf16.emplace_back(static_cast<size_t>(n));
        convert_f32_to_bf16(main, cast.data(), static_cast<size_t>(n));
        tensors.push_back({slice_name("model", name, r.in_param), DType::kBF16, n, cast.data()});
      }
    }
  }
  return ckpt::encode_safetensors(tensors, {{"format", kFormat}, {"rank", std::to_string(rank)}});
}

std::string manifest_path(const std::string& dir) { return (fs::path(dir) / "manifest.json").string(); }

// Runs fn, which reads fields of dir's manifest. A damaged or edited manifest (one flipped byte in
// a key) makes nlohmann::json throw its own exception, which names neither the file nor what is
// expected; this adds both.
template <typename Fn>
decltype(auto) with_manifest_context(const std::string& dir, Fn&& fn) {
  try {
    return fn();
  } catch (const json::exception& e) {
    MXDDP_FAIL("checkpoint manifest '{}' is malformed: {}; it must be the manifest.json mxddp saved, unedited",
               manifest_path(dir), e.what());
  }
}

json read_manifest(const std::string& dir) {
  const std::string path = manifest_path(dir);
  MXDDP_CHECK(fs::exists(path), "'{}' is not a checkpoint: no manifest.json (an interrupted save leaves "
              "'{}.partial' instead)", dir, dir);
  const std::vector<char> bytes = ckpt::read_file(path);
  json m;
  try {
    m = json::parse(bytes.begin(), bytes.end());
  } catch (const std::exception& e) {
    MXDDP_FAIL("'{}' is not valid JSON: {}", path, e.what());
  }
  MXDDP_CHECK(m.value("format", "") == kFormat && m.value("version", 0) == kVersion,
              "'{}' is not an mxddp checkpoint manifest of version {} (format '{}', version {})", path, kVersion,
              m.value("format", ""), m.value("version", 0));
  return m;
}

// Reads a file named in the manifest and checks its size and checksum. Throws naming the problem.
std::vector<char> read_verified(const std::string& dir, const json& file_entry) {
  const std::string name = file_entry.at("name").get<std::string>();
  const std::string path = (fs::path(dir) / name).string();
  MXDDP_CHECK(fs::exists(path), "checkpoint file '{}' is missing", path);
  std::vector<char> bytes = ckpt::read_file(path);
  const auto want_size = file_entry.at("bytes").get<int64_t>();
  MXDDP_CHECK(static_cast<int64_t>(bytes.size()) == want_size, "checkpoint file '{}' is {} bytes; the manifest says "
              "{} (truncated or replaced)", path, bytes.size(), want_size);
  const auto want_crc = file_entry.at("crc32").get<uint32_t>();
  const uint32_t crc = ckpt::crc32_of(bytes);
  MXDDP_CHECK(crc == want_crc, "checkpoint file '{}' is corrupted: CRC-32 {:08x}, the manifest says {:08x}", path, crc,
              want_crc);
  return bytes;
}

// A save publishes D in two renames: D -> D.old, then D.partial -> D (a non-empty directory cannot
// be replaced in one). A kill between them leaves no D, the previous checkpoint intact in D.old and
// the new one complete in D.partial (its manifest is written last, after every rank file). Readers
// take the newest intact copy without changing anything; the next save restores it to D first, so
// no later run deletes the only intact copy.
bool has_manifest(const std::string& dir) { return fs::is_regular_file(fs::path(dir) / "manifest.json"); }

std::string checkpoint_to_read(const std::string& dir) {
  if (fs::exists(dir)) return dir;
  if (has_manifest(dir + ".partial")) return dir + ".partial";
  if (has_manifest(dir + ".old")) return dir + ".old";
  return dir;  // read_manifest names what is missing
}

// Rank 0, before a save: an interrupted publish is completed or rolled back, so D is the newest
// intact checkpoint (or absent) before D.partial is cleared for the new save.
void recover_interrupted_publish(const std::string& dir) {
  if (fs::exists(dir)) return;
  if (has_manifest(dir + ".partial")) fs::rename(dir + ".partial", dir);
  else if (has_manifest(dir + ".old")) fs::rename(dir + ".old", dir);
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

}  // namespace

void save_checkpoint(const std::string& dir, DistributedOptimizer& opt, const SaveOptions& options) {
  Communicator& comm = opt.data_parallel().communicator();
  const DataParallel& buf = opt.data_parallel();
  const std::string partial = dir + ".partial";
  opt.force_param_sync();
  agreed(comm, "checkpoint save (preparing the directory)", [&] {
    if (comm.rank() != 0) return;
    recover_interrupted_publish(dir);
    MXDDP_CHECK(options.overwrite || !fs::exists(dir), "'{}' already exists; pass overwrite to replace it", dir);
    fs::remove_all(partial);
    fs::create_directories(partial);
  });
  // Each rank writes its file and shares (size, crc) with the others.
  int64_t info[2] = {0, 0};  // bytes, crc32
  agreed(comm, "checkpoint save (writing rank files)", [&] {
    const std::vector<char> bytes = encode_rank_file(opt);
    ckpt::write_file_atomic((fs::path(partial) / rank_file_name(comm.rank())).string(), bytes);
    info[0] = static_cast<int64_t>(bytes.size());
    info[1] = ckpt::crc32_of(bytes);
  });
  std::vector<int64_t> infos(static_cast<size_t>(2 * comm.size()));
  comm.all_gather(TensorView{info, DType::kU8, Shape{16}, Device::cpu()},
                  TensorView{infos.data(), DType::kU8, Shape{16 * comm.size()}, Device::cpu()});
  agreed(comm, "checkpoint save (manifest)", [&] {
    if (comm.rank() != 0) return;
    json m = config_json(opt);
    m["format"] = kFormat;
    m["version"] = kVersion;
    m["step"] = opt.step_count();
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
      m["params"].push_back({{"name", spec.name}, {"shape", shape_json(spec.shape)},
                             {"shared_embedding", spec.shared_embedding}, {"slices", slices}});
    }
    m["files"] = json::array();
    for (int r = 0; r < comm.size(); ++r)
      m["files"].push_back({{"name", rank_file_name(r)}, {"bytes", infos[static_cast<size_t>(2 * r)]},
                            {"crc32", static_cast<uint32_t>(infos[static_cast<size_t>(2 * r + 1)])}});
    m["metadata"] = options.metadata;
    const std::string text = m.dump(1);
    ckpt::write_file_atomic((fs::path(partial) / "manifest.json").string(), std::vector<char>(text.begin(), text.end()));
    publish(partial, dir, options.overwrite);
  });
}

std::map<std::string, std::string> load_checkpoint(const std::string& requested_dir, DistributedOptimizer& opt) {
  const std::string dir = checkpoint_to_read(requested_dir);
  Communicator& comm = opt.data_parallel().communicator();
  const DataParallel& buf = opt.data_parallel();
  const size_t num_buckets = buf.layout().buckets.size();
  // Staging: [bucket] main and [state][bucket], shard-sized, padding zero. Nothing live changes
  // until every rank has everything.
  std::vector<std::vector<float>> main(num_buckets);
  std::vector<std::vector<std::vector<float>>> state(static_cast<size_t>(opt.state_count()), main);
  std::map<std::string, std::string> metadata;
  int64_t step = 0;
  // Reads and checks everything into the staging above; changes nothing live.
  const auto stage = [&] {
    const json m = read_manifest(dir);
    const auto& saved_params = m.at("params");
    MXDDP_CHECK(saved_params.size() == buf.params().size(), "'{}' holds {} params; this model has {}", dir,
                saved_params.size(), buf.params().size());
    for (size_t p = 0; p < saved_params.size(); ++p) {
      const std::string name = saved_params[p].at("name").get<std::string>();
      const Shape shape = shape_from_json(saved_params[p].at("shape"));
      const ParamSpec& spec = buf.params()[p];
      MXDDP_CHECK(name == spec.name && shape == spec.shape, "param {} of '{}' is '{}' {}; this model's is '{}' {}", p, dir,
                  name, shape.to_string(), spec.name, spec.shape.to_string());
    }
    std::vector<std::string> state_names = m.at("state_names").get<std::vector<std::string>>();
    MXDDP_CHECK(static_cast<int>(state_names.size()) == opt.state_count() &&
                    (state_names.empty() || state_names[0] == opt.state_name(0)),
                "'{}' holds state of optimizer '{}'; this optimizer is '{}'", dir,
                m.at("optimizer").value("optimizer", "?"), opt.config().optimizer);
    // Which files hold the slices this rank's shards need.
    std::map<std::string, json> file_entries;
    for (const json& f : m.at("files")) file_entries[f.at("name").get<std::string>()] = f;
    std::map<std::string, std::vector<char>> files;
    std::map<std::string, std::map<std::string, ckpt::TensorEntry>> headers;
    auto file = [&](const std::string& name) -> const std::vector<char>& {
      if (!files.count(name)) {
        MXDDP_CHECK(file_entries.count(name), "'{}' names file '{}' for a slice but not in its file list", dir, name);
        files[name] = read_verified(dir, file_entries[name]);
        headers[name] = ckpt::decode_safetensors(files[name], name);
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
        for (const json& slice : saved_params[static_cast<size_t>(need.param)].at("slices")) {
          const Range have{slice.at("start").get<int64_t>(), slice.at("end").get<int64_t>()};
          const int64_t lo = std::max(have.start, need.in_param.start), hi = std::min(have.end, need.in_param.end);
          if (lo >= hi) continue;
          const std::string fname = slice.at("file").get<std::string>();
          const std::vector<char>& bytes = file(fname);
          auto copy = [&](std::string_view kind, std::vector<float>& dst) {
            const std::string tname = slice_name(kind, name, have);
            const auto it = headers[fname].find(tname);
            MXDDP_CHECK(it != headers[fname].end() && it->second.dtype == DType::kF32 && it->second.numel == have.size(),
                        "'{}' lacks f32 tensor '{}' of {} elements", fname, tname, have.size());
            std::memcpy(dst.data() + (need.in_shard.start + lo - need.in_param.start),
                        bytes.data() + it->second.offset + static_cast<size_t>(lo - have.start) * sizeof(float),
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
    step = m.at("step").get<int64_t>();
    metadata = m.value("metadata", std::map<std::string, std::string>{});
  };
  agreed(comm, "checkpoint load", [&] { with_manifest_context(dir, stage); });
  // Commit: every rank has everything.
  for (size_t b = 0; b < num_buckets; ++b) {
    std::memcpy(opt.main_params(static_cast<int>(b)).data, main[b].data(), main[b].size() * sizeof(float));
    for (int s = 0; s < opt.state_count(); ++s)
      std::memcpy(opt.state(s, static_cast<int>(b)).data, state[static_cast<size_t>(s)][b].data(),
                  main[b].size() * sizeof(float));
  }
  opt.set_step_count(step);
  opt.force_param_sync();
  return metadata;
}

bool CheckpointInfo::ok() const {
  for (const CheckpointFileInfo& f : files)
    if (f.status != "ok") return false;
  return true;
}

namespace {

CheckpointInfo inspect_manifest(const std::string& dir) {
  const json m = read_manifest(dir);
  CheckpointInfo info;
  info.step = m.at("step").get<int64_t>();
  info.saved_dp = m.at("dp").get<int>();
  info.optimizer = m.at("optimizer").value("optimizer", "?");
  info.metadata = m.value("metadata", std::map<std::string, std::string>{});
  for (const json& p : m.at("params"))
    info.params.push_back({p.at("name").get<std::string>(), shape_from_json(p.at("shape")),
                           static_cast<int>(p.at("slices").size())});
  for (const json& f : m.at("files")) {
    CheckpointFileInfo fi{f.at("name").get<std::string>(), f.at("bytes").get<int64_t>(), f.at("crc32").get<uint32_t>(), "ok"};
    try {
      read_verified(dir, f);
    } catch (const Error& e) {
      fi.status = e.message();
    }
    info.files.push_back(fi);
  }
  return info;
}

}  // namespace

CheckpointInfo inspect_checkpoint(const std::string& requested_dir) {
  const std::string dir = checkpoint_to_read(requested_dir);
  return with_manifest_context(dir, [&] { return inspect_manifest(dir); });
}

}  // namespace mxddp
