"""The rank simulator's process groups (``runtime/sim/ranksim.py``): a ``SimGroup`` is one simulated rank's view
of a group, a Python ``torch.distributed.ProcessGroup`` whose collectives meet the other members' at a
``_Rendezvous`` and compute their results by definition; send/recv go through the world's mailboxes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import SimulationError


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

    def __init__(self, world: Any, ranks: tuple[int, ...], label: str):
        """``world``: the ``SimWorld`` (its abort flag, timeout and mailboxes)."""
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

    simulated = True  # not in torch's registry of groups (dist.get_backend(group) does not know it)

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

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Done:
        """``dist.all_gather_single`` (ZeRO-3's unit gathers) calls the group by this name."""
        return self._allgather_base(output, input, opts)

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

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Done:
        """``dist.reduce_scatter_single`` (ZeRO-3's unit gradients) calls the group by this name."""
        return self._reduce_scatter_base(output, input, opts)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> _Done:
        parts = self.rv.exchange(self.member, _describe("all_to_all", inputs), [t.clone() for t in inputs])
        for out, p in zip(outputs, parts):
            out.copy_(p[self.member])
        return _Done()

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> _Done:
        """``dist.all_to_all_single``: member i's ``input_split_sizes[j]`` rows (dim 0; equal pieces when the
        list is empty) go to member j, which receives them as its ``output_split_sizes[i]`` rows. The members'
        row counts may differ (expert parallelism's dispatch); a member expecting other counts than are sent
        to it fails with ``SimulationError``."""
        n = self.size()
        sends = list(input_split_sizes) or [input.shape[0] // n] * n
        recvs = list(output_split_sizes) or [output.shape[0] // n] * n
        call = f"all_to_all_single({str(input.dtype).removeprefix('torch.')}{list(input.shape[1:])})"
        parts = self.rv.exchange(self.member, call, ([p.clone() for p in input.split(sends)], recvs))
        got = [pieces[self.member] for pieces, _ in parts]
        sent = [len(p) for p in got]
        if sent != recvs:
            raise SimulationError(
                f"all_to_all_single on {self.rv.label}: member {self.member} expects {recvs} rows from the members, "
                f"they send {sent}"
            )
        if got:
            output.copy_(torch.cat(got).view_as(output))
        return _Done()

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts: Any = None) -> _Done:
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

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
        return self.rv.world.send((id(self.rv), self.member, dst), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Done:
        where = f"recv on {self.rv.label} from member {src} to member {self.member}"
        return self.rv.world.recv((id(self.rv), src, self.member), tensors, where)


__all__ = ["SimGroup"]
