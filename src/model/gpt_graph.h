// The reference GPT's forward and backward as one template over the element type, independent of
// where params, gradients and scratch live: GptAccess says how to read a weight, where a
// gradient accumulates, and how to get scratch. GptModel (gpt_model.cc) runs it in f32 over a
// DistributedDataParallel; the gradient test runs it in f64 over plain arrays.
//
// Per micro-batch: B sequences of T tokens, N = B*T rows, C hidden, H heads, V vocabulary.
// Activations (scratch, by name; "l<i>/" per layer, or one "rc/" set that the layers share for
// what a recompute drops: everything below with full granularity, a selective recompute's
// modules' internals otherwise; see RecomputeModule in model.h):
//   res/<l>   [N, C]  the residual stream entering layer l (l = 0..L; res/L enters the final norm)
//   ln1, ln2  [N, C]  layer norms; *_mean, *_rstd [N]
//   qkv       [N, 3C] fused q | k | v
//   softmax_stats [B, H, 2, T] each query row's softmax max and 1/sum (causal_attention.h: the
//             probabilities themselves are rebuilt in backward, never kept)
//   atty      [N, C]  attention output before the projection
//   xmid      [N, C]  residual after attention
//   fc1       [N, 4C]
// and for every layer the same: "mlp_4c" [N, 4C], GELU's output (fc2's input), rebuilt from fc1 in
// backward just before fc2's weight gradient reads it (an elementwise pass instead of L copies),
// then overwritten by its own gradient; "attn_tiles", attention's per-thread scratch.
//   lnf [N, C], logits [N, V] (overwritten by their gradient in backward)
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include <mxddp/model.h>

#include "gpt_ops.h"

namespace mxddp::model {

// Which copy of a weight a product wants: with MXFP8 params, the forward product reads the
// row-wise quantized weight and the data-gradient product the column-wise one.
enum class WeightUse : uint8_t { kForward, kDataGrad };

template <typename Real>
struct GptAccess {
  // The values of param i, valid until the next weight() call for a param of the same role.
  std::function<const Real*(int param, WeightUse use)> weight;
  // The BF16 bits of a matrix param for its products, read in place, or null where the products
  // need weight() (f32 compute, f32 or MXFP8 params, the f64 graph). Valid as weight()'s.
  std::function<const uint16_t*(int param, WeightUse use)> weight_bf16 = [](int, WeightUse) -> const uint16_t* {
    return nullptr;
  };
  std::function<Real*(int param)> grad;  // where param i's gradient accumulates (+=)
  std::function<void(int param)> grad_ready = [](int) {};
  // The module hooks of DataParallel (data_parallel.h), each with the module's params.
  std::function<void(const std::vector<int>& params)> before_forward = [](const std::vector<int>&) {};
  std::function<void(const std::vector<int>& params)> after_forward = [](const std::vector<int>&) {};
  std::function<void(const std::vector<int>& params)> before_backward = [](const std::vector<int>&) {};
  std::function<void(const std::vector<int>& params)> after_backward = [](const std::vector<int>&) {};
  // Scratch of at least numel elements, the same storage for the same name (contents kept).
  std::function<Real*(const std::string& name, int64_t numel)> scratch;
  // Elements of attention's scratch: it depends on the threads that run it, which a memory plan
  // names instead of reading them from this thread.
  std::function<int64_t(int seq)> attention_scratch_numel = [](int seq) { return model::attention_scratch_numel(seq); };
};

template <typename Real>
class GptGraph {
 public:
  // granularity, modules and fine_grained as GptModelOptions (validated there; fine_grained is its
  // fine_grained_param_gather: the hooks run per weighted submodule, not per layer).
  GptGraph(const GptConfig& config, GptAccess<Real> access,
           RecomputeGranularity granularity = RecomputeGranularity::kNone, RecomputeModules modules = {},
           bool fine_grained = false)
      : cfg_(config), ids_(config), access_(std::move(access)), granularity_(granularity), modules_(std::move(modules)),
        fine_grained_(fine_grained) {}

  // tokens [batch, T + 1]: inputs are each row's first T, targets its last T. Returns the summed
  // loss over the batch's B*T tokens. With grad_scale != 0 the loss's gradient is kept for
  // backward(), which then accumulates every param's gradient of grad_scale * (summed loss) and
  // reports each ready.
  double forward(const int32_t* tokens, int batch, Real grad_scale) {
    const int seq = cfg_.seq_length, n = batch * seq;
    // No tokens: a trace of the control flow (gpt_trace.cc), whose kernels read none.
    inputs_.resize(tokens != nullptr ? static_cast<size_t>(n) : 0);
    targets_.resize(tokens != nullptr ? static_cast<size_t>(n) : 0);
    for (int b = 0; tokens != nullptr && b < batch; ++b)
      for (int t = 0; t < seq; ++t) {
        inputs_[static_cast<size_t>(b * seq + t)] = tokens[b * (seq + 1) + t];
        targets_[static_cast<size_t>(b * seq + t)] = tokens[b * (seq + 1) + t + 1];
      }
    batch_ = batch;
    backward_ready_ = grad_scale != Real(0);
    return forward_pass(grad_scale);
  }

  void backward() {
    MXDDP_CHECK(backward_ready_, "backward() needs a forward() with a non-zero grad_scale just before it");
    backward_ready_ = false;
    backward_pass();
  }

 private:
  struct LayerActs {
    Real *ln1, *ln1_mean, *ln1_rstd, *qkv, *softmax_stats, *atty, *xmid, *ln2, *ln2_mean, *ln2_rstd, *fc1;
  };

  int rows() const { return batch_ * cfg_.seq_length; }
  Real* scratch(const std::string& name, int64_t numel) { return access_.scratch(name, numel); }
  Real* res(int layer) { return scratch(fmt::format("res/{}", layer), int64_t{rows()} * cfg_.hidden_size); }
  const Real* w(int param, WeightUse use = WeightUse::kForward) { return access_.weight(param, use); }
  // A matrix param as its products read it: in place in BF16 where weight_bf16 gives it.
  Operand<Real> lw(int param, WeightUse use = WeightUse::kForward) {
    if (const uint16_t* bits = access_.weight_bf16(param, use)) return {nullptr, bits};
    return {w(param, use), nullptr};
  }
  // A gradient dy [numel] that a weight-gradient and a data-gradient product both read: under BF16
  // compute it is rounded once, here, for both (each product would round it again).
  Operand<Real> grad_operand(const Real* dy, int64_t numel) {
    if constexpr (std::is_same_v<Real, float>) {
      if (products_in_bf16()) {
        if (dy16_.size() < static_cast<size_t>(numel)) dy16_.resize(static_cast<size_t>(numel));
        round_to_bf16(dy, dy16_.data(), numel);
        return {dy, dy16_.data()};
      }
    }
    return {dy, nullptr};
  }
  Real* g(int param) { return access_.grad(param); }
  void ready(std::initializer_list<int> params) {
    for (int p : params) access_.grad_ready(p);
  }

  // Activations whose only readers are products are kept in BF16 when those run in BF16 (the f32
  // graph under --bf16 on a CPU with native BF16): GELU's output (fc2's input) and the layer
  // norms' (layer_norm below). Half the bytes, and no rounding pass before each product.
  bool activations_in_bf16() const {
    if constexpr (std::is_same_v<Real, float>) return products_in_bf16();
    return false;
  }

  // A layer's norms (ln1, ln2) only feed its products too: kept in BF16 under BF16 compute, in the
  // first half of their f32 storage. norm_operand is how the products read them.
  void layer_norm(const Real* x, const Real* weight, const Real* bias, Real* y, Real* mean, Real* rstd) {
    if constexpr (std::is_same_v<Real, float>) {
      if (activations_in_bf16())
        return layernorm_forward_bf16(x, weight, bias, reinterpret_cast<uint16_t*>(y), mean, rstd, rows(),
                                      cfg_.hidden_size);
    }
    layernorm_forward(x, weight, bias, y, mean, rstd, rows(), cfg_.hidden_size);
  }
  Operand<Real> norm_operand(const Real* y) const {
    if (activations_in_bf16()) return {nullptr, reinterpret_cast<const uint16_t*>(y)};
    return {y, nullptr};
  }

  // Whether a selective recompute re-runs submodule m in backward.
  bool selective(RecomputeModule m) const {
    return granularity_ == RecomputeGranularity::kSelective && modules_.contains(m);
  }

  // Layer l's activations: its own ("l<l>/") where backward reads what forward wrote, the shared
  // "rc/" set where forward's values are dropped (overwritten by the next layer) and backward
  // rebuilds them, so a dropped activation costs one layer's worth of scratch, not L.
  LayerActs acts(int layer) {
    const bool full = granularity_ == RecomputeGranularity::kFull;
    const std::string own = fmt::format("l{}/", layer);
    const std::string& norms = full || selective(RecomputeModule::kLayernorm) ? kShared : own;
    const std::string& attn = full || selective(RecomputeModule::kCoreAttn) ? kShared : own;
    const std::string& mlp = full || selective(RecomputeModule::kMlp) ? kShared : own;
    const std::string& rest = full ? kShared : own;  // linear outputs no submodule recompute rebuilds
    const int64_t n = rows(), c = cfg_.hidden_size, t = cfg_.seq_length;
    const int64_t stats = attention_stats_numel(batch_, static_cast<int>(t), cfg_.num_attention_heads);
    return {scratch(norms + "ln1", n * c),     scratch(norms + "ln1_mean", n), scratch(norms + "ln1_rstd", n),
            scratch(rest + "qkv", 3 * n * c),  scratch(attn + "softmax_stats", stats),
            scratch(rest + "atty", n * c),     scratch(rest + "xmid", n * c),   scratch(norms + "ln2", n * c),
            scratch(norms + "ln2_mean", n),    scratch(norms + "ln2_rstd", n),  scratch(mlp + "fc1", 4 * n * c)};
  }

  // Why a submodule runs: in the forward pass, or again in backward to rebuild what was dropped.
  enum class Run : uint8_t { kForward, kRecompute };

  // Layer l: res/l -> res/(l+1), keeping its activations in `a`. A recompute (full granularity)
  // rebuilds `a` and leaves res/(l+1) alone: it is the next layer's input, not this one's.
  void layer_forward(int l, const LayerActs& a, Run run) {
    const int n = rows(), c = cfg_.hidden_size;
    const Real* x = res(l);
    input_layernorm_forward(l, a);
    submodule_before_forward(l, kQkvW);
    linear_forward(norm_operand(a.ln1), lw(ids_.layer(l, kQkvW)), w(ids_.layer(l, kQkvB)), a.qkv, n, c, 3 * c);
    submodule_after_forward(l, kQkvW);
    core_attention_forward(a);
    submodule_before_forward(l, kProjW);
    linear_forward(a.atty, lw(ids_.layer(l, kProjW)), w(ids_.layer(l, kProjB)), a.xmid, n, c, c);
    submodule_after_forward(l, kProjW);
    add_in_place(a.xmid, x, int64_t{n} * c);
    pre_mlp_layernorm_forward(l, a);
    mlp_forward(l, a, run);
    if (run == Run::kForward) add_in_place(res(l + 1), a.xmid, int64_t{n} * c);
  }

  // ---- The submodules a recompute re-runs (RecomputeModule). Forward and the recompute in
  // backward both run a submodule through its function here, so whatever must happen around a
  // submodule's run (such as gathering its params just before, for a fine-grained FSDP gather)
  // has exactly one place to go. ----

  // The params of layer l's submodule whose weight is `weight`: the weight and its bias (LayerParam
  // lists them in that order), one unit of gpt_fsdp_units(config, true).
  std::vector<int> submodule_params(int l, LayerParam weight) const {
    return {ids_.layer(l, weight), ids_.layer(l, static_cast<LayerParam>(weight + 1))};
  }
  // With the fine-grained gather, the hooks around a submodule's run (the weights are read, into
  // the weight scratch, between the two; nothing reads the param storage after the post-hook).
  // Without it the layer's hooks cover the submodule and these do nothing.
  void submodule_before_forward(int l, LayerParam weight) {
    if (fine_grained_) access_.before_forward(submodule_params(l, weight));
  }
  void submodule_after_forward(int l, LayerParam weight) {
    if (fine_grained_) access_.after_forward(submodule_params(l, weight));
  }
  void submodule_before_backward(int l, LayerParam weight) {
    if (fine_grained_) access_.before_backward(submodule_params(l, weight));
  }
  void submodule_after_backward(int l, LayerParam weight) {
    if (fine_grained_) access_.after_backward(submodule_params(l, weight));
  }

  // layernorm, the input norm: res/l -> ln1, ln1_mean, ln1_rstd. Reads ln1's weight and bias.
  void input_layernorm_forward(int l, const LayerActs& a) {
    submodule_before_forward(l, kLn1W);
    layer_norm(res(l), w(ids_.layer(l, kLn1W)), w(ids_.layer(l, kLn1B)), a.ln1, a.ln1_mean, a.ln1_rstd);
    submodule_after_forward(l, kLn1W);
  }

  // core_attn: qkv -> softmax_stats, atty. Reads no params.
  void core_attention_forward(const LayerActs& a) {
    attention_forward(a.qkv, a.softmax_stats, a.atty, attention_tiles(), batch_, cfg_.seq_length, cfg_.hidden_size,
                      cfg_.num_attention_heads);
  }
  // GELU's output in forward, fc2's input and then its gradient in backward (see the top).
  Real* mlp_4c() { return scratch("mlp_4c", int64_t{rows()} * 4 * cfg_.hidden_size); }
  Real* attention_tiles() { return scratch("attn_tiles", access_.attention_scratch_numel(cfg_.seq_length)); }

  // layernorm, the pre-MLP norm: xmid -> ln2, ln2_mean, ln2_rstd. Reads ln2's weight and bias.
  void pre_mlp_layernorm_forward(int l, const LayerActs& a) {
    submodule_before_forward(l, kLn2W);
    layer_norm(a.xmid, w(ids_.layer(l, kLn2W)), w(ids_.layer(l, kLn2B)), a.ln2, a.ln2_mean, a.ln2_rstd);
    submodule_after_forward(l, kLn2W);
  }

  // mlp: ln2 -> fc1 -> GELU -> fc2 -> res/(l+1) (the residual is added by the layer). Forward reads
  // the forward weights of fc1 and fc2. A recompute stops after fc1 and reads fc1's only: backward
  // needs fc1 (GELU's input, from which it rebuilds fc2's input anyway), never fc2's output
  // (Megatron's checkpoint re-runs fc2 too, and drops its output).
  void mlp_forward(int l, const LayerActs& a, Run run) {
    const int n = rows(), c = cfg_.hidden_size;
    submodule_before_forward(l, kFc1W);
    linear_forward(norm_operand(a.ln2), lw(ids_.layer(l, kFc1W)), w(ids_.layer(l, kFc1B)), a.fc1, n, c, 4 * c);
    submodule_after_forward(l, kFc1W);
    if (run == Run::kRecompute) return;  // fc2 is not gathered either
    Real* gelu = mlp_4c();
    if constexpr (std::is_same_v<Real, float>) {
      if (activations_in_bf16()) {  // fc2's operand only: kept in BF16 (the first half of mlp_4c's storage)
        uint16_t* gelu16 = reinterpret_cast<uint16_t*>(gelu);
        gelu_forward_bf16(a.fc1, gelu16, int64_t{n} * 4 * c);
        submodule_before_forward(l, kFc2W);
        linear_forward(Operand<float>(nullptr, gelu16), lw(ids_.layer(l, kFc2W)), w(ids_.layer(l, kFc2B)), res(l + 1),
                       n, 4 * c, c);
        submodule_after_forward(l, kFc2W);
        return;
      }
    }
    gelu_forward(a.fc1, gelu, int64_t{n} * 4 * c);
    submodule_before_forward(l, kFc2W);
    linear_forward(gelu, lw(ids_.layer(l, kFc2W)), w(ids_.layer(l, kFc2B)), res(l + 1), n, 4 * c, c);
    submodule_after_forward(l, kFc2W);
  }

  std::vector<int> layer_params(int l) const {
    std::vector<int> params(kLayerParamCount);
    for (int k = 0; k < kLayerParamCount; ++k) params[static_cast<size_t>(k)] = ids_.layer(l, static_cast<LayerParam>(k));
    return params;
  }

  double forward_pass(Real grad_scale) {
    const int n = rows(), c = cfg_.hidden_size, v = cfg_.vocab_size;
    // The embeddings and the final norm are modules whose params stay resident through backward
    // (the LM head reuses wte), so only the layers get post-forward hooks.
    access_.before_forward({ids_.wte(), ids_.wpe()});
    embedding_forward(inputs_.data(), w(ids_.wte()), w(ids_.wpe()), res(0), batch_, cfg_.seq_length, c);
    for (int l = 0; l < cfg_.num_layers; ++l) {
      const std::vector<int> params = layer_params(l);
      if (!fine_grained_) access_.before_forward(params);
      layer_forward(l, acts(l), Run::kForward);
      if (!fine_grained_) access_.after_forward(params);
    }
    access_.before_forward({ids_.final_norm_weight(), ids_.final_norm_bias()});
    Real* lnf = scratch("lnf", int64_t{n} * c);
    layernorm_forward(res(cfg_.num_layers), w(ids_.final_norm_weight()), w(ids_.final_norm_bias()), lnf,
                      scratch("lnf_mean", n), scratch("lnf_rstd", n), n, c);
    // The LM head is the token embedding, transposed: logits [N, V] = lnf wte^T.
    Real* logits = scratch("logits", int64_t{n} * v);
    gemm_operands(Op::kN, Op::kT, n, v, c, Operand<Real>(lnf), c, lw(ids_.wte()), c, Real(0), logits, v);
    return cross_entropy(logits, targets_.data(), scratch("row_loss", n), n, v, grad_scale);
  }

  void backward_pass() {
    const int n = rows(), c = cfg_.hidden_size, v = cfg_.vocab_size, L = cfg_.num_layers;
    const Real* lnf = scratch("lnf", int64_t{n} * c);
    const Real* dlogits = scratch("logits", int64_t{n} * v);
    Real* dres = scratch("grad/dres", int64_t{n} * c);  // dL/d(residual stream), carried down
    Real* dln = scratch("grad/dc", int64_t{n} * c);
    const Operand<Real> dy_head = grad_operand(dlogits, int64_t{n} * v);
    gemm_operands(Op::kT, Op::kN, v, c, n, dy_head, v, Operand<Real>(lnf), c, Real(1), g(ids_.wte()), c);
    gemm_operands(Op::kN, Op::kN, n, c, v, dy_head, v, lw(ids_.wte(), WeightUse::kDataGrad), c, Real(0), dln, c);
    fill_zero(dres, int64_t{n} * c);
    layernorm_backward(dln, res(L), w(ids_.final_norm_weight()), scratch("lnf_mean", n), scratch("lnf_rstd", n), dres,
                       g(ids_.final_norm_weight()), g(ids_.final_norm_bias()), n, c);
    ready({ids_.final_norm_weight(), ids_.final_norm_bias()});
    for (int l = L - 1; l >= 0; --l) layer_backward(l, dres);
    embedding_backward(inputs_.data(), dres, g(ids_.wte()), g(ids_.wpe()), batch_, cfg_.seq_length, c);
    ready({ids_.wpe(), ids_.wte()});
  }

  // fc2's backward, then GELU's: returns dL/d(fc1 output) [n, 4c] (in d4c, with its BF16 copy
  // under BF16 products) as fc1's products read it. d4c [n, 4c] and d3c [n, 3c] are scratch.
  Operand<Real> fc2_and_gelu_backward(int l, const LayerActs& a, const Real* dres, Real* d4c, Real* d3c) {
    const int n = rows(), c = cfg_.hidden_size;
    const int64_t n4c = int64_t{n} * 4 * c;
    const int fc2_w = ids_.layer(l, kFc2W), fc2_b = ids_.layer(l, kFc2B);
    if constexpr (std::is_same_v<Real, float>) {
      if (activations_in_bf16()) {
        // Forward kept GELU's output in BF16 and backward rebuilds it from fc1. Here the data
        // gradient goes first (into d4c, f32), so that one pass over fc1 rebuilds GELU's output
        // and turns d4c into dL/d(fc1 output), with one sigmoid per element (the rebuild was a
        // pass of its own, a third of GELU's time). The rebuilt output and dres's BF16 copy
        // live in d3c's storage (10c of its 12c bytes per row), free until attention's backward.
        uint16_t* gelu16 = reinterpret_cast<uint16_t*>(d3c);  // [n, 4c] BF16
        uint16_t* dres16 = gelu16 + n4c;                        // [n, c] BF16
        submodule_before_backward(l, kFc2W);
        round_to_bf16(dres, dres16, int64_t{n} * c);
        const Operand<Real> dy_fc2(dres, dres16);
        linear_backward_data(dy_fc2, lw(fc2_w, WeightUse::kDataGrad), d4c, n, 4 * c, c, false);
        if (dy16_.size() < static_cast<size_t>(n4c)) dy16_.resize(static_cast<size_t>(n4c));
        gelu_forward_backward_bf16(a.fc1, d4c, gelu16, d4c, dy16_.data(), n4c);
        linear_backward_weight(dy_fc2, Operand<Real>(nullptr, gelu16), g(fc2_w), g(fc2_b), n, 4 * c, c);
        ready({fc2_w, fc2_b});
        submodule_after_backward(l, kFc2W);
        return {d4c, dy16_.data()};
      }
    }
    gelu_forward(a.fc1, d4c, n4c);  // fc2's input again (forward's was the last layer's)
    submodule_before_backward(l, kFc2W);
    const Operand<Real> dy_fc2 = grad_operand(dres, int64_t{n} * c);
    linear_backward_weight(dy_fc2, Operand<Real>(d4c), g(fc2_w), g(fc2_b), n, 4 * c, c);
    ready({fc2_w, fc2_b});
    linear_backward_data(dy_fc2, lw(fc2_w, WeightUse::kDataGrad), d4c, n, 4 * c, c, false);
    submodule_after_backward(l, kFc2W);
    gelu_backward(a.fc1, d4c, d4c, n4c);
    return grad_operand(d4c, n4c);
  }

  // dres: dL/d res/(l+1) in, dL/d res/l out.
  void layer_backward(int l, Real* dres) {
    const int n = rows(), c = cfg_.hidden_size;
    const std::vector<int> params = layer_params(l);
    // With the fine-grained gather each submodule's backward has its own hooks, below, and a
    // recompute's submodules gather theirs in their forward functions (kept until their backward).
    if (!fine_grained_) access_.before_backward(params);
    const LayerActs a = acts(l);
    // Each recompute runs just before its activations are first needed, as Megatron's does. It is a
    // forward of (part of) the layer: without the fine-grained gather the layer's own pre- and
    // post-forward hooks cover it, so that what only forward reads (FSDP's MXFP8 row-wise copy) is
    // gathered for it, for the whole layer; with it, each submodule's hooks gather only its own.
    const bool early_recompute = granularity_ == RecomputeGranularity::kFull || selective(RecomputeModule::kLayernorm) ||
                                 selective(RecomputeModule::kMlp);
    if (early_recompute && !fine_grained_) access_.before_forward(params);
    if (granularity_ == RecomputeGranularity::kFull) layer_forward(l, a, Run::kRecompute);
    if (selective(RecomputeModule::kLayernorm)) pre_mlp_layernorm_forward(l, a);  // ln2 feeds fc1 (and its recompute)
    if (selective(RecomputeModule::kMlp)) mlp_forward(l, a, Run::kRecompute);
    if (early_recompute && !fine_grained_) access_.after_forward(params);
    const Real* x = res(l);
    Real* dln = scratch("grad/dc", int64_t{n} * c);
    Real* d4c = mlp_4c();  // fc2_and_gelu_backward's scratch, then dL/d(fc1 output)
    Real* d3c = scratch("grad/d3c", int64_t{n} * 3 * c);
    auto id = [&](LayerParam p) { return ids_.layer(l, p); };

    const Operand<Real> dy_fc1 = fc2_and_gelu_backward(l, a, dres, d4c, d3c);
    submodule_before_backward(l, kFc1W);
    linear_backward_weight(dy_fc1, norm_operand(a.ln2), g(id(kFc1W)), g(id(kFc1B)), n, c, 4 * c);
    ready({id(kFc1W), id(kFc1B)});
    linear_backward_data(dy_fc1, lw(id(kFc1W), WeightUse::kDataGrad), dln, n, c, 4 * c, false);
    submodule_after_backward(l, kFc1W);
    // dres becomes dL/dxmid: the residual path plus the pre-MLP norm's path.
    submodule_before_backward(l, kLn2W);
    layernorm_backward(dln, a.xmid, w(id(kLn2W)), a.ln2_mean, a.ln2_rstd, dres, g(id(kLn2W)), g(id(kLn2B)), n, c);
    ready({id(kLn2W), id(kLn2B)});
    submodule_after_backward(l, kLn2W);

    submodule_before_backward(l, kProjW);
    const Operand<Real> dy_proj = grad_operand(dres, int64_t{n} * c);
    linear_backward_weight(dy_proj, a.atty, g(id(kProjW)), g(id(kProjB)), n, c, c);
    ready({id(kProjW), id(kProjB)});
    linear_backward_data(dy_proj, lw(id(kProjW), WeightUse::kDataGrad), dln, n, c, c, false);
    submodule_after_backward(l, kProjW);
    // Rewrites atty as well, with the same values; its last reader (proj's weight gradient) is done.
    if (selective(RecomputeModule::kCoreAttn)) core_attention_forward(a);
    attention_backward(dln, a.qkv, a.softmax_stats, d3c, attention_tiles(), batch_, cfg_.seq_length, c,
                       cfg_.num_attention_heads);
    if (selective(RecomputeModule::kLayernorm)) input_layernorm_forward(l, a);
    submodule_before_backward(l, kQkvW);
    const Operand<Real> dy_qkv = grad_operand(d3c, int64_t{n} * 3 * c);
    linear_backward_weight(dy_qkv, norm_operand(a.ln1), g(id(kQkvW)), g(id(kQkvB)), n, c, 3 * c);
    ready({id(kQkvW), id(kQkvB)});
    linear_backward_data(dy_qkv, lw(id(kQkvW), WeightUse::kDataGrad), dln, n, c, 3 * c, false);
    submodule_after_backward(l, kQkvW);
    submodule_before_backward(l, kLn1W);
    layernorm_backward(dln, x, w(id(kLn1W)), a.ln1_mean, a.ln1_rstd, dres, g(id(kLn1W)), g(id(kLn1B)), n, c);
    ready({id(kLn1W), id(kLn1B)});
    submodule_after_backward(l, kLn1W);
    if (!fine_grained_) access_.after_backward(params);
  }

  GptConfig cfg_;
  GptParamIds ids_;
  // The prefix of the activations a recompute drops: one set that every layer overwrites.
  inline static const std::string kShared = "rc/";

  GptAccess<Real> access_;
  RecomputeGranularity granularity_;
  RecomputeModules modules_;
  bool fine_grained_ = false;
  int batch_ = 0;
  bool backward_ready_ = false;
  std::vector<int32_t> inputs_, targets_;  // [N]
  std::vector<uint16_t> dy16_;  // grad_operand's BF16 gradient, [N, max(V, 4C)] at most
};

}  // namespace mxddp::model
