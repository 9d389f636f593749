// mxddp train: the training loop that `mxddp train` runs, as a library function so tests drive
// the same code the command does.
//
// Owns: TrainConfig (the model, batch sizes, the learning-rate schedule, every DDP and optimizer
// option, data, evaluation and checkpointing), train(), and what it reports (per-step losses and
// timings, validation losses, throughput, per-rank memory). One iteration is the design's:
//   zero_grad (zero the grad buffer; with MXFP8 reuse also stage and start the param gathers),
//   micro-batches 1..k-1 under no_sync, micro-batch k reporting gradients as they are final,
//   finish_grad_sync, the optimizer step.
// Evaluation, checkpoint saves and the end of training go through force_param_sync.
// train() always uses the distributed optimizer, the library's optimizer.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <mxddp/checkpoint.h>
#include <mxddp/checkpoint_history.h>
#include <mxddp/fsdp.h>
#include <mxddp/fsdp_fine_grained.h>
#include <mxddp/data.h>
#include <mxddp/launch_check.h>
#include <mxddp/model.h>

namespace mxddp {

// The learning rate's decay after the warmup (Megatron's --lr-decay-style).
enum class LrDecayStyle : uint8_t { kCosine, kLinear, kConstant };
std::string_view lr_decay_style_name(LrDecayStyle style);  // "cosine", "linear", "constant"
// The inverse; throws Error "--lr-decay-style 'X' is not valid: cosine, linear or constant".
LrDecayStyle parse_lr_decay_style(std::string_view name);

template <>
struct FieldEnum<LrDecayStyle> {
  static std::string_view name(LrDecayStyle s) { return lr_decay_style_name(s); }
  static LrDecayStyle parse(std::string_view s) { return parse_lr_decay_style(s); }
  static std::vector<std::string> names() { return {"cosine", "linear", "constant"}; }
};

struct TrainConfig {
  GptConfig model = gpt_preset("tiny");
  // Activation recompute, as GptModelOptions (Megatron's --recompute-granularity and
  // --recompute-modules). `mxddp train --recompute-activations` sets kFull (docs/model.md).
  RecomputeGranularity recompute_granularity = RecomputeGranularity::kNone;
  RecomputeModules recompute_modules;
  bool bf16 = false;  // Megatron's --bf16: BF16 matrix products with F32 accumulation (GptModelOptions::bf16)
  // Compute threads of each rank (set in the rank's own thread); 0: the cores / the ranks that
  // share this machine (the local backend's ranks, or mpirun's ranks on this node).
  int compute_threads = 0;
  int micro_batch_size = 4;
  // Sequences per iteration; gradient accumulation runs global / (micro x dp) micro-batches.
  int global_batch_size = 32;
  int64_t train_iters = 300;
  // Learning rate: linear warmup from lr / lr_warmup_iters to lr, then decay to min_lr by
  // lr_decay_iters (0 = train_iters), cosine, linear or constant.
  float lr = 2e-3f;
  float min_lr = 2e-4f;
  int64_t lr_warmup_iters = 30;
  int64_t lr_decay_iters = 0;
  LrDecayStyle lr_decay_style = LrDecayStyle::kCosine;
  OptimizerConfig optimizer;  // its lr is the schedule's
  DdpConfig ddp;              // use_distributed_optimizer is forced on
  // FSDP instead of DDP (Megatron's --use-megatron-fsdp): the GPT's decoder layers are the units,
  // or its weighted submodules where fine_grained_param_gather() is on.
  bool use_megatron_fsdp = false;
  FsdpConfig fsdp;
  // Megatron's --check-for-nan-in-loss-and-grad, on by default: a NaN or Inf loss or gradient stops
  // the run with an error naming the iteration and the params whose gradients hold it. Off, such an
  // iteration's update is skipped (StepRecord::skipped) and training goes on.
  bool check_for_nan_in_loss_and_grad = true;
  // Megatron's --check-weight-hash-across-dp-replicas-interval: every this many iterations the
  // ranks compare hashes of their model params (param_hash_mismatches) and a mismatch stops the
  // run with an error naming the params and ranks. 0: never.
  int64_t check_weight_hash_across_dp_replicas_interval = 0;
  uint64_t seed = 1234;       // initialization and sampling
  // Data (docs/data.md): Megatron indexed datasets when data_blend is given (each PREFIX.bin +
  // PREFIX.idx with its weight, split into train/valid/test by documents), else a text file read
  // as bytes (data_path), else (both empty) the built-in corpus of corpus_bytes.
  std::string data_path;
  std::vector<DataBlendEntry> data_blend;
  std::array<double, 3> split{0.969, 0.030, 0.001};  // --split 969,30,1 (normalized); data_blend only
  int64_t corpus_bytes = 1 << 20;
  double valid_fraction = 0.1;  // text and the built-in corpus only: the last fraction of the bytes
  // The tokenizer's vocabulary: every token id must be below it. model.vocab_size is it padded up
  // (Megatron's --make-vocab-size-divisible-by): the embedding's rows. 0: model.vocab_size.
  int64_t tokenizer_vocab_size = 0;
  int64_t eod_id = -1;  // the tokenizer's end-of-document id (-1: none), saved in checkpoints' metadata
  int64_t vocab_size_for_data() const { return tokenizer_vocab_size > 0 ? tokenizer_vocab_size : model.vocab_size; }
  // Validation loss every eval_interval iterations and after the last (0: only after the last),
  // over eval_iters global batches of the validation split. eval_iters 0 disables evaluation.
  int64_t eval_interval = 100;
  int eval_iters = 2;
  // Checkpoints: every save_interval iterations and after the last, when save_dir is set, each in
  // save_dir/iter_0000100/ with save_dir/latest_checkpointed_iteration.txt naming the newest
  // (Megatron's layout); keep_last > 0 keeps only that many iter_ directories.
  std::string save_dir;
  int64_t save_interval = 0;
  int keep_last = 0;
  std::string load_dir;  // resume from here (any dp size): a save_dir (its newest) or one checkpoint
  // Start from a Hugging Face GPT-2 directory's weights (hf.h: config.json, model.safetensors)
  // instead of the seeded initialization, at iteration 0 with a fresh optimizer. `model` must be
  // the directory's config (read_hf_gpt2_config; its seq_length may be shorter). Not with load_dir.
  std::string load_hf_dir;
  // Megatron's --skip-train: no iteration; evaluate the loaded (or initial) params on every
  // evaluation split (eval_iters batches each), report, and stop. Not with save_dir.
  bool skip_train = false;
  // Stopping early, as Megatron's flags: after an iteration divisible by exit_interval, or once the
  // run has lasted exit_duration_in_mins, or when TrainCallbacks::stop_requested says so on any
  // rank, every rank stops after the same iteration, saves (when save_dir is set) and returns with
  // TrainResult::exit_reason. 0: never.
  int64_t exit_interval = 0;
  double exit_duration_in_mins = 0;

  void validate(int dp) const;  // throws Error naming a bad value
  GptModelOptions model_options() const;  // the GPT's options: recompute, bf16, fine-grained hooks
  // FSDP's fine-grained param gather, decided from fsdp's policy and flag, the MXFP8 params and
  // the recompute (decide_fine_grained_param_gather); off without FSDP. Throws as that does.
  FineGrainedParamGatherDecision fine_grained_param_gather() const;
  int accumulation_steps(int dp) const { return global_batch_size / (micro_batch_size * dp); }
};

// What every rank of an `mxddp train` job must agree on, named by flag, for check_same_job
// (launch_check.h): every field of the config except those that may differ per rank (the compute
// threads; the command's --report, --metrics-file, --log-interval and --timeout-ms are not in it).
std::vector<JobField> train_job_fields(const TrainConfig& config);

// The ranks that share this machine's cores and memory: every rank of the local backend (threads of
// one process); under mpirun, the ranks on this node (OMPI_COMM_WORLD_LOCAL_SIZE).
int ranks_on_this_machine(const Communicator& comm);
// The compute threads train() gives the calling rank: config.compute_threads, or (0) the cores
// over the ranks that share this machine.
int rank_compute_threads(const TrainConfig& config, const Communicator& comm);
// ... when ranks_on_this_machine ranks share this machine's cores.
int rank_compute_threads(const TrainConfig& config, int ranks_on_this_machine);

// The schedule's learning rate for (0-based) iteration it.
float learning_rate(const TrainConfig& config, int64_t iteration);

struct StepRecord {
  int64_t iteration = 0;  // 1-based: the number of optimizer steps taken after this one
  // Training samples consumed through this iteration, over the whole run, resumes included
  // (Megatron's consumed_train_samples): the sum of the global batch sizes of iterations 1..this.
  int64_t consumed_samples = 0;
  double loss = 0;        // mean over the global batch, before the update
  double lr = 0;
  double grad_norm = 0;
  bool skipped = false;
  // This rank's time, ms. comm_ms is exposed communication: waits for param gathers in the
  // forward pre-hooks plus finish_grad_sync. optimizer_ms: zero_grad and step.
  double forward_ms = 0, backward_ms = 0, comm_ms = 0, optimizer_ms = 0, step_ms = 0;
};

struct EvalRecord {
  int64_t iteration = 0;
  double loss = 0;
  // The data split evaluated: "validation" (every evaluation during training), or, with
  // skip_train, each held-out split the data has: "validation", then "test" for indexed data whose
  // --split gives the test split documents.
  std::string split = "validation";
};

struct RankMemory {
  MemoryUsage overall;  // peak and live bytes over the whole run
  MemoryUsage steady;   // peaks after the first iteration (the steady state)
  int64_t scratch_allocations_after_warmup = 0;  // global memory buffer (re)allocations; 0 expected
  // FSDP (optim_grads_params): the peak gathered bytes of each GatherSlot over the run (BF16
  // values, MXFP8 row-wise, MXFP8 column-wise), each its own peak; zeros under DDP.
  std::array<int64_t, kGatherSlots> peak_gathered_bytes_by_slot{};
};

struct TrainResult {
  int64_t start_iteration = 0;  // > 0 when resumed
  int64_t start_consumed_samples = 0;  // the samples consumed before it (the checkpoint's)
  std::vector<StepRecord> steps;
  std::vector<EvalRecord> evals;
  double unigram_entropy = 0;  // of the training split, nats
  int64_t tokens_per_iteration = 0;
  double train_seconds = 0;
  double tokens_per_second = 0;
  std::vector<RankMemory> memory_by_rank;  // [dp], on every rank
  std::string exit_reason;  // why the run stopped before train_iters ("" when it did not)
};

struct TrainCallbacks {
  std::function<void(const StepRecord&)> on_step;  // after every iteration, on every rank
  std::function<void(const EvalRecord&)> on_eval;
  std::function<void(int64_t iteration, const std::string& dir)> on_save;
  // Resuming with a schedule or batch other than the checkpoint's: one message per difference.
  std::function<void(const std::string& message)> on_warning;
  // Polled after every iteration on every rank (e.g. a signal's flag, Megatron's
  // --exit-signal-handler); true on any rank stops the run after that iteration, every rank
  // together (they agree through a collective). Such a stop is a preemption with a deadline, so it
  // saves (with save_dir) before the evaluation due at that iteration, which it skips (saying so
  // through on_warning). Set it on every rank or on none.
  std::function<bool()> stop_requested;
  // What stop_requested's true stands for, named in TrainResult::exit_reason ("a stop was requested
  // (--exit-signal-handler: SIGUSR1)"); asked on the ranks whose stop_requested said true. Unset:
  // "TrainCallbacks::stop_requested".
  std::function<std::string()> stop_cause;
  // Tests and benchmarks: decorate the DDP or FSDP object before the model and the optimizer are
  // built on it (e.g. to inject delays into its hooks or to read its event log). Returns the
  // object they will use; it must forward to the one it is given, which it then owns.
  std::function<std::unique_ptr<DataParallel>(std::unique_ptr<DataParallel>)> wrap_data_parallel;
};

// Collective. Hashes (CRC-32) every param as the forward reads it (its values, or an MXFP8 param's
// payloads and scales) on every rank and compares the ranks' hashes: returns "" when all ranks
// hold the same params, otherwise which params differ and on which ranks (the same text on every
// rank). modules: the param lists of the model's modules in forward order, covering every param;
// each is read between dp's before_forward and after_forward, as a forward-only pass would. Call it
// between iterations, after force_param_sync.
std::string param_hash_mismatches(DataParallel& dp, const std::vector<std::vector<int>>& modules);

// The reference GPT's checks of a checkpoint that the checkpoint layer cannot run: when the
// manifest records a model config, its param list (names, shapes, the shared embedding) must be
// the one gpt_param_specs gives for that config. One message per problem; none when no config
// was saved. `mxddp ckpt inspect` adds them to inspect_checkpoint's.
std::vector<std::string> gpt_checkpoint_problems(const CheckpointInfo& info);

// resolve_checkpoint_dir (a --load, `mxddp ckpt inspect`/`export` of a history or one checkpoint)
// is in checkpoint_history.h, with the history's layout, which the Python package shares.

// Collective: every rank of comm calls it with the same config.
TrainResult train(Communicator& comm, const TrainConfig& config, const TrainCallbacks& callbacks = {});

}  // namespace mxddp
