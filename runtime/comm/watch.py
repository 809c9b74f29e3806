"""Every collective bounded by the job's timeout, and a stuck peer named on every rank that waited for it.

torch's ``DeviceMesh`` creates its sub-groups (``dp``, ``tp``, ...) with the backend's default timeout
(30 minutes), not the one ``init_process_group(timeout=)`` got, so a rank that is alive but stuck
(SIGSTOP, a hung data loader) stalled a ``tp`` or ``dp`` all-reduce of every other rank for that long.
``device_mesh`` gives every sub-group one timeout (``autopar.init_mesh(..., timeout=)``; by default the
world group's), and each collective of the runtime waits through ``Pending`` (``runtime/comm/pending.py``)
or ``guarded``, which turn gloo's timeout or lost connection into a ``RuntimeCommError`` naming the axis,
the op and the ranks of the group that did not arrive.

Who did not arrive is agreed through the job's store (``TCPStore``), only after a failure: each rank
whose collective failed writes ``autopar/arrived/<group>/<n>/<rank>`` (``n``: the how-many-th collective
on that group, the same on every member since they issue them in the same order), waits up to
``grace`` seconds for the other members' keys, and names those missing. A stuck rank writes none; a
rank that serves the store (rank 0) being the stuck one leaves the names undetermined: the others then name
rank 0 as the likely stuck one. NCCL
aborts a timed-out communicator in its watchdog instead of raising (``TORCH_NCCL_ASYNC_ERROR_HANDLING``):
there the timeout bounds the wait and the process ends, as torchrun then reports.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.errors import NonFiniteError, PeerFailedError, RuntimeCommError

T = TypeVar("T")

_COUNT: dict[str, int] = {}  # group name -> collectives started on it by this rank


_COMM_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "monitoredbarrier", "peer")


def is_comm_failure(e: BaseException) -> bool:
    """Whether an error comes from the transport (a dead or stuck peer), not from the computation."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = f"{type(e).__name__} {e}".lower()
    return any(w in text for w in _COMM_WORDS)


def world_timeout() -> float | None:
    """The world group's timeout in seconds (what ``init_process_group(timeout=)`` got); None before it."""
    if not dist.is_initialized():
        return None
    pg = dist.distributed_c10d._get_default_group()
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return pg._get_backend(device).options._timeout.total_seconds()
        except (RuntimeError, AttributeError):
            continue
    return None


def device_mesh(device_type: str, axes: dict[str, int], timeout: float | None):
    """``init_device_mesh`` whose every sub-group has ``timeout`` seconds (None: the world group's)."""
    if timeout is not None and not timeout > 0:
        from autopar.errors import MeshError

        raise MeshError(f"init_mesh(timeout={timeout!r}): give the seconds any collective may wait, e.g. 600")
    names, sizes = tuple(axes), tuple(axes.values())
    seconds = timeout if timeout is not None else world_timeout()
    if seconds is None or (timeout is None and len(names) == 1):  # one axis: the world group, its own timeout
        return init_device_mesh(device_type, sizes, mesh_dim_names=names)
    backend = "nccl" if device_type == "cuda" else "gloo"
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=seconds)
    override = {n: (backend, options) for n in names}
    return init_device_mesh(device_type, sizes, mesh_dim_names=names, backend_override=override)


def started(group) -> int:
    """Count a collective started on ``group``; its number there (``failure`` keys on it)."""
    name = _group_name(group)
    _COUNT[name] = _COUNT.get(name, 0) + 1
    return _COUNT[name]


def guarded(on, axis: str | None, op: str, fn: Callable[..., object], /, *args, **kwargs) -> None:
    """The collective ``fn(*args, **kwargs)`` (``op`` on the group ``on``: a ``torch.distributed`` function
    taking ``async_op``) started and waited for (``wait_collective``), its transport failure a
    ``RuntimeCommError``."""
    n = started(on)
    try:
        work = fn(*args, **kwargs, async_op=True)
        if work is not None:
            wait_collective(work, on, axis, op, n)
    except RuntimeCommError:
        raise
    except RuntimeError as e:
        err = failure(e, on, axis, op, n)
        if err is e:
            raise
        raise err from e


def failure(error: BaseException, group, axis: str | None, op: str, n: int) -> BaseException:
    """The ``RuntimeCommError`` for ``error`` of the ``n``-th collective ``op`` on ``group`` (``axis``), naming
    the members that did not arrive; ``error`` itself when it is no transport failure (a bad argument)."""
    if not is_comm_failure(error):
        return error
    me = dist.get_rank() if dist.is_initialized() else 0
    ranks = _ranks(group)
    axis = axis or _axis_of(group)
    seconds = _timeout_of(group)
    grace = min(max(seconds or 5.0, 1.0), 10.0)
    absent = _absent(group, ranks, me, n, grace)
    if absent is None:
        host = "" if me == 0 else " rank 0 is likely the stuck one:"
        who = (
            f"which did not arrive could not be told:{host} the job's store, which rank 0 serves, did not answer "
            f"within {grace:g}s"
        )
    elif absent:
        who = f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} did not arrive"
    else:
        who = "every member arrived (a peer failed during the transfer)"
    within = f" within {seconds:g}s" if seconds else ""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return RuntimeCommError(
        f"rank {me}: the {op} over mesh axis {axis!r} (ranks {ranks}) did not complete{within}: {who}. A peer rank "
        f"stopped or died ({first}); every rank stops here instead of waiting. Raise init_mesh(timeout=) if a "
        "step legitimately waits longer (a slow first step, a checkpoint on one rank)."
    )


def _absent(group, ranks: list[int], me: int, n: int, grace: float) -> list[int] | None:
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    prefix = f"autopar/arrived/{_group_name(group)}/{n}"
    try:
        store.set_timeout(datetime.timedelta(seconds=grace))
        store.set(f"{prefix}/{me}", "1")
        others = [r for r in ranks if r != me]
        deadline = time.monotonic() + grace
        while True:
            missing = [r for r in others if not store.check([f"{prefix}/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.05)
    except (RuntimeError, dist.DistError):
        return None


def _ranks(group) -> list[int]:
    try:
        return dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return []


def _group_name(group) -> str:
    try:
        return group.group_name
    except (RuntimeError, AttributeError, ValueError):  # a simulated group (runtime/sim) has no registered name
        return str(id(group))


def _axis_of(group) -> str:
    desc = getattr(group, "group_desc", "") or ""
    return desc[len("mesh_") :] if desc.startswith("mesh_") else desc or "?"


def _timeout_of(group) -> float | None:
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group._get_backend(device).options._timeout.total_seconds()
        except (RuntimeError, AttributeError):
            continue
    return None


# -- one rank's failure told to the others promptly -------------------------------------------------------------
#
# A rank that raises during a step (a bug in a stage, an out-of-memory, an injected error) used to reach its
# peers only through the transfer timeout: they waited for a message it would never send. ``publish`` writes
# the failure to the job's store under ``autopar/failed/<step>`` (``step``: the how-many-th pipeline step of
# this process, the same on every rank since all run the same steps).
#
# The waiting thread waits on the work itself, so a transfer that completes costs nothing more than before:
# ``wait_watching`` only notes what it waits for (``_ARMED``, one assignment). gloo's point-to-point work can be
# neither polled (``is_completed`` stays False after the data has arrived) nor waited for in slices (a
# ``wait(timeout=)`` that expires closes the connection to the peer), and ``abort()`` does not wake a blocked
# ``wait`` (measured on torch 2.13); waiting on a helper thread instead (one per wait, then one per process)
# cost 1.5x the step of a tiny pp=2 pipeline on 2 busy cores: two thread wake-ups per transfer. Instead one
# watcher thread per process (``_Watcher``) looks every ``POLL`` seconds: a wait still going after a full
# ``POLL`` has the store read for a failure of its step; if one was published, the watcher records the
# ``PeerFailedError`` and asks the peer it waits on, through the store (``autopar/unblock/<peer>/<i>``), to end
# the wait: a rank that raised out of a step serves such requests of that step from its own watcher, with an
# empty send (a receive waiting for it completes, its buffer untouched) or a receive of the bytes (a send
# waiting for it completes). The waiting thread then raises the recorded error. A rank told so raises too and
# serves in turn, so a chain of waits (pp > 2) unwinds. Channels are then out of step (the executor refuses
# further steps). A rank that dies closes its connections, which gloo reports at once.

POLL = 0.2
_STEP = [0]
_ARMED: list[tuple | None] = [None]  # what the waiting thread waits for: (step, peer, bytes, sending)
_STOPPED: dict[int, tuple[tuple, PeerFailedError]] = {}  # id of an armed wait -> it, the error it ends with
_SERVED: list[tuple[int, float] | None] = [None]  # the step whose unblock requests this rank serves (it raised
# during it) and until when: its peers' waits end by their timeout anyway


def step_begun() -> int:
    """Count a pipeline step begun by this process; its number (``publish`` and ``wait_watching`` key on it).
    A failure this process published before is withdrawn (``resumed``)."""
    resumed()
    _STEP[0] += 1
    return _STEP[0]


def _store():
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except (RuntimeError, ValueError, AttributeError):
        return None


def publish(error: BaseException, step: int | None, timeout: float = 600.0) -> None:
    """Tell the other ranks that this one raised ``error`` during step ``step`` (None: outside a pipeline step,
    the plain loop's forward) and will not finish it (best effort: a store that does not answer is left alone):
    a collective it will not join stops waiting for it (``wait_collective``), and from now on this rank ends
    the waits of that step that are on it (``_Watcher.serve``) for ``timeout`` seconds (the transfers'
    timeout: the peers' waits are over by then). A ``RuntimeCommError`` caused by another rank
    is that rank's to tell, but a ``PeerFailedError`` is passed on to this rank's groups, naming the rank that
    raised, so a chain of waits ends at once; a ``NonFiniteError`` is every rank's at once (agreed), so nobody
    waits for this one: none is published (a rank resuming first would otherwise take the others' records for
    stops)."""
    store = _store()
    if store is None:
        return
    if step is not None:
        _SERVED[0] = (step, time.monotonic() + timeout)
        _watcher()
    if isinstance(error, RuntimeCommError) and not isinstance(error, PeerFailedError):
        return
    if isinstance(error, NonFiniteError):  # agreed: raised by every rank at the same point, none waits for another
        return
    first = str(error).splitlines()[0] if str(error) else ""
    me = dist.get_rank()
    mine = f"{type(error).__name__}: {first}"[:2000]
    origin, what = (error.rank, error.error) if isinstance(error, PeerFailedError) else (me, mine)
    try:
        if step is not None and not isinstance(error, RuntimeCommError):
            store.set(f"autopar/failed/{step}", f"{me}\n{mine}")
        _log(store, {"rank": me, "down": dict(_COUNT), "origin": origin, "what": what})
        _DOWN_MINE[0] = True
    except (RuntimeError, dist.DistError):
        pass


def peer_failure(step: int) -> PeerFailedError | None:
    """The ``PeerFailedError`` for a rank that published a failure during step ``step``; None when none did."""
    store = _store()
    if store is None:
        return None
    key = f"autopar/failed/{step}"
    try:
        if not store.check([key]):
            return None
        rank, _, what = store.get(key).decode().partition("\n")
    except (RuntimeError, dist.DistError):
        return None
    me = dist.get_rank()
    return PeerFailedError(
        f"rank {me}: rank {rank} raised during this step ({what}), so what this rank waits for will not come: "
        f"stopping now instead of after the timeout. The error to fix is rank {rank}'s (its own traceback).",
        int(rank),
        what,
    )


class _Watcher:
    """The daemon thread that watches this process's long waits and serves its peers' unblock requests."""

    def __init__(self) -> None:
        self.last: tuple | None = None  # the wait armed at the last look
        self.asked: tuple | None = None  # the last wait whose peer was asked to end it
        self.served = 0  # unblock requests addressed to this rank read so far
        self.keep: list = []  # works (and their buffers) posted to end a peer's wait
        threading.Thread(target=self._loop, name="autopar-watch", daemon=True).start()

    def _loop(self) -> None:
        while True:
            time.sleep(POLL)
            serving = _SERVED[0]
            if serving is not None and time.monotonic() > serving[1]:
                _SERVED[0] = serving = None
            try:
                self.look()
                if serving is not None:
                    self.serve(serving[0])
            except Exception:  # noqa: BLE001 - a store or peer gone (the job is ending): stop serving, stop nothing
                _SERVED[0] = None

    def look(self) -> None:
        """A wait armed since the last look: read its step's failure; if any, record it and ask its peer."""
        armed = _ARMED[0]
        long_wait = armed is not None and armed is self.last
        self.last = armed
        if not long_wait or armed is self.asked:
            return
        step, peer, nbytes, sending = armed  # type: ignore[misc]
        err = peer_failure(step)
        if err is None:
            return
        _STOPPED[id(armed)] = (armed, err)  # the tuple held: its id is not reused meanwhile
        self.asked = armed
        store = _store()
        i = store.add(f"autopar/unblock/{peer}/n", 1)
        request = {"rank": dist.get_rank(), "step": step, "bytes": nbytes, "sending": sending}
        store.set(f"autopar/unblock/{peer}/{i}", json.dumps(request))

    def serve(self, step: int) -> None:
        """End the waits on this rank of step ``step``: an empty send for a receive, a receive for a send."""
        store = _store()
        me = dist.get_rank()
        n = int(store.add(f"autopar/unblock/{me}/n", 0))
        while self.served < n:
            key = f"autopar/unblock/{me}/{self.served + 1}"
            if not store.check([key]):  # counted but not written yet: read at the next look
                return
            self.served += 1
            request = json.loads(store.get(key))
            if request["step"] != step:
                continue
            if request["sending"]:  # the peer's send waits for this rank's receive
                buf = torch.empty(int(request["bytes"]), dtype=torch.uint8)
                self.keep.append((dist.irecv(buf, int(request["rank"])), buf))
            else:  # the peer's receive waits for this rank's send: an empty one completes it
                buf = torch.empty(0, dtype=torch.uint8)
                self.keep.append((dist.isend(buf, int(request["rank"])), buf))


_WATCHER: list[_Watcher] = []


def _watcher() -> _Watcher:
    if not _WATCHER:
        _WATCHER.append(_Watcher())
    return _WATCHER[0]


os.register_at_fork(after_in_child=_WATCHER.clear)  # a forked child has no thread of its parent's


def wait_watching(
    work, timeout: float, step: int | None, peer: int = -1, nbytes: int = 0, sending: bool = False
) -> None:
    """``work.wait()``, bounded by ``timeout`` seconds, ended with ``PeerFailedError`` soon after another
    rank published a failure of step ``step`` (None: a plain bounded wait). ``peer``: the rank the transfer is
    with; ``nbytes``, ``sending``: what it carries and which way (what the peer posts to end it)."""
    if step is None or not _WATCHER and _store() is None:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
        return
    if not _WATCHER:
        _watcher()
    armed = (step, peer, nbytes, sending)
    _ARMED[0] = armed
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    finally:
        _ARMED[0] = None
    if _STOPPED:
        stopped = _STOPPED.pop(id(armed), None)
        if stopped is not None and stopped[0] is armed:
            raise stopped[1]


# -- a collective whose member raised: ended after a first slice ------------------------------------------------
#
# A tensor- or data-parallel collective whose member raised (and lives on) waited for the group's timeout.
# ``publish`` also appends the rank's record to a log in the store (``autopar/down/n`` counts the entries,
# ``autopar/down/<i>`` is the i-th, JSON): the rank, how many collectives it had started on each group
# (``started``: the same count on every member for the same collective), and the rank that raised first and
# its error. A collective waits a first ``POLL`` seconds on its work alone: gloo's collectives honour
# ``wait(timeout=)`` and stay usable after one expires (unlike its transfers; measured on torch 2.13), so one
# that completes by then, almost every one, costs nothing more. A longer wait reads the log every ``POLL``
# seconds (one round trip when nothing is new) and ends with ``PeerFailedError`` naming the axis, the op and
# the members that stopped before they started it (their count there is lower). The group's own timeout
# (``init_mesh(timeout=)``) still bounds the wait. A rank that carries on after its error (its next step)
# withdraws its record, so a later wait is not ended for it. NCCL's wait does not hold the host (the stream
# waits) and a timed-out one aborts the communicator: there the wait is left as it was.

_SLICE = datetime.timedelta(seconds=POLL)
_SLICED: dict[str, bool] = {}  # group name -> whether its works are waited for in slices (gloo)
_DOWN: dict[int, dict] = {}  # rank -> its latest record read from the log (withdrawn ones removed)
_READ = [0]  # log entries read so far
_DOWN_MINE = [False]  # this process published a record not yet withdrawn


def _log(store, record: dict) -> None:
    i = store.add("autopar/down/n", 1)
    store.set(f"autopar/down/{i}", json.dumps(record))


def resumed() -> None:
    """This rank carries on after an error it published (a new step): its record is withdrawn."""
    if not _DOWN_MINE[0]:
        return
    _DOWN_MINE[0] = False
    store = _store()
    if store is None:
        return
    try:
        _log(store, {"rank": dist.get_rank(), "up": True})
    except (RuntimeError, dist.DistError):
        pass


def _read_log(store) -> dict[int, dict]:
    """The records of the ranks that stopped, updated from the log's new entries."""
    n = int(store.add("autopar/down/n", 0))
    while _READ[0] < n:
        key = f"autopar/down/{_READ[0] + 1}"
        if not store.check([key]):  # counted but not written yet: read at the next poll
            break
        record = json.loads(store.get(key))
        _READ[0] += 1
        if record.get("up"):
            _DOWN.pop(int(record["rank"]), None)
        else:
            _DOWN[int(record["rank"])] = record
    return _DOWN


def member_failure(group, axis: str | None, op: str, n: int) -> PeerFailedError | None:
    """The ``PeerFailedError`` for the ``n``-th collective ``op`` on ``group`` when a member published that it
    stopped before starting it; None when none did (or the store does not answer)."""
    store = _store()
    if store is None:
        return None
    try:
        down = _read_log(store)
    except (RuntimeError, dist.DistError, ValueError, KeyError):
        return None
    if not down:
        return None
    name, me, ranks = _group_name(group), dist.get_rank(), _ranks(group)
    gone = [r for r in ranks if r != me and r in down and down[r]["down"].get(name, 0) < n]
    if not gone:
        return None
    first = down[gone[0]]
    origin, what = int(first["origin"]), str(first["what"])
    axis = axis or _axis_of(group)
    who = f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))}"
    return PeerFailedError(
        f"rank {me}: the {op} over mesh axis {axis!r} (ranks {ranks}) cannot complete: {who} did not arrive, "
        f"rank {origin} raised ({what}); stopping now instead of after the timeout. The error to fix is rank "
        f"{origin}'s (its own traceback).",
        origin,
        what,
    )


def wait_collective(work, group, axis: str | None, op: str, n: int) -> None:
    """``work.wait()`` for the ``n``-th collective ``op`` on ``group`` (``axis``); after a first ``POLL``
    seconds, ended with ``PeerFailedError`` as soon as a member published that it will not join."""
    if not _sliceable(group, work):
        work.wait()
        return
    while not _waited(work):
        err = member_failure(group, axis, op, n)
        if err is not None:
            raise err


def _waited(work) -> bool:
    """Whether ``work`` completed within ``POLL`` seconds (its own error raised)."""
    try:
        work.wait(timeout=_SLICE)
        return True
    except RuntimeError as e:
        if work.is_completed():
            work.wait()
            return True
        if not str(e).startswith("Operation timed out!"):  # the transport's error or the group's own timeout
            raise
        return False


def _sliceable(group, work) -> bool:
    if not isinstance(work, dist.Work):  # a simulated rank's (runtime/sim)
        return False
    name = _group_name(group)
    ok = _SLICED.get(name)
    if ok is None:
        try:
            ok = dist.get_backend(group) == "gloo"
        except (RuntimeError, ValueError, AttributeError):
            ok = False
        _SLICED[name] = ok
    return ok


__all__ = [
    "device_mesh", "failure", "guarded", "is_comm_failure", "member_failure", "peer_failure", "publish", "resumed",
    "started", "step_begun", "wait_collective", "wait_watching", "world_timeout",
]  # fmt: skip
