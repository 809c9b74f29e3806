"""Single-process rank simulator: every rank of a mesh runs in its own thread of one process, and
collectives are computed by their definition over the simulated ranks.

    world = SimWorld(MeshSpec((("dp", 2), ("tp", 2))))
    results = world.run(lambda rank: step(world.comm(rank)))  # one thread per rank, results by rank

Each simulated rank gets a ``comm.Comm`` whose process groups are ``SimGroup``s: Python
subclasses of ``torch.distributed.ProcessGroup``, so ``dist.all_reduce(t, group=g)`` and the rest of
autopar's runtime (``runtime/comm/collectives.py``: Megatron's f and g, the vocab-parallel lookup and loss,
gradient sync, ZeRO) run unchanged, forward and backward, with no process group initialised. A
collective is a rendezvous of the members of its group: each member leaves its contribution, the
last to arrive wakes the others, and every member computes its own result from all contributions
(all_reduce sum/avg/max/min/product, all_gather, reduce_scatter, all_to_all, broadcast, barrier;
send/recv through per-pair FIFO mailboxes; groups: ``runtime/sim/groups.py``). A pipeline's
``batch_isend_irecv`` between global ranks goes through ``SimPeers``, a simulated rank's ``Comm.peers``
(``autopar/check/simtrain.py`` trains a whole plan so). Members that call different collectives (another op,
shape or dtype) fail with ``SimulationError`` naming each rank's call; a rank that fails stops the
others; a rank left waiting longer than ``timeout`` reports a deadlock. The design and why torch's
own LocalTensorMode is not used are in docs/architecture.md.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from autopar.errors import SimulationError
from autopar.ir.core import MeshSpec
from autopar.runtime.comm.context import Comm
from autopar.runtime.sim.groups import SimGroup, _Aborted, _Done, _Rendezvous

T = TypeVar("T")


class _Box:
    """The messages of one directed pair in flight, by their number on the pair."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.sent: dict[int, torch.Tensor] = {}
        self.count = 0  # messages sent so far
        self.posted = 0  # receives posted so far


class SimPeers:
    """A simulated rank's ``Comm.peers`` (``comm.TorchPeers``'s methods): global ranks of its groups,
    pipeline point-to-point between global ranks (FIFO per directed pair, as on torch's default group),
    and new groups of any ranks."""

    def __init__(self, world: SimWorld, rank: int):
        self.world, self.rank = world, rank

    @staticmethod
    def posts_independently() -> bool:
        """Each send and receive is its own mailbox op: receives may be posted early."""
        return True

    def global_rank(self, group: SimGroup, member: int) -> int:
        return group.rv.ranks[member]

    def batch_isend_irecv(self, ops: list[tuple[bool, torch.Tensor, int]]) -> list[_Done]:
        """Sends are delivered at once (never block); each receive completes when waited for."""
        me = self.rank
        return [
            self.world.send((None, me, peer), [t])
            if is_send
            else self.world.recv((None, peer, me), [t], f"pipeline recv of rank {me} from rank {peer}")
            for is_send, t, peer in ops
        ]

    def new_group(self, ranks: list[int]) -> SimGroup | None:
        """The group of ``ranks`` (this rank's view; ``None`` when it is not a member)."""
        return self.world.subgroup(tuple(ranks), self.rank)


class SimMesh:
    """What ``runtime/grads.tie_groups`` reads of a DeviceMesh, for a simulated rank: axis names and
    sizes, the rank at each coordinate, and this rank."""

    def __init__(self, world: SimWorld, rank: int):
        self.world, self.rank = world, rank
        self.mesh_dim_names = world.mesh.names
        self.mesh = torch.arange(world.size).reshape(world.mesh.sizes)

    def size(self, dim: int | None = None) -> int:
        return self.world.size if dim is None else self.world.mesh.sizes[dim]

    def get_rank(self) -> int:
        return self.rank


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
        self._boxes: dict[tuple[Any, int, int], _Box] = {}
        self._groups: dict[tuple[str, int], SimGroup] = {}  # (axis, rank) -> that rank's group
        self._rendezvous: list[_Rendezvous] = []
        self._subgroups: dict[tuple[int, ...], _Rendezvous] = {}
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
        """The ``comm.Comm`` of simulated rank ``rank``: its groups, coordinates and axis sizes."""
        return Comm(
            groups={a: self._groups[(a, rank)] for a in self.mesh.names},
            coords=self.coords(rank),
            sizes=dict(self.mesh.axes),
            peers=SimPeers(self, rank),
        )

    def device_mesh(self, rank: int) -> SimMesh:
        """What a ``ParallelModule`` of simulated rank ``rank`` is given as its DeviceMesh."""
        return SimMesh(self, rank)

    def subgroup(self, ranks: tuple[int, ...], rank: int) -> SimGroup | None:
        """Rank ``rank``'s view of a group of any ``ranks`` (one meeting point per set of ranks)."""
        with self._lock:
            rv = self._subgroups.get(ranks)
            if rv is None:
                rv = self._subgroups[ranks] = _Rendezvous(self, ranks, f"group of ranks {list(ranks)}")
                self._rendezvous.append(rv)
        return SimGroup(rv, ranks.index(rank)) if rank in ranks else None

    # -- point-to-point (key: (group or None for global ranks, source, destination)) ------------
    # A receive takes the message whose number on its pair equals its own posting number, as gloo and
    # NCCL match sends and receives in the order each side posts them (not the order receives are waited).
    def _box(self, key: tuple[Any, int, int]) -> _Box:
        with self._lock:
            if key not in self._boxes:
                self._boxes[key] = _Box()
            return self._boxes[key]

    def send(self, key: tuple[Any, int, int], tensors: Sequence[torch.Tensor]) -> _Done:
        box = self._box(key)
        with box.cond:
            for t in tensors:
                box.sent[box.count] = t.detach().clone()
                box.count += 1
            box.cond.notify_all()
        return _Done()

    def recv(self, key: tuple[Any, int, int], tensors: Sequence[torch.Tensor], where: str) -> _Done:
        box = self._box(key)
        with box.cond:
            first = box.posted
            box.posted += len(tensors)

        def wait() -> None:
            for i, t in enumerate(tensors):
                got = self._take(box, first + i, where)
                if got.shape != t.shape or got.dtype != t.dtype:
                    raise SimulationError(
                        f"{where}: sent {got.dtype}{list(got.shape)}, posted {t.dtype}{list(t.shape)}"
                    )
                t.copy_(got)

        return _Done(wait)

    def _take(self, box: _Box, number: int, what: str) -> torch.Tensor:
        with box.cond:
            ok = box.cond.wait_for(lambda: number in box.sent or self.aborted, self.timeout)
            self.raise_if_aborted()
            if not ok:
                raise SimulationError(f"deadlock: {what} waited {self.timeout:.0f} s for a send")
            return box.sent.pop(number)

    # -- running ranks --------------------------------------------------------------------------
    def raise_if_aborted(self) -> None:
        if self.aborted:
            raise _Aborted()

    def _abort(self, rank: int, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = (rank, exc)
            self.aborted = True
            boxes = list(self._boxes.values())
        for rv in self._rendezvous:
            rv.wake()
        for box in boxes:
            with box.cond:
                box.cond.notify_all()

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
