// `mxddp train`: see train_cmd.h. Rank 0 prints and writes the report; every rank trains.
#include "train_cmd.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include <mxddp/comm.h>
#include <mxddp/launch_check.h>
#include <mxddp/output_file.h>
#include <mxddp/quant.h>

#include "cli_checks.h"
#include "command_error.h"
#include "hf_train_flags.h"
#include "launcher.h"
#include "megatron_flags.h"
#include "metrics_log.h"
#include "train_report.h"

namespace mxddp::app {

namespace {

// The value checks of the flags (cli_checks.h), bounded by the type each flag is stored in.
constexpr int64_t kIntMax = std::numeric_limits<int>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr double kFloatMax = std::numeric_limits<float>::max();
// The built-in corpus is generated in memory at startup; 1 GiB is far past any test run's needs.
constexpr int64_t kCorpusBytesMax = int64_t{1} << 30;
// More matrix-product threads per rank than any machine has cores is a typo, not a setting.
constexpr int64_t kComputeThreadsMax = 4096;
const CLI::Validator kPositiveInt = integer_in(1, kIntMax);
const CLI::Validator kPositiveInt64 = integer_in(1, kInt64Max);
const CLI::Validator kIterations = integer_in(0, kInt64Max);
const CLI::Validator kNonNegativeFloat = real_in(0, kFloatMax, Storage::kFloat);

// The signals --exit-signal can name (Megatron's spellings: signal.Signals names).
struct StopSignal {
  int number;
  const char* name;
};
constexpr std::array<StopSignal, 4> kStopSignals = {
    {{SIGTERM, "SIGTERM"}, {SIGINT, "SIGINT"}, {SIGUSR1, "SIGUSR1"}, {SIGUSR2, "SIGUSR2"}}};
std::vector<std::string> stop_signal_names() {
  std::vector<std::string> names;
  for (const StopSignal& s : kStopSignals) names.emplace_back(s.name);
  return names;
}

// The check of a described field's range (config_fields.h) for a flag stored as T: an infinite end
// is T's own limit.
template <typename T>
CLI::Validator range_validator(const FieldRange& r) {
  if constexpr (std::is_integral_v<T>) {
    MXDDP_ASSERT(!r.open_low && !r.open_high);  // an integer range is written closed
    const int64_t lo = std::isinf(r.lo) ? int64_t{std::numeric_limits<T>::min()} : static_cast<int64_t>(r.lo);
    const int64_t hi = std::isinf(r.hi) ? static_cast<int64_t>(std::numeric_limits<T>::max()) : static_cast<int64_t>(r.hi);
    return integer_in(lo, hi);
  } else {
    static_assert(std::is_floating_point_v<T>);
    constexpr double kMax = std::numeric_limits<T>::max();
    MXDDP_ASSERT(!(r.open_low && r.open_high));
    return real_in(std::isinf(r.lo) ? -kMax : r.lo, std::isinf(r.hi) ? kMax : r.hi,
                   std::is_same_v<T, float> ? Storage::kFloat : Storage::kDouble,
                   r.open_low ? Ends::kOpenLow : r.open_high ? Ends::kOpenHigh : Ends::kClosed);
  }
}

// An enum flag (FieldEnum<E>): one of the names, stored parsed; the default shown is value's name.
template <typename E>
CLI::Option* add_enum_option(CLI::App* group, const std::string& flags, E& value, const std::string& help) {
  return group
      ->add_option_function<std::string>(flags, [&value](const std::string& name) { value = FieldEnum<E>::parse(name); },
                                         help)
      ->check(CLI::IsMember(FieldEnum<E>::names()))
      ->default_str(std::string(FieldEnum<E>::name(value)));
}

// A tri-state flag (a std::optional<bool> field): flags "--x,!--no-x" (CLI11's spelling of a
// negation) become two flags that exclude each other; --x sets true, --no-x false, neither leaves
// the field unset. Returns --x's option.
CLI::Option* add_tri_state_flags(CLI::App* group, std::string_view flags, std::optional<bool>& value,
                                 const std::string& help) {
  std::string on, off;
  while (!flags.empty()) {
    const size_t comma = flags.find(',');
    const std::string_view flag = flags.substr(0, comma);
    flags = comma == std::string_view::npos ? std::string_view{} : flags.substr(comma + 1);
    std::string& into = flag.starts_with('!') ? off : on;
    into += fmt::format("{}{}", into.empty() ? "" : ",", flag.starts_with('!') ? flag.substr(1) : flag);
  }
  MXDDP_ASSERT(!on.empty() && !off.empty());
  CLI::Option* on_option = group->add_flag_callback(on, [&value] { value = true; }, help);
  CLI::Option* off_option =
      group->add_flag_callback(off, [&value] { value = false; }, fmt::format("Explicitly off (see {})", on));
  on_option->excludes(off_option);
  return on_option;
}

// A flag for every described field of config that has one (config_fields.h), bound to the field's
// member, except the fields `skip` names (their flag is registered with another config's);
// returns them by field name.
template <typename Config>
std::map<std::string_view, CLI::Option*> add_field_options(CLI::App* group, Config& config,
                                                           bool (*skip)(std::string_view) = nullptr) {
  std::map<std::string_view, CLI::Option*> options;
  for_each_field(config, [&](const auto& field, auto& value) {
    using T = std::remove_cvref_t<decltype(value)>;
    if (!field.has_flag() || (skip != nullptr && skip(field.name))) return;
    const std::string flags(field.flags), help(field.help);
    CLI::Option* option = nullptr;
    if constexpr (std::is_same_v<T, bool>) option = group->add_flag(flags, value, help);
    else if constexpr (NamedEnum<T>) option = add_enum_option(group, flags, value, help);
    else if constexpr (std::is_same_v<T, std::optional<bool>>) option = add_tri_state_flags(group, flags, value, help);
    else if constexpr (kIsOptional<T>)
      option = group->add_option(flags, value, help)->transform(range_validator<typename T::value_type>(field.range));
    else option = group->add_option(flags, value, help)->transform(range_validator<T>(field.range));
    options[field.name] = option;
  });
  return options;
}

}  // namespace

CLI::App* add_train_command(CLI::App& app, TrainArgs& a) {
  auto* cmd = app.add_subcommand("train", "Train the reference GPT with data parallelism");
  add_train_flags(cmd, a);
  return cmd;
}

void add_train_flags(CLI::App* cmd, TrainArgs& a) {
  TrainConfig& c = a.config;
  // A later flag overrides an earlier one (scripts append overrides to a base command line).
  cmd->option_defaults()->always_capture_default()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->add_option("--backend", a.backend,
                  "local (ranks as threads) or mpi; default: mpi under an MPI launcher (mpirun, srun), else local")
      ->check(CLI::IsMember({"local", "mpi"}));
  a.ranks_option =
      cmd->add_option("--ranks", a.ranks, "Ranks of the local backend (under mpirun, -np sets them)")->transform(integer_in(1, 256));
  cmd->add_option("--timeout-ms", a.timeout_ms, "How long a rank waits for its peers (mpi: then aborts the job)")
      ->transform(integer_in(1, kTimeoutMsMax));

  auto* model = cmd->add_option_group("model");
  a.model_option = model->add_option("--model", a.model, "Preset: tiny, small (~10.8M params) or gpt2-124m (GPT-2 small's shape)")
      ->check(CLI::IsMember(gpt_preset_names()));
  // GptConfig's flags override the preset's values once it is known (finish_config).
  for_each_field<GptConfig>([&](const auto& field) {
    using T = typename std::remove_cvref_t<decltype(field)>::value_type;
    if (!field.has_flag()) return;
    model
        ->add_option_function<T>(
            std::string(field.flags),
            [&a, member = field.member](const T& v) { a.model_overrides.push_back([member, v](GptConfig& m) { m.*member = v; }); },
            fmt::format("Override the preset's {}", field.help))
        ->transform(range_validator<T>(field.range));
  });
  model->add_flag("--recompute-activations", a.recompute_activations,
                  "Re-run each layer whole in backward, keeping only its input (= --recompute-granularity full; "
                  "Megatron's flag means selective)");
  model->add_option("--recompute-granularity", a.recompute_granularity,
                    "Activation recompute: full (each layer re-runs whole in backward) or selective (only "
                    "--recompute-modules re-run)");
  // Each occurrence replaces the list (trigger_on_parse clears it), so a later flag overrides an
  // earlier one as every other flag does instead of adding to it.
  model->add_option("--recompute-modules", a.recompute_modules,
                    "With --recompute-granularity selective: any of core_attn, mlp, layernorm, space- or "
                    "comma-separated (default: core_attn)")
      ->delimiter(',')
      ->trigger_on_parse();
  model->add_flag("--bf16", c.bf16, "BF16 matrix products with F32 accumulation (F32 on CPUs without native BF16)");

  auto* batch = cmd->add_option_group("batch and schedule");
  batch->add_option("--micro-batch-size", c.micro_batch_size, "Sequences per rank per micro-batch")->transform(kPositiveInt);
  batch->add_option("--global-batch-size", c.global_batch_size, "Sequences per iteration (accumulation = global / (micro x dp))")
      ->transform(kPositiveInt);
  batch->add_option("--train-iters", c.train_iters, "Iterations (optimizer steps) in all, counting resumed ones")
      ->transform(kIterations);
  batch->add_option("--lr", c.lr, "Peak learning rate")->transform(kNonNegativeFloat);
  batch->add_option("--min-lr", c.min_lr, "Learning rate at the end of the decay")->transform(kNonNegativeFloat);
  batch->add_option("--lr-warmup-iters", c.lr_warmup_iters, "Linear warmup iterations")->transform(kIterations);
  batch->add_option("--lr-decay-iters", c.lr_decay_iters, "Decay ends here (0: --train-iters)")->transform(kIterations);
  add_enum_option(batch, "--lr-decay-style", c.lr_decay_style, "cosine, linear or constant");

  auto* opt = cmd->add_option_group("optimizer");
  add_field_options(opt, c.optimizer);  // OptimizerConfig's described fields (optim.h)

  auto* ddp = cmd->add_option_group("data parallelism (DdpConfig; the distributed optimizer is always on)");
  // DdpConfig's described fields (ddp.h).
  a.bucket_size_option = add_field_options(ddp, c.ddp).at("bucket_size");

  // FsdpConfig's described fields (fsdp.h) but those it shares with DdpConfig, whose flags are
  // DdpConfig's above; finish_train_config copies their values.
  std::string shared_flags;
  for_each_field<FsdpConfig>([&](const auto& field) {
    if (field.has_flag() && is_shared_data_parallel_field<FsdpConfig>(field.name))
      shared_flags += fmt::format("{}{}", shared_flags.empty() ? "" : ", ", field.flags);
  });
  auto* fsdp = cmd->add_option_group(fmt::format("fully sharded data parallel (FsdpConfig; {} apply too)", shared_flags));
  fsdp->add_flag("--use-megatron-fsdp", c.use_megatron_fsdp, "FSDP instead of DDP: each decoder layer is a unit");
  add_field_options(fsdp, c.fsdp, is_shared_data_parallel_field<FsdpConfig>);

  auto* data = cmd->add_option_group("data, evaluation and checkpoints");
  data->add_option("--seed", c.seed, "Seed of the initialization and the sampling")
      ->transform(unsigned_in(0, std::numeric_limits<uint64_t>::max()));
  data->add_option("--data", c.data_path,
                   "Text file to train on, as bytes, or an indexed dataset's PREFIX (default: the built-in corpus)")
      ->transform(non_empty_path());
  data->add_option("--corpus-bytes", c.corpus_bytes, "Size of the built-in corpus (generated in memory)")
      ->transform(integer_in(1, kCorpusBytesMax));
  a.data.valid_fraction_option =
      data->add_option("--valid-fraction", c.valid_fraction, "Fraction of a text's bytes kept for validation")
          ->transform(real_in(0, 0.99, Storage::kDouble));
  data->add_option("--eval-interval", c.eval_interval, "Validation every N iterations (0: only at the end)")
      ->transform(kIterations);
  data->add_option("--eval-iters", c.eval_iters, "Global batches per validation (0: none)")
      ->transform(integer_in(0, std::numeric_limits<int>::max()));
  data->add_option("--save", c.save_dir,
                   "Checkpoint history: each save in DIR/iter_0000100/ (written atomically), "
                   "DIR/latest_checkpointed_iteration.txt naming the newest (Megatron's layout)")
      ->transform(non_empty_path());
  data->add_option("--save-interval", c.save_interval, "Save every N iterations (and at the end)")->transform(kIterations);
  data->add_option("--keep-last", c.keep_last, "Keep only the newest N saves in --save (0: all)")
      ->transform(integer_in(0, kIntMax));
  data->add_option("--load", c.load_dir,
                   "Resume from a --save directory's newest checkpoint, or from one checkpoint (an iter_ directory); "
                   "any data-parallel size")
      ->transform(non_empty_path());
  add_hf_train_flags(data, a);  // --load-hf, --skip-train
  data->add_flag("--check-for-nan-in-loss-and-grad,!--no-check-for-nan-in-loss-and-grad", c.check_for_nan_in_loss_and_grad,
                 "Stop on a NaN or Inf loss or gradient, naming the iteration and params (default: on); off, such "
                 "iterations are skipped and counted in the report");
  data->add_option("--check-weight-hash-across-dp-replicas-interval", c.check_weight_hash_across_dp_replicas_interval,
                   "Every N iterations compare hashes of the model params across data-parallel ranks and stop on a "
                   "mismatch, naming the params and ranks (0: never)")
      ->transform(kIterations)
      ->capture_default_str();

  add_data_flags(cmd, a.data);
  add_megatron_flags(cmd, a.megatron);

  auto* exit = cmd->add_option_group("stopping early (Megatron's flags; each saves first when --save is given)");
  exit->add_option("--exit-interval", c.exit_interval, "Stop after an iteration divisible by N (0: never)")
      ->transform(kIterations);
  exit->add_option("--exit-duration-in-mins", c.exit_duration_in_mins,
                   "Stop after the first iteration that ends this many minutes after the start (0: never)")
      ->transform(kNonNegativeFloat);
  CLI::Option* handler =
      exit->add_flag("--exit-signal-handler", a.exit_signal_handler,
                     "On SIGTERM or SIGUSR1 (or --exit-signal's), finish the current iteration, save, and exit with "
                     "status 0 (a preempted job loses nothing). Under mpirun, send SIGUSR1 to mpirun: it passes "
                     "SIGUSR1 on, but kills the ranks 1 s after passing on a SIGTERM (docs/train.md, Stopping cleanly)");
  exit->add_option("--exit-signal", a.exit_signal,
                   "With --exit-signal-handler, the one signal that stops the run (Megatron's flag; default: SIGTERM "
                   "and SIGUSR1)")
      ->check(CLI::IsMember(stop_signal_names()))
      ->needs(handler);

  auto* out = cmd->add_option_group("output");
  out->add_option("--report", a.report, "Write a JSON report here")->transform(non_empty_path());
  out->add_option("--metrics-file", a.metrics_file,
                  "Write one JSON line per iteration and per validation here as training goes (appended to with "
                  "--load); scripts/plot_metrics.py draws it")
      ->transform(non_empty_path());
  a.log_interval_option =
      out->add_option("--log-interval", a.log_interval,
                      "A plain log line every N iterations (0: about 20 lines), also on a terminal (which otherwise "
                      "shows a progress bar)")
          ->transform(kIterations);
  out->add_option("--compute-threads,--blas-threads", c.compute_threads,
                  "Matrix-product threads per rank (0: cores / ranks on this machine)")
      ->transform(integer_in(0, kComputeThreadsMax));
}

namespace {

// --exit-signal-handler. Receiving a signal stores it (a lock-free atomic store is
// async-signal-safe) and writes a line made beforehand (write(2) is async-signal-safe too); the
// training loop polls the flag after each iteration (TrainCallbacks::stop_requested).
//
// The signals are received by one thread of their own, never by a thread that computes: oneDNN's
// generated GEMM kernels (gemm:jit, which the attention products use) point the stack pointer into
// the heap while they run (oneDNN issue 4845, fixed in 3.12; Debian 12 ships 2.6), so a signal
// handled on a thread inside one writes its frame there and corrupts the heap (about one run in
// ten crashed that way under mpirun). So the stop signals are blocked before any other thread
// exists (MPI's, OpenMP's and the local ranks' threads inherit the mask) and the thread waits for
// them with sigwait().
static_assert(std::atomic<int>::is_always_lock_free);
std::atomic<int> g_stop_signal{0};  // the last stop signal received; 0: none
// What the handler writes for each of kStopSignals; written before the handler is installed and
// never after, so the handler only reads it. Plain arrays: nothing to destroy at exit, when a late
// signal can still arrive.
struct ReceivedLine {
  std::array<char, 1024> text{};
  size_t size = 0;
};
std::array<ReceivedLine, kStopSignals.size()> g_received_lines;

extern "C" void on_stop_signal(int number) {
  g_stop_signal.store(number);
  for (size_t i = 0; i < kStopSignals.size(); ++i)
    if (kStopSignals[i].number == number)
      static_cast<void>(::write(STDOUT_FILENO, g_received_lines[i].text.data(), g_received_lines[i].size));
}

// The thread that receives the blocked stop signals, for the life of the process (detached: exit
// does not wait for it, and it owns nothing to destroy).
void receive_stop_signals(sigset_t signals) {
  for (;;) {
    int number = 0;
    if (sigwait(&signals, &number) == 0) on_stop_signal(number);
  }
}

const char* stop_signal_name(int number) {
  for (const StopSignal& s : kStopSignals)
    if (s.number == number) return s.name;
  return "?";
}

// The line a rank prints when the signal arrives: who got it, and what happens now.
std::string received_line(const char* signal_name, const TrainArgs& a) {
  const std::optional<Launcher> launcher = detect_mpi_launcher();
  const std::string who = launcher ? fmt::format("rank {} (pid {})", launcher->rank, ::getpid())
                                   : fmt::format("(pid {})", ::getpid());
  const std::string save = a.config.save_dir.empty() ? " (no --save: nothing is saved)"
                                                     : fmt::format(" and saves it to '{}'", a.config.save_dir);
  return fmt::format("mxddp train {}: received {}: every rank stops after the current iteration{}\n", who,
                     signal_name, save);
}

// Catches --exit-signal's signal, or SIGTERM and SIGUSR1: SIGTERM is what Slurm, Kubernetes and a
// plain kill send; SIGUSR1 is what mpirun forwards without killing the ranks after it.
void install_stop_signal_handler(const TrainArgs& a) {
  sigset_t caught_set;
  sigemptyset(&caught_set);
  for (size_t i = 0; i < kStopSignals.size(); ++i) {
    const StopSignal& s = kStopSignals[i];
    const bool caught = a.exit_signal.empty() ? (s.number == SIGTERM || s.number == SIGUSR1) : a.exit_signal == s.name;
    if (!caught) continue;
    const std::string line = received_line(s.name, a);
    ReceivedLine& slot = g_received_lines[i];
    slot.size = std::min(line.size(), slot.text.size());  // a --save path near PATH_MAX is cut short
    std::copy_n(line.begin(), slot.size, slot.text.begin());
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    action.sa_flags = SA_RESTART;  // a system call the signal lands in goes on, as it would without the handler
    sigemptyset(&action.sa_mask);
    MXDDP_CHECK(sigaction(s.number, &action, nullptr) == 0, "--exit-signal-handler: cannot install a {} handler: {}",
                s.name, std::strerror(errno));
    sigaddset(&caught_set, s.number);
  }
  // The handler stays installed: it replaces a SIG_IGN inherited from the launcher (sigwait never
  // sees an ignored signal), and it would serve a thread started before this point, if there were one.
  const int rc = pthread_sigmask(SIG_BLOCK, &caught_set, nullptr);
  MXDDP_CHECK(rc == 0, "--exit-signal-handler: cannot block the stop signals: {}", std::strerror(rc));
  std::thread(receive_stop_signals, caught_set).detach();
}

// Rank 0's view of the run on stdout (under MPI only rank 0 writes): a bar redrawn in place on an
// interactive terminal, plain lines otherwise. Plain lines use Megatron's field names, so the greps
// and parsers written for Megatron's logs read them; averages cover the iterations since the
// previous line. mpirun gives its ranks a pseudo-terminal, so under an MPI launcher the output is
// a log however it looks, and --log-interval asks for lines on a terminal too.
class Progress {
 public:
  Progress(int64_t total, int64_t log_interval, bool bar)
      : total_(total), bar_(bar), log_interval_(log_interval > 0 ? log_interval : std::max<int64_t>(1, total / 20)) {}

  void step(const StepRecord& r, int64_t tokens_per_iteration, int global_batch) {
    ms_sum_ += r.step_ms;
    ++steps_;
    interval_ms_ += r.step_ms;
    ++interval_steps_;
    interval_skipped_ += r.skipped ? 1 : 0;
    const double ms_per_iter = ms_sum_ / static_cast<double>(steps_);
    const auto eta_s = static_cast<int64_t>(static_cast<double>(total_ - r.iteration) * ms_per_iter / 1e3);
    if (bar_) {
      const double tokens_per_s = static_cast<double>(tokens_per_iteration) / (ms_per_iter / 1e3);
      constexpr int kWidth = 24;
      const int filled = static_cast<int>(kWidth * r.iteration / std::max<int64_t>(1, total_));
      std::printf("\r[%s%s] %lld/%lld loss %.4f | %.1fk tok/s | ETA %lld:%02lld ", std::string(static_cast<size_t>(filled), '#').c_str(),
                  std::string(static_cast<size_t>(kWidth - filled), '.').c_str(), static_cast<long long>(r.iteration),
                  static_cast<long long>(total_), r.loss, tokens_per_s / 1e3, static_cast<long long>(eta_s / 60),
                  static_cast<long long>(eta_s % 60));
      line_open_ = true;
    } else if (r.iteration % log_interval_ == 0 || r.iteration == total_ || steps_ == 1) {
      const double interval_ms_per_iter = interval_ms_ / static_cast<double>(interval_steps_);
      std::printf(" iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per iteration (ms): %.1f | "
                  "tokens per second: %.0f | learning rate: %.6E | global batch size: %5d | lm loss: %.6E | "
                  "grad norm: %.3f | number of skipped iterations: %3lld | ETA (s): %lld |\n",
                  static_cast<long long>(r.iteration), static_cast<long long>(total_),
                  static_cast<long long>(r.consumed_samples), interval_ms_per_iter,
                  static_cast<double>(tokens_per_iteration) / (interval_ms_per_iter / 1e3), r.lr, global_batch, r.loss,
                  r.grad_norm, static_cast<long long>(interval_skipped_), static_cast<long long>(eta_s));
      interval_ms_ = 0;
      interval_steps_ = 0;
      interval_skipped_ = 0;
    }
    std::fflush(stdout);
  }
  void message(const std::string& text) {
    if (line_open_) std::printf("\n");
    line_open_ = false;
    std::printf("%s\n", text.c_str());
    std::fflush(stdout);
  }

 private:
  int64_t total_;
  bool bar_;
  int64_t log_interval_;
  double ms_sum_ = 0;
  int64_t steps_ = 0;
  double interval_ms_ = 0;  // since the last plain line
  int64_t interval_steps_ = 0, interval_skipped_ = 0;
  bool line_open_ = false;
};

// metrics: --metrics-file's log, or null.
TrainCallbacks rank0_callbacks(Progress& progress, MetricsLog* metrics, const TrainConfig& c) {
  TrainCallbacks cb;
  const int64_t tokens = int64_t{c.global_batch_size} * c.model.seq_length;
  cb.on_step = [&progress, metrics, tokens, batch = c.global_batch_size](const StepRecord& r) {
    if (metrics != nullptr) metrics->iteration(r, tokens);
    progress.step(r, tokens, batch);
  };
  cb.on_eval = [&progress, metrics](const EvalRecord& e) {
    if (metrics != nullptr) metrics->validation(e);
    progress.message(fmt::format("validation at iter {}: loss {:.4f}", e.iteration, e.loss));
  };
  cb.on_warning = [&progress](const std::string& message) { progress.message("warning: " + message); };
  cb.on_save = [&progress](int64_t it, const std::string& dir) {
    progress.message(fmt::format("saved checkpoint at iter {} to {}", it, dir));
  };
  return cb;
}

void print_summary(const TrainConfig& c, const TrainResult& r, int dp) {
  if (c.skip_train) return print_skip_train_summary(c, r);
  if (r.steps.empty()) {
    std::printf("nothing to train: the checkpoint is at iteration %lld of %lld\n", static_cast<long long>(r.start_iteration),
                static_cast<long long>(c.train_iters));
    return;
  }
  std::printf("trained iterations %lld..%lld: loss %.4f -> %.4f (unigram entropy of the data %.4f nats)\n",
              static_cast<long long>(r.steps.front().iteration), static_cast<long long>(r.steps.back().iteration),
              r.steps.front().loss, r.steps.back().loss, r.unigram_entropy);
  // A stop requested by a signal skips the evaluation due at its iteration: the last one is older.
  if (!r.evals.empty() && r.evals.back().iteration == r.steps.back().iteration)
    std::printf("final validation loss %.4f\n", r.evals.back().loss);
  else if (!r.evals.empty())
    std::printf("last validation loss %.4f (after iteration %lld)\n", r.evals.back().loss,
                static_cast<long long>(r.evals.back().iteration));
  std::printf("throughput %.0f tokens/s on %d ranks, %.2f GFLOP/s of model math\n", r.tokens_per_second, dp,
              r.tokens_per_second * c.model.train_flops_per_token() / 1e9);
  const RankMemory& m = r.memory_by_rank.front();
  std::printf("rank 0 memory, steady-state peak (MiB):");
  for (int k = 0; k < kNumMemoryCategories; ++k) {
    const auto cat = static_cast<MemoryCategory>(k);
    if (m.steady.peak(cat) > 0)
      std::printf(" %s %.2f", std::string(memory_category_name(cat)).c_str(), static_cast<double>(m.steady.peak(cat)) / 1048576.0);
  }
  std::printf(" | total %.2f; scratch allocations after the first iteration: %lld\n",
              static_cast<double>(m.steady.total_peak_bytes) / 1048576.0,
              static_cast<long long>(m.scratch_allocations_after_warmup));
  const auto& slot = m.peak_gathered_bytes_by_slot;
  if (c.use_megatron_fsdp && slot[0] + slot[1] + slot[2] > 0)
    std::printf("FSDP peak gathered bytes per rank (each its own peak): values %lld, row-wise %lld, column-wise %lld\n",
                static_cast<long long>(slot[0]), static_cast<long long>(slot[1]), static_cast<long long>(slot[2]));
}


// ", selective recompute of core_attn mlp" for the banner; nothing without recompute.
std::string recompute_banner(const TrainConfig& c) {
  switch (c.recompute_granularity) {
    case RecomputeGranularity::kNone: return "";
    case RecomputeGranularity::kFull: return ", full recompute";
    case RecomputeGranularity::kSelective:
      return fmt::format(", selective recompute of {}", recompute_modules_names(c.recompute_modules));
  }
  return "";
}

// An output file this run writes, checked before the run starts: its missing parent directories
// created (as its writer would), what check_output_file_path checks (not a directory, FIFO, device
// or link), and then a probe file created beside it, written and removed, which finds what the
// types cannot: a read-only mount, a directory this user cannot write, a full disk, a file system
// that holds no files (/proc). in_place: the file is written where it is (--metrics-file), so an
// existing one must also open for writing; otherwise it is replaced by a rename and only its
// directory counts (--report). Throws Error naming what and path.
void check_output_writable(const std::string& path, std::string_view what, bool in_place) {
  const std::filesystem::path parent = std::filesystem::absolute(path).parent_path();
  std::error_code create_ec, ec;
  std::filesystem::create_directories(parent, create_ec);
  MXDDP_CHECK(std::filesystem::is_directory(parent, ec), "{} '{}': {} is not a directory and cannot be created{}", what,
              path, parent.string(), create_ec ? " (" + create_ec.message() + ")" : "");
  check_output_file_path(path, what);
  char host[256] = "host";
  ::gethostname(host, sizeof host - 1);
  const std::string probe = (parent / fmt::format(".{}.{}.{}.probe", std::filesystem::path(path).filename().string(),
                                                  host, ::getpid())).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  MXDDP_CHECK(fd >= 0, "{} '{}' cannot be written: a file cannot be created in {} ({})", what, path, parent.string(),
              std::strerror(errno));
  const bool written = ::write(fd, "\n", 1) == 1;
  const int write_errno = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  MXDDP_CHECK(written, "{} '{}' cannot be written: writing a byte to a new file in {} failed ({})", what, path,
              parent.string(), std::strerror(write_errno));
  if (!in_place || !std::filesystem::exists(std::filesystem::symlink_status(path, ec))) return;
  const int existing = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC | O_NOFOLLOW);  // changes nothing
  MXDDP_CHECK(existing >= 0, "{} '{}' exists and cannot be opened for writing ({})", what, path, std::strerror(errno));
  ::close(existing);
}

// Every output of the run, checked on this process before any rank starts, so that one that
// cannot be written fails the run now and not after its iterations. --save's contents, its lock
// and whether every rank sees rank 0's directory are train()'s checks (Trainer::check_run).
void check_outputs(const TrainArgs& a) {
  if (!a.report.empty()) check_output_writable(a.report, "--report", false);
  if (!a.metrics_file.empty()) check_output_writable(a.metrics_file, "--metrics-file", true);
  if (!a.config.save_dir.empty()) check_output_dir_path(a.config.save_dir, "--save");
}

// The compute line of the banner, with the threads train() is about to give each rank.
std::string compute_info_for_rank(const TrainConfig& config, const Communicator& comm) {
  ComputeInfo info = compute_info();
  info.threads = rank_compute_threads(config, comm);
  return info.describe(config.bf16);
}

}  // namespace

// Everything the flags say, put together and checked before any rank starts.
void finish_train_config(TrainArgs& a) {
  GptConfig& m = a.config.model;
  m = gpt_preset(a.model);
  for (const auto& override_field : a.model_overrides) override_field(m);
  // The data and the vocabulary first: the padded vocabulary is part of the param count.
  a.config.data_blend.clear();
  a.notes = apply_data_flags(a.data, a.config);
  // --load-hf: the model, its vocabulary included, is the HF config.json. The tokenizer's
  // vocabulary (--vocab-size, --vocab-file) may be smaller (TrainConfig::validate checks it);
  // without one, the data's ids are checked against the HF vocabulary.
  const std::vector<std::string> hf_notes = apply_load_hf(a);
  if (!a.config.load_hf_dir.empty() && a.data.vocab_size == 0 && a.data.tokenizer_type.empty())
    a.config.tokenizer_vocab_size = 0;
  const std::vector<std::string> megatron_notes = apply_megatron_flags(a.megatron, m.num_params(), a.bucket_size_option->count() > 0, a.config.ddp.bucket_size);
  a.notes.insert(a.notes.end(), megatron_notes.begin(), megatron_notes.end());
  a.notes.insert(a.notes.end(), hf_notes.begin(), hf_notes.end());
  // The fields FSDP shares with DDP (the overlap flags, the grad and param dtypes, the MXFP8 format)
  // mean the same under FSDP (Megatron's names are shared); their flags set DdpConfig's.
  copy_shared_data_parallel_fields(a.config.ddp, a.config.fsdp);

  // Recompute: Megatron's two flags, and --recompute-activations with its old meaning here (full).
  TrainConfig& c = a.config;
  c.recompute_granularity = a.recompute_granularity.empty() ? RecomputeGranularity::kNone
                                                            : parse_recompute_granularity(a.recompute_granularity);
  if (a.recompute_activations) {
    MXDDP_CHECK(c.recompute_granularity != RecomputeGranularity::kSelective,
                "--recompute-activations re-runs every layer whole (--recompute-granularity full) and contradicts "
                "--recompute-granularity selective; valid: one of the two (mxddp keeps the flag's full meaning, where "
                "Megatron maps it to selective; docs/model.md)");
    c.recompute_granularity = RecomputeGranularity::kFull;
  }
  c.recompute_modules.clear();
  for (const std::string& name : a.recompute_modules) c.recompute_modules.insert(parse_recompute_module(name));
  if (c.recompute_granularity == RecomputeGranularity::kSelective && a.recompute_modules.empty())
    c.recompute_modules = {RecomputeModule::kCoreAttn};  // Megatron's default
}

int run_train_command(int argc, char** argv, TrainArgs& a) {
  finish_train_config(a);
  if (a.exit_signal_handler) install_stop_signal_handler(a);
  const bool mpi = resolve_backend(a.backend, a.ranks_option->count() > 0, a.ranks, detect_mpi_launcher()) == "mpi";
  // Under MPI each process is one rank, which may run on another host with another view of the
  // file system: its verdict goes into the first collective, so that an output one rank cannot
  // write refuses the run on every rank, naming that rank (the ranks given different paths by an
  // MPMD line included: which host gets rank 0 is the launcher's choice). The local backend's
  // ranks share this process's view: it refuses here.
  std::optional<std::string> output_problem;
  if (mpi) {
    try {
      check_outputs(a);
      output_problem = "";
    } catch (const Error& e) {
      output_problem = e.what();
    }
  } else {
    check_outputs(a);
  }

  // Every rank gets the same stop_requested (or none): the ranks agree on it by a collective.
  TrainCallbacks every_rank;
  if (a.exit_signal_handler) {
    every_rank.stop_requested = [] { return g_stop_signal.load() != 0; };
    every_rank.stop_cause = [] { return fmt::format("--exit-signal-handler: {}", stop_signal_name(g_stop_signal.load())); };
  }

  auto run_rank = [&a, &every_rank, &output_problem](Communicator& comm) -> TrainResult {
    if (output_problem) throw_if_any_rank_failed(comm, *output_problem);
    // A bad flag fails before the banner, on every rank alike (rank 0 alone failing here would
    // leave the others in train()'s first collective).
    a.config.validate(comm.size());
    if (comm.rank() != 0) return train(comm, a.config, every_rank);
    std::printf("mxddp train: %s on %d %s rank(s), %s%s; global batch %d = %d micro x %d dp x %d accumulation; %lld "
                "iterations%s\n",
                a.config.model.describe().c_str(), comm.size(), std::string(comm.backend_name()).c_str(),
                a.config.use_megatron_fsdp
                    ? fmt::format("FSDP {}", sharding_strategy_name(a.config.fsdp.data_parallel_sharding_strategy)).c_str()
                    : "DDP + distributed optimizer",
                recompute_banner(a.config).c_str(),
                a.config.global_batch_size, a.config.micro_batch_size, comm.size(),
                a.config.accumulation_steps(comm.size()), static_cast<long long>(a.config.train_iters),
                a.config.load_dir.empty() ? "" : (" (resuming from " + a.config.load_dir + ")").c_str());
    if (a.config.use_megatron_fsdp)
      std::printf("fine-grained param gather: %s\n", a.config.fine_grained_param_gather().reason.c_str());
    std::printf("compute: %s\n", compute_info_for_rank(a.config, comm).c_str());
    for (const std::string& note : a.notes) std::printf("note: %s\n", note.c_str());
    std::fflush(stdout);
    const bool bar = isatty(STDOUT_FILENO) == 1 && a.log_interval_option->count() == 0 && !detect_mpi_launcher();
    Progress progress(a.config.train_iters, a.log_interval, bar);
    std::optional<MetricsLog> metrics;
    if (!a.metrics_file.empty()) metrics.emplace(a.metrics_file, !a.config.load_dir.empty());
    TrainCallbacks callbacks = rank0_callbacks(progress, metrics ? &*metrics : nullptr, a.config);
    callbacks.stop_requested = every_rank.stop_requested;
    callbacks.stop_cause = every_rank.stop_cause;
    TrainResult r = train(comm, a.config, callbacks);
    if (metrics) metrics->memory(r.memory_by_rank);
    progress.message("");
    if (!r.exit_reason.empty())
      std::printf("stopped after iteration %lld of %lld: %s%s\n",
                  static_cast<long long>(r.steps.empty() ? r.start_iteration : r.steps.back().iteration),
                  static_cast<long long>(a.config.train_iters), r.exit_reason.c_str(),
                  a.config.save_dir.empty() ? " (no --save: nothing saved)" : "; the checkpoint is saved");
    print_summary(a.config, r, comm.size());
    if (!a.report.empty()) {
      write_train_report(a.report, a.config, r, comm.size(), std::string(comm.backend_name()));
      std::printf("report written to %s\n", a.report.c_str());
    }
    return r;
  };

  if (mpi) {
    MpiRuntime runtime(&argc, &argv);
    std::unique_ptr<Communicator> comm;
    run_or_abort_job("train", [&] {
      comm = make_mpi_communicator({.timeout_ms = a.timeout_ms});
      run_rank(*comm);
    });
    return 0;
  }
  run_local(a.ranks, [&](Communicator& comm) { run_rank(comm); }, {.timeout_ms = a.timeout_ms});
  return 0;
}

}  // namespace mxddp::app
