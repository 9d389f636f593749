// read_checkpoint_params and encode_checkpoint_params_safetensors (see checkpoint.h): the whole
// params of a checkpoint, for `mxddp ckpt export`. The checks are manifest.h's, the ones
// inspect_checkpoint and a load run; nothing here parses a manifest or a rank file itself.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <mxddp/checkpoint.h>

#include "manifest.h"
#include "safetensors.h"

namespace mxddp {

namespace fs = std::filesystem;

namespace {

// The f32 bytes the manifest's params need, or -1 when their count overflows int64.
int64_t main_param_bytes(const ckpt::Manifest& m) {
  try {
    int64_t bytes = 0;
    for (const ckpt::ManifestParam& p : m.params)
      bytes = checked_add(bytes, checked_mul(p.shape.numel(), int64_t{sizeof(float)}, "param bytes"), "param bytes");
    return bytes;
  } catch (const Error&) {
    return -1;
  }
}

// What the listed rank files hold on disk (a missing or unreadable one counts 0).
int64_t listed_file_bytes(const std::string& dir, const ckpt::Manifest& m) {
  uintmax_t bytes = 0;
  for (const ckpt::ManifestFile& f : m.files) {
    std::error_code ec;
    const uintmax_t size = fs::file_size(fs::path(dir) / f.name, ec);
    if (!ec) bytes += std::min<uintmax_t>(size, INT64_MAX - bytes);  // saturates at INT64_MAX
  }
  return static_cast<int64_t>(bytes);
}

}  // namespace

CheckpointParams read_checkpoint_params(const std::string& requested_dir) {
  CheckpointParams out;
  const std::string dir = ckpt::checkpoint_to_read(requested_dir);
  const ckpt::Manifest m = ckpt::read_manifest(dir);  // checksum first, then structure; throws
  out.info = ckpt::manifest_info(dir, m);  // the fields inspect_checkpoint reports, checks 3 and 5
  CheckpointInfo& info = out.info;
  std::vector<std::string> problems = std::move(info.problems);  // none remain when params are returned
  info.problems.clear();
  // A checkpoint whose files pass check_rank_file holds every slice's main params in f32, so its
  // files are at least main_param_bytes long. A manifest (with a recomputed checksum) can claim any
  // shapes: nothing is allocated unless the files could hold them. When they cannot, the file
  // checks below say which file is short or wrong.
  const int64_t need = main_param_bytes(m);
  const bool assemble = problems.empty() && need >= 0 && need <= listed_file_bytes(info.dir, m);
  if (assemble) {
    out.values.resize(m.params.size());
    for (size_t p = 0; p < m.params.size(); ++p) out.values[p].assign(static_cast<size_t>(m.params[p].shape.numel()), 0.0f);
  }
  // Each file once, checked whole (as inspect does), its main slices copied out, then released: at
  // most one rank file is in memory beside the params.
  for (const ckpt::ManifestFile& f : m.files) {
    std::vector<std::string> file_problems;
    const ckpt::RankFile file = ckpt::check_rank_file(info.dir, m, f, file_problems);
    info.files.push_back({f.name, f.size_bytes, f.crc32,
                          file_problems.empty() ? "ok" : fmt::format("{}", fmt::join(file_problems, "; "))});
    if (!file_problems.empty()) {
      problems.insert(problems.end(), file_problems.begin(), file_problems.end());
      continue;
    }
    if (!assemble) continue;
    for (size_t p = 0; p < m.params.size(); ++p)
      for (const ckpt::ManifestSlice& s : m.params[p].slices) {
        if (s.file != f.name) continue;
        // check_rank_file verified that this tensor exists, is f32 and has s.range.size() elements,
        // and coverage_problems that the range lies within the param.
        const ckpt::TensorEntry& t = file.tensors.at(ckpt::slice_name("main", m.params[p].name, s.range));
        std::memcpy(out.values[p].data() + s.range.start, file.bytes.data() + t.offset,
                    static_cast<size_t>(s.range.size()) * sizeof(float));
      }
  }
  if (problems.empty() && !assemble)  // unreachable by the argument above; kept as a plain refusal
    problems.push_back(fmt::format("its params need {} bytes of f32 main params; its rank files hold {}",
                                   need, listed_file_bytes(info.dir, m)));
  MXDDP_CHECK(problems.empty(), "checkpoint '{}' is damaged: {}", info.dir, fmt::join(problems, "; "));
  return out;
}

std::vector<char> encode_checkpoint_params_safetensors(const CheckpointParams& params, DType dtype,
                                                       const std::map<std::string, std::string>& extra_metadata) {
  MXDDP_CHECK(dtype == DType::kF32 || dtype == DType::kBF16, "whole params are exported as f32 or bf16; got {}",
              dtype_name(dtype));
  const CheckpointInfo& info = params.info;
  MXDDP_ASSERT(params.values.size() == info.params.size());
  std::map<std::string, std::string> metadata = {
      {"mxddp_model_config", ckpt::config_fields_json(info.model_config).dump()},
      {"mxddp_step", std::to_string(info.step)},
      {"mxddp_checkpoint_metadata", nlohmann::json(info.metadata).dump()},
      {"mxddp_dtype", std::string(dtype_name(dtype))},
      // Nothing about where the checkpoint lies or the dp it was saved at: the same params give the
      // same file.
      {"mxddp_source", dtype == DType::kF32 ? "main params (the optimizer's FP32 master copy), assembled whole"
                                            : "main params (the optimizer's FP32 master copy), assembled whole, "
                                              "rounded to bf16 (nearest even)"}};
  if (const auto it = info.metadata.find("iteration"); it != info.metadata.end()) metadata["mxddp_iteration"] = it->second;
  metadata[kExportMarkerKey] = "safetensors";
  for (const auto& [key, value] : extra_metadata) {
    MXDDP_CHECK(!metadata.count(key), "export metadata key '{}' is one mxddp sets itself", key);
    metadata[key] = value;
  }

  const size_t elem = dtype_size_bytes(dtype);
  nlohmann::json header = nlohmann::json::object();
  size_t offset = 0;
  for (size_t p = 0; p < info.params.size(); ++p) {
    const Shape& shape = info.params[p].shape;
    MXDDP_ASSERT(static_cast<int64_t>(params.values[p].size()) == shape.numel());
    nlohmann::json dims = nlohmann::json::array();
    for (int d = 0; d < shape.ndim(); ++d) dims.push_back(shape[d]);
    const size_t bytes = params.values[p].size() * elem;
    header[info.params[p].name] = {{"dtype", dtype == DType::kF32 ? "F32" : "BF16"}, {"shape", dims},
                                   {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data 8-byte aligned, as the format allows
  std::vector<char> file(8 + text.size() + offset);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) file[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  std::memcpy(file.data() + 8, text.data(), text.size());
  char* data = file.data() + 8 + text.size();
  std::vector<bf16_bits> cast;  // one param's bf16 values at a time
  for (const std::vector<float>& v : params.values) {
    const void* bytes = v.data();
    if (dtype == DType::kBF16) {
      cast.resize(v.size());
      convert_f32_to_bf16(v.data(), cast.data(), v.size());
      bytes = cast.data();
    }
    if (!v.empty()) std::memcpy(data, bytes, v.size() * elem);
    data += v.size() * elem;
  }
  return file;
}

bool is_marked_export(const std::string& path, const std::string& marker) {
  const auto metadata = ckpt::read_safetensors_metadata(path);
  if (!metadata) return false;
  const auto it = metadata->find(kExportMarkerKey);
  return it != metadata->end() && it->second == marker;
}

}  // namespace mxddp
