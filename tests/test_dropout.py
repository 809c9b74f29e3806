"""Mesh-invariant dropout (runtime/build/rng.py): every mesh, microbatch count and recomputation draws the
masks autopar draws on one device, so training with dropout is exact (float64, 1e-10) in parallel.

Cost on 2 cores (measured, about 30 s in all): the mask, statistics and lowering tests take about
2 s; the dp/tp meshes run on the single-process rank simulator (tiny GPT-2 and an MLP, 3 SGD steps on
five plans over dp=2, tp=2 and dp=2 x tp=2: about 8 s with planning); the pipeline is one 2-process
gloo spawn (pp=2, four schedule / microbatch / recomputation runs: about 20 s).
"""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.ir.core import MeshSpec, Partial, R, Shard
from autopar.ir.parser import parse
from autopar.ir.printer import print_program
from autopar.passes.capture import capture
from autopar.passes.lower import lower
from autopar.runtime.build.codegen import codegen
from autopar.runtime.build.rng import DropoutRng, DropoutSite, keep_mask, keyed_dropout, uniform
from autopar.runtime.sim.placement_values import assemble
from autopar.runtime.sim.ranksim import SimWorld
from tests.exactness import TOL, float64_batch, float64_model, train

P_DROP = 0.1


# ---------------------------------------------------------------------------------------------
# The generator: masks are slices of the one-device mask, statistics are dropout's


def _mask(rng: DropoutRng, shape, placements, mesh: MeshSpec, coords: dict[str, int], batch_dim=0) -> torch.Tensor:
    site = DropoutSite.of(rng, 3, P_DROP, shape, batch_dim, placements, mesh.names, mesh.sizes, coords, "cpu")
    return site.keep()


PLACEMENTS = {
    "replicated": (R, R),
    "dp rows": (Shard(0), R),
    "tp columns": (R, Shard(1)),
    "nested rows": (Shard(0), Shard(0)),
    "interleaved qkv": (Shard(0), Shard(1, 3)),
    "tp partial": (R, Partial("sum")),
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_local_masks_are_slices_of_the_one_device_mask(name: str) -> None:
    mesh = MeshSpec((("dp", 2), ("tp", 2)))
    shape, placements = (4, 12, 5), PLACEMENTS[name]
    rng = DropoutRng(seed=11, step=2)
    whole = _mask(rng, shape, (R, R), MeshSpec((("one", 1),)), {"one": 0})
    world = SimWorld(mesh)
    locals_ = [_mask(rng, shape, placements, mesh, world.coords(r)).to(torch.float64) for r in range(world.size)]
    summed = frozenset(i for i, p in enumerate(placements) if isinstance(p, Partial))
    if summed:  # a partial value's ranks each hold the whole mask: compare each, not their sum
        for t in locals_:
            assert torch.equal(t.bool(), whole)
        return
    got, spread = assemble(locals_, placements, mesh)
    assert spread == 0.0  # replicas (the R axes) draw the same mask
    assert torch.equal(got.bool(), whole)
    if isinstance(placements[1], Shard):  # tp shards hold different elements, with different masks
        assert not torch.equal(locals_[0], locals_[1])


def test_microbatch_masks_are_rows_of_the_batch_mask() -> None:
    """In a pipeline of M microbatches, microbatch m's mask is rows m*b.. of the whole batch's mask,
    whichever dim carries the batch (here dim 1, as after a transpose)."""
    one = MeshSpec((("one", 1),))
    whole = _mask(DropoutRng(seed=5), (6, 8, 3), (R,), one, {"one": 0}, batch_dim=1)
    for m in (2, 4):
        rows = [
            _mask(DropoutRng(seed=5, microbatch=i, microbatches=m), (6, 8 // m, 3), (R,), one, {"one": 0}, 1)
            for i in range(m)
        ]
        assert torch.equal(torch.cat(rows, 1), whole)
    # a value that holds no batch rows (batch_dim -1) draws the same mask in every microbatch
    a = _mask(DropoutRng(seed=5, microbatch=0, microbatches=2), (6, 3), (R,), one, {"one": 0}, -1)
    b = _mask(DropoutRng(seed=5, microbatch=1, microbatches=2), (6, 3), (R,), one, {"one": 0}, -1)
    assert torch.equal(a, b)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0 / 3.0, 0.999])
def test_the_in_place_mask_makes_the_hash_definitions_decisions(p: float) -> None:
    """``keep_mask`` (in place, on the integer bits) decides as ``uniform(key, index) >= p``, the readable
    definition, on indices small and beyond 2^53 and on keys either side of 2^63."""
    g = torch.Generator().manual_seed(5)
    index = torch.cat([torch.arange(4096), torch.randint(0, 2**62, (4096,), generator=g)])
    for key in (0, 12345, 2**63 + 7, 2**64 - 1):
        assert torch.equal(keep_mask(key, index, p), uniform(key, index) >= p), (key, p)


def test_mask_statistics_and_scaling() -> None:
    one = MeshSpec((("one", 1),))
    n = 1 << 20
    site = DropoutSite.of(DropoutRng(seed=1), 0, P_DROP, (n,), 0, (R,), one.names, one.sizes, {"one": 0}, "cpu")
    keep = site.keep()
    dropped = 1.0 - keep.double().mean().item()
    sigma = (P_DROP * (1 - P_DROP) / n) ** 0.5
    assert abs(dropped - P_DROP) < 5 * sigma  # 5 sigma: fails by chance once in ~3.5 million seeds
    x = torch.randn(n, dtype=torch.float64, requires_grad=True)
    y = keyed_dropout(x, site)
    assert torch.equal(y[keep], x[keep] * (1.0 / (1 - P_DROP))) and not y[~keep].any()
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, keep.double() * (1.0 / (1 - P_DROP)))  # the backward uses the same mask
    # another step, another op or another seed draws an independent mask: agreement ~ p^2 + (1-p)^2
    independent = P_DROP**2 + (1 - P_DROP) ** 2
    for rng, key in ((DropoutRng(seed=1, step=1), 0), (DropoutRng(seed=1), 1), (DropoutRng(seed=2), 0)):
        other = DropoutSite.of(rng, key, P_DROP, (n,), 0, (R,), one.names, one.sizes, {"one": 0}, "cpu").keep()
        assert abs((other == keep).double().mean().item() - independent) < 5 * sigma * 2


# ---------------------------------------------------------------------------------------------
# Models with dropout


GPT2_DROPOUT = (
    "tiny-gpt2:n_layer=2,n_embd=32,n_head=4,vocab_size=64,n_positions=16,"
    f"attn_pdrop={P_DROP},resid_pdrop={P_DROP},embd_pdrop={P_DROP}"
)


def gpt2_with_dropout(batch: int = 4, seq: int = 8, steps: int = 3):
    """Tiny GPT-2 with embedding, attention (SDPA with dropout_p) and residual dropout, in float64."""
    from autopar.models.resolve import build
    from tests.equivalence import make_batches

    spec = build(f"{GPT2_DROPOUT},batch={batch},seq={seq}", device="cpu", seed=0)
    model = float64_model(spec.model)
    return model, [float64_batch(b) for b in make_batches(model, spec.kwargs, steps)]


class DropoutMLP(torch.nn.Module):
    """An MLP with dropout on its hidden layer and on its residual branch."""

    def __init__(self, d: int = 16, h: int = 32):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, h), torch.nn.Linear(h, d)
        self.drop = torch.nn.Dropout(P_DROP)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x, target):
        h = self.drop(torch.nn.functional.gelu(self.fc1(x)))
        return torch.nn.functional.mse_loss(self.norm(x + self.drop(self.fc2(h))), target)


def mlp_with_dropout(batch: int = 8, steps: int = 3):
    torch.manual_seed(0)
    model = float64_model(DropoutMLP())
    g = torch.Generator().manual_seed(1)
    batches = [
        float64_batch({"x": torch.randn(batch, 16, generator=g), "target": torch.randn(batch, 16, generator=g)})
        for _ in range(steps)
    ]
    return model, batches


MODELS = {"gpt2": gpt2_with_dropout, "mlp": mlp_with_dropout}


# ---------------------------------------------------------------------------------------------
# Training on the rank simulator (dp/tp meshes) against autopar on one device


def train_simulated(model, batches, mesh: MeshSpec, layout: str = "autopar", seed: int = 123):
    """3 SGD steps of ``model`` compiled for ``mesh`` on simulated ranks (as ``autopar.compile`` builds
    each rank); every rank's losses, the whole trained parameters, and the planned program."""
    from autopar.passes.flow import FlowOptions, plan_program
    from autopar.passes.shard import ShardOptions
    from autopar.runtime.sim.one_stage import one_stage_module
    from autopar.solver.sharding.baselines import megatron_constraints

    model = copy.deepcopy(model)
    captured = capture(model, (), batches[0])
    options = ShardOptions()
    if layout.startswith("megatron"):  # Megatron's parameter layout; least memory shards the activations too
        objective = "memory" if layout == "megatron-memory" else "time"
        options = ShardOptions(objective=objective, constrain=megatron_constraints(lower(captured, mesh)))
    prog = parse(print_program(plan_program(captured, mesh, FlowOptions(shard=options)).sharded))
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    world = SimWorld(mesh)

    def rank_step(rank: int):
        comm = world.comm(rank)
        cm = one_stage_module(prog, captured.in_spec, captured.out_spec, comm, named.__getitem__, rng=DropoutRng(seed))
        losses = train(cm, batches)
        assert cm.dropout_rng.step == len(batches)  # each step drew new masks
        return losses, cm.full_state_dict()

    results = world.run(rank_step)
    return [r[0] for r in results], results[0][1], prog


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b if b[k].is_floating_point())


def _dropout_placements(prog) -> set[str]:
    return {",".join(map(str, op.type.placements)) for op in prog.ops if "rng" in op.attrs}


@pytest.mark.parametrize("name", list(MODELS))
def test_dp_tp_meshes_train_as_one_device(name: str) -> None:
    model, batches = MODELS[name]()
    ref_losses, ref_params, _ = train_simulated(model, batches, MeshSpec((("one", 1),)))
    # dropout is on: the masks differ from no dropout at all (and from eager PyTorch's stream)
    assert (ref_losses[0] - train(copy.deepcopy(model).eval(), batches)).abs().max() > 1e-3
    seen: dict[str, set[str]] = {}
    for axes, layout in (
        ((("dp", 2),), "autopar"),
        ((("tp", 2),), "megatron"),
        ((("tp", 2),), "megatron-memory"),
        ((("dp", 2), ("tp", 2)), "autopar"),
        ((("dp", 2), ("tp", 2)), "megatron-memory"),
    ):
        losses, params, prog = train_simulated(model, batches, MeshSpec(axes), layout)
        for rank_losses in losses:
            assert ((rank_losses - ref_losses[0]).abs() / ref_losses[0].abs()).max() < TOL, (axes, layout)
        assert _rel(params, ref_params) < TOL, (axes, layout)
        seen[f"{len(axes)}-{layout}"] = _dropout_placements(prog)
    # not vacuous: dropouts ran on values replicated over tp (whose replicas must draw one mask) and
    # on values sharded over tp, by rows or attention heads, nested under dp
    print(seen)
    assert "R" in seen["1-megatron"], seen
    assert any(p.startswith("S(") for p in seen["1-megatron-memory"]), seen
    assert any(p.count("S(") == 2 for p in seen["2-megatron-memory"]), seen
    if name == "gpt2":
        assert "S(1)" in seen["1-megatron-memory"], seen  # attention probabilities split by head


def test_a_mask_drawn_from_local_indices_is_caught(monkeypatch) -> None:
    """The comparison sees a generator that ignores placements (each rank keys the positions of its
    local elements, as per-rank streams would): tp=2 then trains a different model."""
    from autopar.ir.core import local_shape

    model, batches = gpt2_with_dropout()
    ref_losses, ref_params, _ = train_simulated(model, batches, MeshSpec((("one", 1),)))
    real = DropoutSite.of.__func__

    def local_only(cls, rng, key, p, shape, batch_dim, placements, names, sizes, coords, device):
        local = local_shape(tuple(shape), tuple(placements), tuple(sizes))
        return real(cls, rng, key, p, local, batch_dim, (R,) * len(placements), names, sizes, coords, device)

    monkeypatch.setattr(DropoutSite, "of", classmethod(local_only))
    losses, params, _ = train_simulated(model, batches, MeshSpec((("tp", 2),)), "megatron-memory")
    assert ((losses[0] - ref_losses[0]).abs() / ref_losses[0].abs()).max() > 1e-6
    assert _rel(params, ref_params) > 1e-6


# ---------------------------------------------------------------------------------------------
# Pipelines (one 2-process spawn): every microbatch count, schedule and recomputation


def one_device(model, batches, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """3 SGD steps of autopar on one device (a mesh of one rank, in this process)."""
    losses, params, _ = train_simulated(model, batches, MeshSpec((("one", 1),)), seed=seed)
    return losses[0], params


def pipeline_runs(rank: int, world: int, runs: list[tuple]) -> dict:
    """Run on each rank: GPT-2 with dropout on pp=2 for each (schedule, options, microbatches), against
    autopar on one device with the same seed; the largest relative loss and parameter differences."""
    import autopar

    seed = 2024
    model, batches = gpt2_with_dropout(batch=4)
    ref_losses, ref_params = one_device(model, batches, seed)
    mesh = autopar.init_mesh("cpu", pp=2)
    out = {}
    for schedule, opts, microbatches in runs:
        torch.manual_seed(seed)  # the dropout seed is rank 0's torch.initial_seed()
        pipe = autopar.compile(
            model, mesh, kwargs=batches[0], schedule=schedule, schedule_options=opts, microbatches=microbatches
        )
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for b in batches:
            losses.append(pipe.train_step(**b).item())
            opt.step()
            opt.zero_grad()
        full = pipe.full_state_dict()
        common = {k: ref_params[k] for k in full if k in ref_params}
        key = f"{schedule},{opts},M={microbatches}"
        out[key] = {
            "loss_rel": ((torch.tensor(losses, dtype=torch.float64) - ref_losses).abs() / ref_losses.abs()).max(),
            "param_rel": torch.tensor(_rel(full, common)),
            "compared": torch.tensor(len(common)),
        }
    return out


@pytest.mark.multiproc
def test_pipelines_train_as_one_device() -> None:
    from tests._dist import run_distributed

    runs = [("1f1b", {}, 2), ("gpipe", {}, 4), ("1f1b", {"recompute": 1}, 4), ("interleaved", {"chunks": 2}, 2)]
    results = run_distributed(pipeline_runs, 2, runs, timeout=600)
    for rank, res in enumerate(results):
        for key, r in res.items():
            assert r["loss_rel"] < TOL, (rank, key, r)
            assert r["param_rel"] < TOL and r["compared"] > 0, (rank, key, r)


# ---------------------------------------------------------------------------------------------
# Lowering: attention dropout as math attention, random ops autopar cannot key


class Attention(torch.nn.Module):
    def __init__(self, mask: str, causal: bool, scale: float | None, gqa: bool = False):
        super().__init__()
        self.proj = torch.nn.Linear(8, 24)
        self.mask, self.causal, self.scale, self.gqa = mask, causal, scale, gqa

    def qkv(self, x):
        q, k, v = self.proj(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)  # [batch, heads, seq, dim] each
        return (q, k[:, 1:], v[:, :1]) if self.gqa else (q, k, v)  # grouped: both query heads read one key head

    def forward(self, x):
        q, k, v = self.qkv(x)
        mask = None
        if self.mask == "bool":
            mask = torch.ones(5, 5, dtype=torch.bool).triu(2).logical_not()
        elif self.mask == "float":
            mask = torch.arange(25, dtype=x.dtype).view(5, 5) / 25
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.3, is_causal=self.causal, scale=self.scale, enable_gqa=self.gqa
        )
        return out.sum(dim=1)


@pytest.mark.parametrize(
    ("mask", "causal", "scale", "gqa"),
    [
        ("none", True, None, False),
        ("bool", False, 0.7, False),
        ("float", False, None, False),
        ("none", True, None, True),
    ],
)
def test_attention_dropout_is_math_attention_with_a_keyed_mask(mask: str, causal: bool, scale: float | None, gqa):
    """SDPA with dropout_p > 0 lowers to scores, mask, softmax, keyed dropout, weighted sum: the
    program equals PyTorch's math attention with the mask the generator draws for that op. With grouped-query
    heads (``enable_gqa``, as Hugging Face passes it when there is no mask) the key and value heads are repeated."""
    torch.manual_seed(0)
    model = Attention(mask, causal, scale, gqa).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    prog = lower(capture(model, (x,)), MeshSpec((("one", 1),)))
    assert "aten.scaled_dot_product_attention" not in {op.target for op in prog.ops}
    (drop,) = [op for op in prog.ops if "rng" in op.attrs]
    named = dict(model.named_parameters())
    gm = codegen(prog, {"one": 0}, named.__getitem__, rng=DropoutRng(seed=9))
    (got,) = gm(x)
    rng = DropoutRng(seed=9)
    site = DropoutSite.of(rng, 0, 0.3, drop.type.shape, 0, (R,), ("one",), (1,), {"one": 0}, "cpu")
    q, k, v = (t.expand(-1, 2, -1, -1) for t in model.qkv(x))  # one key head: both query heads read it
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else 0.5)
    if causal:
        scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).tril().logical_not(), float("-inf"))
    if mask == "bool":
        scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(2), float("-inf"))
    elif mask == "float":
        scores = scores + torch.arange(25, dtype=x.dtype).view(5, 5) / 25
    expected = (keyed_dropout(scores.softmax(-1), site) @ v).sum(dim=1)
    assert (got - expected).abs().max() < 1e-12


def test_a_random_op_autopar_cannot_key_is_refused() -> None:
    from autopar.errors import CaptureError

    class Noisy(torch.nn.Module):
        def forward(self, x):
            return x + torch.rand_like(x)

    with pytest.raises(CaptureError, match="rand_like.*draws random numbers"):
        lower(capture(Noisy(), (torch.randn(2, 3),)))


def test_sub_microbatches_draw_their_own_rows() -> None:
    """Sub-pipelined tp runs two halves of microbatch m interleaved node by node: half h draws the
    mask of sub-microbatch 2m + h, as the plain module does when told that index."""
    from autopar.runtime.execute.subpipeline import Interleaved

    torch.manual_seed(0)
    model = DropoutMLP().double()
    xs = [(torch.randn(2, 16, dtype=torch.float64), torch.randn(2, 16, dtype=torch.float64)) for _ in range(2)]
    prog = lower(capture(model, xs[0]), MeshSpec((("one", 1),)))
    rng = DropoutRng(seed=4, microbatches=8)
    gm = codegen(prog, {"one": 0}, dict(model.named_parameters()).__getitem__, rng=rng)
    want = []
    for h, x in enumerate(xs):
        rng.microbatch = 6 + h
        want.append(gm(*x)[0])
    outs, _ = Interleaved(gm)([list(x) for x in xs], first=6)
    for (got,), exp in zip(outs, want):
        assert torch.equal(got, exp)
    assert not torch.equal(want[0], gm(*xs[0])[0])  # the index matters (rng.microbatch is 7 now)
