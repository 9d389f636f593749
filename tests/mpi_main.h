// The MPI test suites share one main (mpi_main.cc): it starts MPI, builds a communicator over
// all processes for the tests to use, runs them, and fails every rank if any rank failed.
#pragma once

#include <mxddp/comm.h>

#include <string>

namespace mxddp::testing {
extern Communicator* g_mpi_comm;  // valid while the tests run

// A path under the temp dir named by rank 0 (stem + its pid), the same on every process.
std::string shared_temp_dir(const std::string& stem);
}
