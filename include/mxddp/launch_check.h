// mxddp launch check: every rank of a job runs the same job.
//
// Owns: JobField, check_same_job, throw_if_any_rank_failed.
//
// A launcher can start ranks with different arguments (mpirun's MPMD form `-np 1 A : -np 1 B`, a
// script that builds flags per host). Ranks that disagree on what must agree train a silent wrong
// model (each rank updates its own shard with its own learning rate) or stall in a collective whose
// sizes no longer match. check_same_job compares what each rank says the job is, at startup, and
// refuses the launch on every rank together with one message that names each field that differs
// and the ranks holding each value. PyTorch DDP checks param shapes across ranks; Megatron does not
// check; this checks every field the caller lists.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <mxddp/comm.h>

namespace mxddp {

// One thing every rank must agree on: its name as the user knows it (the flag, e.g. "--lr", or a
// description such as "data checksum") and its value as text.
struct JobField {
  std::string name;
  std::string value;
  bool operator==(const JobField&) const = default;
};

// Collective (two all-gathers of bytes). Throws Error on every rank, with the same message, when the
// ranks' fields differ: for each differing name (in the first rank's order, then names some ranks
// lack), its values and the ranks holding each ("--lr: 0.001 on rank 0; 0.005 on rank 1"). `what`
// says what the fields describe ("mxddp train's flags"). Nothing else is communicated when they agree.
void check_same_job(Communicator& comm, const std::vector<JobField>& fields, std::string_view what);

// Collective (two all-gathers of bytes). Each rank passes its own error, "" for none; when any rank
// has one, throws Error on every rank naming each failing rank and its message, so that a failure
// one rank sees (a file it cannot open) ends every rank instead of leaving the others waiting in
// their next collective.
void throw_if_any_rank_failed(Communicator& comm, const std::string& error);

}  // namespace mxddp
