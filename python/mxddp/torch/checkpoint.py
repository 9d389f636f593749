"""Checkpoints of a ``DistributedDataParallel`` or ``FullyShardedDataParallel`` and its
``DistributedOptimizer`` in mxddp's format (the two interchange: slices are unpadded and resharded).

The C++ checkpoint layer does all of it (include/mxddp/checkpoint.h, checkpoint_history.h): each
rank writes its shard of the F32 main params, the optimizer state and the model params as
unpadded slices (safetensors), rank 0 a checksummed manifest, all atomically; a load checks
everything before changing anything and reshards to any dp and bucket size. Saves go into the
history layout ``mxddp train --save DIR`` writes (``DIR/iter_0000100/``,
``DIR/latest_checkpointed_iteration.txt``), so ``mxddp train --load DIR`` and ``mxddp ckpt
inspect/export DIR`` read them, and these functions read theirs.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Optional, Union

from mxddp import _C
from mxddp.torch import agreement, launch
from mxddp.torch.wrapper import DataParallelModule
from mxddp.torch.optimizer import DistributedOptimizer

PathLike = Union[str, "os.PathLike[str]"]

# Metadata keys the functions own: the iteration of the save (what `mxddp train` resumes from).
_ITERATION_KEY = "iteration"
# What the C++ side's int64 iteration and int keep_last hold.
_ITERATION_MAX = 2 ** 63 - 1
_KEEP_LAST_MAX = 2 ** 31 - 1


def _check_pair(model, optimizer, what: str) -> None:
    if not launch.is_initialized():
        raise RuntimeError(f"mxddp is not initialized: call mxddp.torch.init() first (before {what})")
    if not isinstance(model, DataParallelModule):
        raise TypeError(f"{what}: model must be a mxddp.torch.DistributedDataParallel or FullyShardedDataParallel; "
                        f"got {type(model).__name__}")
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(f"{what}: optimizer must be a mxddp.torch.DistributedOptimizer; got {type(optimizer).__name__}")
    if optimizer.model is not model:
        raise ValueError(f"{what}: the optimizer steps on another model than the one given; pass the "
                         "model the optimizer was built on")
    model._refuse_hybrid(what)


def _path(value, name: str) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike); got {type(value).__name__}")
    path = os.fspath(value)
    if not isinstance(path, str) or not path:
        raise ValueError(f"{name} must be a non-empty path; got {value!r}")
    if "\0" in path:  # the C++ side would stop at it and use a shorter path
        raise ValueError(f"{name} {path!r} holds a NUL character; a path cannot")
    return path


def _agreed(what: str, model, check):
    """Runs ``check()`` (this rank's argument checks, returning ``(result, items)``: the arguments as
    text pairs) and returns its result once every rank of the model's group gave the same items.
    Ranks saving into different directories (or with other metadata, config or keep_last) would
    each write part of a checkpoint somewhere, and a prune could then remove the last complete one;
    a load from different directories would mix states. Every rank raises naming the first
    argument that differs, or a rank's own failed check (agreement.py)."""
    return agreement.agree(what, check, model._comm, differ="do not pass the same arguments",
                           advice="Every rank calls it with the same arguments (a collective); nothing was written "
                                  "or loaded")


def _config_value_text(key: str, value) -> str:
    # The manifest stores a value that is a JSON number written canonically as that number, so an
    # int's text (and a finite float's repr) compares equal to what `mxddp train` saves.
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"model_config['{key}'] is {type(value).__name__}; valid: int, float or str")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"model_config['{key}'] is {value}; a model config value must be finite")
    return value if isinstance(value, str) else repr(value)


def _model_config_fields(model_config: Optional[Mapping]) -> list[tuple[str, str]]:
    if model_config is None:
        return []
    if not isinstance(model_config, Mapping):
        raise TypeError(f"model_config must be a mapping of field names to values; got {type(model_config).__name__}")
    fields = []
    for key, value in model_config.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"model_config keys must be non-empty strings; got {key!r}")
        fields.append((key, _config_value_text(key, value)))
    return fields


def save_checkpoint(save_dir: PathLike, model: DataParallelModule, optimizer: DistributedOptimizer,
                    iteration: int, *, metadata: Optional[Mapping[str, str]] = None,
                    model_config: Optional[Mapping] = None, keep_last: int = 0) -> str:
    """Collective: every rank calls it with the same arguments. Saves the model's params (those
    mxddp holds: the trainable ones) and the optimizer (main params, state, step count) into
    ``save_dir/iter_<iteration, 7 digits>/``, replacing an earlier save of that iteration, then
    points ``save_dir/latest_checkpointed_iteration.txt`` at it and, with ``keep_last`` N > 0,
    removes the oldest ``iter_`` directories below it until N remain. Returns the ``iter_``
    directory.

    ``metadata``: str -> str, stored in the manifest and returned by ``load_checkpoint``
    (``"iteration"`` is this function's). ``model_config``: field -> int, float or str, stored in
    the manifest and compared field by field by a load that passes one; ``mxddp train --load``
    and ``mxddp ckpt inspect`` read it as the GPT's config (``mxddp.torch.gpt.GPT.model_config()``),
    so leave it out for other models (put what you need in ``metadata``).

    save_dir must be new, empty or a checkpoint history. Rank 0 takes its ``mxddp.lock`` at this
    run's first save into it and holds it until ``mxddp.torch.shutdown()`` (at interpreter exit) or
    the process's end, as ``mxddp train --save`` does for its run: another run saving into it (this
    package or ``mxddp train``) meanwhile is refused on every rank, naming the directory and the
    holder (pid, host, since when), and so is this save while another run holds it.
    Frozen params and module buffers (e.g. BatchNorm statistics) are not saved.
    """
    _check_pair(model, optimizer, "save_checkpoint")

    def check():
        path = _path(save_dir, "save_dir")
        if isinstance(iteration, bool) or not isinstance(iteration, int):
            raise TypeError(f"iteration must be an int; got {type(iteration).__name__}")
        if not 0 <= iteration <= _ITERATION_MAX:
            raise ValueError(f"iteration {iteration} is not valid: 0 to 2**63 - 1")
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or not 0 <= keep_last <= _KEEP_LAST_MAX:
            raise ValueError(f"keep_last {keep_last!r} is not valid: an int, 0 (keep every save) to 2**31 - 1")
        meta = {}
        if metadata is not None:
            if not isinstance(metadata, Mapping):
                raise TypeError(f"metadata must be a mapping of str to str; got {type(metadata).__name__}")
            for key, value in metadata.items():
                if not isinstance(key, str) or not isinstance(value, str):
                    raise TypeError(f"metadata must map str to str; got {key!r}: {type(value).__name__}")
                meta[key] = value
        if _ITERATION_KEY in meta:
            raise ValueError("metadata['iteration'] is set by save_checkpoint from its iteration argument; "
                             "leave it out")
        meta[_ITERATION_KEY] = str(iteration)
        fields = _model_config_fields(model_config)
        if model._grads_pending_sync:
            raise RuntimeError("save_checkpoint: gradients were reported but not synchronized; call "
                               "model.finish_grad_sync() (and opt.step()) first")
        items = [("save_dir", os.path.abspath(path)), ("iteration", str(iteration)), ("keep_last", str(keep_last)),
                 ("metadata", json.dumps(meta, sort_keys=True)), ("model_config", json.dumps(fields))]
        return (path, meta, fields), items

    path, meta, fields = _agreed("save_checkpoint", model, check)
    optimizer._take_param_writes()  # values written into the params are what is saved
    return _C.save_checkpoint(path, optimizer._cpp, iteration, meta, fields, keep_last)


def load_checkpoint(load_dir: PathLike, model: DataParallelModule,
                    optimizer: DistributedOptimizer, *,
                    model_config: Optional[Mapping] = None) -> tuple[int, dict[str, str]]:
    """Collective. Loads a checkpoint history's newest save (``load_dir`` holds
    ``latest_checkpointed_iteration.txt``), or one ``iter_`` directory, into the model's params and
    the optimizer (main params, state and step count; the lr and other hyper-parameters stay the
    optimizer's own), at any dp and bucket size. Returns ``(iteration, metadata)``.

    Everything is read and checked first (the manifest's checksum, each rank file's size, CRC-32
    and tensors, the param list's names, shapes and order against this model's, the optimizer's
    kind, ``model_config`` field by field when given, and an iteration in the metadata); on any
    failure every rank raises ``mxddp.Error`` naming the problem, and the model and optimizer are
    as they were.
    """
    _check_pair(model, optimizer, "load_checkpoint")

    def check():
        path = _path(load_dir, "load_dir")
        fields = _model_config_fields(model_config)
        if model._grads_pending_sync:
            raise RuntimeError("load_checkpoint: gradients were reported but not synchronized; call "
                               "model.finish_grad_sync() first")
        return (path, fields), [("load_dir", os.path.abspath(path)), ("model_config", json.dumps(fields))]

    path, fields = _agreed("load_checkpoint", model, check)
    optimizer._take_param_writes()  # so that a failed load leaves them as a step would take them
    _resolved, meta = _C.load_checkpoint(path, optimizer._cpp, fields, [_ITERATION_KEY])
    optimizer._record_param_versions()  # the params hold the loaded values (written by the C++ load)
    return int(meta[_ITERATION_KEY]), dict(meta)
