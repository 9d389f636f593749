// The process's runtime for the Python package (see runtime.h).
#include "runtime.h"

#include <mxddp/core.h>

#ifdef MXDDP_PYTHON_CUDA
#include <mxddp/cuda.h>
#endif
#ifdef MXDDP_PYTHON_NCCL
#include <mxddp/nccl.h>
#endif

#include "../../src/comm/delayed_backend.h"
#include "device.h"
#include "torch_backend.h"

namespace nb = nanobind;

namespace mxddp::python {
namespace {

std::unique_ptr<Runtime>& the_runtime() {
  static std::unique_ptr<Runtime> runtime;
  return runtime;
}
bool& mpi_finalized() {
  static bool finalized = false;
  return finalized;
}

// Runs fn without the GIL if this thread holds it: fn waits for a communicator's queue, whose
// torch collectives take the GIL on the progress thread.
template <typename Fn>
void without_gil(Fn&& fn) {
  if (PyGILState_Check()) {
    nb::gil_scoped_release release;
    fn();
  } else {
    fn();
  }
}

void check_same_settings(const Runtime& runtime, int64_t timeout_ms, const CollectiveDelay& delay) {
  MXDDP_CHECK(runtime.timeout_ms() == timeout_ms,
              "mxddp is already initialized with timeout_ms {}; got {} (one runtime per process)",
              runtime.timeout_ms(), timeout_ms);
  const CollectiveDelay& d = runtime.collective_delay();
  MXDDP_CHECK(d.min_us == delay.min_us && d.max_us == delay.max_us,
              "mxddp is already initialized with collective delay [{}, {}] us; got [{}, {}] (one runtime per process)",
              d.min_us, d.max_us, delay.min_us, delay.max_us);
}

}  // namespace

bool python_is_usable() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

Runtime::Runtime(std::unique_ptr<MpiRuntime> mpi, int64_t timeout_ms, const CollectiveDelay& delay)
    : mpi_(std::move(mpi)), timeout_ms_(timeout_ms), delay_(delay) {
  if (mpi_)
    comm_ = make_mpi_communicator({.timeout_ms = timeout_ms, .memory_tracker = &tracker_, .injected_delay = delay});
}

// The communicators first: each drains its collectives and stops its progress thread while MPI
// (or Python, for the torch ones) is up.
Runtime::~Runtime() {
  groups_.clear();
  comm_.reset();
}

std::pair<int, int> Runtime::init_mpi(int64_t timeout_ms, const CollectiveDelay& delay) {
  MXDDP_CHECK(timeout_ms > 0, "timeout_ms must be > 0; got {}", timeout_ms);
  auto& runtime = the_runtime();
  if (runtime) {
    MXDDP_CHECK(runtime->uses_mpi(),
                "mxddp is already initialized on torch.distributed's default process group; it cannot switch to MPI "
                "in the same process");
    check_same_settings(*runtime, timeout_ms, delay);
    return {runtime->comm_->rank(), runtime->comm_->size()};
  }
  MXDDP_CHECK(!mpi_finalized(), "MPI was finalized in this process and cannot be initialized again");
  auto mpi = std::make_unique<MpiRuntime>(nullptr, nullptr);
  runtime = std::make_unique<Runtime>(std::move(mpi), timeout_ms, delay);
  return {runtime->comm_->rank(), runtime->comm_->size()};
}

std::pair<int, int> Runtime::init_torch(nb::object runner, int rank, int size, int64_t timeout_ms,
                                        const CollectiveDelay& delay) {
  MXDDP_CHECK(timeout_ms > 0, "timeout_ms must be > 0; got {}", timeout_ms);
  auto& runtime = the_runtime();
  if (runtime) {
    MXDDP_CHECK(!runtime->uses_mpi(),
                "mxddp is already initialized on MPI (mxddp.torch.init() ran before torch.distributed was "
                "initialized); it cannot switch to torch.distributed in the same process: call "
                "torch.distributed.init_process_group before mxddp.torch.init()");
    check_same_settings(*runtime, timeout_ms, delay);
    return {runtime->comm_->rank(), runtime->comm_->size()};
  }
  validate_collective_delay(delay);
  auto fresh = std::make_unique<Runtime>(nullptr, timeout_ms, delay);
  fresh->comm_ = make_torch_communicator(std::move(runner), rank, size, &fresh->tracker_, delay);
  runtime = std::move(fresh);
  return {runtime->comm_->rank(), runtime->comm_->size()};
}

Communicator& Runtime::comm(int id) {
  if (id == kWorld) return *comm_;
  const auto it = groups_.find(id);
  MXDDP_CHECK(it != groups_.end(), "no process-group communicator with id {} in this runtime ({} exist)", id,
              groups_.size());
  return *it->second;
}

int Runtime::add_torch_group(nb::object runner, int rank, int size) {
  const int id = static_cast<int>(groups_.size());
  groups_.emplace(id, make_torch_communicator(std::move(runner), rank, size, &tracker_, delay_));
  return id;
}

int Runtime::add_device_group(int host_id, int device, uintptr_t stream, const std::string& engine,
                              nb::object runner) {
  MXDDP_CHECK(engine == "nccl" || engine == "staged", "device engine '{}' is not one of: nccl, staged", engine);
  MXDDP_CHECK(built_with_cuda(), "{}", cuda_devices().second);
  const auto [count, why] = cuda_devices();
  MXDDP_CHECK(device >= 0 && device < count, "CUDA device {} is not usable here: {}", device,
              count == 0 ? why : fmt::format("this process sees devices 0 to {}", count - 1));
  Communicator& host = comm(host_id);
#ifdef MXDDP_PYTHON_CUDA
  const int id = static_cast<int>(groups_.size());
  const auto cuda_stream = reinterpret_cast<CudaStream>(stream);
  if (engine == "nccl") {
#ifdef MXDDP_PYTHON_NCCL
    NcclUniqueId unique_id;
    std::unique_ptr<Communicator> nccl;
    without_gil([&] {
      if (host.rank() == 0) unique_id = nccl_unique_id();
      host.broadcast(TensorView{unique_id.bytes.data(), DType::kU8,
                                Shape{static_cast<int64_t>(unique_id.bytes.size())}, Device::cpu()},
                     {.root = 0})
          .wait();
      nccl = make_nccl_communicator(unique_id, host.rank(), host.size(),
                                    {.device = device, .stream = cuda_stream, .timeout_ms = timeout_ms_});
    });
    groups_.emplace(id, std::move(nccl));
    return id;
#else
    MXDDP_FAIL("device engine 'nccl' needs an mxddp._C built with NCCL (it was built where CMake found no "
               "nccl.h and libnccl); valid here: staged");
#endif
  }
  cuda_set_device(device);
  std::unique_ptr<Compute> compute = make_cuda_compute(cuda_stream);
  std::unique_ptr<Communicator> staged;
  if (uses_mpi()) {
    MXDDP_CHECK(host_id == kWorld, "under MPI only the world has a communicator; got communicator {}", host_id);
    without_gil([&] {
      staged = make_mpi_communicator(
          {.timeout_ms = timeout_ms_, .memory_tracker = &tracker_, .injected_delay = delay_, .compute = compute.get()});
    });
  } else {
    MXDDP_CHECK(!runner.is_none(), "a staged device communicator under torch.distributed needs a GroupRunner of its own");
    staged = make_torch_communicator(std::move(runner), host.rank(), host.size(), &tracker_, delay_, compute.get());
  }
  device_computes_.emplace(id, std::move(compute));
  groups_.emplace(id, std::move(staged));
  return id;
#else
  (void)host;
  (void)stream;
  (void)runner;
  MXDDP_FAIL("unreachable: checked above that the CUDA layer is built");
#endif
}

void Runtime::remove_user() {
  if (--users_ > 0) return;
  // Releases the staging; the next reduction re-allocates it.
  without_gil([&] {
    comm_->set_memory_tracker(&tracker_);
    for (auto& [id, group] : groups_) group->set_memory_tracker(&tracker_);
  });
}

bool Runtime::initialized() { return the_runtime() != nullptr; }

Runtime& Runtime::get() {
  auto& runtime = the_runtime();
  MXDDP_CHECK(runtime != nullptr, "mxddp is not initialized: call mxddp.torch.init() first");
  return *runtime;
}

void Runtime::finalize() {
  auto& runtime = the_runtime();
  if (!runtime) return;
  MXDDP_CHECK(runtime->users_ == 0,
              "cannot finalize mxddp: {} DistributedDataParallel / DistributedOptimizer objects are still open "
              "(close them first)",
              runtime->users_);
  const bool mpi = runtime->uses_mpi();
  without_gil([&] { runtime.reset(); });  // the communicators, then MPI_Finalize (MpiRuntime's destructor)
  if (mpi) mpi_finalized() = true;
}

}  // namespace mxddp::python
