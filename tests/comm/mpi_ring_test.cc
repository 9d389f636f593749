// The MPI backend's ring (src/comm/ring.h): f32 sums of 1 MiB or more, all-reduced and
// reduce-scattered in place, equal the serial reference at every element, over blocks that do not
// split evenly and chunk counts that differ between neighbours; and a reduction's transient memory
// is the two chunks it charges as comm, not a temporary as large as the message (OpenMPI's own
// in-place MPI_Reduce_scatter_block raised rank 0's peak RSS by the whole message, its
// MPI_Allreduce every rank's by half of it: issue 44 item 3). Run under mpirun -np 2 and -np 4.
#include <fstream>
#include <string>

#include "mpi_main.h"
#include "comm/collective_checks.h"
#include "comm/ring.h"

namespace mxddp::testing {
namespace {

// Sizes around the ring's chunk and threshold: the smallest ring message, blocks of a whole number
// of chunks, blocks one element past a chunk (uneven chunk counts between neighbours for the
// all-reduce's near-equal blocks), and several chunks.
const int64_t kCounts[] = {kRingMessageBytesMin / 4, 4 * kRingChunkNumel, 2 * kRingChunkNumel * 4 + 3,
                           4 * kRingChunkNumel + 4 * 7 + 1};

TEST(MpiRing, AllReduceSumAndAvgMatchTheReference) {
  for (int64_t n : kCounts) {
    check_all_reduce(*g_mpi_comm, DType::kF32, ReduceOp::kSum, n, /*async_op=*/false);
    check_all_reduce(*g_mpi_comm, DType::kF32, ReduceOp::kAvg, n, /*async_op=*/true);
  }
}

TEST(MpiRing, InPlaceReduceScatterMatchesTheReference) {
  const int size = g_mpi_comm->size();
  for (int64_t block : {kRingMessageBytesMin / 4 / size, kRingChunkNumel, kRingChunkNumel + 1, 2 * kRingChunkNumel + 5}) {
    check_reduce_scatter(*g_mpi_comm, DType::kF32, ReduceOp::kSum, block, /*in_place=*/true);
    check_reduce_scatter(*g_mpi_comm, DType::kF32, ReduceOp::kAvg, block, /*in_place=*/true);
  }
}

TEST(MpiRing, PrescaleAppliesToTheSum) {
  Communicator& comm = *g_mpi_comm;
  const int64_t n = kRingChunkNumel + 9;
  Buf buf(DType::kF32, n);
  for (int64_t i = 0; i < n; ++i) buf.set(i, value_at(comm.rank(), i));
  comm.all_reduce(buf.view(), {.op = ReduceOp::kSum, .prescale = 0.5f});
  expect_all(buf, 0, n, [&](int64_t i) { return expected_reduction(DType::kF32, ReduceOp::kSum, comm.size(), i, 0.5f); },
             label(comm, "all_reduce/sum/prescale 0.5", DType::kF32, n));
}

// /proc/self/status's field in KiB.
int64_t status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  return -1;
}

// Resets VmHWM to the current RSS (Linux 4.0 and later).
bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  return static_cast<bool>(out.flush());
}

TEST(MpiRing, LargeReductionsHoldOnlyTheirChunks) {
  if (!reset_peak_rss() || status_kib("VmHWM") < 0) GTEST_SKIP() << "no /proc/self/clear_refs or VmHWM here";
  MemoryTracker mine;
  Communicator& comm = *g_mpi_comm;
  const int n = comm.size();
  comm.set_memory_tracker(&mine);
  const int64_t numel = int64_t{16} << 20;  // 64 MiB of f32
  Buf buf(DType::kF32, numel);
  for (int64_t i = 0; i < numel; ++i) buf.set(i, value_at(comm.rank(), i));  // touched: in the RSS
  comm.all_reduce(buf.view());  // the scratch is allocated (and touched) once, then held
  const int64_t scratch_bytes = mine.usage().live(MemoryCategory::kComm);
  EXPECT_EQ(scratch_bytes, mpi_staging_bytes(false, DType::kF32, numel, n));
  EXPECT_EQ(scratch_bytes, 2 * kRingChunkNumel * 4) << "two chunks, whatever the message's size";
  EXPECT_EQ(scratch_bytes, int64_t{2} << 20);
  ASSERT_TRUE(reset_peak_rss());
  const int64_t before_kib = status_kib("VmRSS");
  comm.all_reduce(buf.view());
  comm.reduce_scatter(buf.view(), buf.view().slice(comm.rank() * (numel / n), numel / n));
  const int64_t rise_kib = status_kib("VmHWM") - before_kib;
  // OpenMPI's collectives raised it by 32 MiB (all-reduce) and 64 MiB (reduce-scatter, rank 0).
  EXPECT_LT(rise_kib, 2 * 1024) << "peak RSS rose by " << rise_kib << " KiB during a 64 MiB all-reduce and reduce-scatter";
  EXPECT_EQ(mine.usage().live(MemoryCategory::kComm), mpi_staging_bytes(true, DType::kF32, numel / n, n));
  comm.set_memory_tracker(nullptr);
}

}  // namespace
}  // namespace mxddp::testing
