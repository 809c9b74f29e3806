"""Megatron-style sequence parallelism (Korthikanti et al. 2022) is what the ILP picks when activation memory binds.

A small LLaMA (one layer, hidden 32, a sequence of 64, a batch of one row, so the only token dim a
tensor-parallel rank can split is the sequence) is planned on tp=2 with Megatron's weight layout fixed
(``megatron_options``: column/row-parallel projections, vocabulary-parallel embedding and head; every
activation placed by the ILP, objective ``time``, priced on the default ``local-cpu`` spec):

- without a budget the plan is plain Megatron: the row-parallel outputs are all-reduced and the RMS
  norms run replicated on both ranks;
- with a budget of 87% of that plan's predicted memory per device, the row-parallel outputs (and the
  vocabulary-parallel embedding's) are reduce-scattered onto a sequence shard (``S(1)`` of
  ``[batch, seq, hidden]``), every RMS norm runs on its half of the sequence, and the sequence is
  all-gathered before the next column-parallel projection: no activation is all-reduced any more (the
  one all-reduce left is the scalar loss's).

In both plans the residual adds sum the row-parallel partial sums before the one collective of their region
(``Partial`` placements), not on a sequence shard as in Megatron; an add saves nothing for its backward, so
where it runs costs no activation memory. The planned program has no dropout (LLaMA's is off).

Then the sequence-parallel plan trains two AdamW steps in float64 on simulated ranks
(``autopar/check/simtrain.py``) against the model in one process, every loss and state-dict entry to
``TOL``. Reducing one of its reduce-scatters by ``avg`` in place of ``sum`` fails the loss check (tried by hand).

Why it does not pay without a budget: autopar's sequence-parallel regions communicate more than
Megatron's. The all-gather before a column-parallel projection keeps the local shard in its backward,
and the gradient of the gathered (replicated) input is all-reduced by a separate ``grad_all_reduce``
(Megatron's f), where Megatron's sequence parallelism reduce-scatters it (half the bytes); so each region
costs a reduce-scatter, an all-gather and an all-reduce's backward where Megatron's costs two
all-gather/reduce-scatter pairs, and at this size the ILP only takes it when the memory it saves is needed.
(A larger model priced on ``local-cpu``, hidden 256 and a sequence of 512, takes it without a budget too: the
step time it saves there outweighs the bytes; BENCHMARKS.md, "Sequence parallelism".)

Cost: about 30 s on a loaded 2-core machine (two plans and two simulated steps).
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.check.float64 import Float64Mode
from autopar.check.simtrain import SimCompiled
from autopar.ir.core import MeshSpec, Partial, Replicate, Shard
from autopar.passes.capture import capture
from autopar.passes.flow import FLOW, FlowOptions, plan_program
from autopar.passes.manager import PassManager
from autopar.passes.shard import ShardOptions
from autopar.solver.sharding.baselines import megatron_options
from tests.exactness import TOL, float64_model, loss_error, make_optimizer, state_error, train

transformers = pytest.importorskip("transformers")

TP = MeshSpec((("tp", 2),))
SEQ, HIDDEN, VOCAB = 64, 32, 64
BUDGET_FRACTION = 0.87  # of the unbudgeted plan's predicted bytes per device: the smallest that fits is ~86%


def small_llama() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = float64_model(transformers.LlamaForCausalLM(config))
    g = torch.Generator().manual_seed(1)
    batch = {n: torch.randint(3, VOCAB, (1, SEQ), generator=g) for n in ("input_ids", "labels")}
    return model, batch


def plan(captured, lowered, budget: float | None):
    """The tp=2 plan with Megatron's weights fixed and the activations the ILP's, within ``budget`` bytes."""
    opts = megatron_options(lowered, ShardOptions(objective="time", budget_bytes=budget))
    return plan_program(captured, TP, FlowOptions(shard=opts, cache=False))


def norm_placements(prog) -> list:
    """The tp placement of every RMS norm's ``[batch, seq, hidden]`` square and its ``[batch, seq, 1]`` mean + eps."""
    shapes = {(1, SEQ, HIDDEN): "aten.pow.Tensor_Scalar", (1, SEQ, 1): "aten.add.Tensor"}
    return [op.types[0].placements[0] for op in prog.ops if shapes.get(op.types[0].shape) == op.target]


def residual_adds(prog) -> list:
    """The tp placement of every residual add (two ``[batch, seq, hidden]`` activations summed)."""
    shape = (1, SEQ, HIDDEN)
    types = {r: t for op in prog.ops for r, t in zip(op.results, op.types)}
    return [
        op.types[0].placements[0] for op in prog.ops
        if op.target == "aten.add.Tensor" and op.types[0].shape == shape and len(op.input_refs()) == 2
        and all(r.name in types and types[r.name].shape == shape for r in op.input_refs())
    ]  # fmt: skip


def collectives(prog, target: str, rank: int | None = None) -> list:
    return [op for op in prog.ops if op.target == target and (rank is None or len(op.types[0].shape) == rank)]


def test_sequence_parallel_when_activation_memory_binds_and_exact():
    model, batch = small_llama()
    reference = copy.deepcopy(model)
    captured = capture(model, (), batch)
    lowered = PassManager(FLOW, options={"lower": TP}).run(captured, start="lower", stop="lower")

    free = plan(captured, lowered, None)
    assert norm_placements(free.sharded) == [Replicate()] * 6  # 3 norms: each computed whole on both ranks
    assert len(collectives(free.sharded, "all_reduce", rank=3)) == 3  # embedding, attention out, MLP down
    assert not collectives(free.sharded, "reduce_scatter", rank=3)

    budget = BUDGET_FRACTION * free.shard_result.memory_bytes
    sp = plan(captured, lowered, budget)
    assert sp.shard_result.memory_bytes <= budget
    assert norm_placements(sp.sharded) == [Shard(1)] * 6  # every norm on its half of the sequence
    scatters = collectives(sp.sharded, "reduce_scatter", rank=3)  # in place of the three all-reduces
    assert len(scatters) == 3 and all(op.types[0].placements == (Shard(1),) for op in scatters)
    assert not collectives(sp.sharded, "all_reduce", rank=3)  # only the scalar loss is all-reduced
    gathers = collectives(sp.sharded, "all_gather", rank=3)  # the sequence, before q/k/v, the MLP and the head
    assert [op.kwargs["dim"] for op in gathers] == [1, 1, 1], [op.kwargs for op in gathers]
    rows = [op for op in sp.sharded.ops if op.target == "aten.linear" and op.types[0].placements == (Partial(),)]
    assert len(rows) == 2  # the row-parallel projections: Megatron's tensor parallelism is still there
    # the residual adds sum the row-parallel partial sums before the region's collective, in both plans
    assert residual_adds(sp.sharded) == residual_adds(free.sharded) == [Partial()] * 2
    assert sp.shard_result.comm_bytes > free.shard_result.comm_bytes  # why the unbudgeted plan does not take it

    sim = SimCompiled.of(model, TP, (), batch, sharded=sp.sharded, float64=True)
    make_optimizer("adamw", sim)
    losses = torch.tensor([[float(x) for x in sim.train_step(**batch)] for _ in range(2)], dtype=torch.float64)
    with Float64Mode():  # the model's float32 RMS norm and rotary upcasts in float64, as the programs
        ref = train(reference, [batch, batch], "adamw")
    assert (losses == losses[:, :1]).all(), f"the ranks' losses differ: {losses}"
    assert loss_error(losses[:, 0], ref) < TOL, (losses[:, 0], ref)
    err, where, missing = state_error(sim.full_state_dict(), reference)
    assert not missing and err < TOL, (err, where, missing)
