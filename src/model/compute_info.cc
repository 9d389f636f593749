// The compute runtime's public face (include/mxddp/model.h): each thread's compute thread count
// and a description of what the products run on, for `mxddp train`, its report and the benches.
//
// oneDNN runs its kernels on OpenMP. OpenMP's thread count (nthreads-var) belongs to the calling
// thread, and a std::thread starts from the process default (every core), not from its parent's
// setting, so each rank's thread sets its own: ranks that run as threads of one process each get
// cores / ranks, and dp 1 gets every core.
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>

#include <omp.h>

#include <mxddp/core.h>
#include <mxddp/model.h>

#include "compute_runtime.h"

namespace mxddp {

namespace model {

const dnnl::engine& cpu_engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::memory::desc operand_desc(int rows, int cols, int ld, bool transposed, dnnl::memory::data_type type) {
  const dnnl::memory::dims strides = transposed ? dnnl::memory::dims{1, ld} : dnnl::memory::dims{ld, 1};
  return dnnl::memory::desc({rows, cols}, type, strides);
}

bool cpu_isa_has_bf16() {
  static const bool has = [] {
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
    return (isa & bf16) == bf16;  // oneDNN's ISA values are bit sets: each includes the ones below it
  }();
  return has;
}

}  // namespace model

namespace {

std::string isa_name(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx512_mic: return "avx512_mic";
    case dnnl::cpu_isa::avx512_mic_4ops: return "avx512_mic_4ops";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    default: return "isa 0x" + fmt::format("{:x}", static_cast<unsigned>(isa));
  }
}

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.starts_with("model name")) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown CPU";
}

// The implementation oneDNN picks for the reference shape, the small preset's first MLP product
// ([2048, 384] x [1536, 384]^T); other shapes may get another kernel of the same ISA.
std::string matmul_kernel(dnnl::memory::data_type type) {
  const dnnl::memory::desc a = model::operand_desc(2048, 384, 384, false, type);
  const dnnl::memory::desc b = model::operand_desc(384, 1536, 384, true, type);
  const dnnl::memory::desc c({2048, 1536}, dnnl::memory::data_type::f32, dnnl::memory::dims{1536, 1});
  try {
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), model::cpu_engine()).impl_info_str();
  } catch (const dnnl::error&) {
    return "none";
  }
}

int default_compute_threads() {
  // OpenMP's default for a thread that never set its own: OMP_NUM_THREADS's first value, else
  // every processor this process may run on.
  if (const char* env = std::getenv("OMP_NUM_THREADS"); env != nullptr && std::atoi(env) > 0) return std::atoi(env);
  return omp_get_num_procs();
}

}  // namespace

void set_compute_threads(int threads) {
  MXDDP_CHECK(threads >= 0, "compute threads {} is not valid: 0 (every core) or more", threads);
  // The count asked for must be the count a region gets: oneDNN splits a product's work for the
  // thread count it was created for and runs it in a region of that size, so a region that
  // comes up short (OMP_THREAD_LIMIT below the count, or OMP_DYNAMIC letting the runtime give
  // fewer) silently skips part of the product. So no dynamic adjustment, and at most the limit.
  omp_set_dynamic(0);
  omp_set_num_threads(effective_compute_threads(threads == 0 ? default_compute_threads() : threads));
}

int effective_compute_threads(int threads) { return std::min(threads, omp_get_thread_limit()); }

int compute_threads() { return std::min(omp_get_max_threads(), omp_get_thread_limit()); }

namespace model {

void make_thread_count_exact() {
  if (omp_in_parallel()) return;  // nested: oneDNN runs the product on the calling thread
  if (omp_get_dynamic() || omp_get_max_threads() > omp_get_thread_limit()) set_compute_threads(compute_threads());
}

}  // namespace model

ComputeInfo compute_info() {
  static const ComputeInfo process_wide = [] {
    ComputeInfo info;
    const dnnl::version_t* v = dnnl::version();
    info.library = fmt::format("oneDNN {}.{}.{} matmul (OpenMP)", v->major, v->minor, v->patch);
    info.cpu = cpu_model_name();
    info.isa = isa_name(dnnl::get_effective_cpu_isa());
    info.f32_kernel = matmul_kernel(dnnl::memory::data_type::f32);
    info.bf16_supported = model::cpu_isa_has_bf16();
    info.bf16_kernel = info.bf16_supported ? matmul_kernel(dnnl::memory::data_type::bf16) : "";
    return info;
  }();
  ComputeInfo info = process_wide;
  info.threads = compute_threads();
  return info;
}

std::string ComputeInfo::describe(bool bf16) const {
  std::string products;
  if (!bf16) products = fmt::format("f32 products on {}", f32_kernel);
  else if (bf16_supported) products = fmt::format("bf16 products (f32 accumulation) on {}", bf16_kernel);
  else products = fmt::format("bf16 requested, but this CPU has no native BF16: f32 products on {}", f32_kernel);
  return fmt::format("{}, ISA {} on {}: {}, {} thread(s) per rank", library, isa, cpu, products, threads);
}

std::string compute_library_info(bool bf16) { return compute_info().describe(bf16); }

}  // namespace mxddp
