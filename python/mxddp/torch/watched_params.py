"""A wrapped param's ``.data``, made a write its version counter counts (param_writes.py keeps it).

``p.data`` is torch's escape from autograd: a tensor on the same storage with a version counter of
its own, so ``p.data.clamp_()`` (WGAN's clipping), ``p.data.mul_(mask)`` (pruning) or
``p.data.copy_(v)`` move no counter the Parameter shows, and param_writes.py, which finds writes by
those counters, would miss them: with BF16 params the next step would write the old values back.
While wrapped, each registered param that is an exact ``torch.nn.Parameter`` is given the subclass
``WatchedParameter`` (a ``__class__`` swap: the same object, which the script and its optimizer's
param groups hold), whose ``.data`` is ``p.detach()``: the same storage, shape and strides, not
requiring grad, but sharing the Parameter's counter. So a write through it counts as ``p.copy_``
under ``torch.no_grad()`` does, and a read costs nothing. The one difference from torch's
``.data``: such a write between a forward and its backward makes the backward raise torch's
"modified by an inplace operation" error where the forward saved the param (LayerNorm's weight,
say), where ``.data`` would let it compute with the new values silently (as it still does for the
weights whose gradient mxddp accumulates itself, grad_fusion.py). Assigning ``p.data = t``
is torch's (the wrappers refuse it at the next forward).

A copy of a watched param (``copy.deepcopy``, ``type(p)(data)``, a pickle) is a plain
``torch.nn.Parameter``, and a pickle leaves out DDP's ``main_grad`` (a view of its grad buffer);
``close()`` gives the params their class back.
"""
from __future__ import annotations

import torch

_data_set = torch._C.TensorBase.data.__set__


class WatchedParameter(torch.nn.Parameter):
    """A registered param while wrapped: a ``torch.nn.Parameter`` whose ``.data`` shares its version
    counter."""

    def __new__(cls, data=None, requires_grad=True):  # type(p)(data): a plain Parameter
        return torch.nn.Parameter(data, requires_grad)

    @property
    def data(self):
        return self.detach()

    @data.setter
    def data(self, value):
        _data_set(self, value)

    def __repr__(self):  # torch's, as for a plain Parameter
        return "Parameter containing:\n" + torch._tensor_str._str(self.detach().requires_grad_(self.requires_grad))

    def __getstate__(self):  # what a pickle (torch.save(model.module)) keeps
        state = {k: v for k, v in self.__dict__.items() if k != "main_grad"}
        return state or None

    def __deepcopy__(self, memo):  # a plain Parameter, as a pickle gives (torch's __reduce_ex__)
        if id(self) not in memo:
            memo[id(self)] = torch.nn.Parameter(self.detach().clone(memory_format=torch.preserve_format),
                                                self.requires_grad)
        return memo[id(self)]


def watch(params) -> None:
    """At wrap: the exact torch.nn.Parameters among `params` become watched."""
    for p in params:
        if type(p) is torch.nn.Parameter:
            p.__class__ = WatchedParameter


def unwatch(params) -> None:
    """At close: the watched params among `params` are plain torch.nn.Parameters again."""
    for p in params:
        if type(p) is WatchedParameter:
            p.__class__ = torch.nn.Parameter
