"""Batch coupling: the ops whose value over the whole batch is not what microbatches make of it.

A pipeline, and gradient accumulation, run the program once per microbatch and combine the pieces' losses
by their mean (weighted by the loss's own divisor, ``runtime/call/loss_weight.py``). That is the whole
batch's loss, and gradient, only when every value on the way to the loss is either a per-sample value (it
keeps the batch rows apart) or an affine function of means over the batch (a mean of the microbatches' means
is the batch's mean). Anything else couples the batch, and microbatching changes the model, silently:

- an op that mixes samples: CLIP's contrastive logits ``image_embeds @ text_embeds.T`` (every image against
  every text of the batch: a microbatch sees 1/M of the negatives), batch norm's normalization in training;
- a nonlinear function of batch statistics: the MoE load-balancing loss ``N * sum_e f_e * P_e`` is a
  product of two means over the batch's tokens (the token fraction per expert and the mean router
  probability); the mean of per-microbatch products is not the product of the means;
- per-sample values computed from a batch statistic (``x - x.mean(0)``);
- a value divided by a batch-level quantity other than the loss's own divisor, and a loss that is a sum over
  the batch (averaging pieces divides it by their count).

The analysis is a dataflow over the IR, with no list of models. The batch rows are found as the dropout
keying finds them (``passes/dropout.py``): every user input carries its rows on dim 0, and the sharding rules
(``solver/sharding/rules/``) propagate ``S(d)`` on a virtual axis of microbatches. An op whose batch-carrying
inputs match a strategy with its result ``S(d)`` keeps the rows apart; one whose result comes out ``P(avg)``
or ``P(sum)`` reduces over the batch (a mean or a sum over it); one no strategy matches mixes the samples.
Each value gets a state: ``data`` (no batch data reaches it), ``rows`` (per sample), ``mean`` (affine in
means over the batch), ``sum`` (linear in sums over the batch) or ``coupled``; the first op that makes a
value coupled is a ``Coupling``. Collectives and pipeline transfers leave the global value as it is, so the
analysis reads any program of the flow: lowered, sharded, or split with its send/recv.

The grouped-GEMM experts kernel (transformers' default ``grouped_mm``: ``transformers::grouped_mm_fallback`` or
``aten._grouped_mm``) sorts the flattened (token, slot) expert ids over the whole batch, gathers the tokens in
that order (``hidden[perm // top_k]``), multiplies each group of rows by its expert (``offsets =
cumsum(histc(sorted ids))``) and puts the rows back (``out[inverse(perm)]``). Each row's result is its own
token's, whatever the other rows are, so the whole is per sample; the analysis follows it with four states
tied to the sort: ``sorted`` (per-row values in the sort's order), ``permutation`` (the sort's indices, or
them floor-divided by the slots per token), ``inverse permutation`` and ``offsets`` (the cumulative counts of
the sorted keys over a fixed range of bins). A gather of batch rows by the permutation is ``sorted``; row-wise
ops keep it ``sorted``; a reduction over it is the batch's (a sum does not see the order); a gather of it by
the inverse permutation (or a scatter by the permutation) is per-sample ``rows`` again. Any other use of these
values is unproven.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.ir.core import (
    COLLECTIVES,
    VIEW_OPS,
    Op,
    Partial,
    Program,
    R,
    Ref,
    Shard,
    TensorType,
    Value,
    bound_args,
)
from autopar.solver.sharding.one_axis import Ctx
from autopar.solver.sharding.strategies import RULES

DATA, ROWS, MEAN, SUM, COUPLED = "data", "rows", "mean", "sum", "coupled"
UNKNOWN = "unknown"  # computed from an op the analysis cannot read: not followed further
BATCH_DIVISOR = "batch divisor"
UNPROVEN = "unproven"  # a coupling's kind when the op is one the analysis cannot read (no sharding rule)
# the states of a grouped-GEMM kernel's sort of the batch's rows (module docstring)
SORTED, PERM, INVERSE, OFFSETS = "sorted", "permutation", "inverse permutation", "offsets"
_ORDERED = {SORTED, PERM, INVERSE, OFFSETS}
_SORTS = {"aten.sort", "aten.sort.stable", "aten.argsort", "aten.argsort.stable"}
_GROUPED_MM = {"transformers.grouped_mm_fallback", "aten._grouped_mm"}
_CASTS = {"aten.to.dtype", "aten._to_copy", "aten.to", "aten.clone", "aten.contiguous", "aten.to.dtype_layout"}
TAIL_SCHEDULES = ("gpipe",)  # the schedules that run every forward of the last stage before its backwards
TAIL_INPUT = "batch_tail"  # an input's attr: the step's value of a batch statistic (``Tail``), no batch rows
_VIRTUAL = 2  # microbatches on the virtual axis, as in passes/dropout.py: the shapes only need to divide

# ops linear in each of their float tensor inputs (a value affine in batch means stays so through them)
_LINEAR_ONE = VIEW_OPS | {
    "aten.clone", "aten._to_copy", "aten.neg", "aten.sum", "aten.sum.dim_IntList", "aten.mean", "aten.mean.dim",
    "aten.cat", "aten.stack", "aten.squeeze.dims", "aten.contiguous", "aten.copy", "aten.index_select",
    "aten.select_scatter", "aten.slice_scatter", "aten.lift_fresh_copy",
}  # fmt: skip
_ADDITIVE = {"aten.add.Tensor", "aten.sub.Tensor", "aten.add", "aten.sub"}
_SCALING = {"aten.mul.Tensor", "aten.mul", "aten.mul.Scalar", "aten.div.Tensor", "aten.div", "aten.div.Scalar"}
_DIVISION = {"aten.div.Tensor", "aten.div", "aten.div.Scalar"}
# ops whose result carries no data dependence on their inputs' values (only their shapes)
_SHAPE_ONLY = {
    "aten.zeros_like", "aten.ones_like", "aten.empty_like", "aten.full_like", "aten.sym_size.int", "aten.new_empty",
    "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.new_empty_strided", "aten.empty_strided",
}  # fmt: skip
# ops that leave their first input's global value as it is: collectives, pipeline sends, device moves
_IDENTITY = (COLLECTIVES - {"recv"}) | {"aten.to.device", "aten.to", "aten.to.dtype_layout"}


@dataclass(frozen=True)
class Coupling:
    """One op that couples the batch: where it is, what kind of coupling and why microbatching changes it."""

    result: str  # the op's first result
    target: str
    path: str  # the module it came from ("" when the capture does not say)
    kind: str  # "mixes samples", "nonlinear in batch statistics", "uses a batch statistic", "batch divisor", "sum",
    # or UNPROVEN
    why: str

    @property
    def certain(self) -> bool:
        """Whether the op is known to couple the batch (not only beyond what the analysis can read)."""
        return self.kind != UNPROVEN

    def describe(self) -> str:
        where = f" in {self.path}" if self.path else ""
        return f"%{self.result} = {self.target}{where} ({self.kind}: {self.why})"


@dataclass(frozen=True)
class Analysis:
    """Every value's state and the couplings found, in program order."""

    states: dict[str, str]
    couplings: tuple[Coupling, ...]
    loss_state: str | None  # the first output's state; None when it is no value

    def reaching(self, program: Program) -> tuple[Coupling, ...]:
        """The couplings whose values reach an output of ``program`` (what the user sees or trains on)."""
        origin = _origins(program, self)
        seen: set[str] = set()
        for out in program.outputs:
            if isinstance(out, Ref):
                seen |= origin.get(out.name, set())
        return tuple(c for c in self.couplings if c.result in seen)


@dataclass
class _Orders:
    """What ties the ``sorted``/``permutation``/``inverse permutation``/``offsets`` values to their sort."""

    of: dict[str, str]  # such a value -> the sort it is ordered by (named by the sort's indices)
    step: dict[str, int]  # a permutation -> c: the sort's indices floor-divided by c (the slots per token)
    length: dict[str, int]  # a sort -> how many elements it sorts
    keys: set[str]  # the sorted values themselves (ascending or descending), and their casts
    counts: dict[str, str]  # histc of a sort's keys over fixed bins (a sum over the batch) -> the sort

    def carry(self, src: str, dst: str) -> None:
        """``dst`` is ``src`` moved (a collective, a send/recv): the same ties."""
        for table in (self.of, self.step, self.counts):
            if src in table:
                table[dst] = table[src]
        if src in self.keys:
            self.keys.add(dst)


def analyze(program: Program) -> Analysis:
    """The batch-coupling dataflow over ``program`` (module docstring)."""
    types = program.types()
    divisor = _loss_divisor(program)
    states: dict[str, str] = {}
    dims: dict[str, int] = {}  # the batch dim of a ``rows`` value
    for v in program.inputs:
        rows = v.kind == "input" and bool(v.type.shape) and not v.attrs.get(TAIL_INPUT)
        states[v.name], dims[v.name] = (ROWS, 0) if rows else (DATA, -1)
    sent: dict[str, str] = {}  # "x.sendK" -> what it sends, for the matching "x.recvK"
    zeros = {op.result for op in program.ops if _is_zeros(op)}
    aranges = {op.result for op in program.ops if op.target in ("aten.arange", "aten.arange.start")}
    couplings: list[Coupling] = []
    orders = _Orders({}, {}, {}, set(), {})
    for op in program.ops:
        refs = [r.name for r in op.input_refs()]
        if op.target == "send":
            sent[op.result] = refs[0]
        if op.target == "recv":
            src = sent.get(_sent_name(op.result))
            got, d = (states[src], dims.get(src, -1)) if src is not None else (DATA, -1)
            _set(op, states, dims, [got], [d])
            if src is not None:
                orders.carry(src, op.result)
            continue
        ins = [states[r] for r in refs]
        if not refs or all(s == DATA for s in ins) or op.target in _SHAPE_ONLY:
            _set(op, states, dims, [DATA] * len(op.results), [-1] * len(op.results))
            continue
        worst = next((s for s in (COUPLED, UNKNOWN) if s in ins), None)
        if worst is not None:  # already coupled, or past what the analysis reads: no new coupling here
            _set(op, states, dims, [worst] * len(op.results), [-1] * len(op.results))
            continue
        if op.target in _IDENTITY:
            _set(op, states, dims, [ins[0]] * len(op.results), [dims.get(refs[0], -1)] * len(op.results))
            for r in op.results:
                orders.carry(refs[0], r)
            continue
        ordered = _ordered(op, refs, ins, states, dims, types, aranges, orders)
        if ordered is not None:
            got_states, got_dims, coupling = ordered
            if coupling is not None:
                couplings.append(coupling)
            _set(op, states, dims, got_states, got_dims)
            continue
        if ROWS in ins:
            got_states, got_dims, coupling = _with_rows(op, refs, ins, types, dims, aranges)
        else:
            got_states, got_dims, coupling = _of_statistics(op, refs, ins, states, divisor, zeros)
        if coupling is not None:
            couplings.append(coupling)
        _set(op, states, dims, got_states, got_dims)
    first = program.outputs[0] if program.outputs else None
    loss_state = states.get(first.name) if isinstance(first, Ref) else None
    if loss_state == SUM:
        producer = program.producers()[first.name]
        where = producer if isinstance(producer, Op) else None
        couplings.append(
            Coupling(
                first.name, where.target if where else "input", where.path if where else "", "sum",
                "the loss is a sum over the batch; the step averages its pieces' losses, dividing the loss and its "
                "gradients by their count (use a mean)",
            )
        )  # fmt: skip
        states[first.name] = COUPLED
    return Analysis(states, tuple(couplings), loss_state)


def batch_couplings(program: Program) -> tuple[Coupling, ...]:
    """The ops that couple the batch on the way to ``program``'s outputs (empty: microbatching is exact)."""
    found = analyze(program)
    return found.reaching(program)


# -- the transfer functions ---------------------------------------------------------------------------------


def _set(op: Op, states: dict, dims: dict, got: list[str], got_dims: list[int]) -> None:
    for r, s, d in zip(op.results, got, got_dims):
        states[r], dims[r] = s, d


def _sent_name(recv: str) -> str:
    """``x.recvK`` (passes/transfers.py) -> the send's result ``x.sendK``."""
    base, _, k = recv.rpartition(".recv")
    return f"{base}.send{k}"


def _with_rows(op: Op, refs: list[str], ins: list[str], types: dict, dims: dict, aranges: set[str]):
    """An op some of whose inputs carry the batch rows: it keeps them apart (``rows``), reduces over them
    (``mean`` or ``sum``), or mixes them; and per-sample values computed from a batch statistic couple."""
    n = len(op.results)
    stats = [r for r, s in zip(refs, ins) if s in (MEAN, SUM)]
    if stats:
        why = (
            f"the per-sample values are computed from %{stats[0]}, a statistic over the batch: a microbatch's "
            "statistic is not the batch's"
        )
        return [COUPLED] * n, [-1] * n, _coupling(op, "uses a batch statistic", why)
    got = [dims[r] if s == ROWS else None for r, s in zip(refs, ins)]
    if _trains_batch_norm(op):
        why = "batch norm in training normalizes every sample by the statistics of the batch it is given"
        return [COUPLED] * n, [-1] * n, _coupling(op, "mixes samples", why)
    in_types = [types[r] for r in refs]
    # an op's rule first; then its meaning (a rule may leave out splits that keep rows apart, e.g. an index
    # with data-free indices after the batch dim, which the gather-of-rows rule replicates)
    found = _propagate(op, in_types, got) if op.target in RULES else None
    found = found or _rowwise(op, refs, got, types, aranges)
    if found is None:
        why = (
            "it combines different samples of the batch (no sharding of its batch rows computes it apart): a "
            "microbatch sees only its own samples"
        )
        if RULES.get(op.target) is None:
            why = "the analysis has no rule for it, so it cannot tell whether it keeps the samples apart"
            return [UNKNOWN] * n, [-1] * n, _coupling(op, UNPROVEN, why)
        return [COUPLED] * n, [-1] * n, _coupling(op, "mixes samples", why)
    kind, out_dims = found
    if kind == ROWS:
        return [ROWS if d >= 0 else DATA for d in out_dims], out_dims, None
    return [kind] * n, [-1] * n, None


def _of_statistics(op: Op, refs: list[str], ins: list[str], states: dict, divisor: str | None, zeros: set[str]):
    """An op of batch statistics (``mean``/``sum``) and data-free values: affine ops keep a mean a mean and a
    sum a sum (a sum over a data-free count is a mean: the microbatch's program divides by its own, constant,
    count); a product of two statistics, a nonlinear function of one, or a division by one couples."""
    n = len(op.results)
    if op.target in _ADDITIVE:  # adding a zeros tensor (an accumulator's start) changes nothing
        refs, ins = [r for r in refs if r not in zeros], [s for r, s in zip(refs, ins) if r not in zeros]
    live = [(r, s) for r, s in zip(refs, ins) if s != DATA]
    kinds = {s for _, s in live}
    if op.target in _LINEAR_ONE or (op.target in _ADDITIVE and len(kinds) == 1):
        if len(kinds) == 1 and not (op.target in _ADDITIVE and SUM in kinds and len(live) < len(refs)):
            return [kinds.pop()] * n, [-1] * n, None
    if op.target in _SCALING and len(live) == 1:
        scaled = not (op.target in _DIVISION and len(refs) > 1 and refs[1] == live[0][0])
        if scaled:  # a statistic times or over a data-free value
            averaged = op.target in _DIVISION and live[0][1] == SUM
            return [MEAN if averaged else live[0][1]] * n, [-1] * n, None
    if op.target in _DIVISION and op.result == divisor and ins[:2] == [SUM, SUM]:
        return [MEAN] * n, [-1] * n, None  # the loss's own ratio, weighed per piece (runtime/call/loss_weight.py)
    names = ", ".join(f"%{r} ({s} over the batch)" for r, s in live)
    if op.target in _DIVISION and len(refs) > 1 and states.get(refs[1]) in (MEAN, SUM):
        kind = BATCH_DIVISOR
        why = (
            f"it divides by %{refs[1]}, a quantity over the batch: each microbatch would divide by its own "
            "(only the loss's last division by a count of the data is weighed per microbatch)"
        )
    else:
        kind = "nonlinear in batch statistics"
        why = (
            f"it is a nonlinear function of {names}: the mean over microbatches of a function of their statistics "
            "is not the function of the batch's"
        )
    return [COUPLED] * n, [-1] * n, _coupling(op, kind, why)


_BATCH_NORMS = {"aten.batch_norm", "aten.native_batch_norm", "aten._native_batch_norm_legit_functional"}
_ALONG_DIM = {"aten.topk": -1, "aten.sort": -1, "aten.argsort": -1, "aten.sort.stable": -1, "aten.chunk": 0,
              "aten.argmax": None, "aten.argmin": None}  # fmt: skip


def _is_zeros(op: Op) -> bool:
    if op.target in ("aten.zeros", "aten.zeros_like", "aten.new_zeros"):
        return True
    return op.target in ("aten.full", "aten.full_like", "aten.new_full") and len(op.args) > 1 and op.args[1] == 0


def _trains_batch_norm(op: Op) -> bool:
    bound = bound_args(op) if op.target in _BATCH_NORMS else None
    return bound is not None and bool(bound.get("training", False))


def _rowwise(
    op: Op, refs: list[str], got: list[int | None], types: dict, aranges: set[str]
) -> tuple[str, list[int]] | None:
    """The result dims of an op the sharding rules do not cover but whose meaning keeps rows apart along its
    batch dim: along-a-dim ops (topk, sort, chunk) away from the batch dim; repeat_interleave, broadcast_to
    and stack; an index or gather with data-free indices away from the batch dim, a data-free table looked
    up by per-sample indices, each sample's own elements picked by ``arange`` over the batch; baddbmm over
    the batch; batch norm in evaluation. Histograms (histc, bincount) count over the batch: a sum.
    ``None``: none of these (the caller then reports the op as unproven)."""
    bound = bound_args(op) or {}
    rows = [d for d in got if d is not None]
    first = got[0] if got else None
    rank = len(types[refs[0]].shape) if refs else 0
    n = len(op.results)
    if op.target in _ALONG_DIM and first is not None and len(rows) == 1:
        dim = bound.get("dim", _ALONG_DIM[op.target])
        if dim is None:  # over the flattened tensor
            return None
        keep = bound.get("keepdim", True)
        out = first if keep or dim % rank > first else first - 1
        return (ROWS, [out] * n) if dim % rank != first else None
    if op.target == "aten.repeat_interleave.self_int" and first is not None and len(rows) == 1:
        dim = bound.get("dim")
        if dim is None:  # flattened: the rows stay in order only when they lead
            return (ROWS, [0]) if first == 0 else None
        return ROWS, [first]  # each element repeated in place: a sample's rows stay its own, in order
    if op.target == "aten.broadcast_to" and first is not None:
        return ROWS, [first + len(op.types[0].shape) - rank]  # expand's: new dims lead
    if op.target == "aten.stack" and len(set(rows)) == 1:  # a new dim among the inputs' own
        dim = bound.get("dim", 0) % (rank + 1)
        return ROWS, [rows[0] if rows[0] < dim else rows[0] + 1]
    if op.target == "aten.gather" and len(got) == 2:  # out = input gathered along dim by index (index's shape)
        dim = bound.get("dim", 0) % rank
        if first is None and got[1] is not None:
            return ROWS, [got[1]]  # a data-free table looked up by per-sample indices
        if first is not None and first != dim and got[1] in (None, first):
            return ROWS, [first]  # each sample's own elements
    if op.target in _BATCH_NORMS and first == 0:  # in evaluation: the running statistics, per sample
        return ROWS, [0] + [-1] * (n - 1)
    fixed = op.target != "aten.histc" or bound.get("min", 0) < bound.get("max", 0)  # not over the data's range
    if op.target in ("aten.histc", "aten.bincount") and first is not None and len(rows) == 1 and fixed:
        return SUM, [-1]  # counts over every element: the batch's are the sum of its microbatches'
    if op.target == "aten.baddbmm" and all(d in (None, 0) for d in got) and got[1:] != [None, None]:
        return ROWS, [0]
    if op.target == "aten.index.Tensor":
        indices = bound.get("indices", ())
        positions = [i for i, x in enumerate(indices) if x is not None]
        if first is not None and got[1:] and all(d is None for d in got[1:]) and positions and first < positions[0]:
            return ROWS, [first]  # data-free indices into dims after the batch's: each sample's own elements
        if first is None and len(indices) == 1 and positions == [0] and got[1] is not None:
            return ROWS, [got[1]]  # a data-free table looked up by per-sample indices
        at = indices[first] if first is not None and first < len(indices) else None
        if isinstance(at, Ref) and at.name in aranges and positions == list(range(first, len(indices))):
            return ROWS, [first]  # x[..., arange(B), idx]: sample b's own elements, picked by its own index
    return None


# -- a grouped-GEMM kernel's sort of the batch's rows (module docstring) ------------------------------------


def _ordered(
    op: Op, refs: list[str], ins: list[str], states: dict, dims: dict, types: dict, aranges: set[str], orders: _Orders
):
    """The states of an op that sorts batch rows, or reads values tied to such a sort; ``None`` for any other op
    (the caller's transfer functions then apply)."""
    n = len(op.results)
    if op.target in _SORTS and ins == [ROWS] and dims[refs[0]] == 0 and len(types[refs[0]].shape) == 1:
        p = op.results[-1]  # the sort's indices name it
        orders.of[p], orders.step[p], orders.length[p] = p, 1, types[refs[0]].shape[0]
        if n == 1:
            return [PERM], [-1], None
        orders.of[op.results[0]] = p
        orders.keys.add(op.results[0])
        return [SORTED, PERM], [-1, -1], None
    counted = [r for r in refs if r in orders.counts]
    if counted and op.target == "aten.cumsum" and refs == counted and (bound_args(op) or {}).get("dim") in (0, -1):
        orders.of[op.result] = orders.counts[counted[0]]
        return [OFFSETS], [-1], None
    if not any(s in _ORDERED for s in ins):
        return None

    def unproven(why: str):
        return [UNKNOWN] * n, [-1] * n, _coupling(op, UNPROVEN, why)

    sorts = {orders.of[r] for r, s in zip(refs, ins) if s in _ORDERED}
    if len(sorts) != 1:
        return unproven("it combines values put in the orders of different sorts of the batch's rows")
    p = sorts.pop()
    state = dict(zip(refs, ins))
    bound = bound_args(op) or {}

    def is_(x, kind: str, step: int | None = None) -> bool:
        ok = isinstance(x, Ref) and state.get(x.name) == kind and orders.of.get(x.name) == p
        return ok and (step is None or orders.step.get(x.name) == step)

    def batch_rows(x, per: int) -> bool:  # batch rows on dim 0, ``per`` of the sort's elements each
        return (
            isinstance(x, Ref)
            and state.get(x.name) == ROWS
            and dims[x.name] == 0
            and (types[x.name].shape[0] * per == orders.length[p])
        )

    t, a = op.target, op.args
    if t == "aten.floor_divide" and len(a) == 2 and is_(a[0], PERM) and isinstance(a[1], int) and a[1] > 0:
        orders.of[op.result], orders.step[op.result] = p, orders.step[a[0].name] * a[1]
        return [PERM], [-1], None
    if t in ("aten.argsort", "aten.argsort.stable") and is_(a[0], PERM, 1):  # the inverse permutation
        orders.of[op.result] = p
        return [INVERSE], [-1], None
    if t == "aten.index.Tensor" and len(bound.get("indices", ())) == 1:
        src, (index,) = a[0], bound["indices"]
        if is_(index, PERM) and batch_rows(src, orders.step[index.name]):  # the tokens gathered in sorted order
            orders.of[op.result] = p
            return [SORTED], [-1], None
        if is_(index, INVERSE) and is_(src, SORTED):  # sorted rows put back in the batch's order
            return [ROWS], [0], None
    if t == "aten.index_select" and bound.get("dim") == 0 and is_(bound.get("index"), INVERSE):
        if is_(bound.get("self"), SORTED):
            return [ROWS], [0], None
    if t == "aten.index_put" and len(bound.get("indices", ())) == 1 and is_(bound["indices"][0], PERM, 1):
        dst, values = bound.get("self"), bound.get("values")
        whole = (
            isinstance(dst, Ref) and state.get(dst.name) == DATA and types[dst.name].shape[:1] == (orders.length[p],)
        )  # every row of a data-free tensor overwritten (the permutation is one)
        if whole and not bound.get("accumulate", False):
            if isinstance(values, Ref) and values.name in aranges and types[values.name].shape == (orders.length[p],):
                orders.of[op.result] = p
                return [INVERSE], [-1], None  # inv[perm] = arange(n)
            if is_(values, SORTED):
                return [ROWS], [0], None  # out[perm] = sorted rows: the batch's order again
    if t == "aten.index_add" and bound.get("dim") == 0 and is_(bound.get("index"), PERM):
        dst = bound.get("self")
        per = orders.step[bound["index"].name]
        fits = (
            isinstance(dst, Ref)
            and state.get(dst.name) == DATA
            and types[dst.name].shape[0] * per == (orders.length[p])
        )
        if fits and is_(bound.get("source"), SORTED):
            return [ROWS], [0], None  # each token's slots summed back into its row
    if t == "aten.histc" and isinstance(a[0], Ref) and a[0].name in orders.keys:
        low, high = bound.get("min", 0), bound.get("max", 0)
        if low < high:  # fixed bins: the counts are a sum over the batch, and split the sorted rows in groups
            orders.counts[op.result] = p
            return [SUM], [-1], None
        return unproven("a histogram over the data's own range: its bins depend on the batch")
    if t in _GROUPED_MM:
        x, weight = a[0], a[1]
        offs = a[2] if len(a) > 2 else op.kwargs.get("offs")
        plain_weight = isinstance(weight, Ref) and state.get(weight.name, DATA) == DATA
        if is_(x, SORTED) and plain_weight and is_(offs, OFFSETS):
            orders.of[op.result] = p  # each sorted row times its own group's expert: a row-wise product
            return [SORTED], [-1], None
        return unproven("a grouped matmul whose rows or offsets are not the sort's")
    if any(s in (PERM, INVERSE, OFFSETS) for s in ins) or ROWS in ins:
        return unproven("it uses a sort of the batch's rows other than to gather the rows and put them back")
    # row-wise ops of sorted values (and data-free ones): read as the batch rows on dim 0
    as_rows = [ROWS if s == SORTED else s for s in ins]
    got, got_dims, coupling = _with_rows(op, refs, as_rows, types, dims | dict.fromkeys(refs, 0), aranges)
    if coupling is not None or got[0] in (MEAN, SUM):
        return got, got_dims, coupling  # a reduction over the sorted rows is one over the batch's: order-free
    if all(s == ROWS and d == 0 for s, d in zip(got, got_dims)):
        for r in op.results:
            orders.of[r] = p
            if t in _CASTS and refs[0] in orders.keys:
                orders.keys.add(r)
        return [SORTED] * n, [-1] * n, None
    return unproven("a row-wise reading of the sorted rows does not keep them on dim 0")


def _coupling(op: Op, kind: str, why: str) -> Coupling:
    return Coupling(op.result, op.target, op.path, kind, why)


def _whole(t: TensorType, d: int) -> TensorType:
    if d < 0:
        return replace(t, placements=(R,))
    shape = list(t.shape)
    shape[d] *= _VIRTUAL
    return replace(t, shape=tuple(shape), placements=(R,))


def _propagate(op: Op, in_types: list[TensorType], got: list[int | None]) -> tuple[str, list[int]] | None:
    """``(ROWS, result dims)`` for an op that keeps the batch rows apart, ``(MEAN | SUM, [])`` for one that
    reduces over them, ``None`` for one no strategy of its rule computes with the rows split (it mixes them).
    ``got``: each input's batch dim, ``None`` for a data-free input: the same for every sample, it may be
    placed any way (a microbatch's program computes its own slice of it, captured at the microbatch's shape)."""
    rule = RULES.get(op.target)
    if rule is None:
        return None
    ins = [_whole(t, -1 if d is None else d) for t, d in zip(in_types, got)]
    want = tuple(None if d is None else Shard(d) for d in got)
    reduced: str | None = None
    for d in [-1, *range(len(op.types[0].shape))]:
        outs = [_whole(t, d) if d < len(t.shape) else t for t in op.types]
        try:
            strategies = rule(Ctx(op, ins, outs, _VIRTUAL, (1,)))
        except (IndexError, ValueError, ZeroDivisionError, TypeError):  # a batch dim the op's shapes refute
            continue
        for s_in, s_out in strategies:
            if not all(a is None or b is None or a == b for a, b in zip(s_in, want)):
                continue
            first = s_out[0]
            if d >= 0 and first == Shard(d):
                if all(isinstance(p, Shard) for p in s_out):
                    return ROWS, [p.dim for p in s_out]
            if d < 0 and isinstance(first, Partial) and reduced is None:
                reduced = MEAN if first.op == "avg" else SUM
    if reduced is not None:
        return reduced, [-1] * len(op.results)
    return None


def _loss_divisor(program: Program) -> str | None:
    """The division that makes the loss (the first output, through copies) a ratio, when it is one: the
    runtime weighs each piece by its divisor when that is computed from the data alone."""
    if not program.outputs or not isinstance(program.outputs[0], Ref):
        return None
    producers = program.producers()
    op = producers.get(program.outputs[0].name)
    while isinstance(op, Op) and (op.target in _IDENTITY or op.target in VIEW_OPS | {"aten.clone", "aten._to_copy"}):
        refs = op.input_refs()
        if len(refs) != 1:
            return None
        op = producers.get(refs[0].name)
    if not isinstance(op, Op) or op.target not in _DIVISION or len(op.args) < 2 or not isinstance(op.args[1], Ref):
        return None
    return op.result if _from_inputs(program, op.args[1].name, producers) else None


def _from_inputs(program: Program, name: str, producers: dict) -> bool:
    """Whether ``name`` is computed from user inputs alone (no parameter, buffer or transfer reaches it)."""
    stack, seen = [name], set()
    while stack:
        x = producers[stack.pop()]
        if not isinstance(x, Op):
            if x.kind != "input":
                return False
            continue
        if x.target in ("send", "recv"):
            return False
        if x.result not in seen:
            seen.add(x.result)
            stack.extend(r.name for r in x.input_refs())
    return True


def _origins(program: Program, analysis: Analysis) -> dict[str, set[str]]:
    """Value -> the couplings (by result) its value depends on."""
    found = {c.result for c in analysis.couplings}
    origin: dict[str, set[str]] = {}
    sent: dict[str, str] = {}
    for op in program.ops:
        refs = [r.name for r in op.input_refs()]
        if op.target == "send":
            sent[op.result] = refs[0]
        if op.target == "recv":
            refs = [s] if (s := sent.get(_sent_name(op.result))) is not None else []
        got: set[str] = set()
        for r in refs:
            got |= origin.get(r, set())
        if op.result in found:
            got = got | {op.result}
        for r in op.results:
            origin[r] = got
    return origin


# -- exact under microbatching: the batch tail ----------------------------------------------------------------


@dataclass(frozen=True)
class Tail:
    """How a coupled loss is made exact over the microbatches of a step: a gradient-free batch statistic each
    coupling op reads (``operands``: the MoE load-balancing loss's per-expert token fractions, from top-k
    indices, in its product with the mean router probabilities; the count of targets a loss divides by
    before it adds another term) is taken once over the whole step, as the mean of the microbatches' values
    (equal shares of the batch), and fed back into every microbatch's program in its place (``inputs``).
    ``f_step * P_m`` averaged over the microbatches is ``f * P`` of the batch, ``x_m / mean(d)`` averaged is
    ``sum(x) / sum(d)``; the rest is affine in means over the batch (the analysis checks the rewritten
    program), so the microbatches' mean loss is the batch's, and so is its gradient (the statistics carry
    none). ``ops``: the coupling ops it makes exact."""

    operands: tuple[str, ...]
    inputs: tuple[str, ...]
    ops: tuple[str, ...]
    stages: tuple[int, ...]  # the stages of the coupling ops (a planned program's; () before planning)


def _gradients(program: Program) -> set[str]:
    """The values a gradient can reach: floating values computed from parameters, received values or inputs
    that take one; integer results (top-k indices, one-hot masks) and ``detach`` stop it."""
    types = program.types()
    got = {v.name for v in program.inputs if v.kind == "param" or v.attrs.get("grad")}
    for op in program.ops:
        if op.target in ("aten.detach", "aten.alias_detach") or op.target in _SHAPE_ONLY:
            continue
        if op.target == "recv" or any(r.name in got for r in op.input_refs()):
            got |= {r for r in op.results if types[r].torch_dtype.is_floating_point}
    return got


def batch_tail(program: Program) -> Tail | None:
    """The ``Tail`` that makes every certain coupling of ``program`` exact, or ``None`` where none does (a
    coupling that is no product of batch statistics, or whose statistics all carry gradients: CLIP's logits,
    batch norm)."""
    found = [c for c in batch_couplings(program) if c.certain]
    if not found:
        return None
    states, grads, producers = analyze(program).states, _gradients(program), program.producers()
    operands: list[str] = []
    for c in found:
        op = producers[c.result]
        if not isinstance(op, Op):
            return None
        if c.kind == BATCH_DIVISOR:  # x / d, both sums or both means: x_m / mean_m(d_m), averaged, is X / D
            x, d = op.args[0], op.args[1]
            same = isinstance(x, Ref) and states.get(x.name) == states[d.name]
            if not same or d.name in grads:
                return None
            free = [d.name]
        elif c.kind == "nonlinear in batch statistics":  # a product of means, one of them gradient-free
            live = [r.name for r in op.input_refs() if states.get(r.name) not in (DATA, None)]
            if op.target not in ("aten.mul.Tensor", "aten.mul") or any(states[r] != MEAN for r in live):
                return None
            free = [r for r in live if r not in grads][:1]
            if not free:
                return None
        else:
            return None
        operands += [r for r in free if r not in operands]
    tail = Tail(
        tuple(operands),
        tuple(f"{r}.step" for r in operands),
        tuple(c.result for c in found),
        tuple(sorted({producers[c.result].attrs["stage"] for c in found if "stage" in producers[c.result].attrs})),
    )
    if any(c.certain for c in batch_couplings(tail_program(program, tail))):
        return None
    return tail


def tail_program(program: Program, tail: Tail) -> Program:
    """``program`` with the tail's statistics read from its inputs at the coupling ops (only there) and
    appended to its outputs (each microbatch's own value, which the step's is the mean of). The ops and
    statistics not in ``program`` (another stage's) are left out."""
    here = {op.result for op in program.ops} | {v.name for v in program.inputs}
    pairs = {a: b for a, b in zip(tail.operands, tail.inputs) if a in here}
    types = program.types()
    ops = []
    for op in program.ops:
        if op.result in tail.ops:
            op = replace(op, args=tuple(Ref(pairs[a.name]) if isinstance(a, Ref) and a.name in pairs else a
                                        for a in op.args))  # fmt: skip
        ops.append(op)
    users = {a: next(op for op in program.ops if op.result in tail.ops and Ref(a) in op.args) for a in pairs}
    # a count (an integer sum) averaged over the microbatches is no integer: in the dtype the op computes in
    typed = {a: types[a] if types[a].is_float else replace(types[a], dtype=users[a].types[0].dtype) for a in pairs}
    inputs = tuple(Value(b, "input", typed[a], {TAIL_INPUT: True}) for a, b in pairs.items())
    return replace(
        program, inputs=program.inputs + inputs, ops=tuple(ops), outputs=program.outputs + tuple(Ref(a) for a in pairs)
    )


def microbatching_refusal(
    program: Program, pieces: int, weighed: bool = False, tail: bool = False, schedule: str = ""
) -> str | None:
    """The message refusing to run ``program`` as ``pieces`` microbatches, naming every coupling; ``None``
    when it runs exactly so (one piece, or no coupling). Only certain couplings refuse: an op the analysis
    cannot read (``UNPROVEN``: an op with no sharding rule whose meaning is not read here, or a sort of the
    batch's rows used otherwise than a grouped-GEMM kernel does) is reported by ``autopar check``, not
    refused, so a model that microbatches exactly is not stopped for what the analysis does not know; a
    coupling computed only from such an op's results is not seen (documented in docs/architecture.md).
    ``weighed``: the caller said how the pieces weigh (a
    ``loss_weight`` of its own), which decides a division by a count over the batch, so that is no refusal.
    ``tail``: the step can run a ``Tail`` (every forward of its stage before the first backward: GPipe), so a
    coupling it makes exact is no refusal either; ``schedule``: the schedule's name, for the message."""
    if pieces <= 1:
        return None
    if tail and _tail_on_last_stage(program):
        return None
    found = [c for c in batch_couplings(program) if c.certain and not (weighed and c.kind == BATCH_DIVISOR)]
    if not found:
        return None
    ops = "; ".join(c.describe() for c in found)
    return (
        f"the step runs as {pieces} microbatches, but the model couples its batch, so each microbatch would "
        f"compute a different model than the whole batch does: {ops}. Train with one microbatch per step "
        "(microbatches=1), put the parallelism on a data-parallel axis instead of pp (data parallelism keeps "
        "batch-level values over the whole batch), say how the pieces weigh with loss_weight= (which settles a "
        "division by a count over the batch, not the other couplings), or accept the per-microbatch semantics with "
        "microbatch_semantics='per_microbatch' (what Megatron's and torch's pipelines do silently)"
        + (_tail_hint(program, schedule) if not tail else "")
    )


def _tail_on_last_stage(program: Program) -> bool:
    """Whether a ``Tail`` makes ``program``'s couplings exact, its ops on the last stage (the executor's)."""
    found = batch_tail(program)
    last = program.attrs.get("pipeline_stages", 1) - 1
    return found is not None and all(s == last for s in found.stages)


def _tail_hint(program: Program, schedule: str) -> str:
    if not _tail_on_last_stage(program):
        return ""
    return (
        f". The load-balancing statistics could be taken over the whole step (exact), but only on a schedule that "
        f"runs every forward of their stage before its first backward (gpipe), not on {schedule or 'this one'}"
    )


__all__ = [
    "TAIL_INPUT",
    "TAIL_SCHEDULES",
    "Analysis",
    "Coupling",
    "Tail",
    "analyze",
    "batch_couplings",
    "batch_tail",
    "microbatching_refusal",
    "tail_program",
]
