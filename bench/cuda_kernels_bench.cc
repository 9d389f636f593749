// The CUDA kernels' throughput against the device's own copy bandwidth, measured in the same run
// (issue 41's figures; run by scripts/gpu_check.sh on the GPU machine): MXFP8 quantize row- and
// column-wise and dequantize (E4M3, bf16 values), AdamW on an F32 shard (param = main, grad, two
// moments). Bytes count what each kernel must read and write once; the copy's count its read and
// its write. Each figure is the median of --runs timed launches (CUDA events) after one warm-up.
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
    DeviceBuffer values = buffer(static_cast<size_t>(n) * 2), data = buffer(static_cast<size_t>(n));
    DeviceBuffer out = buffer(static_cast<size_t>(n) * 2);
    std::vector<bf16_bits> host(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) host[static_cast<size_t>(i)] = f32_to_bf16(static_cast<float>((i * 2654435761u) % 2001) - 1000.0f);
    cuda_copy(values.data(), host.data(), host.size() * 2, nullptr);
    const Shape shape{rows, cols};
    const TensorView v = values.view(DType::kBF16, shape), d = data.view(DType::kU8, shape), o = out.view(DType::kBF16, shape);
    for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) {
      const QuantizeOptions opt{Fp8Format::kE4M3, ScaleMode::kRceil, axis};
      const Shape scale_shape = mx_scale_shape(rows, cols, axis);
      DeviceBuffer scales = buffer(static_cast<size_t>(scale_shape.numel()));
      const TensorView s = scales.view(DType::kU8, scale_shape);
      const double bytes = 3.0 * static_cast<double>(n) + static_cast<double>(scale_shape.numel());
      const std::string name = std::string("mx_quantize ") + (axis == QuantAxis::kRow ? "row" : "col") + " e4m3 bf16";
      report(name.c_str(), bytes, time_s(runs, [&] { cuda_mx_quantize(v, d, s, opt, nullptr); }), copy_rate);
      const std::string back = std::string("mx_dequantize ") + (axis == QuantAxis::kRow ? "row" : "col") + " to bf16";
      report(back.c_str(), bytes, time_s(runs, [&] { cuda_mx_dequantize(d, s, o, opt, nullptr); }), copy_rate);
    }
  }
  {
    const auto bytes = static_cast<size_t>(adam_numel) * 4;
    DeviceBuffer grad = buffer(bytes), param = buffer(bytes), m = buffer(bytes), v = buffer(bytes);
    cudaMemsetAsync(grad.data(), 0, bytes, nullptr);
    cudaMemsetAsync(param.data(), 0, bytes, nullptr);
    cudaMemsetAsync(m.data(), 0, bytes, nullptr);
    cudaMemsetAsync(v.data(), 0, bytes, nullptr);
    const AdamWScalars a{.lr = 1e-3f, .weight_decay = 0.1f, .step_size = 1e-3f, .bias_correction2_sqrt = 0.1f};
    const double s = time_s(runs, [&] {
      cuda_adamw(grad.data(), DType::kF32, static_cast<float*>(param.data()), static_cast<float*>(m.data()),
                 static_cast<float*>(v.data()), nullptr, DType::kF32, adam_numel, a, nullptr);
    });
    // Reads grad, param, exp_avg, exp_avg_sq; writes the last three.
    report("adamw f32 shard (param, grad, m, v)", 7.0 * static_cast<double>(bytes), s, copy_rate);
    std::printf("adamw_ms %.4f numel %lld\n", s * 1e3, static_cast<long long>(adam_numel));
  }
  return 0;
}
