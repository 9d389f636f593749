// The checkpoint history in the library (checkpoint_history.h), which mxddp train and the Python
// package share: a save into save_dir/iter_NNNNNNN with the tracker and pruning, a load of the
// history's newest, the save-directory lock and check for one save, and refusals on every rank
// that leave the run as it was (a different iteration per rank, a missing directory, a missing
// count in the metadata); readers that meet another run's save (issue 40 item 9), what interrupted
// saves leave, the tracker's and the lock holder's text in messages and a history with no save
// (item 15), and where an export may not write (item 3).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <fmt/ranges.h>

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

// Makes a directory immutable (chattr +i) for its lifetime, so that removing what it holds fails
// even for root; ok() is false where the file system or the process cannot (then the test skips).
class Immutable {
 public:
  explicit Immutable(const std::string& dir) : fd_(::open(dir.c_str(), O_RDONLY | O_DIRECTORY)) {
    int flags = 0;
    if (fd_ >= 0 && ::ioctl(fd_, FS_IOC_GETFLAGS, &flags) == 0) {
      flags |= FS_IMMUTABLE_FL;
      set_ = ::ioctl(fd_, FS_IOC_SETFLAGS, &flags) == 0;
    }
  }
  ~Immutable() {
    int flags = 0;
    if (set_ && ::ioctl(fd_, FS_IOC_GETFLAGS, &flags) == 0) {
      flags &= ~FS_IMMUTABLE_FL;
      ::ioctl(fd_, FS_IOC_SETFLAGS, &flags);
    }
    if (fd_ >= 0) ::close(fd_);
  }
  Immutable(const Immutable&) = delete;
  Immutable& operator=(const Immutable&) = delete;
  bool ok() const { return set_; }

 private:
  int fd_;
  bool set_ = false;
};

TEST(CheckpointHistory, ASaveWhosePruningFailsSaysItIsCompleteAndNamed) {
  const std::string dir = fresh_dir("prune_fails");
  bool skipped = false;
  with_trained_mlp([&](Communicator& comm, DistributedOptimizer& opt) {
    save_checkpoint_to_history(dir, 1, opt, {.metadata = {{"iteration", "1"}}});
    comm.barrier();
    std::optional<Immutable> frozen;
    uint8_t ok = 1;
    if (comm.rank() == 0) {
      frozen.emplace(dir + "/iter_0000001");
      ok = frozen->ok() ? 1 : 0;
    }
    comm.barrier();
    TensorView flag{&ok, DType::kU8, Shape{1}, Device::cpu()};
    comm.broadcast(flag).wait();
    if (!ok) {
      skipped = true;
      return;
    }
    try {
      save_checkpoint_to_history(dir, 2, opt, {.metadata = {{"iteration", "2"}}}, {.keep_last = 1});
      ADD_FAILURE() << "the failed pruning went unreported";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("and the tracker names it (the save is complete), but removing the older "
                                           "saves beyond keep_last=1 failed"),
                std::string::npos)
          << e.what();
    }
    comm.barrier();
    frozen.reset();
    EXPECT_EQ(read_text(dir + "/latest_checkpointed_iteration.txt"), "2\n");
    EXPECT_EQ(load_checkpoint_from_history(dir, opt, {.count_metadata = {"iteration"}}).metadata.at("iteration"), "2");
  });
  fs::remove_all(dir);
  if (skipped) GTEST_SKIP() << "chattr +i is not available here (not root, or not a file system that has it)";
}

TEST(CheckpointHistory, AHistoryInsideAnotherHistoryOrCheckpointIsRefused) {
  const std::string dir = fresh_dir("nested");
  with_trained_mlp([&](Communicator& comm, DistributedOptimizer& opt) {
    save_checkpoint_to_history(dir, 1, opt, {.metadata = {{"iteration", "1"}}});
    comm.barrier();
    const std::string top = fs::canonical(dir).string();
    const std::pair<std::string, std::string> cases[] = {
        {dir + "/iter_0000001/best", fmt::format("checkpoint '{}/iter_0000001'", top)},
        {dir + "/best", fmt::format("checkpoint history '{}'", top)}};
    for (const auto& [inner, place] : cases) {
      try {
        save_checkpoint_to_history(inner, 2, opt, {}, {.check_and_lock = true, .what = "save dir"});
        ADD_FAILURE() << inner << " was accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(fmt::format("save dir '{}' is inside the {}", inner, place)),
                  std::string::npos)
            << e.what();
      }
      EXPECT_FALSE(fs::exists(inner));
    }
    save_checkpoint_to_history(dir, 2, opt, {}, {.check_and_lock = true, .what = "save dir"});  // the history itself
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

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// A history at dir with iteration 1 saved (and tracked), plus iteration 2 saved in a second
// history at dir + "_next", to be moved in as another run's save would publish it.
void save_two_iterations(const std::string& dir) {
  with_trained_mlp([&](Communicator& comm, DistributedOptimizer& opt) {
    save_checkpoint_to_history(dir, 1, opt, {.metadata = {{"iteration", "1"}}});
    ddp_train_step(opt, 1, kGlobalBatch);
    save_checkpoint_to_history(dir + "_next", 2, opt, {.metadata = {{"iteration", "2"}}});
    comm.barrier();
  });
}

// What a save of iteration 2 with keep_last 1 does once the reader has resolved iteration 1: the
// new checkpoint published, the tracker moved to it, and the old one being removed (one rank file
// gone so far).
void concurrent_save_of_iteration_2(const std::string& dir) {
  fs::rename(dir + "_next/iter_0000002", dir + "/iter_0000002");
  write_text(dir + "/latest_checkpointed_iteration.txt", "2\n");
  fs::remove(dir + "/iter_0000001/rank_00001.safetensors");
}

TEST(CheckpointHistory, AReaderThatMeetsASaveReadsAgainInsteadOfReportingDamage) {
  const std::string dir = fresh_dir("reader_race");
  save_two_iterations(dir);
  int calls = 0;
  CheckpointInfo info;
  const bool sound = checkpoint_history::read_while_unchanged(dir, [&] {
    const std::string resolved = resolve_checkpoint_dir(dir);
    if (++calls == 1) concurrent_save_of_iteration_2(dir);
    info = inspect_checkpoint(resolved);
    return info.ok();
  });
  EXPECT_TRUE(sound) << fmt::format("{}", fmt::join(info.problems, "; "));
  EXPECT_EQ(calls, 2) << "the first read met the save; the second read the new checkpoint";
  EXPECT_EQ(info.dir, dir + "/iter_0000002");
  fs::remove_all(dir);
  fs::remove_all(dir + "_next");
}

TEST(CheckpointHistory, AFileMissingWhileTheTrackerStaysIsDamage) {
  const std::string dir = fresh_dir("reader_damage");
  save_two_iterations(dir);
  fs::remove(dir + "/iter_0000001/rank_00001.safetensors");
  int calls = 0;
  CheckpointInfo info;
  const bool sound = checkpoint_history::read_while_unchanged(dir, [&] {
    ++calls;
    info = inspect_checkpoint(resolve_checkpoint_dir(dir));
    return info.ok();
  });
  EXPECT_FALSE(sound);
  EXPECT_EQ(calls, 1) << "nothing changed: the read is not repeated";
  ASSERT_EQ(info.problems.size(), 1u);
  EXPECT_NE(info.problems[0].find("rank_00001.safetensors' is missing"), std::string::npos) << info.problems[0];
  // Thrown the same way: a tracker naming a directory that is gone, while it stays, is an error.
  fs::remove_all(dir + "/iter_0000001");
  calls = 0;
  try {
    checkpoint_history::read_while_unchanged(dir, [&] {
      ++calls;
      return inspect_checkpoint(resolve_checkpoint_dir(dir)).ok();
    });
    ADD_FAILURE() << "a history whose checkpoint is gone read as sound";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("names iteration 1, but " + dir + "/iter_0000001 holds no checkpoint"),
              std::string::npos) << e.what();
  }
  EXPECT_EQ(calls, 1);
  fs::remove_all(dir);
  fs::remove_all(dir + "_next");
}

TEST(CheckpointHistory, AHistoryThatNeverStandsStillIsSaidToBeBeingWritten) {
  const std::string dir = fresh_dir("reader_busy");
  save_two_iterations(dir);
  int calls = 0;
  try {
    checkpoint_history::read_while_unchanged(dir, [&] {
      ++calls;
      // Every read meets another save: the tracker moves on to an iteration not yet published.
      write_text(dir + "/latest_checkpointed_iteration.txt", fmt::format("{}\n", 100 + calls));
      return inspect_checkpoint(resolve_checkpoint_dir(dir)).ok();
    });
    ADD_FAILURE() << "read a history that changed under every read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint history '" + dir + "' is being written"), std::string::npos)
        << e.what();
    EXPECT_EQ(std::string(e.what()).find("is damaged"), std::string::npos) << e.what();
  }
  EXPECT_EQ(calls, checkpoint_history::kReadTries);
  fs::remove_all(dir);
  fs::remove_all(dir + "_next");
}

TEST(CheckpointHistory, RanksThatFindDifferentCheckpointsAreRefused) {
  const std::string dir = fresh_dir("two_copies");
  save_two_iterations(dir);  // dir and dir_next: two histories of the same run
  with_trained_mlp([&](Communicator& comm, DistributedOptimizer& opt) {
    const std::vector<float> before = main_params(opt);
    try {
      load_checkpoint_from_history(comm.rank() == 0 ? dir : dir + "_next", opt);
      ADD_FAILURE() << "the ranks loaded different checkpoints";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("every rank must load the same checkpoint"), std::string::npos) << e.what();
    }
    EXPECT_EQ(main_params(opt), before);
  });
  fs::remove_all(dir);
  fs::remove_all(dir + "_next");
}

TEST(CheckpointHistory, ASaveClearsWhatInterruptedSavesOfOtherIterationsLeft) {
  const std::string dir = fresh_dir("leftovers");
  save_two_iterations(dir);
  // Left by runs killed while saving: half-written iteration 5, a publish of 3 rolled back by
  // hand, and iteration 4 complete in .partial (killed between its two renames, no iter_0000004).
  fs::create_directories(dir + "/iter_0000005.partial");
  write_text(dir + "/iter_0000005.partial/rank_00000.safetensors", "half");
  fs::create_directories(dir + "/iter_0000003.old");
  fs::rename(dir + "_next/iter_0000002", dir + "/iter_0000004.partial");
  with_trained_mlp([&](Communicator& comm, DistributedOptimizer& opt) {
    save_checkpoint_to_history(dir, 2, opt, {.metadata = {{"iteration", "2"}}},
                               {.keep_last = 2, .check_and_lock = true, .what = "save dir"});
    comm.barrier();
  });
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"iter_0000001", "iter_0000002", "iter_0000004",
                                             "latest_checkpointed_iteration.txt"}))
      << "the only complete copy of 4 takes its name (later than the save: kept); the rest is removed";
  EXPECT_TRUE(inspect_checkpoint(dir + "/iter_0000004").ok());
  fs::remove_all(dir);
  fs::remove_all(dir + "_next");
}

TEST(CheckpointHistory, TrackerTextIsQuotedEscapedAndBounded) {
  const std::string dir = fresh_dir("tracker_text");
  fs::create_directories(dir);
  const auto error_of = [&](const std::string& text) {
    write_text(dir + "/latest_checkpointed_iteration.txt", text);
    try {
      resolve_checkpoint_dir(dir);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  std::string e = error_of("1\x1b[31mred\x07\n");
  EXPECT_NE(e.find("holds '1\\x1b[31mred\\x07'; expected the iteration"), std::string::npos) << e;
  EXPECT_EQ(e.find('\x1b'), std::string::npos) << "a terminal escape reached the message";
  e = error_of(std::string("six\tand\xff") + std::string(40, 'z'));
  EXPECT_NE(e.find("holds 'six\\tand\\xff" + std::string(24, 'z') + "... (48 bytes)'"), std::string::npos) << e;
  fs::remove_all(dir);
}

TEST(CheckpointHistory, TheLockHoldersTextIsEscaped) {
  const std::string dir = fresh_dir("lock_text");
  {
    SaveDirLock held(dir, "--save");
    write_text(dir + "/mxddp.lock", "pid 1\x1b]0;title\x07 on host x\n");  // the same file, rewritten
    try {
      SaveDirLock second(dir, "--save");
      ADD_FAILURE() << "a second writer took the lock";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("another live run (pid 1\\x1b]0;title\\x07 on host x)"), std::string::npos) << what;
      EXPECT_EQ(what.find('\x1b'), std::string::npos) << "a terminal escape reached the message";
    }
  }
  fs::remove_all(dir);
}

TEST(CheckpointHistory, AHistoryWithoutSavesIsDescribedAsWhatItHolds) {
  const std::string dir = fresh_dir("no_saves");
  fs::create_directories(dir);
  const auto error_of = [&] {
    try {
      inspect_checkpoint(dir);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  std::string e = error_of();
  EXPECT_NE(e.find("'" + dir + "' is not a checkpoint: no manifest.json; it is empty ("), std::string::npos) << e;
  EXPECT_EQ(e.find(".partial"), std::string::npos) << "no interrupted save to suggest: " << e;
  { SaveDirLock lock(dir, "--save"); e = error_of(); }  // as a run that has not saved yet holds it
  EXPECT_NE(e.find("it holds mxddp.lock: a --save history with no completed save yet"), std::string::npos) << e;
  EXPECT_NE(e.find("a --save history holds latest_checkpointed_iteration.txt"), std::string::npos) << e;
  EXPECT_EQ(e.find(".partial"), std::string::npos) << e;
  fs::remove_all(dir);
}

TEST(CheckpointHistory, CheckpointPlaceOfSeesThroughLinksAndDotDot) {
  const std::string dir = fresh_dir("place");
  save_two_iterations(dir);
  const std::string real = fs::canonical(dir).string();
  const auto place = [](const std::string& path) {
    const auto p = checkpoint_history::checkpoint_place_of(path);
    return p ? p->kind + " " + p->dir : std::string("none");
  };
  EXPECT_EQ(place(dir + "/iter_0000001/manifest.json"), "checkpoint " + real + "/iter_0000001");
  EXPECT_EQ(place(dir + "/latest_checkpointed_iteration.txt"), "checkpoint history " + real);
  EXPECT_EQ(place(dir), "checkpoint history " + real);
  EXPECT_EQ(place(dir + "/new/../iter_0000001/x.safetensors"), "checkpoint " + real + "/iter_0000001");
  EXPECT_EQ(place(dir + "_new/../" + fs::path(dir).filename().string() + "/iter_0000001/x"),
            "checkpoint " + real + "/iter_0000001") << "a missing directory, then '..' back into the history";
  fs::create_directory_symlink(dir + "/iter_0000001", dir + "_link");
  EXPECT_EQ(place(dir + "_link/model.safetensors"), "checkpoint " + real + "/iter_0000001");
  EXPECT_EQ(place(dir + "_elsewhere/model.safetensors"), "none");
  fs::remove(dir + "_link");
  fs::remove_all(dir);
  fs::remove_all(dir + "_next");
}

}  // namespace
}  // namespace mxddp::testing
