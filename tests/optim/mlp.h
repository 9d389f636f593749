// A 3-layer tanh MLP with a mean-squared-error loss, written against the public API the way a
// user's model would be: params read from ddp.param(i) (bf16), weight gradients accumulated into
// main_grad(i), grad_ready in backward order, before_forward per layer. The same forward/backward
// also drives a plain, unsharded reference trainer (PlainTrainer) that the distributed optimizer
// is compared with.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include <mxddp/compute.h>
#include <mxddp/optim.h>
#include <mxddp/quant.h>

namespace mxddp::testing {

constexpr int kIn = 6, kHidden = 16, kOut = 3;

// mxfp8: mark the weight matrices as MXFP8 params (for fp8_param_gather).
inline std::vector<ParamSpec> mlp_params(bool mxfp8 = false) {
  return {{"l0.w", Shape{kIn, kHidden}, false, mxfp8},     {"l0.b", Shape{kHidden}},
          {"l1.w", Shape{kHidden, kHidden}, false, mxfp8}, {"l1.b", Shape{kHidden}},
          {"l2.w", Shape{kHidden, kOut}, false, mxfp8},    {"l2.b", Shape{kOut}}};
}

// Deterministic initial values, one f32 vector per param.
inline std::vector<std::vector<float>> mlp_init() {
  std::vector<std::vector<float>> init;
  int k = 0;
  for (const ParamSpec& s : mlp_params()) {
    std::vector<float> v(static_cast<size_t>(s.shape.numel()));
    const float scale = s.shape.ndim() == 2 ? 1.0f / std::sqrt(static_cast<float>(s.shape[0])) : 0.1f;
    for (size_t i = 0; i < v.size(); ++i) v[i] = scale * std::sin(0.7f * static_cast<float>(i) + 1.3f * static_cast<float>(++k));
    init.push_back(std::move(v));
  }
  return init;
}

inline std::vector<TensorView> views_of(std::vector<std::vector<float>>& values) {
  std::vector<TensorView> v;
  const auto specs = mlp_params();
  for (size_t i = 0; i < values.size(); ++i) v.push_back({values[i].data(), DType::kF32, specs[i].shape});
  return v;
}

// Sample `index` of step `step`'s global batch.
inline void sample(int step, int index, float* x, float* y) {
  for (int i = 0; i < kIn; ++i) x[i] = std::sin(0.37f * static_cast<float>(step * 31 + index * 7 + i));
  for (int o = 0; o < kOut; ++o) y[o] = 0.5f * std::cos(x[o] + x[o + 3]);
}

struct ModelHooks {
  std::function<std::vector<float>(int)> param;                      // f32 copy of param i
  // The weight the data-gradient product uses (MXFP8: the column-wise copy); empty = param.
  std::function<std::vector<float>(int)> param_for_data_grad;
  std::function<void(int, const std::vector<float>&)> accumulate;    // grad of param i += g
  std::function<void(int)> grad_ready = [](int) {};
  std::function<void(const std::vector<int>&)> before_forward = [](const std::vector<int>&) {};
};

// Forward and backward over samples [first, first + count) of `step`; gradients of the mean loss
// over those samples. Returns the mean loss.
inline double forward_backward(const ModelHooks& m, int step, int first, int count) {
  const int dims[4] = {kIn, kHidden, kHidden, kOut};
  std::vector<std::vector<float>> w(3), b(3), wd(3);
  std::vector<std::vector<float>> gw(3), gb(3);
  for (int l = 0; l < 3; ++l) {
    m.before_forward({2 * l, 2 * l + 1});
    w[static_cast<size_t>(l)] = m.param(2 * l);
    wd[static_cast<size_t>(l)] = m.param_for_data_grad ? m.param_for_data_grad(2 * l) : w[static_cast<size_t>(l)];
    b[static_cast<size_t>(l)] = m.param(2 * l + 1);
    gw[static_cast<size_t>(l)].assign(w[static_cast<size_t>(l)].size(), 0.0f);
    gb[static_cast<size_t>(l)].assign(b[static_cast<size_t>(l)].size(), 0.0f);
  }
  double loss = 0;
  const float inv_count = 1.0f / static_cast<float>(count);
  for (int s = first; s < first + count; ++s) {
    std::vector<std::vector<float>> act(4);
    act[0].resize(kIn);
    std::vector<float> y(kOut);
    sample(step, s, act[0].data(), y.data());
    for (int l = 0; l < 3; ++l) {
      const int n_in = dims[l], n_out = dims[l + 1];
      auto& out = act[static_cast<size_t>(l + 1)];
      out.assign(static_cast<size_t>(n_out), 0.0f);
      for (int o = 0; o < n_out; ++o) {
        float z = b[static_cast<size_t>(l)][static_cast<size_t>(o)];
        for (int i = 0; i < n_in; ++i) z += act[static_cast<size_t>(l)][static_cast<size_t>(i)] * w[static_cast<size_t>(l)][static_cast<size_t>(i * n_out + o)];
        out[static_cast<size_t>(o)] = l < 2 ? std::tanh(z) : z;
      }
    }
    std::vector<float> delta(kOut);
    for (int o = 0; o < kOut; ++o) {
      const float d = act[3][static_cast<size_t>(o)] - y[static_cast<size_t>(o)];
      loss += 0.5 * static_cast<double>(d) * d;
      delta[static_cast<size_t>(o)] = d * inv_count;
    }
    for (int l = 2; l >= 0; --l) {
      const int n_in = dims[l], n_out = dims[l + 1];
      std::vector<float> prev(static_cast<size_t>(n_in), 0.0f);
      for (int i = 0; i < n_in; ++i)
        for (int o = 0; o < n_out; ++o) {
          gw[static_cast<size_t>(l)][static_cast<size_t>(i * n_out + o)] += act[static_cast<size_t>(l)][static_cast<size_t>(i)] * delta[static_cast<size_t>(o)];
          prev[static_cast<size_t>(i)] += wd[static_cast<size_t>(l)][static_cast<size_t>(i * n_out + o)] * delta[static_cast<size_t>(o)];
        }
      for (int o = 0; o < n_out; ++o) gb[static_cast<size_t>(l)][static_cast<size_t>(o)] += delta[static_cast<size_t>(o)];
      if (l > 0)
        for (int i = 0; i < n_in; ++i) {
          const float a = act[static_cast<size_t>(l)][static_cast<size_t>(i)];
          prev[static_cast<size_t>(i)] *= 1.0f - a * a;  // tanh'
        }
      delta = std::move(prev);
    }
  }
  for (int l = 2; l >= 0; --l) {  // backward order: last layer's grads are final first
    m.accumulate(2 * l, gw[static_cast<size_t>(l)]);
    m.grad_ready(2 * l);
    m.accumulate(2 * l + 1, gb[static_cast<size_t>(l)]);
    m.grad_ready(2 * l + 1);
  }
  return loss / count;
}

// The bytes of view v of compute's memory (host or a device's), copied to the host.
inline std::vector<uint8_t> bytes_on_host(Compute& compute, const TensorView& v) {
  std::vector<uint8_t> bytes(v.nbytes());
  compute.copy_to_host(bytes.data(), v.data, bytes.size());
  return bytes;
}

// An MXFP8 param dequantized, in the given orientation; its bytes may be in compute's memory.
inline std::vector<float> dequantized(const Mxfp8View& t, Compute& compute = cpu_compute()) {
  std::vector<uint8_t> data = bytes_on_host(compute, t.data), scales = bytes_on_host(compute, t.scales);
  std::vector<float> v(static_cast<size_t>(t.data.numel()));
  mx_dequantize({data.data(), DType::kU8, t.data.shape}, {scales.data(), DType::kU8, t.scales.shape},
                TensorView{v.data(), DType::kF32, t.data.shape}, t.options);
  return v;
}

// Param i as f32: an MXFP8 param dequantized in the given orientation, any other widened. Read
// through the DDP's compute, so its buffers may be a device's.
inline std::vector<float> ddp_param_f32(const DistributedDataParallel& ddp, int i, QuantAxis mxfp8_axis) {
  if (ddp.buffer().params()[static_cast<size_t>(i)].mxfp8) return dequantized(ddp.mxfp8_param(i, mxfp8_axis), ddp.compute());
  const TensorView p = ddp.param(i);
  const std::vector<uint8_t> bytes = bytes_on_host(ddp.compute(), p);
  std::vector<float> v(static_cast<size_t>(p.numel()));
  if (p.dtype == DType::kF32) std::memcpy(v.data(), bytes.data(), bytes.size());
  else convert_bf16_to_f32(reinterpret_cast<const bf16_bits*>(bytes.data()), v.data(), v.size());
  return v;
}

// Hooks over a DistributedDataParallel (f32 grads, bf16 or f32 params; MXFP8 weights are used
// row-wise in forward and column-wise for the data gradient).
inline ModelHooks ddp_hooks(DistributedDataParallel& ddp) {
  ModelHooks m;
  m.param = [&ddp](int i) { return ddp_param_f32(ddp, i, QuantAxis::kRow); };
  m.param_for_data_grad = [&ddp](int i) { return ddp_param_f32(ddp, i, QuantAxis::kCol); };
  m.accumulate = [&ddp](int i, const std::vector<float>& g) {
    const TensorView grad = ddp.main_grad(i);
    if (grad.device.is_cpu()) {
      float* dst = grad.data_as<float>();
      for (size_t k = 0; k < g.size(); ++k) dst[k] += g[k];
      return;
    }
    // The device's main_grad: through a host copy, as the params are read.
    std::vector<float> sum(g.size());
    ddp.compute().copy_to_host(sum.data(), grad.data, grad.nbytes());
    for (size_t k = 0; k < g.size(); ++k) sum[k] += g[k];
    ddp.compute().copy_from_host(grad.data, sum.data(), grad.nbytes());
  };
  m.grad_ready = [&ddp](int i) { ddp.grad_ready(i); };
  m.before_forward = [&ddp](const std::vector<int>& params) { ddp.before_forward(params); };
  return m;
}

// The DDP under an optimizer built over one.
inline DistributedDataParallel& ddp_of(const DistributedOptimizer& opt) {
  return dynamic_cast<DistributedDataParallel&>(opt.data_parallel());
}

// One data-parallel training step on global batch `global_batch`: rank r takes its slice.
inline double ddp_train_step(DistributedOptimizer& opt, int step, int global_batch) {
  DistributedDataParallel& ddp = ddp_of(opt);
  const int dp = ddp.communicator().size(), rank = ddp.communicator().rank();
  const int local = global_batch / dp;
  opt.zero_grad();
  const double loss = forward_backward(ddp_hooks(ddp), step, rank * local, local);
  ddp.finish_grad_sync();
  opt.step();
  // The mean loss over the global batch, for comparison with an unsharded run.
  float l = static_cast<float>(loss);
  Communicator& comm = ddp.communicator();
  if (comm.device().is_cpu()) {
    comm.all_reduce(TensorView{&l, DType::kF32, Shape{1}, Device::cpu()}, {.op = ReduceOp::kAvg});
    return l;
  }
  // A device's communicator reduces its own memory: the loss goes through a float of it.
  MemoryTracker scratch;
  const ComputeBuffer staged = ddp.compute().allocate(sizeof l, MemoryCategory::kScratch, scratch);
  ddp.compute().copy_from_host(staged.data(), &l, sizeof l);
  comm.all_reduce(staged.view(DType::kF32, Shape{1}), {.op = ReduceOp::kAvg});
  ddp.compute().copy_to_host(&l, staged.data(), sizeof l);
  return l;
}

// Plain, unsharded AdamW/SGD over the whole global batch: FP32 main params, BF16 model params.
struct PlainTrainer {
  OptimizerConfig cfg;
  std::vector<std::vector<float>> main, m, v, grad;
  int64_t t = 0;
  double last_norm = 0, last_coeff = 1;

  bool bf16_params = true;  // the model reads bf16(main), as a DDP with bf16 params does

  explicit PlainTrainer(const OptimizerConfig& c, DType param_dtype = DType::kBF16)
      : cfg(c), main(mlp_init()), bf16_params(param_dtype == DType::kBF16) {
    if (bf16_params)
      for (auto& p : main)
        for (float& x : p) x = bf16_to_f32(f32_to_bf16(x));
    for (auto& p : main) {
      m.emplace_back(p.size(), 0.0f);
      v.emplace_back(p.size(), 0.0f);
      grad.emplace_back(p.size(), 0.0f);
    }
  }

  // The gradient of the global batch's mean loss, formed as data parallelism forms it: the mean
  // over each of `parts` equal slices, times 1/parts, summed in slice order (so rounding matches
  // and the comparison isolates the sharded optimizer).
  double train_step(int step, int global_batch, int parts = 1) {
    std::vector<std::vector<float>> part_grad(grad.size());
    ModelHooks h;
    h.param = [&](int i) {
      std::vector<float> p = main[static_cast<size_t>(i)];
      if (bf16_params)
        for (float& x : p) x = bf16_to_f32(f32_to_bf16(x));
      return p;
    };
    h.accumulate = [&](int i, const std::vector<float>& g) { part_grad[static_cast<size_t>(i)] = g; };
    double loss = 0;
    const float scale = 1.0f / static_cast<float>(parts);
    const int local = global_batch / parts;
    for (int r = 0; r < parts; ++r) {
      loss += forward_backward(h, step, r * local, local) / parts;
      for (size_t p = 0; p < grad.size(); ++p)
        for (size_t k = 0; k < grad[p].size(); ++k)
          grad[p][k] = r == 0 ? part_grad[p][k] * scale : grad[p][k] + part_grad[p][k] * scale;
    }
    double sq = 0;
    for (auto& g : grad)
      for (float x : g) sq += static_cast<double>(x) * x;
    last_norm = std::sqrt(sq);
    last_coeff = 1;
    if (cfg.clip_grad > 0 && cfg.clip_grad / (last_norm + 1e-6) < 1) last_coeff = cfg.clip_grad / (last_norm + 1e-6);
    ++t;
    const auto specs = mlp_params();
    const float bc1 = static_cast<float>(1 - std::pow(static_cast<double>(cfg.adam_beta1), static_cast<double>(t)));
    const float bc2s = static_cast<float>(std::sqrt(1 - std::pow(static_cast<double>(cfg.adam_beta2), static_cast<double>(t))));
    for (size_t p = 0; p < main.size(); ++p) {
      const float wd = specs[p].shape.ndim() >= 2 ? cfg.weight_decay : 0.0f;
      for (size_t i = 0; i < main[p].size(); ++i) {
        float g = grad[p][i] * static_cast<float>(last_coeff);
        float& x = main[p][i];
        if (cfg.optimizer == OptimizerType::kAdam) {
          x *= 1.0f - cfg.lr * wd;
          m[p][i] = cfg.adam_beta1 * m[p][i] + (1 - cfg.adam_beta1) * g;
          v[p][i] = cfg.adam_beta2 * v[p][i] + (1 - cfg.adam_beta2) * g * g;
          x -= (cfg.lr / bc1) * m[p][i] / (std::sqrt(v[p][i]) / bc2s + cfg.adam_eps);
        } else {
          g += wd * x;
          m[p][i] = cfg.sgd_momentum * m[p][i] + g;
          x -= cfg.lr * m[p][i];
        }
      }
    }
    return loss;
  }
};

// Largest relative difference between this rank's shard of main params and the reference's.
inline double max_rel_diff_to_reference(const DistributedOptimizer& opt, const PlainTrainer& ref) {
  const ParamAndGradBuffer& buf = ddp_of(opt).buffer();
  const int rank = opt.data_parallel().communicator().rank();
  double worst = 0;
  for (size_t b = 0; b < buf.layout().buckets.size(); ++b) {
    const float* main = opt.main_params(static_cast<int>(b)).data_as<const float>();
    for (const ShardParamRange& r : buf.layout().shards[static_cast<size_t>(rank)][b].params)
      for (int64_t k = 0; k < r.in_param.size(); ++k) {
        const double got = main[r.in_shard.start + k];
        const double want = ref.main[static_cast<size_t>(r.param)][static_cast<size_t>(r.in_param.start + k)];
        worst = std::max(worst, std::fabs(got - want) / std::max(std::fabs(want), 1e-3));
      }
  }
  return worst;
}

}  // namespace mxddp::testing
