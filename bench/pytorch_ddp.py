#!/usr/bin/env python3
"""PyTorch DDP beside mxddp on the same GPT shape, threads and machine (issue 10's comparison).

Optional: it needs PyTorch (`python3 -m venv /work/venv-torch && /work/venv-torch/bin/pip install
torch`), is never a test, and CI never runs it. It trains mxddp's reference GPT shape (byte-level
vocabulary 256, learned position embeddings, pre-LayerNorm blocks with fused-qkv causal attention
and a tanh-GELU MLP, a final LayerNorm, an LM head tied to the token embedding) with
torch.nn.parallel.DistributedDataParallel over gloo, one process per rank (torch.multiprocessing),
`--threads` intra-op threads per rank, AdamW, one micro-batch per rank per step (as `mxddp train
--global-batch-size micro x dp` does). `--bf16` runs the forward under torch.autocast(bfloat16),
mxddp's side with --bf16. Then it runs `mxddp train --report` with the same settings and prints
both: median step time over the steps after the warm-up ones, and the whole job's peak memory
(the sum over the rank processes of each one's peak RSS; mxddp's ranks are threads of one process).

    /work/venv-torch/bin/python bench/pytorch_ddp.py --model small --micro-batch 8 --dp 2 --threads 1
"""
import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

PRESETS = {  # mxddp's gpt_preset(): layers, hidden, heads, seq
    "tiny": (2, 64, 4, 64),
    "small": (6, 384, 6, 256),
    "gpt2-124m": (12, 768, 12, 1024),
}
VOCAB = 256


def build_model(torch, layers, hidden, heads, seq):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)
            self.ln2 = nn.LayerNorm(hidden)
            self.fc1 = nn.Linear(hidden, 4 * hidden)
            self.fc2 = nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, hidden)
            self.wpe = nn.Embedding(seq, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.lnf = nn.LayerNorm(hidden)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            logits = self.lnf(x) @ self.wte.weight.t()  # the tied LM head
            return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))

    return Gpt()


def torch_rank(rank, args, port, out_queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.dp)
    layers, hidden, heads, seq = PRESETS[args.model]
    torch.manual_seed(1234)
    model = torch.nn.parallel.DistributedDataParallel(build_model(torch, layers, hidden, heads, seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(rank)
    step_s = []
    for _ in range(args.iters):
        tokens = torch.randint(0, VOCAB, (args.micro_batch, seq + 1), generator=gen)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        step_s.append(time.perf_counter() - t0)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out_queue.put((rank, step_s, peak_kib, str(torch.__version__)))  # plain types: the parent never imports torch
    dist.destroy_process_group()


def run_torch(args):
    import multiprocessing as mp  # the parent never imports torch: its memory is the ranks'

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=torch_rank, args=(r, args, port, queue)) for r in range(args.dp)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    rank0 = next(r for r in results if r[0] == 0)
    steps = rank0[1][args.warmup:]
    return {
        "step_s": statistics.median(steps),
        "peak_mib": sum(r[2] for r in results) / 1024,
        "version": rank0[3],
    }


def run_mxddp(args):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [args.mxddp, "train", "--model", args.model, "--ranks", str(args.dp),
               "--micro-batch-size", str(args.micro_batch), "--global-batch-size", str(args.micro_batch * args.dp),
               "--train-iters", str(args.iters), "--lr-warmup-iters", "1", "--eval-iters", "0",
               "--compute-threads", str(args.threads), "--corpus-bytes", str(1 << 22), "--report", report]
        if args.bf16:
            cmd.append("--bf16")
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed with {proc.returncode}")
        peak_kib = usage.ru_maxrss
        with open(report) as f:
            r = json.load(f)
    steps = [s["step_ms"] / 1e3 for s in r["steps"]][args.warmup:]
    return {"step_s": statistics.median(steps), "peak_mib": peak_kib / 1024, "compute": r["compute"]["summary"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=sorted(PRESETS))
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank, both sides")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="leading steps left out of the median")
    p.add_argument("--bf16", action="store_true", help="torch.autocast(bfloat16) vs mxddp --bf16")
    p.add_argument("--mxddp", default=os.path.join(os.path.dirname(__file__), "..", "build", "release", "mxddp"))
    p.add_argument("--skip-mxddp", action="store_true")
    args = p.parse_args()
    if args.iters <= args.warmup:
        sys.exit(f"--iters {args.iters} must exceed --warmup {args.warmup}")
    if importlib.util.find_spec("torch") is None:
        sys.exit("PyTorch is not installed here; see this script's docstring")

    # mxddp first, while this process is small: Linux carries a process's peak RSS across exec.
    mx = None if args.skip_mxddp else run_mxddp(args)
    torch_r = run_torch(args)
    print(f"{args.model}, micro-batch {args.micro_batch}, dp {args.dp}, {args.threads} thread(s) per rank, "
          f"{'bf16' if args.bf16 else 'f32'}; medians of steps {args.warmup + 1}..{args.iters}")
    print(f"{'':10} {'step_s':>8} {'peak_MiB':>9}")
    print(f"{'pytorch':10} {torch_r['step_s']:8.3f} {torch_r['peak_mib']:9.0f}   torch {torch_r['version']} DDP gloo"
          f"{', autocast bf16' if args.bf16 else ''}")
    if mx is None:
        return
    print(f"{'mxddp':10} {mx['step_s']:8.3f} {mx['peak_mib']:9.0f}   {mx['compute']}")
    print(f"mxddp / pytorch: step time {mx['step_s'] / torch_r['step_s']:.2f}x, "
          f"peak memory {mx['peak_mib'] / torch_r['peak_mib']:.2f}x")


if __name__ == "__main__":
    main()
