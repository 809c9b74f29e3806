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

transformers' default ``grouped_mm`` kernel computes an expert block as grouped matmuls over the rows sorted
by expert (``x[S, K]``, ``w[E, K, N]``, the groups' cumulative ends ``offs[E]``, whole on every rank): gate/up,
the activation row by row, down. An expert-parallel grouped matmul (``w`` split on its experts, ``x`` by
rows) reads its rows dispatched to their experts' ranks; the block is written with one dispatch and one
combine around all of it, as Megatron-Core's and torchtitan's token dispatchers move a layer's tokens:

    %d = expert_grouped_dispatch(%x, %offs) {axis=ep, experts=E}      rows to the rank owning their expert
    %h = transformers.grouped_mm_fallback(%d, %w1, %offs) <ep_rows=dispatched>   on the rank's experts
    ...                                                                 row-wise ops on dispatched rows
    %y = transformers.grouped_mm_fallback(%h2, %w2, %offs) <ep_rows=dispatched>
    %z = expert_grouped_combine(%y, %offs) {axis=ep, experts=E}       each row back to its block, in place

The routing comes from ``offs`` alone (every rank knows every block's rows of every group), so no counts are
exchanged. Rows between two grouped matmuls of one routing stay dispatched only where every row input of an
op is dispatched already: no other row value is sent on the way (a row-wise op reading rows that are not
dispatched, a bias gathered by expert, gets its dispatched inputs combined first, and the next grouped matmul
dispatches again). ``mark_expert_blocks`` finds the blocks on the lowered program (``attrs["ep_block"]``),
so the ILP prices each grouped matmul's share of its block's two exchanges (``solver/sharding/experts.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.errors import PipelineError, PlanError
from autopar.ir.core import VIEW_OPS, Op, Program, Ref, Replicate, Shard, TensorType, iter_refs, map_refs
from autopar.solver.sharding.experts import (
    EP_BLOCK,
    EP_ROWS,
    EXPERT_GATHER,
    EXPERT_GROUPED_MM,
    GROUPED_COMBINE,
    GROUPED_DISPATCH,
    expert_axes,
    grouped_expert_axes,
)
from autopar.solver.sharding.rules.elementwise import POINTWISE

DISPATCH, COMBINE = "expert_dispatch", "expert_combine"
CAPACITY = "capacity"  # a grouped matmul's attribute: each expert's capacity in rows (set_capacity)
DISPATCHES = frozenset({DISPATCH, GROUPED_DISPATCH})
COMBINES = frozenset({COMBINE, GROUPED_COMBINE})
EXPERT_OPS = DISPATCHES | COMBINES
# pointwise ops that compute each element from the same element of their inputs alone (dropout keys its
# mask by global element index, runtime/build/rng.py: not on permuted rows; tril/triu see their positions)
_ROW_POINTWISE = POINTWISE - {"aten.dropout", "aten.tril", "aten.triu", "aten.broadcast_tensors"}
# collectives on another axis than a grouped routing's that its dispatched rows pass (_collective_on_rows)
_ROW_COLLECTIVES = frozenset({"all_reduce", "grad_all_reduce", "all_gather", "reduce_scatter", "local_shard"})
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


@dataclass(frozen=True)
class Route:
    """One routing of rows on a mesh axis: by the router's indices ``src`` (an expert-parallel gather's), or
    by the offsets ``src`` of a grouped matmul's sorted rows (``grouped``); ``rows``: how many rows it moves."""

    src: str
    axis: int
    rows: int
    grouped: bool = False


def insert_expert_dispatch(prog: Program) -> Program:
    """``prog`` with each expert-parallel gather's rows dispatched and combined, and each expert-parallel
    grouped matmul's (the module docstring)."""
    types = prog.types()
    gathers = {
        op.result: axes
        for op in prog.ops
        if op.target == EXPERT_GATHER
        and (axes := expert_axes([types[r.name] for r in op.input_refs()], _read(op, types)))
    }
    grouped = {
        op.result: axes
        for op in prog.ops
        if op.target in EXPERT_GROUPED_MM
        and (axes := grouped_expert_axes([types[r.name] for r in op.input_refs()], _read(op, types)))
    }
    if not gathers and not grouped:
        return prog
    return _Rewrite(prog, types).run(gathers, grouped)


def _read(op: Op, types: dict[str, TensorType]) -> list:
    return [types[r.name].placements for r in op.input_refs()]


def _one_axis(op: Op, axes: list[int]) -> int:
    if len(axes) != 1:
        raise PlanError(
            f"%{op.result} = {op.target} is split over its experts on {len(axes)} mesh axes at once; "
            "expert parallelism uses one expert axis (ep): constrain the table to one"
        )
    return axes[0]


class _Rewrite:
    def __init__(self, prog: Program, types: dict[str, TensorType]):
        self.prog, self.types = prog, types
        self.ops: list[Op] = []
        self.routed: dict[str, Route] = {}  # value -> its routing
        self.experts: dict[Route, int] = {}  # routing -> the number of experts it routes to
        self.capacity: dict[Route, int] = {}  # a grouped routing -> its experts' capacity, where it has one
        self.dispatched: dict[tuple[str, Route, bool], str] = {}
        self.combined: dict[str, str] = {}
        self.counter = 0
        self.producer = {r: op for op in prog.ops for r in op.results}
        self.readers: dict[str, list[Op]] = {}
        for op in prog.ops:
            for r in op.input_refs():
                self.readers.setdefault(r.name, []).append(op)
        self.regathered: dict[tuple[str, Route], str] = {}

    def run(self, gathers: dict[str, list[int]], grouped: dict[str, list[int]]) -> Program:
        for op in self.prog.ops:
            if op.result in gathers:
                self.gather(op, gathers[op.result])
            elif op.result in grouped:
                self.grouped(op, _one_axis(op, grouped[op.result]))
            else:
                self.other(op)
        outputs = tuple(map_refs(self.prog.outputs, lambda r: Ref(self.nominal(r.name, ""))))
        made_again = {name for name, _ in self.regathered}
        return self.prog.with_(ops=_without_unread(self.ops, outputs, made_again), outputs=outputs)

    def gather(self, op: Op, axes: list[int]) -> None:
        table, idx = op.input_refs()
        route = Route(idx.name, _one_axis(op, axes), self.types[idx.name].shape[0])
        self.experts.setdefault(route, self.types[table.name].shape[0])
        local_ids = self.dispatch(self.nominal(idx.name, op.path), route, op.path, local_ids=True)
        rename = {table.name: self.nominal(table.name, op.path), idx.name: local_ids}
        self.ops.append(op.with_(args=map_refs(op.args, lambda r: Ref(rename[r.name]))))
        for r in op.results:
            self.routed[r] = route

    def grouped(self, op: Op, axis: int) -> None:
        """An expert-parallel grouped matmul: on its rows dispatched (here, unless they are already), its
        result dispatched rows of the same routing."""
        x, w, offs = op.input_refs()
        route = Route(offs.name, axis, self.types[x.name].shape[0], grouped=True)
        self.experts.setdefault(route, self.types[w.name].shape[0])
        if op.attrs.get(CAPACITY) is not None:
            self.capacity.setdefault(route, op.attrs[CAPACITY])
        rows = (
            x.name if self.routed.get(x.name) == route else self.dispatch(self.nominal(x.name, op.path), route, op.path)
        )
        rename = {x.name: rows, w.name: self.nominal(w.name, op.path), offs.name: self.nominal(offs.name, op.path)}
        args, kwargs = map_refs((op.args, op.kwargs), lambda r: Ref(rename[r.name]))
        attrs = {k: v for k, v in op.attrs.items() if k != EP_BLOCK}
        self.ops.append(op.with_(args=args, kwargs=kwargs, attrs={**attrs, EP_ROWS: "dispatched"}))
        for r in op.results:
            self.routed[r] = route

    def other(self, op: Op) -> None:
        refs = op.input_refs()
        routes = {self.routed[r.name] for r in refs if r.name in self.routed}
        if len(routes) == 1:
            route = next(iter(routes))
            reads = self._row_reads(op, route)
            if (
                reads is not None
                and route.grouped
                and any(rows and r.name not in self.routed for r, rows in zip(refs, reads))
            ):
                reads = None  # a grouped routing sends no other rows on the way: combined first
            elif reads is not None and self._combine_sooner(op, route, refs, reads):
                reads = None  # combined first: fewer tensors sent than its other rows there and its result back
            if reads is not None:
                rename = {
                    r.name: self.arrive(r.name, route, op.path) if rows and r.name not in self.routed else r.name
                    for r, rows in zip(refs, reads)
                }
                self.ops.append(op.with_(args=map_refs(op.args, lambda r: Ref(rename[r.name]))))
                for r in op.results:
                    self.routed[r] = route
                return
        rename = {r.name: self.nominal(r.name, op.path) for r in refs}
        args, kwargs = map_refs((op.args, op.kwargs), lambda r: Ref(rename[r.name]))
        self.ops.append(op.with_(args=args, kwargs=kwargs))

    def _combine_sooner(self, op: Op, route: Route, refs: list[Ref], reads: list[bool]) -> bool:
        """Whether ``op``, row by row on ``route``'s rows, is better run on its rows in their own order: rows it
        reads would be sent to it (none a gather made again there, ``arrive``), no more of its inputs are routed
        than that, and every reader of its results reads them combined (none works on them row by row), so
        combining its routed inputs first sends fewer tensors than sending the others there and its result back.
        Mixtral's routing weights multiply the experts' outputs so: weighed after the combine, as a token
        dispatcher does, they are not sent (two all-to-alls a layer fewer, forward and backward)."""
        sent = [r.name for r, rows in zip(refs, reads) if rows and r.name not in self.routed]
        if not sent or any(self.producer[n].target == EXPERT_GATHER for n in sent if n in self.producer):
            return False
        if sum(r.name in self.routed for r in refs) > len(sent):
            return False
        return all(self._row_reads(c, route) is None for r in op.results for c in self.readers.get(r, ()))

    def _row_reads(self, op: Op, route: Route) -> list[bool] | None:
        """For an op that works row by row on the routing's rows: which of its inputs are rows (to be read
        dispatched); None when it does not (its routed inputs are combined first)."""
        if route.grouped and op.target in _ROW_COLLECTIVES:
            return [True] if self._collective_on_rows(op, route) else None
        return row_reads(op, self.types, route.axis, route.rows)

    def _collective_on_rows(self, op: Op, route: Route) -> bool:
        """Whether the collective ``op`` on another mesh axis leaves the grouped routing's rows as they are: it
        reads and makes them split by rows on the routing's axis, moves no dim 0, and its group's ranks hold
        the same block of rows (neither its input nor its result split by rows on its own axis), so they hold
        the same dispatched rows in the same order."""
        (src,) = op.input_refs()
        axis = self.prog.mesh.index(op.kwargs["axis"])
        ins, out = self.types[src.name], op.types[0]
        if axis == route.axis or not (_is_rows(ins, route.axis, route.rows) and _is_rows(out, route.axis, route.rows)):
            return False
        if op.kwargs.get("dim", 1) % len(out.shape) == 0:
            return False
        return not any(isinstance(t.placements[axis], Shard) and t.placements[axis].dim == 0 for t in (ins, out))

    # -- the inserted ops -----------------------------------------------------------------------
    def arrive(self, name: str, route: Route, path: str) -> str:
        """The rows of ``name`` on the ranks of their experts: dispatched, or, for the rows of a gather of a table
        whole on the routing's axis by the routing's own indices (an expert table the plan reads gathered, its
        rows then meeting dispatched ones), gathered there instead (``regather``): the indices move, not the
        gathered matrices (E x K x N elements a row against one index)."""
        key = (name, route)
        if key not in self.regathered:
            made = self.regather(name, route, path)
            if made is None:
                return self.dispatch(name, route, path)
            self.regathered[key] = made
        return self.regathered[key]

    def regather(self, name: str, route: Route, path: str) -> str | None:
        """``aten.index.Tensor(table, [idx])`` (the op making ``name``) made on the rows' experts' ranks: with
        ``idx`` dispatched (global ids), or where ``table`` is its expert-split parameter all-gathered on the axis,
        from the rank's own experts by their local ids, the all-gather left unread (``_without_unread``); None
        where ``name`` is no such gather."""
        op = self.producer.get(name)
        if route.grouped or op is None or op.target != EXPERT_GATHER or len(op.input_refs()) != 2:
            return None
        table, idx = (r.name for r in op.input_refs())
        if idx != route.src or not isinstance(self.types[table].placements[route.axis], Replicate):
            return None
        ids = self.nominal(idx, path)
        split = self._split_table(table, route)
        if split is not None:
            table, ids = split, self.dispatch(ids, route, path, local_ids=True)
        else:
            ids = self.dispatch(ids, route, path)
        self.counter += 1
        made = f"ep{self.counter}"
        rename = {op.input_refs()[0].name: table, idx: ids}
        self.ops.append(op.with_(results=(made,), args=map_refs(op.args, lambda r: Ref(rename[r.name])), path=path))
        self.types[made] = op.types[0]
        self.routed[made] = route
        return made

    def _split_table(self, table: str, route: Route) -> str | None:
        """The parameter split on its experts over the routing's axis that ``table`` is all-gathered from there
        (through the backward's all-reduces), when it is."""
        axis = self.prog.mesh.names[route.axis]
        op = self.producer.get(table)
        while op is not None and op.target == "grad_all_reduce" and op.kwargs.get("axis") == axis:
            op = self.producer.get(op.input_refs()[0].name)
        if op is None or op.target != "all_gather" or op.kwargs.get("axis") != axis or op.kwargs.get("dim") != 0:
            return None
        src = op.input_refs()[0].name
        t = self.types[src]
        split = t.placements[route.axis] == Shard(0) and t.shape[0] == self.experts.get(route)
        return src if split and src in {v.name for v in self.prog.params} else None

    def dispatch(self, name: str, route: Route, path: str, local_ids: bool = False) -> str:
        key = (name, route, local_ids)
        if key not in self.dispatched:
            kwargs = self._kwargs(route)
            if local_ids:
                kwargs["local_ids"] = True
            target = GROUPED_DISPATCH if route.grouped else DISPATCH
            self.dispatched[key] = self.emit(target, name, route.src, kwargs, path)
            self.routed[self.dispatched[key]] = route
        return self.dispatched[key]

    def nominal(self, name: str, path: str) -> str:
        """``name`` with its rows in their own order on their own rank: combined when it is routed."""
        if name not in self.routed:
            return name
        if name not in self.combined:
            route = self.routed[name]
            kwargs = self._kwargs(route)
            target = GROUPED_COMBINE if route.grouped else COMBINE
            self.combined[name] = self.emit(target, name, route.src, kwargs, path)
        return self.combined[name]

    def _kwargs(self, route: Route) -> dict:
        kwargs = {"axis": self.prog.mesh.names[route.axis], "experts": self.experts[route]}
        if route in self.capacity:
            kwargs["capacity"] = self.capacity[route]
        return kwargs

    def emit(self, target: str, src: str, idx: str, kwargs: dict, path: str) -> str:
        self.counter += 1
        name = f"ep{self.counter}"
        t = self.types[src]
        self.ops.append(Op((name,), (t,), target, (Ref(src), Ref(idx)), kwargs, path=path))
        self.types[name] = t
        return name


# ops without effects that a regathered gather may leave unread: the gather, and the table's all-gather
_UNREAD = frozenset({EXPERT_GATHER, "all_gather", "grad_all_reduce"}) | VIEW_OPS


def _without_unread(ops: list[Op], outputs, made: set[str]) -> tuple[Op, ...]:
    """``ops`` less the gathers ``made`` again on the experts' ranks (``_Rewrite.regather``) where nothing else
    reads them, and then what only they read (ops of ``_UNREAD``: the table's all-gather), and so on."""
    if not made:
        return tuple(ops)
    suspects = set(made)
    reads: dict[str, int] = {}
    for r in iter_refs(outputs):
        reads[r.name] = reads.get(r.name, 0) + 1
    for op in ops:
        for r in op.input_refs():
            reads[r.name] = reads.get(r.name, 0) + 1
    keep = [True] * len(ops)
    for i in range(len(ops) - 1, -1, -1):  # a reader comes after what it reads: one backward sweep
        op = ops[i]
        if op.target in _UNREAD and suspects & set(op.results) and not any(reads.get(r, 0) for r in op.results):
            keep[i] = False
            for r in op.input_refs():
                reads[r.name] -= 1
                suspects.add(r.name)
    return tuple(op for op, k in zip(ops, keep) if k)


def row_reads(op: Op, types: dict[str, TensorType], axis: int | None, n_rows: int) -> list[bool] | None:
    """For an op that works row by row on ``n_rows`` rows split on mesh axis ``axis`` (any placement where
    ``axis`` is None: the lowered program's structure alone): which of its inputs are rows; None when it
    does not work row by row."""
    if op.kwargs and op.target != "aten.to.dtype":
        return None
    if not all(_is_rows(t, axis, n_rows) for t in op.types):
        return None
    refs = [types[r.name] for r in op.input_refs()]
    out_rank = len(op.types[0].shape)
    if op.target in _ROW_POINTWISE:  # rows, or broadcast over them (no dim aligned with dim 0 of the result)
        reads = []
        for t in refs:
            if _is_rows(t, axis, n_rows) and len(t.shape) == out_rank:
                reads.append(True)
            elif len(t.shape) < out_rank or t.shape[0] == 1:
                if axis is not None and not isinstance(t.placements[axis], Replicate):
                    return None
                reads.append(False)
            else:
                return None
        return reads
    if op.target == "aten.bmm":
        return [True, True] if all(_is_rows(t, axis, n_rows) for t in refs) else None
    if op.target == "aten.linear" and len(op.args) == 2:
        x, w = refs
        whole = axis is None or isinstance(w.placements[axis], Replicate)
        return [True, False] if _is_rows(x, axis, n_rows) and whole else None
    if op.target in _DIM_ARG:
        pos = _DIM_ARG[op.target]
        dim = op.args[pos] if len(op.args) > pos else 0
        if not isinstance(dim, int) or dim % len(refs[0].shape) == 0 or len(refs) != 1:
            return None
        return [True] if _is_rows(refs[0], axis, n_rows) else None
    if op.target == "aten.squeeze.dims" and all(d % len(refs[0].shape) != 0 for d in op.args[1]):
        return [True] if _is_rows(refs[0], axis, n_rows) else None
    return None


def mark_expert_blocks(prog: Program) -> Program:
    """``prog`` (lowered, every placement R) with each grouped matmul that shares its rows with another of the
    same offsets marked ``attrs["ep_block"]``: ``first`` (its rows come in from elsewhere, its result goes on
    row by row to another's rows), ``last`` (its rows come from another's result, its own leaves), ``inner``
    (both): what ``insert_expert_dispatch`` writes when the plan makes them expert-parallel, one dispatch
    before the first and one combine after the last. A grouped matmul of no block is left unmarked."""
    types = prog.types()
    origin: dict[str, frozenset[str]] = {}  # a value computed row by row from grouped matmuls' results: theirs
    offs_of: dict[str, str] = {}  # grouped matmul -> its offsets
    takes_in: set[str] = set()  # grouped matmuls whose rows come from another's result
    feeds: set[str] = set()  # grouped matmuls whose result reaches another's rows
    for op in prog.ops:
        refs = op.input_refs()
        if op.target in EXPERT_GROUPED_MM and len(refs) == 3 and len(types[refs[0].name].shape) == 2:
            x, _, offs = refs
            sources = {g for g in origin.get(x.name, ()) if offs_of[g] == offs.name}
            if sources:
                takes_in.add(op.result)
                feeds.update(sources)
            offs_of[op.result] = offs.name
            origin[op.result] = frozenset({op.result})
            continue
        came = [origin[r.name] for r in refs if r.name in origin]
        if not came:
            continue
        n_rows = types[next(r.name for r in refs if r.name in origin)].shape[0]
        reads = row_reads(op, types, None, n_rows)
        if reads is None or any(rows and r.name not in origin for r, rows in zip(refs, reads)):
            continue
        for r in op.results:
            origin[r] = frozenset().union(*came)
    if not feeds:
        return prog
    place = {(True, True): "inner", (False, True): "first", (True, False): "last"}
    ops = []
    for op in prog.ops:
        key = (op.result in takes_in, op.result in feeds)
        ops.append(op.with_(attrs={**op.attrs, EP_BLOCK: place[key]}) if key in place else op)
    return prog.with_(ops=tuple(ops))


def capacity_of(factor: float, rows: int, experts: int) -> int:
    """GShard's and Switch's expert capacity: ``ceil(factor * rows / experts)`` rows per expert, ``rows`` the
    (token, slot) rows of one batch (its tokens times the router's top-k)."""
    return math.ceil(factor * rows / experts)


def set_capacity(prog: Program, factor: float | None) -> Program:
    """``prog`` with every grouped matmul of an experts kernel keeping, per expert, the first ``capacity_of``
    rows of its group in their sorted order (``attrs["capacity"]``; token dropping as in GShard and Switch: a
    row over capacity gets a zero result, and so no gradient); ``factor`` None: dropless, ``prog`` as it is.
    The runtime drops the rows wherever the grouped matmul runs (``runtime/comm/all_to_all.py``: not sent
    under expert parallelism, masked otherwise). Both grouped matmuls of an expert block read the same
    offsets, so they drop the same rows and the block's result for them is zero."""
    if factor is None:
        return prog
    if not factor > 0:
        raise PlanError(f"capacity_factor={factor}: an expert's capacity factor must be positive (None: dropless)")
    types = prog.types()
    ops = []
    for op in prog.ops:
        refs = op.input_refs()
        if op.target in EXPERT_GROUPED_MM and len(refs) == 3 and len(types[refs[1].name].shape) == 3:
            x, w = types[refs[0].name], types[refs[1].name]
            op = op.with_(attrs={**op.attrs, CAPACITY: capacity_of(factor, x.shape[0], w.shape[0])})
        ops.append(op)
    return prog.with_(ops=tuple(ops))


def routed_values(prog: Program) -> set[str]:
    """The values of ``prog`` that hold dispatched rows (a rank holds a data-dependent permutation of them, not
    its slice): the dispatches' results and what is computed from them up to their combine."""
    routed: set[str] = set()
    for op in prog.ops:
        if op.target in DISPATCHES or (op.target not in COMBINES and any(r.name in routed for r in op.input_refs())):
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


def _is_rows(t: TensorType, axis: int | None, n_rows: int) -> bool:
    """Whether ``t`` holds the routing's rows: dim 0 as long, split by rows on the axis (when there is one)."""
    if not t.shape or t.shape[0] != n_rows:
        return False
    if axis is None:
        return True
    p = t.placements[axis] if t.placements else None
    return isinstance(p, Shard) and p.dim == 0 and p.chunks == 1


__all__ = [
    "CAPACITY",
    "COMBINE",
    "COMBINES",
    "DISPATCH",
    "DISPATCHES",
    "EXPERT_OPS",
    "GROUPED_COMBINE",
    "GROUPED_DISPATCH",
    "Route",
    "insert_expert_dispatch",
    "mark_expert_blocks",
    "require_whole_dispatch_regions",
    "capacity_of",
    "routed_values",
    "row_reads",
    "set_capacity",
]
