// Ring reduce-scatter (an in-place f32 sum) and ring all-gather over any point-to-point transport,
// through a scratch of two chunks: what the MPI backend runs for f32 sums of 1 MiB or more, and the
// torch backend for its in-place reduce-scatter.
//
// Why not the engines' own collectives:
//   - OpenMPI 4.1's allocate temporaries as large as the message: its in-place
//     MPI_Reduce_scatter_block malloc'd a whole bucket on rank 0 (114 MiB for a 30M-param model's
//     single bucket), its MPI_Allreduce half the message on every rank at 2 ranks. Freed at once,
//     RSS hides them, but they land inside backward, on the step's memory peak, where no tracker
//     sees them (issue 44 item 3: DDP + distributed optimizer peaked above Megatron's). The ring
//     was also faster here: tests/comm/mpi_ring_test.cc, bench/comm_bench.cc.
//   - gloo's reduce_scatter ran 4x slower than its all_reduce of the same input, so the torch
//     backend all-reduced the whole input: twice the bytes a reduce-scatter moves.
// The ring moves what the bandwidth-optimal algorithms move: per phase each rank sends and
// receives (size - 1) / size of the message.
//
// Reduce-scatter: in step s (0 <= s < size - 1) a rank sends block (rank - s - 1) to its right
// neighbour and receives block (rank - s - 2) from its left one, adding it into its own copy. The
// block sent in step s is the one step s - 1's additions completed, so after size - 1 steps the
// block received last, (rank - size) = rank, holds every rank's contribution. Each step's block
// moves in chunks of kRingChunkNumel, received into two alternating scratch chunks: chunk c + 1 is
// in flight while chunk c is summed. Summation order: block b's sum starts at rank b + 1 and goes
// round the ring, ending at rank b. At 2 ranks that is the single addition every engine does.
//
// All-gather: in step s a rank sends block (rank - s) to the right and receives block
// (rank - s - 1) from the left straight into place, one message per block.
//
// A Transport moves bytes; it has a Request type (value-initialized: nothing in flight) and
//   Request isend(const void* data, int64_t bytes, int peer);
//   Request irecv(void* data, int64_t bytes, int peer);
//   void wait(Request& request);  // returns at once for a value-initialized request
// Messages between a pair of ranks must match in the order they were posted (MPI's and gloo's
// rule for one tag). A transport that can add what it receives straight into place also has
//   Request irecv_sum(float* data, int64_t numel, int peer);  // data[i] = data[i] + received[i]
// and then the reduce-scatter sends each block as one message and needs no scratch (the shared-
// memory transport sums out of its slots).
#pragma once

#include <algorithm>
#include <cstdint>

#include <mxddp/comm.h>

#include "../compute/reduce.h"

namespace mxddp {

// 1 MiB of f32 per chunk, so the scratch is 2 MiB, held for the run: it is memory Megatron's
// gloo does not hold between collectives (issue 44 item 3). A message through MPI costs a few
// microseconds against a chunk's ~0.3 ms transfer; through the torch backend's gloo fallback (four
// Python calls per chunk) tens: there the reduce-scatter of 114 MiB took 51 ms with 1 MiB chunks
// against 39 ms with 4 MiB (gloo's all_reduce of it: 68 ms; 2 ranks, this project's AMD EPYC VM).
inline constexpr int64_t kRingChunkNumel = int64_t{1} << 18;
// Messages below this many bytes go to the engine's own collectives: there latency rules, the
// ring's 2 (size - 1) steps would cost more, and the temporaries are small.
inline constexpr int64_t kRingMessageBytesMin = int64_t{1} << 20;

// The scratch (f32 elements) a ring reduction needs when its largest block holds block_numel, over
// a transport without irecv_sum.
inline int64_t ring_scratch_numel(int64_t block_numel) { return 2 * std::min(kRingChunkNumel, block_numel); }

// Transports that sum what they receive into place (see above).
template <typename Transport>
concept SummingTransport = requires(Transport& t, float* data) { t.irecv_sum(data, int64_t{0}, 0); };

namespace ring_detail {
inline int block_at(int rank, int step, int size) { return ((rank - step) % size + size) % size; }
inline int64_t chunk_numel(int64_t numel, int64_t chunk) { return std::min(kRingChunkNumel, numel - chunk * kRingChunkNumel); }
}  // namespace ring_detail

// Sums every rank's data into this rank's block: block b is data[offsets[b], offsets[b + 1])
// (offsets: size + 1 ascending values, the same on every rank). On return block `rank` holds the
// sum over ranks; every other block holds a partial sum (scratch, as comm.h's in-place
// reduce-scatter allows). scratch: [ring_scratch_numel(largest block)] floats; unused (may be null)
// over a SummingTransport.
template <typename Transport>
void ring_reduce_scatter_sum(Transport& t, int rank, int size, float* data, const int64_t* offsets, float* scratch) {
  using ring_detail::chunk_numel;
  const int right = (rank + 1) % size;
  const int left = (rank - 1 + size) % size;
  for (int step = 0; step + 1 < size; ++step) {
    const int send_b = ring_detail::block_at(rank, step + 1, size);
    const int recv_b = ring_detail::block_at(rank, step + 2, size);
    const float* send = data + offsets[send_b];
    float* recv = data + offsets[recv_b];
    const int64_t send_n = offsets[send_b + 1] - offsets[send_b];
    const int64_t recv_n = offsets[recv_b + 1] - offsets[recv_b];
    if constexpr (SummingTransport<Transport>) {
      auto recv_req = t.irecv_sum(recv, recv_n, left);
      auto send_req = t.isend(send, 4 * send_n, right);
      t.wait(recv_req);
      t.wait(send_req);
      continue;
    }
    const int64_t chunks = (std::max(send_n, recv_n) + kRingChunkNumel - 1) / kRingChunkNumel;
    typename Transport::Request recv_req[2]{};
    typename Transport::Request send_req[2]{};
    auto post = [&](int64_t c) {
      const auto slot = static_cast<size_t>(c % 2);
      if (c * kRingChunkNumel < recv_n)
        recv_req[slot] = t.irecv(scratch + slot * kRingChunkNumel, 4 * chunk_numel(recv_n, c), left);
      if (c * kRingChunkNumel < send_n)
        send_req[slot] = t.isend(send + c * kRingChunkNumel, 4 * chunk_numel(send_n, c), right);
    };
    post(0);
    for (int64_t c = 0; c < chunks; ++c) {
      const auto slot = static_cast<size_t>(c % 2);
      t.wait(send_req[1 - slot]);  // chunk c - 1's send: its slot is reused by chunk c + 1
      if (c + 1 < chunks) post(c + 1);
      t.wait(recv_req[slot]);
      if (c * kRingChunkNumel < recv_n) {
        float* mine = recv + c * kRingChunkNumel;
        const void* inputs[2] = {mine, scratch + slot * kRingChunkNumel};
        reduce_arrays(DType::kF32, ReduceOp::kSum, inputs, 2, chunk_numel(recv_n, c), mine);
      }
    }
    t.wait(send_req[0]);
    t.wait(send_req[1]);
  }
}

// Sends this rank's block to every rank and receives theirs into place: block b is
// data[offsets[b], offsets[b + 1]) in bytes; afterwards every block b holds rank b's block b.
template <typename Transport>
void ring_all_gather(Transport& t, int rank, int size, char* data, const int64_t* offsets) {
  const int right = (rank + 1) % size;
  const int left = (rank - 1 + size) % size;
  for (int step = 0; step + 1 < size; ++step) {
    const int send_b = ring_detail::block_at(rank, step, size);
    const int recv_b = ring_detail::block_at(rank, step + 1, size);
    auto recv = t.irecv(data + offsets[recv_b], offsets[recv_b + 1] - offsets[recv_b], left);
    auto send = t.isend(data + offsets[send_b], offsets[send_b + 1] - offsets[send_b], right);
    t.wait(recv);
    t.wait(send);
  }
}

}  // namespace mxddp
