"""The orderly end of a distributed run: every process group destroyed and freed, its gloo worker threads
joined, while the interpreter is still whole.

Why: a gloo worker thread drops its reference to a finished work (and so to the work's tensors) only
after the caller's ``wait()`` has returned. Dropping a C++ reference to a tensor that Python also holds
decrefs its PyObject, which takes the GIL (``c10::intrusive_ptr``'s 2 -> 1 transition). When the main
thread keeps the GIL from its last collective into ``Py_FinalizeEx`` (it hands it over after the 5 ms
switch interval), the worker gets it after finalization began, CPython ends the thread (``pthread_exit``),
the forced unwind crosses a ``noexcept`` destructor and the process dies with SIGABRT, "terminate called
without an active exception", after all its work succeeded (pytorch/pytorch#179291, an atexit
``destroy_process_group`` proposed upstream and abandoned). ``dist.destroy_process_group`` alone does not
close it: it empties torch's table of groups, but a group, and its workers, live as long as anything
refers to it (a DeviceMesh's ``_pg_registry``, a compiled module's ``Comm``, the defaults of
``torch.distributed.nn.functional``) and are freed in the interpreter's teardown, too late.

``shutdown`` destroys the groups, has every holder forget its groups (DeviceMesh, functions whose default
argument is a group, the types named by ``holds_groups``, the caches named by ``caches_groups``) and
collects the garbage, so that each ``ProcessGroupGloo`` is freed here: its destructor releases the GIL and
joins its workers, which finish their last work first. ``shutdown_at_exit`` registers it with ``atexit``
(which runs before finalization), once per process; ``autopar.init_mesh`` and ``Comm.from_device_mesh``
call it.
"""

from __future__ import annotations

import atexit
import gc
import os
import warnings
import weakref
from collections.abc import Callable
from types import FrameType, FunctionType
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import ProcessGroup

GLOO_THREAD = "pt_gloo_runloop"  # the name ProcessGroupGloo gives its worker threads


def _forget_default_group(fn: FunctionType) -> None:
    """A function whose default argument is a group: torch.distributed.nn.functional's ``group=group.WORLD``
    binds the default group of the moment it is imported (DCP imports it at its first save). ``None`` says
    the default group to those functions, so nothing changes for a caller while a group is alive."""
    if fn.__defaults__ and any(isinstance(d, ProcessGroup) for d in fn.__defaults__):
        fn.__defaults__ = tuple(None if isinstance(d, ProcessGroup) else d for d in fn.__defaults__)


# type -> how an instance of it forgets its process groups; autopar's holders add themselves (holds_groups)
_HOLDERS: dict[type, Callable[[Any], None]] = {
    DeviceMesh: lambda mesh: mesh._pg_registry.clear(),
    FunctionType: _forget_default_group,
}
_CACHES: list[Callable[[], None]] = []  # module-level caches of groups, emptied at shutdown
_registered = False


def holds_groups(cls: type, forget: Callable[[Any], None]) -> None:
    """Declare that instances of ``cls`` hold process groups and how one forgets them (``shutdown``)."""
    _HOLDERS[cls] = forget


def caches_groups(clear: Callable[[], None]) -> None:
    """Declare a module-level cache of process groups and how it is emptied (``shutdown``)."""
    _CACHES.append(clear)


def gloo_threads() -> int:
    """How many gloo worker threads this process runs (Linux's /proc; 0 where there is none)."""
    n = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().strip() == GLOO_THREAD
        except OSError:  # the thread ended meanwhile
            pass
    return n


def shutdown() -> None:
    """Destroy every process group (if any is left) and free them all now, their worker threads joined.
    Warns when a gloo worker thread is still alive afterwards: something else still refers to its group
    (a group of the user's own kept in a global), naming the holder where it can."""
    groups = [weakref.ref(pg) for pg in distributed_c10d._world.pg_map] if dist.is_initialized() else []
    if dist.is_initialized():
        dist.destroy_process_group()
    for clear in _CACHES:
        clear()
    for obj in gc.get_objects():
        forget = _HOLDERS.get(type(obj))
        if forget is not None:
            forget(obj)
    gc.collect()  # a holder in a reference cycle frees its groups only here
    left = gloo_threads()
    if left:
        held = [pg for pg in (r() for r in groups) if pg is not None]
        referrers = [h for pg in held for h in gc.get_referrers(pg) if h is not held and not isinstance(h, FrameType)]
        holders = sorted({type(h).__name__ for h in referrers})
        warnings.warn(
            f"{left} gloo worker threads outlive autopar's shutdown: a process group is still referred to"
            + (f" (by {holders})" if holders else "")
            + "; the process may abort in the interpreter's teardown (pytorch/pytorch#179291). Drop your own "
            "references to process groups before exit.",
            RuntimeWarning,
            stacklevel=2,
        )


def shutdown_at_exit() -> None:
    """Run ``shutdown`` when the interpreter exits (before it finalizes), registered once per process."""
    global _registered
    if not _registered:
        atexit.register(shutdown)
        _registered = True


__all__ = ["caches_groups", "gloo_threads", "holds_groups", "shutdown", "shutdown_at_exit"]
