"""Checks that two record_run.py loss lists are equal within a tolerance, element by element, and long
enough to cover the run; prints the largest difference.

usage: compare_losses.py TORCH_JSON MXDDP_JSON MIN_COUNT TOLERANCE
"""
import json
import sys

reference, candidate = (json.load(open(p)) for p in sys.argv[1:3])
min_count, tolerance = int(sys.argv[3]), float(sys.argv[4])
if len(reference) != len(candidate) or len(reference) < min_count:
    sys.exit(f"FAIL: {len(reference)} losses from torch DDP and {len(candidate)} from mxddp; expected the same "
             f"count, at least {min_count}")
worst = max(range(len(reference)), key=lambda i: abs(reference[i] - candidate[i]))
difference = abs(reference[worst] - candidate[worst])
print(f"{len(reference)} losses; largest difference {difference:.3g} at #{worst} "
      f"(torch {reference[worst]:.8f}, mxddp {candidate[worst]:.8f}); last torch {reference[-1]:.8f} "
      f"mxddp {candidate[-1]:.8f}")
if not difference <= tolerance:
    sys.exit(f"FAIL: losses differ by {difference:.3g} > {tolerance}")
