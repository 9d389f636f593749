// mxddp checkpoint: distributed-optimizer checkpoints that reshard across data-parallel sizes.
//
// On disk, a checkpoint is a directory:
//   manifest.json            format "mxddp-checkpoint" version 2: step, configs, the model config
//                            (every field, as a JSON object), the param list, which file holds
//                            which slice of which param, each file's size and CRC-32, and
//                            "manifest_crc32": the CRC-32 of the manifest itself
//   rank_00000.safetensors   one per saving rank: for each param slice in that rank's shards,
//   rank_00001.safetensors   "main/<param>/<start>-<end>" (f32), one tensor per optimizer state
//   ...                      ("exp_avg/...", "exp_avg_sq/..." or "momentum_buffer/...", f32) and
//                            "model/<param>/<start>-<end>" (the model params, bf16 or f32)
// Every tensor is a logical, unpadded slice of a flattened param, so a checkpoint saved at one dp
// and bucket size loads at any other (same param list). safetensors and JSON: Python reads them.
//
// Trust: manifest_crc32 is the CRC-32 of the manifest's JSON without that key, dumped compactly
// with sorted keys (nlohmann's dump(); Python's json.dumps(m, sort_keys=True, separators=(",", ":"),
// ensure_ascii=False) for what mxddp writes). Load and inspect verify it before reading any field,
// so an edited step or iteration is refused; a version-1 manifest (no checksum) is refused too.
// File names must be this directory's "rank_NNNNN.safetensors", never a path. Load and inspect run
// the same checks (src/checkpoint/manifest.h): the checksums, every rank file's safetensors header,
// every tensor's dtype and size against the manifest, and slices that cover every param exactly.
//
// Writes are atomic: files go to DIR.partial (temporary names, fsync, rename), the manifest is
// written last, and DIR.partial is renamed to DIR. A load reads and verifies everything it needs
// (manifest, model config, param list, sizes, checksums, tensors) before changing anything; if any
// rank fails, every rank throws and the run is left as it was.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <mxddp/optim.h>

namespace mxddp {

// A model's configuration as (field, value) pairs, every field (e.g. GptConfig::fields()).
using ModelConfigFields = std::vector<std::pair<std::string, std::string>>;

struct SaveOptions {
  bool overwrite = false;                       // replace an existing checkpoint at DIR
  std::map<std::string, std::string> metadata;  // stored in the manifest, returned by load
  ModelConfigFields model_config;               // stored in the manifest, checked by a load that asks
};

struct LoadOptions {
  // When not empty, the checkpoint's model config must equal this field by field (a model with
  // other heads can have the same param shapes); the error lists every differing field.
  ModelConfigFields model_config;
  // Metadata keys that must hold a non-negative integer (e.g. "iteration"): checked with the rest,
  // before anything changes, so a checkpoint without them is refused and the run left as it was.
  std::vector<std::string> count_metadata;
};

// Collective. Brings the model params up to date first (force_param_sync), then writes.
void save_checkpoint(const std::string& dir, DistributedOptimizer& optimizer, const SaveOptions& options = {});

// A metadata value that counts something (iteration, consumed_train_samples): decimal digits only,
// within int64. Throws Error naming the checkpoint dir, the key and the value otherwise (a missing
// key included). The one parser for such values: the load's count_metadata check and its callers.
int64_t checkpoint_metadata_count(const std::map<std::string, std::string>& metadata, const std::string& key,
                                  const std::string& dir);

// Collective. Restores main params, optimizer state and the step count, then the model params
// from the main params (force_param_sync). Returns the metadata saved with the checkpoint. The
// optimizer's hyper-parameters (lr, betas, ...) are the caller's: they are not overwritten.
std::map<std::string, std::string> load_checkpoint(const std::string& dir, DistributedOptimizer& optimizer,
                                                   const LoadOptions& options = {});

// What a checkpoint holds, read and checked without a communicator (for `mxddp ckpt inspect`):
// everything a load checks that does not need the model.
struct CheckpointFileInfo {
  std::string name;
  int64_t size_bytes = 0;
  uint32_t crc32 = 0;
  std::string status;  // "ok", or its problems joined by "; " ("... is missing", "... is corrupted ...")
};
struct CheckpointParamInfo {
  std::string name;
  Shape shape;
  int slices = 0;
  bool shared_embedding = false;
  // What the run kept the param as: the model dtype ("bf16", "f32") or "mxfp8_e4m3" / "mxfp8_e5m2".
  // Every param is saved as model_dtype; an MXFP8 one as the cast of its main params.
  std::string dtype;
};
struct CheckpointInfo {
  std::string dir;  // the directory read: DIR, or DIR.partial / DIR.old after an interrupted save
  int64_t step = 0;
  int saved_dp = 0;
  std::string optimizer;
  std::vector<std::string> state_names;
  std::string model_dtype;  // the dtype the model params are saved as
  // What the run's params were, for a person: the model dtype alone ("bf16"), or with MXFP8 params
  // "mxfp8_e4m3 (4 params) and bf16 (12 params), saved as bf16". A save of an fp8_param_gather run
  // from before the params were marked says so instead of naming them.
  std::string param_dtype;
  ModelConfigFields model_config;
  std::vector<CheckpointParamInfo> params;
  std::vector<CheckpointFileInfo> files;
  std::map<std::string, std::string> metadata;
  std::vector<std::string> problems;  // coverage holes, damaged files, wrong tensors: one message each
  bool ok() const { return problems.empty(); }
};
// Throws Error when the manifest cannot be trusted (missing, not JSON, a bad checksum, an old
// version, a malformed field, a file name that is not a rank file of DIR); everything else is
// reported in problems.
CheckpointInfo inspect_checkpoint(const std::string& dir);
// The same as one JSON object: dir, ok, step, saved_dp, optimizer, state_names, model_dtype,
// param_dtype, model_config, metadata, params (name, shape, slices, shared_embedding, dtype), files
// (name, bytes, crc32, status) and problems.
std::string checkpoint_info_json(const CheckpointInfo& info);

// A checkpoint's params whole (for `mxddp ckpt export`): each param's FP32 main params (the
// optimizer's master copy, what a load restores and the model params are cast from; runs with
// MXFP8 params have them too) assembled from the slices every saving rank wrote, as a load at
// dp 1 would assemble them.
struct CheckpointParams {
  CheckpointInfo info;                     // as inspect_checkpoint gives it, with no problems
  std::vector<std::vector<float>> values;  // [param] in info.params order: shape.numel() values, row-major
};
// Runs every check inspect_checkpoint runs (those a load runs: the manifest's checksum and
// structure, the coverage of every param, each listed rank file's size, CRC-32, header, save id
// and tensors, no unlisted rank file), reading each rank file once, and copies the "main/..."
// slices into place. Throws Error "checkpoint 'DIR' is damaged: ..." with every problem found
// when any check fails (nothing is returned in part), or what read_manifest throws. Nothing is
// allocated for the params before the listed files are known to be large enough to hold them.
CheckpointParams read_checkpoint_params(const std::string& dir);

// One safetensors file of whole params: each param under its checkpoint name with its shape, in
// info.params order, as F32 or BF16 (dtype kF32 or kBF16; bf16 is f32 rounded to nearest even),
// the header padded with spaces to 8 bytes as the rank files' are. Its "__metadata__" (string
// values): "mxddp_model_config", the manifest's model config as one JSON object (numbers as
// numbers, as the manifest stores it; "{}" when none was saved); "mxddp_step", the optimizer
// step; "mxddp_iteration", the checkpoint metadata's "iteration" when it has one;
// "mxddp_checkpoint_metadata", all of that metadata as one JSON object; "mxddp_dtype", "f32" or
// "bf16"; "mxddp_source", what the values are; kExportMarkerKey, "safetensors"; then
// extra_metadata (which may not redefine these). Nothing depends on where the checkpoint lies or
// the dp it was saved at.
std::vector<char> encode_checkpoint_params_safetensors(const CheckpointParams& params, DType dtype,
                                                       const std::map<std::string, std::string>& extra_metadata = {});

// The "__metadata__" key that marks a safetensors file `mxddp ckpt export` wrote: "safetensors"
// for encode_checkpoint_params_safetensors' file, "hf" for an HF export's model.safetensors. An
// export replaces an existing file only when it carries the mark (and the user asks: --overwrite),
// never a file it did not write.
inline constexpr const char* kExportMarkerKey = "mxddp_export";
// Whether path is a readable safetensors file whose header's __metadata__ has kExportMarkerKey
// equal to marker. Reads the header only; never throws for what the file holds.
bool is_marked_export(const std::string& path, const std::string& marker);

}  // namespace mxddp
