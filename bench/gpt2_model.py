"""The HF GPT-2 the Python benchmarks train (megatron_compare.py, torch_ddp_compare.py,
torch_fsdp_compare.py): dropout off, so every impl sees the same arithmetic, and the input embedding
tied to the LM head, as GPT-2 ships. Imported from this folder."""


def gpt2_lm_head_model(layers: int, hidden: int, seq: int, heads: int | None = None, vocab: int | None = None):
    """A GPT2LMHeadModel with torch's seed set to 0 before its weights are drawn; heads of 64 unless
    given, GPT-2's vocabulary (50257) unless given."""
    import torch
    import transformers

    extra = {} if vocab is None else {"vocab_size": vocab}
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads or hidden // 64, n_positions=seq,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                                     **extra)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)
