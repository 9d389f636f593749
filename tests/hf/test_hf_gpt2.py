"""mxddp's GPT to and from Hugging Face GPT-2 (docs/hf.md): `mxddp ckpt export --format hf`,
`mxddp train --load-hf`, `--skip-train`, and the refusals of what mxddp's GPT cannot run.

Run by tests/hf/run_hf_tests.sh (CTest hf_gpt2) with a venv that has torch and transformers:
    MXDDP_CLI=build/release/mxddp build/pyvenv-torch/bin/python -m pytest -q tests/hf

The losses are compared on the very batches mxddp evaluates or trains on: the samplers of
src/model/token_dataset.cc (SplitMix64 of (seed, round, sample)) are re-implemented here from
their contract in docs/model.md ("Data"), independently of the C++.
"""
import json
import math
import os
import shutil
import struct
import subprocess

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

MXDDP = os.environ.get("MXDDP_CLI", "build/release/mxddp")
SEED = 1234
T = 32  # --seq-length of every run here
RUN = ["--ranks", "2", "--compute-threads", "1", "--seq-length", str(T), "--micro-batch-size", "2",
       "--global-batch-size", "8", "--eval-iters", "2", "--seed", str(SEED)]
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2"]


def mxddp(*args, ok=True):
    p = subprocess.run([MXDDP, *map(str, args)], capture_output=True, text=True, timeout=600)
    if ok:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def refused(*args):
    """Runs mxddp expecting a refusal: non-zero status, nothing trained; returns the error text."""
    p = mxddp(*args, ok=False)
    assert p.returncode != 0, p.stdout
    assert "trained iterations" not in p.stdout and "evaluation only" not in p.stdout, p.stdout
    return p.stderr


# ---- The data mxddp reads (docs/model.md, "Data"): byte tokens, the last 10% validation.

M64 = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def mix_hash(a, b, c=0):
    return splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)


def batch(data, valid, round_, first, count):
    """[count, T + 1] tokens: TokenDataset::fill_batch's samples first..first+count of stream round_."""
    split = len(data) - math.floor(0.1 * len(data))
    base, span = (split, len(data) - split) if valid else (0, split)
    domain = 0x76616C6964 if valid else 0x747261696E  # "valid", "train"
    rows = []
    for k in range(count):
        start = base + mix_hash(SEED ^ domain, round_, first + k) % (span - T)
        rows.append(list(data[start:start + T + 1]))
    return torch.tensor(rows)


def hf_loss(model, tokens):
    """GPT2LMHeadModel's mean next-token loss over tokens [B, T + 1], in the model's dtype."""
    with torch.no_grad():
        logits = model(tokens[:, :T]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                                 tokens[:, 1:].reshape(-1)).item()


def validation_loss(model, data):
    """mxddp's evaluation: --eval-iters 2 global batches of 8 (the same at any dp), averaged."""
    return sum(hf_loss(model, batch(data, True, e, 0, 8)) for e in range(2)) / 2


def round_to_bf16(model):
    """The params as mxddp's model holds them: each rounded to bf16 (nearest even), kept in f32."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), "rb").read()
    data = readme[:6000]
    (d / "data.txt").write_bytes(data)
    return d, data


@pytest.fixture(scope="module")
def trained(work):
    """A short mxddp run (dp 2) with a checkpoint, and the validation loss it printed."""
    d, data = work
    mxddp("train", *RUN, *MODEL, "--data", d / "data.txt", "--train-iters", "12", "--save", d / "ckpt",
          "--report", d / "train.json")
    report = json.load(open(d / "train.json"))
    return d / "ckpt", report["validation"][-1]["loss"]


# ---- Export

def test_export_loads_with_no_glue_and_reproduces_mxddps_loss(work, trained):
    d, data = work
    ckpt, printed = trained
    out = mxddp("ckpt", "export", ckpt, "--format", "hf", "--out", d / "hf_model").stdout
    assert "the model params mxddp evaluates with (bf16" in out, out
    assert sorted(os.listdir(d / "hf_model")) == ["config.json", "model.safetensors"]
    cfg = json.load(open(d / "hf_model" / "config.json"))
    assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["activation_function"] == "gelu_new"
    assert (cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["n_positions"], cfg["vocab_size"]) == (32, 2, 2, T, 256)
    assert cfg["layer_norm_epsilon"] == 1e-5 and cfg["tie_word_embeddings"] is True
    assert cfg["bos_token_id"] is None and cfg["eos_token_id"] is None  # bytes: no <|endoftext|>
    model = GPT2LMHeadModel.from_pretrained(d / "hf_model").eval()
    assert model.dtype == torch.float32  # HF evaluates in f32; the values are mxddp's bf16 params
    loss = validation_loss(model, data)
    assert abs(loss - printed) < 1e-5, (loss, printed)
    # mxddp's own evaluation-only run of the same checkpoint prints the same loss.
    mxddp("train", *RUN, *MODEL, "--data", d / "data.txt", "--train-iters", "12", "--load", ckpt, "--skip-train",
          "--report", d / "skip.json")
    assert abs(json.load(open(d / "skip.json"))["validation"][0]["loss"] - loss) < 1e-5


def test_export_f32_is_the_main_params_in_hfs_layout(work, trained):
    """--dtype f32: each HF tensor is the checkpoint's main param, transposed for Conv1D weights."""
    from safetensors.torch import load_file
    d, data = work
    ckpt, printed = trained
    mxddp("ckpt", "export", ckpt, "--format", "hf", "--dtype", "f32", "--out", d / "hf_f32")
    mxddp("ckpt", "export", ckpt, "--out", d / "main.safetensors")
    hf, main = load_file(d / "hf_f32" / "model.safetensors"), load_file(d / "main.safetensors")
    assert all(t.dtype == torch.float32 for t in hf.values())
    pairs = {"transformer.wte.weight": ("embedding.word_embeddings.weight", False),
             "transformer.wpe.weight": ("embedding.position_embeddings.weight", False),
             "transformer.ln_f.weight": ("decoder.final_layernorm.weight", False),
             "transformer.ln_f.bias": ("decoder.final_layernorm.bias", False)}
    for l in range(2):
        h, m = f"transformer.h.{l}.", f"decoder.layers.{l}."
        for hf_name, name, t in [("ln_1", "input_layernorm", False), ("attn.c_attn", "self_attention.linear_qkv", True),
                                 ("attn.c_proj", "self_attention.linear_proj", True),
                                 ("ln_2", "pre_mlp_layernorm", False), ("mlp.c_fc", "mlp.linear_fc1", True),
                                 ("mlp.c_proj", "mlp.linear_fc2", True)]:
            pairs[h + hf_name + ".weight"] = (m + name + ".weight", t)
            pairs[h + hf_name + ".bias"] = (m + name + ".bias", False)
    assert sorted(hf) == sorted(pairs)
    for name, (source, transposed) in pairs.items():
        expected = main[source].T if transposed else main[source]
        assert torch.equal(hf[name], expected.contiguous()), name
    # The main params evaluate close to, but not at, the loss mxddp printed (its params are bf16).
    loss = validation_loss(GPT2LMHeadModel.from_pretrained(d / "hf_f32").eval(), data)
    assert abs(loss - printed) < 1e-2


def test_export_replaces_a_previous_export_and_refuses_other_directories(work, trained):
    d, _ = work
    ckpt, _ = trained
    out = d / "again"
    mxddp("ckpt", "export", ckpt, "--format", "hf", "--out", out)
    assert "--overwrite" in refused("ckpt", "export", ckpt, "--format", "hf", "--out", out, "--eos-token-id", "10")
    mxddp("ckpt", "export", ckpt, "--format", "hf", "--out", out, "--eos-token-id", "10", "--overwrite")
    assert json.load(open(out / "config.json"))["eos_token_id"] == 10
    assert not os.path.exists(str(out) + ".partial") and not os.path.exists(str(out) + ".old")
    (out / "notes.txt").write_text("mine")
    assert "holds 'notes.txt'" in refused("ckpt", "export", ckpt, "--format", "hf", "--out", out)
    assert (out / "notes.txt").read_text() == "mine"
    assert "is not a directory" in refused("ckpt", "export", ckpt, "--format", "hf", "--out", d / "data.txt")
    assert "--eos-token-id 256 is not in the model's vocabulary of 256" in refused(
        "ckpt", "export", ckpt, "--format", "hf", "--out", d / "eos", "--eos-token-id", "256")
    assert not os.path.exists(d / "eos")
    assert "--dtype 'bf16' is not valid with --format hf" in refused(
        "ckpt", "export", ckpt, "--format", "hf", "--out", d / "x", "--dtype", "bf16")


# ---- Import

def save_random_gpt2(path, dtype=torch.float32, **overrides):
    """save_pretrained of a random GPT-2 (vocabulary 320 >= the 256 byte ids, n_positions 48 > T)."""
    torch.manual_seed(0)
    fields = dict(vocab_size=320, n_positions=48, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    fields.update(overrides)
    model = GPT2LMHeadModel(GPT2Config(**fields))
    with torch.no_grad():  # norms and biases away from 1 and 0: a swapped or untransposed tensor shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path)
    return path


def first_loss(d, hf_dir, *extra):
    mxddp("train", *RUN, "--data", d / "data.txt", "--train-iters", "1", "--load-hf", hf_dir,
          "--report", d / "import.json", *extra)
    return json.load(open(d / "import.json"))["steps"][0]["loss"]


def test_import_first_loss_equals_hfs_on_the_same_batch(work):
    d, data = work
    hf_dir = save_random_gpt2(d / "random_f32")
    loss = first_loss(d, hf_dir)
    model = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    tokens = batch(data, False, 0, 0, 8)  # iteration 1's global batch (samples 0..7)
    f32 = hf_loss(model, tokens)
    bf16 = hf_loss(round_to_bf16(model), tokens)
    # mxddp computes in f32 with its params in bf16: HF's loss on those params, in f32.
    assert abs(loss - bf16) < 1e-5, (loss, bf16, f32)
    assert abs(loss - f32) < 1e-2  # the f32 weights differ by bf16's rounding only


def test_import_of_a_bf16_model_equals_hfs_loss_exactly_rounded(work):
    """A bf16 save: mxddp's bf16 params are HF's weights, so HF's f32 evaluation is the reference."""
    d, data = work
    hf_dir = save_random_gpt2(d / "random_bf16", dtype=torch.bfloat16)
    loss = first_loss(d, hf_dir)
    model = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert abs(loss - hf_loss(model, batch(data, False, 0, 0, 8))) < 1e-5


def test_import_skip_train_then_export_round_trips(work):
    """--load-hf --skip-train evaluates HF's model; a run from it saves; the export loads back."""
    d, data = work
    hf_dir = save_random_gpt2(d / "random_rt", dtype=torch.bfloat16)
    out = mxddp("train", *RUN, "--data", d / "data.txt", "--load-hf", hf_dir, "--skip-train",
                "--report", d / "rt.json").stdout
    model = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
    report = json.load(open(d / "rt.json"))
    assert abs(report["validation"][0]["loss"] - validation_loss(model, data)) < 1e-5
    assert "--load-hf: attn_pdrop 0.1, embd_pdrop 0.1, resid_pdrop 0.1: mxddp's GPT has no dropout" in out
    # One iteration at lr 0 changes no weight, so its checkpoint holds HF's weights as imported.
    mxddp("train", *RUN, "--data", d / "data.txt", "--load-hf", hf_dir, "--train-iters", "1", "--lr", "0",
          "--min-lr", "0", "--save", d / "rt_ckpt")
    mxddp("ckpt", "export", d / "rt_ckpt", "--format", "hf", "--out", d / "rt_hf")
    back = GPT2LMHeadModel.from_pretrained(d / "rt_hf").eval()
    cfg = json.load(open(d / "rt_hf" / "config.json"))
    assert (cfg["vocab_size"], cfg["n_positions"]) == (320, T)  # the run's sequence: wpe's first T rows
    original = dict(model.named_parameters())
    for name, p in back.named_parameters():
        expected = original[name][:T] if name.endswith("wpe.weight") else original[name]
        assert torch.equal(p, expected), name  # lr 0: the bf16 weights unchanged, through mxddp and back


# ---- --skip-train

def test_skip_train_at_the_last_iteration_reports_the_losses(work, trained):
    d, _ = work
    ckpt, printed = trained
    p = mxddp("train", *RUN, *MODEL, "--data", d / "data.txt", "--train-iters", "12", "--load", ckpt, "--skip-train",
              "--report", d / "skip_fields.json", "--metrics-file", d / "skip_metrics.jsonl")
    assert "evaluation only (--skip-train): the checkpoint --load" in p.stdout and "at iteration 12" in p.stdout
    assert " validation loss at iteration 12 on validation set | lm loss value: " in p.stdout, p.stdout
    assert "nothing to train" not in p.stdout
    r = json.load(open(d / "skip_fields.json"))
    assert r["config"]["skip_train"] is True and r["steps"] == [] and r["start_iteration"] == 12
    assert [e["iteration"] for e in r["validation"]] == [12]
    assert abs(r["validation"][0]["loss"] - printed) < 1e-6  # the same params, batches and dp
    lines = [json.loads(l) for l in open(d / "skip_metrics.jsonl")]
    assert [(l["iteration"], l["lm_loss"]) for l in lines if l["type"] == "validation"] == \
           [(12, r["validation"][0]["loss"])]


def test_skip_train_refusals(work, trained):
    d, _ = work
    ckpt, _ = trained
    base = ["train", *RUN, *MODEL, "--data", d / "data.txt", "--load", ckpt, "--skip-train"]
    assert "--skip-train evaluates --eval-iters batches per split, and --eval-iters is 0" in refused(
        *base, "--eval-iters", "0")
    assert "--skip-train trains nothing, so --save" in refused(*base, "--save", d / "skip_save")


# ---- Hostile and unsupported HF directories

def edited_config(d, name, **changes):
    src = save_random_gpt2(d / "base_model") if not os.path.exists(d / "base_model") else d / "base_model"
    dst = d / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    cfg = json.load(open(dst / "config.json"))
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(dst / "config.json", "w"))
    return dst


def load_hf_error(d, hf_dir, *extra):
    return refused("train", *RUN, "--data", d / "data.txt", "--train-iters", "1", "--load-hf", hf_dir, *extra)


@pytest.mark.parametrize("field, value, message", [
    ("activation_function", "gelu", "activation_function \"gelu\": mxddp's MLP uses GELU's tanh approximation"),
    ("activation_function", "relu", "activation_function \"relu\""),
    ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx true"),
    ("scale_attn_weights", False, "scale_attn_weights false"),
    ("n_inner", 64, "n_inner 64: mxddp's MLP is 4 x n_embd = 128 wide"),
    ("tie_word_embeddings", False, "tie_word_embeddings false"),
    ("layer_norm_epsilon", 1e-6, "layer_norm_epsilon 1e-06: mxddp's LayerNorm epsilon is 1e-05"),
    ("add_cross_attention", True, "add_cross_attention true"),
    ("model_type", "gpt_neo", "model_type \"gpt_neo\""),
    ("architectures", ["GPT2ForSequenceClassification"], "architectures \"GPT2ForSequenceClassification\""),
    ("n_head", 3, "n_head 3"),
    ("vocab_size", "many", "vocab_size is \"many\"; expected an integer"),
])
def test_load_hf_refuses_what_mxddps_gpt_cannot_run(work, field, value, message):
    d, _ = work
    err = load_hf_error(d, edited_config(d, f"bad_{field}", **{field: value}))
    assert message in err, err


def test_load_hf_accepts_gpt2_defaults_and_numerics_only_options(work):
    """Keys left out take GPT2Config's defaults; reorder_and_upcast_attn changes only HF's precision."""
    d, _ = work
    hf_dir = edited_config(d, "defaults", n_inner=..., activation_function=..., reorder_and_upcast_attn=True)
    out = mxddp("train", *RUN, "--data", d / "data.txt", "--train-iters", "1", "--load-hf", hf_dir).stdout
    assert "note: --load-hf: reorder_and_upcast_attn true changes only the precision" in out
    assert "trained iterations 1..1" in out


def test_load_hf_refuses_broken_files(work):
    d, _ = work
    src = save_random_gpt2(d / "base_model") if not os.path.exists(d / "base_model") else d / "base_model"
    # No config.json.
    empty = d / "empty_dir"
    empty.mkdir(exist_ok=True)
    assert "has no config.json" in load_hf_error(d, empty)
    # No model.safetensors (only a pickle).
    pickle = edited_config(d, "pickle_only")
    os.rename(pickle / "model.safetensors", pickle / "pytorch_model.bin")
    assert "has no model.safetensors (only pytorch_model.bin" in load_hf_error(d, pickle)
    # Truncated: the tensors run past the end of the file.
    trunc = edited_config(d, "truncated")
    raw = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(raw[:len(raw) - 100])
    assert "lie outside the" in load_hf_error(d, trunc) and "truncated or damaged" in load_hf_error(d, trunc)
    # Shorter than its own header.
    (trunc / "model.safetensors").write_bytes(raw[:20])
    assert "runs past the file" in load_hf_error(d, trunc)
    # config.json not JSON.
    garbage = edited_config(d, "garbage_config")
    (garbage / "config.json").write_text("{not json")
    assert "is not JSON" in load_hf_error(d, garbage)
    # model.safetensors a directory, or a FIFO: refused, never read (a FIFO would block forever).
    not_file = edited_config(d, "dir_safetensors")
    os.remove(not_file / "model.safetensors")
    os.mkdir(not_file / "model.safetensors")
    assert "model.safetensors' is a directory, not a regular file" in load_hf_error(d, not_file)
    os.rmdir(not_file / "model.safetensors")
    os.mkfifo(not_file / "model.safetensors")
    assert "model.safetensors" in load_hf_error(d, not_file) and "not a regular file" in load_hf_error(d, not_file)


def rewrite_safetensors(path, edit):
    """Re-encodes path's tensors after edit(dict name -> tensor) changes them."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_load_hf_refuses_wrong_tensors(work):
    d, _ = work
    wrong = edited_config(d, "wrong_shape")
    rewrite_safetensors(wrong / "model.safetensors", lambda t: t.__setitem__(
        "transformer.h.1.attn.c_attn.weight", t["transformer.h.1.attn.c_attn.weight"].T.contiguous()))
    err = load_hf_error(d, wrong)
    assert "tensor 'transformer.h.1.attn.c_attn.weight' has shape [96, 32] (F32); GPT-2 of config.json's sizes needs " \
           "[32, 96]" in err, err
    missing = edited_config(d, "missing_tensor")
    rewrite_safetensors(missing / "model.safetensors", lambda t: t.pop("transformer.ln_f.bias"))
    assert "has no tensor 'transformer.ln_f.bias'" in load_hf_error(d, missing)
    extra = edited_config(d, "extra_tensor")
    rewrite_safetensors(extra / "model.safetensors", lambda t: t.__setitem__("transformer.h.2.ln_1.weight", torch.ones(32)))
    assert "holds tensors that are not part of GPT-2 of config.json's 2 layers: transformer.h.2.ln_1.weight" in \
        load_hf_error(d, extra)
    untied = edited_config(d, "untied_head")
    rewrite_safetensors(untied / "model.safetensors", lambda t: t.__setitem__("lm_head.weight", torch.zeros(320, 32)))
    assert "lm_head.weight differs from the token embedding" in load_hf_error(d, untied)
    int_dtype = edited_config(d, "int_tensor")
    rewrite_safetensors(int_dtype / "model.safetensors", lambda t: t.__setitem__(
        "transformer.ln_f.bias", torch.zeros(32, dtype=torch.int32)))
    assert "dtype I32 is not read here; valid: F32, BF16, F16" in load_hf_error(d, int_dtype)


@pytest.mark.parametrize("dtype, name", [(torch.float32, "F32"), (torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_load_hf_refuses_non_finite_weights_naming_the_tensor(work, dtype, name):
    """NaN and Inf in the file are refused at load with the tensor, the count and the first element,
    in the file's own layout and dtype, instead of a NaN loss at iteration 1 blamed on the gradients."""
    d, _ = work
    hf_dir = save_random_gpt2(d / f"non_finite_{name}", dtype=dtype)

    def poison(t):
        w = t["transformer.h.0.attn.c_attn.weight"]  # [32, 96] as HF's Conv1D stores it
        w[2, 5], w[3, 0], w[7, 1] = float("nan"), float("inf"), float("-inf")
    rewrite_safetensors(hf_dir / "model.safetensors", poison)
    err = load_hf_error(d, hf_dir)
    assert f"tensor 'transformer.h.0.attn.c_attn.weight' ({name} [32, 96], mxddp's " \
           "decoder.layers.0.self_attention.linear_qkv.weight) holds 3 non-finite values (1 NaN, 2 +-Inf), the first " \
           "at element 197 [2, 5] = nan: a model to load must be finite" in err, err


def test_load_hf_refuses_contradicting_flags_and_too_small_a_vocabulary(work):
    d, _ = work
    src = save_random_gpt2(d / "base_model") if not os.path.exists(d / "base_model") else d / "base_model"
    assert "a model flag sets num_layers to 3, but --load-hf" in load_hf_error(d, src, "--num-layers", "3")
    assert "--model small and --load-hf" in load_hf_error(d, src, "--model", "small")
    assert "--seq-length 64 is longer than --load-hf" in load_hf_error(d, src, "--seq-length", "64")
    assert "--load 'x' and --load-hf" in load_hf_error(d, src, "--load", "x")
    small_vocab = edited_config(d, "small_vocab", vocab_size=64)
    rewrite_safetensors(small_vocab / "model.safetensors", lambda t: t.__setitem__(
        "transformer.wte.weight", t["transformer.wte.weight"][:64].contiguous()))
    err = load_hf_error(d, small_vocab)
    assert "token id" in err and "the vocabulary has 64 tokens" in err and "the vocabulary of --load-hf" in err, err
