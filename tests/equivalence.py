"""Train a model with autopar on a dp/tp mesh and in a single process, in float64; compare (run in each rank)."""

from __future__ import annotations

import copy

import torch

import autopar
from tests.exactness import (
    STATES_PER_ELEMENT,
    drop_a_row_parallel_all_reduce,
    float64_batch,
    float64_model,
    loss_error,
    loss_of,
    parameter_error,
    train,
)


def tiny_gpt2(seed: int = 0, batch: int = 4, seq: int = 16, steps: int = 3):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=2,
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


MODELS = {"gpt2": tiny_gpt2, "mlp": tiny_mlp}


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
    (``drop_a_row_parallel_all_reduce``), a sharding bug the comparison must see."""
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
        from autopar.solver.baselines import data_parallel_constraints, megatron_constraints
        from autopar.solver.cost import TrainingSetup

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
    dropped = drop_a_row_parallel_all_reduce(compiled.module) if "broken" in kinds else ""
    states: list[int] = []
    losses = train(compiled, batches, optimizer, states=states)
    full = compiled.full_state_dict()
    gathered_alive = -1
    if compiled.zero3 is not None:  # the whole parameters must not outlive the forward
        loss = loss_of(compiled(**batches[0]))
        gathered_alive = compiled.zero3.gathered_alive()
        loss.backward()  # re-gathers the saved ones; the gradients are dropped (after the comparison)
    ref_losses = train(reference, batches, optimizer)
    param_rel, worst_param, _ = parameter_error(full, reference)
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
        "full_numel": torch.tensor(sum(p.numel() for p in full.values())),
    }


def _zero_expected(compiled, per_element: int, per_tensor: bool = False) -> int:
    """Optimizer state elements a rank holds under ZeRO-2: ``per_element`` per element of its slice of
    the parameters replicated over the ZeRO axes (gradient summed over all of them, or whole on every
    rank; padded to equal slices), ``per_element`` per other element. ``per_tensor``: each parameter
    padded and sliced on its own (ZeRO-3's layout, where with ``per_element=1`` this is also the number
    of parameter elements the rank keeps)."""
    from autopar.ir.core import Replicate
    from autopar.runtime.zero import zero_axes_of

    zero_axes, replicas = zero_axes_of(compiled.setup, compiled.program.mesh)
    need = set(zero_axes) | set(replicas)
    k = 1
    for a in zero_axes:
        k *= compiled.program.mesh.axis_size(a)
    managed = other = 0
    shapes = dict(zip(compiled.zero3.names, compiled.zero3.shapes)) if compiled.zero3 is not None else {}
    for v in compiled.program.params:
        n = shapes[v.name].numel() if v.name in shapes else compiled.module.get_parameter(v.name).numel()
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
