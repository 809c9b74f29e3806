"""Expert parallelism written into the program: token dispatch and combine around expert-parallel gathers.

The ILP may read ``aten.index.Tensor(table, [idx])`` with the table split on its expert dim and the indices
by rows on an expert axis (``solver/sharding/rules/experts.py``): each rank holds E/n experts, so a rank's
rows need experts it does not hold. This step (run at the end of ``insert-collectives``) makes that a local
gather by moving the rows instead of the experts, as Megatron-Core's and torchtitan's token dispatchers do:

    %d = expert_dispatch(%x, %idx) {axis=ep, experts=E}                 rows to the rank owning their expert
    %l = expert_dispatch(%idx, %idx) {axis=ep, experts=E, local_ids=True}   their experts, numbered locally
    %g = aten.index.Tensor(%table, [%l])                               the local experts' rows
    ...                                                                 row-wise ops on dispatched rows
    %y = expert_combine(%h, %idx) {axis=ep, experts=E}                 each row back to its own rank, in order

A dispatched value (*routed*) keeps its IR type: its global shape and placements are those of the rows
it permutes (a rank holds a data-dependent number of them; the printed local shape is the mean). From a
gather on, every op that works row by row (pointwise ops, ``bmm``, ``linear`` by a weight whole on the
axis, views, chunks and splits that keep dim 0) and reads routed rows of one routing computes on routed
rows: its other row inputs (split by rows on the axis, as long) are dispatched too, and inputs without
rows (replicated there, broadcast) are read as they are. Any other read of a routed value, and the
program's outputs, get it combined back first. Every op thus computes on some permutation of its rows
what it computes on them in order, so the program's values and gradients are unchanged
(``runtime/comm/all_to_all.py``: the dispatch's backward is the combine and the other way round).
"""

from __future__ import annotations

from autopar.errors import PipelineError, PlanError
from autopar.ir.core import Op, Program, Ref, Replicate, Shard, TensorType, map_refs
from autopar.solver.sharding.experts import EXPERT_GATHER, expert_axes
from autopar.solver.sharding.rules.elementwise import POINTWISE

DISPATCH, COMBINE = "expert_dispatch", "expert_combine"
EXPERT_OPS = frozenset({DISPATCH, COMBINE})
# pointwise ops that compute each element from the same element of their inputs alone (dropout keys its
# mask by global element index, runtime/build/rng.py: not on permuted rows; tril/triu see their positions)
_ROW_POINTWISE = POINTWISE - {"aten.dropout", "aten.tril", "aten.triu", "aten.broadcast_tensors"}
# ops with a dim argument (position in args) that work row by row when that dim is not 0
_DIM_ARG = {
    "aten.unsqueeze": 1,
    "aten.squeeze.dim": 1,
    "aten.chunk": 2,
    "aten.split.Tensor": 2,
    "aten.split_with_sizes": 2,
    "aten.select.int": 1,
    "aten.slice.Tensor": 1,
}


def insert_expert_dispatch(prog: Program) -> Program:
    """``prog`` with each expert-parallel gather's rows dispatched and combined (the module docstring)."""
    types = prog.types()
    gathers = {
        op.result: axes
        for op in prog.ops
        if op.target == EXPERT_GATHER
        and (axes := expert_axes([types[r.name] for r in op.input_refs()], _read(op, types)))
    }
    if not gathers:
        return prog
    return _Rewrite(prog, types).run(gathers)


def _read(op: Op, types: dict[str, TensorType]) -> list:
    return [types[r.name].placements for r in op.input_refs()]


class _Rewrite:
    def __init__(self, prog: Program, types: dict[str, TensorType]):
        self.prog, self.types = prog, types
        self.ops: list[Op] = []
        self.routed: dict[str, tuple[str, int]] = {}  # value -> its routing: (index value, axis)
        self.experts: dict[tuple[str, int], int] = {}  # routing -> the number of experts it routes to
        self.dispatched: dict[tuple[str, tuple[str, int], bool], str] = {}
        self.combined: dict[str, str] = {}
        self.counter = 0

    def run(self, gathers: dict[str, list[int]]) -> Program:
        for op in self.prog.ops:
            if op.result in gathers:
                self.gather(op, gathers[op.result])
            else:
                self.other(op)
        outputs = tuple(map_refs(self.prog.outputs, lambda r: Ref(self.nominal(r.name, ""))))
        return self.prog.with_(ops=tuple(self.ops), outputs=outputs)

    def gather(self, op: Op, axes: list[int]) -> None:
        if len(axes) != 1:
            raise PlanError(
                f"%{op.result} = {op.target} is split over its experts on {len(axes)} mesh axes at once; "
                "expert parallelism uses one expert axis (ep): constrain the table to one"
            )
        table, idx = op.input_refs()
        route = (idx.name, axes[0])
        self.experts.setdefault(route, self.types[table.name].shape[0])
        local_ids = self.dispatch(self.nominal(idx.name, op.path), route, op.path, local_ids=True)
        rename = {table.name: self.nominal(table.name, op.path), idx.name: local_ids}
        self.ops.append(op.with_(args=map_refs(op.args, lambda r: Ref(rename[r.name]))))
        for r in op.results:
            self.routed[r] = route

    def other(self, op: Op) -> None:
        refs = op.input_refs()
        routes = {self.routed[r.name] for r in refs if r.name in self.routed}
        if len(routes) == 1:
            route = next(iter(routes))
            reads = self._row_reads(op, route)
            if reads is not None:
                rename = {
                    r.name: self.dispatch(r.name, route, op.path) if rows and r.name not in self.routed else r.name
                    for r, rows in zip(refs, reads)
                }
                self.ops.append(op.with_(args=map_refs(op.args, lambda r: Ref(rename[r.name]))))
                for r in op.results:
                    self.routed[r] = route
                return
        rename = {r.name: self.nominal(r.name, op.path) for r in refs}
        args, kwargs = map_refs((op.args, op.kwargs), lambda r: Ref(rename[r.name]))
        self.ops.append(op.with_(args=args, kwargs=kwargs))

    def _row_reads(self, op: Op, route: tuple[str, int]) -> list[bool] | None:
        """For an op that works row by row on the routing's rows: which of its inputs are rows (to be read
        dispatched); None when it does not (its routed inputs are combined first)."""
        axis = route[1]
        n_rows = self.types[route[0]].shape[0]
        if op.kwargs and op.target != "aten.to.dtype":
            return None
        if not all(_is_rows(t, axis, n_rows) for t in op.types):
            return None
        refs = [self.types[r.name] for r in op.input_refs()]
        out_rank = len(op.types[0].shape)
        if op.target in _ROW_POINTWISE:  # rows, or broadcast over them (no dim aligned with dim 0 of the result)
            reads = []
            for t in refs:
                if _is_rows(t, axis, n_rows) and len(t.shape) == out_rank:
                    reads.append(True)
                elif len(t.shape) < out_rank or t.shape[0] == 1:
                    if not isinstance(t.placements[axis], Replicate):
                        return None
                    reads.append(False)
                else:
                    return None
            return reads
        if op.target == "aten.bmm":
            return [True, True] if all(_is_rows(t, axis, n_rows) for t in refs) else None
        if op.target == "aten.linear" and len(op.args) == 2:
            x, w = refs
            return [True, False] if _is_rows(x, axis, n_rows) and isinstance(w.placements[axis], Replicate) else None
        if op.target in _DIM_ARG:
            pos = _DIM_ARG[op.target]
            dim = op.args[pos] if len(op.args) > pos else 0
            if not isinstance(dim, int) or dim % len(refs[0].shape) == 0 or len(refs) != 1:
                return None
            return [True] if _is_rows(refs[0], axis, n_rows) else None
        if op.target == "aten.squeeze.dims" and all(d % len(refs[0].shape) != 0 for d in op.args[1]):
            return [True] if _is_rows(refs[0], axis, n_rows) else None
        return None

    # -- the inserted ops -----------------------------------------------------------------------
    def dispatch(self, name: str, route: tuple[str, int], path: str, local_ids: bool = False) -> str:
        key = (name, route, local_ids)
        if key not in self.dispatched:
            kwargs = {"axis": self.prog.mesh.names[route[1]], "experts": self.experts[route]}
            if local_ids:
                kwargs["local_ids"] = True
            self.dispatched[key] = self.emit(DISPATCH, name, route[0], kwargs, path)
            self.routed[self.dispatched[key]] = route
        return self.dispatched[key]

    def nominal(self, name: str, path: str) -> str:
        """``name`` with its rows in their own order on their own rank: combined when it is routed."""
        if name not in self.routed:
            return name
        if name not in self.combined:
            route = self.routed[name]
            kwargs = {"axis": self.prog.mesh.names[route[1]], "experts": self.experts[route]}
            self.combined[name] = self.emit(COMBINE, name, route[0], kwargs, path)
        return self.combined[name]

    def emit(self, target: str, src: str, idx: str, kwargs: dict, path: str) -> str:
        self.counter += 1
        name = f"ep{self.counter}"
        t = self.types[src]
        self.ops.append(Op((name,), (t,), target, (Ref(src), Ref(idx)), kwargs, path=path))
        self.types[name] = t
        return name


def routed_values(prog: Program) -> set[str]:
    """The values of ``prog`` that hold dispatched rows (a rank holds a data-dependent permutation of them, not
    its slice): the dispatches' results and what is computed from them up to their combine."""
    routed: set[str] = set()
    for op in prog.ops:
        if op.target == DISPATCH or (op.target != COMBINE and any(r.name in routed for r in op.input_refs())):
            routed.update(op.results)
    return routed


def require_whole_dispatch_regions(prog: Program) -> None:
    """Refuse a pipeline stage boundary between a dispatch and its combine (``PipelineError``): the rows in
    between are a data-dependent number on each rank, which a stage boundary's buffers (sized from the IR)
    cannot carry, and each stage's experts are those of its own pipeline rank group."""
    routed = routed_values(prog)
    stage_of = {r: op.attrs.get("stage") for op in prog.ops for r in op.results}
    for op in prog.ops:
        for r in op.input_refs():
            if r.name in routed and stage_of.get(r.name) != op.attrs.get("stage"):
                raise PipelineError(
                    f"a pipeline stage boundary falls inside a mixture of experts' dispatched rows: %{r.name} "
                    f"(stage {stage_of.get(r.name)}) is read by %{op.result} = {op.target} (stage "
                    f"{op.attrs.get('stage')}); cut the pipeline at another place (fewer stages, or stages of "
                    "whole layers) or plan without the ep axis"
                )


def _is_rows(t: TensorType, axis: int, n_rows: int) -> bool:
    """Whether ``t`` holds the routing's rows: dim 0 as long, split by rows on the axis."""
    p = t.placements[axis] if t.placements else None
    return bool(t.shape) and t.shape[0] == n_rows and isinstance(p, Shard) and p.dim == 0 and p.chunks == 1


__all__ = [
    "COMBINE",
    "DISPATCH",
    "EXPERT_OPS",
    "insert_expert_dispatch",
    "require_whole_dispatch_regions",
    "routed_values",
]
