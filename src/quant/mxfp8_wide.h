// The wide MXFP8 kernels' per-thread work (mxfp8_wide_cuda.cu), as host-and-device functions so
// that tests/cuda/wide_kernels_host_test.cc can run every thread's share on the CPU (the warp's
// shuffles and the block's barriers emulated) against mx_quantize / mx_dequantize where no GPU is.
//
// Why wide: the element kernels (mxfp8_cuda.cu) move one value per thread and encode in software;
// here a thread moves 8 values (16 codes when decoding) with 16-byte loads and 8- or 16-byte
// stores, and encodes two values per instruction with the FP8 conversion of sm_89 and later
// (cvt.rn.satfinite, through cuda_fp8.h; its host form is the software reference). Both round to
// nearest even and saturate finite values to the format's largest, as fp8::encode does; the only
// inputs where they differ, NaNs, never reach the encoder (a block holding one stores zeros).
//
// Layouts (a "group" is one thread's share):
//   rows: group g is the flat elements [8g, 8g + 8); with cols % 32 == 0 the four groups
//         4b .. 4b + 3 make block b, whose scale is scales[b]. The block's amax is a max over
//         the four threads (lanes 4k .. 4k + 3 of a warp).
//   cols: a thread block takes a tile of 32 rows (one band) x 64 columns through shared memory:
//         thread t loads and stores row t / 8, columns 8 (t % 8) .. + 8; for the amax, thread t
//         takes column t / 4, rows 8 (t % 4) .. + 8, and four threads make the column's max.
//   dequantize: group g is the flat codes [16g, 16g + 16), all in one row-wise block (cols % 32
//         == 0) or, column-wise, in one row with 16 consecutive scales (cols % 16 == 0).
#pragma once

#include <cstdint>

#include <cuda_fp8.h>
#include <vector_functions.h>
#include <vector_types.h>

#include "cuda/vector_access.h"
#include "fp8_element.h"

namespace mxddp::cuda_kernels::wide {

inline constexpr int kBlock = fp8::kMxBlock;
inline constexpr int kRowGroup = 8;      // values per thread, row-wise and in a column tile's row
inline constexpr int kDecodeGroup = 16;  // codes per thread when dequantizing
inline constexpr int kTileCols = 64;     // a column tile's width
inline constexpr int kTileThreads = kBlock * kTileCols / kRowGroup;  // 256
inline constexpr int kTilePitch = kTileCols + 1;  // shared-memory row pitch: the amax reads hit 32 banks

using fp8::abs_bits;
using fp8::amax_from_bits;
MXDDP_HOST_DEVICE inline uint32_t max_bits(uint32_t a, uint32_t b) { return a > b ? a : b; }

// Eight values from in + i (16-byte aligned), widened to f32.
MXDDP_HOST_DEVICE inline void load8(const float* in, int64_t i, float v[kRowGroup]) {
  const float4 a = load_vec<float4>(in + i), b = load_vec<float4>(in + i + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
MXDDP_HOST_DEVICE inline void load8(const bf16_bits* in, int64_t i, float v[kRowGroup]) {
  const uint4 q = load_vec<uint4>(in + i);
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  for (int k = 0; k < 4; ++k) {  // little-endian: the lower half is the earlier element
    v[2 * k] = bf16_to_f32(static_cast<bf16_bits>(w[k] & 0xffffu));
    v[2 * k + 1] = bf16_to_f32(static_cast<bf16_bits>(w[k] >> 16));
  }
}

// Two finite values' codes, the first in the low byte.
template <bool E4M3>
MXDDP_HOST_DEVICE inline uint32_t encode2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, E4M3 ? __NV_E4M3 : __NV_E5M2);
}

// Eight values times their scale inverses, encoded, element k in byte k; zero bytes where
// nan[k] (the NaN-scaled blocks, as mx_quantize stores).
template <bool E4M3>
MXDDP_HOST_DEVICE inline uint2 encode8(const float v[kRowGroup], const float inv[kRowGroup], const bool nan[kRowGroup]) {
  uint32_t w[2];
  for (int h = 0; h < 2; ++h) {
    uint32_t word = 0;
    for (int k = 0; k < 4; k += 2) {
      const int e = 4 * h + k;
      uint32_t pair = encode2<E4M3>(v[e] * inv[e], v[e + 1] * inv[e + 1]);
      if (nan[e]) pair &= 0xff00u;
      if (nan[e + 1]) pair &= 0x00ffu;
      word |= pair << (8 * k);
    }
    w[h] = word;
  }
  return make_uint2(w[0], w[1]);
}

// ---- row-wise quantize: cols % 32 == 0, in 16-byte aligned, data 8-byte aligned ----

// Loads group g into v; returns the group's largest |x| as bits (the block's is the max over its
// four groups).
template <typename T>
MXDDP_HOST_DEVICE inline uint32_t row_group_load(const T* in, int64_t g, float v[kRowGroup]) {
  load8(in, g * kRowGroup, v);
  uint32_t amax = 0;
  for (int k = 0; k < kRowGroup; ++k) amax = max_bits(amax, abs_bits(v[k]));
  return amax;
}

// Encodes group g with its block's amax; the block's first group writes the scale.
template <bool E4M3>
MXDDP_HOST_DEVICE inline void row_group_store(const float v[kRowGroup], uint32_t block_amax, int64_t g, bool rceil,
                                              uint8_t* data, uint8_t* scales) {
  const uint8_t scale = fp8::scale_for_amax(amax_from_bits(block_amax), fp8::spec_of(E4M3), rceil);
  if (g % (kBlock / kRowGroup) == 0) scales[g / (kBlock / kRowGroup)] = scale;
  const bool nan_block = scale == fp8::kE8M0NanCode;
  const float inv = nan_block ? 0.0f : fp8::e8m0_inverse(scale);
  float invs[kRowGroup];
  bool nans[kRowGroup];
  for (int k = 0; k < kRowGroup; ++k) invs[k] = inv, nans[k] = nan_block;
  store_vec(data + g * kRowGroup, encode8<E4M3>(v, invs, nans));
}

// ---- column-wise quantize: cols % 8 == 0, in 16-byte aligned, data 8-byte aligned ----

struct ColTile {
  float values[kBlock][kTilePitch];  // [32 rows of the band, 64 columns of the tile]
  float inv[kTileCols];              // each column's scale inverse
  bool nan[kTileCols];               // each column's block is NaN-scaled
};

// Phase 1, thread t: loads its 8 values of the tile at (row r0, column c0) into shared memory;
// zeros past the tensor's last row or column (they leave a column's max unchanged).
template <typename T>
MXDDP_HOST_DEVICE inline void col_tile_load(const T* in, int64_t rows, int64_t cols, int64_t r0, int64_t c0, int t,
                                            ColTile& tile) {
  const int row = t / (kTileCols / kRowGroup), col = (t % (kTileCols / kRowGroup)) * kRowGroup;
  float v[kRowGroup] = {};
  if (r0 + row < rows && c0 + col < cols) load8(in, (r0 + row) * cols + c0 + col, v);
  for (int k = 0; k < kRowGroup; ++k) tile.values[row][col + k] = v[k];
}

// Phase 2, thread t: the largest |x| (as bits) of its quarter of column t / 4.
MXDDP_HOST_DEVICE inline uint32_t col_tile_partial_amax(const ColTile& tile, int t) {
  const int col = t / 4, row0 = (t % 4) * (kBlock / 4);
  uint32_t amax = 0;
  for (int k = 0; k < kBlock / 4; ++k) amax = max_bits(amax, abs_bits(tile.values[row0 + k][col]));
  return amax;
}

// Phase 2, the column's first thread (t % 4 == 0): the column's scale, to the scales and the tile.
template <bool E4M3>
MXDDP_HOST_DEVICE inline void col_tile_scale(uint32_t column_amax, int64_t cols, int64_t band, int64_t c0, int t,
                                             bool rceil, uint8_t* scales, ColTile& tile) {
  const int col = t / 4;
  const uint8_t scale = fp8::scale_for_amax(amax_from_bits(column_amax), fp8::spec_of(E4M3), rceil);
  if (c0 + col < cols) scales[band * cols + c0 + col] = scale;
  tile.nan[col] = scale == fp8::kE8M0NanCode;
  tile.inv[col] = tile.nan[col] ? 0.0f : fp8::e8m0_inverse(scale);
}

// Phase 3, thread t: encodes its 8 values of the tile with their columns' scales.
template <bool E4M3>
MXDDP_HOST_DEVICE inline void col_tile_store(const ColTile& tile, int64_t rows, int64_t cols, int64_t r0, int64_t c0,
                                             int t, uint8_t* data) {
  const int row = t / (kTileCols / kRowGroup), col = (t % (kTileCols / kRowGroup)) * kRowGroup;
  if (r0 + row >= rows || c0 + col >= cols) return;
  store_vec(data + (r0 + row) * cols + c0 + col, encode8<E4M3>(&tile.values[row][col], &tile.inv[col], &tile.nan[col]));
}

// ---- dequantize: data, scales (column-wise) and out 16-byte aligned; cols % 32 == 0 row-wise,
// cols % 16 == 0 column-wise. table[c] = fp8::decode(c): the product below is mx_dequantize's. ----

MXDDP_HOST_DEVICE inline void store16(float* out, int64_t i, const float v[kDecodeGroup]) {
  for (int k = 0; k < kDecodeGroup; k += 4) store_vec(out + i + k, make_float4(v[k], v[k + 1], v[k + 2], v[k + 3]));
}
MXDDP_HOST_DEVICE inline void store16(bf16_bits* out, int64_t i, const float v[kDecodeGroup]) {
  uint32_t w[kDecodeGroup / 2];
  for (int k = 0; k < kDecodeGroup / 2; ++k)
    w[k] = uint32_t{f32_to_bf16(v[2 * k])} | (uint32_t{f32_to_bf16(v[2 * k + 1])} << 16);
  store_vec(out + i, make_uint4(w[0], w[1], w[2], w[3]));
  store_vec(out + i + 8, make_uint4(w[4], w[5], w[6], w[7]));
}

template <typename T>
MXDDP_HOST_DEVICE inline void dequantize_group(const uint8_t* data, const uint8_t* scales, const float* table,
                                               int64_t cols, bool colwise, int64_t g, T* out) {
  const int64_t i = g * kDecodeGroup;
  const uint4 q = load_vec<uint4>(data + i);
  const uint32_t codes[4] = {q.x, q.y, q.z, q.w};
  float v[kDecodeGroup];
  if (!colwise) {  // the group lies in row-wise block i / 32
    const float scale = fp8::e8m0_value(scales[i / kBlock]);
    for (int k = 0; k < kDecodeGroup; ++k) v[k] = table[(codes[k / 4] >> (8 * (k % 4))) & 0xffu] * scale;
  } else {  // row r's 16 columns from c: their scales are consecutive in band r / 32's row
    const int64_t r = i / cols, c = i % cols;
    const uint4 s = load_vec<uint4>(scales + (r / kBlock) * cols + c);
    const uint32_t sw[4] = {s.x, s.y, s.z, s.w};
    for (int k = 0; k < kDecodeGroup; ++k) {
      const int shift = 8 * (k % 4);
      v[k] = table[(codes[k / 4] >> shift) & 0xffu] * fp8::e8m0_value(static_cast<uint8_t>((sw[k / 4] >> shift) & 0xffu));
    }
  }
  store16(out, i, v);
}

// Whether the wide kernels take a tensor: its shape's divisibility and the pointers' alignment.
inline bool quantize_fits(const void* in, const uint8_t* data, int64_t cols, bool colwise) {
  return cols % (colwise ? kRowGroup : kBlock) == 0 && aligned(in, 16) && aligned(data, 8);
}
inline bool dequantize_fits(const uint8_t* data, const uint8_t* scales, const void* out, int64_t cols, bool colwise) {
  return cols % (colwise ? kDecodeGroup : kBlock) == 0 && aligned(data, 16) && aligned(out, 16) &&
         (!colwise || aligned(scales, 16));
}

}  // namespace mxddp::cuda_kernels::wide
