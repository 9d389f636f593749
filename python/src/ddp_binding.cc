// mxddp._C.DistributedDataParallel: the C++ DDP over one of the runtime's communicators (the world's
// or a torch process group's), with its param and grad buffers handed to torch as views (DLPack, no
// copies). The GIL is released while the library works (grad_ready may issue a collective;
// finish_grad_sync waits for them), so the communicator's progress thread and the Python backward
// run at the same time; a torch communicator's progress thread needs the GIL to run at all.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <mxddp/quant.h>

#ifdef MXDDP_PYTHON_CUDA
#include <mxddp/cuda.h>
#endif

#include "bindings.h"
#include "runtime.h"
#include "views.h"

namespace nb = nanobind;

namespace mxddp::python {

PyDataParallel::PyDataParallel(std::unique_ptr<DataParallel> dp) : dp_(std::move(dp)) { Runtime::get().add_user(); }

PyDataParallel::~PyDataParallel() {
  if (dp_) close();
}

DataParallel& PyDataParallel::data_parallel() {
  MXDDP_CHECK(dp_ != nullptr, "this model was closed (close() freed its buffers)");
  return *dp_;
}

void PyDataParallel::close() {
  if (!dp_) return;
  MXDDP_CHECK(optimizers_ == 0, "close the DistributedOptimizer ({} open) before its model", optimizers_);
  {
    nb::gil_scoped_release release;
    no_sync_scopes_.clear();
    dp_.reset();  // waits for collectives still in flight
  }
  Runtime::get().remove_user();  // releases the GIL itself where it waits
}

// Both without the GIL: entering or leaving no_sync may wait for a collective (FSDP), and a torch
// communicator's progress thread needs the GIL to finish it.
void PyDataParallel::enter_no_sync() {
  DataParallel& dp = data_parallel();
  std::unique_ptr<DataParallel::NoSyncScope> scope;
  {
    nb::gil_scoped_release release;
    scope = std::make_unique<DataParallel::NoSyncScope>(dp);
  }
  no_sync_scopes_.push_back(std::move(scope));
}

void PyDataParallel::exit_no_sync() {
  MXDDP_CHECK(!no_sync_scopes_.empty(), "no_sync exit without a matching enter");
  std::unique_ptr<DataParallel::NoSyncScope> scope = std::move(no_sync_scopes_.back());
  no_sync_scopes_.pop_back();
  nb::gil_scoped_release release;
  scope.reset();
}

namespace {

std::unique_ptr<DataParallel> make_ddp(const std::vector<ParamSpec>& params, const DdpConfig& config,
                                       const std::vector<TensorView>& initial_values, const CommHandle& handle) {
  Runtime& runtime = Runtime::get();
  Communicator& comm = handle.comm();
  nb::gil_scoped_release release;
  return std::make_unique<DistributedDataParallel>(comm, params, config, runtime.tracker(), initial_values);
}

}  // namespace

PyDdp::PyDdp(const std::vector<ParamSpec>& params, const DdpConfig& config, const std::vector<TensorView>& initial_values,
             const CommHandle& comm)
    : PyDataParallel(make_ddp(params, config, initial_values, comm)) {}

std::vector<ParamSpec> to_specs(const std::vector<PyParam>& params, const std::vector<bool>& mxfp8,
                                const std::vector<bool>& mxfp8_colwise_forward) {
  MXDDP_CHECK(mxfp8.empty() || mxfp8.size() == params.size(), "got {} mxfp8 flags for {} params; give one per param or none",
              mxfp8.size(), params.size());
  MXDDP_CHECK(mxfp8_colwise_forward.empty() || mxfp8_colwise_forward.size() == params.size(),
              "got {} mxfp8_colwise_forward flags for {} params; give one per param or none",
              mxfp8_colwise_forward.size(), params.size());
  std::vector<ParamSpec> specs;
  for (const auto& [name, shape, shared] : params) {
    const size_t i = specs.size();
    specs.push_back(ParamSpec{.name = name, .shape = to_shape(shape, "param '" + name + "'"), .shared_embedding = shared,
                              .mxfp8 = !mxfp8.empty() && mxfp8[i],
                              .mxfp8_colwise_forward = !mxfp8_colwise_forward.empty() && mxfp8_colwise_forward[i]});
  }
  return specs;
}

namespace {

std::pair<int64_t, int64_t> range_pair(const Range& r) { return {r.start, r.end}; }

void bind_ddp_config(nb::module_& m) {
  nb::class_<DdpConfig>(m, "DdpConfig", "mxddp::DdpConfig: the C++ DDP's options (fields as Megatron names them).")
      .def(nb::init<>())
      .def_rw("grad_reduce_in_fp32", &DdpConfig::grad_reduce_in_fp32)
      .def_rw("overlap_grad_reduce", &DdpConfig::overlap_grad_reduce)
      .def_rw("use_distributed_optimizer", &DdpConfig::use_distributed_optimizer)
      .def_rw("bucket_size", &DdpConfig::bucket_size, nb::arg().none())
      .def_rw("pad_buckets_for_high_nccl_busbw", &DdpConfig::pad_buckets_for_high_nccl_busbw)
      .def_rw("average_in_collective", &DdpConfig::average_in_collective)
      .def_rw("check_for_nan_in_grad", &DdpConfig::check_for_nan_in_grad)
      .def_rw("force_all_reduce", &DdpConfig::force_all_reduce)
      .def_rw("buckets_per_group", &DdpConfig::buckets_per_group)
      .def_rw("overlap_param_gather", &DdpConfig::overlap_param_gather)
      .def_rw("fp8_param_gather", &DdpConfig::fp8_param_gather)
      .def_rw("reuse_grad_buf_for_mxfp8_param_ag", &DdpConfig::reuse_grad_buf_for_mxfp8_param_ag)
      .def_prop_rw(
          "param_dtype", [](const DdpConfig& c) { return std::string(dtype_name(c.param_dtype)); },
          [](DdpConfig& c, const std::string& name) { c.param_dtype = parse_param_dtype(name); });
}

// The calls every DataParallel answers alike, bound once on the handles' base class.
void bind_data_parallel(nb::module_& m) {
  nb::class_<PyDataParallel>(m, "DataParallel", "What DistributedDataParallel and FullyShardedDataParallel share.")
      .def_prop_ro("num_params", [](PyDataParallel& s) { return s.data_parallel().num_params(); })
      .def_prop_ro("closed", &PyDataParallel::closed)
      .def_prop_ro("open_optimizers", &PyDataParallel::open_optimizers)
      .def("param_name", [](PyDataParallel& s, int i) { return s.data_parallel().params().at(static_cast<size_t>(i)).name; })
      // The views keep this handle alive (their DLPack owner), so the buffers outlive every tensor
      // over them unless close() is called explicitly.
      .def("param", [](nb::handle_t<PyDataParallel> self, int i) {
        DataParallel& dp = nb::cast<PyDataParallel&>(self).data_parallel();
        TensorView values;
        {
          nb::gil_scoped_release release;  // as every call into a DataParallel that could wait for a collective
          values = dp.param(i);
        }
        return to_torch(values, self);
      }, "Param i's values: a torch view of the param buffer (FSDP: of its gathered storage, valid while gathered).")
      .def("main_grad", [](nb::handle_t<PyDataParallel> self, int i) {
        DataParallel& dp = nb::cast<PyDataParallel&>(self).data_parallel();
        TensorView grad;
        {
          // FSDP may wait here for a reduce-scatter still reading the bucket (several micro-batches).
          nb::gil_scoped_release release;
          grad = dp.main_grad(i);
        }
        return to_torch(grad, self);
      }, "Param i's gradient: a torch view of the grad buffer (FSDP: valid until grad_ready(i)).")
      .def("grad_ready", [](PyDataParallel& s, int i) {
        DataParallel& dp = s.data_parallel();
        nb::gil_scoped_release release;
        dp.grad_ready(i);
      }, nb::arg("index"))
      .def("finish_grad_sync", [](PyDataParallel& s) {
        DataParallel& dp = s.data_parallel();
        nb::gil_scoped_release release;
        dp.finish_grad_sync();
      })
      .def("zero_grad_buffer", [](PyDataParallel& s) {
        DataParallel& dp = s.data_parallel();
        nb::gil_scoped_release release;
        dp.zero_grad_buffer();
      })
      .def("enter_no_sync", &PyDataParallel::enter_no_sync)
      .def("exit_no_sync", &PyDataParallel::exit_no_sync)
      .def_prop_ro("no_sync_depth", &PyDataParallel::no_sync_depth)
      .def_prop_ro("param_dtype", [](PyDataParallel& s) { return std::string(dtype_name(s.data_parallel().param_dtype())); })
      .def_prop_ro("grad_dtype", [](PyDataParallel& s) { return std::string(dtype_name(s.data_parallel().grad_dtype())); })
      .def("before_forward", [](PyDataParallel& s, const std::vector<int>& params) {
        DataParallel& dp = s.data_parallel();
        nb::gil_scoped_release release;
        dp.before_forward(params);
      }, nb::arg("params"),
           "The forward pre-hook of the module holding these params (registration indices): DDP waits for their "
           "param gathers (overlap_param_gather); FSDP gathers them (its unit, or the non-unit params).")
      // MXFP8 params (fp8_param_gather).
      .def("is_mxfp8", [](PyDataParallel& s, int i) { return s.data_parallel().is_mxfp8(i); })
      .def("mxfp8_param", [](nb::handle_t<PyDataParallel> self, int i, const std::string& axis) {
        DataParallel& dp = nb::cast<PyDataParallel&>(self).data_parallel();
        const QuantAxis quant_axis = parse_quant_axis(axis);
        Mxfp8View q;
        {
          nb::gil_scoped_release release;  // FSDP may wait for the param's gather
          q = dp.mxfp8_param(i, quant_axis);
        }
        return std::make_pair(to_torch(q.data, self), to_torch(q.scales, self));
      }, nb::arg("index"), nb::arg("axis"),
           "Param i's MXFP8 storage in one orientation ('row' or 'col'): (element bytes u8 [M, N], E8M0 scales u8).")
      .def("dequantize_param", [](PyDataParallel& s, int i, const std::string& axis, AnyArray out, uintptr_t stream) {
        // mxfp8_param may wait for a gather, which a torch communicator's progress thread runs with the GIL.
        nb::gil_scoped_release release;
        DataParallel& dp = s.data_parallel();
        const Mxfp8View q = dp.mxfp8_param(i, parse_quant_axis(axis));
        const TensorView target = from_any_array(out, "dequantize_param's out");
        MXDDP_CHECK(target.shape == q.data.shape, "dequantize_param: out has shape {} but param '{}' is {}",
                    target.shape.to_string(), dp.params().at(static_cast<size_t>(i)).name, q.data.shape.to_string());
        MXDDP_CHECK(target.device == q.data.device, "dequantize_param: out is on {} but param '{}' is on {}",
                    to_string(target.device), dp.params().at(static_cast<size_t>(i)).name, to_string(q.data.device));
        if (!target.device.is_cpu()) {
#ifdef MXDDP_PYTHON_CUDA
          cuda_mx_dequantize(q.data, q.scales, target, q.options, reinterpret_cast<CudaStream>(stream));
          return;
#else
          (void)stream;
          MXDDP_FAIL("unreachable: a device param in an mxddp._C without the CUDA layer");
#endif
        }
        mx_dequantize(q.data, q.scales, target, q.options);
      }, nb::arg("index"), nb::arg("axis"), nb::arg("out"), nb::arg("stream") = 0,
           "Writes param i's MXFP8 values, row- or column-wise, into out (f32 or bf16 [M, N], contiguous, on the "
           "param's device; on a GPU enqueued on stream, torch.cuda.current_stream().cuda_stream).")
      .def("close", &PyDataParallel::close,
           "Waits for collectives in flight and frees the buffers; every view of them is invalid after.");
}

}  // namespace

void bind_ddp(nb::module_& m) {
  bind_ddp_config(m);
  bind_data_parallel(m);
  nb::class_<PyDdp, PyDataParallel>(m, "DistributedDataParallel",
                    "The C++ DistributedDataParallel: params laid out in one padded, bucketed buffer; buckets "
                    "reduced as their grads are reported.")
      .def("__init__",
           [](PyDdp* self, const std::vector<PyParam>& params, const DdpConfig& config, const std::vector<bool>& mxfp8,
              const std::vector<HostArray>& initial_values, const CommHandle* comm) {
             std::vector<ParamSpec> specs = to_specs(params, mxfp8);
             new (self) PyDdp(specs, config, to_views(initial_values), comm ? *comm : CommHandle{});
           },
           nb::arg("params"), nb::arg("config"), nb::arg("mxfp8") = std::vector<bool>{},
           nb::arg("initial_values") = std::vector<HostArray>{}, nb::arg("comm").none() = nb::none(),
           "params: [(name, shape, shared_embedding)] in registration order; mxfp8: [] or a flag per param (kept "
           "as MXFP8 with fp8_param_gather: 2-D only); initial_values: [] (zeros) or each param's values (f32 or "
           "bf16, contiguous), copied in before the MXFP8 and BF16 copies are taken from them; comm: the "
           "communicator to reduce over (a handle from add_torch_group), None: the world's.")
      .def("param_buffer", [](nb::handle_t<PyDdp> self) {
        return to_torch(nb::cast<PyDdp&>(self).ddp().buffer().param_buffer(), self);
      })
      .def("grad_buffer", [](nb::handle_t<PyDdp> self) {
        return to_torch(nb::cast<PyDdp&>(self).ddp().buffer().grad_buffer(), self);
      })
      .def("broadcast_params", [](PyDdp& s) {
        DistributedDataParallel& ddp = s.ddp();
        nb::gil_scoped_release release;
        ddp.broadcast_params();
      }, "Copies rank 0's param buffer to every rank.")
      .def_prop_ro("grads_live", [](PyDdp& s) { return s.ddp().grads_live(); })
      // The layout, for tests and for users who want to see where their params went (elements).
      .def_prop_ro("numel", [](PyDdp& s) { return s.ddp().layout().numel; })
      .def_prop_ro("num_buckets", [](PyDdp& s) { return static_cast<int>(s.ddp().layout().buckets.size()); })
      .def("param_range", [](PyDdp& s, int i) {
        return range_pair(s.ddp().layout().params.at(static_cast<size_t>(i)).range);
      })
      .def("bucket_of_param", [](PyDdp& s, int i) { return s.ddp().layout().params.at(static_cast<size_t>(i)).bucket; })
      .def("bucket_range", [](PyDdp& s, int b) {
        return range_pair(s.ddp().layout().buckets.at(static_cast<size_t>(b)).range);
      })
      // The param all-gather (distributed optimizer): what tests observe of it.
      .def_prop_ro("param_sync_pending", [](PyDdp& s) { return s.ddp().param_sync_pending(); })
      .def_prop_ro("next_param_gather_group", [](PyDdp& s) { return s.ddp().next_param_gather_group(); },
                   "The bucket group whose gather is dispatched next; -1 when none is left.")
      .def("group_of_param", [](PyDdp& s, int i) { return s.ddp().group_of_param(i); })
      .def("pending_gathers", [](PyDdp& s, const std::vector<int>& params) {
             std::vector<int> pending;
             for (int p : params) {
               MXDDP_CHECK(p >= 0 && p < s.ddp().num_params(), "pending_gathers: param index {} out of range; valid: 0..{}",
                           p, s.ddp().num_params() - 1);
               if (s.ddp().param_gather_pending(p)) pending.push_back(p);
             }
             return pending;
           }, "Of these registration indices, those whose bucket group's all-gather is still to land.")
      .def_prop_ro("num_bucket_groups", [](PyDdp& s) { return s.ddp().num_bucket_groups(); })
      .def("bucket_group_issued", [](PyDdp& s, int g) { return s.ddp().bucket_group_issued(g); });
}

}  // namespace mxddp::python
