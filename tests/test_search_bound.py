"""The search's family bound from its chains (``Analytic.family_floor``, issue 35): the pipeline's bubble, the
recomputation memory forces and each rank's own data-parallel sync, never above a member that fits; the pruned
search finds what scoring every candidate finds."""

from __future__ import annotations

import dataclasses
import random

import pytest

from autopar.search import Scorer, search
from autopar.search.evaluation import order_near_equal
from autopar.search.price import Analytic
from autopar.search.search import smallest_memory
from autopar.search.space import SearchSpace, chains, families, max_shard, sync_options
from autopar.solver.cluster.spec import ClusterSpec
from tests.test_search import gpt_profile

SPACE = SearchSpace(chunks=(2, 4), waves=(1,), devices_per_node=8)


def _members(an: Analytic, space: SearchSpace, f):
    """Every priced candidate of family ``f``: each chain's every ZeRO stage and recomputation level."""
    for ch in chains(an, space, f):
        for c in ch.candidates():
            ev = an.evaluate(c)
            if ev is not None:
                yield ev


def check_family_floor(an: Analytic, space: SearchSpace, world: int, budgets, sample: int | None = None, seed=0):
    """For every family (or ``sample`` of them) and budget: the chains' time bound is at most the lower bound of
    every member that fits the budget, at least the mean-compute-and-sync bound, and the memory bound at most
    every member's memory; the bound without the memory (the search's first step) at most that bound; each chain's
    ZeRO stages' own bounds (``chain_floors``) at least the family's and at most the lower bound of each of their
    members that fits. Returns (members checked, families whose bound rose by forced recomputation or the bubble).
    """
    fams = families(an, space, world)
    if sample is not None and sample < len(fams):
        fams = random.Random(seed).sample(fams, sample)
    checked = rose = 0
    for f in fams:
        members = list(_members(an, space, f))
        priced = {ev.candidate: ev for ev in members}
        fam_chains = list(chains(an, space, f))
        opts = sync_options(space, f, an.zero0_dominated)
        cheap = an.family_bounds(
            f.pp, f.dp, f.tp, f.micro_batch, f.microbatches, max_shard(space, f), opts, f.cp, ep=f.ep
        )[0]
        free = an.family_floor(list(chains(an, space, f)), 0.0, max_shard(space, f), opts, memory=False)[0]
        for budget in budgets:
            t, mem = an.family_floor(list(chains(an, space, f)), budget, max_shard(space, f), opts)
            assert free <= t, (f, budget, free, t)
            fitting = [ev for ev in members if ev.memory <= budget]
            assert bool(fitting) <= (t < float("inf")), (f, budget)
            for ev in members:
                assert ev.memory >= mem * (1 - 1e-9), (ev.candidate.describe(), ev.memory, mem)
            for ev in fitting:
                assert ev.lower_bound >= t * (1 - 1e-9), (ev.candidate.describe(), budget, ev.lower_bound, t)
                checked += 1
            for ch, floors in zip(fam_chains, an.chain_floors(fam_chains, budget, max_shard(space, f), opts)):
                assert min(floors) >= t * (1 - 1e-12)
                floor = dict(zip(ch.zeros, floors))
                for ev in filter(None, map(priced.get, ch.candidates())):
                    if ev.memory <= budget:
                        low = floor[ev.candidate.zero]
                        assert ev.lower_bound >= low * (1 - 1e-9), (ev.candidate.describe(), budget, low)
            rose += fitting != [] and t > cheap * (1 + 1e-6)
    return checked, rose


@pytest.mark.parametrize(
    "cluster, attention",
    [("dgx-a100:nodes=2", "fused"), ("dgx-a100:nodes=2", "unfused"), ("local-cpu:nodes=2,devices_per_node=8", "fused")],
)
def test_family_floor_never_exceeds_a_member_that_fits(cluster, attention):
    """Random families of a 8-layer GPT on 16 devices (NCCL, whose ZeRO-0 buckets overlap the backward, and gloo),
    fused and unfused attention, at budgets from roomy to tight enough to force recomputation."""
    prof = gpt_profile(layers=8)
    an = Analytic(prof, ClusterSpec.load(cluster), 64, attention=attention)
    mems = sorted(ev.memory for f in families(an, SPACE, 16)[:40] for ev in _members(an, SPACE, f))
    budgets = [float("inf"), mems[len(mems) // 2], mems[len(mems) // 8], mems[0] * 1.01]
    checked, rose = check_family_floor(an, SPACE, 16, budgets, sample=40)
    assert checked > 200 and rose > 10, (checked, rose)


def _exhaustive(an: Analytic, space: SearchSpace, world: int, budget: float, top: int, scorer: Scorer):
    """Every candidate of the space that fits (each chain's every ZeRO stage and recomputation level), each scored,
    no bound or dominance pruning: the ``top`` best as the search orders them."""
    fits = [
        ev
        for f in families(an, space, world)
        for ch in chains(an, space, f)
        for c in ch.candidates()
        if (ev := an.evaluate(c)) is not None and ev.memory <= budget
    ]
    return order_near_equal([scorer.score(ev) for ev in fits])[:top]


@pytest.mark.parametrize("frac", [1.1, 1.5])
def test_top_k_is_what_scoring_every_candidate_finds(frac):
    """4-layer GPT on 8 A100s, global batch 16, budgets 10% and 50% over the least any candidate needs:
    ``search(top=K)`` returns exactly the K best of every candidate that fits, for K = 1, 3, 5, 10. The staircase
    it replaced kept per ZeRO stage only the least recomputation that fits and a higher stage only with less
    recomputation: it lost a slower level still among the K best or, within NEAR_EQUAL of a faster one, ahead on
    memory (SCP's recomputation hidden in the bubble), and a higher ZeRO stage that is faster (ZeRO-3's gathers
    beside the backward)."""
    prof, cluster = gpt_profile(layers=4), ClusterSpec.load("dgx-a100")
    space = dataclasses.replace(SPACE, chunks=(2,), devices_per_node=cluster.devices_per_node)
    an = Analytic(prof, cluster, 16)
    budget = smallest_memory(an, space, families(an, space, 8)) * frac
    scorer = Scorer()
    every = _exhaustive(an, space, 8, budget, 10, scorer)
    for k in (1, 3, 5, 10):
        res = search(prof, cluster, 16, budget_bytes=budget, space=space, top=k, scorer=scorer)
        assert [e.candidate for e in res.best] == [e.candidate for e in every[:k]], k
        assert [e.step_time for e in res.best] == pytest.approx([e.step_time for e in every[:k]], rel=1e-12)


@pytest.mark.parametrize("tight", [False, True])
def test_the_pruned_search_finds_what_scoring_everything_finds(tight):
    """4-layer GPT on 8 A100s, global batch 16: the branch and bound with the chains' bound (families pruned and
    over budget before any is priced) returns the same top 3, the same step times, as scoring every candidate of
    the space that fits (and is not dominated); at a budget 10% over the least any candidate needs, recomputation
    is forced."""
    prof, cluster = gpt_profile(layers=4), ClusterSpec.load("dgx-a100")
    space = dataclasses.replace(SPACE, chunks=(2,), devices_per_node=cluster.devices_per_node)
    an = Analytic(prof, cluster, 16)
    budget = smallest_memory(an, space, families(an, space, 8)) * 1.1 if tight else 80 * 2**30
    scorer = Scorer()
    want = _exhaustive(an, space, 8, budget, 3, scorer)
    res = search(prof, cluster, 16, budget_bytes=budget, space=space, top=3, scorer=scorer)
    assert [e.candidate for e in res.best] == [e.candidate for e in want]
    assert [e.step_time for e in res.best] == pytest.approx([e.step_time for e in want], rel=1e-12)
    old = search(prof, cluster, 16, budget_bytes=budget, space=space, top=3, scorer=scorer, bound="sync")
    assert [e.candidate for e in old.best] == [e.candidate for e in want]
    assert res.stats["families_pruned_by_bound"] + res.stats["families_over_budget"] > (
        old.stats["families_pruned_by_bound"] + old.stats["families_over_budget"]
    )
    assert res.stats["priced"] < old.stats["priced"]
    assert res.stats["space"] == old.stats["space"]
    if tight:
        assert any(e.candidate.recompute != "none" for e in want)
    shuffled = search(prof, cluster, 16, budget_bytes=budget, space=space, top=3, scorer=scorer, order="shuffle")
    assert [e.candidate for e in shuffled.best] == [e.candidate for e in want]
