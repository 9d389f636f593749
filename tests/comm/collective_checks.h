// Collective checks shared by the local-backend suite (ranks as threads) and the MPI suite (ranks
// as processes): every rank fills its buffers from (rank, index) alone, so each can compute the
// serial reference for the whole group without communicating. Inputs are multiples of 1/4 in
// [-8, 8): exact in bf16 and f32, so every summation order gives identical bits and the checks
// are exact on any backend. (Bitwise determinism for inexact sums is tested on the local backend
// separately.)
#pragma once

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/comm.h>

namespace mxddp::testing {

inline float value_at(int rank, int64_t i) {
  return static_cast<float>(((rank * 37 + i * 11 + (i >> 7)) % 64) - 32) * 0.25f;
}

// A host buffer of `n` elements of `dtype` with typed get/set through f32.
class Buf {
 public:
  Buf(DType dtype, int64_t n) : dtype_(dtype), bytes_(static_cast<size_t>(n) * dtype_size_bytes(dtype)), n_(n) {}
  TensorView view() { return TensorView{bytes_.data(), dtype_, Shape{n_}, Device::cpu()}; }
  int64_t numel() const { return n_; }
  void set(int64_t i, float v) {
    const auto k = static_cast<size_t>(i);
    if (dtype_ == DType::kF32) std::memcpy(&bytes_[4 * k], &v, 4);
    else if (dtype_ == DType::kBF16) { const bf16_bits b = f32_to_bf16(v); std::memcpy(&bytes_[2 * k], &b, 2); }
    else bytes_[k] = static_cast<unsigned char>(static_cast<int>(v * 4.0f) & 0xff);  // u8: the quarter steps
  }
  float get(int64_t i) const {
    const auto k = static_cast<size_t>(i);
    if (dtype_ == DType::kF32) { float v; std::memcpy(&v, &bytes_[4 * k], 4); return v; }
    if (dtype_ == DType::kBF16) { bf16_bits b; std::memcpy(&b, &bytes_[2 * k], 2); return bf16_to_f32(b); }
    return bytes_[k];
  }

 private:
  DType dtype_;
  std::vector<unsigned char> bytes_;
  int64_t n_;
};

// What element i of a reduction over `size` ranks must be, rounded as the collective rounds.
// prescale is a power of two in these checks, so products stay exact whatever the order.
inline float expected_reduction(DType dtype, ReduceOp op, int size, int64_t i, float prescale = 1.0f) {
  Buf one(dtype, 1);
  double acc = 0;
  for (int r = 0; r < size; ++r) {
    one.set(0, value_at(r, i));
    const double x = one.get(0) * static_cast<double>(prescale);
    acc = r == 0 ? x : (op == ReduceOp::kMax ? std::max(acc, x) : acc + x);
  }
  if (dtype == DType::kU8) return static_cast<float>(static_cast<uint32_t>(acc) & 0xffu);
  if (op == ReduceOp::kAvg) acc = static_cast<double>(static_cast<float>(acc) / static_cast<float>(size));
  one.set(0, static_cast<float>(acc));
  return one.get(0);
}

// Counts elements of `got` (starting at got_offset) that differ from want(i), reporting the first.
template <typename Want>
void expect_all(const Buf& got, int64_t got_offset, int64_t n, Want want, const std::string& what) {
  int64_t bad = 0;
  int64_t first = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (got.get(got_offset + i) != want(i) && bad++ == 0) first = i;  // inputs hold no NaN
  }
  EXPECT_EQ(bad, 0) << what << ": first mismatch at " << first << ": got " << (first >= 0 ? got.get(got_offset + first) : 0)
                    << ", want " << (first >= 0 ? want(first) : 0);
}

inline std::string label(const Communicator& comm, std::string_view op, DType dtype, int64_t n) {
  return fmt::format("{} {} n={} rank {}/{}", op, dtype_name(dtype), n, comm.rank(), comm.size());
}

inline void check_all_reduce(Communicator& comm, DType dtype, ReduceOp op, int64_t n, bool async_op) {
  Buf buf(dtype, n);
  for (int64_t i = 0; i < n; ++i) buf.set(i, value_at(comm.rank(), i));
  Work work = comm.all_reduce(buf.view(), {.op = op, .async_op = async_op});
  work.wait();
  EXPECT_TRUE(work.is_completed());
  expect_all(buf, 0, n, [&](int64_t i) { return expected_reduction(dtype, op, comm.size(), i); },
             label(comm, fmt::format("all_reduce/{}", reduce_op_name(op)), dtype, n));
}

inline void check_reduce_scatter(Communicator& comm, DType dtype, ReduceOp op, int64_t n, bool in_place) {
  const int size = comm.size();
  const int rank = comm.rank();
  Buf in(dtype, n * size);
  for (int64_t i = 0; i < n * size; ++i) in.set(i, value_at(rank, i));
  const auto want = [&](int64_t i) { return expected_reduction(dtype, op, size, rank * n + i); };
  const std::string what = label(comm, fmt::format("reduce_scatter/{}{}", reduce_op_name(op), in_place ? "/in_place" : ""), dtype, n);
  if (in_place) {
    comm.reduce_scatter(in.view(), in.view().slice(rank * n, n), {.op = op});
    // The rest of the input is scratch afterwards (comm.h): only this rank's block is checked.
    expect_all(in, rank * n, n, want, what);
  } else {
    Buf out(dtype, n);
    comm.reduce_scatter(in.view(), out.view(), {.op = op});
    expect_all(out, 0, n, want, what);
  }
}

inline void check_all_gather(Communicator& comm, DType dtype, int64_t n, bool in_place) {
  const int size = comm.size();
  const int rank = comm.rank();
  Buf out(dtype, n * size);
  const std::string what = label(comm, in_place ? "all_gather/in_place" : "all_gather", dtype, n);
  if (in_place) {
    for (int64_t i = 0; i < n; ++i) out.set(rank * n + i, value_at(rank, i));
    comm.all_gather(out.view().slice(rank * n, n), out.view());
  } else {
    Buf in(dtype, n);
    for (int64_t i = 0; i < n; ++i) in.set(i, value_at(rank, i));
    comm.all_gather(in.view(), out.view());
  }
  Buf one(dtype, 1);
  expect_all(out, 0, n * size, [&](int64_t i) { one.set(0, value_at(static_cast<int>(i / n), i % n)); return one.get(0); }, what);
}

inline void check_broadcast(Communicator& comm, DType dtype, int64_t n, int root) {
  Buf buf(dtype, n);
  for (int64_t i = 0; i < n; ++i) buf.set(i, value_at(comm.rank(), i));
  comm.broadcast(buf.view(), {.root = root});
  Buf one(dtype, 1);
  expect_all(buf, 0, n, [&](int64_t i) { one.set(0, value_at(root, i)); return one.get(0); },
             label(comm, fmt::format("broadcast/root{}", root), dtype, n));
}

// Sum and avg with a prescale of 1/4, on the reducing collectives.
inline void check_prescale(Communicator& comm, DType dtype, int64_t n) {
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    Buf buf(dtype, n);
    for (int64_t i = 0; i < n; ++i) buf.set(i, value_at(comm.rank(), i));
    comm.all_reduce(buf.view(), {.op = op, .prescale = 0.25f});
    expect_all(buf, 0, n, [&](int64_t i) { return expected_reduction(dtype, op, comm.size(), i, 0.25f); },
               label(comm, fmt::format("all_reduce/{}/prescale", reduce_op_name(op)), dtype, n));
    Buf in(dtype, n * comm.size());
    for (int64_t i = 0; i < n * comm.size(); ++i) in.set(i, value_at(comm.rank(), i));
    comm.reduce_scatter(in.view(), in.view().slice(comm.rank() * n, n), {.op = op, .prescale = 0.25f});
    expect_all(in, comm.rank() * n, n,
               [&](int64_t i) { return expected_reduction(dtype, op, comm.size(), comm.rank() * n + i, 0.25f); },
               label(comm, fmt::format("reduce_scatter/{}/prescale", reduce_op_name(op)), dtype, n));
  }
}

// Every collective on `dtype` at counts that do not divide evenly by the rank count.
inline void check_every_collective(Communicator& comm, DType dtype) {
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{65537}}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      if (dtype == DType::kU8 && op == ReduceOp::kAvg) continue;
      check_all_reduce(comm, dtype, op, n, /*async_op=*/n % 2 == 1);
      check_reduce_scatter(comm, dtype, op, n, /*in_place=*/true);
      check_reduce_scatter(comm, dtype, op, n, /*in_place=*/false);
    }
    check_all_gather(comm, dtype, n, /*in_place=*/true);
    check_all_gather(comm, dtype, n, /*in_place=*/false);
    check_broadcast(comm, dtype, n, /*root=*/comm.size() - 1);
    check_broadcast(comm, dtype, n, /*root=*/0);
    if (dtype != DType::kU8) check_prescale(comm, dtype, n);
  }
  comm.barrier();
}

// Issues an asynchronous all_reduce and keeps this thread busy without calling wait(): the
// collective must complete on its own (the progress thread moves it), proving overlap is real.
inline void check_async_progress_without_wait(Communicator& comm) {
  const int64_t n = 1 << 20;
  Buf buf(DType::kF32, n);
  for (int64_t i = 0; i < n; ++i) buf.set(i, value_at(comm.rank(), i));
  Work work = comm.all_reduce(buf.view(), {.op = ReduceOp::kSum, .async_op = true});
  volatile double host_work = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int64_t spins = 0;
  while (!work.is_completed() && std::chrono::steady_clock::now() < deadline) {
    for (int k = 0; k < 1000; ++k) host_work = host_work + 1.0;  // the caller computing
    ++spins;
  }
  EXPECT_TRUE(work.is_completed()) << "async all_reduce made no progress while the caller computed";
  work.wait();
  expect_all(buf, 0, n, [&](int64_t i) { return expected_reduction(DType::kF32, ReduceOp::kSum, comm.size(), i); },
             label(comm, "async all_reduce", DType::kF32, n));
}

// Ranks that disagree on a call's count get an Error naming the field, on every rank, and the
// communicator stays usable afterwards.
inline void check_mismatch_is_an_error(Communicator& comm) {
  if (comm.size() < 2) return;
  Buf buf(DType::kF32, 16 + comm.rank());
  try {
    comm.all_reduce(buf.view());
    ADD_FAILURE() << "all_reduce with counts differing across ranks did not throw on rank " << comm.rank();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("element count 16 vs 17"), std::string::npos) << e.what();
  }
  Buf typed(comm.rank() == 0 ? DType::kF32 : DType::kBF16, 8);
  try {
    comm.all_reduce(typed.view());
    ADD_FAILURE() << "all_reduce with dtypes differing across ranks did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dtype f32 vs bf16"), std::string::npos) << e.what();
  }
  // Rank 0 calls a collective the others do not (an all-reduce under `if rank == 0`) while they
  // make their next one: the error says the calls differ, not only which operations met.
  Buf one(DType::kF32, 4), gathered(DType::kF32, 4 * comm.size());
  try {
    if (comm.rank() == 0)
      comm.all_reduce(one.view());
    else
      comm.all_gather(one.view(), gathered.view());
    ADD_FAILURE() << "an all_reduce meeting an all_gather did not throw on rank " << comm.rank();
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("operation all_reduce vs all_gather (the ranks' calls differ here"), std::string::npos) << what;
  }
  check_all_reduce(comm, DType::kF32, ReduceOp::kSum, 33, false);
}

}  // namespace mxddp::testing
