#!/usr/bin/env python3
"""The weight-gradient kernels of gradient_accumulation_fusion against the hook path, per dtype pair
(docs/python.md, "gradient_accumulation_fusion"; not a test).

For the weights of an HF GPT-2 (hidden C, tokens T = micro-batch x seq) it times, one thread, what
each path does per weight and backward:

  hook   dW = dy^T x in the params' dtype (a new tensor), then main_grad.add_(dW) (main_grad in the
         grad buffer's dtype), as the post-accumulate-grad hook
  fused  main_grad.addmm_(dy^T, x): one GEMM with beta 1; when main_grad's dtype is not the params'
         (BF16 params, F32 grad buffer) dy and x are cast to it first, as grad_fusion.py would

for params/main_grad F32/F32, BF16/BF16 and BF16/F32, and the embedding's row scatter (hook: torch's
dense embedding backward, a [V, C] tensor, then the add; fused: index_add_ into main_grad). Medians of
--repeats calls after one warm-up, milliseconds.

    python bench/grad_fusion_kernels.py --hidden 384 --tokens 512
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from proc_stats import cpu_model, loadavg_1m  # this folder

VOCAB = 50257


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def linear_paths(tokens: int, n_in: int, n_out: int, param: torch.dtype, grad: torch.dtype, repeats: int):
    g = torch.Generator().manual_seed(0)
    dy = torch.randn(tokens, n_out, generator=g).to(param)
    x = torch.randn(tokens, n_in, generator=g).to(param)
    main_grad = torch.zeros(n_out, n_in, dtype=grad)

    def hook():
        main_grad.add_(dy.t().mm(x))

    def fused():
        if grad == param:
            main_grad.addmm_(dy.t(), x)
        else:
            main_grad.addmm_(dy.t().to(grad), x.to(grad))

    return median_ms(hook, repeats), median_ms(fused, repeats)


def embedding_paths(tokens: int, dim: int, param: torch.dtype, grad: torch.dtype, repeats: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (tokens,), generator=g)
    dy = torch.randn(tokens, dim, generator=g).to(param)
    main_grad = torch.zeros(VOCAB, dim, dtype=grad)

    def hook():
        main_grad.add_(torch.ops.aten.embedding_dense_backward(dy, ids, VOCAB, -1, False))

    def fused():
        main_grad.index_add_(0, ids, dy.to(grad))

    return median_ms(hook, repeats), median_ms(fused, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--tokens", type=int, default=512, help="micro-batch x seq")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    c, t = args.hidden, args.tokens
    print(f"# {cpu_model()}, {os.cpu_count()} cores ({platform.machine()}), 1 thread, torch {torch.__version__}, "
          f"kernel {platform.release()}, load {loadavg_1m():.1f}; hidden {c}, tokens {t}; ms, medians of {args.repeats}")
    shapes = {"attn qkv [3C, C]": (c, 3 * c), "mlp fc [4C, C]": (c, 4 * c), "lm head [V, C]": (c, VOCAB)}
    print(f"{'weight':18} {'params/main_grad':16} {'hook_ms':>8} {'fused_ms':>8} {'fused/hook':>10}")
    for param, grad in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                        (torch.bfloat16, torch.float32)):
        pair = f"{str(param)[6:]}/{str(grad)[6:]}"
        for name, (n_in, n_out) in shapes.items():
            hook, fused = linear_paths(t, n_in, n_out, param, grad, args.repeats)
            print(f"{name:18} {pair:16} {hook:8.2f} {fused:8.2f} {fused / hook:10.2f}", flush=True)
        hook, fused = embedding_paths(t, c, param, grad, args.repeats)
        print(f"{'embedding [V, C]':18} {pair:16} {hook:8.2f} {fused:8.2f} {fused / hook:10.2f}", flush=True)


if __name__ == "__main__":
    main()
