// The MPI test suites share one main (mpi_main.cc): it starts MPI, builds a communicator over
// all processes for the tests to use, runs them, and fails every rank if any rank failed.
#pragma once

#include <mxddp/comm.h>

namespace mxddp::testing {
extern Communicator* g_mpi_comm;  // valid while the tests run
}
