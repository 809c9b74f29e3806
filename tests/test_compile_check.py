"""``autopar.compile(..., check=True)``: the plan is checked on simulated ranks before training.

One 2-rank gloo spawn compiles a small GPT model on tp=2 (least-memory plan: its forward reduces partial
sums over tp) with check=True, once as it is (it compiles and its first loss equals the model's) and once
with reductions that forget to reduce (compile raises CheckError naming the reduction, on every rank).
In-process: the size limit's error says how to check a scaled-down copy, and a pipeline mesh is refused.
Cost: about 15-25 s on a loaded 2-core machine (one spawn of 2 ranks, two checks on rank 0).
"""

from __future__ import annotations

import pytest
import torch

from autopar.errors import CheckError
from tests._dist import run_distributed

MODEL = "gpt3-175b:n_layer=2,n_embd=64,n_head=4,vocab_size=256,batch=4,seq=8"


def _compile_twice(rank: int, world: int) -> dict[str, object]:
    import autopar
    from autopar.models import build
    from autopar.passes.shard import ShardOptions
    from autopar.runtime import collectives as coll

    spec = build(MODEL, device="cpu", seed=0)
    mesh = autopar.init_mesh("cpu", tp=world)
    options = ShardOptions(objective="memory")
    out: dict[str, object] = {}
    compiled = autopar.compile(spec.model, mesh, spec.args, spec.kwargs, options=options, check=True)
    out["loss"] = float(compiled(*spec.args, **spec.kwargs).loss)
    out["model_loss"] = float(spec.model(*spec.args, **spec.kwargs).loss)

    start = coll._start_reduce
    coll._start_reduce = lambda c, x, axis, op, then=None: coll.Pending(
        None, lambda: then(x.clone()) if then is not None else x.clone()
    )
    try:
        autopar.compile(spec.model, mesh, spec.args, spec.kwargs, options=options, check=True)
        out["broken"] = "compiled"
    except CheckError as e:
        out["broken"] = str(e)
    finally:
        coll._start_reduce = start
    return out


def test_compile_check_passes_and_names_a_broken_reduction() -> None:
    for rank, out in enumerate(run_distributed(_compile_twice, 2)):
        assert out["loss"] == pytest.approx(out["model_loss"], rel=1e-5), out  # float32 training, summed in order
        broken = out["broken"]
        assert "does not train this model exactly" in broken, (rank, broken)
        assert "first op whose output differs" in broken, (rank, broken)
        assert "= all_reduce(" in broken or "= reduce_scatter(" in broken, (rank, broken)


def test_check_size_limit_says_how_to_check_a_scaled_down_copy(monkeypatch) -> None:
    from autopar import check
    from autopar.ir.core import MeshSpec
    from autopar.models import build
    from autopar.passes.capture import capture
    from autopar.passes.flow import plan_program

    spec = build(MODEL, device="cpu", seed=0)
    prog = plan_program(capture(spec.model, spec.args, spec.kwargs), MeshSpec((("dp", 2), ("tp", 2)))).sharded
    assert check.check_before_training(prog, spec.model, spec.args, spec.kwargs).agrees
    monkeypatch.setattr(check, "CHECK_MAX_PARAMS", 1000)
    with pytest.raises(CheckError, match=r"at most 1,000 parameters; this one has [\d,]+\..*autopar check .*dp=2,tp=2"):
        check.check_before_training(prog, spec.model, spec.args, spec.kwargs)


def test_check_refuses_a_pipeline_mesh() -> None:
    from torch.distributed.device_mesh import DeviceMesh

    import autopar

    class FakeMesh(DeviceMesh):  # no process group needed: compile refuses before using it
        def __init__(self) -> None:
            pass

        mesh_dim_names = ("pp", "tp")

        def size(self, dim: int | None = None) -> int:
            return 2 if dim is not None else 4

        device_type = "cpu"

    with pytest.raises(CheckError, match="dp/tp meshes"):
        autopar.compile(torch.nn.Linear(2, 2), FakeMesh(), (torch.randn(2, 2),), check=True)
