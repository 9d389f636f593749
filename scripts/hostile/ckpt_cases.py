# Part 1 of the campaign: damaged and crafted copies of a small checkpoint, each loaded twice.
#
# A case copies a checkpoint, damages the copy one way, then runs `mxddp ckpt inspect COPY` and a
# resume `mxddp train --load COPY`. A damaged copy must be refused by both (inspect may instead
# list the damage and exit non-zero); a copy of a different model is intact, so only the resume
# must refuse it; the controls (intact copies, other data-parallel sizes) must load. Either way
# the attempt must leave every file of the case byte-identical.
#
# Crafted edits of a rank file's safetensors header come with the manifest's crc32 and byte count
# recomputed, so they reach the header checks instead of stopping at the CRC; plain byte flips and
# truncations are left for the CRC to catch.
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import time
import zlib

import runner

MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
               "--micro-batch-size", "2", "--global-batch-size", "8", "--corpus-bytes", "65536", "--eval-iters", "0"]
RANK0 = "rank_00000.safetensors"
RANK1 = "rank_00001.safetensors"
MANIFEST = "manifest.json"
TRACKER = "latest_checkpointed_iteration.txt"
CHECKSUM_KEY = "manifest_crc32"  # version 2 manifests; absent from version 1
# Resealed edits of these fields make a self-consistent checkpoint that a save with other settings
# could have written (records of the saving run's settings), so a load may accept them.
FORGEABLE = ("metadata", "ddp", "layout", "data_parallel")

# The checkpoints made once: name -> (flag overrides, ranks). "base" is the one damaged; the
# others are intact checkpoints of other models (heads4 and heads8 have base's shapes) or of the
# same model saved at another data-parallel size.
SOURCES = {
    "base": ({}, 2),
    "heads4": ({"--num-attention-heads": "4"}, 2),
    "heads8": ({"--num-attention-heads": "8"}, 2),
    "layers3": ({"--num-layers": "3"}, 2),
    "seq64": ({"--seq-length": "64"}, 2),
    "hidden64": ({"--hidden-size": "64"}, 2),
    "sgd": ({"--optimizer": "sgd"}, 2),
    "dp1": ({}, 1),
    "dp4": ({}, 4),
}


def model_flags(overrides=None):
    flags = list(MODEL_FLAGS)
    for key, value in (overrides or {}).items():
        if key in flags:
            flags[flags.index(key) + 1] = value
        else:
            flags += [key, value]
    return flags


def make_sources(binary, root, timeout_s, mem_limit):
    """Each source's checkpoint directory (the newest of the --save history a run writes), and
    "history": the base run's whole history (tracker, iter_0000002) for the history cases."""
    paths = {}
    for name, (overrides, ranks) in SOURCES.items():
        path = os.path.join(root, "sources", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        argv = [binary, "train", "--ranks", str(ranks), "--train-iters", "2", *model_flags(overrides), "--save", path]
        result = runner.run(argv, root, max(timeout_s, 120), mem_limit)
        if result["rc"] != 0:
            raise SystemExit(f"making checkpoint {name} failed: {' '.join(argv)}\n{result['stderr']}")
        with open(os.path.join(path, TRACKER)) as f:
            paths[name] = os.path.join(path, "iter_%07d" % int(f.read().strip()))
        if name == "base":
            paths["history"] = path
    return paths


def resume_argv(binary, copy):
    return [binary, "train", "--ranks", "2", *MODEL_FLAGS, "--train-iters", "3", "--load", copy]


# ---- helpers that edit a copy ----

def read_manifest(ck):
    with open(os.path.join(ck, MANIFEST)) as f:
        return json.load(f)


def write_manifest(ck, manifest, reseal=False):
    """Writes in the saver's own format (indent 1, sorted keys), so an unedited manifest round-trips
    exactly. reseal: recompute "manifest_crc32" (the CRC-32 of the compact, key-sorted manifest
    without that key) as a forger who read the format would; otherwise a stale one stays."""
    if reseal and isinstance(manifest, dict) and CHECKSUM_KEY in manifest:
        manifest.pop(CHECKSUM_KEY)
        compact = json.dumps(manifest, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
        manifest[CHECKSUM_KEY] = zlib.crc32(compact.encode())
    text = json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False)
    write_bytes(os.path.join(ck, MANIFEST), text.encode())


def write_bytes(path, data):
    if os.path.lexists(path) and not os.path.isfile(path):
        remove(path)
    with open(path, "wb") as f:
        f.write(data)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def split_rank(data):
    n = struct.unpack("<Q", data[:8])[0]
    return n, data[8:8 + n], data[8 + n:]


def join_rank(header_bytes, payload, pad=True):
    if pad:
        header_bytes += b" " * (-(8 + len(header_bytes)) % 8)
    return struct.pack("<Q", len(header_bytes)) + header_bytes + payload


def fix_crc(ck, fname):
    """Recomputes the manifest's crc32 and byte count of fname, as a careful forger would."""
    manifest = read_manifest(ck)
    data = read_bytes(os.path.join(ck, fname))
    for entry in manifest["files"]:
        if entry["name"] == fname:
            entry["crc32"] = zlib.crc32(data)
            entry["bytes"] = len(data)
    write_manifest(ck, manifest, reseal=True)


def edit_rank_header(fname, edit, raw=False):
    """A builder that applies edit to the parsed header (or, raw, to its bytes), rewrites the rank
    file around the same payload and fixes the manifest's CRC."""
    def build(root, ck):
        path = os.path.join(ck, fname)
        _, header, payload = split_rank(read_bytes(path))
        if raw:
            new_header = edit(header)
        else:
            parsed = json.loads(header)
            edit(parsed)
            new_header = json.dumps(parsed, separators=(",", ":"), sort_keys=True).encode()
        write_bytes(path, join_rank(new_header, payload))
        fix_crc(ck, fname)
    return build


def rank_length_field(fname, value):
    def build(root, ck):
        path = os.path.join(ck, fname)
        data = read_bytes(path)
        write_bytes(path, struct.pack("<Q", value % (1 << 64)) + data[8:])
        fix_crc(ck, fname)
    return build


def manifest_leaves(node, path=()):
    """Every scalar in the manifest as (path, value)."""
    if isinstance(node, dict):
        for key in sorted(node):
            yield from manifest_leaves(node[key], path + (key,))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from manifest_leaves(item, path + (i,))
    else:
        yield path, node


def manifest_keys(node, path=()):
    """Every key as (path to its dict, key), once per key name per place (list indices as '*')."""
    seen = set()
    def walk(node, path, pattern):
        if isinstance(node, dict):
            for key in sorted(node):
                if (pattern, key) not in seen:
                    seen.add((pattern, key))
                    yield path, key
                yield from walk(node[key], path + (key,), pattern + (key,))
        elif isinstance(node, list):
            for i, item in enumerate(node):
                yield from walk(item, path + (i,), pattern + ("*",))
    yield from walk(node, path, ())


def get_at(node, path):
    for key in path:
        node = node[key]
    return node


def set_leaf(path, value):
    """An edit of the parsed manifest."""
    def edit(manifest):
        get_at(manifest, path[:-1])[path[-1]] = value
    return edit


def edit_manifest(edit, reseal=False):
    def build(root, ck):
        manifest = read_manifest(ck)
        edit(manifest)
        write_manifest(ck, manifest, reseal)
    return build


def resealed_expectation(path, value=None):
    """(inspect, train) expectations of a resealed edit at path: a record of the saving run's
    settings, or a step the run could have reached (0..3 of --train-iters 3), may be accepted; the
    model config is only checked by a load (inspect has no model); everything else is structure
    and must be refused by both."""
    if path == ("step",) and type(value) is int and 0 <= value <= 3:
        return "any", "any"
    if path and (path[0] in FORGEABLE or (path[0] == "optimizer" and path[1:] != ("optimizer",))):
        return "any", "any"
    if path and path[0] == "model_config":
        return "any", "fail"
    return "fail", "fail"


def raw_manifest(make):
    """make(original bytes) -> new bytes."""
    def build(root, ck):
        path = os.path.join(ck, MANIFEST)
        write_bytes(path, make(read_bytes(path)))
    return build


def changed(value):
    """A different value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 if value else 1.0
    if isinstance(value, str):
        return value + "x"
    return 0  # null


def path_name(path):
    return ".".join(str(p) for p in path)


class Case:
    def __init__(self, category, name, build, source="base", inspect="fail", train="fail", check=None):
        self.category = category
        self.name = name
        self.build = build
        self.source = source
        self.expect_inspect = inspect  # "fail", "ok" or "any"
        self.expect_train = train      # "fail", "ok" or "any"
        # Instead of inspect + resume: check(binary, case_root, ck, timeout_s, mem_limit) runs its own
        # commands and returns (verdict, first result, second result, files_changed).
        self.check = check


def generate(sources, rng):
    """Every case, in a fixed order for a given seed."""
    cases = []
    add = lambda *a, **k: cases.append(Case(*a, **k))

    def add_edit(category, label, edit, path=None, resealed=None, value=None):
        """The edit twice: as is (the manifest checksum must catch it) and resealed (the field
        checks must)."""
        add(category, label, edit_manifest(edit))
        inspect, train = resealed or resealed_expectation(path, value)
        add(category + "+resealed", label, edit_manifest(edit, reseal=True), inspect=inspect, train=train)
    nothing = lambda root, ck: None
    base = sources["base"]
    sizes = {f: os.path.getsize(os.path.join(base, f)) for f in (RANK0, RANK1)}
    headers = {f: split_rank(read_bytes(os.path.join(base, f)))[0] for f in (RANK0, RANK1)}
    base_manifest = read_manifest(base)

    # Controls: these must load.
    add("control", "intact copy", nothing, inspect="ok", train="ok")
    add("control", "manifest re-serialized unchanged", edit_manifest(lambda m: None), inspect="ok", train="ok")
    add("control", "manifest resealed unchanged", edit_manifest(lambda m: None, reseal=True), inspect="ok",
        train="ok")
    def only_old(root, ck):
        os.rename(ck, ck + ".old")
    add("control", "only ck.old left (a save killed between its renames)", only_old, inspect="ok", train="ok")
    add("control", "rank 0 header re-serialized, crc fixed", edit_rank_header(RANK0, lambda h: None),
        inspect="ok", train="ok")
    add("control", "saved at dp 1, resumed at dp 2", nothing, source="dp1", inspect="ok", train="ok")
    add("control", "saved at dp 4, resumed at dp 2", nothing, source="dp4", inspect="ok", train="ok")

    # Random byte flips, header region and data region separately, left for the CRC.
    def flip(fname, offsets):
        def build(root, ck):
            path = os.path.join(ck, fname)
            data = bytearray(read_bytes(path))
            for off, mask in offsets:
                data[off] ^= mask
            write_bytes(path, bytes(data))
        return build
    for fname in (RANK0, RANK1):
        for region, lo, hi in (("header", 0, 8 + headers[fname]), ("data", 8 + headers[fname], sizes[fname])):
            for _ in range(15):
                offsets = [(rng.randrange(lo, hi), rng.randrange(1, 256)) for _ in range(rng.randint(1, 3))]
                add(f"rank-flip-{region}", f"{fname} flip {offsets}", flip(fname, offsets))

    # Truncations and appended bytes.
    def truncate(fname, size):
        def build(root, ck):
            os.truncate(os.path.join(ck, fname), size)
        return build
    def append(fname, extra):
        def build(root, ck):
            path = os.path.join(ck, fname)
            with open(path, "ab") as f:
                f.write(extra if extra is not None else read_bytes(path))
        return build
    for fname in (RANK0, RANK1):
        n, size = headers[fname], sizes[fname]
        for cut in sorted({0, 4, 8, 8 + n // 2, 8 + n, 8 + n + 1, (8 + n + size) // 2, size - 1}):
            add("rank-truncate", f"{fname} truncated to {cut} of {size} bytes", truncate(fname, cut))
        for label, extra in (("1 byte", b"\0"), ("4096 bytes", bytes(4096)), ("a copy of itself", None)):
            add("rank-append", f"{fname} with {label} appended", append(fname, extra))

    # Crafted safetensors headers, CRC fixed.
    first = "exp_avg/decoder.final_layernorm.bias/0-32"  # rank 0's first tensor: F32 [32] at [128, 256]
    def first_key(h):
        return next(k for k in sorted(h) if k != "__metadata__")
    def tensor_edit(field, value):
        def edit(h):
            h[first_key(h)][field] = value
        return edit
    header_edits = []
    for value in ("F16", "BF16", "I32", "F64", "XX", "", 32):
        header_edits.append((f"dtype {value!r}", tensor_edit("dtype", value)))
    for value in ([33], [31], [], [-1], [0], [9223372036854775807], [18446744073709551616], ["32"], [4, 8]):
        header_edits.append((f"shape {value}", tensor_edit("shape", value)))
    for value in ([128, 260], [132, 260], [256, 128], [128, 10 ** 9], [0, 18446744073709551615], [-128, 256],
                  [128], [128, 256, 384], ["128", "256"], [128.0, 256.0], None):
        header_edits.append((f"data_offsets {value}", tensor_edit("data_offsets", value)))
    def rename_tensor(h):
        h[first_key(h) + "x"] = h.pop(first_key(h))
    def drop_tensor(h):
        del h[first_key(h)]
    def extra_tensor(h):
        h["bogus/extra.weight/0-32"] = dict(h[first_key(h)])
    def drop_meta(h):
        del h["__metadata__"]
    def meta(key, value):
        def edit(h):
            h["__metadata__"][key] = value
        return edit
    header_edits += [("tensor key renamed", rename_tensor), ("tensor removed", drop_tensor),
                     ("extra tensor aliasing another's bytes", extra_tensor),
                     ("__metadata__ removed", drop_meta), ("__metadata__ rank 0 -> 1", meta("rank", "1")),
                     ("__metadata__ format changed", meta("format", "safetensors")),
                     ("__metadata__ rank -> 99999999999999999999", meta("rank", "99999999999999999999"))]
    for label, edit in header_edits:
        add("rank-header-crafted", f"{RANK0} {label}", edit_rank_header(RANK0, edit))
    raw_edits = [
        ("duplicate tensor key", lambda h: h.replace(b'{"__metadata__"', b'{"' + first.encode() +
                                                     b'":{"data_offsets":[0,128],"dtype":"F32","shape":[32]},'
                                                     b'"__metadata__"', 1)),
        ("header '{'", lambda h: b"{"), ("header '[]'", lambda h: b"[]"), ("header 'null'", lambda h: b"null"),
        ("header random bytes", lambda h: bytes(rng.randrange(256) for _ in range(len(h)))),
        ("header padded with NULs", lambda h: h.rstrip(b" ") + b"\0" * 8),
        ("header with trailing garbage", lambda h: h.rstrip(b" ") + b"garbage!"),
        ("header nested 100000 deep", lambda h: b"[" * 100000 + b"]" * 100000),
        ("header of a huge number", lambda h: h.replace(b"[128,256]", b"[128,1" + b"0" * 400 + b"]", 1)),
        ("header with invalid UTF-8 in a key", lambda h: h.replace(b"exp_avg/", b"exp_\xff\xfe/", 1)),
    ]
    for label, edit in raw_edits:
        add("rank-header-crafted", f"{RANK0} {label}", edit_rank_header(RANK0, edit, raw=True))
    for label, edit in header_edits[::4]:
        add("rank-header-crafted", f"{RANK1} {label}", edit_rank_header(RANK1, edit))
    n0 = headers[RANK0]
    for value in (0, n0 - 1, n0 + 1, sizes[RANK0] - 8, sizes[RANK0], 1 << 63, (1 << 64) - 1):
        add("rank-header-length", f"{RANK0} header length field {value} (is {n0})", rank_length_field(RANK0, value))

    # Every scalar of the manifest changed.
    for path, value in manifest_leaves(base_manifest):
        new = changed(value)
        label = f"{path_name(path)}: {value!r} -> {new!r}"
        if path == (CHECKSUM_KEY,):
            add("manifest-scalar", label, edit_manifest(set_leaf(path, new)))
        else:
            add_edit("manifest-scalar", label, set_leaf(path, new), path, value=new)

    # Extreme values at the places that size things.
    extreme_paths = [("step",), ("dp",), ("version",), ("layout", "numel"), ("layout", "buckets", 0, 1),
                     ("files", 0, "bytes"), ("files", 0, "crc32"), ("params", 0, "shape", 0),
                     ("params", 0, "slices", 0, "start"), ("params", 0, "slices", 0, "end")]
    for path in extreme_paths:
        original = get_at(base_manifest, path)
        for value in (-1, 0, 9223372036854775807, 18446744073709551616, 1.5, "1", None, True):
            if type(value) is type(original) and value == original:
                continue  # not an edit
            add_edit("manifest-extreme", f"{path_name(path)} -> {value!r}", set_leaf(path, value), path, value=value)
        add("manifest-extreme", f"{path_name(path)} -> 1e400 (raw)",
            raw_manifest(lambda b, p=path: json.dumps(_set_copy(json.loads(b), p, 1234567890123), indent=1,
                                                      sort_keys=True).replace("1234567890123", "1e400").encode()))

    # Keys renamed and removed.
    for path, key in manifest_keys(base_manifest):
        def rename(m, path=path, key=key):
            d = get_at(m, path)
            d[key + "_renamed"] = d.pop(key)
        def drop(m, path=path, key=key):
            del get_at(m, path)[key]
        where = path_name(path + (key,))
        if path + (key,) == (CHECKSUM_KEY,):
            add("manifest-key", f"{where} renamed", edit_manifest(rename))
            add("manifest-key", f"{where} removed", edit_manifest(drop))
            continue
        add_edit("manifest-key", f"{where} renamed", rename, path + (key,))
        add_edit("manifest-key", f"{where} removed", drop, path + (key,))

    # The step and the iteration.
    step = base_manifest["step"]
    # A resealed step the run could have reached may be accepted; one it cannot, must not.
    for value in (step + 1, step - 1, 0, -1, 3, 9223372036854775807):
        expect = ("fail", "fail") if value < 0 or value > 3 else ("any", "any")
        add_edit("manifest-step", f"step {step} -> {value}", set_leaf(("step",), value), resealed=expect)
    for value in ("3", "1", "abc", "", "-1"):
        add_edit("manifest-step", f"metadata.iteration -> {value!r}", set_leaf(("metadata", "iteration"), value),
                 ("metadata",))
    def both(m):
        m["step"] = 1
        m["metadata"]["iteration"] = "1"
    add_edit("manifest-step", "step and iteration both 1 (consistent)", both, resealed=("any", "any"))

    # File names: escaping the directory, absolute, another rank's file, odd spellings. An outside
    # copy of the real rank file is put where each escaping name points, so a loader that follows
    # the name loads intact bytes and only a confinement check can refuse it.
    def names_case(new_name, scope, outside, reseal):
        def build(root, ck):
            if outside:
                target = os.path.join(root, outside)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(os.path.join(ck, RANK0), target)
            name = new_name.replace("{root}", root).replace("{ck}", ck)
            manifest = read_manifest(ck)
            if scope in ("files", "both"):
                for entry in manifest["files"]:
                    if entry["name"] == RANK0:
                        entry["name"] = name
            if scope in ("slices", "both"):
                for param in manifest["params"]:
                    for s in param["slices"]:
                        if s["file"] == RANK0:
                            s["file"] = name
            write_manifest(ck, manifest, reseal)
        return build
    hostile_names = [("../x/" + RANK0, "x/" + RANK0), ("{root}/outside/" + RANK0, "outside/" + RANK0),
                     ("{ck}/" + RANK0, None), (RANK1, None), ("./" + RANK0, None), (RANK0 + "/", None),
                     ("", None), ("/dev/zero", None), (MANIFEST, None), ("x/../" + RANK0, None),
                     (RANK0 + "\0.bak", None), ("sub/" + RANK0, "ck/sub/" + RANK0)]
    for name, outside in hostile_names:
        for scope in ("files", "slices", "both"):
            label = f"{RANK0} -> {name!r} in {scope}"
            add("manifest-filename", label, names_case(name, scope, outside, False))
            add("manifest-filename+resealed", label, names_case(name, scope, outside, True))

    # Shapes, order, dtypes and state names.
    def swap_shape(m):
        m["params"][0]["shape"] = list(reversed(m["params"][0]["shape"]))
    def swap_params(m):
        m["params"][0], m["params"][1] = m["params"][1], m["params"][0]
    def swap_layers(m):
        p = m["params"]
        i = next(k for k, q in enumerate(p) if q["name"].startswith("decoder.layers.1.input_layernorm.weight"))
        j = next(k for k, q in enumerate(p) if q["name"].startswith("decoder.layers.0.input_layernorm.weight"))
        p[i]["name"], p[j]["name"] = p[j]["name"], p[i]["name"]
    def drop_param(m):
        m["params"].pop()
    def dup_param(m):
        m["params"].append(json.loads(json.dumps(m["params"][-1])))
    def slice_edit(start=None, end=None):
        def edit(m):
            s = m["params"][0]["slices"][1]
            if start is not None:
                s["start"] = start
            if end is not None:
                s["end"] = end
        return edit
    def state_names(value):
        def edit(m):
            m["state_names"] = value
        return edit
    def buckets(value):
        def edit(m):
            m["layout"]["buckets"] = value
        return edit
    structural = [("params[0] shape reversed (same numel)", swap_shape), ("params 0 and 1 swapped", swap_params),
                  ("layer 0 and 1 input_layernorm names swapped", swap_layers), ("last param removed", drop_param),
                  ("last param duplicated", dup_param), ("slices overlap", slice_edit(start=4000)),
                  ("slices leave a gap", slice_edit(start=4100)), ("slice past the end", slice_edit(end=9000)),
                  ("slice reversed", slice_edit(start=8192, end=4096)),
                  ("state_names reversed", state_names(["exp_avg_sq", "exp_avg"])),
                  ("state_names short", state_names(["exp_avg"])),
                  ("state_names extra", state_names(["exp_avg", "exp_avg_sq", "x"])),
                  ("state_names empty", state_names([])),
                  ("layout buckets merged", buckets([[0, 35200]])), ("layout buckets empty", buckets([])),
                  ("optimizer sgd", set_leaf(("optimizer", "optimizer"), "sgd")),
                  ("model_dtype f32", set_leaf(("model_dtype",), "f32")),
                  ("model_dtype fp8", set_leaf(("model_dtype",), "fp8")),
                  ("format other", set_leaf(("format",), "other"))]
    # Which param comes first, its shape and the state order are the model's and the optimizer's:
    # only a load can compare them.
    model_dependent = {"params[0] shape reversed (same numel)", "params 0 and 1 swapped",
                       "layer 0 and 1 input_layernorm names swapped", "state_names reversed"}
    for label, edit in structural:
        if label.startswith("layout"):
            add_edit("manifest-structure", label, edit, ("layout",))
        else:
            add_edit("manifest-structure", label, edit,
                     resealed=("any", "fail") if label in model_dependent else ("fail", "fail"))
    add_edit("manifest-structure", "data_parallel fsdp", set_leaf(("data_parallel",), "fsdp"), ("data_parallel",))

    # Not JSON at all.
    invalid = [("truncated to 1 byte", lambda b: b[:1]), ("truncated to half", lambda b: b[:len(b) // 2]),
               ("last byte cut", lambda b: b[:-1]), ("'{'", lambda b: b"{"), ("'[]'", lambda b: b"[]"),
               ("'null'", lambda b: b"null"), ("'1'", lambda b: b"1"), ("trailing garbage", lambda b: b + b"x"),
               ("two objects", lambda b: b + b + b""), ("NUL in the middle", lambda b: b[:100] + b"\0" + b[101:]),
               ("invalid UTF-8 in a string", lambda b: b.replace(b"mxddp-checkpoint", b"mxddp-\xff\xfeeckpoint")),
               ("nested 100000 deep", lambda b: b"[" * 100000 + b"]" * 100000),
               ("nested 1000000 deep in a value", lambda b: re.sub(rb'"version": \d+', b'"version": ' + b"[" * 1000000
                                                                   + b"]" * 1000000, b)),
               ("duplicate key step", lambda b: b.replace(b'"step": 2', b'"step": 2,\n "step": 7')),
               ("a comment", lambda b: b"// c\n" + b), ("single quotes", lambda b: b.replace(b'"', b"'")),
               ("trailing comma", lambda b: b[:-1] + b",}"),
               ("10 MB string value", lambda b: b.replace(b'"seed": "1234"', b'"seed": "' + b"9" * 10_000_000 + b'"')),
               ("huge number literal", lambda b: b.replace(b'"step": 2', b'"step": 1' + b"0" * 100000))]
    for label, make in invalid:
        add("manifest-invalid-json", label, raw_manifest(make))
    # A UTF-8 byte-order mark before intact JSON is no damage; either answer is fine.
    add("manifest-invalid-json", "UTF-8 BOM before intact JSON", raw_manifest(lambda b: b"\xef\xbb\xbf" + b),
        inspect="any", train="any")
    add("manifest-empty", "empty manifest", raw_manifest(lambda b: b""))
    add("manifest-empty", "whitespace-only manifest", raw_manifest(lambda b: b"  \n"))
    add("rank-empty", f"empty {RANK0}", truncate(RANK0, 0))

    # Something else in place of a file.
    def replace_with(target, kind):
        def build(root, ck):
            path = os.path.join(ck, target)
            original = os.path.join(root, "original." + target)
            if os.path.lexists(path):
                shutil.move(path, original) if kind == "directory-holding-it" else remove(path)
            if kind == "fifo":
                os.mkfifo(path)
            elif kind == "directory":
                os.mkdir(path)
            elif kind == "directory-holding-it":
                os.mkdir(path)
                shutil.move(original, os.path.join(path, target))
            elif kind == "symlink-/dev/zero":
                os.symlink("/dev/zero", path)
            elif kind == "device-zero":
                runner.make_device(path, 1, 5, "/dev/zero")
            elif kind == "device-full":
                runner.make_device(path, 1, 7, "/dev/full")
            elif kind == "dangling-symlink":
                os.symlink(os.path.join(root, "nowhere"), path)
            elif kind == "symlink-loop":
                os.symlink(os.path.basename(path), path)
            elif kind == "symlink-other-rank":
                os.symlink(RANK1 if target != RANK1 else RANK0, path)
            elif kind == "symlink-directory":
                os.symlink(root, path)
        return build
    kinds = ["fifo", "directory", "directory-holding-it", "symlink-/dev/zero", "device-zero", "device-full",
             "dangling-symlink", "symlink-loop", "symlink-other-rank", "symlink-directory"]
    for target in (MANIFEST, RANK0, RANK1):
        for kind in kinds:
            add("special-file", f"{target} is a {kind}", replace_with(target, kind))
    def replace_dir(kind):
        def build(root, ck):
            shutil.rmtree(ck)
            if kind == "regular file":
                write_bytes(ck, b"not a checkpoint")
            elif kind == "fifo":
                os.mkfifo(ck)
            elif kind == "symlink to /dev/zero":
                os.symlink("/dev/zero", ck)
            elif kind == "device node":
                runner.make_device(ck, 1, 5, "/dev/zero")
            elif kind == "empty directory":
                os.mkdir(ck)
            elif kind == "dangling symlink":
                os.symlink(os.path.join(root, "nowhere"), ck)
        return build
    for kind in ("regular file", "fifo", "symlink to /dev/zero", "device node", "empty directory", "missing",
                 "dangling symlink"):
        add("special-dir", f"checkpoint directory is a {kind}", replace_dir(kind))

    # Missing and extra files.
    def drop_files(*names):
        def build(root, ck):
            for name in names:
                remove(os.path.join(ck, name))
        return build
    add("missing-file", "manifest.json missing", drop_files(MANIFEST))
    add("missing-file", f"{RANK0} missing", drop_files(RANK0))
    add("missing-file", f"{RANK1} missing", drop_files(RANK1))
    add("missing-file", "both rank files missing", drop_files(RANK0, RANK1))
    def extra_rank(list_it, dp=None):
        def build(root, ck):
            shutil.copyfile(os.path.join(ck, RANK1), os.path.join(ck, "rank_00002.safetensors"))
            if list_it or dp:
                manifest = read_manifest(ck)
                if list_it:
                    entry = dict(next(e for e in manifest["files"] if e["name"] == RANK1))
                    entry["name"] = "rank_00002.safetensors"
                    manifest["files"].append(entry)
                if dp:
                    manifest["dp"] = dp
                write_manifest(ck, manifest, reseal=True)
        return build
    add("extra-file", "extra rank_00002.safetensors (not in the manifest)", extra_rank(False))
    add("extra-file", "extra rank_00002.safetensors listed in files, dp still 2", extra_rank(True))
    add("extra-file", "extra rank_00002.safetensors listed in files, dp 3", extra_rank(True, 3))

    # Rank files mixed up or taken from another checkpoint.
    def swap_ranks(root, ck):
        a, b = os.path.join(ck, RANK0), os.path.join(ck, RANK1)
        tmp = os.path.join(root, "swap")
        os.rename(a, tmp)
        os.rename(b, a)
        os.rename(tmp, b)
    def foreign_rank(fix):
        def build(root, ck):
            shutil.copyfile(os.path.join(sources["heads4"], RANK0), os.path.join(ck, RANK0))
            if fix:
                fix_crc(ck, RANK0)
        return build
    add("mixed-files", "rank files 0 and 1 swapped", swap_ranks)
    add("mixed-files", "rank 0 file from the 4-head checkpoint", foreign_rank(False))
    add("mixed-files", "rank 0 file from the 4-head checkpoint, crc fixed", foreign_rank(True))
    def damaged_partial(root, ck):
        os.rename(ck, ck + ".partial")
        path = os.path.join(ck + ".partial", MANIFEST)
        write_bytes(path, read_bytes(path)[:-10])
    add("mixed-files", "only ck.partial left, its manifest cut short", damaged_partial)
    add("mixed-files", "manifest from the 4-head checkpoint",
        lambda root, ck: shutil.copyfile(os.path.join(sources["heads4"], MANIFEST), os.path.join(ck, MANIFEST)))

    # Intact checkpoints of other models: inspect may pass, the resume must refuse.
    for source, label in (("heads4", "4 heads (same shapes)"), ("heads8", "8 heads (same shapes)"),
                          ("layers3", "3 layers"), ("seq64", "seq 64"), ("hidden64", "hidden 64"),
                          ("sgd", "optimizer sgd")):
        add("other-model", f"checkpoint of {label} into the 2-head adam model", nothing, source=source,
            inspect="any", train="fail")
    cases += history_cases(sources)
    return cases


# ---- the history around checkpoints (issue 40 items 3, 9, 15) ----
# Each runs in a copy of the base run's history (ck: the tracker, iter_0000002) and says
# "detected" when mxddp held, "missed-by-<what>" when not.

CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _verdict(results, held, what):
    if any(r["crashed"] for r in results):
        return "crash"
    if any(r["timed_out"] for r in results):
        return "hang"
    return "detected" if held else "missed-by-" + what


def export_refused(source, out, *extra, prepare=None):
    """`ckpt export SOURCE --out OUT`: must fail with an error and leave every file as it was."""
    def check(binary, root, ck, timeout_s, mem_limit):
        if prepare:
            prepare(root, ck)
        before = runner.snapshot(root)
        r = runner.run([binary, "ckpt", "export", source, "--out", out(root, ck), *extra], root, timeout_s, mem_limit)
        diff = runner.snapshot_diff(before, runner.snapshot(root))
        return _verdict([r], r["rc"] != 0 and r["has_mxddp_error"] and not diff, "export"), r, r, diff
    return check


def history_cases(sources):
    cases = []
    add = lambda name, check: cases.append(Case("history", name, None, source="history", check=check))
    j = os.path.join
    other = sources["dp1"]  # a checkpoint of another run, exported into this history's files
    add("export over a checkpoint's manifest.json", export_refused(other, lambda root, ck: j(ck, "iter_0000002", MANIFEST)))
    add("export over a checkpoint's rank file", export_refused(other, lambda root, ck: j(ck, "iter_0000002", RANK1)))
    add("export over the history's tracker", export_refused(other, lambda root, ck: j(ck, TRACKER)))
    add("export into a checkpoint through a symbolic link", export_refused(
        other, lambda root, ck: j(root, "link", RANK0),
        prepare=lambda root, ck: os.symlink(j(ck, "iter_0000002"), j(root, "link"))))
    add("export into a checkpoint through missing/..", export_refused(
        other, lambda root, ck: j(root, "missing", "..", "ck", "iter_0000002", "x.safetensors")))
    add("export --format hf onto the history", export_refused(other, lambda root, ck: ck, "--format", "hf"))

    def foreign_config(root, ck):
        os.makedirs(j(root, "hf"))
        write_bytes(j(root, "hf", "config.json"), b'{"mine": 1}\n')
    for flag in ([], ["--overwrite"]):
        label = ", --overwrite" if flag else ""
        add("export --format hf over a directory with another config.json" + label, export_refused(
            other, lambda root, ck: j(root, "hf"), "--format", "hf", *flag, prepare=foreign_config))
        add("export over a file it did not write" + label, export_refused(
            other, lambda root, ck: j(root, "theirs.safetensors"), *flag,
            prepare=lambda root, ck: write_bytes(j(root, "theirs.safetensors"), b"theirs")))

    def escaped_tracker(binary, root, ck, timeout_s, mem_limit):
        write_bytes(j(ck, TRACKER), b"2\x1b]0;title\x07\x1b[31m" + b"9" * 40 + b"\n")
        runs = [runner.run([binary, "ckpt", "inspect", ck], root, timeout_s, mem_limit),
                runner.run(resume_argv(binary, ck), root, timeout_s, mem_limit)]
        held = all(r["rc"] != 0 and r["has_mxddp_error"] and not CONTROL_CHARS.search(r["stderr"]) for r in runs)
        return _verdict(runs, held, "escaping"), runs[0], runs[1], []
    add("tracker holding terminal escape sequences", escaped_tracker)

    def stale_partials(binary, root, ck, timeout_s, mem_limit):
        for it in (1, 3):  # saves killed half-way, of iterations this resume does not save
            os.makedirs(j(ck, "iter_%07d.partial" % it))
            write_bytes(j(ck, "iter_%07d.partial" % it, RANK0), b"half")
        r = runner.run([binary, "train", "--ranks", "2", *MODEL_FLAGS, "--train-iters", "4", "--save-interval", "2",
                        "--keep-last", "1", "--load", ck, "--save", ck], root, timeout_s, mem_limit)
        left = sorted(os.listdir(ck))
        held = r["rc"] == 0 and left == ["iter_0000004", TRACKER]
        return _verdict([r], held, "train"), r, r, [] if held else [f"left {left}"]
    add("stale iter_N.partial after a resume with --keep-last", stale_partials)

    def no_saves(binary, root, ck, timeout_s, mem_limit):
        shutil.rmtree(ck)
        os.makedirs(ck)
        write_bytes(j(ck, "mxddp.lock"), b"")  # a run killed before its first save
        r = runner.run([binary, "ckpt", "inspect", ck], root, timeout_s, mem_limit)
        held = r["rc"] != 0 and r["has_mxddp_error"] and ".partial" not in r["error_line"]
        return _verdict([r], held, "inspect"), r, r, []
    add("inspect of a history with no save yet", no_saves)

    def readers_during_saves(binary, root, ck, timeout_s, mem_limit, seconds=6):
        """ckpt inspect in a loop while a run saves every iteration with --keep-last 1."""
        writer = subprocess.Popen([binary, "train", "--ranks", "2", *MODEL_FLAGS, "--train-iters", "1000000",
                                   "--save-interval", "1", "--keep-last", "1", "--load", ck, "--save", ck],
                                  cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=runner.child_env(), start_new_session=True)
        def tracked():
            with open(j(ck, TRACKER), "rb") as f:
                return f.read()
        first = tracked()
        runs, bad = [], None
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end and writer.poll() is None:
                r = runner.run([binary, "ckpt", "inspect", ck], root, timeout_s, mem_limit)
                runs.append(r)
                if r["rc"] != 0 and bad is None:
                    bad = r
            writer_ran = writer.poll() is None  # it saved throughout, until stopped here
        finally:
            os.killpg(writer.pid, signal.SIGKILL)
            writer.wait()
        if not runs or not writer_ran or tracked() == first:
            raise RuntimeError(f"the writer did not save during the reads ({len(runs)} reads, exit {writer.returncode})")
        last = bad or runs[-1]
        return _verdict(runs, bad is None, "inspect"), last, last, []
    add("ckpt inspect while another run saves with --keep-last 1 (6 s)", readers_during_saves)
    return cases


def _set_copy(manifest, path, value):
    get_at(manifest, path[:-1])[path[-1]] = value
    return manifest


def classify(case, inspect, train, files_changed):
    runs = (inspect, train)
    if any(r["crashed"] for r in runs):
        return "crash"
    if any(r["timed_out"] for r in runs):
        return "hang"
    if case.expect_train == "ok":
        ok = train["rc"] == 0 and (case.expect_inspect != "ok" or inspect["rc"] == 0)
        return "control-ok" if ok else "control-failed"
    missed = []
    if case.expect_inspect == "fail" and inspect["rc"] == 0:
        missed.append("inspect")
    if case.expect_train == "fail" and train["rc"] == 0:
        missed.append("train")
    if missed:
        return "missed-by-" + "+".join(missed)
    if train["rc"] == 0:
        return "accepted-allowed"  # e.g. a resealed record of the saving run's settings
    if not train["has_mxddp_error"]:
        return "unclear-error"
    return "detected"


def run_case(binary, root, sources, case_id, case, timeout_s, mem_limit, keep_all):
    case_root = os.path.join(root, "cases", f"{case_id:04d}")
    if os.path.lexists(case_root):
        shutil.rmtree(case_root)
    os.makedirs(case_root)
    ck = os.path.join(case_root, "ck")
    shutil.copytree(sources[case.source], ck, symlinks=True)
    if case.check:
        return run_check_case(binary, case_id, case, case_root, ck, timeout_s, mem_limit, keep_all)
    try:
        case.build(case_root, ck)
    except Exception as e:  # a builder that does not fit this checkpoint format: say so, go on
        return {"id": case_id, "category": case.category, "name": case.name, "source": case.source,
                "expect_inspect": case.expect_inspect, "expect_train": case.expect_train,
                "classification": "harness-error", "files_changed": [], "dir": case_root,
                "error": f"{type(e).__name__}: {e}"[:500], "inspect": None, "train": None}
    before = runner.snapshot(case_root)
    inspect = runner.run([binary, "ckpt", "inspect", ck], case_root, timeout_s, mem_limit)
    train = runner.run(resume_argv(binary, ck), case_root, timeout_s, mem_limit)
    diff = runner.snapshot_diff(before, runner.snapshot(case_root))
    verdict = classify(case, inspect, train, diff)
    record = {
        "id": case_id, "category": case.category, "name": case.name, "source": case.source,
        "expect_inspect": case.expect_inspect, "expect_train": case.expect_train,
        "classification": verdict, "files_changed": diff, "dir": case_root,
        "inspect": inspect, "train": train,
    }
    if not keep_all and verdict in ("detected", "control-ok") and not diff:
        shutil.rmtree(case_root, ignore_errors=True)
        record["dir"] = None
    return record


def run_check_case(binary, case_id, case, case_root, ck, timeout_s, mem_limit, keep_all):
    try:
        verdict, first, second, diff = case.check(binary, case_root, ck, timeout_s, mem_limit)
    except Exception as e:  # the harness, not mxddp: say so, go on
        return {"id": case_id, "category": case.category, "name": case.name, "source": case.source,
                "expect_inspect": case.expect_inspect, "expect_train": case.expect_train,
                "classification": "harness-error", "files_changed": [], "dir": case_root,
                "error": f"{type(e).__name__}: {e}"[:500], "inspect": None, "train": None}
    record = {
        "id": case_id, "category": case.category, "name": case.name, "source": case.source,
        "expect_inspect": case.expect_inspect, "expect_train": case.expect_train,
        "classification": verdict, "files_changed": diff, "dir": case_root,
        "inspect": first, "train": second,
    }
    if not keep_all and verdict == "detected" and not diff:
        shutil.rmtree(case_root, ignore_errors=True)
        record["dir"] = None
    return record
