"""UDP round trips between two simulated hosts (tests/multihost/latency.sh).

  udp_rtt.py echo PORT SECONDS        answers every datagram on PORT for SECONDS, then exits
  udp_rtt.py ping ADDR PORT COUNT     sends COUNT datagrams one at a time, prints the median round
                                      trip in microseconds; exits 1 if an answer takes over 2 s
"""
import socket
import statistics
import sys
import time


def echo(port: int, seconds: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data, peer = sock.recvfrom(2048)
        except TimeoutError:
            break
        sock.sendto(data, peer)


def ping(addr: str, port: int, count: int) -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(2.0)
    rtts_us = []
    for i in range(count):
        start = time.perf_counter_ns()
        sock.sendto(i.to_bytes(8, "little"), (addr, port))
        try:
            while int.from_bytes(sock.recv(2048), "little") != i:  # a late answer to an earlier one
                pass
        except TimeoutError:
            print(f"udp_rtt: no answer to datagram {i} from {addr}:{port} within 2 s", file=sys.stderr)
            return 1
        rtts_us.append((time.perf_counter_ns() - start) / 1000)
    print(f"{statistics.median(rtts_us):.0f}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["echo"] and len(sys.argv) == 4:
        echo(int(sys.argv[2]), float(sys.argv[3]))
    elif sys.argv[1:2] == ["ping"] and len(sys.argv) == 5:
        sys.exit(ping(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    else:
        sys.exit(__doc__)
