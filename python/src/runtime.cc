// The process's MPI runtime for the Python package (see runtime.h).
#include "runtime.h"

#include <mxddp/core.h>

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

}  // namespace

Runtime::Runtime(std::unique_ptr<MpiRuntime> mpi, int64_t timeout_ms, const CollectiveDelay& delay)
    : mpi_(std::move(mpi)), timeout_ms_(timeout_ms), delay_(delay) {
  comm_ = make_mpi_communicator({.timeout_ms = timeout_ms, .memory_tracker = &tracker_, .injected_delay = delay});
}

// The communicator first: it drains its collectives and stops its progress thread while MPI is up.
Runtime::~Runtime() { comm_.reset(); }

std::pair<int, int> Runtime::init_mpi(int64_t timeout_ms, const CollectiveDelay& delay) {
  MXDDP_CHECK(timeout_ms > 0, "timeout_ms must be > 0; got {}", timeout_ms);
  auto& runtime = the_runtime();
  if (runtime) {
    MXDDP_CHECK(runtime->timeout_ms_ == timeout_ms,
                "mxddp is already initialized with timeout_ms {}; got {} (one runtime per process)",
                runtime->timeout_ms_, timeout_ms);
    MXDDP_CHECK(runtime->delay_.min_us == delay.min_us && runtime->delay_.max_us == delay.max_us,
                "mxddp is already initialized with collective delay [{}, {}] us; got [{}, {}] (one runtime per process)",
                runtime->delay_.min_us, runtime->delay_.max_us, delay.min_us, delay.max_us);
    return {runtime->comm_->rank(), runtime->comm_->size()};
  }
  MXDDP_CHECK(!mpi_finalized(), "MPI was finalized in this process and cannot be initialized again");
  auto mpi = std::make_unique<MpiRuntime>(nullptr, nullptr);
  runtime = std::make_unique<Runtime>(std::move(mpi), timeout_ms, delay);
  return {runtime->comm_->rank(), runtime->comm_->size()};
}

void Runtime::remove_user() {
  if (--users_ == 0) comm_->set_memory_tracker(&tracker_);  // releases the staging; the next reduction re-allocates
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
  runtime.reset();  // the communicator, then MPI_Finalize (MpiRuntime's destructor)
  mpi_finalized() = true;
}

}  // namespace mxddp::python
