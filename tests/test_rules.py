"""Every sharding rule (solver/sharding/rules/), checked on simulated ranks against the unsharded op.

For each op target with a rule, hypothesis draws shapes and arguments (``CASES``) and a mesh of one,
two or three axes; every strategy the rule offers on that mesh (on meshes with more than
``SAMPLE`` strategies, a drawn sample; every one-axis candidate appears on the 1-D meshes) is run
forward and backward on the simulated ranks in float64 and compared with the whole op
(``autopar.check.rules``). ``test_checker_catches_broken_rule`` shows the check failing on rules
broken on purpose. Cost: about 20-40 s for the file on a loaded 2-core machine.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers.integrations.moe  # noqa: F401 (registers transformers::grouped_mm_fallback)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.check.float64 import Float64Mode
from autopar.check.rules import check_strategy, one_op_program, strategies_of
from autopar.ir.core import MeshSpec, Partial, Shard
from autopar.solver.sharding.rules.elementwise import POINTWISE
from autopar.solver.sharding.strategies import RULES

F64 = torch.float64
MESHES = [
    MeshSpec((("a", 2),)),
    MeshSpec((("a", 3),)),
    MeshSpec((("a", 4),)),
    MeshSpec((("a", 2), ("b", 2))),
    MeshSpec((("a", 2), ("b", 3))),
    MeshSpec((("a", 2), ("b", 2), ("c", 2))),
]
SAMPLE = 10
SIZES = st.sampled_from([1, 2, 3, 4, 6, 8, 12])


def _f(shape, lo: float = 0.5, hi: float = 2.0) -> torch.Tensor:
    """Float64 values in [lo, hi): positive, so log, sqrt, pow and reciprocal are defined."""
    return torch.rand(shape, dtype=F64) * (hi - lo) + lo


def _shape(draw, rank_lo: int = 1, rank_hi: int = 3) -> list[int]:
    return draw(st.lists(SIZES, min_size=rank_lo, max_size=rank_hi))


def _bcast(draw, shape: list[int]) -> list[int]:
    """A shape that broadcasts to ``shape``: a suffix with some dims set to 1."""
    k = draw(st.integers(0, len(shape)))
    return [1 if draw(st.booleans()) else s for s in shape[len(shape) - k :]]


def _mask(shape) -> torch.Tensor:
    return torch.rand(shape) > 0.5


UNARY = [
    "aten.neg", "aten.exp", "aten.log", "aten.tanh", "aten.sigmoid", "aten.silu", "aten.gelu", "aten.relu",
    "aten.sqrt", "aten.rsqrt", "aten.abs", "aten.sin", "aten.cos", "aten.erf", "aten.reciprocal", "aten.alias",
    "aten.contiguous", "aten.clone", "aten.detach", "aten.lift_fresh_copy", "aten.zeros_like", "aten.ones_like",
    "aten.empty_like", "aten.square",
]  # fmt: skip
BINARY = [
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.pow.Tensor_Tensor",
    "aten.minimum", "aten.maximum", "aten.min.other", "aten.max.other", "aten.eq.Tensor", "aten.ne.Tensor",
    "aten.lt.Tensor", "aten.le.Tensor", "aten.gt.Tensor", "aten.ge.Tensor",
]  # fmt: skip
SCALAR = [
    "aten.add.Scalar", "aten.sub.Scalar", "aten.mul.Scalar", "aten.div.Scalar", "aten.rsub.Scalar",
    "aten.pow.Tensor_Scalar", "aten.eq.Scalar", "aten.ne.Scalar", "aten.lt.Scalar", "aten.le.Scalar",
    "aten.gt.Scalar", "aten.ge.Scalar", "aten.clamp_min", "aten.clamp_max",
]  # fmt: skip
BOOL_BINARY = ["aten.__and__.Tensor", "aten.__or__.Tensor", "aten.logical_and", "aten.logical_or"]
BOOL_UNARY = ["aten.logical_not", "aten.bitwise_not"]


def _case(target: str, draw) -> tuple[tuple, dict]:  # noqa: C901 (one branch per op family)
    """Arguments for one call of ``target`` with drawn shapes."""
    if target in UNARY:
        return (_f(_shape(draw)),), {}
    if target in BINARY:
        s = _shape(draw)
        b = _bcast(draw, s)
        return ((_f(s), _f(b)) if draw(st.booleans()) else (_f(b), _f(s))), {}
    if target in SCALAR:
        return (_f(_shape(draw)), draw(st.sampled_from([0.5, 1.0, 2.0]))), {}
    if target in BOOL_BINARY:
        s = _shape(draw)
        return (_mask(s), _mask(_bcast(draw, s))), {}
    if target in BOOL_UNARY:
        return (_mask(_shape(draw)),), {}
    s = _shape(draw)
    x = _f(s)
    rank = len(s)
    d = draw(st.integers(0, rank - 1))
    simple = {
        "aten.clamp": ((x, 0.8, 1.5), {}),
        "aten.full_like": ((x, 2.5), {}),
        "aten.dropout": ((x, 0.0, True), {}),
        "aten.to.dtype": ((x, F64), {}),
        "aten.to.dtype_layout": ((x,), {"dtype": F64}),
        "aten._to_copy": ((x,), {"dtype": F64}),
        "aten.type_as": ((x, _f(s)), {}),
        "aten.masked_fill.Scalar": ((x, _mask(_bcast(draw, s)), -1.5), {}),
        "aten.masked_fill.Tensor": ((x, _mask(_bcast(draw, s)), torch.tensor(-1.5, dtype=F64)), {}),
        "aten.where.self": ((_mask(_bcast(draw, s)), x, _f(_bcast(draw, s))), {}),
        "aten.where.ScalarOther": ((_mask(_bcast(draw, s)), x, 0.25), {}),
        "aten.where.ScalarSelf": ((_mask(_bcast(draw, s)), 0.25, x), {}),
        "aten.broadcast_tensors": (([x, _f(_bcast(draw, s))],), {}),
        "aten.transpose.int": ((x, d, draw(st.integers(-rank, rank - 1))), {}),
        "aten.permute": ((x, draw(st.permutations(list(range(rank))))), {}),
        "aten.unsqueeze": ((x, draw(st.integers(0, rank))), {}),
        "aten.select.int": ((x, d, draw(st.integers(0, s[d] - 1))), {}),
        "aten.cumsum": ((x, d), {}),
        "aten._softmax": ((x, d, False), {}),
        "aten._log_softmax": ((x, d, False), {}),
        "aten.softmax.int": ((x, d), {}),
        "aten.log_softmax.int": ((x, d), {}),
        "aten.sum": ((x,), {}),
        "aten.mean": ((x,), {}),
        # no autograd formula for aten.copy: functionalized writes of non-float values (T5's shifted labels)
        "aten.copy": ((torch.randint(0, 9, s), torch.randint(0, 9, _bcast(draw, s))), {}),
        "aten.fill.Scalar": ((x, 1.5), {}),
        "aten.fill.Tensor": ((x, torch.tensor(-1.5, dtype=F64)), {}),
        "aten.mse_loss": ((x, _f(s), draw(st.sampled_from([0, 1, 2]))), {}),
        "aten.arange": ((s[0],), {"dtype": F64, "device": torch.device("cpu")}),
        "aten.arange.start": ((1, s[0] + 1), {"dtype": F64, "device": torch.device("cpu")}),
        "aten.arange.start_step": ((0, 2 * s[0], 2), {"dtype": F64, "device": torch.device("cpu")}),
        "aten.full": ((s, 1.5), {"dtype": F64, "device": torch.device("cpu")}),
        "aten.zeros": ((s,), {"dtype": F64, "device": torch.device("cpu")}),
        "aten.ones": ((s,), {"dtype": F64, "device": torch.device("cpu")}),
        "aten.empty.memory_format": ((s,), {"dtype": F64, "device": torch.device("cpu")}),
        "aten.scalar_tensor": ((2.5,), {"dtype": F64, "device": torch.device("cpu")}),
        "aten.new_ones": ((x, s), {}),
        "aten.new_zeros": ((x, s), {}),
        "aten.new_full": ((x, s, 1.5), {}),
        "aten.new_empty": ((x, s), {}),
    }
    if target in simple:
        return simple[target]
    if target in ("aten.tril", "aten.triu"):
        return (_f(_shape(draw, 2, 3)), draw(st.integers(-1, 1))), {}
    if target == "aten.t":
        return (_f(_shape(draw, 2, 2)),), {}
    if target in ("aten.view", "aten.reshape", "aten._unsafe_view"):
        return (x, _regroup(draw, s)), {}
    if target == "aten.flatten.using_ints":
        lo = draw(st.integers(0, rank - 1))
        return (x, lo, draw(st.integers(lo, rank - 1))), {}
    if target in ("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze"):
        s1 = list(s)
        s1.insert(d, 1)
        arg = {"aten.squeeze.dim": (d,), "aten.squeeze.dims": ([d],), "aten.squeeze": ()}[target]
        return (_f(s1), *arg), {}
    if target == "aten.expand":
        small = [1 if draw(st.booleans()) else v for v in s]
        lead = draw(st.lists(SIZES, max_size=1))
        return (_f(small), lead + s), {}
    if target == "aten.slice_scatter":  # src fills base[lo:hi:step] along d
        lo = draw(st.integers(0, s[d] - 1))
        hi, step = draw(st.integers(lo + 1, s[d])), draw(st.integers(1, 2))
        src = list(s)
        src[d] = len(range(lo, hi, step))
        return (x, _f(src), d, lo, hi, step), {}
    if target in ("aten.gather", "aten.scatter.value", "aten.scatter.src"):  # index rows along d (DeepSeek's router)
        idx_shape = list(s)
        idx_shape[d] = draw(st.integers(1, s[d]))
        if target != "aten.gather" and idx_shape[d] > 1:  # scatter: distinct positions per row (no write races)
            idx = torch.stack(
                [torch.randperm(s[d])[: idx_shape[d]] for _ in range(torch.Size(idx_shape).numel() // idx_shape[d])]
            )
            idx = idx.reshape([*idx_shape[:d], *idx_shape[d + 1 :], idx_shape[d]]).movedim(-1, d).contiguous()
        else:
            idx = torch.randint(0, s[d], idx_shape)
        if target == "aten.gather":
            return (x, d, idx), {}
        return ((x, d, idx, 1.5) if target == "aten.scatter.value" else (x, d, idx, _f(idx_shape))), {}
    if target == "aten.select_scatter":  # src fills base.select(d, i)
        return (x, _f(s[:d] + s[d + 1 :]), d, draw(st.integers(0, s[d] - 1))), {}
    if target == "aten.slice.Tensor":
        lo = draw(st.integers(0, s[d] - 1))
        return (x, d, lo, draw(st.integers(lo + 1, s[d])), draw(st.integers(1, 2))), {}
    if target in ("aten.split.Tensor", "aten.split_with_sizes"):
        pieces = draw(st.sampled_from([k for k in (1, 2, 3, 4) if s[d] % k == 0]))
        if target == "aten.split.Tensor":
            return (x, s[d] // pieces, d), {}
        return (x, [s[d] // pieces] * pieces, d), {}
    if target == "aten.cat":
        if rank > 1 and draw(st.booleans()):  # a 1-D empty tensor, which torch.cat skips (an empty key/value cache)
            return ([_f([0]), x] if draw(st.booleans()) else [x, _f([0])], d), {}
        other = list(s)
        other[d] = draw(SIZES)
        return ([x, _f(other)], d), {}
    if target in ("aten.sum.dim_IntList", "aten.mean.dim"):
        dims = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
        return (x, dims, draw(st.booleans())), {}
    if target == "aten.mm":
        m, k, n = draw(SIZES), draw(SIZES), draw(SIZES)
        return (_f([m, k]), _f([k, n])), {}
    if target == "aten.bmm":
        b, m, k, n = draw(SIZES), draw(SIZES), draw(SIZES), draw(SIZES)
        return (_f([b, m, k]), _f([b, k, n])), {}
    if target == "aten.matmul":
        m, k, n = draw(SIZES), draw(SIZES), draw(SIZES)
        batch = _shape(draw, 0, 2)
        return (_f(batch + [m, k]), _f(_bcast(draw, batch) + [k, n])), {}
    if target == "aten.linear":
        n = draw(SIZES)
        return (x, _f([n, s[-1]])), {}
    if target in ("aten.conv2d", "aten.convolution"):
        return _conv_case(target, draw)
    if target == "aten.embedding":
        v, e = draw(SIZES), draw(SIZES)
        pad = draw(st.sampled_from([-1, 0, v - 1]))  # a padding row's gradient stays zero
        return (_f([v, e]), torch.randint(0, v, _shape(draw, 1, 2)), pad, draw(st.booleans())), {}
    if target == "aten.layer_norm":
        k = draw(st.integers(1, rank))
        norm = s[rank - k :]
        return (x, norm, _f(norm), _f(norm), 1e-5), {}
    if target == "aten.scaled_dot_product_attention":
        b, h, q, kv, e = draw(SIZES), draw(SIZES), draw(SIZES), draw(SIZES), draw(SIZES)
        causal = draw(st.booleans()) and q == kv
        groups = draw(st.sampled_from([g for g in (1, 2, 4) if h % g == 0]))  # grouped-query heads (enable_gqa)
        kw = {"is_causal": causal} | ({"enable_gqa": True} if groups > 1 else {})
        return (_f([b, h, q, e]), _f([b, h // groups, kv, e]), _f([b, h // groups, kv, e])), kw
    if target == "aten.cross_entropy_loss":
        n, c = draw(SIZES), draw(SIZES)
        reduction = draw(st.sampled_from([0, 1, 2]))
        target_ = torch.randint(0, c, (n,))
        if draw(st.booleans()):  # ignored rows (see test_mean_loss_with_ignored_rows)
            target_[torch.rand(n) < 0.4] = -100
        return (_f([n, c], -2.0, 2.0), target_, None, reduction, -100, 0.0), {}
    if target in ("aten._grouped_mm", "transformers.grouped_mm_fallback"):
        return _grouped_mm_case(target, draw)
    if target == "aten.index.Tensor":  # rows of a table (experts: rank 3) by one index tensor
        table = _f([draw(SIZES), *_shape(draw, 1, 2)])
        return (table, [torch.randint(0, table.shape[0], _shape(draw, 1, 2))]), {}
    if target == "aten.topk":
        return (x, draw(st.integers(1, s[d])), d), {}
    if target == "aten.repeat_interleave.self_int":
        return (x, draw(st.integers(1, 3)), d), {}
    if target == "aten.chunk":
        return (x, draw(st.integers(1, 3)), d), {}
    if target in ("aten.pad", "aten.constant_pad_nd"):
        pads = [draw(st.integers(0, 2)) for _ in range(2 * draw(st.integers(1, rank)))]
        return ((x, pads, "constant", 0.5) if target == "aten.pad" else (x, pads, 0.5)), {}
    raise AssertionError(f"no test case for {target}: add one to tests/test_rules.py")


def _grouped_mm_case(target: str, draw) -> tuple[tuple, dict]:
    """x[S, K] by w[E, K, N] with rows grouped by expert: cumulative ends, some experts given no row, and rows
    past the last end (zero in the result)."""
    s, k, n, e = draw(SIZES), draw(SIZES), draw(SIZES), draw(st.integers(1, 4))
    ends = sorted(draw(st.integers(0, s)) for _ in range(e))
    offs = torch.tensor(ends, dtype=torch.int32)
    return (_f([s, k]), _f([e, k, n]), offs), {}


def _regroup(draw, s: list[int]) -> list[int]:
    """A shape with the same elements: adjacent dims merged, or one dim split into two factors."""
    out = list(s)
    if len(out) > 1 and draw(st.booleans()):
        i = draw(st.integers(0, len(out) - 2))
        out[i : i + 2] = [out[i] * out[i + 1]]
    i = draw(st.integers(0, len(out) - 1))
    factors = [f for f in range(2, out[i]) if out[i] % f == 0]
    if factors:
        f = draw(st.sampled_from(factors))
        out[i : i + 1] = [f, out[i] // f]
    return out


def _conv_case(target: str, draw) -> tuple[tuple, dict]:
    n, c, o, h = (
        draw(SIZES),
        draw(st.sampled_from([1, 2, 4])),
        draw(st.sampled_from([2, 4, 6])),
        draw(st.integers(3, 5)),
    )
    groups = draw(st.sampled_from([g for g in (1, 2) if c % g == 0 and o % g == 0]))
    bias = _f([o]) if draw(st.booleans()) else None
    x, w = _f([n, c, h, h]), _f([o, c // groups, 2, 2])
    if target == "aten.conv2d":
        return (x, w, bias, [1, 1], [1, 1], [1, 1], groups), {}
    return (x, w, bias, [1, 1], [1, 1], [1, 1], False, [0, 0], groups), {}


def _float64(target: str) -> contextlib.AbstractContextManager:
    """torch._grouped_mm has no float64 kernel: run it under Float64Mode, which computes it group by group."""
    return Float64Mode() if target == "aten._grouped_mm" else contextlib.nullcontext()


@st.composite
def _example(draw, target: str):
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    mesh = draw(st.sampled_from(MESHES))
    args, kwargs = _case(target, draw)
    with _float64(target):
        prog, whole = one_op_program(target, args, kwargs, mesh)
    found = strategies_of(prog)
    if len(found) > SAMPLE:
        found = [found[i] for i in draw(st.permutations(range(len(found))))[:SAMPLE]]
    return prog, whole, found


def failures(prog, whole, found) -> list[str]:
    out = []
    for s in found:
        out += [f"{s.inputs} -> {s.label()}: {p}" for p in check_strategy(prog, whole, s)]
    return out


@pytest.mark.parametrize("target", sorted(RULES))
def test_rule(target: str) -> None:
    examples = 2 if target in POINTWISE else 5

    @settings(max_examples=examples, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(_example(target))
    def check(example) -> None:
        prog, whole, found = example
        with _float64(target):
            bad = failures(prog, whole, found)
        assert not bad, f"{prog.ops[0]} on mesh {prog.mesh}:\n" + "\n".join(bad[:5])

    check()


def _broken_linear_partials(real):
    """A wrong rule: claims exp is linear (a partial input gives a partial output)."""

    def rule(c):
        out = real(c)
        if c.op.target == "aten.exp":
            out.append(((Partial("sum"),), (Partial("sum"),)))
        return out

    return rule


def _broken_softmax(real):
    """A wrong rule: lets softmax be split along the dim it normalizes."""

    def rule(c):
        dim = c.op.args[1] % len(c.ins[0].shape)
        out = real(c)
        if c.ins[0].shape[dim] % c.n == 0:
            out.append(((Shard(dim),), (Shard(dim),)))
        return out

    return rule


@pytest.mark.parametrize(
    ("target", "broken", "args"),
    [
        ("aten.exp", _broken_linear_partials, lambda: (_f([4, 6]),)),
        ("aten._softmax", _broken_softmax, lambda: (_f([4, 6]), 1, False)),
    ],
)
def test_checker_catches_broken_rule(monkeypatch, target, broken, args) -> None:
    """The check behind test_rule fails on a rule broken on purpose (and passes on the real one)."""
    mesh = MeshSpec((("a", 2),))
    prog, whole = one_op_program(target, args(), {}, mesh)
    assert failures(prog, whole, strategies_of(prog)) == []
    monkeypatch.setitem(RULES, target, broken(RULES[target]))
    bad = failures(prog, whole, strategies_of(prog))
    assert bad and all("differ" in b for b in bad), bad


def test_mean_loss_with_ignored_rows() -> None:
    """A bug this check found: a mean cross-entropy over rows split across ranks used to be offered as
    the partial average of each rank's mean over its own non-ignored rows, which is the whole mean only
    when every rank ignores as many rows. The rule now offers split rows only for a sum (lowering writes
    a mean as sum / count), so every strategy it offers for this op is right."""
    logits = _f([4, 6], -2.0, 2.0)
    target = torch.tensor([1, -100, 2, 3])
    prog, whole = one_op_program(
        "aten.cross_entropy_loss", (logits, target, None, 1, -100, 0.0), {}, MeshSpec((("a", 2),))
    )
    assert failures(prog, whole, strategies_of(prog)) == []


def test_grouped_query_attention_splits_its_key_heads_with_the_query_heads() -> None:
    """A bug a causal capture found (HF passes ``enable_gqa=True`` to SDPA when it has no mask): 4 query heads over
    2 key heads, the query heads split over 2 ranks while the keys were read whole, so each rank's 2 query heads
    read key heads 0 and 1 instead of their group's one. Now the key and value heads split with the query heads
    (in matching blocks) or the head split is not offered (fewer key heads than ranks: 2 heads over 4)."""
    q, kv = _f([2, 4, 6, 8]), _f([2, 2, 6, 8])
    for n, split in ((2, True), (4, False)):
        prog, whole = one_op_program(
            "aten.scaled_dot_product_attention", (q, kv, kv), {"is_causal": True, "enable_gqa": True},
            MeshSpec((("a", n),)),
        )  # fmt: skip
        found = strategies_of(prog)
        assert failures(prog, whole, found) == []
        heads = [s for s in found if s.inputs[0] == (Shard(1),)]
        assert bool(heads) == split and all(s.inputs[1] == (Shard(1),) for s in heads), [s.inputs for s in found]
