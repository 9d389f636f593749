// Communicator: the one validated entry point per collective. Everything a single rank can check
// about its own arguments is checked here, before anything is queued; what only the group can
// check (that all ranks agree) is each backend's first step.
#include <cmath>
#include <cstring>

#include <mxddp/comm.h>

#include "backend.h"
#include "progress_queue.h"
#include "work_state.h"

namespace mxddp {

std::string_view collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kBarrier: return "barrier";
  }
  MXDDP_FAIL("unknown collective kind {}", static_cast<int>(kind));
}

std::string describe_mismatch(const CollectiveCall& a, const CollectiveCall& b) {
  if (a.kind != b.kind)  // what tells the user most: the calls themselves differ, not their arguments
    return fmt::format("operation {} vs {} (the ranks' calls differ here: one rank made a collective call the others "
                       "did not make at this point, such as one under `if rank == 0`, or made them in another "
                       "order; every rank must make the same collective calls in the same order)",
                       collective_name(a.kind), collective_name(b.kind));
  if (a.dtype != b.dtype) return fmt::format("dtype {} vs {}", dtype_name(a.dtype), dtype_name(b.dtype));
  if (a.count != b.count) return fmt::format("element count {} vs {}", a.count, b.count);
  const bool reduces = a.kind == CollectiveKind::kAllReduce || a.kind == CollectiveKind::kReduceScatter;
  if (reduces && a.op != b.op) return fmt::format("reduce op {} vs {}", reduce_op_name(a.op), reduce_op_name(b.op));
  if (reduces && a.prescale != b.prescale) return fmt::format("prescale {} vs {}", a.prescale, b.prescale);
  if (a.kind == CollectiveKind::kBroadcast && a.root != b.root) return fmt::format("root {} vs {}", a.root, b.root);
  return "";
}

std::array<int64_t, kCallHeaderFields> pack_call_header(uint64_t seq, const CollectiveCall& call) {
  uint32_t prescale_bits;
  std::memcpy(&prescale_bits, &call.prescale, sizeof prescale_bits);
  return {static_cast<int64_t>(seq), static_cast<int64_t>(call.kind), static_cast<int64_t>(call.dtype),
          static_cast<int64_t>(call.op), call.root, call.count, prescale_bits};
}

namespace {

CollectiveCall unpack_call_header(const int64_t* fields) {
  CollectiveCall c;
  c.kind = static_cast<CollectiveKind>(fields[1]);
  c.dtype = static_cast<DType>(fields[2]);
  c.op = static_cast<ReduceOp>(fields[3]);
  c.root = static_cast<int>(fields[4]);
  c.count = fields[5];
  const auto bits = static_cast<uint32_t>(fields[6]);
  std::memcpy(&c.prescale, &bits, sizeof bits);
  return c;
}

}  // namespace

void check_call_headers(const int64_t* headers, int size, int stride, uint64_t seq, CollectiveKind kind) {
  MXDDP_ASSERT(stride >= kCallHeaderFields);
  auto header = [&](int r) { return headers + static_cast<ptrdiff_t>(stride) * r; };
  for (int r = 0; r < size; ++r) {
    const auto sent = static_cast<uint64_t>(header(r)[0]);
    MXDDP_CHECK(sent == seq, "{} #{}: rank {} sent the header of its collective #{}; the ranks' sequences "
                "diverged (a bug in mxddp)", collective_name(kind), seq, r, sent);
  }
  for (int r = 0; r < size; ++r)
    MXDDP_CHECK(unpack_call_header(header(r)).count != kRefusedCallCount,
                "{} #{}: rank {} failed before it could take part (its own error says why); nothing was moved",
                collective_name(kind), seq, r);
  const CollectiveCall first = unpack_call_header(header(0));
  for (int r = 1; r < size; ++r) {
    const std::string mismatch = describe_mismatch(first, unpack_call_header(header(r)));
    MXDDP_CHECK(mismatch.empty(), "{} #{}: ranks disagree: rank 0 vs rank {}: {}", collective_name(kind), seq, r,
                mismatch);
  }
}

namespace {

bool is_float(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF64; }

void check_buffer(const TensorView& t, std::string_view what, std::string_view op, Device device) {
  MXDDP_CHECK(is_float(t.dtype) || t.dtype == DType::kU8 || t.dtype == DType::kI64 || t.dtype == DType::kI32 ||
                  t.dtype == DType::kBool,
              "{}: {} has dtype {}; collectives take f32, bf16, f64, u8, i64, i32 or bool", op, what,
              dtype_name(t.dtype));
  MXDDP_CHECK(t.device == device, "{}: {} is on {}; this communicator's buffers are on {}", op, what,
              to_string(t.device), to_string(device));
  MXDDP_CHECK(t.data != nullptr || t.numel() == 0, "{}: {} ({}) has a null data pointer", op, what,
              t.to_string());
}

// avg and prescale are float arithmetic: an integer average would have to round, and torch refuses
// avg for integer and bool tensors too, so mxddp does the same rather than pick a rounding.
void check_reduce_op(DType dtype, ReduceOp op, float prescale, std::string_view name) {
  MXDDP_CHECK(is_float(dtype) || op != ReduceOp::kAvg,
              "{}: avg is defined for f32 and bf16, and f64 (floats only); got {} (use sum or max)", name, dtype_name(dtype));
  if (prescale == 1.0f) return;
  MXDDP_CHECK(std::isfinite(prescale), "{}: prescale must be finite; got {}", name, prescale);
  MXDDP_CHECK(op != ReduceOp::kMax, "{}: prescale {} applies to sum and avg, not max", name, prescale);
  MXDDP_CHECK(is_float(dtype), "{}: prescale {} applies to f32, bf16 and f64, not {}", name, prescale,
              dtype_name(dtype));
}

// Accepts `part` being exactly block `index` (of part's size) of `whole` (in place) or disjoint
// from it; throws if the two overlap any other way, since the collective would read what it writes.
void check_in_place_or_disjoint(const TensorView& whole, const TensorView& part, int index, std::string_view op) {
  const auto* w = static_cast<const char*>(whole.data);
  const auto* p = static_cast<const char*>(part.data);
  const size_t block_bytes = part.nbytes();
  if (p == w + static_cast<size_t>(index) * block_bytes && block_bytes > 0) return;
  const bool disjoint = p + block_bytes <= w || w + whole.nbytes() <= p;
  MXDDP_CHECK(disjoint || block_bytes == 0,
              "{}: buffers overlap but the {}-element block is not this rank's block {} of the "
              "{}-element buffer; pass exactly that block for in-place, or disjoint buffers",
              op, part.numel(), index, whole.numel());
}

// reduce_scatter and all_gather: `whole` must be `size` blocks of `block`'s length and dtype, and
// either disjoint from block or have it as its block `rank` (in place).
void check_whole_and_block(const TensorView& whole, std::string_view whole_name, const TensorView& block,
                           std::string_view block_name, int size, int rank, std::string_view op, Device device) {
  check_buffer(whole, whole_name, op, device);
  check_buffer(block, block_name, op, device);
  MXDDP_CHECK(whole.dtype == block.dtype, "{}: {} is {} but {} is {}; they must match", op, whole_name,
              dtype_name(whole.dtype), block_name, dtype_name(block.dtype));
  MXDDP_CHECK(whole.numel() == block.numel() * size, "{}: {} has {} elements; it must be size ({}) x {} ({}) = {}",
              op, whole_name, whole.numel(), size, block_name, block.numel(), block.numel() * size);
  check_in_place_or_disjoint(whole, block, rank, op);
}

}  // namespace

struct Communicator::Call : CollectiveCall {};

Communicator::Communicator(std::unique_ptr<CommBackend> backend)
    : backend_(std::move(backend)),
      queue_(std::make_unique<ProgressQueue>()),
      issue_mutex_(std::make_unique<std::mutex>()),
      engine_(backend_.get()) {
  MXDDP_CHECK(backend_ != nullptr, "Communicator: no engine");
}

Communicator::Communicator(std::unique_ptr<StreamOrderedBackend> backend)
    : ordered_(std::move(backend)), issue_mutex_(std::make_unique<std::mutex>()), engine_(ordered_.get()) {
  MXDDP_CHECK(ordered_ != nullptr, "Communicator: no engine");
}

Communicator::~Communicator() { queue_.reset(); }  // drain before the backend goes away

int Communicator::rank() const { return engine_->rank(); }
int Communicator::size() const { return engine_->size(); }
std::string_view Communicator::backend_name() const { return engine_->name(); }
Compute& Communicator::compute() const { return engine_->compute(); }
Device Communicator::device() const { return compute().device(); }

Work Communicator::submit(const Call& call, bool async_op) {
  const CollectiveCall c = call;
  if (!ordered_) {
    CommBackend* backend = backend_.get();
    Work work;
    {
      // Issued and queued together, so that the engine's issue() sees the calls in run() order.
      std::lock_guard lock(*issue_mutex_);
      backend->issue(c);
      work = queue_->submit([backend, c] { backend->run(c); });
    }
    if (!async_op) work.wait();
    return work;
  }
  // Stream-ordered: enqueued here, one issuing thread at a time, so every rank's engine sees the
  // collectives in the order they were issued. An error while enqueueing is the Work's.
  auto state = std::make_shared<detail::WorkState>();
  {
    std::lock_guard lock(*issue_mutex_);
    std::exception_ptr failure;
    try {
      state->stream = ordered_->enqueue(c);
    } catch (...) {
      failure = std::current_exception();
    }
    state->complete(failure);
  }
  Work work(state);
  if (!async_op) work.wait();
  return work;
}

Work Communicator::all_reduce(TensorView buffer, const AllReduceOptions& options) {
  check_buffer(buffer, "buffer", "all_reduce", device());
  check_reduce_op(buffer.dtype, options.op, options.prescale, "all_reduce");
  Call call;
  call.kind = CollectiveKind::kAllReduce;
  call.dtype = buffer.dtype;
  call.op = options.op;
  call.prescale = options.prescale;
  call.count = buffer.numel();
  call.send = buffer.data;
  call.recv = buffer.data;
  return submit(call, options.async_op);
}

Work Communicator::reduce_scatter(TensorView input, TensorView output, const ReduceScatterOptions& options) {
  check_whole_and_block(input, "input", output, "output", size(), rank(), "reduce_scatter", device());
  check_reduce_op(input.dtype, options.op, options.prescale, "reduce_scatter");
  Call call;
  call.kind = CollectiveKind::kReduceScatter;
  call.dtype = input.dtype;
  call.op = options.op;
  call.prescale = options.prescale;
  call.count = output.numel();
  call.send = input.data;
  call.recv = output.data;
  return submit(call, options.async_op);
}

Work Communicator::all_gather(TensorView input, TensorView output, const AllGatherOptions& options) {
  check_whole_and_block(output, "output", input, "input", size(), rank(), "all_gather", device());
  Call call;
  call.kind = CollectiveKind::kAllGather;
  call.dtype = input.dtype;
  call.count = input.numel();
  call.send = input.data;
  call.recv = output.data;
  return submit(call, options.async_op);
}

Work Communicator::broadcast(TensorView buffer, const BroadcastOptions& options) {
  check_buffer(buffer, "buffer", "broadcast", device());
  MXDDP_CHECK(options.root >= 0 && options.root < size(), "broadcast: root {} is not a rank; valid: 0..{}",
              options.root, size() - 1);
  Call call;
  call.kind = CollectiveKind::kBroadcast;
  call.dtype = buffer.dtype;
  call.root = options.root;
  call.count = buffer.numel();
  call.send = buffer.data;
  call.recv = buffer.data;
  return submit(call, options.async_op);
}

Work Communicator::barrier(const BarrierOptions& options) {
  Call call;
  call.kind = CollectiveKind::kBarrier;
  return submit(call, options.async_op);
}

// On the progress thread, in issue order: the backend's staging is only touched there.
void Communicator::set_memory_tracker(MemoryTracker* tracker) {
  if (ordered_) return;  // no staging: the stream-ordered engine reduces in place on the device
  CommBackend* backend = backend_.get();
  queue_->submit([backend, tracker] { backend->set_memory_tracker(tracker); }).wait();
}

}  // namespace mxddp
