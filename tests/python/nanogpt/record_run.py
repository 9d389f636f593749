"""Runs a nanoGPT train.py (this folder's copy, or its mxddp port) as torchrun started it, and records
the losses it computes: every float the script itself reads with ``Tensor.item()`` (the training loss it
logs, the evaluation losses), on rank 0, in order, at full precision (train.py prints them rounded to
four decimals). The script is not changed: only ``torch.Tensor.item`` is wrapped, and only calls made
from the script's own lines are recorded (a library's internal ``.item()`` differs between torch DDP
and mxddp and would misalign the two lists).

usage (under torchrun, from a folder holding configurator.py and data/<dataset>/):
    record_run.py LOSSES_JSON TRAIN_SCRIPT [--key=value ...]
"""
import json
import os
import runpy
import sys

import torch

losses_path, script = sys.argv[1], os.path.abspath(sys.argv[2])
recorded: list[float] = []
original_item = torch.Tensor.item


def item(self):
    value = original_item(self)
    if sys._getframe(1).f_code.co_filename == script:
        recorded.append(float(value))
    return value


torch.Tensor.item = item
sys.argv = [script] + sys.argv[3:]
sys.path.insert(0, os.path.dirname(script))  # train.py imports model.py from its own folder
try:
    runpy.run_path(script, run_name="__main__")
finally:
    if int(os.environ.get("RANK", "0")) == 0:
        with open(losses_path, "w") as f:
            json.dump(recorded, f)
