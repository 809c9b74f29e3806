"""One failure, every rank told: an error found on some ranks raised as the same ``AutoparError`` on all.

Rank 0 plans and broadcasts the programs (``autopar.compile``); when its planning fails the others got
nothing to receive and died of gloo's "Connection closed by peer", or waited minutes in the broadcast if
rank 0 caught the error. ``from_rank0`` broadcasts the error instead (its class name and message, as
strings: nothing pickled is rebuilt), and every rank raises it. ``agree`` does the same for an error
found on some ranks only (an input of one rank's shard out of range): one small all-reduce says whether
and where, before any collective of the step could be entered by some ranks and not others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

import autopar.errors as errors

T = TypeVar("T")


def _record(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


def rebuilt(record: tuple[str, str], where: str) -> errors.AutoparError:
    """The error of ``record`` (an ``AutoparError`` subclass by name; any other one as ``AutoparError``) as
    raised on the rank that found it, saying ``where`` it was."""
    name, message = record
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.AutoparError)):
        return errors.AutoparError(f"{where} failed with {name}: {message}")
    err = cls.__new__(cls)  # some subclasses take more arguments than the message: none is needed to raise it
    Exception.__init__(err, f"{message} ({where})")
    return err


def from_rank0(fn: Callable[[], T], group=None) -> T | None:
    """``fn()`` on rank 0 (its result for the caller to broadcast), ``None`` elsewhere; when it raises, every
    rank of ``group`` raises the same error (rank 0 its own). Collective."""
    box: list = [None]
    failed: BaseException | None = None
    result = None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - broadcast, then re-raised on rank 0 itself
            failed, box[0] = e, _record(e)
    dist.broadcast_object_list(box, src=0, group=group)
    if failed is not None:
        raise failed
    if box[0] is not None:
        raise rebuilt(tuple(box[0]), "on rank 0, which plans for every rank")
    return result


def agree(problem: errors.AutoparError | None, group=None) -> None:
    """Raise ``problem`` (found on this rank, or ``None``) as the same error on every rank of ``group``: the
    lowest rank's that found one. One all-reduce of a number when none did. Collective."""
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    first = torch.tensor([me if problem is not None else world], dtype=torch.int64)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    src = int(first)
    if src == world:
        return
    box = [_record(problem) if me == src and problem is not None else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    if me == src and problem is not None:
        raise problem
    raise rebuilt(tuple(box[0]), f"found on rank {src}; every rank stops before the step")


__all__ = ["agree", "from_rank0", "rebuilt"]
