#!/usr/bin/env python3
"""Tables and plots of bench/multihost_sweep.sh's results against the ring model of each link.

Ring model, n ranks, link rate B (bytes/s, each direction), one-way latency a: a collective of S
bytes takes busfactor * S / B + steps * a (all_reduce: busfactor 2(n-1)/n, 2(n-1) steps;
reduce_scatter and all_gather: (n-1)/n, n-1 steps), so its busbw can reach
busfactor * S / (busfactor * S / B + steps * a): B on a link without latency. a is the link's
measured one-way latency (half the UDP round trip that bench/multihost_rtt.sh measured, the
delaying wire's own cost included). A training step can hide its communication when the model's
time for the step's collectives (gradient reduce-scatter in f32, param all-gathers in the params'
dtype: once for DDP, in forward and in backward for FSDP) is below its compute (forward + backward).

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
    """comm_10gbit_veth.json -> ('10gbit', 'veth'); train_1gbit_100_ddp.json -> ('1gbit', '100', 'ddp')."""
    base = os.path.basename(path)[len(prefix):-len(".json")]
    rate, lat, *rest = base.split("_", 2)
    return (rate, lat, *rest)


def latency_label(lat):
    return "veth" if lat == "veth" else f"{lat} us"


def rtt_us(out_dir, rate, lat):
    """The link's measured UDP round trip (rtt_TAG.txt), or None."""
    try:
        with open(os.path.join(out_dir, f"rtt_{rate}_{lat}.txt")) as f:
            m = re.search(r"rtt_us ([0-9.]+)", f.read())
    except FileNotFoundError:
        return None
    return float(m.group(1)) if m else None


def model_busbw_GBps(op, n, size, bits, one_way_s):
    """The ring model's busbw of one collective (GB/s)."""
    factor, steps = (2 * (n - 1) / n, 2 * (n - 1)) if op == "all_reduce" else ((n - 1) / n, n - 1)
    seconds = factor * size * 8 / bits + steps * one_way_s
    return factor * size / seconds / 1e9


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
        rtt = rtt_us(out_dir, rate, lat)
        for row in doc["rows"]:
            comm.append({"rate": rate, "lat": lat, "rtt_us": rtt, **row})
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
        # Gradients reduce-scatter in f32; params gather in their own dtype (bf16 with --bf16).
        param_bytes = 2 if doc["config"].get("bf16") else 4
        wire_bytes = params * (4 + (2 * param_bytes if fsdp else param_bytes)) * (n - 1) / n
        bits = rate_bits(rate)
        model_ms = wire_bytes * 8 / bits * 1e3 if bits else None
        train.append({"rate": rate, "lat": lat, "case": case, "n": n, "rtt_us": rtt_us(out_dir, rate, lat),
                      "exposed_share": statistics.median(s["exposed_comm_ms"] / s["step_ms"] for s in steps),
                      "step_ms": med("step_ms"), "compute_ms": med("forward_ms") + med("backward_ms"),
                      "model_comm_ms": model_ms})
    order = lambda r: (r["lat"] != "veth", int(r["lat"]) if r["lat"] != "veth" else 0,  # noqa: E731
                       rate_bits(r["rate"]) or float("inf"))
    comm.sort(key=order)
    train.sort(key=lambda r: (order(r), r["case"]))

    lines = ["| link | latency | round trip | op | size | busbw GB/s | link GB/s | busbw / link | model GB/s | busbw / model |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in comm:
        bits = rate_bits(r["rate"])
        rtt = f"{r['rtt_us']:.0f} us" if r["rtt_us"] is not None else "-"
        head = f"| {r['rate']} | {latency_label(r['lat'])} | {rtt} | {r['op']} | {r['size_bytes'] >> 20} MiB | {r['busbw_GBps']:.3f} |"
        if bits:
            model = model_busbw_GBps(r["op"], r["ranks"], r["size_bytes"], bits, (r["rtt_us"] or 0) / 2e6)
            r["model_GBps"] = model
            lines.append(f"{head} {bits / 8e9:.3f} | {r['busbw_GBps'] * 8e9 / bits:.2f} | {model:.3f} | "
                         f"{r['busbw_GBps'] / model:.2f} |")
        else:
            lines.append(f"{head} - | - | - | - |")
    lines += ["", "| link | latency | round trip | case | step ms | compute ms | model comm ms | hideable | exposed share |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in train:
        model = f"{r['model_comm_ms']:.1f}" if r["model_comm_ms"] is not None else "-"
        hide = ("yes" if r["model_comm_ms"] <= r["compute_ms"] else "no") if r["model_comm_ms"] is not None else "-"
        rtt = f"{r['rtt_us']:.0f} us" if r["rtt_us"] is not None else "-"
        lines.append(f"| {r['rate']} | {latency_label(r['lat'])} | {rtt} | {r['case']} | {r['step_ms']:.0f} | "
                     f"{r['compute_ms']:.0f} | {model} | {hide} | {100 * r['exposed_share']:.1f}% |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text)
    print(text)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = ("all_reduce", "reduce_scatter", "all_gather")
    veth_rates = sorted({r["rate"] for r in comm if r["lat"] == "veth" and rate_bits(r["rate"])}, key=rate_bits)
    wire_rates = sorted({r["rate"] for r in comm if r["lat"] != "veth" and rate_bits(r["rate"])}, key=rate_bits)
    lats = sorted({int(r["lat"]) for r in comm if r["lat"] != "veth"})

    # busbw: against the link rate on veth links (left), against the latency on wires (right).
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [rate_bits(x) / 1e9 for x in veth_rates]
    left.plot(xs, [x / 8 for x in xs], "k--", label="ring model (busbw = link rate)")
    for op in ops:
        ys = [next((r["busbw_GBps"] for r in comm if r["lat"] == "veth" and r["rate"] == x and r["op"] == op), None)
              for x in veth_rates]
        left.plot(xs, ys, "o-", label=op)
    for r in comm:
        if r["lat"] == "veth" and rate_bits(r["rate"]) is None and r["op"] == "all_reduce":
            left.axhline(r["busbw_GBps"], color="gray", lw=0.8, label="unshaped veth (all_reduce)")
    left.set_xscale("log"); left.set_yscale("log")
    if xs:
        left.set_xticks(xs, [f"{x:g}" for x in xs])
    left.minorticks_off()
    left.set_xlabel("link rate (Gbit/s)"); left.set_ylabel("busbw (GB/s)")
    left.set_title("veth links, 2 hosts x 1 rank, 16 MiB")
    left.legend(fontsize=7)
    for rate in wire_rates:
        for op in ops:
            rows = sorted((r for r in comm if r["lat"] != "veth" and r["rate"] == rate and r["op"] == op and "model_GBps" in r),
                          key=lambda r: int(r["lat"]))
            right.plot([int(r["lat"]) for r in rows], [r["busbw_GBps"] * 8e9 / rate_bits(rate) for r in rows], "o-",
                       label=f"{op}, {rate}")
        rows = sorted((r for r in comm if r["lat"] != "veth" and r["rate"] == rate and r["op"] == "all_reduce"
                       and "model_GBps" in r), key=lambda r: int(r["lat"]))
        right.plot([int(r["lat"]) for r in rows], [r["model_GBps"] * 8e9 / rate_bits(rate) for r in rows], "k--", lw=0.8)
    right.axhline(0.8, color="r", ls=":", lw=0.8, label="0.8 of the link")
    right.set_xscale("log")
    if lats:
        right.set_xticks(lats, [str(x) for x in lats])
    right.minorticks_off()
    right.set_ylim(0, 1.1)
    right.set_xlabel("one-way latency added (us; delaying wires)"); right.set_ylabel("busbw / link rate")
    right.set_title("wires: busbw / link rate (dashed: ring model)")
    right.legend(fontsize=7)
    fig.tight_layout(); fig.savefig(os.path.join(out_dir, "busbw.png"), dpi=110)

    # Exposed communication: against the rate on veth links (left), against the latency (right).
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for case in sorted({r["case"] for r in train}):
        rows = [r for r in train if r["case"] == case and r["lat"] == "veth" and rate_bits(r["rate"])]
        left.plot([rate_bits(r["rate"]) / 1e9 for r in rows], [100 * r["exposed_share"] for r in rows], "o-", label=case)
        for rate in wire_rates:
            rows = sorted((r for r in train if r["case"] == case and r["lat"] != "veth" and r["rate"] == rate),
                          key=lambda r: int(r["lat"]))
            right.plot([int(r["lat"]) for r in rows], [100 * r["exposed_share"] for r in rows], "o-", label=f"{case}, {rate}")
    for ax in (left, right):
        ax.axhline(10, color="k", ls="--", lw=0.8, label="10% target")
        ax.set_xscale("log"); ax.minorticks_off()
        ax.set_ylabel("exposed communication (% of step)")
        ax.legend(fontsize=7)
    if xs:
        left.set_xticks(xs, [f"{x:g}" for x in xs])
    if lats:
        right.set_xticks(lats, [str(x) for x in lats])
    left.set_xlabel("link rate (Gbit/s)"); left.set_title("mxddp train, veth links, overlap on")
    right.set_xlabel("one-way latency added (us; delaying wires)"); right.set_title("mxddp train, wires, overlap on")
    fig.tight_layout(); fig.savefig(os.path.join(out_dir, "exposed.png"), dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
