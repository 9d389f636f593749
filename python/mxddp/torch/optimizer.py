"""``DistributedOptimizer``: mxddp's C++ distributed optimizer stepping on a DDP's buffers, as a
``torch.optim.Optimizer``.

Each rank keeps F32 main params and the AdamW (or SGD) state for its shard of every bucket; a step
computes the global grad norm, clips, updates the shard and all-gathers the updated params into the
param buffer, which the torch params are views of.

Built from a user's ``torch.optim.AdamW``, ``Adam`` or ``SGD`` (torch_optimizer.py says what is
honoured and what refused) it behaves as that optimizer: its ``param_groups`` (lr, weight_decay,
betas, eps, momentum per group, read at every step, so a script or any ``torch.optim.lr_scheduler``
drives them), params no group holds not trained, a param the model reports unused this iteration
(``model._unused_params``) left untouched as torch leaves a param whose grad is None,
``state_dict()``/``load_state_dict()`` in torch's format (optimizer_state.py), ``zero_grad``,
``clip_grad_norm_``. Built from an ``OptimizerConfig`` it is Megatron's: two groups (decay for
params of two or more dimensions, none for the rest, with ``lr_mult``/``wd_mult`` that Megatron's
``OptimizerParamScheduler`` reads), clipping by ``clip_grad``, ``step()`` returning Megatron's triple.

A step whose global grad norm is NaN or Inf is skipped (nothing changes). The first of a run of
skipped steps warns, naming the norm, the params whose gradients hold the NaN or Inf and, per rank,
the params whose own values do (found only then: a step that goes through pays nothing for it);
more than ``OptimizerConfig.max_consecutive_skipped_steps`` in a row raise on every rank, since a
NaN that persists (one rank's param) would otherwise skip every step forever, silently.
"""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Optional

import torch

from mxddp import _C
from mxddp.torch import agreement, launch, optimizer_state, param_writes, torch_optimizer
from mxddp.torch.config import OptimizerConfig
from mxddp.torch.wrapper import DataParallelModule

# Params a skipped step's message names before it only counts the rest.
_NAMES_SHOWN_MAX = 8


def _number_text(v) -> str:
    """A group value as the ranks compare it: 1 and 1.0 (an lr written either way) are the same value."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return repr(float(v))
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_number_text(x) for x in v) + ")"
    return repr(v)


def _group_text(group: dict) -> str:
    return repr(sorted((k, _number_text(v)) for k, v in group.items() if k != "params"))


class SkippedStepWarning(RuntimeWarning):
    """``DistributedOptimizer.step()`` skipped a step: its global grad norm was NaN or Inf."""


def _name_list(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_NAMES_SHOWN_MAX])
    return shown + (f" and {len(names) - _NAMES_SHOWN_MAX} more ({len(names)} in all)"
                    if len(names) > _NAMES_SHOWN_MAX else "")


class DistributedOptimizer(torch.optim.Optimizer):
    """Megatron-core's distributed optimizer for a ``mxddp.torch.DistributedDataParallel`` or a
    ``mxddp.torch.FullyShardedDataParallel``, driven either by Megatron's ``OptimizerConfig`` or by
    a user's ``torch.optim.AdamW``/``Adam``/``SGD`` over the model's params. With
    ``use_distributed_optimizer=True`` (and FSDP's sharded strategies) each rank holds its shard of
    the state; otherwise every rank updates the whole model (a replicated optimizer).

    ``torch.amp.GradScaler`` works with it through torch's contract for optimizers that handle
    scaling themselves (``_step_supports_amp_scaling``, the scaler passing itself to ``step``; torch
    warns once that it will change that contract): the grads live in mxddp's buffer, not in
    ``.grad``, so the scaler cannot unscale or check them itself. The step unscales them as it
    updates (a multiplier, no extra pass), decides found_inf from the global grad norm (the same on
    every rank, so the scales stay equal), skips on it and records it for ``scaler.update()``. After
    ``scaler.unscale_(opt)``, ``clip_grad_norm_`` and ``get_grad_norm`` report the unscaled norm."""

    _step_supports_amp_scaling = True

    def __init__(self, model: DataParallelModule, optimizer, config_overrides: Optional[dict] = None, *,
                 release_heap_after_step: bool = True):
        """optimizer: a mxddp.torch.OptimizerConfig (Megatron's) or a torch.optim.AdamW/Adam/SGD.
        With an OptimizerConfig the param groups are megatron-core's (megatron_groups.py: no decay
        for biases and 1-D params); config_overrides (OptimizerConfig only) is megatron-core's
        ``{ParamKey: override}`` on top of them.

        release_heap_after_step: after each step, hand the pages of the heap's free blocks back to
        the system (glibc's ``malloc_trim``; nothing elsewhere). glibc keeps the holes a step's freed
        activations leave in its heap resident, and the next step's peak comes on top of them: on
        issue 44's GPT-2 that is 1.2 GiB per rank, and the peak falls from 1.02x Megatron's to 0.82-0.84x.
        It costs about 1% of that step (the walk, and the pages faulted back in)."""
        if not isinstance(release_heap_after_step, bool):
            raise TypeError(f"DistributedOptimizer: release_heap_after_step must be a bool; got "
                            f"{release_heap_after_step!r}")
        megatron = isinstance(optimizer, OptimizerConfig)

        def describe():
            if not isinstance(model, DataParallelModule):
                raise TypeError("model must be a mxddp.torch.DistributedDataParallel or FullyShardedDataParallel; "
                                f"got {type(model).__name__}")
            if model.ddp_config.reuse_grad_buf_for_mxfp8_param_ag and model._open_optimizers():
                # Each one's zero_grad() stages its main params into the one grad buffer and gathers
                # it: a second one's step would wait unstaged while the model ran on.
                raise ValueError("DistributedOptimizer: this model already has an open DistributedOptimizer, and with "
                                 "reuse_grad_buf_for_mxfp8_param_ag it takes one (its zero_grad() stages the step "
                                 "into the grad buffer the params are gathered from); give one optimizer several "
                                 "param groups instead, or close the other first")
            if megatron:
                optimizer.check_model(model, exact=False)
                kind, groups, defaults, of = self._megatron_groups(model, optimizer, config_overrides)
                items = optimizer.agreement_items() + [("group_of_param", repr(of))]
                items += [(f"param_groups[{i}]", _group_text(g))
                          for i, g in enumerate(groups)]
                return (kind, groups, defaults, of), items
            if config_overrides is not None:
                raise ValueError("DistributedOptimizer: config_overrides applies to an OptimizerConfig (Megatron's "
                                 "param groups); with a torch optimizer give its param_groups instead")
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError("DistributedOptimizer(model, optimizer): optimizer must be a mxddp.torch.OptimizerConfig "
                                "or a torch.optim.AdamW, Adam or SGD built over the model's params; got "
                                f"{type(optimizer).__name__}")
            kind = torch_optimizer.kind_of(optimizer)
            for i, g in enumerate(optimizer.param_groups):
                torch_optimizer.check_group(kind, i, g, construction=True)
            of = torch_optimizer.group_of_params(model, optimizer.param_groups)
            groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                      for g in optimizer.param_groups]
            items = [("optimizer", type(optimizer).__name__), ("group_of_param", repr(of))]
            items += [(f"param_groups[{i}]", _group_text(g))
                      for i, g in enumerate(groups)]
            return (kind, groups, dict(optimizer.defaults), of), items

        # Every rank the same config or groups, checked before anything is built.
        kind, groups, defaults, of = agreement.agree("DistributedOptimizer", describe)
        self._constructed = False
        super().__init__(groups, defaults)
        self._constructed = True
        self.model = model
        self._kind = kind
        self._megatron = megatron
        self._group_of = of
        self.config = optimizer if megatron else None
        cfg = optimizer.to_cpp() if megatron else _C.OptimizerConfig()
        if not megatron:
            cfg.optimizer = kind
            cfg.clip_grad = 0.0  # the user clips with clip_grad_norm_
        self._cpp = _C.DistributedOptimizer(model._cpp, cfg)
        self._closed = False
        model._add_optimizer(self)
        if model._param_versions is None:
            # The main params were just taken from the params. (With another optimizer open, writes
            # it has yet to take stay pending: this one's main params hold them already.)
            param_writes.record(model)
        self._cpp.set_param_groups(of, [self._hyper(g, i) for i, g in enumerate(self.param_groups)])
        # Group membership is fixed here (the state is laid out over the model's buffers): each
        # group's params, to refuse a later edit of the lists instead of ignoring it.
        self._group_params = [[id(p) for p in g["params"]] for g in self.param_groups]
        self._consecutive_skipped_steps = 0
        self._release_heap_after_step = release_heap_after_step
        # The next step's grad multiplier from clip_grad_norm_ (GradScaler's 1/scale is read at the step).
        self._clip_coeff = 1.0
        self._scaler_ref = None  # the GradScaler that last stepped this optimizer
        self._stepped = False
        launch._track_optimizer(self)
        if not megatron and len(optimizer.state) != 0:
            # A torch optimizer that holds state (it stepped, or a script loaded a checkpoint into it
            # before wrapping, as nanoGPT's train.py does on resume): that state moves in, and the
            # torch optimizer's own copy is freed (its memory would otherwise stay held twice).
            self.load_state_dict(optimizer.state_dict())
            optimizer.state.clear()
        self._torch_optimizer = None if megatron else weakref.ref(optimizer)
        if not megatron:
            torch_optimizer.retire(optimizer, self)

    @staticmethod
    def _megatron_groups(model, config: OptimizerConfig, config_overrides: Optional[dict]):
        """Megatron-core 0.16's param groups (megatron_groups.py: no decay for biases and 1-D params,
        lr_mult, decoupled lr, the caller's overrides), over the wrapper's named params."""
        from mxddp.torch.megatron_groups import megatron_param_groups
        groups = megatron_param_groups(list(model.named_parameters()), config, config_overrides)
        of = torch_optimizer.group_of_params(model, groups)
        defaults = {"lr": float(config.lr), "weight_decay": float(config.weight_decay)}
        return "adam" if config.optimizer == "adam" else "sgd", groups, defaults, of

    def _hyper(self, group: dict, index: int) -> tuple:
        if self._megatron:
            c = self.config
            # A group's own betas, eps or momentum (a config_overrides entry, or a script's edit) wins over
            # the config's, as in Megatron, whose torch optimizer reads them from the group.
            torch_optimizer.check_numbers(index, group)
            betas = group.get("betas", (c.adam_beta1, c.adam_beta2))
            # decoupled_weight_decay=False is torch's Adam (L2 decay added to the grad), as Megatron's.
            return (float(group["lr"]), float(group["weight_decay"]), float(betas[0]), float(betas[1]),
                    float(group.get("eps", c.adam_eps)), float(group.get("momentum", c.sgd_momentum)),
                    bool(getattr(c, "decoupled_weight_decay", True)))
        return torch_optimizer.hyper(self._kind, group)

    def add_param_group(self, param_group: dict) -> None:
        if self.__dict__.get("_constructed", False):
            raise RuntimeError("DistributedOptimizer.add_param_group: groups are fixed once the optimizer is built "
                               "(its state is laid out over the model's buffers); build the torch optimizer with every "
                               "group before wrapping it")
        super().add_param_group(param_group)

    def _push_groups(self) -> None:
        """The groups' current hyperparameters into the C++ optimizer (a scheduler may have changed them)."""
        for i, g in enumerate(self.param_groups):
            if [id(p) for p in g["params"]] != self._group_params[i]:
                raise RuntimeError(f"DistributedOptimizer: param group {i}'s params changed after the optimizer was "
                                   "built; mxddp fixes which params each group holds at construction (the state is "
                                   "laid out over the model's buffers): build a new optimizer with the groups wanted")
            if not self._megatron:
                torch_optimizer.check_group(self._kind, i, g, construction=False)
            self._cpp.set_group(i, *self._hyper(g, i))

    def _check_grads_ready(self, what: str) -> None:
        if not self.model.grads_live:
            raise RuntimeError(f"DistributedOptimizer.{what} was called before any backward since the last "
                               "zero_grad(): run loss.backward() and model.finish_grad_sync() first")
        if self.model._grads_pending_sync:
            if getattr(self.model, "_sync_at_backward_end", False):  # torch's form: no finish_grad_sync to call
                raise RuntimeError(f"DistributedOptimizer.{what}: the last backward ran inside model.no_sync() (or with "
                                   "require_backward_grad_sync=False), which accumulates the gradients without "
                                   "synchronizing them; mxddp reads that when a backward starts, so run the last "
                                   "micro-batch's backward outside no_sync(), or call model.finish_grad_sync()")
            raise RuntimeError(f"DistributedOptimizer.{what}: gradients were reported but not synchronized; call "
                               "model.finish_grad_sync() after the last backward and before it")

    def _scaler_unscale(self, scaler, for_step: bool) -> float:
        """1/scale of `scaler` (torch's reciprocal in f64, then f32) when it applies: at the step
        always, before it only once the user called scaler.unscale_(self)."""
        if scaler is None or not scaler.is_enabled():
            return 1.0
        state = scaler._per_optimizer_states.get(id(self))
        unscaled = state is not None and state["stage"].name == "UNSCALED"
        if not (for_step or unscaled):
            return 1.0
        return float(scaler._scale.double().reciprocal().float())

    def _pending_scaler(self):
        """The GradScaler that unscale_()d this optimizer this iteration, if any: the one that last
        stepped it, or before any step (the first iteration) the one whose records name it."""
        scaler = self._scaler_ref() if self._scaler_ref is not None else None
        if scaler is None and not self._stepped:
            import gc
            for obj in gc.get_objects():
                # type(), not isinstance(): the latter reads __class__, which some proxies warn on.
                # A disabled scaler (torch.cuda.amp.GradScaler(enabled=False) on a CPU) keeps no records.
                if issubclass(type(obj), torch.amp.GradScaler) and id(self) in getattr(obj, "_per_optimizer_states", {}):
                    return obj
        return scaler

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Collective. With an ``OptimizerConfig`` returns Megatron's ``(update_successful,
        grad_norm, num_zeros_in_grad)``: update_successful is False when the global grad norm is NaN
        or Inf (nothing changes, as ``mxddp train`` skips such a step); grad_norm is before
        clipping; num_zeros_in_grad is None (not counted, as Megatron without
        log_num_zeros_in_grad; with it, ``count_zeros()`` before the update, as Megatron's; None too
        when the step is skipped). With a torch optimizer returns the closure's loss (or None), as
        torch's step; a NaN or Inf norm skips the step there too.

        The params ``model._unused_params`` names (registration indices, agreed across ranks) are
        left untouched this step: no decay, no moment update, no step count, as torch does for a
        param whose grad is None.

        The first skipped step of a run of them warns (``SkippedStepWarning``) with the norm and
        the params at fault; a skip beyond ``config.max_consecutive_skipped_steps`` in a row
        raises ``mxddp.Error`` on every rank naming the count and those params."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_grads_ready("step()")
        self._push_groups()
        kept = getattr(self.model, "_kept_zero_grads", set())
        frozen = sorted(int(i) for i in (getattr(self.model, "_unused_params", None) or []) if i not in kept)
        self.model._before_param_update()  # DDP: a gather still reading the shards ends first
        self._take_param_writes()  # values a script wrote into the params are what the step starts from
        unscale, clip_coeff = self._scaler_unscale(grad_scaler, True), self._clip_coeff
        self._clip_coeff = 1.0
        # Megatron counts before the update, after clipping the grads in place; mxddp's step clips by
        # a coefficient and leaves the grads as reduced, which are counted. The two differ only where
        # the clip coefficient rounds a grad to 0 (a denormal F32 grad clipped by a large norm).
        num_zeros = self.count_zeros() if self._megatron and self.config.log_num_zeros_in_grad else None
        skipped, grad_norm, _clip = self._cpp.step(unscale, clip_coeff, frozen)
        self._record_param_versions()  # a write from here until the params are gathered is lost
        self._stepped = True
        retired = self._torch_optimizer() if self._torch_optimizer is not None else None
        if retired is not None:
            retired._opt_called = True  # a torch scheduler on the wrapped optimizer checks this was stepped
        if self._release_heap_after_step:
            _C.release_free_heap_pages()  # the step's activations are gone: their heap pages go too
        if grad_scaler is not None:
            self._scaler_ref = weakref.ref(grad_scaler)
            if grad_scaler.is_enabled():
                # What scaler.update() reads: found_inf from the global norm, alike on every rank.
                scale = grad_scaler._scale
                grad_scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {
                    scale.device: torch.full((), 1.0 if skipped else 0.0, dtype=torch.float32, device=scale.device)}
        if skipped and grad_scaler is not None and grad_scaler.is_enabled():
            pass  # an overflow the scaler handles by backing off: expected, not warned about
        elif skipped:
            self._after_skipped_step(grad_norm)
        else:
            self._consecutive_skipped_steps = 0
            self.model._after_param_update(gathered=False)
        if not skipped and self.model.ddp_config.reuse_grad_buf_for_mxfp8_param_ag:
            self.model._awaiting_zero_grad = True  # the update waits in the main params for zero_grad()
        if self._megatron:
            return (False, grad_norm, None) if skipped else (True, grad_norm, num_zeros)
        return loss

    def count_zeros(self) -> float:
        """Collective (Megatron's name). The elements of the synchronized grads that are zero (+0 or
        -0; not the buckets' padding), each counted once and summed over the ranks: Megatron's
        ``num_zeros_in_grad``. A float as Megatron's, but exact (Megatron sums in f32)."""
        self._check_grads_ready("count_zeros()")
        return float(self._cpp.count_zero_grads())

    def get_grad_norm(self) -> float:
        """Collective (Megatron's name). The global L2 norm of the synchronized grads, each element
        counted once, as the next step would use them (after a pending unscale or clip)."""
        self._check_grads_ready("get_grad_norm()")
        unscale = self._scaler_unscale(self._pending_scaler(), False)
        return self._cpp.grad_norm(unscale) * self._clip_coeff

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """Collective. torch.nn.utils.clip_grad_norm_'s semantics over the synchronized grads (which
        live in mxddp's buffer, not in ``.grad``): returns the total norm as a tensor and scales the
        grads the next step uses by max_norm / (norm + 1e-6) clamped to 1. Only norm_type 2.
        foreach (torch's choice of kernel) changes nothing here."""
        if foreach not in (None, True, False):
            raise TypeError(f"clip_grad_norm_: foreach must be None, True or False; got {foreach!r}")
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_: norm_type={norm_type!r} is not supported; valid: 2.0 (the L2 norm)")
        if not float(max_norm) >= 0.0:  # NaN too
            raise ValueError(f"clip_grad_norm_: max_norm={max_norm!r} is not valid; valid: a number >= 0 "
                             "(0 zeroes the gradients, as torch's)")
        norm = self.get_grad_norm()
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                               "by the non-finite norm anyway, set `error_if_nonfinite=False`")
        coeff = float(max_norm) / (norm + 1e-6)
        if math.isfinite(norm) and coeff < 1.0:  # a NaN or Inf norm skips the step anyway
            self._clip_coeff *= coeff
        return torch.tensor(norm, dtype=torch.float32, device=self.model.device)  # on the grads' device, as torch's

    def state_dict(self) -> dict:
        """torch's format (optimizer_state.py). No collective: any rank may call it alone. A
        sharded optimizer's holds this rank's shard, loadable only here. The hooks of
        ``register_state_dict_pre_hook`` and ``register_state_dict_post_hook`` run as torch's do."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._take_param_writes()
        state_dict = optimizer_state.state_dict(self)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores a state_dict() (or torch's, into a replicated optimizer). Collective where the
        main params are copies (BF16 params): the model's params are brought up to date. The hooks
        of ``register_load_state_dict_pre_hook`` (on a shallow copy, which they may replace) and
        ``register_load_state_dict_post_hook`` run as torch's do."""
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._take_param_writes()  # before the load, which then writes over what they wrote
        if optimizer_state.load_state_dict(self, state_dict):
            self.force_param_sync()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _after_skipped_step(self, grad_norm: float) -> None:
        """Warns at the first skip of a run, raises beyond the limit. Every rank skipped (the norm
        is global) and counts alike (the configs agree), so the collectives here match."""
        self._consecutive_skipped_steps += 1
        count = self._consecutive_skipped_steps
        limit = self.config.max_consecutive_skipped_steps if self._megatron else None
        over = limit is not None and count > limit
        if count > 1 and not over:
            return
        why = self._why_skipped(grad_norm)
        if over:
            raise _C.Error(f"DistributedOptimizer.step(): the step was skipped ({count} in a row, more than "
                           f"OptimizerConfig.max_consecutive_skipped_steps={limit}): {why}. A NaN or Inf that lasts "
                           "is not a passing spike (a param that holds one, a learning rate that diverged); "
                           "the run ends here rather than skip every step from now on")
        ends = "" if limit is None else \
            f"; more than {limit} skipped in a row raise (OptimizerConfig.max_consecutive_skipped_steps)"
        warnings.warn(f"DistributedOptimizer.step() skipped the step (nothing was updated): {why}{ends}",
                      SkippedStepWarning, stacklevel=3)

    def _why_skipped(self, grad_norm: float) -> str:
        """Collective. The norm, the params whose reduced gradients hold a NaN or Inf, and per rank
        the params whose own values do (those whose torch tensor holds its values here)."""
        names = self.model._names
        grads = [names[i] for i in self._cpp.nonfinite_grad_params()]
        why = (f"the global grad norm is {grad_norm}; params whose gradients hold a NaN or Inf: "
               f"{_name_list(grads) if grads else 'none'}")
        checked = self.model._params_holding_values()  # the same on every rank
        if not checked:
            return why + "; the params' values were not checked (none holds its values between iterations)"
        rank, world = self.model._comm.rank, self.model._comm.size
        flags = torch.zeros(world, len(names), dtype=torch.float32)
        for i in checked:
            if not bool(torch.isfinite(self.model._params[i].detach()).all()):
                flags[rank, i] = 1.0
        _C.all_reduce(flags, "max", self.model._comm)
        values = [f"{_name_list([names[i] for i in flags[r].nonzero().flatten().tolist()])} on rank {r}"
                  for r in range(world) if bool(flags[r].any())]
        return why + f"; params whose values hold a NaN or Inf: {'; '.join(values) if values else 'none'}"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the grad buffer (every param's main_grad); the torch params' .grad is already None
        after each hook. set_to_none is torch's and Megatron's argument: with False a DDP param that
        had a gradient keeps it (a zero) in torch's terms, so later steps update it even in windows no
        rank uses it (find_unused_parameters), as torch's optimizer steps a zero .grad. With
        reuse_grad_buf_for_mxfp8_param_ag it then stages the main params in the grad buffer and starts
        the param all-gather (the first group only with overlap_param_gather)."""
        self._clip_coeff = 1.0
        self.model._before_zero_grad()
        reuse = self.model.ddp_config.reuse_grad_buf_for_mxfp8_param_ag
        if reuse:
            self._take_param_writes()  # the main params are staged and gathered into the params next
        self._cpp.zero_grad()
        if reuse:
            self._record_param_versions()
        self.model._after_zero_grad(set_to_none)

    def force_param_sync(self) -> None:
        """Collective. Brings every rank's model params up to date with the main params now,
        whatever state the param sync is in (for evaluation, or reading the params, between
        iterations). With reuse_grad_buf_for_mxfp8_param_ag it zeroes the grad buffer first (the
        staging area), so call it only between finish_grad_sync/step and the next backward."""
        self._take_param_writes()
        self._cpp.force_param_sync()
        self._record_param_versions()
        self.model._after_param_update(gathered=True)
        if self.model.ddp_config.reuse_grad_buf_for_mxfp8_param_ag:
            self.model._grads_pending_sync = False  # the grad buffer was zeroed to stage in
        self.model._awaiting_zero_grad = False

    def get_loss_scale(self) -> torch.Tensor:
        """Megatron's: the loss scale, ``tensor([1.0])`` on the model's device, as Megatron's
        optimizers without a grad scaler (mxddp's has none of its own: ``OptimizerConfig`` refuses
        fp16's loss scaling; with torch's form a ``torch.amp.GradScaler`` does the scaling)."""
        return torch.ones(1, dtype=torch.float32, device=self.model.device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Megatron's (Megatron-LM sets ``config.grad_scale_func`` to it): ``get_loss_scale() * loss``."""
        return self.get_loss_scale() * loss

    def reload_model_params(self, state_dict: Optional[dict] = None) -> None:
        """Megatron's: the main params from the model's params now (or, given ``state_dict``, from
        its tensors, which may be more precise than BF16 params: a model state dict keyed as
        ``model.state_dict()`` or as ``model.module.state_dict()``). Local, no collective. A DDP's
        optimizer takes values written into the params by itself before its next step
        (param_writes.py); this is for a script that wants it done now, or the values from a state
        dict. MXFP8 weights are left as they are (their Parameters hold no values; their main
        params are already the master copy)."""
        model = self.model
        self._take_param_writes()  # every open optimizer's, not only this one's
        if state_dict is None:
            if model.param_dtype == torch.float32:
                self._record_param_versions()  # F32 params are their own main params
                return
            sources = {i: model._params[i] for i in model._params_holding_values()}
        else:
            # Every param a state dict can give (a sharded FSDP's too, whose Parameters hold none).
            sources = self._reload_sources(state_dict, [i for i in range(len(model._params))
                                                        if i not in model._mxfp8_kind])
        with torch.no_grad():
            param_writes.copy_into_main(self, sources)
        self._record_param_versions()

    def _reload_sources(self, state_dict, indices: list[int]) -> dict[int, torch.Tensor]:
        """reload_model_params' tensors: each param's by its name, ``module.<name>`` or ``<name>``,
        checked for shape before any is copied."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"reload_model_params(state_dict): a dict of name -> tensor; got {type(state_dict).__name__}")
        model, sources = self.model, {}
        for i in indices:
            name = model._names[i]
            value = state_dict.get(f"module.{name}", state_dict.get(name))
            if value is None:
                raise KeyError(f"reload_model_params: the state dict has no entry for param '{name}' (as "
                               f"'module.{name}' or '{name}')")
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(model._params[i].shape):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"reload_model_params: entry for param '{name}' is {shape}; the param is "
                                 f"{tuple(model._params[i].shape)}")
            sources[i] = value.to(device=model.device, dtype=torch.float32)
        return sources

    def _take_param_writes(self) -> None:
        if self.model._param_versions is not None:
            param_writes.take(self.model)

    def _record_param_versions(self) -> None:
        if self.model._param_versions is not None:
            param_writes.record(self.model)

    @property
    def lr(self) -> float:
        """The first param group's lr."""
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        """Sets every param group's lr (what each step then uses)."""
        for g in self.param_groups:
            g["lr"] = float(value)

    @property
    def step_count(self) -> int:
        return self._cpp.step_count

    def close(self) -> None:
        self._cpp.close()
        self._closed = True
        if not self.model._open_optimizers():
            self.model._param_versions = None  # no main params left to keep in step with the params
