"""Pin a published configuration: the search space of exactly one plan, priced as a paper or recipe gives it.

``autopar plan MODEL --cluster SPEC --global-batch B --mesh pp=8,dp=12,tp=8 --microbatch-size 1
--chunks 2 --recompute full`` prices Megatron's (t, p, d, b, v, full recomputation) for the 145.6B row of
its Table 1 with the search's price model (``price.py`` + the simulator), without searching: every
dimension the flags give is pinned, each one left out is still chosen by the search among its values
(so ``--mesh dp=32 --recompute full`` picks only the micro-batch). ``--mesh dp=32`` with B / (dp b) > 1
microbatches is gradient accumulation without a pipeline axis (schedule "none"). ``--sequence-parallel`` adds
Megatron's sequence parallelism beside tp (NeMo's recipes run it): priced, not yet written as a plan file
(``materialize.build_plan``).

A pinned configuration is priced even when it does not fit the memory budget (the budget is then
infinite unless ``--budget-gb`` gives one): its memory is printed beside the device's, so a recipe that
the search would reject is still priced as published, with why it would be rejected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.errors import SearchError
from autopar.ir.axes import CONTEXT_AXIS, PIPELINE_AXIS
from autopar.schedule.placement import schedule_of
from autopar.search.space import SEARCHED, SearchSpace

PINNABLE_AXES = (PIPELINE_AXIS, "dp", CONTEXT_AXIS, "tp")


@dataclass(frozen=True)
class Pin:
    """What a published configuration fixes; ``None`` leaves a dimension to the search."""

    mesh: dict[str, int]
    micro_batch: int | None = None
    recompute: str | None = None  # "none", "full" or "stage-aware"
    schedule: str | None = None
    chunks: int | None = None
    waves: int | None = None
    zero: int | None = None
    mics_group: int | None = None
    layout: str | None = None  # "even" (Megatron's L / S layers per stage) or "balanced"
    sequence_parallel: bool | None = None  # Megatron's sequence parallelism over tp (True: on, needs tp > 1)

    def __post_init__(self) -> None:
        bad = [a for a in self.mesh if a not in PINNABLE_AXES]
        if bad:
            raise SearchError(
                f"a pinned mesh names the axes {', '.join(PINNABLE_AXES)} (pp outermost, then dp, cp, tp innermost, "
                f"Megatron's rank order), not {', '.join(bad)}: write e.g. --mesh pp=8,dp=12,tp=8"
            )
        if any(n < 1 for n in self.mesh.values()):
            raise SearchError(f"mesh sizes must be positive: {self.mesh}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise SearchError(f"--microbatch-size must be positive, not {self.micro_batch}")
        if self.recompute is not None and self.recompute not in ("none", "full", "stage-aware"):
            raise SearchError(f"--recompute is none, full or stage-aware, not {self.recompute!r}")

    @property
    def pp(self) -> int:
        return self.mesh.get(PIPELINE_AXIS, 1)

    @property
    def world(self) -> int:
        n = 1
        for v in self.mesh.values():
            n *= v
        return n

    def the_schedule(self) -> str | None:
        """The pinned schedule: as given, else the shape's own (chunks: interleaved, waves: wave), "none" without
        a pipeline axis, else left to the search."""
        if self.pp == 1:
            if self.schedule not in (None, "none"):
                raise SearchError(
                    f"--schedule {self.schedule} needs a pipeline axis; without pp the plan accumulates gradients "
                    "over B / (dp b) microbatches (schedule none)"
                )
            return "none"
        if self.schedule is not None:
            if self.schedule not in SEARCHED:
                raise SearchError(f"the search prices the schedules {', '.join(SEARCHED[1:])}, not {self.schedule!r}")
            return self.schedule
        if (self.chunks or 1) > 1 or self.waves:
            return schedule_of(2, self.chunks or 1, self.waves)
        return None

    def space(self, base: SearchSpace | None = None) -> SearchSpace:
        """The search space of the pinned configuration (``base``'s values for what is not pinned)."""
        base = base or SearchSpace()
        changes: dict = {
            "pp": (self.pp,),
            "dp": (self.mesh.get("dp", 1),),
            "tp": (self.mesh.get("tp", 1),),
            "cp": (self.mesh.get(CONTEXT_AXIS, 1),),
        }
        if self.micro_batch is not None:
            changes["micro_batch"] = (self.micro_batch,)
        sched = self.the_schedule()
        if sched is not None:
            changes["schedules"] = (sched,)
        if self.chunks is not None:
            changes["chunks"] = (self.chunks,)
        if self.waves is not None:
            changes["waves"] = (self.waves,)
        if self.recompute is not None:
            # Merak's SCP always carries stage-aware ratios; "full" there is alpha_1 = 0 (space._levels)
            changes["recompute"] = (self.recompute,)
        if self.zero is not None:
            changes["zero"] = (self.zero,)
            changes["mics_groups"] = (self.mics_group or 0,)
        elif self.mics_group is not None:
            changes["mics_groups"] = (self.mics_group,)
        if self.layout is not None:
            changes["layouts"] = (self.layout,)
        if self.sequence_parallel is not None:
            changes["sequence_parallel"] = (self.sequence_parallel,)
        return dataclasses.replace(base, **changes)

    def check(self, world: int, global_batch: int) -> None:
        """Refuse a pin that cannot exist on the cluster, naming why."""
        if self.world != world:
            raise SearchError(
                f"the pinned mesh {self.mesh} has {self.world} ranks but the cluster has {world} devices: give a "
                "mesh whose sizes multiply to the cluster's devices (or --cluster PRESET:nodes=N)"
            )
        dp = self.mesh.get("dp", 1)
        if self.sequence_parallel and self.mesh.get("tp", 1) == 1:
            raise SearchError(
                "--sequence-parallel splits over the tensor-parallel ranks what they would otherwise replicate: pin "
                "a mesh with tp > 1 (e.g. --mesh pp=4,dp=4,tp=4), or leave --sequence-parallel out"
            )
        if global_batch % dp:
            raise SearchError(f"the global batch {global_batch} is not divisible by dp={dp}")
        if self.micro_batch is not None and (global_batch // dp) % self.micro_batch:
            raise SearchError(
                f"--microbatch-size {self.micro_batch} does not divide the {global_batch // dp} samples per "
                f"data-parallel replica (global batch {global_batch} / dp {dp})"
            )
        if self.mics_group is not None and (dp % self.mics_group or not 1 < self.mics_group < dp):
            raise SearchError(
                f"--mics-group {self.mics_group} must divide dp={dp}, exceed 1 and be less than dp (dp itself: "
                "plain ZeRO over the dp group, --zero without --mics-group)"
            )


__all__ = ["PINNABLE_AXES", "Pin"]
