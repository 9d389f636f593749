// The training loop behind `mxddp train` (see train.h): the Trainer (trainer.h), whose phases build
// the DDP or FSDP, the distributed optimizer and the GPT for this rank, resume from a checkpoint, run
// the iterations, evaluate, save, and gather what every rank used in memory; train() drives it.
// TrainConfig's own checks and schedule are in train_config.cc.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <thread>

#include <mxddp/hf.h>
#include <mxddp/input_file.h>
#include <mxddp/launch_check.h>
#include <mxddp/output_file.h>
#include <mxddp/train.h>

#include "../checkpoint/file_io.h"
#include "../checkpoint/printable.h"
#include "../plan/memory_floor.h"
#include "trainer.h"

namespace mxddp {

namespace {

using Clock = Trainer::Clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

double all_reduce_mean(Communicator& comm, double local) {
  float v = static_cast<float>(local);
  comm.all_reduce(TensorView{&v, DType::kF32, Shape{1}, Device::cpu()}, {.op = ReduceOp::kAvg});
  return v;
}

// Every rank's RankMemory, all-gathered as raw bytes.
std::vector<RankMemory> gather_memory(Communicator& comm, const RankMemory& mine) {
  std::vector<RankMemory> all(static_cast<size_t>(comm.size()));
  static_assert(std::is_trivially_copyable_v<RankMemory>);
  const auto bytes = static_cast<int64_t>(sizeof(RankMemory));
  comm.all_gather(TensorView{const_cast<RankMemory*>(&mine), DType::kU8, Shape{bytes}, Device::cpu()},
                  TensorView{all.data(), DType::kU8, Shape{bytes * comm.size()}, Device::cpu()});
  return all;
}

// The model itself is stored structurally (SaveOptions::model_config, every GptConfig field) and
// compared field by field on --load.
// What a resume compares with the run's flags (warn_on_resume_differences): the batch and the
// whole learning-rate schedule (train_iters too: a cosine decay over lr_decay_iters 0 spans it).
std::map<std::string, std::string> schedule_fields(const TrainConfig& c) {
  return {{"global_batch_size", std::to_string(c.global_batch_size)},
          {"lr", fmt::format("{}", c.lr)},
          {"min_lr", fmt::format("{}", c.min_lr)},
          {"lr_warmup_iters", std::to_string(c.lr_warmup_iters)},
          {"lr_decay_iters", std::to_string(c.lr_decay_iters)},
          {"lr_decay_style", std::string(lr_decay_style_name(c.lr_decay_style))},
          {"train_iters", std::to_string(c.train_iters)}};
}

std::map<std::string, std::string> checkpoint_metadata(const TrainConfig& c, int64_t iteration, int64_t consumed_samples) {
  std::map<std::string, std::string> meta = schedule_fields(c);
  meta["iteration"] = std::to_string(iteration);
  // Megatron's args.consumed_train_samples: after a resume with another global batch size it is
  // not iteration x batch size, and the data goes on from it.
  meta["consumed_train_samples"] = std::to_string(consumed_samples);
  meta["seed"] = std::to_string(c.seed);
  // The tokenizer the run trained with (the model's vocab_size is the padded one), for exports.
  meta["tokenizer_vocab_size"] = std::to_string(c.vocab_size_for_data());
  if (c.eod_id >= 0) meta["eod_id"] = std::to_string(c.eod_id);
  return meta;
}

// Megatron resumes whatever the flags say; so do we, but say what differs from the checkpoint's
// (a checkpoint from before these fields were saved has fewer to compare).
void warn_on_resume_differences(const std::map<std::string, std::string>& meta, const TrainConfig& c,
                                const std::string& dir, const TrainCallbacks& callbacks) {
  if (!callbacks.on_warning) return;
  for (const auto& [key, value] : schedule_fields(c)) {
    const auto it = meta.find(key);
    if (it == meta.end() || it->second == value) continue;
    // A longer run is the usual reason to resume; it changes the schedule only when the decay
    // spans the run.
    const bool decay_spans_run = c.lr_decay_iters == 0 && c.lr_decay_style != LrDecayStyle::kConstant;
    if (key == "train_iters" && !decay_spans_run) continue;
    callbacks.on_warning(fmt::format("resuming from '{}' with {} {} (the checkpoint was saved with {}){}; the run goes "
                                     "on with this run's value",
                                     dir, key, value, it->second,
                                     key == "train_iters" ? ": the lr decays over train_iters (--lr-decay-iters 0), so "
                                                            "the schedule from here differs"
                                                          : ""));
  }
}


// Rank 0's text on every rank: its length, then its bytes.
std::string broadcast_from_rank0(Communicator& comm, std::string text) {
  uint64_t length = text.size();
  comm.broadcast(TensorView{&length, DType::kU8, Shape{8}, Device::cpu()}).wait();
  text.resize(length);
  if (length > 0)
    comm.broadcast(TensorView{text.data(), DType::kU8, Shape{static_cast<int64_t>(length)}, Device::cpu()}).wait();
  return text;
}

// The first line of a small file (at most 4 KiB is read), or nullopt with `why` when it cannot be
// opened. Rank 0 also flushes it to the file server (fsync), so that other hosts of a network file
// system that caches writes read what it wrote.
std::optional<std::string> read_first_line(const std::string& path, bool flush, std::string& why) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    why = std::strerror(errno);
    return std::nullopt;
  }
  if (flush) static_cast<void>(::fsync(fd));  // best effort: a local file system needs none
  char buffer[4096];
  const ssize_t n = ::pread(fd, buffer, sizeof buffer, 0);
  ::close(fd);
  std::string text(buffer, static_cast<size_t>(std::max<ssize_t>(n, 0)));
  return text.substr(0, text.find('\n'));
}

}  // namespace

// ---- Trainer: set-up phases

Trainer::Trainer(Communicator& comm, const TrainConfig& config, const TrainCallbacks& callbacks)
    : comm_(comm), config_(config), callbacks_(callbacks), start_time_(Clock::now()) {
  check_run();
  load_data();
  build_data_parallel();
  build_optimizer_and_model();
}

void Trainer::check_run() {
  const int dp = comm_.size();
  // First, before anything depends on the flags: ranks launched with different ones (an mpirun
  // MPMD line) are refused together, naming each difference, instead of training a silent wrong
  // model or stalling in a collective whose sizes no longer match.
  check_same_job(comm_, train_job_fields(config_), "mxddp train's flags");
  config_.validate(dp);  // the same config on every rank: the same verdict
  // What each rank checks on its own machine ends every rank when it fails on one.
  std::string error;
  try {
    if (!config_.save_dir.empty()) {
      checkpoint_history::check_save_dir(config_.save_dir);
      if (comm_.rank() == 0) save_lock_.emplace(config_.save_dir);
    }
    // Before anything is allocated: a run that cannot fit is an error with the figures, not a
    // process that grows until it is killed. A --data file's size is read here; load_data names
    // the file if it cannot be read.
    std::error_code ec;
    const auto file_bytes = config_.data_path.empty() ? 0 : std::filesystem::file_size(config_.data_path, ec);
    double data_bytes = config_.data_path.empty() ? static_cast<double>(config_.corpus_bytes)
                                                  : (ec ? 0.0 : static_cast<double>(file_bytes));
    // Indexed datasets are mapped, not read: their .bin pages are the page cache's; the index and
    // the sample index (a few int64 per document and per sample) are about the .idx's size.
    if (!config_.data_blend.empty()) {
      data_bytes = 0;
      for (const DataBlendEntry& e : config_.data_blend) {
        const auto idx_bytes = std::filesystem::file_size(e.prefix + ".idx", ec);
        data_bytes += ec ? 0.0 : static_cast<double>(idx_bytes);
      }
    }
    check_train_fits_in_memory(config_, dp, ranks_on_this_machine(comm_), data_bytes);
  } catch (const Error& e) {  // (anything else, e.g. std::bad_alloc, ends the process as it did)
    error = e.what();
  }
  throw_if_any_rank_failed(comm_, error);
  check_save_dir_shared();
  set_compute_threads(rank_compute_threads(config_, comm_));
}

void Trainer::check_save_dir_shared() {
  if (config_.save_dir.empty() || comm_.size() == 1) return;
  // Rank 0 holds the lock now, and its lock file holds its pid, host and start time: text no other
  // run's lock file holds. A rank that reads something else there sees another directory.
  const std::string lock_path = (std::filesystem::path(config_.save_dir) / kSaveLockFile).string();
  std::string why;
  const std::string rank0_text =
      broadcast_from_rank0(comm_, comm_.rank() == 0 ? read_first_line(lock_path, true, why).value_or("") : "");
  std::string error;
  if (comm_.rank() != 0) {
    // Made here too, as each rank's save would: a lookup of the path this rank made before rank 0
    // created it may be cached as "missing" by a network file system's client; mkdir asks the server.
    std::error_code ec;
    std::filesystem::create_directories(config_.save_dir, ec);
    std::optional<std::string> mine;
    // A few tries: some network file systems show another host's new file only after a moment.
    constexpr int kTries = 10;
    constexpr auto kPause = std::chrono::milliseconds(100);
    for (int attempt = 0; attempt < kTries; ++attempt) {
      if (attempt > 0) std::this_thread::sleep_for(kPause);
      mine = read_first_line(lock_path, false, why);
      if (mine == rank0_text) break;
    }
    if (mine != rank0_text)
      error = fmt::format(
          "--save '{}' is not the directory rank 0 saves to: rank 0 has just written its lock file '{}' ('{}'), and "
          "this rank {}. Every rank writes its own part of each checkpoint into --save, so it must be one directory "
          "shared by every rank's host (a network or parallel file system), not a directory on each host's own disk",
          config_.save_dir, lock_path, ckpt::printable_text(rank0_text, 200),
          mine ? fmt::format("reads another run's text there ('{}')", ckpt::printable_text(*mine, 200))
               : fmt::format("cannot open it ({})", why));
    else if (::faccessat(AT_FDCWD, config_.save_dir.c_str(), W_OK, AT_EACCESS) != 0)
      error = fmt::format("--save '{}' cannot be written by this rank ({}); every rank writes its own part of each "
                          "checkpoint there", config_.save_dir, std::strerror(errno));
  }
  throw_if_any_rank_failed(comm_, error);
}

void Trainer::load_data() {
  std::string error;
  try {
    data_.emplace(config_);
  } catch (const Error& e) {  // (anything else, e.g. std::bad_alloc, ends the process as it did)
    error = e.what();
  }
  throw_if_any_rank_failed(comm_, error);
  // The same --data path can hold different bytes on different hosts (or change between reads).
  check_same_job(comm_, data_->identity(), "the data each rank read");
}

void Trainer::build_data_parallel() {
  const GptConfig& mc = config_.model;
  DdpConfig ddp_config = config_.ddp;
  ddp_config.use_distributed_optimizer = true;
  std::vector<std::vector<float>> init;  // freed once copied in
  if (config_.load_hf_dir.empty()) {
    init = gpt_init_params(mc, config_.seed);
  } else {
    // Every rank reads the directory; a problem on one ends all, and the ranks must have read the
    // same bytes (another host can hold another copy under the same path).
    std::string error;
    HfGpt2Params hf;
    try {
      hf = read_hf_gpt2_params(config_.load_hf_dir, mc);
    } catch (const Error& e) {
      error = e.what();
    }
    throw_if_any_rank_failed(comm_, error);
    check_same_job(comm_, {{"--load-hf config.json crc32", fmt::format("{:08x}", hf.config_crc32)},
                           {"--load-hf model.safetensors crc32", fmt::format("{:08x}", hf.safetensors_crc32)}},
                   "the HF checkpoint each rank read");
    init = std::move(hf.values);
  }
  const std::vector<ParamSpec> specs = gpt_param_specs(mc, ddp_config.fp8_param_gather);
  std::vector<TensorView> views;
  for (size_t i = 0; i < specs.size(); ++i) views.push_back({init[i].data(), DType::kF32, specs[i].shape});
  if (config_.use_megatron_fsdp) {
    FsdpConfig fsdp_config = config_.fsdp;  // the MXFP8 format is set where DDP's is (--fp8-format, ...)
    fsdp_config.mxfp8_elem = ddp_config.mxfp8_elem;
    fsdp_config.mxfp8_scale_mode = ddp_config.mxfp8_scale_mode;
    auto owned = std::make_unique<FullyShardedDataParallel>(
        comm_, specs, gpt_fsdp_units(mc, config_.model_options().fine_grained_param_gather), fsdp_config, tracker_,
        views);
    fsdp_ = owned.get();
    data_parallel_ = std::move(owned);
  } else {
    data_parallel_ = std::make_unique<DistributedDataParallel>(comm_, specs, ddp_config, tracker_, views);
  }
  if (callbacks_.wrap_data_parallel) {
    data_parallel_ = callbacks_.wrap_data_parallel(std::move(data_parallel_));
    MXDDP_CHECK(data_parallel_ != nullptr, "TrainCallbacks::wrap_data_parallel returned null");
  }
}

void Trainer::build_optimizer_and_model() {
  const GptConfig& mc = config_.model;
  optimizer_.emplace(*data_parallel_, config_.optimizer, tracker_);
  model_.emplace(*data_parallel_, pool_, mc, config_.model_options());
  result_.unigram_entropy = data_->unigram_entropy();
  result_.tokens_per_iteration = int64_t{config_.global_batch_size} * mc.seq_length;
  tokens_.resize(static_cast<size_t>(config_.micro_batch_size) * (mc.seq_length + 1));
  const GptParamIds ids(mc);
  forward_modules_.push_back({ids.wte(), ids.wpe()});
  // The model's modules are FSDP's units (fine-grained: the submodules); DDP takes either.
  for (std::vector<int>& unit : gpt_fsdp_units(mc, config_.model_options().fine_grained_param_gather))
    forward_modules_.push_back(std::move(unit));
  forward_modules_.push_back({ids.final_norm_weight(), ids.final_norm_bias()});
}

int64_t Trainer::first_sequence(int m) const {
  const int local_batch = config_.global_batch_size / comm_.size();
  return int64_t{comm_.rank()} * local_batch + int64_t{m} * config_.micro_batch_size;
}

// ---- Loading and saving checkpoints

void Trainer::load_checkpoint() {
  if (config_.load_dir.empty()) return;
  // A history's newest (or one checkpoint), the same one on every rank (ranks that read the tracker
  // at different moments of another run's save, or hosts that see different copies, are refused),
  // read again when another run's save changes the history meanwhile. The model config is compared
  // before anything changes: a model with other heads can have the same param shapes and would
  // load silently.
  const HistoryLoadResult loaded =
      load_checkpoint_from_history(config_.load_dir, *optimizer_, {.model_config = config_.model.fields()});
  const std::string& load_dir = loaded.dir;
  const std::map<std::string, std::string>& meta = loaded.metadata;
  MXDDP_CHECK(meta.count("iteration") > 0, "checkpoint '{}' was not written by mxddp train: its metadata has no iteration",
              load_dir);
  result_.start_iteration = checkpoint_metadata_count(meta, "iteration", load_dir);
  // A checkpoint from before consumed samples were saved: as if the batch size had always been
  // this run's (what every count assumed then).
  consumed_samples_ = meta.count("consumed_train_samples") > 0
                          ? checkpoint_metadata_count(meta, "consumed_train_samples", load_dir)
                          : checked_mul(result_.start_iteration, config_.global_batch_size, "consumed samples");
  MXDDP_CHECK(consumed_samples_ >= result_.start_iteration,
              "checkpoint '{}' has consumed_train_samples {} at iteration {}: every iteration consumes at least one "
              "sample, so its metadata is not what mxddp train saved", load_dir, consumed_samples_,
              result_.start_iteration);
  result_.start_consumed_samples = consumed_samples_;
  // The count goes on by the batch each iteration; a (resealed, edited) count near 2^63 would overflow.
  checked_add(consumed_samples_,
              checked_mul(std::max<int64_t>(0, config_.train_iters - result_.start_iteration), config_.global_batch_size,
                          "the samples of the iterations left"),
              fmt::format("checkpoint '{}': its consumed_train_samples {} plus the samples of the iterations left",
                          load_dir, consumed_samples_));
  // Every optimizer step is an iteration (a skipped one is an iteration without a step).
  MXDDP_CHECK(optimizer_->step_count() <= result_.start_iteration,
              "checkpoint '{}' holds optimizer step {} but iteration {}: a run takes at most one step per iteration, "
              "so its manifest is not what mxddp train saved", load_dir, optimizer_->step_count(),
              result_.start_iteration);
  if (comm_.rank() == 0) warn_on_resume_differences(meta, config_, load_dir, callbacks_);
}

void Trainer::save_checkpoint(int64_t iteration) {
  // The history's directory was checked and its lock taken when the run started (check_run).
  const std::string dir = save_checkpoint_to_history(
      config_.save_dir, iteration, *optimizer_,
      {.metadata = checkpoint_metadata(config_, iteration, consumed_samples_), .model_config = config_.model.fields()},
      {.keep_last = config_.keep_last});
  if (callbacks_.on_save) callbacks_.on_save(iteration, dir);
}

// ---- The iterations

void Trainer::run_iterations() {
  train_start_ = Clock::now();
  if (config_.skip_train) {  // Megatron's --skip-train: evaluate what was loaded, train nothing
    for (const std::string& split : data_->eval_split_names()) evaluate(result_.start_iteration, split);
    return;
  }
  for (int64_t it = result_.start_iteration; it < config_.train_iters; ++it) {
    result_.steps.push_back(run_iteration(it));
    if (callbacks_.on_step) callbacks_.on_step(result_.steps.back());
    if (it == result_.start_iteration) mark_steady_state();
    if (!after_iteration(it + 1)) break;
  }
}

StepRecord Trainer::run_iteration(int64_t it) {
  const auto t_step = Clock::now();
  optimizer_->set_lr(learning_rate(config_, it));
  model_->reset_timings();
  StepRecord rec;
  rec.iteration = it + 1;
  rec.lr = optimizer_->lr();

  auto t0 = Clock::now();
  optimizer_->zero_grad();
  rec.optimizer_ms = ms_since(t0);
  const double loss_sum = run_micro_batches();
  consumed_samples_ += config_.global_batch_size;
  rec.consumed_samples = consumed_samples_;
  t0 = Clock::now();
  data_parallel_->finish_grad_sync();
  rec.comm_ms = ms_since(t0) + model_->timings().param_wait_ms;
  t0 = Clock::now();
  const StepResult step = optimizer_->step();
  rec.optimizer_ms += ms_since(t0);
  rec.forward_ms = model_->timings().forward_ms;
  rec.backward_ms = model_->timings().backward_ms;
  rec.grad_norm = step.grad_norm;
  rec.skipped = step.skipped;
  rec.loss = all_reduce_mean(comm_, loss_sum / accumulation_steps());
  check_finite(rec, step);
  rec.step_ms = ms_since(t_step);
  return rec;
}

double Trainer::run_micro_batches() {
  const int accum = accumulation_steps(), mb = config_.micro_batch_size;
  const float loss_scale = 1.0f / static_cast<float>(accum);  // the gradient of the mean over micro-batches
  double loss_sum = 0;
  for (int m = 0; m < accum; ++m) {
    data_->fill_train(consumed_samples_ + first_sequence(m), mb, tokens_.data());
    if (m + 1 < accum) {  // gradients are reduced only in the last micro-batch
      auto no_sync = data_parallel_->no_sync();
      loss_sum += model_->forward_backward(tokens_.data(), mb, loss_scale);
    } else {
      loss_sum += model_->forward_backward(tokens_.data(), mb, loss_scale);
    }
  }
  return loss_sum;
}

void Trainer::check_finite(const StepRecord& rec, const StepResult& step) {
  if (!config_.check_for_nan_in_loss_and_grad || (!step.skipped && std::isfinite(rec.loss))) return;
  // Every rank sees the same loss and norm, so every rank stops here, together.
  std::string names;
  for (int p : optimizer_->nonfinite_grad_params())
    names += fmt::format("{}{}", names.empty() ? "" : ", ", data_parallel_->params()[static_cast<size_t>(p)].name);
  MXDDP_FAIL("iteration {}: NaN or Inf found (loss {}, grad norm {}); params whose gradients hold it: {}. The update "
             "was not applied (--no-check-for-nan-in-loss-and-grad skips such iterations and goes on)",
             rec.iteration, rec.loss, step.grad_norm, names.empty() ? "none (only the loss)" : names);
}

void Trainer::mark_steady_state() {
  // Everything the run needs is allocated by now; from here on the peaks are the steady state.
  warmup_usage_ = tracker_.usage();
  allocations_at_warmup_ = pool_.allocation_count();
  tracker_.reset_peaks();
}

bool Trainer::after_iteration(int64_t iteration) {
  const bool last = iteration == config_.train_iters;
  // Decided first: a requested stop is a preemption whose scheduler kills the job after a grace
  // time, so its save must not wait behind an evaluation (which can take longer than an iteration).
  ExitDecision exit = exit_decision(iteration);
  const int64_t hash_interval = config_.check_weight_hash_across_dp_replicas_interval;
  if (hash_interval > 0 && iteration % hash_interval == 0) check_weight_hashes(iteration);
  const bool eval_due =
      config_.eval_iters > 0 && (last || (config_.eval_interval > 0 && iteration % config_.eval_interval == 0));
  if (eval_due && !exit.requested) {
    evaluate(iteration);
    // A signal that came during the evaluation stops the run now, not after one more iteration.
    if (exit.reason.empty() && callbacks_.stop_requested) exit = exit_decision(iteration);
  } else if (eval_due && comm_.rank() == 0 && callbacks_.on_warning) {
    callbacks_.on_warning(fmt::format("{}: the evaluation due after iteration {} is skipped, to {} at once", exit.reason,
                                      iteration, config_.save_dir.empty() ? "stop" : "save"));
  }
  const bool stopping = last || !exit.reason.empty();
  const bool saving =
      !config_.save_dir.empty() && (stopping || (config_.save_interval > 0 && iteration % config_.save_interval == 0));
  if (saving) save_checkpoint(iteration);
  if (!stopping) return true;
  // The last iteration is no early stop, whatever else was due there.
  if (!last) result_.exit_reason = exit.reason;
  return false;
}

void Trainer::check_weight_hashes(int64_t iteration) {
  optimizer_->force_param_sync();  // as Megatron: the param gather is finished before hashing
  const std::string mismatches = param_hash_mismatches(*data_parallel_, forward_modules_);
  MXDDP_CHECK(mismatches.empty(),
              "iteration {}: the model params differ across data-parallel replicas "
              "(--check-weight-hash-across-dp-replicas-interval {}): {}",
              iteration, config_.check_weight_hash_across_dp_replicas_interval, mismatches);
}

void Trainer::evaluate(int64_t iteration, const std::string& split) {
  optimizer_->force_param_sync();  // the model params must be the main params' (MXFP8 reuse: re-staged)
  const int accum = accumulation_steps(), mb = config_.micro_batch_size;
  double sum = 0;
  for (int e = 0; e < config_.eval_iters; ++e)
    for (int m = 0; m < accum; ++m) {
      data_->fill_eval(split, e, first_sequence(m), mb, tokens_.data());
      sum += model_->evaluate(tokens_.data(), mb);
    }
  const EvalRecord record{iteration, all_reduce_mean(comm_, sum / (config_.eval_iters * accum)), split};
  result_.evals.push_back(record);
  if (callbacks_.on_eval) callbacks_.on_eval(record);
}

// Whether to stop after this iteration, the same answer on every rank: --exit-interval needs no
// agreement; the clock and stop_requested (a signal) are each rank's own, so the ranks agree on
// the maximum of each.
Trainer::ExitDecision Trainer::exit_decision(int64_t iteration) {
  const bool agree_on_exit = config_.exit_duration_in_mins > 0 || callbacks_.stop_requested;
  uint8_t flags[2] = {0, 0};  // [the clock passed --exit-duration-in-mins, a stop was requested]
  bool requested_here = false;
  if (agree_on_exit) {
    const double minutes = std::chrono::duration<double>(Clock::now() - start_time_).count() / 60;
    requested_here = callbacks_.stop_requested && callbacks_.stop_requested();
    flags[0] = static_cast<uint8_t>(config_.exit_duration_in_mins > 0 && minutes >= config_.exit_duration_in_mins);
    flags[1] = static_cast<uint8_t>(requested_here);
    comm_.all_reduce(TensorView{flags, DType::kU8, Shape{2}, Device::cpu()}, {.op = ReduceOp::kMax});
  }
  if (flags[1]) {
    const std::string cause = !requested_here          ? "on another rank"
                              : callbacks_.stop_cause ? callbacks_.stop_cause()
                                                      : "TrainCallbacks::stop_requested";
    return {fmt::format("a stop was requested ({})", cause), true};
  }
  if (config_.exit_interval > 0 && iteration % config_.exit_interval == 0)
    return {fmt::format("--exit-interval {}", config_.exit_interval), false};
  if (flags[0]) return {fmt::format("--exit-duration-in-mins {} reached", config_.exit_duration_in_mins), false};
  return {};
}

// ---- The end of the run

TrainResult Trainer::finish() {
  optimizer_->force_param_sync();  // end of training: the model holds the final params
  result_.train_seconds = std::chrono::duration<double>(Clock::now() - train_start_).count();
  double step_ms_sum = 0;  // iterations only: evaluation and saves are not training throughput
  for (const StepRecord& r : result_.steps) step_ms_sum += r.step_ms;
  if (step_ms_sum > 0)
    result_.tokens_per_second = static_cast<double>(result_.steps.size()) *
                                static_cast<double>(result_.tokens_per_iteration) / (step_ms_sum / 1e3);
  result_.memory_by_rank = gather_memory(comm_, rank_memory());
  return std::move(result_);
}

RankMemory Trainer::rank_memory() const {
  RankMemory mine;
  mine.steady = tracker_.usage();
  mine.overall = result_.steps.empty() ? mine.steady : max_peaks(warmup_usage_, mine.steady);
  mine.scratch_allocations_after_warmup = result_.steps.empty() ? 0 : pool_.allocation_count() - allocations_at_warmup_;
  if (fsdp_ != nullptr)
    for (int s = 0; s < kGatherSlots; ++s)
      mine.peak_gathered_bytes_by_slot[static_cast<size_t>(s)] = fsdp_->peak_gathered_bytes(static_cast<GatherSlot>(s));
  return mine;
}

TrainResult train(Communicator& comm, const TrainConfig& config, const TrainCallbacks& callbacks) {
  Trainer trainer(comm, config, callbacks);
  trainer.load_checkpoint();
  trainer.run_iterations();
  return trainer.finish();
}

}  // namespace mxddp
