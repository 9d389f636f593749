// mxddp._C: the extension module. mxddp::Error surfaces in Python as mxddp._C.Error (a
// RuntimeError) carrying the library's message (without the C++ file and line, which say nothing
// to a Python user).
#include <nanobind/nanobind.h>

#include "bindings.h"

namespace nb = nanobind;

NB_MODULE(_C, m) {
  // torch tensors that view the buffers keep their DDP handle alive (DLPack owner); those still
  // referenced when the interpreter ends (a traceback, a module global) are freed by the OS, not
  // leaked in any way that matters, and nanobind's report of them would only be noise.
  nb::set_leak_warnings(false);
  m.doc() = "mxddp's C++ data-parallel runtime (DDP buffers, overlapped collectives, distributed optimizer)";
  static nb::exception<mxddp::Error> error_type(m, "Error", PyExc_RuntimeError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const mxddp::Error& e) {
      PyErr_SetString(error_type.ptr(), e.message().c_str());
    }
  });
  mxddp::python::bind_runtime(m);
  mxddp::python::bind_ddp(m);
  mxddp::python::bind_fsdp(m);
  mxddp::python::bind_optimizer(m);
  mxddp::python::bind_plan(m);
  mxddp::python::bind_checkpoint(m);
}
