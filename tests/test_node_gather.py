"""ZeRO-3's hierarchical gathers across nodes (``runtime/grads/node_gather.py``, MiCS Sec. 3.3): training equals one
process in float64, the collectives really ran per node (inter-node among one rank per node, then intra-node), and
every gathered unit is bit for bit the flat gather's. On simulated ranks (8 of them, "nodes" of 2 or 4 through
``LOCAL_WORLD_SIZE``) and on 4 gloo processes as 2 nodes of 2 (one spawn). Only where the plan says so
(``TrainingSetup.hierarchical_gather``): without it the gathers stay flat whatever the ranks per node."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from autopar.check.simtrain import SimCompiled
from autopar.config import TrainConfig
from autopar.errors import ConfigError
from autopar.ir.core import MeshSpec
from autopar.models.small_families import FAMILIES
from autopar.passes.shard import ShardOptions
from autopar.runtime.grads.node_gather import node_groups, ranks_per_node
from autopar.solver.sharding.cost import TrainingSetup
from tests._dist import run_distributed
from tests.exactness import TOL, assert_sim_trains_as_one_process, float64_model, make_optimizer


def _members(group) -> tuple[int, ...]:
    """The global ranks of a process group (torch's, or the rank simulator's)."""
    rv = getattr(group, "rv", None)
    return tuple(rv.ranks) if rv is not None else tuple(dist.get_process_group_ranks(group))


class _Recorder:
    """Records the member lists of every ``all_gather_single`` / ``reduce_scatter_single`` group (patched in)."""

    def __init__(self, monkeypatch=None):
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self._orig = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single")}
        for name, fn in self._orig.items():
            wrapped = self._wrap(name, fn)
            if monkeypatch is not None:
                monkeypatch.setattr(dist, name, wrapped)
            else:
                setattr(dist, name, wrapped)

    def _wrap(self, name, fn):
        def call(out, inp, group=None, async_op=False):
            self.calls.append((name, _members(group)))
            return fn(out, inp, group=group, async_op=async_op)

        return call

    def groups(self, name: str) -> set[tuple[int, ...]]:
        return {g for n, g in self.calls if n == name}


def _node_of(members: tuple[int, ...], per_node: int) -> list[int]:
    return [r // per_node for r in members]


def _assert_hierarchical(rec: _Recorder, per_node: int, group_size: int) -> None:
    """Every unit collective ran in a group of one rank per node, or of ranks of one node; none over the flat group."""
    for name in ("all_gather_single", "reduce_scatter_single"):
        groups = rec.groups(name)
        inter = {g for g in groups if len(set(_node_of(g, per_node))) == len(g)}
        intra = {g for g in groups if len(set(_node_of(g, per_node))) == 1}
        assert inter and intra and groups == inter | intra, (name, groups)
        assert all(len(g) < group_size for g in groups), (name, groups)


def _gathered_bit_equal(module) -> bool:
    """Each unit gathered hierarchically equals the flat gather of the same slices, bit for bit (a collective)."""
    z3 = module.zero3
    assert z3.node_groups is not None
    hier = [z3._finish(z3._start(u)) for u in range(len(z3.units))]
    saved, z3.node_groups = z3.node_groups, None
    try:
        flat = [z3._finish(z3._start(u)) for u in range(len(z3.units))]
    finally:
        z3.node_groups = saved
    return bool(hier) and all(torch.equal(a, b) for a, b in zip(hier, flat))


# (mesh, setup, ranks per node, ZeRO group size)
SIM_RUNS = {
    "zero3-dp8-nodes-of-2": ((("dp", 8),), TrainingSetup(zero=3, hierarchical_gather=True), 2, 8),
    # two ZeRO axes, the outer crossing the nodes of 4, the inner inside one: the axes' own groups, outer first
    "zero3-dp2xdp4-nodes-of-4": (
        (("dpo", 2), ("dp", 4)),
        TrainingSetup(zero=3, zero_axes=("dpo", "dp"), hierarchical_gather=True),
        4,
        8,
    ),
    # MiCS: partition groups of 4 spanning 2 nodes of 2, replicated twice (the 2-hop gradient sync after)
    "mics4-dpr2-nodes-of-2": (
        (("dpr", 2), ("dp", 4)),
        TrainingSetup(zero=3, zero_axes=("dpr", "dp"), mics_group=4, hierarchical_gather=True),
        2,
        4,
    ),
}


@pytest.mark.parametrize("run", list(SIM_RUNS))
def test_hierarchical_gathers_train_as_one_process_on_simulated_ranks(run: str, monkeypatch) -> None:
    """Two AdamW steps of tiny GPT-2 in float64 on 8 simulated ranks with ``LOCAL_WORLD_SIZE`` set: equal to one
    process (``TOL``), every unit gather and gradient reduce-scatter ran per node, and every gathered unit equals
    the flat gather bit for bit. About 2 s each."""
    axes, setup, per_node, group_size = SIM_RUNS[run]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    torch.manual_seed(0)
    model, batch = FAMILIES["gpt2"](torch.Generator().manual_seed(1))
    model = float64_model(model)
    reference = copy.deepcopy(model)
    sim = SimCompiled.of(model, MeshSpec(axes), (), batch, options=ShardOptions(setup=setup), float64=True)
    sizes = sim.run(lambda m: (m.zero3.node_groups.nodes, m.zero3.node_groups.per_node))
    assert set(sizes) == {(group_size // per_node, per_node)}, sizes
    if run == "zero3-dp2xdp4-nodes-of-4":  # the subgroups are the axes' own (no new communicator)
        assert all(sim.run(lambda m: (m.zero3.node_groups.inter is m.comm.groups["dpo"]) and
                           (m.zero3.node_groups.intra is m.comm.groups["dp"])))  # fmt: skip
    make_optimizer("adamw", sim)
    rec = _Recorder(monkeypatch)
    assert_sim_trains_as_one_process(sim, reference, batch, "adamw")
    _assert_hierarchical(rec, per_node, group_size)
    assert all(sim.run(_gathered_bit_equal))


def test_without_the_plans_decision_the_gathers_stay_flat_on_simulated_ranks(monkeypatch) -> None:
    """The same dp=8 ZeRO-3 run with ``LOCAL_WORLD_SIZE=2`` but ``hierarchical_gather=False`` (what a plan on a
    cluster whose rails are fast decides, ``ClusterSpec.hierarchical_pays``): no node groups, every unit gather and
    reduce-scatter over the whole group of 8."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    model, batch = FAMILIES["gpt2"](torch.Generator().manual_seed(1))
    options = ShardOptions(setup=TrainingSetup(zero=3))
    sim = SimCompiled.of(float64_model(model), MeshSpec((("dp", 8),)), (), batch, options=options, float64=True)
    assert sim.run(lambda m: m.zero3.node_groups) == [None] * 8
    rec = _Recorder(monkeypatch)
    sim.train_step(**batch)
    for name in ("all_gather_single", "reduce_scatter_single"):
        assert rec.groups(name) == {tuple(range(8))}, (name, rec.groups(name))


def test_a_group_inside_one_node_or_one_rank_per_node_stays_flat() -> None:
    """No hierarchy where it would change nothing: the group inside one node, one of its ranks per node, or nodes
    holding unequal shares of it; and none without a ranks-per-node figure."""
    from autopar.runtime.sim.ranksim import SimWorld

    world = SimWorld(MeshSpec((("dp", 4), ("tp", 2))))

    def groups(per_node, axes=("dp",)):
        return world.run(lambda r: node_groups(world.comm(r), axes, per_node, world.device_mesh(r)))

    assert groups(None) == [None] * 8
    assert groups(8) == [None] * 8  # one node
    assert groups(2) == [None] * 8  # dp ranks are 2 apart: one per node of 2
    assert groups(3) == [None] * 8  # nodes of 3 hold 2 or 1 of a group's ranks
    found = groups(4)  # 2 nodes of 4: 2 of each dp group's ranks in each
    assert all(g is not None and (g.nodes, g.per_node) == (2, 2) for g in found)
    assert {_members(g.inter) for g in found} == {(0, 4), (2, 6), (1, 5), (3, 7)}
    assert {_members(g.intra) for g in found} == {(0, 2), (4, 6), (1, 3), (5, 7)}


def test_ranks_per_node_reads_the_option_then_torchrun(monkeypatch) -> None:
    """``TrainConfig.ranks_per_node`` (the runtime's option), else ``LOCAL_WORLD_SIZE``; a bad value names itself."""
    assert TrainConfig(ranks_per_node=2).runtime_options().ranks_per_node == 2
    assert TrainConfig().runtime_options().ranks_per_node is None
    with pytest.raises(ConfigError, match="ranks_per_node"):
        TrainConfig(ranks_per_node=0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ranks_per_node(None) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node(None) == 4 and ranks_per_node(2) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
        ranks_per_node(None)
    with pytest.raises(ConfigError, match="ranks_per_node"):
        ranks_per_node(0)


def test_the_plan_decides_hierarchical_gather_from_the_cluster_and_carries_it() -> None:
    """``TrainConfig.hierarchical_gather=None``: decided where the plan is made (``decide_gathers``) by
    ``ClusterSpec.hierarchical_pays`` for the ZeRO group on the mesh: dp=16 on 2 nodes of 8 of MiCS's p3dn yes, of a
    DGX A100 no, ZeRO-2 or one node no; True/False pin it either way. A plan file's options keep it, and the config
    read back from them pins it (what ``compile(plan=...)`` runs); a value not a bool is refused by name."""
    from autopar.planner import options_dict, options_from_dict
    from autopar.solver.sharding.options import decide_gathers

    mesh = MeshSpec((("dp", 16),))
    cases = (("mics-p3dn:nodes=2", 3, 16, True), ("dgx-a100:nodes=2", 3, 16, False),
             ("mics-p3dn:nodes=2", 2, 16, False), ("mics-p3dn:nodes=2", 3, 8, False))  # fmt: skip
    for cluster, zero, dp, pays in cases:
        cfg = TrainConfig(zero=zero, cluster=cluster)
        opts = cfg.shard_options()
        assert opts.setup.hierarchical_gather is False  # undecided until the mesh is known
        on = MeshSpec((("dp", dp),))
        assert decide_gathers(opts, on, cfg.hierarchical_gather).setup.hierarchical_gather is pays, (cluster, zero, dp)
        for pinned in (True, False):
            assert decide_gathers(opts, on, pinned).setup.hierarchical_gather is pinned
    decided = decide_gathers(TrainConfig(zero=3, cluster="mics-p3dn:nodes=2").shard_options(), mesh)
    back = TrainConfig.from_shard_options(options_from_dict(options_dict(decided)))
    assert back.hierarchical_gather is True and back.training_setup().hierarchical_gather is True
    assert TrainConfig.from_dict(TrainConfig(hierarchical_gather=False).to_dict()).hierarchical_gather is False
    with pytest.raises(ConfigError, match="hierarchical_gather"):
        TrainConfig(hierarchical_gather=1)


def _gloo_ranks(rank: int, world: int) -> dict:
    """ZeRO-3 over dp=4 and over dp=2 x dp=2 on 2 "nodes" of 2 (``LOCAL_WORLD_SIZE=2``), the setup's
    ``hierarchical_gather`` pinned on: three AdamW steps of tiny GPT-2 in float64 against one process, the groups
    each collective ran in, the gathered units against the flat gather; and dp=4 with ``ranks_per_node=2`` left to
    compile's decision (priced on this one-node host: flat)."""
    import os

    from transformers import GPT2Config, GPT2LMHeadModel

    import autopar
    from tests.exactness import LogitsLoss, loss_error, state_error, train

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out = {}
    runs = (("dp4", {"dp": 4}, None), ("dp2xdp2", {"dpo": 2, "dp": 2}, ("dpo", "dp")), ("dp4-flat", {"dp": 4}, None))
    for name, axes, zero_axes in runs:
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        model = float64_model(LogitsLoss(GPT2LMHeadModel(config)))
        ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
        reference = copy.deepcopy(model)
        mesh = autopar.init_mesh("cpu", **axes)
        if name == "dp4-flat":
            compiled = autopar.compile(model, mesh, kwargs=batch, zero=3, ranks_per_node=2)
        else:
            options = ShardOptions(setup=TrainingSetup(zero=3, zero_axes=zero_axes, hierarchical_gather=True))
            compiled = autopar.compile(model, mesh, kwargs=batch, options=options)
        rec = _Recorder()
        try:
            losses = train(compiled, [batch] * 3, "adamw")
        finally:
            for n, fn in rec._orig.items():
                setattr(dist, n, fn)
        ref = train(reference, [batch] * 3, "adamw")
        err, where, missing = state_error(compiled.full_state_dict(), reference)
        calls = [(n == "all_gather_single", g) for n, g in rec.calls]
        out[name] = {
            "loss_error": torch.tensor(loss_error(losses, ref)),
            "state_error": torch.tensor(err),
            "missing": torch.tensor(len(missing)),
            "gather_groups": torch.tensor([g for is_gather, g in calls if is_gather]),
            "scatter_groups": torch.tensor([g for is_gather, g in calls if not is_gather]),
            "units": torch.tensor(len(compiled.zero3.units)),
            "bit_equal": torch.tensor(name == "dp4-flat" or _gathered_bit_equal(compiled)),
            "flat": torch.tensor(compiled.zero3.node_groups is None and not compiled.setup.hierarchical_gather),
        }
    return out


@pytest.mark.multiproc
def test_hierarchical_gathers_on_gloo_ranks_as_two_nodes_of_two():
    """4 gloo processes as 2 nodes of 2: ZeRO-3 over one axis and over two equal one process to ``TOL``, every unit
    collective ran among {0, 2} / {1, 3} (across the nodes) or {0, 1} / {2, 3} (inside one), and the gathered units
    are the flat gather's bit for bit; left to compile's decision, flat over {0, 1, 2, 3} though the ranks per node
    are given."""
    results = run_distributed(_gloo_ranks, 4)
    inter, intra = {(0, 2), (1, 3)}, {(0, 1), (2, 3)}
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert r["loss_error"] < TOL and r["state_error"] < TOL and r["missing"] == 0, (rank, name, r)
            assert bool(r["bit_equal"]) and r["units"] == 3, (rank, name, r["units"])  # the root and 2 layers
            assert bool(r["flat"]) == (name == "dp4-flat"), (rank, name)
            for kind in ("gather_groups", "scatter_groups"):
                if name == "dp4-flat":
                    assert {tuple(g) for g in r[kind].tolist()} == {(0, 1, 2, 3)}, (rank, name, r[kind])
                    continue
                groups = {tuple(g) for g in r[kind].tolist()}
                assert groups and groups <= inter | intra and groups & inter and groups & intra, (rank, name, groups)
