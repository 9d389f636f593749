// cuda.h's kernel entry points: each checks its arguments (sizes, dtypes, devices) and names what
// is wrong, then enqueues the kernel through its launcher beside the CPU reference
// (src/core/elementwise_cuda.cu, src/quant/mxfp8_cuda.cu, src/optim/optim_cuda.cu) and turns a launch
// failure into an Error naming the kernel.
#include <mxddp/cuda.h>

#include "core/elementwise_cuda.h"
#include "cuda/cuda_check.h"
#include "optim/optim_cuda.h"
#include "quant/mxfp8_checks.h"
#include "quant/mxfp8_cuda.h"

namespace mxddp {
namespace {

static_assert(kCudaSumOfSquaresNumel == cuda_kernels::kSumOfSquaresNumel);

void check_elements(std::string_view op, int64_t n, const void* a, const void* b) {
  MXDDP_CHECK(n >= 0, "{}: n = {} elements; valid: n >= 0", op, n);
  MXDDP_CHECK(n == 0 || (a != nullptr && b != nullptr), "{}: a null pointer for {} elements", op, n);
}

// Whether dtype is bf16; throws naming op and what unless it is f32 or bf16, the kernels' two.
bool is_bf16(std::string_view op, std::string_view what, DType dtype) {
  MXDDP_CHECK(dtype == DType::kF32 || dtype == DType::kBF16, "{}: {} must be f32 or bf16; got {}", op, what,
              dtype_name(dtype));
  return dtype == DType::kBF16;
}

cuda_kernels::GradKind grad_kind(std::string_view op, DType dtype) {
  return is_bf16(op, "grads", dtype) ? cuda_kernels::GradKind::kBF16 : cuda_kernels::GradKind::kF32;
}

cuda_kernels::ParamKind param_kind(std::string_view op, const void* param, DType dtype) {
  if (param == nullptr) return cuda_kernels::ParamKind::kNone;
  return is_bf16(op, "staged params", dtype) ? cuda_kernels::ParamKind::kBF16 : cuda_kernels::ParamKind::kF32;
}

// The CPU codec's rules on device views, and the launch shape they describe.
cuda_kernels::MxShape check_mx(const TensorView& values, const TensorView& data, const TensorView& scales,
                               const QuantizeOptions& o, std::string_view op) {
  check_mx_views(values, data, scales, o, op, Device::Kind::kCuda);
  return {.rows = values.shape[0], .cols = values.shape[1], .e4m3 = o.elem == Fp8Format::kE4M3,
          .rceil = o.scale_mode == ScaleMode::kRceil, .colwise = o.axis == QuantAxis::kCol};
}

// The shard codec's rules, and every view given on a CUDA device.
cuda_kernels::MxShape check_mx_shard_on_device(const TensorView& shard, int64_t offset, const Shape& shape,
                                               const TensorView& scales, const TensorView* data,
                                               const QuantizeOptions& o, std::string_view op) {
  check_mx_shard(shard, offset, shape, scales, o, op);
  for (const TensorView* v : {&shard, &scales, data})
    MXDDP_CHECK(v == nullptr || v->numel() == 0 || v->device.kind == Device::Kind::kCuda,
                "{}: the CUDA codec runs on cuda tensors; got {}", op, v->to_string());
  return {.rows = shape[0], .cols = shape[1], .e4m3 = o.elem == Fp8Format::kE4M3,
          .rceil = o.scale_mode == ScaleMode::kRceil, .colwise = o.axis == QuantAxis::kCol};
}

}  // namespace

void cuda_mx_shard_scales(const TensorView& shard, int64_t offset, const Shape& shape, TensorView scales,
                          const QuantizeOptions& options, CudaStream stream) {
  const cuda_kernels::MxShape s =
      check_mx_shard_on_device(shard, offset, shape, scales, nullptr, options, "cuda_mx_shard_scales");
  MXDDP_CUDA_CHECK(cuda_kernels::launch_mx_shard_scales(shard.data, shard.dtype == DType::kBF16, offset, shard.numel(),
                                                        scales.data_as<uint8_t>(), s, stream),
                   "cuda_mx_shard_scales of {} at {} of {}", shard.to_string(), offset, shape.to_string());
}

void cuda_mx_shard_encode(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                          TensorView data, const QuantizeOptions& options, CudaStream stream) {
  const cuda_kernels::MxShape s =
      check_mx_shard_on_device(shard, offset, shape, scales, &data, options, "cuda_mx_shard_encode");
  MXDDP_CHECK(data.dtype == DType::kU8 && data.numel() == shard.numel(),
              "cuda_mx_shard_encode: data must be u8 [{}]; got {}", shard.numel(), data.to_string());
  MXDDP_CUDA_CHECK(cuda_kernels::launch_mx_shard_encode(shard.data, shard.dtype == DType::kBF16, offset, shard.numel(),
                                                        scales.data_as<const uint8_t>(), data.data_as<uint8_t>(), s,
                                                        stream),
                   "cuda_mx_shard_encode of {} at {} of {}", shard.to_string(), offset, shape.to_string());
}

void cuda_convert_f32_to_bf16(const float* in, bf16_bits* out, int64_t n, CudaStream stream) {
  check_elements("cuda_convert_f32_to_bf16", n, in, out);
  MXDDP_CUDA_CHECK(cuda_kernels::launch_f32_to_bf16(in, out, n, stream), "cuda_convert_f32_to_bf16 of {} elements", n);
}

void cuda_convert_bf16_to_f32(const bf16_bits* in, float* out, int64_t n, CudaStream stream) {
  check_elements("cuda_convert_bf16_to_f32", n, in, out);
  MXDDP_CUDA_CHECK(cuda_kernels::launch_bf16_to_f32(in, out, n, stream), "cuda_convert_bf16_to_f32 of {} elements", n);
}

void cuda_scale(void* data, DType dtype, int64_t n, float factor, CudaStream stream) {
  check_elements("cuda_scale", n, data, data);
  MXDDP_CUDA_CHECK(cuda_kernels::launch_scale(data, is_bf16("cuda_scale", "data", dtype), n, factor, stream),
                   "cuda_scale of {} {} elements", n, dtype_name(dtype));
}

void cuda_zero(void* data, size_t bytes, CudaStream stream) {
  if (bytes == 0) return;
  MXDDP_CHECK(data != nullptr, "cuda_zero: a null pointer for {} bytes", bytes);
  MXDDP_CUDA_CHECK(cudaMemsetAsync(data, 0, bytes, stream), "cuda_zero of {} bytes", bytes);
}

void cuda_count_nonfinite(const void* data, DType dtype, int64_t n, int64_t* count_device, CudaStream stream) {
  MXDDP_CHECK(count_device != nullptr, "cuda_count_nonfinite: count_device is null");
  check_elements("cuda_count_nonfinite", n, data, count_device);
  const bool bf16 = is_bf16("cuda_count_nonfinite", "data", dtype);
  static_assert(sizeof(int64_t) == sizeof(unsigned long long));
  MXDDP_CUDA_CHECK(cuda_kernels::launch_count_nonfinite(data, bf16, n,
                                                        reinterpret_cast<unsigned long long*>(count_device), stream),
                   "cuda_count_nonfinite over {} elements", n);
}

void cuda_count_zeros(const void* data, DType dtype, int64_t n, int64_t* count_device, CudaStream stream) {
  MXDDP_CHECK(count_device != nullptr, "cuda_count_zeros: count_device is null");
  check_elements("cuda_count_zeros", n, data, count_device);
  const bool bf16 = is_bf16("cuda_count_zeros", "data", dtype);
  MXDDP_CUDA_CHECK(cuda_kernels::launch_count_zeros(data, bf16, n, reinterpret_cast<unsigned long long*>(count_device),
                                                    stream),
                   "cuda_count_zeros over {} elements", n);
}

void cuda_accumulate(float* main_grad, const void* grad, DType grad_dtype, int64_t n, CudaStream stream) {
  check_elements("cuda_accumulate", n, main_grad, grad);
  MXDDP_CUDA_CHECK(cuda_kernels::launch_accumulate(main_grad, grad, is_bf16("cuda_accumulate", "grads", grad_dtype), n,
                                                   stream),
                   "cuda_accumulate of {} elements", n);
}

void cuda_mx_quantize(const TensorView& input, TensorView data, TensorView scales, const QuantizeOptions& options,
                      CudaStream stream) {
  const cuda_kernels::MxShape shape = check_mx(input, data, scales, options, "cuda_mx_quantize");
  MXDDP_CUDA_CHECK(cuda_kernels::launch_mx_quantize(input.data, input.dtype == DType::kBF16, data.data_as<uint8_t>(),
                                                    scales.data_as<uint8_t>(), shape, stream),
                   "cuda_mx_quantize of {}", input.to_string());
}

void cuda_mx_dequantize(const TensorView& data, const TensorView& scales, TensorView output,
                        const QuantizeOptions& options, CudaStream stream) {
  const cuda_kernels::MxShape shape = check_mx(output, data, scales, options, "cuda_mx_dequantize");
  MXDDP_CUDA_CHECK(cuda_kernels::launch_mx_dequantize(data.data_as<const uint8_t>(), scales.data_as<const uint8_t>(),
                                                      output.data, output.dtype == DType::kBF16, shape, stream),
                   "cuda_mx_dequantize into {}", output.to_string());
}

void cuda_adamw(const void* grad, DType grad_dtype, float* main, float* exp_avg, float* exp_avg_sq, void* param,
                DType param_dtype, int64_t n, const AdamWScalars& a, CudaStream stream) {
  check_elements("cuda_adamw", n, grad, main);
  check_elements("cuda_adamw", n, exp_avg, exp_avg_sq);
  const optim_kernel::AdamScalars s{a.lr,        a.weight_decay, a.beta1, a.beta2, a.eps, a.step_size,
                                    a.bias_correction2_sqrt, a.clip_coeff, a.l2};
  MXDDP_CUDA_CHECK(cuda_kernels::launch_adamw(grad, grad_kind("cuda_adamw", grad_dtype), main, exp_avg, exp_avg_sq, param,
                                              param_kind("cuda_adamw", param, param_dtype), n, s, stream),
                   "cuda_adamw over {} elements", n);
}

void cuda_sgd(const void* grad, DType grad_dtype, float* main, float* momentum, void* param, DType param_dtype,
              int64_t n, const SgdScalars& a, CudaStream stream) {
  check_elements("cuda_sgd", n, grad, main);
  check_elements("cuda_sgd", n, momentum, main);
  const optim_kernel::SgdScalars s{a.lr, a.weight_decay, a.momentum, a.clip_coeff};
  MXDDP_CUDA_CHECK(cuda_kernels::launch_sgd(grad, grad_kind("cuda_sgd", grad_dtype), main, momentum, param,
                                            param_kind("cuda_sgd", param, param_dtype), n, s, stream),
                   "cuda_sgd over {} elements", n);
}

void cuda_sum_of_squares(const void* grad, DType grad_dtype, int64_t n, double* out_device, CudaStream stream) {
  MXDDP_CHECK(out_device != nullptr, "cuda_sum_of_squares: out_device is null; it must hold {} doubles",
              kCudaSumOfSquaresNumel);
  check_elements("cuda_sum_of_squares", n, grad, out_device);
  MXDDP_CUDA_CHECK(cuda_kernels::launch_sum_of_squares(grad, grad_kind("cuda_sum_of_squares", grad_dtype), n,
                                                       out_device, stream),
                   "cuda_sum_of_squares over {} elements", n);
}

}  // namespace mxddp
