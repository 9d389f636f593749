"""Writes one value (nan, inf or -inf) over element INDEX of tensor NAME in a safetensors file, in
place, for the --load-hf tests of non-finite weights (tests/model/data_hardening.cmake). The
Python standard library only: the CTest suite runs it without torch.

usage: poison_safetensors.py FILE NAME INDEX VALUE
"""
import json
import math
import struct
import sys

path, name, index, text = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
value = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[text]
with open(path, "r+b") as f:
    (header_bytes,) = struct.unpack("<Q", f.read(8))
    entry = json.loads(f.read(header_bytes))[name]
    # F32 as is; BF16 is the top half of the F32; F16 by struct's half-precision format.
    encoded = {"F32": struct.pack("<f", value), "BF16": struct.pack("<f", value)[2:],
               "F16": struct.pack("<e", value)}[entry["dtype"]]
    begin, end = entry["data_offsets"]
    assert 0 <= index < (end - begin) // len(encoded), f"{name} has no element {index}"
    f.seek(8 + header_bytes + begin + index * len(encoded))
    f.write(encoded)
print(f"{name}[{index}] = {text}")
