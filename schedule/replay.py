"""Timing-only replay of a sound schedule: what ``simulate`` says of its times, without checking or recording.

The search simulates a candidate's schedule to time it (``search/score.py``), every schedule one of the registry's
(``generators.py``), each already proved sound by ``simulate`` in the property tests. ``simulate`` checks every
action (its data there, no duplicate, the FIFO pairing of every send with its receive), records every event and
transfer, and works on ``Action`` objects: at pp = 64 and a few hundred microbatches that is seconds of CPU per
schedule, most of the search's time. ``Replay(schedule)`` compiles the lists once into a flat program, in an order
every action's inputs precede, and ``Replay.run(costs)`` times it: per rank the end of its last compute action and
its compute seconds, exactly (the same float operations in the same order) what ``simulate(schedule, costs)``
gives in its ``"eager"`` p2p mode (``tests/test_replay.py`` compares them on every registered schedule).

The eager mode's times form a DAG over each rank's fixed order: a send is posted at its rank's clock (which then
advances by ``t_send``), a receive only posts (no time), and a compute action starts ``t_action`` after the later
of its rank's clock and the arrival of the tensor it consumes from another rank, which is its send's post time
plus the boundary's ``tc``. ``REDUCE_GRADS`` and ``STEP`` take their cost on the rank's clock. The program is
only for schedules ``simulate`` accepts: an unsound one is refused while compiling (a deadlock) or timed
meaninglessly (a missing receive is not noticed); build with ``simulate`` when in doubt.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from fractions import Fraction

from autopar.errors import ScheduleError
from autopar.schedule.action_costs import Costs, Number
from autopar.schedule.actions import SEND_KINDS, Action, Kind, Schedule, split_backwards

# op codes of the compiled program
_SEND, _COMPUTE, _OTHER = 0, 1, 2
_FORMAT = "replay 1"  # the first line of ``Replay.to_text``


class Replay:
    """A schedule compiled for timing (see the module docstring). ``ops`` is the program, five integers an op
    (``array``: a pp = 64 schedule of a few hundred microbatches has ~300k ops), in an order where every
    action comes after the actions it waits for; ``recipe`` says how each cost slot is read off a ``Costs``."""

    __slots__ = ("ops", "recipe", "num_ranks", "num_stages", "num_sends")

    def __init__(self, schedule: Schedule | None = None):
        if schedule is None:  # filled by from_text
            return
        self.num_ranks, self.num_stages = schedule.num_ranks, schedule.num_stages
        local = schedule.stage_to_rank
        self._compile(schedule.name, [_entries(lst, local, r) for r, lst in enumerate(schedule.actions)])

    @classmethod
    def from_orders(cls, name: str, compute: Sequence[Sequence[Action]], stage_to_rank: Sequence[int]) -> Replay:
        """The program of ``insert_comm_actions(compute, stage_to_rank, ..., post_ahead=False)``'s lists, compiled
        straight from the compute orders (no ``Action`` for a transfer): each send right after its producer, the
        receives (no time in the eager mode) left out, ``REDUCE_GRADS`` after each stage's last ``B``/``W`` and
        ``STEP`` last, as ``comm_actions`` places them (the same ops, ``tests/test_replay.py``)."""
        r = cls()
        r.num_ranks, r.num_stages = len(compute), len(stage_to_rank)
        r._compile(name, [_order_entries(order, stage_to_rank, rank) for rank, order in enumerate(compute)])
        return r

    def _compile(self, name: str, lists: list[list[tuple]]) -> None:
        """Fill the program from each rank's entries (``_entries``) by the simulator's own sweep."""
        slots: dict[tuple, int] = {}  # (what, stage, fraction) -> cost slot
        sends: dict[tuple, int] = {}  # (kind, mb, stage) of a send -> its slot of post times
        ops: list[int] = []  # five an op: code, rank, cost or post slot, send slot or -1, tc stage
        pcs = [0] * self.num_ranks
        progress = True
        while progress:  # each rank as far as it can go, until none can move
            progress = False
            for r, lst in enumerate(lists):
                pc = pcs[r]
                while pc < len(lst):
                    code, key, dep_key, tc = lst[pc]
                    if code == _SEND:
                        sends[key] = len(sends)
                        ops += (_SEND, r, sends[key], -1, 0)
                    elif code == _OTHER:
                        ops += (_OTHER, r, slots.setdefault(key, len(slots)), -1, 0)
                    else:
                        dep = -1
                        if dep_key is not None:
                            dep = sends.get(dep_key, -2)
                            if dep == -2:  # its tensor is not sent yet: another rank first
                                break
                        ops += (_COMPUTE, r, slots.setdefault(key, len(slots)), dep, tc)
                    pc += 1
                    progress = True
                pcs[r] = pc
        stuck = [r for r, lst in enumerate(lists) if pcs[r] < len(lst)]
        if stuck:
            raise ScheduleError(f"schedule {name}: ranks {stuck} wait for a tensor never sent (simulate it)")
        self.ops = array("i", ops)
        self.recipe = sorted(slots, key=slots.__getitem__)
        self.num_sends = len(sends)

    def to_text(self) -> str:
        """The program as text (``from_text`` reads it back): a header, the cost slots, every op's five integers."""
        recipe = [[what, s, str(x)] for what, s, x in self.recipe]
        head = f"{_FORMAT} ranks={self.num_ranks} stages={self.num_stages} sends={self.num_sends}"
        return "\n".join([head, json.dumps(recipe), " ".join(map(str, self.ops))]) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Replay:
        """Read ``to_text``'s form; ``ScheduleError`` when it is not that form."""
        lines = text.split("\n")
        if len(lines) < 3 or not lines[0].startswith(_FORMAT + " "):
            raise ScheduleError(f"not a schedule replay ({_FORMAT!r} header)")
        try:
            sizes = dict(w.split("=") for w in lines[0][len(_FORMAT) :].split())
            ints = array("i", map(int, lines[2].split()))
            r = cls()
            r.num_ranks, r.num_stages, r.num_sends = (int(sizes[k]) for k in ("ranks", "stages", "sends"))
            r.recipe = [(what, s, Fraction(x)) for what, s, x in json.loads(lines[1])]
        except (ValueError, KeyError, TypeError) as e:
            raise ScheduleError(f"damaged schedule replay: {e}") from None
        if len(ints) % 5:
            raise ScheduleError("damaged schedule replay: its ops are not five integers each")
        r.ops = ints
        return r

    def _table(self, c: Costs) -> list[Number]:
        """Each cost slot's value, computed as ``simulate`` computes the action's cost."""
        out: list[Number] = []
        for what, s, x in self.recipe:
            if what == "f":
                out.append(c.tf[s])
            elif what == "b":
                out.append(c.tb[s])
            elif what == "b split":
                out.append(c.tb[s] - c.tw[s])  # type: ignore[index]
            elif what == "w":
                out.append(c.tw[s])  # type: ignore[index]
            elif what == "r":
                out.append(c.tr[s] * x)
            elif what == "reduce":
                out.append(c.t_reduce[s] if c.t_reduce is not None else 0)
            else:
                out.append(c.t_step)
        return out

    def run(self, costs: Costs) -> tuple[list[float], list[Number]]:
        """(per rank the end of its last compute action, as a float (0.0 without one); per rank its compute
        seconds): ``simulate(schedule, costs)``'s ``max`` of its compute events' ends and its ``busy``."""
        if costs.num_stages != self.num_stages:
            raise ScheduleError(f"costs are for {costs.num_stages} stages, the schedule has {self.num_stages}")
        table, tc = self._table(costs), costs.tc
        t_send, t_action = costs.t_send, costs.t_action
        clock: list[Number] = [0] * self.num_ranks
        busy: list[Number] = [0] * self.num_ranks
        last: list[Number | None] = [None] * self.num_ranks
        posted: list[Number] = [0] * self.num_sends
        it = iter(self.ops)
        for code, r, i, dep, boundary in zip(it, it, it, it, it):
            if code == _COMPUTE:
                ready = clock[r]
                if dep >= 0:
                    there = posted[dep] + tc[boundary]
                    ready = max(ready, there)
                start = ready + t_action
                end = start + table[i]
                clock[r] = end
                busy[r] += end - start
                last[r] = end if last[r] is None else max(last[r], end)
            elif code == _SEND:
                posted[i] = clock[r]
                clock[r] += t_send
            else:
                clock[r] += table[i]
        return [0.0 if e is None else float(e) for e in last], busy


def _compute_entry(a: Action, local: Sequence[int], r: int, splits: frozenset) -> tuple:
    """A compute action's entry: (_COMPUTE, cost slot key, the send it waits for or None, its boundary)."""
    k, s = a.kind, a.stage
    dep, tc = None, 0
    if k is Kind.F and s and local[s - 1] != r:
        dep, tc = (Kind.SEND_ACT, a.mb, s - 1), s - 1
    elif k is Kind.B and s + 1 < len(local) and local[s + 1] != r:
        dep, tc = (Kind.SEND_GRAD, a.mb, s + 1), s
    if k is Kind.F:
        key = ("f", s, 0)
    elif k is Kind.B:
        key = ("b split" if (a.mb, s) in splits else "b", s, 0)
    elif k is Kind.W:
        key = ("w", s, 0)
    else:
        key = ("r", s, a.recompute)
    return (_COMPUTE, key, dep, tc)


def _entries(lst: Sequence[Action], local: Sequence[int], r: int) -> list[tuple]:
    """One rank's full list as program entries (code, key, dep, tc); receives dropped (no time when eager)."""
    splits = split_backwards(lst)
    out: list[tuple] = []
    for a in lst:
        k = a.kind
        if k in SEND_KINDS:
            out.append((_SEND, (k, a.mb, a.stage), None, 0))
        elif k is Kind.STEP:
            out.append((_OTHER, ("step", 0, 0), None, 0))
        elif k is Kind.REDUCE_GRADS:
            out.append((_OTHER, ("reduce", a.stage, 0), None, 0))
        elif k is not Kind.RECV_ACT and k is not Kind.RECV_GRAD:
            out.append(_compute_entry(a, local, r, splits))
    return out


def _order_entries(order: Sequence[Action], local: Sequence[int], r: int) -> list[tuple]:
    """``_entries`` of the list ``insert_comm_actions(post_ahead=False)`` makes of one rank's compute order."""
    splits = split_backwards(order)
    n = len(local)
    out: list[tuple] = []
    last: dict[int, int] = {}
    for i, a in enumerate(order):
        out.append(_compute_entry(a, local, r, splits))
        k, s = a.kind, a.stage
        if k is Kind.F and s + 1 < n and local[s + 1] != r:
            out.append((_SEND, (Kind.SEND_ACT, a.mb, s), None, 0))
        elif k is Kind.B and s > 0 and local[s - 1] != r:
            out.append((_SEND, (Kind.SEND_GRAD, a.mb, s), None, 0))
        if k is Kind.B or k is Kind.W:
            last[s] = i
    out += [(_OTHER, ("reduce", s, 0), None, 0) for s in sorted(last, key=last.__getitem__)]
    out.append((_OTHER, ("step", 0, 0), None, 0))
    return out


__all__ = ["Replay"]
