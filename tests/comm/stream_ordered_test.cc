// Communicator over a stream-ordered engine (backend.h's StreamOrderedBackend, which the nccl
// engine is): a collective is enqueued on the issuing thread, one issuer at a time, after the
// arguments are checked; Work::wait() rethrows an enqueue failure or a failure the engine found
// later, and otherwise orders the compute stream (the engine's order_after) without waiting;
// is_completed() asks the engine; HSDP over it is refused. The engine here is a fake over a local group (it runs each
// all-reduce there when enqueued), so that the plumbing is tested where no GPU is.
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/comm.h>
#include <mxddp/fsdp.h>

#include "comm/backend.h"

namespace mxddp::testing {
namespace {

// What a fake engine saw and what it is told to do.
struct FakeLog {
  std::atomic<int> enqueues{0}, orders{0}, inside{0}, max_inside{0};
  std::thread::id enqueue_thread;
  std::atomic<bool> device_done{false};
  std::atomic<bool> fail_next_enqueue{false};
  std::mutex mutex;
  std::exception_ptr late;  // under mutex
};

// Runs each all-reduce (and barrier) on a local group's communicator when it is enqueued.
class FakeOrderedBackend final : public StreamOrderedBackend {
 public:
  FakeOrderedBackend(Communicator& inner, FakeLog& log) : inner_(inner), log_(log) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view name() const override { return "fake_ordered"; }
  Compute& compute() const override { return inner_.compute(); }

  EnqueuedCollective enqueue(const CollectiveCall& call) override {
    const int now = ++log_.inside;
    int seen = log_.max_inside.load();
    while (now > seen && !log_.max_inside.compare_exchange_weak(seen, now)) {
    }
    ++log_.enqueues;
    log_.enqueue_thread = std::this_thread::get_id();
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // widen any overlap of two issuers
    const bool fail = log_.fail_next_enqueue.exchange(false);
    --log_.inside;
    if (fail) MXDDP_FAIL("the engine refused the call (injected)");
    if (call.kind == CollectiveKind::kAllReduce)
      inner_.all_reduce(TensorView{call.recv, call.dtype, Shape{call.count}, Device::cpu()}, {.op = call.op, .prescale = call.prescale});
    else if (call.kind == CollectiveKind::kBarrier)
      inner_.barrier();
    else
      MXDDP_FAIL("the fake engine runs all_reduce and barrier; got {}", collective_name(call.kind));
    EnqueuedCollective out;
    out.order_after = [log = &log_] { ++log->orders; };
    out.finished = [log = &log_] { return log->device_done.load(); };
    out.late_failure = [log = &log_] {
      std::lock_guard lock(log->mutex);
      return log->late;
    };
    return out;
  }

 private:
  Communicator& inner_;
  FakeLog& log_;
};

// fn(comm, log) on each of `ranks` local ranks, comm being a Communicator over a fake engine.
template <typename Fn>
void run_ordered(int ranks, Fn fn) {
  std::vector<FakeLog> logs(static_cast<size_t>(ranks));
  run_local(ranks, [&](Communicator& inner) {
    FakeLog& log = logs[static_cast<size_t>(inner.rank())];
    Communicator comm(std::unique_ptr<StreamOrderedBackend>(std::make_unique<FakeOrderedBackend>(inner, log)));
    EXPECT_TRUE(comm.stream_ordered());
    EXPECT_EQ(comm.backend_name(), "fake_ordered");
    fn(comm, log);
  });
}

TEST(StreamOrdered, EnqueuedOnTheIssuingThreadAndOrderedOnWait) {
  run_ordered(2, [](Communicator& comm, FakeLog& log) {
    std::vector<float> x(100, static_cast<float>(comm.rank() + 1));
    Work work = comm.all_reduce(TensorView{x.data(), DType::kF32, Shape{100}, Device::cpu()}, {.async_op = true});
    EXPECT_EQ(log.enqueues.load(), 1);
    EXPECT_EQ(log.enqueue_thread, std::this_thread::get_id()) << "no progress thread: the issuer enqueues";
    EXPECT_EQ(log.orders.load(), 0) << "an async call orders nothing until wait()";
    work.wait();
    EXPECT_EQ(log.orders.load(), 1);
    EXPECT_EQ(x[0], 3.0f);
    // A blocking call is the same call followed by wait().
    comm.all_reduce(TensorView{x.data(), DType::kF32, Shape{100}, Device::cpu()});
    EXPECT_EQ(log.orders.load(), 2);
    EXPECT_EQ(x[99], 6.0f);
  });
}

TEST(StreamOrdered, IsCompletedAsksTheDevice) {
  run_ordered(1, [](Communicator& comm, FakeLog& log) {
    float x = 1;
    Work work = comm.all_reduce(TensorView{&x, DType::kF32, Shape{1}, Device::cpu()}, {.async_op = true});
    EXPECT_FALSE(work.is_completed()) << "enqueued, but the device has not finished it";
    log.device_done = true;
    EXPECT_TRUE(work.is_completed());
  });
}

TEST(StreamOrdered, AnEnqueueFailureIsRethrownByWaitAndByABlockingCall) {
  run_ordered(1, [](Communicator& comm, FakeLog& log) {
    float x = 1;
    const TensorView v{&x, DType::kF32, Shape{1}, Device::cpu()};
    log.fail_next_enqueue = true;
    Work work = comm.all_reduce(v, {.async_op = true});
    EXPECT_TRUE(work.is_completed());
    for (int i = 0; i < 2; ++i) {
      try {
        work.wait();
        ADD_FAILURE() << "wait() returned after a failed enqueue";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("the engine refused the call (injected)"), std::string::npos) << e.what();
      }
    }
    EXPECT_EQ(log.orders.load(), 0) << "a failed collective orders nothing";
    log.fail_next_enqueue = true;
    EXPECT_THROW(comm.all_reduce(v), Error);
    comm.all_reduce(v);  // the next call goes on
    EXPECT_EQ(log.orders.load(), 1);
  });
}

TEST(StreamOrdered, AFailureFoundAfterTheEnqueueIsRethrownByWait) {
  run_ordered(1, [](Communicator& comm, FakeLog& log) {
    float x = 1;
    Work work = comm.all_reduce(TensorView{&x, DType::kF32, Shape{1}, Device::cpu()}, {.async_op = true});
    {
      std::lock_guard lock(log.mutex);
      log.late = std::make_exception_ptr(Error("all_reduce #0: not complete after timeout_ms 10 (injected)", "test"));
    }
    try {
      work.wait();
      ADD_FAILURE() << "wait() returned after the engine failed";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not complete after timeout_ms 10 (injected)"), std::string::npos) << e.what();
    }
    EXPECT_EQ(log.orders.load(), 0) << "the compute stream is not ordered after a failed collective";
  });
}

// The arguments are checked before anything is enqueued; and issuers on two threads never enqueue
// at once, so the engine sees one order of collectives.
TEST(StreamOrdered, ArgumentsAreCheckedFirstAndIssuersTakeTurns) {
  run_ordered(1, [](Communicator& comm, FakeLog& log) {
    float x = 1;
    EXPECT_THROW(comm.all_reduce(TensorView{&x, DType::kF32, Shape{1}, Device::cuda(0)}), Error);
    EXPECT_THROW(comm.all_reduce(TensorView{&x, DType::kI32, Shape{1}, Device::cpu()}, {.op = ReduceOp::kAvg}), Error);
    EXPECT_EQ(log.enqueues.load(), 0);
    std::vector<std::thread> issuers;
    for (int t = 0; t < 4; ++t)
      issuers.emplace_back([&] {
        for (int i = 0; i < 10; ++i) comm.barrier();
      });
    for (std::thread& t : issuers) t.join();
    EXPECT_EQ(log.enqueues.load(), 40);
    EXPECT_EQ(log.max_inside.load(), 1) << "two issuers were inside the engine at once";
  });
}

// HSDP needs its two communicators' collectives ordered with each other; two stream-ordered ones
// would each order theirs with their own compute stream only, so FSDP refuses the pair, naming the
// engine, and allocates nothing.
TEST(StreamOrdered, HsdpOverAStreamOrderedCommunicatorIsRefused) {
  LocalGroup replicas(1);
  run_ordered(1, [&](Communicator& comm, FakeLog&) {
    MemoryTracker tracker;
    const std::vector<ParamSpec> params{{.name = "w", .shape = Shape{64, 64}}};
    try {
      FullyShardedDataParallel fsdp(comm, params, {{0}}, FsdpConfig{}, tracker, {}, &replicas.communicator(0));
      ADD_FAILURE() << "HSDP was built over a stream-ordered communicator";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("HSDP over a stream-ordered (fake_ordered) communicator is not supported yet"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(tracker.usage().total_live_bytes, 0);
  });
}

}  // namespace
}  // namespace mxddp::testing
