// MXFP8 quantizer throughput: input bytes per second for row-wise and column-wise quantization of
// f32 and bf16 [M, N] matrices, against single-thread memcpy bandwidth measured in the same run
// (bytes copied per second). The quantizer uses every core; medians of 7 runs.
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include <mxddp/quant.h>

#include "bench_util.h"

int main(int argc, char** argv) {
  using namespace mxddp;
  using namespace mxddp::bench;
  CLI::App app{"MXFP8 quantizer throughput (row- and column-wise, f32 and bf16 input) against memcpy bandwidth"};
  CLI11_PARSE(app, argc, argv);
  const double memcpy_bw = memcpy_bandwidth_bytes_per_s(size_t{256} << 20);
  std::printf("memcpy (1 thread, 256 MiB): %.2f GB/s; quantizer threads: %u\n", memcpy_bw / 1e9,
              std::max(1u, std::thread::hardware_concurrency()));
  std::printf("%-12s %-6s %-5s %-5s %12s %12s %10s\n", "shape", "input", "axis", "elem", "ms", "input_GBps", "vs_memcpy");
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1024, 1024}, {4096, 4096}, {8192, 4096}}) {
    std::vector<float> x(static_cast<size_t>(rows * cols));
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0, 1);
    for (float& v : x) v = d(rng);
    std::vector<bf16_bits> xb(x.size());
    convert_f32_to_bf16(x.data(), xb.data(), x.size());
    std::vector<uint8_t> data(x.size());
    for (DType dtype : {DType::kF32, DType::kBF16})
      for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol})
        for (Fp8Format elem : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
          const Shape ss = mx_scale_shape(rows, cols, axis);
          std::vector<uint8_t> scales(static_cast<size_t>(ss.numel()));
          const TensorView in{dtype == DType::kF32 ? static_cast<void*>(x.data()) : static_cast<void*>(xb.data()), dtype,
                              Shape{rows, cols}};
          std::vector<double> ms;
          for (int run = 0; run < 8; ++run) {
            const double t0 = now_s();
            mx_quantize(in, TensorView{data.data(), DType::kU8, Shape{rows, cols}}, TensorView{scales.data(), DType::kU8, ss},
                        {elem, ScaleMode::kRceil, axis});
            if (run > 0) ms.push_back((now_s() - t0) * 1e3);
          }
          const double t = median(ms);
          const double gbps = static_cast<double>(in.nbytes()) / (t / 1e3);
          std::printf("%-12s %-6s %-5s %-5s %12.2f %12.2f %10.2f\n", fmt::format("{}x{}", rows, cols).c_str(),
                      std::string(dtype_name(dtype)).c_str(), axis == QuantAxis::kRow ? "row" : "col",
                      std::string(fp8_format_name(elem)).c_str(), t, gbps / 1e9, gbps / memcpy_bw);
        }
  }
  return 0;
}
