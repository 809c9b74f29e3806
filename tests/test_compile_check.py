"""``autopar.compile(..., check=True)``: the plan is checked on simulated ranks before training.

One 2-rank gloo spawn compiles with check=True on tp=2 (least-memory plans: their forwards reduce partial sums
over tp): a small GPT model (checked as it is; its first loss equals the model's), a GPT-2 above
``CHECK_MAX_PARAMS`` built on the meta device (checked on a scaled-down copy), and that model again with
reductions that forget to reduce (compile raises CheckError naming the reduction, on every rank).
In-process: a pipeline plan, GPT-3's plan through a scaled-down copy, a large model without a config refused.
Cost: about 30-40 s on a loaded 2-core machine (one spawn of 2 ranks, three checks on rank 0, three in-process).
"""

from __future__ import annotations

import pytest
import torch

from autopar.build import plan_programs
from autopar.check.step import check_before_training
from autopar.errors import CheckError
from autopar.ir.core import MeshSpec
from autopar.models.resolve import build
from autopar.passes.capture import capture
from autopar.passes.shard import ShardOptions
from autopar.schedule.generators import make_schedule
from tests._dist import run_distributed

MODEL = "gpt3-175b:n_layer=2,n_embd=64,n_head=4,vocab_size=256,batch=4,seq=8"


# above CHECK_MAX_PARAMS (about 29M parameters), built on the meta device: check=True checks a copy rebuilt small
# from its config carrying the plan's ops and placements (autopar/check/scale.py)
LARGE = "gpt2:n_layer=2,n_embd=512,n_head=8,batch=4,seq=16"


def _compile(rank: int, world: int) -> dict[str, object]:
    import autopar
    from autopar.check.step import CHECK_MAX_PARAMS
    from autopar.models.resolve import build
    from autopar.passes.shard import ShardOptions
    from autopar.runtime.comm import pending as inflight

    mesh = autopar.init_mesh("cpu", tp=world)
    options = ShardOptions(objective="memory")
    out: dict[str, object] = {}
    spec = build(MODEL, device="cpu", seed=0)
    compiled = autopar.compile(spec.model, mesh, spec.args, spec.kwargs, options=options, check=True)
    out["loss"] = float(compiled(*spec.args, **spec.kwargs).loss)
    out["model_loss"] = float(spec.model(*spec.args, **spec.kwargs).loss)

    large = build(LARGE, device="meta")
    out["large_params"] = sum(p.numel() for p in large.model.parameters())
    assert out["large_params"] > CHECK_MAX_PARAMS
    compiled = autopar.compile(large.model, mesh, large.args, large.kwargs, options=options, check=True)
    out["large"] = "compiled"
    start = inflight.start_reduce
    inflight.start_reduce = lambda c, x, axis, op, then=None: inflight.Pending(
        None, lambda: then(x.clone()) if then is not None else x.clone()
    )
    try:
        autopar.compile(large.model, mesh, large.args, large.kwargs, options=options, check=True)
        out["broken"] = "compiled"
    except CheckError as e:
        out["broken"] = str(e)
    finally:
        inflight.start_reduce = start
    return out


def test_compile_check_passes_and_names_a_broken_reduction() -> None:
    for rank, out in enumerate(run_distributed(_compile, 2)):
        assert out["loss"] == pytest.approx(out["model_loss"], rel=1e-5), out  # float32 training, summed in order
        assert out["large"] == "compiled", out
        broken = out["broken"]
        assert "does not train this model exactly (check=True (on a scaled-down copy" in broken, (rank, broken)
        assert "first op whose output differs" in broken, (rank, broken)
        assert "= all_reduce(" in broken or "= reduce_scatter(" in broken, (rank, broken)


def _planned(name: str, mesh: MeshSpec, device: str):
    spec = build(name, device=device, seed=0)
    captured = capture(spec.model, spec.args, spec.kwargs)
    sched = make_schedule("1f1b", mesh.pipeline_size, 1)
    forward, train = plan_programs(captured, mesh, sched, ShardOptions(objective="memory"))
    return forward, train, spec.model, captured, spec.args, spec.kwargs, mesh, sched.stage_to_rank


def test_check_before_training_on_a_pipeline_and_on_a_scaled_down_copy() -> None:
    """In-process: the real-size program of a small model on pp=2 x tp=2, and GPT-3 (2 of its layers, built on
    meta: 3.6 billion parameters) on pp=2 x tp=2 through a copy scaled down to widths of 1/64."""
    report = check_before_training(*_planned(MODEL, MeshSpec((("pp", 2), ("tp", 2))), "cpu"))
    assert report.agrees and str(report.mesh) == "[pp=2, tp=2]", report.summary()
    forward, *rest = _planned("gpt3-175b:n_layer=2", MeshSpec((("pp", 2), ("tp", 2))), "meta")
    report = check_before_training(forward, *rest)
    assert report.agrees and report.max_diff < 1e-10, report.summary()
    widths = {t.shape[-1] for op in report.program.ops for t in op.types if t.shape}
    assert 12288 not in widths and 12288 // 64 in widths, sorted(widths)  # the copy's sizes, not the model's


def test_a_large_model_without_a_config_is_refused_clearly() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4096, 4096, device="meta")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x).sum()

    x = torch.randn(4, 4096)
    net = Net()
    captured = capture(net, (x,), {})
    mesh = MeshSpec((("tp", 2),))
    forward, train = plan_programs(captured, mesh, make_schedule("1f1b", 1, 1), ShardOptions(objective="memory"))
    with pytest.raises(CheckError, match=r"has no `config`; check a small configuration .*autopar check file.py:fn"):
        check_before_training(forward, train, net, captured, (x,), {}, mesh, (0,))
