"""Pipeline action lists: the Action and Schedule types and their one-action-per-line text form.

A schedule is, per rank, an ordered list of actions. The same lists drive the simulator
(`autopar.schedule.simulator`) and the distributed executor.

Vocabulary:

- A *stage* is one model chunk in pipeline order, numbered globally ``0 .. S-1``. A rank may hold
  several (``v`` chunks under Megatron interleaving, ``2W`` under Hanayo waves);
  ``Schedule.stage_to_rank[s]`` says which rank holds stage ``s`` and ``Schedule.stages_of_rank(r)``
  lists a rank's stages in pipeline order.
- ``F(mb, stage)`` runs the forward of microbatch ``mb`` through ``stage``; ``B(mb, stage)`` its
  backward. Zero-bubble schedules split the backward: when the list also holds ``W(mb, stage)``,
  ``B`` computes only the gradients of the stage's inputs (what the previous stage waits for) and
  ``W``, later on the same rank, the gradients of the stage's weights (``split_backwards`` names
  the split ones). A microbatch-stage's activations stay stashed until its backward is complete:
  its ``W`` when split, its ``B`` otherwise (``ends_backward``).
- ``F.recompute`` is the fraction (0..1) of the stage's activations that the forward does
  *not* stash: ``0`` stores everything, ``1`` is full activation checkpointing (only the stage
  input is kept), anything between is Merak's stage-aware recomputation. When it is non-zero a
  ``RECOMPUTE(mb, stage)`` with the same fraction must run after the ``F`` and before the ``B``.
- ``SEND_ACT(mb, stage, peer)`` ships the output of ``stage`` to ``peer = stage + 1``;
  ``RECV_ACT(mb, stage, peer)`` receives the input of ``stage`` from ``peer = stage - 1``.
  ``SEND_GRAD(mb, stage, peer=stage-1)`` / ``RECV_GRAD(mb, stage, peer=stage+1)`` do the same for
  the gradient flowing back. ``stage`` is always the stage *on this rank*. When ``stage`` and
  ``peer`` sit on the same rank (the bottom of a wave's V) there is no send or receive at all: the
  hand-over is local.
- ``REDUCE_GRADS(stage)`` reduces a stage's gradients over the data-parallel axes; ``STEP`` runs
  the optimizer. Every generated list ends with them.

Text form, one action per line (``str(action)`` / ``Action.parse``)::

    F mb=0 stage=2
    F mb=0 stage=2 recompute=1/2
    W mb=0 stage=2
    SEND_ACT mb=0 stage=2 peer=3
    REDUCE_GRADS stage=2
    STEP

``Schedule.to_text()`` prints a header and every rank's list; ``Schedule.from_text`` reads it back,
and ``Schedule.from_text(s.to_text()) == s`` holds for every schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction

from autopar.errors import ScheduleError


class Kind(str, Enum):
    """What an action does."""

    F = "F"
    B = "B"
    W = "W"
    RECOMPUTE = "RECOMPUTE"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    REDUCE_GRADS = "REDUCE_GRADS"
    STEP = "STEP"


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.W, Kind.RECOMPUTE})
SEND_KINDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD})
RECV_KINDS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})
P2P_KINDS = SEND_KINDS | RECV_KINDS
_NEEDS_MB = COMPUTE_KINDS | P2P_KINDS


@dataclass(frozen=True)
class Action:
    """One step of one rank: see the module docstring for the meaning of each kind."""

    kind: Kind
    stage: int | None = None
    mb: int | None = None
    peer: int | None = None
    recompute: Fraction = Fraction(0)

    def __post_init__(self) -> None:
        k = self.kind
        if k is not Kind.STEP and self.stage is None:
            raise ScheduleError(f"{k.value} needs a stage")
        if (k in _NEEDS_MB) != (self.mb is not None):
            raise ScheduleError(f"{k.value} {'needs' if k in _NEEDS_MB else 'takes no'} microbatch")
        if (k in P2P_KINDS) != (self.peer is not None):
            raise ScheduleError(f"{k.value} {'needs' if k in P2P_KINDS else 'takes no'} peer stage")
        if k in P2P_KINDS:
            want = self.stage + 1 if k in (Kind.SEND_ACT, Kind.RECV_GRAD) else self.stage - 1
            if self.peer != want:
                raise ScheduleError(f"{self}: the peer of stage {self.stage} must be stage {want}")
        if not isinstance(self.recompute, Fraction):
            object.__setattr__(self, "recompute", Fraction(self.recompute))
        if self.recompute and k not in (Kind.F, Kind.RECOMPUTE):
            raise ScheduleError(f"{k.value} takes no recompute fraction")
        r = self.recompute  # 0 <= r <= 1 on its integers (a Fraction's denominator is positive): no Fraction compares
        if not 0 <= r.numerator <= r.denominator or (k is Kind.RECOMPUTE and not r):
            raise ScheduleError(f"{self}: recompute fraction must be in (0, 1] on RECOMPUTE, [0, 1] on F")

    def __str__(self) -> str:
        parts = [self.kind.value]
        if self.mb is not None:
            parts.append(f"mb={self.mb}")
        if self.stage is not None:
            parts.append(f"stage={self.stage}")
        if self.peer is not None:
            parts.append(f"peer={self.peer}")
        if self.recompute:
            parts.append(f"recompute={self.recompute}")
        return " ".join(parts)

    @classmethod
    def parse(cls, line: str) -> Action:
        """Read one action from its text form (the inverse of ``str``)."""
        words = line.split()
        if not words:
            raise ScheduleError("empty action line")
        try:
            kind = Kind(words[0])
        except ValueError:
            raise ScheduleError(f"unknown action {words[0]!r} in {line!r}") from None
        fields: dict[str, int | Fraction] = {}
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if not sep or key not in ("mb", "stage", "peer", "recompute") or key in fields:
                raise ScheduleError(f"bad field {word!r} in {line!r}")
            try:
                fields[key] = Fraction(value) if key == "recompute" else int(value)
            except ValueError:
                raise ScheduleError(f"bad value in {word!r} of {line!r}") from None
        return cls(kind, **fields)  # type: ignore[arg-type]


_NONE = Fraction(0)  # nothing recomputed (Fractions are immutable: one serves every action)


def F(mb: int, stage: int, recompute: Fraction | int = 0) -> Action:
    """Forward of microbatch ``mb`` through ``stage``."""
    return Action(Kind.F, stage, mb, recompute=recompute if recompute else _NONE)


def B(mb: int, stage: int) -> Action:
    """Backward of microbatch ``mb`` through ``stage``."""
    return Action(Kind.B, stage, mb)


def W(mb: int, stage: int) -> Action:
    """Weight gradients of microbatch ``mb`` through ``stage``, after its input-gradient ``B``."""
    return Action(Kind.W, stage, mb)


def split_backwards(actions: Sequence[Action]) -> frozenset[tuple[int, int]]:
    """The (mb, stage) whose backward ``actions`` split into ``B`` and ``W`` (those with a ``W``)."""
    return frozenset((a.mb, a.stage) for a in actions if a.kind is Kind.W)  # type: ignore[misc]


def ends_backward(a: Action, split: frozenset[tuple[int, int]]) -> bool:
    """Whether ``a`` completes its microbatch-stage's backward (frees its stash): ``W``, or an unsplit ``B``."""
    return a.kind is Kind.W or (a.kind is Kind.B and (a.mb, a.stage) not in split)


def stage_stash_points(actions: Sequence[Action]) -> list[tuple[tuple[int, int], ...]]:
    """Per stage of one rank's list (in stage order), the (stashed, awaiting W) counts of microbatches after
    each action, at the points no other point exceeds in every count: the candidates for the rank's peak
    memory, whatever each stage's stash and W-kept gradient weigh (a split ``B`` keeps its stash and adds the
    weight ops' output gradients until its ``W``)."""
    split = split_backwards(actions)
    stages = sorted({a.stage for a in actions if a.kind in COMPUTE_KINDS and a.stage is not None})
    live, pending = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0)
    points: set[tuple[tuple[int, int], ...]] = set()
    for a in actions:
        if a.kind in COMPUTE_KINDS and a.stage is not None:
            if a.kind is Kind.F:
                live[a.stage] += 1
            elif a.kind is Kind.B and (a.mb, a.stage) in split:
                pending[a.stage] += 1
            elif a.kind is Kind.W:
                pending[a.stage] -= 1
            live[a.stage] -= ends_backward(a, split)
        points.add(tuple((live[s], pending[s]) for s in stages))
    return _frontier(points, lambda p: sum(p, ()))


def stage_peaks(actions: Sequence[Action]) -> tuple[int, ...]:
    """Per stage of one rank's list (in stage order), the most microbatches it stashes at once: each stage's largest
    stashed count of ``stage_stash_points``, without the points (one pass, no frontier)."""
    split = split_backwards(actions)
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for a in actions:
        if a.kind in COMPUTE_KINDS and a.stage is not None:
            n = live.get(a.stage, 0) + (a.kind is Kind.F) - ends_backward(a, split)
            live[a.stage] = n
            peak[a.stage] = max(peak.get(a.stage, 0), n)
    return tuple(peak[s] for s in sorted(peak))


def stash_points(actions: Sequence[Action]) -> list[tuple[int, int]]:
    """``stage_stash_points`` summed over the rank's stages: the (stashed, awaiting W) counts that can be its
    peak when every stage's stash and W-kept gradient weigh the same."""
    return _frontier({(sum(n for n, _ in p), sum(k for _, k in p)) for p in stage_stash_points(actions)})


def _frontier(points: set, flat=lambda p: p) -> list:
    """The points no other point reaches or exceeds in every coordinate (of ``flat(point)``), sorted.

    In decreasing lexicographic order of the coordinates a point can be covered only by one before it (or one
    with the same coordinates), and then by one of the maximal coordinates seen so far: each point is compared
    with those only, not with every other point."""
    by_coords: dict[tuple, list] = {}
    for p in points:
        by_coords.setdefault(tuple(flat(p)), []).append(p)
    maximal: list[tuple] = []  # coordinates seen that none seen before reaches in every coordinate
    out = []
    for c in sorted(by_coords, reverse=True):
        if any(all(x >= y for x, y in zip(m, c)) for m in maximal):
            continue
        maximal.append(c)
        if len(by_coords[c]) == 1:  # two points with the same coordinates cover each other
            out.append(by_coords[c][0])
    return sorted(out)


def RECOMPUTE(mb: int, stage: int, fraction: Fraction | int = 1) -> Action:
    """Re-run the part of ``stage``'s forward whose activations were not stashed."""
    return Action(Kind.RECOMPUTE, stage, mb, recompute=Fraction(fraction))


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: per-rank action lists plus the stage -> rank placement.

    ``actions[r]`` is rank ``r``'s list, executed in order. ``name`` and ``options`` record which
    generator made it (for printing and plan files); they do not affect execution.
    """

    num_ranks: int
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    name: str = "custom"
    options: tuple[tuple[str, int | Fraction], ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        object.__setattr__(self, "options", tuple(sorted(dict(self.options).items())))
        if min(self.num_ranks, self.num_stages, self.num_microbatches) < 1:
            raise ScheduleError("a schedule needs at least one rank, stage and microbatch")
        if len(self.stage_to_rank) != self.num_stages:
            raise ScheduleError(f"stage_to_rank has {len(self.stage_to_rank)} entries, not {self.num_stages}")
        if any(not 0 <= r < self.num_ranks for r in self.stage_to_rank):
            bad = list(self.stage_to_rank)
            raise ScheduleError(f"stage_to_rank {bad} names a rank outside 0..{self.num_ranks - 1}")
        if len(self.actions) != self.num_ranks:
            raise ScheduleError(f"{len(self.actions)} action lists for {self.num_ranks} ranks")
        for rank, actions in enumerate(self.actions):
            for i, a in enumerate(actions):
                if a.stage is not None and not 0 <= a.stage < self.num_stages:
                    raise ScheduleError(f"rank {rank} action {i} {a}: no stage {a.stage}")
                if a.stage is not None and self.stage_to_rank[a.stage] != rank:
                    owner = self.stage_to_rank[a.stage]
                    raise ScheduleError(f"rank {rank} action {i} {a}: stage {a.stage} is on rank {owner}")
                if a.mb is not None and not 0 <= a.mb < self.num_microbatches:
                    raise ScheduleError(f"rank {rank} action {i} {a}: no microbatch {a.mb}")

    def stages_of_rank(self, rank: int) -> list[int]:
        """The stages rank ``rank`` holds, in pipeline order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def to_text(self) -> str:
        """Header, placement, then each rank's actions one per line (parse with ``from_text``)."""
        opts = "".join(f" {k}={v}" for k, v in self.options)
        lines = [
            f"schedule {self.name} ranks={self.num_ranks} stages={self.num_stages} "
            f"microbatches={self.num_microbatches}{opts}",
            "stage_to_rank " + " ".join(map(str, self.stage_to_rank)),
        ]
        for rank, actions in enumerate(self.actions):
            lines.append(f"rank {rank}")
            lines.extend(f"  {a}" for a in actions)
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Read a schedule printed by ``to_text``."""
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        if len(lines) < 2 or not lines[0].startswith("schedule ") or not lines[1].startswith("stage_to_rank"):
            raise ScheduleError("schedule text must start with a 'schedule' line and a 'stage_to_rank' line")
        head = lines[0].split()
        try:
            kv = {k: _number(v) for k, _, v in (w.partition("=") for w in head[2:])}
            stage_to_rank = [int(x) for x in lines[1].split()[1:]]
        except ValueError:
            raise ScheduleError(f"bad schedule header {lines[0]!r} / {lines[1]!r}") from None
        sizes = [kv.pop(k, None) for k in ("ranks", "stages", "microbatches")]
        if None in sizes:
            raise ScheduleError(f"schedule header {lines[0]!r} lacks ranks=, stages= or microbatches=")
        actions: list[list[Action]] = []
        for line in lines[2:]:
            if line.startswith("rank "):
                if line.split() != ["rank", str(len(actions))]:
                    raise ScheduleError(f"expected 'rank {len(actions)}', got {line!r}")
                actions.append([])
            elif not actions:
                raise ScheduleError(f"action {line.strip()!r} before any 'rank N' line")
            else:
                actions[-1].append(Action.parse(line))
        ranks, stages, mbs = (int(x) for x in sizes)  # type: ignore[arg-type]
        lists = tuple(map(tuple, actions))
        return cls(ranks, stages, mbs, tuple(stage_to_rank), lists, head[1], tuple(kv.items()))


def _number(text: str) -> int | Fraction:
    value = Fraction(text)
    return int(value) if value.denominator == 1 else value


def check_placement(stage_to_rank: Sequence[int], num_ranks: int) -> None:
    """Every rank must hold at least one stage."""
    missing = sorted(set(range(num_ranks)) - set(stage_to_rank))
    if missing:
        raise ScheduleError(f"ranks {missing} hold no stage in placement {list(stage_to_rank)}")
