#!/usr/bin/python3
"""Writes a Megatron indexed dataset (PREFIX.bin + PREFIX.idx, megatron-core's MMIDIDX format)
from a text file, for `mxddp train --data-path PREFIX` (docs/data.md).

Each document is one line of the input (empty lines are skipped), or, with --paragraphs, a run of
lines ended by an empty line. Its tokens are either

  bytes  (default) the UTF-8 bytes of the document: ids 0..255, the vocabulary mxddp's text uses;
  ids    whitespace-separated integer token ids (text tokenized elsewhere, any vocabulary).

--append-eod ID adds an end-of-document token to each document (e.g. 256 with --vocab-size 257,
or 50256 for GPT-2's "<|endoftext|>"). One sequence per document, as Megatron's
preprocess_data.py writes without --split-sentences.

    python3 scripts/make_indexed_dataset.py README.md /tmp/readme           # bytes, uint16
    python3 scripts/make_indexed_dataset.py ids.txt /tmp/ids --tokens ids --dtype int32

Only the Python standard library is needed. The two files are written to temporary names and
renamed into place, the .idx last, so a reader never sees a half-written pair.
"""
import argparse
import array
import os
import struct
import sys

# megatron-core's DType codes: (code, array typecode, smallest id, largest id).
DTYPES = {
    "uint8": (1, "B", 0, 255),
    "int8": (2, "b", -128, 127),
    "int16": (3, "h", -32768, 32767),
    "int32": (4, "i", -(2**31), 2**31 - 1),
    "int64": (5, "q", -(2**63), 2**63 - 1),
    "uint16": (8, "H", 0, 65535),
}
MAGIC = b"MMIDIDX\x00\x00"


def documents(path, paragraphs):
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    if not paragraphs:
        return [line for line in lines if line.strip()]
    docs, current = [], []
    for line in lines:
        if line.strip():
            current.append(line)
        elif current:
            docs.append(b"\n".join(current))
            current = []
    if current:
        docs.append(b"\n".join(current))
    return docs


def tokens_of(doc, kind, line_number):
    if kind == "bytes":
        return list(doc)
    try:
        return [int(t) for t in doc.split()]
    except ValueError:
        sys.exit(f"document {line_number}: not whitespace-separated integer ids (--tokens ids)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="text file")
    p.add_argument("prefix", help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokens", choices=["bytes", "ids"], default="bytes")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="uint16")
    p.add_argument("--append-eod", type=int, default=None, metavar="ID")
    p.add_argument("--paragraphs", action="store_true", help="documents end at empty lines (default: one per line)")
    a = p.parse_args()
    code, typecode, low, high = DTYPES[a.dtype]
    width = array.array(typecode).itemsize
    lengths, pointers = [], []
    data = array.array(typecode)
    for n, doc in enumerate(documents(a.input, a.paragraphs)):
        ids = tokens_of(doc, a.tokens, n)
        if a.append_eod is not None:
            ids.append(a.append_eod)
        bad = [t for t in ids if t < low or t > high]
        if bad:
            sys.exit(f"document {n}: token id {bad[0]} does not fit --dtype {a.dtype} ({low}..{high})")
        if len(ids) >= 2**31:
            sys.exit(f"document {n}: {len(ids)} tokens; a sequence holds at most 2^31 - 1")
        pointers.append(len(data) * width)
        lengths.append(len(ids))
        data.extend(ids)
    if not lengths:
        sys.exit(f"'{a.input}' has no documents")
    if sys.byteorder != "little":
        data.byteswap()
    count = len(lengths)
    idx = bytearray(MAGIC)
    idx += struct.pack("<Q", 1)  # version
    idx += struct.pack("<B", code)
    idx += struct.pack("<Q", count)  # sequences
    idx += struct.pack("<Q", count + 1)  # document indices: one per document, and the end
    idx += struct.pack(f"<{count}i", *lengths)
    idx += struct.pack(f"<{count}q", *pointers)
    idx += struct.pack(f"<{count + 1}q", *range(count + 1))
    for suffix, payload in ((".bin", data.tobytes()), (".idx", bytes(idx))):
        tmp = a.prefix + suffix + ".tmp"
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, a.prefix + suffix)
    print(f"wrote {a.prefix}.bin and {a.prefix}.idx: {count} documents, {len(data)} tokens ({a.dtype})")


if __name__ == "__main__":
    main()
