// mxddp model: the reference GPT and its data, written against the public API like any user's
// model (it never reaches into library internals).
//
// Owns:
//   GptConfig and its presets; the param list (registration order = forward order, Megatron's
//   names) and a deterministic GPT-2-style initialization;
//   GptModel: a GPT-2 decoder (token + position embeddings, pre-LayerNorm blocks with causal
//   multi-head attention and a GELU MLP, a final LayerNorm, an LM head tied to the token
//   embedding) with a hand-written forward and backward on the CPU over a DistributedDataParallel
//   (with Megatron's full or selective activation recompute):
//   BF16 params (or MXFP8 with fp8_param_gather) converted into f32 scratch from a
//   GlobalMemoryBuffer, f32 compute on oneDNN (BF16 products with bf16), weight gradients accumulated straight into
//   main_grad and reported with grad_ready the moment they are final, before_forward per module;
//   TokenDataset: byte-level tokens (vocabulary 256) from a text file or the built-in corpus,
//   a train/validation split, and deterministic rank-disjoint sampling.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <mxddp/data_parallel.h>
#include <mxddp/ddp.h>
#include <mxddp/memory.h>

namespace mxddp {

// ----------------------------------------------------------------------------------------------
// Configuration and params
// ----------------------------------------------------------------------------------------------

struct GptConfig {
  int vocab_size = 256;  // embedding rows: the tokenizer's vocabulary padded (256: byte-level tokens)
  int num_layers = 2;
  int hidden_size = 64;
  int num_attention_heads = 4;
  int seq_length = 64;  // tokens per sequence (and rows of the position embedding)

  void validate() const;  // throws Error naming a bad value
  int64_t num_params() const;
  // Matrix-product FLOPs of one training token (forward + backward = 3 x forward), counting
  // the attention products at full T x T as computed.
  double train_flops_per_token() const;
  std::string describe() const;  // "2 layers, hidden 64, 4 heads, seq 64, 0.12M params"
  // Every field as (name, value), in declaration order: what a checkpoint stores and compares
  // on load (two models with other head counts have the same param shapes).
  std::vector<std::pair<std::string, std::string>> fields() const;
  // The inverse of fields(): the same names in the same order, integer values; throws Error
  // naming the field otherwise, or when the config is not valid.
  static GptConfig from_fields(const std::vector<std::pair<std::string, std::string>>& fields);
};

// Every GptConfig field, once (config_fields.h): `mxddp train`'s model flags (each overrides its
// --model preset), its report's "model" section, and the names of fields() (a checkpoint
// manifest's "model_config"; config_fields_test checks they agree). vocab_size has no flag of
// its own: `mxddp train` sets it from --vocab-size or the tokenizer's, padded by
// --make-vocab-size-divisible-by (docs/data.md).
constexpr auto describe_fields(std::type_identity<GptConfig>) {
  using C = GptConfig;
  return std::tuple{
      ConfigField<C, int>{"vocab_size", "", "Vocabulary size, padded (256: byte-level tokens)", &C::vocab_size, kPositive},
      ConfigField<C, int>{"num_layers", "--num-layers", "decoder layers", &C::num_layers, kPositive},
      ConfigField<C, int>{"hidden_size", "--hidden-size", "hidden size", &C::hidden_size, kPositive},
      ConfigField<C, int>{"num_attention_heads", "--num-attention-heads", "heads", &C::num_attention_heads, kPositive},
      ConfigField<C, int>{"seq_length", "--seq-length", "sequence length", &C::seq_length, kPositive},
  };
}

// "tiny" (2 x 64, seq 64), "small" (6 x 384, seq 256, ~10.8M params), "gpt2-124m" (GPT-2 small's
// shape: 12 x 768, 12 heads, seq 1024; 85.8M params with the byte-level vocabulary).
GptConfig gpt_preset(std::string_view name);
std::vector<std::string> gpt_preset_names();

// A decoder layer's params, in registration order; layer l's param k has index 2 + 12 l + k.
enum LayerParam : int {
  kLn1W, kLn1B, kQkvW, kQkvB, kProjW, kProjB, kLn2W, kLn2B, kFc1W, kFc1B, kFc2W, kFc2B, kLayerParamCount
};

// Registration indices of the params.
struct GptParamIds {
  explicit GptParamIds(const GptConfig& config) : num_layers(config.num_layers) {}
  int wte() const { return 0; }  // [V, C], the shared embedding (also the LM head)
  int wpe() const { return 1; }  // [T, C]
  int layer(int l, LayerParam p) const { return 2 + kLayerParamCount * l + static_cast<int>(p); }
  int final_norm_weight() const { return 2 + kLayerParamCount * num_layers; }
  int final_norm_bias() const { return final_norm_weight() + 1; }
  // In 64 bits: a config read from an untrusted manifest may have 2^31 - 1 layers.
  int64_t count() const { return 4 + int64_t{kLayerParamCount} * num_layers; }
  int num_layers;
};

// The param list. Linear weights are [out, in]; with mxfp8_linear_weights they are marked MXFP8
// (for fp8_param_gather). The token embedding is marked as the shared embedding.
std::vector<ParamSpec> gpt_param_specs(const GptConfig& config, bool mxfp8_linear_weights = false);

// FSDP's units for the GPT, in forward order: one per decoder layer (its 12 params), or with
// fine_grained (the fine-grained param gather) one per weighted submodule of each layer, its weight
// and bias: input norm, qkv, proj, pre-MLP norm, fc1, fc2 (6 per layer; GptModelOptions must then
// say fine_grained_param_gather, so that the model's hooks name these units). The embeddings and
// the final norm are non-unit params.
std::vector<std::vector<int>> gpt_fsdp_units(const GptConfig& config, bool fine_grained = false);

// GPT-2's initialization, deterministic from the seed: linear weights and embeddings N(0, 0.02),
// the residual projections (attention output, second MLP layer) N(0, 0.02 / sqrt(2 L)), biases 0,
// norm weights 1. One f32 vector per param, in registration order.
std::vector<std::vector<float>> gpt_init_params(const GptConfig& config, uint64_t seed);

// ----------------------------------------------------------------------------------------------
// The model over DistributedDataParallel
// ----------------------------------------------------------------------------------------------

// Activation recompute, Megatron's --recompute-granularity (docs/model.md, "Activation recompute").
//   kNone: every layer keeps its activations for backward.
//   kFull: a layer keeps only its input (the residual stream) and re-runs its whole forward at the
//     start of its backward (Megatron's full granularity with --recompute-method uniform
//     --recompute-num-layers 1).
//   kSelective: a layer keeps its activations except the internals of recompute_modules, which
//     its backward re-runs just before it needs them.
enum class RecomputeGranularity : uint8_t { kNone, kFull, kSelective };

// The submodules a selective recompute re-runs, with Megatron's names (--recompute-modules), and
// what each drops per layer (N = micro-batch x seq rows, C hidden, H heads, T seq):
//   core_attn: the attention core (scores, softmax, P V; no weights): its softmax statistics
//     [B, H, 2, T]. The attention is flash-style and keeps no [T, T] probabilities anyway, so this
//     saves little (it is what Megatron's default selective recompute names).
//   mlp: fc1 -> GELU -> fc2 (weights fc1, fc2): fc1's output [N, 4C]. Backward re-runs fc1 only:
//     fc2's output is not needed for any gradient, and GELU's output is not kept in any mode (every
//     backward rebuilds it from fc1, into one buffer all layers share).
//   layernorm: the input and pre-MLP norms (weights and biases): their outputs [N, C] and
//     statistics (mean, rstd) [N] each.
enum class RecomputeModule : uint8_t { kCoreAttn, kMlp, kLayernorm };
using RecomputeModules = std::set<RecomputeModule>;

std::string_view recompute_granularity_name(RecomputeGranularity g);  // "none", "full", "selective"
// "full" or "selective" (the values of Megatron's flag; none is the flag left out). Throws Error
// naming the value otherwise.
RecomputeGranularity parse_recompute_granularity(std::string_view name);
std::string_view recompute_module_name(RecomputeModule m);  // "core_attn", "mlp", "layernorm"
RecomputeModule parse_recompute_module(std::string_view name);  // throws Error naming the value
std::string recompute_modules_names(const RecomputeModules& modules);  // "core_attn mlp" (flag order)

struct GptModelOptions {
  RecomputeGranularity recompute_granularity = RecomputeGranularity::kNone;
  // With kSelective, the submodules to recompute: at least one (Megatron's default is
  // {kCoreAttn}; `mxddp train` fills it in). Must be empty otherwise.
  RecomputeModules recompute_modules;
  // Megatron's --bf16: the matrix products multiply BF16 operands with F32 accumulation (into F32
  // activations and main_grad) where the CPU has native BF16 (see bf16 in ComputeInfo), F32
  // products elsewhere. Off: F32 products, what the exactness tests compare.
  bool bf16 = false;
  // The module hooks run around each weighted submodule (its weight and bias) instead of around
  // each decoder layer: the modules of gpt_fsdp_units(config, true), for FSDP's fine-grained param
  // gather. Forward and a recompute call before_forward / after_forward around the submodule's
  // run; backward calls before_backward / after_backward around each submodule's gradients.
  bool fine_grained_param_gather = false;

  void validate() const;  // throws Error naming a contradictory recompute setting
};

// Time spent in the model since the last reset, in ms. param_wait_ms is the time the pre-forward
// and pre-backward hooks spent waiting for param all-gathers (exposed communication);
// forward_ms and backward_ms exclude it.
struct GptTimings {
  double forward_ms = 0;
  double backward_ms = 0;
  double param_wait_ms = 0;
};

class GptModel {
 public:
  // dp (DistributedDataParallel or FullyShardedDataParallel) must hold gpt_param_specs(config, ...)
  // and keep f32 gradients (grad_reduce_in_fp32), which the weight-gradient products accumulate
  // into with beta = 1. Each decoder layer is one module for the hooks; the embeddings and the
  // final norm are modules of their own. dp and scratch must outlive the model.
  GptModel(DataParallel& ddp, GlobalMemoryBuffer& scratch, const GptConfig& config,
           const GptModelOptions& options = {});
  ~GptModel();
  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  // tokens: [micro_batch, seq_length + 1] (inputs: each row's first T, targets: its last T).
  // Forward and backward; accumulates the gradient of loss_scale x (mean loss over the
  // micro-batch's tokens) into main_grad and reports every param ready. Returns the mean loss.
  double forward_backward(const int32_t* tokens, int micro_batch, float loss_scale);
  // Forward only: the mean loss.
  double evaluate(const int32_t* tokens, int micro_batch);

  const GptConfig& config() const;
  const GptTimings& timings() const;
  void reset_timings();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ----------------------------------------------------------------------------------------------
// The model's calls, without the compute (for mxddp plan)
// ----------------------------------------------------------------------------------------------

// What one micro-batch of GptModel asks of its DataParallel and its scratch pool, in the order it
// asks, as GptModel::forward_backward / evaluate run it. The memory planner replays these against
// a simulated DDP or FSDP to know every allocation without running the model.
class GptCallTrace {
 public:
  virtual ~GptCallTrace() = default;
  // A GlobalMemoryBuffer::get_tensor of numel f32 elements under this name (the weight copies
  // included: gpt_weight_scratch_name in the model's sources).
  virtual void scratch(const std::string& name, int64_t numel) = 0;
  virtual void main_grad(int param) = 0;   // DataParallel::main_grad (FSDP may allocate there)
  virtual void grad_ready(int param) = 0;  // DataParallel::grad_ready
  // The module hooks of DataParallel, each with the module's params.
  virtual void before_forward(const std::vector<int>& params) = 0;
  virtual void after_forward(const std::vector<int>& params) = 0;
  virtual void before_backward(const std::vector<int>& params) = 0;
  virtual void after_backward(const std::vector<int>& params) = 0;
};

struct GptTraceOptions {
  int micro_batch = 1;
  bool backward = true;      // forward_backward; false: evaluate's forward only
  int compute_threads = 1;   // the rank's threads (attention's scratch is two [64, T] tiles per thread)
  std::vector<bool> mxfp8;   // [num params]: DataParallel::is_mxfp8 (the column-wise weight copies)
  // The params are stored in BF16 (DDPConfig's default param dtype): with options.bf16 on a CPU
  // with native BF16 the products read them in place and take no f32 weight copies.
  bool bf16_params = true;
};

// Runs the GPT's forward (and backward) control flow, computing nothing and touching no
// activation memory, and reports each call to trace. Cost: O(layers), whatever the shapes.
void trace_gpt_micro_batch(const GptConfig& config, const GptModelOptions& options, const GptTraceOptions& trace_options,
                           GptCallTrace& trace);

// Threads each matrix product of the calling thread may use (OpenMP's per-thread setting, which
// oneDNN follows): with ranks as threads, each rank's thread sets cores / ranks. A thread that
// never sets it uses every core. 0 restores that default. The count is capped at OpenMP's thread
// limit (OMP_THREAD_LIMIT) and OpenMP's dynamic adjustment is turned off, so that every region
// gets the count asked for (oneDNN relies on it).
void set_compute_threads(int threads);
// The count set_compute_threads(threads) gives a thread (threads > 0): at most the thread limit.
int effective_compute_threads(int threads);
int compute_threads();  // the calling thread's: at most the thread limit

// What the matrix products run on: for `mxddp train`'s banner and report and the benches.
struct ComputeInfo {
  std::string library;      // "oneDNN 2.6.3 matmul (OpenMP)"
  std::string cpu;          // the CPU's model name
  std::string isa;          // the instruction set oneDNN dispatches to, e.g. "avx512_core_amx"
  std::string f32_kernel;   // oneDNN's f32 implementation for the small preset's MLP product
  std::string bf16_kernel;  // ... its BF16 one; empty without native BF16
  bool bf16_supported = false;  // --bf16 really computes in BF16 (avx512_bf16 or AMX)
  int threads = 1;              // compute_threads() of the calling thread
  // One line: library, ISA, CPU, the kernel the products of that dtype run on, threads.
  std::string describe(bool bf16) const;
};
ComputeInfo compute_info();  // threads: the calling thread's
std::string compute_library_info(bool bf16 = false);  // compute_info().describe(bf16)

// ----------------------------------------------------------------------------------------------
// Data
// ----------------------------------------------------------------------------------------------

// The built-in corpus: deterministic English-like text from a small grammar (a fixed vocabulary
// of words in sentence templates), `bytes` long. Byte-level unigram entropy about 2.9 nats; a
// model that learns the words and the grammar gets well below it.
std::string builtin_corpus(int64_t bytes, uint64_t seed = 0);

// Byte-level tokens with a train/validation split: the last valid_fraction of the bytes are
// validation. Sampling is stateless: sequence j of iteration i starts at a position hashed from
// (seed, i, j), so a run resumed at iteration i reads what the uninterrupted run would have, at
// any data-parallel size. A global batch of G sequences gives rank r of dp the sequences
// [r G/dp, (r+1) G/dp), split into micro-batches in order.
// The offset of the first byte of text that is not UTF-8 text (a NUL, or a byte that starts or
// continues no valid UTF-8 sequence), or -1 when all of it is: what TokenDataset::from_file
// accepts as text.
int64_t first_non_text_byte(std::string_view text);

class TokenDataset {
 public:
  TokenDataset(std::string text, double valid_fraction, int seq_length);
  // A text file: refused (Error naming the offset) when it is not text (first_non_text_byte) or is a
  // Megatron index, so that token ids are never trained on as bytes.
  static TokenDataset from_file(const std::string& path, double valid_fraction, int seq_length);

  int64_t train_tokens() const { return split_; }
  std::string_view text() const { return bytes_; }  // every token, training split first
  int64_t valid_tokens() const { return static_cast<int64_t>(bytes_.size()) - split_; }
  // Entropy of the training split's byte frequencies, in nats: the loss of the best model that
  // ignores context.
  double unigram_entropy() const;

  // tokens [count, seq_length + 1] <- sequences [first, first + count) of stream `round`. Training
  // (the training split) uses round 0 and numbers its samples across the run: sample s is the
  // s-th consumed (consumed samples before the iteration + the position in its global batch), so
  // the data position is the consumed-sample count, whatever the batch size was (Megatron's
  // sampler resumes from consumed_train_samples). Evaluation (the validation split) uses round =
  // the validation batch's number and the position in it.
  void fill_batch(bool valid, uint64_t seed, int64_t round, int64_t first, int count, int32_t* tokens) const;

 private:
  std::string bytes_;
  int64_t split_ = 0;
  int seq_length_ = 0;
};

}  // namespace mxddp
