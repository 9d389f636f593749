// mxddp._C.save_checkpoint / load_checkpoint: the C++ checkpoint layer (checkpoint.h: atomic,
// checksummed, resharding across dp and bucket sizes) in the history layout `mxddp train
// --save/--load` uses (checkpoint_history.h), for a DistributedOptimizer Python holds. Thin: every
// check and the layout are the library's; the GIL is released while it works (it is collective).
//
// The save directory's lock (SaveDirLock, rank 0) is held from a run's first save into it until
// release_save_locks() (mxddp.torch.shutdown, at interpreter exit) or the process's end, as
// `mxddp train --save` holds it for the run's life: a lock held per save only would let a second
// run write the same history between two saves, each replacing the other's iterations.
#include <sys/stat.h>

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <mxddp/checkpoint_history.h>
#include <mxddp/launch_check.h>

#include "bindings.h"

namespace nb = nanobind;
namespace fs = std::filesystem;

namespace mxddp::python {
namespace {

constexpr const char* kSaveDirWhat = "save directory";  // how messages name save_dir

// A lock this process holds, and the identity of the lock file it took, so that a history removed
// or whose lock file was replaced under the run is noticed (and locked again) at the next save.
struct HeldSaveLock {
  std::unique_ptr<SaveDirLock> lock;
  dev_t device = 0;
  ino_t inode = 0;
};

struct HeldSaveLocks {
  std::mutex mutex;
  std::map<std::string, HeldSaveLock> by_dir;  // canonical save_dir -> its lock
};

HeldSaveLocks& held_save_locks() {
  static HeldSaveLocks locks;
  return locks;
}

std::string lock_file(const std::string& save_dir) { return (fs::path(save_dir) / kSaveLockFile).string(); }

bool still_ours(const std::string& save_dir, const HeldSaveLock& held) {
  struct stat st {};
  return ::lstat(lock_file(save_dir).c_str(), &st) == 0 && st.st_dev == held.device && st.st_ino == held.inode;
}

// Rank 0: takes save_dir's lock unless this process holds it already. Throws Error naming the
// directory and the holder when another live run holds it.
void hold_save_lock(const std::string& save_dir) {
  std::error_code ec;
  fs::create_directories(save_dir, ec);  // so that its canonical path names it, whatever spelling reaches it
  MXDDP_CHECK(!ec, "{} '{}' cannot be created: {}", kSaveDirWhat, save_dir, ec.message());
  const std::string key = fs::canonical(save_dir, ec).string();
  MXDDP_CHECK(!ec, "{} '{}' cannot be resolved: {}", kSaveDirWhat, save_dir, ec.message());
  HeldSaveLocks& locks = held_save_locks();
  std::lock_guard guard(locks.mutex);
  if (auto it = locks.by_dir.find(key); it != locks.by_dir.end()) {
    if (still_ours(save_dir, it->second)) return;
    locks.by_dir.erase(it);  // its lock file is gone: lock it anew below
  }
  HeldSaveLock held{.lock = std::make_unique<SaveDirLock>(save_dir, kSaveDirWhat)};
  struct stat st {};
  MXDDP_CHECK(::lstat(lock_file(save_dir).c_str(), &st) == 0, "{} '{}': its lock file '{}' vanished as it was taken",
              kSaveDirWhat, save_dir, lock_file(save_dir));
  held.device = st.st_dev;
  held.inode = st.st_ino;
  locks.by_dir.emplace(key, std::move(held));
}

// Collective: every rank checks save_dir (check_save_dir) and rank 0 holds its lock; a failure on
// any rank (rank 0 finding another run's lock) is an Error on every rank naming the failing rank,
// so no rank goes on to the save and waits there for the others.
void hold_save_dir_for_the_run(Communicator& comm, const std::string& save_dir) {
  std::string error;
  try {
    checkpoint_history::check_save_dir(save_dir, kSaveDirWhat);
    if (comm.rank() == 0) hold_save_lock(save_dir);
  } catch (const Error& e) {
    error = e.message();
  } catch (const std::exception& e) {
    error = e.what();
  }
  throw_if_any_rank_failed(comm, error);
}

}  // namespace

void bind_checkpoint(nb::module_& m) {
  m.def(
      "save_checkpoint",
      [](const std::string& save_dir, PyOptimizer& handle, int64_t iteration,
         const std::map<std::string, std::string>& metadata, const ModelConfigFields& model_config, int keep_last) {
        DistributedOptimizer& optimizer = handle.optimizer();
        nb::gil_scoped_release release;
        hold_save_dir_for_the_run(optimizer.data_parallel().communicator(), save_dir);
        return save_checkpoint_to_history(save_dir, iteration, optimizer,
                                          {.metadata = metadata, .model_config = model_config},
                                          {.keep_last = keep_last, .what = kSaveDirWhat});
      },
      nb::arg("save_dir"), nb::arg("optimizer"), nb::arg("iteration"), nb::arg("metadata"), nb::arg("model_config"),
      nb::arg("keep_last"),
      "Collective. Saves into save_dir/iter_NNNNNNN and points save_dir/latest_checkpointed_iteration.txt at it; "
      "returns the iter_ directory. Rank 0 holds save_dir's lock from then until release_save_locks().");
  m.def(
      "release_save_locks",
      [] {
        HeldSaveLocks& locks = held_save_locks();
        std::lock_guard guard(locks.mutex);
        locks.by_dir.clear();  // each removes its lock file and releases the lock
      },
      "Releases every save directory lock this process holds (mxddp.torch.shutdown calls it).");
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
