// The safetensors container (8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the raw little-endian data), for the two dtypes
// checkpoints use: F32 and BF16.
#pragma once

#include <map>
#include <optional>
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
  int ndim = 0;
  size_t offset = 0;  // into the file's bytes
};

// Parses and validates the header of `file` (its whole contents) as encode_safetensors writes it:
// the header is canonical JSON (nlohmann's compact dump, so no duplicate keys, other spacing or
// bytes past it but the space padding), every data_offsets is [begin, end) with end - begin the
// shape's bytes, and the tensors tile the data after the header exactly (no gap, no overlap, no
// trailing bytes). Names map to entries; metadata_out, when given, receives "__metadata__".
// `what` names the file in errors.
std::map<std::string, TensorEntry> decode_safetensors(const std::vector<char>& file, const std::string& what,
                                                      std::map<std::string, std::string>* metadata_out = nullptr);

// The "__metadata__" of the safetensors file at path, read from its header alone (string values
// only), or nullopt when path is not a readable regular file with a safetensors header that is a
// JSON object (another kind of file). For telling a file mxddp wrote from one it did not.
std::optional<std::map<std::string, std::string>> read_safetensors_metadata(const std::string& path);

}  // namespace mxddp::ckpt
