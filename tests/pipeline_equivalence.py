"""Pipeline training on a mesh vs a single-process run of the same model and data, in float64 (run in each rank)."""

from __future__ import annotations

import copy
from typing import Any

import torch

import autopar
from autopar.models import build
from autopar.runtime.actions import COMPUTE_KINDS
from autopar.runtime.costs import Costs
from autopar.runtime.simulator import simulate
from tests.exactness import float64_batch, float64_model, loss_error, parameter_error, train, user_name
from tests.exactness import make_optimizer as new_optimizer  # compare_pipeline's make_optimizer is a flag

PRESETS = {"gpt2": "tiny-gpt2", "llama": "tiny-llama", "bert": "tiny-bert"}


def make_batches(model: torch.nn.Module, example: dict, steps: int, seed: int = 1) -> list[dict]:
    """``steps`` batches shaped like ``example``: token ids below the vocabulary size, or normals."""
    g = torch.Generator().manual_seed(seed)
    vocab = getattr(getattr(model, "config", None), "vocab_size", 2)
    out = []
    for _ in range(steps):
        b = {}
        for k, v in example.items():
            if v.dtype.is_floating_point:
                b[k] = torch.randn(v.shape, generator=g, dtype=v.dtype)
            else:
                b[k] = torch.randint(0, vocab, v.shape, generator=g, dtype=v.dtype)
        out.append(b)
    return out


def compare_pipeline(
    rank: int,
    world: int,
    model_name: str,
    axes: dict[str, int],
    runs: list[tuple],
    *,
    steps: int = 3,
    microbatches: int = 4,
    batch: int = 8,
    meta: bool = False,
    compile_kwargs: dict | None = None,
    make_optimizer: bool = False,
    megatron: bool = False,
) -> dict[str, Any]:
    """For each (schedule, schedule options[, this run's own compile keywords]) in ``runs``: train
    ``steps`` SGD steps in float64 (tests/exactness.py) with autopar on the mesh and compare the
    losses and every parameter with one single-process reference. ``make_optimizer``: the pipeline's
    own optimizer (ZeRO-2 / MiCS when the plan says so) instead of the user's over the local shards."""
    from autopar.runtime.init import materialize

    preset = f"{PRESETS.get(model_name, model_name)}:batch={batch}"
    spec = build(preset, device="meta" if meta else "cpu", seed=0)
    model = float64_model(spec.model)
    # a meta model is initialized shard by shard by autopar; the reference holds the same numbers
    reference = materialize(float64_model(build(preset, device="meta").model), seed=0) if meta else copy.deepcopy(model)
    example = build(preset, device="cpu", seed=0).kwargs if meta else spec.kwargs
    batches = [float64_batch(b) for b in make_batches(reference, example, steps)]
    ref_losses = train(reference, batches)
    mesh = autopar.init_mesh("cpu", **axes)
    compile_kwargs = dict(compile_kwargs or {})
    if megatron:  # Megatron's layout: the residual stream between stages replicated over tp
        compile_kwargs["options"] = _megatron_options(model, batches[0], axes, microbatches)
    out: dict[str, Any] = {}
    for schedule, opts, *more in runs:
        extra = dict(more[0]) if more else {}  # this run's own compile keywords (microbatches= too)
        pipe = autopar.compile(  # the model is only read (and captured once per microbatch shape)
            model,
            mesh,
            kwargs=batches[0],
            schedule=schedule,
            schedule_options=opts,
            **{"microbatches": microbatches, **compile_kwargs, **extra},
        )
        if make_optimizer:  # the optimizer runs inside train_step (ZeRO-2 when the plan says so)
            opt = new_optimizer("sgd", pipe)
            losses = [pipe.train_step(**b).item() for b in batches]
        else:  # the user's own optimizer over the local shards
            opt = new_optimizer("sgd", pipe.parameters())
            losses = []
            for b in batches:
                losses.append(pipe.train_step(**b).item())
                opt.step()
                opt.zero_grad()
        key = schedule + "".join(f",{k}={v}" for k, v in {**opts, **extra}.items())
        param_rel, worst_param, compared = parameter_error(pipe.full_state_dict(), reference, whole=False)
        measured = pipe.measured()  # the last step, from every pipeline rank's trace
        r = pipe.coords()["pp"]
        sim = simulate(pipe.schedule, Costs.uniform(pipe.schedule.num_stages))
        out[key] = {
            "loss_rel": torch.tensor(loss_error(torch.tensor(losses, dtype=torch.float64), ref_losses)),
            "param_rel": torch.tensor(param_rel, dtype=torch.float64),
            "worst_param": worst_param,
            "compared": compared,  # this rank's stages' parameters; every one is held by some rank
            "all_params": [user_name(n) for n, _ in reference.named_parameters()],  # a tied group by its first name
            "local_numel": torch.tensor(sum(p.numel() for p in pipe.parameters())),
            "full_numel": torch.tensor(sum(p.numel() for p in reference.parameters())),
            "optimizer_numel": torch.tensor(sum(p.numel() for g in opt.param_groups for p in g["params"])),
            "peak_stash": torch.tensor(pipe.peak_stash),
            "sim_peak_stash": torch.tensor(sim.peak_activations[r]),
            "measured_bubble": torch.tensor(float(measured.bubble_ratio)),
            "measured_computes": torch.tensor(
                [sum(e.action.kind in COMPUTE_KINDS for e in events) for events in measured.timeline]
            ),
            "sim_computes": torch.tensor(
                [sum(e.action.kind in COMPUTE_KINDS for e in events) for events in sim.timeline]
            ),
            "stages": torch.tensor(sorted(pipe.stages)),
        }
    return out


def _megatron_options(model: torch.nn.Module, batch: dict, axes: dict[str, int], microbatches: int):
    from autopar.ir.core import MeshSpec
    from autopar.passes.lower import lower
    from autopar.passes.shard import ShardOptions
    from autopar.pipeline import _capture, split_batch
    from autopar.solver.baselines import megatron_constraints

    args, kwargs = split_batch((), batch, microbatches)[0]
    inner = MeshSpec(tuple((a, n) for a, n in axes.items() if a != "pp"))
    prog = lower(_capture(model, args, kwargs), inner)
    return ShardOptions(objective="time", constrain=megatron_constraints(prog), pin_constrained=True)


def sub_pipeline_events(
    rank: int,
    world: int,
    model_name: str,
    axes: dict[str, int],
    microbatches: int = 2,
    batch: int = 8,
    megatron: bool = False,
) -> dict[str, Any]:
    """One 1F1B step with sub-pipelined tensor parallelism, recording every compute, issue and wait of
    the interleaved sub-microbatches (``autopar.runtime.subpipeline.record_events``), and which issues
    had the other sub-microbatch compute before their wait."""
    from autopar.runtime.subpipeline import record_events

    spec = build(f"{PRESETS.get(model_name, model_name)}:batch={batch}", device="cpu", seed=0)
    b = make_batches(spec.model, spec.kwargs, 1)[0]
    mesh = autopar.init_mesh("cpu", **axes)
    # captured at the half microbatch the stages are built for, so compile reuses the capture
    kw: dict[str, Any] = {"options": _megatron_options(spec.model, b, axes, 2 * microbatches)} if megatron else {}
    pipe = autopar.compile(spec.model, mesh, kwargs=b, microbatches=microbatches, sub_pipeline_tp=True, **kw)
    with record_events() as events:
        pipe.train_step(**b)
    issued = overlapped_issues(events)
    return {phase: torch.tensor([ok for _label, _h, ok in issued.get(phase, [])], dtype=torch.bool) for phase in "FB"}


def overlapped_issues(events: list[tuple[str, int, str, str]]) -> dict[str, list[tuple[str, int, bool]]]:
    """Per phase (F, B), each issued collective as ``(label, sub-microbatch, overlapped)``: overlapped
    when the other sub-microbatch computed between the issue and its wait."""
    out: dict[str, list[tuple[str, int, bool]]] = {}
    for i, (phase, h, kind, label) in enumerate(events):
        if kind != "issue":
            continue
        j = next(k for k in range(i + 1, len(events)) if events[k] == (phase, h, "wait", label))
        ok = any(e[0] == phase and e[1] != h and e[2] == "compute" for e in events[i + 1 : j])
        out.setdefault(phase, []).append((label, h, ok))
    return out


def compare_jobs(rank: int, world: int, jobs: list[dict]) -> dict[str, Any]:
    """Several ``compare_pipeline`` calls in one process group (spawning is the expensive part of a
    test): each job is its keyword arguments plus a ``name``; ``"kind": "events"`` runs
    ``sub_pipeline_events`` instead."""
    out = {}
    for job in jobs:
        job = dict(job)
        name = job.pop("name")
        fn = sub_pipeline_events if job.pop("kind", "compare") == "events" else compare_pipeline
        out[name] = fn(rank, world, **job)
    return out
