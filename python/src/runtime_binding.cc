// mxddp._C's process-level entry points: MPI start and end, the memory tracker's figures, and the
// few collectives a script needs beside its model (agreeing on a port, averaging a loss) or the
// package needs to compare what the ranks wrap (all_gather_bytes).
#include <mpi.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include "bindings.h"
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
      "collective_delay_us",
      [] {
        const CollectiveDelay& d = Runtime::get().collective_delay();
        return std::make_pair(d.min_us, d.max_us);
      },
      "(min, max): the delay the world communicator injects before each collective ((0, 0): none).");
  m.def("is_initialized", &Runtime::initialized);
  m.def("finalize", &Runtime::finalize, "Destroys the communicator and finalizes MPI (every DDP closed first).");
  m.def("rank", [] { return Runtime::get().comm().rank(); });
  m.def("world_size", [] { return Runtime::get().comm().size(); });
  m.def(
      "memory_usage",
      [] {
        const MemoryUsage usage = Runtime::get().tracker().usage();
        nb::dict out;
        for (int c = 0; c < kNumMemoryCategories; ++c) {
          const auto name = memory_category_name(static_cast<MemoryCategory>(c));
          out[nb::str(name.data(), name.size())] =
              nb::make_tuple(usage.live_bytes[static_cast<size_t>(c)], usage.peak_bytes[static_cast<size_t>(c)]);
        }
        return out;
      },
      "This process's tracked bytes per category: {name: (live_bytes, peak_bytes)}.");
  m.def("reset_memory_peaks", [] { Runtime::get().tracker().reset_peaks(); });
  m.def(
      "all_reduce",
      [](HostArray array, const std::string& op) {
        const TensorView view = from_array(array, "all_reduce's tensor");
        const ReduceOp reduce_op = parse_reduce_op(op);
        nb::gil_scoped_release release;
        Runtime::get().comm().all_reduce(view, {.op = reduce_op}).wait();
      },
      nb::arg("tensor"), nb::arg("op") = "sum", "In place, across every rank (f32 or bf16, contiguous, CPU).");
  m.def(
      "broadcast",
      [](HostArray array, int root) {
        const TensorView view = from_array(array, "broadcast's tensor");
        nb::gil_scoped_release release;
        Runtime::get().comm().broadcast(view, {.root = root}).wait();
      },
      nb::arg("tensor"), nb::arg("root") = 0, "In place, from root to every rank (f32 or bf16, contiguous, CPU).");
  m.def(
      "abort",
      [](int code) {
        Runtime::get();  // only while MPI is up
        MPI_Abort(MPI_COMM_WORLD, code);
      },
      nb::arg("code"), "Ends every rank of the job at once (MPI_Abort): a rank that cannot go on.");
  m.def(
      "all_gather_bytes",
      [](nb::bytes data) {
        Communicator& comm = Runtime::get().comm();
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
      nb::arg("data"),
      "Collective: every rank's bytes, in rank order. Every rank must pass the same number of bytes (a digest, "
      "a length, a padded text).");
  m.def("barrier", [] {
    nb::gil_scoped_release release;
    Runtime::get().comm().barrier().wait();
  });
}

}  // namespace mxddp::python
