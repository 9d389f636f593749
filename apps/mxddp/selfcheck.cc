// The collective self-check: see selfcheck.h. Inputs are small integers times 1/4, exact in bf16
// and f32, so every summation order gives the same bits and the check holds on any backend.
#include "selfcheck.h"

#include <mxddp/launch_check.h>

#include <cstring>
#include <vector>

namespace mxddp::app {

namespace {

float input_value(int rank, int64_t i) { return static_cast<float>(((rank * 7 + i * 13) % 64) - 32) * 0.25f; }

// Stores value v as dtype in a byte vector at element i.
void store(std::vector<unsigned char>& bytes, DType dtype, int64_t i, float v) {
  const auto k = static_cast<size_t>(i);
  if (dtype == DType::kF32) std::memcpy(bytes.data() + 4 * k, &v, 4);
  else if (dtype == DType::kBF16) { const bf16_bits b = f32_to_bf16(v); std::memcpy(bytes.data() + 2 * k, &b, 2); }
  else bytes[k] = static_cast<unsigned char>(static_cast<int>(v * 4.0f) & 0xff);
}

float load(const std::vector<unsigned char>& bytes, DType dtype, int64_t i) {
  const auto k = static_cast<size_t>(i);
  if (dtype == DType::kF32) { float v; std::memcpy(&v, bytes.data() + 4 * k, 4); return v; }
  if (dtype == DType::kBF16) { bf16_bits b; std::memcpy(&b, bytes.data() + 2 * k, 2); return bf16_to_f32(b); }
  return bytes[k];
}

// The serial reference of element i reduced over all ranks, rounded like the collective.
float reference(DType dtype, ReduceOp op, int size, int64_t i) {
  std::vector<unsigned char> one(4);
  uint32_t acc_u8 = 0;
  float acc = 0.0f;
  for (int r = 0; r < size; ++r) {
    store(one, dtype, 0, input_value(r, i));
    const float x = load(one, dtype, 0);
    if (dtype == DType::kU8) acc_u8 = op == ReduceOp::kMax ? std::max(acc_u8, static_cast<uint32_t>(x)) : acc_u8 + static_cast<uint32_t>(x);
    else acc = r == 0 ? x : (op == ReduceOp::kMax ? std::max(acc, x) : acc + x);
  }
  if (dtype == DType::kU8) return static_cast<float>(acc_u8 & 0xffu);
  if (op == ReduceOp::kAvg) acc /= static_cast<float>(size);
  store(one, dtype, 0, acc);
  return load(one, dtype, 0);
}

}  // namespace

SelfcheckResult run_selfcheck(Communicator& comm, int64_t count) {
  // Every rank must issue the same sizes: ranks given different --count are refused together
  // (launch_check.h), instead of failing in the first collective with element counts.
  check_same_job(comm, {{"--count", std::to_string(count)}}, "mxddp selfcheck's flags");
  SelfcheckResult result;
  const int size = comm.size();
  const int rank = comm.rank();
  auto record = [&](bool ok, std::string what) { (ok ? result.passed : result.failed).push_back(std::move(what)); };
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kU8}) {
    const size_t elem = dtype_size_bytes(dtype);
    auto view = [&](std::vector<unsigned char>& b, int64_t n) { return TensorView{b.data(), dtype, Shape{n}, Device::cpu()}; };
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      if (dtype == DType::kU8 && op == ReduceOp::kAvg) continue;
      // all_reduce over count elements
      std::vector<unsigned char> buf(static_cast<size_t>(count) * elem);
      for (int64_t i = 0; i < count; ++i) store(buf, dtype, i, input_value(rank, i));
      comm.all_reduce(view(buf, count), {.op = op});
      bool ok = true;
      for (int64_t i = 0; i < count && ok; ++i) ok = load(buf, dtype, i) == reference(dtype, op, size, i);
      record(ok, fmt::format("all_reduce     {:<4} {:<3} {} elements", dtype_name(dtype), reduce_op_name(op), count));
      // reduce_scatter in place: this rank's block of a size*count buffer
      std::vector<unsigned char> in(static_cast<size_t>(count * size) * elem);
      for (int64_t i = 0; i < count * size; ++i) store(in, dtype, i, input_value(rank, i));
      TensorView whole = view(in, count * size);
      comm.reduce_scatter(whole, whole.slice(rank * count, count), {.op = op});
      ok = true;
      for (int64_t i = 0; i < count && ok; ++i)
        ok = load(in, dtype, rank * count + i) == reference(dtype, op, size, rank * count + i);
      record(ok, fmt::format("reduce_scatter {:<4} {:<3} {} elements per rank", dtype_name(dtype), reduce_op_name(op), count));
    }
    // all_gather in place, then broadcast from the last rank
    std::vector<unsigned char> out(static_cast<size_t>(count * size) * elem);
    for (int64_t i = 0; i < count; ++i) store(out, dtype, rank * count + i, input_value(rank, i));
    TensorView gathered = view(out, count * size);
    comm.all_gather(gathered.slice(rank * count, count), gathered);
    bool ok = true;
    std::vector<unsigned char> expect(4);
    for (int r = 0; r < size && ok; ++r)
      for (int64_t i = 0; i < count && ok; ++i) {
        store(expect, dtype, 0, input_value(r, i));
        ok = load(out, dtype, r * count + i) == load(expect, dtype, 0);
      }
    record(ok, fmt::format("all_gather     {:<4}     {} elements per rank", dtype_name(dtype), count));
    std::vector<unsigned char> buf(static_cast<size_t>(count) * elem);
    for (int64_t i = 0; i < count; ++i) store(buf, dtype, i, input_value(rank, i));
    comm.broadcast(view(buf, count), {.root = size - 1});
    ok = true;
    for (int64_t i = 0; i < count && ok; ++i) {
      store(expect, dtype, 0, input_value(size - 1, i));
      ok = load(buf, dtype, i) == load(expect, dtype, 0);
    }
    record(ok, fmt::format("broadcast      {:<4}     {} elements from rank {}", dtype_name(dtype), count, size - 1));
  }
  comm.barrier();  // throws (and the job fails) if a rank never arrives
  record(true, fmt::format("barrier        all {} ranks arrived", size));
  return result;
}

}  // namespace mxddp::app
