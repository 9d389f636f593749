// The safetensors header parser against crafted headers (the fuzz target's findings, kept here as
// cases that must stay errors): sizes and offsets come from the file, so every one is range- and
// overflow-checked before it is used to index the file's bytes.
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "checkpoint/safetensors.h"

namespace mxddp::testing {
namespace {

// A file of `header` (JSON) and data_bytes zero bytes after it.
std::vector<char> file_with_header(const std::string& header, size_t data_bytes) {
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

}  // namespace
}  // namespace mxddp::testing
