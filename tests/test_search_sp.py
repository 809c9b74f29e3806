"""Megatron's sequence parallelism in the whole-plan search (``Candidate.sp``, ``autopar plan --sequence-parallel``).

Korthikanti et al. 2022 (section 4.2.2): beside tensor parallelism over t ranks, the norms, residuals and dropouts
run on 1/t of the sequence, so a layer keeps s b h (34 / t + 5 a s / (h t)) bytes in place of
s b h (10 + 24 / t + 5 a s / (h t)) (16-bit activations, one-byte dropout masks), and each tensor-parallel
all-reduce becomes a reduce-scatter and an all-gather of the same bytes. The search prices it in its stage terms
(``StageTerms.tp_seconds``, ``stage_acts``, ``rank_act``; ``CommTime.p2p``); a plan priced so is not written
(``materialize.build_plan``: the runtime's sequence-sharded regions are the ILP's own).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from autopar.errors import PlanError, SearchError
from autopar.search import Scorer, profile_model, search
from autopar.search.pin import Pin
from autopar.search.price import Analytic, _held
from autopar.search.profile import Profile, UnitCost
from autopar.search.space import Candidate, SearchSpace, families
from autopar.solver.cluster.spec import ClusterSpec

GPT = "gpt2:n_layer=2,n_embd=64,n_head=4,n_positions=32,vocab_size=128,seq=32"
GiB = 2**30


def korthikanti_layer(s: int, h: int, a: int) -> UnitCost:
    """One GPT layer as Korthikanti et al.'s Table 2 counts it, per sample, in bytes of 16-bit activations: 10 s h
    replicated over tp (the two layer norms' inputs, the QKV and MLP inputs, two dropout masks), 24 s h + 5 a s^2
    split (the attention's and MLP's insides, the scores, their softmax and dropout), 2 s h entering (its input)."""
    mm = 24 * s * h * h + 4 * s * s * h
    return UnitCost("layer", "h.0", mm, mm, mm, 12 * h * h, 13 * h, 24 * s * h + 5 * a * s * s, 10 * s * h, 2 * s * h,
                    4 * s * h, 2, 4 * s * h, 2)  # fmt: skip


def test_sequence_parallel_activations_are_korthikantis_formula():
    s, h, a, b, t = 128, 64, 4, 2, 4
    unit = korthikanti_layer(s, h, a)
    prof = Profile("korthikanti", s, 2, (unit,), 12 * h * h + 13 * h, (a, h))  # itemsize 2: bf16 bytes as counted
    an = Analytic(prof, ClusterSpec.load("dgx-a100"), 8)
    assert an.act_scale == 1.0
    kept, saves = an.stage_acts(0, 1, b, t, 1)
    kept_sp, saves_sp = an.stage_acts(0, 1, b, t, 1, sp=True)
    assert kept == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert kept_sp == pytest.approx(s * b * h * (34 / t + 5 * a * s / (h * t)), rel=1e-12)
    # full recomputation keeps each layer's input: 2 s b h, and with sequence parallelism its 1/t part
    assert kept - saves == pytest.approx(2 * s * b * h, rel=1e-12)
    assert kept_sp - saves_sp == pytest.approx(2 * s * b * h / t, rel=1e-12)
    assert an.rank_act(unit, t, sp=True) * b == pytest.approx(kept_sp, rel=1e-12)
    assert an.stage_acts(0, 1, b, 1, 1, sp=True) == an.stage_acts(0, 1, b, 1, 1)  # nothing to split without tp


def test_sequence_parallel_divides_the_replicated_terms_and_moves_the_same_bytes():
    """On a captured GPT-2: every saved activation 1/tp; the forward's collectives (an all-gather per f, a
    reduce-scatter per g) take what its all-reduces took, the backward's those plus the f inputs gathered again
    (nothing hidden beside a split backward); the pipeline sends 1/tp of the boundary and gathers nothing."""
    prof = profile_model(GPT)
    cluster = ClusterSpec.load("dgx-a100")
    an = Analytic(prof, cluster, 16)
    layer, b, tp = prof.units[1], 2, 4
    assert layer.act_rep > 0
    kept, _ = an.stage_acts(1, 2, b, tp, 1)
    kept_sp, _ = an.stage_acts(1, 2, b, tp, 1, sp=True)
    sa = an.act_scale * b
    assert kept == pytest.approx((layer.act_tp / tp + layer.act_rep) * sa, rel=1e-12)
    assert kept_sp == pytest.approx((layer.act_tp + layer.act_rep) / tp * sa, rel=1e-12)
    # a ring's all-reduce is its reduce-scatter and all-gather: the same bytes and steps
    intra, k = an.comm.intra(tp), an.comm.per_node(tp, 1)
    nb = layer.ar_fwd_bytes / layer.ar_fwd_count * sa
    ar = an.comm.allreduce(nb, 1, tp, intra, k)
    assert an.comm.gather(nb, tp, intra, k) + an.comm.scatter(nb, tp, intra, k) == pytest.approx(ar, rel=1e-12)
    fwd, bwd, rfwd = an.tp_seconds(1, 2, b, tp, split=True)
    fwd_sp, bwd_sp, rfwd_sp = an.tp_seconds(1, 2, b, tp, sp=True, split=True)
    regather = sum(an.comm.gather(g * sa, tp, intra, k) for g, _ in layer.ar_bwd_groups)
    assert fwd > 0 and fwd_sp == pytest.approx(fwd, rel=1e-12) and rfwd_sp == pytest.approx(rfwd, rel=1e-12)
    assert bwd_sp == pytest.approx(bwd + regather, rel=1e-12)
    # beside the backward's matmuls (NCCL, not split) each f's gather and scatter are hidden as far as they run
    assert an.tp_seconds(1, 2, b, tp, sp=True)[1] < bwd_sp
    # the head and the embedding: one f (gathered forward), one g (scattered forward)
    assert an.tp_seconds(0, 4, b, tp, sp=True, split=True)[0] == pytest.approx(an.tp_seconds(0, 4, b, tp)[0], rel=1e-12)
    c = Candidate(2, 1, tp, b, 4, "1f1b", layout="even")
    plain, sp = an.evaluate(c), an.evaluate(dataclasses.replace(c, sp=True))
    boundary = prof.units[2].input_bytes * sa
    assert sp.tc[0] == pytest.approx(cluster.collective_seconds("send", boundary / tp, 1, True), rel=1e-12)
    assert plain.tc[0] == pytest.approx(sp.tc[0] + an.comm.gather(boundary, tp, intra, k), rel=1e-12)
    assert max(sp.rank_memory) < max(plain.rank_memory) and sp.weight_memory == plain.weight_memory
    # the family bound stays below its member's
    bound = an.family_bounds(2, 1, tp, b, 4, 0, cp=1, sp=True)[0]
    assert bound <= sp.lower_bound <= Scorer().score(sp).step_time


def test_the_search_offers_sequence_parallelism_only_beside_tp_and_only_when_asked():
    an = Analytic(profile_model(GPT), ClusterSpec.load("dgx-a100"), 16)
    fams = families(an, SearchSpace(sequence_parallel=(False, True)), 4)
    assert {f.sp for f in fams if f.tp > 1} == {False, True} and not any(f.sp for f in fams if f.tp == 1)
    assert not any(f.sp for f in families(an, SearchSpace(), 4))  # the default: left out (no plan file of it)
    with pytest.raises(SearchError, match="tp > 1"):
        Pin({"pp": 2, "dp": 2}, sequence_parallel=True).check(4, 16)
    # a searched plan priced with it is not written (the runtime would not run it as priced)
    space = SearchSpace(pp=(1,), tp=(4,), micro_batch=(2,), zero=(0,), recompute=("none",), sequence_parallel=(True,))
    result = search(an.p, an.cluster, 16, space=space, spec=GPT)
    assert result.best[0].candidate.sp
    with pytest.raises(PlanError, match="sequence parallelism"):
        result.materialize()


def _llama70b(layers: int = 80) -> Profile:
    """LLaMA-2 70B's profile: a one-layer capture of the ``llama-70b`` preset (its pre and post units, one layer)
    with the layer repeated: every layer of the model is the same."""
    one = profile_model("llama-70b:num_hidden_layers=1")
    pre, layer, post = one.units
    units = (pre, *(dataclasses.replace(layer, label=f"model.layers.{i}") for i in range(layers)), post)
    total = one.total_params + (layers - 1) * (layer.params_tp + layer.params_rep)
    return dataclasses.replace(one, units=units, total_params=total, model="llama-70b")


NEMO = Candidate(4, 64, 4, 1, 32, "interleaved", 20, recompute="none", zero=1, layout="even", sp=True)
NEMO_FLAGS = ["--cluster", "dgx-h100:nodes=128", "--global-batch", "2048", "--mesh", "pp=4,dp=64,tp=4",
              "--microbatch-size", "1", "--chunks", "20", "--recompute", "none", "--layout", "even", "--zero", "1",
              "--sequence-parallel"]  # fmt: skip


def test_nemos_llama2_70b_recipe_pinned_through_plan_mesh_fits_only_with_sequence_parallelism(capsys, monkeypatch):
    """NeMo's Llama-2-70B pre-training recipe (NeMo-Framework-Launcher ``conf/training/llama/llama2_70b.yaml``: 128
    DGX H100 nodes, TP 4, PP 4, VP 20, micro-batch 1, GBS 2048, sequence 4096, no recomputation, sequence parallel,
    the distributed optimizer: ZeRO-1) through ``autopar plan --mesh``: priced as given, it fits the device's budget
    (its memory less the reserve); without sequence parallelism it needs more than an 80 GB H100. The last rank's
    last chunk (the head's logits) stashes one microbatch at a time, not the rank's whole count (``price._held``)."""
    from autopar.cli import main

    prof = _llama70b()
    assert prof.total_params == 68_976_648_192  # LLaMA-2 70B
    monkeypatch.setattr(sys.modules["autopar.search.search"], "profile_model", lambda spec: prof)
    assert main(["plan", "llama-70b", *NEMO_FLAGS, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["best"][0]["candidate"] == NEMO.to_dict()
    assert report["pinned"]["fits"]
    cluster = ClusterSpec.load("dgx-h100:nodes=128")
    an = Analytic(prof, cluster, 2048)
    sp, plain = an.evaluate(NEMO), an.evaluate(dataclasses.replace(NEMO, sp=False))
    assert report["pinned"]["memory_bytes"] == pytest.approx(sp.memory, rel=1e-12) and sp.memory <= cluster.plan_memory
    assert plain.memory > 80 * GiB and sp.weight_memory == plain.weight_memory
    kept = sp.info["act_kept"]
    assert _held(NEMO, NEMO.inflight_counts(), kept, sp.stage_rank)[3] < 77 * max(kept[s] for s in range(3, 80, 4))


def test_a_sequence_parallel_pin_round_trips_through_plan_mesh_and_is_not_written(capsys, tmp_path):
    """``--sequence-parallel`` beside ``--mesh``: the candidate comes back with ``sp`` at the step and memory the price
    model gives it directly; ``-o`` is refused before searching, naming why."""
    from autopar.cli import main

    spec, cluster = "gpt2:n_layer=8,n_embd=64,n_head=4,n_positions=64,vocab_size=256,seq=64,batch=1", "dgx-a100:nodes=2"
    pins = ["plan", spec, "--cluster", cluster, "--global-batch", "16", "--mesh", "pp=2,dp=2,tp=4", "--microbatch-size",
            "2", "--chunks", "2", "--recompute", "none", "--layout", "even", "--zero", "1"]  # fmt: skip
    assert main([*pins, "--sequence-parallel", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["best"][0]
    want = Candidate(2, 2, 4, 2, 4, "interleaved", 2, recompute="none", zero=1, layout="even", sp=True)
    assert best["candidate"] == want.to_dict()
    an = Analytic(profile_model(spec), ClusterSpec.load(cluster), 16)
    direct = Scorer().score(an.evaluate(want))
    assert best["step_seconds"] == pytest.approx(direct.step_time, rel=1e-12)
    assert best["peak_memory_bytes"] == pytest.approx(direct.memory, rel=1e-12)
    assert main([*pins, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["best"][0]["peak_memory_bytes"] > direct.memory
    assert main([*pins, "--sequence-parallel", "-o", str(tmp_path / "plan.json")]) == 2
    assert "sequence parallelism" in capsys.readouterr().err and not (tmp_path / "plan.json").exists()
    assert main(["plan", spec, "--mesh", "tp=4", "--sequence-parallel"]) == 2  # priced only with --global-batch
    assert "--global-batch" in capsys.readouterr().err


@pytest.mark.parametrize("pp, chunks", [(2, 3), (4, 2), (4, 20), (8, 2)])
def test_interleaved_chunk_peaks_stop_growing_from_four_pp_microbatches(pp, chunks):
    """``price._stage_peaks`` reads each chunk's most stashed microbatches off the compute orders at min(m, 4 pp):
    the whole schedule's at m, below 4 pp and past it (no more with more m); and past it a rank's count at its peak
    never exceeds the sum of its chunks' peaks (``price._held``'s bound is sound)."""
    from autopar.schedule.actions import stage_stash_points
    from autopar.schedule.generators import inflight_per_rank, make_schedule
    from autopar.search.price import _stage_peaks

    for m in (pp + 1, 6 * pp + 1):  # below 4 pp: its own orders; past it: _stage_peaks reads 4 pp
        lists = make_schedule("interleaved", pp, m, chunks=chunks).actions
        peaks = tuple(tuple(max(p[i][0] for p in pts) for i in range(chunks)) for pts in map(stage_stash_points, lists))
        assert peaks == _stage_peaks(pp, m, chunks)
        counts = inflight_per_rank("interleaved", pp, m, chunks)
        assert m < 4 * pp or all(n <= sum(p) for n, p in zip(counts, peaks))
