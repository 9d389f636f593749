// mxddp_link_wire: one simulated host's network link with a fixed one-way delay, for the multihost
// harness (scripts/multihost, docs/multihost.md). The harness uses it for link latency because
// tc's netem, the usual tool, is missing from some kernels (this project's CI machine among them).
//
// The link is a pair of TAP devices: HOST_DEV inside the host's network namespace and SWITCH_DEV
// inside the switch's (the bridge's). Every frame one device transmits is received on the other
// DELAY_NS later, in order. A frame that would overflow a direction's queue (QUEUE_BYTES) is
// dropped, as a full NIC queue drops it. Bandwidth and loss stay with tc on either device's
// egress, exactly as on the harness's veth links.
//
// Frames cross with their virtio-net header (IFF_VNET_HDR), and both devices offer checksum and
// TCP segmentation offload. TCP therefore moves segments of up to 64 KiB through the wire, not
// 1500-byte frames: a few thousand wakeups a second at the benchmark's link rates instead of a
// hundred thousand, on a machine whose cores also run the ranks.
//
// Threads: one per direction (see DelayLine). The delay is constant, so the queue's head is always
// the next frame due. The timer slack is set to 1 ns: Linux's default 50 us would be a latency
// floor of its own.
//
// The process runs until it is signalled (the harness's teardown kills it with everything else in
// its namespaces); the devices vanish with it.

#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <fmt/core.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

// The largest frame a TAP device with TSO hands to userspace: a 64 KiB GSO segment, its headers
// and the virtio-net header. Reads use a buffer of this size, so no frame is ever truncated.
constexpr size_t kFrameBytesMax = 128 * 1024;
constexpr int64_t kDelayNsMax = 1'000'000'000;  // 1 s: far beyond any data-centre link
constexpr int64_t kQueueBytesMin = 2 * kFrameBytesMax;
constexpr int64_t kQueueBytesMax = int64_t{1} << 30;

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

std::string errno_text() { return std::strerror(errno); }

int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

// Enters a network namespace: NAME is one of `ip netns`'s (/run/netns/NAME) or a path to a
// namespace file (/proc/PID/ns/net).
void enter_netns(const std::string& netns) {
  const std::string path = netns.find('/') == std::string::npos ? "/run/netns/" + netns : netns;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(fmt::format("network namespace '{}' ({}): {}", netns, path, errno_text()));
  const int rc = setns(fd, CLONE_NEWNET);
  const int setns_errno = errno;
  close(fd);
  if (rc != 0) fail(fmt::format("entering network namespace '{}': {}", netns, std::strerror(setns_errno)));
}

// A TAP device NAME in the current network namespace, with the virtio-net header and TSO/checksum
// offload; returns its file descriptor (the device lives as long as it is open), non-blocking: a
// reader drains it until EAGAIN, and a TAP device's writes never wait anyway.
int open_tap(const std::string& name) {
  if (name.empty() || name.size() >= IFNAMSIZ)
    fail(fmt::format("device name '{}': 1 to {} characters", name, IFNAMSIZ - 1));
  const int fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(fmt::format("/dev/net/tun: {} (needs CONFIG_TUN and CAP_NET_ADMIN)", errno_text()));
  ifreq ifr{};
  ifr.ifr_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
  std::memcpy(ifr.ifr_name, name.data(), name.size());
  if (ioctl(fd, TUNSETIFF, &ifr) != 0) fail(fmt::format("creating TAP device '{}': {}", name, errno_text()));
  if (ioctl(fd, TUNSETOFFLOAD, static_cast<unsigned long>(TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)) != 0)
    fail(fmt::format("offloads on TAP device '{}': {}", name, errno_text()));
  return fd;
}

struct Frame {
  std::vector<std::byte> bytes;  // [virtio-net header + Ethernet frame]
  int64_t due_ns = 0;
};

// One direction of the link, one thread: frames in the order they were sent, each written DELAY_NS
// after it was read. The thread waits in ppoll() for the next frame or the head's due time,
// whichever comes first: one wakeup per frame, no hand-off between threads (with a reader and a
// writer thread a frame took about 45 us to cross on a 2-core VM, with one 26 us).
class DelayLine {
 public:
  DelayLine(int from_fd, int to_fd, int64_t delay_ns, int64_t queue_bytes_max)
      : from_fd_(from_fd), to_fd_(to_fd), delay_ns_(delay_ns), queue_bytes_max_(queue_bytes_max) {}

  void start() { thread_ = std::thread([this] { run(); }); }
  void join() { thread_.join(); }

 private:
  [[noreturn]] void run() {
    std::vector<std::byte> buffer(kFrameBytesMax);
    pollfd readable{.fd = from_fd_, .events = POLLIN, .revents = 0};
    for (;;) {
      int64_t now_ns = monotonic_ns();
      while (!frames_.empty() && frames_.front().due_ns <= now_ns) deliver_head();
      timespec wait{};
      if (!frames_.empty()) {
        const int64_t wait_ns = frames_.front().due_ns - now_ns;
        wait = {.tv_sec = wait_ns / 1'000'000'000, .tv_nsec = wait_ns % 1'000'000'000};
      }
      const int rc = ppoll(&readable, 1, frames_.empty() ? nullptr : &wait, nullptr);
      if (rc < 0 && errno != EINTR) die(fmt::format("waiting for a frame: {}", errno_text()));
      if (rc <= 0 || !(readable.revents & POLLIN)) continue;
      // Everything the device holds now, stamped with one time.
      now_ns = monotonic_ns();
      for (;;) {
        const ssize_t n = read(from_fd_, buffer.data(), buffer.size());
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) break;
        if (n < 0) die(fmt::format("reading a frame: {}", errno_text()));  // the device is gone, the link with it
        if (queued_bytes_ + n > queue_bytes_max_) continue;  // a full queue drops the newest frame, as a NIC's does
        queued_bytes_ += n;
        frames_.push_back({std::vector<std::byte>(buffer.begin(), buffer.begin() + n), now_ns + delay_ns_});
        if (delay_ns_ == 0) deliver_head();
      }
    }
  }

  void deliver_head() {
    const Frame& frame = frames_.front();
    // A device that is down (a link taken down by a fault test) refuses the frame: it is lost, as
    // on a cable that was pulled.
    while (write(to_fd_, frame.bytes.data(), frame.bytes.size()) < 0 && errno == EINTR) {
    }
    queued_bytes_ -= static_cast<int64_t>(frame.bytes.size());
    frames_.pop_front();
  }

  [[noreturn]] static void die(const std::string& what) {
    fmt::print(stderr, "mxddp_link_wire: {}\n", what);
    _exit(1);
  }

  const int from_fd_, to_fd_;
  const int64_t delay_ns_, queue_bytes_max_;
  std::deque<Frame> frames_;
  int64_t queued_bytes_ = 0;
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mxddp_link_wire: a simulated host's link with a one-way delay (scripts/multihost)"};
  std::string host_netns, host_dev = "eth0", switch_netns, switch_dev;
  int64_t delay_ns = 0, queue_bytes = 16 << 20;
  app.add_option("--host-netns", host_netns, "the host's network namespace (an `ip netns` name or a path)")->required();
  app.add_option("--host-dev", host_dev, "the TAP device made in the host's namespace");
  app.add_option("--switch-netns", switch_netns, "the switch's network namespace")->required();
  app.add_option("--switch-dev", switch_dev, "the TAP device made in the switch's namespace")->required();
  app.add_option("--delay-ns", delay_ns, "one-way delay of each direction, ns")
      ->check(CLI::Range(int64_t{0}, kDelayNsMax));
  app.add_option("--queue-bytes", queue_bytes, "frames held per direction before new ones are dropped, bytes")
      ->check(CLI::Range(kQueueBytesMin, kQueueBytesMax));
  CLI11_PARSE(app, argc, argv);
  try {
    if (prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL) != 0) fail(fmt::format("PR_SET_TIMERSLACK: {}", errno_text()));
    enter_netns(host_netns);
    const int host_fd = open_tap(host_dev);
    // The process stays in the switch's namespace, so the harness's teardown (which ends every
    // process in its namespaces) ends it too.
    enter_netns(switch_netns);
    const int switch_fd = open_tap(switch_dev);
    DelayLine outbound(host_fd, switch_fd, delay_ns, queue_bytes);
    DelayLine inbound(switch_fd, host_fd, delay_ns, queue_bytes);
    outbound.start();
    inbound.start();
    outbound.join();  // never returns: the loops end only with the process
    inbound.join();
  } catch (const std::exception& e) {
    fmt::print(stderr, "mxddp_link_wire: {}\n", e.what());
    return 1;
  }
  return 0;
}
