// Small deterministic random numbers for the model and its data: SplitMix64 (Steele, Lea and
// Flood) for integers and Box-Muller for normals. Defined here rather than taken from <random>
// because std::normal_distribution's output is implementation-defined, and the same seed must
// give the same model and the same batches with any standard library.
#pragma once

#include <cmath>
#include <cstdint>

namespace mxddp::model {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A hash of several 64-bit values.
inline uint64_t mix_hash(uint64_t a, uint64_t b, uint64_t c = 0) { return splitmix64(splitmix64(splitmix64(a) ^ b) ^ c); }

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() { return splitmix64(state_++); }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  uint64_t below(uint64_t n) { return next() % n; }
  double normal() {
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

}  // namespace mxddp::model
