// torch's caching allocator under mxddp's device buffers, and what this build knows of devices
// (see device.h).
#include "device.h"

#include <cstdint>

#include <nanobind/nanobind.h>

#include <mxddp/core.h>

#include "runtime.h"

#ifdef MXDDP_PYTHON_CUDA
#include <mxddp/cuda.h>
#include <mxddp/memory.h>
#endif

namespace nb = nanobind;

namespace mxddp::python {

bool built_with_cuda() {
#ifdef MXDDP_PYTHON_CUDA
  return true;
#else
  return false;
#endif
}

bool built_with_nccl() {
#ifdef MXDDP_PYTHON_NCCL
  return true;
#else
  return false;
#endif
}

#ifdef MXDDP_PYTHON_CUDA

namespace {

// Blocks of torch's caching allocator on the current device. torch keeps each block on the stream
// it was allocated on, and hands it out again on that stream only once it is freed there, which is
// the stream order DeviceAllocator promises. The functions are looked up on each call: a module
// object held in a static would be released after the interpreter is gone.
class TorchCachingAllocator final : public DeviceAllocator {
 public:
  void* allocate(size_t bytes, CudaStream stream) override {
    nb::gil_scoped_acquire gil;
    int device = 0;
    try {
      nb::module_ cuda = nb::module_::import_("torch.cuda");
      device = nb::cast<int>(cuda.attr("current_device")());
      const auto address = nb::cast<uintptr_t>(cuda.attr("caching_allocator_alloc")(
          bytes, device, reinterpret_cast<uintptr_t>(stream)));
      return reinterpret_cast<void*>(address);
    } catch (nb::python_error& e) {
      // torch.OutOfMemoryError: the device is full. The rest (no CUDA in torch, a bad device) is an Error.
      nb::object oom = nb::module_::import_("torch").attr("OutOfMemoryError");
      if (e.matches(oom)) throw OutOfMemory(bytes, "device memory (torch's caching allocator)");
      MXDDP_FAIL("torch.cuda.caching_allocator_alloc of {} bytes on cuda:{} failed: {}", bytes, device, e.what());
    }
  }

  void deallocate(void* data, size_t, CudaStream) noexcept override {
    // After the interpreter has ended, torch's allocator is gone with it: the block is the
    // process's until it exits (a buffer that outlived Python; the driver reclaims it).
    if (data == nullptr || !python_is_usable()) return;
    nb::gil_scoped_acquire gil;
    try {
      nb::module_::import_("torch.cuda").attr("caching_allocator_delete")(reinterpret_cast<uintptr_t>(data));
    } catch (nb::python_error& e) {
      e.discard_as_unraisable("mxddp: torch.cuda.caching_allocator_delete");
    }
  }

  std::string_view name() const override { return "torch"; }
};

}  // namespace

std::pair<int, std::string> cuda_devices() {
  std::string why;
  const int count = cuda_device_count(&why);
  return {count, why};
}

void use_torch_caching_allocator() {
  // Never destroyed: every block it handed out must be able to come back to it, whenever that is.
  static auto* allocator = new TorchCachingAllocator();
  set_device_allocator(allocator);
}

#else  // no CUDA layer

std::pair<int, std::string> cuda_devices() {
  return {0, "this build of mxddp._C has no CUDA layer (it was built where CMake found no CUDA compiler; "
             "scripts/setup.sh gives it the venv's nvcc)"};
}

void use_torch_caching_allocator() {
  MXDDP_FAIL("this build of mxddp._C has no CUDA layer: it cannot place buffers on a device");
}

#endif

}  // namespace mxddp::python
