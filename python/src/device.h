// The Python package's side of a module on a GPU: what this extension was built with, the devices
// this process sees, and torch's caching allocator behind cuda.h's DeviceAllocator, so that mxddp's
// device buffers and the model's activations come out of one pool and never hold memory from each
// other. The communicators for device buffers are the runtime's (Runtime::add_device_group).
//
// Without the CUDA layer (MXDDP_PYTHON_CUDA unset: no CUDA compiler where it was built) the
// extension still builds and these answer "not built with CUDA".
#pragma once

#include <string>
#include <utility>

namespace mxddp::python {

bool built_with_cuda();  // linked with mxddp_cuda
bool built_with_nccl();  // linked with mxddp_nccl

// (devices this process can use, why none) as cuda.h's cuda_device_count; (0, "this build of
// mxddp._C has no CUDA layer ...") without the CUDA layer.
std::pair<int, std::string> cuda_devices();

// From now on every device buffer mxddp allocates comes from torch's caching allocator
// (torch.cuda.caching_allocator_alloc / caching_allocator_delete) on the buffer's stream. Called
// again: nothing more. Throws an Error without the CUDA layer. Needs the GIL; the allocator takes
// it for each allocation and free, from whatever thread makes them.
void use_torch_caching_allocator();

}  // namespace mxddp::python
