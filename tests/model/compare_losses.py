#!/usr/bin/python3
"""Compares the training losses of two `mxddp train` reports over the iterations both ran:
a run resumed at another data-parallel size must read the same samples as the uninterrupted one,
so its losses must match (within the float reduction-order difference of another dp).

    compare_losses.py FULL_REPORT RESUMED_REPORT TOLERANCE
Prints "losses equal: N iterations (largest difference D)" or exits non-zero naming the first
iteration that differs.
"""
import json
import sys


def losses(path):
    return {s["iteration"]: s["loss"] for s in json.load(open(path))["steps"]}


full, resumed, tolerance = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
common = sorted(set(full) & set(resumed))
if not common:
    sys.exit(f"no common iterations: {sorted(full)} and {sorted(resumed)}")
worst = 0.0
for it in common:
    diff = abs(full[it] - resumed[it])
    if diff > tolerance:
        sys.exit(f"iteration {it}: loss {full[it]} uninterrupted, {resumed[it]} resumed (difference {diff} > {tolerance})")
    worst = max(worst, diff)
print(f"losses equal: {len(common)} iterations (largest difference {worst:.3g})")
