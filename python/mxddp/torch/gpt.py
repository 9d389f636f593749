"""``GPT``: mxddp's reference GPT (src/model, docs/model.md) as a torch module.

It has exactly the C++ model's params, in its order, under its (Megatron-style) names and shapes,
and its math, so a checkpoint of one loads into the other (``mxddp train --save`` into this module
with ``mxddp.torch.load_checkpoint``, and a save of this module with ``GPT.model_config()`` into
``mxddp train --load``):

- token embedding ``embedding.word_embeddings.weight`` [V, C] (byte vocabulary, V = 256), also
  the LM head (tied; marked ``shared_embedding`` as the C++ param list marks it), and learned
  positions ``embedding.position_embeddings.weight`` [T, C];
- per layer ``decoder.layers.<l>.``: ``input_layernorm``, ``self_attention.linear_qkv`` [3C, C]
  (rows q | k | v, head h's rows at h*D within each), ``self_attention.linear_proj`` [C, C],
  ``pre_mlp_layernorm``, ``mlp.linear_fc1`` [4C, C], ``mlp.linear_fc2`` [C, 4C]: pre-LayerNorm
  blocks with causal attention (scale 1/sqrt(D)) and a GELU (tanh approximation) MLP;
- ``decoder.final_layernorm``; LayerNorm's epsilon is 1e-5.

The math runs in F32 whatever the params' dtype, as the C++ model's does: with
``module.to(torch.bfloat16)`` (what ``mxddp train`` keeps its params as) each weight is widened to
F32 where it is used. The initialization is GPT-2's (N(0, 0.02), the residual projections
N(0, 0.02 / sqrt(2 L)), biases 0, norm weights 1) from torch's generator: the same distribution
as the C++ model's ``gpt_init_params``, not the same numbers.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

_LAYERNORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """mxddp's ``GptConfig``, its fields and defaults (the ``tiny`` preset)."""
    vocab_size: int = 256
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 64

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{field.name} is {value!r}; valid: a positive int")
        if self.vocab_size > 256:
            raise ValueError(f"GPTConfig.vocab_size is {self.vocab_size}; valid: 1..256 (tokens are bytes)")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"GPTConfig.num_attention_heads {self.num_attention_heads} does not divide "
                             f"hidden_size {self.hidden_size}")

    @classmethod
    def preset(cls, name: str) -> "GPTConfig":
        """``mxddp train --model NAME``'s shape: tiny, small or gpt2-124m."""
        presets = {"tiny": cls(), "small": cls(num_layers=6, hidden_size=384, num_attention_heads=6, seq_length=256),
                   "gpt2-124m": cls(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024)}
        if name not in presets:
            raise ValueError(f"model preset '{name}' is not known; valid: {', '.join(presets)}")
        return presets[name]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


class _Linear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _f32(self.weight), _f32(self.bias))


class _LayerNorm(torch.nn.LayerNorm):
    def __init__(self, size: int):
        super().__init__(size, eps=_LAYERNORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, _f32(self.weight), _f32(self.bias), self.eps)


class _Embedding(torch.nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = torch.nn.Embedding(config.seq_length, config.hidden_size)
        # The C++ param list marks it: with the distributed optimizer it gets a bucket of its own.
        self.word_embeddings.weight.shared_embedding = True
        # The model's forward reads both tables itself (widened to F32, the positions sliced), not
        # through the Embedding modules' forward: every gradient of theirs would reach the
        # Parameters anyway, so fusing them buys nothing and they keep DDP's post-accumulate-grad hook.
        self.word_embeddings.weight.gradient_accumulation_fusion = False
        self.position_embeddings.weight.gradient_accumulation_fusion = False


class _SelfAttention(torch.nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        c = config.hidden_size
        self.heads = config.num_attention_heads
        self.linear_qkv = _Linear(c, 3 * c)
        self.linear_proj = _Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        d = c // self.heads
        q, k, v = self.linear_qkv(x).split(c, dim=-1)  # [B, T, C] each: the q | k | v row blocks
        q, k, v = (z.view(b, t, self.heads, d).transpose(1, 2) for z in (q, k, v))  # [B, H, T, D]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(d))
        return self.linear_proj(y.transpose(1, 2).reshape(b, t, c))  # head h at columns h*D


class _Mlp(torch.nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        c = config.hidden_size
        self.linear_fc1 = _Linear(c, 4 * c)
        self.linear_fc2 = _Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class _Layer(torch.nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        c = config.hidden_size
        self.input_layernorm = _LayerNorm(c)
        self.self_attention = _SelfAttention(config)
        self.pre_mlp_layernorm = _LayerNorm(c)
        self.mlp = _Mlp(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class _Decoder(torch.nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(config) for _ in range(config.num_layers))
        self.final_layernorm = _LayerNorm(config.hidden_size)


class GPT(torch.nn.Module):
    """mxddp's reference GPT. ``model(tokens)`` with tokens [B, S + 1] (int, S <= seq_length: each
    row's first S are the inputs, its last S the targets, as ``mxddp train`` feeds them) returns
    the mean cross-entropy over the B x S targets; ``model.logits(inputs)`` [B, S] -> [B, S, V]."""

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        self.config = GPTConfig() if config is None else config
        if not isinstance(self.config, GPTConfig):
            raise TypeError(f"config must be a mxddp.torch.gpt.GPTConfig; got {type(self.config).__name__}")
        self.embedding = _Embedding(self.config)
        self.decoder = _Decoder(self.config)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's initialization (see the module's doc), from torch's default generator."""
        residual_std = 0.02 / math.sqrt(2.0 * self.config.num_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if name.endswith("layernorm.weight") else 0.0)
            else:
                residual = name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight")
                p.normal_(0.0, residual_std if residual else 0.02)

    def model_config(self) -> dict[str, int]:
        """The config as ``mxddp train`` stores it in a checkpoint (every GptConfig field): pass it
        as ``model_config`` to ``save_checkpoint`` / ``load_checkpoint``."""
        return dataclasses.asdict(self.config)

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.dim() != 2 or inputs.dtype not in (torch.int32, torch.int64, torch.uint8):
            raise ValueError(f"inputs must be integer tokens [batch, seq]; got {inputs.dtype} {tuple(inputs.shape)}")
        s = inputs.shape[1]
        if not 1 <= s <= self.config.seq_length:
            raise ValueError(f"sequence of {s} tokens; valid: 1..seq_length ({self.config.seq_length})")
        inputs = inputs.long()
        wte = _f32(self.embedding.word_embeddings.weight)
        x = F.embedding(inputs, wte) + _f32(self.embedding.position_embeddings.weight)[:s]
        for layer in self.decoder.layers:
            x = layer(x)
        return self.decoder.final_layernorm(x) @ wte.t()  # the tied LM head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[1] < 2:
            raise ValueError(f"tokens must be [batch, seq + 1] with seq >= 1; got {tuple(tokens.shape)}")
        logits = self.logits(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].long().reshape(-1))
