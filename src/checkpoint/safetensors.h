// The safetensors container (8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the raw little-endian data), for the two dtypes
// checkpoints use: F32 and BF16.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <mxddp/core.h>

namespace mxddp::ckpt {

struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  int64_t numel = 0;
  const void* data = nullptr;
};

std::vector<char> encode_safetensors(const std::vector<TensorToWrite>& tensors,
                                     const std::map<std::string, std::string>& metadata);

struct TensorEntry {
  DType dtype = DType::kF32;
  int64_t numel = 0;
  size_t offset = 0;  // into the file's bytes
};

// Parses and validates the header of `file` (its whole contents): names map to entries whose
// byte ranges lie inside the file. `what` names the file in errors.
std::map<std::string, TensorEntry> decode_safetensors(const std::vector<char>& file, const std::string& what);

}  // namespace mxddp::ckpt
