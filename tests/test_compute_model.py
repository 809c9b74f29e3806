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
    """Larger GEMMs are not less efficient by the smooth curve (in each of m, n, k), never above max_eff <= 1; the
    curve is symmetric in m, n, k and the whole efficiency (with the wave bound) in m and n (the tile in either
    orientation); where the table gives no tile the efficiency is the curve's; seconds never fall as a dimension
    grows (``test_a_gemm_never_takes_less_time_as_it_grows`` sweeps the tile and wave boundaries)."""
    table = compute.load_table(kind)
    dims = (1, 16, 64, 256, 1024, 4096, 16384)
    for dtype, curve in table.matmul.items():
        assert 0 < curve.max_eff <= 1
        for m, n, k in itertools.product(dims, repeat=3):
            e = table.efficiency(compute.Work("matmul", 2.0 * m * n * k, m=m, n=n, k=k, dtype=dtype))
            assert 0 < e <= curve(m, n, k) <= curve.max_eff
            for bigger in (dict(m=m * 4), dict(n=n * 4), dict(k=k * 4)):
                assert curve(*{"m": m, "n": n, "k": k, **bigger}.values()) >= curve(m, n, k)
                if not (table.sms and curve.tile):
                    w2 = compute.Work("matmul", 1.0, **{"m": m, "n": n, "k": k, **bigger}, dtype=dtype)
                    assert table.efficiency(w2) >= e
            assert curve(k, m, n) == pytest.approx(curve(m, n, k))
            assert table.efficiency(compute.Work("matmul", 1.0, m=n, n=m, k=k, dtype=dtype)) == pytest.approx(e)
            if not (table.sms and curve.tile):
                assert e == curve(m, n, k)
    big = compute.Work("matmul", 2.0 * 16384**3, m=16384, n=16384, k=16384, dtype="bf16")
    assert 0.9 * table.curve("matmul", "bf16").max_eff < table.efficiency(big)
    for curve in table.attention.values():
        assert 0 < curve.max_eff <= 1 and curve.tile is None
        for s in (128, 512, 2048, 8192):
            short = table.efficiency(compute.Work("attention", 1.0, m=s, n=s, k=64))
            assert short <= table.efficiency(compute.Work("attention", 1.0, m=2 * s, n=2 * s, k=64)) <= curve.max_eff


def test_every_gpu_table_has_its_sm_count_and_the_cpu_none():
    """The SM counts of the published datasheets/whitepapers; a 16-bit tile where the table gives one (B200: none,
    its source says why), no tile on fp32 (the CUDA cores' SGEMM) nor on any CPU or unnamed device."""
    want = {"a100": 108, "h100": 132, "h200": 132, "b200": 148, "v100": 80, "rtx3090": 82}
    for kind, sms in want.items():
        table = compute.load_table(kind)
        assert table.sms == sms and "sms" in table.sources and "matmul tile" in table.sources
        assert table.curve("matmul", "fp32").tile is None
        assert table.curve("matmul", "fp16").tile == (None if kind == "b200" else (256, 128))
    for kind in ("cpu", "generic"):
        table = compute.load_table(kind)
        assert table.sms is None and all(c.tile is None for c in table.matmul.values())


def test_the_wave_bound_is_nvidias_wave_and_tile_quantization():
    """On an A100 (108 SMs, 256 x 128 tiles): QKV of Fig. 16's 91B at t = 8, [2048, 10240] x [10240, 3840], is 240
    tiles, 3 waves of 108 (74% busy): its efficiency is max_eff s(k) 240 / 324, below the curve; at b = 2 (m = 4096)
    480 tiles in 5 waves (89%). 8192^3 (the curve's fit) fills 19 waves to 99.8%: the curve binds, unchanged. One
    wave or less, and an output narrower than a tile (attention's PV at head dim 64), are the curve's (cuBLAS's
    smaller tiles, not given). The output is quantized in whichever orientation needs fewer waves."""
    table = compute.load_table("a100")
    curve = table.curve("matmul", "bf16")
    eff = lambda m, n, k: table.efficiency(compute.Work("matmul", 2.0 * m * n * k, m=m, n=n, k=k, dtype="bf16"))  # noqa: E731
    s = lambda x: x / (x + curve.half)  # noqa: E731
    assert eff(2048, 3840, 10240) == pytest.approx(curve.max_eff * s(10240) * 240 / 324)
    assert eff(2048, 3840, 10240) < 0.85 * curve(2048, 3840, 10240)
    assert eff(4096, 3840, 10240) == pytest.approx(curve.max_eff * s(10240) * 480 / 540)
    assert eff(8192, 8192, 8192) == curve(8192, 8192, 8192) == pytest.approx(0.737, abs=5e-4)
    assert eff(2048, 1536, 4096) == curve(2048, 1536, 4096)  # 8 x 12 = 96 tiles: one wave
    assert eff(32 * 2048, 64, 2048) == curve(32 * 2048, 64, 2048)  # 64 wide: not a 256 x 128 tile's GEMM
    # 2304 x 1408: 9 x 11 = 99 tiles of 256 x 128 (1 wave) beside 18 x 6 = 108 of 128 x 256 (1 wave): no bound;
    # 2560 x 1408: 110 (2 waves) beside 20 x 6 = 120 (2 waves) -> 2560 * 1408 / (216 * 32768) busy
    assert eff(2304, 1408, 4096) == curve(2304, 1408, 4096)
    assert eff(2560, 1408, 4096) == pytest.approx(curve.max_eff * s(4096) * 2560 * 1408 / (216 * 256 * 128))
    # 3072 x 1152: 12 x 9 = 108 tiles (one wave) one way, 24 x 5 = 120 (two) the other: the one wave's
    assert eff(3072, 1152, 4096) == eff(1152, 3072, 4096) == curve(3072, 1152, 4096)


@pytest.mark.parametrize("kind", [k for k in GPU_KINDS if k != "b200"])
def test_a_gemm_never_takes_less_time_as_it_grows(kind):
    """More work never takes less time: seconds of [m, k] x [k, n] (FLOPs 2 m n k, bytes of its three tensors)
    never fall as m, n or k grows, swept in steps that cross every tile and wave boundary of transformer-sized
    GEMMs, though the efficiency does fall (a wave begun nearly empty); the backward (``gradient_works``) the same."""
    dev = compute.Device({"bf16": 312e12, "fp16": 312e12}, 2e12, compute.load_table(kind))
    dtype = "fp16"

    def work(m, n, k):
        return compute.Work("matmul", 2.0 * m * n * k, 2.0 * (m * k + k * n + m * n), m, n, k, dtype)

    fell = 0
    for fixed in ((2048, 3840), (4096, 1280), (512, 10240), (8192, 8192)):
        for axis in range(3):
            prev_t = prev_b = prev_e = None
            for x in range(64, 12289, 64):
                dims = list(fixed)
                dims.insert(axis, x)
                w = work(*dims)
                t, b, e = compute.seconds(w, dev), compute.backward_seconds(w, dev), compute.efficiency(w, dev)
                if prev_t is not None:
                    # on a plateau (the same waves) the seconds are equal but for float rounding
                    assert t >= prev_t * (1 - 1e-12) and b >= prev_b * (1 - 1e-12), (kind, dims)
                    fell += e < prev_e
                prev_t, prev_b, prev_e = t, b, e
    assert fell > 0  # the efficiency is not monotone: the seconds are


def test_the_backward_prices_each_gradient_matmul_at_its_own_shape():
    """A matmul's backward is its two gradient matmuls (output m x k, and the weight's k x n), each at its own wave
    bound: QKV of the 91B at t = 8 (output 2048 x 3840, 3 waves, 74% busy) has gradients 2048 x 10240 (640 tiles, 6
    waves) and 10240 x 3840 (1200 tiles, 12 waves), cheaper than twice its forward; the search's and the ILP's
    weight-gradient time is the second's. Without a tile (the CPU's table) the backward is twice the forward."""
    dev = compute.device_of(ClusterSpec.load("dgx-a100"))
    qkv = compute.Work("matmul", 2.0 * 2048 * 3840 * 10240, 0.0, 2048, 3840, 10240, "bf16")
    dgrad, wgrad = compute.gradient_works(qkv)
    assert (dgrad.m, dgrad.n, dgrad.k) == (2048, 10240, 3840) and (wgrad.m, wgrad.n, wgrad.k) == (10240, 3840, 2048)
    back = compute.backward_seconds(qkv, dev)
    assert back == pytest.approx(compute.seconds(dgrad, dev) + compute.seconds(wgrad, dev))
    assert back < 0.9 * 2 * compute.seconds(qkv, dev)
    assert compute.weight_grad_seconds(qkv, dev) == compute.seconds(wgrad, dev)
    assert compute.train_seconds(qkv, dev) == compute.seconds(qkv, dev) + back
    cpu = compute.device_of(ClusterSpec.load("local-cpu"))
    w = dataclasses.replace(qkv, m=96, n=200, k=72, flops=2.0 * 96 * 200 * 72, dtype="fp32")
    assert compute.backward_seconds(w, cpu) == pytest.approx(2 * compute.seconds(w, cpu), rel=1e-12)
    assert compute.weight_grad_seconds(w, cpu) == pytest.approx(compute.seconds(w, cpu), rel=1e-12)


def test_a_flat_curve_is_rejected_as_a_table_error():
    from autopar.errors import ClusterSpecError

    good = compute.load_table("a100").to_dict()
    with pytest.raises(ClusterSpecError, match="max_eff"):
        compute.table_from_dict({**good, "matmul": {"bf16": {"max_eff": 1.5, "half": 1}}})
    again = compute.table_from_dict(good)  # the SM count and the tiles round-trip through the file form
    assert again.sms == 108 and again.matmul == compute.load_table("a100").matmul
    for bad in ({"sms": 0}, {"sms": "108"}, {"matmul": {"bf16": {"max_eff": 0.7, "half": 128, "tile": [256]}}}):
        with pytest.raises(ClusterSpecError, match="sms|tile"):
            compute.table_from_dict({**good, **bad})
    with pytest.raises(ClusterSpecError, match="attention curve has none"):
        compute.table_from_dict({**good, "attention": {"default": {"max_eff": 0.7, "half": 1, "tile": [128, 128]}}})
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
    gelu = compute.Work("elementwise", 1e6, 8e6, dtype="fp32", ops=0, rated=(("transcendental", 1.0),))
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
        secs = [
            compute.seconds(compute.Work("elementwise", f, 4.0 * f, ops=1, rated=((cls, 1.0),)), dev) for f in sizes
        ]
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
    assert compute.op_work(
        SimpleNamespace(target="aten.gelu", flops=8, input_refs=lambda: [], types=()), {}, "fp32"
    ).rated == (("transcendental", 1.0),)


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
