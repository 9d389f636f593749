// Fuzz target: the safetensors header parser (src/checkpoint/safetensors.cc), given a whole file.
//
// decode_safetensors either throws mxddp::Error or keeps the promise its header makes: every
// entry's byte range lies inside the file, after the header, and holds exactly its element count
// of its dtype. A crash, a sanitizer report, any other exception or a broken promise fails.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <mxddp/core.h>

#include "checkpoint/safetensors.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<char> file(data, data + size);
  std::map<std::string, mxddp::ckpt::TensorEntry> entries;
  try {
    entries = mxddp::ckpt::decode_safetensors(file, "fuzz input");
  } catch (const mxddp::Error&) {
    return 0;  // refused, with a message: what a damaged file should get
  }
  // Accepted, so the file has an 8-byte little-endian header length that fits in it.
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | data[i];
  const uint64_t data_start = 8 + header_bytes;
  for (const auto& [name, e] : entries) {
    MXDDP_FUZZ_ASSERT(e.numel >= 0, "tensor '%s' has numel %lld", name.c_str(), static_cast<long long>(e.numel));
    const uint64_t bytes = static_cast<uint64_t>(e.numel) * mxddp::dtype_size_bytes(e.dtype);
    MXDDP_FUZZ_ASSERT(bytes / mxddp::dtype_size_bytes(e.dtype) == static_cast<uint64_t>(e.numel),
                      "tensor '%s': numel %lld overflows a byte count", name.c_str(), static_cast<long long>(e.numel));
    MXDDP_FUZZ_ASSERT(e.offset >= data_start && e.offset <= size && bytes <= size - e.offset,
                      "tensor '%s' at offset %zu, %llu bytes, is not inside the data [%llu, %zu)", name.c_str(),
                      e.offset, static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(data_start),
                      size);
  }
  return 0;
}
