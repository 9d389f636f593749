// Every rank runs the same job (launch_check.h): ranks launched with different flags are refused
// at startup, on every rank together, with one message naming each differing flag and the ranks
// holding each value; a failure one rank sees ends all of them (throw_if_any_rank_failed); a --save
// directory another live run holds is refused naming that run, and a killed run's lock is taken over.
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <fstream>
#include <functional>

#include <mxddp/launch_check.h>

#include "comm/recording_compute.h"
#include "model/train_util.h"
#include "train/same_job_cases.h"
#include <mxddp/checkpoint_history.h>

namespace mxddp::testing {
namespace {

// Runs train() on dp in-process ranks, rank `odd` with `change` applied to its config; each
// rank's Error message [rank] ("" where a rank returned).
std::vector<std::string> errors_with_one_rank_changed(int dp, int odd, const std::function<void(TrainConfig&)>& change) {
  set_compute_threads(1);
  TrainConfig same = small_train_config();
  same.train_iters = 1;
  same.eval_iters = 0;
  TrainConfig other = same;
  change(other);
  std::vector<std::string> errors(static_cast<size_t>(dp));
  run_local(dp, [&](Communicator& comm) {
    try {
      train(comm, comm.rank() == odd ? other : same);
    } catch (const Error& e) {
      errors[static_cast<size_t>(comm.rank())] = e.what();
    }
  });
  return errors;
}

TEST(SameJob, EveryFieldClassMismatchedOnOneRankIsRefusedOnEveryRankNamingTheFlagAndRanks) {
  for (int dp : {2, 4}) {
    const int odd = dp - 1;
    for (const Mismatch& m : mismatches()) {
      const std::vector<std::string> errors = errors_with_one_rank_changed(dp, odd, m.change);
      for (int r = 0; r < dp; ++r) {
        const std::string& e = errors[static_cast<size_t>(r)];
        EXPECT_NE(e.find("not launched with the same job"), std::string::npos) << m.what << ", dp " << dp << ", rank " << r << ": " << e;
        EXPECT_NE(e.find(std::string("\n  ") + m.flag + ":"), std::string::npos) << m.what << ", dp " << dp << ": " << e;
        EXPECT_NE(e.find(fmt::format("on rank {}", odd)), std::string::npos) << m.what << ": names the odd rank: " << e;
        EXPECT_EQ(e, errors.front()) << m.what << ": every rank gives the same message";
      }
      const std::string& e = errors.front();
      EXPECT_NE(e.find(dp == 2 ? "on rank 0" : "on ranks 0, 1, 2"), std::string::npos) << m.what << ": " << e;
    }
  }
}

// The case that used to stall until the watchdog: FSDP on both ranks, different strategies.
TEST(SameJob, FsdpStrategiesThatDifferAreNamedInsteadOfStalling) {
  for (int dp : {2, 4}) {
    const std::vector<std::string> errors = errors_with_one_rank_changed(dp, dp - 1, [](TrainConfig& c) {
      c.use_megatron_fsdp = true;
      c.fsdp.data_parallel_sharding_strategy = ShardingStrategy::kOptim;
    });
    for (const std::string& e : errors) EXPECT_NE(e.find("--use-megatron-fsdp: 'false' on"), std::string::npos) << e;
  }
  set_compute_threads(1);
  TrainConfig a = small_train_config();
  a.train_iters = 1;
  a.eval_iters = 0;
  a.use_megatron_fsdp = true;
  TrainConfig b = a;
  b.fsdp.data_parallel_sharding_strategy = ShardingStrategy::kOptim;
  std::vector<std::string> got(2);
  run_local(2, [&](Communicator& comm) {
    try {
      train(comm, comm.rank() == 0 ? a : b);
    } catch (const Error& e) {
      got[static_cast<size_t>(comm.rank())] = e.what();
    }
  });
  for (const std::string& e : got)
    EXPECT_NE(e.find("--data-parallel-sharding-strategy: 'optim_grads_params' on rank 0; 'optim' on rank 1"),
              std::string::npos) << e;
}

TEST(SameJob, AMatchedLaunchTrainsAsBefore) {
  const TrainConfig c = small_train_config();
  const auto all = train_local_all(2, c);
  EXPECT_EQ(losses(all[0]), losses(all[1]));
  EXPECT_EQ(all[0].steps.size(), 4u);
}

TEST(SameJob, FieldsMissingOnARankAndFailuresOnOneRankAreNamed) {
  std::vector<std::string> errors(3);
  run_local(3, [&](Communicator& comm) {
    std::vector<JobField> fields{{"--a", "1"}};
    if (comm.rank() == 1) fields.push_back({"--b", "x"});
    try {
      check_same_job(comm, fields, "the test's fields");
    } catch (const Error& e) {
      errors[static_cast<size_t>(comm.rank())] = e.what();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("the test's fields differ"), std::string::npos) << e;
    EXPECT_NE(e.find("--b: (not given) on ranks 0, 2; 'x' on rank 1"), std::string::npos) << e;
    EXPECT_EQ(e.find("--a:"), std::string::npos) << "an agreed field is not listed: " << e;
  }
  run_local(3, [&](Communicator& comm) {
    EXPECT_NO_THROW(check_same_job(comm, {{"--a", "1"}, {"--b", std::string(100000, 'y')}}, "long values"));
    try {
      throw_if_any_rank_failed(comm, comm.rank() == 2 ? "cannot open --data 'x'" : "");
      ADD_FAILURE() << "rank " << comm.rank() << " went on";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 2: cannot open --data 'x'"), std::string::npos) << e.what();
    }
    EXPECT_NO_THROW(throw_if_any_rank_failed(comm, ""));
  });
}

// A CUDA model's communicator collects device memory only: the texts are staged through it, as
// mxddp.torch's checkpoint save checks its directory on every rank (it refused host views before).
TEST(SameJob, RanksOnADeviceCompareAndNameFailuresToo) {
  const ClaimedDevice claimed(2);
  std::vector<std::string> errors(2);
  run_local(2, [&](Communicator& comm) {
    ASSERT_FALSE(comm.device().is_cpu());
    EXPECT_NO_THROW(throw_if_any_rank_failed(comm, ""));
    EXPECT_NO_THROW(check_same_job(comm, {{"--a", "1"}}, "the test's fields"));
    try {
      check_same_job(comm, {{"--a", comm.rank() == 0 ? "1" : "2"}}, "the test's fields");
    } catch (const Error& e) {
      errors[static_cast<size_t>(comm.rank())] = e.what();
    }
  }, claimed.options);
  for (const std::string& e : errors) EXPECT_NE(e.find("--a: '1' on rank 0; '2' on rank 1"), std::string::npos) << e;
  for (const auto& compute : claimed.computes) EXPECT_GT(compute->copies.load(), 0) << "staged through the device";
}

TEST(SaveDirLock, ASecondWriterIsRefusedNamingTheFirst) {
  TempDir dir("save_lock");
  const std::string save = (dir.path / "history").string();
  {
    SaveDirLock first(save);
    try {
      SaveDirLock second(save);
      FAIL() << "a second lock on one --save directory";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("is being written by another live run"), std::string::npos) << m;
      EXPECT_NE(m.find(fmt::format("pid {}", ::getpid())), std::string::npos) << "names the holder: " << m;
    }
  }
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(save) / kSaveLockFile)) << "a run that ends removes it";
  EXPECT_NO_THROW(SaveDirLock again(save)) << "released with its holder";
}

TEST(SaveDirLock, AKilledRunsLockIsTakenOver) {
  TempDir dir("save_lock_killed");
  const std::string save = (dir.path / "history").string();
  std::filesystem::create_directories(save);
  const std::string lock = (std::filesystem::path(save) / kSaveLockFile).string();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // async-signal-safe calls only
    const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT, 0644);
    if (fd < 0 || ::flock(fd, LOCK_EX) != 0) ::_exit(1);
    ::raise(SIGKILL);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "the holder was killed";
  // The file still names an old holder; the lock went with the process.
  std::ofstream(lock) << "pid 999999 on host gone, holding it since 2026-01-01T00:00:00Z\n";
  EXPECT_NO_THROW(SaveDirLock taken(save));
}

TEST(SaveDirLock, TrainingIntoADirectoryAnotherRunHoldsIsRefusedBeforeAnything) {
  TempDir dir("save_lock_train");
  TrainConfig c = small_train_config();
  c.train_iters = 1;
  c.save_dir = (dir.path / "history").string();
  SaveDirLock other(c.save_dir);
  const std::vector<std::string> errors = train_local_errors(2, c);
  for (const std::string& e : errors) EXPECT_NE(e.find("is being written by another live run"), std::string::npos) << e;
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(c.save_dir) / "iter_0000001")) << "nothing was saved";
}

}  // namespace
}  // namespace mxddp::testing
