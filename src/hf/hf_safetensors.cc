// The lenient safetensors reader and the F32 writer of the HF GPT-2 interop: see hf_safetensors.h.
#include "hf_safetensors.h"

#include <algorithm>
#include <cstring>
#include <string_view>

#include <nlohmann/json.hpp>

#include <mxddp/core.h>
#include <mxddp/input_file.h>

namespace mxddp::hf {

namespace {

int64_t dtype_bytes(const std::string& dtype) { return dtype == "F32" ? 4 : 2; }

// A JSON value that must be a non-negative integer (a shape dimension or an offset).
int64_t non_negative(const nlohmann::json& v, const std::string& what, const std::string& field) {
  MXDDP_CHECK(v.is_number_integer() && (v.is_number_unsigned() || v.get<int64_t>() >= 0) &&
                  !(v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)),
              "{}: {} is {}; expected a non-negative integer", what, field, v.dump());
  return v.get<int64_t>();
}

}  // namespace

StFile read_safetensors(const std::string& path, const std::string& what) {
  StFile out;
  out.bytes = InputFile(path, what).read_all();  // a FIFO or a directory is refused, not read
  const std::vector<char>& file = out.bytes;
  MXDDP_CHECK(file.size() >= 8, "{} '{}' is {} bytes: too short for a safetensors header (8 bytes of length, then JSON)",
              what, path, file.size());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[static_cast<size_t>(i)]);
  MXDDP_CHECK(n <= file.size() - 8, "{} '{}': its header length {} runs past the file ({} bytes): truncated or not "
              "safetensors", what, path, n, file.size());
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(std::string_view(file.data() + 8, static_cast<size_t>(n)));
  } catch (const std::exception& e) {
    MXDDP_FAIL("{} '{}': its header is not JSON ({})", what, path, e.what());
  }
  MXDDP_CHECK(header.is_object(), "{} '{}': its header is not a JSON object", what, path);
  const size_t data_begin = 8 + static_cast<size_t>(n);
  const auto data_bytes = static_cast<int64_t>(file.size() - data_begin);
  std::vector<std::pair<int64_t, int64_t>> spans;  // to check that no two tensors overlap
  for (const auto& [name, entry] : header.items()) {
    const std::string where = fmt::format("{} '{}', tensor '{}'", what, path, name);
    if (name == "__metadata__") {
      MXDDP_CHECK(entry.is_object(), "{} '{}': __metadata__ is not an object", what, path);
      for (const auto& [key, value] : entry.items())
        MXDDP_CHECK(value.is_string(), "{} '{}': __metadata__ '{}' is not a string", what, path, key);
      out.metadata = entry.get<std::map<std::string, std::string>>();
      continue;
    }
    MXDDP_CHECK(entry.is_object() && entry.contains("dtype") && entry.contains("shape") && entry.contains("data_offsets"),
                "{}: expected an object with dtype, shape and data_offsets; got {}", where, entry.dump());
    StTensor t;
    MXDDP_CHECK(entry["dtype"].is_string(), "{}: dtype is {}", where, entry["dtype"].dump());
    t.dtype = entry["dtype"].get<std::string>();
    MXDDP_CHECK(t.dtype == "F32" || t.dtype == "BF16" || t.dtype == "F16",
                "{}: dtype {} is not read here; valid: F32, BF16, F16", where, t.dtype);
    MXDDP_CHECK(entry["shape"].is_array(), "{}: shape is {}", where, entry["shape"].dump());
    t.numel = 1;
    for (const nlohmann::json& d : entry["shape"]) {
      t.shape.push_back(non_negative(d, where, "a shape dimension"));
      t.numel = checked_mul(t.numel, t.shape.back(), where + ": its element count");
    }
    const nlohmann::json& offsets = entry["data_offsets"];
    MXDDP_CHECK(offsets.is_array() && offsets.size() == 2, "{}: data_offsets is {}; expected [begin, end]", where,
                offsets.dump());
    const int64_t begin = non_negative(offsets[0], where, "data_offsets[0]");
    const int64_t end = non_negative(offsets[1], where, "data_offsets[1]");
    MXDDP_CHECK(begin <= end && end <= data_bytes, "{}: data_offsets [{}, {}] lie outside the {} bytes of data after "
                "the header: the file is truncated or damaged", where, begin, end, data_bytes);
    const int64_t bytes = checked_mul(t.numel, dtype_bytes(t.dtype), where + ": its bytes");
    MXDDP_CHECK(end - begin == bytes, "{}: data_offsets [{}, {}] hold {} bytes, but {} of shape [{}] is {} bytes", where,
                begin, end, end - begin, t.dtype, fmt::join(t.shape, ", "), bytes);
    t.offset = data_begin + static_cast<size_t>(begin);
    spans.emplace_back(begin, end);
    out.tensors.emplace(name, std::move(t));
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    MXDDP_CHECK(spans[i].first >= spans[i - 1].second, "{} '{}': two tensors overlap at data bytes [{}, {})", what, path,
                spans[i].first, std::min(spans[i].second, spans[i - 1].second));
  return out;
}

std::vector<float> tensor_f32(const StFile& file, const std::string& name) {
  const StTensor& t = file.tensors.at(name);
  std::vector<float> out(static_cast<size_t>(t.numel));
  const char* src = file.bytes.data() + t.offset;
  if (t.dtype == "F32") {
    if (t.numel > 0) std::memcpy(out.data(), src, out.size() * sizeof(float));
    return out;
  }
  for (size_t i = 0; i < out.size(); ++i) {
    uint16_t h = 0;
    std::memcpy(&h, src + 2 * i, 2);  // little-endian on the hosts mxddp builds for
    out[i] = t.dtype == "BF16" ? bf16_to_f32(h) : f16_to_f32(h);
  }
  return out;
}

std::vector<char> encode_f32_safetensors(const std::vector<StTensorToWrite>& tensors,
                                         const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  int64_t offset = 0;
  std::vector<int64_t> numels;
  for (const StTensorToWrite& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel = checked_mul(numel, d, "a tensor's element count");
    numels.push_back(numel);
    const int64_t bytes = checked_mul(numel, 4, "a tensor's bytes");
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset = checked_add(offset, bytes, "the file's data bytes");
  }
  header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data 8-byte aligned, as the format allows
  std::vector<char> out(8 + text.size() + static_cast<size_t>(offset));
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, text.data(), text.size());
  char* data = out.data() + 8 + text.size();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto bytes = static_cast<size_t>(numels[i]) * 4;
    if (bytes > 0) std::memcpy(data, tensors[i].data, bytes);
    data += bytes;
  }
  return out;
}

}  // namespace mxddp::hf
