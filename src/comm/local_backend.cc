// The local backend: ranks are threads of one process sharing memory.
//
// Each collective is a rendezvous in three steps:
//   1. arrive:  post this rank's call (pointers included) in its slot, wait until every rank has
//               posted the same sequence number, or the timeout fires, or the group is aborted;
//   2. work:    check every rank issued the same call, then move data by reading and writing
//               peers' buffers directly, each rank doing a disjoint 1/size of the work;
//   3. depart:  a barrier, so no rank returns (and lets its caller reuse its buffers) while a peer
//               may still read them.
// Only step 1 can time out. Whether a collective runs is decided under the group mutex from the
// arrival count alone, so either every rank runs it or none touches a buffer. Step 3 never times
// out: once everyone arrived, every rank reaches it after a bounded amount of copying.
//
// The bytes move through each rank's Compute (LocalOptions::computes): the CPU's kernels on host
// memory, a device's on its stream. On a device, a rank synchronizes its compute before step 1 (what
// it enqueued before the collective is in its buffers) and after step 2 (its share is written and
// its reads done before anyone departs). With LocalOptions::comm_computes, a stream of the rank's
// own for its collectives, it waits before step 1 only for an event recorded on its compute when the
// collective was issued, moves its share on the comm compute, and synchronizes that alone: the
// rank's later work is neither waited for nor queued ahead of the collective.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#include <mxddp/comm.h>
#include <mxddp/compute.h>

#include "backend.h"
#include "delayed_backend.h"

namespace mxddp {

class LocalGroupState {
 public:
  // steady_clock counts int64 nanoseconds (about 292 years), so now() + a timeout of 2^63 ns or more
  // overflows into the past and every collective would time out at once. A wait is capped at 100
  // years: forever for any run, and far from overflow whatever the clock's epoch (the boot).
  static constexpr int64_t kWaitMsMax = int64_t{100} * 365 * 24 * 3600 * 1000;

  LocalGroupState(int size, const LocalOptions& options)
      : size_(size), timeout_ms_(options.timeout_ms), slots_(static_cast<size_t>(size)) {}

  int size() const { return size_; }

  // Step 1. Copies every rank's call for this sequence number into calls (size() entries); throws
  // if the group is aborted or a peer does not arrive in time (and then aborts it for everyone).
  void arrive(int rank, uint64_t seq, const CollectiveCall& call, std::vector<CollectiveCall>& calls) {
    std::unique_lock lock(mutex_);
    MXDDP_CHECK(!aborted_, "local communicator (rank {}): {} #{} refused: {}", rank,
                collective_name(call.kind), seq, abort_reason_);
    slots_[static_cast<size_t>(rank)] = {seq, call};
    cv_.notify_all();
    const auto all_arrived = [&] {
      return std::all_of(slots_.begin(), slots_.end(), [&](const Slot& s) { return s.seq == seq; });
    };
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::min(timeout_ms_, kWaitMsMax));
    cv_.wait_until(lock, deadline, [&] { return aborted_ || all_arrived(); });
    if (!all_arrived()) {
      if (!aborted_) {
        std::string missing;
        for (int r = 0; r < size_; ++r)
          if (slots_[static_cast<size_t>(r)].seq != seq) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
        abort_locked(fmt::format("rank {} waited {} ms (timeout_ms) in {} #{}; rank(s) {} never arrived",
                                 rank, timeout_ms_, collective_name(call.kind), seq, missing));
      }
      MXDDP_FAIL("local communicator (rank {}): {} #{} failed: {}", rank, collective_name(call.kind), seq,
                 abort_reason_);
    }
    for (size_t r = 0; r < slots_.size(); ++r) calls[r] = slots_[r].call;
  }

  // Step 3.
  void depart() {
    std::unique_lock lock(mutex_);
    const uint64_t generation = depart_generation_;
    if (++departed_ == size_) {
      departed_ = 0;
      ++depart_generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return depart_generation_ != generation; });
    }
  }

  void abort(const std::string& reason) {
    std::lock_guard lock(mutex_);
    if (!aborted_) abort_locked(reason);
  }

  // A rank could not move its share of collective seq (before departing): aborts the group and
  // marks that collective failed for every rank.
  void fail_collective(uint64_t seq, const std::string& reason) {
    std::lock_guard lock(mutex_);
    if (!aborted_) abort_locked(reason);
    failed_seq_ = seq;
  }

  // After step 3: throws if a rank failed its share of collective seq, so that no rank returns a
  // result a peer left half written. An abort for another reason (a rank's thread failing after
  // the collective) does not undo a collective that completed; the next one fails instead.
  void check_completed(int rank, CollectiveKind kind, uint64_t seq) {
    std::lock_guard lock(mutex_);
    MXDDP_CHECK(failed_seq_ != seq, "local communicator (rank {}): {} #{} failed: {}", rank, collective_name(kind),
                seq, abort_reason_);
  }

 private:
  struct Slot {
    uint64_t seq = 0;
    CollectiveCall call;
  };
  void abort_locked(std::string reason) {
    aborted_ = true;
    abort_reason_ = std::move(reason);
    cv_.notify_all();
  }

  const int size_;
  const int64_t timeout_ms_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;  // guarded by mutex_; slot r is rank r's current call
  int departed_ = 0;         // guarded by mutex_
  uint64_t depart_generation_ = 0;
  bool aborted_ = false;
  std::string abort_reason_;
  uint64_t failed_seq_ = 0;  // the collective a rank failed to move its share of; 0: none
};

namespace {

// Rank r's part [begin, end) of count elements, split evenly with boundaries on 64-byte lines so
// two ranks never write the same cache line.
std::pair<int64_t, int64_t> partition(int64_t count, int parts, int index, size_t elem_bytes) {
  const auto align = static_cast<int64_t>(64 / elem_bytes);
  auto boundary = [&](int i) {
    if (i == parts) return count;
    return std::min(count, count * i / parts / align * align);
  };
  return {boundary(index), boundary(index + 1)};
}

class LocalBackend final : public CommBackend {
 public:
  // mover: the comm compute that moves this rank's shares (LocalOptions::comm_computes), or null:
  // compute itself.
  LocalBackend(std::shared_ptr<LocalGroupState> group, int rank, Compute& compute, Compute* mover)
      : group_(std::move(group)),
        rank_(rank),
        compute_(compute),
        comm_compute_(mover),
        calls_(static_cast<size_t>(group_->size())),
        inputs_(calls_.size()),
        outputs_(calls_.size()) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::string_view name() const override { return "local"; }
  Compute& compute() const override { return compute_; }

  // With a comm compute: the event after the work the rank enqueued before this collective.
  void issue(const CollectiveCall& call) noexcept override {
    if (comm_compute_ == nullptr) return;
    Issued issued{.call = call};
    try {
      issued.ready = compute_.record_event();
    } catch (...) {
      issued.failure = std::current_exception();
    }
    std::lock_guard lock(issued_mutex_);
    issued_.push_back(std::move(issued));
  }

  void run(const CollectiveCall& call) override {
    const uint64_t seq = ++seq_;
    // A failure of this rank's compute (a device fault, a refused launch) fails the collective on
    // every rank: the group aborts, so that peers waiting to arrive or reading this rank's result
    // stop, and no rank returns a result this one left half written.
    const auto abort_group = [&](const std::exception& e) {
      group_->fail_collective(seq, fmt::format("rank {} could not move its share of {} #{}: {}", rank_,
                                               collective_name(call.kind), seq, e.what()));
    };
    try {
      wait_for_inputs(call);
    } catch (const std::exception& e) {
      abort_group(e);
      throw;
    }
    group_->arrive(rank_, seq, call, calls_);
    const std::vector<CollectiveCall>& calls = calls_;
    std::string mismatch;
    int mismatched_rank = 0;
    for (int r = 1; r < size() && mismatch.empty(); ++r) {
      mismatch = describe_mismatch(calls[0], calls[static_cast<size_t>(r)]);
      mismatched_rank = r;
    }
    std::exception_ptr failure;
    if (mismatch.empty()) {
      try {
        move_data(calls);
        mover().synchronize();
      } catch (const std::exception& e) {
        failure = std::current_exception();
        abort_group(e);
      }
    }
    group_->depart();  // also on a mismatch or failure: peers may still be reading the slots
    if (failure) std::rethrow_exception(failure);
    MXDDP_CHECK(mismatch.empty(), "{} #{}: ranks disagree: rank 0 vs rank {}: {}", collective_name(call.kind),
                seq, mismatched_rank, mismatch);
    group_->check_completed(rank_, call.kind, seq);
  }

 private:
  // One collective between issue() and run(), with a comm compute.
  struct Issued {
    CollectiveCall call;
    std::unique_ptr<ComputeEvent> ready;  // after the work enqueued before it was issued
    std::exception_ptr failure;           // why no event could be recorded
  };

  Compute& mover() const { return comm_compute_ != nullptr ? *comm_compute_ : compute_; }

  // Returns once what the rank enqueued before issuing `call` is in its buffers: an event recorded
  // when it was issued, or (without a comm compute) the whole compute.
  void wait_for_inputs(const CollectiveCall& call) {
    if (comm_compute_ == nullptr) {
      compute_.synchronize();
      return;
    }
    Issued issued;
    {
      std::lock_guard lock(issued_mutex_);
      // Communicator runs every call it issued, in issue order (one progress queue per rank).
      MXDDP_CHECK(!issued_.empty() && issued_.front().call.send == call.send && issued_.front().call.recv == call.recv,
                  "{} of {} elements ran without the event of its issue (a bug in mxddp)", collective_name(call.kind),
                  call.count);
      issued = std::move(issued_.front());
      issued_.pop_front();
    }
    if (issued.failure) std::rethrow_exception(issued.failure);
    issued.ready->wait();
  }

  // Every rank moves a disjoint 1/size share of the bytes, so all progress threads stream at once,
  // and each element is read and written the fewest times the operation allows (the bytes
  // comm_bench's vs_stream counts).
  void move_data(const std::vector<CollectiveCall>& calls) {
    const CollectiveCall& mine = calls[static_cast<size_t>(rank_)];
    const int n = size();
    const size_t elem = dtype_size_bytes(mine.dtype);
    std::vector<const void*>& inputs = inputs_;
    std::vector<void*>& outputs = outputs_;
    const auto at = [elem](const void* base, int64_t index) {
      return static_cast<char*>(const_cast<void*>(base)) + static_cast<size_t>(index) * elem;
    };
    switch (mine.kind) {
      case CollectiveKind::kAllReduce: {
        // This rank owns elements [begin, end) of every rank's buffer: it reduces them and writes
        // the result to all buffers in the same pass (each buffer is read and written once).
        // Nobody else reads or writes that range.
        const auto [begin, end] = partition(mine.count, n, rank_, elem);
        if (begin == end) return;
        for (int r = 0; r < n; ++r) {
          inputs[static_cast<size_t>(r)] = at(calls[static_cast<size_t>(r)].send, begin);
          outputs[static_cast<size_t>(r)] = at(calls[static_cast<size_t>(r)].recv, begin);
        }
        mover().reduce({.dtype = mine.dtype, .op = mine.op, .prescale = mine.prescale, .count = end - begin,
                         .inputs = {inputs.data(), static_cast<size_t>(n)},
                         .outputs = {outputs.data(), static_cast<size_t>(n)}});
        return;
      }
      case CollectiveKind::kReduceScatter: {
        // Block rank_ of every input is read by this rank alone, so an in-place output is safe.
        const int64_t offset = static_cast<int64_t>(rank_) * mine.count;
        for (int r = 0; r < n; ++r) inputs[static_cast<size_t>(r)] = at(calls[static_cast<size_t>(r)].send, offset);
        mover().reduce({.dtype = mine.dtype, .op = mine.op, .prescale = mine.prescale, .count = mine.count,
                         .inputs = {inputs.data(), static_cast<size_t>(n)}, .outputs = {&mine.recv, 1}});
        return;
      }
      case CollectiveKind::kAllGather: {
        // Push: this rank reads its own block once and writes it into block rank_ of every rank's
        // output (its own too unless in place). Only this rank writes those blocks.
        int n_dsts = 0;
        for (int r = 0; r < n; ++r) {
          void* dst = at(calls[static_cast<size_t>(r)].recv, static_cast<int64_t>(rank_) * mine.count);
          if (dst != mine.send) outputs[static_cast<size_t>(n_dsts++)] = dst;
        }
        mover().copy_to_many(mine.send, {outputs.data(), static_cast<size_t>(n_dsts)},
                              static_cast<size_t>(mine.count) * elem);
        return;
      }
      case CollectiveKind::kBroadcast: {
        // Every rank copies its share [begin, end) of the root's buffer to every other rank, so the
        // root's buffer is read once and the work is split across all progress threads.
        const auto [begin, end] = partition(mine.count, n, rank_, elem);
        if (begin == end) return;
        int n_dsts = 0;
        for (int r = 0; r < n; ++r)
          if (r != mine.root) outputs[static_cast<size_t>(n_dsts++)] = at(calls[static_cast<size_t>(r)].recv, begin);
        mover().copy_to_many(at(calls[static_cast<size_t>(mine.root)].send, begin),
                              {outputs.data(), static_cast<size_t>(n_dsts)}, static_cast<size_t>(end - begin) * elem);
        return;
      }
      case CollectiveKind::kBarrier:
        return;
    }
  }

  std::shared_ptr<LocalGroupState> group_;
  const int rank_;
  Compute& compute_;  // the rank's: its memory (its stream); moves its share without a comm compute
  Compute* comm_compute_;  // moves its share on a stream of its own (LocalOptions::comm_computes), or null
  std::mutex issued_mutex_;     // issue() runs on the issuing thread, run() on the progress thread
  std::deque<Issued> issued_;   // with a comm compute: the calls issued and not yet run, in order
  // Touched only by this rank's progress thread; sized once so a collective allocates nothing.
  uint64_t seq_ = 0;
  std::vector<CollectiveCall> calls_;  // [size] every rank's call of the current collective
  std::vector<const void*> inputs_;    // [size] every rank's input pointer for this rank's part
  std::vector<void*> outputs_;         // [size] the destinations this rank writes its part to
};

}  // namespace

LocalGroup::LocalGroup(int size, const LocalOptions& options) {
  MXDDP_CHECK(size >= 1, "a local group needs at least 1 rank; got {}", size);
  MXDDP_CHECK(options.timeout_ms > 0, "timeout_ms must be positive; got {}", options.timeout_ms);
  const std::vector<Compute*>& computes = options.computes;
  MXDDP_CHECK(computes.empty() || computes.size() == static_cast<size_t>(size),
              "a local group of {} ranks got {} computes; give one per rank, or none (host memory)", size,
              computes.size());
  for (size_t r = 0; r < computes.size(); ++r) {
    MXDDP_CHECK(computes[r] != nullptr, "the compute of local rank {} is null", r);
    MXDDP_CHECK(computes[r]->device() == computes[0]->device(),
                "local rank {}'s compute works on {} but rank 0's on {}; a local group's ranks read each other's "
                "buffers, so they share one device",
                r, to_string(computes[r]->device()), to_string(computes[0]->device()));
  }
  const std::vector<Compute*>& comm_computes = options.comm_computes;
  MXDDP_CHECK(comm_computes.empty() || comm_computes.size() == computes.size(),
              "a local group of {} ranks with {} computes got {} comm computes; give one per compute, or none",
              size, computes.size(), comm_computes.size());
  for (size_t r = 0; r < comm_computes.size(); ++r) {
    MXDDP_CHECK(comm_computes[r] != nullptr, "the comm compute of local rank {} is null", r);
    MXDDP_CHECK(comm_computes[r]->device() == computes[r]->device(),
                "local rank {}'s comm compute works on {} but its compute on {}; it moves that compute's buffers", r,
                to_string(comm_computes[r]->device()), to_string(computes[r]->device()));
  }
  state_ = std::make_shared<LocalGroupState>(size, options);
  for (int r = 0; r < size; ++r) {
    Compute& compute = computes.empty() ? cpu_compute() : *computes[static_cast<size_t>(r)];
    Compute* mover = comm_computes.empty() ? nullptr : comm_computes[static_cast<size_t>(r)];
    communicators_.push_back(std::make_unique<Communicator>(
        with_injected_delay(std::make_unique<LocalBackend>(state_, r, compute, mover), options.injected_delay)));
  }
}

LocalGroup::~LocalGroup() {
  // A communicator's destructor drains its queue. Abort first so a rank whose peers are gone
  // fails its pending collectives instead of waiting out the timeout.
  abort("the local group is being destroyed");
  communicators_.clear();
}

Communicator& LocalGroup::communicator(int rank) {
  MXDDP_CHECK(rank >= 0 && rank < size(), "rank {} is not in this local group; valid: 0..{}", rank, size() - 1);
  return *communicators_[static_cast<size_t>(rank)];
}

void LocalGroup::abort(const std::string& reason) { state_->abort(reason); }

}  // namespace mxddp
