"""Run every rank's action list against per-action costs: prove it sound, time it, measure memory.

``simulate(schedule, costs)`` executes the lists of all ranks as soon as possible: each rank runs
its actions in order, a compute action starts when the rank is free, a receive completes when the
matching send's data has arrived. It raises ``ScheduleError`` naming the rank, the action index and
the action when a list is unsound:

- a forward whose input is not there (no ``RECV_ACT`` before it, or the previous stage's ``F`` has
  not run on this rank when the hand-over is local); a backward before its forward, before its
  ``RECOMPUTE``, or before its output gradient arrived; a ``W`` before its ``B``; a duplicate or
  missing ``F``/``B``/``W``;
- a send to a stage on the same rank (local hand-overs have no p2p), a send before the tensor
  exists, a receive paired with a send of another tensor (pairing is FIFO per directed rank pair,
  see ``autopar.schedule.comm_actions``), a send that nobody receives;
- a deadlock: no rank can move; the error lists where every unfinished rank is stuck.

Point-to-point semantics (``p2p=``):

- ``"eager"`` (default, used for timing): a compute action starts ``t_action`` (the executor's own
  time) after its rank is free and its data has arrived; a send never blocks its rank
  (``isend`` posted, data on the wire for ``tc``; issuing it holds the sender ``t_send``); a receive
  is posted where it stands and its data is there at ``send time + tc``; the compute that consumes it
  waits until then. This is the prefetching runtime of Hanayo section 4.2 and the papers' idealised
  timing.
- ``"batched"``: each maximal run of consecutive sends/receives in a list is one
  ``batch_isend_irecv``, and the rank blocks until every op in it has met its partner (a send needs
  the receiver to have posted its receive): the transfer runs from the later of the two posts for
  ``tc``. A list that passes here cannot deadlock under blocking-but-batched p2p.

A ``B`` whose ``W`` is in the list (``actions.split_backwards``) costs ``tb - tw`` and the ``W``
``tw``; an unsplit ``B`` costs ``tb``. A microbatch-stage stays stashed until its backward is complete
(``actions.ends_backward``): its ``W`` when split.

The result, with both bubble ratios the papers use, is a ``SimResult`` (``autopar.schedule.timeline``).
"""

from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

from autopar.errors import ScheduleError
from autopar.schedule.action_costs import Costs, Number
from autopar.schedule.actions import (
    COMPUTE_KINDS,
    P2P_KINDS,
    SEND_KINDS,
    Action,
    Kind,
    Schedule,
    ends_backward,
    split_backwards,
)
from autopar.schedule.timeline import Event, SimResult, Transfer

Key = tuple[Kind, int, int]  # (kind, mb, stage) of a receive, as seen by the receiving rank
Channel = tuple[int, int]  # (source rank, destination rank)


class _Rank:
    """What one rank has done so far: finished tensors and its stash of activations."""

    def __init__(self, index: int, split: frozenset[tuple[int, int]]) -> None:
        self.index = index
        self.split = split  # (mb, stage) whose backward is a B and a later W
        self.weights: set[tuple[int, int]] = set()  # W done
        self.pc = 0
        self.clock: Number = 0
        self.fwd: dict[tuple[int, int], Fraction] = {}  # (mb, stage) -> recompute fraction
        self.bwd: set[tuple[int, int]] = set()
        self.recomputed: set[tuple[int, int]] = set()
        self.posted: dict[Key, int] = {}  # receive -> its action index
        self.sent: set[Key] = set()
        self.reduced: set[int] = set()
        self.stash, self.peak = 0, 0
        self.bytes: Number = 0
        self.peak_bytes: Number = 0
        self.events: list[Event] = []
        self.p2p_events: list[tuple[Action, Number, Channel, int]] = []
        self.batch: list[tuple[Channel, int]] | None = None  # batched mode: the posted, unfinished batch
        self.batch_end = 0


class _Sim:
    def __init__(self, schedule: Schedule, costs: Costs, p2p: str) -> None:
        if costs.num_stages != schedule.num_stages:
            raise ScheduleError(f"costs are for {costs.num_stages} stages, the schedule has {schedule.num_stages}")
        if p2p not in ("eager", "batched"):
            raise ScheduleError(f"p2p must be 'eager' or 'batched', not {p2p!r}")
        self.s, self.c, self.mode = schedule, costs, p2p
        self.ranks = [_Rank(r, split_backwards(lst)) for r, lst in enumerate(schedule.actions)]
        # per channel: sends and posted receives in FIFO order, as (action, post time, action index)
        self.sends: dict[Channel, list[tuple[Action, Number, int]]] = defaultdict(list)
        self.recvs: dict[Channel, list[tuple[Action, Number, int]]] = defaultdict(list)
        self.paired: dict[Channel, int] = defaultdict(int)
        self.done_at: dict[tuple[Channel, int], Number] = {}  # transfer end of the k-th pair
        self.arrival: dict[tuple[int, Key], Number] = {}  # (receiving rank, receive) -> data there
        self.transfers: list[Transfer] = []

    def fail(self, rank: _Rank, msg: str, index: int | None = None) -> ScheduleError:
        i = rank.pc if index is None else index
        return ScheduleError(f"rank {rank.index} action {i} ({self.s.actions[rank.index][i]}): {msg}")

    def run(self) -> SimResult:
        lists, progress = self.s.actions, True
        while progress:
            progress = False
            for rank in self.ranks:
                while rank.pc < len(lists[rank.index]) and self.step(rank):
                    progress = True
        stuck = [r for r in self.ranks if r.pc < len(lists[r.index])]
        if stuck:
            raise ScheduleError("deadlock, no rank can move: " + "; ".join(self.why_stuck(r) for r in stuck))
        self.check_complete()
        ranks = self.ranks
        for rank in ranks:
            for a, post, ch, k in rank.p2p_events:
                rank.events.append(Event(rank.index, a, post, max(post, self.done_at[(ch, k)])))
            rank.events.sort(key=lambda e: (e.start, e.end))
        return SimResult(
            schedule=self.s,
            timeline=[r.events for r in self.ranks],
            transfers=self.transfers,
            step_time=max(r.clock for r in self.ranks),
            busy=[sum((e.end - e.start for e in r.events if e.action.kind in COMPUTE_KINDS), 0) for r in ranks],
            peak_activations=[r.peak for r in ranks],
            peak_activation_bytes=[r.peak_bytes for r in ranks] if self.c.act_bytes is not None else None,
        )

    def why_stuck(self, rank: _Rank) -> str:
        where = f"rank {rank.index} at action {rank.pc} ({self.s.actions[rank.index][rank.pc]})"
        if rank.batch is not None:
            return where + " waits for its batch's partners to post"
        need = self.needs(rank, self.s.actions[rank.index][rank.pc])
        return where + (f" waits for the data of its action {rank.posted[need]}" if need else "")

    def check_complete(self) -> None:
        for (src, dst), sends in self.sends.items():
            n = len(self.recvs[(src, dst)])
            if len(sends) > n:
                raise self.fail(self.ranks[src], f"no matching receive on rank {dst}", sends[n][2])
        for rank in self.ranks:
            for stage in self.s.stages_of_rank(rank.index):
                for mb in range(self.s.num_microbatches):
                    if not self.finished(rank, mb, stage):
                        what = "W" if (mb, stage) in rank.bwd else "B" if (mb, stage) in rank.fwd else "F"
                        raise ScheduleError(f"rank {rank.index} never runs {what}(mb={mb}, stage={stage})")

    @staticmethod
    def finished(rank: _Rank, mb: int, stage: int) -> bool:
        """Whether the backward of (mb, stage) is complete on ``rank`` (its W ran, when split)."""
        key = (mb, stage)
        return key in rank.weights if key in rank.split else key in rank.bwd

    def step(self, rank: _Rank) -> bool:
        """Run rank's next action if it can; False when it must wait for another rank."""
        a = self.s.actions[rank.index][rank.pc]
        if a.kind in P2P_KINDS:
            return self.p2p_eager(rank, a) if self.mode == "eager" else self.p2p_batched(rank)
        self.check_compute(rank, a)
        need = self.needs(rank, a)
        if need is not None and (rank.index, need) not in self.arrival:
            return False
        ready = max(rank.clock, self.arrival[(rank.index, need)]) if need is not None else rank.clock
        start = ready + (self.c.t_action if a.kind in COMPUTE_KINDS else 0)  # the executor's own time, after its data
        self.account(rank, a)
        end = start + self.cost(a, rank.split)
        rank.events.append(Event(rank.index, a, start, end))
        rank.clock, rank.pc = end, rank.pc + 1
        return True

    def needs(self, rank: _Rank, a: Action) -> Key | None:
        """The received tensor compute action ``a`` consumes, if its producer is on another rank."""
        s, local = a.stage, self.s.stage_to_rank
        if a.kind is Kind.F and s and local[s - 1] != rank.index:
            return (Kind.RECV_ACT, a.mb, s)  # type: ignore[return-value]
        if a.kind is Kind.B and s is not None and s + 1 < len(local) and local[s + 1] != rank.index:
            return (Kind.RECV_GRAD, a.mb, s)  # type: ignore[return-value]
        return None

    def cost(self, a: Action, split: frozenset[tuple[int, int]]) -> Number:
        s, c = a.stage, self.c
        if a.kind is Kind.STEP:
            return c.t_step
        assert s is not None
        if a.kind is Kind.F:
            return c.tf[s]
        if a.kind is Kind.B:
            return c.tb[s] - c.tw[s] if (a.mb, s) in split else c.tb[s]  # type: ignore[index]
        if a.kind is Kind.W:
            return c.tw[s]  # type: ignore[index]
        if a.kind is Kind.RECOMPUTE:
            return c.tr[s] * a.recompute
        return c.t_reduce[s] if c.t_reduce is not None else 0

    def check_compute(self, rank: _Rank, a: Action) -> None:
        s, mb, key, last = a.stage, a.mb, (a.mb, a.stage), self.s.num_stages - 1
        local = self.s.stage_to_rank
        if a.kind is Kind.F:
            assert s is not None and mb is not None
            if key in rank.fwd:
                raise self.fail(rank, "second forward of this microbatch and stage")
            if s > 0 and local[s - 1] == rank.index and (mb, s - 1) not in rank.fwd:
                raise self.fail(rank, f"input from stage {s - 1} (same rank) not computed yet")
            if s > 0 and local[s - 1] != rank.index and (Kind.RECV_ACT, mb, s) not in rank.posted:
                raise self.fail(rank, f"input from stage {s - 1} on rank {local[s - 1]}: no RECV_ACT before it")
        elif a.kind is Kind.B:
            assert s is not None and mb is not None
            if key not in rank.fwd:
                raise self.fail(rank, "backward before its forward")
            if key in rank.bwd:
                raise self.fail(rank, "second backward of this microbatch and stage")
            if rank.fwd[key] and key not in rank.recomputed:
                raise self.fail(rank, "backward before the RECOMPUTE its checkpointed forward needs")
            if s < last and local[s + 1] == rank.index and (mb, s + 1) not in rank.bwd:
                raise self.fail(rank, f"output gradient from stage {s + 1} (same rank) not computed yet")
            if s < last and local[s + 1] != rank.index and (Kind.RECV_GRAD, mb, s) not in rank.posted:
                raise self.fail(rank, f"gradient from stage {s + 1} on rank {local[s + 1]}: no RECV_GRAD before it")
        elif a.kind is Kind.W:
            if key not in rank.bwd:
                raise self.fail(rank, "weight gradients before the B of this microbatch and stage")
            if key in rank.weights:
                raise self.fail(rank, "second W of this microbatch and stage")
        elif a.kind is Kind.RECOMPUTE:
            if key not in rank.fwd or key in rank.bwd or key in rank.recomputed:
                raise self.fail(rank, "recompute needs a stashed forward whose backward has not run")
            if rank.fwd[key] != a.recompute:
                raise self.fail(rank, f"its forward checkpointed a fraction {rank.fwd[key]}, not {a.recompute}")
        elif a.kind is Kind.REDUCE_GRADS:
            assert s is not None
            if any(not self.finished(rank, m, s) for m in range(self.s.num_microbatches)) or s in rank.reduced:
                raise self.fail(rank, "gradients reduced before every backward (and W) of the stage ran, or twice")
            rank.reduced.add(s)
        elif a.kind is Kind.STEP and rank.reduced != set(self.s.stages_of_rank(rank.index)):
            raise self.fail(rank, "optimizer step before REDUCE_GRADS of every stage on this rank")

    def account(self, rank: _Rank, a: Action) -> None:
        """Record the tensor the action made and update the activation stash."""
        key, s = (a.mb, a.stage), a.stage
        if a.kind is Kind.F:
            rank.fwd[key] = a.recompute  # type: ignore[index]
            rank.stash += 1
            rank.peak = max(rank.peak, rank.stash)
        elif a.kind is Kind.RECOMPUTE:
            rank.recomputed.add(key)  # type: ignore[arg-type]
        elif a.kind is Kind.B:
            rank.bwd.add(key)  # type: ignore[arg-type]
        elif a.kind is Kind.W:
            rank.weights.add(key)  # type: ignore[arg-type]
        done = ends_backward(a, rank.split)
        rank.stash -= done
        if self.c.act_bytes is None or s is None or a.kind not in COMPUTE_KINDS:
            return
        act = self.c.act_bytes[s]
        inp = self.c.input_bytes[s] if self.c.input_bytes is not None else 0
        grads = self.c.w_bytes[s] if self.c.w_bytes is not None and key in rank.split else 0
        x = rank.fwd[key]  # type: ignore[index]
        kept = (1 - x) * act + x * inp if x else act
        if a.kind is Kind.F:
            rank.bytes += kept
        elif a.kind is Kind.RECOMPUTE:
            rank.bytes += x * act
        elif not done:  # a split B: the stash stays, the weight ops' output gradients join it
            rank.bytes += grads
        else:
            rank.bytes -= kept + x * act + grads
        rank.peak_bytes = max(rank.peak_bytes, rank.bytes)

    def post(self, rank: _Rank, a: Action, index: int) -> tuple[Channel, int]:
        """Check and post one send or receive; returns its channel and FIFO position."""
        assert a.peer is not None
        peer_rank = self.s.stage_to_rank[a.peer]
        if peer_rank == rank.index:
            raise self.fail(rank, f"stage {a.peer} is on this rank: the hand-over is local, not p2p", index)
        key: Key = (a.kind, a.mb, a.stage)  # type: ignore[assignment]
        if a.kind in SEND_KINDS:
            made = rank.fwd if a.kind is Kind.SEND_ACT else rank.bwd
            if (a.mb, a.stage) not in made:
                raise self.fail(rank, "sends a tensor this rank has not computed yet", index)
            if key in rank.sent:
                raise self.fail(rank, "second send of this tensor", index)
            rank.sent.add(key)
            ch, queue = (rank.index, peer_rank), self.sends
        else:
            if key in rank.posted:
                raise self.fail(rank, "second receive of this tensor", index)
            rank.posted[key] = index
            ch, queue = (peer_rank, rank.index), self.recvs
        queue[ch].append((a, rank.clock, index))
        rank.p2p_events.append((a, rank.clock, ch, len(queue[ch]) - 1))
        self.pair(ch)
        return ch, len(queue[ch]) - 1

    def pair(self, ch: Channel) -> None:
        """Match the channel's sends and receives in FIFO order as far as both are posted."""
        for k in range(self.paired[ch], min(len(self.sends[ch]), len(self.recvs[ch]))):
            send, t_send, i_send = self.sends[ch][k]
            recv, t_recv, i_recv = self.recvs[ch][k]
            want = Kind.RECV_ACT if send.kind is Kind.SEND_ACT else Kind.RECV_GRAD
            if (recv.kind, recv.mb, recv.stage, recv.peer) != (want, send.mb, send.peer, send.stage):
                msg = f"pairs (FIFO from rank {ch[0]}) with its action {i_send} ({send})"
                raise self.fail(self.ranks[ch[1]], msg, i_recv)
            start = t_send if self.mode == "eager" else max(t_send, t_recv)
            end = start + self.c.tc[min(send.stage, send.peer)]  # type: ignore[type-var]
            self.done_at[(ch, k)] = end
            self.arrival[(ch[1], (recv.kind, recv.mb, recv.stage))] = end  # type: ignore[index]
            self.transfers.append(Transfer(ch[0], ch[1], send, recv, start, end))
            self.paired[ch] = k + 1

    def p2p_eager(self, rank: _Rank, a: Action) -> bool:
        self.post(rank, a, rank.pc)
        if a.kind in SEND_KINDS:
            rank.clock += self.c.t_send  # issuing it holds the rank; its data leaves when it is posted
        rank.pc += 1
        return True

    def p2p_batched(self, rank: _Rank) -> bool:
        lst = self.s.actions[rank.index]
        if rank.batch is None:
            end = rank.pc
            while end < len(lst) and lst[end].kind in P2P_KINDS:
                end += 1
            rank.batch = [self.post(rank, lst[i], i) for i in range(rank.pc, end)]
            rank.batch_end = end
        if any(k >= self.paired[ch] for ch, k in rank.batch):
            return False
        sends = sum(lst[i].kind in SEND_KINDS for i in range(rank.pc, rank.batch_end))
        rank.clock = max([rank.clock + sends * self.c.t_send] + [self.done_at[op] for op in rank.batch])
        rank.pc, rank.batch = rank.batch_end, None
        return True


def simulate(schedule: Schedule, costs: Costs, *, p2p: str = "eager") -> SimResult:
    """Execute ``schedule`` with ``costs``; raise ``ScheduleError`` if it is unsound (see module doc)."""
    return _Sim(schedule, costs, p2p).run()
