// safetensors encode/decode: see safetensors.h. The header is padded with spaces to a multiple of
// 8 bytes, as the format allows, so the data is 8-byte aligned.
#include "safetensors.h"

#include <algorithm>
#include <cstring>
#include <string_view>

#include <nlohmann/json.hpp>

#include <mxddp/input_file.h>

#include "json_int.h"

namespace mxddp::ckpt {

namespace {
const char* st_dtype(DType d) {
  switch (d) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    default: MXDDP_FAIL("checkpoints store f32 and bf16 tensors; got {}", dtype_name(d));
  }
}
}  // namespace

std::vector<char> encode_safetensors(const std::vector<TensorToWrite>& tensors,
                                     const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  size_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    const size_t bytes = static_cast<size_t>(t.numel) * dtype_size_bytes(t.dtype);
    header[t.name] = {{"dtype", st_dtype(t.dtype)}, {"shape", {t.numel}}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::vector<char> out(8 + text.size() + offset);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, text.data(), text.size());
  char* data = out.data() + 8 + text.size();
  for (const TensorToWrite& t : tensors) {
    const size_t bytes = static_cast<size_t>(t.numel) * dtype_size_bytes(t.dtype);
    if (bytes) std::memcpy(data, t.data, bytes);
    data += bytes;
  }
  return out;
}

std::map<std::string, TensorEntry> decode_safetensors(const std::vector<char>& file, const std::string& what,
                                                      std::map<std::string, std::string>* metadata_out) {
  MXDDP_CHECK(file.size() >= 8, "'{}' is {} bytes: too short for a safetensors header", what, file.size());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[static_cast<size_t>(i)]);
  MXDDP_CHECK(n <= file.size() - 8, "'{}': header length {} exceeds the file ({} bytes)", what, n, file.size());
  const std::string_view text(file.data() + 8, static_cast<size_t>(n));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    MXDDP_FAIL("'{}': the safetensors header is not valid JSON: {}", what, e.what());
  }
  MXDDP_CHECK(header.is_object(), "'{}': the safetensors header is {}, not an object", what, header.type_name());
  // The header must be exactly what encode_safetensors writes: a duplicate key (the parser keeps
  // the last), other bytes after the JSON or a shifted header length all change the text.
  const size_t json_end = text.find_last_not_of(' ');
  MXDDP_CHECK(text.substr(0, json_end == std::string_view::npos ? 0 : json_end + 1) == header.dump(),
              "'{}': the safetensors header is not the canonical JSON mxddp writes (a duplicate key, other spacing or "
              "bytes, or a wrong header length)", what);
  const size_t data_start = 8 + n;
  const auto data_bytes = static_cast<int64_t>(file.size() - data_start);
  std::map<std::string, TensorEntry> entries;
  std::vector<std::pair<int64_t, int64_t>> spans;  // [begin, end) of every tensor
  for (const auto& [name, t] : header.items()) {
    try {
      if (name == "__metadata__") {
        MXDDP_CHECK(t.is_object(), "__metadata__ is {}, not an object", t.type_name());
        std::map<std::string, std::string> metadata;
        for (const auto& [key, value] : t.items()) {
          MXDDP_CHECK(value.is_string(), "__metadata__ entry '{}' is {}, not a string", key, value.type_name());
          metadata[key] = value.get<std::string>();
        }
        if (metadata_out) *metadata_out = std::move(metadata);
        continue;
      }
      TensorEntry e;
      const std::string dtype = t.at("dtype").get<std::string>();
      MXDDP_CHECK(dtype == "F32" || dtype == "BF16", "tensor '{}' has dtype {}; expected F32 or BF16", name, dtype);
      e.dtype = dtype == "F32" ? DType::kF32 : DType::kBF16;
      const nlohmann::json& shape = t.at("shape");
      MXDDP_CHECK(shape.is_array() && shape.size() <= static_cast<size_t>(Shape::kMaxDims),
                  "tensor '{}' has shape {}; expected an array of at most {} dimensions", name, shape.dump(),
                  Shape::kMaxDims);
      int64_t numel = 1;
      for (const auto& d : shape)
        numel = checked_mul(numel, json_int(d, 0, INT64_MAX, fmt::format("a dimension of tensor '{}'", name)),
                            fmt::format("the element count of tensor '{}'", name));
      e.numel = numel;
      e.ndim = static_cast<int>(shape.size());
      // Offsets are relative to the data after the header: both must lie within it (no wrap past
      // 2^64), and the span must be exactly the shape's bytes.
      const nlohmann::json& offsets = t.at("data_offsets");
      MXDDP_CHECK(offsets.is_array() && offsets.size() == 2, "tensor '{}' has data_offsets {}; expected [begin, end]",
                  name, offsets.dump());
      const int64_t begin = json_int(offsets[0], 0, data_bytes, fmt::format("tensor '{}' data start", name));
      const int64_t end = json_int(offsets[1], begin, data_bytes, fmt::format("tensor '{}' data end", name));
      const int64_t bytes = checked_mul(numel, static_cast<int64_t>(dtype_size_bytes(e.dtype)),
                                        fmt::format("the byte count of tensor '{}'", name));
      MXDDP_CHECK(end - begin == bytes, "tensor '{}' claims bytes [{}, {}) but its shape holds {} bytes", name, begin, end,
                  bytes);
      e.offset = data_start + static_cast<size_t>(begin);
      entries[name] = e;
      spans.emplace_back(begin, end);
    } catch (const nlohmann::json::exception& ex) {
      MXDDP_FAIL("'{}': tensor '{}' has a malformed header entry: {}", what, name, ex.what());
    } catch (const Error& ex) {
      MXDDP_FAIL("'{}': {}", what, ex.message());
    }
  }
  // The tensors tile the data region: every byte after the header belongs to exactly one tensor.
  std::sort(spans.begin(), spans.end());
  int64_t next = 0;
  for (const auto& [begin, end] : spans) {
    MXDDP_CHECK(begin == next, "'{}': the tensors' data {} at byte {} of the data region (bytes [{}, {}) follow): "
                "tensors must tile it", what, begin < next ? "overlaps" : "leaves a gap", next, begin, end);
    next = end;
  }
  MXDDP_CHECK(next == data_bytes, "'{}': {} bytes after the last tensor's data; tensors must tile the data region", what,
              data_bytes - next);
  return entries;
}

std::optional<std::map<std::string, std::string>> read_safetensors_metadata(const std::string& path) {
  constexpr uint64_t kHeaderBytesMax = 100 << 20;  // the format's own limit on the header
  try {
    InputFile file(path, "safetensors file");
    unsigned char length[8];
    if (file.size_bytes() < 8) return std::nullopt;
    file.read_exact(length, sizeof length);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | length[i];
    if (n > kHeaderBytesMax || n > static_cast<uint64_t>(file.size_bytes()) - 8) return std::nullopt;
    std::string text(static_cast<size_t>(n), '\0');
    file.read_exact(text.data(), text.size());
    const nlohmann::json header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!header.is_object()) return std::nullopt;
    std::map<std::string, std::string> metadata;
    if (const auto it = header.find("__metadata__"); it != header.end() && it->is_object())
      for (const auto& [key, value] : it->items())
        if (value.is_string()) metadata[key] = value.get<std::string>();
    return metadata;
  } catch (const Error&) {
    return std::nullopt;
  }
}

}  // namespace mxddp::ckpt
