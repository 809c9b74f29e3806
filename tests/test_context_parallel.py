"""Context parallelism on a ``cp`` mesh axis: attention with the query sequence split over cp.

Small LLaMA, Qwen3 and Gemma2 models (one layer, hidden 32, a sequence long enough for splitting attention to
pay on the default ``local-cpu`` spec), at transformers' default attention implementation (SDPA with an explicit
causal mask; Gemma2's eager softmax(QK^T)V with its sliding window), are planned with roles by name: the cp
axis splits the token ids and labels on the sequence (``solver/sharding/context_roles.py``) and the ILP places
the rest. Each plan computes every attention on the rank's half of the queries against all-gathered keys and
values (``solver/sharding/rules/context.py``); rotary positions and masks are computed whole from ``arange``
and sliced to each rank's rows, and the mean loss is a sum over each rank's tokens over the global count.
Then two AdamW steps in float64 on simulated ranks (``autopar/check/simtrain.py``) equal the model in one
process, every loss and state-dict entry to ``TOL``: on cp=2 (each family, and LLaMA with a padding mask),
cp=2 x tp=2 and pp=2 x cp=2; LLaMA on 2 real gloo ranks equals the simulated ranks; ``autopar check`` agrees on
cp=2 x tp=2; and a hypothesis test runs every candidate of the attention rule (random sizes, boolean and
additive masks with broadcast dims, ``is_causal``) on simulated ranks against the whole op. Breaking the rule on
purpose fails it (tried by hand: a causal query split with SDPA's own mask, or every rank's mask built from
row 0, differs by ~0.1). Cost: about 35 s on a quiet 2-core machine.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.check.float64 import Float64Mode
from autopar.check.rules import check_strategy, one_op_program, strategies_of
from autopar.check.simtrain import SimCompiled
from autopar.check.step import check_model
from autopar.ir.core import MeshSpec, Replicate, Shard
from autopar.passes.shard import ShardOptions
from autopar.solver.cluster.spec import ClusterSpec
from tests._dist import run_distributed
from tests.exactness import TOL, float64_model, loss_error, make_optimizer, state_error, train

transformers = pytest.importorskip("transformers")

SEQ, HIDDEN, VOCAB = 1024, 32, 64
F64 = torch.float64
LAYERS = {"llama": 1, "qwen3": 1, "gemma2": 2}  # Gemma2's first layer slides a window, its second attends globally
OPTIONS = ShardOptions(objective="time", roles="name")
CP = MeshSpec((("cp", 2),))


def small(family: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, head_dim=8,
    )  # fmt: skip
    common["num_hidden_layers"] = LAYERS[family]
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen3":
        config = transformers.Qwen3Config(**common)
        cls = transformers.Qwen3ForCausalLM
    else:
        config = transformers.Gemma2Config(**common, sliding_window=SEQ // 4)
        cls = transformers.Gemma2ForCausalLM
    model = float64_model(cls(config))
    g = torch.Generator().manual_seed(1)
    batch = {n: torch.randint(3, VOCAB, (1, SEQ), generator=g) for n in ("input_ids", "labels")}
    return model, batch


def query_splits(prog) -> list:
    """The placement on the cp axis of every attention's query: an SDPA's ``q``, an eager attention's softmax
    of ``[batch, heads, queries, keys]`` scores."""
    axis = prog.mesh.names.index("cp")
    types = prog.types()
    out = []
    for op in prog.ops:
        if op.target == "aten.scaled_dot_product_attention":
            out.append(types[op.args[0].name].placements[axis])
        elif op.target in ("aten.softmax.int", "aten._softmax") and len(op.types[0].shape) == 4:
            out.append(op.types[0].placements[axis])
    return out


def check_exact(family: str, mesh: MeshSpec) -> None:
    model, batch = small(family)
    reference = copy.deepcopy(model)
    sim = SimCompiled.of(model, mesh, (), batch, options=OPTIONS, float64=True)
    splits = query_splits(sim.program)
    assert splits == [Shard(2)] * LAYERS[family], splits
    make_optimizer("adamw", sim)
    losses = torch.tensor([[float(x) for x in sim.train_step(**batch)] for _ in range(2)], dtype=torch.float64)
    with Float64Mode():
        ref = train(reference, [batch, batch], "adamw")
    assert (losses == losses[:, :1]).all(), f"the ranks' losses differ: {losses}"
    assert loss_error(losses[:, 0], ref) < TOL, (losses[:, 0], ref)
    err, where, missing = state_error(sim.full_state_dict(), reference)
    assert not missing and err < TOL, (err, where, missing)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_cp2_exact(family):
    check_exact(family, CP)


class PaddedLoss(torch.nn.Module):
    """The mean token loss of a causal LM given a padding ``attention_mask`` (an input split on cp like the ids)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.model = lm.model

    def forward(self, input_ids, attention_mask, labels):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def test_cp2_padding_mask_exact():
    """A padded sequence (the last 100 tokens padding, their labels ignored): transformers builds the causal and
    padding mask in the graph from the cp-split ``attention_mask``; the mean is over the unpadded tokens of
    every rank (the second rank holds all the padding)."""
    lm, batch = small("llama")
    model = PaddedLoss(lm)
    reference = copy.deepcopy(model)
    mask = torch.ones(1, SEQ, dtype=torch.long)
    mask[:, -100:] = 0
    batch = {**batch, "attention_mask": mask, "labels": batch["labels"].masked_fill(mask == 0, -100)}
    sim = SimCompiled.of(model, CP, (), batch, options=OPTIONS, float64=True)
    assert query_splits(sim.program) == [Shard(2)]
    make_optimizer("adamw", sim)
    losses = torch.tensor([[float(x) for x in sim.train_step(**batch)] for _ in range(2)], dtype=torch.float64)
    with Float64Mode():
        ref = train(reference, [batch, batch], "adamw")
    assert loss_error(losses[:, 0], ref) < TOL, (losses[:, 0], ref)
    err, where, missing = state_error(sim.full_state_dict(), reference)
    assert not missing and err < TOL, (err, where, missing)


def test_cp2_tp2_exact():
    check_exact("qwen3", MeshSpec((("cp", 2), ("tp", 2))))


def test_pp2_cp2_exact():
    check_exact("llama", MeshSpec((("pp", 2), ("cp", 2))))


def _gloo_rank(rank: int, world: int) -> dict:
    """One gloo rank: the small LLaMA compiled on cp=2 by ``autopar.compile``, two AdamW steps; the losses, the
    cp placement of its attention's query and the whole state (rank 0)."""
    import autopar

    model, batch = small("llama")
    compiled = autopar.compile(model, autopar.init_mesh("cpu", cp=world), kwargs=batch, objective="time", cluster=GLOO)
    losses = train(compiled, [batch, batch], "adamw")
    state = compiled.full_state_dict()
    return {"losses": losses, "splits": repr(query_splits(compiled.program)), "state": state if rank == 0 else {}}


GLOO = "local-cpu"


def test_gloo_cp2_matches_the_simulator():
    """The real collectives: the LLaMA on 2 gloo ranks trains as the same plan on simulated ranks, every loss
    and state entry to ``TOL`` (both run the model's own float32 casts, so they are compared with each
    other; the simulated ranks are compared with one process in float64 above)."""
    results = run_distributed(_gloo_rank, 2)
    model, batch = small("llama")
    sim = SimCompiled.of(
        model, CP, (), batch, options=ShardOptions(objective="time", roles="name", cluster=ClusterSpec.load(GLOO))
    )
    make_optimizer("adamw", sim)
    sim_losses = torch.tensor([float(sim.train_step(**batch)[0]) for _ in range(2)], dtype=torch.float64)
    sim_state = sim.full_state_dict()
    for r in results:
        assert r["splits"] == repr([Shard(2)]), r["splits"]
        assert loss_error(r["losses"], sim_losses) < TOL, (r["losses"], sim_losses)
    worst = max(
        float((v - sim_state[k]).abs().max() / sim_state[k].abs().max().clamp_min(1e-30))
        for k, v in results[0]["state"].items()
        if v.is_floating_point()
    )
    assert set(results[0]["state"]) == set(sim_state) and worst < TOL, worst


CP_MESHES = [MeshSpec((("cp", 2),)), MeshSpec((("cp", 4),)), MeshSpec((("cp", 2), ("tp", 2)))]


@st.composite
def _attention(draw):
    """An SDPA call: random sizes, a mask (none, boolean or additive float; each of its batch and head dims
    whole or broadcast), causal or not, and a mesh with a cp axis."""
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    sizes = st.sampled_from([1, 2, 4, 6, 8])
    b, h, e = draw(sizes), draw(sizes), draw(sizes)
    causal = draw(st.booleans())  # SDPA's own causal mask (queries and keys of one length, no mask given)
    q = draw(st.sampled_from([2, 4, 8, 12]))
    kv = q if causal else draw(st.sampled_from([2, 4, 8, 12]))
    args = [
        torch.randn(b, h, q, e, dtype=F64),
        torch.randn(b, h, kv, e, dtype=F64),
        torch.randn(b, h, kv, e, dtype=F64),
    ]
    kind = "none" if causal else draw(st.sampled_from(["none", "bool", "float"]))
    kwargs: dict = {"scale": draw(st.sampled_from([None, 0.25]))}
    if causal:
        kwargs["is_causal"] = True
    if kind != "none":
        shape = [draw(st.sampled_from([1, b])), draw(st.sampled_from([1, h])), draw(st.sampled_from([1, q])), kv]
        mask = torch.rand(shape) < 0.7
        mask[..., 0] = True  # every query row sees a key (a fully masked row is NaN in one process too)
        args.append(mask if kind == "bool" else torch.where(mask, 0.0, -1e4).to(F64) + torch.randn(shape, dtype=F64))
    return args, kwargs, draw(st.sampled_from(CP_MESHES))


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(_attention())
def test_attention_rule_on_simulated_ranks(example):
    """Every strategy of the attention rule, the query-sequence split included, run forward and backward on
    simulated ranks in float64 (``autopar.check.rules``) equals the whole op; the query split is offered
    wherever the query sequence divides, causal calls included (each rank's mask on its global rows)."""
    args, kwargs, mesh = example
    prog, whole = one_op_program("aten.scaled_dot_product_attention", tuple(args), kwargs, mesh)
    found = strategies_of(prog)
    cp = mesh.names.index("cp")
    query = [s for s in found if s.inputs[0][cp] == Shard(2) and s.inputs[1][cp] == Replicate()]
    q = args[0].shape[2]
    assert bool(query) == (q % mesh.sizes[cp] == 0), (found, kwargs, q)
    bad = [f"{s.inputs} -> {s.label()}: {p}" for s in found for p in check_strategy(prog, whole, s)]
    assert not bad, "\n".join(bad[:5])


def test_autopar_check_on_a_cp_mesh():
    """``autopar check`` (``check_model``: one float64 step of every simulated rank, value by value against one
    process) agrees on Qwen3's cp=2 x tp=2 plan, the split attention's values included."""
    model, batch = small("qwen3")
    report = check_model(model, (), batch, MeshSpec((("cp", 2), ("tp", 2))), options=OPTIONS)
    assert report.agrees and report.max_diff < TOL, report.summary()
    assert query_splits(report.program) == [Shard(2)] and report.compared > 100, report.compared
