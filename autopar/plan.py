"""The plan file: a versioned JSON document holding everything planned for a model on a mesh.

    {"format": "autopar-plan", "version": 1, "model": "gpt2", "fingerprint": "...",
     "mesh": {"dp": 2, "tp": 4}, "cluster": {...} | null, "options": {...}, "config": {...} | null,
     "program": "<the IR after all passes>", "stats": {...}, "baselines": {...}, "pipeline": null}

``config`` is the ``TrainConfig`` the plan was made with (``autopar plan --config``, its flags), which
``compile(plan=...)`` starts from; ``options`` the sharding solve's own options (what the program was solved
for). A plan without ``config`` (written before it existed) gives compile its options alone.

``mesh`` is the mesh of the sharded program; a plan with a pipeline keeps the mesh to launch, ``pp``
included, in ``pipeline.mesh`` (``autopar.search.launch_options`` reads both).

``fingerprint`` is the SHA-256 of the captured graph's IR printed without a mesh, so a plan made
offline for one mesh is refused by a model whose graph differs; the mesh is checked separately.
Never pickle: the program is the textual IR, which ``autopar.ir.parser.parse`` reads back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.errors import IRError, PlacementError, PlanError, VerifyError
from autopar.ir.axes import PIPELINE_AXIS
from autopar.ir.core import COLLECTIVES, MeshSpec, Program, Ref, map_refs
from autopar.ir.parser import parse
from autopar.ir.verify import side_effect, verify_local
from autopar.passes.capture import Captured
from autopar.passes.lower import lower
from autopar.solver.sharding.cost import TrainingSetup

FORMAT = "autopar-plan"
VERSION = 1


# Ops that only change memory layout: a model traced on the meta device can show more or fewer of
# them than the same model with real weights (HF GPT-2's attention gains an aten.contiguous on meta),
# so they do not enter the fingerprint.
_LAYOUT_ONLY = {"aten.contiguous", "aten.alias"}


def fingerprint(captured: Captured, lowered: Program | None = None) -> str:
    """SHA-256 of the captured graph's IR without a mesh and without layout-only ops: the same model
    and inputs give the same fingerprint whether they were traced on meta or with real weights.
    ``lowered``: ``lower(captured, MeshSpec())`` when the caller has it (else ``captured.plain``, if made)."""
    prog = lowered if lowered is not None else captured.plain
    if prog is None:
        prog = lower(captured, MeshSpec())
    alias: dict[str, str] = {}
    ops = []
    for op in prog.ops:
        if op.target in _LAYOUT_ONLY and len(op.input_refs()) == 1:
            alias[op.result] = alias.get(op.input_refs()[0].name, op.input_refs()[0].name)
            continue
        ops.append(op.with_(args=map_refs(op.args, lambda r: Ref(alias.get(r.name, r.name)))))
    outputs = tuple(map_refs(list(prog.outputs), lambda r: Ref(alias.get(r.name, r.name))))
    canonical = prog.with_(ops=tuple(ops), outputs=outputs)
    # op result names are counters: renumber so a removed op leaves no gap
    text = "\n".join(_strip_names(canonical))
    return hashlib.sha256(text.encode()).hexdigest()


def _strip_names(prog: Program) -> list[str]:
    """Each op as 'target(args) : types' with values numbered by first definition (names dropped)."""
    number: dict[str, str] = {v.name: v.name for v in prog.inputs}
    lines = [f"{v.kind} {v.name} {v.type}" for v in prog.inputs]
    for op in prog.ops:
        args = map_refs((op.args, op.kwargs), lambda r: f"%{number[r.name]}")
        lines.append(f"{op.target}{args!r} {[str(t) for t in op.types]}")
        for r in op.results:
            number[r] = str(len(number))
    lines.append(repr(map_refs(list(prog.outputs), lambda r: f"%{number[r.name]}")))
    return lines


# each field a plan file holds: the JSON types it may have
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "fingerprint": (str,), "mesh": (dict,), "program": (str,), "model": (str, type(None)),
    "cluster": (dict, type(None)), "options": (dict,), "config": (dict, type(None)), "stats": (dict,),
    "baselines": (dict,), "pipeline": (dict, type(None)),
}  # fmt: skip


def _check_fields(data: dict[str, Any], source: str) -> None:
    """Each field of the right JSON type, the mesh axis names to positive integer sizes, the options' setup
    keys the training setup's: a hand-edited plan gets a ``PlanError`` naming the field, not a traceback."""
    for name, types in _FIELD_TYPES.items():
        if name in data and not isinstance(data[name], types):
            want = " or ".join({"NoneType": "null", "dict": "an object", "str": "a string"}[t.__name__] for t in types)
            raise PlanError(f"{source}: {name!r} must be {want}, not {type(data[name]).__name__} {data[name]!r:.60}")
    for axis, size in data["mesh"].items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise PlanError(f"{source}: mesh axis {axis!r} has size {size!r}; sizes are positive integers")
    setup = (data.get("options") or {}).get("setup", {})
    if not isinstance(setup, dict):
        raise PlanError(f"{source}: options.setup must be an object, not {type(setup).__name__}")
    known = {f.name for f in dataclasses.fields(TrainingSetup)}
    unknown = sorted(set(setup) - known)
    if unknown:
        raise PlanError(f"{source}: options.setup has unknown keys {unknown} (known: {sorted(known)}); plan again")
    pipeline = data.get("pipeline")
    # a pipelined plan (a schedule over pp > 1 stages) needs its stages; a searched one-stage plan has none
    if isinstance(pipeline, dict) and pipeline.get("schedule") is not None and "stage_plan" not in pipeline:
        raise PlanError(
            f"{source}: its pipeline lacks stage_plan (the stages and their costs); plan again with a pp axis"
        )


@dataclass
class Plan:
    fingerprint: str
    mesh: dict[str, int]
    program: str
    model: str | None = None
    cluster: dict[str, Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    baselines: dict[str, Any] = field(default_factory=dict)
    pipeline: dict[str, Any] | None = None
    config: dict[str, Any] | None = None  # the TrainConfig it was made with (TrainConfig.to_dict)
    version: int = VERSION

    @property
    def mesh_spec(self) -> MeshSpec:
        """The mesh the sharded program is for: the launch mesh without its pipeline axis."""
        # a plan written before plans kept the launch mesh in pipeline.mesh has the pipeline axis in mesh
        return MeshSpec(tuple(self.mesh.items())).without_pipeline()

    @property
    def launch_mesh(self) -> MeshSpec:
        """The mesh to launch (``autopar.init_mesh(**axes)``): with a pipeline, its ``pp`` axis too."""
        if self.pipeline and self.pipeline.get("mesh"):
            return MeshSpec(tuple(self.pipeline["mesh"].items()))
        return MeshSpec(tuple(self.mesh.items()))

    def parsed(self) -> Program:
        return parse(self.program)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise PlanError(
                f"no plan file at {path}; write one with `autopar plan MODEL --mesh ... -o {path}`"
            ) from None
        except json.JSONDecodeError as e:
            raise PlanError(f"{path} is not JSON ({e}); plan files are written by `autopar plan -o`") from None
        except RecursionError:
            raise PlanError(
                f"{path} nests its JSON too deeply to be a plan; plan files are written by `autopar plan -o`"
            ) from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "the plan") -> Plan:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlanError(f'{source} is not an autopar plan (no "format": "{FORMAT}")')
        version = data.get("version")
        if version != VERSION or isinstance(version, bool):
            what = repr(version)
            if version == str(VERSION):
                what += f" (a {type(version).__name__}, not the number {VERSION})"
            raise PlanError(
                f"{source} is plan format version {what}, this autopar reads version {VERSION}; "
                "plan the model again with this version"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [k for k in ("fingerprint", "mesh", "program") if k not in data]
        if missing:
            raise PlanError(f"{source} lacks {', '.join(missing)}")
        unknown = sorted(set(data) - names - {"format"})
        if unknown:
            raise PlanError(f"{source} has unknown fields {unknown}")
        _check_fields(data, source)
        return cls(**{k: v for k, v in data.items() if k in names})

    def check(self, captured: Captured, mesh: MeshSpec, lowered: Program | None = None) -> None:
        """Refuse a plan made for another graph or another mesh, saying which. ``mesh`` is the launch
        mesh (with ``pp`` for a pipeline) or the mesh of the sharded program (without it)."""
        fp = fingerprint(captured, lowered)
        if fp != self.fingerprint:
            raise PlanError(
                f"the plan was made for another graph (fingerprint {self.fingerprint[:12]}, this model and "
                f"inputs give {fp[:12]}): plan again for this model, batch and sequence"
            )
        if PIPELINE_AXIS in self.launch_mesh.names and PIPELINE_AXIS in mesh.names:
            want, got = self.launch_mesh, mesh
        else:  # a plan without a pipeline on a pp mesh: its stages are cut at compile time
            want, got = self.mesh_spec, mesh.without_pipeline()
        if want != got:
            raise PlanError(f"the plan is for mesh {want}, not {got}: launch that mesh or plan again")

    def program_for(self, captured: Captured, mesh: MeshSpec) -> Program:
        """The plan's program for ``captured`` on ``mesh`` (as ``check``), checked as data before anything
        runs it: a plan file is data, and its program text can name any ATen op. Its mesh must be the plan's
        (``autopar check`` reported an edited program's mesh as agreeing), and every op must be one this
        model's own lowering emits or one of autopar's collectives and transfers (the only ops the passes
        after lowering insert): an edited op (``aten.from_file``, a random op the model has not, a write
        in place) is refused with what it would do (``ir/verify.py:side_effect``), and so is a placement that an op
        cannot run with on a rank's shards (``ir/verify.py:verify_local``: ``PlacementError``)."""
        lowered = lower(captured, MeshSpec())
        self.check(captured, mesh, lowered)
        try:
            prog = parse(self.program)
        except IRError as e:
            raise PlanError(f"the plan's program is not valid autopar IR ({e}); plan again") from None
        if prog.mesh.without_pipeline() != self.mesh_spec:
            raise PlanError(
                f"the plan's program is over mesh {prog.mesh.without_pipeline()} but the plan says {self.mesh_spec}: "
                "the file was edited; plan again for the mesh you launch"
            )
        own = {op.target for op in lowered.ops} | COLLECTIVES
        for op in prog.ops:
            if op.target not in own:
                effect = side_effect(op.target)
                raise PlanError(
                    f"the plan's program has %{op.result} = {op.target}"
                    + (f", which {effect}," if effect else "")
                    + " an op this model's lowering never emits: a plan's program may hold only the model's own "
                    "ops and autopar's collectives, so this one was added by hand; plan again"
                )
        try:  # each rank runs every op on its shards: an edited placement would fail inside the generated code
            verify_local(prog)
        except VerifyError as e:
            raise PlacementError(
                f"the plan's program does not run on one rank: {e}. Its placements were edited by hand or it "
                "is not the program autopar planned; plan again (`autopar plan`) rather than edit placements"
            ) from None
        return prog
