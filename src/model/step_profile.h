// Where a micro-batch's model time goes, by kind of work (issue 28's profile): the matrix
// products, the BF16 casts around them, the row kernels, the attention (its products, casts and
// softmax apart), the weight staging. Off by default; `gpt_bench --breakdown` turns it on in each
// rank's thread. Each part is timed exclusively: a part running inside another (a product inside
// attention) is taken out of the outer one. Only the thread that enabled it records: OpenMP
// workers (attention's heads at 2 threads per rank) do not, and their time stays with the scope
// that started the parallel region.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <vector>

namespace mxddp::model::profile {

enum class Part : uint8_t {
  kProducts,           // matmul kernels outside attention
  kCasts,              // rounding operands to BF16 for those products
  kLayerNorm,         // LayerNorm, forward and backward
  kGelu,               // GELU forward (and its rebuild in backward) and backward
  kCrossEntropy,       // the loss and its gradient
  kElementwise,        // bias copies and sums, residual adds, zeroing, embeddings
  kAttentionProducts,  // attention's score, P v and gradient products
  kAttentionCasts,     // their BF16 operand casts
  kAttentionSoftmax,   // attention's causal softmax, forward and backward
  kAttentionOther,     // the rest of attention (zeroing dk, dv; the OpenMP region at > 1 thread)
  kWeights,            // staging params for the products (BF16 param -> the product's operand)
  kCount
};
inline constexpr int kPartCount = static_cast<int>(Part::kCount);
const char* part_name(Part part);

// One micro-batch's milliseconds per part.
using MicroBatch = std::array<double, kPartCount>;

// The calling thread records from now on (or stops); enabling clears its records.
void set_enabled(bool enabled);
bool enabled();
// Starts a new record (GptModel::forward_backward calls it); scopes outside any record count nowhere.
void begin_micro_batch();
// The calling thread's records, one per micro-batch since set_enabled(true).
const std::vector<MicroBatch>& records();

// Times its lifetime as `part` (exclusive of nested scopes). Costs one thread-local read when off.
class Scope {
 public:
  explicit Scope(Part part);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Part part_;
  bool active_ = false;
  double nested_ms_ = 0;
  Scope* parent_ = nullptr;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace mxddp::model::profile
