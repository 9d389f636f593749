"""Wrap-time agreement across ranks: every rank must wrap the same params with the same configs.

Ranks that build different models (a param ``[64, 16]`` on one rank and ``[16, 64]`` on another,
which have the same size and so the same layout) or pass different configs (``lr=1e-2`` against
``lr=1.0``) would train silently wrong, or stall in a collective whose sizes no longer match. So
``DistributedDataParallel``, ``FullyShardedDataParallel`` and ``DistributedOptimizer`` describe
what they are about to build as ordered ``(item, value)`` text pairs and call ``agree()`` before
anything is allocated. It all-gathers a SHA-256 of the description (32 bytes per rank, the only
cost when the ranks agree); only when the digests differ does it exchange the descriptions
themselves, so that every rank raises the same error naming the first item that differs, each
value and the ranks holding it (as ``mxddp train``'s launch check, include/mxddp/launch_check.h,
does for its flags).

A rank whose own checks fail before it has a description (a param of a dtype mxddp does not take)
still takes part: ``agree()`` is given its error instead, and every rank raises, the failing one
its own exception and the others an error naming that rank and quoting it, so no rank is left
waiting in the exchange.
"""
from __future__ import annotations

import hashlib
import json
from typing import Callable, Optional, Sequence, TypeVar

from mxddp import _C

Items = list[tuple[str, str]]
T = TypeVar("T")

# A description that is a rank's own failure rather than its items (a key no item has).
_FAILED = "\0failed"
# How a text's length travels: 8 bytes, little-endian.
_LENGTH_BYTES = 8


def param_items(names: Sequence[str], params: Sequence, mxfp8: Sequence[bool] = ()) -> Items:
    """One item per registered param, by position: its name, shape, dtype and kind of device (the
    index may differ: rank r on cuda:r), and whether it is kept as MXFP8, or marked as a shared
    embedding (both change the layout)."""
    items = []
    for i, (name, p) in enumerate(zip(names, params)):
        extra = (" shared_embedding" if getattr(p, "shared_embedding", False) else "") + \
            (" mxfp8" if i < len(mxfp8) and mxfp8[i] else "")
        place = "" if p.device.type in ("cpu", "meta") else f" on {p.device.type}"
        items.append((f"param #{i}", f"'{name}' {list(p.shape)} {p.dtype}{place}{extra}"))
    return items


# What a disagreement at wrap time says the ranks should do.
_WRAP_ADVICE = ("Every rank must wrap the same module (the same trainable params, names, shapes, dtypes and order) "
                "with the same configs; otherwise the ranks train silently wrong or stall in a collective")


def agree(what: str, describe: Callable[[], tuple[T, Items]], comm=None, differ: str = "do not build the same thing",
          advice: str = _WRAP_ADVICE) -> T:
    """Collective over comm (a ``_C.Communicator`` handle; None: the world): every rank of it calls it
    at the same point. Runs ``describe()`` (this rank's checks,
    returning ``(result, items)``) and returns its result when every rank gave the same items.
    Otherwise raises ``mxddp.Error`` on every rank naming the first item that differs (``what``
    names the constructor); a rank whose ``describe()`` raised re-raises its own exception, the
    others an error quoting it. With one rank nothing is exchanged."""
    try:
        result, items = describe()
        failure: Optional[BaseException] = None
        description = json.dumps(items)
    except Exception as e:  # noqa: BLE001 (passed on to every rank, then re-raised)
        result, failure = None, e
        description = json.dumps([[_FAILED, f"{type(e).__name__}: {e}"]])
    size = comm.size if comm is not None else (_C.world_size() if _C.is_initialized() else 1)
    if size > 1:  # uninitialized: the C++ constructor says so next
        digest = hashlib.sha256(description.encode()).digest()
        if len(set(_C.all_gather_bytes(digest, comm))) > 1:
            descriptions = [[tuple(item) for item in json.loads(d)] for d in _all_gather_text(description, comm)]
            if failure is None:
                raise _C.Error(_disagreement(what, descriptions, differ, advice))
    if failure is not None:
        raise failure
    return result


def _all_gather_text(text: str, comm=None) -> list[str]:
    """Every rank's text, in rank order: the lengths first, so that every rank sends as many bytes."""
    data = text.encode()
    lengths = [int.from_bytes(n, "little")
               for n in _C.all_gather_bytes(len(data).to_bytes(_LENGTH_BYTES, "little"), comm)]
    padded = _C.all_gather_bytes(data.ljust(max(lengths), b"\0"), comm)
    return [p[:n].decode() for p, n in zip(padded, lengths)]


def _rank_list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _values_by_rank(values: list[Optional[str]]) -> str:
    """'a' on rank 0; 'b' on ranks 1, 2 (values in the order of their first rank)."""
    groups: dict[Optional[str], list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{'(absent)' if v is None else v} on {_rank_list(rs)}" for v, rs in groups.items())


def _disagreement(what: str, descriptions: list[Items], differ: str, advice: str) -> str:
    """The message every rank raises: a failing rank's error, else the first differing item."""
    failed = [(r, d[0][1]) for r, d in enumerate(descriptions) if d and d[0][0] == _FAILED]
    if failed:
        errors = failed[0][1] if len(failed) == 1 else "; ".join(f"rank {r}: {message}" for r, message in failed)
        return f"{what}: {_rank_list([r for r, _ in failed])} cannot build it, so no rank does: {errors}"
    # Items by their earliest place on any rank: a param only some ranks have comes before the
    # configs, at its own place.
    place: dict[str, int] = {}
    for d in descriptions:
        for i, (k, _) in enumerate(d):
            place[k] = min(place.get(k, i), i)
    keys = sorted(place, key=place.__getitem__)
    per_rank = [dict(d) for d in descriptions]
    differing = [k for k in keys if len({values.get(k) for values in per_rank}) > 1]
    first = differing[0]
    more = f" ({len(differing) - 1} more differ after it)" if len(differing) > 1 else ""
    counts = [sum(1 for k in d if k.startswith("param #")) for d in per_rank]
    count_note = "" if len(set(counts)) == 1 else \
        f"; the numbers of params differ: {_values_by_rank([str(c) for c in counts])}"
    return (f"{what}: the {len(descriptions)} ranks {differ}: {first} is "
            f"{_values_by_rank([values.get(first) for values in per_rank])}{count_note}{more}. {advice}")
