"""Expert parallelism in the whole-plan search (``autopar plan MODEL --global-batch B``): ``Candidate.ep``.

A mixture of experts' profile knows its experts (``UnitCost.params_ep``, ``experts``, ``routed``); the search
offers the ep degrees dividing dp and the experts (none for a dense model), prices each (the expert tables
divided over ep, each expert op's all-to-alls at the busiest rank's rows, the dense gradients all-reduced over
ep too) and prints the layout it chose.
"""

from __future__ import annotations

import dataclasses

import pytest

from autopar.ir.core import MeshSpec
from autopar.search import profile_model, search
from autopar.search.price import Analytic
from autopar.search.space import Candidate, SearchSpace, families
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.experts import busiest_rows

# tiny Mixtral (2 layers, hidden 1024, 8 experts of width 4096, top-2): its experts are most of its memory
MOE = (
    "mixtral-8x22b:num_hidden_layers=2,hidden_size=1024,intermediate_size=4096,num_attention_heads=8,"
    "num_key_value_heads=2,num_local_experts=8,vocab_size=1024,seq=256,batch=1"
)
CLUSTER = "dgx-a100"  # 8 GPUs in one node


@pytest.fixture(scope="module")
def moe():
    return profile_model(MOE)


def test_only_a_mixture_of_experts_gets_expert_degrees(moe) -> None:
    """The MoE profile counts its 8 experts and their tables; its dp=8 meshes come with ep 1, 2, 4 and 8 (each
    dividing dp and the experts); a dense model (tiny GPT-2) has no experts and no family with ep > 1."""
    assert moe.experts == 8
    layers = [u for u in moe.units if u.kind == "layer"]
    assert all(u.params_ep == 8 * 3 * 1024 * 4096 and len(u.routed) == 2 for u in layers)
    an = Analytic(moe, ClusterSpec.load(CLUSTER), 16)
    eps = {f.ep for f in families(an, SearchSpace(devices_per_node=8), 8) if f.dp == 8}
    assert eps == {1, 2, 4, 8}
    dense = profile_model("tiny-gpt2")
    an = Analytic(dense, ClusterSpec.load(CLUSTER), 16)
    assert dense.experts == 0 and {f.ep for f in families(an, SearchSpace(devices_per_node=8), 8)} == {1}


def test_expert_parallel_price(moe) -> None:
    """dp=8 on one node, ZeRO-0, micro-batch 2: with ep=2 a rank holds half the expert tables, its memory lower by
    exactly half of them at the candidate's bytes per parameter; each stage's forward grows by the all-to-alls of
    every expert op (its rows there at K and back at N: ``collective_seconds('all_to_all')`` of the busiest rank's
    rows under uniform routing, ``busiest_rows``) plus the busiest rank's extra expert FLOPs, and its backward by
    twice that; a skewed router (imbalance 1.5) costs more."""
    cluster = ClusterSpec.load(CLUSTER)
    an = Analytic(moe, cluster, 16)
    plain = Candidate(1, 8, 1, 2, 1, "none")
    ep2 = dataclasses.replace(plain, ep=2)
    a, b = an.evaluate(plain), an.evaluate(ep2)
    experts = sum(u.params_ep for u in moe.units)
    assert a.memory - b.memory == pytest.approx(experts / 2 * an.bytes_per_param(plain), rel=1e-9)
    intra, k = an.comm.intra(2), an.comm.per_node(2, 1)
    added = 0.0
    for u in moe.units:
        for rows, width, calls in u.routed:
            busiest = busiest_rows(round(rows * 2 * 2), 2)
            nbytes = busiest * width * an.act_scale * 2 / calls
            added += calls * cluster.collective_seconds("all_to_all", nbytes, 2, intra, k)
        if u.routed:
            rows = u.routed[0][0] * 2
            added += (busiest_rows(round(rows * 2), 2) / rows - 1) * an.flop_seconds(u.expert_flops * 2)
    assert added > 0
    assert b.tf[0] - a.tf[0] == pytest.approx(added, rel=1e-9)
    assert b.tb[0] - a.tb[0] == pytest.approx(2 * added, rel=1e-9)
    skewed = Analytic(moe, cluster, 16, router_imbalance=1.5).evaluate(ep2)
    assert skewed.tf[0] > b.tf[0] and skewed.memory == b.memory
    # a capacity factor caps the busiest rank's rows at its times the mean (busiest_rows): 1.0 drops the skew and
    # the noise, 4.0 none of it
    capped = Analytic(moe, cluster, 16, router_imbalance=1.5, capacity_factor=1.0).evaluate(ep2)
    roomy = Analytic(moe, cluster, 16, router_imbalance=1.5, capacity_factor=4.0).evaluate(ep2)
    assert capped.tf[0] < b.tf[0] and roomy.tf == skewed.tf
    at_mean = 0.0
    for u in moe.units:
        for rows, width, calls in u.routed:
            nbytes = rows * 2 * width * an.act_scale * 2 / calls  # the mean rows: nothing beyond them computed
            at_mean += calls * cluster.collective_seconds("all_to_all", nbytes, 2, intra, k)
    assert capped.tf[0] - a.tf[0] == pytest.approx(at_mean, rel=1e-9)


def test_search_prices_the_router_and_the_capacity(moe) -> None:
    """``search``'s ``router_imbalance`` and ``capacity_factor`` reach its prices: the same expert-parallel plan
    (pinned by the space) is priced as ``Analytic`` prices it with them: slower under a skewed router, faster than
    dropless under a capacity of 1.0 below the skew."""
    cluster = ClusterSpec.load(CLUSTER)
    space = SearchSpace(pp=(1,), tp=(1,), zero=(0,), ep=(2,), micro_batch=(2,))
    steps = {}
    for ri, cf in ((1.0, None), (1.5, None), (1.5, 1.0)):
        found = search(
            moe, cluster, 16, budget_bytes=float("inf"), space=space, router_imbalance=ri, capacity_factor=cf
        )
        best = found.best[0]
        assert best.candidate.ep == 2
        want = Analytic(moe, cluster, 16, router_imbalance=ri, capacity_factor=cf).evaluate(best.candidate)
        assert best.tf == pytest.approx(want.tf, rel=1e-12) and best.tb == pytest.approx(want.tb, rel=1e-12)
        steps[ri, cf] = best.step_time
    assert steps[1.5, None] > steps[1.0, None] > steps[1.5, 1.0]


def test_search_chooses_expert_parallelism_when_only_it_fits(moe) -> None:
    """Without a pipeline, tensor parallelism or ZeRO (pp=1, tp=1, ZeRO-0 on dp=8), a budget below data
    parallelism's memory and above ep=2's: the search's plan is expert-parallel, the fastest of those that fit."""
    an = Analytic(moe, ClusterSpec.load(CLUSTER), 16)
    plain, ep2 = Candidate(1, 8, 1, 1, 2, "none"), Candidate(1, 8, 1, 1, 2, "none", ep=2)
    budget = (an.evaluate(plain).memory + an.evaluate(ep2).memory) / 2
    space = SearchSpace(pp=(1,), tp=(1,), zero=(0,))
    result = search(moe, ClusterSpec.load(CLUSTER), 16, budget_bytes=budget, space=space, top=3, spec=MOE)
    assert result.best[0].candidate.ep >= 2 and all(ev.candidate.ep > 1 for ev in result.best)
    assert f"ep{result.best[0].candidate.ep}" in result.format(1)


def test_cli_prints_the_expert_parallel_layout_it_chose(capsys) -> None:
    """``autopar plan MOE --cluster dgx-a100 --global-batch 16 --budget-gb 0.5``: the search's best plan (the whole
    space: pipelines, tensor parallelism, ZeRO and MiCS beside it) splits the experts over ep=2, and the table it
    prints says so in its first row."""
    from autopar.cli import main

    assert main(["plan", MOE, "--cluster", CLUSTER, "--global-batch", "16", "--budget-gb", "0.5", "--top", "2"]) == 0
    out = capsys.readouterr().out
    first = next(line for line in out.splitlines() if line.strip().startswith("1 "))
    assert " ep2 " in first, out


def test_family_bounds_hold_for_expert_parallel_candidates(moe) -> None:
    """The branch and bound stays exact with ep: for every family of the MoE on 8 GPUs (ep 1 to 8), each of its
    candidates' step-time lower bound and memory are at least the family's bounds."""
    from autopar.search.space import chains, max_shard, sync_options

    cluster = ClusterSpec.load(CLUSTER)
    an = Analytic(moe, cluster, 16)
    space = SearchSpace(devices_per_node=8, chunks=(2,), waves=(1,))
    checked = 0
    for f in families(an, space, 8):
        if f.ep == 1 and f.dp > 1:
            continue
        time_bound, memory_bound = an.family_bounds(
            f.pp, f.dp, f.tp, f.micro_batch, f.microbatches, max_shard(space, f),
            sync_options(space, f, an.zero0_dominated), ep=f.ep,
        )  # fmt: skip
        for ch in chains(an, space, f):
            for z in ch.zeros:
                for level in range(len(ch.levels)):
                    ev = an.evaluate(ch.candidate(z, level))
                    if ev is not None:
                        assert ev.lower_bound >= time_bound * (1 - 1e-9), (ch.candidate(z, level), time_bound)
                        assert ev.memory >= memory_bound * (1 - 1e-9), (ch.candidate(z, level), memory_bound)
                        checked += ev.candidate.ep > 1
    assert checked > 50


def test_family_floor_holds_for_expert_parallel_candidates(moe) -> None:
    """The chains' family bound (bubble, forced recomputation, per-rank sync; issue 35) with ep: every family of the
    MoE on 8 GPUs (ep 1 to 8), never above a member that fits, at a roomy and a tight budget."""
    from tests.test_search_bound import check_family_floor

    an = Analytic(moe, ClusterSpec.load(CLUSTER), 16)
    space = SearchSpace(devices_per_node=8, chunks=(2,), waves=(1,))
    assert {f.ep for f in families(an, space, 8)} >= {1, 2, 4, 8}
    checked, rose = check_family_floor(an, space, 8, [float("inf"), 0.5 * 2**30])
    assert checked > 50, checked


def _cli_json(capsys, *flags: str) -> dict:
    import json

    from autopar.cli import main

    assert main(["plan", MOE, "--cluster", CLUSTER, "--global-batch", "16", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_search_prices_the_router_imbalance(capsys) -> None:
    """``autopar plan MOE --global-batch 16 --router-imbalance F`` (the flag ``--mesh`` takes too): the search's
    40 best plans at F = 1 and F = 2 (budget 0.5 GiB, where ep plans are among the best); every expert-parallel
    candidate listed in both is slower under the skewed router and every other one priced the same; the best
    plan at F = 1 is expert parallel, at F = 2 it is not (the skew costs ep2 more than tensor parallelism's
    all-reduces). ``--capacity-factor 1`` caps the skew at the mean: the ep candidates price below dropless F = 2."""
    budget = ("--budget-gb", "0.5", "--top", "40")
    runs = {f: _cli_json(capsys, *budget, "--router-imbalance", f) for f in ("1", "2")}
    runs["cap"] = _cli_json(capsys, *budget, "--router-imbalance", "2", "--capacity-factor", "1")
    assert [(r["router_imbalance"], r["capacity_factor"]) for r in runs.values()] == [(1, None), (2, None), (2, 1)]
    steps = {k: {row["configuration"]: row for row in r["best"]} for k, r in runs.items()}
    both = steps["1"].keys() & steps["2"].keys()
    ep = [c for c in both if steps["1"][c]["candidate"]["ep"] > 1]
    assert ep and len(both) > len(ep), sorted(both)
    for c in both:
        a, b = steps["1"][c]["step_seconds"], steps["2"][c]["step_seconds"]
        assert b > a if c in ep else b == a, c
    assert runs["1"]["best"][0]["candidate"]["ep"] > 1 and runs["2"]["best"][0]["candidate"]["ep"] == 1
    capped = [c for c in steps["cap"].keys() & steps["2"].keys() if steps["2"][c]["candidate"]["ep"] > 1]
    assert capped and all(steps["cap"][c]["step_seconds"] < steps["2"][c]["step_seconds"] for c in capped)


def test_router_flags_reach_the_ilp_and_the_search_alike(moe, monkeypatch, capsys) -> None:
    """``--router-imbalance 1.7 --capacity-factor 1.25``: with ``--mesh`` they are the TrainConfig's fields, so the
    sharding ILP's cost model prices with them (``shard_options().setup``); without, the search prices with the same
    values and the plan it materializes is solved with them (``materialize.shard_options``), so ``-o`` writes the
    plan the search priced. A value below 1 is refused by name."""
    from autopar.cli import build_parser
    from autopar.cli import plan as plan_cli
    from autopar.errors import ConfigError
    from autopar.search import cli as search_cli
    from autopar.search.materialize import shard_options

    flags = ["--router-imbalance", "1.7", "--capacity-factor", "1.25"]
    args = build_parser().parse_args(["plan", MOE, "--mesh", "dp=2,ep=2", *flags])
    setup = plan_cli.plan_config(args).shard_options().setup
    assert (setup.router_imbalance, setup.capacity_factor) == (1.7, 1.25)
    seen = {}

    def fake_search(spec, cluster, batch, budget, space, **kw):
        seen.update(kw)
        return search(moe, cluster, batch, budget, SearchSpace(pp=(1,), tp=(1,), ep=(2,)), spec=spec, **kw)

    monkeypatch.setattr(search_cli, "search_model", fake_search)
    args = build_parser().parse_args(["plan", MOE, "--cluster", CLUSTER, "--global-batch", "16", *flags])
    assert plan_cli.run(args) == 0
    assert (seen["router_imbalance"], seen["capacity_factor"]) == (1.7, 1.25)
    assert "router imbalance 1.7, capacity factor 1.25" in capsys.readouterr().out
    found = fake_search(MOE, ClusterSpec.load(CLUSTER), 16, None, None, **seen)
    ev = found.best[0]
    want = Analytic(moe, found.cluster, 16, router_imbalance=1.7, capacity_factor=1.25).evaluate(ev.candidate)
    assert ev.candidate.ep == 2 and ev.tf == pytest.approx(want.tf, rel=1e-12)
    opts = shard_options(found, ev, MeshSpec(tuple(ev.candidate.mesh().items())), 60.0, "cbc")
    assert (opts.setup.router_imbalance, opts.setup.capacity_factor, opts.capacity_factor) == (1.7, 1.25, 1.25)
    with pytest.raises(ConfigError, match="router_imbalance"):
        plan_cli.plan_config(build_parser().parse_args(["plan", MOE, "--router-imbalance", "0.5"]))
