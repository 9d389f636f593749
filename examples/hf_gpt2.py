"""An HF transformers GPT2LMHeadModel (random init, tied embedding) trained with mxddp (docs/python.md).

    mpirun --allow-run-as-root --oversubscribe -np 2 build/pyvenv-torch/bin/python examples/hf_gpt2.py
    ... examples/hf_gpt2.py --fsdp optim_grads_params [--fine-grained] [--recompute]

Byte-level language modelling of this repository's README: each rank reads its own windows of it.
The tied token embedding / LM head is one param, registered once. --fsdp: Megatron-FSDP with a unit
per GPT2Block (the tied embedding, wpe and ln_f are non-unit params) instead of DDP.
"""
import argparse
from pathlib import Path

import torch
import transformers

import mxddp.torch as mxt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--fsdp", choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                        help="FullyShardedDataParallel with this sharding strategy instead of DDP")
    parser.add_argument("--fine-grained", action="store_true", help="with --fsdp: a unit per weighted submodule")
    parser.add_argument("--recompute", action="store_true", help="recompute each block's forward in backward")
    args = parser.parse_args()

    rank, world = mxt.init()
    torch.set_num_threads(1)
    text = (Path(__file__).resolve().parent.parent / "README.md").read_bytes()
    corpus = torch.tensor(list(text), dtype=torch.long)

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=128, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    module = transformers.GPT2LMHeadModel(config)
    if args.recompute:
        # HF's activation checkpointing by the name the installed transformers has (renamed after 5.17).
        if hasattr(module, "activation_checkpointing_enable"):
            module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        module.train()
    if args.fsdp:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        model = mxt.FullyShardedDataParallel(module, mxt.DistributedDataParallelConfig(
            use_megatron_fsdp=True, use_distributed_optimizer=True, data_parallel_sharding_strategy=args.fsdp,
            overlap_grad_reduce=True, overlap_param_gather=True, grad_reduce_in_fp32=True,
            megatron_fsdp_enable_fine_grained_param_gather=True if args.fine_grained else None),
            fsdp_unit_modules=[GPT2Block])
    else:
        model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
            overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=100_000, grad_reduce_in_fp32=True))
    opt = mxt.DistributedOptimizer(model, mxt.OptimizerConfig(lr=1e-3, weight_decay=0.1, adam_beta2=0.95))
    data = torch.Generator().manual_seed(1 + rank)

    for step in range(1, args.steps + 1):
        opt.zero_grad()
        starts = torch.randint(0, len(corpus) - args.seq, (args.batch,), generator=data)
        ids = torch.stack([corpus[s:s + args.seq] for s in starts.tolist()])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.finish_grad_sync()
        _, grad_norm, _ = opt.step()
        mean = loss.detach().reshape(1).clone()
        mxt.all_reduce(mean, "avg")
        if rank == 0 and (step == 1 or step % 10 == 0):
            print(f"step {step:4d}  loss {mean.item():.4f} nats/byte  grad norm {grad_norm:.3f}", flush=True)
    if rank == 0:
        n = sum(p.numel() for p in module.parameters())
        if args.fsdp:
            gathered = model.peak_gathered_bytes()["values"]
            print(f"dp {world}: {n} params (tied embedding once); FSDP {args.fsdp}, {model.num_units} units, "
                  f"{gathered} bytes gathered at most")
        else:
            print(f"dp {world}: {n} params (tied embedding once); {model.num_buckets} buckets")


if __name__ == "__main__":
    main()
