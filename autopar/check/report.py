"""`autopar check`'s verdict: what differs (``Finding``), the report, and the comparison of every simulated
rank's values and gradients, assembled by their placements, with the whole program's."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autopar.check.rules import UNDEFINED_VALUES
from autopar.ir.core import COLLECTIVES, VIEW_OPS, MeshSpec, Op, Program, Replicate, Value, target_name
from autopar.ir.printer import print_program
from autopar.passes.capture import Captured
from autopar.passes.experts import routed_values
from autopar.passes.lower import _module_path
from autopar.runtime.sim.placement_values import assemble, assemble_grad

TOLERANCE = 1e-10  # relative to the value's largest magnitude


@dataclass
class Finding:
    """Where the sharded program first departs from the unsharded one."""

    kind: str  # "forward" | "gradient" | "capture"
    value: str
    error: float
    op: Op | None = None
    line: str = ""
    source: str = ""
    consumers: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # the op's inputs with their types and placements

    def describe(self) -> str:
        if self.kind == "capture":
            return (
                f"the captured graph differs from the model itself ({self.value}, by {self.error:.3g}): "
                "capture or lowering is wrong, not the sharding"
            )
        where = f"  # {self.op.path}" if self.op is not None and self.op.path else ""
        src = f"\n  source: {self.source}" if self.source else ""
        src += f"\n  inputs: {', '.join(self.inputs)}" if self.inputs else ""
        if self.kind == "forward":
            return f"first op whose output differs (by {self.error:.3g}):\n  {self.line}{where}{src}"
        users = "\n".join(f"    {c}" for c in self.consumers)
        return (
            f"first gradient that differs (by {self.error:.3g}): of %{self.value}\n  {self.line}{where}{src}\n"
            f"  made by the backward of its consumers:\n{users}"
        )


@dataclass
class CheckReport:
    mesh: MeshSpec
    loss: float | None
    loss_reference: float | None
    max_diff: float  # largest relative difference over every compared value and gradient
    compared: int
    finding: Finding | None
    program: Program | None = None  # the checked program (float64), when the ranks ran
    note: str = ""  # what the reference was, when not the model itself
    # on a pipeline: the ops that couple the batch (passes/batch_coupling.py), which the checked microbatch
    # cannot show but more than one microbatch per step would change
    couplings: tuple[str, ...] = ()

    @property
    def agrees(self) -> bool:
        return self.finding is None

    def summary(self) -> str:
        loss = ""
        if self.loss is not None:
            ref = "autopar on one device" if self.note else "model"
            loss = f" loss {self.loss:.12g} ({ref} {self.loss_reference:.12g});"
        if self.agrees:
            return (
                f"agrees on mesh {self.mesh}:{loss} largest relative difference {self.max_diff:.3g} over "
                f"{self.compared} values and gradients (float64, tolerance {TOLERANCE:g})"
                + self._unsplit()
                + self._note()
            )
        return f"DIFFERS on mesh {self.mesh}:{loss}\n{self.finding.describe()}" + self._note()  # type: ignore[union-attr]

    def _unsplit(self) -> str:
        """A warning when the checked plan splits nothing: the ranks then compute what one device does."""
        prog = self.program
        if prog is None or prog.mesh.size <= 1:
            return ""
        types = [v.type for v in prog.inputs] + [t for op in prog.ops for t in op.types]
        if any(not isinstance(p, Replicate) for t in types for p in t.placements):
            return ""
        return (
            "\n  note: the plan replicates every value on this mesh, so no sharding was checked (a small model is "
            "fastest unsplit: try --objective memory; a dim no axis size divides is never split)"
        )

    def _note(self) -> str:
        note = f"\n  note: {self.note}" if self.note else ""
        if self.couplings:
            ops = "\n".join(f"    {c}" for c in self.couplings)
            note += (
                "\n  warning: the model couples its batch, so a pipeline's microbatches would train another model "
                "(one microbatch is exact; compile refuses more unless microbatch_semantics='per_microbatch'):\n" + ops
            )
        return note


def compare_ranks(prog, ref, ranks, captured, worst, ref_out, model_out, outputs) -> CheckReport:
    mesh = prog.mesh
    types = prog.types()
    users = prog.users()
    producers = prog.producers()
    lines = _ir_lines(prog)
    sources = _source_lines(captured, prog)
    compared = 0
    loss = loss_ref = None
    if outputs and not types[outputs[0].name].shape and types[outputs[0].name].is_float:
        loss_ref = float(model_out[0].detach())
    grad_bad: list[tuple[int, str, float]] = []
    order = {r: i for i, op in enumerate(prog.ops) for r in op.results}
    partial = _partial_grads(prog)
    routed = routed_values(prog)  # rows dispatched to their experts: a permutation on each rank, not its slice
    undefined = _undefined_values(prog)
    for op in prog.ops:
        if op.result in undefined:
            continue
        for r, t in zip(op.results, op.types):
            if r in routed or r not in ref or not isinstance(ref[r], torch.Tensor):
                continue
            if any(r not in rec.values for rec, _ in ranks):
                continue
            got, spread = assemble([rec.values[r].detach() for rec, _ in ranks], t.placements, mesh)
            err = max(relative_difference(got, ref[r].detach()), _rel_spread(spread, ref[r]))
            compared += 1
            if outputs and r == outputs[0].name and loss_ref is not None:
                loss = float(got.detach())
            if err > TOLERANCE:
                ins = [f"%{x.name} : {types[x.name]}{_received(producers.get(x.name))}" for x in op.input_refs()]
                finding = Finding("forward", r, err, op, lines[r], sources.get(r, ""), inputs=ins)
                return CheckReport(mesh, loss, loss_ref, err, compared, finding)
            worst = max(worst, err)
            g_ref = ref[r].grad
            grads = [rec.values[r].grad for rec, _ in ranks]
            if g_ref is None or any(x is None for x in grads):
                continue
            g, spread = assemble_grad(grads, t.placements, mesh, partial[r])
            gerr = max(relative_difference(g, g_ref), _rel_spread(spread, g_ref))
            compared += 1
            if gerr > TOLERANCE:
                grad_bad.append((order[r], r, gerr))
            worst = max(worst, gerr if gerr <= TOLERANCE else 0.0)
    for v in prog.params:
        g_ref = ref[v.name].grad
        if g_ref is None:
            continue
        got, spread = assemble([grads[v.name] for _, grads in ranks], v.type.placements, mesh)
        err = max(relative_difference(got, g_ref), _rel_spread(spread, g_ref))
        compared += 1
        if err > TOLERANCE:
            grad_bad.append((-1, v.name, err))
        else:
            worst = max(worst, err)
    if grad_bad:
        _, r, err = max(grad_bad)
        prod = producers[r]
        op = prod if isinstance(prod, Op) else None
        line = lines.get(r, f"{prod.kind} %{r} : {prod.type}" if isinstance(prod, Value) else r)
        cons = [lines[c.result] + (f"  # {c.path}" if c.path else "") for c in users.get(r, [])]
        ins = [f"%{x.name} : {types[x.name]}" for x in op.input_refs()] if op is not None else []
        finding = Finding("gradient", r, err, op, line, sources.get(r, ""), cons, ins)
        return CheckReport(mesh, loss, loss_ref, err, compared, finding)
    return CheckReport(mesh, loss, loss_ref, worst, compared, None)


def _undefined_values(prog: Program) -> set[str]:
    """Values of uninitialised memory, whose contents no two runs need share: ``empty_like``'s results and what
    collectives and views make of them (transformers' MoE kernels fill an ``empty_like`` by an ``index_put``,
    whose result is compared)."""
    out: set[str] = set()
    for op in prog.ops:
        if op.target in UNDEFINED_VALUES or (
            (op.target in COLLECTIVES or op.target in VIEW_OPS) and any(r.name in out for r in op.input_refs())
        ):
            out.update(op.results)
    return out


def _received(producer: object) -> str:
    """`` (received from stage k)`` for a value a ``recv`` made: the op reading it is a stage's first."""
    if isinstance(producer, Op) and producer.target == "recv":
        return f" (received from stage {producer.kwargs['peer_stage']}: a stage boundary)"
    return ""


def _partial_grads(prog: Program) -> dict[str, frozenset[int]]:
    """For each value, the axes on which each rank's gradient of it is a partial sum: a replicated
    value read by an op that computes different things on different ranks there, or by an op that
    does not (all its inputs replicated there) whose result's gradient is partial, except through
    Megatron's f on that axis (grad_all_reduce, whose backward sums it). Integer values have no gradient: a
    grouped matmul's offsets, split over no axis, say nothing of the router's top-k that they come from."""
    types = prog.types()
    out: dict[str, set[int]] = {name: set() for name in types}
    for op in reversed(prog.ops):
        ins = op.input_refs()
        for a in range(len(prog.mesh.sizes)):
            divergent = any(not isinstance(types[r.name].placements[a], Replicate) for r in ins)
            if op.target == "grad_all_reduce" and prog.mesh.names[a] == op.kwargs.get("axis"):
                continue
            if divergent or any(a in out[r] for r in op.results):
                for r in ins:
                    if isinstance(types[r.name].placements[a], Replicate) and types[r.name].is_float:
                        out[r.name].add(a)
    return {k: frozenset(v) for k, v in out.items()}


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    if a.shape != b.shape:
        return float("inf")
    if not b.is_floating_point():
        return 0.0 if torch.equal(a.to(b.dtype), b) else float("inf")
    if b.numel() == 0:
        return 0.0
    a, b = a.to(torch.float64), b.to(torch.float64)
    finite = torch.isfinite(b)
    # NaN where NaN, and the same infinities (T5's log of a zero relative distance is -inf)
    if not torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num()) or not torch.isfinite(a[finite]).all():
        return 1.0
    if not finite.any():
        return 0.0
    d = (a[finite] - b[finite]).abs()
    return float(d.max()) / max(1.0, float(b[finite].abs().max()))


def _rel_spread(spread: float, ref: torch.Tensor) -> float:
    if not ref.is_floating_point() or ref.numel() == 0:
        return 0.0 if spread == 0 else float("inf")
    return spread / max(1.0, float(ref.detach().abs().max()))


def _ir_lines(prog: Program) -> dict[str, str]:
    """Each op's printed IR line (without the path comment), by each of its results."""
    text = print_program(prog).splitlines()
    out: dict[str, str] = {}
    body = [ln for ln in text if " = " in ln and ln.lstrip().startswith("%")]
    for op, ln in zip(prog.ops, body):
        for r in op.results:
            out[r] = ln.split("  #")[0].rstrip()
    return out


def _source_lines(captured: Captured, prog: Program) -> dict[str, str]:
    """Best effort: the user's source line of each op, from the exported graph's stack traces (ops
    matched by module path and target in order; ops lowering made from another op have none)."""

    nodes: dict[tuple[str, str], list[str]] = {}
    for n in captured.exported.graph_module.graph.nodes:
        if n.op != "call_function" or not hasattr(n.target, "_schema"):
            continue
        trace = n.meta.get("stack_trace") or ""
        frames = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
        user = [f for f in frames if "/torch/" not in f]
        nodes.setdefault((_module_path(n), target_name(n.target)), []).append(user[-1] if user else "")
    out: dict[str, str] = {}
    seen: dict[tuple[str, str], int] = {}
    for op in prog.ops:
        key = (op.path, op.target)
        i = seen.get(key, 0)
        seen[key] = i + 1
        found = nodes.get(key, [])
        if i < len(found) and found[i]:
            out[op.result] = found[i]
    return out
