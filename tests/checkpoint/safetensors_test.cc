// The safetensors header parser against crafted headers (the fuzz target's findings, kept here as
// cases that must stay errors): sizes and offsets come from the file, so every one is range- and
// overflow-checked before it is used to index the file's bytes.
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"

namespace mxddp::testing {
namespace {

// A file of `header_json`, written canonically (nlohmann's compact dump, as encode_safetensors
// writes it) so that only the check a case aims at can refuse it, and data_bytes zero bytes.
std::vector<char> file_with_header(const std::string& header_json, size_t data_bytes) {
  const std::string header = nlohmann::json::parse(header_json).dump();
  std::vector<char> file(8);
  for (int i = 0; i < 8; ++i) file[static_cast<size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  file.insert(file.end(), header.begin(), header.end());
  file.resize(file.size() + data_bytes, 0);
  return file;
}

void expect_refused(const std::string& header, size_t data_bytes, const std::string& needle) {
  try {
    const auto entries = ckpt::decode_safetensors(file_with_header(header, data_bytes), "crafted.safetensors");
    ADD_FAILURE() << "accepted " << header << " as " << entries.size() << " tensor(s)";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("crafted.safetensors"), std::string::npos) << e.what();
  }
}

TEST(SafetensorsHeader, AWellFormedTensorDecodes) {
  const auto entries = ckpt::decode_safetensors(
      file_with_header(R"({"t":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})", 24), "ok.safetensors");
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries.at("t").numel, 6);
  EXPECT_EQ(entries.at("t").dtype, DType::kF32);
}

// A tensor of -1 elements whose end offset 2^64 - 4 wrapped the bounds check to below the file size.
TEST(SafetensorsHeader, NegativeDimensionIsRefused) {
  expect_refused(R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,18446744073709551612]}})", 8,
                 "a dimension of tensor 't' is -1");
}

// begin = 2^64 - data_start made data_start + begin wrap to 0: the header's own bytes as a tensor.
TEST(SafetensorsHeader, OffsetsPastTheFileAreRefused) {
  expect_refused(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551560,18446744073709551564]}})", 8,
                 "tensor 't' data start is 18446744073709551560");
}

// [2^62, 4] overflowed the signed element count.
TEST(SafetensorsHeader, ElementCountPastInt64IsRefused) {
  expect_refused(R"({"t":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,4]}})", 8,
                 "the element count of tensor 't'");
}

// A dimension past int64 parses as a float, which get<int64_t>() cast (undefined behaviour).
TEST(SafetensorsHeader, DimensionThatIsAFloatIsRefused) {
  expect_refused(R"({"t":{"dtype":"F32","shape":[92233720368547758070],"data_offsets":[0,4]}})", 8,
                 "a dimension of tensor 't' is 9.223372036854776e+19");
  expect_refused(R"({"t":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 8, "a dimension of tensor 't' is 1.5");
}

TEST(SafetensorsHeader, SpanThatIsNotTheShapesBytesIsRefused) {
  expect_refused(R"({"t":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})", 8, "its shape holds 6 bytes");
  expect_refused(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 8, "tensor 't' data end is 0");
}

// Campaign findings: headers whose every entry is valid alone but which are not the file mxddp
// wrote (overlapping or gapped tensors, a third offset, trailing bytes, a duplicate key, padding
// other than spaces, a header length off by one).
TEST(SafetensorsHeader, TensorsMustTileTheDataRegion) {
  expect_refused(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})",
                 8, "overlaps");
  expect_refused(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8, "leaves a gap");
  expect_refused(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8, "4 bytes after the last tensor");
  expect_refused(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", 8, "expected [begin, end]");
}

TEST(SafetensorsHeader, OnlyTheCanonicalHeaderIsRead) {
  auto raw = [](const std::string& text, size_t data_bytes) {
    std::vector<char> file(8);
    for (int i = 0; i < 8; ++i) file[static_cast<size_t>(i)] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
    file.insert(file.end(), text.begin(), text.end());
    file.resize(file.size() + data_bytes, 0);
    return file;
  };
  const std::string one = R"({"a":{"data_offsets":[0,4],"dtype":"F32","shape":[1]}})";
  EXPECT_EQ(ckpt::decode_safetensors(raw(one + "   ", 4), "padded").size(), 1u) << "space padding is the format's";
  for (const auto& [text, name] :
       {std::pair<std::string, std::string>{R"({"a":{"data_offsets":[0,4],"dtype":"F32","shape":[1]},"a":{"data_offsets":[0,4],"dtype":"F32","shape":[1]}})", "duplicate key"},
        {one + std::string(3, '\0'), "NUL padding"},
        {R"({ "a":{"data_offsets":[0,4],"dtype":"F32","shape":[1]}})", "other spacing"}}) {
    EXPECT_THROW(ckpt::decode_safetensors(raw(text, 4), name), Error) << name;
  }
  // The header length one short: the last padding byte becomes data, which no tensor holds.
  std::vector<char> shifted = raw(one + " ", 4);
  shifted[0] = static_cast<char>(shifted[0] - 1);
  EXPECT_THROW(ckpt::decode_safetensors(shifted, "shifted"), Error);
}

}  // namespace
}  // namespace mxddp::testing
