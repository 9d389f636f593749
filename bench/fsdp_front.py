#!/usr/bin/python3
"""Draws the memory/time front of `fsdp_bench sweep` (issue 12) as a PNG.

Each run is a point: x = step time (ms, median), y = peak gathered bytes per rank (KiB). One
panel per injected latency; colour = gather granularity (unit / fine-grained), marker = params
(bf16 / mxfp8), fill = recompute (none filled, full hollow, selective crossed). The runs on the
Pareto front (no other run of that panel is both faster and smaller) are joined by a line.

Needs matplotlib (Debian: apt-get install python3-matplotlib). Usage:
    build/release/bench/fsdp_bench sweep --json fsdp_sweep.json
    python3 bench/fsdp_front.py fsdp_sweep.json docs/fsdp_front.png
"""
import json
import sys


def pareto(points):
    """The points no other point beats on both step time and bytes, by step time."""
    front = []
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if not front or p[1] < front[-1][1]:
            front.append(p)
    return front


def main(argv):
    if len(argv) != 3:
        sys.exit(__doc__)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.load(open(argv[1]))
    runs = [r for r in doc["runs"] if "refused" not in r]
    if not runs:
        sys.exit(f"{argv[1]} holds no completed runs")
    latencies = sorted({r["latency_us"] for r in runs})
    fig, axes = plt.subplots(1, len(latencies), figsize=(5.2 * len(latencies), 4.6), squeeze=False)
    colours = {"unit": "tab:blue", "fine": "tab:orange"}
    markers = {"bf16": "o", "mxfp8": "s"}
    fills = {"none": "full", "full": "none", "selective": "cross"}
    for ax, latency in zip(axes[0], latencies):
        here = [r for r in runs if r["latency_us"] == latency]
        for r in here:
            x, y = r["step_ms"], r["peak_gathered_bytes"] / 1024
            face = colours[r["gather"]] if fills[r["recompute"]] == "full" else "none"
            ax.scatter(x, y, s=46, marker=markers[r["params"]], facecolors=face, edgecolors=colours[r["gather"]],
                       linewidths=1.4, hatch="xx" if fills[r["recompute"]] == "cross" else None)
            ax.annotate(str(r["prefetch"])[0], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        front = pareto([(r["step_ms"], r["peak_gathered_bytes"] / 1024) for r in here])
        ax.plot([p[0] for p in front], [p[1] for p in front], color="grey", linewidth=1, zorder=0)
        ax.set_title(f"latency {latency} us per collective")
        ax.set_xlabel("step time, ms (median)")
        ax.set_ylabel("peak gathered per rank, KiB")
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=c, marker="o", linestyle="", label=g) for g, c in colours.items()]
    handles += [plt.Line2D([], [], color="black", marker=m, linestyle="", markerfacecolor="none", label=p)
                for p, m in markers.items()]
    handles += [plt.Line2D([], [], color="grey", label="front")]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), frameon=False)
    fig.suptitle(f"FSDP param gather, {doc['preset']} dp {doc['dp']} ({doc['cpu']}); label: prefetch units "
                 "(u = unbounded); filled: no recompute, hollow: full, hatched: selective mlp", fontsize=8, y=0.02)
    fig.tight_layout(rect=(0, 0.05, 1, 0.92))
    fig.savefig(argv[2], dpi=110)
    print(f"wrote {argv[2]}: {len(runs)} runs, {len(latencies)} latencies")


if __name__ == "__main__":
    main(sys.argv)
