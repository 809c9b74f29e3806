"""The executor's point-to-point (runtime/execute/p2p.py): with ``ahead`` every channel keeps its next receive
posted (the first at the step's start, the next once the one before is taken: with the consumer's sends, or
before the rank next waits), in the list's FIFO order, each once; without it receives are posted where the
list puts them. Cost: well under a second."""

from __future__ import annotations

import pytest
import torch

from autopar.errors import RuntimeCommError
from autopar.runtime.execute.p2p import PointToPoint
from autopar.runtime.execute.stage_runner import Buffer, Part, StageRunner
from autopar.schedule.actions import COMPUTE_KINDS, RECV_KINDS, SEND_KINDS, Action, Kind
from autopar.schedule.generators import make_schedule


class _Work:
    def wait(self, timeout=None) -> None:
        pass


def _replay(name: str, rank: int, ahead: bool) -> tuple[list[tuple[str, Action]], list[Action]]:
    """Run ``rank``'s list of schedule ``name`` (P = 4, M = 8) through a PointToPoint as the executor does:
    each batch posted, each F/B waiting for its receive. Returns what the transport saw, in order
    (("post", receive) and ("take", receive)), and the list's receives."""
    sched = make_schedule(name, 4, 8)
    actions = sched.actions[rank]
    buf = Buffer("x", (2,), torch.float32, True)
    part = Part(lambda env: (env["x"],), ("x",), (True,))
    stages = {s: StageRunner(s, part, [buf], [buf], s == sched.num_stages - 1) for s in sched.stages_of_rank(rank)}
    seen: list[tuple[str, Action]] = []

    def batch(ops):
        return [_Work() for _ in ops]

    p2p = PointToPoint(
        stages, lambda s: sched.stage_to_rank[s], batch, lambda fn, _what, _peer: fn(), 60.0,
        torch.device("cpu"), 1, actions, ahead,
    )  # fmt: skip
    posted = p2p.post

    def post(acts):
        seen.extend(("post", a) for a in acts if a.kind in RECV_KINDS and a not in p2p.posted_at)
        posted(acts)

    p2p.post = post  # type: ignore[method-assign]
    p2p.reset()
    p2p.start()
    s2r, i = sched.stage_to_rank, 0
    while i < len(actions):
        a = actions[i]
        if a.kind in SEND_KINDS | RECV_KINDS:
            j = i
            while j < len(actions) and actions[j].kind in SEND_KINDS | RECV_KINDS:
                j += 1
            for b in actions[i:j]:
                if b.kind in SEND_KINDS:
                    p2p.to_send[(b.kind, b.mb, b.stage)] = [torch.zeros(2)]
            p2p.post(actions[i:j])
            i = j
            continue
        if a.kind in COMPUTE_KINDS and a.kind is not Kind.W:
            s = a.stage
            if a.kind is Kind.F and s > 0 and s2r[s - 1] != rank:
                key = (Kind.RECV_ACT, a.mb, s)
            elif a.kind is Kind.B and s + 1 < len(s2r) and s2r[s + 1] != rank:
                key = (Kind.RECV_GRAD, a.mb, s)
            else:
                key = None
            if key is not None:
                seen.append(("take", Action(key[0], s, a.mb, s - 1 if key[0] is Kind.RECV_ACT else s + 1)))
                p2p.wait(key, [])
        if a.kind in COMPUTE_KINDS:
            seen.append(("compute", a))
        i += 1
        if i < len(actions) and actions[i].kind not in SEND_KINDS | RECV_KINDS:
            p2p.post_due()
    return seen, [a for a in actions if a.kind in RECV_KINDS]


def _late(seen: list[tuple[str, Action]], recvs: list[Action], s2r) -> list[Action]:
    """Receives posted later than they should be: the first of a channel after the step's first compute; any
    other after the second compute that follows the take of the one before it on its channel (the first is
    that receive's consumer: its sends carry the post, or the post follows it)."""
    computes = [i for i, (what, _a) in enumerate(seen) if what == "compute"]
    late = []
    for peer in {s2r[a.peer] for a in recvs}:
        mine = [a for a in recvs if s2r[a.peer] == peer]
        if computes and seen.index(("post", mine[0])) > computes[0]:
            late.append(mine[0])
        for b, n in zip(mine, mine[1:]):
            after = [i for i in computes if i > seen.index(("take", b))]
            if len(after) > 1 and seen.index(("post", n)) > after[1]:
                late.append(n)
    return late


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "1f1b"])
def test_each_channel_keeps_its_next_receive_posted(name: str) -> None:
    s2r = make_schedule(name, 4, 8).stage_to_rank
    for rank in range(4):
        seen, recvs = _replay(name, rank, ahead=True)
        posts = [a for what, a in seen if what == "post"]
        assert sorted(map(str, posts)) == sorted(map(str, recvs)) and len(set(posts)) == len(posts)
        for peer in {s2r[a.peer] for a in recvs}:  # FIFO: the list's order per channel
            assert [a for a in posts if s2r[a.peer] == peer] == [a for a in recvs if s2r[a.peer] == peer]
        assert not _late(seen, recvs, s2r), rank


def test_without_ahead_receives_are_posted_where_the_list_puts_them() -> None:
    """The list alone posts some receives later than ``ahead`` does (so the test above can fail)."""
    sched = make_schedule("zbv", 4, 8)
    seen, recvs = _replay("zbv", 1, ahead=False)
    assert [a for what, a in seen if what == "post"] == recvs
    assert _late(seen, recvs, sched.stage_to_rank)


def test_a_receive_out_of_the_channels_order_is_an_error() -> None:
    sched = make_schedule("1f1b", 2, 2)
    buf = Buffer("x", (2,), torch.float32, True)
    part = Part(lambda env: (env["x"],), ("x",), (True,))
    stages = {1: StageRunner(1, part, [buf], [], True)}
    recvs = [a for a in sched.actions[1] if a.kind in RECV_KINDS]
    p2p = PointToPoint(
        stages, lambda s: sched.stage_to_rank[s], lambda ops: [_Work() for _ in ops], lambda fn, *_: fn(), 60.0,
        torch.device("cpu"), 1, sched.actions[1], False,
    )  # fmt: skip
    with pytest.raises(RuntimeCommError, match="is posted before"):
        p2p.post([recvs[1]])


def test_a_receive_buffer_is_reused_only_when_nothing_else_holds_it() -> None:
    """Each receive's buffers are the last step's again (as torch's PipelineStage keeps its own), unless a
    view of them, an autograd graph that saved them, or any other tensor still holds them: then new ones."""
    sched = make_schedule("1f1b", 2, 2)
    buf = Buffer("x", (2, 3), torch.float32, True)
    part = Part(lambda env: (env["x"],), ("x",), (True,))
    stages = {1: StageRunner(1, part, [buf], [], True)}
    p2p = PointToPoint(stages, lambda s: s, lambda ops: [_Work() for _ in ops], lambda fn, *_: fn(), 60.0,
                       torch.device("cpu"), 1, sched.actions[1], True)  # fmt: skip
    recv = next(a for a in sched.actions[1] if a.kind in RECV_KINDS)

    def address() -> int:
        return p2p._buffers(recv)[0].data_ptr()

    first = address()
    assert address() == first  # nothing held it: the same buffer
    held = p2p._buffers(recv)[0][:1]  # a view of it, as a user's output might be
    assert address() != first
    del held
    second = address()
    assert address() == second
    leaf = p2p._buffers(recv)[0].requires_grad_(True)
    loss = (leaf * torch.ones(2, 3, requires_grad=True)).sum()  # the graph saves the leaf
    del leaf
    assert address() != second
    loss.backward()
    del loss
    third = address()
    assert address() == third
    x = p2p._buffers(recv)[0]
    assert not x.requires_grad and x.grad is None
