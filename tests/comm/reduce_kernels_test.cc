// Every ISA's float reduction kernel this CPU can run (x86-64-v2 always; AVX2 and AVX-512F where
// present) against a scalar reference, element for element and bit for bit: f32 and bf16, sum,
// avg and max, with and without prescale, 1 to 5 inputs, several outputs (one of them an input,
// as all_reduce writes), lengths around every vector width and unrolled step (4 vectors), unaligned
// pointers, and values that exercise bf16 rounding (ties, carries into Inf), NaN, Inf, signed zeros
// and subnormals. Also every ISA's one-to-many copy the gathers use, with plain and streaming stores.
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "compute/reduce.h"
#include "compute/reduce_kernels.h"

namespace mxddp {
namespace {

using reduce_kernels::Combine;
using reduce_kernels::Elem;
using reduce_kernels::FloatReduce;

struct Isa {
  const char* name;
  void (*kernel)(const FloatReduce&);
  bool available;
};

std::vector<Isa> isas() {
  __builtin_cpu_init();
  return {{"x86-64-v2", reduce_kernels::reduce_float_base, true},
          {"avx2", reduce_kernels::reduce_float_avx2, __builtin_cpu_supports("avx2") != 0},
          {"avx512f", reduce_kernels::reduce_float_avx512, __builtin_cpu_supports("avx512f") != 0}};
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// A value drawn to hit the kernel's corner cases now and then, ordinary values otherwise.
float draw(std::mt19937& rng) {
  std::uniform_int_distribution<int> pick(0, 19);
  std::uniform_real_distribution<float> ordinary(-8, 8);
  switch (pick(rng)) {
    case 0: return std::numeric_limits<float>::quiet_NaN();
    case 1: return pick(rng) < 10 ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity();
    case 2: return pick(rng) < 10 ? 0.0f : -0.0f;
    case 3: return from_bits(0x00000001u + static_cast<uint32_t>(rng() % 0x007fffffu));  // subnormal
    case 4: return from_bits((bits_of(ordinary(rng)) & 0xffff0000u) | 0x8000u);      // a bf16 tie
    case 5: return from_bits(0x7f7f8000u | (rng() & 0x7fffu));                        // rounds to Inf in bf16
    default: return ordinary(rng);
  }
}

// The scalar reference: reduce_arrays' documented arithmetic on one element, with core's
// conversions. Returns the stored bits (f32, or bf16 in the low 16 bits).
uint32_t reference(const std::vector<float>& xs, Combine combine, float prescale, Elem elem) {
  float acc = xs[0];
  if (prescale != 1.0f) acc *= prescale;
  for (size_t k = 1; k < xs.size(); ++k) {
    const float x = xs[k];
    if (combine == Combine::kMax) acc = (x > acc || x != x) ? x : acc;
    else if (prescale != 1.0f) acc += x * prescale;
    else acc += x;
  }
  if (combine == Combine::kAvg) acc /= static_cast<float>(xs.size());
  return elem == Elem::kF32 ? bits_of(acc) : f32_to_bf16(acc);
}

bool is_nan_bits(uint32_t bits, Elem elem) {
  return elem == Elem::kF32 ? (bits & 0x7fffffffu) > 0x7f800000u : (bits & 0x7fffu) > 0x7f80u;
}

void check_case(const Isa& isa, Elem elem, Combine combine, float prescale, int n_inputs, int64_t count,
                size_t offset, std::mt19937& rng) {
  const size_t esize = elem == Elem::kF32 ? 4 : 2;
  const size_t stride = static_cast<size_t>(count) + offset + 64;  // room past the end to catch overruns
  // inputs: [n_inputs][stride] elements, each starting `offset` elements into its row
  std::vector<unsigned char> in_bytes(static_cast<size_t>(n_inputs) * stride * esize);
  std::vector<std::vector<float>> values(static_cast<size_t>(count), std::vector<float>(static_cast<size_t>(n_inputs)));
  std::vector<const void*> inputs(static_cast<size_t>(n_inputs));
  for (int k = 0; k < n_inputs; ++k) {
    unsigned char* row = in_bytes.data() + (static_cast<size_t>(k) * stride + offset) * esize;
    inputs[static_cast<size_t>(k)] = row;
    for (int64_t i = 0; i < count; ++i) {
      float v = draw(rng);
      if (elem == Elem::kBF16) {
        const bf16_bits b = f32_to_bf16(v);
        std::memcpy(row + i * 2, &b, 2);
        v = bf16_to_f32(b);
      } else {
        std::memcpy(row + i * 4, &v, 4);
      }
      values[static_cast<size_t>(i)][static_cast<size_t>(k)] = v;
    }
  }
  // outputs: input 0 itself (in place) and two separate buffers at another misalignment
  constexpr unsigned char kGuard = 0xA5;
  std::vector<unsigned char> out_bytes(2 * stride * esize, kGuard);
  void* outputs[3] = {const_cast<void*>(inputs[0]), out_bytes.data() + (offset + 1) * esize,
                      out_bytes.data() + (stride + offset + 3) * esize};
  FloatReduce r;
  r.elem = elem;
  r.combine = combine;
  r.inputs = inputs.data();
  r.n_inputs = n_inputs;
  r.count = count;
  r.outputs = outputs;
  r.n_outputs = 3;
  r.prescale = prescale;
  isa.kernel(r);
  const std::string what = fmt::format("{} {} combine={} prescale={} inputs={} count={} offset={}", isa.name,
                                       elem == Elem::kF32 ? "f32" : "bf16", static_cast<int>(combine), prescale,
                                       n_inputs, count, offset);
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t want = reference(values[static_cast<size_t>(i)], combine, prescale, elem);
    for (int j = 0; j < 3; ++j) {
      uint32_t got = 0;
      std::memcpy(&got, static_cast<unsigned char*>(outputs[j]) + static_cast<size_t>(i) * esize, esize);
      // Two NaNs summed may keep either payload depending on operand order; NaN-ness is what the
      // contract fixes. Every other result must match bit for bit.
      if (is_nan_bits(want, elem)) {
        ASSERT_TRUE(is_nan_bits(got, elem)) << what << " i=" << i << " out=" << j;
      } else {
        ASSERT_EQ(got, want) << what << " i=" << i << " out=" << j;
      }
    }
  }
  // Nothing written outside the outputs' ranges.
  for (size_t b = 0; b < out_bytes.size(); ++b) {
    const size_t e = b / esize;
    const bool in_out1 = e >= offset + 1 && e < offset + 1 + static_cast<size_t>(count);
    const bool in_out2 = e >= stride + offset + 3 && e < stride + offset + 3 + static_cast<size_t>(count);
    if (!in_out1 && !in_out2) {
      ASSERT_EQ(out_bytes[b], kGuard) << what << " byte " << b;
    }
  }
}

TEST(ReduceKernels, EveryIsaMatchesScalarReferenceBitForBit) {
  std::mt19937 rng(11);
  int isas_run = 0;
  for (const Isa& isa : isas()) {
    if (!isa.available) continue;
    ++isas_run;
    for (Elem elem : {Elem::kF32, Elem::kBF16})
      for (Combine combine : {Combine::kSum, Combine::kAvg, Combine::kMax})
        for (float prescale : {1.0f, 0.37f}) {
          if (combine == Combine::kMax && prescale != 1.0f) continue;
          for (int n_inputs : {1, 2, 3, 5})
            for (int64_t count : {0, 1, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 1027})
              for (size_t offset : {size_t{0}, size_t{1}})
                check_case(isa, elem, combine, prescale, n_inputs, count, offset, rng);
        }
  }
  EXPECT_GE(isas_run, 1);
}

TEST(ReduceKernels, DispatchNamesTheWidestIsaTheCpuHas) {
  __builtin_cpu_init();
  const std::string want = __builtin_cpu_supports("avx512f") ? "avx512f"
                           : __builtin_cpu_supports("avx2")  ? "avx2"
                                                             : "x86-64-v2";
  EXPECT_EQ(reduce_kernel_isa(), want);
}

// Every byte lands, at every destination offset within a line (the streaming path starts at the
// destination's next 64-byte line), at lengths around a line and the 256 KiB chunk, for every ISA's
// kernel this CPU runs, with plain and streaming stores, and through copy_to_many (which streams at
// kNontemporalCopyBytesMin and up); nothing outside a destination's range is written.
TEST(CopyToMany, CopiesEveryByteOnEveryKernelAndStorePath) {
  using reduce_kernels::CopyMany;
  std::vector<std::pair<std::string, std::function<void(const void*, void* const*, int, size_t)>>> copies;
  copies.emplace_back("copy_to_many", copy_to_many);
  std::vector<std::pair<std::string, void (*)(const CopyMany&)>> kernels = {{"base", reduce_kernels::copy_many_base}};
  if (__builtin_cpu_supports("avx2")) kernels.emplace_back("avx2", reduce_kernels::copy_many_avx2);
  if (__builtin_cpu_supports("avx512f")) kernels.emplace_back("avx512", reduce_kernels::copy_many_avx512);
  for (const auto& [isa, kernel] : kernels)
    for (bool stream : {false, true})
      copies.emplace_back(isa + (stream ? " streaming" : " plain"),
                          [kernel, stream](const void* src, void* const* dsts, int n_dsts, size_t bytes) {
                            CopyMany c;
                            c.src = src;
                            c.dsts = dsts;
                            c.n_dsts = n_dsts;
                            c.bytes = bytes;
                            c.nontemporal = stream;
                            kernel(c);
                          });
  constexpr size_t kGuard = 64;
  const size_t chunk = size_t{256} << 10;
  const size_t big = kNontemporalCopyBytesMin / 2 + 129;  // x2 destinations: streaming
  std::mt19937 rng(11);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{1000}, chunk - 1, chunk + 77,
                       big}) {
    std::vector<uint8_t> src(bytes + 3);
    for (uint8_t& b : src) b = static_cast<uint8_t>(rng());
    for (size_t dst_offset : {size_t{0}, size_t{1}, size_t{13}, size_t{32}, size_t{63}}) {
      for (size_t src_offset : {size_t{0}, size_t{3}}) {
        for (int n_dsts : {1, 2}) {
          std::vector<std::vector<uint8_t>> dst(static_cast<size_t>(n_dsts),
                                                std::vector<uint8_t>(bytes + dst_offset + 2 * kGuard + 64, 0xA5));
          void* dsts[2];
          for (int j = 0; j < n_dsts; ++j) {
            // kGuard bytes before the range, then dst_offset past a 64-byte line.
            auto* base = dst[static_cast<size_t>(j)].data();
            const size_t to_line = (64 - reinterpret_cast<uintptr_t>(base + kGuard) % 64) % 64;
            dsts[j] = base + kGuard + to_line + dst_offset;
          }
          for (const auto& [name, copy] : copies) {
          std::fill(dst[0].begin(), dst[0].end(), uint8_t{0xA5});
          if (n_dsts == 2) std::fill(dst[1].begin(), dst[1].end(), uint8_t{0xA5});
          copy(src.data() + src_offset, dsts, n_dsts, bytes);
          for (int j = 0; j < n_dsts; ++j) {
            const auto* base = dst[static_cast<size_t>(j)].data();
            const auto begin = static_cast<size_t>(static_cast<const uint8_t*>(dsts[j]) - base);
            for (size_t i = 0; i < dst[static_cast<size_t>(j)].size(); ++i) {
              const uint8_t want = i >= begin && i < begin + bytes ? src[src_offset + i - begin] : uint8_t{0xA5};
              ASSERT_EQ(base[i], want) << name << " bytes=" << bytes << " dst_offset=" << dst_offset
                                       << " src_offset=" << src_offset << " dst " << j << " byte " << i;
            }
          }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace mxddp
