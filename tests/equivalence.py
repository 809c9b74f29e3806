"""The equivalence harness: autopar on a mesh vs a single-process run of the same model and data, in
float64 (tests/exactness.py), run in every rank. One module class runs every mesh, so one harness:

- ``compare`` / ``compare_models``: the module called like the model (``forward``, the user's
  ``backward`` and optimizer), on meshes without a pipeline: layouts, ZeRO-2/3 state accounting, a
  broken program the comparison must see;
- ``compare_train_step`` / ``compare_jobs``: ``train_step`` under a schedule on any mesh (a mesh
  without ``pp`` is one stage): losses, ``forward``'s outputs before training, and the whole model
  gathered by ``full_state_dict`` (every key of ``model.state_dict()``) after it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import autopar
from autopar.ir.axes import PIPELINE_AXIS
from autopar.models.resolve import build
from autopar.schedule.action_costs import Costs
from autopar.schedule.actions import COMPUTE_KINDS
from autopar.schedule.simulator import simulate
from tests.exactness import (
    STATES_PER_ELEMENT,
    drop_a_row_parallel_all_reduce,
    float64_batch,
    float64_model,
    loss_error,
    loss_of,
    parameter_error,
    state_error,
    train,
    train_accumulating,
)
from tests.exactness import make_optimizer as new_optimizer  # compare_train_step's make_optimizer is a flag


def tiny_gpt2(seed: int = 0, batch: int = 4, seq: int = 16, steps: int = 3, layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=32,
        use_cache=False,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (batch, seq), generator=g)
        batches.append({"input_ids": ids, "labels": torch.roll(ids, -1, 1)})
    return model, batches


class MLP(torch.nn.Module):
    """A plain model with a branch and a residual, computing its own loss."""

    def __init__(self, d: int = 32, h: int = 64):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, h)
        self.fc2 = torch.nn.Linear(h, d)
        self.gate = torch.nn.Linear(d, h, bias=False)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x, target):
        h = torch.nn.functional.gelu(self.fc1(x)) * torch.sigmoid(self.gate(x))
        y = self.norm(x + self.fc2(h))
        return torch.nn.functional.mse_loss(y, target)


def tiny_mlp(seed: int = 0, batch: int = 8, steps: int = 3):
    torch.manual_seed(seed)
    model = MLP()
    g = torch.Generator().manual_seed(seed + 1)
    batches = [
        {"x": torch.randn(batch, 32, generator=g), "target": torch.randn(batch, 32, generator=g)} for _ in range(steps)
    ]
    return model, batches


MODELS = {"gpt2": tiny_gpt2, "gpt2x4": lambda: tiny_gpt2(layers=4), "mlp": tiny_mlp}


def compare(rank: int, world: int, model_name: str, axes: dict[str, int], strategy: str = "autopar") -> dict:
    """Run on every rank: autopar on the mesh vs the single-process reference, both from one seed, in
    float64 with SGD (tests/exactness.py).

    ``strategy`` is ``+``-joined kinds. ``"megatron"`` trains Megatron's layout (vocab-parallel
    embedding, column/row linears) instead of the ILP's choice, so every sharding rule it uses is
    checked numerically too; ``"zero2"`` alone trains data parallel on every axis with ZeRO-2 over all
    of them, and ``"megatron+zero2"`` Megatron's layout with ZeRO-2 over ``dp``, both through the
    compiled module's sharded optimizer (``make_optimizer``); ``"megatron+zero3"`` the same layout with
    ZeRO-3 over ``dp`` (each rank keeps its slice of the dp-replicated parameters; the forward
    all-gathers them); ``"plan"`` compiles every rank from a plan file made offline. ``"adamw"`` trains
    with AdamW instead of SGD; ``"broken"`` drops one row-parallel all-reduce from every rank's program
    (``drop_a_row_parallel_all_reduce``), a sharding bug the comparison must see; ``"keepgrads"`` zeroes
    the gradients in place between steps (``zero_grad(set_to_none=False)``): they stay the slices of
    the gradient buckets they became at the first step's sync, and accumulate there; ``"accumulate"``
    accumulates two batches per step, the first backward inside ``no_sync()``, and also trains a second
    compiled copy without ``no_sync`` (its first gradients synced twice: the comparison must see it)."""
    kinds = set(strategy.split("+"))
    model, batches = MODELS[model_name]()
    model, batches = float64_model(model), [float64_batch(b) for b in batches]
    optimizer = "adamw" if "adamw" in kinds else "sgd"
    reference = copy.deepcopy(model)
    mesh = autopar.init_mesh("cpu", **axes)
    options = None
    if kinds & {"megatron", "zero2", "zero3"}:
        from autopar.api import mesh_spec
        from autopar.passes.capture import capture
        from autopar.passes.lower import lower
        from autopar.passes.shard import ShardOptions
        from autopar.solver.sharding.baselines import data_parallel_constraints, megatron_constraints
        from autopar.solver.sharding.cost import TrainingSetup

        prog = lower(capture(model, (), batches[0]), mesh_spec(mesh))
        layout = megatron_constraints(prog) if "megatron" in kinds else data_parallel_constraints(prog)
        setup = TrainingSetup()
        for zero in (2, 3):  # alone: data parallel on every axis, ZeRO over all of them; with megatron: over dp
            if f"zero{zero}" in kinds:
                setup = TrainingSetup(zero=zero, zero_axes=None if "megatron" in kinds else tuple(axes))
        # least memory keeps the batch split under pure data parallelism (least communication would
        # gather a tiny model's input and replicate its compute, leaving no gradient for ZeRO to shard)
        objective = "time" if "megatron" in kinds else "memory"
        # Megatron computes with each weight shard where it is stored (pin_constrained)
        options = ShardOptions(objective=objective, constrain=layout, setup=setup, pin_constrained="megatron" in kinds)
    plan = None
    if "plan" in kinds:  # planned offline into a JSON file, then every rank compiles from the file
        import tempfile

        import torch.distributed as dist

        from autopar.api import mesh_spec
        from autopar.passes.capture import capture
        from autopar.passes.shard import ShardOptions
        from autopar.planner import plan_captured

        path = [f"{tempfile.gettempdir()}/autopar-test-plan-{model_name}-{'x'.join(map(str, axes.values()))}.json"]
        if rank == 0:
            report = plan_captured(capture(model, (), batches[0]), mesh_spec(mesh), ShardOptions(), baselines=())
            report.plan.save(path[0])
        dist.barrier()
        plan = path[0]
    compiled = autopar.compile(model, mesh, kwargs=batches[0], options=options, plan=plan)
    dropped = drop_a_row_parallel_all_reduce(compiled.stage_modules["forward0"]) if "broken" in kinds else ""
    states: list[int] = []
    accumulate = "accumulate" in kinds
    if accumulate:  # two batches a step; a copy without no_sync syncs its first gradients twice
        twice = autopar.compile(copy.deepcopy(reference), mesh, kwargs=batches[0], options=options)
        train_accumulating(twice, batches, optimizer, no_sync=False)
        losses = train_accumulating(compiled, batches, optimizer)
        states.append(0)
    else:
        losses = train(compiled, batches, optimizer, states=states, set_to_none="keepgrads" not in kinds)
    buffers = {b.untyped_storage().data_ptr() for b in compiled._grads._buffers.values()}
    synced = [p for n, p in compiled.named_parameters() if n in compiled._grads._axes and compiled._grads._axes[n]]
    in_buckets = sum(p.grad is not None and p.grad.untyped_storage().data_ptr() in buffers for p in synced)
    full = compiled.full_state_dict()
    gathered_alive, gathered_peak, units = -1, -1, []
    if compiled.zero3 is not None:  # the whole parameters must not outlive the forward
        compiled.zero3.reset_peak()
        loss = loss_of(compiled(**batches[0]))
        gathered_alive = compiled.zero3.gathered_bytes.alive()  # bytes of whole parameters left
        loss.backward()  # re-gathers the saved ones; the gradients are dropped (after the comparison)
        gathered_peak = compiled.zero3.peak_gathered()  # the most whole bytes alive in forward and backward
        units = compiled.zero3.unit_bytes()
    ref_losses = (train_accumulating if accumulate else train)(reference, batches, optimizer)
    param_rel, worst_param, _ = parameter_error(full, reference)
    unsynced_rel = parameter_error(twice.full_state_dict(), reference)[0] if accumulate else 0.0
    per_element = STATES_PER_ELEMENT[optimizer]
    return {
        "loss_rel": torch.tensor(loss_error(losses, ref_losses), dtype=torch.float64),
        "param_rel": torch.tensor(param_rel, dtype=torch.float64),
        "worst_param": worst_param,
        "dropped": dropped,
        "states_per_element": torch.tensor(per_element),
        "local_numel": torch.tensor(sum(p.numel() for p in compiled.parameters())),
        "optimizer_state_numel": torch.tensor(states[0]),
        "zero_expected_numel": torch.tensor(_zero_expected(compiled, per_element)),
        "zero3_expected_numel": torch.tensor(_zero_expected(compiled, 1, per_tensor=True)),
        "gathered_alive": torch.tensor(gathered_alive),
        "gathered_peak": torch.tensor(gathered_peak),
        "root_bytes": torch.tensor(sum(b for label, b in units if label == "root")),
        "block_bytes": torch.tensor([b for label, b in units if label != "root"], dtype=torch.int64),
        "full_numel": torch.tensor(sum(p.numel() for p in full.values())),
        "synced_params": torch.tensor(len(synced)),
        "grads_in_buckets": torch.tensor(in_buckets),
        "unsynced_rel": torch.tensor(unsynced_rel, dtype=torch.float64),
        "fused_f": torch.tensor(fused_column_linears(compiled)),
        **axis_use(compiled.program),
    }


def axis_use(prog) -> dict[str, torch.Tensor]:
    """What the plan does with each mesh axis: how many parameters it shards there (``sharded_on_<axis>``) and
    how many user inputs it splits on the batch there (``batch_on_<axis>``), and how many inputs there are."""
    from autopar.ir.core import Shard

    out = {"inputs": torch.tensor(sum(v.kind == "input" for v in prog.inputs))}
    for i, name in enumerate(prog.mesh.names):
        params = [v for v in prog.inputs if v.kind == "param"]
        inputs = [v for v in prog.inputs if v.kind == "input"]
        out[f"sharded_on_{name}"] = torch.tensor(sum(isinstance(v.type.placements[i], Shard) for v in params))
        out[f"batch_on_{name}"] = torch.tensor(sum(v.type.placements[i] == Shard(0) for v in inputs))
    return out


def fused_column_linears(compiled) -> int:
    """How many of Megatron's f run fused with their matmuls (runtime/comm/column_linear.py) in the rank's modules."""
    from autopar.runtime.comm.column_linear import column_linears

    gms = compiled.stage_modules.values()
    return sum(n.target is column_linears for gm in gms for n in gm.graph.nodes)


def _zero_expected(compiled, per_element: int, per_tensor: bool = False) -> int:
    """Optimizer state elements a rank holds under ZeRO-2: ``per_element`` per element of its slice of
    the parameters replicated over the ZeRO axes (gradient summed over all of them, or whole on every
    rank; padded to equal slices), ``per_element`` per other element. ``per_tensor``: each parameter
    padded and sliced on its own (ZeRO-3's layout, where with ``per_element=1`` this is also the number
    of parameter elements the rank keeps)."""
    from autopar.ir.core import Replicate
    from autopar.runtime.grads.zero import zero_axes_of

    zero_axes, replicas = zero_axes_of(compiled.setup, compiled.program.mesh)
    need = set(zero_axes) | set(replicas)
    k = 1
    for a in zero_axes:
        k *= compiled.program.mesh.axis_size(a)
    managed = other = 0
    shapes = dict(zip(compiled.zero3.names, compiled.zero3.shapes)) if compiled.zero3 is not None else {}
    for v in compiled.program.params:
        n = shapes[v.name].numel() if v.name in shapes else compiled.get_parameter(v.name).numel()
        sync = set(v.attrs.get("grad_sync", ()))
        on = [compiled.program.mesh.names.index(a) for a in need]
        replicated = all(isinstance(v.type.placements[i], Replicate) for i in on)
        if need and (need <= sync or (replicated and not need & sync)):
            managed += -(-n // k) * k if per_tensor else n
        else:
            other += n
    return per_element * (-(-managed // k) + other)


def compare_models(rank: int, world: int, models: list[str], axes: dict[str, int]) -> dict:
    """Several comparisons in one process group (spawning is the expensive part of a test).
    A name ``model@megatron`` trains that model with Megatron's layout."""
    out = {}
    for name in models:
        model, _, strategy = name.partition("@")
        out[name] = compare(rank, world, model, axes, strategy or "autopar")
    return out


class CNN(torch.nn.Module):
    """A small convolutional model (ViT-style patch embedding plus a conv block) with its own loss."""

    def __init__(self):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 16, kernel_size=4, stride=4)
        self.conv = torch.nn.Conv2d(16, 16, kernel_size=3, padding=1)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x, target):
        h = torch.nn.functional.gelu(self.patch(x))
        h = h + self.conv(h)
        return torch.nn.functional.cross_entropy(self.head(h.mean(dim=(2, 3))), target)


def tiny_cnn(seed: int = 0, batch: int = 4, steps: int = 3):
    torch.manual_seed(seed)
    model = CNN()
    g = torch.Generator().manual_seed(seed + 1)
    batches = [
        {"x": torch.randn(batch, 3, 16, 16, generator=g), "target": torch.randint(0, 10, (batch,), generator=g)}
        for _ in range(steps)
    ]
    return model, batches


MODELS["cnn"] = tiny_cnn


class TinyLM(torch.nn.Module):
    """Embedding, one block, a vocabulary head and the loss only: Megatron's layout keeps the logits
    split by vocabulary end to end (vocab-parallel lookup and vocab-parallel cross-entropy)."""

    def __init__(self, vocab: int = 128, d: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))
        logits = self.lm_head(h)
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def tiny_lm(seed: int = 0, batch: int = 4, seq: int = 8, steps: int = 3):
    torch.manual_seed(seed)
    model = TinyLM()
    g = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (batch, seq), generator=g)
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = -100  # ignored positions, as HF pads shifted labels
        batches.append({"input_ids": ids, "labels": labels})
    return model, batches


MODELS["lm"] = tiny_lm


# ---------------------------------------------------------------------------------------------
# train_step on any mesh

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


def _keywords(spec) -> dict[str, torch.Tensor]:
    """A preset's example inputs as keywords (``tiny-mlp`` gives ``x`` positionally): ``train_step`` and the
    batches take keywords."""
    import inspect

    names = list(inspect.signature(spec.model.forward).parameters)
    return {**dict(zip(names, spec.args)), **spec.kwargs}


def compare_train_step(
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
    check_forward: bool = True,
) -> dict[str, Any]:
    """For each (schedule, schedule options[, this run's own compile keywords]) in ``runs``: the
    module's ``forward`` on the first batch before training (the model's output: the loss; not with
    ``check_forward=False``: ``forward_rel`` is then 0), then
    ``steps`` SGD steps of ``train_step`` in float64 (tests/exactness.py) with autopar on the mesh
    (any mesh: without ``pp`` one stage), compared with one single-process reference: the forward
    output, the losses, and every key of the model's state dict as ``full_state_dict`` gathers it
    whole on every rank. ``make_optimizer``: the module's own optimizer (ZeRO when the plan says
    so) instead of the user's over the local shards."""
    from autopar.runtime.build.init_weights import materialize

    preset = f"{PRESETS.get(model_name, model_name)}:batch={batch}"
    spec = build(preset, device="meta" if meta else "cpu", seed=0)
    model = float64_model(spec.model)
    # a meta model is initialized shard by shard by autopar; the reference holds the same numbers
    reference = materialize(float64_model(build(preset, device="meta").model), seed=0) if meta else copy.deepcopy(model)
    example = _keywords(build(preset, device="cpu", seed=0) if meta else spec)
    batches = [float64_batch(b) for b in make_batches(reference, example, steps)]
    with torch.no_grad():
        ref_out = loss_of(reference(**batches[0]))
    ref_losses = train(reference, batches)
    mesh = autopar.init_mesh("cpu", **axes)
    compile_kwargs = dict(compile_kwargs or {})
    if megatron:  # Megatron's layout: the residual stream between stages replicated over tp
        compile_kwargs["options"] = _megatron_options(model, batches[0], axes, microbatches)
    out: dict[str, Any] = {}
    for schedule, opts, *more in runs:
        extra = dict(more[0]) if more else {}  # this run's own compile keywords (microbatches= too)
        graphs_before, inductor_before = _dynamo_graphs(), _inductor_graphs()
        pipe = autopar.compile(  # the model is only read (and captured once per microbatch shape)
            model,
            mesh,
            kwargs=batches[0],
            schedule=schedule,
            schedule_options=opts,
            **{"microbatches": microbatches, **compile_kwargs, **extra},
        )
        out_rel = 0.0
        if check_forward:  # forward, every rank
            out_rel = ((loss_of(pipe(**batches[0])) - ref_out).abs() / ref_out.abs()).item()
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
        state_rel, worst_key, missing = state_error(pipe.full_state_dict(), reference)
        measured = pipe.measured()  # the last step, from every pipeline rank's trace
        r = pipe.coords().get(PIPELINE_AXIS, 0)
        sim = simulate(pipe.schedule, Costs.uniform(pipe.schedule.num_stages))
        out[key] = {
            "loss_rel": torch.tensor(loss_error(torch.tensor(losses, dtype=torch.float64), ref_losses)),
            "forward_rel": torch.tensor(out_rel, dtype=torch.float64),
            "param_rel": torch.tensor(state_rel, dtype=torch.float64),
            "worst_param": worst_key,
            "missing": missing,  # keys of the model's state dict (or extra ones) the gathered model lacks
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
            "losses": torch.tensor(losses, dtype=torch.float64),
            # torch_compile: the graphs dynamo compiled for this run, and what the module's log says
            "graphs": torch.tensor(_dynamo_graphs() - graphs_before),
            "inductor_graphs": torch.tensor(_inductor_graphs() - inductor_before),
            "compile_log": _compile_log(pipe),
        }
    return out


def _dynamo_graphs() -> int:
    """The graphs torch.compile has compiled in this process (0 before dynamo is imported)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def _inductor_graphs() -> int:
    """The graphs Inductor has compiled or loaded from its FX graph cache in this process (a forward, a backward,
    or each half of a split backward: runtime/build/compiled_split.py)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    c = utils.counters["inductor"]
    return int(c["fxgraph_cache_hit"] + c["fxgraph_cache_miss"] + c["fxgraph_cache_bypass"])


def _compile_log(pipe) -> dict | None:
    """A torch_compile module's log as plain data (the programs run compiled, eager calls, failures)."""
    log = getattr(pipe, "compile_log", None)
    if log is None:
        return None
    return {
        "compiled": sorted(log.first_s),
        "eager": dict(log.eager),
        "failed": list(log.failed),
        "graph_buckets": {k: [list(b) for b in v] for k, v in log.graph_buckets.items()},
        "schedules": dict(log.schedules),
        "split": {k: {"graphs": list(v.graphs), "calls": dict(v.calls)} for k, v in log.split.items()},
    }


def _megatron_options(model: torch.nn.Module, batch: dict, axes: dict[str, int], microbatches: int):
    from autopar.api import _capture
    from autopar.ir.core import MeshSpec
    from autopar.passes.lower import lower
    from autopar.runtime.call.batch import split_batch
    from autopar.solver.sharding.baselines import megatron_options

    args, kwargs = split_batch((), batch, microbatches)[0]
    inner = MeshSpec(tuple(axes.items())).without_pipeline()
    return megatron_options(lower(_capture(model, args, kwargs), inner))


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
    the interleaved sub-microbatches (``autopar.runtime.execute.subpipeline.record_events``), and which issues
    had the other sub-microbatch compute before their wait."""
    from autopar.runtime.execute.subpipeline import record_events

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
        fn = sub_pipeline_events if job.pop("kind", "compare") == "events" else compare_train_step
        out[name] = fn(rank, world, **job)
    return out


# ---------------------------------------------------------------------------------------------
# the training loop (tests/test_training_loop.py): examples/train_lm.py's GPT, pure PyTorch

_EXAMPLE = "autopar_example_train_lm"


def train_lm_example():
    """``examples/train_lm.py`` as a module (loaded once per process)."""
    import importlib.util
    import sys
    from pathlib import Path

    if _EXAMPLE not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"
        spec = importlib.util.spec_from_file_location(_EXAMPLE, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_EXAMPLE] = module
        spec.loader.exec_module(module)
    return sys.modules[_EXAMPLE]


def tiny_padded_gpt(seed: int = 0, batch: int = 8, steps: int = 3, dropout: float = 0.0, seq: int = 8):
    """The example's GPT, tiny, in float64 (``float64_model``: no parameter starts at zero), and
    ``steps`` batches of next-token labels whose rows end in a random number (0 to seq - 2) of
    ignored (-100) positions, so microbatches hold different numbers of targets."""
    ex = train_lm_example()
    torch.manual_seed(seed)
    model = float64_model(ex.GPT(ex.GPTConfig(vocab=64, seq=seq, dim=32, heads=2, layers=2, dropout=dropout)))
    g = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (batch, seq + 1), generator=g)
        labels = ids[:, 1:].clone()
        pad = torch.randint(0, seq - 1, (batch,), generator=g)
        labels[torch.arange(seq) >= seq - pad[:, None]] = -100
        batches.append({"input_ids": ids[:, :-1].contiguous(), "labels": labels})
    return model, batches
