// compute.h's entry points: every argument check, once for all implementations, before the
// implementation's run_* does the work.
#include <mxddp/compute.h>

#include "../quant/mxfp8_checks.h"

#include <algorithm>
#include <cstdint>

namespace mxddp {

TensorView ComputeBuffer::view(DType dtype, const Shape& shape) const {
  const int64_t numel = shape.numel();
  MXDDP_CHECK(static_cast<uint64_t>(numel) <= bytes_ / dtype_size_bytes(dtype),
              "a view of {} {} elements does not fit a buffer of {} bytes", numel, dtype_name(dtype), bytes_);
  return TensorView{data_, dtype, shape, device_};
}

namespace {

// Throws unless dtype is f32 or bf16, the element types of every operation here.
void check_float(std::string_view op, std::string_view what, DType dtype) {
  MXDDP_CHECK(dtype == DType::kF32 || dtype == DType::kBF16, "{}: {} must be f32 or bf16; got {}", op, what,
              dtype_name(dtype));
}

void check_bytes(std::string_view op, size_t bytes, const void* a, const void* b) {
  MXDDP_CHECK(bytes == 0 || (a != nullptr && b != nullptr), "{}: a null pointer for {} bytes", op, bytes);
}

// A view given to an implementation must be in its memory (an empty one may be anywhere).
void check_device(std::string_view op, std::string_view what, const TensorView& v, const Compute& compute) {
  MXDDP_CHECK(v.numel() == 0 || (v.data != nullptr && v.device == compute.device()),
              "{}: {} {} is {}; the {} compute works on {} memory", op, what, v.to_string(),
              v.data == nullptr ? "null" : "on " + to_string(v.device), compute.name(), to_string(compute.device()));
}

}  // namespace

ComputeBuffer Compute::allocate(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed) {
  return run_allocate(bytes, category, tracker, zeroed);
}

ComputeBuffer Compute::allocate_host(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed) {
  return run_allocate_host(bytes, category, tracker, zeroed);
}

void Compute::zero(void* data, size_t bytes) {
  check_bytes("zero", bytes, data, data);
  if (bytes > 0) run_zero(data, bytes);
}

void Compute::copy(void* dst, const void* src, size_t bytes) {
  check_bytes("copy", bytes, dst, src);
  if (bytes > 0) run_copy(dst, src, bytes);
}

void Compute::copy_from_host(void* dst, const void* host, size_t bytes) {
  check_bytes("copy_from_host", bytes, dst, host);
  if (bytes > 0) run_copy_from_host(dst, host, bytes);
}

void Compute::copy_to_host(void* host, const void* src, size_t bytes) {
  check_bytes("copy_to_host", bytes, host, src);
  if (bytes > 0) run_copy_to_host(host, src, bytes);
}

void Compute::copy_to_host_async(void* host, const void* src, size_t bytes) {
  check_bytes("copy_to_host_async", bytes, host, src);
  if (bytes > 0) run_copy_to_host_async(host, src, bytes);
}

std::unique_ptr<ComputeEvent> Compute::record_event() { return run_record_event(); }

void Compute::convert(const TensorView& in, const TensorView& out) {
  MXDDP_CHECK(in.numel() == out.numel(), "convert: {} elements into {}; the counts must match", in.numel(),
              out.numel());
  check_float("convert", "the input", in.dtype);
  check_float("convert", "the output", out.dtype);
  check_device("convert", "the input", in, *this);
  check_device("convert", "the output", out, *this);
  if (in.numel() == 0) return;
  if (in.dtype == out.dtype) run_copy(out.data, in.data, in.nbytes());
  else run_convert(in, out);
}

bool Compute::all_finite(const TensorView& data) {
  check_float("all_finite", "the data", data.dtype);
  check_device("all_finite", "the data", data, *this);
  return data.numel() == 0 || run_all_finite(data);
}

double Compute::sum_of_squares(std::span<const TensorView> runs) {
  for (const TensorView& run : runs) {
    check_float("sum_of_squares", "a run", run.dtype);
    check_device("sum_of_squares", "a run", run, *this);
  }
  return run_sum_of_squares(runs);
}

int64_t Compute::count_zeros(std::span<const TensorView> runs) {
  for (const TensorView& run : runs) {
    check_float("count_zeros", "a run", run.dtype);
    check_device("count_zeros", "a run", run, *this);
  }
  return runs.empty() ? 0 : run_count_zeros(runs);
}

namespace {

void check_shard(std::string_view op, const ShardUpdate& s, bool two_states, const Compute& compute) {
  const int64_t n = s.grads.numel();
  check_float(op, "the grads", s.grads.dtype);
  check_device(op, "the grads", s.grads, compute);
  MXDDP_CHECK(n == 0 || (s.main != nullptr && s.state0 != nullptr && (!two_states || s.state1 != nullptr)),
              "{}: a null main or state pointer for {} elements", op, n);
  if (s.params.data == nullptr) return;  // not staged
  MXDDP_CHECK(s.params.numel() == n, "{}: {} staged params for {} grads; give one per grad, or none", op,
              s.params.numel(), n);
  check_float(op, "the staged params", s.params.dtype);
  check_device(op, "the staged params", s.params, compute);
  MXDDP_CHECK(s.params.data != s.main || s.params.dtype == DType::kF32,
              "{}: the staged params are main itself, so they must be f32; got {}", op, dtype_name(s.params.dtype));
}

}  // namespace

void Compute::adamw(const ShardUpdate& shard, const AdamWScalars& scalars) {
  check_shard("adamw", shard, /*two_states=*/true, *this);
  if (shard.grads.numel() > 0) run_adamw(shard, scalars);
}

void Compute::sgd(const ShardUpdate& shard, const SgdScalars& scalars) {
  check_shard("sgd", shard, /*two_states=*/false, *this);
  if (shard.grads.numel() > 0) run_sgd(shard, scalars);
}

void Compute::mx_quantize(const TensorView& input, const Mxfp8View& out) {
  check_mx_views(input, out.data, out.scales, out.options, "mx_quantize", device().kind);
  check_device("mx_quantize", "the input", input, *this);
  check_device("mx_quantize", "the data", out.data, *this);
  check_device("mx_quantize", "the scales", out.scales, *this);
  if (input.numel() > 0) run_mx_quantize(input, out);
}

void Compute::mx_shard_scales(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                              const QuantizeOptions& options) {
  check_mx_shard(shard, offset, shape, scales, options, "mx_shard_scales");
  check_device("mx_shard_scales", "the shard", shard, *this);
  check_device("mx_shard_scales", "the scales", scales, *this);
  if (scales.numel() > 0) run_mx_shard_scales(shard, offset, shape, scales, options);
}

void Compute::mx_shard_encode(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                              const TensorView& data, const QuantizeOptions& options) {
  check_mx_shard(shard, offset, shape, scales, options, "mx_shard_encode");
  MXDDP_CHECK(data.dtype == DType::kU8 && data.numel() == shard.numel(), "mx_shard_encode: data must be u8 [{}]; got {}",
              shard.numel(), data.to_string());
  check_device("mx_shard_encode", "the shard", shard, *this);
  check_device("mx_shard_encode", "the scales", scales, *this);
  check_device("mx_shard_encode", "the data", data, *this);
  if (shard.numel() > 0) run_mx_shard_encode(shard, offset, shape, scales, data, options);
}

void Compute::reduce(const ReduceRun& run) {
  const DType t = run.dtype;
  const bool is_float = t == DType::kF32 || t == DType::kBF16 || t == DType::kF64;
  MXDDP_CHECK(is_float || t == DType::kU8 || t == DType::kI64 || t == DType::kI32 || t == DType::kBool,
              "reduce: dtype {}; valid: f32, bf16, f64, u8, i64, i32, bool", dtype_name(t));
  MXDDP_CHECK(run.op == ReduceOp::kSum || run.op == ReduceOp::kAvg || run.op == ReduceOp::kMax,
              "reduce: unknown op {}; valid: sum, avg, max", static_cast<int>(run.op));
  MXDDP_CHECK(is_float || run.op != ReduceOp::kAvg, "reduce: avg of {}; avg is for floats (f32, bf16, f64)",
              dtype_name(t));
  MXDDP_CHECK(run.prescale == 1.0f || (is_float && run.op != ReduceOp::kMax),
              "reduce: prescale {} with {} of {}; a prescale applies to sum and avg of floats", run.prescale,
              reduce_op_name(run.op), dtype_name(t));
  MXDDP_CHECK(run.count >= 0, "reduce: count {}; valid: >= 0", run.count);
  MXDDP_CHECK(!run.inputs.empty() && !run.outputs.empty(), "reduce: {} inputs and {} outputs; it needs one of each "
              "at least", run.inputs.size(), run.outputs.size());
  MXDDP_CHECK(run.inputs.size() <= INT32_MAX && run.outputs.size() <= INT32_MAX,
              "reduce: {} inputs and {} outputs; at most 2^31 - 1 of each", run.inputs.size(), run.outputs.size());
  // One input written back onto itself unscaled (a collective of a group of one): nothing to do.
  // Skipped here so that no implementation rewrites it (a bf16 signaling NaN would come back quiet).
  const auto is_the_input = [&](void* p) { return p == run.inputs[0]; };
  const bool identity = run.inputs.size() == 1 && run.prescale == 1.0f &&
                        std::all_of(run.outputs.begin(), run.outputs.end(), is_the_input);
  if (run.count == 0 || identity) return;
  for (const void* p : run.inputs) MXDDP_CHECK(p != nullptr, "reduce: a null input of {} elements", run.count);
  for (const void* p : run.outputs) MXDDP_CHECK(p != nullptr, "reduce: a null output of {} elements", run.count);
  run_reduce(run);
}

void Compute::copy_to_many(const void* src, std::span<void* const> dsts, size_t bytes) {
  if (bytes == 0 || dsts.empty()) return;
  MXDDP_CHECK(src != nullptr, "copy_to_many: a null source of {} bytes", bytes);
  for (const void* p : dsts) MXDDP_CHECK(p != nullptr, "copy_to_many: a null destination of {} bytes", bytes);
  run_copy_to_many(src, dsts, bytes);
}

}  // namespace mxddp
