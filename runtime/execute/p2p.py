"""One rank's point-to-point traffic in a pipeline step: post each batch of sends and receives, wait for a
receive when its consumer needs it, and wait for the sends still in flight before reducing or stepping.

Consecutive ``SEND_*``/``RECV_*`` actions are one ``torch.distributed.batch_isend_irecv`` (through the
rank's ``Comm.peers``: on the rank simulator, its mailboxes). Receives go
into buffers whose local shapes come from the IR (``StageRunner.recv``/``send``), one set per
sub-microbatch; tensors gloo cannot send travel as their bytes (``execute.state.wire_view``). Every
wait runs through the executor's ``guard``, which turns a transport failure or timeout into a
``RuntimeCommError`` naming the action and the peer.

Receives ahead of the list (``ahead=True``): where the transport issues each send and receive on its own
(gloo; the rank simulator's mailboxes), every channel (peer rank) keeps its next receive posted: the
first of each at the start of the step, the next once its consumer has taken the one before and
computed: with the consumer's own sends (the batch that follows it, sends first), else right after the
compute (``post_due``), and in any case before the rank next blocks in a wait. Posting it straight after
the wait put a receive post (0.1-0.25 ms with its buffer, on gloo) between every arrival and the compute
waiting for it, on the step's critical path. gloo's tcp transport is a rendezvous: a send whose receive
is not yet posted waits for the receiver's notice, and the sender's event loop thread writes the data
only then; a send whose receive is posted is written at once from the sending thread. The list's receive
positions (``schedule/comm_actions.py``, rule 5) are the gaps the receiver reaches at or after the send under
nominal costs, so with real costs about half the receives came after their send, and each of those paid
the rendezvous on the consumer's path (docs/runtime.md has the measurement). Posting ahead keeps FIFO
order per channel (receives are posted in the list's order), holds at most one more receive buffer per
channel, and cannot deadlock: nothing waits on a posted receive until its consumer. NCCL runs a batch as
one group on a stream that an early receive would hold up, so there receives stay where the list puts
them.
"""

from __future__ import annotations

import datetime
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from autopar.errors import RuntimeCommError
from autopar.runtime.comm import watch
from autopar.runtime.execute.stage_runner import StageRunner
from autopar.runtime.execute.state import PendingReceive, wire_view
from autopar.schedule.actions import RECV_KINDS, Action, Kind

Key = tuple[Kind, int, int]  # (kind, microbatch, stage) of a send or receive


class PointToPoint:
    """The sends and receives of one rank's step (``reset`` before each step)."""

    def __init__(
        self,
        stages: dict[int, StageRunner],
        peer_rank: Callable[[int], int],
        batch_isend_irecv: Callable[[list[tuple[bool, torch.Tensor, int]]], list],
        guard: Callable[[Callable, object, int], object],
        timeout: float,
        device: torch.device,
        sub_microbatches: int,
        actions: Sequence[Action] = (),
        ahead: bool = False,
    ):
        self.stages, self.peer_rank, self.guard = stages, peer_rank, guard
        self.batch_isend_irecv = batch_isend_irecv
        self.timeout, self.device, self.sub = timeout, device, sub_microbatches
        self.ahead = ahead
        self.step: int | None = None  # the step being run (``watch.step_begun``): its failures are watched for
        self._channels: dict[int, list[Action]] = defaultdict(list)  # peer rank -> its receives, in list order
        self._kept: dict[Key, list[torch.Tensor]] = {}  # each receive's buffers, for the next step
        for a in actions:
            if a.kind in RECV_KINDS:
                self._channels[self.peer_rank(a.peer)].append(a)  # type: ignore[arg-type]
        self.reset()

    def reset(self) -> None:
        self.to_send: dict[Key, list[torch.Tensor]] = {}  # what the compute left for a SEND_* to ship
        self._pending: dict[Key, PendingReceive] = {}
        self._in_flight: list[tuple[list, Action, int, list[torch.Tensor]]] = []
        self._done: dict[int, object] = {}
        self._unposted = {peer: deque(recvs) for peer, recvs in self._channels.items()}
        self._due: list[int] = []  # channels whose next receive goes up at the next post or wait
        self.posted_at: dict[Action, float] = {}  # with ``ahead``: when each receive was posted

    def start(self) -> None:
        """Open the step: with ``ahead``, post the first receive of every channel."""
        if self.ahead:
            self.post([q[0] for q in self._unposted.values() if q])

    def post(self, batch: Sequence[Action]) -> None:
        """Post ``batch`` (consecutive sends and receives) as one ``batch_isend_irecv``; a receive already
        posted ahead is skipped."""
        ops: list[tuple[bool, torch.Tensor, int]] = []
        posted: list[tuple[Action, list[torch.Tensor], int]] = []
        for a in batch:
            peer = self.peer_rank(a.peer)  # type: ignore[arg-type]
            if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                tensors = self.to_send.pop((a.kind, a.mb, a.stage))  # type: ignore[arg-type]
                ops += [(True, t, peer) for t in tensors]
            else:
                if a in self.posted_at:
                    continue
                queue = self._unposted.get(peer)
                if queue and queue[0] != a:
                    raise RuntimeCommError(f"{a} is posted before {queue[0]}, which precedes it from rank {peer}")
                if queue:
                    queue.popleft()
                if self.ahead:
                    self.posted_at[a] = time.perf_counter()
                tensors = self._buffers(a)
                ops += [(False, wire_view(b), peer) for b in tensors]
            posted.append((a, tensors, peer))
        works = self.guard(lambda: self.batch_isend_irecv(ops), batch[0], -1) if ops else []
        per_op = len(works) == len(ops)  # gloo: one work per op; NCCL may return one for the batch
        k = 0
        for a, tensors, peer in posted:
            mine = works[k : k + len(tensors)] if per_op else list(works)
            k += len(tensors)
            if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                self._in_flight.append((mine, a, peer, tensors))
            else:
                self._pending[(a.kind, a.mb, a.stage)] = PendingReceive(tensors, mine, a, peer)  # type: ignore[index]
        received = {peer for a, _t, peer in posted if a.kind in RECV_KINDS}
        self._due = [peer for peer in self._due if peer not in received]  # the batch posted their next one
        self.post_due()

    def post_due(self) -> None:
        """Post the next receive of every channel whose last one was taken (``ahead``): the executor calls it
        after a compute that no batch of sends follows."""
        due, self._due = self._due, []
        nxt = [q[0] for q in (self._unposted.get(peer) for peer in dict.fromkeys(due)) if q]
        if nxt:
            self.post(nxt)

    def _buffers(self, a: Action) -> list[torch.Tensor]:
        """The receive's buffers: last step's for the same receive when nothing else holds them any more
        (as torch's ``PipelineStage`` keeps its receive buffers), else new ones. A fresh 512 KiB buffer
        cost 40 us a receive here, on the path of the compute waiting for it."""
        key = (a.kind, a.mb, a.stage)
        kept = self._kept.get(key)
        if kept is not None and all(_unshared(t) for t in kept):
            for t in kept:
                t.requires_grad_(False)
                t.grad = None
            return kept
        st = self.stages[a.stage]  # type: ignore[index]
        specs = st.recv if a.kind is Kind.RECV_ACT else [b for b in st.send if b.grad]
        made = [torch.empty(b.shape, dtype=b.dtype, device=self.device) for _ in range(self.sub) for b in specs]
        self._kept[key] = made  # type: ignore[index]
        return made

    def wait(self, key: Key, waited: list[tuple[Action, float]]) -> list[torch.Tensor]:
        """The buffers of the posted receive ``key``, once it has completed (noted in ``waited``)."""
        self.post_due()  # about to block: the time is free
        p = self._pending.pop(key, None)
        if p is None:
            kind, mb, stage = key
            raise RuntimeCommError(
                f"{kind.value} mb={mb} stage={stage} is needed but was never posted: the action list is "
                "unsound for this executor"
            )
        for w, size in zip(p.works, _sizes(p.works, p.buffers)):
            self._complete(w, p.action, p.peer_rank, size)
        waited.append((p.action, time.perf_counter()))
        if self.ahead:  # the channel's next receive, before its sender gets there, but after this
            self._due.append(p.peer_rank)  # consumer's compute and sends: posting it is not on their path
        return p.buffers

    def drain(self) -> None:
        """Wait for every send still in flight (their buffers may then be freed)."""
        self.post_due()
        for works, a, peer, tensors in self._in_flight:
            for w, size in zip(works, _sizes(works, tensors)):
                self._complete(w, a, peer, size)
        self._in_flight = []
        self._done = {}

    def in_flight(self) -> bool:
        """Whether a send or receive of the step is posted and not yet waited for."""
        return bool(self._pending or self._in_flight)

    def _complete(self, work, a: Action, peer: int, nbytes: int) -> None:
        """Wait for one work once (a gloo receive waited twice would wait for another message)."""
        if id(work) in self._done:
            return
        if isinstance(work, dist.Work):  # a rank's failure published in the store stops the wait (comm/watch.py)
            sending = a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD)
            self.guard(lambda: watch.wait_watching(work, self.timeout, self.step, peer, nbytes, sending), a, peer)
        else:  # a simulated rank's transfer (runtime/sim)
            self.guard(lambda: work.wait(timeout=datetime.timedelta(seconds=self.timeout)), a, peer)
        self._done[id(work)] = work  # kept alive until the step ends, so its id is not reused


def _sizes(works: list, tensors: list[torch.Tensor]) -> list[int]:
    """The bytes each work carries: one tensor a work (gloo), else unknown (0: NCCL's batch, which a peer's
    failure does not keep the host waiting on)."""
    return [t.nbytes for t in tensors] if len(works) == len(tensors) else [0] * len(works)


def _unshared(t: torch.Tensor) -> bool:
    """Whether only the caller's reference holds ``t``: no autograd graph, view or other tensor of its
    storage (the second storage count is the temporary that asking takes)."""
    return t._use_count() == 1 and torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2


__all__ = ["PointToPoint"]
