"""One rank's point-to-point traffic in a pipeline step: post each batch of sends and receives, wait for a
receive when its consumer needs it, and wait for the sends still in flight before reducing or stepping.

Consecutive ``SEND_*``/``RECV_*`` actions are one ``torch.distributed.batch_isend_irecv`` (NCCL). On gloo
each receive is posted directly and the sends are issued by one helper thread, in list order: gloo
writes a message in the issuing thread when its receive is already posted (the executor posts them
ahead), 0.1-0.2 ms for a 512 KiB boundary on this machine and more under load, which the compute
thread would otherwise pay on every send before its next action (docs/runtime.md). Receives go
into buffers whose local shapes come from the IR (``StageRunner.recv``/``send``), one set per
sub-microbatch; tensors gloo cannot send travel as their bytes (``executor_state.wire_view``). Every
wait runs through the executor's ``guard``, which turns a transport failure or timeout into a
``RuntimeCommError`` naming the action and the peer.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import torch.distributed as dist

from autopar.errors import RuntimeCommError
from autopar.runtime.actions import Action, Kind
from autopar.runtime.executor_state import PendingReceive, wire_view
from autopar.runtime.stage_runner import StageRunner

Key = tuple[Kind, int, int]  # (kind, microbatch, stage) of a send or receive


class PointToPoint:
    """The sends and receives of one rank's step (``reset`` before each step)."""

    def __init__(
        self,
        stages: dict[int, StageRunner],
        peer_rank: Callable[[int], int],
        guard: Callable[[Callable, object, int], object],
        timeout: float,
        device: torch.device,
        sub_microbatches: int,
    ):
        self.stages, self.peer_rank, self.guard = stages, peer_rank, guard
        self.timeout, self.device, self.sub = timeout, device, sub_microbatches
        self._gloo: bool | None = None  # known at the first post (the process group exists by then)
        self._sender: ThreadPoolExecutor | None = None  # gloo: issues the sends, one at a time, in order
        self.reset()

    def reset(self) -> None:
        self.to_send: dict[Key, list[torch.Tensor]] = {}  # what the compute left for a SEND_* to ship
        self._pending: dict[Key, PendingReceive] = {}
        # each send's works (gloo: the future of the helper thread issuing it), action, peer, tensors
        self._in_flight: list[tuple[list | Future, Action, int, list[torch.Tensor]]] = []
        self._done: dict[int, object] = {}

    def post(self, batch: Sequence[Action]) -> None:
        """Post ``batch`` (consecutive sends and receives) as one ``batch_isend_irecv``; on gloo its
        receives directly and its sends through the helper thread."""
        if self._gloo is None:
            self._gloo = dist.get_backend() == "gloo"
        if self._gloo:
            self._post_gloo(batch)
            return
        ops: list[dist.P2POp] = []
        posted: list[tuple[Action, list[torch.Tensor], int]] = []
        for a in batch:
            peer = self.peer_rank(a.peer)  # type: ignore[arg-type]
            if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                tensors = self.to_send.pop((a.kind, a.mb, a.stage))  # type: ignore[arg-type]
                ops += [dist.P2POp(dist.isend, t, peer) for t in tensors]
            else:
                tensors = self._buffers(a)
                ops += [dist.P2POp(dist.irecv, wire_view(b), peer) for b in tensors]
            posted.append((a, tensors, peer))
        works = self.guard(lambda: dist.batch_isend_irecv(ops), batch[0], -1) if ops else []
        per_op = len(works) == len(ops)  # gloo: one work per op; NCCL may return one for the batch
        k = 0
        for a, tensors, peer in posted:
            mine = works[k : k + len(tensors)] if per_op else list(works)
            k += len(tensors)
            if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                self._in_flight.append((mine, a, peer, tensors))
            else:
                self._pending[(a.kind, a.mb, a.stage)] = PendingReceive(tensors, mine, a, peer)  # type: ignore[index]

    def _post_gloo(self, batch: Sequence[Action]) -> None:
        """gloo runs a batch op by op anyway: each receive is posted here, each send handed to the helper
        thread (one thread, so the sends of a channel leave in list order and pair FIFO as they must)."""
        for a in batch:
            peer = self.peer_rank(a.peer)  # type: ignore[arg-type]
            if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                tensors = self.to_send.pop((a.kind, a.mb, a.stage))  # type: ignore[arg-type]
                if self._sender is None:
                    self._sender = ThreadPoolExecutor(1, thread_name_prefix="autopar-send")
                future = self._sender.submit(lambda ts=tensors, p=peer: [dist.isend(t, p) for t in ts])
                self._in_flight.append((future, a, peer, tensors))
            else:
                tensors = self._buffers(a)
                works = self.guard(lambda ts=tensors, p=peer: [dist.irecv(wire_view(b), p) for b in ts], a, peer)
                self._pending[(a.kind, a.mb, a.stage)] = PendingReceive(tensors, works, a, peer)  # type: ignore[index]

    def _buffers(self, a: Action) -> list[torch.Tensor]:
        st = self.stages[a.stage]  # type: ignore[index]
        specs = st.recv if a.kind is Kind.RECV_ACT else [b for b in st.send if b.grad]
        return [torch.empty(b.shape, dtype=b.dtype, device=self.device) for _ in range(self.sub) for b in specs]

    def wait(self, key: Key, waited: list[tuple[Action, float]]) -> list[torch.Tensor]:
        """The buffers of the posted receive ``key``, once it has completed (noted in ``waited``)."""
        p = self._pending.pop(key, None)
        if p is None:
            kind, mb, stage = key
            raise RuntimeCommError(
                f"{kind.value} mb={mb} stage={stage} is needed but was never posted: the action list is "
                "unsound for this executor"
            )
        for w in p.works:
            self._complete(w, p.action, p.peer_rank)
        waited.append((p.action, time.perf_counter()))
        return p.buffers

    def drain(self) -> None:
        """Wait for every send still in flight (their buffers may then be freed)."""
        for works, a, peer, _tensors in self._in_flight:
            if isinstance(works, Future):
                works = self.guard(lambda f=works, a=a: _issued(f, a, self.timeout), a, peer)
            for w in works:
                self._complete(w, a, peer)
        self._in_flight = []
        self._done = {}

    def _complete(self, work, a: Action, peer: int) -> None:
        """Wait for one work once (a gloo receive waited twice would wait for another message)."""
        if id(work) in self._done:
            return
        self.guard(lambda: work.wait(timeout=datetime.timedelta(seconds=self.timeout)), a, peer)
        self._done[id(work)] = work  # kept alive until the step ends, so its id is not reused


def _issued(future: Future, a: Action, timeout: float) -> list:
    """The works of a send the helper thread issued (its error, if issuing failed)."""
    try:
        return future.result(timeout=timeout)
    except FutureTimeout as e:
        raise RuntimeCommError(f"{a}: the send was not issued within {timeout:g}s") from e


__all__ = ["PointToPoint"]
