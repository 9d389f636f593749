// mxddp._C's process-level entry points: the runtime's start (on MPI or on torch.distributed) and
// end, the communicators of the user's process groups, the memory tracker's figures, and the few
// collectives a script needs beside its model (agreeing on a port, averaging a loss) or the package
// needs to compare what the ranks wrap (all_gather_bytes). Every call that waits for a collective
// releases the GIL: a torch communicator's progress thread needs it to run the collective.
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <vector>

#include <mpi.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include "bindings.h"
#include "device.h"
#include "runtime.h"
#include "views.h"

namespace nb = nanobind;

namespace mxddp::python {
namespace {

ReduceOp parse_reduce_op(const std::string& name) {
  if (name == "sum") return ReduceOp::kSum;
  if (name == "avg") return ReduceOp::kAvg;
  if (name == "max") return ReduceOp::kMax;
  MXDDP_FAIL("reduce op '{}' is not supported; valid: sum, avg, max", name);
}

// A tensor of any dtype the collectives take (comm.h): what torch users reduce beside their
// params (float64 metrics, int64/int32 counts, bool flags). from_array (views.h) takes only the
// param dtypes, float32 and bfloat16.
TensorView collective_view(const HostArray& array, const std::string& what) {
  struct Known {
    nb::dlpack::dtype dl;
    DType dtype;
  };
  const Known known[] = {{nb::dtype<float>(), DType::kF32},
                         {{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1}, DType::kBF16},
                         {nb::dtype<double>(), DType::kF64},
                         {nb::dtype<int64_t>(), DType::kI64},
                         {nb::dtype<int32_t>(), DType::kI32},
                         {nb::dtype<uint8_t>(), DType::kU8},
                         {nb::dtype<bool>(), DType::kBool}};
  for (const Known& k : known) {
    if (array.dtype() != k.dl) continue;
    std::vector<int64_t> dims;
    for (size_t i = 0; i < array.ndim(); ++i) dims.push_back(static_cast<int64_t>(array.shape(i)));
    return TensorView{array.data(), k.dtype, to_shape(dims, what), Device::cpu()};
  }
  MXDDP_FAIL("{}: dtype (DLPack code {}, {} bits) is not taken; valid: float32, bfloat16, float64, int64, int32, "
             "uint8, bool", what, static_cast<int>(array.dtype().code), static_cast<int>(array.dtype().bits));
}

}  // namespace

void bind_runtime(nb::module_& m) {
  m.def(
      "init_mpi",
      [](int64_t timeout_ms, int64_t delay_min_us, int64_t delay_max_us) {
        // The parity tests' straggler: every gradient reduction and param gather starts late.
        const CollectiveDelay delay{.min_us = delay_min_us, .max_us = delay_max_us, .all_reduce = true,
                                    .reduce_scatter = true, .all_gather = true};
        return Runtime::init_mpi(timeout_ms, delay);
      },
      nb::arg("timeout_ms"), nb::arg("delay_min_us") = 0, nb::arg("delay_max_us") = 0,
      "Initializes MPI and the world communicator once per process; returns (rank, world_size). delay_*_us: each "
      "all-reduce, reduce-scatter and all-gather starts after a uniform random delay in [min, max] (0, 0: none).");
  m.def(
      "init_torch",
      [](nb::object runner, int rank, int size, int64_t timeout_ms, int64_t delay_min_us, int64_t delay_max_us) {
        const CollectiveDelay delay{.min_us = delay_min_us, .max_us = delay_max_us, .all_reduce = true,
                                    .reduce_scatter = true, .all_gather = true};
        return Runtime::init_torch(std::move(runner), rank, size, timeout_ms, delay);
      },
      nb::arg("runner").none(), nb::arg("rank"), nb::arg("size"), nb::arg("timeout_ms"), nb::arg("delay_min_us") = 0,
      nb::arg("delay_max_us") = 0,
      "The runtime on torch.distributed's default group: runner is a mxddp.torch.process_group.GroupRunner over it, "
      "rank and size this process's place in it; returns (rank, world_size). delay_*_us as for init_mpi. Once "
      "initialized, returns the same pair (runner is then not used: None will do).");
  m.def("backend", [] { return std::string(Runtime::get().backend()); },
        "What the world communicator runs on: 'mpi' or 'torch'.");
  nb::class_<CommHandle>(m, "Communicator",
                         "A handle on one of the runtime's communicators: the world's, or one over a torch "
                         "process group (add_torch_group). Valid until finalize().")
      .def_ro("id", &CommHandle::id)
      .def_prop_ro("rank", [](const CommHandle& h) { return h.comm().rank(); })
      .def_prop_ro("size", [](const CommHandle& h) { return h.comm().size(); })
      .def_prop_ro("backend", [](const CommHandle& h) { return std::string(h.comm().backend_name()); })
      .def_prop_ro("device", [](const CommHandle& h) { return to_string(h.comm().device()); },
                   "Where the buffers of the objects built on it live: 'cpu' or 'cuda:N'.");
  m.def(
      "add_torch_group",
      [](nb::object runner, int rank, int size) {
        return CommHandle{Runtime::get().add_torch_group(std::move(runner), rank, size)};
      },
      nb::arg("runner"), nb::arg("rank"), nb::arg("size"),
      "A communicator over a torch process group (runner: a GroupRunner over it; rank and size in it), owned by "
      "the runtime until finalize(); returns its handle for DistributedDataParallel(comm=...).");
  m.def(
      "add_device_group",
      [](const CommHandle* host, int device, uintptr_t stream, const std::string& engine, nb::object runner) {
        return CommHandle{Runtime::get().add_device_group(host ? host->id : Runtime::kWorld, device, stream, engine,
                                                          std::move(runner))};
      },
      nb::arg("host").none(), nb::arg("device"), nb::arg("stream"), nb::arg("engine"),
      nb::arg("runner").none() = nb::none(),
      "A communicator over host's ranks (None: the world) for buffers on CUDA device `device`, its work ordered on "
      "`stream` (torch.cuda.current_stream().cuda_stream; 0: the legacy default stream). engine 'nccl' (each rank "
      "on a GPU of its own) or 'staged' (the host engine through page-locked memory; under torch.distributed runner "
      "is a GroupRunner over a private gloo group of the same ranks). Collective over those ranks.");
  m.def("built_with_cuda", &built_with_cuda, "Whether this extension has the CUDA layer (mxddp_cuda).");
  m.def("built_with_nccl", &built_with_nccl, "Whether this extension has the NCCL communicator (mxddp_nccl).");
  m.def("cuda_devices", &cuda_devices,
        "(devices this process can use, why there are none): CUDA's own answer, not torch's.");
  m.def("use_torch_caching_allocator", &use_torch_caching_allocator,
        "From now on mxddp's device buffers come from torch's caching allocator (idempotent).");
  m.def("world_communicator", [] { Runtime::get(); return CommHandle{Runtime::kWorld}; });
  m.def(
      "collective_delay_us",
      [] {
        const CollectiveDelay& d = Runtime::get().collective_delay();
        return std::make_pair(d.min_us, d.max_us);
      },
      "(min, max): the delay the world communicator injects before each collective ((0, 0): none).");
  m.def("is_initialized", &Runtime::initialized);
  m.def("finalize", &Runtime::finalize,
        "Destroys the communicators (draining them) and finalizes MPI if it was started (every DDP closed first).");
  m.def("rank", [] { return Runtime::get().comm().rank(); });
  m.def("world_size", [] { return Runtime::get().comm().size(); });
  m.def(
      "memory_usage",
      [](std::optional<std::string> place) {
        const MemoryUsage usage = Runtime::get().tracker().usage();
        const MemoryAmounts* amounts = &usage;
        if (place) {
          if (*place == "host") {
            amounts = &usage.at(MemoryPlace::kHost);
          } else if (*place == "device") {
            amounts = &usage.at(MemoryPlace::kDevice);
          } else {
            throw nb::value_error(
                fmt::format("memory_usage: place '{}' is not one of None, 'host', 'device'", *place).c_str());
          }
        }
        nb::dict out;
        for (int c = 0; c < kNumMemoryCategories; ++c) {
          const auto name = memory_category_name(static_cast<MemoryCategory>(c));
          out[nb::str(name.data(), name.size())] =
              nb::make_tuple(amounts->live_bytes[static_cast<size_t>(c)], amounts->peak_bytes[static_cast<size_t>(c)]);
        }
        return out;
      },
      nb::arg("place").none() = nb::none(),
      "This process's tracked bytes per category: {name: (live_bytes, peak_bytes)}, on every place together "
      "(None), or only the host's or the device's.");
  m.def("reset_memory_peaks", [] { Runtime::get().tracker().reset_peaks(); });
  m.def(
      "release_free_heap_pages",
      [] {
        nb::gil_scoped_release release;
        return release_free_heap_pages();
      },
      "Hands the pages of the heap's free blocks back to the system (glibc's malloc_trim(0)); whether any was.");
  m.def(
      "all_reduce",
      [](HostArray array, const std::string& op, const CommHandle* comm) {
        const TensorView view = collective_view(array, "all_reduce's tensor");
        const ReduceOp reduce_op = parse_reduce_op(op);
        Communicator& c = comm ? comm->comm() : Runtime::get().comm();
        nb::gil_scoped_release release;
        c.all_reduce(view, {.op = reduce_op}).wait();
      },
      nb::arg("tensor"), nb::arg("op") = "sum", nb::arg("comm").none() = nb::none(),
      "In place, across every rank of comm (None: the world): a contiguous CPU float32, bfloat16, float64, int64, "
      "int32, uint8 or bool tensor; avg for floats only; bool's sum and max are a logical or.");
  m.def(
      "broadcast",
      [](HostArray array, int root, const CommHandle* comm) {
        const TensorView view = collective_view(array, "broadcast's tensor");
        Communicator& c = comm ? comm->comm() : Runtime::get().comm();
        nb::gil_scoped_release release;
        c.broadcast(view, {.root = root}).wait();
      },
      nb::arg("tensor"), nb::arg("root") = 0, nb::arg("comm").none() = nb::none(),
      "In place, from root (a rank of comm; None: the world) to every rank: a contiguous CPU tensor of any "
      "dtype all_reduce takes.");
  m.def(
      "abort",
      [](int code) {
        if (Runtime::get().uses_mpi()) MPI_Abort(MPI_COMM_WORLD, code);
        // torch.distributed has no job-wide abort: this process ends now, without draining its
        // communicators (their peers may never come), and the launcher (torchrun) ends the others
        // when it sees a worker fail; the peers' collectives with this rank fail at once meanwhile.
        std::fflush(nullptr);
        std::_Exit(code);
      },
      nb::arg("code"),
      "Ends the job after a failure on this rank: under MPI every rank at once (MPI_Abort); under "
      "torch.distributed this process at once, and the launcher ends the others.");
  m.def(
      "all_gather_bytes",
      [](nb::bytes data, const CommHandle* handle) {
        Communicator& comm = handle ? handle->comm() : Runtime::get().comm();
        const auto size = static_cast<int64_t>(data.size());
        MXDDP_CHECK(size > 0, "all_gather_bytes: give at least one byte");
        std::string mine(data.c_str(), data.size());
        std::string all(static_cast<size_t>(size) * static_cast<size_t>(comm.size()), '\0');  // [ranks][size]
        {
          nb::gil_scoped_release release;
          comm.all_gather(TensorView{mine.data(), DType::kU8, Shape{size}, Device::cpu()},
                          TensorView{all.data(), DType::kU8, Shape{static_cast<int64_t>(all.size())}, Device::cpu()})
              .wait();
        }
        nb::list out;
        for (size_t r = 0; r < static_cast<size_t>(comm.size()); ++r)
          out.append(nb::bytes(all.data() + r * static_cast<size_t>(size), static_cast<size_t>(size)));
        return out;
      },
      nb::arg("data"), nb::arg("comm").none() = nb::none(),
      "Collective over comm (None: the world): every rank's bytes, in rank order. Every rank must pass the same number of bytes (a digest, "
      "a length, a padded text).");
  m.def(
      "barrier",
      [](const CommHandle* comm) {
        Communicator& c = comm ? comm->comm() : Runtime::get().comm();
        nb::gil_scoped_release release;
        c.barrier().wait();
      },
      nb::arg("comm").none() = nb::none(), "Every rank of comm (None: the world) arrives before any leaves.");
}

}  // namespace mxddp::python
