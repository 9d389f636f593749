// mxddp._C.save_checkpoint / load_checkpoint: the C++ checkpoint layer (checkpoint.h: atomic,
// checksummed, resharding across dp and bucket sizes) in the history layout `mxddp train
// --save/--load` uses (checkpoint_history.h), for a DistributedOptimizer Python holds. Thin: every
// check and the layout are the library's; the GIL is released while it works (it is collective).
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <mxddp/checkpoint_history.h>

#include "bindings.h"

namespace nb = nanobind;

namespace mxddp::python {

void bind_checkpoint(nb::module_& m) {
  m.def(
      "save_checkpoint",
      [](const std::string& save_dir, PyOptimizer& handle, int64_t iteration,
         const std::map<std::string, std::string>& metadata, const ModelConfigFields& model_config, int keep_last) {
        DistributedOptimizer& optimizer = handle.optimizer();
        nb::gil_scoped_release release;
        return save_checkpoint_to_history(save_dir, iteration, optimizer,
                                          {.metadata = metadata, .model_config = model_config},
                                          {.keep_last = keep_last, .check_and_lock = true, .what = "save directory"});
      },
      nb::arg("save_dir"), nb::arg("optimizer"), nb::arg("iteration"), nb::arg("metadata"), nb::arg("model_config"),
      nb::arg("keep_last"),
      "Collective. Saves into save_dir/iter_NNNNNNN and points save_dir/latest_checkpointed_iteration.txt at it; "
      "returns the iter_ directory.");
  m.def(
      "load_checkpoint",
      [](const std::string& load_dir, PyOptimizer& handle, const ModelConfigFields& model_config,
         const std::vector<std::string>& count_metadata) {
        DistributedOptimizer& optimizer = handle.optimizer();
        nb::gil_scoped_release release;
        HistoryLoadResult r = load_checkpoint_from_history(
            load_dir, optimizer, {.model_config = model_config, .count_metadata = count_metadata});
        return std::make_pair(std::move(r.dir), std::move(r.metadata));
      },
      nb::arg("load_dir"), nb::arg("optimizer"), nb::arg("model_config"), nb::arg("count_metadata"),
      "Collective. Loads a history's newest checkpoint (or one iter_ directory); returns (directory, metadata).");
}

}  // namespace mxddp::python
