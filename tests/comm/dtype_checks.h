// Collective checks for the dtypes torch users reduce besides f32/bf16 (issue 44, item 4): f64,
// i64, i32 and bool, every collective and every reduce op, shared by the local-backend suite and
// the MPI suite. As in collective_checks.h every rank fills its buffers from (rank, index) alone
// and computes the serial reference itself. The values are chosen so that a wrong path shows:
// f64 values carry a 2^-40 part that f32 would drop; integers are multiples of 2^33 (i64) or 2^20
// (i32), beyond f32's exact range, and some elements hold the type's maximum so that sums wrap;
// bool elements are set on one rank (or none), so only a logical or gives the reference. Every
// f64 sum is exact, so any summation order gives the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/comm.h>

namespace mxddp::testing {

// Storage of one element: bool travels as one byte (std::vector<bool> packs bits).
template <DType D>
using StorageOf = std::conditional_t<
    D == DType::kF64, double,
    std::conditional_t<D == DType::kI64, int64_t, std::conditional_t<D == DType::kI32, int32_t, uint8_t>>>;

template <DType D>
StorageOf<D> dtype_value(int rank, int64_t i, int size) {
  const auto base = static_cast<int64_t>((rank * 37 + i * 11 + (i >> 7)) % 64) - 32;
  if constexpr (D == DType::kF64) {
    return std::ldexp(static_cast<double>(base), -2) + std::ldexp(static_cast<double>((rank + 1) * (i % 5 + 1)), -40);
  } else if constexpr (D == DType::kI64) {
    if (i % 17 == 3) return std::numeric_limits<int64_t>::max() - rank;  // sums wrap
    return base * (int64_t{1} << 33) + rank;
  } else if constexpr (D == DType::kI32) {
    if (i % 17 == 3) return std::numeric_limits<int32_t>::max() - rank;
    return static_cast<int32_t>(base * (1 << 20) + rank);
  } else {
    // Set on rank i % (size + 1): on exactly one rank, or (when that is size) on none.
    return static_cast<uint8_t>(i % (size + 1) == rank ? 1 : 0);
  }
}

// The serial reference of element i reduced over `size` ranks (prescale: a power of two, so f64
// products are exact whether a backend scales the inputs or the result).
template <DType D>
StorageOf<D> dtype_expected(ReduceOp op, int size, int64_t i, double prescale = 1.0) {
  using S = StorageOf<D>;
  if constexpr (D == DType::kF64) {
    double acc = dtype_value<D>(0, i, size) * prescale;
    for (int r = 1; r < size; ++r) {
      const double x = dtype_value<D>(r, i, size);
      acc = op == ReduceOp::kMax ? std::max(acc, x) : acc + x * prescale;
    }
    return op == ReduceOp::kAvg ? acc / size : acc;
  } else if constexpr (D == DType::kBool) {
    uint8_t any = 0;
    for (int r = 0; r < size; ++r) any |= dtype_value<D>(r, i, size);
    return any;
  } else {
    using U = std::make_unsigned_t<S>;
    S acc = dtype_value<D>(0, i, size);
    for (int r = 1; r < size; ++r) {
      const S x = dtype_value<D>(r, i, size);
      acc = op == ReduceOp::kMax ? std::max(acc, x) : static_cast<S>(static_cast<U>(acc) + static_cast<U>(x));
    }
    return acc;
  }
}

template <DType D>
TensorView view_of(std::vector<StorageOf<D>>& v) {
  return TensorView{v.data(), D, Shape{static_cast<int64_t>(v.size())}, Device::cpu()};
}

// Counts the elements of got[offset, offset + n) that differ from want(i), naming the first.
template <typename S, typename Want>
void expect_elements(const std::vector<S>& got, int64_t offset, int64_t n, Want want, const std::string& what) {
  int64_t bad = 0;
  int64_t first = -1;
  for (int64_t i = 0; i < n; ++i)
    if (got[static_cast<size_t>(offset + i)] != want(i) && bad++ == 0) first = i;
  if (bad == 0) return;
  ADD_FAILURE() << what << ": " << bad << " of " << n << " elements differ; first at " << first << ": got "
                << +got[static_cast<size_t>(offset + first)] << ", want " << +want(first);
}

// The reduce ops a dtype takes: avg only for floats (as torch).
inline std::vector<ReduceOp> ops_of(DType dtype) {
  if (dtype == DType::kF64) return {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};
  return {ReduceOp::kSum, ReduceOp::kMax};
}

// all_reduce, reduce_scatter (out of place and in place), all_gather and broadcast, every op, for
// element counts that hit the local backend's partition edges (1, an odd count, several lines).
template <DType D>
void check_dtype_collectives(Communicator& comm) {
  using S = StorageOf<D>;
  const int size = comm.size();
  const int rank = comm.rank();
  for (const int64_t n : {int64_t{1}, int64_t{37}, int64_t{1000}}) {
    const std::string tag = fmt::format("{} n={} rank {}/{}", dtype_name(D), n, rank, size);
    for (const ReduceOp op : ops_of(D)) {
      const std::string what = fmt::format("{} {}", reduce_op_name(op), tag);
      std::vector<S> buf(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) buf[static_cast<size_t>(i)] = dtype_value<D>(rank, i, size);
      comm.all_reduce(view_of<D>(buf), {.op = op});
      expect_elements(buf, 0, n, [&](int64_t i) { return dtype_expected<D>(op, size, i); }, "all_reduce " + what);

      std::vector<S> whole(static_cast<size_t>(n * size));
      for (int64_t i = 0; i < n * size; ++i) whole[static_cast<size_t>(i)] = dtype_value<D>(rank, i, size);
      std::vector<S> block(static_cast<size_t>(n));
      comm.reduce_scatter(view_of<D>(whole), view_of<D>(block), {.op = op, .async_op = true}).wait();
      const auto want_block = [&](int64_t i) { return dtype_expected<D>(op, size, int64_t{rank} * n + i); };
      expect_elements(block, 0, n, want_block, "reduce_scatter " + what);
      const TensorView in_place = view_of<D>(whole).slice(int64_t{rank} * n, n);
      comm.reduce_scatter(view_of<D>(whole), in_place, {.op = op});
      expect_elements(whole, int64_t{rank} * n, n, want_block, "in-place reduce_scatter " + what);
    }
    if constexpr (D == DType::kF64) {
      // prescale, as DDP's 1/dp: a power of two, so scaling inputs or the result is exact.
      std::vector<S> buf(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) buf[static_cast<size_t>(i)] = dtype_value<D>(rank, i, size);
      comm.all_reduce(view_of<D>(buf), {.op = ReduceOp::kSum, .prescale = 0.25f});
      expect_elements(buf, 0, n, [&](int64_t i) { return dtype_expected<D>(ReduceOp::kSum, size, i, 0.25); },
                      "prescaled all_reduce " + tag);
    }

    std::vector<S> mine(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) mine[static_cast<size_t>(i)] = dtype_value<D>(rank, i, size);
    std::vector<S> gathered(static_cast<size_t>(n * size));
    comm.all_gather(view_of<D>(mine), view_of<D>(gathered));
    for (int r = 0; r < size; ++r)
      expect_elements(gathered, int64_t{r} * n, n, [&](int64_t i) { return dtype_value<D>(r, i, size); },
                      fmt::format("all_gather block {} {}", r, tag));

    const int root = size - 1;
    std::vector<S> bcast(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) bcast[static_cast<size_t>(i)] = dtype_value<D>(rank == root ? root : rank + 1, i + 1, size);
    comm.broadcast(view_of<D>(bcast), {.root = root});
    expect_elements(bcast, 0, n, [&](int64_t i) { return dtype_value<D>(root, i + 1, size); },
                    fmt::format("broadcast from {} {}", root, tag));
  }
}

// avg and prescale are float arithmetic: refused for the integer types and bool, naming the dtype.
inline void check_integer_ops_refused(Communicator& comm) {
  std::vector<int64_t> v(4);
  for (const DType dtype : {DType::kI64, DType::kI32, DType::kBool}) {
    const TensorView t{v.data(), dtype, Shape{4}, Device::cpu()};
    const std::string name(dtype_name(dtype));
    try {
      comm.all_reduce(t, {.op = ReduceOp::kAvg});
      ADD_FAILURE() << "avg of " << name << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("avg is defined for f32 and bf16, and f64 (floats only); got " + name),
                std::string::npos)
          << e.what();
    }
    try {
      comm.all_reduce(t, {.op = ReduceOp::kSum, .prescale = 0.5f});
      ADD_FAILURE() << "prescale of " << name << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("applies to f32, bf16 and f64, not " + name), std::string::npos) << e.what();
    }
  }
}

}  // namespace mxddp::testing
