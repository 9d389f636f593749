"""One iteration's backward over micro-batches, shared by the tests that train (mxddp's DDP or
torch's): every micro-batch but the last under ``model.no_sync()``, as Megatron's and torch's
gradient accumulation run."""
import contextlib


def backward_micro_batches(model, loss_fn, batch_fn, rank, step, micro_batches):
    """Runs forward and backward of ``micro_batches`` micro-batches (each loss divided by their
    count); returns the iteration's loss, their sum."""
    total = 0.0
    for m in range(micro_batches):
        with model.no_sync() if m < micro_batches - 1 else contextlib.nullcontext():
            loss = loss_fn(model, batch_fn(rank, step, m)) / micro_batches
            loss.backward()
        total += loss.item()
    return total
