// mxddp checkpoint: distributed-optimizer checkpoints that reshard across data-parallel sizes.
//
// On disk, a checkpoint is a directory:
//   manifest.json            step, configs, layout, the param list, which file holds which slice
//                            of which param, and each file's size and CRC-32
//   rank_00000.safetensors   one per saving rank: for each param slice in that rank's shards,
//   rank_00001.safetensors   "main/<param>/<start>-<end>" (f32), one tensor per optimizer state
//   ...                      ("exp_avg/...", "exp_avg_sq/..." or "momentum_buffer/...", f32) and
//                            "model/<param>/<start>-<end>" (the bf16 model params)
// Every tensor is a logical, unpadded slice of a flattened param, so a checkpoint saved at one dp
// and bucket size loads at any other (same param list). safetensors and JSON: Python reads them.
//
// Writes are atomic: files go to DIR.partial (temporary names, fsync, rename), the manifest is
// written last, and DIR.partial is renamed to DIR. A load reads and verifies everything it needs
// (manifest, sizes, checksums, param list) before changing anything; if any rank fails, every rank
// throws and the run is left as it was.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <mxddp/optim.h>

namespace mxddp {

struct SaveOptions {
  bool overwrite = false;                       // replace an existing checkpoint at DIR
  std::map<std::string, std::string> metadata;  // stored in the manifest, returned by load
};

// Collective. Brings the model params up to date first (force_param_sync), then writes.
void save_checkpoint(const std::string& dir, DistributedOptimizer& optimizer, const SaveOptions& options = {});

// Collective. Restores main params, optimizer state and the step count, then the model params
// from the main params (force_param_sync). Returns the metadata saved with the checkpoint. The
// optimizer's hyper-parameters (lr, betas, ...) are the caller's: they are not overwritten.
std::map<std::string, std::string> load_checkpoint(const std::string& dir, DistributedOptimizer& optimizer);

// What a checkpoint holds, read without a communicator (for `mxddp ckpt inspect`).
struct CheckpointFileInfo {
  std::string name;
  int64_t size_bytes = 0;
  uint32_t crc32 = 0;
  std::string status;  // "ok", or what is wrong with it ("missing", "size 10 != 20", "checksum ...")
};
struct CheckpointParamInfo {
  std::string name;
  Shape shape;
  int slices = 0;
};
struct CheckpointInfo {
  int64_t step = 0;
  int saved_dp = 0;
  std::string optimizer;
  std::vector<CheckpointParamInfo> params;
  std::vector<CheckpointFileInfo> files;
  std::map<std::string, std::string> metadata;
  bool ok() const;  // every file present with the right size and checksum
};
// Throws Error if the manifest is missing or unreadable; file problems are reported per file.
CheckpointInfo inspect_checkpoint(const std::string& dir);

}  // namespace mxddp
