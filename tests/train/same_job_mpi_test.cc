// Every rank runs the same job, under mpirun (-np 2 and -np 4): each field class mismatched on the
// last rank is refused on every process, before the first iteration, with the same message naming
// the flag and the ranks; a matched launch trains.
#include "model/train_util.h"
#include "mpi_main.h"
#include "train/same_job_cases.h"

namespace mxddp::testing {
namespace {

TEST(SameJobMpi, EveryFieldClassMismatchedOnTheLastRankIsRefusedNamingTheFlag) {
  set_compute_threads(1);
  Communicator& comm = *g_mpi_comm;
  const int odd = comm.size() - 1;
  for (const Mismatch& m : mismatches()) {
    TrainConfig c = small_train_config();
    c.train_iters = 1;
    c.eval_iters = 0;
    if (comm.rank() == odd) m.change(c);
    std::string error;
    try {
      train(comm, c);
    } catch (const Error& e) {
      error = e.what();
    }
    EXPECT_NE(error.find(std::string("\n  ") + m.flag + ":"), std::string::npos) << m.what << ": " << error;
    EXPECT_NE(error.find(fmt::format("on rank {}", odd)), std::string::npos) << m.what << ": " << error;
    EXPECT_NE(error.find(odd == 1 ? "on rank 0" : "on ranks 0, 1, 2"), std::string::npos) << m.what << ": " << error;
  }
  TrainConfig same = small_train_config();
  same.eval_iters = 0;
  EXPECT_EQ(train(comm, same).steps.size(), 4u) << "a matched launch trains";
}

}  // namespace
}  // namespace mxddp::testing
