#!/usr/bin/env python3
"""torch.optim.AdamW(fused=True) on the same F32 shard as cuda_kernels_bench's AdamW (param, grad,
two moments of --numel elements each, on cuda:0): the peer issue 41's AdamW figure is compared with.
Median of --runs timed steps (CUDA events) after one warm-up; prints "torch_fused_adamw_ms <ms>"."""
import argparse
import statistics

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--numel", type=int, default=1 << 28)
    p.add_argument("--runs", type=int, default=10)
    args = p.parse_args()
    param = torch.nn.Parameter(torch.zeros(args.numel, device="cuda"))
    param.grad = torch.zeros_like(param)
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.1, fused=True)
    opt.step()  # allocates the moments; the warm-up
    times = []
    for _ in range(args.runs):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    print(f"torch_fused_adamw_ms {statistics.median(times):.4f} numel {args.numel} ({torch.__version__}, "
          f"{torch.cuda.get_device_name(0)})")


if __name__ == "__main__":
    main()
