// The CUDA kernels' throughput against the device's own copy bandwidth, measured in the same run
// (issue 41's figures; run by scripts/gpu_check.sh on the GPU machine): MXFP8 quantize row- and
// column-wise and dequantize (E4M3, bf16 values), AdamW on an F32 shard (param = main, grad, two
// moments). Bytes count what each kernel must read and write once; the copy's count its read and
// its write. Each kernel runs twice: on aligned views (the wide kernels) and on views one element
// off alignment, marked "(element)" (the element kernels), which shows what the wide ones gain. Each figure is the median of --runs timed launches (CUDA events) after one warm-up.
// Prints one line per figure; exits 77 without a device.
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>

#include <mxddp/cuda.h>

#include "bench_util.h"

namespace {

using namespace mxddp;

// Median seconds of fn() over runs launches on the default stream, after one warm-up.
template <typename Fn>
double time_s(int runs, Fn&& fn) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  fn();
  std::vector<double> times;
  for (int r = 0; r < runs; ++r) {
    cudaEventRecord(start, nullptr);
    fn();
    cudaEventRecord(stop, nullptr);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms * 1e-3);
  }
  cuda_synchronize(nullptr);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return bench::median(times);
}

void report(const char* what, double bytes, double seconds, double copy_bytes_per_s) {
  const double rate = bytes / seconds;
  std::printf("%-34s %10.3f ms %9.1f GB/s  %.2f of copy\n", what, seconds * 1e3, rate * 1e-9, rate / copy_bytes_per_s);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The CUDA kernels against the device-to-device copy bandwidth of the same run"};
  int64_t rows = 8192, cols = 8192, adam_numel = int64_t{1} << 28;
  int runs = 10;
  app.add_option("--mx-rows", rows, "rows of the MXFP8 tensor (bf16 values)")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--mx-cols", cols, "columns of the MXFP8 tensor")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--adam-numel", adam_numel, "elements of the AdamW shard (default 2^28: 1 GiB of F32 per tensor)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
  app.add_option("--runs", runs, "timed launches per figure (median)")->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);
  std::string why;
  if (cuda_device_count(&why) == 0) {
    std::printf("SKIP: %s\n", why.c_str());
    return 77;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("# %s, %d SMs, %.0f MB L2; medians of %d launches\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize / 1e6, runs);
  MemoryTracker tracker;
  const auto buffer = [&](size_t bytes) { return DeviceBuffer(bytes, MemoryCategory::kScratch, tracker, nullptr); };

  // The yardstick: a 1 GiB device-to-device copy, read + write.
  const size_t copy_bytes = size_t{1} << 30;
  DeviceBuffer src = buffer(copy_bytes), dst = buffer(copy_bytes);
  cudaMemsetAsync(src.data(), 1, copy_bytes, nullptr);
  const double copy_s = time_s(runs, [&] { cuda_copy(dst.data(), src.data(), copy_bytes, nullptr); });
  const double copy_rate = 2.0 * copy_bytes / copy_s;
  report("device-to-device copy (1 GiB)", 2.0 * copy_bytes, copy_s, copy_rate);
  src = DeviceBuffer();
  dst = DeviceBuffer();

  {
    const int64_t n = rows * cols;
    // 16 spare bytes each, for the views skewed one element off alignment (the element kernels).
    DeviceBuffer values = buffer(static_cast<size_t>(n) * 2 + 16), data = buffer(static_cast<size_t>(n) + 16);
    DeviceBuffer out = buffer(static_cast<size_t>(n) * 2 + 16);
    std::vector<bf16_bits> host(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) host[static_cast<size_t>(i)] = f32_to_bf16(static_cast<float>((i * 2654435761u) % 2001) - 1000.0f);
    cuda_copy(values.data(), host.data(), host.size() * 2, nullptr);
    const Shape shape{rows, cols};
    // skew 0: the wide kernels (where the shape fits them); skew 1: the element kernels.
    for (int skew : {0, 1}) {
      const auto at = [&](const DeviceBuffer& b, DType dt) {
        return TensorView{static_cast<char*>(b.data()) + skew * dtype_size_bytes(dt), dt, shape, b.view(dt, Shape{1}).device};
      };
      const TensorView v = at(values, DType::kBF16), d = at(data, DType::kU8), o = at(out, DType::kBF16);
      const char* kind = skew == 0 ? "" : " (element)";
      for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) {
        const QuantizeOptions opt{Fp8Format::kE4M3, ScaleMode::kRceil, axis};
        const Shape scale_shape = mx_scale_shape(rows, cols, axis);
        DeviceBuffer scales = buffer(static_cast<size_t>(scale_shape.numel()) + 16);
        const TensorView s{static_cast<uint8_t*>(scales.data()) + skew, DType::kU8, scale_shape, v.device};
        const double bytes = 3.0 * static_cast<double>(n) + static_cast<double>(scale_shape.numel());
        const std::string axis_name = axis == QuantAxis::kRow ? "row" : "col";
        const std::string name = "mx_quantize " + axis_name + " e4m3 bf16" + kind;
        report(name.c_str(), bytes, time_s(runs, [&] { cuda_mx_quantize(v, d, s, opt, nullptr); }), copy_rate);
        const std::string back = "mx_dequantize " + axis_name + " to bf16" + kind;
        report(back.c_str(), bytes, time_s(runs, [&] { cuda_mx_dequantize(d, s, o, opt, nullptr); }), copy_rate);
      }
    }
  }
  {
    const auto bytes = static_cast<size_t>(adam_numel) * 4;
    // One spare element each, for the skewed run (the element kernel).
    DeviceBuffer grad = buffer(bytes + 4), param = buffer(bytes + 4), m = buffer(bytes + 4), v = buffer(bytes + 4);
    cudaMemsetAsync(grad.data(), 0, bytes + 4, nullptr);
    cudaMemsetAsync(param.data(), 0, bytes + 4, nullptr);
    cudaMemsetAsync(m.data(), 0, bytes + 4, nullptr);
    cudaMemsetAsync(v.data(), 0, bytes + 4, nullptr);
    const AdamWScalars a{.lr = 1e-3f, .weight_decay = 0.1f, .step_size = 1e-3f, .bias_correction2_sqrt = 0.1f};
    for (int skew : {0, 1}) {
      const auto f = [&](const DeviceBuffer& b) { return static_cast<float*>(b.data()) + skew; };
      const double s = time_s(runs, [&] {
        cuda_adamw(f(grad), DType::kF32, f(param), f(m), f(v), nullptr, DType::kF32, adam_numel, a, nullptr);
      });
      // Reads grad, param, exp_avg, exp_avg_sq; writes the last three.
      report(skew == 0 ? "adamw f32 shard (param, grad, m, v)" : "adamw f32 shard (element)", 7.0 * static_cast<double>(bytes),
             s, copy_rate);
      if (skew == 0) std::printf("adamw_ms %.4f numel %lld\n", s * 1e3, static_cast<long long>(adam_numel));
    }
  }
  return 0;
}
