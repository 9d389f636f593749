// The mxddp command. Subcommands are added as their layers land; each reports errors as one line
// on stderr and a non-zero exit status, never a stack trace.
#include <malloc.h>
#include <pthread.h>
#include <sys/resource.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <optional>

#include <CLI/CLI.hpp>

#include <mxddp/comm.h>
#include <mxddp/memory.h>

#include "ckpt_cmd.h"
#include "cli_checks.h"
#include "command_error.h"
#include "launcher.h"
#include "layout_cmd.h"
#include "plan_cmd.h"
#include "quantize_cmd.h"
#include "selfcheck.h"
#include "data_cmd.h"
#include "train_cmd.h"

namespace {

struct SelfcheckArgs {
  std::string backend;  // "" when not given: the launcher decides (launcher.h)
  int ranks = 4;
  const CLI::Option* ranks_option = nullptr;  // whether --ranks was given
  int64_t count = 4099;  // prime-ish on purpose: splits unevenly across ranks
  int64_t timeout_ms = 60'000;
};

// Prints rank 0's verified lines; returns the number of failures across ranks seen here.
int report(int rank, int size, std::string_view backend, const mxddp::app::SelfcheckResult& r) {
  if (rank == 0) {
    std::printf("selfcheck: %d ranks on the %.*s backend\n", size, static_cast<int>(backend.size()), backend.data());
    for (const auto& line : r.passed) std::printf("  ok    %s\n", line.c_str());
  }
  for (const auto& line : r.failed) std::printf("  FAIL  rank %d: %s\n", rank, line.c_str());
  return static_cast<int>(r.failed.size());
}

int run_selfcheck(int argc, char** argv, const SelfcheckArgs& args) {
  const std::string backend = mxddp::app::resolve_backend(args.backend, args.ranks_option->count() > 0, args.ranks,
                                                          mxddp::app::detect_mpi_launcher());
  if (backend == "mpi") {
    mxddp::MpiRuntime runtime(&argc, &argv);
    int failures = 0;
    std::unique_ptr<mxddp::Communicator> comm;
    mxddp::app::run_or_abort_job("selfcheck", [&] {
      comm = mxddp::make_mpi_communicator({.timeout_ms = args.timeout_ms});
      failures = report(comm->rank(), comm->size(), "mpi", mxddp::app::run_selfcheck(*comm, args.count));
    });
    comm.reset();
    return failures == 0 ? 0 : 1;
  }
  std::mutex mutex;
  int failures = 0;
  mxddp::run_local(
      args.ranks,
      [&](mxddp::Communicator& comm) {
        auto result = mxddp::app::run_selfcheck(comm, args.count);
        std::lock_guard lock(mutex);
        failures += report(comm.rank(), comm.size(), "local", result);
      },
      {.timeout_ms = args.timeout_ms});
  if (failures == 0) std::printf("selfcheck: all collectives match the serial reference on every rank\n");
  return failures == 0 ? 0 : 1;
}

// ---- The process under resource limits (ulimit -f, ulimit -v) ----

// A write past the file-size limit (ulimit -f) raises SIGXFSZ, whose default action kills the
// process without a word and leaves its temporary files. Ignored, the write fails with EFBIG,
// which the writers report naming the file and the limit, cleaning up as after a full disk.
void ignore_file_size_signal() { std::signal(SIGXFSZ, SIG_IGN); }

// glibc loads libgcc_s's unwinder the first time one of its own frames is unwound (an exception
// thrown through pthread_once, as oneDNN's std::call_once does, or a thread's pthread_exit), and
// when that load fails, as it does once memory is exhausted, it aborts the process with
// "libgcc_s.so.1 must be installed for unwinding to work". A thread that exits through
// pthread_exit makes it load now, while memory is plentiful; it stays loaded for the process.
void load_unwinder_now() {
  pthread_t thread;
  if (::pthread_create(&thread, nullptr, [](void*) -> void* { ::pthread_exit(nullptr); }, nullptr) == 0)
    ::pthread_join(thread, nullptr);
}

// Each malloc arena (one per thread that allocates, up to 8 per core) reserves 64 MiB of address
// space. That costs nothing until an address-space limit (ulimit -v) counts it: a two-rank run's
// threads reserved four arenas, 256 MiB of a 300 MiB limit, and failed with nothing of its own
// allocated. Under such a limit the threads share one arena.
void share_one_malloc_arena_under_address_space_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) ::mallopt(M_ARENA_MAX, 1);
}

// OpenMPI maps about 80 MiB as it starts (its components' libraries, shared-memory segments, the
// stacks of its threads) and, when an address-space limit leaves no room for them, fails inside
// MPI_Init with messages of its own or crashes. A process an MPI launcher started under such a
// limit is refused before MPI starts, naming the limit.
constexpr double kMpiStartAddressSpaceBytes = 128.0 * 1024 * 1024;

void check_room_to_start_mpi() {
  const std::optional<mxddp::AddressSpace> space = mxddp::address_space_limit();
  if (!space || !mxddp::app::detect_mpi_launcher()) return;
  const double room = space->limit_bytes - space->mapped_bytes;
  MXDDP_CHECK(room >= kMpiStartAddressSpaceBytes,
              "out of memory: the address-space limit (ulimit -v, RLIMIT_AS) of {} leaves {} beyond the {} this "
              "process maps before MPI starts, and starting MPI needs about {} more (before any of the run's own "
              "memory): raise ulimit -v",
              mxddp::format_bytes(space->limit_bytes), mxddp::format_bytes(room),
              mxddp::format_bytes(space->mapped_bytes), mxddp::format_bytes(kMpiStartAddressSpaceBytes));
}

}  // namespace

// Every allocation of the command that fails throws mxddp::OutOfMemory, a std::bad_alloc naming
// the bytes asked for, rather than a bare std::bad_alloc. (Sanitizer builds keep their own
// operator new, which checks each new against its delete.) The default operator delete frees
// with std::free, which matches std::malloc here.
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
void* operator new(std::size_t bytes) {
  for (;;) {
    if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
    const std::new_handler handler = std::get_new_handler();
    if (handler == nullptr) throw mxddp::OutOfMemory(bytes);
    handler();
  }
}
void* operator new[](std::size_t bytes) { return ::operator new(bytes); }
#endif

int main(int argc, char** argv) {
  share_one_malloc_arena_under_address_space_limit();  // before any thread allocates
  ignore_file_size_signal();
  load_unwinder_now();
  CLI::App app{"mxddp: memory-lean data-parallel training runtime"};
  app.set_version_flag("--version", std::string("mxddp ") + MXDDP_VERSION);
  app.require_subcommand(1);

  SelfcheckArgs selfcheck;
  auto* cmd = app.add_subcommand("selfcheck", "Run every collective on every dtype and check it against a serial reference");
  cmd->add_option("--backend", selfcheck.backend,
                  "local (ranks as threads) or mpi; default: mpi under an MPI launcher (mpirun, srun), else local")
      ->check(CLI::IsMember({"local", "mpi"}));
  selfcheck.ranks_option = cmd->add_option("--ranks", selfcheck.ranks, "Ranks of the local backend (under mpirun, -np sets them)")
                               ->transform(mxddp::app::integer_in(1, 256))
                               ->capture_default_str();
  cmd->add_option("--count", selfcheck.count, "Elements per rank per collective")
      ->transform(mxddp::app::integer_in(1, int64_t{1} << 28))->capture_default_str();
  cmd->add_option("--timeout-ms", selfcheck.timeout_ms, "How long a rank waits for its peers (mpi: then aborts the job)")
      ->transform(mxddp::app::integer_in(1, mxddp::app::kTimeoutMsMax))->capture_default_str();

  mxddp::app::LayoutArgs layout;
  auto* layout_cmd = mxddp::app::add_layout_command(app, layout);
  mxddp::app::QuantizeArgs quantize;
  auto* quantize_cmd = mxddp::app::add_quantize_command(app, quantize);
  mxddp::app::TrainArgs train;
  auto* train_cmd = mxddp::app::add_train_command(app, train);
  mxddp::app::PlanArgs plan;
  auto* plan_cmd = mxddp::app::add_plan_command(app, plan);
  mxddp::app::CkptArgs ckpt;
  auto* ckpt_cmd = mxddp::app::add_ckpt_command(app, ckpt);
  mxddp::app::DataArgs data;
  auto* data_cmd = mxddp::app::add_data_command(app, data);

  // CLI11's own parse errors read as mxddp's do.
  app.failure_message([](const CLI::App* failed, const CLI::Error& e) {
    return "mxddp: error: " + CLI::FailureMessage::simple(failed, e);
  });
  try {
    mxddp::app::check_no_empty_arguments(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mxddp: error: %s\n", e.what());
    return 1;
  }
  CLI11_PARSE(app, argc, argv);
  const std::string subcommand = app.get_subcommands().front()->get_name();
  try {
    if (cmd->parsed() || train_cmd->parsed()) check_room_to_start_mpi();
    if (cmd->parsed()) return run_selfcheck(argc, argv, selfcheck);
    if (train_cmd->parsed()) return mxddp::app::run_train_command(argc, argv, train);
    if (plan_cmd->parsed()) mxddp::app::run_plan_command(plan);
    if (layout_cmd->parsed()) mxddp::app::run_layout_command(layout);
    if (ckpt_cmd->parsed()) return mxddp::app::run_ckpt_command(ckpt);
    if (quantize_cmd->parsed()) mxddp::app::run_quantize_command(quantize);
    if (data_cmd->parsed()) mxddp::app::run_data_command(data);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", mxddp::app::command_error_text(e, subcommand).c_str());
    return 1;
  }
  return 0;
}
