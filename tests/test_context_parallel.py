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
import functools
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.check.rules import check_strategy, one_op_program, strategies_of
from autopar.check.simtrain import SimCompiled
from autopar.check.step import check_model
from autopar.ir.core import MeshSpec, Replicate, Shard, TensorType
from autopar.ir.layout import redistribute_steps
from autopar.passes.capture import capture
from autopar.passes.collectives import insert_collectives
from autopar.passes.lower import lower
from autopar.passes.shard import ShardOptions, shard
from autopar.runtime.comm.context_attention import _finite, _flash_block_backward, _scores
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.cost import CostModel
from autopar.solver.sharding.rules.context import attention_form
from tests._dist import run_distributed
from tests.exactness import (
    TOL,
    assert_sim_trains_as_one_process,
    float64_model,
    loss_error,
    make_optimizer,
    train,
)

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


def attention_forms(prog) -> list[str | None]:
    """The form of context parallelism every SDPA call of ``prog`` takes on its cp axis (``attention_form``)."""
    axis, types = prog.mesh.names.index("cp"), prog.types()
    return [
        attention_form(
            [types[r.name] for r in op.input_refs()], [types[r.name].placements for r in op.input_refs()], axis
        )
        for op in prog.ops
        if op.target == "aten.scaled_dot_product_attention"
    ]


def check_exact(family: str, mesh: MeshSpec, form: str = "auto") -> None:
    model, batch = small(family)
    reference = copy.deepcopy(model)
    options = replace(OPTIONS, context_attention=form)
    sim = SimCompiled.of(model, mesh, (), batch, options=options, float64=True)
    splits = query_splits(sim.program)
    assert splits == [Shard(1 if form == "ulysses" else 2)] * LAYERS[family], splits  # heads, or the sequence
    if form != "auto":
        assert attention_forms(sim.program) == [form] * LAYERS[family], attention_forms(sim.program)
    if form == "ulysses":
        moves = [op.kwargs for op in sim.program.ops if op.target == "all_to_all"]
        assert moves and all(m["axis"] == "cp" for m in moves), moves
    make_optimizer("adamw", sim)
    losses = assert_sim_trains_as_one_process(sim, reference, batch, "adamw")
    assert (losses == losses[:, :1]).all(), f"the ranks' losses differ: {losses}"


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
    assert_sim_trains_as_one_process(sim, reference, batch, "adamw")


def test_cp2_tp2_exact():
    check_exact("qwen3", MeshSpec((("cp", 2), ("tp", 2))))


def test_cp2_ring_exact():
    """Ring attention (``context_attention="ring"``): LLaMA's causal attention with its keys and values split on
    the sequence, their blocks passed around the cp ring by send/recv, the queries load-balanced (rank r computes
    pieces r and 3 - r of 4), trains as one process; the plan prices the ring's point-to-point traffic as the
    program it emits runs it (the ILP's communication seconds are ``program_comm``'s)."""
    check_exact("llama", CP, "ring")


def test_cp2_ulysses_exact():
    """Ulysses (``context_attention="ulysses"``): LLaMA's attention split on its heads over cp, reached from the
    sequence split by all-to-alls (``ir/layout.py``'s all-to-all step, one per tensor each way), trains as one
    process."""
    check_exact("llama", CP, "ulysses")


class PackedDocuments(torch.nn.Module):
    """One attention layer over packed documents: each token attends causally within its own document only (the
    mask built in the graph from ``doc_ids``, an input split on cp like the ids), and the mean next-token loss."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, doc_ids, labels):
        x = self.embed(input_ids)
        b, length, _ = x.shape
        q, k, v = (t.view(b, length, 4, HIDDEN // 4).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        pos = torch.arange(length, device=x.device)
        mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (pos[:, None] >= pos[None, :])
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask[:, None])
        logits = self.out(y.transpose(1, 2).reshape(b, length, HIDDEN))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


@pytest.mark.parametrize("form", ["all-gather", "ring", "ulysses"])
def test_cp2_document_mask_exact(form):
    """Packed sequences (item 4 of issue 32): documents of 300, 500 and 224 tokens, the first and third crossing the
    cp boundary at 512; per-document causal masks in every form of context parallelism train as one process."""
    torch.manual_seed(0)
    model = float64_model(PackedDocuments())
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=g)
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor([300, 500, 224])).unsqueeze(0)
    batch = {"input_ids": ids, "doc_ids": docs, "labels": torch.randint(3, VOCAB, (1, SEQ), generator=g)}
    sim = SimCompiled.of(model, CP, (), batch, options=replace(OPTIONS, context_attention=form), float64=True)
    assert attention_forms(sim.program) == [form], attention_forms(sim.program)
    make_optimizer("adamw", sim)
    assert_sim_trains_as_one_process(sim, reference, batch, "adamw")


def test_sequence_to_heads_is_one_all_to_all():
    """A shard moving from one dim to another on one axis is one all-to-all (not an all-gather and a slice),
    priced at (n-1)/n of the local bytes forward and again backward (the reverse all-to-all); with another axis
    splitting one of the dims it stays a gather and a slice."""
    assert [s.kind for s in redistribute_steps((Shard(2),), (Shard(1),))] == ["all_to_all"]
    nested = redistribute_steps((Shard(2), Shard(1)), (Shard(1), Shard(1)))
    assert "all_to_all" not in [s.kind for s in nested]
    spec = ClusterSpec.load("local-cpu")
    cost = CostModel(MeshSpec((("cp", 4),)), cluster=spec)
    t = TensorType("f32", (2, 8, 64, 16))
    vol, sec = cost.redistribute(t, (Shard(2),), (Shard(1),))
    per_byte, latency = spec.collective_terms("all_to_all", 4, True)
    local = t.nbytes / 4
    assert vol == pytest.approx(2 * 3 / 4 * local) and sec == pytest.approx(2 * (local * per_byte + latency))


@pytest.mark.heavy
def test_attention_dropout_on_a_split_sequence_draws_one_devices_mask():
    """Attention dropout on cp: SDPA with ``dropout_p > 0`` lowers to math attention with a keyed dropout of the
    probabilities (``passes/dropout.py``), its mask keyed by each element's global position
    (``runtime/build/rng.py``), so the probabilities split on their query rows over cp draw the rows of the one
    device's mask: LLaMA with attention dropout 0.1 trains on cp=2 as on one device, two AdamW steps in float64, every
    loss and state-dict entry to ``TOL``; the dropout really splits on cp. (Against eager PyTorch the masks differ:
    torch's generator draws them; ``tests/test_dropout.py`` shows the lowering equals math attention with autopar's
    mask.)"""
    model, batch = small("llama")
    attentions = [m for m in model.modules() if hasattr(m, "attention_dropout")]
    assert attentions
    for m in attentions:
        m.attention_dropout = 0.1
    model.train()
    runs = {}
    for mesh in (MeshSpec((("dp", 1),)), CP):
        torch.manual_seed(0)  # the dropout seed (SimCompiled.of reads torch.initial_seed())
        sim = SimCompiled.of(copy.deepcopy(model), mesh, (), batch, options=OPTIONS, float64=True)
        drops = [op for op in sim.program.ops if "rng" in op.attrs and len(op.types[0].shape) == 4]
        assert drops, "no keyed attention dropout"
        if mesh is CP:
            assert all(op.types[0].placements[0] == Shard(2) for op in drops), [op.types[0] for op in drops]
        make_optimizer("adamw", sim)
        losses = [float(sim.train_step(**batch)[0]) for _ in range(2)]
        runs[mesh] = (losses, sim.full_state_dict())
    (one, one_state), (cp, cp_state) = runs.values()
    assert loss_error(torch.tensor(cp), torch.tensor(one)) < TOL, (cp, one)
    err = max(((cp_state[k] - v).abs().max() / v.abs().max().clamp_min(1e-30)).item() for k, v in one_state.items())
    assert err < TOL, err


@pytest.mark.heavy
def test_all_gather_form_reduce_scatters_the_key_value_gradients():
    """In the all-gather form each cp rank's gradient of the gathered keys and values is a partial sum; the program
    reduce-scatters it in the gathers' backward (the adjoint of an all-gather) where it had all-reduced it (f) and
    kept the local shard: no f is left on cp, every cp gather (of the keys and values before the rotary and the
    grouped-query repeat) has ``reduce_grad``, and ``program_comm`` prices each as its forward all-gather and its
    backward reduce-scatter. That the program trains exactly: ``test_cp2_exact``, ``test_cp2_document_mask_exact``
    and the gloo run (all-gather form)."""
    prog, spec, opts, sharding, program = _planned("all-gather", _lowered_llama())
    assert not [op for op in program.ops if op.target == "grad_all_reduce" and op.kwargs["axis"] == "cp"]
    gathers = [op for op in program.ops if op.target == "all_gather" and op.kwargs["axis"] == "cp"]
    assert gathers and all(op.kwargs.get("reduce_grad") for op in gathers), [op.kwargs for op in gathers]
    per_byte, latency = spec.collective_terms("reduce_scatter", 2, True)
    wholes = [op.types[0].nbytes for op in gathers]  # each gathered tensor: every rank's bytes
    cost = CostModel(prog.mesh, opts.setup, spec)
    unfolded = program.with_(
        ops=tuple(op.with_(kwargs={k: v for k, v in op.kwargs.items() if k != "reduce_grad"}) for op in program.ops)
    )
    (vol, sec), (vol0, sec0) = cost.program_comm(program), cost.program_comm(unfolded)
    assert vol - vol0 == pytest.approx(sum(wholes) / 2, rel=1e-12)  # (n-1)/n of each
    assert sec - sec0 == pytest.approx(sum(w * per_byte + latency for w in wholes), rel=1e-12)
    # the ILP prices the f folded into the gathers before the grouped-query repeat (solve.FoldThrough), as run
    assert (sharding.comm_bytes, sharding.comm_seconds) == pytest.approx((vol, sec), rel=1e-9)


@pytest.mark.heavy
@pytest.mark.parametrize(
    "family, mesh", [("qwen3", MeshSpec((("cp", 4),))), ("llama", MeshSpec((("cp", 2), ("tp", 2))))]
)
def test_ring_exact_more_meshes(family, mesh):
    """Ring attention on cp=4 (each rank's queries exchanged in two pieces) and beside head-parallel tp."""
    check_exact(family, mesh, "ring")


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


FORMS = ("ring", "ulysses")


def _gloo_forms_rank(rank: int, world: int) -> dict:
    """One gloo rank: the small LLaMA compiled on cp=2 with ring attention, then with Ulysses, two AdamW steps
    each; the losses, the attention's form and the whole state (rank 0) of each."""
    import autopar

    out = {}
    for form in FORMS:
        model, batch = small("llama")
        mesh = autopar.init_mesh("cpu", cp=world)
        compiled = autopar.compile(model, mesh, kwargs=batch, objective="time", cluster=GLOO, context_attention=form)
        losses = train(compiled, [batch, batch], "adamw")
        state = compiled.full_state_dict() if rank == 0 else {}
        out[form] = {"losses": losses, "forms": attention_forms(compiled.program), "state": state}
    return out


@pytest.mark.heavy
def test_gloo_ring_and_ulysses_match_the_simulator():
    """Ring attention's send/recv and Ulysses' all-to-alls on 2 real gloo ranks train as the same plans on
    simulated ranks, every loss and state entry to ``TOL``."""
    results = run_distributed(_gloo_forms_rank, 2)
    for form in FORMS:
        model, batch = small("llama")
        opts = ShardOptions(objective="time", roles="name", cluster=ClusterSpec.load(GLOO), context_attention=form)
        sim = SimCompiled.of(model, CP, (), batch, options=opts)
        make_optimizer("adamw", sim)
        sim_losses = torch.tensor([float(sim.train_step(**batch)[0]) for _ in range(2)], dtype=torch.float64)
        sim_state = sim.full_state_dict()
        for r in results:
            got = r[form]
            assert got["forms"] == [form], got["forms"]
            assert loss_error(got["losses"], sim_losses) < TOL, (form, got["losses"], sim_losses)
        state = results[0][form]["state"]
        worst = max(
            float((v - sim_state[k]).abs().max() / sim_state[k].abs().max().clamp_min(1e-30))
            for k, v in state.items()
            if v.is_floating_point()
        )
        assert set(state) == set(sim_state) and worst < TOL, (form, worst)


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
    """Every strategy of the attention rule, the query-sequence split and ring attention included, run forward and
    backward on simulated ranks in float64 (``autopar.check.rules``) equals the whole op; the query split is offered
    wherever the query sequence divides, causal calls included (each rank's mask on its global rows), ring attention
    wherever queries and keys are one sequence in ``2 * cp`` pieces (a float mask's gradient included)."""
    args, kwargs, mesh = example
    prog, whole = one_op_program("aten.scaled_dot_product_attention", tuple(args), kwargs, mesh)
    found = strategies_of(prog)
    cp = mesh.names.index("cp")
    query = [s for s in found if s.inputs[0][cp] == Shard(2) and s.inputs[1][cp] == Replicate()]
    ring = [s for s in found if s.inputs[0][cp] == Shard(2) and s.inputs[1][cp] == Shard(2)]
    q, kv = args[0].shape[2], args[1].shape[2]
    assert bool(query) == (q % mesh.sizes[cp] == 0), (found, kwargs, q)
    assert bool(ring) == (q == kv and q % (2 * mesh.sizes[cp]) == 0), (found, kwargs, q)
    bad = [f"{s.inputs} -> {s.label()}: {p}" for s in found for p in check_strategy(prog, whole, s)]
    assert not bad, "\n".join(bad[:5])


def test_autopar_check_on_a_cp_mesh():
    """``autopar check`` (``check_model``: one float64 step of every simulated rank, value by value against one
    process) agrees on Qwen3's cp=2 x tp=2 plan, the split attention's values included."""
    model, batch = small("qwen3")
    report = check_model(model, (), batch, MeshSpec((("cp", 2), ("tp", 2))), options=OPTIONS)
    assert report.agrees and report.max_diff < TOL, report.summary()
    assert query_splits(report.program) == [Shard(2)] and report.compared > 100, report.compared


@pytest.mark.parametrize("cluster", ["local-cpu", pytest.param("dgx-h100", marks=pytest.mark.heavy)])
def test_ring_priced_as_emitted(cluster):
    """The ILP prices ring attention's point-to-point traffic as the emitted program runs it: the plan's
    communication is ``program_comm``'s, collective by collective; on gloo (nothing overlaps) the ring's own share
    is, by hand, one step of the rank's key and value blocks forward, one backward, one hop of their gradient
    accumulators (each rank keeps its own share of its block's), and the load balancing's exchange of half the
    queries and half the output each way (a causal call: no mask rows to send), each message a point-to-point send
    on the cp link."""
    prog = _lowered_llama()
    spec = ClusterSpec.load(cluster)
    opts = replace(OPTIONS, context_attention="ring", cluster=spec)
    sharding = shard(prog, opts)
    program = insert_collectives(sharding.program)
    cost = CostModel(prog.mesh, opts.setup, spec)
    vol, sec = cost.program_comm(program)
    assert (sharding.comm_bytes, sharding.comm_seconds) == pytest.approx((vol, sec), rel=1e-9)
    (op,) = [op for op in program.ops if op.target == "aten.scaled_dot_product_attention"]
    types = program.types()
    ins = [types[r.name] for r in op.input_refs()]
    assert attention_forms(program) == ["ring"]
    ring_vol, ring_sec = cost.inherent(op.target, ins, [t.placements for t in ins], op)
    if cluster == "local-cpu":
        q, k, v = (t.nbytes / 2 for t in ins)  # each rank's half; causal, no mask (passes/hf_masks.py)
        per_byte, latency = spec.collective_terms("send", 2, True)
        messages = [k, v, k, v, k, v, q / 2, q / 2, q / 2, q / 2]
        assert ring_vol == pytest.approx(sum(messages), rel=1e-12)
        assert ring_sec == pytest.approx(sum(m * per_byte + latency for m in messages), rel=1e-12)
    assert 0 < ring_sec < sec


@pytest.mark.parametrize("case", ["full", "diagonal", "boolean, a row hidden", "additive"])
def test_ring_flash_block_backward_is_the_explicit_gradient(case):
    """One sub-block's backward on the CPU flash backward kernel (``_flash_block_backward``, given the output and
    log-sum-exp) equals autograd through the explicit sub-block in float64, a row a mask hides wholly (log-sum-exp
    -inf) included: no NaN, gradients 0 there."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask, diag = None, case == "diagonal"
    if case.startswith("boolean"):
        mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
        mask[..., 3, :] = False
    elif case == "additive":
        mask = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    s = _scores(q, k, 0.5, mask, diag)
    lse = torch.logsumexp(s, -1)
    out = torch.matmul(torch.exp(s - _finite(lse).unsqueeze(-1)), v)
    g = torch.randn_like(out)
    out.backward(g)
    got = _flash_block_backward(g, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), 0.5, mask, diag)
    for mine, ref in zip(got, (q.grad, k.grad, v.grad)):
        assert not mine.isnan().any()
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-10)


def _planned(form: str, prog):
    """``prog`` planned in context-attention ``form`` on ``local-cpu``: (prog, spec, options, the sharding, its
    program after insert-collectives), the form checked on every attention."""
    spec = ClusterSpec.load("local-cpu")
    opts = replace(OPTIONS, context_attention=form, cluster=spec)
    sharding = shard(prog, opts)
    program = insert_collectives(sharding.program)
    assert attention_forms(program) == [form] * LAYERS["llama"], attention_forms(program)
    return prog, spec, opts, sharding, program


@functools.cache
def _lowered_llama():
    """``small("llama")`` captured and lowered on ``CP`` (one IR, shared by the tests that price its plans)."""
    model, batch = small("llama")
    return lower(capture(model, (), batch), CP)


def _issued_by_rank0(sim: SimCompiled, batch: dict) -> list[tuple[str, float]]:
    """Every collective and point-to-point send rank 0 of ``sim`` issues in one training step (forward, backward,
    gradient sync), as ``(kind, bytes)`` with bytes as the cost model sizes a message (``CostModel._collective``):
    an all-reduce's tensor, an all-gather's gathered output, a reduce-scatter's whole input, an all-to-all's and a
    send's local tensor. Recorded where the rank simulator's groups meet (``runtime/sim/groups._Rendezvous``)
    and where its sends are posted."""
    import threading

    from autopar.runtime.sim import groups as sim_groups
    from autopar.runtime.sim.ranksim import SimWorld

    KINDS = {  # noqa: N806
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_to_all_single": "all_to_all",
    }
    found: list[tuple[str, float]] = []
    mine = lambda: threading.current_thread().name == "autopar-sim-rank0"  # noqa: E731

    def size(x) -> float:
        if isinstance(x, torch.Tensor):
            return float(x.nbytes)
        return float(sum(size(y) for y in x)) if isinstance(x, (list, tuple)) else 0.0

    exchange, send = sim_groups._Rendezvous.exchange, SimWorld.send

    def record_exchange(self, member, call, payload):
        if mine():
            name = call.split("(")[0]
            kind = KINDS.get(name, name)
            nbytes = size(payload[0] if kind == "all_to_all" else payload)
            found.append((kind, nbytes * (len(self.ranks) if kind == "all_gather" else 1)))
        return exchange(self, member, call, payload)

    def record_send(self, key, tensors):
        if mine():
            found.extend(("send", float(t.nbytes)) for t in tensors)
        return send(self, key, tensors)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sim_groups._Rendezvous, "exchange", record_exchange)
        patch.setattr(SimWorld, "send", record_send)
        sim.train_step(**batch)
    return found


@pytest.mark.parametrize("form", ["all-gather", "ring", "ulysses"])
def test_ilp_prices_the_collectives_the_cp_program_issues(form):
    """For each form of context parallelism the ILP's predicted communication (bytes and seconds per rank) is that
    of the collectives the generated rank program issues, counted on the rank simulator in one training step
    (forward, backward and the gradient sync) and each priced by its kind's alpha-beta on the cp link: the
    all-gather form's key/value gradients reduce-scattered in the backward of gathers that lie before the
    grouped-query repeat (the ILP had charged an all-reduce of the repeated keys and values at the attention, 2.06x
    the bytes the run moves), ring attention's sends and Ulysses' all-to-alls. Bytes and seconds both: a
    collective of another kind than priced, or of another size, changes both. The one term the ILP leaves to the
    plan is each gradient bucket's latency (``bucket_latency``; one bucket here)."""
    model, batch = small("llama")
    prog, spec, opts, sharding, program = _planned(form, _lowered_llama())
    sim = SimCompiled.of(model, CP, (), batch, options=opts, sharded=program)
    make_optimizer("adamw", sim)
    issued = _issued_by_rank0(sim, batch)
    cost = CostModel(prog.mesh, opts.setup, spec)
    vol = sec = 0.0
    for kind, nbytes in issued:
        if kind == "send":
            per_byte, latency = spec.collective_terms("send", 2, True)
            factor = 1.0
        else:
            factor, per_byte, latency = cost._collective_terms(kind, 0)
        vol, sec = vol + factor * nbytes, sec + nbytes * per_byte + latency
    kinds = {k for k, _ in issued}
    assert {"ring": "send", "all-gather": "reduce_scatter", "ulysses": "all_to_all"}[form] in kinds, issued
    assert [k for k, _ in issued].count("all_reduce") == 3, issued  # the loss's sum and count, one gradient bucket
    latency = cost.bucket_latency(0, 1)
    assert (sharding.comm_bytes, sharding.comm_seconds + latency) == pytest.approx((vol, sec), rel=1e-9), issued


def test_ring_sub_block_masks_take_the_kernels_unmasked_and_causal_paths():
    """Ring attention's sub-blocks (``_sub_blocks``) under a boolean mask: one the mask hides nothing of runs
    unmasked, one it shows exactly the causal triangle of runs causal (the kernel's fast paths: LLaMA's explicit
    causal mask, 0.39 and 0.24 of the masked path's time forward, BENCHMARKS 23), one it hides wholly is skipped,
    and any other keeps its mask: the triangle in one head only, a triangle off the diagonal. That the simplified
    blocks compute the same attention: ``test_cp2_ring_exact`` (LLaMA's causal mask) and the rule's property test."""
    from autopar.runtime.comm.context_attention import _mask_of, _sub_blocks

    w = 4
    tri = torch.ones(w, w, dtype=torch.bool).tril()
    mask = torch.zeros(1, 2, 2 * w, 4 * w, dtype=torch.bool)  # 2 heads; 2 query pieces of w rows, 4 key pieces
    mask[..., :w, :w] = True  # query slot 0, key piece 0: nothing hidden
    mask[..., :w, w : 2 * w] = tri  # key piece 1: the causal triangle
    mask[:, 0, w:, :w] = tri  # query slot 1, key piece 0: the triangle in head 0 only
    mask[:, 1, w:, :w] = True
    mask[..., w:, 2 * w : 3 * w] = torch.ones(w, w, dtype=torch.bool).tril(-1)  # key piece 2: off the diagonal
    blocks = {block: _sub_blocks((0, 3), block, False, _mask_of(mask, block, w)) for block in (0, 1)}
    got = {block: [(a, b, diag, m is None) for a, b, diag, m in found] for block, found in blocks.items()}
    assert got == {0: [(0, 0, False, True), (0, 1, True, True), (1, 0, False, False)], 1: [(1, 0, False, False)]}


def test_ilp_prices_the_all_gather_form_as_emitted_beside_tp():
    """On cp=2 x tp=2 the all-gather form's fold (the key/value f reduce-scattered in the gathers before the
    grouped-query repeat) is chosen and priced as ``program_comm`` prices the emitted program (bytes and seconds):
    on gloo a reduce-scatter takes an all-reduce's seconds (``spec.runs_as``), so folded and not tie in seconds,
    and the ILP took the unfolded price the program does not run (1.084x its bytes) until fewer bytes broke the
    tie."""
    model, batch = small("llama")
    mesh = MeshSpec((("cp", 2), ("tp", 2)))
    _, spec, opts, sharding, program = _planned("all-gather", lower(capture(model, (), batch), mesh))
    assert len([op for op in program.ops if op.kwargs.get("reduce_grad")]) == 2
    vol, sec = CostModel(mesh, opts.setup, spec).program_comm(program)
    assert (sharding.comm_bytes, sharding.comm_seconds) == pytest.approx((vol, sec), rel=1e-9)
