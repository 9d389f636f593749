// `mxddp selfcheck`: the main job until training lands. Runs every collective on every dtype
// across the ranks of a communicator and checks each result against a serial reference that
// every rank computes on its own from the same deterministic inputs.
#pragma once

#include <string>
#include <vector>

#include <mxddp/comm.h>

namespace mxddp::app {

struct SelfcheckResult {
  std::vector<std::string> passed;  // one line per verified (collective, dtype, op, count)
  std::vector<std::string> failed;
};

// Collective over `comm`; every rank must call it. count is the per-rank element count.
SelfcheckResult run_selfcheck(Communicator& comm, int64_t count);

}  // namespace mxddp::app
