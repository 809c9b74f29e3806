"""ZeRO-3 + ``precision="bf16"`` + ``torch_compile=True`` on 2 gloo ranks (dp=2), a tiny GPT-2 (a root unit and
three blocks), against eager bf16 and eager fp32 (both ZeRO-3).

What must hold of the compiled run: its losses and final parameters are as close to fp32's as eager bf16's are
(tests/test_torch_compile.py's ``BF16_NOISE``: both round to bf16, at different places), and eager bf16 differs
from fp32 (bf16 is really used); the training program ran compiled (``compile_log``: no failure, ``stage0``
compiled, nothing eager but ZeRO-3's gathers and releases; dynamo compiled graphs), with no compile failure's
``RuntimeWarning``; the plan is ZeRO-3 (each rank holds half the parameters, gathered unit by unit); and the
compute copies stay one unit at a time as in eager (runtime/grads/zero3.py): the bf16 copies autograd saves are
tokens cast again in the backward (the bytes saved drop by as much as in eager when they are, to within the
1-D parameters' copies), to the same bits (the gradients equal those of the copies saved), and the gathered
units and copies alive at once are no more than the plan priced (``predicted_categories``' ``gathered``,
which eager measures exactly, as tests/test_memory.py checks).

What the test caught (runtime/build/compiled.py): the compiled program dropped ZeRO-3's release as dead code
(a call returning nothing), so no copy became a token (the drop was 0 bytes, eager's 313,088) and every gathered
unit stayed to the forward's end (641,280 bytes of fp32 units at once, the copies not even counted; priced
516,480); with the release kept, dynamo's graph breaks at the gathers and releases still held every unit and
every copy to the forward's end (the frames resuming after them last as long as the program: 961,920 bytes,
the whole model in fp32 and in bf16), which cutting the program at them (``_compiled``) ends. (Its cut where
the head reads the root again after the last block shows on a larger root: BENCHMARKS 20.)
"""

from __future__ import annotations

import os

import pytest
import torch

from autopar.solver.sharding.cost import TrainingSetup
from autopar.solver.sharding.options import ShardOptions
from tests._dist import run_distributed
from tests.equivalence import _compile_log, _dynamo_graphs
from tests.test_torch_compile import BF16_NOISE, sgd_without_compile_warnings

ZERO3 = ShardOptions(setup=TrainingSetup(zero=3))
RUNS = (("fp32", False), ("bf16", False), ("bf16", True))


def _run(model, batches, precision: str, compiled: bool) -> dict:
    """Train ``batches`` with SGD under ZeRO-3 in ``precision``; then one more step's saved bytes, gradients and
    gathered bytes with the copies cast again and saved (bf16)."""
    import autopar
    from autopar.runtime.measure.memory import SavedTensors, predicted_categories

    graphs = _dynamo_graphs()
    mesh = autopar.init_mesh("cpu", dp=2)
    m = autopar.compile(model, mesh, kwargs=batches[0], options=ZERO3, precision=precision, torch_compile=compiled)
    losses, opt = sgd_without_compile_warnings(m, batches)
    full = m.full_state_dict()
    out = {
        "losses": losses,
        "params": {k: v.double() for k, v in full.items() if v.is_floating_point()},
        "graphs": _dynamo_graphs() - graphs,
        "compile_log": _compile_log(m),
        "zero3": m.zero3 is not None,
        "local_numel": sum(p.numel() for p in m.parameters()),
        "full_numel": sum(p.numel() for p in model.parameters()),
        "gathered_predicted": predicted_categories(m)["gathered"],
        "units": m.zero3.unit_bytes() if m.zero3 is not None else [],
    }
    if precision == "fp32" or m.zero3 is None:
        return out
    params = list(m.parameters())
    grads = []
    for cast_again in (True, False):  # False: autograd saves the copies themselves (tests/test_memory.py's reference)
        m.zero3.cast_again = cast_again
        m.zero3.reset_peak()
        with SavedTensors(params + list(batches[0].values())) as saved:
            m.train_step(**batches[0])
        out[f"saved_{cast_again}"] = saved.bytes
        out[f"gathered_{cast_again}"] = m.zero3.peak_gathered()
        grads.append(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]))
        opt.zero_grad(set_to_none=True)
    out["cast_again_equal"] = torch.equal(*grads) and grads[0].abs().sum().item() > 0
    return out


def _ranks(rank: int, world: int, cache: str) -> dict:
    from tests.equivalence import tiny_gpt2

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    model, batches = tiny_gpt2(batch=4, seq=16, steps=3, layers=3)
    out = {f"{p}{c}": _run(model, batches, p, c) for p, c in RUNS}
    start = {k: v.double() for k, v in model.state_dict().items() if v.is_floating_point()}
    out["start"] = {k: start[k] for k in out["fp32False"]["params"]}
    # the bf16 copies of the 1-D parameters (biases, layer norms): which of those autograd saves depends on
    # Inductor's partitioner; every 2-D one is a matmul's (or the embedding's) weight
    out["vector_copy_bytes"] = 2 * sum(p.numel() for p in model.parameters() if p.dim() == 1)
    return out


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).abs() / ref.abs()).max().item()


def _update_rel(params: dict, fp32: dict, start: dict) -> float:
    """How far ``params`` are from fp32's, as a fraction of the fp32 run's update (the weights moved by
    training; a fraction of the weights themselves would hide a wrong gradient below bf16's rounding)."""
    diff = sum(((params[k] - fp32[k]) ** 2).sum() for k in fp32)
    moved = sum(((fp32[k] - start[k]) ** 2).sum() for k in fp32)
    return (diff / moved).sqrt().item()


@pytest.mark.multiproc
@pytest.mark.heavy  # 61-71 s cold (Inductor compiling on both ranks) at load 3-5 on the 2 shared cores; 20 s warm
@pytest.mark.timeout(900)
def test_zero3_bf16_compiled_trains_as_eager_bf16_with_one_unit_of_copies_at_a_time(tmp_path):
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(tmp_path / "inductor")
    for rank, res in enumerate(run_distributed(_ranks, 2, cache, timeout=850)):
        fp32, eager, compiled = (res[f"{p}{c}"] for p, c in RUNS)
        for key, r in zip(("fp32", "bf16 eager", "bf16 compiled"), (fp32, eager, compiled)):
            at = f"{key}, rank {rank}"
            # ZeRO-3: each rank's parameters are its half of the model's, gathered unit by unit
            assert r["zero3"] and r["local_numel"] == r["full_numel"] // 2, (at, r["local_numel"], r["full_numel"])
            assert (r["compile_log"] is None) == (key != "bf16 compiled"), at
        at = f"rank {rank}"
        log = compiled["compile_log"]
        assert compiled["graphs"] > 0, f"{at}: dynamo compiled no graph"
        assert not log["failed"] and "stage0" in log["compiled"], (at, log)  # the training program ran compiled
        calls = {c.split(" ")[0] for c in log["eager"].get("stage0", ())}  # what it leaves eager: the graph breaks
        assert calls == {"Zero3Params._gather_unit", "Zero3Params._release_unit"}, (at, log["eager"])
        # bf16: losses and the parameters' updates as close to fp32 as eager bf16's are (BF16_NOISE)
        loss_eager, loss_compiled = _rel(eager["losses"], fp32["losses"]), _rel(compiled["losses"], fp32["losses"])
        start = res["start"]
        param_eager = _update_rel(eager["params"], fp32["params"], start)
        param_compiled = _update_rel(compiled["params"], fp32["params"], start)
        print(
            f"{at}: bf16 vs fp32, largest relative loss error: eager {loss_eager:.2e}, compiled {loss_compiled:.2e}; "
            f"parameters off by a fraction of the update: eager {param_eager:.2e}, compiled {param_compiled:.2e}"
        )
        assert loss_eager > 0 and param_eager > 0, f"{at}: bf16 changed nothing (not computed in bf16?)"
        assert loss_compiled <= BF16_NOISE * max(loss_eager, 2**-8), (at, loss_compiled, loss_eager)
        assert param_compiled <= BF16_NOISE * max(param_eager, 2**-8), (at, param_compiled, param_eager)
        # the copies autograd saves are tokens, cast again in the backward to the forward's bits
        assert eager["cast_again_equal"] and compiled["cast_again_equal"], at
        drop_eager = eager["saved_False"] - eager["saved_True"]
        drop_compiled = compiled["saved_False"] - compiled["saved_True"]
        print(f"{at}: bytes saved less with the copies cast again: eager {drop_eager:,}, compiled {drop_compiled:,}")
        assert abs(drop_compiled - drop_eager) <= res["vector_copy_bytes"], (at, drop_compiled, drop_eager)
        # the units gathered and their copies alive at once: what the plan priced, as eager (exactly); at most the
        # root and two blocks (the one computing, the one arriving) with their bf16 copies (half their bytes)
        units = dict(compiled["units"])
        bound = 1.5 * (units.pop("root") + sum(sorted(units.values())[-2:]))
        print(
            f"{at}: gathered bytes at most: eager {eager['gathered_True']:,}, compiled {compiled['gathered_True']:,}, "
            f"priced {compiled['gathered_predicted']:,.0f}; the root and two blocks {bound:,.0f}"
        )
        assert eager["gathered_True"] == eager["gathered_predicted"] <= bound, (at, eager["gathered_True"])
        assert compiled["gathered_True"] <= compiled["gathered_predicted"], (at, compiled["gathered_True"])
