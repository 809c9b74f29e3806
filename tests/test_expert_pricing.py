"""The price of expert parallelism (``solver/sharding/experts.py``): what a grouped matmul's all-to-alls move,
measured on the runtime's own split sizes; a skewed router's price; the free ILP choosing the expert split.

The runtime's ``expert_grouped_mm`` (``runtime/comm/all_to_all.py``) runs here on every rank of a mesh in turn
with its all-to-all replaced by a recorder, so its split sizes are the ones a run would use, for routings drawn
at random (uniform, and skewed towards the first rank's experts).
"""

from __future__ import annotations

import itertools
import math
import types

import pytest
import torch

from autopar.config import TrainConfig
from autopar.errors import ConfigError, SolverError
from autopar.ir.core import MeshSpec, Op, R, Ref, Shard, TensorType
from autopar.models.small_families import _MOE_CONFIGS, FAMILIES, _lm
from autopar.passes.capture import capture
from autopar.passes.describe import describe_plan
from autopar.passes.lower import lower
from autopar.passes.shard import ShardOptions, shard
from autopar.runtime.comm import all_to_all as a2a
from autopar.solver.sharding.cost import CostModel, TrainingSetup
from autopar.solver.sharding.experts import EXPERT_GROUPED_MM, busiest_rows, expert_rows, grouped_price
from autopar.solver.sharding.roles import expert_parallel_constraints
from tests.exactness import float64_model

EXPERT_TABLES = ("experts.gate_up_proj", "experts.down_proj")


class _Splits:
    """Stands in for ``_AllToAll``: records each call's split sizes (what this rank receives from each source)
    and returns rows of the size the call would."""

    calls: list = []

    @staticmethod
    def apply(x, c, axis, out_splits, in_splits):
        _Splits.calls.append(list(out_splits))
        return x.new_zeros(sum(out_splits), *x.shape[1:])


def _most_received(monkeypatch, names, sizes, row_axes, experts, local, probs, trials) -> float:
    """The mean over ``trials`` routings (each of the mesh's rows to an expert drawn from ``probs``) of the most
    rows one rank receives from the other ranks of ``ep`` in ``expert_grouped_mm``'s dispatch."""
    monkeypatch.setattr(a2a, "_AllToAll", _Splits)
    gen = torch.Generator().manual_seed(0)
    n = sizes[names.index("ep")]
    blocks = 1
    for a in row_axes:
        blocks *= sizes[names.index(a)]
    total = 0.0
    for _ in range(trials):
        ids = torch.multinomial(probs, local * blocks, replacement=True, generator=gen)
        offs = torch.cumsum(torch.bincount(ids, minlength=experts), 0).to(torch.int32)
        most = 0
        for coords in itertools.product(*(range(s) for s in sizes)):
            comm = types.SimpleNamespace(sizes=dict(zip(names, sizes)), coords=dict(zip(names, coords)))
            monkeypatch.setattr(a2a, "current_comm", lambda comm=comm: comm)
            _Splits.calls.clear()
            x, w = torch.zeros(local, 1), torch.zeros(experts // n, 1, 1)
            a2a.expert_grouped_mm(x, w, offs, kernel=lambda x, w, o: x, axis="ep", experts=experts, rows=row_axes)
            recv = _Splits.calls[0]
            most = max(most, sum(recv) - recv[comm.coords["ep"]])
        total += most
    return total / trials


@pytest.mark.parametrize(
    ("names", "sizes", "row_axes"),
    [(("ep",), (2,), ("ep",)), (("ep",), (4,), ("ep",)), (("ep",), (8,), ("ep",)),
     (("dp", "ep"), (2, 2), ("dp", "ep")), (("ep", "dp"), (2, 2), ("ep", "dp"))],
)  # fmt: skip
@pytest.mark.parametrize("skew", [1.0, 1.5])
def test_sorted_blocks_cross_what_the_price_says(monkeypatch, names, sizes, row_axes, skew) -> None:
    """The rows a grouped matmul's busiest rank receives from other ranks (the runtime's split sizes, mean of the
    busiest over random routings of 1,024 rows a rank, the first rank's experts ``skew`` times as likely) are
    what ``expert_rows`` prices, within 0.75-1.75 of it: with ep the outer rows axis each rank's block of the
    sorted rows is its own experts' and only the imbalance crosses, a small fraction of what the gather's rule
    (every row from a random rank) would charge; with dp outer one rank of each group takes its group's rows."""
    n = sizes[names.index("ep")]
    experts, local = 2 * n, 1024
    probs = torch.ones(experts)
    probs[:2] *= skew  # the first ep rank's two experts
    probs /= probs.sum()
    imbalance = float(probs[:2].sum()) * n  # its share over the mean share
    measured = _most_received(monkeypatch, names, sizes, row_axes, experts, local, probs, trials=10)
    placements = tuple(Shard(0) if a in row_axes else R for a in names)
    priced = expert_rows(local, placements, sizes, names.index("ep"), imbalance)[1]
    assert 0.75 * measured <= priced <= 1.75 * measured, (measured, priced)
    if row_axes[0] == "ep" and skew == 1.0:  # aligned blocks: only the noise of the counts crosses
        assert measured < 0.1 * busiest_rows(local * n, n) * (n - 1) / n, measured


def _grouped_op(rows: int = 64, k: int = 16, n_out: int = 32, experts: int = 4):
    x = TensorType("f32", (rows, k))
    w = TensorType("f32", (experts, k, n_out))
    offs = TensorType("i32", (experts,))
    op = Op(
        ("y",),
        (TensorType("f32", (rows, n_out)),),
        "transformers.grouped_mm_fallback",
        (Ref("x"), Ref("w"), Ref("offs")),
        flops=2 * rows * k * n_out,
    )
    return op, {"x": x, "w": w, "offs": offs}


def test_skew_raises_the_price_as_the_formula_says() -> None:
    """``TrainingSetup.router_imbalance`` f: an expert-parallel grouped matmul on ep=4 pays for its busiest rank's
    f times the mean rows plus the sampling noise (``busiest_rows``), less its own block: its all-to-alls' bytes
    grow by exactly 2 (f2 - f1) x mean rows x (K + N) x itemsize per device, the seconds by those bytes over the
    link (plus nothing: the latencies do not depend on f), and its computation by the busiest rank's rows over
    the mean; f below 1 is refused by name."""
    mesh = MeshSpec((("ep", 4),))
    op, ts = _grouped_op()
    placements = [(Shard(0),), (Shard(0),), (R,)]
    ins = [ts["x"], ts["w"], ts["offs"]]
    mean_rows, width, itemsize = 64 / 4, 16 + 32, 4
    prices, computes = {}, {}
    for f in (1.0, 1.5, 2.0):
        cost = CostModel(mesh, TrainingSetup(router_imbalance=f))
        prices[f] = cost.inherent(op.target, ins, placements)
        computes[f] = cost.op_seconds(op, ts, [True], placements)
        plain = cost.op_seconds(op, ts, [True])
        load = busiest_rows(64, 4, f) / mean_rows
        assert computes[f] == pytest.approx(plain * load, rel=1e-12)
    per_link = CostModel(mesh).cluster.collective_terms("all_to_all", 4, True)[0] * 4 / 3
    for f1, f2 in ((1.0, 1.5), (1.5, 2.0)):
        grown = 2 * (f2 - f1) * mean_rows * width * itemsize
        assert prices[f2][0] - prices[f1][0] == pytest.approx(grown, rel=1e-12)
        assert prices[f2][1] - prices[f1][1] == pytest.approx(grown * per_link, rel=1e-12)
        assert computes[f2] > computes[f1]
    assert grouped_price(ins, placements, mesh, lambda a: (0.0, 0.0), 1.0)[0] == prices[1.0][0]
    with pytest.raises(SolverError, match="router_imbalance"):
        TrainingSetup(router_imbalance=0.5)
    # settable where a user plans: TrainConfig's field reaches the cost model, and is refused below 1 by name
    assert TrainConfig(router_imbalance=1.5).training_setup().router_imbalance == 1.5
    with pytest.raises(ConfigError, match="router_imbalance"):
        TrainConfig(router_imbalance=0.9)


def _tiny(family: str, kernel: str):
    config, cls, cfg = _MOE_CONFIGS[family]
    cfg = dict(cfg, num_experts_per_tok=2, router_aux_loss_coef=0.0, num_hidden_layers=1)
    torch.manual_seed(0)
    model, kwargs = _lm(config, cls, **cfg, experts_implementation=kernel)(torch.Generator().manual_seed(1))
    return float64_model(model), kwargs


def test_free_ilp_splits_the_grouped_experts_over_ep() -> None:
    """DeepSeek-V3 (tiny: MLA, a shared expert, grouped top-2 routing over 4 experts; transformers' default
    grouped_mm kernel) planned on ep=2 under the memory objective with nothing constrained: the ILP splits both
    expert tables on their experts over ``ep`` (before the grouped all-to-alls were priced by the rows that cross
    the links it split the experts' widths instead), a plan the ILP prices below the best with the experts' widths
    split."""
    model, kwargs = _tiny("deepseek_v3", "grouped_mm")
    mesh = MeshSpec((("ep", 2),))
    lowered = lower(capture(model, (), kwargs), mesh)
    free = shard(lowered, ShardOptions(objective="memory"))
    tables = [v for v in free.program.params if v.name.endswith(EXPERT_TABLES)]
    assert len(tables) == 2 and all(t.type.placements == (Shard(0),) for t in tables), [str(t.type) for t in tables]
    width = {t.name: (lambda p: isinstance(p[0], Shard) and p[0].dim > 0) for t in tables}
    wide = shard(lowered, ShardOptions(objective="memory", constrain=width))
    assert free.solution.objective < wide.solution.objective, (free.solution.objective, wide.solution.objective)


@pytest.mark.parametrize("kernel", ["grouped_mm", "batched_mm"])
def test_roles_by_name_put_the_expert_tables_on_ep(kernel: str) -> None:
    """With roles by name (``TrainConfig``'s default) an ``ep`` axis is expert parallel: OLMoE's two expert tables
    (read by grouped matmuls, or by the batched_mm kernel's gathers) are constrained to their experts split over
    ``ep``, and the plan holds them so; a dense model (LLaMA) gets no such constraint."""
    model, kwargs = _tiny("olmoe", kernel)
    lowered = lower(capture(model, (), kwargs), MeshSpec((("ep", 2),)))
    found = expert_parallel_constraints(lowered)
    assert sorted(n.rsplit(".", 1)[-1] for n in found) == ["down_proj", "gate_up_proj"], found
    assert all(c.want == (Shard(0),) for c in found.values())
    planned = shard(lowered, ShardOptions(objective="memory", roles="name"))
    tables = [v for v in planned.program.params if v.name.endswith(EXPERT_TABLES)]
    assert len(tables) == 2 and all(t.type.placements[0] == Shard(0) for t in tables), [str(t.type) for t in tables]
    # the plan's summary says so (passes/describe.py), the dense layers apart: no "tensor parallel (Megatron)" on ep
    text = describe_plan(planned.program)
    experts = (
        "ep=2: expert parallel: 2 expert tables split on their experts (2 of 4 a rank), tokens sent to their "
        "experts' ranks and back by all-to-all at 2 expert ops; dense layers "
    )
    assert experts in text and "Megatron" not in text, text
    dense_params = [v for v in planned.program.params if not v.name.endswith(EXPERT_TABLES)]
    n = sum(isinstance(v.type.placements[0], Shard) for v in dense_params)
    assert f"{n} of {len(dense_params)} dense parameters sharded" in text if n else "dense layers data parallel" in text
    dense, dense_kwargs = FAMILIES["llama"](torch.Generator().manual_seed(1))
    captured = capture(dense, (), dense_kwargs)
    assert expert_parallel_constraints(lower(captured, MeshSpec((("ep", 2),)))) == {}
    if kernel == "grouped_mm":  # a dense model's tp axis keeps Megatron's name
        tp = shard(lower(captured, MeshSpec((("tp", 2),))), ShardOptions(roles="name"))
        assert "tp=2: tensor parallel (Megatron): column/row on " in describe_plan(tp.program)


def test_capacity_caps_the_busiest_rank_as_the_formula_says() -> None:
    """A capacity factor c (GShard's, Switch's: each expert keeps c times its mean rows, the rest dropped before
    the dispatch) caps the busiest expert rank's rows at c times the mean: ``busiest_rows`` is
    ``min(imbalance mu + sigma sqrt(2 ln n), c mu, N)``, so under a router skewed past c the price is c's. A grouped
    matmul on ep=4 (each rank's block its own experts', only the busiest rank's rows beyond its block cross) moves
    2 x (c mu - mu) x (K + N) x itemsize per device and computes c times the mean rows; a capacity above the skew
    changes nothing. The shard pass's options carry the factor to the cost model (``ShardOptions.capacity_factor``
    sets ``setup.capacity_factor``), and a non-positive one is refused by name."""
    rows, n = 64, 4
    mean = rows / n
    noise = math.sqrt(rows * (1 / n) * (1 - 1 / n)) * math.sqrt(2 * math.log(n))
    for f, c in ((1.0, None), (2.0, None), (2.0, 1.25), (2.0, 0.5), (1.0, 4.0), (1.5, 1.5)):
        want = min(rows, f * mean + noise, rows if c is None else c * mean)
        assert busiest_rows(rows, n, f, c) == pytest.approx(want, rel=1e-12), (f, c)
    mesh = MeshSpec((("ep", n),))
    op, ts = _grouped_op(rows)
    placements = [(Shard(0),), (Shard(0),), (R,)]
    ins = [ts["x"], ts["w"], ts["offs"]]
    width, itemsize = 16 + 32, 4
    skewed = CostModel(mesh, TrainingSetup(router_imbalance=2.0))
    plain = skewed.op_seconds(op, ts, [True])
    for c in (1.25, 1.0):
        capped = CostModel(mesh, ShardOptions(setup=TrainingSetup(router_imbalance=2.0), capacity_factor=c).setup)
        vol, _ = capped.inherent(op.target, ins, placements, op)
        assert vol == pytest.approx(2 * (c * mean - mean) * width * itemsize, rel=1e-12)
        assert capped.op_seconds(op, ts, [True], placements) == pytest.approx(plain * c, rel=1e-12)
        assert vol < skewed.inherent(op.target, ins, placements, op)[0]
    roomy = CostModel(mesh, TrainingSetup(router_imbalance=1.5, capacity_factor=2.0))
    assert roomy.inherent(op.target, ins, placements, op) == CostModel(
        mesh, TrainingSetup(router_imbalance=1.5)
    ).inherent(op.target, ins, placements, op)
    assert TrainConfig(capacity_factor=1.25).shard_options().setup.capacity_factor == 1.25
    assert ShardOptions(capacity_factor=None, setup=TrainingSetup(capacity_factor=2.0)).setup.capacity_factor is None
    with pytest.raises(SolverError, match="capacity_factor"):
        TrainingSetup(capacity_factor=0.0)


@pytest.mark.heavy  # a capture and three solves, 24 s under load
def test_the_ilp_prices_the_capacity() -> None:
    """OLMoE (tiny, grouped_mm) planned on ep=2 with roles by name (memory objective: the rows split over ep, sent to
    their experts' ranks) under a router skewed to 1.8 times the mean: a capacity factor of 1.0 drops the rows over
    it, and the plan's predicted all-to-all bytes and seconds and the experts' computation are lower for it (the
    same layout: the tables split over ep, the rows dispatched, either way); a factor above the skew prices as
    dropless (tests/test_search_experts.py: the search's price)."""
    model, kwargs = _tiny("olmoe", "grouped_mm")
    lowered = lower(capture(model, (), kwargs), MeshSpec((("ep", 2),)))
    skew = TrainingSetup(router_imbalance=1.8)
    plans = {
        c: shard(lowered, ShardOptions(objective="memory", roles="name", setup=skew, capacity_factor=c))
        for c in (None, 1.0, 4.0)
    }
    tables = {
        c: [v.type.placements for v in p.program.params if v.name.endswith(EXPERT_TABLES)] for c, p in plans.items()
    }
    assert all(t == [(Shard(0),), (Shard(0),)] for t in tables.values()), tables
    grouped = [op.result for op in lowered.ops if op.target in EXPERT_GROUPED_MM]
    assert len(grouped) == 2 and all(p.chosen[g].inputs[0] == (Shard(0),) for p in plans.values() for g in grouped)
    assert plans[1.0].comm_bytes < plans[None].comm_bytes and plans[1.0].comm_seconds < plans[None].comm_seconds
    assert plans[1.0].compute_seconds < plans[None].compute_seconds
    assert plans[4.0].comm_bytes == plans[None].comm_bytes
    assert plans[4.0].step_seconds == pytest.approx(plans[None].step_seconds, rel=1e-12)
    assert all(op.attrs.get("capacity") for op in plans[1.0].program.ops if "grouped_mm" in op.target)
