// All-core streaming bandwidth, STREAM-style: the limit the local collectives are measured against.
// One thread per core, each on its own first-touched arrays; bytes are counted as STREAM counts
// them (every element read or written once, no read-for-ownership). Three kernels run and the
// best median wins, so the limit is the fastest way this memory system streams at that footprint:
//   copy  a[i] = b[i]         with non-temporal stores (glibc's memcpy keeps regular stores up to
//                             3/4 of the reported L3, which on a VM can be hundreds of MiB)
//   triad a[i] = b[i] + s*c[i]
//   add   a[i] += b[i]        in place, the pattern of an in-place reduction (no RFO)
// The footprint (all threads' arrays together) is chosen by the caller: the same bytes a
// collective touches, so a collective whose buffers sit in the LLC is compared with what the
// LLC streams, not with DRAM.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <barrier>
#include <cstring>
#include <thread>
#include <vector>

#include <mxddp/memory.h>

#include "bench_util.h"

namespace mxddp::bench {

namespace stream_detail {

// dst, src: [n] f32, 64-byte aligned (HostBuffer), n a multiple of 16.
__attribute__((target("avx512f"))) inline void copy_nt_avx512(float* dst, const float* src, size_t n) {
  for (size_t i = 0; i < n; i += 16) _mm512_stream_ps(dst + i, _mm512_load_ps(src + i));
  _mm_sfence();
}
__attribute__((target("avx"))) inline void copy_nt_avx(float* dst, const float* src, size_t n) {
  for (size_t i = 0; i < n; i += 8) _mm256_stream_ps(dst + i, _mm256_load_ps(src + i));
  _mm_sfence();
}
inline void copy_nt(float* dst, const float* src, size_t n) {
  if (__builtin_cpu_supports("avx512f")) return copy_nt_avx512(dst, src, n);
  if (__builtin_cpu_supports("avx")) return copy_nt_avx(dst, src, n);
  for (size_t i = 0; i < n; i += 4) _mm_stream_ps(dst + i, _mm_load_ps(src + i));
  _mm_sfence();
}
// Plain loops the compiler vectorizes once per ISA; the widest the CPU has runs.
__attribute__((target_clones("avx512f", "avx2", "default"))) inline void triad(float* a, const float* b,
                                                                             const float* c, size_t n) {
  for (size_t i = 0; i < n; ++i) a[i] = b[i] + 3.0f * c[i];
}
__attribute__((target_clones("avx512f", "avx2", "default"))) inline void add_in_place(float* a, const float* b,
                                                                                    size_t n) {
  for (size_t i = 0; i < n; ++i) a[i] += b[i];
}

}  // namespace stream_detail

struct StreamBandwidth {
  double copy_bytes_per_s = 0, triad_bytes_per_s = 0, add_bytes_per_s = 0;
  int threads = 0;
  double best() const { return std::max({copy_bytes_per_s, triad_bytes_per_s, add_bytes_per_s}); }
};

// Streaming bandwidth over all cores with `footprint_bytes` of arrays in total, median of `runs`
// per kernel.
inline StreamBandwidth stream_bandwidth(size_t footprint_bytes, int runs = 7) {
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // Three arrays per thread (triad needs them); copy and add use two of them.
  const size_t numel = std::max<size_t>(footprint_bytes / 4 / 3 / static_cast<size_t>(threads) / 16 * 16, 16);
  MemoryTracker tracker;
  std::vector<HostBuffer> arrays;  // [threads x 3] each [numel] f32
  arrays.resize(static_cast<size_t>(threads) * 3);
  std::barrier sync(threads);
  std::vector<std::vector<double>> seconds(3);  // per kernel: [runs]
  auto body = [&](int t) {
    float* a[3];
    for (int k = 0; k < 3; ++k) {
      HostBuffer& buf = arrays[static_cast<size_t>(t) * 3 + static_cast<size_t>(k)];
      buf = HostBuffer(numel * 4, MemoryCategory::kScratch, tracker);
      a[k] = static_cast<float*>(buf.data());
      std::fill(a[k], a[k] + numel, 1.0f);  // first touch on this thread
    }
    for (int kernel = 0; kernel < 3; ++kernel)
      for (int r = -1; r < runs; ++r) {  // run -1 warms up
        sync.arrive_and_wait();
        const double t0 = now_s();
        if (kernel == 0) stream_detail::copy_nt(a[0], a[1], numel);
        else if (kernel == 1) stream_detail::triad(a[0], a[1], a[2], numel);
        else stream_detail::add_in_place(a[0], a[1], numel);
        sync.arrive_and_wait();
        if (t == 0 && r >= 0) seconds[static_cast<size_t>(kernel)].push_back(now_s() - t0);
      }
  };
  {
    std::vector<std::jthread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back(body, t);
  }
  const double array_bytes = static_cast<double>(numel) * 4 * threads;  // one array, all threads
  StreamBandwidth bw;
  bw.threads = threads;
  bw.copy_bytes_per_s = 2 * array_bytes / median(seconds[0]);
  bw.triad_bytes_per_s = 3 * array_bytes / median(seconds[1]);
  bw.add_bytes_per_s = 3 * array_bytes / median(seconds[2]);
  return bw;
}

}  // namespace mxddp::bench
