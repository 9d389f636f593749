// Every ISA's float reduction kernel this CPU can run (x86-64-v2 always; AVX2 and AVX-512F where
// present) against a scalar reference, element for element and bit for bit: f32 and bf16, sum,
// avg and max, with and without prescale, 1 to 5 inputs, several outputs (one of them an input,
// as all_reduce writes), lengths around every vector width, unaligned pointers, and values that
// exercise bf16 rounding (ties, carries into Inf), NaN, Inf, signed zeros and subnormals. Also the
// one-to-many copy the gathers use.
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "comm/reduce.h"
#include "comm/reduce_kernels.h"

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
            for (int64_t count : {0, 1, 3, 4, 7, 8, 15, 16, 17, 31, 33, 100, 1027})
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

TEST(CopyToMany, EveryDestinationGetsTheBytesAndNothingElse) {
  std::mt19937 rng(5);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{4099}, size_t{600001}}) {
    std::vector<unsigned char> src(bytes + 3);
    for (auto& b : src) b = static_cast<unsigned char>(rng());
    constexpr unsigned char kGuard = 0x5A;
    std::vector<unsigned char> dst(3 * (bytes + 16), kGuard);
    void* dsts[3] = {dst.data() + 1, dst.data() + (bytes + 16) + 7, dst.data() + 2 * (bytes + 16)};
    copy_to_many(src.data() + 3, dsts, 3, bytes);
    for (int j = 0; j < 3; ++j)
      ASSERT_EQ(std::memcmp(dsts[j], src.data() + 3, bytes), 0) << "bytes=" << bytes << " dst " << j;
    size_t untouched = 0;
    for (unsigned char b : dst) untouched += b == kGuard;
    // Random source bytes can equal the guard; count only what must be guard.
    size_t guard_in_copies = 0;
    for (size_t i = 0; i < bytes; ++i) guard_in_copies += src[3 + i] == kGuard;
    EXPECT_EQ(untouched, dst.size() - 3 * bytes + 3 * guard_in_copies) << "bytes=" << bytes;
  }
}

}  // namespace
}  // namespace mxddp
