// The checkpoint manifest and the checks load and inspect share: see manifest.h.
#include "manifest.h"

#include <algorithm>
#include <filesystem>

#include <fmt/ranges.h>

#include <mxddp/checkpoint_history.h>
#include <mxddp/optim.h>

#include "file_io.h"
#include "json_int.h"
#include "printable.h"

namespace mxddp::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kChecksumKey = "manifest_crc32";

uint32_t crc32_of_text(const std::string& text) { return crc32_of(text); }

Shape shape_from_json(const json& j) {
  MXDDP_CHECK(j.is_array() && j.size() <= static_cast<size_t>(Shape::kMaxDims), "bad shape {}", j.dump());
  std::vector<int64_t> d;
  for (const json& x : j) d.push_back(json_int(x, 0, INT64_MAX, "a dimension of shape " + j.dump()));
  return Shape(d);
}

// A name the manifest gives a file must stay inside the checkpoint directory: a path such as
// "../other/rank_00000.safetensors" would read a shard from elsewhere, checksum and all.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos && name.find('\0') == std::string::npos;
}

void check_file_name(const std::string& path, const std::string& entry, const std::string& name) {
  MXDDP_CHECK(is_plain_file_name(name), "checkpoint manifest '{}': {} names file '{}', which is not a plain file "
              "name inside the checkpoint directory (it is empty, '.', '..' or holds a '/'); checkpoint files are "
              "rank files such as 'rank_00000.safetensors'", path, entry, name);
}

ConfigFields config_fields_from_json(const json& j) {
  MXDDP_CHECK(j.is_object(), "model_config is {}, not an object", j.type_name());
  ConfigFields fields;
  for (const auto& [key, value] : j.items()) {
    MXDDP_CHECK(value.is_string() || value.is_number(), "model_config field '{}' is {}, not a string or number", key,
                value.type_name());
    fields.emplace_back(key, value.is_string() ? value.get<std::string>() : value.dump());
  }
  return fields;
}

// Everything after the checksum: the fields, their types, the file names.
Manifest parse_manifest(const json& j, const std::string& path) {
  Manifest m;
  m.path = path;
  // Adam's bias correction raises beta to the step in double, exact to 2^53: a larger count is no
  // step a run has taken.
  m.step = json_int(j.at("step"), 0, int64_t{1} << 53, "step");
  m.dp = static_cast<int>(json_int(j.at("dp"), 1, INT32_MAX, "dp"));
  m.save_id = j.at("save_id").get<std::string>();
  MXDDP_CHECK(m.save_id.size() == 16 && m.save_id.find_first_not_of("0123456789abcdef") == std::string::npos,
              "save_id '{}' is not 16 hex digits", m.save_id);
  m.optimizer = j.at("optimizer").at("optimizer").get<std::string>();
  m.state_names = j.at("state_names").get<std::vector<std::string>>();
  const std::vector<std::string_view> states = optimizer_state_names(m.optimizer);
  MXDDP_CHECK(std::equal(m.state_names.begin(), m.state_names.end(), states.begin(), states.end()),
              "state_names [{}] are not optimizer '{}''s [{}]", fmt::join(m.state_names, ", "), m.optimizer,
              fmt::join(states, ", "));
  m.model_dtype = parse_dtype(j.at("model_dtype").get<std::string>());
  MXDDP_CHECK(m.model_dtype == DType::kBF16 || m.model_dtype == DType::kF32, "model_dtype {} is not bf16 or f32",
              dtype_name(m.model_dtype));
  m.model_config = config_fields_from_json(j.at("model_config"));
  m.metadata = j.at("metadata").get<std::map<std::string, std::string>>();
  for (const char* section : {"ddp", "fsdp"})
    if (j.contains(section) && j.at(section).contains("fp8_param_gather"))
      m.fp8_param_gather = m.fp8_param_gather || j.at(section).at("fp8_param_gather").get<bool>();

  const json& files = j.at("files");
  MXDDP_CHECK(files.is_array() && files.size() == static_cast<size_t>(m.dp), "checkpoint manifest '{}' lists {} "
              "files for a save at dp {}; a save writes one per rank", path, files.size(), m.dp);
  for (size_t i = 0; i < files.size(); ++i) {
    ManifestFile f{files[i].at("name").get<std::string>(),
                   json_int(files[i].at("bytes"), 0, INT64_MAX, fmt::format("files[{}].bytes", i)),
                   static_cast<uint32_t>(json_int(files[i].at("crc32"), 0, UINT32_MAX, fmt::format("files[{}].crc32", i)))};
    const std::string entry = fmt::format("files[{}]", i);
    check_file_name(path, entry, f.name);
    MXDDP_CHECK(f.name == rank_file_name(static_cast<int>(i)), "checkpoint manifest '{}': {} is named '{}'; rank {}'s "
                "file is '{}'", path, entry, f.name, i, rank_file_name(static_cast<int>(i)));
    m.files.push_back(f);
  }

  for (const json& p : j.at("params")) {
    ManifestParam param{p.at("name").get<std::string>(), shape_from_json(p.at("shape")),
                        p.at("shared_embedding").get<bool>(), {}, "", -1};
    if (p.contains("step")) param.step = json_int(p.at("step"), 0, m.step, fmt::format("param '{}''s step", param.name));
    if (p.contains("mxfp8_elem")) {
      param.mxfp8_elem = p.at("mxfp8_elem").get<std::string>();
      MXDDP_CHECK(param.mxfp8_elem == "e4m3" || param.mxfp8_elem == "e5m2",
                  "checkpoint manifest '{}': param '{}' has mxfp8_elem '{}'; valid: e4m3, e5m2", path, param.name,
                  param.mxfp8_elem);
    }
    for (const json& s : p.at("slices")) {
      ManifestSlice slice{s.at("file").get<std::string>(),
                          Range{json_int(s.at("start"), 0, INT64_MAX, "a slice's start"),
                                json_int(s.at("end"), 0, INT64_MAX, "a slice's end")}};
      const std::string entry = fmt::format("a slice of param '{}'", param.name);
      check_file_name(path, entry, slice.file);
      MXDDP_CHECK(std::any_of(m.files.begin(), m.files.end(), [&](const ManifestFile& f) { return f.name == slice.file; }),
                  "checkpoint manifest '{}': {} names file '{}', which is not in its file list", path, entry, slice.file);
      param.slices.push_back(slice);
    }
    MXDDP_CHECK(std::none_of(m.params.begin(), m.params.end(), [&](const ManifestParam& q) { return q.name == param.name; }),
                "checkpoint manifest '{}' lists param '{}' twice", path, param.name);
    MXDDP_CHECK(!param.shared_embedding || std::none_of(m.params.begin(), m.params.end(),
                                                        [](const ManifestParam& q) { return q.shared_embedding; }),
                "checkpoint manifest '{}' marks param '{}' as a second shared embedding; a model has at most one", path,
                param.name);
    m.params.push_back(std::move(param));
  }
  return m;
}

// Why dir, which has no manifest.json, is not a checkpoint: what it is or holds, and what is valid.
std::string missing_manifest_message(const std::string& dir) {
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  if (!fs::exists(st)) return fmt::format("checkpoint directory '{}' does not exist", dir);
  constexpr const char* kValid = "a checkpoint is a directory holding manifest.json and rank_NNNNN.safetensors "
                                 "files; a --save history holds latest_checkpointed_iteration.txt naming its newest "
                                 "iter_NNNNNNN directory";
  if (!fs::is_directory(st)) return fmt::format("'{}' is not a checkpoint: it is not a directory ({})", dir, kValid);
  std::vector<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec))
    names.push_back(printable_text(entry.path().filename().string()));
  std::sort(names.begin(), names.end());
  constexpr size_t kNamesShown = 8;
  std::string holds = "it is empty";
  if (!names.empty()) {
    const size_t shown = std::min(names.size(), kNamesShown);
    holds = fmt::format("it holds {}{}", fmt::join(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
                        names.size() > shown ? fmt::format(" and {} more", names.size() - shown) : "");
  }
  // mxddp.lock alone: a history whose run took the lock and has not completed a save (or never will).
  const bool history = std::find(names.begin(), names.end(), kSaveLockFile) != names.end();
  const bool partial = fs::exists(dir + ".partial", ec);
  return fmt::format("'{}' is not a checkpoint: no manifest.json; {}{}{} ({})", dir, holds,
                     history ? ": a --save history with no completed save yet (its lock file is there, no "
                               "latest_checkpointed_iteration.txt)" : "",
                     partial ? fmt::format("; '{}.partial' is a save of it that was interrupted before its manifest "
                                           "was written, never loaded", dir) : "",
                     kValid);
}

}  // namespace

std::string rank_file_name(int rank) { return fmt::format("rank_{:05d}.safetensors", rank); }

std::string slice_name(std::string_view kind, const std::string& param, const Range& r) {
  return fmt::format("{}/{}/{}-{}", kind, param, r.start, r.end);
}

std::string manifest_path(const std::string& dir) { return (fs::path(dir) / "manifest.json").string(); }

bool has_manifest(const std::string& dir) { return fs::is_regular_file(fs::path(dir) / "manifest.json"); }

void recover_interrupted_publish(const std::string& dir) {
  if (fs::exists(dir)) return;
  if (has_manifest(dir + ".partial")) fs::rename(dir + ".partial", dir);
  else if (has_manifest(dir + ".old")) fs::rename(dir + ".old", dir);
}

std::string checkpoint_to_read(const std::string& dir) {
  if (fs::exists(dir)) return dir;
  if (has_manifest(dir + ".partial")) return dir + ".partial";
  if (has_manifest(dir + ".old")) return dir + ".old";
  return dir;  // read_manifest names what is missing
}

json config_fields_json(const ConfigFields& fields) {
  json j = json::object();
  for (const auto& [key, value] : fields) {
    const json number = json::parse(value, nullptr, /*allow_exceptions=*/false);
    j[key] = number.is_number() && number.dump() == value ? number : json(value);
  }
  return j;
}

std::string seal_manifest(json m) {
  MXDDP_ASSERT(!m.contains(kChecksumKey));
  m[kChecksumKey] = crc32_of_text(m.dump());  // nlohmann's objects keep their keys sorted
  return m.dump(1);
}

Manifest read_manifest(const std::string& dir) {
  const std::string path = manifest_path(dir);
  MXDDP_CHECK(fs::exists(path), "{}", missing_manifest_message(dir));
  const std::vector<char> bytes = read_file(path);
  json j;
  try {
    j = json::parse(bytes.begin(), bytes.end());
  } catch (const std::exception& e) {
    MXDDP_FAIL("'{}' is not valid JSON: {}", path, e.what());
  }
  MXDDP_CHECK(j.is_object() && j.contains("format") && j["format"] == kManifestFormat && j.contains("version") &&
                  j["version"].is_number_integer(),
              "'{}' is not an mxddp checkpoint manifest (format '{}' with an integer version)", path, kManifestFormat);
  const int64_t version = json_int(j["version"], INT64_MIN, INT64_MAX, fmt::format("'{}': version", path));
  MXDDP_CHECK(version != 1, "'{}' is a version-1 mxddp checkpoint manifest, which predates manifest checksums: "
              "nothing in it can be verified, so it is refused. This mxddp reads version {}", path, kManifestVersion);
  MXDDP_CHECK(version == kManifestVersion, "'{}' is an mxddp checkpoint manifest of version {}; this mxddp reads "
              "version {}", path, version, kManifestVersion);
  // The checksum comes before any field is used: an edited step or file list must not be acted on.
  MXDDP_CHECK(j.contains(kChecksumKey), "checkpoint manifest '{}' has no '{}' (a CRC-32); it cannot be verified",
              path, kChecksumKey);
  const auto want_crc = static_cast<uint32_t>(json_int(j[kChecksumKey], 0, UINT32_MAX, fmt::format("'{}': {}", path, kChecksumKey)));
  j.erase(kChecksumKey);
  const uint32_t crc = crc32_of_text(j.dump());
  MXDDP_CHECK(crc == want_crc, "checkpoint manifest '{}' fails its checksum: its content has CRC-32 {:08x}, its "
              "{} says {:08x}; it was edited or damaged after the save, so none of it can be trusted", path, crc,
              kChecksumKey, want_crc);
  try {
    return parse_manifest(j, path);
  } catch (const json::exception& e) {
    MXDDP_FAIL("checkpoint manifest '{}' is malformed: {}; it must be the manifest.json mxddp saved", path, e.what());
  } catch (const Error& e) {
    if (e.message().find(path) != std::string::npos) throw;
    MXDDP_FAIL("checkpoint manifest '{}' is malformed: {}; it must be the manifest.json mxddp saved", path, e.message());
  }
}

std::vector<std::string> coverage_problems(const Manifest& m) {
  std::vector<std::string> problems;
  for (const ManifestParam& p : m.params) {
    const int64_t numel = p.shape.numel();
    std::vector<Range> ranges;
    for (const ManifestSlice& s : p.slices) ranges.push_back(s.range);
    std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.start < b.start; });
    int64_t next = 0;  // [0, next) is covered
    for (const Range& r : ranges) {
      if (r.start < 0 || r.end > numel || r.start >= r.end) {
        problems.push_back(fmt::format("param '{}': slice [{}, {}) is empty or outside its {} elements", p.name, r.start,
                                       r.end, numel));
        continue;
      }
      if (r.start > next)
        problems.push_back(fmt::format("param '{}': elements [{}, {}) are in no slice: no file holds them", p.name, next,
                                       r.start));
      else if (r.start < next)
        problems.push_back(fmt::format("param '{}': elements [{}, {}) are in more than one slice", p.name, r.start,
                                       std::min(next, r.end)));
      next = std::max(next, r.end);
    }
    if (next < numel)
      problems.push_back(fmt::format("param '{}': elements [{}, {}) are in no slice: no file holds them", p.name, next,
                                     numel));
  }
  return problems;
}

std::vector<std::string> unlisted_rank_file_problems(const std::string& dir, const Manifest& m) {
  std::vector<std::string> problems;
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool looks_like_rank_file = name.starts_with("rank_") && name.ends_with(".safetensors");
    if (looks_like_rank_file && std::none_of(m.files.begin(), m.files.end(), [&](const ManifestFile& f) { return f.name == name; }))
      problems.push_back(fmt::format("checkpoint file '{}' is not in the manifest (saved at dp {}, files rank_00000.. "
                                     "rank_{:05d}): a file of another save?", (fs::path(dir) / name).string(), m.dp,
                                     m.dp - 1));
  }
  if (ec) problems.push_back(fmt::format("cannot list checkpoint directory '{}': {}", dir, ec.message()));
  return problems;
}

RankFile check_rank_file(const std::string& dir, const Manifest& m, const ManifestFile& file,
                         std::vector<std::string>& problems) {
  const std::string path = (fs::path(dir) / file.name).string();
  if (!fs::exists(fs::symlink_status(path))) {
    problems.push_back(fmt::format("checkpoint file '{}' is missing", path));
    return {};
  }
  RankFile out;
  try {
    out.bytes = read_file(path);
  } catch (const Error& e) {
    problems.push_back(e.message());
    return {};
  }
  if (static_cast<int64_t>(out.bytes.size()) != file.size_bytes) {
    problems.push_back(fmt::format("checkpoint file '{}' is {} bytes; the manifest says {} (truncated or replaced)",
                                   path, out.bytes.size(), file.size_bytes));
    return {};
  }
  if (const uint32_t crc = crc32_of(out.bytes); crc != file.crc32) {
    problems.push_back(fmt::format("checkpoint file '{}' is corrupted: CRC-32 {:08x}, the manifest says {:08x}", path,
                                   crc, file.crc32));
    return {};
  }
  std::map<std::string, std::string> metadata;
  try {
    out.tensors = decode_safetensors(out.bytes, path, &metadata);
  } catch (const Error& e) {
    problems.push_back(e.message());
    return {};
  }
  // The file must be this save's file of this rank: a rank file of another save (same model, its
  // CRC fixed in the manifest) or another rank's file carries another save_id or rank.
  const auto index = std::find_if(m.files.begin(), m.files.end(), [&](const ManifestFile& f) { return f.name == file.name; });
  const std::string rank = std::to_string(index - m.files.begin());
  for (const auto& [key, want] : {std::pair<std::string, std::string>{"format", kManifestFormat}, {"rank", rank},
                                  {"save_id", m.save_id}}) {
    const auto it = metadata.find(key);
    if (it == metadata.end() || it->second != want)
      problems.push_back(fmt::format("checkpoint file '{}' has {} '{}' in its metadata; this checkpoint's is '{}' (a file "
                                     "of another save or rank)", path, key, it == metadata.end() ? "(none)" : it->second,
                                     want));
  }
  // What the manifest places in this file: for each slice, main and every state in f32 and the
  // model params in the model dtype, each with the slice's element count.
  std::map<std::string, std::pair<DType, int64_t>> expected;
  for (const ManifestParam& p : m.params)
    for (const ManifestSlice& s : p.slices) {
      if (s.file != file.name) continue;
      expected[slice_name("main", p.name, s.range)] = {DType::kF32, s.range.size()};
      for (const std::string& state : m.state_names) expected[slice_name(state, p.name, s.range)] = {DType::kF32, s.range.size()};
      expected[slice_name("model", p.name, s.range)] = {m.model_dtype, s.range.size()};
    }
  for (const auto& [name, want] : expected) {
    const auto it = out.tensors.find(name);
    if (it == out.tensors.end())
      problems.push_back(fmt::format("checkpoint file '{}': tensor '{}' is missing ({} {} elements expected)", path,
                                     name, want.second, dtype_name(want.first)));
    else if (it->second.dtype != want.first || it->second.numel != want.second || it->second.ndim != 1)
      problems.push_back(fmt::format("checkpoint file '{}': tensor '{}' is {} {} elements in {} dimension(s); the "
                                     "manifest implies {} {} in 1", path, name, it->second.numel,
                                     dtype_name(it->second.dtype), it->second.ndim, want.second, dtype_name(want.first)));
  }
  for (const auto& [name, entry] : out.tensors)
    if (!expected.count(name))
      problems.push_back(fmt::format("checkpoint file '{}': tensor '{}' is not one the manifest places in it", path, name));
  return out;
}

std::string model_config_differences(const ConfigFields& saved, const ConfigFields& expected) {
  const std::map<std::string, std::string> saved_map(saved.begin(), saved.end());
  const std::map<std::string, std::string> expected_map(expected.begin(), expected.end());
  std::vector<std::string> diffs;
  for (const auto& [key, value] : expected) {
    const auto it = saved_map.find(key);
    if (it == saved_map.end()) diffs.push_back(fmt::format("{}: checkpoint (absent), this run {}", key, value));
    else if (it->second != value) diffs.push_back(fmt::format("{}: checkpoint {}, this run {}", key, it->second, value));
  }
  for (const auto& [key, value] : saved)
    if (!expected_map.count(key)) diffs.push_back(fmt::format("{}: checkpoint {}, this run (absent)", key, value));
  return fmt::format("{}", fmt::join(diffs, "; "));
}

}  // namespace mxddp::ckpt
