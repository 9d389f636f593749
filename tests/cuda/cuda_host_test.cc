// The CUDA layer's host side, which runs without a device: every entry point refuses bad sizes,
// dtypes, null pointers and cpu views with an Error naming the value before it touches CUDA, and
// the device probe says why no device is usable rather than failing.
#include <string>

#include <gtest/gtest.h>

#include <mxddp/cuda.h>

namespace mxddp::testing {
namespace {

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(CudaHost, DeviceProbeSaysWhyWhenThereIsNone) {
  std::string why;
  const int n = cuda_device_count(&why);
  EXPECT_GE(n, 0);
  if (n == 0) {
    EXPECT_NE(why.find("CUDA"), std::string::npos) << why;
  }
  EXPECT_EQ(cuda_device_count(nullptr), n);  // the reason is optional, the answer the same
}

TEST(CudaHost, ElementwiseKernelsRefuseNegativeSizesAndNullPointers) {
  float f = 0;
  bf16_bits b = 0;
  EXPECT_NE(error_of([&] { cuda_convert_f32_to_bf16(&f, &b, -1, nullptr); }).find("n = -1 elements; valid: n >= 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda_convert_bf16_to_f32(nullptr, &f, 4, nullptr); }).find("a null pointer for 4 elements"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda_adamw(&f, DType::kF32, &f, &f, &f, nullptr, DType::kF32, -3, AdamWScalars{}, nullptr); })
                .find("cuda_adamw: n = -3"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda_sgd(&f, DType::kF32, &f, nullptr, nullptr, DType::kF32, 2, SgdScalars{}, nullptr); })
                .find("cuda_sgd: a null pointer"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda_sum_of_squares(&f, DType::kF32, 1, nullptr, nullptr); }).find("out_device is null"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda_scale(&f, DType::kF32, -7, 2.0f, nullptr); }).find("cuda_scale: n = -7"), std::string::npos);
  EXPECT_NE(error_of([&] { cuda_zero(nullptr, 16, nullptr); }).find("a null pointer for 16 bytes"), std::string::npos);
  EXPECT_NE(error_of([&] { cuda_count_nonfinite(&f, DType::kF32, 1, nullptr, nullptr); }).find("count_device is null"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda_count_zeros(&f, DType::kF32, 1, nullptr, nullptr); }).find("count_device is null"),
            std::string::npos);
  int64_t count = 0;
  EXPECT_NE(error_of([&] { cuda_count_zeros(&f, DType::kF16, 1, &count, nullptr); })
                .find("cuda_count_zeros: data must be f32 or bf16; got f16"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda_accumulate(&f, nullptr, DType::kBF16, 3, nullptr); }).find("a null pointer for 3"),
            std::string::npos);
}

TEST(CudaHost, OptimizerKernelsNameAnUnsupportedDtype) {
  float f = 0;
  EXPECT_NE(error_of([&] { cuda_adamw(&f, DType::kF16, &f, &f, &f, nullptr, DType::kF32, 1, AdamWScalars{}, nullptr); })
                .find("grads must be f32 or bf16; got f16"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda_sgd(&f, DType::kF32, &f, &f, &f, DType::kE4M3, 1, SgdScalars{}, nullptr); })
                .find("staged params must be f32 or bf16; got e4m3"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda_scale(&f, DType::kI64, 1, 2.0f, nullptr); }).find("data must be f32 or bf16; got i64"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda_accumulate(&f, &f, DType::kU8, 1, nullptr); }).find("grads must be f32 or bf16; got u8"),
            std::string::npos);
}

TEST(CudaHost, Mxfp8KernelsRefuseCpuViewsAndWrongShapes) {
  float x[64] = {};
  uint8_t d[64] = {}, s[2] = {};
  const TensorView in{x, DType::kF32, Shape{2, 32}, Device::cpu()};
  const TensorView data{d, DType::kU8, Shape{2, 32}, Device::cpu()};
  const TensorView scales{s, DType::kU8, Shape{2, 1}, Device::cpu()};
  EXPECT_NE(error_of([&] { cuda_mx_quantize(in, data, scales, QuantizeOptions{}, nullptr); })
                .find("the CUDA codec runs on cuda tensors; got values on cpu"),
            std::string::npos);
  const auto on_device = [](TensorView v) {
    v.device = Device::cuda(0);
    return v;
  };
  TensorView wrong_scales = on_device(scales);
  wrong_scales.shape = Shape{1, 2};
  EXPECT_NE(error_of([&] { cuda_mx_quantize(on_device(in), on_device(data), wrong_scales, QuantizeOptions{}, nullptr); })
                .find("scales must be u8 [2, 1] for row-wise blocks"),
            std::string::npos);
  TensorView flat = on_device(in);
  flat.shape = Shape{64};
  EXPECT_NE(error_of([&] { cuda_mx_dequantize(on_device(data), on_device(scales), flat, QuantizeOptions{}, nullptr); })
                .find("expects a 2-D [M, N] tensor"),
            std::string::npos);
  // The shard codec: host views, a shard past the tensor's end, and data of another size.
  const TensorView shard{x, DType::kF32, Shape{40}, Device::cpu()};
  const Shape whole{2, 32};
  EXPECT_NE(error_of([&] { cuda_mx_shard_scales(shard, 0, whole, scales, QuantizeOptions{}, nullptr); })
                .find("cuda_mx_shard_scales: the CUDA codec runs on cuda tensors; got"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda_mx_shard_scales(on_device(shard), 30, whole, on_device(scales), QuantizeOptions{}, nullptr); })
                .find("a shard of 40 elements at offset 30 does not fit a [2, 32] tensor"),
            std::string::npos);
  TensorView short_data = on_device(data);
  short_data.shape = Shape{39};
  EXPECT_NE(error_of([&] {
              cuda_mx_shard_encode(on_device(shard), 0, whole, on_device(scales), short_data, QuantizeOptions{}, nullptr);
            }).find("cuda_mx_shard_encode: data must be u8 [40]"),
            std::string::npos);
}

}  // namespace
}  // namespace mxddp::testing
