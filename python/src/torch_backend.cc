// The torch.distributed engine under a Communicator (see torch_backend.h).
//
// Each collective, on the communicator's progress thread:
//   1. the consistency check of backend.h: every rank's call header (sequence number, kind, dtype,
//      op, root, count, prescale) is all-gathered through the group, and any field that differs
//      from rank 0's fails the call on every rank (the same Error text as the mpi backend's);
//   2. the data, by the group's gloo ops on DLPack views of the caller's buffers.
// The GIL is held only while Python runs (building the views, issuing the op); torch releases it
// inside each wait, and the C++ passes (bf16 widening, avg, prescale) run without it.
//
// What gloo lacks is done here, to give the semantics comm.h promises on every backend:
//   - reductions are sums and maxes only: avg divides after, prescale multiplies after (as the mpi
//     backend does: equal to the local backend's fused prescale up to rounding);
//   - bf16 reductions run in f32 (widened into a staging buffer charged as comm, sized exactly as
//     the mpi backend's, mpi_staging_bytes), rounded once;
//   - f32 sums of 1 MiB or more (an all-reduce, an in-place reduce-scatter: the gradient syncs) and
//     gathers of 1 MiB or more run on ring.h's ring, as the mpi backend's sums do: through shared
//     memory (shm_ring.h) when every rank of the group is on this host, summing out of its slots
//     with no scratch, else over the group's send/recv through the ring's 2 MiB scratch. gloo alone was slow at them: gloo's reduce_scatter ran 4x slower than its all_reduce of the same input, which moves
//     twice the bytes a reduce-scatter needs, and its _allgather_base 5x slower than one send/recv
//     pair of the same blocks (torch 2.15, 114 MiB f32, 2 ranks on one host: all_reduce 68 ms, ring
//     reduce-scatter 39 ms; _allgather_base 126 ms, ring all-gather 26 ms);
//   - a smaller reduce_scatter in place is an all_reduce of the whole input (the rest of it is
//     scratch by comm.h's contract); not in place it is gloo's reduce_scatter, since only the
//     output may be written;
//   - max lets NaN win (comm.h), which gloo's max does not in every order: each rank's header
//     says whether its input holds a NaN, and only when one does is the max run on the input with
//     NaN read as -inf, then NaN written back where any rank had one (a byte mask, max-reduced);
//   - bool reduces as bytes by max (logical or), normalized to 0/1;
//   - gathers and broadcasts move raw bytes, so every dtype travels alike.
#include "torch_backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <string>
#include <vector>

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include "../../src/comm/backend.h"
#include "../../src/comm/delayed_backend.h"
#include "../../src/compute/reduce.h"
#include "../../src/comm/ring.h"
#include "../../src/comm/shm_ring.h"
#include "../../src/comm/staged_backend.h"
#include "runtime.h"

namespace nb = nanobind;

namespace mxddp::python {
namespace {

nb::dlpack::dtype dlpack_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32: return nb::dtype<float>();
    case DType::kF64: return nb::dtype<double>();
    case DType::kI64: return nb::dtype<int64_t>();
    case DType::kI32: return nb::dtype<int32_t>();
    case DType::kU8: return nb::dtype<uint8_t>();
    default: MXDDP_FAIL("the torch backend passes no {} buffer to torch (a bug in mxddp)", dtype_name(dtype));
  }
}

// A torch tensor over count elements at data (no copy, no owner: it must not outlive the call).
// Needs the GIL.
nb::object tensor(const void* data, DType dtype, int64_t count) {
  const size_t shape[1] = {static_cast<size_t>(count)};
  nb::ndarray<nb::pytorch, nb::device::cpu> array(const_cast<void*>(data), 1, shape, nb::handle(), nullptr,
                                                  dlpack_dtype(dtype));
  return array.cast(nb::rv_policy::reference);
}

// The same bytes as u8, for the ops that only move data.
nb::object bytes_tensor(const void* data, DType dtype, int64_t count) {
  return tensor(data, DType::kU8, count * static_cast<int64_t>(dtype_size_bytes(dtype)));
}

bool is_float(DType dtype) { return dtype == DType::kF32 || dtype == DType::kF64; }

class TorchBackend final : public CommBackend {
 public:
  TorchBackend(nb::object runner, int rank, int size, MemoryTracker* tracker)
      : runner_(std::move(runner)), rank_(rank), size_(size), tracker_(tracker ? tracker : &own_tracker_) {
    MXDDP_CHECK(size >= 1 && rank >= 0 && rank < size, "torch process group: rank {} of size {} is not valid", rank,
                size);
    if (size > 1) setup_shm();
  }

  // The runner is a Python object: dropped under the GIL, or leaked if Python is already gone
  // (a communicator that outlived the interpreter; the process is ending anyway).
  ~TorchBackend() override {
    staging_ = HostBuffer();
    if (python_is_usable()) {
      nb::gil_scoped_acquire gil;
      runner_.reset();
    } else {
      runner_.release();
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "torch"; }
  Compute& compute() const override { return cpu_compute(); }

  void set_memory_tracker(MemoryTracker* tracker) override {
    staging_ = HostBuffer();  // un-charged from the old tracker; the next reduction re-allocates
    tracker_ = tracker ? tracker : &own_tracker_;
  }

  void run(const CollectiveCall& call) override {
    ++seq_;
    any_nan_ = false;
    exchange_headers(call);
    switch (call.kind) {
      case CollectiveKind::kAllReduce: all_reduce(call); return;
      case CollectiveKind::kReduceScatter: reduce_scatter(call); return;
      case CollectiveKind::kAllGather: all_gather(call); return;
      case CollectiveKind::kBroadcast:
        python(call, [&] { runner_.attr("broadcast")(bytes_tensor(call.recv, call.dtype, call.count), call.root); });
        return;
      case CollectiveKind::kBarrier: python(call, [&] { runner_.attr("barrier")(); }); return;
    }
    MXDDP_FAIL("unknown collective kind {}", static_cast<int>(call.kind));
  }

 private:
  // The common call header (backend.h: seq, kind, dtype, op, root, count, prescale bits), then
  // has_nan (max only).
  static constexpr int kHeaderFields = kCallHeaderFields + 1;

  // Runs fn (which calls the runner) under the GIL; a Python exception (gloo's timeout, a peer
  // that closed its connection) becomes an Error carrying torch's message.
  template <typename Fn>
  void python(const CollectiveCall& call, Fn&& fn) {
    MXDDP_CHECK(python_is_usable(),
                "{} #{}: the Python interpreter is shutting down, so the torch process group cannot run it (call "
                "mxddp.torch.shutdown() before the interpreter exits; the package's atexit hook does)",
                collective_name(call.kind), seq_);
    std::string error;
    {
      nb::gil_scoped_acquire gil;
      try {
        fn();
      } catch (nb::python_error& e) {
        error = std::string(nb::type_name(e.type()).c_str()) + ": " + nb::str(e.value()).c_str();
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    if (!error.empty())
      MXDDP_FAIL("{} #{} failed in torch.distributed on rank {} of {}: {}", collective_name(call.kind), seq_, rank_,
                 size_, error);
  }

  void exchange_headers(const CollectiveCall& call) {
    // The common header, and a field of this backend's own: whether this rank's input holds a NaN.
    int64_t mine[kHeaderFields];
    const auto common = pack_call_header(seq_, call);
    std::copy(common.begin(), common.end(), mine);
    mine[kCallHeaderFields] = has_nan(call) ? 1 : 0;
    headers_.assign(static_cast<size_t>(kHeaderFields * size_), 0);
    python(call, [&] {
      runner_.attr("all_gather")(tensor(headers_.data(), DType::kI64, kHeaderFields * size_),
                                 tensor(mine, DType::kI64, kHeaderFields));
    });
    for (int r = 0; r < size_; ++r)
      any_nan_ = any_nan_ || headers_[static_cast<size_t>(kHeaderFields * r + kCallHeaderFields)] != 0;
    check_call_headers(headers_.data(), size_, kHeaderFields, seq_, call.kind);
  }

  // f32 staging for bf16 reductions, the size the mpi backend (and the memory plan) charges.
  float* staging_f32(const CollectiveCall& call) {
    const auto bytes = static_cast<size_t>(
        mpi_staging_bytes(call.kind == CollectiveKind::kReduceScatter, call.dtype, call.count, size_));
    MXDDP_ASSERT(bytes > 0);
    if (staging_.size_bytes() < bytes) {
      staging_ = HostBuffer();
      staging_ = HostBuffer(bytes, MemoryCategory::kComm, *tracker_);
    }
    return static_cast<float*>(staging_.data());
  }

  // gloo sums or maxes; avg is a sum divided after (finish).
  static const char* wire_op(ReduceOp op) { return op == ReduceOp::kMax ? "max" : "sum"; }

  // The float result's avg and prescale, in the buffer's own precision.
  void finish(void* data, DType dtype, int64_t count, const CollectiveCall& call) const {
    if (call.op == ReduceOp::kMax) return;
    if (dtype == DType::kF32) finish_in_place(static_cast<float*>(data), count, call.op, size_, call.prescale);
    if (dtype == DType::kF64) finish_in_place(static_cast<double*>(data), count, call.op, size_, call.prescale);
  }

  static void normalize_bools(void* data, int64_t count) {
    auto* b = static_cast<uint8_t*>(data);
    for (int64_t i = 0; i < count; ++i) b[i] = b[i] != 0;
  }

  // Whether this rank's input to a float max holds a NaN (what its header reports).
  bool has_nan(const CollectiveCall& call) const {
    const bool reduces = call.kind == CollectiveKind::kAllReduce || call.kind == CollectiveKind::kReduceScatter;
    if (!reduces || call.op != ReduceOp::kMax) return false;
    const int64_t n = call.kind == CollectiveKind::kReduceScatter ? call.count * size_ : call.count;
    switch (call.dtype) {
      case DType::kF32: return any_nan(static_cast<const float*>(call.send), n);
      case DType::kF64: return any_nan(static_cast<const double*>(call.send), n);
      case DType::kBF16: {
        const auto* b = static_cast<const bf16_bits*>(call.send);
        return std::any_of(b, b + n, [](bf16_bits v) { return (v & 0x7fff) > 0x7f80; });
      }
      default: return false;
    }
  }

  template <typename T>
  static bool any_nan(const T* data, int64_t n) {
    return std::any_of(data, data + n, [](T v) { return std::isnan(v); });
  }

  // A max where some rank has a NaN: NaN read as -inf, then written back where any rank had one.
  template <typename T>
  void max_with_nan(const CollectiveCall& call, T* data, DType dtype, int64_t count) {
    std::vector<uint8_t> mask(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      mask[static_cast<size_t>(i)] = std::isnan(data[i]) ? 1 : 0;
      if (mask[static_cast<size_t>(i)]) data[i] = -std::numeric_limits<T>::infinity();
    }
    python(call, [&] {
      runner_.attr("all_reduce")(tensor(data, dtype, count), "max");
      runner_.attr("all_reduce")(tensor(mask.data(), DType::kU8, count), "max");
    });
    for (int64_t i = 0; i < count; ++i)
      if (mask[static_cast<size_t>(i)]) data[i] = std::numeric_limits<T>::quiet_NaN();
  }

  // An in-place all_reduce of count elements at data, whose dtype is wire (the call's, or f32 for
  // bf16's staging).
  void all_reduce_raw(const CollectiveCall& call, void* data, DType wire, int64_t count) {
    if (any_nan_ && wire == DType::kF32) return max_with_nan(call, static_cast<float*>(data), wire, count);
    if (any_nan_ && wire == DType::kF64) return max_with_nan(call, static_cast<double*>(data), wire, count);
    const bool flags = wire == DType::kBool;
    python(call, [&] {
      runner_.attr("all_reduce")(tensor(data, flags ? DType::kU8 : wire, count), flags ? "max" : wire_op(call.op));
    });
  }

  // ring.h's transport: the private gloo group's send/recv (torch Works), each issued under the
  // GIL; Work.wait() releases it while gloo moves the data.
  class RingTransport {
   public:
    // A torch Work in flight, or nothing. Dropped under the GIL (leaked if Python is gone), so
    // that an Error thrown mid-ring unwinds safely.
    class Request {
     public:
      Request() = default;
      explicit Request(nb::object work) : work_(std::move(work)) {}
      Request(Request&& other) noexcept : work_(std::move(other.work_)) {}
      Request& operator=(Request&& other) noexcept {
        drop();
        work_ = std::move(other.work_);
        return *this;
      }
      ~Request() { drop(); }
      nb::object& work() { return work_; }

     private:
      void drop() noexcept {
        if (!work_.is_valid()) return;
        if (!python_is_usable()) {
          work_.release();
          return;
        }
        nb::gil_scoped_acquire gil;
        work_.reset();
      }
      nb::object work_;
    };

    RingTransport(TorchBackend& backend, const CollectiveCall& call) : b_(backend), call_(call) {}
    Request isend(const void* data, int64_t bytes, int peer) { return issue("isend", data, bytes, peer); }
    Request irecv(void* data, int64_t bytes, int peer) { return issue("irecv", data, bytes, peer); }
    void wait(Request& q) {
      if (!q.work().is_valid()) return;
      b_.python(call_, [&] {
        q.work().attr("wait")();
        q.work().reset();
      });
    }

   private:
    Request issue(const char* method, const void* data, int64_t bytes, int peer) {
      nb::object work;
      b_.python(call_, [&] { work = b_.runner_.attr(method)(tensor(data, DType::kU8, bytes), peer); });
      return Request(std::move(work));
    }
    TorchBackend& b_;
    const CollectiveCall& call_;
  };

  // The ring through shared memory (shm_ring.h) when the runner found every rank of the group on
  // this host (runner.shm_token: a token unique to the group, or None). Collective, with an
  // agreement after each phase, so every rank uses it or none does (gloo's send/recv then). Sets
  // runner.ring_transport to "shm" or "gloo (why)". Called with the GIL held.
  void setup_shm() {
    nb::object token = runner_.attr("shm_token");
    std::string why = "the ranks are not all on one host, or MXDDP_TORCH_SHM=0";
    std::unique_ptr<ShmRingTransport> shm;
    if (!token.is_none()) {
      why.clear();
      const auto timeout_ms = static_cast<int64_t>(nb::cast<double>(runner_.attr("timeout_s")) * 1000.0);
      try {
        shm = ShmRingTransport::create(nb::cast<std::string>(token), rank_, size_, timeout_ms);
      } catch (const std::exception& e) {
        why = e.what();
      }
      if (agree_ok(why.empty(), why) && agree_ok(shm->connect(why), why)) {
        shm->unlink_own();  // every rank has mapped its left neighbour's channel
        shm_ = std::move(shm);
      }
    }
    nb::setattr(runner_, "ring_transport", nb::str(shm_ ? "shm" : ("gloo (" + why + ")").c_str()));
  }

  // Whether every rank's ok is true (a max of failure flags over the group).
  bool agree_ok(bool ok, std::string& why) {
    uint8_t failed = ok ? 0 : 1;
    runner_.attr("all_reduce")(tensor(&failed, DType::kU8, 1), "max");
    if (failed != 0 && ok) why = "another rank could not set up its shared memory";
    return failed == 0;
  }

  // The f32 sums that go round the ring (the mpi backend's rule, so mpi_staging_bytes sizes both).
  bool ring_sum(const CollectiveCall& call, int64_t message_numel) const {
    return call.dtype == DType::kF32 && call.op != ReduceOp::kMax && size_ > 1 &&
           message_numel * int64_t{sizeof(float)} >= kRingMessageBytesMin;
  }

  // In place on the ring over blocks [offsets[b], offsets[b + 1]) (elements): this rank's block
  // holds the finished sum; the rest is scratch.
  void ring_reduce_scatter(const CollectiveCall& call, float* data, const std::vector<int64_t>& offsets) {
    if (shm_) {  // sums out of the shared-memory slots: no scratch
      ring_reduce_scatter_sum(*shm_, rank_, size_, data, offsets.data(), nullptr);
    } else {
      RingTransport ring(*this, call);
      ring_reduce_scatter_sum(ring, rank_, size_, data, offsets.data(), staging_f32(call));
    }
    const int64_t mine = offsets[static_cast<size_t>(rank_)];
    finish(data + mine, DType::kF32, offsets[static_cast<size_t>(rank_) + 1] - mine, call);
  }

  void all_gather(const CollectiveCall& call) {
    const int64_t block_bytes = call.count * static_cast<int64_t>(dtype_size_bytes(call.dtype));
    if (size_ == 1 || block_bytes * size_ < kRingMessageBytesMin) {
      python(call, [&] {
        runner_.attr("all_gather")(bytes_tensor(call.recv, call.dtype, call.count * size_),
                                   bytes_tensor(call.send, call.dtype, call.count));
      });
      return;
    }
    char* recv = static_cast<char*>(call.recv);
    if (call.send != recv + block_bytes * rank_) std::memcpy(recv + block_bytes * rank_, call.send, static_cast<size_t>(block_bytes));
    std::vector<int64_t> offsets(static_cast<size_t>(size_) + 1);
    for (int b = 0; b <= size_; ++b) offsets[static_cast<size_t>(b)] = block_bytes * b;
    ring_gather(call, recv, offsets);
  }

  // ring.h's all-gather of byte blocks, through shared memory or gloo.
  void ring_gather(const CollectiveCall& call, char* data, const std::vector<int64_t>& offsets) {
    if (shm_) {
      ring_all_gather(*shm_, rank_, size_, data, offsets.data());
      return;
    }
    RingTransport ring(*this, call);
    ring_all_gather(ring, rank_, size_, data, offsets.data());
  }

  void all_reduce(const CollectiveCall& call) {
    if (call.dtype == DType::kBF16) {
      auto* data = static_cast<bf16_bits*>(call.recv);
      float* f32 = staging_f32(call);
      convert_bf16_to_f32(data, f32, static_cast<size_t>(call.count));
      all_reduce_raw(call, f32, DType::kF32, call.count);
      finish(f32, DType::kF32, call.count, call);
      convert_f32_to_bf16(f32, data, static_cast<size_t>(call.count));
      return;
    }
    if (ring_sum(call, call.count)) {
      // Reduce-scatter over near-equal blocks, finished, then the blocks gathered.
      std::vector<int64_t> offsets(static_cast<size_t>(size_) + 1);
      for (int b = 0; b <= size_; ++b) offsets[static_cast<size_t>(b)] = call.count * b / size_;
      auto* data = static_cast<float*>(call.recv);
      ring_reduce_scatter(call, data, offsets);
      for (int64_t& o : offsets) o *= int64_t{sizeof(float)};
      ring_gather(call, reinterpret_cast<char*>(data), offsets);
      return;
    }
    all_reduce_raw(call, call.recv, call.dtype, call.count);
    if (call.dtype == DType::kBool) normalize_bools(call.recv, call.count);
    if (is_float(call.dtype)) finish(call.recv, call.dtype, call.count, call);
  }

  void reduce_scatter(const CollectiveCall& call) {
    const int64_t whole = call.count * size_;
    if (call.dtype == DType::kBF16) {
      // Widen the whole input, all-reduce it in f32, round this rank's block once into recv.
      float* f32 = staging_f32(call);  // [size + 1, count]; the first size blocks used
      convert_bf16_to_f32(static_cast<const bf16_bits*>(call.send), f32, static_cast<size_t>(whole));
      all_reduce_raw(call, f32, DType::kF32, whole);
      float* block = f32 + call.count * rank_;
      finish(block, DType::kF32, call.count, call);
      convert_f32_to_bf16(block, static_cast<bf16_bits*>(call.recv), static_cast<size_t>(call.count));
      return;
    }
    const size_t block_bytes = static_cast<size_t>(call.count) * dtype_size_bytes(call.dtype);
    const bool in_place = call.recv == static_cast<const char*>(call.send) + static_cast<size_t>(rank_) * block_bytes;
    if (in_place && ring_sum(call, whole)) {
      std::vector<int64_t> offsets(static_cast<size_t>(size_) + 1);
      for (int b = 0; b <= size_; ++b) offsets[static_cast<size_t>(b)] = call.count * b;
      ring_reduce_scatter(call, static_cast<float*>(const_cast<void*>(call.send)), offsets);
      return;
    }
    if (in_place) {
      all_reduce_raw(call, const_cast<void*>(call.send), call.dtype, whole);
    } else if (any_nan_) {  // the NaN-aware max works in place: on a copy, so that input stays as it was
      std::vector<char> copy(static_cast<const char*>(call.send),
                             static_cast<const char*>(call.send) + block_bytes * static_cast<size_t>(size_));
      all_reduce_raw(call, copy.data(), call.dtype, whole);
      std::memcpy(call.recv, copy.data() + block_bytes * static_cast<size_t>(rank_), block_bytes);
    } else {
      const bool flags = call.dtype == DType::kBool;
      const DType wire = flags ? DType::kU8 : call.dtype;
      python(call, [&] {
        runner_.attr("reduce_scatter")(tensor(call.recv, wire, call.count), tensor(call.send, wire, whole),
                                       flags ? "max" : wire_op(call.op));
      });
    }
    if (call.dtype == DType::kBool) normalize_bools(call.recv, call.count);
    if (is_float(call.dtype)) finish(call.recv, call.dtype, call.count, call);
  }

  nb::object runner_;
  const int rank_;
  const int size_;
  uint64_t seq_ = 0;
  bool any_nan_ = false;  // the current call's: some rank's max input holds a NaN
  std::vector<int64_t> headers_;  // [size][kHeaderFields]
  MemoryTracker own_tracker_;
  MemoryTracker* tracker_;
  HostBuffer staging_;
  std::unique_ptr<ShmRingTransport> shm_;  // null: the ring runs on gloo's send/recv
};

}  // namespace

std::unique_ptr<Communicator> make_torch_communicator(nb::object runner, int rank, int size, MemoryTracker* tracker,
                                                      const CollectiveDelay& delay, Compute* device) {
  validate_collective_delay(delay);
  std::unique_ptr<CommBackend> engine =
      with_injected_delay(std::make_unique<TorchBackend>(std::move(runner), rank, size, tracker), delay);
  // The header all-gather of each call (above) runs before any byte moves, so the staging may
  // count on the ranks agreeing.
  if (device != nullptr && device->place() == MemoryPlace::kDevice)
    engine = std::make_unique<StagedBackend>(std::move(engine), *device, tracker, /*host_checks_agreement=*/true);
  return std::make_unique<Communicator>(std::move(engine));
}

}  // namespace mxddp::python
