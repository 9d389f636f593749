// The checkpoint manifest (manifest.json, format "mxddp-checkpoint" version 2) and every check a
// checkpoint must pass, shared by load_checkpoint and inspect_checkpoint so the two cannot drift:
//   1. the manifest's own CRC-32 ("manifest_crc32": the CRC-32 of the manifest without that key,
//      dumped compactly with its keys sorted), verified before any other field is read;
//   2. its structure: the format and version, every field's type, file names that are plain
//      "rank_NNNNN.safetensors" names of this directory (never a path), one file per saving rank;
//   3. coverage: the slices of every param tile [0, numel) exactly and name listed files;
//   4. each rank file: size and CRC-32 as listed, a parsable safetensors header, and exactly the
//      tensors its slices imply (main and every optimizer state f32, model in the model dtype),
//      each with the slice's element count.
// Structural problems (1, 2) throw: nothing after them can be trusted. Coverage and file problems
// (3, 4) are collected as messages, so inspect can list them all; load throws with them.
#pragma once

#include <mxddp/checkpoint.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <mxddp/buffer.h>
#include <mxddp/core.h>

#include "safetensors.h"

namespace mxddp::ckpt {

inline constexpr const char* kManifestFormat = "mxddp-checkpoint";
inline constexpr int kManifestVersion = 2;

using ConfigFields = std::vector<std::pair<std::string, std::string>>;

std::string rank_file_name(int rank);  // "rank_00003.safetensors"
std::string slice_name(std::string_view kind, const std::string& param, const Range& r);  // "main/w/0-100"
std::string manifest_path(const std::string& dir);

// A save publishes D in two renames: D -> D.old, then D.partial -> D (a non-empty directory cannot
// be replaced in one). A kill between them leaves no D, the previous checkpoint intact in D.old and
// the new one complete in D.partial (its manifest is written last, after every rank file). Readers
// take the newest intact copy without changing anything; the next save restores it to D first, so
// no later run deletes the only intact copy.
bool has_manifest(const std::string& dir);
std::string checkpoint_to_read(const std::string& dir);
// Before a save of D (rank 0), and for the interrupted saves a history commit clears: an
// interrupted publish is completed or rolled back, so D is the newest intact checkpoint (or absent).
void recover_interrupted_publish(const std::string& dir);

struct ManifestSlice {
  std::string file;
  Range range;  // of the flattened param
};
struct ManifestParam {
  std::string name;
  Shape shape;
  bool shared_embedding = false;
  std::vector<ManifestSlice> slices;
  // The run kept it as MXFP8 with these elements ("e4m3", "e5m2"); "" for a param that is not, or
  // one a save before this field did not mark (see Manifest::fp8_param_gather).
  std::string mxfp8_elem;
  // The optimizer steps this param took (fewer than Manifest::step where it went unused in some,
  // as torch leaves a param without a grad); -1 in a save before this field (then step's).
  int64_t step = -1;
};
struct ManifestFile {
  std::string name;
  int64_t size_bytes = 0;
  uint32_t crc32 = 0;
};
struct Manifest {
  std::string path;  // manifest.json, for messages
  int64_t step = 0;
  std::string save_id;  // 16 hex digits, also in every rank file's metadata
  int dp = 0;
  std::string optimizer;
  std::vector<std::string> state_names;
  DType model_dtype = DType::kBF16;
  ConfigFields model_config;  // as saved; empty when the saver passed none
  std::vector<ManifestParam> params;
  std::vector<ManifestFile> files;
  std::map<std::string, std::string> metadata;
  // The saving run's ddp or fsdp section says fp8_param_gather (false when it has neither).
  bool fp8_param_gather = false;
};

// The model config as a JSON object: a value that is a JSON number written canonically ("4",
// "0.5") is stored as that number, anything else as a string; read_manifest reads a number back
// as its canonical text, so a saved config compares equal to the one it was saved from.
nlohmann::json config_fields_json(const ConfigFields& fields);

// Adds "manifest_crc32" to m (which must not hold it yet) and returns the text to write.
std::string seal_manifest(nlohmann::json m);

// Reads DIR/manifest.json and runs checks 1 and 2; throws Error naming the file and the problem.
Manifest read_manifest(const std::string& dir);

// Check 3: one message per problem, naming the param and the elements.
std::vector<std::string> coverage_problems(const Manifest& m);

// Check 5: files in the directory that look like rank files (rank_*.safetensors) but are not
// listed: a save writes exactly the listed ones, so another is a sign of mixed saves. One
// message per file.
std::vector<std::string> unlisted_rank_file_problems(const std::string& dir, const Manifest& m);

// What inspect_checkpoint and read_checkpoint_params report from the manifest of the checkpoint in
// dir alone: its fields and params, and checks 3 and 5 as problems (files are not read).
CheckpointInfo manifest_info(const std::string& dir, const Manifest& m);

// Check 4 on one listed file. Appends one message per problem (naming the file and the tensor);
// returns the file's bytes and tensors when its size, CRC and header are sound, else empty ones.
struct RankFile {
  std::vector<char> bytes;
  std::map<std::string, TensorEntry> tensors;
};
RankFile check_rank_file(const std::string& dir, const Manifest& m, const ManifestFile& file,
                         std::vector<std::string>& problems);

// Compares the checkpoint's model config with the run's, field by field. Returns "" when equal,
// else every differing field as "name: checkpoint X, this run Y" joined by "; ".
std::string model_config_differences(const ConfigFields& saved, const ConfigFields& expected);

}  // namespace mxddp::ckpt
