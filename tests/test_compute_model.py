"""The one compute model (solver/cluster/compute.py): efficiency tables monotone, the four callers (the sharding
ILP's CostModel, the stage balancer's SubgraphCost, the search's StageTerms, and the simulator, which runs the
balancer's and the search's stage times) price the same op the same, and `autopar calibrate` writes a device table
the planner then prices with."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch

from autopar.ir.core import MeshSpec
from autopar.passes.capture import capture
from autopar.passes.lower import lower
from autopar.search.price import Analytic
from autopar.search.profile import profile_program
from autopar.solver.cluster import compute
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.cost import CostModel, TrainingSetup
from autopar.solver.stages.cost import StageContext, subgraph_costs

KINDS = [k for k in compute.list_devices()]
GPU_KINDS = ("a100", "h100", "h200", "b200", "v100", "rtx3090")


def test_every_device_kind_has_a_table_with_a_source_for_each_number():
    assert set(GPU_KINDS) | {"cpu", "generic"} <= set(KINDS)
    for kind in KINDS:
        table = compute.load_table(kind)
        assert table.sources, kind
        for key in ("matmul", "attention", "vector_eff", "bandwidth_eff", "launch_seconds"):
            assert any(s.startswith(key) for s in table.sources), (kind, key)
    for preset, kind in [
        ("dgx-a100", "a100"),
        ("dgx-h100", "h100"),
        ("dgx-h200", "h200"),
        ("dgx-b200", "b200"),
        ("mics-p3dn", "v100"),
        ("merak-3090", "rtx3090"),
        ("local-cpu", "cpu"),
    ]:
        assert ClusterSpec.load(preset).device == kind


@pytest.mark.parametrize("kind", KINDS)
def test_matmul_efficiency_never_falls_as_a_gemm_grows_and_stays_below_the_peak(kind):
    """Larger GEMMs are not less efficient (in each of m, n, k), never above max_eff <= 1; the curve is symmetric in
    m, n, k (a backward's two matmuls price as its forward); seconds never fall as a dimension grows."""
    table = compute.load_table(kind)
    dims = (1, 16, 64, 256, 1024, 4096, 16384)
    for dtype, curve in table.matmul.items():
        assert 0 < curve.max_eff <= 1
        for m, n, k in itertools.product(dims, repeat=3):
            e = table.efficiency(compute.Work("matmul", 2.0 * m * n * k, m=m, n=n, k=k, dtype=dtype))
            assert 0 < e <= curve.max_eff
            for bigger in (dict(m=m * 4), dict(n=n * 4), dict(k=k * 4)):
                w2 = compute.Work("matmul", 1.0, **{"m": m, "n": n, "k": k, **bigger}, dtype=dtype)
                assert table.efficiency(w2) >= e
            assert table.efficiency(compute.Work("matmul", 1.0, m=k, n=m, k=n, dtype=dtype)) == pytest.approx(e)
    big = compute.Work("matmul", 2.0 * 16384**3, m=16384, n=16384, k=16384, dtype="bf16")
    assert 0.9 * table.curve("matmul", "bf16").max_eff < table.efficiency(big)
    for curve in table.attention.values():
        assert 0 < curve.max_eff <= 1
        for s in (128, 512, 2048, 8192):
            short = table.efficiency(compute.Work("attention", 1.0, m=s, n=s, k=64))
            assert short <= table.efficiency(compute.Work("attention", 1.0, m=2 * s, n=2 * s, k=64)) <= curve.max_eff


def test_a_flat_curve_is_rejected_as_a_table_error():
    from autopar.errors import ClusterSpecError

    good = compute.load_table("a100").to_dict()
    with pytest.raises(ClusterSpecError, match="max_eff"):
        compute.table_from_dict({**good, "matmul": {"bf16": {"max_eff": 1.5, "half": 1}}})
    with pytest.raises(ClusterSpecError, match="unknown device kind 'a1000'"):
        compute.load_table("a1000")


def test_elementwise_is_priced_by_bytes_and_unfused_attention_costs_more_than_fused():
    dev = compute.device_of(ClusterSpec.load("dgx-a100"))
    w = compute.Work("elementwise", 1e6, 4e9, dtype="bf16")
    assert compute.seconds(w, dev) == pytest.approx(4e9 / (2.039e12 * 0.85))
    att = compute.Work("attention", 4.0 * 32 * 2048 * 2048 * 128, m=32 * 2048, n=2048, k=128, dtype="bf16")
    unfused = compute.seconds(
        compute.Work("attention_unfused", att.flops, m=att.m, n=att.n, k=att.k, dtype="bf16"), dev
    )
    assert compute.seconds(att, dev) < unfused


class Block(torch.nn.Module):
    def __init__(self, h=64):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).sum()


def test_the_four_callers_price_the_same_op_the_same():
    """One matmul (fc1 of [512, 64] x [64, 256]) priced by the ILP's CostModel, the stage balancer's subgraph cost,
    the search's unit terms (the simulator runs these stage times) and compute.seconds directly: the same seconds,
    to float rounding, on A100 bf16 and on this CPU in fp32; and unlike the old constant 0.5 of peak."""
    prog = lower(capture(Block(), (torch.randn(8, 64, 64),)), MeshSpec())
    types = prog.types()
    fc1 = next(op for op in prog.ops if op.target in compute.MATMULS)
    for preset, dtype in (("dgx-a100", "bf16"), ("local-cpu", "fp32")):
        cluster = ClusterSpec.load(preset)
        device = compute.device_of(cluster)
        want = 3 * compute.seconds(compute.op_work(fc1, types, dtype), device)
        ilp = CostModel(MeshSpec(), TrainingSetup(precision=dtype), cluster).op_seconds(fc1, types, [])
        i = prog.ops.index(fc1)

        one = SimpleNamespace(index=0, start=i, stop=i + 1, graph_inputs=(), flops=fc1.flops, label="fc1")
        ctx = StageContext(prog, cluster, 1, 1, False, dtype, None)
        balancer = subgraph_costs(ctx, [one], lambda c, s: 0.0).subgraphs[0].compute_seconds
        # the search: the profile's works of every op at micro-batch 8 (one unit here), against the balancer's
        # and the ILP's price of every op
        an = Analytic(profile_program(prog, batch=8), cluster, 8, precision=dtype)
        search = 3 * sum(an.unit_seconds(u, 8, 1)[0] for u in an.p.units)
        every = [SimpleNamespace(index=0, start=0, stop=len(prog.ops), graph_inputs=(), flops=0, label="all")]
        whole = subgraph_costs(ctx, every, lambda c, s: 0.0).subgraphs[0].compute_seconds
        cm = CostModel(MeshSpec(), TrainingSetup(precision=dtype), cluster)
        assert search == pytest.approx(whole, rel=1e-12)
        assert whole == pytest.approx(sum(cm.op_seconds(op, types, []) for op in prog.ops), rel=1e-12)
        assert ilp == pytest.approx(want, rel=1e-12)
        assert balancer == pytest.approx(want, rel=1e-12)
        old = 3 * fc1.flops / (cluster.peak(dtype) * 0.5)
        assert abs(want - old) > 0.05 * old  # the shape matters: not the old constant


def test_calibrate_writes_a_device_table_the_planner_then_prices_with(tmp_path, capsys):
    """`autopar calibrate --sweep` (a tiny sweep) writes a spec naming the device table it wrote beside it; the
    sharding ILP's CostModel and the search's StageTerms price with that table; editing the table (half the
    efficiency) doubles the price of a compute-bound matmul: the planner reads it."""
    import yaml

    from autopar.cli import main

    out = tmp_path / "spec.yaml"
    assert main(["calibrate", "--quick", "--sweep", "16,64", "-o", str(out)]) == 0
    assert "matmul curve" in capsys.readouterr().out
    spec = ClusterSpec.load(out)
    table = compute.load_table(spec.device)
    assert spec.device == str(tmp_path / "spec.device.yaml") and spec.efficiency is None
    assert table.sources["matmul fp32"].startswith("measured: torch.mm sweep over m, n, k in [16, 64]")
    big = compute.Work("matmul", 2.0 * 512**3, 3 * 4 * 512**2, 512, 512, 512, "fp32", ops=0)
    cm = CostModel(MeshSpec(), TrainingSetup(precision="fp32"), spec)
    priced = cm.work_seconds(big, [])
    assert priced == pytest.approx(3 * big.flops / (spec.peak("fp32") * table.curve("matmul", "fp32")(512, 512, 512)))
    prof = profile_program(lower(capture(Block(), (torch.randn(8, 64, 64),)), MeshSpec()), batch=8)
    before = sum(Analytic(prof, spec, 8, precision="fp32").unit_seconds(u, 8, 1)[0] for u in prof.units)
    data = yaml.safe_load((tmp_path / "spec.device.yaml").read_text())
    data["matmul"]["fp32"]["max_eff"] /= 2
    (tmp_path / "spec.device.yaml").write_text(yaml.safe_dump(data))
    again = ClusterSpec.load(out)
    assert CostModel(MeshSpec(), TrainingSetup(precision="fp32"), again).work_seconds(big, []) == pytest.approx(
        2 * priced
    )
    after = sum(Analytic(prof, again, 8, precision="fp32").unit_seconds(u, 8, 1)[0] for u in prof.units)
    assert after > 1.2 * before
    # on a CPU it also measured (in this thread's CPU time) the cache term, the transcendental and softmax rates and
    # an eager op's overhead, each with its source, and the planner prices with them
    assert table.cache_bandwidth > spec.memory_bandwidth and table.cache_bytes > 0
    assert set(table.rates) == {"transcendental", "softmax"}
    assert {"cache", "rates", "launch_seconds", "clock", "load", "attention"} <= set(table.sources)
    assert "autograd" in table.sources["launch_seconds"] and "thread_time" in table.sources["clock"]
    gelu = compute.Work("elementwise", 1e6, 8e6, dtype="fp32", ops=0, rate_class="transcendental")
    want = max(1e6 / table.rates["transcendental"], table.stream_seconds(8e6, spec.memory_bandwidth))
    assert cm.work_seconds(gelu, []) == pytest.approx(3 * want)
    small = compute.Work("elementwise", 0.0, 1024.0, dtype="fp32", ops=0)  # cache-resident: at the cache rate
    assert cm.work_seconds(small, []) == pytest.approx(3 * 1024 / table.cache_bandwidth)


def test_the_cpu_terms_are_monotone_and_fit_what_they_measure():
    """The cache term (``DeviceTable.stream_seconds``): never decreasing in the bytes moved, never above the time
    without it, the streaming rate past ``cache_bytes``; ``fit_cache`` recovers the term from times it makes; a
    rate class's op never gets faster with more FLOPs, nor faster than without its rate; a table round-trips with
    both through its file form, and a bad value is refused naming it."""
    from autopar.errors import ClusterSpecError
    from autopar.runtime.measure.calibrate import fit_cache

    bw = 20e9
    table = dataclasses.replace(compute.load_table("cpu"), cache_bandwidth=80e9, cache_bytes=12 * 2**20)
    sizes = sorted({int(x) for x in torch.logspace(2, 9, 200).tolist()})
    times = [table.stream_seconds(b, bw) for b in sizes]
    plain = dataclasses.replace(table, cache_bandwidth=None, cache_bytes=0.0)
    assert all(a <= b for a, b in zip(times, times[1:]))
    assert all(t <= plain.stream_seconds(b, bw) for b, t in zip(sizes, times))
    assert table.stream_seconds(2**30, bw) - table.stream_seconds(2**29, bw) == pytest.approx(2**29 / bw)
    points = [(float(b), table.stream_seconds(b, bw)) for b in (48e3, 768e3, 12 * 2**20, 48 * 2**20, 192 * 2**20)]
    assert fit_cache(points, bw) == pytest.approx((12 * 2**20, 80e9))
    assert fit_cache([(b, b / bw) for b, _ in points], bw)[0] == 0.0  # no faster small sizes: no cache term
    rated = dataclasses.replace(table, rates={"transcendental": 0.5e9, "softmax": 3e9})
    for cls in ("transcendental", "softmax", ""):
        dev = compute.Device({"fp32": 70e9}, bw, rated)
        secs = [compute.seconds(compute.Work("elementwise", f, 4.0 * f, ops=1, rate_class=cls), dev) for f in sizes]
        assert all(a <= b for a, b in zip(secs, secs[1:]))
        no_rate = compute.Device({"fp32": 70e9}, bw, table)
        assert all(
            s >= compute.seconds(compute.Work("elementwise", f, 4.0 * f, ops=1), no_rate) for f, s in zip(sizes, secs)
        )
    again = compute.table_from_dict(rated.to_dict())
    assert (again.cache_bandwidth, again.cache_bytes, again.rates) == (80e9, 12 * 2**20, rated.rates)
    for bad in ({"cache_bandwidth": -1.0}, {"rates": {"gelu": 1e9}}, {"rates": {"softmax": 0}}):
        with pytest.raises(ClusterSpecError, match="cache_bandwidth|rates"):
            compute.table_from_dict({**rated.to_dict(), **bad})
    assert (
        compute.op_work(
            SimpleNamespace(target="aten.gelu", flops=8, input_refs=lambda: [], types=()), {}, "fp32"
        ).rate_class
        == "transcendental"
    )


def test_unfused_attention_moves_its_scores_as_megatron_does():
    """Unfused attention (Megatron-LM of 2021): forward = its two matmuls (each moving the scores once, by its
    roofline) + the softmax and dropout moving the m x n scores 4 times and writing a one-byte mask; backward = four
    matmuls + 5 passes and the mask read (less than twice the forward's 4); the ILP's and the balancer's price of
    every other kind stays exactly three forwards."""
    dev = compute.device_of(ClusterSpec.load("dgx-a100"))
    m, n, k = 24 * 2048, 2048, 96
    w = compute.Work("attention_unfused", 4.0 * m * n * k, m=m, n=n, k=k, dtype="bf16")
    fast = dataclasses.replace(dev, peak_flops={"bf16": 1e30})  # FLOPs free: what is left is the bytes moved
    bw = 2.039e12 * 0.85
    assert compute.seconds(w, fast) == pytest.approx((m * n * (2 * 4 + 1) + 2 * m * (n + 2 * k) * 2) / bw)
    assert compute.backward_seconds(w, fast) == pytest.approx((m * n * (2 * 5 + 1) + 4 * m * (n + 2 * k) * 2) / bw)
    assert compute.backward_seconds(w, dev) < 2 * compute.seconds(w, dev)
    assert compute.train_seconds(w, dev) == compute.seconds(w, dev) + compute.backward_seconds(w, dev)
    for other in (compute.Work("matmul", 1e12, 1e8, 4096, 4096, 4096, "bf16"), compute.Work("elementwise", 0, 1e9)):
        assert compute.train_seconds(other, dev) == 3 * compute.seconds(other, dev)
    assert compute.unfused_saved_bytes("bf16") == 5 and compute.unfused_saved_bytes("fp32") == 9


def test_the_ilp_prices_a_group_spanning_nodes_as_the_search_does():
    """A dp group of 32 over 4 nodes of 8 (tp = 2 inside): the ILP's CostModel rings it over 4 rails per node,
    as the search's CommTime and NCCL do, not over one; an axis inside a node keeps NVLink's price."""
    from autopar.search.comm_time import CommTime

    cluster = ClusterSpec.load("dgx-a100:nodes=8")
    cm = CostModel(MeshSpec((("dp", 32), ("tp", 2))), TrainingSetup(precision="bf16"), cluster)
    comm = CommTime(cluster, 4.0, 4.0)
    nbytes = 1e9
    for axis, n, stride in ((0, 32, 2), (1, 2, 1)):
        want = comm.allreduce(nbytes, 1, n, comm.intra(n * stride), comm.per_node(n, stride))
        assert cm._collective("all_reduce", nbytes, axis)[1] == pytest.approx(want, rel=1e-12)
    one_rail = comm.allreduce(nbytes, 1, 32, False, 1)
    assert cm._collective("all_reduce", nbytes, 0)[1] < one_rail / 3  # 4 rails, the NVLink cap not reached
