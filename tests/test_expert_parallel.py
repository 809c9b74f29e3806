"""Expert parallelism (``solver/sharding/experts.py``, ``passes/experts.py``, ``runtime/comm/all_to_all.py``):
tiny Mixtral, Qwen3-MoE, OLMoE and Qwen2-MoE (a shared expert beside the routed ones) planned on an ``ep``
mesh train exactly as one process, with each rank holding E/n experts and the token dispatch and combine as
all-to-alls in every rank's program, whose calls and bytes per step are those the program says.

The first tests use Hugging Face's ``batched_mm`` experts kernel (``small_families.moe(family, "batched_mm")``):
it gathers each row's expert matrices with ``aten.index.Tensor``, the op the expert-parallel strategy
splits. The default ``grouped_mm`` kernel (and the eager loop, captured through it) lowers to a grouped matmul
over tokens sorted by expert, expert-parallel inside the op (``expert_grouped_mm``): tested at the end.

Training runs on simulated ranks (``autopar/check/simtrain.py``) in float64 against the model in one
process, two SGD steps, every loss and parameter to ``TOL``; one spawned gloo run
(``test_gloo_dispatch_matches_the_simulator``) checks the real ``all_to_all_single`` with uneven splits.
``test_dropping_the_combine_breaks_training`` shows the exactness check failing on a broken rewrite.
"""

from __future__ import annotations

import copy
import functools
import threading
from dataclasses import replace

import pytest
import torch

from autopar.check.float64 import Float64Mode
from autopar.check.simtrain import SimCompiled
from autopar.check.step import check_model
from autopar.errors import PipelineError
from autopar.ir.core import MeshSpec, R, Shard
from autopar.ir.parser import parse
from autopar.ir.printer import print_program
from autopar.models.small_families import _MOE_CONFIGS, _lm, moe
from autopar.passes import experts as experts_pass
from autopar.passes.capture import capture
from autopar.passes.collectives import insert_collectives
from autopar.passes.experts import COMBINE, DISPATCH, GROUPED_DISPATCH, routed_values
from autopar.passes.lower import lower
from autopar.passes.shard import ShardOptions, format_placements, required_inputs, shard
from autopar.passes.transfers import insert_transfers
from autopar.runtime.build import codegen as codegen_module
from autopar.runtime.comm import all_to_all as a2a
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.cost import CostModel, TrainingSetup
from autopar.solver.sharding.experts import (
    ALL_TO_ALLS_PER_GROUPED_MM,
    EXPERT_GROUPED_MM,
    GROUPED_COMBINE,
    grouped_expert_axes,
)
from tests._dist import run_distributed
from tests.exactness import (
    TOL,
    assert_sim_trains_as_one_process,
    float64_model,
    loss_error,
    make_optimizer,
    state_error,
    train,
)

EP = MeshSpec((("ep", 2),))
EP_TP = MeshSpec((("ep", 2), ("tp", 2)))
PP_EP = MeshSpec((("pp", 2), ("ep", 2)))
DP_EP = MeshSpec((("dp", 2), ("ep", 2)))
EP_DP = MeshSpec((("ep", 2), ("dp", 2)))  # ep the outer axis of the rows' blocks (ep ranks hold blocks 2 apart)
MEMORY = ShardOptions(objective="memory")

FAMILY = {
    "mixtral": moe("mixtral", "batched_mm"),
    "qwen3_moe": _lm(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=32, router_aux_loss_coef=0.0, experts_implementation="batched_mm",
    ),
    "olmoe": _lm(
        "OlmoeConfig", "OlmoeForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, router_aux_loss_coef=0.0, experts_implementation="batched_mm",
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    ),
    "qwen2_moe": _lm(  # a shared expert beside the routed ones
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        router_aux_loss_coef=0.0, experts_implementation="batched_mm",
    ),
}  # fmt: skip


def _model(family: str):
    torch.manual_seed(0)
    model, kwargs = FAMILY[family](torch.Generator().manual_seed(1))
    model = float64_model(model)
    return model, {k: v.double() if v.is_floating_point() else v for k, v in kwargs.items()}


def _expert_tables(prog) -> list:
    return [v for v in prog.params if v.name.endswith(("gate_up_proj", "down_proj"))]


def _sim(model, kwargs, mesh: MeshSpec) -> SimCompiled:
    return SimCompiled.of(model, mesh, (), kwargs, options=MEMORY, float64=True)


@pytest.mark.parametrize(
    ("family", "mesh", "zero"),
    [
        ("mixtral", EP, 0),
        ("qwen3_moe", EP, 0),
        ("olmoe", EP, 0),
        ("qwen2_moe", EP, 0),
        ("mixtral", EP_TP, 0),
        ("mixtral", DP_EP, 2),
    ],  # fmt: skip
)
def test_moe_trains_exactly_with_experts_split_over_ep(family: str, mesh: MeshSpec, zero: int) -> None:
    """Two SGD steps on simulated ranks equal two in one process (float64, every loss and parameter to
    ``TOL``), the plan splitting every expert table over ``ep`` (each rank holds E/2 experts) and every rank's
    program dispatching and combining; on dp=2 x ep=2 with ZeRO-2 over dp."""
    model, kwargs = _model(family)
    reference = copy.deepcopy(model)
    options = replace(MEMORY, setup=TrainingSetup(optimizer="sgd", zero=zero)) if zero else MEMORY
    sim = SimCompiled.of(model, mesh, (), kwargs, options=options, float64=True)
    prog = sim.modules[0].program
    ep = mesh.index("ep")
    tables = _expert_tables(prog)
    assert tables and all(t.type.placements[ep] == Shard(0) for t in tables), [str(t.type) for t in tables]
    for module in sim.modules:  # each rank holds E/2 experts of every table
        local = dict(module.named_parameters())
        for t in tables:
            assert local[t.name].shape[0] == t.type.shape[0] // 2, (t.name, local[t.name].shape)
    layers = len(tables) // 2  # gate/up and down per MoE layer
    for module in sim.modules:  # every rank's program: per layer the rows and their local experts dispatched
        targets = [op.target for op in module.train_program.ops]
        assert targets.count(COMBINE) >= layers and targets.count(DISPATCH) >= 2 * layers, targets
    make_optimizer("sgd", sim)
    losses = assert_sim_trains_as_one_process(sim, reference, kwargs, "sgd")
    assert (losses == losses[:, :1]).all(), f"the ranks' losses differ: {losses}"


class _Recorder:
    """Stands in for ``torch.distributed`` in ``runtime/comm/all_to_all.py``: records every
    ``all_to_all_single`` (global rank, bytes sent, bytes received, the split lists) and runs it."""

    def __init__(self, real):
        self.real, self.calls, self.lock = real, {}, threading.Lock()

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        rank = group.rv.ranks[group.member]  # a simulated group: its member's global rank
        with self.lock:
            self.calls.setdefault(rank, []).append((input.nbytes, output.nbytes, input_split_sizes))
        return self.real.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)


def test_each_ranks_all_to_alls_are_the_programs(monkeypatch) -> None:
    """One training step of Mixtral on ep=2: each rank runs one exchange of counts per routing (n integers),
    one all-to-all per dispatch and combine of its program forward and one per float one backward, in the
    same order on every rank; each moves the rows its op holds: every call's bytes sent over the ranks sum
    to the op's global bytes (dispatched rows are a permutation of all rows), as do its bytes received, and
    each rank's side of the call in its own order is the op's local bytes."""
    model, kwargs = _model("mixtral")
    sim = _sim(model, kwargs, EP)
    prog = sim.modules[0].train_program
    recorder = _Recorder(a2a.dist)
    monkeypatch.setattr(a2a, "dist", recorder)
    make_optimizer("sgd", sim)
    sim.train_step(**kwargs)

    ops = [op for op in prog.ops if op.target in (DISPATCH, COMBINE)]
    routings = {(op.args[1].name, op.kwargs["axis"]) for op in ops}
    forward = [op.types[0] for op in ops]
    backward = [op.types[0] for op in reversed(ops) if op.types[0].is_float]
    n = EP.size
    assert set(recorder.calls) == set(range(n))
    for rank, calls in recorder.calls.items():
        counts = [c for c in calls if c[0] == n * 8 and c[1] == n * 8 and c[2] is None]
        data = [c for c in calls if c not in counts]
        assert len(counts) == len(routings), (rank, len(counts), routings)
        assert len(data) == len(forward) + len(backward), (rank, len(data), len(forward), len(backward))
    steps = [forward, backward]
    data = {r: [c for c in calls if c[2] is not None] for r, calls in recorder.calls.items()}
    k = 0
    for phase, types in enumerate(steps):
        for i, t in enumerate(types):
            op = ops[i] if phase == 0 else [op for op in reversed(ops) if op.types[0].is_float][i]
            sent = sum(data[r][k][0] for r in range(n))
            received = sum(data[r][k][1] for r in range(n))
            assert sent == received == t.nbytes, (op, sent, received, t.nbytes)
            nominal_side = 0 if (op.target == DISPATCH) == (phase == 0) else 1  # the side in the rank's order
            for r in range(n):
                assert data[r][k][nominal_side] == t.local_nbytes(EP), (op, r, data[r][k], t.local_nbytes(EP))
            k += 1


def test_combining_rows_out_of_order_breaks_training(monkeypatch) -> None:
    """The exactness check can fail: with the combine sending each row back but not putting it at its place
    (the rows left sorted by expert rank), Mixtral on ep=2 no longer trains as one process."""

    def unsorted_back(c, y, route, axis):
        return a2a._send(c, y, axis, sum(route.send), route.send, route.recv)

    monkeypatch.setattr(a2a, "_back", unsorted_back)
    model, kwargs = _model("mixtral")
    reference = copy.deepcopy(model)
    sim = _sim(model, kwargs, EP)
    make_optimizer("sgd", sim)
    losses = torch.tensor([[float(x) for x in sim.train_step(**kwargs)] for _ in range(2)], dtype=torch.float64)
    with Float64Mode():
        ref = train(reference, [kwargs, kwargs], "sgd")
    assert loss_error(losses[:, 0], ref) > 1e3 * TOL, (losses[:, 0], ref)
    assert state_error(sim.full_state_dict(), reference)[0] > 1e3 * TOL


def _read_whole(prog, table: str, axis: int):
    """``prog`` with the gathers of ``table`` reading it whole on mesh axis ``axis`` (the shard pass's ``in``), as
    a plan may that stores it split on its experts: the program all-gathers it there and gathers locally."""
    ops = []
    for op in prog.ops:
        refs = [r.name for r in op.input_refs()]
        if op.target == "aten.index.Tensor" and refs and refs[0] == table:
            whole = required_inputs(op)[0][:axis] + (R,) + required_inputs(op)[0][axis + 1 :]
            op = op.with_(attrs={**op.attrs, "in": [format_placements(whole), *op.attrs["in"][1:]]})
        ops.append(op)
    return prog.with_(ops=tuple(ops))


@pytest.mark.parametrize("source", ["its experts", "the gathered table"])
def test_a_table_read_whole_is_gathered_on_the_experts_ranks(source: str, monkeypatch) -> None:
    """A plan that stores Mixtral's down projections split over ep but reads them whole (what the time objective
    chose for bench/expert_parallel_vs_hand.py, BENCHMARKS.md section 19) meets their gathered matrices with
    dispatched rows: instead of sending each row's gathered K x N matrix to its expert's rank (before: an
    all-gather of the table and a 3-D dispatch of 32 x 64 elements a row), the program gathers them there
    (``_Rewrite.regather``): from the rank's own experts by the local ids the gate/up table's gather already
    dispatched, the all-gather gone; or, where the table is not its split parameter gathered (forced here),
    from the gathered table by the rows' dispatched global ids. Either way no matrix is sent, and two SGD steps
    on simulated ranks equal one process (float64)."""
    if source == "the gathered table":
        monkeypatch.setattr(experts_pass._Rewrite, "_split_table", lambda self, table, route: None)
    model, kwargs = _model("mixtral")
    reference = copy.deepcopy(model)
    planned = shard(lower(capture(model, (), kwargs), EP), MEMORY).program
    downs = [t.name for t in _expert_tables(planned) if t.name.endswith("down_proj")]
    assert downs and all(t.type.placements[0] == Shard(0) for t in _expert_tables(planned))
    for name in downs:
        planned = _read_whole(planned, name, 0)
    prog = insert_collectives(planned)  # a plan file's program: the collectives and the expert dispatch in it
    gathered = [op for op in prog.ops if op.target == "all_gather" and op.input_refs()[0].name in downs]
    dispatched = [op for op in prog.ops if op.target == DISPATCH]
    matrices = [op for op in dispatched if len(op.types[0].shape) == 3 and op.types[0].shape[2] > 1]
    ids = [op for op in dispatched if op.args[0] == op.args[1]]  # the router's indices themselves
    assert not matrices, [str(op.types[0]) for op in matrices]
    # per layer the rows and their experts' ids are sent and the experts' outputs combined, nothing else: the
    # routing weights multiply the combined outputs (``_Rewrite._combine_sooner``), as the peer weighs them
    combines = [op for op in prog.ops if op.target == COMBINE]
    assert len(dispatched) == (2 if source == "its experts" else 3) * len(downs) and len(combines) == len(downs)
    if source == "its experts":
        assert not gathered and len(ids) == len(downs), [str(op) for op in ids]  # one for both tables
    else:
        assert len(gathered) == len(downs) and len(ids) == 2 * len(downs)  # local ids and global ones
    sim = SimCompiled.of(model, EP, (), kwargs, options=MEMORY, sharded=prog, float64=True)
    make_optimizer("sgd", sim)
    losses = assert_sim_trains_as_one_process(sim, reference, kwargs, "sgd")
    assert (losses == losses[:, :1]).all(), f"the ranks' losses differ: {losses}"


GLOO_CLUSTER = "local-cpu"


def _gloo_rank(rank: int, world: int) -> dict:
    """One gloo rank: Mixtral compiled on ep=2 by ``autopar.compile``, two SGD steps; the losses, the local
    experts' count and the whole state (rank 0)."""
    import autopar

    model, kwargs = _model("mixtral")
    compiled = autopar.compile(
        model, autopar.init_mesh("cpu", ep=world), kwargs=kwargs, objective="memory", cluster=GLOO_CLUSTER
    )
    losses = train(compiled, [kwargs, kwargs], "sgd")
    local = dict(compiled.named_parameters())
    experts = [local[t.name].shape[0] for t in _expert_tables(compiled.program)]
    state = compiled.full_state_dict()
    return {"losses": losses, "experts": torch.tensor(experts), "state": state if rank == 0 else {}}


def test_gloo_dispatch_matches_the_simulator() -> None:
    """The real collective: Mixtral on 2 gloo ranks (``all_to_all_single`` with uneven splits) trains as the
    same plan on simulated ranks, every loss and parameter to ``TOL`` (both run the model's own float32
    casts, so they are compared with each other, not with float64 semantics), each rank holding 2 of the 4
    experts."""
    results = run_distributed(_gloo_rank, 2)
    model, kwargs = _model("mixtral")
    options = ShardOptions(objective="memory", cluster=ClusterSpec.load(GLOO_CLUSTER))
    sim = SimCompiled.of(model, EP, (), kwargs, options=options)
    make_optimizer("sgd", sim)
    sim_losses = torch.tensor([float(sim.train_step(**kwargs)[0]) for _ in range(2)], dtype=torch.float64)
    for r in results:
        assert r["experts"].tolist() and all(e == 2 for e in r["experts"].tolist()), r["experts"]
        assert loss_error(r["losses"], sim_losses) < TOL, (r["losses"], sim_losses)
    sim_state = sim.full_state_dict()
    worst = max(
        float((v - sim_state[k]).abs().max() / sim_state[k].abs().max().clamp_min(1e-30))
        for k, v in results[0]["state"].items()
        if v.is_floating_point()
    )
    assert set(results[0]["state"]) == set(sim_state) and worst < TOL, worst


def test_check_compares_every_value_outside_the_dispatched_rows() -> None:
    """``autopar check`` (``check_model``: one float64 step of every simulated rank, value by value) agrees on
    Qwen3-MoE's ep=2 x tp=2 plan; the dispatched values (each rank holds a permutation of the rows) are
    skipped, everything else, the combined expert outputs and the expert tables' gradients included, is
    compared."""
    model, kwargs = _model("qwen3_moe")
    report = check_model(model, (), kwargs, EP_TP, options=MEMORY)
    assert report.agrees and report.max_diff < TOL, report.summary()
    routed = routed_values(report.program)
    assert routed and report.compared > 200
    assert any(op.target == COMBINE for op in report.program.ops)


def test_the_ilp_prices_what_the_program_emits_and_it_round_trips() -> None:
    """The plan's predicted communication equals its program's collectives priced one by one (the expert
    gathers' all-to-alls on the gathers, ``solver/sharding/experts.py``), and the program with its
    dispatches and combines prints and parses back to itself."""
    model, kwargs = FAMILY["mixtral"](torch.Generator().manual_seed(1))
    lowered = lower(capture(model, (), kwargs), EP)
    sharding = shard(lowered, MEMORY)
    program = insert_collectives(sharding.program)
    assert any(op.target == DISPATCH for op in program.ops)
    cost = CostModel(EP, MEMORY.setup, MEMORY.cluster).program_comm(program)
    assert (sharding.comm_bytes, sharding.comm_seconds) == pytest.approx(cost, rel=1e-9)
    assert sharding.comm_bytes > 0
    assert parse(print_program(program)) == program


@pytest.mark.parametrize("cut", ["between layers", "inside the dispatched rows"])
def test_pipeline_stages_hold_whole_dispatch_regions(cut: str) -> None:
    """pp=2 x ep=2: each stage's experts on its own pipeline rank group, cut between Qwen3-MoE's layers, trains
    exactly (two 1F1B steps of two microbatches); a stage boundary inside a dispatch's rows is refused by
    ``insert-transfers`` with a ``PipelineError`` instead of sending a data-dependent number of rows."""
    model, kwargs = _model("qwen3_moe")
    if cut == "inside the dispatched rows":
        program = insert_collectives(shard(lower(capture(model, (), kwargs), EP), MEMORY).program)
        first = next(i for i, op in enumerate(program.ops) if op.target == "aten.bmm")
        ops = tuple(op.with_(attrs={**op.attrs, "stage": int(i >= first)}) for i, op in enumerate(program.ops))
        with pytest.raises(PipelineError, match="stage boundary falls inside"):
            insert_transfers(program.with_(ops=ops, attrs={**program.attrs, "pipeline_stages": 2}))
        return
    reference = copy.deepcopy(model)
    sim = SimCompiled.of(model, PP_EP, (), kwargs, options=MEMORY, float64=True, microbatches=2, schedule="1f1b")
    prog = sim.modules[0].train_program
    stages = {op.attrs["stage"] for op in prog.ops if op.target in (DISPATCH, COMBINE)}
    assert stages == {0, 1}, stages  # both stages dispatch their own layer's tokens
    assert all(t.type.placements[0] == Shard(0) for t in _expert_tables(prog))
    make_optimizer("sgd", sim)
    assert_sim_trains_as_one_process(sim, reference, kwargs, "sgd")


# -- transformers' default experts kernel (grouped_mm) and the eager loop (captured through it) ---------------
def _kernel_model(family: str, kernel: str, layers: int = 1):
    """Tiny ``family`` (``small_families._MOE_CONFIGS``: 4 experts, top-2) with its experts computed by
    ``kernel``, in float64, and its input."""
    config, cls, cfg = _MOE_CONFIGS[family]
    cfg = dict(cfg, num_experts_per_tok=2, router_aux_loss_coef=0.0, num_hidden_layers=layers)
    torch.manual_seed(0)
    model, kwargs = _lm(config, cls, **cfg, experts_implementation=kernel)(torch.Generator().manual_seed(1))
    return float64_model(model), kwargs


def _counting(real, calls: list):
    """``real`` (a function of ``runtime/comm/all_to_all.py`` the generated code calls), appending its name and
    expert axis to ``calls`` at each call."""

    @functools.wraps(real)
    def counted(*args, **kwargs):
        calls.append((real.__name__, kwargs["axis"]))
        return real(*args, **kwargs)

    return counted


_GROUPED_CALLS = ("expert_grouped_dispatch", "expert_grouped_combine", "expert_local_grouped_mm", "expert_grouped_mm")


def _count_grouped_calls(monkeypatch, calls: list) -> None:
    """Record every call of the generated code into the grouped expert-parallel functions (``_counting``)."""
    for name in _GROUPED_CALLS:
        monkeypatch.setattr(codegen_module.experts, name, _counting(getattr(a2a, name), calls))
    monkeypatch.setattr(
        codegen_module.experts,
        "FUNCTIONS",
        {**a2a.FUNCTIONS, **{n: getattr(codegen_module.experts, n) for n in _GROUPED_CALLS[:2]}},
    )


@pytest.mark.parametrize(
    ("family", "kernel", "mesh", "zero", "layers"),
    [
        ("olmoe", "grouped_mm", EP, 0, 1),
        ("deepseek_v3", "eager", EP, 0, 1),
        ("olmoe", "grouped_mm", EP_TP, 0, 1),
        ("qwen3_moe", "grouped_mm", DP_EP, 2, 1),
        ("olmoe", "grouped_mm", PP_EP, 0, 2),
        ("olmoe", "grouped_mm", EP_DP, 0, 1),
        *(
            pytest.param(family, kernel, mesh, 0, 2 if mesh is PP_EP else 1, marks=pytest.mark.heavy)
            for family in ("olmoe", "deepseek_v3")
            for kernel in ("grouped_mm", "batched_mm", "eager")
            for mesh in (EP, EP_TP, PP_EP)
            if (family, kernel, mesh)
            not in {
                ("olmoe", "grouped_mm", EP),
                ("deepseek_v3", "eager", EP),
                ("olmoe", "grouped_mm", EP_TP),
                ("olmoe", "grouped_mm", PP_EP),
            }
        ),
    ],  # fmt: skip
)
def test_grouped_kernel_trains_exactly_with_experts_split_over_ep(
    family: str, kernel: str, mesh: MeshSpec, zero: int, layers: int, monkeypatch
) -> None:
    """transformers' default kernel (``grouped_mm``, captured as ``transformers::grouped_mm_fallback`` in
    float64) and the eager loop (captured through it): two SGD steps on simulated ranks equal two in one process
    (float64, every loss and parameter to ``TOL``) with every expert table split on its experts over ``ep`` by the
    ILP itself, nothing constrained (each rank holding E/2), every grouped matmul read expert-parallel (each
    layer's rows sent to their experts' ranks once before gate/up and back once after down), on ep=2,
    ep=2 x tp=2, dp=2 x ep=2 with ZeRO-2 over dp, and pp=2 x ep=2 (each stage's experts on its pipeline rank
    group, 1F1B over two microbatches)."""
    model, kwargs = _kernel_model(family, kernel, layers)
    reference = copy.deepcopy(model)
    setup = TrainingSetup(optimizer="sgd", zero=zero) if zero else MEMORY.setup
    options = replace(MEMORY, setup=setup)
    if mesh is EP_DP:  # the rows split on ep and dp, ep outer: an ep group's blocks are not adjacent
        options = replace(options, data_parallel="activations")
    pipelined = dict(microbatches=2, schedule="1f1b") if "pp" in mesh.names else {}
    calls: list = []
    _count_grouped_calls(monkeypatch, calls)
    sim = SimCompiled.of(model, mesh, (), kwargs, options=options, float64=True, **pipelined)
    prog = sim.modules[0].train_program
    ep = prog.mesh.index("ep")
    tables = _expert_tables(prog)
    assert len(tables) == 2 * layers and all(t.type.placements[ep] == Shard(0) for t in tables), tables
    held = {t.name: 0 for t in tables}
    for module in sim.modules:  # every table on 2 ranks of each stage (4 on ep=2 x tp=2), E/2 experts each
        local = dict(module.named_parameters())
        for t in tables:
            if t.name in local:
                held[t.name] += 1
                assert local[t.name].shape[0] == t.type.shape[0] // 2, (t.name, local[t.name].shape)
    assert all(h == mesh.size // layers for h in held.values()), held
    types = prog.types()
    grouped = [op for op in prog.ops if op.target in EXPERT_GROUPED_MM]
    if kernel == "batched_mm":  # expert-parallel gathers: the rows dispatched and combined by ops of the program
        targets = [op.target for op in prog.ops]
        assert not grouped and targets.count(COMBINE) >= layers and targets.count(DISPATCH) >= 2 * layers, targets
    else:
        assert len(grouped) == 2 * layers
    for op in grouped:
        ins = [types[r.name] for r in op.input_refs()]
        assert grouped_expert_axes(ins, [t.placements for t in ins]) == [ep], [str(t) for t in ins]
    make_optimizer("sgd", sim)
    losses = torch.tensor([[float(x) for x in sim.train_step(**kwargs)] for _ in range(2)], dtype=torch.float64)
    micro = 2 if "pp" in mesh.names else 1  # each rank's two grouped matmuls (one layer) per microbatch, 2 steps
    runs = micro * 2 * mesh.size * (kernel != "batched_mm")  # each rank's layer forwards
    assert all(axis == "ep" for _, axis in calls), calls
    assert [n for n, _ in calls].count("expert_local_grouped_mm") == 2 * runs, calls
    # one dispatch and one combine per layer, but where the plan splits the rows between the grouped matmuls on
    # tp as well (ep=2 x tp=2 under the memory objective: a reduce-scatter of gate/up's result on its rows)
    blocks = [op.target for op in prog.ops].count(GROUPED_DISPATCH) // layers if grouped else 0
    assert blocks == (2 if mesh is EP_TP else 1) * bool(grouped), (blocks, mesh)
    exchanges = {n: [m for m, _ in calls].count(n) for n in _GROUPED_CALLS[:2]}
    assert exchanges == dict.fromkeys(exchanges, blocks * runs), (exchanges, runs)
    with Float64Mode():
        ref = train(reference, [kwargs, kwargs], "sgd")
    assert (losses == losses[:, :1]).all(), f"the ranks' losses differ: {losses}"
    assert loss_error(losses[:, 0], ref) < TOL, (losses[:, 0], ref)
    err, where, missing = state_error(sim.full_state_dict(), reference)
    assert not missing and err < TOL, (err, where, missing)


def test_each_ranks_grouped_all_to_alls_are_the_programs(monkeypatch) -> None:
    """One training step of OLMoE (transformers' default grouped_mm kernel) on ep=2: each rank runs per MoE
    layer one all-to-all of its rows to their experts before gate/up and one back after down forward (the
    program's ``expert_grouped_dispatch`` and ``expert_grouped_combine``; both grouped matmuls and the
    activation between them on the dispatched rows), and the two inverse ones backward
    (``ALL_TO_ALLS_PER_GROUPED_MM`` per exchange), no exchange of counts (the offsets are whole); every call's
    bytes sent over the ranks sum to the moved value's global bytes, as do its bytes received, and each rank's
    own side of a call is the value's local bytes. The ILP's price of the grouped matmuls (each its side of the
    block, ``attrs["ep_block"]``) equals the program's dispatch and combine priced one by one."""
    model, kwargs = _kernel_model("olmoe", "grouped_mm")
    sim = SimCompiled.of(model, EP, (), kwargs, options=MEMORY, float64=True)
    prog = sim.modules[0].train_program
    types = prog.types()
    grouped = [op for op in prog.ops if op.target in EXPERT_GROUPED_MM]
    assert len(grouped) == 2 and all(op.attrs.get("ep_rows") == "dispatched" for op in grouped)
    exchanges = [op for op in prog.ops if op.target in (GROUPED_DISPATCH, GROUPED_COMBINE)]
    assert [op.target for op in exchanges] == [GROUPED_DISPATCH, GROUPED_COMBINE]
    dispatch, combine = exchanges
    assert dispatch.result == grouped[0].args[0].name and combine.args[0].name == grouped[1].result
    recorder = _Recorder(a2a.dist)
    monkeypatch.setattr(a2a, "dist", recorder)
    make_optimizer("sgd", sim)
    sim.train_step(**kwargs)

    # (the value whose rows move, whether this rank's side in its own order is the sending one), in call order
    forward = [(types[dispatch.args[0].name], 0), (types[combine.args[0].name], 1)]
    backward = [(t, 1 - side) for t, side in reversed(forward)]
    expected = forward + backward
    assert len(expected) == ALL_TO_ALLS_PER_GROUPED_MM * len(exchanges)
    assert set(recorder.calls) == set(range(EP.size))
    for rank, calls in recorder.calls.items():
        assert len(calls) == len(expected), (rank, len(calls), len(expected))
    for k, (t, side) in enumerate(expected):
        sent = sum(recorder.calls[r][k][0] for r in range(EP.size))
        received = sum(recorder.calls[r][k][1] for r in range(EP.size))
        assert sent == received == t.nbytes, (k, sent, received, t.nbytes)
        for r in range(EP.size):
            assert recorder.calls[r][k][side] == t.local_nbytes(EP), (k, r, recorder.calls[r][k], t.local_nbytes(EP))

    lowered = lower(capture(model, (), kwargs), EP)
    blocks = [op.attrs.get("ep_block") for op in lowered.ops if op.target in EXPERT_GROUPED_MM]
    assert blocks == ["first", "last"], blocks
    cost = CostModel(EP, MEMORY.setup, MEMORY.cluster)
    ilp = [  # the grouped matmuls as the ILP prices them, each its side of the block
        cost.inherent(op.target, [types[r.name] for r in op.input_refs()], [types[r.name].placements
                      for r in op.input_refs()], op.with_(attrs={"ep_block": b}))
        for op, b in zip(grouped, blocks)
    ]  # fmt: skip
    emitted = [cost.inherent(op.target, [types[r.name] for r in op.input_refs()], None, op) for op in exchanges]
    assert [x for p in ilp for x in p] == pytest.approx([x for p in emitted for x in p], rel=1e-12), (ilp, emitted)
    assert all(b > 0 for b, _ in emitted), emitted
    assert all(cost.inherent(op.target, [types[r.name] for r in op.input_refs()], [types[r.name].placements
               for r in op.input_refs()], op) == (0.0, 0.0) for op in grouped)  # fmt: skip


# -- token dropping: an expert capacity (GShard, Switch) -------------------------------------------------------
def _dropping(real, capacity: int):
    """transformers' ``_grouped_mm`` (rows sorted by expert, ``offs`` the groups' cumulative ends) with each
    expert's rows after its first ``capacity`` given a zero result: the single-process reference of a capacity."""

    def grouped_mm(input, weight, offs):
        out = real(input, weight, offs=offs)
        ends = offs.long()
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        starts = torch.repeat_interleave(ends - counts, counts)  # each row's group start, rows up to ends[-1]
        position = torch.arange(int(ends[-1])) - starts
        keep = torch.zeros(out.shape[0], dtype=torch.bool)
        keep[: int(ends[-1])] = position < capacity
        return out * keep.unsqueeze(1).to(out.dtype)

    return grouped_mm


@pytest.mark.parametrize(
    ("mesh", "factor"),
    [(EP, 0.75), pytest.param(MeshSpec((("dp", 2),)), 0.75, marks=pytest.mark.heavy)],
)
def test_capacity_factor_drops_the_same_rows_as_one_process(mesh: MeshSpec, factor: float, monkeypatch) -> None:
    """OLMoE (grouped_mm) with ``capacity_factor=0.75``: every grouped matmul keeps ceil(0.75 x rows / experts)
    rows per expert (``attrs["capacity"]``), the rest dropped; two SGD steps on ep=2 (the rows over capacity
    never sent: the dispatch sends fewer rows than the block holds) and, heavy, on dp=2 (masked in place) equal
    one process whose grouped matmuls drop the same rows (float64, ``TOL``), and that reference differs from
    the dropless one, so the dropping is real. ``capacity_factor=None`` (every other test) is dropless."""
    import transformers.integrations.moe as hf_moe

    model, kwargs = _kernel_model("olmoe", "grouped_mm")
    reference, dropless = copy.deepcopy(model), copy.deepcopy(model)
    options = replace(MEMORY, capacity_factor=factor)
    if "dp" in mesh.names:
        options = replace(options, data_parallel="activations")
    recorder = _Recorder(a2a.dist)
    monkeypatch.setattr(a2a, "dist", recorder)
    sim = SimCompiled.of(model, mesh, (), kwargs, options=options, float64=True)
    prog = sim.modules[0].train_program
    types = prog.types()
    grouped = [op for op in prog.ops if op.target in EXPERT_GROUPED_MM]
    rows, experts = types[grouped[0].args[0].name].shape[0], types[grouped[0].args[1].name].shape[0]
    capacity = -(-3 * rows // (4 * experts))  # ceil(0.75 rows / experts)
    assert len(grouped) == 2 and all(op.attrs.get("capacity") == capacity for op in grouped), grouped
    if "ep" in mesh.names:
        assert [op.target for op in prog.ops].count(GROUPED_DISPATCH) == 1
    make_optimizer("sgd", sim)
    losses = torch.tensor([[float(x) for x in sim.train_step(**kwargs)] for _ in range(2)], dtype=torch.float64)
    if "ep" in mesh.names:  # the step's first call: the dispatch forward, fewer rows than the ranks' blocks hold
        sent = sum(recorder.calls[r][0][0] for r in range(mesh.size))
        assert sent < types[grouped[0].args[0].name].nbytes, sent
    with Float64Mode():
        plain = train(dropless, [kwargs, kwargs], "sgd")
        with monkeypatch.context() as m:
            m.setattr(hf_moe, "_grouped_mm", _dropping(hf_moe._grouped_mm, capacity))
            ref = train(reference, [kwargs, kwargs], "sgd")
    assert loss_error(ref, plain) > 1e3 * TOL, (ref, plain)  # rows were dropped
    assert (losses == losses[:, :1]).all(), f"the ranks' losses differ: {losses}"
    assert loss_error(losses[:, 0], ref) < TOL, (losses[:, 0], ref)
    err, where, missing = state_error(sim.full_state_dict(), reference)
    assert not missing and err < TOL, (err, where, missing)


@pytest.mark.heavy
def test_zero2_over_dp_and_ep_trains_exactly() -> None:
    """ZeRO-2 over the ep axis as well as dp (``zero_axes=("dp", "ep")``) on dp=2 x ep=2, Qwen3-MoE with the
    grouped_mm kernel, AdamW: the parameters the plan replicates on both axes with their gradients summed there
    are one flat vector whose optimizer states each rank holds a quarter of, the experts split on ep; two steps
    equal one process (float64, ``TOL``). (Parameters whose gradient is not summed over every ZeRO axis, the
    expert tables split on ep among them, stay outside ZeRO, unsharded: ``runtime/grads/zero.py``.)"""
    from autopar.runtime.grads.zero import ZeroOptimizer

    model, kwargs = _kernel_model("qwen3_moe", "grouped_mm")
    reference = copy.deepcopy(model)
    options = replace(MEMORY, setup=TrainingSetup(optimizer="adam", zero=2, zero_axes=("dp", "ep")))
    sim = SimCompiled.of(model, DP_EP, (), kwargs, options=options, float64=True)
    ep = DP_EP.index("ep")
    assert all(t.type.placements[ep] == Shard(0) for t in _expert_tables(sim.modules[0].program))
    make_optimizer("adamw", sim)
    for module in sim.modules:
        opt = module._optimizer
        assert isinstance(opt, ZeroOptimizer) and opt.zero_axes == ("dp", "ep"), opt
        flat = opt.flats[0]
        assert flat.params and flat.master.numel() * 4 == flat.padded, (flat.master.numel(), flat.padded)
    assert_sim_trains_as_one_process(sim, reference, kwargs, "adamw")
