// ring.h's transport through shared memory, for a group whose ranks share a host: the torch
// backend's ring when torchrun (or srun) put every rank of the group on one machine.
//
// Why: under torchrun the ring's messages otherwise go through gloo's TCP over loopback, a kernel
// copy each way and four Python calls per chunk; with OpenMPI under mpirun the same ring moves
// through shared memory. The 124M GPT-2 step of bench/torch_ddp_compare.py was 1.34x slower under
// torchrun than under mpirun (issue 43 asks for 5%).
//
// Each rank owns one channel to its right neighbour (the only peer a ring sends to): a POSIX
// shared-memory object of kShmSlots slots of kShmSlotBytes, with a published and a consumed
// counter (single producer, single consumer). A send copies its bytes into free slots, a receive
// copies them out of filled ones; a slot holds bytes of one message only, and both ends post the
// same message sizes in the same order (the ring's schedule is the same on every rank), which the
// receiver checks. A summing receive adds a slot's f32s into place as it empties it. Posting only queues an operation; every wait() moves all queued operations of
// both channels forward, so a message longer than the channel cannot deadlock the ring.
//
// Setup is in three collective phases (the caller puts a barrier or an agreement between them):
// create() makes and maps this rank's channel, connect() maps the left neighbour's, unlink_own()
// removes this rank's name once the neighbour has mapped it (the mappings outlive the names, so a
// crash after setup leaks nothing in /dev/shm).
//
// A wait that sees no progress spins briefly, then sleeps with a growing backoff (10 us to 1 ms),
// and after timeout_ms without any progress throws an Error naming the neighbour it waits for.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>

namespace mxddp {

// 1 MiB per channel, mapped by two ranks (its sender and its receiver): what the ring holds beyond
// Megatron's gloo (issue 44 item 3). 256 KiB slots keep a slot's copy in L2 and cost one counter
// handoff per 0.1 ms of copying.
inline constexpr int kShmSlots = 4;
inline constexpr int64_t kShmSlotBytes = int64_t{1} << 18;

struct ShmChannel;  // the mapped layout (shm_ring.cc)

class ShmRingTransport {
 public:
  struct Request {
    int kind = 0;     // 0: nothing in flight; 1: a send; 2: a receive
    uint64_t id = 0;  // its index among this transport's sends (or receives)
  };

  // Phase 1: creates and maps this rank's channel, named "/<name_prefix>-<rank>" (name_prefix: a
  // token unique to the group and the job). Throws an Error naming the shm object on failure.
  static std::unique_ptr<ShmRingTransport> create(const std::string& name_prefix, int rank, int size,
                                                   int64_t timeout_ms);
  // Phase 2, after every rank's create(): maps the left neighbour's channel. False, with why set,
  // when it cannot (another IPC namespace: same host name, separate /dev/shm).
  bool connect(std::string& why);
  // Phase 3, after every rank's connect(): unlinks this rank's name.
  void unlink_own();
  ~ShmRingTransport();
  ShmRingTransport(const ShmRingTransport&) = delete;
  ShmRingTransport& operator=(const ShmRingTransport&) = delete;

  // ring.h's Transport. peer must be the right neighbour (sends) or the left one (receives).
  Request isend(const void* data, int64_t bytes, int peer);
  Request irecv(void* data, int64_t bytes, int peer);
  // A receive that adds each f32 it gets into data instead of storing it (data[i] + received[i]):
  // ring.h's reduce-scatter sums straight out of the slots, with no scratch.
  Request irecv_sum(float* data, int64_t numel, int peer);
  void wait(Request& request);

 private:
  struct Op {
    char* data;
    int64_t bytes;
    int64_t done;
    bool sum = false;  // a receive that adds f32s into data
  };
  Request post_recv(void* data, int64_t bytes, int peer, bool sum);
  ShmRingTransport(std::string own_name, int rank, int size, int64_t timeout_ms);
  bool progress();
  bool complete(const Request& request) const;

  std::string own_name_;
  bool own_linked_ = false;
  int rank_;
  int size_;
  int64_t timeout_ms_;
  ShmChannel* out_ = nullptr;  // this rank's channel, to rank + 1
  ShmChannel* in_ = nullptr;   // rank - 1's channel, to this rank
  std::deque<Op> sends_;       // queued, oldest first
  std::deque<Op> recvs_;
  uint64_t sends_posted_ = 0;
  uint64_t sends_completed_ = 0;
  uint64_t recvs_posted_ = 0;
  uint64_t recvs_completed_ = 0;
};

}  // namespace mxddp
