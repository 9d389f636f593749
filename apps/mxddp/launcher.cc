// launcher.h: the launcher's environment and the backend it implies.
#include "launcher.h"

#include <cstdlib>

#include <mxddp/core.h>

namespace mxddp::app {

namespace {

// The integer in environment variable `name`, if it is set and all digits (a launcher writes them).
std::optional<int> env_int(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  int64_t value = 0;
  for (const char* p = text; *p != '\0'; ++p) {
    if (*p < '0' || *p > '9') return std::nullopt;
    value = value * 10 + (*p - '0');
    if (value > (int64_t{1} << 30)) return std::nullopt;
  }
  return static_cast<int>(value);
}

}  // namespace

std::optional<Launcher> detect_mpi_launcher() {
  if (const auto size = env_int("OMPI_COMM_WORLD_SIZE"))
    return Launcher{fmt::format("OMPI_COMM_WORLD_SIZE={}", *size), *size, env_int("OMPI_COMM_WORLD_RANK").value_or(0)};
  if (const auto size = env_int("PMI_SIZE"))
    return Launcher{fmt::format("PMI_SIZE={}", *size), *size, env_int("PMI_RANK").value_or(0)};
  if (const auto rank = env_int("PMIX_RANK")) return Launcher{fmt::format("PMIX_RANK={}", *rank), 0, *rank};
  return std::nullopt;
}

std::string resolve_backend(const std::string& backend, bool ranks_given, int ranks,
                            const std::optional<Launcher>& launcher) {
  MXDDP_CHECK(backend.empty() || backend == "local" || backend == "mpi",
              "--backend '{}' is not a backend; valid: local, mpi", backend);
  if (launcher) {
    const std::string job = launcher->world_size > 0 ? fmt::format("a job of {} processes", launcher->world_size)
                                                     : std::string("an MPI job");
    MXDDP_CHECK(backend != "local" || launcher->world_size == 1,
                "--backend local, but this process was started by an MPI launcher ({}) as rank {} of {}: every process "
                "would run its own copy of the whole job (all writing the same --save directory). Leave out --backend "
                "(the launcher's processes are the ranks) or start mxddp without mpirun to run --ranks threads",
                launcher->evidence, launcher->rank, job);
    MXDDP_CHECK(!ranks_given,
                "--ranks {} under an MPI launcher ({}): the launcher's process count sets the ranks (mpirun -np); "
                "leave out --ranks",
                ranks, launcher->evidence);
    return backend.empty() ? "mpi" : backend;
  }
  MXDDP_CHECK(!(backend == "mpi" && ranks_given),
              "--backend mpi --ranks {} without an MPI launcher would run 1 rank, not {}: start it with "
              "mpirun -np {} (without --ranks), or use the local backend (leave out --backend)",
              ranks, ranks, ranks);
  if (backend.empty()) {
    const auto world = env_int("WORLD_SIZE");
    MXDDP_CHECK(!world || *world <= 1,
                "WORLD_SIZE={} (torchrun's) but no MPI launcher: mxddp's processes join through MPI, so each of "
                "these would run its own copy of the job. Start it with mpirun -np {}, or run one process with "
                "--ranks {} (ranks as threads)",
                *world, *world, *world);
    return "local";
  }
  return backend;
}

}  // namespace mxddp::app
