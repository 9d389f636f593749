// The NCCL engine (include/mxddp/nccl.h): one process per rank, each on its own GPU, with its
// collectives in the device's stream order (backend.h's StreamOrderedBackend).
//
// A collective, enqueued on the issuing thread (Communicator holds one issuer at a time):
//   1. with check_consistency, every rank's call header is all-gathered over a second NCCL
//      communicator (split from the first, on a stream of its own, so the gather waits only for
//      the peers to arrive, not for the work in flight) and compared on the host: a mismatch is an
//      Error on every rank before any buffer is touched, as with the mpi backend;
//   2. an event recorded on the compute stream makes the NCCL stream wait for the work enqueued so
//      far, and the NCCL call is enqueued there;
//   3. a fresh event is recorded after it and handed to the Work: wait() makes the compute stream
//      wait for that event (the host does not), is_completed() queries it;
//   4. the watchdog thread takes the event: it polls the events in flight and NCCL's asynchronous
//      error, and past timeout_ms (or on an error) aborts the communicators; the failure is then
//      every later wait()'s and enqueue's.
// Both communicators are nonblocking (NCCL's config.blocking = 0), so joining and every call can be
// given up on: a call that answers ncclInProgress is polled until NCCL has taken it up.
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <mxddp/host_device.h>
#include <mxddp/nccl.h>

#include "../cuda/cuda_check.h"
#include "backend.h"

static_assert(sizeof(ncclUniqueId) == sizeof(mxddp::NcclUniqueId::bytes), "NCCL_UNIQUE_ID_BYTES changed");

namespace mxddp {

namespace {

using Clock = std::chrono::steady_clock;

std::string nccl_last_error() {
  const char* text = ncclGetLastError(nullptr);
  return text && *text ? fmt::format(": {}", text) : std::string();
}

std::string nccl_failure(ncclResult_t rc) { return fmt::format("NCCL error {}{}", ncclGetErrorString(rc), nccl_last_error()); }

// For the calls that need no communicator (the version, a unique id).
void nccl_check(ncclResult_t rc, std::string_view what) {
  if (rc != ncclSuccess) MXDDP_FAIL("{}: {}", what, nccl_failure(rc));
}

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return ncclFloat32;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF64: return ncclFloat64;
    case DType::kI64: return ncclInt64;
    case DType::kI32: return ncclInt32;
    case DType::kU8:
    case DType::kBool: return ncclUint8;  // bool: one byte 0 or 1, reduced by max (= logical or)
    case DType::kF16:
    case DType::kE4M3:
    case DType::kE5M2:
    case DType::kE8M0: break;
  }
  MXDDP_FAIL("dtype {} has no NCCL type; the communicator moves f32, bf16, f64, i64, i32, u8 and bool", dtype_name(dtype));
}

// ---- Owning handles, released in the right order even when a constructor throws half way ----

// cudaStreamDestroy returns at once and releases the stream once its work is done: the engine
// never waits here, since after an abort that work may never end cleanly.
struct StreamDeleter {
  void operator()(CUstream_st* stream) const noexcept { cudaStreamDestroy(stream); }
};
struct EventDeleter {
  void operator()(CUevent_st* event) const noexcept { cudaEventDestroy(event); }
};
struct PinnedDeleter {
  void operator()(int64_t* host) const noexcept { cudaFreeHost(host); }
};
using UniqueStream = std::unique_ptr<CUstream_st, StreamDeleter>;
using UniqueEvent = std::unique_ptr<CUevent_st, EventDeleter>;
using UniquePinned = std::unique_ptr<int64_t[], PinnedDeleter>;

UniqueStream make_stream(std::string_view what) {
  cudaStream_t stream = nullptr;
  MXDDP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "creating {}", what);
  return UniqueStream(stream);
}

std::shared_ptr<CUevent_st> make_event(std::string_view what) {
  cudaEvent_t event = nullptr;
  MXDDP_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "creating {}", what);
  return std::shared_ptr<CUevent_st>(event, EventDeleter{});
}

// An NCCL communicator: finalized (its calls completed, within timeout_ms) then destroyed; aborted
// instead when that fails or when it was given up on.
struct CommHandle {
  ncclComm_t comm = nullptr;
  int64_t timeout_ms = 0;
  CommHandle() = default;
  CommHandle(const CommHandle&) = delete;
  CommHandle& operator=(const CommHandle&) = delete;
  ~CommHandle() { finalize(); }
  void finalize() noexcept {
    if (comm == nullptr) return;
    ncclResult_t state = ncclCommFinalize(comm);
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (state == ncclSuccess || state == ncclInProgress) {
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
      if (state != ncclInProgress || Clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (state == ncclSuccess) ncclCommDestroy(comm);
    else ncclCommAbort(comm);
    comm = nullptr;
  }
  void abort() noexcept {
    if (comm != nullptr) ncclCommAbort(comm);
    comm = nullptr;
  }
};

// The engine's failure, shared with its Works (which may outlive it): set once, by whichever
// thread finds it first.
class Health {
 public:
  std::exception_ptr error() const {
    std::lock_guard lock(mutex_);
    return error_;
  }
  std::string reason() const {
    std::lock_guard lock(mutex_);
    return reason_;
  }
  // Records the failure (the first one only) and returns the Error for it.
  Error record(const std::string& reason) {
    std::lock_guard lock(mutex_);
    if (!error_) {
      reason_ = reason;
      error_ = std::make_exception_ptr(Error(fmt::format("{}; the NCCL communicator is aborted", reason), "nccl"));
    }
    return Error(fmt::format("{}; the NCCL communicator is aborted", reason_), "nccl");
  }

 private:
  mutable std::mutex mutex_;
  std::exception_ptr error_;
  std::string reason_;
};

class NcclBackend final : public StreamOrderedBackend {
 public:
  NcclBackend(const NcclUniqueId& id, int rank, int size, const NcclOptions& options)
      : rank_(rank), size_(size), options_(options) {
    std::string why;
    const int devices = cuda_device_count(&why);
    MXDDP_CHECK(devices > 0, "make_nccl_communicator (rank {} of {}): {}", rank, size, why);
    if (options.device >= 0) {
      MXDDP_CHECK(options.device < devices, "make_nccl_communicator: NcclOptions::device {} does not exist; this "
                  "process sees {} device(s), 0..{}", options.device, devices, devices - 1);
      device_ = options.device;
    } else {
      MXDDP_CUDA_CHECK(cudaGetDevice(&device_), "reading the current device");
    }
    select_device(device_);
    if (!options.stream) owned_stream_ = make_stream("the rank's compute stream");  // shared with the Works
    compute_stream_ = options.stream ? *options.stream : owned_stream_.get();
    compute_ = make_cuda_compute(compute_stream_);
    nccl_stream_ = make_stream("the NCCL stream");
    check_stream_ = make_stream("the call headers' stream");
    ready_ = make_event("the NCCL ordering event");

    // The call headers' exchange: size slots of kHeaderFields i64 each on the device, and pinned on
    // the host (this rank's header, then every rank's), so that both copies are asynchronous and
    // the wait for them is the watchdog's.
    const size_t header_bytes = static_cast<size_t>(size) * kHeaderFields * sizeof(int64_t);
    headers_ = compute_->allocate(header_bytes, MemoryCategory::kComm, tracker_);
    barrier_slot_ = compute_->allocate(sizeof(int64_t), MemoryCategory::kComm, tracker_);
    // Allocated and zeroed in the compute stream's order, but used on the engine's own streams.
    compute_->synchronize();
    void* pinned = nullptr;
    MXDDP_CUDA_CHECK(cudaMallocHost(&pinned, header_bytes + kHeaderFields * sizeof(int64_t)),
                     "pinning {} bytes for the call headers", header_bytes + kHeaderFields * sizeof(int64_t));
    host_headers_.reset(static_cast<int64_t*>(pinned));

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclUniqueId nccl_id;
    std::memcpy(&nccl_id, id.bytes.data(), sizeof nccl_id);
    comm_.timeout_ms = check_comm_.timeout_ms = options.timeout_ms;
    const auto deadline = Clock::now() + std::chrono::milliseconds(options.timeout_ms);
    const std::string joining = fmt::format("rank {} of {} joining the NCCL group on cuda:{}", rank, size, device_);
    check(ncclCommInitRankConfig(&comm_.comm, size, nccl_id, rank, &config), joining);
    settle(comm_.comm, joining, deadline);
    if (options.check_consistency && size > 1) {
      ncclConfig_t split_config = NCCL_CONFIG_INITIALIZER;
      split_config.blocking = 0;
      split_config.splitShare = 1;  // the parent's resources: the headers are 64 bytes a rank
      check(ncclCommSplit(comm_.comm, 0, rank, &check_comm_.comm, &split_config), joining + ", its header group");
      settle(check_comm_.comm, joining + ", its header group", deadline);
    }
    watchdog_ = std::thread([this] { watch(); });
  }

  // Waits for the collectives in flight (the watchdog ends once they are done, or aborts them past
  // their deadline), then releases everything on the rank's device (which the calling thread is
  // left on), in order.
  ~NcclBackend() override {
    {
      std::lock_guard lock(flight_mutex_);
      stopping_ = true;
    }
    flight_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    cudaSetDevice(device_);
    // Freed on the compute stream: nothing on the engine's streams uses them now (every collective
    // completed, or the engine was aborted and they are undefined anyway).
    barrier_slot_ = ComputeBuffer();
    headers_ = ComputeBuffer();
    check_comm_.finalize();
    comm_.finalize();
    ready_.reset();
    check_stream_.reset();
    nccl_stream_.reset();
    compute_.reset();
    owned_stream_.reset();  // destroyed once the last Work that orders it goes
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "nccl"; }
  Compute& compute() const override { return *compute_; }

  EnqueuedCollective enqueue(const CollectiveCall& call) override {
    std::lock_guard nccl_lock(nccl_mutex_);  // with the watchdog's abort
    if (const std::exception_ptr failed = health_->error()) std::rethrow_exception(failed);
    const uint64_t seq = seq_++;
    const std::string what = fmt::format("{} #{} ({} x {}) on rank {} of {}, cuda:{}", collective_name(call.kind), seq,
                                         call.count, dtype_name(call.dtype), rank_, size_, device_);
    select_device(device_);
    if (check_comm_.comm != nullptr)
      check_consistency(call, seq, what, Clock::now() + std::chrono::milliseconds(options_.timeout_ms));
    // The collective's own budget starts once its peers are known to have reached it.
    const auto deadline = Clock::now() + std::chrono::milliseconds(options_.timeout_ms);
    std::shared_ptr<CUevent_st> done = make_event(what + "'s completion event");  // before the call: it must be tracked
    MXDDP_CUDA_CHECK(cudaEventRecord(ready_.get(), compute_stream_), "{}: recording the compute stream's event", what);
    MXDDP_CUDA_CHECK(cudaStreamWaitEvent(nccl_stream_.get(), ready_.get(), 0), "{}: ordering after the compute stream", what);
    run_nccl(call, what, deadline);
    MXDDP_CUDA_CHECK(cudaEventRecord(done.get(), nccl_stream_.get()), "{}: recording its completion", what);
    {
      std::lock_guard lock(flight_mutex_);
      in_flight_.push_back({done, deadline, what});
    }
    flight_cv_.notify_all();

    // The Work's side: it may outlive this engine, so it holds the event, the compute stream (if
    // owned here) and the health by reference count.
    EnqueuedCollective out;
    out.order_after = [done, device = device_, stream = compute_stream_, owned = owned_stream_] {
      select_device(device);  // the waiter's thread may be on none yet (a context on device 0 otherwise)
      MXDDP_CUDA_CHECK(cudaStreamWaitEvent(stream, done.get(), 0), "ordering the compute stream after an NCCL collective");
    };
    out.finished = [done] { return cudaEventQuery(done.get()) != cudaErrorNotReady; };
    out.late_failure = [health = health_] { return health->error(); };
    return out;
  }

 private:
  static constexpr int kHeaderFields = 8;  // kCallHeaderFields, padded

  struct InFlight {
    std::shared_ptr<CUevent_st> done;
    Clock::time_point deadline;
    std::string what;
  };

  // Every rank's header for call, gathered over the header group and compared with rank 0's. The
  // host waits here, but only for the peers to reach this collective.
  void check_consistency(const CollectiveCall& call, uint64_t seq, const std::string& what, Clock::time_point deadline) {
    const auto header = pack_call_header(seq, call);
    int64_t* mine = host_headers_.get();                 // [kHeaderFields], pinned
    int64_t* all = host_headers_.get() + kHeaderFields;  // [size, kHeaderFields], pinned
    std::fill(mine, mine + kHeaderFields, 0);
    std::copy(header.begin(), header.end(), mine);
    auto* slots = static_cast<int64_t*>(headers_.data());
    int64_t* own = slots + static_cast<ptrdiff_t>(rank_) * kHeaderFields;
    const size_t all_bytes = static_cast<size_t>(size_) * kHeaderFields * sizeof(int64_t);
    const std::string exchanging = what + ", exchanging call headers";
    MXDDP_CUDA_CHECK(cudaMemcpyAsync(own, mine, kHeaderFields * sizeof(int64_t), cudaMemcpyHostToDevice, check_stream_.get()),
                     "{}: staging the call header", what);
    check(ncclAllGather(own, slots, kHeaderFields, ncclInt64, check_comm_.comm, check_stream_.get()), exchanging);
    settle(check_comm_.comm, exchanging, deadline);
    MXDDP_CUDA_CHECK(cudaMemcpyAsync(all, slots, all_bytes, cudaMemcpyDeviceToHost, check_stream_.get()),
                     "{}: reading the call headers", what);
    for (int64_t polls = 0;; ++polls) {
      const cudaError_t done = cudaStreamQuery(check_stream_.get());
      if (done == cudaSuccess) break;
      if (done != cudaErrorNotReady)
        fail(fmt::format("{}: {} ({})", exchanging, cudaGetErrorString(done), cudaGetErrorName(done)));
      ncclResult_t state = ncclSuccess;
      check(ncclCommGetAsyncError(check_comm_.comm, &state), exchanging);
      if (state != ncclSuccess && state != ncclInProgress) fail(fmt::format("{}: {}", exchanging, nccl_failure(state)));
      if (Clock::now() > deadline)
        fail(fmt::format("{}: a peer did not reach it within timeout_ms {}", exchanging, options_.timeout_ms));
      pause(polls);
    }
    check_call_headers(all, size_, kHeaderFields, seq, call.kind);
  }

  void run_nccl(const CollectiveCall& call, const std::string& what, Clock::time_point deadline) {
    const ncclDataType_t type = nccl_type(call.dtype);
    const auto count = static_cast<size_t>(call.count);
    cudaStream_t stream = nccl_stream_.get();
    switch (call.kind) {
      case CollectiveKind::kAllReduce:
      case CollectiveKind::kReduceScatter: {
        const ncclRedOp_t op = prepare_op(call, type, what);
        const ncclResult_t rc = call.kind == CollectiveKind::kAllReduce
                                    ? ncclAllReduce(call.send, call.recv, count, type, op, comm_.comm, stream)
                                    : ncclReduceScatter(call.send, call.recv, count, type, op, comm_.comm, stream);
        if (rc == ncclSuccess || rc == ncclInProgress) settle(comm_.comm, what, deadline);  // NCCL took the op up
        if (op != ncclSum && op != ncclAvg && op != ncclMax) ncclRedOpDestroy(op, comm_.comm);
        check(rc, what);
        return;
      }
      case CollectiveKind::kAllGather:
        check(ncclAllGather(call.send, call.recv, count, type, comm_.comm, stream), what);
        break;
      case CollectiveKind::kBroadcast:
        check(ncclBroadcast(call.send, call.recv, count, type, call.root, comm_.comm, stream), what);
        break;
      case CollectiveKind::kBarrier: {
        // A one-element all-reduce of a word of its own (the header slots are the header stream's).
        void* slot = barrier_slot_.data();
        check(ncclAllReduce(slot, slot, 1, ncclInt64, ncclMax, comm_.comm, stream), what);
        break;
      }
    }
    settle(comm_.comm, what, deadline);
  }

  // The NCCL reduction of a call: sum, avg, max; a prescale is a PreMulSum (of prescale / size for
  // avg), created for this call and destroyed once NCCL has taken the call up, as NCCL allows.
  ncclRedOp_t prepare_op(const CollectiveCall& call, ncclDataType_t type, const std::string& what) {
    if (call.dtype == DType::kBool) return ncclMax;
    if (call.prescale == 1.0f) {
      switch (call.op) {
        case ReduceOp::kSum: return ncclSum;
        case ReduceOp::kAvg: return ncclAvg;
        case ReduceOp::kMax: return ncclMax;
      }
    }
    // Communicator allows a prescale on floats' sum and avg only.
    const double factor = call.op == ReduceOp::kAvg ? static_cast<double>(call.prescale) / size_ : call.prescale;
    float f32 = static_cast<float>(factor);
    bf16_bits bf16 = f32_to_bf16(f32);
    double f64 = factor;
    void* scalar = call.dtype == DType::kBF16 ? static_cast<void*>(&bf16)
                   : call.dtype == DType::kF64 ? static_cast<void*>(&f64)
                                               : static_cast<void*>(&f32);
    ncclRedOp_t op = ncclSum;
    check(ncclRedOpCreatePreMulSum(&op, scalar, type, ncclScalarHostImmediate, comm_.comm),
          fmt::format("{}: the prescale {} (PreMulSum)", what, call.prescale));
    return op;
  }

  // Until NCCL has taken the last call on comm up (a nonblocking communicator's ncclInProgress).
  void settle(ncclComm_t comm, const std::string& what, Clock::time_point deadline) {
    for (int64_t polls = 0;; ++polls) {
      ncclResult_t state = ncclSuccess;
      check(ncclCommGetAsyncError(comm, &state), what + ": reading NCCL's state");
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) fail(fmt::format("{}: {}", what, nccl_failure(state)));
      if (Clock::now() > deadline)
        fail(fmt::format("{}: NCCL did not take the call up within timeout_ms {}", what, options_.timeout_ms));
      pause(polls);
    }
  }

  // An NCCL call's result: taken up (ncclInProgress is settled later), a misuse of the API (a bug
  // here, which leaves the communicator as it was), or a failure, which aborts it.
  void check(ncclResult_t rc, const std::string& what) {
    if (rc == ncclSuccess || rc == ncclInProgress) return;
    if (rc == ncclInvalidArgument || rc == ncclInvalidUsage) MXDDP_FAIL("{}: NCCL refused the call: {}", what, nccl_failure(rc));
    fail(fmt::format("{}: {}", what, nccl_failure(rc)));
  }

  // Aborts both NCCL communicators and records the failure: this and every later call fail, and
  // so does every wait() on a collective of this engine. The buffers of the collectives in flight
  // are undefined from then on (an aborted kernel ends early); the engine does not wait for them,
  // since after an abort they may never end cleanly. Called with nccl_mutex_ held.
  [[noreturn]] void fail(const std::string& reason) {
    const Error error = health_->record(reason);
    check_comm_.abort();
    comm_.abort();
    throw error;
  }

  // Spin briefly (a small collective takes microseconds), then leave the core to others.
  static void pause(int64_t polls) {
    if (polls < 1000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  }

  // The watchdog thread: retires the collectives in flight as their events complete; the oldest
  // one past its deadline, or an asynchronous NCCL error, aborts the engine (health_ then fails
  // every later wait() and enqueue). Ends when asked to stop with nothing in flight, or after a
  // failure. It calls NCCL only when no enqueue is (try_lock: an enqueue waiting for its peers
  // holds the lock, under a deadline of its own).
  void watch() {
    cudaSetDevice(device_);
    for (;;) {
      InFlight oldest;
      {
        std::unique_lock lock(flight_mutex_);
        while (!in_flight_.empty() && cudaEventQuery(in_flight_.front().done.get()) != cudaErrorNotReady)
          in_flight_.pop_front();
        if (in_flight_.empty()) {
          if (stopping_ || health_->error()) return;
          flight_cv_.wait(lock, [&] { return stopping_ || !in_flight_.empty(); });
          continue;
        }
        oldest = in_flight_.front();
      }
      {
        std::unique_lock nccl_lock(nccl_mutex_, std::try_to_lock);
        if (nccl_lock.owns_lock() && !health_->error()) {
          std::string reason;
          ncclResult_t state = ncclSuccess;
          if (ncclCommGetAsyncError(comm_.comm, &state) == ncclSuccess && state != ncclSuccess && state != ncclInProgress)
            reason = fmt::format("{}: {}", oldest.what, nccl_failure(state));
          else if (Clock::now() > oldest.deadline)
            reason = fmt::format("{}: not complete after timeout_ms {}: a peer stalled or left", oldest.what,
                                 options_.timeout_ms);
          if (!reason.empty()) {
            try {
              fail(reason);
            } catch (const Error&) {  // recorded in health_
            }
          }
        }
      }
      std::unique_lock lock(flight_mutex_);
      if (health_->error()) {
        in_flight_.clear();  // aborted: their kernels have ended
        return;
      }
      flight_cv_.wait_for(lock, std::chrono::microseconds(200));
    }
  }

  const int rank_, size_;
  const NcclOptions options_;
  int device_ = 0;
  // Declared in the order they are made; destroyed in reverse: the header slots freed on the
  // compute stream, the NCCL communicators finalized, then the streams. The compute stream, when
  // owned here, is shared with the Works whose wait() orders it.
  std::shared_ptr<CUstream_st> owned_stream_;
  CudaStream compute_stream_ = nullptr;
  std::unique_ptr<Compute> compute_;
  UniqueStream nccl_stream_;
  UniqueStream check_stream_;
  std::shared_ptr<CUevent_st> ready_;
  CommHandle comm_;
  CommHandle check_comm_;  // the header group (with check_consistency, size > 1)
  MemoryTracker tracker_;  // the header slots (a few bytes per rank)
  ComputeBuffer headers_;  // [size, kHeaderFields] i64 on the device, the header stream's
  ComputeBuffer barrier_slot_;  // [1] i64 on the device, the NCCL stream's
  UniquePinned host_headers_;  // [1 + size, kHeaderFields] i64: this rank's header, then every rank's
  uint64_t seq_ = 0;       // under nccl_mutex_
  std::shared_ptr<Health> health_ = std::make_shared<Health>();
  std::mutex nccl_mutex_;  // one thread at a time calls NCCL on the communicators (enqueue, abort)
  std::mutex flight_mutex_;
  std::condition_variable flight_cv_;
  std::deque<InFlight> in_flight_;  // under flight_mutex_, oldest first
  bool stopping_ = false;           // under flight_mutex_
  std::thread watchdog_;            // started last
};

}  // namespace

int nccl_version() {
  int version = 0;
  nccl_check(ncclGetVersion(&version), "reading NCCL's version");
  return version;
}

NcclUniqueId nccl_unique_id() {
  ncclUniqueId id;
  nccl_check(ncclGetUniqueId(&id), "making an NCCL unique id");
  NcclUniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof id);
  return out;
}

NcclUniqueId nccl_unique_id_over_mpi() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  MXDDP_CHECK(initialized && !finalized, "nccl_unique_id_over_mpi needs a live MpiRuntime (MPI initialized: {}, "
              "finalized: {})", initialized != 0, finalized != 0);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  NcclUniqueId id;
  if (rank == 0) id = nccl_unique_id();
  const int rc = MPI_Bcast(id.bytes.data(), static_cast<int>(id.bytes.size()), MPI_CHAR, 0, MPI_COMM_WORLD);
  MXDDP_CHECK(rc == MPI_SUCCESS, "nccl_unique_id_over_mpi: MPI_Bcast of the id failed (rc {})", rc);
  return id;
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int rank, int size,
                                                     const NcclOptions& options) {
  MXDDP_CHECK(size >= 1, "make_nccl_communicator: size {} must be at least 1", size);
  MXDDP_CHECK(rank >= 0 && rank < size, "make_nccl_communicator: rank {} is not in 0..{} (size {})", rank, size - 1, size);
  MXDDP_CHECK(options.device >= -1, "make_nccl_communicator: NcclOptions::device {} must be a CUDA ordinal or -1 "
              "(the current device)", options.device);
  MXDDP_CHECK(options.timeout_ms > 0, "make_nccl_communicator: NcclOptions::timeout_ms {} must be positive",
              options.timeout_ms);
  return std::make_unique<Communicator>(
      std::unique_ptr<StreamOrderedBackend>(std::make_unique<NcclBackend>(id, rank, size, options)));
}

}  // namespace mxddp
