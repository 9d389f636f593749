#!/usr/bin/python3
"""Draws a training run of `mxddp train` as PNGs.

Reads either the metrics file (`--metrics-file`, one JSON object per line, written as training
goes: it can be drawn while the run is going or after a crash) or the end report (`--report`,
one JSON object), and writes into OUT_DIR:

  loss.png       training loss and validation loss against the iteration, learning rate on a
                 second axis
  step_time.png  each iteration's time split into forward, backward, exposed communication,
                 optimizer and the rest
  memory.png     each rank's steady-state peak bytes by category (when the input has them: the
                 report always, the metrics file once the run has ended)

    python3 scripts/plot_metrics.py run.jsonl --out plots/
    python3 scripts/plot_metrics.py report.json --out plots/

It needs matplotlib (Debian: python3-matplotlib). It prints each file it wrote.
"""
import argparse
import json
import os
import sys


def load(path):
    """(iterations, validations, memory) from a metrics file or a report; memory is
    [(rank, {category: peak bytes})]."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        report = json.loads(text)
    except json.JSONDecodeError:
        report = None
    if isinstance(report, dict) and "steps" in report:
        iters = [dict(s, lm_loss=s["loss"], learning_rate=s["lr"]) for s in report["steps"]]
        vals = [dict(v, lm_loss=v["loss"]) for v in report.get("validation", [])]
        memory = [(m["rank"], m["steady_state"]) for m in report.get("memory", [])]
        return iters, vals, memory
    iters, vals, memory = [], [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # A run killed mid-write leaves at most its last line cut short.
            print(f"{path}:{number}: not a JSON line (cut short?), skipped", file=sys.stderr)
            continue
        kind = record.get("type")
        if kind == "iteration":
            iters.append(record)
        elif kind == "validation":
            vals.append(record)
        elif kind == "memory":
            memory.append((record["rank"], record["steady_state"]))
    return iters, vals, memory


def plot_loss(plt, iters, vals, out):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["iteration"] for r in iters], [r["lm_loss"] for r in iters], label="training loss", lw=1)
    if vals:
        ax.plot([v["iteration"] for v in vals], [v["lm_loss"] for v in vals], "o-", label="validation loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats)")
    lr_ax = ax.twinx()
    lr_ax.plot([r["iteration"] for r in iters], [r["learning_rate"] for r in iters], color="gray", ls="--", lw=1,
               label="learning rate")
    lr_ax.set_ylabel("learning rate")
    lines = ax.get_legend_handles_labels()
    lr_lines = lr_ax.get_legend_handles_labels()
    ax.legend(lines[0] + lr_lines[0], lines[1] + lr_lines[1], loc="upper right")
    ax.set_title("loss and learning rate")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_step_time(plt, iters, out):
    x = [r["iteration"] for r in iters]
    parts = [("forward_ms", "forward"), ("backward_ms", "backward"), ("exposed_comm_ms", "exposed comm"),
             ("optimizer_ms", "optimizer")]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(iters)
    for key, label in parts:
        values = [r.get(key, 0.0) for r in iters]
        ax.bar(x, values, bottom=bottom, label=label, width=1.0)
        bottom = [b + v for b, v in zip(bottom, values)]
    rest = [max(0.0, r["step_ms"] - b) for r, b in zip(iters, bottom)]
    ax.bar(x, rest, bottom=bottom, label="rest", width=1.0, color="lightgray")
    ax.set_xlabel("iteration")
    ax.set_ylabel("ms (rank 0)")
    ax.set_title("step time")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_memory(plt, memory, out):
    categories = [c for c in memory[0][1] if c != "total" and any(m[c]["peak_bytes"] > 0 for _, m in memory)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(memory)
    for i, (rank, usage) in enumerate(memory):
        ax.bar([k + i * width for k in range(len(categories))], [usage[c]["peak_bytes"] / 2**20 for c in categories],
               width=width, label=f"rank {rank}")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(categories))])
    ax.set_xticklabels(categories, rotation=20)
    ax.set_ylabel("steady-state peak (MiB)")
    ax.set_title("memory by category")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="a --metrics-file (JSON lines) or a --report (JSON)")
    parser.add_argument("--out", required=True, help="directory for the PNGs (created if missing)")
    args = parser.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_metrics: matplotlib is not installed (Debian: apt install python3-matplotlib)")
    try:
        iters, vals, memory = load(args.input)
    except OSError as e:
        sys.exit(f"plot_metrics: cannot read {args.input}: {e.strerror}")
    if not iters:
        sys.exit(f"plot_metrics: {args.input} holds no iterations (neither a metrics file nor a report?)")
    os.makedirs(args.out, exist_ok=True)
    written = [os.path.join(args.out, "loss.png"), os.path.join(args.out, "step_time.png")]
    plot_loss(plt, iters, vals, written[0])
    plot_step_time(plt, iters, written[1])
    if memory:
        written.append(os.path.join(args.out, "memory.png"))
        plot_memory(plt, memory, written[2])
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
