// The NCCL engine (include/mxddp/nccl.h): one process per rank, each on its own GPU.
//
// A collective, on the communicator's progress thread:
//   1. the rank's device is made current (a CUDA device is per thread);
//   2. an event recorded on the compute stream makes the communication stream wait for the work
//      enqueued before the collective was taken up;
//   3. with check_consistency, every rank's call header is all-gathered and compared (the mpi
//      backend's rule: a mismatch is an Error on every rank, before any buffer is touched);
//   4. the NCCL call is enqueued on the communication stream;
//   5. the progress thread polls the stream until it is done, and NCCL for an asynchronous error,
//      under the watchdog: past timeout_ms the communicator is aborted and the call fails.
// The communicator is nonblocking (NCCL's config.blocking = 0), so that joining the group and
// every call can be given up on: a call that answers ncclInProgress is polled the same way.
#include <chrono>
#include <cstring>
#include <optional>
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
#include "delayed_backend.h"

static_assert(sizeof(ncclUniqueId) == sizeof(mxddp::NcclUniqueId::bytes), "NCCL_UNIQUE_ID_BYTES changed");

// MXDDP_NCCL_CHECK(call, what...): throws an Error with NCCL's name for the result, its last error
// message, and the caller's context.
#define MXDDP_NCCL_CHECK(call, ...)                                                                   \
  do {                                                                                                \
    const ncclResult_t mxddp_nccl_rc_ = (call);                                                       \
    if (mxddp_nccl_rc_ != ncclSuccess && mxddp_nccl_rc_ != ncclInProgress) [[unlikely]]               \
      MXDDP_FAIL("{}: NCCL error {} ({}){}", ::fmt::format(__VA_ARGS__), ncclGetErrorString(mxddp_nccl_rc_), \
                 static_cast<int>(mxddp_nccl_rc_), ::mxddp::nccl_last_error());                          \
  } while (0)

namespace mxddp {

namespace {

std::string nccl_last_error() {
  const char* text = ncclGetLastError(nullptr);
  return text && *text ? fmt::format(": {}", text) : std::string();
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

// The owning handles a backend holds, released in the right order even when its constructor
// throws half way (streams and events are CUDA's, the communicator NCCL's).
struct StreamDeleter {
  void operator()(CUstream_st* stream) const noexcept {
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  }
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

// An NCCL communicator: finalized (its calls completed, within timeout_ms) then destroyed; aborted
// instead when that fails or when it was given up on.
struct CommHandle {
  ncclComm_t comm = nullptr;
  int64_t timeout_ms = 0;
  CommHandle() = default;
  CommHandle(const CommHandle&) = delete;
  CommHandle& operator=(const CommHandle&) = delete;
  ~CommHandle() {
    if (comm == nullptr) return;
    ncclResult_t state = ncclCommFinalize(comm);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (state == ncclSuccess || state == ncclInProgress) {
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
      if (state != ncclInProgress || std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (state == ncclSuccess) ncclCommDestroy(comm);
    else ncclCommAbort(comm);
  }
  void abort() noexcept {
    if (comm != nullptr) ncclCommAbort(comm);
    comm = nullptr;
  }
};

class NcclBackend final : public CommBackend {
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
      MXDDP_CUDA_CHECK(cudaSetDevice(device_), "selecting device {}", device_);
    } else {
      MXDDP_CUDA_CHECK(cudaGetDevice(&device_), "reading the current device");
    }
    if (options.stream == nullptr) owned_stream_.emplace();
    compute_stream_ = options.stream ? options.stream : owned_stream_->get();
    compute_ = make_cuda_compute(compute_stream_);
    cudaStream_t stream = nullptr;
    MXDDP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "creating the NCCL stream");
    comm_stream_.reset(stream);
    cudaEvent_t event = nullptr;
    MXDDP_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "creating the NCCL ordering event");
    ready_.reset(event);

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclUniqueId nccl_id;
    std::memcpy(&nccl_id, id.bytes.data(), sizeof nccl_id);
    comm_.timeout_ms = options.timeout_ms;
    // The call headers' exchange: size slots of kHeaderFields i64 each on the device, and pinned on
    // the host (this rank's header, then every rank's), so that both copies are truly asynchronous
    // and the watchdog's wait covers them.
    const size_t header_bytes = static_cast<size_t>(size) * kHeaderFields * sizeof(int64_t);
    headers_ = compute_->allocate(header_bytes, MemoryCategory::kComm, tracker_);
    void* pinned = nullptr;
    MXDDP_CUDA_CHECK(cudaMallocHost(&pinned, header_bytes + kHeaderFields * sizeof(int64_t)),
                     "pinning {} bytes for the call headers", header_bytes + kHeaderFields * sizeof(int64_t));
    host_headers_.reset(static_cast<int64_t*>(pinned));

    const std::string joining = fmt::format("rank {} of {} joining the NCCL group on cuda:{}", rank, size, device_);
    start_deadline();
    check(ncclCommInitRankConfig(&comm_.comm, size, nccl_id, rank, &config), joining);
    settle(joining);
  }

  ~NcclBackend() override {  // before the members go: their CUDA and NCCL calls need the device
    cudaSetDevice(device_);
    // Every collective ended (done, or aborted and drained), so this returns; the header slots are
    // then freed on the compute stream with nothing on the NCCL stream still using them.
    if (comm_stream_) cudaStreamSynchronize(comm_stream_.get());
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "nccl"; }
  Compute& compute() const override { return *compute_; }

  void run(const CollectiveCall& call) override {
    MXDDP_CHECK(broken_.empty(), "{}: the NCCL communicator was aborted earlier: {}", collective_name(call.kind), broken_);
    const uint64_t seq = seq_++;
    const std::string what = fmt::format("{} #{} ({} x {}) on rank {} of {}, cuda:{}", collective_name(call.kind), seq,
                                         call.count, dtype_name(call.dtype), rank_, size_, device_);
    start_deadline();
    MXDDP_CUDA_CHECK(cudaSetDevice(device_), "{}: selecting the device", what);
    MXDDP_CUDA_CHECK(cudaEventRecord(ready_.get(), compute_stream_), "{}: recording the compute stream's event", what);
    MXDDP_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_.get(), ready_.get(), 0), "{}: ordering after the compute stream", what);
    if (options_.check_consistency && size_ > 1) check_consistency(call, seq, what);
    enqueue(call, what);
    wait_for_stream(what);
  }

 private:
  static constexpr int kHeaderFields = 8;  // kCallHeaderFields, padded

  // Every rank's header for call, gathered and compared with rank 0's.
  void check_consistency(const CollectiveCall& call, uint64_t seq, const std::string& what) {
    const auto header = pack_call_header(seq, call);
    int64_t* mine = host_headers_.get();                 // [kHeaderFields], pinned
    int64_t* all = host_headers_.get() + kHeaderFields;  // [size, kHeaderFields], pinned
    std::fill(mine, mine + kHeaderFields, 0);
    std::copy(header.begin(), header.end(), mine);
    auto* slots = static_cast<int64_t*>(headers_.data());
    int64_t* own = slots + static_cast<ptrdiff_t>(rank_) * kHeaderFields;
    const size_t all_bytes = static_cast<size_t>(size_) * kHeaderFields * sizeof(int64_t);
    MXDDP_CUDA_CHECK(cudaMemcpyAsync(own, mine, kHeaderFields * sizeof(int64_t), cudaMemcpyHostToDevice, comm_stream_.get()),
                     "{}: staging the call header", what);
    check(ncclAllGather(own, slots, kHeaderFields, ncclInt64, comm_.comm, comm_stream_.get()), what + ", exchanging call headers");
    settle(what);
    MXDDP_CUDA_CHECK(cudaMemcpyAsync(all, slots, all_bytes, cudaMemcpyDeviceToHost, comm_stream_.get()),
                     "{}: reading the call headers", what);
    wait_for_stream(what + ", exchanging call headers");
    check_call_headers(all, size_, kHeaderFields, seq, call.kind);
  }

  void enqueue(const CollectiveCall& call, const std::string& what) {
    const ncclDataType_t type = nccl_type(call.dtype);
    const auto count = static_cast<size_t>(call.count);
    switch (call.kind) {
      case CollectiveKind::kAllReduce:
      case CollectiveKind::kReduceScatter: {
        PreparedOp op = prepare_op(call, type, what);
        const ncclResult_t rc = call.kind == CollectiveKind::kAllReduce
                                    ? ncclAllReduce(call.send, call.recv, count, type, op.op, comm_.comm, comm_stream_.get())
                                    : ncclReduceScatter(call.send, call.recv, count, type, op.op, comm_.comm, comm_stream_.get());
        if (rc == ncclSuccess || rc == ncclInProgress) settle(what);  // NCCL has taken the op up
        op.release(comm_.comm);
        check(rc, what);
        return;
      }
      case CollectiveKind::kAllGather:
        check(ncclAllGather(call.send, call.recv, count, type, comm_.comm, comm_stream_.get()), what);
        break;
      case CollectiveKind::kBroadcast:
        check(ncclBroadcast(call.send, call.recv, count, type, call.root, comm_.comm, comm_stream_.get()), what);
        break;
      case CollectiveKind::kBarrier: {
        // A one-element all-reduce of the header slot: every rank must reach it.
        void* slot = headers_.data();
        check(ncclAllReduce(slot, slot, 1, ncclInt64, ncclMax, comm_.comm, comm_stream_.get()), what);
        break;
      }
    }
    settle(what);
  }

  // The NCCL reduction of a call: sum, avg, max; a prescale is a PreMulSum (of prescale / size for
  // avg), created for this call and released once NCCL has taken the call up, as NCCL allows.
  struct PreparedOp {
    ncclRedOp_t op = ncclSum;
    bool created = false;
    void release(ncclComm_t comm) {
      if (created) ncclRedOpDestroy(op, comm);
    }
  };
  PreparedOp prepare_op(const CollectiveCall& call, ncclDataType_t type, const std::string& what) {
    if (call.dtype == DType::kBool) return {ncclMax, false};
    if (call.prescale == 1.0f) {
      switch (call.op) {
        case ReduceOp::kSum: return {ncclSum, false};
        case ReduceOp::kAvg: return {ncclAvg, false};
        case ReduceOp::kMax: return {ncclMax, false};
      }
    }
    // Communicator allows a prescale on floats' sum and avg only.
    const double factor = call.op == ReduceOp::kAvg ? static_cast<double>(call.prescale) / size_ : call.prescale;
    PreparedOp prepared{ncclSum, true};
    float f32 = static_cast<float>(factor);
    bf16_bits bf16 = f32_to_bf16(f32);
    double f64 = factor;
    void* scalar = call.dtype == DType::kBF16 ? static_cast<void*>(&bf16)
                   : call.dtype == DType::kF64 ? static_cast<void*>(&f64)
                                               : static_cast<void*>(&f32);
    check(ncclRedOpCreatePreMulSum(&prepared.op, scalar, type, ncclScalarHostImmediate, comm_.comm),
          fmt::format("{}: the prescale {} (PreMulSum)", what, call.prescale));
    return prepared;
  }

  // Until NCCL has finished taking up the last call (a nonblocking communicator's ncclInProgress).
  void settle(const std::string& what) {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      check(ncclCommGetAsyncError(comm_.comm, &state), what + ": reading NCCL's state");
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) fail(what, fmt::format("NCCL error {}{}", ncclGetErrorString(state), nccl_last_error()));
      if (std::chrono::steady_clock::now() > deadline_)
        fail(what, fmt::format("NCCL did not take the call up within timeout_ms {}", options_.timeout_ms));
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // Until the communication stream is done, watching NCCL for an asynchronous error.
  void wait_for_stream(const std::string& what) {
    for (int64_t polls = 0;; ++polls) {
      const cudaError_t done = cudaStreamQuery(comm_stream_.get());
      if (done == cudaSuccess) return;
      if (done != cudaErrorNotReady)
        fail(what, fmt::format("on the NCCL stream: {} ({})", cudaGetErrorString(done), cudaGetErrorName(done)));
      ncclResult_t state = ncclSuccess;
      check(ncclCommGetAsyncError(comm_.comm, &state), what + ": reading NCCL's state");
      if (state != ncclSuccess && state != ncclInProgress)
        fail(what, fmt::format("NCCL error {}{}", ncclGetErrorString(state), nccl_last_error()));
      if (std::chrono::steady_clock::now() > deadline_)
        fail(what, fmt::format("not complete after timeout_ms {}: a peer stalled or left", options_.timeout_ms));
      // Spin briefly (a collective of a few KiB takes microseconds), then leave the core to others.
      if (polls < 1000) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // The watchdog's one deadline for everything a call (or joining) waits on.
  void start_deadline() {
    deadline_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.timeout_ms);
  }

  // An NCCL call's result: taken up (ncclInProgress is settled later), a misuse of the API (a bug
  // here, which leaves the communicator as it was), or a failure, which aborts it.
  void check(ncclResult_t rc, const std::string& what) {
    if (rc == ncclSuccess || rc == ncclInProgress) return;
    if (rc == ncclInvalidArgument || rc == ncclInvalidUsage)
      MXDDP_FAIL("{}: NCCL refused the call: {}{}", what, ncclGetErrorString(rc), nccl_last_error());
    fail(what, fmt::format("NCCL error {}{}", ncclGetErrorString(rc), nccl_last_error()));
  }

  // Aborts the NCCL communicator and drains its stream (its kernels see the abort and end), so no
  // buffer of the failed call is still being written once it fails; every later call fails at once.
  [[noreturn]] void fail(const std::string& what, const std::string& why) {
    broken_ = fmt::format("{}: {}", what, why);
    comm_.abort();
    if (comm_stream_) cudaStreamSynchronize(comm_stream_.get());
    MXDDP_FAIL("{}; the NCCL communicator is aborted", broken_);
  }

  const int rank_, size_;
  const NcclOptions options_;
  int device_ = 0;
  // Declared in the order they are made; destroyed in reverse: the header slots freed on the compute
  // stream, the NCCL communicator finalized, then the streams.
  std::optional<OwnedCudaStream> owned_stream_;
  CudaStream compute_stream_ = nullptr;
  std::unique_ptr<Compute> compute_;
  UniqueStream comm_stream_;
  UniqueEvent ready_;
  CommHandle comm_;
  MemoryTracker tracker_;  // the header slots (a few bytes per rank)
  ComputeBuffer headers_;       // [size, kHeaderFields] i64 on the device
  UniquePinned host_headers_;   // [1 + size, kHeaderFields] i64: this rank's header, then every rank's
  std::chrono::steady_clock::time_point deadline_;
  uint64_t seq_ = 0;
  std::string broken_;  // why the communicator was aborted; empty while it works
};

}  // namespace

int nccl_version() {
  int version = 0;
  MXDDP_NCCL_CHECK(ncclGetVersion(&version), "reading NCCL's version");
  return version;
}

NcclUniqueId nccl_unique_id() {
  ncclUniqueId id;
  MXDDP_NCCL_CHECK(ncclGetUniqueId(&id), "making an NCCL unique id");
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
  // Before joining: a bad delay found after the join would leave the peers waiting in it.
  validate_collective_delay(options.injected_delay);
  return std::make_unique<Communicator>(
      with_injected_delay(std::make_unique<NcclBackend>(id, rank, size, options), options.injected_delay));
}

}  // namespace mxddp
