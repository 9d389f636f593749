// safetensors as Hugging Face writes it, for the GPT-2 import and export (hf.h). The checkpoint
// layer's decoder (src/checkpoint/safetensors.h) accepts only its own canonical header; a file
// from `save_pretrained` orders its keys and pads its header its own way, and may hold F16 or
// BF16. This reader takes any valid header and checks every field against the file before use.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace mxddp::hf {

struct StTensor {
  std::string dtype;           // "F32", "BF16" or "F16"
  std::vector<int64_t> shape;  // as the header says
  int64_t numel = 0;
  size_t offset = 0;           // into the file's bytes
};

struct StFile {
  std::vector<char> bytes;  // the whole file
  std::map<std::string, StTensor> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__" (string values)
};

// Reads and checks path (named `what` in errors): the 8-byte header length within the file, the
// header a JSON object, each tensor's dtype one of F32/BF16/F16, its shape non-negative integers
// whose element count does not overflow, data_offsets [begin, end) within the data with end -
// begin the shape's bytes, and no two tensors overlapping. Throws Error naming the file and the
// tensor otherwise.
StFile read_safetensors(const std::string& path, const std::string& what);

// The tensor's values as f32 (BF16 and F16 widened exactly), row-major.
std::vector<float> tensor_f32(const StFile& file, const std::string& name);

struct StTensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;  // shape's element count of values
};

// One file of F32 tensors, in the given order, the header padded with spaces to 8 bytes.
std::vector<char> encode_f32_safetensors(const std::vector<StTensorToWrite>& tensors,
                                         const std::map<std::string, std::string>& metadata);

}  // namespace mxddp::hf
