// How the mxddp command reports a subcommand that failed: one line on stderr, and, under mpirun,
// the end of the whole job, so that a rank that fails alone neither leaves its peers waiting in a
// collective nor waits in MPI_Finalize itself with its message unprinted.
#pragma once

#include <exception>
#include <string>
#include <string_view>

#include <mxddp/comm.h>

namespace mxddp::app {

// "mxddp: error: {what}", or for std::bad_alloc what ran out of memory and what to change.
std::string command_error_text(const std::exception& e, std::string_view subcommand);

// The MPI path of a subcommand: runs fn(); if it throws, ends the whole job with the error text
// naming this rank (MpiRuntime::abort_job, exit status 1). Whatever fn's caller holds stays alive:
// a communicator's destructor could wait on a collective its peers will never join.
template <class Fn>
void run_or_abort_job(std::string_view subcommand, Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    MpiRuntime::abort_job(
        "rank " + std::to_string(MpiRuntime::world_rank()) + ": " + command_error_text(e, subcommand), 1);
  }
}

}  // namespace mxddp::app
