#!/usr/bin/env python3
"""Tables and plots of bench/multihost_sweep.sh's results against the ring model of each link.

Ring model, n ranks, link rate B (bytes/s, each direction), latency a: a collective of S bytes
takes busfactor * S / B + steps * a (all_reduce: busfactor 2(n-1)/n, 2(n-1) steps; reduce_scatter
and all_gather: (n-1)/n, n-1 steps), so its busbw can reach B. A training step can hide its
communication when the model's time for the step's collectives (gradient reduce-scatter in f32,
bf16 param all-gathers: once for DDP, in forward and in backward for FSDP) is below its compute
(forward + backward).

    multihost_plot.py DIR    writes DIR/summary.md, DIR/busbw.png, DIR/exposed.png
"""
import glob
import json
import os
import re
import statistics
import sys

RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate):
    """tc's rate text (10gbit) in bits per second; None for an unshaped link."""
    if rate == "none":
        return None
    m = re.fullmatch(r"([0-9.]+)(kbit|mbit|gbit)", rate)
    if not m:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit or gbit")
    return float(m.group(1)) * RATE_UNITS[m.group(2)]


def split_tag(path, prefix):
    """comm_10gbit_0us.json -> ('10gbit', 0); train_10gbit_0us_ddp.json -> ('10gbit', 0, 'ddp')."""
    base = os.path.basename(path)[len(prefix):-len(".json")]
    rate, lat, *rest = base.split("_", 2)
    return (rate, int(lat[:-2]), *rest)


def params_of(out_path):
    with open(out_path) as f:
        m = re.search(r"([0-9.]+)M params", f.read())
    return float(m.group(1)) * 1e6 if m else None


def main(out_dir):
    comm, train = [], []
    for path in glob.glob(os.path.join(out_dir, "comm_*.json")):
        rate, lat = split_tag(path, "comm_")
        with open(path) as f:
            doc = json.load(f)
        for row in doc["rows"]:
            comm.append({"rate": rate, "lat": lat, **row})
    for path in glob.glob(os.path.join(out_dir, "train_*.json")):
        rate, lat, case = split_tag(path, "train_")
        with open(path) as f:
            doc = json.load(f)
        steps = [s for s in doc["steps"] if s["iteration"] >= 3]
        if not steps:
            continue
        med = lambda k: statistics.median(s[k] for s in steps)  # noqa: E731
        params = params_of(path[:-len(".json")] + ".out")
        n = doc["config"]["dp"]
        fsdp = case.startswith("fsdp")
        wire_bytes = params * (4 + (2 * 2 if fsdp else 2)) * (n - 1) / n
        bits = rate_bits(rate)
        model_ms = wire_bytes * 8 / bits * 1e3 if bits else None
        train.append({"rate": rate, "lat": lat, "case": case, "n": n,
                      "exposed_share": statistics.median(s["exposed_comm_ms"] / s["step_ms"] for s in steps),
                      "step_ms": med("step_ms"), "compute_ms": med("forward_ms") + med("backward_ms"),
                      "model_comm_ms": model_ms})
    order = lambda r: (r["lat"], rate_bits(r["rate"]) or float("inf"))  # noqa: E731
    comm.sort(key=order)
    train.sort(key=lambda r: (order(r), r["case"]))

    lines = ["| link | latency | op | size | busbw GB/s | link GB/s | busbw / link |", "|---|---|---|---|---|---|---|"]
    for r in comm:
        bits = rate_bits(r["rate"])
        link = bits / 8e9 if bits else None
        lines.append(f"| {r['rate']} | {r['lat']} us | {r['op']} | {r['size_bytes'] >> 20} MiB | {r['busbw_GBps']:.3f} | "
                     f"{link:.3f} | {r['busbw_GBps'] / link:.2f} |" if link else
                     f"| {r['rate']} | {r['lat']} us | {r['op']} | {r['size_bytes'] >> 20} MiB | {r['busbw_GBps']:.3f} | - | - |")
    lines += ["", "| link | latency | case | step ms | compute ms | model comm ms | hideable | exposed share |",
              "|---|---|---|---|---|---|---|---|"]
    for r in train:
        model = f"{r['model_comm_ms']:.1f}" if r["model_comm_ms"] is not None else "-"
        hide = ("yes" if r["model_comm_ms"] <= r["compute_ms"] else "no") if r["model_comm_ms"] is not None else "-"
        lines.append(f"| {r['rate']} | {r['lat']} us | {r['case']} | {r['step_ms']:.0f} | {r['compute_ms']:.0f} | {model} | "
                     f"{hide} | {100 * r['exposed_share']:.1f}% |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text)
    print(text)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shaped = sorted({r["rate"] for r in comm if rate_bits(r["rate"])}, key=rate_bits)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [rate_bits(x) / 1e9 for x in shaped]
    ax.plot(xs, [x / 8 for x in xs], "k--", label="ring model (busbw = link rate)")
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        ys = [next((r["busbw_GBps"] for r in comm if r["rate"] == x and r["op"] == op), None) for x in shaped]
        ax.plot(xs, ys, "o-", label=op)
    for r in comm:
        if rate_bits(r["rate"]) is None and r["op"] == "all_reduce":
            ax.axhline(r["busbw_GBps"], color="gray", lw=0.8, label="unshaped veth (all_reduce)")
    ax.set_xscale("log"); ax.set_yscale("log")
    ax.set_xticks(xs, [f"{x:g}" for x in xs]); ax.minorticks_off()
    ax.set_xlabel("link rate (Gbit/s)"); ax.set_ylabel("busbw (GB/s)")
    ax.set_title("2 hosts x 1 rank, 16 MiB, OpenMPI TCP over veth")
    ax.legend(fontsize=8); fig.tight_layout(); fig.savefig(os.path.join(out_dir, "busbw.png"), dpi=110)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for case in sorted({r["case"] for r in train}):
        rows = [r for r in train if r["case"] == case and rate_bits(r["rate"])]
        ax.plot([rate_bits(r["rate"]) / 1e9 for r in rows], [100 * r["exposed_share"] for r in rows], "o-", label=case)
    ax.axhline(10, color="k", ls="--", lw=0.8, label="10% target")
    ax.set_xscale("log"); ax.set_xticks(xs, [f"{x:g}" for x in xs]); ax.minorticks_off()
    ax.set_xlabel("link rate (Gbit/s)"); ax.set_ylabel("exposed communication (% of step)")
    ax.set_title("mxddp train, 2 hosts x 1 rank, overlap on")
    ax.legend(fontsize=8); fig.tight_layout(); fig.savefig(os.path.join(out_dir, "exposed.png"), dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
