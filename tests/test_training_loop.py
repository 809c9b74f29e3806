"""Everything a training loop needs (issue 19), checked in float64 against one process at 1e-10 relative.

One spawned group of 4 gloo ranks runs every check on 4 (``_four``), one of 8 the 3D mesh (``_eight``);
the model is ``examples/train_lm.py``'s GPT, tiny and pure PyTorch (no Hugging Face import in the
ranks), its labels padded with -100 by a different amount per row (``tiny_padded_gpt``):

- dp=2 x tp=2, ZeRO-2: local batches (each rank passes its rows, used as they come) give
  the losses, gradient norms and parameters of global batches and of the single process; AdamW with
  two parameter groups given by a callable over the user's names, a warm-up + cosine ``LambdaLR``,
  clipping inside ``train_step``; the user's own loop (forward, backward, ``clip_grad_norm_``, step)
  the same; the norm counted naively (every rank's gradients, replicas included) is far off (the check
  can fail); bad batches, a mistyped group name and clipping after ``train_step`` stepped raise clear
  errors. An MLP's float inputs, split over dp by the plan, are used as each rank passes them (ZeRO-3).
- pp=2 x dp=2, 4 microbatches: token-weighted loss (``loss_weight="tokens"``) equals the single process
  with local and global batches (each rank passing only the inputs its stage reads), SGD with two
  groups given by name lists, ``StepLR``, clipping with the embedding tied across the pipeline ranks;
  the same run without the weighting is off by far more than 1e-10.
- pp=2 x dp=2 with dropout 0.1: ``eval()`` + ``no_grad`` outputs (loss and this rank's rows of the
  logits) equal the single process in eval mode; train mode's outputs differ (dropout is on); two
  runs with one seed give bitwise-identical losses, another seed other losses.
- ``examples/train_lm.py`` under torchrun (4 processes, its own test): pp=2 x dp=2 with ZeRO-2 for 4
  steps, a checkpoint, then the script's ``run`` resumed for 2 more on 4 forked ranks: its loss curve, gradient norms,
  learning rates and evaluations equal the script's ``--reference`` run (in this process).
- pp=2 x dp=2 x tp=2 (8 ranks) with ZeRO-2: the clipped global norm, the losses and the parameters
  equal ``torch.nn.utils.clip_grad_norm_``'s single process, also with sub-pipelined tp (halves
  weighted by their tokens; scaling the halves equally instead is 5e-5 off, checked by hand).

Cost on the 2-core machine, measured while other work shared it (load average 8-15): the 4-rank
group 11-39 s, the 8-rank group 12-17 s, the example's torchrun launch and its forked resume 63 s of CPU
at load 20-30 (two torchrun launches: 81 s), the single-process tests 4-9 s. Largest
differences seen: 5e-14 (AdamW parameters through ZeRO-2), 2e-16 (the clipped norm on 8 ranks),
1.8e-16 (the example's losses under torchrun).
"""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch

from autopar.errors import BatchError, OptimizerError
from autopar.runtime.call.batch import DataLayout, merge_outputs, token_count
from autopar.runtime.grads.optimizer import fused_by_default, resolve_groups
from tests.equivalence import tiny_mlp, tiny_padded_gpt, train_lm_example
from tests.exactness import TOL, float64_batch, float64_model, state_error

MAX_NORM = 0.05  # below every step's norm here, so every step is clipped


def _no_decay(name: str) -> dict:
    return {"weight_decay": 0.0} if train_lm_example().no_decay(name) else {}


def _warmup_cosine(step: int) -> float:
    return (step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / 3))


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs() / b.abs()).max().item()


# ---------------------------------------------------------------------------------------------
# 4 ranks


def _reference(model, batches, make_opt, make_sched, clip: bool = True) -> dict:
    """The single process: per-step losses, clipped norms (before clipping) and learning rates."""
    opt = make_opt(model)
    sched = make_sched(opt)
    out = {"loss": [], "norm": [], "lr": []}
    for b in batches:
        out["lr"].append(opt.param_groups[0]["lr"])
        result = model(**b)
        loss = result[0] if isinstance(result, tuple) else result
        loss.backward()
        if clip:
            out["norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        sched.step()
        out["loss"].append(loss.item())
    return out


def _compare(run: dict, ref: dict, state, reference_model) -> dict:
    state_rel, worst, missing = state_error(state, reference_model)
    return {
        "loss_rel": _rel(run["loss"], ref["loss"]),
        "norm_rel": _rel(run["norm"], ref["norm"]) if ref["norm"] else 0.0,
        "lr_rel": _rel(run["lr"], ref["lr"]),
        "state_rel": state_rel,
        "worst": worst,
        "missing": missing,
        "loss": torch.tensor(run["loss"], dtype=torch.float64),
    }


def _raises(fn, error: type[Exception]) -> str:
    try:
        fn()
    except error as e:
        return str(e)
    return "(nothing raised)"


def _zero2_groups_clip(rank: int) -> dict:
    """dp=2 x tp=2, ZeRO-2: global vs local batches vs the user's own loop, against one process."""
    import autopar
    from autopar.passes.shard import ShardOptions
    from autopar.solver.sharding.cost import TrainingSetup

    model, batches = tiny_padded_gpt(steps=5)
    adamw = {"lr": 1e-2, "weight_decay": 0.1}

    def reference_opt(m):
        named = list(m.named_parameters())
        decay = [p for n, p in named if not _no_decay(n)]
        return torch.optim.AdamW(
            [{"params": decay}, {"params": [p for n, p in named if _no_decay(n)], **_no_decay("x.bias")}], **adamw
        )

    def sched(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine)

    reference = copy.deepcopy(model)
    ref = _reference(reference, batches, reference_opt, sched)
    mesh = autopar.init_mesh("cpu", dp=2, tp=2)
    options = ShardOptions(setup=TrainingSetup(zero=2))
    out: dict = {"ref_norms": torch.tensor(ref["norm"])}
    for mode in ("global", "local", "user"):
        batch = "global" if mode == "global" else "local"
        # the loss's weighting: read from the program (the default) on local batches, said explicitly on global
        weight = {"loss_weight": "tokens"} if mode == "global" else {}
        m = autopar.compile(model, mesh, kwargs=batches[0], options=options, microbatches=2, batch=batch, **weight)
        clip = {"max_grad_norm": MAX_NORM} if mode != "user" else {}
        opt = m.make_optimizer(torch.optim.AdamW, _no_decay, **clip, **adamw)
        s = sched(opt)
        run = {"loss": [], "norm": [], "lr": []}
        for i, b in enumerate(batches):
            call = b if mode == "global" else autopar.data.local_batch(m, b)
            run["lr"].append(opt.param_groups[0]["lr"])
            if mode == "user":
                loss = m(**call)[0]
                loss.backward()
                if i == 0:  # every rank's gradients summed, replicas counted again: not the norm
                    out["naive_norm"] = _naive_norm(m)
                norm = m.clip_grad_norm_(MAX_NORM)
                opt.step()
                opt.zero_grad()
            else:
                loss = m.train_step(**call)
                norm = m.grad_norm
            s.step()
            run["loss"].append(loss.item())
            run["norm"].append(norm.item())
        out[mode] = _compare(run, ref, m.full_state_dict(), reference)
        out[mode]["direct"] = list(m._call._direct)
        if mode == "global":
            out["errors"] = [
                _raises(lambda m=m: m.train_step(**autopar.data.local_batch(m, batches[0])), BatchError),
                _raises(lambda m=m: m.clip_grad_norm_(1.0), OptimizerError),
                _raises(
                    lambda m=m: m.make_optimizer(torch.optim.SGD, [{"params": ["wte.weigth"]}], lr=0.1), OptimizerError
                ),
            ]
        if mode == "local":
            out["errors"].append(_raises(lambda m=m: m.train_step(**batches[0]), BatchError))
    return out


def _float_inputs_zero3(rank: int) -> dict:
    """dp=2 x tp=2, float inputs the plan splits over dp (each rank's rows are its share as they come),
    ZeRO-3 over dp, clipping inside ``train_step``: local vs global batches vs one process."""
    import autopar
    from autopar.passes.shard import ShardOptions
    from autopar.solver.sharding.cost import TrainingSetup

    model, batches = tiny_mlp(steps=2)
    model, batches = float64_model(model), [float64_batch(b) for b in batches]
    sgd = {"lr": 0.1, "momentum": 0.9}
    reference = copy.deepcopy(model)
    ref = _reference(reference, batches, lambda m: torch.optim.SGD(m.parameters(), **sgd), _constant)
    mesh = autopar.init_mesh("cpu", dp=2, tp=2)
    # least memory keeps the batch split over dp (least time may replicate a model this small)
    options = ShardOptions(objective="memory", setup=TrainingSetup(zero=3))
    out: dict = {}
    for mode in ("global", "local"):
        m = autopar.compile(model, mesh, kwargs=batches[0], options=options, microbatches=2, batch=mode)
        m.make_optimizer(torch.optim.SGD, max_grad_norm=MAX_NORM, **sgd)
        run = {"loss": [], "norm": [], "lr": [sgd["lr"]] * len(batches)}
        for b in batches:
            run["loss"].append(m.train_step(**(b if mode == "global" else autopar.data.local_batch(m, b))).item())
            run["norm"].append(m.grad_norm.item())
        out[mode] = _compare(run, ref, m.full_state_dict(), reference)
        out[mode]["direct"] = list(m._call._direct)
        out[mode]["zero3"] = m.zero3 is not None and bool(m.zero3.names)
    return out


def _constant(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _naive_norm(m) -> float:
    """The 2-norm of every gradient every rank holds (ZeRO-2's not yet reduced), summed over all ranks."""
    import torch.distributed as dist

    acc = torch.zeros((), dtype=torch.float64)
    for p in m.parameters():
        if p.grad is not None:
            acc += p.grad.double().pow(2).sum()
    dist.all_reduce(acc)
    return acc.sqrt().item()


def _tokens(rank: int) -> dict:
    """pp=2 x dp=2, 4 microbatches: the token-weighted loss, local and global, SGD groups by name lists."""
    import autopar

    model, batches = tiny_padded_gpt(steps=3)
    names = [n for n, _ in model.named_parameters()]
    decay = [n for n in names if not _no_decay(n)]
    plain = [n for n in names if _no_decay(n)]
    sgd = {"lr": 0.1, "momentum": 0.9}

    def reference_opt(m):
        params = dict(m.named_parameters())
        groups = [
            {"params": [params[n] for n in decay], "weight_decay": 1e-2},
            {"params": [params[n] for n in plain], "lr": 0.05},
        ]
        return torch.optim.SGD(groups, **sgd)

    def sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)

    reference = copy.deepcopy(model)
    ref = _reference(reference, batches, reference_opt, sched)
    mesh = autopar.init_mesh("cpu", pp=2, dp=2)
    out: dict = {}
    for mode in ("global", "local", "unweighted"):
        # global: the weighting read from the program (the default); local: said explicitly; unweighted: none
        weight = {"local": {"loss_weight": "tokens"}, "unweighted": {"loss_weight": None}}.get(mode, {})
        m = autopar.compile(
            model, mesh, kwargs=batches[0], microbatches=4, batch="local" if mode == "local" else "global", **weight
        )
        groups = [{"params": decay, "weight_decay": 1e-2}, {"params": plain, "lr": 0.05}]
        opt = m.make_optimizer(torch.optim.SGD, groups, max_grad_norm=MAX_NORM, **sgd)
        s = sched(opt)
        run = {"loss": [], "norm": [], "lr": []}
        for b in batches:
            if mode == "local":  # only this rank's rows of the inputs its stage reads
                b = {k: v for k, v in autopar.data.local_batch(m, b).items() if k in m.data_layout.inputs}
            run["lr"].append(opt.param_groups[0]["lr"])
            run["loss"].append(m.train_step(**b).item())
            run["norm"].append(m.grad_norm.item())
            s.step()
        out[mode] = _compare(run, ref, m.full_state_dict(), reference)
        out[mode]["inputs"] = list(m.data_layout.inputs)
    return out


def _eval_and_determinism(rank: int) -> dict:
    """pp=2 x dp=2, dropout 0.1: eval outputs against one process; two runs with one seed."""
    import autopar

    model, batches = tiny_padded_gpt(steps=3, dropout=0.1)
    reference = copy.deepcopy(model).eval()
    mesh = autopar.init_mesh("cpu", pp=2, dp=2)
    out: dict = {}
    losses = {}
    for run, seed in (("a", 0), ("b", 0), ("c", 1)):
        torch.manual_seed(seed)  # chooses the dropout masks
        m = autopar.compile(model, mesh, kwargs=batches[0], microbatches=2, batch="local", loss_weight="tokens")
        local = autopar.data.local_batch(m, batches[0])
        if run == "a":
            with torch.no_grad():
                m.eval()
                loss, logits = m(**local)
                m.train()
                ref_loss, ref_logits = reference(**batches[0])
            rows = autopar.data.local_rows(m)
            out["eval_loss_rel"] = _rel(loss, ref_loss)
            out["eval_logits_rel"] = ((logits - ref_logits[rows]).abs().max() / ref_logits.abs().max()).item()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        losses[run] = []
        for b in batches:
            losses[run].append(m.train_step(**autopar.data.local_batch(m, b)))
            opt.step()
            opt.zero_grad()
        if run == "c":  # the same parameters in train and eval mode: dropout draws only in train mode
            with torch.no_grad():
                train_logits = m(**local)[1]
                eval_logits = m.eval()(**local)[1]
            out["train_vs_eval"] = ((train_logits - eval_logits).abs().max() / eval_logits.abs().max()).item()
    out["losses"] = {k: torch.stack(v) for k, v in losses.items()}
    return out


EXAMPLE_ARGS = [
    "--mesh", "pp=2,dp=2", "--zero", "2", "--microbatches", "2", "--steps", "6", "--batch", "8", "--seq", "16",
    "--dim", "32", "--heads", "2", "--warmup", "2", "--eval-every", "2", "--eval-batches", "2", "--dtype", "float64",
    "--max-bytes", "60000", "--clip", "0.5", "--no-progress",
]  # fmt: skip


def _four(rank: int, world: int) -> dict:
    import time

    out = {}
    jobs = (
        ("zero2", _zero2_groups_clip),
        ("float", _float_inputs_zero3),
        ("tokens", _tokens),
        ("eval", _eval_and_determinism),
    )
    for name, fn in jobs:
        t0 = time.perf_counter()
        out[name] = fn(rank)
        out[name]["seconds"] = time.perf_counter() - t0
    return out


def _check_run(r: dict, at: str) -> None:
    assert not r["missing"], f"{at}: state keys differ: {r['missing']}"
    for key in ("loss_rel", "norm_rel", "lr_rel", "state_rel"):
        assert r[key] < TOL, f"{at}: {key} = {r[key]:.2e}" + (f" ({r['worst']})" if key == "state_rel" else "")


@pytest.mark.multiproc
def test_training_loop_on_four_ranks(tmp_path):
    """Every 4-rank check in one spawned group (the module docstring lists them)."""
    from tests._dist import run_distributed

    results = run_distributed(_four, 4, timeout=900)
    largest: dict[str, float] = {}
    for rank, res in enumerate(results):
        z = res["zero2"]
        assert (z["ref_norms"] > MAX_NORM).all(), "every step must be clipped for the norm to matter"
        for mode in ("global", "local", "user"):
            _check_run(z[mode], f"rank {rank} dp2 x tp2 ZeRO-2 {mode}")
        assert _rel(z["naive_norm"], z["ref_norms"][0]) > 1e-2, "the naive norm should differ from the true one"
        assert "batch='local'" in z["errors"][0] and "rows" in z["errors"][0], z["errors"][0]
        assert "max_grad_norm" in z["errors"][1], z["errors"][1]
        assert "wte.weight" in z["errors"][2], z["errors"][2]
        assert "has 4" in z["errors"][3] and "batch='global'" in z["errors"][3], z["errors"][3]
        # the plan knows the batch is local: every input is used as the rank's rows come, none gathered first
        assert all(z["local"]["direct"]), z["local"]["direct"]
        f = res["float"]
        for mode in ("global", "local"):
            _check_run(f[mode], f"rank {rank} dp2 x tp2 float inputs, ZeRO-3 {mode}")
        assert all(f["local"]["direct"]) and f["local"]["zero3"], "the plan splits the rows over dp: used as given"
        t = res["tokens"]
        for mode in ("global", "local"):
            _check_run(t[mode], f"rank {rank} pp2 x dp2 tokens {mode}")
        # the same numbers to float64 rounding (bitwise before roles by name, when both batches got one plan; with
        # roles the global and the local batch's constraints differ and the reductions may run in another order)
        assert _rel(t["local"]["loss"], t["global"]["loss"]) < TOL, f"rank {rank}: local and global losses differ"
        assert t["unweighted"]["loss_rel"] > 1e-6, "microbatch means must differ from the token mean here"
        assert t["local"]["inputs"] == (["input_ids"] if rank < 2 else ["labels"]), t["local"]["inputs"]
        e = res["eval"]
        assert e["eval_loss_rel"] < TOL and e["eval_logits_rel"] < TOL, e
        assert e["train_vs_eval"] > 1e-3, e["train_vs_eval"]
        assert torch.equal(e["losses"]["a"], e["losses"]["b"]), "one seed, plan and data: bitwise equal losses"
        assert not torch.equal(e["losses"]["a"], e["losses"]["c"]), "another seed draws other dropout masks"
        for name, value in (
            ("local vs one process (tokens)", t["local"]["loss_rel"]),
            ("zero2 params", z["local"]["state_rel"]),
            ("pp norms", t["local"]["norm_rel"]),
            ("eval logits", e["eval_logits_rel"]),
        ):
            largest[name] = max(largest.get(name, 0.0), value)
    print(
        "largest relative differences:",
        largest,
        "seconds:",
        {k: round(v["seconds"], 1) for k, v in results[0].items() if isinstance(v, dict) and "seconds" in v},
    )


def _resume_example(rank: int, world: int, argv: list[str]) -> dict:
    """``examples/train_lm.py``'s ``run`` on one rank of a forked group, as its ``main`` calls it under torchrun
    (after ``init_process_group``): the curves of the steps it trains."""
    ex = train_lm_example()
    return ex.run(ex.parser().parse_args(argv))


@pytest.mark.multiproc
@pytest.mark.slow
def test_train_lm_under_torchrun_equals_one_process(tmp_path):
    """``examples/train_lm.py`` as its users run it: ``torchrun --nproc-per-node 4`` on pp=2 x dp=2 with
    ZeRO-2 (float64, a tiny GPT, the corpus cut to 60 kB), 4 steps and a checkpoint; then the script's
    ``run`` resumes from it for 2 more on 4 ranks forked from the test's preloaded server (the code
    ``main`` runs after ``init_process_group``; a second torchrun launch cost 4 more interpreters
    importing torch and autopar, and torchrun itself is what the first launch checks). The curve of both
    (losses, gradient norms, learning rates, evaluations at steps 2, 4, 6) equals the script's
    ``--reference`` run in this process within TOL. Cost: one launch of 4 processes, each importing
    torch and autopar (about 8 s of CPU), and one forked group."""
    import json
    import os

    from tests._dist import run_distributed
    from tests.test_launch import ROOT, _launch

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    script, ckpt = ROOT / "examples" / "train_lm.py", str(tmp_path / "ckpt")
    out = tmp_path / "curves.json"
    argv = [*EXAMPLE_ARGS, "--ckpt-dir", ckpt, "--until", "4", "--ckpt-every", "4", "--out", str(out)]
    results = _launch(argv, 1, env, tmp_path, script=script, nproc=4, restarts=0)
    assert all(rc == 0 for rc, _ in results), "\n".join(text for _, text in results)[-6000:]
    first = json.loads(out.read_text())
    resumed = run_distributed(_resume_example, 4, [*EXAMPLE_ARGS, "--ckpt-dir", ckpt, "--resume"], timeout=300)[0]
    got = {k: first[k] + [list(x) if isinstance(x, tuple) else x for x in resumed[k]] for k in first}
    ex = train_lm_example()
    reference = ex.run(ex.parser().parse_args([*EXAMPLE_ARGS, "--reference"]))
    assert len(got["loss"]) == 6 and [s for s, _ in got["eval"]] == [2, 4, 6], got
    for key in ("loss", "grad_norm", "lr"):
        assert _rel(got[key], reference[key]) < TOL, f"example {key}: {_rel(got[key], reference[key]):.2e}"
    assert _rel([v for _, v in got["eval"]], [v for _, v in reference["eval"]]) < TOL
    print("largest relative difference of the losses:", _rel(got["loss"], reference["loss"]))


# ---------------------------------------------------------------------------------------------
# 8 ranks


def _eight(rank: int, world: int, root: str) -> dict:
    """pp=2 x dp=2 x tp=2, ZeRO-2, clipping inside ``train_step``, the token-weighted loss; also with
    Merak's sub-pipelined tp (each microbatch run as two halves holding different numbers of tokens).
    The first exports the whole model to safetensors before training (bit for bit the user's model,
    loadable with ``strict=True``) and after (the single process's within TOL)."""
    import os

    import autopar
    from autopar.passes.shard import ShardOptions
    from autopar.runtime.checkpoint.safetensors_io import load_safetensors, save_safetensors
    from autopar.solver.sharding.cost import TrainingSetup

    model, batches = tiny_padded_gpt(steps=3)
    sgd = {"lr": 0.1, "momentum": 0.9}
    reference = copy.deepcopy(model)
    ref = _reference(reference, batches, lambda m: torch.optim.SGD(m.parameters(), **sgd), _constant)
    mesh = autopar.init_mesh("cpu", pp=2, dp=2, tp=2)
    # least memory: every stage sharded over tp, ZeRO-2 over dp
    options = ShardOptions(objective="memory", setup=TrainingSetup(zero=2))
    out = {}
    for name, sub in (("1f1b", False), ("sub-pipelined", True)):
        weight = {} if sub else {"loss_weight": "tokens"}  # sub-pipelined: the program's weighting (the default)
        m = autopar.compile(
            model, mesh, kwargs=batches[0], options=options, microbatches=2, sub_pipeline_tp=sub, **weight
        )
        m.make_optimizer(torch.optim.SGD, max_grad_norm=MAX_NORM, **sgd)
        if not sub:  # the export before training: the user's own model, every key, bit for bit
            before = load_safetensors(save_safetensors(m, os.path.join(root, "before.safetensors")))
            mine = model.state_dict()
            out["export"] = {
                "same keys": before.keys() == mine.keys(),
                "exact": all(torch.equal(before[k], v) for k, v in mine.items() if k in before),
                "strict load": copy.deepcopy(model).load_state_dict(before, strict=True) is not None,
            }
        run = {"loss": [], "norm": [], "lr": [sgd["lr"]] * len(batches)}
        for b in batches:
            run["loss"].append(m.train_step(**b).item())
            run["norm"].append(m.grad_norm.item())
        out[name] = _compare(run, ref, m.full_state_dict(), reference)
        if not sub:  # and after: what it trained, as the single process trained it
            after = load_safetensors(save_safetensors(m, os.path.join(root, "after.safetensors")))
            out["export"]["trained"] = torch.tensor(state_error(after, reference)[0])
            whole = m.full_state_dict()
            out["export"]["equals full_state_dict"] = all(torch.equal(after[k], v) for k, v in whole.items())
        out[name]["sharded"] = sum(p.numel() for p in m.parameters()) < sum(p.numel() for p in reference.parameters())
    out["ref_norms"] = torch.tensor(ref["norm"])
    return out


@pytest.mark.multiproc
def test_clipping_and_export_on_pp2_dp2_tp2_zero2(tmp_path):
    """Clipping and the token-weighted loss on the 3D mesh with ZeRO-2, plain and sub-pipelined; the
    whole model exported to safetensors from it (the tied head stored once)."""
    from safetensors import safe_open

    from tests._dist import run_distributed

    for rank, res in enumerate(run_distributed(_eight, 8, str(tmp_path), timeout=900)):
        export = res.pop("export")
        assert export.pop("trained") < TOL and all(export.values()), (rank, export)
        assert (res["ref_norms"] > MAX_NORM).all()
        for name in ("1f1b", "sub-pipelined"):
            r = res[name]
            assert r["sharded"], "the stages should be sharded over tp"
            _check_run(r, f"rank {rank} pp2 x dp2 x tp2 ZeRO-2 {name}")
            print(name, "norm", r["norm_rel"], "state", r["state_rel"], "loss", r["loss_rel"])
    with safe_open(str(tmp_path / "after.safetensors"), "pt") as f:
        assert "head.weight" not in f.keys() and "wte.weight" in f.keys()  # noqa: SIM118 - the tied head once


# ---------------------------------------------------------------------------------------------
# one process


def test_data_rows_sampler_and_weights():
    """Which rows each data-parallel rank takes (MiCS's two dp axes too), the batch sampler built on
    them, the token count, the weighted merge and the parameter-group errors."""
    names, sizes = ("pp", "dpr", "dp", "tp"), (2, 2, 2, 2)
    layouts = [
        DataLayout.of(names, sizes, {"pp": 0, "dpr": r // 2, "dp": r % 2, "tp": 1}, pieces=2, piece_rows=8)
        for r in range(4)
    ]
    rows = [lay.data_rows() for lay in layouts]
    assert rows[1] == [2, 3, 10, 11], rows[1]  # its quarter of each of the two pieces
    assert sorted(r for rs in rows for r in rs) == list(range(16))
    with pytest.raises(BatchError, match="multiple of 8"):
        DataLayout.of(("dp",), (4,), {"dp": 0}, pieces=2, piece_rows=6).require_divisible()

    from autopar.data import BatchSampler

    fake = [types.SimpleNamespace(data_layout=lay, options=types.SimpleNamespace(batch="local")) for lay in layouts]
    samplers = [BatchSampler(40, 16, f, seed=3) for f in fake]
    whole = list(BatchSampler(40, 16, seed=3))
    assert len(whole) == 2 and all(len(b) == 16 for b in whole)
    for step, batch in enumerate(whole):
        mine = [list(s)[step] for s in samplers]
        assert sorted(i for m in mine for i in m) == sorted(batch)
        assert mine[1] == [batch[i] for i in rows[1]]
    with pytest.raises(BatchError, match="global batch of 16"):
        BatchSampler(40, 8, fake[0])

    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    assert token_count()({"labels": labels}).item() == 3
    assert token_count(shift=1)({"labels": labels}).item() == 1
    with pytest.raises(BatchError, match="labels"):
        token_count()({"ids": labels})
    merged = merge_outputs([[torch.tensor(1.0)], [torch.tensor(4.0)]], weights=[3.0, 1.0])
    assert merged[0].item() == pytest.approx(1.75)

    users = {"w": ["w", "tied.w"], "b": ["b"]}
    groups = resolve_groups([{"params": ["tied.w"], "lr": 1}, {"params": ["b"]}], users, ["w", "b"])
    assert groups == [({"lr": 1}, ["w"]), ({}, ["b"])]
    assert resolve_groups(lambda n: {"wd": 0} if n == "b" else None, users, ["w", "b"]) == [
        ({}, ["w"]),
        ({"wd": 0}, ["b"]),
    ]
    with pytest.raises(OptimizerError, match="in no group"):
        resolve_groups([{"params": ["w"]}], users, ["w", "b"])
    with pytest.raises(OptimizerError, match="two|groups 0 and 1"):
        resolve_groups([{"params": ["w", "b"]}, {"params": ["tied.w"]}], users, ["w", "b"])


def test_a_local_batch_is_planned_as_given():
    """``batch="local"`` reaches the planner: the token ids and labels are where their rows were dealt
    (split over dp, ``deals_rows``), so the ranks use them as they come, and moving one is priced, not free.
    The example's GPT (dim 64, 64 tokens x 8) on dp=2 x tp=2: the local plan keeps both inputs dealt and
    no collective moves them; the global plan (what local batches ran before) keeps the labels whole, which
    a local batch would have had to all-gather at run time. Too small a model (dim 32, 8 x 4) computes the
    loss whole on every dp rank: the local plan then all-gathers the labels in the program, and pays for it
    (its predicted step is slower than the global plan's, which got the whole labels for free)."""
    from autopar.api import DEFAULT_PIPELINE, parse_mesh
    from autopar.ir.layout import deals_rows
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.passes.manager import PassManager
    from autopar.passes.shard import ShardOptions, planning_options
    from autopar.solver.cluster.spec import ClusterSpec
    from tests.test_cost_plans import _moved_recomputable

    ex = train_lm_example()
    mesh = parse_mesh("dp=2,tp=2")
    plans = {}
    for dim, seq, rows in ((64, 64, 8), (32, 8, 4)):
        torch.manual_seed(0)
        model = ex.GPT(ex.GPTConfig(vocab=256, seq=seq, dim=dim, heads=2, layers=2))
        ids = torch.randint(0, 256, (rows, seq))
        lowered = lower(capture(model, (), {"input_ids": ids, "labels": ids}), mesh)
        for batch in ("global", "local"):
            opts = planning_options(ShardOptions(batch=batch), ClusterSpec.load("local-cpu"))
            pm = PassManager(DEFAULT_PIPELINE, options={"shard": opts})
            planned = pm.run(lowered)
            inputs = [v for v in planned.inputs if v.kind == "input"]
            dealt = [deals_rows(v.type.placements, (0,)) for v in inputs]
            # collectives moving a user input (integer inputs are among the values a global batch recomputes)
            moved = [m.split(" ")[2].split("(")[0] for m in _moved_recomputable(lowered, planned)
                     if any(f" of %{v.name} " in m for v in inputs)]  # fmt: skip
            plans[dim, batch] = (dealt, moved, pm.info["shard"].step_seconds)
    dealt, moved, seconds = plans[64, "local"]
    assert dealt == [True, True] and not moved, plans[64, "local"]
    assert plans[64, "global"][0] == [True, False], "the global plan keeps the labels whole (the check can fail)"
    assert seconds > plans[64, "global"][2]  # the loss's token count over split labels is reduced: priced
    dealt, moved, seconds = plans[32, "local"]
    assert dealt == [True, True] and moved == ["all_gather"], plans[32, "local"]
    assert seconds > plans[32, "global"][2], plans


class _ByWeight(torch.nn.Module):
    """A ratio whose divisor a parameter reaches: not a mean over the data's items."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum() / self.w.sum()


def test_the_loss_weighting_is_read_from_the_program():
    """``loss_weight="auto"`` finds the divisor of a mean cross-entropy (its count of labels that are not
    -100: the program's ``sum / count``, only ``labels`` read); a mean-squared error (no ratio) and a ratio
    over a parameter get none (equal microbatches). That the weights it computes train as one device does
    is the 4- and 8-rank runs' check."""
    from autopar.api import parse_mesh
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.runtime.call.loss_weight import divisor_program

    mesh = parse_mesh("dp=1")
    model, batches = tiny_padded_gpt(steps=1)
    divisor = divisor_program(lower(capture(model, (), batches[0]), mesh))
    assert divisor is not None and [v.name for v in divisor.inputs] == ["labels"], divisor
    assert [op.target for op in divisor.ops][-2:] == ["aten.ne.Scalar", "aten.sum"]
    mlp, mlp_batches = tiny_mlp(steps=1)
    assert divisor_program(lower(capture(mlp, (), mlp_batches[0]), mesh)) is None
    assert divisor_program(lower(capture(_ByWeight(), (torch.randn(3, 4),), {}), mesh)) is None


def test_the_optimizer_gets_torchs_fused_kernel_unless_told_otherwise():
    """``make_optimizer``'s default implementation: torch's fused kernel where the class has one; the caller's
    ``fused``/``foreach`` as given; torch's default where the class has no fused kernel or torch refuses it
    for these options. The fused kernel trains the for-loop's numbers to rounding (float64, 3 AdamW steps)."""

    def params():
        g = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(5, 3, generator=g, dtype=torch.float64)) for _ in range(2)]

    def implementation(opt: torch.optim.Optimizer) -> tuple:
        return bool(opt.defaults.get("fused")), bool(opt.defaults.get("foreach"))

    assert implementation(fused_by_default(torch.optim.AdamW, params(), lr=1e-3)) == (True, False)
    assert implementation(fused_by_default(torch.optim.SGD, params(), lr=0.1, momentum=0.9)) == (True, False)
    assert implementation(fused_by_default(torch.optim.AdamW, params(), foreach=True)) == (False, True)
    assert implementation(fused_by_default(torch.optim.AdamW, params(), fused=False)) == (False, False)
    assert implementation(fused_by_default(torch.optim.RMSprop, params(), lr=0.01)) == (False, False)  # none
    refused = fused_by_default(torch.optim.AdamW, params(), differentiable=True)  # torch: fused is not
    assert implementation(refused) == (False, False)
    z = torch.nn.Parameter(torch.randn(3, dtype=torch.complex128))  # torch refuses fused complex at step()
    complex_opt = fused_by_default(torch.optim.AdamW, [{"params": [z]}], lr=1e-3)
    assert implementation(complex_opt) == (False, False)
    z.grad = torch.ones_like(z)
    complex_opt.step()

    fused, plain = params(), params()
    opts = fused_by_default(torch.optim.AdamW, fused, lr=1e-3), torch.optim.AdamW(plain, lr=1e-3, foreach=False)
    for step in range(3):
        for ps, opt in zip((fused, plain), opts):
            for i, p in enumerate(ps):
                p.grad = torch.full_like(p, 0.1 * (step + 1) * (i + 1)).sin()
            opt.step()
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=TOL, atol=0)
