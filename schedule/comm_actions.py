"""Complete per-rank compute orders into full action lists: place every SEND/RECV by the pairing rule.

A schedule generator decides only the order of ``F``, ``B``, ``W`` and ``RECOMPUTE`` on each rank;
``insert_comm_actions`` adds the point-to-point actions and the closing ``REDUCE_GRADS``/``STEP``. The rules, which
the executor may rely on:

1. **Only across ranks.** A stage boundary whose two stages sit on the same rank (the bottom of a
   wave's V) gets no send and no receive; the consumer reads the producer's output locally.
2. **Send right after the producer.** ``SEND_ACT`` follows the ``F`` that made the activation,
   ``SEND_GRAD`` the ``B`` that made the gradient.
3. **FIFO per directed rank pair.** The k-th send from rank a to rank b pairs with the k-th receive
   on rank b from rank a (what NCCL and gloo do without tags), and the simulator rejects a list
   where the k-th receive names another tensor.
4. **Batches.** The sends and receives between two compute actions form one batch, meant for one
   ``torch.distributed.batch_isend_irecv`` call: sends first, then receives.
5. **Receives are posted ahead, where the receiver is when the data is sent.** ``insert_comm_actions`` first puts
   each receive right before its consumer and times the lists with nominal costs (T_F = 1,
   T_B = 2, T_R = 1 per stage, a split B and its W 1 each, no transfer time), under the eager
   semantics below. It then moves
   every receive to the first gap of the receiving rank that the rank leaves no earlier than the
   moment the matching send is posted (never later than the consumer, keeping FIFO order).

Why rule 5: with receives placed right before their consumers, two ranks that send to each other
(interleaved chunks wrap from rank P-1 to rank 0; waves turn at both ends) can each block in a
batch whose send waits for a receive the other posts only one compute later: a deadlock under
blocking p2p. With rule 5 a list cannot deadlock under the strictest semantics, ``batched``: each
batch blocks its rank until every op in it has met its partner. Proof sketch: take a stuck batch X
whose nominal leave time b(X) is smallest. If X waits on a send, its receive is in a gap with
leave time >= the send time, so the receiver is stuck at an earlier gap, whose leave time is
< the send time <= b(X). If X waits on a receive, the sender is stuck before the send's gap, so at a
gap it leaves strictly earlier (compute costs are positive). Either way a stuck batch leaves
earlier than X: a contradiction. Deadlock freedom is a property of the order, not of the costs, so
it holds for any costs. The simulator still checks every generated list in both modes.

Under the nominal costs the move changes no time: the data arrives before the rank leaves the gap
anyway. An executor may post a receive even earlier (prefetch); posting earlier only helps.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Sequence

from autopar.errors import ScheduleError
from autopar.schedule.action_costs import Costs
from autopar.schedule.actions import COMPUTE_KINDS, Action, Kind, Schedule
from autopar.schedule.simulator import simulate

Channel = tuple[int, int]  # (source rank, destination rank)


def _message(a: Action, stage_to_rank: Sequence[int], rank: int) -> tuple[Action, Action, int] | None:
    """The (send, recv, destination rank) that compute action ``a`` on ``rank`` produces, if any."""
    s, num_stages = a.stage, len(stage_to_rank)
    assert s is not None and a.mb is not None
    if a.kind is Kind.F and s + 1 < num_stages and stage_to_rank[s + 1] != rank:
        send, recv = Action(Kind.SEND_ACT, s, a.mb, s + 1), Action(Kind.RECV_ACT, s + 1, a.mb, s)
        return send, recv, stage_to_rank[s + 1]
    if a.kind is Kind.B and s > 0 and stage_to_rank[s - 1] != rank:
        send, recv = Action(Kind.SEND_GRAD, s, a.mb, s - 1), Action(Kind.RECV_GRAD, s - 1, a.mb, s)
        return send, recv, stage_to_rank[s - 1]
    return None


class _Messages:
    """Every cross-rank message of a set of compute orders: who sends it after which compute."""

    def __init__(self, compute: Sequence[Sequence[Action]], stage_to_rank: Sequence[int]) -> None:
        self.compute = compute
        # per channel, in the sender's order: (index of the producing compute, the receive)
        self.by_channel: dict[Channel, list[tuple[int, Action]]] = defaultdict(list)
        self.sends: list[dict[int, Action]] = [{} for _ in compute]  # rank -> producer index -> send
        self.consumer: list[dict[Action, int]] = [{} for _ in compute]  # rank -> receive -> consumer
        for rank, order in enumerate(compute):
            for i, a in enumerate(order):
                if a.kind not in COMPUTE_KINDS:
                    raise ScheduleError(f"rank {rank} compute order holds {a}; give only F, B, W and RECOMPUTE")
                if a.kind in (Kind.RECOMPUTE, Kind.W):  # they neither send nor receive
                    continue
                msg = _message(a, stage_to_rank, rank)
                if msg is not None:
                    self.sends[rank][i] = msg[0]
                    self.by_channel[(rank, msg[2])].append((i, msg[1]))
                recv = _needed(a, stage_to_rank, rank)
                if recv is not None:
                    self.consumer[rank][recv] = i

    def assemble(self, recv_gap: Callable[[int, int, int, Action], int]) -> tuple[tuple[Action, ...], ...]:
        """Full lists; ``recv_gap(src, producer index, dst, recv)`` picks the gap of each receive.

        Gap ``g`` sits just before compute ``g``. Receives of one channel keep the sender's order.
        """
        recvs: list[dict[int, list[Action]]] = [defaultdict(list) for _ in self.compute]
        for (src, dst), msgs in sorted(self.by_channel.items()):
            latest = len(self.compute[dst])
            placed = []
            for i, recv in reversed(msgs):  # FIFO: no receive later than the one after it
                if recv not in self.consumer[dst]:
                    raise ScheduleError(f"rank {dst} never consumes {recv}, which rank {src} sends")
                latest = min(latest, recv_gap(src, i, dst, recv), self.consumer[dst][recv])
                placed.append((latest, recv))
            for gap, recv in reversed(placed):
                recvs[dst][gap].append(recv)
        lists = []
        for rank, order in enumerate(self.compute):
            out: list[Action] = []
            for gap in range(len(order) + 1):
                if gap and gap - 1 in self.sends[rank]:
                    out.append(self.sends[rank][gap - 1])
                out.extend(recvs[rank].get(gap, ()))
                if gap < len(order):
                    out.append(order[gap])
            last = {a.stage: i for i, a in enumerate(order) if a.kind in (Kind.B, Kind.W)}  # after the last W
            out.extend(Action(Kind.REDUCE_GRADS, s) for s in sorted(last, key=last.__getitem__))
            out.append(Action(Kind.STEP))
            lists.append(tuple(out))
        return tuple(lists)


def _needed(a: Action, stage_to_rank: Sequence[int], rank: int) -> Action | None:
    """The receive compute action ``a`` on ``rank`` consumes, if its producer is on another rank."""
    s = a.stage
    assert s is not None
    if a.kind is Kind.F and s > 0 and stage_to_rank[s - 1] != rank:
        return Action(Kind.RECV_ACT, s, a.mb, s - 1)
    if a.kind is Kind.B and s + 1 < len(stage_to_rank) and stage_to_rank[s + 1] != rank:
        return Action(Kind.RECV_GRAD, s, a.mb, s + 1)
    return None


def insert_comm_actions(
    compute: Sequence[Sequence[Action]],
    stage_to_rank: Sequence[int],
    num_microbatches: int,
    *,
    post_ahead: bool = True,
) -> tuple[tuple[Action, ...], ...]:
    """Insert sends, receives, ``REDUCE_GRADS`` and ``STEP`` into per-rank compute orders.

    ``post_ahead=False`` skips rule 5 and leaves every receive right before its consumer (FIFO
    kept): sound under eager p2p, but it can deadlock under blocking batched p2p.
    """
    msgs = _Messages(compute, stage_to_rank)
    first = msgs.assemble(lambda src, i, dst, recv: msgs.consumer[dst][recv])
    if not post_ahead:
        return first
    # Time the lists with nominal costs, then post each receive where its rank is when the data is
    # sent. Receives move only earlier, so the eager timing is unchanged.
    num_ranks, num_stages = len(compute), len(stage_to_rank)
    nominal = Costs.uniform(num_stages, tf=1, tb=2, tr=1, tc=0)
    sched = Schedule(num_ranks, num_stages, num_microbatches, tuple(stage_to_rank), first)
    timeline = simulate(sched, nominal).timeline
    starts = [[e.start for e in events if e.action.kind in COMPUTE_KINDS] for events in timeline]
    ends = [[e.end for e in events if e.action.kind in COMPUTE_KINDS] for events in timeline]
    leave = [s + [e[-1] if e else 0] for s, e in zip(starts, ends)]  # time a rank leaves each gap

    def gap_at_send(src: int, i: int, dst: int, recv: Action) -> int:
        return bisect_left(leave[dst], ends[src][i])

    return msgs.assemble(gap_at_send)
