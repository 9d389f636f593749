"""Checks that `mxddp plan --json` equals `mxddp train --report`'s memory, for every rank, category and
figure (live, steady-state peak, overall peak) and the FSDP gather peaks. Prints the first difference
and exits 1; prints "plan equals report: N ranks x M figures" otherwise.

Usage: plan_vs_report.py REPORT.json PLAN.json
"""
import json
import sys


def main() -> int:
    report = json.load(open(sys.argv[1]))
    plan = json.load(open(sys.argv[2]))
    per_rank = plan["per_rank"]
    figures = 0
    for rank in report["memory"]:
        for category, planned in per_rank.items():
            for key, measured in (("live_bytes", rank["steady_state"][category]["live_bytes"]),
                                  ("steady_peak_bytes", rank["steady_state"][category]["peak_bytes"]),
                                  ("overall_peak_bytes", rank["overall"][category]["peak_bytes"])):
                if planned[key] != measured:
                    print(f"rank {rank['rank']} {category} {key}: plan {planned[key]}, report {measured}")
                    return 1
                figures += 1
        if rank["peak_gathered_bytes_by_orientation"] != plan["peak_gathered_bytes_by_slot"]:
            print(f"rank {rank['rank']} peak gathered: plan {plan['peak_gathered_bytes_by_slot']}, "
                  f"report {rank['peak_gathered_bytes_by_orientation']}")
            return 1
    print(f"plan equals report: {len(report['memory'])} ranks x {figures // len(report['memory'])} figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
