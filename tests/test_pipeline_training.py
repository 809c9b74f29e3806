"""Pipeline (3D-parallel) training equals single-process training, for every schedule; the stage IR.

Multi-process tests run several models, schedules and meshes per spawned process group (spawning is
the expensive part): pp=2 on 2 ranks; pp=2 x dp=2 and pp=2 x tp=2 on 4 (with and without Merak's
sub-pipelined tensor parallelism); pp=2 x dp=2 x tp=2 (also sub-pipelined) and MiCS on 8. The
zero-bubble schedules (ZB-H1, ZB-H2, ZB-V, DualPipeV: B and W apart) run inside the same spawns: each
on pp=2 (GPT-2 and LLaMA) and pp=2 x dp=2, with recomputation, ZeRO-2, ZeRO-3, tensor parallelism
(ILP-sharded and sub-pipelined; Megatron's layout with scatter/gather). Each run
trains 3 SGD steps in float64 on 4 microbatches and is compared with one single-process run of the
same model and batches (tests/equivalence.py, tests/exactness.py): per-step losses and every
parameter within 1e-10 relative.
"""

from __future__ import annotations

import os
from fractions import Fraction

import pytest
import torch

from autopar.errors import PipelineError, VerifyError
from autopar.ir.core import MeshSpec, Shard
from autopar.ir.parser import parse
from autopar.ir.printer import print_program
from autopar.ir.verify import verify
from autopar.models.resolve import build
from autopar.passes.assign_stages import assign_stages
from autopar.passes.capture import capture
from autopar.passes.lower import lower
from autopar.passes.prune import prune_outputs
from autopar.passes.shard import ShardOptions
from autopar.passes.stage_program import recompute_cut, split_for_recompute, stage_program
from autopar.passes.transfers import insert_transfers
from autopar.runtime.build.codegen import codegen
from autopar.runtime.build.init_weights import canonical_names, init_value, materialize
from autopar.runtime.call.batch import split_batch
from autopar.runtime.execute.stage_runner import Part
from autopar.runtime.measure.trace import TraceEvent, measured_result, on_one_clock
from autopar.schedule.action_costs import Costs
from autopar.schedule.actions import COMPUTE_KINDS
from autopar.schedule.generators import make_schedule
from autopar.schedule.simulator import simulate
from tests._dist import run_distributed
from tests.equivalence import compare_jobs
from tests.exactness import TOL

ALL = [
    ("gpipe", {}),
    ("1f1b", {}),
    ("interleaved", {"chunks": 2}),
    ("wave", {"waves": 1}),
    ("scp", {"alpha1": Fraction(1, 2)}),
]
# Merak's sub-pipelined tp: 2 microbatches of 4 (the batch of 8), each run as two halves of 2, the
# microbatch shape of the other runs (one capture and one plan serve both)
SUB = {"microbatches": 2, "sub_pipeline_tp": True}
# SCP's partial recomputation runs the recompute head and rest interleaved too
# The least-memory plan shards every stage over tp (the fastest plan of a model this small may replicate
# it), so the tensor-parallel collectives inside stages, and sub-pipelining them, are exercised.
SHARDED = ShardOptions(objective="memory")
SUB_RUNS = [("1f1b", {}, SUB), ("interleaved", {"chunks": 2}, SUB), ("scp", {"alpha1": Fraction(1, 2)}, SUB)]
# zero bubble: each backward split into B (input gradients) and W (weight gradients, runtime/execute/split_backward.py)
ZB = [("zb-h1", {}), ("zb-h2", {}), ("zbv", {}), ("dualpipev", {})]


def _check(results, where: str, tp_sharded: bool = False, zero: tuple[str, ...] = ()) -> None:
    largest: dict[str, tuple[float, float, float]] = {}
    for rank, res in enumerate(results):
        for job, out in res.items():
            if "F" in out:
                continue  # not a comparison (sub-pipeline events)
            for key, r in out.items():
                at = f"{where} {job} {key}, rank {rank}"
                loss_rel, param_rel, fwd_rel = r["loss_rel"].item(), r["param_rel"].item(), r["forward_rel"].item()
                assert fwd_rel < TOL, f"{at}: forward's output differs by {fwd_rel:.2e} relative"
                assert loss_rel < TOL, f"{at}: losses differ by {loss_rel:.2e} relative"
                # the whole model on every rank: every key of the model's state dict, no other
                assert not r["missing"], f"{at}: full_state_dict's keys differ from the model's: {r['missing']}"
                assert param_rel < TOL, f"{at}: {r['worst_param']} differs by {param_rel:.2e} relative"
                old = largest.get(job, (0.0, 0.0, 0.0))
                largest[job] = (max(old[0], loss_rel), max(old[1], param_rel), max(old[2], fwd_rel))
                # activations are freed when their backward is done: the stash peaks where the simulator says
                assert r["peak_stash"] == r["sim_peak_stash"], at
                assert torch.equal(r["measured_computes"], r["sim_computes"]), at
                assert r["measured_bubble"] >= 0, at
                if tp_sharded:
                    assert r["local_numel"] < r["full_numel"], at
                if job in zero:  # ZeRO-2 / MiCS: the optimizer holds a slice of the replicated parameters
                    assert r["optimizer_numel"] < r["local_numel"], at
    print(f"{where}: largest relative differences (loss, state, forward):", largest)


# ---------------------------------------------------------------------------------------------
# Multi-process: the numbers


@pytest.mark.multiproc
def test_pp2_every_schedule_gpt2_llama_bert_and_meta_init_and_dp2_one_stage():
    """Every schedule on pp=2 (forward's outputs, the losses and the whole gathered model equal the
    single process's); a mesh without pp is a one-stage pipeline: train_step on dp=2 with 2
    microbatches (gradient accumulation), also with the stage recomputed. The zero-bubble schedules on
    GPT-2 and LLaMA, one with every stage checkpointed (recomputed before B, kept until W)."""
    runs = [*ALL, ("1f1b", {"recompute": 1}), *ZB, ("zbv", {"recompute": 1})]
    jobs = [
        {"name": "gpt2", "model_name": "gpt2", "axes": {"pp": 2}, "runs": runs},
        {"name": "llama", "model_name": "llama", "axes": {"pp": 2}, "runs": ALL + ZB},
        {"name": "bert", "model_name": "bert", "axes": {"pp": 2}, "runs": ALL},
        # built on the meta device, initialized shard by shard; the reference is materialize()d
        {"name": "gpt2-meta", "model_name": "gpt2", "axes": {"pp": 2}, "runs": [("1f1b", {})], "meta": True},
        {
            "name": "gpt2-dp2-one-stage",
            "model_name": "gpt2",
            "axes": {"dp": 2},
            "runs": [("1f1b", {}), ("1f1b", {"recompute": 1})],
            "microbatches": 2,
        },
    ]
    _check(run_distributed(compare_jobs, 2, jobs, timeout=600), "pp2 and dp2")


def _check_sub_pipeline_events(results, job: str) -> None:
    """Every rank interleaved its sub-microbatches in both directions: for nearly every collective one
    sub-microbatch issued, the other computed before the wait (the exceptions are collectives issued
    back to back, with no computation between them to overlap)."""
    for rank, res in enumerate(results):
        for phase in "FB":
            ok = res[job][phase]
            assert len(ok) >= 4, f"rank {rank} {phase}: {len(ok)} issued collectives"
            assert ok.float().mean() >= 0.9, f"rank {rank} {phase}: {int(ok.sum())} of {len(ok)} overlapped"


@pytest.mark.multiproc
def test_pp2_dp2_and_pp2_tp2_every_schedule_zero2_zero3_scatter_gather_sub_pipelined_meta_dp2tp2():
    from autopar.solver.sharding.cost import TrainingSetup

    zero2 = {"options": ShardOptions(setup=TrainingSetup(zero=2))}
    zero3 = {"options": ShardOptions(setup=TrainingSetup(zero=3))}
    mics3 = {"options": ShardOptions(setup=TrainingSetup(zero=3, zero_axes=("dpr", "dp"), mics_group=2))}
    sharded = {"options": SHARDED}
    jobs = [
        {  # ZeRO-3 in a pipeline: each F, RECOMPUTE, B and W gathers the stage's units one at a time
            "name": "gpt2-pp2dp2-zero3",
            "model_name": "gpt2",
            "axes": {"pp": 2, "dp": 2},
            "runs": [("1f1b", {}), ("1f1b", {"recompute": 1}), ("zb-h1", {})],  # W reduce-scatters the units
            "compile_kwargs": zero3,
            "make_optimizer": True,
            "steps": 2,
        },
        {  # ZeRO-3 inside MiCS partition groups (dp) replicated over dpr, one stage: the 2-hop gradient sync
            "name": "gpt2-mics3",
            "model_name": "gpt2",
            "axes": {"dpr": 2, "dp": 2},
            "runs": [("1f1b", {})],
            "compile_kwargs": mics3,
            "make_optimizer": True,
            "steps": 2,
        },
        {  # a meta-device model initialized shard by shard on dp x tp (one stage)
            "name": "gpt2-meta-dp2tp2",
            "model_name": "gpt2",
            "axes": {"dp": 2, "tp": 2},
            "runs": [("1f1b", {})],
            "meta": True,
            "microbatches": 2,
            "steps": 2,
        },
        {"name": "gpt2-pp2dp2", "model_name": "gpt2", "axes": {"pp": 2, "dp": 2}, "runs": ALL + ZB},
        {"name": "llama-pp2dp2", "model_name": "llama", "axes": {"pp": 2, "dp": 2}, "runs": ZB},
        {
            "name": "gpt2-pp2dp2-zero2",
            "model_name": "gpt2",
            "axes": {"pp": 2, "dp": 2},
            "runs": [("1f1b", {}), ("wave", {"waves": 1}), ("zbv", {})],
            "compile_kwargs": zero2,
            "make_optimizer": True,
        },
        {
            "name": "gpt2-pp2tp2",
            "model_name": "gpt2",
            "axes": {"pp": 2, "tp": 2},
            "runs": ALL + SUB_RUNS + [("zbv", {}, SUB)],  # each sub-pipelined segment split into B and W
            "compile_kwargs": sharded,
        },
        {
            "name": "llama-pp2tp2-scatter-gather",
            "model_name": "llama",
            "axes": {"pp": 2, "tp": 2},
            "runs": [
                ("1f1b", {}),
                ("interleaved", {"chunks": 2}),
                ("1f1b", {}, SUB),
                ("gpipe", {}, SUB),
                ("zb-h1", {}),
            ],
            "compile_kwargs": {"scatter_gather": True},
            "megatron": True,  # Megatron's layout keeps the boundary replicated over tp: 1/t goes on the wire
        },
        {  # the issue/compute/wait order of one sub-pipelined step, Megatron's f/g layout
            "name": "llama-sub-events",
            "kind": "events",
            "model_name": "llama",
            "axes": {"pp": 2, "tp": 2},
            "megatron": True,
        },
    ]
    results = run_distributed(compare_jobs, 4, jobs, timeout=900)
    _check(results, "4 ranks", zero=("gpt2-pp2dp2-zero2",))
    # ZeRO-3: a rank keeps its dp slice of its stage's parameters (about a quarter of the model)
    for res in results:
        r = res["gpt2-pp2dp2-zero3"]["1f1b"]
        assert r["local_numel"] < 0.3 * r["full_numel"], (r["local_numel"], r["full_numel"])
    _check_sub_pipeline_events(results, "llama-sub-events")


@pytest.mark.multiproc
def test_pp2_dp2_tp2_and_mics():
    from autopar.solver.sharding.cost import TrainingSetup

    mics = ShardOptions(setup=TrainingSetup(zero=2, zero_axes=("dpr", "dp"), mics_group=2))
    jobs = [
        {
            "name": "gpt2-pp2dp2tp2",
            "model_name": "gpt2",
            "axes": {"pp": 2, "dp": 2, "tp": 2},
            "runs": [("1f1b", {}), ("interleaved", {"chunks": 2}), ("1f1b", {}, SUB)],
            "compile_kwargs": {"options": SHARDED},
        },
        {  # MiCS: partition groups of 2 (dp), replicated over dpr; 2-hop gradient sync
            "name": "gpt2-mics",
            "model_name": "gpt2",
            "axes": {"pp": 2, "dpr": 2, "dp": 2},
            "runs": [("1f1b", {})],
            "compile_kwargs": {"options": mics},
            "make_optimizer": True,
        },
    ]
    _check(run_distributed(compare_jobs, 8, jobs, timeout=900), "8 ranks", zero=("gpt2-mics",))


@pytest.mark.multiproc
@pytest.mark.skipif(
    not os.environ.get("AUTOPAR_LONG_TESTS"),
    reason="8 gloo ranks x 3 more schedules take ~8 min on 2 cores; run with AUTOPAR_LONG_TESTS=1",
)
def test_pp2_dp2_tp2_gpipe_wave_scp():
    """The schedules the 8-rank test above leaves out, on the same 3D mesh (opt-in: too slow for
    `make test`; passed on this machine in 8 min 23 s)."""
    jobs = [
        {
            "name": "gpt2-pp2dp2tp2-rest",
            "model_name": "gpt2",
            "axes": {"pp": 2, "dp": 2, "tp": 2},
            "runs": [r for r in ALL if r[0] in ("gpipe", "wave", "scp")],
            "compile_kwargs": {"options": SHARDED},
        }
    ]
    _check(run_distributed(compare_jobs, 8, jobs, timeout=1200), "8 ranks")


# ---------------------------------------------------------------------------------------------
# Single process: the stage IR


def _program(name: str = "tiny-gpt2", mesh: MeshSpec | None = None, microbatch: int = 2):
    spec = build(name, device="meta")
    kw = {k: v[:microbatch] for k, v in spec.kwargs.items()}
    return prune_outputs(lower(capture(spec.model, spec.args, kw), mesh or MeshSpec()))


def test_transfers_pair_every_send_with_a_recv_and_round_trip():
    ann, plan, _ = assign_stages(_program("tiny-llama"), 2, chunks=2)
    prog = insert_transfers(ann)
    verify(prog)
    assert parse(print_program(prog)) == prog
    sends = [op for op in prog.ops if op.target == "send"]
    recvs = [op for op in prog.ops if op.target == "recv"]
    assert len(sends) == len(recvs) > 0
    for s, r in zip(sends, recvs):
        assert s.kwargs["peer_stage"] == s.attrs["stage"] + 1 == r.attrs["stage"]
        assert s.type == r.type and s.kwargs["grad"] == r.kwargs["grad"]
    # the rotary tables are common nodes: they travel forward only; the residual stream carries a gradient
    assert any(not op.kwargs["grad"] and op.type.is_float for op in sends)
    assert any(op.kwargs["grad"] and op.type.is_float for op in sends)
    assert prog.attrs["pipeline_stages"] == plan.num_stages == 4


def test_verifier_rejects_unpaired_and_non_neighbour_transfers():
    prog = insert_transfers(assign_stages(_program(), 2)[0])
    recv = next(i for i, op in enumerate(prog.ops) if op.target == "recv")
    dropped = prog.with_(ops=prog.ops[:recv] + prog.ops[recv + 1 :])
    with pytest.raises(VerifyError):
        verify(dropped)
    send = next(i for i, op in enumerate(prog.ops) if op.target == "send")
    bad = prog.ops[send].with_(kwargs=dict(prog.ops[send].kwargs, peer_stage=5))
    with pytest.raises(VerifyError, match="neighbouring"):
        verify(prog.with_(ops=prog.ops[:send] + (bad,) + prog.ops[send + 1 :]))


def test_scatter_gather_sends_one_tp_shard_and_gathers_it():
    mesh = MeshSpec((("tp", 2),))
    prog = _program(mesh=mesh)  # every placement replicated: each boundary can be scattered
    out = insert_transfers(assign_stages(prog, 2)[0], scatter_gather=True)
    verify(out)
    send = next(op for op in out.ops if op.target == "send" and op.type.is_float)
    assert isinstance(send.type.placements[0], Shard)
    producer = {r: op for op in out.ops for r in op.results}[send.args[0].name]
    assert producer.target == "local_shard"
    recv = next(op for op in out.ops if op.target == "recv" and op.type.is_float)
    users = [op for op in out.ops if any(a.name == recv.result for a in op.input_refs())]
    assert [u.target for u in users] == ["all_gather"]


def test_stages_chained_in_one_process_compute_the_models_loss():
    """The stage programs, run one after another with real weights, give the model's own loss; so do
    the recompute head and rest of every stage (the cut loses nothing and adds nothing)."""
    spec = build("tiny-gpt2", device="cpu", seed=0)
    kw = {k: v[:2] for k, v in spec.kwargs.items()}
    prog = prune_outputs(lower(capture(spec.model, (), kw)))
    tp = insert_transfers(assign_stages(prog, 2, chunks=2)[0])
    named = dict(spec.model.named_parameters(remove_duplicate=False))
    env: dict[str, torch.Tensor] = dict(kw)
    sent: list[torch.Tensor] = []
    for s in range(tp.attrs["pipeline_stages"]):
        sp = stage_program(tp, s)
        for v, t in zip(sp.recv, sent):
            env[v.name] = t
        gm = codegen(sp.program, {}, lambda n: named[n])
        outs = Part.of(gm, sp.program)(env)
        cut = recompute_cut(sp, Fraction(1, 2))
        if 0 < cut < len(sp.program.ops):
            head, rest = split_for_recompute(sp.program, cut)
            h = Part.of(codegen(head, {}, lambda n: named[n]), head)(env)
            r = Part.of(codegen(rest, {}, lambda n: named[n]), rest)
            split_outs = r({**env, **dict(zip(r.inputs, h))})
            for a, b in zip(outs, split_outs):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        sent = list(outs)
    with torch.no_grad():
        want = spec.model(**kw).loss
    torch.testing.assert_close(sent[0], want, rtol=1e-6, atol=0)


def test_recompute_cut_takes_a_fraction_of_the_subgraphs():
    tp = insert_transfers(assign_stages(_program(), 1)[0])
    sp = stage_program(tp, 0)
    n = len({s for s in sp.subgraphs if s >= 0})
    assert n > 2
    assert recompute_cut(sp, Fraction(0)) == 0
    assert recompute_cut(sp, Fraction(1)) == len(sp.program.ops)
    half = recompute_cut(sp, Fraction(1, 2))
    assert 0 < half < len(sp.program.ops)
    assert len({s for s in sp.subgraphs[:half] if s >= 0}) == round(n / 2)


def test_split_batch_cuts_dim0_and_refuses_uneven_batches():
    x, y = torch.arange(8).view(4, 2), torch.arange(4)
    parts = split_batch((x,), {"y": y}, 2)
    assert [p[1]["y"].tolist() for p in parts] == [[0, 1], [2, 3]]
    assert torch.equal(parts[1][0][0], x[2:])
    with pytest.raises(Exception, match="3 equal microbatches"):
        split_batch((x,), {}, 3)


# ---------------------------------------------------------------------------------------------
# Single process: meta-device initialization


def test_meta_init_is_deterministic_per_tensor_and_uses_the_models_initializers():
    m1 = build("tiny-gpt2", device="meta").model
    m2 = build("tiny-gpt2", device="meta").model
    names = list(dict.fromkeys(canonical_names(m1).values()))
    # any order, any subset: each tensor depends only on (seed, name)
    a = {n: init_value(m1, n, seed=3) for n in names}
    b = {n: init_value(m2, n, seed=3) for n in reversed(names)}
    assert all(torch.equal(a[n], b[n]) for n in names)
    assert not torch.equal(init_value(m1, names[0], seed=4), a[names[0]])
    full = materialize(build("tiny-gpt2", device="meta").model, seed=3)
    assert all(torch.equal(t, a[canonical_names(full)[n]]) for n, t in full.state_dict().items())
    # GPT-2's own scheme: LayerNorm weight 1, biases 0, residual projections scaled by 1/sqrt(2 n_layer)
    assert torch.equal(a["transformer.h.0.ln_1.weight"], torch.ones(64))
    assert torch.equal(a["transformer.h.0.attn.c_attn.bias"], torch.zeros(192))
    std = a["transformer.h.0.attn.c_proj.weight"].std().item()
    assert abs(std - 0.02 / 2) < 0.002
    assert full.lm_head.weight is full.transformer.wte.weight  # ties survive


def test_meta_init_refuses_a_tensor_no_initializer_writes():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        m = Odd()
    with pytest.raises(PipelineError, match="no initializer"):
        init_value(m, "w")


# ---------------------------------------------------------------------------------------------
# Single process: measured traces -> SimResult


def test_measured_result_of_a_simulated_timeline_gives_the_simulated_bubble():
    sched = make_schedule("1f1b", 4, 8)
    sim = simulate(sched, Costs.uniform(4, tf=1, tb=2))
    traces = [[TraceEvent(e.action, float(e.start), float(e.end)) for e in events] for events in sim.timeline]
    got = measured_result(sched, traces)
    assert got.bubble_ratio == pytest.approx(float(sim.bubble_ratio))
    assert got.step_time == pytest.approx(float(sim.step_time))
    assert got.peak_activations == sim.peak_activations
    computes = [[e.action for e in ev if e.action.kind in COMPUTE_KINDS] for ev in got.timeline]
    assert computes == [[e.action for e in ev if e.action.kind in COMPUTE_KINDS] for ev in sim.timeline]


def test_traces_of_ranks_that_began_apart_are_put_on_one_clock():
    """A simulated step recorded by ranks that began it at different moments (each trace counting from its
    own start, as the executor's do) comes back as the simulated step once ``on_one_clock`` shifts each by
    its origin, counting from when the rank holding stage 0 began (every compute waits for it); without
    the shift a receive ends before its send began."""
    sched = make_schedule("1f1b", 4, 8)
    sim = simulate(sched, Costs.uniform(4, tf=1, tb=2, tc=Fraction(1, 4)))

    def recorded(began: list[float]) -> list[list[TraceEvent]]:
        """Each rank's trace when rank r began at ``began[r]`` and the step itself began with rank 0."""
        return [
            [TraceEvent(e.action, float(e.start) + began[0] - b, float(e.end) + began[0] - b) for e in ev]
            for ev, b in zip(sim.timeline, began)
        ]

    def same_as_simulated(got) -> None:
        m = measured_result(sched, got)
        assert m.step_time == pytest.approx(float(sim.step_time))
        assert m.bubble_ratio == pytest.approx(float(sim.bubble_ratio))
        assert all(t.end >= t.start for t in m.transfers)

    for began in ([0.0, 0.3, 0.1, 0.7], [0.9, 0.3, 0.1, 0.7]):  # rank 0 (stage 0) began first, then last
        own = recorded(began)
        assert any(t.end < t.start for t in measured_result(sched, own).transfers)  # a receive "ends" early
        same_as_simulated(on_one_clock(own, [100.0 + b for b in began], [0.0] * 4))
        skews = [0.0, 5.0, -2.0, 9.0]  # other hosts' clocks
        same_as_simulated(on_one_clock(own, [100.0 + b + k for b, k in zip(began, skews)], skews))


def test_a_plan_files_stages_are_kept_and_inserted_collectives_join_their_consumer():
    from autopar.ir.core import Op, Ref
    from autopar.passes.flow import _complete_stages, _planned_stages

    ann = assign_stages(_program(mesh=MeshSpec((("tp", 2),))), 2)[0]
    assert _planned_stages(ann) == 2
    # a collective inserted after the stages were chosen (as autopar plan's insert-collectives does)
    i = next(k for k, op in enumerate(ann.ops) if op.attrs["stage"] == 1 and op.type.is_float)
    src = ann.ops[i - 1]
    t = src.type.with_placements((Shard(len(src.type.shape) - 1),))
    extra = Op(("late",), (t,), "local_shard", (Ref(src.result),), {"axis": "tp", "dim": t.placements[0].dim})
    prog = ann.with_(ops=ann.ops[:i] + (extra,) + ann.ops[i:])
    done = _complete_stages(prog)
    assert done.ops[i].attrs["stage"] == ann.ops[i].attrs["stage"] == 1
    assert [op.attrs["stage"] for op in done.ops] == sorted(op.attrs["stage"] for op in done.ops)
    verify(insert_transfers(done))
