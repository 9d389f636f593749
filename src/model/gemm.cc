// gemm.h's products. f32 (and BF16 compute) on oneDNN's matmul primitive; f64 on OpenBLAS.
//
// A oneDNN primitive is compiled (JIT) for one shape, layout and attribute set, which costs far
// more than a small product, so each thread keeps its own plans keyed by everything the
// primitive depends on: the model calls the same few dozen shapes every step, so after the first
// step every product is a cache hit. Plans are per thread because a rank's thread count is part
// of what a primitive was compiled for, and because an execution stream is not shared between
// threads. The operands' storage (transposes, leading dimensions) is described to oneDNN as
// strides, so no operand is copied in f32. BF16 compute rounds each f32 operand into a per-thread
// staging buffer with oneDNN's reorder (RNE, vectorized and threaded), in the operand's own
// orientation (a plain cast: transposing on the way made the weight-gradient products' cast
// cost more than the product, and the AMX kernel reads a transposed BF16 A at full speed), and
// reads an operand that is already BF16 (a BF16 param) in place; then it multiplies with F32
// accumulation straight into the F32 C, alpha as an output scale and beta as a sum post-op
// (weight-gradient products accumulate beta = 1 into main_grad).
#include "gemm.h"

#include <dlfcn.h>

#include <cstring>
#include <unordered_map>
#include <vector>

#include <cblas.h>
#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <mxddp/core.h>

#include "compute_runtime.h"
#include "step_profile.h"

namespace mxddp::model {

namespace {

thread_local GemmDType t_gemm_dtype = GemmDType::kF32;

struct PlanKey {
  int m, n, k, lda, ldb, ldc, threads;
  bool trans_a, trans_b, bf16;
  bool a_bf16, b_bf16;  // the operand is stored in BF16 already (read in place)
  bool bias;            // a bias [n] is added to each row
  uint32_t alpha_bits, beta_bits;
  bool operator==(const PlanKey&) const = default;
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    for (int v : {key.m, key.n, key.k, key.lda, key.ldb, key.ldc, key.threads}) mix(static_cast<uint32_t>(v));
    mix(static_cast<uint64_t>(key.trans_a) | static_cast<uint64_t>(key.trans_b) << 1 | static_cast<uint64_t>(key.bf16) << 2 |
        static_cast<uint64_t>(key.a_bf16) << 3 | static_cast<uint64_t>(key.b_bf16) << 4 |
        static_cast<uint64_t>(key.bias) << 5);
    mix(key.alpha_bits);
    mix(key.beta_bits);
    return static_cast<size_t>(h);
  }
};

// One product's primitives and the memory objects they run on; data handles are set per call.
struct Plan {
  dnnl::matmul matmul;
  dnnl::memory a, b, c;         // the caller's A, B (as stored: f32, or BF16 read in place) and C
  dnnl::memory bias;            // [1, n] f32, when the key has one
  dnnl::reorder round_a, round_b;  // BF16 compute of an f32 operand only: it -> its staging buffer
  dnnl::memory a16, b16;        // BF16 compute of an f32 operand only: over the staging buffers
};

// More distinct shapes than this on one thread means shapes vary without bound (say, a batch
// size that changes every call): start over rather than grow.
constexpr size_t kMaxPlansPerThread = 512;

struct ThreadState {
  dnnl::stream stream{cpu_engine()};
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
  std::vector<uint16_t> a16, b16;  // BF16 staging of op(A) [M, K] and op(B) [K, N], stored as the caller's
};

ThreadState& thread_state() {
  thread_local ThreadState state;
  return state;
}

uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

Plan make_plan(const PlanKey& key) {
  using dt = dnnl::memory::data_type;
  const dnnl::engine& engine = cpu_engine();
  const auto a_f32 = operand_desc(key.m, key.k, key.lda, key.trans_a, key.a_bf16 ? dt::bf16 : dt::f32);
  const auto b_f32 = operand_desc(key.k, key.n, key.ldb, key.trans_b, key.b_bf16 ? dt::bf16 : dt::f32);
  const dnnl::memory::desc c_desc({key.m, key.n}, dt::f32, dnnl::memory::dims{key.ldc, 1});
  Plan plan;
  plan.a = dnnl::memory(a_f32, engine, nullptr);
  plan.b = dnnl::memory(b_f32, engine, nullptr);
  plan.c = dnnl::memory(c_desc, engine, nullptr);
  const dnnl::memory::desc bias_desc({1, key.n}, dt::f32, dnnl::memory::dims{key.n, 1});
  if (key.bias) plan.bias = dnnl::memory(bias_desc, engine, nullptr);
  dnnl::memory::desc a_mm = a_f32, b_mm = b_f32;
  if (key.bf16) {
    // Each f32 operand is staged densely in the caller's orientation (a plain cast, no
    // transpose: see the top); the kernel packs both into its own blocked layouts either way.
    if (!key.a_bf16) {
      a_mm = operand_desc(key.m, key.k, key.trans_a ? key.m : key.k, key.trans_a, dt::bf16);
      plan.a16 = dnnl::memory(a_mm, engine, nullptr);
      plan.round_a = dnnl::reorder(plan.a, plan.a16);
    }
    if (!key.b_bf16) {
      b_mm = operand_desc(key.k, key.n, key.trans_b ? key.k : key.n, key.trans_b, dt::bf16);
      plan.b16 = dnnl::memory(b_mm, engine, nullptr);
      plan.round_b = dnnl::reorder(plan.b, plan.b16);
    }
  }
  float alpha, beta;
  std::memcpy(&alpha, &key.alpha_bits, sizeof alpha);
  std::memcpy(&beta, &key.beta_bits, sizeof beta);
  dnnl::primitive_attr attr;
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {
    dnnl::post_ops post;
    post.append_sum(beta);
    attr.set_post_ops(post);
  }
  plan.matmul = dnnl::matmul(dnnl::matmul::primitive_desc(
      key.bias ? dnnl::matmul::desc(a_mm, b_mm, bias_desc, c_desc) : dnnl::matmul::desc(a_mm, b_mm, c_desc), attr,
      engine));
  return plan;
}

void check_operands(Op op_a, Op op_b, int m, int n, int k, int lda, int ldb, int ldc) {
  MXDDP_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm sizes m {} n {} k {} are not valid: each must be >= 0", m, n, k);
  const int a_cols = op_a == Op::kN ? k : m, b_cols = op_b == Op::kN ? n : k;
  MXDDP_CHECK(lda >= std::max(1, a_cols), "gemm lda {} is not valid: A is stored with {} columns, so lda >= {}", lda,
              a_cols, std::max(1, a_cols));
  MXDDP_CHECK(ldb >= std::max(1, b_cols), "gemm ldb {} is not valid: B is stored with {} columns, so ldb >= {}", ldb,
              b_cols, std::max(1, b_cols));
  MXDDP_CHECK(ldc >= std::max(1, n), "gemm ldc {} is not valid: C has {} columns, so ldc >= {}", ldc, n, std::max(1, n));
}

}  // namespace

void set_gemm_dtype(GemmDType dtype) { t_gemm_dtype = dtype; }
GemmDType gemm_dtype() { return t_gemm_dtype; }

bool bf16_gemm_supported() { return cpu_isa_has_bf16(); }

void gemm(Op op_a, Op op_b, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
          float beta, float* c, int ldc) {
  gemm(op_a, op_b, m, n, k, alpha, GemmOperand{a, lda, false}, GemmOperand{b, ldb, false}, beta, c, ldc);
}

void gemm(Op op_a, Op op_b, int m, int n, int k, float alpha, GemmOperand a, GemmOperand b, float beta, float* c,
          int ldc, const float* bias) {
  check_operands(op_a, op_b, m, n, k, a.ld, b.ld, ldc);
  MXDDP_CHECK(bias == nullptr || alpha == 1.0f, "gemm: alpha {} with a bias is not supported; valid: alpha 1", alpha);
  const bool bf16 = t_gemm_dtype == GemmDType::kBF16 && bf16_gemm_supported();
  MXDDP_CHECK(bf16 || (!a.bf16 && !b.bf16),
              "gemm: a BF16 operand (A {}, B {}) needs BF16 compute, and this thread computes in f32 ({}); valid: "
              "f32 operands, or set_gemm_dtype(kBF16) on a CPU with native BF16",
              a.bf16 ? "bf16" : "f32", b.bf16 ? "bf16" : "f32",
              t_gemm_dtype == GemmDType::kBF16 ? "this CPU has no native BF16" : "the thread's gemm dtype is f32");
  if (m == 0 || n == 0) return;
  if (k == 0) {  // C = beta C (+ bias); as in BLAS, beta = 0 does not read C
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        float& cij = c[static_cast<int64_t>(i) * ldc + j];
        cij = (beta == 0.0f ? 0.0f : beta * cij) + (bias != nullptr ? bias[j] : 0.0f);
      }
    return;
  }
  make_thread_count_exact();
  const PlanKey key{m,      n,      k,    a.ld, b.ld, ldc, omp_get_max_threads(), op_a == Op::kT, op_b == Op::kT, bf16,
                    a.bf16, b.bf16, bias != nullptr, float_bits(alpha), float_bits(beta)};
  ThreadState& state = thread_state();
  auto it = state.plans.find(key);
  if (it == state.plans.end()) {
    if (state.plans.size() >= kMaxPlansPerThread) state.plans.clear();
    try {
      it = state.plans.emplace(key, make_plan(key)).first;
    } catch (const dnnl::error& e) {
      MXDDP_FAIL("oneDNN has no {} matmul for [{} x {}] x [{} x {}] (op_a {}, op_b {}, ld {} {} {}): {}",
                 bf16 ? "bf16" : "f32", m, k, k, n, op_a == Op::kT ? "T" : "N", op_b == Op::kT ? "T" : "N", a.ld, b.ld,
                 ldc, e.what());
    }
  }
  Plan& plan = it->second;
  plan.a.set_data_handle(const_cast<void*>(a.data));  // read only: oneDNN's memory handle is not const
  plan.b.set_data_handle(const_cast<void*>(b.data));
  plan.c.set_data_handle(c);
  if (bias != nullptr) plan.bias.set_data_handle(const_cast<float*>(bias));
  if (bf16) {
    const bool stage_a = !a.bf16, stage_b = !b.bf16;
    if (stage_a) {
      state.a16.resize(std::max(state.a16.size(), static_cast<size_t>(m) * k));
      plan.a16.set_data_handle(state.a16.data());
    }
    if (stage_b) {
      state.b16.resize(std::max(state.b16.size(), static_cast<size_t>(k) * n));
      plan.b16.set_data_handle(state.b16.data());
    }
    {
      const profile::Scope casts(profile::Part::kCasts);
      if (stage_a) plan.round_a.execute(state.stream, plan.a, plan.a16);
      if (stage_b) plan.round_b.execute(state.stream, plan.b, plan.b16);
    }
    const profile::Scope products(profile::Part::kProducts);
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, stage_a ? plan.a16 : plan.a}, {DNNL_ARG_WEIGHTS, stage_b ? plan.b16 : plan.b}, {DNNL_ARG_DST, plan.c}};
    if (bias != nullptr) args.emplace(DNNL_ARG_BIAS, plan.bias);
    plan.matmul.execute(state.stream, args);
  } else {
    const profile::Scope products(profile::Part::kProducts);
    std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, plan.a}, {DNNL_ARG_WEIGHTS, plan.b}, {DNNL_ARG_DST, plan.c}};
    if (bias != nullptr) args.emplace(DNNL_ARG_BIAS, plan.bias);
    plan.matmul.execute(state.stream, args);
  }
  state.stream.wait();
}

namespace {

// OpenBLAS's cblas_dgemm, loaded on the first f64 product (only the gradient check makes any).
// Linked, OpenBLAS would start a thread per core in every process that loads it, each mapping a
// 128 MiB buffer, which under an address-space limit (ulimit -v) retries the map forever: the
// mxddp command, which never multiplies in f64, spun a core and hung at exit.
decltype(&cblas_dgemm) openblas_dgemm() {
  static const decltype(&cblas_dgemm) dgemm = [] {
    void* library = ::dlopen("libopenblas.so.0", RTLD_NOW | RTLD_LOCAL);
    MXDDP_CHECK(library != nullptr, "the f64 products need OpenBLAS: {}", ::dlerror());
    auto* fn = reinterpret_cast<decltype(&cblas_dgemm)>(::dlsym(library, "cblas_dgemm"));
    MXDDP_CHECK(fn != nullptr, "libopenblas.so.0 has no cblas_dgemm: {}", ::dlerror());
    return fn;
  }();
  return dgemm;
}

}  // namespace

void gemm(Op op_a, Op op_b, int m, int n, int k, double alpha, const double* a, int lda, const double* b, int ldb,
          double beta, double* c, int ldc) {
  check_operands(op_a, op_b, m, n, k, lda, ldb, ldc);
  if (m == 0 || n == 0) return;
  openblas_dgemm()(CblasRowMajor, op_a == Op::kT ? CblasTrans : CblasNoTrans, op_b == Op::kT ? CblasTrans : CblasNoTrans,
              m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace mxddp::model
