"""A compiled module's optimizer: parameter groups given by the user's parameter names, ZeRO-1/2 when planned.

``param_groups`` is what ``torch.optim`` takes, with names instead of tensors, resolved over the
whole model so every rank has the same groups in the same order (a pipeline rank's group may hold
none of its parameters; a learning-rate scheduler then still sees every group):

- a list of dicts, ``[{"params": ["h.0.attn.c_attn.weight", ...], "weight_decay": 0.1}, ...]``: every
  trainable parameter in exactly one group (a tied parameter under any of its names);
- a callable, ``name -> options`` (``{}`` or ``None``: the defaults), called once per parameter with
  its first name in ``model.state_dict()``; parameters with equal options form one group, in the
  order they first appear.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from autopar.errors import OptimizerError
from autopar.runtime.comm.context import Comm
from autopar.runtime.grads.zero import ZeroOptimizer, whole_gradient_params, zero_axes_of

ParamGroups = Sequence[Mapping[str, Any]] | Callable[[str], Mapping[str, Any] | None]


def user_names(program, state) -> tuple[dict[str, list[str]], list[str]]:
    """(program name -> the user's names of that parameter, the trainable program names in order) of
    ``program``; ``state``: the user's state-dict keys -> program names (``None``: the same names)."""
    trainable = [v.name for v in program.params if v.type.is_float]
    if state is None:
        return {n: [n] for n in trainable}, trainable
    names: dict[str, list[str]] = {n: [] for n in trainable}
    for key, n in state[0].items():
        if n in names:
            names[n].append(key)
    return names, trainable


def resolve_groups(
    spec: ParamGroups | None, names: Mapping[str, list[str]], trainable: Sequence[str]
) -> list[tuple[dict[str, Any], list[str]]] | None:
    """(options, program names) per group, over the whole model. ``names``: program name -> the
    user's names of that parameter (state-dict order); ``trainable``: program names, in order."""
    if spec is None:
        return None
    if callable(spec):
        keyed: dict[str, tuple[dict[str, Any], list[str]]] = {}
        for n in trainable:
            options = dict(spec(names[n][0]) or {})
            keyed.setdefault(repr(sorted(options.items())), (options, []))[1].append(n)
        return list(keyed.values())
    program = {user: n for n, users in names.items() for user in users}
    owner: dict[str, int] = {}
    groups = []
    for i, group in enumerate(spec):
        members = group.get("params") if isinstance(group, Mapping) else None
        if members is None or isinstance(members, str) or not all(isinstance(m, str) for m in members):
            raise OptimizerError(
                f"parameter group {i} needs 'params': a list of the model's parameter names "
                "(e.g. {'params': ['lm_head.weight'], 'weight_decay': 0.0})"
            )
        mine = []
        for user in members:
            n = program.get(user)
            if n is None:
                close = difflib.get_close_matches(user, list(program), n=3)
                raise OptimizerError(
                    f"parameter group {i} names {user!r}, which is no trainable parameter of the model"
                    + (f"; did you mean {close}?" if close else "")
                )
            if owner.get(n, i) != i:
                raise OptimizerError(f"{user!r} is in parameter groups {owner[n]} and {i}: give it one group")
            owner[n] = i
            mine.append(n)
        groups.append(({k: v for k, v in group.items() if k != "params"}, mine))
    missing = [names[n][0] for n in trainable if n not in owner]
    if missing:
        raise OptimizerError(
            f"{len(missing)} trainable parameter(s) are in no group, e.g. {missing[:5]}: every parameter needs one "
            "(a callable name -> options gives every parameter a group)"
        )
    return groups


def build_optimizer(
    optimizer_cls: type[torch.optim.Optimizer],
    groups: list[tuple[dict[str, Any], list[str]]] | None,
    params: dict[str, torch.nn.Parameter],
    grad_sync: dict[str, list[str]],
    setup,
    program,
    comm: Comm,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """``optimizer_cls`` over this rank's ``params`` (name -> parameter, a ZeRO-3 slice where there is
    one) in ``groups``: ``ZeroOptimizer`` with ZeRO-1/2 over the plan's axes, else the class itself."""
    make = functools.partial(fused_by_default, optimizer_cls, sparse_grads=sparse_gradients(program))
    zero_axes, replica_axes = zero_axes_of(setup, program.mesh)
    if 1 <= setup.zero <= 2 and zero_axes:
        whole = whole_gradient_params(program, zero_axes + replica_axes)
        return ZeroOptimizer(params, grad_sync, make, comm, zero_axes, replica_axes, whole, groups=groups, **kwargs)
    if groups is None:
        return make(list(params.values()), **kwargs)
    torch_groups = [{**options, "params": [params[n] for n in members if n in params]} for options, members in groups]
    return make(torch_groups, **kwargs)


def sparse_gradients(program) -> bool:
    """Whether some parameter of ``program`` gets a sparse gradient: an embedding lookup with ``sparse=True``
    (``nn.Embedding(sparse=True)``; ``aten.embedding``'s fifth argument, ``aten._embedding_bag``'s seventh)."""
    where = {"aten.embedding": 4, "aten._embedding_bag": 6, "aten._embedding_bag_forward_only": 6}
    return any(
        op.target in where and len(op.args) > where[op.target] and op.args[where[op.target]] is True
        for op in program.ops
    )


def fused_by_default(
    optimizer_cls: type[torch.optim.Optimizer], params: list, *, sparse_grads: bool = False, **kwargs: Any
) -> torch.optim.Optimizer:
    """``optimizer_cls(params, **kwargs)`` with torch's fused kernel when the caller chose no implementation
    (neither ``fused`` nor ``foreach`` given) and the class has one (Adam, AdamW, SGD, Adagrad): one kernel over
    all the tensors instead of about ten ops per parameter (``bench/optimizer_kernels.py``: AdamW on issue
    13's GPT-2, one CPU thread, 2.5 against 7.0 ms a step), as torchtitan defaults to. Its numbers differ
    from the for-loop's in the last bits of float64, as torch's implementations differ from each other.
    Where torch refuses the fused kernel for these parameters or options (a device or dtype without it,
    ``differentiable=True``; ``sparse_grads``: some parameter's gradient is sparse, which the fused kernels
    refuse only at ``step()``, as they refuse complex parameters), torch's default."""
    chosen = "fused" in kwargs or "foreach" in kwargs
    tensors = [p for x in params for p in (x["params"] if isinstance(x, dict) else [x])]
    complex_ = any(not torch.is_floating_point(p) for p in tensors)  # torch refuses fused for it only at step()
    if chosen or sparse_grads or complex_ or "fused" not in inspect.signature(optimizer_cls).parameters:
        return optimizer_cls(params, **kwargs)
    try:
        return optimizer_cls(params, fused=True, **kwargs)
    except RuntimeError:  # torch's own check: "`fused=True` requires ...", "`fused` does not support ..."
        return optimizer_cls(params, **kwargs)


__all__ = ["ParamGroups", "build_optimizer", "fused_by_default", "resolve_groups", "user_names"]
