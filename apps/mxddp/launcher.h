// Which backend a command runs on, from --backend, --ranks and the launcher that started it.
//
// Under mpirun (or srun, or MPICH's mpiexec) every process is one rank of the job, so the local
// backend would make N independent copies of the run, all writing the same --save directory; and
// --ranks means nothing when the launcher decides the ranks. So, as torchrun users expect from
// WORLD_SIZE/RANK, the launcher's environment picks the MPI backend when --backend is not given,
// and a flag that contradicts it is an error naming both:
//   --backend local under a launcher of more than one process,
//   --ranks N under a launcher (the launcher's -np decides),
//   --backend mpi --ranks N without one (it would run 1 rank, not N),
//   torchrun's WORLD_SIZE > 1 without an MPI launcher (mxddp's processes join through MPI).
// Open MPI 4.1 under mpirun sets OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_RANK; PMIx launchers
// (Open MPI 5, Slurm's srun --mpi=pmix) set PMIX_RANK; MPICH's Hydra and Intel MPI set PMI_SIZE and
// PMI_RANK.
#pragma once

#include <optional>
#include <string>

namespace mxddp::app {

struct Launcher {
  std::string evidence;  // what was seen, e.g. "OMPI_COMM_WORLD_SIZE=4"
  int world_size = 0;    // 0: the launcher does not say (PMIx without a size); MPI will tell
  int rank = 0;
};

// The MPI launcher this process runs under, read from the environment; nullopt if none.
std::optional<Launcher> detect_mpi_launcher();

// The backend to run ("local" or "mpi"). backend: --backend as given, "" if not given; ranks_given:
// whether --ranks was on the command line (ranks: its value). Throws Error on a contradiction.
std::string resolve_backend(const std::string& backend, bool ranks_given, int ranks,
                            const std::optional<Launcher>& launcher);

}  // namespace mxddp::app
