"""The compute model's price of compiled compute (``solver/cluster/compute.compiled_works``, issue 33): under
torch.compile the elementwise ops between two matmuls fuse into one kernel per connected group, priced by the
bytes that kernel reads and writes once and one launch; matmuls, attention and collectives keep their own price.
No compiling here: the IR of captured models only."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from autopar.ir.core import MeshSpec
from autopar.passes.capture import capture
from autopar.passes.lower import lower
from autopar.solver.cluster import compute
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.stages.cost import StageContext, subgraph_costs


class Chain(torch.nn.Module):
    def __init__(self, d=64, h=256):
        super().__init__()
        self.fc1, self.ln, self.fc2 = torch.nn.Linear(d, h), torch.nn.LayerNorm(h), torch.nn.Linear(h, d)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.ln(self.fc1(x))) * 2 + 1  # bias add, norm, gelu, mul, add: one kernel
        return self.fc2(h).sum()


def _prog(model, *args):
    prog = lower(capture(model, args), MeshSpec())
    return prog, prog.types()


def test_an_elementwise_chain_between_two_matmuls_is_one_kernel_priced_by_its_outside_bytes():
    prog, types = _prog(Chain(), torch.randn(8, 16, 64))
    ops = list(prog.ops)
    eager = [compute.op_work(op, types, "fp32") for op in ops]
    works = compute.compiled_works(ops, types, "fp32")
    kinds = [w.kind for w in works]
    assert kinds == ["matmul", "elementwise", "matmul", "elementwise"], [op.target for op in ops]
    fc1 = next(i for i, op in enumerate(ops) if op.target in compute.MATMULS)
    fc2 = next(i for i, op in enumerate(ops) if op.target in compute.MATMULS and i > fc1)
    assert works[0] == eager[fc1] and works[2] == eager[fc2]  # matmuls priced as op_work prices them
    chain = ops[fc1 + 1 : fc2]
    assert len([op for op in chain if op.target not in compute.VIEW_OPS]) >= 5
    fused = works[1]
    # reads fc1's output and the bias and norm parameters once, writes only what fc2 reads: 4 bytes a float
    outside = {ops[fc1].result, "fc1.bias", "ln.weight", "ln.bias"}
    read = {r.name for op in chain for r in op.input_refs()} - {r for op in chain for r in op.results}
    assert read == outside, read
    written = {r.name for r in ops[fc2].input_refs()} & {r for op in chain for r in op.results}
    want = 4.0 * sum(types[n].numel for n in outside | written)
    assert fused.bytes == want and fused.ops == 1
    assert fused.flops == sum(float(op.flops) for op in chain)
    assert fused.bytes < sum(eager[i].bytes for i in range(fc1 + 1, fc2)) / 3  # the intermediates are not moved


def test_two_independent_chains_are_two_kernels_and_a_collective_stays_its_own():
    class Two(torch.nn.Module):
        def forward(self, x, y):
            return torch.relu(x) * 3, torch.tanh(y) + 1

    prog, types = _prog(Two(), torch.randn(32, 32), torch.randn(32, 32))
    works = compute.compiled_works(prog.ops, types, "fp32")
    assert [w.ops for w in works] == [1, 1]
    assert [w.bytes for w in works] == [2 * 4.0 * 32 * 32] * 2  # each reads its input and writes its output
    # a collective between two elementwise ops splits the run (Inductor does not fuse across it)
    relu, mul = prog.ops[0], prog.ops[1]
    reduce = relu.with_(target="all_reduce", results=("r",), args=(relu.args[0],))
    types2 = {**types, "r": types[relu.result]}
    mine = compute.compiled_works([reduce, relu, mul], types2, "fp32")
    assert [w.ops for w in mine] == [1, 1] and mine[0] == compute.op_work(reduce, types2, "fp32")


# a CPU's table with the transcendental and softmax rates `autopar calibrate` measures there (BENCHMARKS 22: gelu
# at ~2 ns an element, far slower than its bytes), at about this machine's values
RATES = {"transcendental": 0.5e9, "softmax": 3e9}


def _rated_cpu() -> compute.Device:
    table = replace(compute.load_table("cpu"), name="cpu-rated", rates=RATES)
    return compute.Device({"fp32": 70e9, "bf16": 70e9}, 20e9, table)


def _members(ops, start, stop):
    return [i for i in range(start, stop) if ops[i].target not in compute.VIEW_OPS]


def test_a_fused_kernel_is_bound_by_its_members_math_at_their_class_rates():
    """A fused kernel with a gelu in it (``Chain``: bias add, norm, gelu, mul, add) on a table with a transcendental
    rate costs at least the gelu's FLOPs at that rate plus one launch (its members' compute, each at its class's
    rate, the rest at the vector rate, against its fused bytes), where its bytes alone price it well below; never
    above the same ops op by op; its shares add up to it; on a table without rates (a GPU's) it is priced as
    before, by its FLOPs at the vector rate and its bytes."""
    prog, types = _prog(Chain(), torch.randn(8, 16, 64))
    ops = list(prog.ops)
    works = compute.compiled_works(ops, types, "fp32")
    fused = works[1]
    fc1, fc2 = [i for i, op in enumerate(ops) if op.target in compute.MATMULS]
    members = _members(ops, fc1 + 1, fc2)
    gelu = [ops[i] for i in members if ops[i].target == "aten.gelu"]
    assert len(gelu) == 1 and gelu[0].flops > 0
    g = float(gelu[0].flops)
    assert fused.rated == (("transcendental", g / fused.flops),)
    dev = _rated_cpu()
    launch = dev.table.launch_seconds
    at_rate = g / RATES["transcendental"]
    got = compute.seconds(fused, dev)
    assert got >= at_rate + launch
    vector = dev.peak("fp32") * dev.table.vector_eff
    stream = dev.table.stream_seconds(fused.bytes, dev.memory_bandwidth)
    assert got == pytest.approx(max(at_rate + (fused.flops - g) / vector, stream) + launch, rel=1e-12)
    bytes_only = compute.seconds(replace(fused, rated=()), dev)  # the kernel's price before its members' rates
    assert bytes_only < 0.5 * at_rate
    eager = sum(compute.seconds(compute.op_work(ops[i], types, "fp32"), dev) for i in members)
    assert got < eager
    shares = compute.compiled_shares(ops, types, "fp32")
    assert sum(compute.seconds(shares[i], dev) for i in members) == pytest.approx(got, rel=1e-12)
    assert all(shares[i].rated == fused.rated for i in members)
    # a GPU's table has no rates: the kernel's price is its roofline of FLOPs at the vector rate and bytes
    gpu = compute.device_of(ClusterSpec.load("dgx-a100"))
    assert not gpu.table.rates
    vector = gpu.peak("fp32") * gpu.table.vector_eff
    stream = gpu.table.stream_seconds(fused.bytes, gpu.memory_bandwidth)
    assert compute.seconds(fused, gpu) == max(fused.flops / vector, stream) + gpu.table.launch_seconds


def test_a_kernel_of_two_rate_classes_pays_both():
    """A softmax over a gelu fused into one kernel: both classes' FLOPs, each at its own rate, summed."""

    class Both(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(torch.nn.functional.gelu(x), dim=-1) * 2

    prog, types = _prog(Both(), torch.randn(64, 256))
    ops = list(prog.ops)
    (fused,) = compute.compiled_works(ops, types, "fp32")
    flops = {c: sum(float(op.flops) for op in ops if compute.RATE_CLASSES.get(op.target) == c) for c in RATES}
    assert all(flops.values())
    assert dict(fused.rated) == pytest.approx({c: f / fused.flops for c, f in flops.items()}, rel=1e-12)
    dev = _rated_cpu()
    both = sum(f / RATES[c] for c, f in flops.items())
    assert compute.seconds(fused, dev) >= both + dev.table.launch_seconds
    eager = sum(compute.seconds(compute.op_work(op, types, "fp32"), dev) for op in ops)
    assert compute.seconds(fused, dev) <= eager


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_compiled_gpt2_moves_fewer_bytes_in_fewer_launches_with_the_same_flops_and_matmuls(dtype):
    from tests.equivalence import tiny_gpt2

    model, batches = tiny_gpt2(batch=2, seq=16)
    prog = lower(capture(model, (), batches[0]), MeshSpec())
    types = prog.types()
    eager = [compute.op_work(op, types, dtype) for op in prog.ops]
    works = compute.compiled_works(prog.ops, types, dtype)
    assert sum(w.flops for w in works) == pytest.approx(sum(w.flops for w in eager), rel=1e-12)
    big = lambda ws: Counter(w for w in ws if w.kind != "elementwise")  # noqa: E731
    assert big(works) == big(eager)  # every matmul and attention priced as before
    assert sum(w.bytes for w in works) < 0.7 * sum(w.bytes for w in eager)
    assert sum(w.ops for w in works) < 0.7 * sum(w.ops for w in eager)
    # the stage balancer prices a compiled run through it: every op of the program as one subgraph
    cluster = ClusterSpec.load("dgx-a100")
    every = [SimpleNamespace(index=0, start=0, stop=len(prog.ops), graph_inputs=(), flops=0, label="all")]
    priced = {}
    for compiled in (False, True):
        ctx = StageContext(prog, cluster, 1, 1, False, dtype, None, compiled=compiled)
        priced[compiled] = subgraph_costs(ctx, every, lambda c, s: 0.0).subgraphs[0].compute_seconds
    device = compute.device_of(cluster)
    assert priced[True] == pytest.approx(sum(3 * compute.seconds(w, device) for w in works), rel=1e-12)
    assert priced[True] < priced[False]


def test_torch_compile_reaches_the_stage_balancer_and_prices_the_stages_fused():
    """``torch_compile=True`` prices the plan compiled: ``pricing_options`` sets ``TrainingSetup.compiled`` (not
    under sub-pipelined tp, whose programs stay eager), the flow hands it to the assign-stages pass, and the
    stage plan's compute seconds (``compiled_works``) fall below the op-by-op plan's on pp=2."""

    from autopar.build import pricing_options
    from autopar.ir.core import MeshSpec as Mesh
    from autopar.passes.flow import FlowOptions, plan_program
    from autopar.passes.shard import ShardOptions
    from autopar.schedule.generators import make_schedule
    from tests.equivalence import tiny_gpt2

    sched = make_schedule("1f1b", 2, 2)
    assert pricing_options(None, sched, False, torch_compile=True).setup.compiled
    assert not pricing_options(None, sched, True, torch_compile=True).setup.compiled  # sub-pipelined: eager
    assert pricing_options(None, sched, False) is None
    model, batches = tiny_gpt2(batch=4, seq=16)
    captured = capture(model, (), batches[0])
    mesh = Mesh((("pp", 2),))
    stages = {}
    for compiled in (False, True):
        opts = ShardOptions()
        opts = replace(opts, setup=replace(opts.setup, compiled=compiled))
        planned = plan_program(captured, mesh, FlowOptions(shard=opts, microbatches=2, cache=False))
        stages[compiled] = planned.stage_plan.stages
    assert len(stages[True]) == 2
    for eager, fused in zip(stages[False], stages[True]):
        if (eager.first, eager.last) == (fused.first, fused.last):  # the same ops: fused is cheaper
            assert fused.compute_seconds < eager.compute_seconds, (eager, fused)
    assert sum(s.compute_seconds for s in stages[True]) < sum(s.compute_seconds for s in stages[False])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("rated", [False, True], ids=["a100", "cpu-rated"])
def test_the_four_price_models_price_a_compiled_program_alike(dtype, rated, tmp_path):
    """One price for compiled compute (issue 33): the sharding ILP's ``CostModel.op_seconds`` (after
    ``price_program``), the stage balancer's ``subgraph_costs``, the search's ``StageTerms.unit_seconds`` (from the
    profile's ``compiled_works``) and the simulator's compute actions (fed by the search's per-stage times) all
    price tiny GPT-2's program as ``compute.compiled_works`` does, forward plus backward; priced eager, each gives
    the op-by-op price instead. On an A100 and on a CPU table with transcendental and softmax rates (its fused
    gelu and loss kernels priced by their members' math: ``Work.rated``, kept through the search's profile)."""
    from autopar.schedule.simulator import simulate
    from autopar.search.price import Analytic
    from autopar.search.profile import profile_program
    from autopar.search.score import Scorer
    from autopar.search.space import Candidate
    from autopar.solver.sharding.cost import CostModel, TrainingSetup
    from tests.equivalence import tiny_gpt2

    b = 2
    model, batches = tiny_gpt2(batch=b, seq=16)
    prog = lower(capture(model, (), batches[0]), MeshSpec())
    types = prog.types()
    cluster = ClusterSpec.load("dgx-a100")
    if rated:
        cluster = ClusterSpec.load("local-cpu")
        _rated_cpu().table.save(tmp_path / "cpu-rated.yaml")
        cluster = replace(cluster, device=str(tmp_path / "cpu-rated.yaml"))
    device = compute.device_of(cluster)
    assert bool(device.table.rates) == rated
    train = lambda works: sum(compute.train_seconds(w, device) for w in works)  # noqa: E731
    kernels = compute.compiled_works(prog.ops, types, dtype)
    want = {True: train(kernels)}
    want[False] = train(compute.op_work(op, types, dtype) for op in prog.ops)
    assert want[True] < (0.95 if rated else 0.9) * want[False]
    if rated:  # the gelu and loss kernels: above their bytes' price
        assert {c for w in kernels for c, _ in w.rated} == set(RATES)
        assert want[True] > train(replace(w, rated=()) for w in kernels)
    # the shares: one per op, adding up to the kernels' price
    shares = compute.compiled_shares(prog.ops, types, dtype)
    assert len(shares) == len(prog.ops) and train(shares) == pytest.approx(want[True], rel=1e-12)
    prof = profile_program(prog, batch=b)
    for compiled in (True, False):
        # the sharding ILP: each op priced alone, on an empty mesh (nothing divides it)
        cost = CostModel(MeshSpec(), TrainingSetup(precision=dtype, compiled=compiled), cluster)
        cost.price_program(prog)
        ilp = sum(cost.op_seconds(op, types, []) for op in prog.ops)
        # the stage balancer: the program cut into subgraphs of 7 ops (a cut anywhere prices the same)
        ctx = StageContext(prog, cluster, 1, 1, False, dtype, None, compiled=compiled)
        cuts = [
            SimpleNamespace(index=i, start=a, stop=min(a + 7, len(prog.ops)), graph_inputs=(), flops=0, label="")
            for i, a in enumerate(range(0, len(prog.ops), 7))
        ]
        balancer = sum(c.compute_seconds for c in subgraph_costs(ctx, cuts, lambda c, s: 0.0).subgraphs)
        # the search: every unit forward and backward at micro-batch b
        an = Analytic(prof, cluster, b, precision=dtype, compiled=compiled)
        search = sum(an.unit_seconds(u, b, 1)[0] + an.unit_seconds(u, b, 1)[2] for u in prof.units)
        # the simulator: a 2-stage 1F1B pipeline of 3 microbatches of b; its ranks' compute is 3 steps' worth
        ev = an.evaluate(Candidate(2, 1, 1, b, 3, "1f1b"))
        sim = sum(float(x) for x in simulate(Scorer().schedule("1f1b", 2, 3, ()), Scorer().costs(ev)).busy) / 3
        # the search's profile keeps bytes at 4 per float and scales them to the dtype, an integer input's too
        # (StageTerms.unit_seconds): in bf16 its price is off by those bytes (here 0.3% eager, 0.03% compiled)
        near = 1e-9 if dtype == "fp32" else 1e-2
        for name, got in (("ILP", ilp), ("stage balancer", balancer), ("search", search), ("simulator", sim)):
            rel = near if name in ("search", "simulator") else 1e-9
            assert got == pytest.approx(want[compiled], rel=rel), (name, compiled, got, want[compiled])
