"""Compute orders of the zero-bubble schedules: the backward split into B (input gradients) and W (weights).

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024) observe that only the input-gradient half
of a backward, ``B``, is on the critical path between stages; the weight-gradient half, ``W``, can
run any time after its ``B`` on the same rank, so it can fill bubbles. The orders here are the
papers' handcrafted schedules; ``autopar.schedule.generators`` registers them (``zb-h1``, ``zb-h2``,
``zbv``, ``dualpipev``) and ``autopar.schedule.comm_actions`` adds the sends and receives.

- ``delay_weights(order, delay)``: ZB-H1 and ZB-H2 are 1F1B orders of ``F``/``B`` in which the ``W``
  of the j-th ``B`` runs right after the (j + delay)-th ``B`` (the remaining ones at the end). ZB-H1
  warms up like 1F1B (P - r - 1 forwards on rank r) and delays r weight passes, which keeps every
  rank at P in-flight microbatches (1F1B's peak) and makes the gradient travel back one ``B`` per hop;
  ZB-H2 warms up with 2(P - r - 1) forwards and delays 2r, so all 2P - 1 in flight on every rank.
  Both read off the paper's Fig. 3 (P = 4, M = 8).
- ``zbv_orders``: ZB-V (the paper's section 6, Fig. 8): 2P stages in a V, rank r holding stage r
  (chunk 0) and 2P - 1 - r (chunk 1). Warm-up 2(P - r) - 1 forwards of chunk 0, then r pairs
  (chunk 1, chunk 0), then P - r groups F B W of chunk 1; steady state F B W of chunk 0 then of
  chunk 1; cool-down r pairs of B (chunk 0, chunk 1), then P - r of B, W of chunk 0, then the
  remaining W, chunk 1's first. Lists are made for max(M, 2P - 1) microbatches and the padding's
  actions dropped (dropping actions only removes dependencies).
- ``checkpointed(order)``: any of them with full activation checkpointing: every ``F`` stashes only
  the stage's input and a ``RECOMPUTE`` runs right before each ``B`` (not waiting for the gradient).
  The recomputed activations then live until the ``W``, which needs them too.
- ``dualpipev_orders``: DeepSeek's DualPipeV (DualPipe cut in half: one copy of the weights, the same
  V placement), after the published reference schedule in eight phases. Its main phase pairs a
  forward of one chunk with a *whole* backward of the other (an unsplit ``B``: no ``W`` follows),
  which a GPU overlaps; the first and last phases split the backward to fill the bubbles. Needs
  M >= 2P.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from autopar.errors import ScheduleError
from autopar.schedule.actions import RECOMPUTE, Action, B, F, Kind, W


def delay_weights(order: Sequence[Action], delay: int) -> list[Action]:
    """``order`` (F and B) with the W of its j-th B placed right after its (j + delay)-th B, the rest at the end."""
    backwards = [a for a in order if a.kind is Kind.B]
    out: list[Action] = []
    done = 0
    for a in order:
        out.append(a)
        if a.kind is Kind.B:
            done += 1
            if done > delay:
                w = backwards[done - 1 - delay]
                out.append(W(w.mb, w.stage))  # type: ignore[arg-type]
    out += [W(b.mb, b.stage) for b in backwards[max(done - delay, 0) :]]  # type: ignore[arg-type]
    return out


def checkpointed(order: Sequence[Action]) -> list[Action]:
    """``order`` with every forward checkpointed (``recompute=1``) and its ``RECOMPUTE`` right before its ``B``."""
    out: list[Action] = []
    for a in order:
        if a.kind is Kind.F:
            a = F(a.mb, a.stage, 1)  # type: ignore[arg-type]
        elif a.kind is Kind.B:
            out.append(RECOMPUTE(a.mb, a.stage))  # type: ignore[arg-type]
        out.append(a)
    return out


class _Order:
    """One rank's order being built: the next microbatch of each (kind, stage) and the W not yet run."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next: dict[tuple[Kind, int], int] = defaultdict(int)
        self.waiting: list[tuple[int, int]] = []  # (mb, stage) of split B whose W has not run, oldest first

    def f(self, stage: int) -> None:
        mb = self.next[(Kind.F, stage)]
        self.next[(Kind.F, stage)] += 1
        self.actions.append(F(mb, stage))

    def b(self, stage: int, split: bool = True) -> None:
        """The next B of ``stage``; ``split=False``: the whole backward (no W follows)."""
        mb = self.next[(Kind.B, stage)]
        self.next[(Kind.B, stage)] += 1
        self.actions.append(B(mb, stage))
        if split:
            self.waiting.append((mb, stage))

    def w(self, stage: int | None = None) -> None:
        """The W of the oldest waiting B (of ``stage``, if given); nothing if none waits."""
        for i, (mb, s) in enumerate(self.waiting):
            if stage is None or s == stage:
                del self.waiting[i]
                self.actions.append(W(mb, s))
                return

    def group(self, stage: int, forward: bool = True) -> None:
        """ZB-V's group: F (unless ``forward=False``), B, then the W of the oldest waiting B of ``stage``."""
        if forward:
            self.f(stage)
        self.b(stage)
        self.w(stage)

    def count(self, kind: Kind, stage: int) -> int:
        return self.next[(kind, stage)]

    def below(self, num_microbatches: int) -> list[Action]:
        """The order without the actions of padding microbatches (``mb >= num_microbatches``)."""
        return [a for a in self.actions if a.mb is not None and a.mb < num_microbatches]


def zbv_orders(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-V's F/B/W order of every rank (see the module docstring)."""
    P, M = num_ranks, num_microbatches
    n = max(M, 2 * P - 1)
    orders = []
    for r in range(P):
        o, c0, c1 = _Order(), r, 2 * P - 1 - r
        for _ in range(2 * (P - r) - 1):
            o.f(c0)
        for _ in range(r):
            o.f(c1)
            o.f(c0)
        for _ in range(P - r):
            o.group(c1)
        while o.count(Kind.F, c1) < o.count(Kind.F, c0) or o.count(Kind.F, c0) < n:
            o.group(c0, forward=o.count(Kind.F, c0) < n)
            o.group(c1)
        for _ in range(r):
            o.b(c0)
            o.b(c1)
        for _ in range(P - r):
            o.group(c0, forward=False)
        while o.waiting:
            o.w(c1 if any(s == c1 for _, s in o.waiting) else c0)
        orders.append(o.below(M))
    return orders


def dualpipev_orders(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    """DualPipeV's F/B/W order of every rank (see the module docstring)."""
    P, M = num_ranks, num_microbatches
    if M < 2 * P:
        raise ScheduleError(f"dualpipev needs at least 2P = {2 * P} microbatches (one per stage), got {M}")
    orders = []
    for r in range(P):
        o, c0, c1 = _Order(), r, 2 * P - 1 - r
        for _ in range(2 * (P - r - 1)):  # 1: chunk 0 forwards
            o.f(c0)
        for _ in range(r + 1):  # 2: both chunks' forwards
            o.f(c0)
            o.f(c1)
        for _ in range(P - r - 1):  # 3: chunk 1 split backward, a W, a forward
            o.b(c1)
            o.w()
            o.f(c1)
        for _ in range(M - 2 * P + r + 1):  # 4: forward of one chunk with the whole backward of the other
            o.f(c0)
            o.b(c1, split=False)
            o.f(c1)
            o.b(c0, split=False)
        for _ in range(P - r - 1):  # 5: chunk 1's whole backward, then chunk 1 forward with chunk 0 backward
            o.b(c1, split=False)
            o.f(c1)
            o.b(c0, split=False)
        split = False
        for i in range(r + 1):  # 6: both backwards; the second half of them split (zero bubble)
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            o.b(c1, split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            o.b(c0, split)
        for _ in range(P - r - 1):  # 7: a W, chunk 0 split backward
            o.w()
            o.b(c0)
        while o.waiting:  # 8: the remaining W
            o.w()
        orders.append(o.actions)
    return orders


__all__ = ["checkpointed", "delay_weights", "dualpipev_orders", "zbv_orders"]
