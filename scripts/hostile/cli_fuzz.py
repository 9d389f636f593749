# Part 2 of the campaign: known-good invocations of each subcommand with 1-3 options made hostile.
#
# The options and their documented ranges come from each subcommand's --help (CLI11's
# "--name TYPE:[lo, hi]=default" lines), so a new flag is fuzzed without editing this file. Each
# mutated value is judged before the run: "nonsense" (outside the documented range, the wrong
# type, an unusable path, a cross-flag rule the docs state), "ambiguous" (a spelling some parsers
# take and others refuse: hex, padding, a case change), "long" (valid, but a lot of work: run
# with a short limit) or "valid". A nonsense value must be refused with an error naming the flag
# or the value; accepting it is "silently accepted nonsense".
#
# Paths the fuzzer hands out as outputs are always names inside the invocation's own working
# directory (its own FIFO, device node copies, symbolic links), never a system path: a regressed
# binary that replaces its target then replaces only a sandbox file.
import json
import math
import os
import re
import shutil
import struct
import sys

import runner

if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)  # the hostile values include 5000-digit numbers

SUBCOMMANDS = [("train",), ("plan",), ("layout",), ("quantize",), ("selfcheck",), ("ckpt", "inspect"),
               ("ckpt", "export")]
WEIGHTS = [30, 15, 12, 15, 13, 15, 15]

TRAIN_TINY = ["--ranks", "2", "--train-iters", "2", "--num-layers", "2", "--hidden-size", "32",
              "--num-attention-heads", "2", "--seq-length", "32", "--micro-batch-size", "2",
              "--global-batch-size", "8", "--corpus-bytes", "65536", "--eval-iters", "0"]

# What a TEXT option's value names, where the help cannot say.
ROLES = {
    ("train", "--data"): "in-file", ("train", "--load"): "in-ckpt", ("train", "--save"): "out-dir",
    # An indexed dataset PREFIX (or a text file), and a Hugging Face GPT-2 directory (issue 40).
    ("train", "--data-path"): "in-indexed", ("train", "--load-hf"): "in-hf",
    ("train", "--report"): "out-file", ("quantize", "--input"): "in-quant",
    ("quantize", "--out-data"): "out-file", ("quantize", "--out-scales"): "out-file",
    ("ckpt inspect", "dir"): "in-ckpt", ("layout", "--shapes"): "shapes", ("layout", "--bucket-size"): "bucket",
    # `mxddp ckpt export DIR --out FILE [--dtype f32|bf16]`: its --help gives --dtype as TEXT, so the
    # two valid values are named here (ckpt_export.cc).
    ("ckpt export", "dir"): "in-ckpt", ("ckpt export", "--out"): "out-file", ("ckpt export", "--dtype"): "export-dtype",
    ("quantize", "--shape"): "qshape",
    # `mxddp plan` takes train's flags and reads --load (its iteration) and its own inputs; the flags
    # that name a run's data and outputs (--data, --save, --report, --metrics-file) change nothing in
    # a plan and are not opened, so any text is valid for them there.
    ("plan", "--load"): "in-ckpt", ("plan", "--shapes"): "shapes", ("plan", "--safetensors"): "in-file",
}

# Valid values above these (below, for the *_MIN ones) are a lot of work, not nonsense: they run
# under the short limit and a timeout is "valid-long-killed".
COST_MAX = {
    ("train", "--train-iters"): 20, ("train", "--eval-iters"): 10, ("train", "--corpus-bytes"): 1 << 24,
    ("train", "--num-layers"): 8, ("train", "--hidden-size"): 256, ("train", "--seq-length"): 256,
    ("train", "--micro-batch-size"): 32, ("train", "--global-batch-size"): 256, ("train", "--ranks"): 16,
    ("train", "--compute-threads"): 8, ("selfcheck", "--count"): 1 << 18, ("selfcheck", "--ranks"): 64,
    ("layout", "--dp"): 1 << 12, ("plan", "--num-layers"): 10000, ("plan", "--fit-max-dp"): 1 << 16,
}
COST_MIN = {("train", "--bucket-size"): 256, ("train", "--suggested-communication-unit-size"): 256,
            ("train", "--timeout-ms"): 2000, ("selfcheck", "--timeout-ms"): 2000}

HUGE = ["2147483648", "2147483647", "4294967296", "9223372036854775807", "9223372036854775808",
        "18446744073709551615", "18446744073709551616", "1e39", "99999999999999999999"]
NEGATIVE = ["-1", "-2147483649", "-9223372036854775809", "-1e39", "-0.5"]
ZEROS = ["0", "-0", "0.0", "+0", "00"]
NANINF = ["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e999"]
HEX = ["0x10", "0X1f", "0x", "0x7fffffffffffffff", "0xffffffffffffffff", "0b101", "0o7", "010"]
SPACES = [" 4", "4 ", "\t4", "4\n", " ", "\n", "4 4"]
NONNUMERIC = ["abc", "4abc", "1,000", "1_000", "four", "-", "true", "[1]", "\"4\"", "\uff14", "4;rm", "$HOME"]
UNITS = ["4k", "1M", "2GiB", "10ms", "1s", "4KB", "1e3", "1.5", "2.", ".5", "1e-50"]
LONG = ["9" * 5000, "a" * 10000, "1" + "0" * 400, "0" * 5000 + "4", "a" * 200, "a" * 300]
GENERIC = ([("huge", v) for v in HUGE] + [("negative", v) for v in NEGATIVE] + [("zero", v) for v in ZEROS] +
           [("empty", "")] + [("naninf", v) for v in NANINF] + [("hex", v) for v in HEX] +
           [("whitespace", v) for v in SPACES] + [("non-numeric", v) for v in NONNUMERIC] +
           [("units", v) for v in UNITS] + [("long", v) for v in LONG])
UNKNOWN_FLAGS = ["--no-such-flag", "--ranks2", "-x", "---ranks", "--Ranks", "--train_iters", "-", "--=4",
                 "--lr=", "--help-me", "--ranks=", "-r"]
# Paths made in every invocation's working directory: name -> what it is.
SPECIAL_PATHS = {
    "fifo": "fifo", "dir": "empty directory", "dev_zero": "device node (1,5)", "dev_full": "device node (1,7)",
    "dev_null": "device node (1,3)", "link_file": "symlink to a regular file", "link_dir": "symlink to a directory",
    "dangling": "dangling symlink", "loop": "symlink loop", "regfile": "regular file", "empty": "empty file",
    "regfile/x": "path under a regular file", "nope/x": "path under a missing directory",
}


# ---- --help ----

class Option:
    def __init__(self, names, type_, constraint, default, required, multi, flag_negation):
        self.names = names
        self.name = next((n for n in names if n.startswith("--")), names[0])
        self.type = type_  # INT, UINT, FLOAT, TEXT, or None for a flag
        self.constraint = constraint
        self.default = default
        self.required = required
        self.multi = multi
        self.positional = not names[0].startswith("-")

    def range(self):
        m = re.match(r"([\[(])\s*(\S+),\s*(\S+)\s*([\])])$", self.constraint or "")
        if not m:
            return None
        return float(m.group(2)) if self.type == "FLOAT" else int(m.group(2)), \
            float(m.group(3)) if self.type == "FLOAT" else int(m.group(3)), m.group(1) == "(", m.group(4) == ")"

    def choices(self):
        m = re.match(r"\{(.*)\}$", self.constraint or "")
        return m.group(1).split(",") if m else None


# "  --name,--alias TYPE:CONSTRAINT=DEFAULT REQUIRED ...   description" (the description may follow
# after one space or start on the next line).
OPTION_RE = re.compile(r"^\s{2,}((?:-\w,)?--[\w-]+(?:,--[\w-]+)*(?:\{\w+\})?|\w+)(?: (TEXT|INT|UINT|FLOAT)"
                       r"(?::(\[[^\]]*[\])]|\([^)\]]*[\])]|\{[^}]*\}|not empty|[^=\s]+))?(?:=(\S+))?"
                       r"( REQUIRED)?( \.\.\.)?)?(?:\s+\S.*)?$")


def parse_help(text):
    options = []
    for line in text.splitlines():
        m = OPTION_RE.match(line)
        if not m or m.group(1) in ("Options", "Positionals"):
            continue
        names_part = m.group(1)
        negation = None
        if "{" in names_part:
            names_part, negation = names_part.split("{", 1)
        names = [n for n in names_part.split(",") if n]
        if "--help" in names or (not names[0].startswith("-") and m.group(2) is None):
            continue
        options.append(Option(names, m.group(2), m.group(3), m.group(4), bool(m.group(5)), bool(m.group(6)),
                               negation))
    return options


# ---- judging one value ----

INT_RE = re.compile(r"-?\d+$")
FLOAT_RE = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
F32_MAX = 3.4028234663852886e38


def lenient_int(text):
    """The integer a lenient parser (strtoll base 0, padding, '+', '1e3', '_') could read, or None."""
    t = text.strip().replace("_", "")
    try:
        return int(t, 0)
    except ValueError:
        pass
    try:
        return int(t, 10)
    except ValueError:
        pass
    try:
        f = float(t)
        return int(f) if math.isfinite(f) and f == int(f) else None
    except (ValueError, OverflowError):
        return None


def in_range(value, rng):
    lo, hi, lo_open, hi_open = rng
    return (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)


def judge_number(opt, text):
    rng = opt.range()
    if opt.type in ("INT", "UINT"):
        if INT_RE.match(text) and not re.match(r"-?0\d", text):
            v = int(text)
            return ("valid", v) if rng is None or in_range(v, rng) else ("nonsense", None)
        v = lenient_int(text)
        if v is None or (rng and not in_range(v, rng)):
            return "nonsense", None
        if re.match(r"-?\d+\.\d*$", text.strip()) and not re.match(r"-?\d+\.0*$", text.strip()):
            return "nonsense", None
        return "ambiguous", v
    # FLOAT: the help says 32-bit.
    if FLOAT_RE.match(text):
        v = float(text)
        if not math.isfinite(v) or abs(v) > F32_MAX or (rng and not in_range(v, rng)):
            return "nonsense", None
        if v != 0 and abs(v) < 1.4e-45:
            return "ambiguous", v  # rounds to 0 as a 32-bit float
        return "valid", v
    try:
        v = float(text.strip().replace("_", ""))
    except (ValueError, OverflowError):
        try:
            v = float.fromhex(text.strip())
        except (ValueError, OverflowError):
            return "nonsense", None
    if not math.isfinite(v) or abs(v) > F32_MAX or (rng and not in_range(v, rng)):
        return "nonsense", None
    return "ambiguous", v


def judge_path(role, text, special):
    """special: the name is one made in the working directory (SPECIAL_PATHS) or 'good:...'."""
    if text == "":
        return "nonsense", "empty path"
    if len(os.path.basename(text)) > 255 or len(text) > 4000:
        return "nonsense", "name too long"
    kind = special
    if role.startswith("in-"):
        good = {"in-file": ("good:data", "good:quant-input", "link_file", "regfile"),
                "in-quant": ("good:quant-input", "good:quant-input2", "link_quant"),
                "in-ckpt": ("good:ckpt", "good:link-ckpt"),
                "in-indexed": ("good:indexed", "good:data", "link_file", "regfile"),  # a text file is text data
                "in-hf": ("good:hf",)}[role]
        return ("valid", kind) if kind in good else ("nonsense", kind or "missing file")
    if text == "-":
        return "ambiguous", "'-' (stdout to some tools)"
    if role == "out-file":
        if kind in ("regfile", "empty", "good:new", "good:new-under-missing-dir", "nope/x"):
            return "valid", kind
        if kind or "/" in text or text in (".", ".."):
            return "nonsense", kind or "odd path"
        return "valid", "new name"
    if role == "out-dir":
        if kind in ("dir", "good:new", "good:new-under-missing-dir", "nope/x"):
            return "valid", kind
        if kind or "/" in text or text in (".", ".."):
            return "nonsense", kind or "odd path"
        return "valid", "new name"
    raise ValueError(role)


def parse_shapes(text):
    """layout --shapes: the param numels, or None when the grammar is broken."""
    numels = []
    for part in text.split(","):
        if not re.match(r"\d+(x\d+)*$", part):
            return None
        n = 1
        for d in part.split("x"):
            n *= int(d)
        numels.append((n, [int(d) for d in part.split("x")]))
    return numels


def judge_text(sub, opt, text, special):
    role = ROLES.get((sub, opt.name))
    if role == "shapes":
        shapes = parse_shapes(text)
        if shapes is None:
            return "nonsense", "shape grammar"
        if any(d == 0 for _, dims in shapes for d in dims) or any(d >= 1 << 63 for _, dims in shapes for d in dims):
            return "nonsense", "dimension 0 or past int64"
        if sum(n for n, _ in shapes) >= 1 << 63:
            return "nonsense", "numel past int64"
        if re.search(r"(^|[x,])0\d", text):
            return "ambiguous", "a dimension with a leading zero"
        return ("long" if len(shapes) > 10000 else "valid"), None
    if role == "bucket":
        if text in ("none", "default"):
            return "valid", None
        verdict, _ = judge_number(Option(["--x"], "INT", "[1, 9223372036854775807]", None, False, False, None), text)
        return verdict, None
    if role == "export-dtype":
        if text in ("f32", "bf16"):
            return "valid", None
        if text.strip().lower() in ("f32", "bf16"):
            return "ambiguous", "case or padding"
        return "nonsense", None
    if role == "qshape":
        m = re.match(r"(\d+)x(\d+)$", text)
        if not m or re.match(r"0\d", m.group(1)) or re.match(r"0\d", m.group(2)):
            return "nonsense", "shape grammar"
        if int(m.group(1)) == 0 or int(m.group(2)) == 0:
            return "nonsense", "zero dimension"
        return "valid", (int(m.group(1)), int(m.group(2)))
    if role:
        return judge_path(role, text, special)
    choices = opt.choices()
    if choices is not None:
        if text in choices:
            return "valid", None
        if text.strip().lower() in choices:
            return "ambiguous", None
        return "nonsense", None
    if opt.constraint == "not empty" and text == "":
        return "nonsense", None
    return "valid", None


def judge(sub, opt, text, special):
    if opt.type in ("INT", "UINT", "FLOAT"):
        verdict, value = judge_number(opt, text)
        if verdict == "valid" and value is not None:
            if value > COST_MAX.get((sub, opt.name), math.inf) or value < COST_MIN.get((sub, opt.name), -math.inf):
                return "long", value
        return verdict, value
    return judge_text(sub, opt, text, special)


# ---- one invocation ----

class Fixtures:
    """Files shared by every invocation (only ever read) and the good checkpoint."""
    def __init__(self, root, ckpt_source):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.data = os.path.join(root, "data.txt")
        with open(self.data, "w") as f:
            f.write(("the quick brown fox jumps over the lazy dog. " * 2000)[:65536])
        self.quant = os.path.join(root, "in.f32")
        self.quant2 = os.path.join(root, "in2.f32")
        payload = struct.pack("<4096f", *[((i * 7919) % 1000) / 250.0 - 2.0 for i in range(4096)])
        for path in (self.quant, self.quant2):
            with open(path, "wb") as f:
                f.write(payload)
        self.ckpt = os.path.join(root, "ck")
        if os.path.lexists(self.ckpt):
            shutil.rmtree(self.ckpt)
        shutil.copytree(ckpt_source, self.ckpt)
        self.link_ckpt = os.path.join(root, "link_ck")
        if not os.path.lexists(self.link_ckpt):
            os.symlink(self.ckpt, self.link_ckpt)
        # Indexed datasets of the data's bytes: intact, and with one id (4112) past the vocabulary.
        self.indexed = os.path.join(root, "indexed")
        self.indexed_bad_ids = os.path.join(root, "indexed_bad_ids")
        docs = [list(line.encode()) for line in ("the quick brown fox jumps over the lazy dog. " * 400).split(". ")]
        write_indexed(self.indexed, docs)
        docs[7][3] = 4112
        write_indexed(self.indexed_bad_ids, docs)
        # Hugging Face GPT-2 directories of TRAIN_TINY's model: finite, and with a NaN or an Inf in
        # one weight (refused at load naming the tensor).
        self.hf = os.path.join(root, "hf")
        self.hf_nan = os.path.join(root, "hf_nan")
        self.hf_inf = os.path.join(root, "hf_inf")
        write_hf_gpt2(self.hf, None)
        write_hf_gpt2(self.hf_nan, ("transformer.h.1.mlp.c_fc.weight", 37, math.nan))
        write_hf_gpt2(self.hf_inf, ("transformer.wte.weight", 100, -math.inf))


def write_indexed(prefix, docs):
    """PREFIX.bin + PREFIX.idx (megatron-core's MMIDIDX, uint16): one sequence per document."""
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(struct.pack(f"<{len(d)}H", *d))
    pointers, at = [], 0
    for d in docs:
        pointers.append(at)
        at += 2 * len(d)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\0\0" + struct.pack("<QBQQ", 1, 8, len(docs), len(docs) + 1))
        f.write(struct.pack(f"<{len(docs)}i", *[len(d) for d in docs]))
        f.write(struct.pack(f"<{len(docs)}q", *pointers))
        f.write(struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1)))


def write_hf_gpt2(directory, poison):
    """config.json + model.safetensors (F32) of a GPT-2 with TRAIN_TINY's sizes (2 layers, hidden
    32, 2 heads, n_positions 32, vocabulary 256), small deterministic weights; poison: (tensor,
    element, value) written over one of them."""
    os.makedirs(directory, exist_ok=True)
    h, layers = 32, 2
    shapes = {"transformer.wte.weight": [256, h], "transformer.wpe.weight": [32, h],
              "transformer.ln_f.weight": [h], "transformer.ln_f.bias": [h]}
    for layer in range(layers):
        for name, shape in (("ln_1.weight", [h]), ("ln_1.bias", [h]), ("attn.c_attn.weight", [h, 3 * h]),
                            ("attn.c_attn.bias", [3 * h]), ("attn.c_proj.weight", [h, h]), ("attn.c_proj.bias", [h]),
                            ("ln_2.weight", [h]), ("ln_2.bias", [h]), ("mlp.c_fc.weight", [h, 4 * h]),
                            ("mlp.c_fc.bias", [4 * h]), ("mlp.c_proj.weight", [4 * h, h]), ("mlp.c_proj.bias", [h])):
            shapes[f"transformer.h.{layer}.{name}"] = shape
    header, data = {}, bytearray()
    for name, shape in shapes.items():
        numel = math.prod(shape)
        ones = name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))
        values = [1.0 if ones else ((i * 7919) % 1000) / 25000.0 - 0.02 for i in range(numel)]
        if poison and poison[0] == name:
            values[poison[1]] = poison[2]
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + 4 * numel]}
        data += struct.pack(f"<{numel}f", *values)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    config = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=256, n_positions=32, n_embd=h,
                  n_layer=layers, n_head=2, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


def make_specials(cwd):
    os.mkfifo(os.path.join(cwd, "fifo"))
    os.mkdir(os.path.join(cwd, "dir"))
    for name, minor, real in (("dev_zero", 5, "/dev/zero"), ("dev_full", 7, "/dev/full"), ("dev_null", 3, "/dev/null")):
        runner.make_device(os.path.join(cwd, name), 1, minor, real)
    with open(os.path.join(cwd, "regfile"), "w") as f:
        f.write("x" * 1000)
    open(os.path.join(cwd, "empty"), "w").close()
    os.symlink("regfile", os.path.join(cwd, "link_file"))
    os.symlink("dir", os.path.join(cwd, "link_dir"))
    os.symlink("nowhere", os.path.join(cwd, "dangling"))
    os.symlink("loop", os.path.join(cwd, "loop"))


def base_items(sub, fx):
    """The known-good invocation as [(option name, value)] (value None: a flag; name None: a
    positional)."""
    if sub in ("train", "plan"):
        return [(TRAIN_TINY[i], TRAIN_TINY[i + 1]) for i in range(0, len(TRAIN_TINY), 2)]
    if sub == "layout":
        return [("--shapes", "95x95,95,1"), ("--dp", "4")]
    if sub == "quantize":
        return [("--input", fx.quant), ("--shape", "64x64"), ("--out-data", "out/d.bin"),
                ("--out-scales", "out/s.bin")]
    if sub == "selfcheck":
        return [("--ranks", "2"), ("--count", "64")]
    if sub == "ckpt export":
        return [(None, fx.ckpt), ("--out", "out/model.safetensors"), ("--dtype", "bf16")]
    return [(None, fx.ckpt)]


def path_values(role, fx, rng):
    """(label, text, special kind) candidates for a path option."""
    values = [(f"path:{name}", name, name) for name in SPECIAL_PATHS]
    values += [("path:/dev/zero", "/dev/zero", "device"), ("path:/dev/null", "/dev/null", "device"),
               ("path:/dev/full", "/dev/full", "device")] if role.startswith("in-") else []
    values += [("path:long", "d/" * 2100, None), ("path:newline", "new\nname", None)]
    if role in ("in-file",):
        values += [("path:good", fx.data, "good:data"), ("path:good-binary", fx.quant, "good:quant-input")]
    if role == "in-quant":
        values += [("path:good", fx.quant2, "good:quant-input2"), ("path:text-file", fx.data, "data-size")]
    if role == "in-indexed":
        values += [("path:good", fx.indexed, "good:indexed"), ("path:good-bin-name", fx.indexed + ".bin", "good:indexed"),
                   ("path:text-file", fx.data, "good:data"),
                   ("path:ids-past-vocabulary", fx.indexed_bad_ids, "ids past the vocabulary")]
    if role == "in-hf":
        values += [("path:good", fx.hf, "good:hf"), ("path:nan-weight", fx.hf_nan, "a NaN weight"),
                   ("path:inf-weight", fx.hf_inf, "an Inf weight"), ("path:ckpt-not-hf", fx.ckpt, "an mxddp checkpoint")]
    if role == "in-ckpt":
        values += [("path:good", fx.ckpt, "good:ckpt"), ("path:good-symlink", fx.link_ckpt, "good:link-ckpt"),
                   ("path:data-file", fx.data, "file")]
    if role.startswith("out-"):
        values += [("path:new", "new.out", "good:new"), ("path:new-under-missing-dir", "a/b/c/new.out",
                                                            "good:new-under-missing-dir")]
    return values


def choose_value(sub, opt, fx, rng):
    """(label, text, special) for a hostile or boundary value of opt."""
    role = ROLES.get((sub, opt.name))
    if role and role not in ("shapes", "bucket", "qshape", "export-dtype"):
        pool = path_values(role, fx, rng)
        if rng.random() < 0.25:
            label, text = rng.choice(GENERIC)
            return label, text, None
        return rng.choice(pool)
    if role == "shapes":
        dim = rng.choice([v for _, v in GENERIC] + ["1", "95", "2147483648"])
        forms = [dim, f"95x{dim}", f"{dim},95", f"95x95,{dim},1", f"95x95,95,{dim}x{dim}", "95,,1", "95x95,",
                 ",", "x", "95xx95", "1," * 20000 + "1", "4x4x4x4x4x4x4x4", "95X95"]
        return "shapes", rng.choice(forms), None
    if role == "export-dtype" and rng.random() < 0.6:
        text = rng.choice(["f32", "bf16", "F32", "BF16", " bf16", "f32 ", "f16", "fp32", "bfloat16", "e4m3",
                           "mxfp8", "f3", "bf16x", "f32,bf16", "float32"])
        return "dtype", text, None
    if role == "qshape":
        dim = rng.choice([v for _, v in GENERIC] + ["64", "32", "128"])
        forms = [f"{dim}x64", f"64x{dim}", dim, f"{dim}x{dim}", "32x128", "128x32", "64x64x1", "64X64", "x64",
                 "64x", "4294967296x4294967296", "3037000499x3037000499"]
        return "qshape", rng.choice(forms), None
    choices = opt.choices()
    if choices and rng.random() < 0.6:
        c = rng.choice(choices)
        text = rng.choice([c, c.upper(), " " + c, c + " ", c[:-1], c + "x", ""])
        return "choice", text, None
    rngs = opt.range() if opt.type in ("INT", "UINT", "FLOAT") else None
    if rngs and rng.random() < 0.25:
        lo, hi, _, _ = rngs
        if opt.type == "FLOAT":
            cand = [repr(lo), repr(hi), repr(float(hi) * 1.0000001), repr(lo - 1e-7), repr(-1e-7)]
        else:
            cand = [str(lo), str(hi), str(lo - 1), str(hi + 1), str(rng.randint(lo, min(hi, lo + 64)))]
        return "boundary", rng.choice(cand), None
    label, text = rng.choice(GENERIC)
    return label, text, None


def generate_invocation(index, rng, options_by_sub, fx, subcommands=None):
    """subcommands: the (sub, ...) tuples to draw from, by their WEIGHTS (None: all)."""
    pool = [(s, w) for s, w in zip(SUBCOMMANDS, WEIGHTS) if subcommands is None or s in subcommands]
    sub = rng.choices([s for s, _ in pool], [w for _, w in pool])[0]
    sub_name = " ".join(sub)
    options = [o for o in options_by_sub[sub_name] if not o.positional]
    positional = [o for o in options_by_sub[sub_name] if o.positional]
    items = [[name, value, "sep"] for name, value in base_items(sub_name, fx)]
    mutations = []
    for _ in range(rng.choices([1, 2, 3], [50, 30, 20])[0]):
        kind = rng.choices(["set", "unknown", "repeat", "drop", "extra-positional", "flag-value"],
                           [72, 7, 6, 5, 5, 5])[0]
        if kind == "set" and sub[0] == "ckpt" and positional and rng.random() < 0.5:
            opt = positional[0]
        elif kind == "set":
            opt = rng.choice([o for o in options if o.type] or positional)
        elif kind == "repeat":
            # A flag or an option already given, repeated with its own value.
            given = [o for o in options if o.type is None or any(i[0] == o.name for i in items)]
            if not given:
                continue
            opt = rng.choice(given)
        if kind == "set":
            label, text, special = choose_value(sub_name, opt, fx, rng)
            verdict, detail = judge(sub_name, opt, text, special)
            key = None if opt.positional else opt.name
            for item in items:
                if item[0] == key:
                    item[1] = text
                    break
            else:
                items.append([key, text, "sep"])
            if key is not None:
                next(item for item in items if item[0] == key)[2] = rng.choice(["sep", "sep", "eq"])
            mutations.append(dict(kind=kind, flag=opt.name, value=text, label=label, verdict=verdict,
                                  detail=repr(detail)[:80], special=special, positional=opt.positional))
        elif kind == "unknown":
            flag = rng.choice(UNKNOWN_FLAGS)
            items.append([flag, None, "sep"])
            # "--" ends the options: what follows is positional, still refused by these commands.
            mutations.append(dict(kind=kind, flag=flag, value=None, label="unknown-flag", verdict="nonsense"))
        elif kind == "repeat":
            value = None if opt.type is None else next(i[1] for i in items if i[0] == opt.name)
            items.append([opt.name, value, "sep"])
            if opt.type is None and sum(1 for i in items if i[0] == opt.name) < 2:
                items.append([opt.name, value, "sep"])  # a flag not given yet: twice
            # Last-one-wins and refusing are both fair for a repeated single-value option.
            verdict = "valid" if opt.multi else "ambiguous"
            mutations.append(dict(kind=kind, flag=opt.name, value=value, label="repeated-flag", verdict=verdict))
        elif kind == "drop":
            present = [i for i in items]
            if not present:
                continue
            item = rng.choice(present)
            items.remove(item)
            opt = next((o for o in options_by_sub[sub_name] if (o.positional and item[0] is None) or
                        item[0] in o.names), None)
            required = opt is not None and opt.required
            verdict = "nonsense" if required else "valid"
            if item[0] == "--train-iters" or item[0] == "--corpus-bytes":
                verdict = "long"  # the defaults: 300 iterations, 1 MiB
            if item[0] == "--ranks" and sub_name in ("train", "plan"):
                verdict = "valid"  # default 4 ranks: 8 = 2 x 4 x 1
            mutations.append(dict(kind=kind, flag=item[0] or (opt.name if opt else "positional"), value=None,
                                  label="dropped", verdict=verdict, positional=item[0] is None))
        elif kind == "extra-positional":
            text = rng.choice(["extra", "1", "--", "", "-"])
            items.append([None, text, "sep"])
            # A trailing "--" only ends the options.
            mutations.append(dict(kind=kind, flag="positional", value=text, label="extra-positional",
                                  verdict="ambiguous" if text == "--" else "nonsense"))
        else:
            flags = [o for o in options if o.type is None]
            if not flags:
                continue
            opt = rng.choice(flags)
            text = rng.choice(["true", "false", "1", "0", "yes", "banana", "", "2", "-1", "on"])
            items.append([opt.name, text, "eq"])
            # CLI11 reads numbers as counts and true/false/yes/on as booleans: only "" and words are nonsense.
            verdict = "nonsense" if text in ("", "banana") else "ambiguous"
            mutations.append(dict(kind=kind, flag=opt.name, value=text, label="flag=value", verdict=verdict))
    # A later mutation of the same option (or a drop) supersedes an earlier one.
    superseded = [m for m in mutations if not is_live(m, items)]
    mutations = [m for m in mutations if is_live(m, items)]
    verdict = cross_checks(sub_name, items, mutations, fx)
    argv = [*sub]
    for name, value, form in items:
        if name is None:
            argv.append(value)
        elif value is None:
            argv.append(name)
        elif form == "eq":
            argv.append(f"{name}={value}")
        else:
            argv += [name, value]
    return dict(id=index, sub=sub_name, argv_tail=argv, mutations=mutations, superseded=superseded, expect=verdict)


def is_live(m, items):
    """Whether mutation m still shows in the final items."""
    kind, flag, value = m["kind"], m["flag"], m.get("value")
    key = None if m.get("positional") else flag
    if kind in ("set", "flag-value"):
        return any(i[0] == key and i[1] == value for i in items)
    if kind == "repeat":
        return sum(1 for i in items if i[0] == flag) >= 2
    if kind == "unknown":
        return any(i[0] == flag for i in items)
    if kind == "drop":
        return not any(i[0] == key for i in items)
    if kind == "extra-positional":
        return any(i[0] is None and i[1] == value for i in items)
    return True


def cross_checks(sub, items, mutations, fx):
    """The invocation's verdict: the worst of its mutations, and the documented cross-flag rules
    on the values as given (the divisibility of the batch, the heads, the input's size)."""
    order = ["nonsense", "ambiguous", "long", "valid"]
    verdict = min((m["verdict"] for m in mutations), key=order.index, default="valid")
    if verdict == "nonsense":
        return verdict
    values = {}
    for name, value, _ in items:
        if name in values:  # a repeated flag: no single value to check
            return verdict
        values[name] = value
    def as_int(name, default):
        try:
            return int(values.get(name, default))
        except (TypeError, ValueError):
            return None
    if sub in ("train", "plan"):
        hidden, heads = as_int("--hidden-size", 64), as_int("--num-attention-heads", 4)
        gbs, mbs, ranks = as_int("--global-batch-size", 32), as_int("--micro-batch-size", 4), as_int("--ranks", 4)
        if sub == "plan" and "--dp" in values:
            ranks = as_int("--dp", 4)  # plan's data-parallel size, over --ranks
        if None not in (hidden, heads) and heads > 0 and hidden % heads:
            mutations.append(dict(kind="cross", flag="--hidden-size", value=str(hidden), label="cross",
                                  verdict="nonsense", detail=f"hidden {hidden} % heads {heads}"))
            return "nonsense"
        # plan checks the batch only when it plans the GPT at one dp (not for --shapes, a safetensors
        # header or --fit, which tries the dp that divide it); train only on the local backend.
        batch_checked = not any(k in values for k in ("--shapes", "--safetensors", "--fit")) if sub == "plan" \
            else values.get("--backend", "local") == "local"
        if batch_checked and None not in (gbs, mbs, ranks) and mbs * ranks > 0 \
                and gbs % (mbs * ranks):
            mutations.append(dict(kind="cross", flag="--global-batch-size", value=str(gbs), label="cross",
                                  verdict="nonsense", detail=f"gbs {gbs} % (mbs {mbs} x dp {ranks})"))
            return "nonsense"
    if sub == "quantize":
        shape = re.match(r"(\d+)x(\d+)$", values.get("--shape") or "")
        path = values.get("--input")
        dtype = values.get("--dtype", "f32")
        if shape and path in (fx.quant, fx.quant2, fx.data) and dtype in ("f32", "bf16"):
            need = int(shape.group(1)) * int(shape.group(2)) * (4 if dtype == "f32" else 2)
            if need != os.path.getsize(path):
                mutations.append(dict(kind="cross", flag="--shape", value=values["--shape"], label="cross",
                                      verdict="nonsense", detail=f"{need} bytes wanted"))
                return "nonsense"
        if values.get("--out-data") and values.get("--out-data") == values.get("--out-scales"):
            return "nonsense"
    if sub == "layout" and "--shared-embedding" in values:
        shapes = parse_shapes(values.get("--shapes") or "")
        index = as_int("--shared-embedding", 0)
        if shapes is not None and index is not None and index >= len(shapes):
            mutations.append(dict(kind="cross", flag="--shared-embedding", value=str(index), label="cross",
                                  verdict="nonsense", detail=f"{len(shapes)} params"))
            return "nonsense"
    return verdict


def names_something(inv, result, all_flags):
    """What in the error names the mutation: a mutated flag, a mutated value, or another flag."""
    text = result["stderr"] + "\n" + result["stdout"][-2000:]
    for m in inv["mutations"]:
        flag = m.get("flag")
        if flag and flag != "positional" and re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text):
            return "flag"
        value = m.get("value")
        if value == "" and ("''" in text or '""' in text or "empty" in text):
            return "value"
        if value:
            v = value.strip() or value
            if len(v) > 40:
                if v[:40] in text:
                    return "value"
            elif re.search(r"(?<![\w.])" + re.escape(v) + r"(?![\w])", text) or repr(v) in text:
                return "value"
    if any(f in text for f in all_flags):
        return "other-flag"
    return None


def classify(inv, result, named):
    if result["crashed"]:
        return "crash"
    if result["timed_out"]:
        return "valid-long-killed" if inv["expect"] == "long" else "hang"
    if result["rc"] == 0:
        return {"nonsense": "silently-accepted-nonsense", "ambiguous": "accepted-ambiguous"}.get(
            inv["expect"], "accepted-valid")
    return "rejected-with-clear-error" if named else "other-error"


def run_invocation(binary, root, inv, options_by_sub, timeout_s, long_timeout_s, mem_limit, keep_all):
    cwd = os.path.join(root, "work", f"{inv['id']:05d}")
    if os.path.lexists(cwd):
        shutil.rmtree(cwd)
    os.makedirs(cwd)
    make_specials(cwd)
    argv = [binary, *inv["argv_tail"]]
    limit = long_timeout_s if inv["expect"] == "long" else timeout_s
    result = runner.run(argv, cwd, limit, mem_limit)
    all_flags = [n for o in options_by_sub[inv["sub"]] for n in o.names if n.startswith("--")]
    named = names_something(inv, result, all_flags) if result["rc"] != 0 else None
    verdict = classify(inv, result, named)
    record = dict(inv, argv=argv, classification=verdict, named=named, cwd=cwd, **{
        k: result[k] for k in ("rc", "signal", "timed_out", "sanitizer", "wall_s", "error_line", "stderr")})
    record.pop("argv_tail")
    if not keep_all and verdict in ("rejected-with-clear-error", "accepted-valid", "valid-long-killed"):
        shutil.rmtree(cwd, ignore_errors=True)
        record["cwd"] = None
    return record
