// A generic model for the data-parallel tests: its structure (modules, params, units) is generated
// from a structure class and a seed, so DDP and every FSDP strategy can be checked on shapes the
// reference GPT never has (every param in a unit, non-unit params first, last or in the middle, a
// param read by two modules, one-param units, frozen params, MXFP8 weights). It calls the
// DataParallel hooks the way a real model does (docs: include/mxddp/data_parallel.h), and the same
// forward/backward drives a serial reference (one rank, the whole global batch, plain f32 AdamW)
// that forms the gradients in the order the runtime reduces them, so a data-parallel run must
// reproduce its updates bit for bit on the local backend.
//
// The math, per module: z = x W^T (+ b), z' = z * g (a gain, if any), y = tanh(z'); loss per
// sample 0.5 * sum(y^2) of the last module, scaled by 1 / (the rank's samples per iteration).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <mxddp/data_parallel.h>
#include <mxddp/optim.h>
#include <mxddp/quant.h>

namespace mxddp::testing {

// Where the params of no unit sit. kAllInUnits is the structure that hid the after_backward defect
// (the GPT's embeddings sit outside every unit and report last).
enum class StructureClass : uint8_t {
  kAllInUnits,     // every registered param in a unit
  kNonUnitFirst,   // 1-2 non-unit modules before the units
  kNonUnitLast,    // 1-2 after them
  kNonUnitMiddle,  // 1-2 between two units
  kTiedFirstLast,  // a non-unit weight read by the first and the last module (a tied embedding)
};
inline constexpr StructureClass kStructureClasses[] = {StructureClass::kAllInUnits, StructureClass::kNonUnitFirst,
                                                       StructureClass::kNonUnitLast, StructureClass::kNonUnitMiddle,
                                                       StructureClass::kTiedFirstLast};

inline std::string structure_class_name(StructureClass c) {
  switch (c) {
    case StructureClass::kAllInUnits: return "all_in_units";
    case StructureClass::kNonUnitFirst: return "non_unit_first";
    case StructureClass::kNonUnitLast: return "non_unit_last";
    case StructureClass::kNonUnitMiddle: return "non_unit_middle";
    case StructureClass::kTiedFirstLast: return "tied_first_last";
  }
  return "?";
}

// One param of the model: registered with mxddp (index >= 0) or frozen (index -1: the model holds
// its values itself, as Megatron leaves requires_grad=False params out of DDP's buffers).
struct GenericParam {
  std::string name;
  Shape shape;
  bool frozen = false;
  bool mxfp8 = false;
  int index = -1;           // registration index
  int last_use_module = 0;  // the lowest module reading it: its grad is final after that module's backward
  std::vector<float> init;  // f32 initial values
};

struct GenericModule {
  int in = 0, out = 0;
  int weight = -1;  // into GenericModel::params: W [out, in]
  int bias = -1;    // [out] or -1
  int gain = -1;    // [out] or -1
};

// What the hooks are called around: a unit (one or more modules), a non-unit module, or a module
// whose params are all frozen (no hooks: mxddp holds nothing of it).
struct GenericBlock {
  std::vector<int> modules;
  int unit = -1;                 // -1: not a unit
  std::vector<int> hook_params;  // registration indices the hooks name; empty: no hooks
};

struct GenericModel {
  StructureClass structure = StructureClass::kAllInUnits;
  std::vector<GenericParam> params;  // frozen included
  std::vector<GenericModule> modules;
  std::vector<GenericBlock> blocks;  // forward order
  std::vector<ParamSpec> specs;      // the registered params, in registration order
  std::vector<int> param_of_spec;    // [registration index] -> params index
  std::vector<std::vector<int>> units;  // registration indices, forward order

  int input_dim() const { return modules.front().in; }
  std::string describe() const {
    std::string s = structure_class_name(structure) + ":";
    for (const GenericBlock& b : blocks) {
      s += b.unit >= 0 ? fmt::format(" u{}[", b.unit) : (b.hook_params.empty() ? std::string(" frozen[") : std::string(" nu["));
      for (int m : b.modules) {
        const GenericModule& mod = modules[static_cast<size_t>(m)];
        s += fmt::format("{}{}x{}", m == b.modules.front() ? "" : " ", mod.out, mod.in);
      }
      s += "]";
    }
    return s;
  }
};

// A model's initial values in registration order ([spec] f32) and views of them, as a
// DataParallel's constructor takes them. Not copyable: the views point into `values`.
struct GenericInitialValues {
  explicit GenericInitialValues(const GenericModel& model) {
    for (int p : model.param_of_spec) values.push_back(model.params[static_cast<size_t>(p)].init);
    for (size_t i = 0; i < values.size(); ++i) views.push_back({values[i].data(), DType::kF32, model.specs[i].shape});
  }
  GenericInitialValues(const GenericInitialValues&) = delete;
  GenericInitialValues& operator=(const GenericInitialValues&) = delete;

  std::vector<std::vector<float>> values;
  std::vector<TensorView> views;
};

// A structure of class c, drawn from seed. fine_grained: every module in a unit is a unit of its
// own (the fine-grained param gather); otherwise units group 1-3 consecutive modules. mxfp8: the
// weights of unit modules are MXFP8 params. Every structure has a frozen param in a unit module, a
// fully frozen module (no hooks), and a one-param unit module (a weight alone).
inline GenericModel make_generic_model(StructureClass c, uint64_t seed, bool fine_grained, bool mxfp8) {
  std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(c));
  auto pick = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int dims[] = {8, 16, 24, 40};
  GenericModel m;
  m.structure = c;

  // Module kinds in forward order: 'u' unit module, 'n' non-unit module, 'f' fully frozen module.
  const int unit_modules = pick(4, 6);
  std::string kinds(static_cast<size_t>(unit_modules), 'u');
  const int non_unit = pick(1, 2);
  switch (c) {
    case StructureClass::kAllInUnits: break;
    case StructureClass::kNonUnitFirst: kinds = std::string(static_cast<size_t>(non_unit), 'n') + kinds; break;
    case StructureClass::kNonUnitLast: kinds += std::string(static_cast<size_t>(non_unit), 'n'); break;
    case StructureClass::kNonUnitMiddle:
      kinds.insert(static_cast<size_t>(pick(2, unit_modules - 2)), static_cast<size_t>(non_unit), 'n');
      break;
    case StructureClass::kTiedFirstLast: kinds = "n" + kinds + "n"; break;
  }
  kinds.insert(static_cast<size_t>(pick(1, static_cast<int>(kinds.size()) - 1)), 1, 'f');
  const int one_param_module = [&] {  // a unit module with its weight alone
    std::vector<int> u;
    for (size_t i = 0; i < kinds.size(); ++i)
      if (kinds[i] == 'u') u.push_back(static_cast<int>(i));
    return u[static_cast<size_t>(pick(0, static_cast<int>(u.size()) - 1))];
  }();
  const int frozen_in_unit = [&] {  // a unit module (not the one-param one) with a frozen bias
    for (;;) {
      const int i = pick(0, static_cast<int>(kinds.size()) - 1);
      if (kinds[static_cast<size_t>(i)] == 'u' && i != one_param_module) return i;
    }
  }();

  auto add_param = [&](const std::string& name, Shape shape, bool frozen, bool is_mxfp8) {
    GenericParam p{.name = name, .shape = shape, .frozen = frozen, .mxfp8 = is_mxfp8 && !frozen};
    const int64_t n = shape.numel();
    const float scale = shape.ndim() == 2 ? 1.5f / std::sqrt(static_cast<float>(shape[1])) : 0.3f;
    const float phase = static_cast<float>(m.params.size()) * 1.7f + static_cast<float>(seed % 97);
    for (int64_t i = 0; i < n; ++i) p.init.push_back(scale * std::sin(0.61f * static_cast<float>(i) + phase) + (shape.ndim() == 1 && name.ends_with("gain") ? 1.0f : 0.0f));
    m.params.push_back(std::move(p));
    return static_cast<int>(m.params.size()) - 1;
  };

  const int tied_dim = dims[pick(1, 3)];
  int tied = -1;
  int width = c == StructureClass::kTiedFirstLast ? tied_dim : dims[pick(0, 3)];
  for (size_t i = 0; i < kinds.size(); ++i) {
    const char kind = kinds[i];
    const bool last = i + 1 == kinds.size();
    GenericModule mod;
    mod.in = width;
    // The tied weight is square: the modules reading it, and the one feeding the last, are tied_dim wide.
    mod.out = c == StructureClass::kTiedFirstLast && (i == 0 || i + 2 >= kinds.size()) ? tied_dim : dims[pick(0, 3)];
    const std::string prefix = fmt::format("m{}.", i);
    const bool uses_tied = c == StructureClass::kTiedFirstLast && (i == 0 || last);
    if (uses_tied) {
      if (tied < 0) tied = add_param("tied.weight", Shape{tied_dim, tied_dim}, false, false);
      mod.weight = tied;
    } else {
      mod.weight = add_param(prefix + "weight", Shape{mod.out, mod.in}, kind == 'f', kind == 'u' && mxfp8);
    }
    if (static_cast<int>(i) != one_param_module) {
      if (kind == 'f' || static_cast<int>(i) == frozen_in_unit || uses_tied || pick(0, 9) < 7)
        mod.bias = add_param(prefix + "bias", Shape{mod.out}, kind == 'f' || static_cast<int>(i) == frozen_in_unit, false);
      if (pick(0, 9) < 4) mod.gain = add_param(prefix + "gain", Shape{mod.out}, kind == 'f', false);
    }
    m.modules.push_back(mod);
    width = mod.out;
  }

  // Registration: params in forward order of first use; a param's last use is its lowest module.
  for (size_t mi = 0; mi < m.modules.size(); ++mi)
    for (int p : {m.modules[mi].weight, m.modules[mi].bias, m.modules[mi].gain}) {
      if (p < 0) continue;
      GenericParam& gp = m.params[static_cast<size_t>(p)];
      if (gp.index >= 0 || gp.frozen) continue;
      gp.index = static_cast<int>(m.specs.size());
      gp.last_use_module = static_cast<int>(mi);
      m.specs.push_back({gp.name, gp.shape, /*shared_embedding=*/p == tied, gp.mxfp8});
      m.param_of_spec.push_back(p);
    }

  // Blocks: consecutive unit modules grouped into units (1-3 modules, or 1 when fine-grained).
  for (size_t i = 0; i < kinds.size();) {
    GenericBlock b;
    if (kinds[i] == 'u') {
      const int run = fine_grained ? 1 : pick(1, 3);
      for (int k = 0; k < run && i < kinds.size() && kinds[i] == 'u'; ++k) b.modules.push_back(static_cast<int>(i++));
      b.unit = static_cast<int>(m.units.size());
      m.units.emplace_back();
    } else {
      b.modules.push_back(static_cast<int>(i++));
    }
    for (int mi : b.modules) {
      const GenericModule& mod = m.modules[static_cast<size_t>(mi)];
      for (int p : {mod.weight, mod.bias, mod.gain}) {
        if (p < 0 || m.params[static_cast<size_t>(p)].frozen) continue;
        const int idx = m.params[static_cast<size_t>(p)].index;
        if (std::find(b.hook_params.begin(), b.hook_params.end(), idx) == b.hook_params.end()) b.hook_params.push_back(idx);
      }
    }
    if (b.unit >= 0) m.units.back() = b.hook_params;
    m.blocks.push_back(std::move(b));
  }
  return m;
}

// What the model reads and reports through: a DataParallel, or the serial reference.
class GenericModelAccess {
 public:
  virtual ~GenericModelAccess() = default;
  // Registered param `index` as f32: forward (kRow) or for the data gradient (kCol); an MXFP8 param
  // dequantized from that orientation, any other widened (both axes alike).
  virtual std::vector<float> values(int index, QuantAxis use) = 0;
  virtual void add_grad(int index, const std::vector<float>& grad) = 0;  // main_grad += grad
  virtual void grad_ready(int index) = 0;
  virtual void before_forward(const std::vector<int>& params) = 0;
  virtual void after_forward(const std::vector<int>& params) = 0;
  virtual void before_backward(const std::vector<int>& params) = 0;
  virtual void after_backward(const std::vector<int>& params) = 0;
};

// Input sample `sample` of iteration `it`: [input_dim].
inline std::vector<float> generic_sample(int dim, int it, int sample) {
  std::vector<float> x(static_cast<size_t>(dim));
  for (int i = 0; i < dim; ++i) x[static_cast<size_t>(i)] = 0.8f * std::sin(0.37f * static_cast<float>(it * 131 + sample * 17 + i));
  return x;
}

// One micro-batch: samples [first, first + count) of iteration it, forward and backward, the loss
// scaled by loss_scale. recompute: each unit's forward runs again in backward, between its
// pre-backward and its gradients (as the GPT's full recompute does, inside the unit's own hooks).
// Returns the scaled loss.
inline double generic_forward_backward(const GenericModel& model, GenericModelAccess& a, int it, int first, int count,
                                       float loss_scale, bool recompute) {
  const size_t nm = model.modules.size();
  // Per module and sample: input x [in], pre-gain z [out], output y [out].
  std::vector<std::vector<std::vector<float>>> xs(nm), zs(nm), ys(nm);
  auto value_of = [&](int p, QuantAxis use) {
    const GenericParam& gp = model.params[static_cast<size_t>(p)];
    return gp.frozen ? gp.init : a.values(gp.index, use);
  };
  // Runs module mi on every sample's input xs[mi], filling zs[mi] and ys[mi].
  auto run_module = [&](size_t mi) {
    const GenericModule& mod = model.modules[mi];
    const std::vector<float> w = value_of(mod.weight, QuantAxis::kRow);
    const std::vector<float> b = mod.bias >= 0 ? value_of(mod.bias, QuantAxis::kRow) : std::vector<float>();
    const std::vector<float> g = mod.gain >= 0 ? value_of(mod.gain, QuantAxis::kRow) : std::vector<float>();
    zs[mi].assign(static_cast<size_t>(count), std::vector<float>(static_cast<size_t>(mod.out)));
    ys[mi].assign(static_cast<size_t>(count), std::vector<float>(static_cast<size_t>(mod.out)));
    for (int s = 0; s < count; ++s) {
      const std::vector<float>& x = xs[mi][static_cast<size_t>(s)];
      for (int o = 0; o < mod.out; ++o) {
        float z = 0;
        for (int i = 0; i < mod.in; ++i) z += x[static_cast<size_t>(i)] * w[static_cast<size_t>(o * mod.in + i)];
        if (!b.empty()) z += b[static_cast<size_t>(o)];
        zs[mi][static_cast<size_t>(s)][static_cast<size_t>(o)] = z;
        const float zg = g.empty() ? z : z * g[static_cast<size_t>(o)];
        ys[mi][static_cast<size_t>(s)][static_cast<size_t>(o)] = std::tanh(zg);
      }
      if (mi + 1 < nm) xs[mi + 1][static_cast<size_t>(s)] = ys[mi][static_cast<size_t>(s)];
    }
  };

  for (int s = 0; s < count; ++s) xs[0].push_back(generic_sample(model.input_dim(), it, first + s));
  for (size_t mi = 1; mi < nm; ++mi) xs[mi].resize(static_cast<size_t>(count));
  for (const GenericBlock& block : model.blocks) {
    if (!block.hook_params.empty()) a.before_forward(block.hook_params);
    for (int mi : block.modules) run_module(static_cast<size_t>(mi));
    if (!block.hook_params.empty()) a.after_forward(block.hook_params);
  }

  double loss = 0;
  std::vector<std::vector<float>> dy(static_cast<size_t>(count));  // [sample][out] of the module at hand
  for (int s = 0; s < count; ++s) {
    for (float y : ys[nm - 1][static_cast<size_t>(s)]) {
      loss += 0.5 * static_cast<double>(y) * y * loss_scale;
      dy[static_cast<size_t>(s)].push_back(y * loss_scale);
    }
  }
  for (size_t bi = model.blocks.size(); bi-- > 0;) {
    const GenericBlock& block = model.blocks[bi];
    const bool hooked = !block.hook_params.empty();
    if (hooked) a.before_backward(block.hook_params);
    if (recompute && block.unit >= 0) {
      a.before_forward(block.hook_params);
      for (int mi : block.modules) run_module(static_cast<size_t>(mi));
      a.after_forward(block.hook_params);
    }
    for (size_t k = block.modules.size(); k-- > 0;) {
      const auto mi = static_cast<size_t>(block.modules[k]);
      const GenericModule& mod = model.modules[mi];
      const std::vector<float> wd = value_of(mod.weight, QuantAxis::kCol);
      const std::vector<float> g = mod.gain >= 0 ? value_of(mod.gain, QuantAxis::kRow) : std::vector<float>();
      std::vector<float> gw(static_cast<size_t>(mod.out * mod.in), 0.0f), gb(static_cast<size_t>(mod.out), 0.0f),
          gg(static_cast<size_t>(mod.out), 0.0f);
      std::vector<std::vector<float>> dx(static_cast<size_t>(count), std::vector<float>(static_cast<size_t>(mod.in), 0.0f));
      for (int s = 0; s < count; ++s) {
        const auto su = static_cast<size_t>(s);
        for (int o = 0; o < mod.out; ++o) {
          const auto ou = static_cast<size_t>(o);
          const float y = ys[mi][su][ou];
          float dz = dy[su][ou] * (1.0f - y * y);
          if (!g.empty()) {
            gg[ou] += dz * zs[mi][su][ou];
            dz *= g[ou];
          }
          gb[ou] += dz;
          for (int i = 0; i < mod.in; ++i) {
            gw[static_cast<size_t>(o * mod.in + i)] += dz * xs[mi][su][static_cast<size_t>(i)];
            dx[su][static_cast<size_t>(i)] += dz * wd[static_cast<size_t>(o * mod.in + i)];
          }
        }
      }
      dy = std::move(dx);
      const std::pair<int, const std::vector<float>*> grads[] = {{mod.weight, &gw}, {mod.bias, &gb}, {mod.gain, &gg}};
      for (const auto& [p, grad] : grads) {
        if (p < 0 || model.params[static_cast<size_t>(p)].frozen) continue;
        const GenericParam& gp = model.params[static_cast<size_t>(p)];
        a.add_grad(gp.index, *grad);
        if (gp.last_use_module == static_cast<int>(mi)) a.grad_ready(gp.index);
      }
    }
    if (hooked) a.after_backward(block.hook_params);
  }
  return loss;
}

// ---- Values as a data-parallel run's model sees them ----

inline float round_to_dtype(DType dtype, float x) { return dtype == DType::kF32 ? x : bf16_to_f32(f32_to_bf16(x)); }

// The values the model computes with for main params `main` [rows, cols] (or 1-D): the param dtype's
// rounding, and for an MXFP8 param that quantized and dequantized in orientation `use`.
inline std::vector<float> model_values(const std::vector<float>& main, const Shape& shape, DType param_dtype, bool mxfp8,
                                       QuantAxis use, Fp8Format elem, ScaleMode scale_mode) {
  std::vector<float> v(main.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = round_to_dtype(param_dtype, main[i]);
  if (!mxfp8) return v;
  const int64_t rows = shape[0], cols = shape[1];
  std::vector<uint8_t> data(v.size());
  const Shape scale_shape = mx_scale_shape(rows, cols, use);
  std::vector<uint8_t> scales(static_cast<size_t>(scale_shape.numel()));
  const QuantizeOptions o{elem, scale_mode, use};
  mx_quantize(TensorView{v.data(), DType::kF32, shape}, TensorView{data.data(), DType::kU8, shape},
              TensorView{scales.data(), DType::kU8, scale_shape}, o);
  mx_dequantize(TensorView{data.data(), DType::kU8, shape}, TensorView{scales.data(), DType::kU8, scale_shape},
                TensorView{v.data(), DType::kF32, shape}, o);
  return v;
}

// AdamW on f32 main params, element for element what DistributedOptimizer's kernel computes
// (src/optim/adamw_kernel.h; clip_grad 0, so the clip coefficient is 1). Weight decay on 2-D params.
struct PlainAdamW {
  OptimizerConfig cfg;
  std::vector<std::vector<float>> main, exp_avg, exp_avg_sq;  // [registration index][numel]
  int64_t t = 0;

  PlainAdamW(const OptimizerConfig& c, const GenericModel& model, DType param_dtype) : cfg(c) {
    for (int p : model.param_of_spec) {
      std::vector<float> v = model.params[static_cast<size_t>(p)].init;
      for (float& x : v) x = round_to_dtype(param_dtype, x);  // the optimizer starts from the params as stored
      exp_avg.emplace_back(v.size(), 0.0f);
      exp_avg_sq.emplace_back(v.size(), 0.0f);
      main.push_back(std::move(v));
    }
  }

  void step(const std::vector<std::vector<float>>& grads, const std::vector<ParamSpec>& specs) {
    ++t;
    const auto td = static_cast<double>(t);
    const float step_size = static_cast<float>(cfg.lr / static_cast<float>(1.0 - std::pow(static_cast<double>(cfg.adam_beta1), td)));
    const float bc2 = static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(cfg.adam_beta2), td)));
    for (size_t p = 0; p < main.size(); ++p) {
      const float decay = 1.0f - cfg.lr * (specs[p].shape.ndim() >= 2 ? cfg.weight_decay : 0.0f);
      for (size_t i = 0; i < main[p].size(); ++i) {
        const float g = grads[p][i] * 1.0f;
        float x = main[p][i] * decay;
        const float m = cfg.adam_beta1 * exp_avg[p][i] + (1.0f - cfg.adam_beta1) * g;
        const float v = cfg.adam_beta2 * exp_avg_sq[p][i] + (1.0f - cfg.adam_beta2) * g * g;
        x -= step_size * m / (std::sqrt(v) / bc2 + cfg.adam_eps);
        exp_avg[p][i] = m;
        exp_avg_sq[p][i] = v;
        main[p][i] = x;
      }
    }
  }
};

// How a data-parallel run forms the iteration's gradient from each rank's micro-batches:
// kAccumulateThenReduce: each rank sums its micro-batches in main_grad, then one reduction (DDP,
// FSDP no_shard and optim); kReduceEachMicroBatch: every micro-batch is reduced and the reduced
// shards summed (FSDP optim_grads and optim_grads_params). A reduction sums the ranks in rank
// order, each prescaled by 1/dp, as the local backend does.
enum class GradOrder : uint8_t { kAccumulateThenReduce, kReduceEachMicroBatch };

struct GenericRunShape {
  int dp = 1;
  int micro_batches = 1;
  int micro_batch_size = 2;
  int iterations = 3;
  DType param_dtype = DType::kBF16;
  bool recompute = false;
  Fp8Format elem = Fp8Format::kE4M3;
  ScaleMode scale_mode = ScaleMode::kRceil;

  int local_samples() const { return micro_batches * micro_batch_size; }
  // The samples rank r's micro-batch m takes from each iteration's global batch.
  int first_sample(int rank, int m) const { return (rank * micro_batches + m) * micro_batch_size; }
  float loss_scale() const { return 1.0f / static_cast<float>(local_samples()); }
};

// The serial reference: the whole global batch on one rank, each rank's micro-batches computed in
// turn and combined in `order`, then PlainAdamW. Returns the main params after each iteration's step
// ([iteration][registration index][numel]).
inline std::vector<std::vector<std::vector<float>>> generic_reference(const GenericModel& model, const GenericRunShape& run,
                                                                     GradOrder order, const OptimizerConfig& cfg) {
  PlainAdamW opt(cfg, model, run.param_dtype);
  const size_t np = model.specs.size();
  struct RefAccess final : GenericModelAccess {
    const GenericModel& model;
    const GenericRunShape& run;
    const PlainAdamW& opt;
    std::vector<std::vector<float>> grad;  // the buffer main_grad would be
    RefAccess(const GenericModel& m, const GenericRunShape& r, const PlainAdamW& o) : model(m), run(r), opt(o) {}
    std::vector<float> values(int index, QuantAxis use) override {
      const ParamSpec& s = model.specs[static_cast<size_t>(index)];
      return model_values(opt.main[static_cast<size_t>(index)], s.shape, run.param_dtype, s.mxfp8, use, run.elem, run.scale_mode);
    }
    void add_grad(int index, const std::vector<float>& g) override {
      std::vector<float>& dst = grad[static_cast<size_t>(index)];
      for (size_t i = 0; i < g.size(); ++i) dst[i] += g[i];
    }
    void grad_ready(int) override {}
    void before_forward(const std::vector<int>&) override {}
    void after_forward(const std::vector<int>&) override {}
    void before_backward(const std::vector<int>&) override {}
    void after_backward(const std::vector<int>&) override {}
  };
  auto zeros = [&] {
    std::vector<std::vector<float>> z;
    for (const ParamSpec& s : model.specs) z.emplace_back(static_cast<size_t>(s.shape.numel()), 0.0f);
    return z;
  };
  const float prescale = 1.0f / static_cast<float>(run.dp);
  // sum over ranks of parts[r] * prescale, in rank order.
  auto reduce = [&](const std::vector<std::vector<std::vector<float>>>& parts) {
    std::vector<std::vector<float>> out = parts[0];
    for (size_t p = 0; p < np; ++p)
      for (size_t i = 0; i < out[p].size(); ++i) {
        float acc = parts[0][p][i] * prescale;
        for (size_t r = 1; r < parts.size(); ++r) acc += parts[r][p][i] * prescale;
        out[p][i] = acc;
      }
    return out;
  };
  std::vector<std::vector<std::vector<float>>> history;
  for (int it = 0; it < run.iterations; ++it) {
    RefAccess a(model, run, opt);
    std::vector<std::vector<float>> total = zeros();
    if (order == GradOrder::kAccumulateThenReduce) {
      std::vector<std::vector<std::vector<float>>> per_rank;
      for (int r = 0; r < run.dp; ++r) {
        a.grad = zeros();
        for (int m = 0; m < run.micro_batches; ++m)
          generic_forward_backward(model, a, it, run.first_sample(r, m), run.micro_batch_size, run.loss_scale(), run.recompute);
        per_rank.push_back(a.grad);
      }
      total = reduce(per_rank);
    } else {
      for (int m = 0; m < run.micro_batches; ++m) {
        std::vector<std::vector<std::vector<float>>> per_rank;
        for (int r = 0; r < run.dp; ++r) {
          a.grad = zeros();
          generic_forward_backward(model, a, it, run.first_sample(r, m), run.micro_batch_size, run.loss_scale(), run.recompute);
          per_rank.push_back(a.grad);
        }
        const auto reduced = reduce(per_rank);
        for (size_t p = 0; p < np; ++p)
          for (size_t i = 0; i < total[p].size(); ++i) total[p][i] += reduced[p][i];
      }
    }
    opt.step(total, model.specs);
    history.push_back(opt.main);
  }
  return history;
}

// ---- The model over a DataParallel ----

// The model computes on the host; a DataParallel whose buffers are another place's (its compute's
// device) is read and written through copies of them.
class DataParallelModelAccess final : public GenericModelAccess {
 public:
  explicit DataParallelModelAccess(DataParallel& dp) : dp_(dp) {}
  std::vector<float> values(int index, QuantAxis use) override {
    const Shape& shape = dp_.params()[static_cast<size_t>(index)].shape;
    std::vector<float> v(static_cast<size_t>(shape.numel()));
    if (dp_.is_mxfp8(index)) {
      const Mxfp8View q = dp_.mxfp8_param(index, use);
      std::vector<uint8_t> data, scales;
      mx_dequantize(on_host(q.data, data), on_host(q.scales, scales), TensorView{v.data(), DType::kF32, shape}, q.options);
      return v;
    }
    std::vector<uint8_t> bytes;
    const TensorView p = on_host(dp_.param(index), bytes);
    if (p.dtype == DType::kF32) std::copy_n(p.data_as<const float>(), v.size(), v.begin());
    else convert_bf16_to_f32(p.data_as<const bf16_bits>(), v.data(), v.size());
    return v;
  }
  void add_grad(int index, const std::vector<float>& g) override {
    const TensorView mg = dp_.main_grad(index);
    MXDDP_CHECK(mg.dtype == DType::kF32, "the generic model accumulates f32 grads; got {}", dtype_name(mg.dtype));
    std::vector<uint8_t> bytes;
    float* dst = on_host(mg, bytes).data_as<float>();
    for (size_t i = 0; i < g.size(); ++i) dst[i] += g[i];
    if (!mg.device.is_cpu()) dp_.compute().copy_from_host(mg.data, bytes.data(), bytes.size());
  }
  void grad_ready(int index) override { dp_.grad_ready(index); }
  void before_forward(const std::vector<int>& p) override { dp_.before_forward(p); }
  void after_forward(const std::vector<int>& p) override { dp_.after_forward(p); }
  void before_backward(const std::vector<int>& p) override { dp_.before_backward(p); }
  void after_backward(const std::vector<int>& p) override { dp_.after_backward(p); }

 private:
  // v itself on the host; elsewhere a host copy of its bytes, kept in `copy`.
  TensorView on_host(TensorView v, std::vector<uint8_t>& copy) const {
    if (v.device.is_cpu()) return v;
    copy.resize(v.nbytes());
    dp_.compute().copy_to_host(copy.data(), v.data, copy.size());
    return TensorView{copy.data(), v.dtype, v.shape, Device::cpu()};
  }

  DataParallel& dp_;
};

}  // namespace mxddp::testing
