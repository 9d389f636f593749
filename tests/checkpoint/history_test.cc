// The checkpoint history in the library (checkpoint_history.h), which mxddp train and the Python
// package share: a save into save_dir/iter_NNNNNNN with the tracker and pruning, a load of the
// history's newest, the save-directory lock and check for one save, and refusals on every rank
// that leave the run as it was (a different iteration per rank, a missing directory, a missing
// count in the metadata).
#include <filesystem>
#include <fstream>
#include <sstream>

#include <mxddp/checkpoint_history.h>

#include "optim/optim_checks.h"

namespace mxddp::testing {
namespace {

namespace fs = std::filesystem;

const OptimizerConfig kAdam{.lr = 1e-2f, .weight_decay = 0.05f, .clip_grad = 1.0f};

std::string fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("mxddp_history_{}_{}", name, ::getpid());
  fs::remove_all(dir);
  return dir.string();
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::vector<float> main_params(DistributedOptimizer& opt) {
  std::vector<float> all;
  for (int b = 0; b < opt.num_buckets(); ++b) {
    const TensorView v = opt.main_params(b);
    all.insert(all.end(), v.data_as<const float>(), v.data_as<const float>() + v.numel());
  }
  return all;
}

// Runs fn(opt) on each rank of a dp-2 MLP after one training step.
template <typename Fn>
void with_trained_mlp(Fn&& fn) {
  run_local(2, [&](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(), tracker, views_of(init));
    DistributedOptimizer opt(ddp, kAdam, tracker);
    ddp_train_step(opt, 0, kGlobalBatch);
    fn(comm, opt);
  });
}

TEST(CheckpointHistory, SavesIterDirectoriesWithTheTrackerPrunesAndLoadsTheNewest) {
  const std::string dir = fresh_dir("layout");
  with_trained_mlp([&](Communicator& comm, DistributedOptimizer& opt) {
    const HistorySaveOptions once{.check_and_lock = true, .what = "save dir"};
    EXPECT_EQ(save_checkpoint_to_history(dir, 1, opt, {.metadata = {{"iteration", "1"}}}, once), dir + "/iter_0000001");
    ddp_train_step(opt, 1, kGlobalBatch);
    const std::vector<float> saved = main_params(opt);
    HistorySaveOptions keep_one = once;
    keep_one.keep_last = 1;
    save_checkpoint_to_history(dir, 2, opt, {.metadata = {{"iteration", "2"}}}, keep_one);
    comm.barrier();
    EXPECT_EQ(read_text(dir + "/latest_checkpointed_iteration.txt"), "2\n");
    EXPECT_FALSE(fs::exists(dir + "/iter_0000001")) << "keep_last 1 prunes the older save";
    EXPECT_FALSE(fs::exists(dir + "/mxddp.lock")) << "the lock is held for the save only";
    ddp_train_step(opt, 2, kGlobalBatch);
    const HistoryLoadResult r = load_checkpoint_from_history(dir, opt, {.count_metadata = {"iteration"}});
    EXPECT_EQ(r.dir, dir + "/iter_0000002");
    EXPECT_EQ(r.metadata.at("iteration"), "2");
    EXPECT_EQ(main_params(opt), saved);
    EXPECT_EQ(opt.step_count(), 2);
  });
  fs::remove_all(dir);
}

TEST(CheckpointHistory, RefusalsComeOnEveryRankAndChangeNothing) {
  const std::string dir = fresh_dir("refusals");
  with_trained_mlp([&](Communicator& comm, DistributedOptimizer& opt) {
    // A different iteration on each rank would name two directories.
    EXPECT_THROW(save_checkpoint_to_history(dir, 3 + comm.rank(), opt, {}), Error);
    EXPECT_FALSE(fs::exists(dir));
    // No iteration in the metadata: refused before anything changes.
    save_checkpoint_to_history(dir, 5, opt, {.metadata = {{"note", "x"}}});
    ddp_train_step(opt, 1, kGlobalBatch);
    const std::vector<float> before = main_params(opt);
    try {
      load_checkpoint_from_history(dir, opt, {.count_metadata = {"iteration"}});
      ADD_FAILURE() << "a checkpoint without an iteration loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("has no 'iteration' in its metadata (keys: [note])"), std::string::npos)
          << e.what();
    }
    EXPECT_EQ(main_params(opt), before);
    EXPECT_EQ(opt.step_count(), 2);
    // A missing directory: every rank throws, naming it.
    try {
      load_checkpoint_from_history(dir + "_missing", opt);
      ADD_FAILURE() << "a missing directory loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(dir + "_missing"), std::string::npos) << e.what();
    }
    EXPECT_EQ(main_params(opt), before);
  });
  fs::remove_all(dir);
}

TEST(CheckpointHistory, ASaveIntoAHistoryAnotherWriterHoldsIsRefused) {
  const std::string dir = fresh_dir("locked");
  SaveDirLock other(dir, "--save");  // as a live mxddp train --save holds it
  with_trained_mlp([&](Communicator&, DistributedOptimizer& opt) {
    try {
      save_checkpoint_to_history(dir, 1, opt, {}, {.check_and_lock = true, .what = "save dir"});
      ADD_FAILURE() << "saved into a locked history";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is being written by another live run"), std::string::npos) << e.what();
    }
  });
  EXPECT_FALSE(fs::exists(dir + "/iter_0000001"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mxddp::testing
