"""Single-process rank simulator: every rank of a mesh runs in its own thread of one process, and
collectives are computed by their definition over the simulated ranks.

    world = SimWorld(MeshSpec((("dp", 2), ("tp", 2))))
    results = world.run(lambda rank: step(world.comm(rank)))  # one thread per rank, results by rank

Each simulated rank gets a ``collectives.Comm`` whose process groups are ``SimGroup``s: Python
subclasses of ``torch.distributed.ProcessGroup``, so ``dist.all_reduce(t, group=g)`` and the rest of
autopar's runtime (``runtime/collectives.py``: Megatron's f and g, the vocab-parallel lookup and loss,
gradient sync, ZeRO) run unchanged, forward and backward, with no process group initialised. A
collective is a rendezvous of the members of its group: each member leaves its contribution, the
last to arrive wakes the others, and every member computes its own result from all contributions
(all_reduce sum/avg/max/min/product, all_gather, reduce_scatter, all_to_all, broadcast, barrier;
send/recv through per-pair FIFO mailboxes). Members that call different collectives (another op,
shape or dtype) fail with ``SimulationError`` naming each rank's call; a rank that fails stops the
others; a rank left waiting longer than ``timeout`` reports a deadlock. The design and why torch's
own LocalTensorMode is not used are in docs/architecture.md.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from autopar.errors import SimulationError
from autopar.ir.core import MeshSpec
from autopar.runtime.collectives import Comm

T = TypeVar("T")


class _Aborted(Exception):
    """Raised in a simulated rank when another rank failed: the first failure is what is reported."""


class _Done:
    """A finished collective (the simulator computes results before returning)."""

    def __init__(self, wait: Callable[[], None] | None = None):
        self._wait = wait

    def wait(self, timeout: Any = None) -> bool:
        if self._wait is not None:
            self._wait()
            self._wait = None
        return True

    def is_completed(self) -> bool:
        return self._wait is None

    def is_success(self) -> bool:
        return True


class _Rendezvous:
    """The meeting point of one group's members: contributions of one collective call at a time."""

    def __init__(self, world: SimWorld, ranks: tuple[int, ...], label: str):
        self.world, self.ranks, self.label = world, ranks, label
        self.cond = threading.Condition()
        self.slots: list[Any] = [None] * len(ranks)
        self.arrived = 0
        self.generation = 0
        self.results: dict[int, list[Any]] = {}
        self.readers: dict[int, int] = {}

    def exchange(self, member: int, call: str, payload: Any) -> list[Any]:
        """Leave ``payload`` for a collective described by ``call`` (op, shapes, dtypes) and return every
        member's payload in member order once all have arrived."""
        with self.cond:
            self.world.raise_if_aborted()
            gen = self.generation
            self.slots[member] = (call, payload)
            self.arrived += 1
            if self.arrived == len(self.ranks):
                calls = [c for c, _ in self.slots]
                if len(set(calls)) > 1:
                    detail = "; ".join(f"rank {r}: {c}" for r, c in zip(self.ranks, calls))
                    err = SimulationError(f"ranks of {self.label} called different collectives: {detail}")
                    self.results[gen] = err  # type: ignore[assignment]
                else:
                    self.results[gen] = [p for _, p in self.slots]
                self.readers[gen] = len(self.ranks)
                self.slots = [None] * len(self.ranks)
                self.arrived = 0
                self.generation += 1
                self.cond.notify_all()
            else:
                ok = self.cond.wait_for(lambda: self.generation != gen or self.world.aborted, self.world.timeout)
                self.world.raise_if_aborted()
                if not ok:
                    waiting = [r for r, s in zip(self.ranks, self.slots) if s is not None]
                    raise SimulationError(
                        f"deadlock: ranks {waiting} of {self.label} wait in {call} for ranks "
                        f"{sorted(set(self.ranks) - set(waiting))} for {self.world.timeout:.0f} s"
                    )
            out = self.results[gen]
            self.readers[gen] -= 1
            if self.readers[gen] == 0:
                del self.results[gen], self.readers[gen]
        if isinstance(out, Exception):
            raise out
        return out

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def reset(self) -> None:
        """Forget a collective an aborted run left half-met (its members stopped before all arrived)."""
        with self.cond:
            self.slots = [None] * len(self.ranks)
            self.arrived = 0
            self.results.clear()
            self.readers.clear()


def _describe(name: str, tensors: Sequence[torch.Tensor], extra: str = "") -> str:
    shapes = ",".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)
    return f"{name}({shapes}{extra})"


def _op_name(op: Any) -> str:
    """'SUM', 'MAX', ... for a ReduceOp or its RedOpType."""
    return getattr(getattr(op, "op", op), "name", str(op))


def _reduce(parts: list[torch.Tensor], op: Any) -> torch.Tensor:
    stack = torch.stack(parts)
    if op == dist.ReduceOp.SUM:
        return stack.sum(0)
    if op == dist.ReduceOp.AVG:
        return stack.sum(0) / len(parts)
    if op == dist.ReduceOp.MAX:
        return stack.amax(0)
    if op == dist.ReduceOp.MIN:
        return stack.amin(0)
    if op == dist.ReduceOp.PRODUCT:
        return stack.prod(0)
    raise SimulationError(f"the rank simulator has no reduce op {op}")


class SimGroup(dist.ProcessGroup):
    """One rank's view of a simulated process group (the ranks of one mesh axis through it)."""

    def __init__(self, rendezvous: _Rendezvous, member: int):
        super().__init__(member, len(rendezvous.ranks))
        self.rv, self.member = rendezvous, member

    # -- identity -------------------------------------------------------------------------------
    def size(self) -> int:
        return len(self.rv.ranks)

    def rank(self) -> int:
        return self.member

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "autopar-sim"

    @property
    def group_name(self) -> str:
        return self.rv.label

    def __repr__(self) -> str:
        return f"SimGroup({self.rv.label}, member {self.member})"

    # -- collectives ----------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        parts = self.rv.exchange(
            self.member, _describe("all_reduce", tensors, f",{_op_name(op)}"), [t.clone() for t in tensors]
        )
        for i, t in enumerate(tensors):
            t.copy_(_reduce([p[i] for p in parts], op))
        return _Done()

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        return self.allreduce(tensors, opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> _Done:
        parts = self.rv.exchange(self.member, _describe("all_gather", inputs), [t.clone() for t in inputs])
        for i, outs in enumerate(outputs):
            for out, p in zip(outs, parts):
                out.copy_(p[i])
        return _Done()

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Done:
        parts = self.rv.exchange(self.member, _describe("all_gather_into_tensor", [input]), input.clone())
        output.copy_(torch.cat(parts, 0).view_as(output))
        return _Done()

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> _Done:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        flat = [t.clone() for ts in inputs for t in ts]
        parts = self.rv.exchange(
            self.member, _describe("reduce_scatter", flat, f",{_op_name(op)}"), [t.clone() for t in flat]
        )
        n = self.size()
        for i, out in enumerate(outputs):
            out.copy_(_reduce([p[i * n + self.member] for p in parts], op))
        return _Done()

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Done:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        parts = self.rv.exchange(
            self.member, _describe("reduce_scatter_tensor", [input], f",{_op_name(op)}"), input.clone()
        )
        whole = _reduce(parts, op)
        output.copy_(whole.reshape(self.size(), -1)[self.member].view_as(output))
        return _Done()

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> _Done:
        parts = self.rv.exchange(self.member, _describe("all_to_all", inputs), [t.clone() for t in inputs])
        for out, p in zip(outputs, parts):
            out.copy_(p[self.member])
        return _Done()

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        root = opts.rootRank if opts is not None else 0
        parts = self.rv.exchange(
            self.member, _describe("broadcast", tensors, f",root={root}"), [t.clone() for t in tensors]
        )
        for t, src in zip(tensors, parts[root]):
            t.copy_(src)
        return _Done()

    def barrier(self, opts: Any = None) -> _Done:
        self.rv.exchange(self.member, "barrier()", None)
        return _Done()

    # -- point to point (FIFO per directed pair of members, as gloo and NCCL without tags) -----------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Done:
        box = self.rv.world.mailbox(self.rv, self.member, dst)
        for t in tensors:
            box.put(t.detach().clone())
        return _Done()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Done:
        box = self.rv.world.mailbox(self.rv, src, self.member)

        def wait() -> None:
            for t in tensors:
                got = self.rv.world.take(box, f"recv on {self.rv.label} from member {src}")
                if got.shape != t.shape or got.dtype != t.dtype:
                    raise SimulationError(
                        f"recv on {self.rv.label}: member {src} sent {got.dtype}{list(got.shape)}, "
                        f"member {self.member} posted {t.dtype}{list(t.shape)}"
                    )
                t.copy_(got)

        return _Done(wait)


class SimWorld:
    """Every rank of ``mesh``: the simulated process groups of each axis, and threads to run ranks.

    Ranks are numbered row-major over the mesh axes (the first axis outermost), as
    ``init_device_mesh`` numbers them; ``coords(rank)`` gives a rank's coordinate on each axis."""

    def __init__(self, mesh: MeshSpec, timeout: float = 60.0):
        self.mesh, self.timeout = mesh, timeout
        self.size = math.prod(mesh.sizes) if mesh.sizes else 1
        self.aborted = False
        self._error: tuple[int, BaseException] | None = None
        self._lock = threading.Lock()
        self._boxes: dict[tuple[int, int, int], queue.Queue] = {}
        self._groups: dict[tuple[str, int], SimGroup] = {}  # (axis, rank) -> that rank's group
        self._rendezvous: list[_Rendezvous] = []
        names = mesh.names
        for a, axis in enumerate(names):
            others = [range(n) for i, n in enumerate(mesh.sizes) if i != a]
            for rest in itertools.product(*others):
                ranks = []
                for c in range(mesh.sizes[a]):
                    coords = list(rest)
                    coords.insert(a, c)
                    ranks.append(self.rank_of(coords))
                where = ",".join(f"{n}={v}" for n, v in zip((n for n in names if n != axis), rest))
                rv = _Rendezvous(self, tuple(ranks), f"axis {axis}" + (f" at {where}" if where else ""))
                self._rendezvous.append(rv)
                for member, r in enumerate(ranks):
                    self._groups[(axis, r)] = SimGroup(rv, member)

    # -- coordinates ----------------------------------------------------------------------------
    def rank_of(self, coords: Sequence[int]) -> int:
        rank = 0
        for c, n in zip(coords, self.mesh.sizes):
            rank = rank * n + c
        return rank

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for name, n in reversed(self.mesh.axes):
            out[name] = rank % n
            rank //= n
        return dict(reversed(list(out.items())))

    def group(self, axis: str, rank: int) -> SimGroup:
        return self._groups[(axis, rank)]

    def comm(self, rank: int) -> Comm:
        """The ``collectives.Comm`` of simulated rank ``rank``: its groups, coordinates and axis sizes."""
        return Comm(
            groups={a: self._groups[(a, rank)] for a in self.mesh.names},
            coords=self.coords(rank),
            sizes=dict(self.mesh.axes),
        )

    # -- point-to-point mailboxes ---------------------------------------------------------------
    def mailbox(self, rv: _Rendezvous, src: int, dst: int) -> queue.Queue:
        key = (id(rv), src, dst)
        with self._lock:
            if key not in self._boxes:
                self._boxes[key] = queue.Queue()
            return self._boxes[key]

    def take(self, box: queue.Queue, what: str) -> torch.Tensor:
        waited = 0.0
        while True:
            self.raise_if_aborted()
            try:
                return box.get(timeout=0.05)
            except queue.Empty:
                waited += 0.05
                if waited >= self.timeout:
                    raise SimulationError(f"deadlock: {what} waited {self.timeout:.0f} s for a send") from None

    # -- running ranks --------------------------------------------------------------------------
    def raise_if_aborted(self) -> None:
        if self.aborted:
            raise _Aborted()

    def _abort(self, rank: int, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = (rank, exc)
            self.aborted = True
        for rv in self._rendezvous:
            rv.wake()

    def run(self, fn: Callable[[int], T], ranks: Sequence[int] | None = None) -> list[T]:
        """Call ``fn(rank)`` for every rank, each in its own thread, and return the results by rank.
        The first rank to raise stops the others; its exception is raised here, naming the rank."""
        ranks = list(range(self.size)) if ranks is None else list(ranks)
        results: dict[int, T] = {}
        if self.aborted:  # the last run stopped its ranks wherever they were: nothing of it may carry over
            for rv in self._rendezvous:
                rv.reset()
            self._boxes.clear()
        self.aborted, self._error = False, None

        def main(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except _Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread below)
                self._abort(rank, e)

        threads = [threading.Thread(target=main, args=(r,), name=f"autopar-sim-rank{r}", daemon=True) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._error is not None:
            rank, exc = self._error
            if isinstance(exc, SimulationError):
                raise exc
            raise SimulationError(
                f"simulated rank {rank} {self.coords(rank)} failed: {type(exc).__name__}: {exc}"
            ) from exc
        return [results[r] for r in ranks]
