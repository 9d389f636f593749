// The shared-memory channels of shm_ring.h: their layout, setup, and the progress loop.
#include "shm_ring.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <mxddp/core.h>

#include "../compute/reduce.h"

namespace mxddp {

// The mapped object: this header (the two counters on cache lines of their own, one written by
// each end), then at kHeaderBytes the slots, [kShmSlots][kShmSlotBytes]. Cross-process atomics
// need lock-free ones.
struct ShmChannel {
  static constexpr uint64_t kMagic = 0x6d78646470736872;  // "mxddpshr"
  static constexpr size_t kHeaderBytes = 512;
  uint64_t magic;
  uint64_t slot_bytes;
  uint64_t slots;
  alignas(64) std::atomic<uint64_t> published;  // slots the sender has filled, ever
  alignas(64) std::atomic<uint64_t> consumed;   // slots the receiver has emptied, ever
  alignas(64) int64_t len[kShmSlots];           // bytes in each slot (written before published)

  static size_t mapped_bytes() { return kHeaderBytes + static_cast<size_t>(kShmSlots * kShmSlotBytes); }
  char* slot(uint64_t index) {
    return reinterpret_cast<char*>(this) + kHeaderBytes + (index % kShmSlots) * static_cast<uint64_t>(kShmSlotBytes);
  }
};
static_assert(sizeof(ShmChannel) <= ShmChannel::kHeaderBytes, "the header must fit before the slots");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory counters must be lock-free");

namespace {

ShmChannel* map_channel(int fd, const std::string& name) {
  void* p = mmap(nullptr, ShmChannel::mapped_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  MXDDP_CHECK(p != MAP_FAILED, "shm ring: mmap of {} ({} bytes) failed: {}", name, ShmChannel::mapped_bytes(),
              std::strerror(errno));
  return static_cast<ShmChannel*>(p);
}

std::string channel_name(const std::string& prefix, int rank) { return "/" + prefix + "-" + std::to_string(rank); }

}  // namespace

ShmRingTransport::ShmRingTransport(std::string own_name, int rank, int size, int64_t timeout_ms)
    : own_name_(std::move(own_name)), rank_(rank), size_(size), timeout_ms_(timeout_ms) {}

std::unique_ptr<ShmRingTransport> ShmRingTransport::create(const std::string& name_prefix, int rank, int size,
                                                           int64_t timeout_ms) {
  MXDDP_CHECK(size >= 2 && rank >= 0 && rank < size, "shm ring: rank {} of size {} is not valid", rank, size);
  MXDDP_CHECK(!name_prefix.empty() && name_prefix.find('/') == std::string::npos,
              "shm ring: name prefix '{}' must be non-empty and hold no '/'", name_prefix);
  MXDDP_CHECK(timeout_ms > 0, "shm ring: timeout_ms {} must be positive", timeout_ms);
  std::unique_ptr<ShmRingTransport> t(new ShmRingTransport(channel_name(name_prefix, rank), rank, size, timeout_ms));
  const int fd = shm_open(t->own_name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  MXDDP_CHECK(fd >= 0, "shm ring: shm_open({}) failed: {}", t->own_name_, std::strerror(errno));
  t->own_linked_ = true;
  const bool sized = ftruncate(fd, static_cast<off_t>(ShmChannel::mapped_bytes())) == 0;
  const int saved = errno;
  if (!sized) {
    close(fd);
    MXDDP_FAIL("shm ring: sizing {} to {} bytes failed: {}", t->own_name_, ShmChannel::mapped_bytes(),
               std::strerror(saved));
  }
  ShmChannel* c = nullptr;
  try {
    c = map_channel(fd, t->own_name_);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  c->magic = ShmChannel::kMagic;
  c->slot_bytes = static_cast<uint64_t>(kShmSlotBytes);
  c->slots = kShmSlots;
  new (&c->published) std::atomic<uint64_t>(0);
  new (&c->consumed) std::atomic<uint64_t>(0);
  t->out_ = c;
  return t;
}

bool ShmRingTransport::connect(std::string& why) {
  const std::string name = own_name_.substr(0, own_name_.rfind('-') + 1) + std::to_string((rank_ - 1 + size_) % size_);
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    why = fmt::format("shm_open({}) failed: {}", name, std::strerror(errno));
    return false;
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != ShmChannel::mapped_bytes()) {
    why = fmt::format("{} holds {} bytes, not a channel's {}", name, static_cast<int64_t>(st.st_size),
                      ShmChannel::mapped_bytes());
    close(fd);
    return false;
  }
  ShmChannel* c = map_channel(fd, name);
  close(fd);
  if (c->magic != ShmChannel::kMagic || c->slot_bytes != static_cast<uint64_t>(kShmSlotBytes) ||
      c->slots != static_cast<uint64_t>(kShmSlots)) {
    munmap(c, ShmChannel::mapped_bytes());
    why = fmt::format("{} is not an mxddp shm ring channel of this build", name);
    return false;
  }
  in_ = c;
  return true;
}

void ShmRingTransport::unlink_own() {
  if (own_linked_) shm_unlink(own_name_.c_str());
  own_linked_ = false;
}

ShmRingTransport::~ShmRingTransport() {
  unlink_own();
  if (out_ != nullptr) munmap(out_, ShmChannel::mapped_bytes());
  if (in_ != nullptr) munmap(in_, ShmChannel::mapped_bytes());
}

ShmRingTransport::Request ShmRingTransport::isend(const void* data, int64_t bytes, int peer) {
  MXDDP_CHECK(peer == (rank_ + 1) % size_ && bytes >= 0, "shm ring: rank {} sends only to its right neighbour {}; "
              "got a send of {} bytes to rank {}", rank_, (rank_ + 1) % size_, bytes, peer);
  MXDDP_CHECK(out_ != nullptr && in_ != nullptr, "shm ring: used before connect()");
  sends_.push_back({const_cast<char*>(static_cast<const char*>(data)), bytes, 0});
  Request r{1, sends_posted_++};
  progress();
  return r;
}

ShmRingTransport::Request ShmRingTransport::irecv(void* data, int64_t bytes, int peer) {
  return post_recv(data, bytes, peer, false);
}

ShmRingTransport::Request ShmRingTransport::irecv_sum(float* data, int64_t numel, int peer) {
  MXDDP_CHECK(numel >= 0 && numel <= INT64_MAX / 4, "shm ring: a summing receive of {} floats is not valid", numel);
  return post_recv(data, numel * 4, peer, true);
}

ShmRingTransport::Request ShmRingTransport::post_recv(void* data, int64_t bytes, int peer, bool sum) {
  MXDDP_CHECK(peer == (rank_ - 1 + size_) % size_ && bytes >= 0, "shm ring: rank {} receives only from its left "
              "neighbour {}; got a receive of {} bytes from rank {}", rank_, (rank_ - 1 + size_) % size_, bytes, peer);
  MXDDP_CHECK(out_ != nullptr && in_ != nullptr, "shm ring: used before connect()");
  recvs_.push_back({static_cast<char*>(data), bytes, 0, sum});
  return Request{2, recvs_posted_++};
}

// Operations complete in the order they were posted, per direction. An empty one moves nothing
// and completes when it reaches the front of its queue (the peer's matching one does alike).
bool ShmRingTransport::complete(const Request& r) const {
  if (r.kind == 1) return r.id < sends_completed_;
  if (r.kind == 2) return r.id < recvs_completed_;
  return true;
}

bool ShmRingTransport::progress() {
  bool moved = false;
  while (!sends_.empty()) {
    Op& op = sends_.front();
    if (op.done == op.bytes) {
      sends_.pop_front();
      ++sends_completed_;
      moved = true;
      continue;
    }
    const uint64_t published = out_->published.load(std::memory_order_relaxed);  // only this end writes it
    if (published - out_->consumed.load(std::memory_order_acquire) >= static_cast<uint64_t>(kShmSlots)) break;
    const int64_t n = std::min(kShmSlotBytes, op.bytes - op.done);
    std::memcpy(out_->slot(published), op.data + op.done, static_cast<size_t>(n));
    out_->len[published % kShmSlots] = n;
    out_->published.store(published + 1, std::memory_order_release);
    op.done += n;
    moved = true;
  }
  while (!recvs_.empty()) {
    Op& op = recvs_.front();
    if (op.done == op.bytes) {
      recvs_.pop_front();
      ++recvs_completed_;
      moved = true;
      continue;
    }
    const uint64_t consumed = in_->consumed.load(std::memory_order_relaxed);  // only this end writes it
    if (consumed == in_->published.load(std::memory_order_acquire)) break;
    const int64_t n = in_->len[consumed % kShmSlots];
    MXDDP_CHECK(n > 0 && n <= op.bytes - op.done && (!op.sum || n % 4 == 0), "shm ring: rank {} got a piece of {} bytes from rank {} where {} "
                "of a {}-byte message remained: the ranks' ring schedules differ (a bug in mxddp)", rank_, n,
                (rank_ - 1 + size_) % size_, op.bytes - op.done, op.bytes);
    if (op.sum) {  // n is a whole number of floats: both ends cut the message at the same slot size
      auto* mine = reinterpret_cast<float*>(op.data + op.done);
      const void* inputs[2] = {mine, in_->slot(consumed)};
      reduce_arrays(DType::kF32, ReduceOp::kSum, inputs, 2, n / 4, mine);
    } else {
      std::memcpy(op.data + op.done, in_->slot(consumed), static_cast<size_t>(n));
    }
    in_->consumed.store(consumed + 1, std::memory_order_release);
    op.done += n;
    moved = true;
  }
  return moved;
}

void ShmRingTransport::wait(Request& r) {
  using Clock = std::chrono::steady_clock;
  auto last_progress = Clock::now();
  int idle_polls = 0;
  while (!complete(r)) {
    if (progress()) {
      last_progress = Clock::now();
      idle_polls = 0;
      continue;
    }
    // Spin a little (the peer is usually mid-copy), then sleep a quarter of the idle time so far,
    // 10 us to 1 ms, so that a rank waiting for a late peer leaves the core to the peer.
    if (++idle_polls < 64) {
      std::this_thread::yield();
      continue;
    }
    const auto idle = Clock::now() - last_progress;
    if (idle > std::chrono::milliseconds(timeout_ms_)) {
      const bool sending = r.kind == 1;
      MXDDP_FAIL("shm ring: rank {} made no progress for {} ms (timeout_ms) {} rank {}: it stopped, or is stuck "
                 "before this collective", rank_, timeout_ms_, sending ? "sending to" : "receiving from",
                 sending ? (rank_ + 1) % size_ : (rank_ - 1 + size_) % size_);
    }
    const auto nap = std::clamp<Clock::duration>(idle / 4, std::chrono::microseconds(10), std::chrono::milliseconds(1));
    std::this_thread::sleep_for(nap);
  }
  r = Request{};
}

}  // namespace mxddp
