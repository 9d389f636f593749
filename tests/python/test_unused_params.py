"""Unused params against torch DDP(find_unused_parameters=True) + torch.optim.AdamW (issue 43 item 3):
a branch every rank skips on some steps gets no gradient there, and AdamW leaves it untouched (no
decay, no moment update) as torch does for a param whose .grad is None; with and without overlap,
with a replicated optimizer (torch's form) and with the distributed one (Megatron's form). The
model's clip_grad_norm_ clips as torch.nn.utils.clip_grad_norm_. Runs under mpirun at 2 and 4 ranks."""
import copy

import pytest
import torch

import mxddp.torch as mxt


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(8, 16)
        self.branch = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("form", ["torch", "megatron_no_overlap", "megatron_distributed_overlap"])
def test_unused_branch_matches_torch_ddp_with_adamw(ranks, form):
    rank, _ = ranks
    torch.manual_seed(0)
    module = Branchy()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(module), find_unused_parameters=True)
    ref_opt = adamw(ref.parameters())
    if form == "torch":
        model = mxt.DistributedDataParallel(module, find_unused_parameters=True)
    else:
        overlap = form == "megatron_distributed_overlap"
        model = mxt.DistributedDataParallel(module, mxt.DistributedDataParallelConfig(
            overlap_grad_reduce=overlap, use_distributed_optimizer=overlap, bucket_size=200 if overlap else None),
            find_unused_parameters=True)
    opt = mxt.DistributedOptimizer(model, adamw(module.parameters()))
    gen = torch.Generator().manual_seed(rank)
    try:
        for step in range(8):
            use = step % 3 != 1  # skipped by every rank on steps 1, 4, 7 (after AdamW has moments)
            x = torch.randn(4, 8, generator=gen)
            opt.zero_grad()
            loss = model(x, use_branch=use).square().mean()
            loss.backward()
            model.finish_grad_sync()  # Megatron's form; a no-op in torch's
            norm = model.clip_grad_norm_(1.0)
            opt.step()
            ref_opt.zero_grad()
            ref_loss = ref(x, use_branch=use).square().mean()
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            assert abs(loss.item() - ref_loss.item()) <= 1e-5, step
            assert abs(float(norm) - float(ref_norm)) <= 1e-5 * max(1.0, float(ref_norm)), step
            names = [n for n, _ in model.registered_params()]
            assert [names[i] for i in model._unused_params] == ([] if use else ["branch.weight", "branch.bias"])
            for (n, p), q in zip(module.named_parameters(), ref.module.parameters()):
                torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"step {step} {n}: {m}")
    finally:
        opt.close()
        model.close()
