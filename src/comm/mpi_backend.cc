// The MPI backend: one process per rank, over OpenMPI.
//
// Every MPI call of a communicator is made from its progress thread (which is why the runtime asks
// for MPI_THREAD_MULTIPLE: several communicators, several threads). The progress thread runs each
// collective to completion while the caller computes, which is what gives asynchronous calls
// progress without the caller polling MPI (the design PyTorch's ProcessGroupMPI uses too).
//
// A collective runs in two phases under the watchdog (mpi_watchdog.h), so that a rank that stops
// cannot hang its peers:
//   1. arrival (with check_consistency): each rank sends its call header (sequence number, kind,
//      dtype, count, op, root, prescale) to every peer and receives theirs, point to point and
//      nonblocking, waited on with a no-progress deadline (wait_or_abort, which sleeps while a peer
//      is late, so a rank waiting for one still computing leaves the cores to compute). This is the
//      consistency check's exchange, so it costs no extra message round; unlike the allgather it
//      replaces, each peer's header lands in a request of its own, so a rank that times out knows
//      exactly which peers have reached the collective and which have not. MPI's non-overtaking
//      rule between a pair of ranks pairs the k-th header from a peer with this rank's k-th
//      receive; the sequence number inside is checked anyway. p2p and collective traffic on one
//      communicator never match each other, so the headers share comm_ (under a tag of their own).
//      O(size) small messages per rank: right for the node-scale groups this backend serves.
//   2. data: the blocking MPI collective, as before (faster than OpenMPI's nonblocking ones; see
//      mpi_watchdog.h), watched by a CallWatchdog thread. After phase 1 it waits only on data in
//      flight (without it, on late peers too); OpenMPI polls inside it, yielding the core between
//      empty polls (MpiRuntime sets mpi_yield_when_idle). Once every header has arrived, a stall
//      here can only be reported as waiting on every peer: MPI shows nothing of a collective's
//      partial state.
// No progress for MpiOptions::timeout_ms in phase 1, or phase 2 running that long, aborts the job
// (see abort_job_on_stall for why that, and not an Error).
//
// Errors come back as return codes (MPI_ERRORS_RETURN on our duplicated communicator) and become
// mxddp::Error with MPI's own error string.
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <mpi.h>

#include <mxddp/comm.h>

#include "backend.h"
#include "delayed_backend.h"
#include "mpi_watchdog.h"
#include "../compute/reduce.h"
#include "ring.h"
#include "staged_backend.h"

namespace mxddp {

namespace {

#define MXDDP_MPI_CHECK(call_expr, what)                                             \
  do {                                                                               \
    const int mxddp_mpi_rc = (call_expr);                                            \
    if (mxddp_mpi_rc != MPI_SUCCESS) [[unlikely]]                                    \
      MXDDP_FAIL("MPI error in {}: {} (rc {})", what, mpi_error_string(mxddp_mpi_rc), mxddp_mpi_rc); \
  } while (0)

std::string mpi_error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "unknown MPI error";
  return std::string(text, static_cast<size_t>(len));
}

// The wire type of a dtype: bf16 travels as raw 16-bit words (MPI cannot do arithmetic on it);
// bool as C's _Bool (one byte, like torch.bool), which MPI's logical or reduces.
MPI_Datatype wire_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kBF16: return MPI_UINT16_T;
    case DType::kU8: return MPI_UNSIGNED_CHAR;
    case DType::kF64: return MPI_DOUBLE;
    case DType::kI64: return MPI_INT64_T;
    case DType::kI32: return MPI_INT32_T;
    case DType::kBool: return MPI_C_BOOL;
    case DType::kF16:
    case DType::kE4M3:
    case DType::kE5M2:
    case DType::kE8M0: break;
  }
  MXDDP_FAIL("the mpi backend moves f32, bf16, u8, f64, i64, i32 and bool; got {}", dtype_name(dtype));
}

// The f32 and f64 results that MPI only summed: avg's division and the prescale (reduce.h).
void finish_float(const CollectiveCall& call, void* result, int size) {
  if (call.dtype == DType::kF32) finish_in_place(static_cast<float*>(result), call.count, call.op, size, call.prescale);
  if (call.dtype == DType::kF64) finish_in_place(static_cast<double*>(result), call.count, call.op, size, call.prescale);
}

// OpenMPI saturates MPI_SUM on MPI_UNSIGNED_CHAR; mxddp's u8 sum wraps modulo 256 on every backend.
void u8_wrapping_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint8_t*>(in);
  auto* b = static_cast<uint8_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = static_cast<uint8_t>(a[i] + b[i]);
}

int checked_count(int64_t count, std::string_view what) {
  MXDDP_CHECK(count <= INT_MAX, "{}: {} elements exceed MPI's int count limit ({})", what, count, INT_MAX);
  return static_cast<int>(count);
}

class MpiBackend final : public CommBackend {
 public:
  explicit MpiBackend(const MpiOptions& options)
      : check_consistency_(options.check_consistency),
        timeout_ms_(options.timeout_ms),
        tracker_(options.memory_tracker ? options.memory_tracker : &own_tracker_),
        data_watchdog_(options.timeout_ms, [this](std::string_view collective, uint64_t seq) {
          return stall_message(collective, seq, data_stall_reason(), all_peers());
        }) {
    MXDDP_CHECK(options.timeout_ms > 0, "MpiOptions::timeout_ms must be positive; got {}", options.timeout_ms);
    MXDDP_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    MXDDP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MXDDP_MPI_CHECK(MPI_Op_create(u8_wrapping_sum, /*commute=*/1, &u8_sum_), "MPI_Op_create");
    headers_.resize(static_cast<size_t>(kCallHeaderFields * size_));
    arrived_.resize(static_cast<size_t>(size_));
    requests_.resize(static_cast<size_t>(2 * (size_ - 1)));
    indices_.resize(requests_.size());
  }
  ~MpiBackend() override {
    MPI_Op_free(&u8_sum_);
    MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "mpi"; }
  Compute& compute() const override { return cpu_compute(); }

  void run(const CollectiveCall& call) override {
    ++seq_;
    if (check_consistency_) {
      exchange_headers(call);
      check_call_headers(headers_.data(), size_, kCallHeaderFields, seq_, call.kind);
    }
    const std::string_view what = collective_name(call.kind);
    switch (call.kind) {
      case CollectiveKind::kAllReduce: return all_reduce(call);
      case CollectiveKind::kReduceScatter: return reduce_scatter(call);
      case CollectiveKind::kAllGather: {
        const int count = checked_count(call.count, what);
        const MPI_Datatype type = wire_type(call.dtype);
        const size_t block_bytes = static_cast<size_t>(call.count) * dtype_size_bytes(call.dtype);
        const bool in_place = call.send == static_cast<char*>(call.recv) + static_cast<size_t>(rank_) * block_bytes;
        const auto watched = data_watchdog_.watch(what, seq_);
        MXDDP_MPI_CHECK(MPI_Allgather(in_place ? MPI_IN_PLACE : call.send, count, type, call.recv, count, type, comm_),
                        "MPI_Allgather");
        return;
      }
      case CollectiveKind::kBroadcast: {
        const auto watched = data_watchdog_.watch(what, seq_);
        MXDDP_MPI_CHECK(MPI_Bcast(call.recv, checked_count(call.count, what), wire_type(call.dtype), call.root, comm_),
                        "MPI_Bcast");
        return;
      }
      case CollectiveKind::kBarrier: {
        const auto watched = data_watchdog_.watch(what, seq_);
        MXDDP_MPI_CHECK(MPI_Barrier(comm_), "MPI_Barrier");
        return;
      }
    }
  }

 private:
  // The tag of header messages; collectives never match point-to-point traffic, so any tag works.
  static constexpr int kHeaderTag = 0x6d78;  // "mx"

  // Phase 1: sends this rank's header to every peer and waits for all of theirs (see the top of
  // this file). arrived_[r] records which peers' headers for seq_ came in, for the stall report.
  void exchange_headers(const CollectiveCall& call) {
    int64_t* mine = headers_.data() + kCallHeaderFields * rank_;
    const auto fields = pack_call_header(seq_, call);
    std::copy(fields.begin(), fields.end(), mine);
    std::fill(arrived_.begin(), arrived_.end(), false);
    arrived_[static_cast<size_t>(rank_)] = true;
    // requests_[i] for i < size-1 receives from peer_of(i); requests_[size-1+i] sends to it.
    const int peers = size_ - 1;
    auto peer_of = [&](int i) { return i < rank_ ? i : i + 1; };
    for (int i = 0; i < peers; ++i) {
      const int peer = peer_of(i);
      MXDDP_MPI_CHECK(MPI_Irecv(headers_.data() + kCallHeaderFields * peer, kCallHeaderFields, MPI_INT64_T, peer,
                                kHeaderTag, comm_, &requests_[static_cast<size_t>(i)]),
                      "MPI_Irecv (call header)");
      MXDDP_MPI_CHECK(MPI_Isend(mine, kCallHeaderFields, MPI_INT64_T, peer, kHeaderTag, comm_,
                                &requests_[static_cast<size_t>(peers + i)]),
                      "MPI_Isend (call header)");
    }
    wait_or_abort(
        requests_, indices_, timeout_ms_,
        [&](int index) {
          if (index < peers) arrived_[static_cast<size_t>(peer_of(index))] = true;
        },
        [&] {
          std::vector<int> missing;
          for (int r = 0; r < size_; ++r)
            if (!arrived_[static_cast<size_t>(r)]) missing.push_back(r);
          if (missing.empty())  // every header came in; only a send of ours is still pending
            return stall_message(collective_name(call.kind), seq_,
                                 "every rank reached it, but this rank's header sends did not complete", all_peers());
          return stall_message(collective_name(call.kind), seq_,
                               "these ranks have not reached it (they issued no header for it: each stopped, or is "
                               "held in an earlier collective by a peer that did)",
                               missing);
        });
  }

  std::string_view data_stall_reason() const {
    return check_consistency_ ? "every rank reached it (all headers arrived) but its data exchange stalled; it "
                                "needs every peer, and which one stopped is not visible from here"
                              : "arrival is not tracked with MpiOptions::check_consistency off, so these are all "
                                "the peers";
  }

  std::vector<int> all_peers() const {
    std::vector<int> peers;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) peers.push_back(r);
    return peers;
  }

  std::string stall_message(std::string_view collective, uint64_t seq, std::string_view why,
                            const std::vector<int>& waited_on) const {
    return fmt::format("mxddp: mpi watchdog: rank {}: {} #{} made no progress for {} ms (timeout_ms); waiting on "
                       "rank(s) {}: {}; aborting the job (MPI_Abort, exit status {})",
                       rank_, collective, seq, timeout_ms_, format_ranks(waited_on), why,
                       kMpiStallExitCode);
  }

 public:
  void set_memory_tracker(MemoryTracker* tracker) override {
    staging_ = HostBuffer();  // un-charged from the old tracker; the next reduction re-allocates
    tracker_ = tracker ? tracker : &own_tracker_;
  }

 private:
  // f32 staging for bf16 reductions (summing in f32, as the local backend does), charged as comm;
  // sized by mpi_staging_bytes (what the memory plan charges).
  float* staging_f32(const CollectiveCall& call) {
    const auto bytes = static_cast<size_t>(mpi_staging_bytes(call.kind == CollectiveKind::kReduceScatter, call.dtype,
                                                              call.count, size_));
    MXDDP_ASSERT(bytes > 0);
    if (staging_.size_bytes() < bytes) {
      staging_ = HostBuffer();
      staging_ = HostBuffer(bytes, MemoryCategory::kComm, *tracker_);
    }
    return static_cast<float*>(staging_.data());
  }

  // f32 sums of a MiB or more go round the ring (ring.h): MPI's collectives would allocate a
  // temporary as large as the message.
  bool ring_sum(const CollectiveCall& call, int64_t message_numel) const {
    return call.dtype == DType::kF32 && call.op != ReduceOp::kMax && size_ > 1 &&
           message_numel * int64_t{sizeof(float)} >= kRingMessageBytesMin;
  }

  // ring.h's transport: nonblocking point-to-point on comm_, under a tag of its own (the headers
  // use another; messages between a pair of ranks match in order within a tag). Whole floats go as
  // MPI_FLOAT, so a message may hold up to INT_MAX of them.
  struct RingTransport {
    struct Request {
      MPI_Request r = MPI_REQUEST_NULL;
    };
    static constexpr int kTag = 0x6d79;
    MPI_Comm comm;
    static MPI_Datatype word(int64_t bytes) { return bytes % 4 == 0 ? MPI_FLOAT : MPI_BYTE; }
    static int words(int64_t bytes, std::string_view what) { return checked_count(bytes % 4 == 0 ? bytes / 4 : bytes, what); }
    Request isend(const void* data, int64_t bytes, int peer) {
      Request q;
      MXDDP_MPI_CHECK(MPI_Isend(data, words(bytes, "ring send"), word(bytes), peer, kTag, comm, &q.r), "MPI_Isend (ring)");
      return q;
    }
    Request irecv(void* data, int64_t bytes, int peer) {
      Request q;
      MXDDP_MPI_CHECK(MPI_Irecv(data, words(bytes, "ring receive"), word(bytes), peer, kTag, comm, &q.r),
                      "MPI_Irecv (ring)");
      return q;
    }
    void wait(Request& q) { MXDDP_MPI_CHECK(MPI_Wait(&q.r, MPI_STATUS_IGNORE), "MPI_Wait (ring)"); }
  };

  void all_reduce(const CollectiveCall& call) {
    const int count = checked_count(call.count, "all_reduce");
    if (ring_sum(call, call.count)) {
      // Reduce-scatter over near-equal blocks, finish this rank's block, gather the blocks.
      std::vector<int64_t> offsets(static_cast<size_t>(size_) + 1);
      for (int b = 0; b <= size_; ++b) offsets[static_cast<size_t>(b)] = call.count * b / size_;
      auto* data = static_cast<float*>(call.recv);
      float* scratch = staging_f32(call);
      const auto watched = data_watchdog_.watch("all_reduce", seq_);
      RingTransport ring{comm_};
      ring_reduce_scatter_sum(ring, rank_, size_, data, offsets.data(), scratch);
      const int64_t mine = offsets[static_cast<size_t>(rank_)];
      finish_in_place(data + mine, offsets[static_cast<size_t>(rank_) + 1] - mine, call.op, size_, call.prescale);
      for (int64_t& o : offsets) o *= int64_t{sizeof(float)};
      ring_all_gather(ring, rank_, size_, reinterpret_cast<char*>(data), offsets.data());
      return;
    }
    if (call.dtype != DType::kBF16) {
      {
        const auto watched = data_watchdog_.watch("all_reduce", seq_);
        MXDDP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, call.recv, count, wire_type(call.dtype), mpi_op(call.op, call.dtype), comm_),
                        "MPI_Allreduce");
      }
      finish_float(call, call.recv, size_);
      return;
    }
    auto* data = static_cast<bf16_bits*>(call.recv);
    float* f32 = staging_f32(call);
    convert_bf16_to_f32(data, f32, static_cast<size_t>(call.count));
    {
      const auto watched = data_watchdog_.watch("all_reduce", seq_);
      MXDDP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, f32, count, MPI_FLOAT, mpi_op(call.op, call.dtype), comm_), "MPI_Allreduce");
    }
    finish_in_place(f32, call.count, call.op, size_, call.prescale);
    convert_f32_to_bf16(f32, data, static_cast<size_t>(call.count));
  }

  void reduce_scatter(const CollectiveCall& call) {
    const int count = checked_count(call.count, "reduce_scatter");
    checked_count(call.count * size_, "reduce_scatter input");
    const size_t elem = dtype_size_bytes(call.dtype);
    if (call.dtype == DType::kBF16) {
      // Widen the whole input to f32, reduce-scatter in f32 into the staging tail, round once.
      float* f32 = staging_f32(call);  // [size + 1, count]
      float* out = f32 + call.count * size_;
      convert_bf16_to_f32(static_cast<const bf16_bits*>(call.send), f32, static_cast<size_t>(call.count * size_));
      {
        const auto watched = data_watchdog_.watch("reduce_scatter", seq_);
        MXDDP_MPI_CHECK(MPI_Reduce_scatter_block(f32, out, count, MPI_FLOAT, mpi_op(call.op, call.dtype), comm_),
                        "MPI_Reduce_scatter_block");
      }
      finish_in_place(out, call.count, call.op, size_, call.prescale);
      convert_f32_to_bf16(out, static_cast<bf16_bits*>(call.recv), static_cast<size_t>(call.count));
      return;
    }
    const size_t block_bytes = static_cast<size_t>(count) * elem;
    if (call.recv != static_cast<const char*>(call.send) + static_cast<size_t>(rank_) * block_bytes) {
      {
        const auto watched = data_watchdog_.watch("reduce_scatter", seq_);
        MXDDP_MPI_CHECK(MPI_Reduce_scatter_block(call.send, call.recv, count, wire_type(call.dtype),
                                                 mpi_op(call.op, call.dtype), comm_),
                        "MPI_Reduce_scatter_block");
      }
      finish_float(call, call.recv, size_);
      return;
    }
    if (ring_sum(call, call.count * size_)) {
      // In place on the ring: this rank's block is summed where it lies; the rest is left as scratch.
      std::vector<int64_t> offsets(static_cast<size_t>(size_) + 1);
      for (int b = 0; b <= size_; ++b) offsets[static_cast<size_t>(b)] = call.count * b;
      {
        float* scratch = staging_f32(call);
        const auto watched = data_watchdog_.watch("reduce_scatter", seq_);
        RingTransport ring{comm_};
        ring_reduce_scatter_sum(ring, rank_, size_, static_cast<float*>(const_cast<void*>(call.send)), offsets.data(),
                                scratch);
      }
      finish_float(call, call.recv, size_);
      return;
    }
    // In place otherwise (f64, integers, max, small messages): MPI's in-place form leaves this
    // rank's block at the start of the buffer, then moved to its block. Block 0 is clobbered, which the contract allows (comm.h): the rest of an
    // in-place input is scratch afterwards, as the unreduced rest of Megatron's grad buffer is.
    // That spares a block-sized staging buffer held for the whole run.
    void* whole = const_cast<void*>(call.send);
    {
      const auto watched = data_watchdog_.watch("reduce_scatter", seq_);
      MXDDP_MPI_CHECK(MPI_Reduce_scatter_block(MPI_IN_PLACE, whole, count, wire_type(call.dtype),
                                               mpi_op(call.op, call.dtype), comm_),
                      "MPI_Reduce_scatter_block");
    }
    finish_float(call, whole, size_);
    if (rank_ != 0) std::memcpy(call.recv, whole, block_bytes);  // disjoint blocks
  }

  // avg is a sum followed by a division. bool's sum and max are both a logical or. Integer sums
  // wrap: OpenMPI adds int32/int64 with the machine's two's-complement add, as the local backend.
  MPI_Op mpi_op(ReduceOp op, DType dtype) const {
    if (dtype == DType::kBool) return MPI_LOR;
    if (op == ReduceOp::kMax) return MPI_MAX;
    return dtype == DType::kU8 ? u8_sum_ : MPI_SUM;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Op u8_sum_ = MPI_OP_NULL;
  int rank_ = 0;
  int size_ = 1;
  uint64_t seq_ = 0;
  const bool check_consistency_;
  const int64_t timeout_ms_;
  std::vector<int64_t> headers_;     // kCallHeaderFields per rank: the current collective's headers
  std::vector<bool> arrived_;        // per rank: its header for seq_ came in
  std::vector<MPI_Request> requests_;  // the header exchange's receives, then its sends
  std::vector<int> indices_;         // MPI_Testsome's scratch
  MemoryTracker own_tracker_;
  MemoryTracker* tracker_;
  HostBuffer staging_;  // declared after the trackers it is charged to
  CallWatchdog data_watchdog_;  // last: its thread reads the members above through stall_message
};

}  // namespace

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  MXDDP_CHECK(!initialized, "MPI is already initialized; create one MpiRuntime per process");
  // OpenMPI's blocking calls (the data phase of every collective) poll their progress engine; with
  // mpi_yield_when_idle the poll gives up the core between polls that find nothing. OpenMPI turns
  // it on only when it sees more ranks than slots, not when a data loader, a second job or a CPU
  // hog shares the cores; there a rank polling for a descheduled peer took the core that peer
  // needed (issue 44). On an idle core the yield returns at once. A setting of the user's wins.
  ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
  int provided = 0;
  MXDDP_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  if (provided < MPI_THREAD_MULTIPLE) {
    MPI_Finalize();
    MXDDP_FAIL("this MPI provides thread level {}; mxddp needs MPI_THREAD_MULTIPLE ({})", provided,
               MPI_THREAD_MULTIPLE);
  }
}

MpiRuntime::~MpiRuntime() { MPI_Finalize(); }

void MpiRuntime::abort_job(const std::string& message, int exit_code) {
  end_job_or_exit(message, [exit_code] { MPI_Abort(MPI_COMM_WORLD, exit_code); }, kMpiAbortGrace);
}

int MpiRuntime::world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int MpiRuntime::world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

int64_t mpi_staging_bytes(bool reduce_scatter, DType dtype, int64_t count, int size) {
  constexpr int64_t kF32 = sizeof(float);
  if (dtype == DType::kBF16) return reduce_scatter ? kF32 * count * (int64_t{size} + 1) : kF32 * count;
  if (dtype != DType::kF32 || size < 2) return 0;
  const int64_t message_numel = reduce_scatter ? count * size : count;
  if (message_numel * kF32 < kRingMessageBytesMin) return 0;
  const int64_t block_numel = reduce_scatter ? count : (count + size - 1) / size;
  return kF32 * ring_scratch_numel(block_numel);
}

std::unique_ptr<Communicator> make_mpi_communicator(const MpiOptions& options) {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  MXDDP_CHECK(initialized && !finalized, "make_mpi_communicator needs a live MpiRuntime (MPI initialized: {}, "
              "finalized: {})", initialized != 0, finalized != 0);
  std::unique_ptr<CommBackend> engine =
      with_injected_delay(std::make_unique<MpiBackend>(options), options.injected_delay);
  if (options.compute != nullptr && options.compute->place() == MemoryPlace::kDevice)
    engine = std::make_unique<StagedBackend>(std::move(engine), *options.compute, options.memory_tracker,
                                             options.check_consistency);
  return std::make_unique<Communicator>(std::move(engine));
}

}  // namespace mxddp
