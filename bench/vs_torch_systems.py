"""The systems bench/vs_torch.py compares: autopar's plans and the torch peers users write by hand, built on one rank.

Every system is built from the same model spec and seed on every rank and returns its loss only:

- ``autopar-dp`` / ``autopar-tp`` / ``autopar-zero3``: ``autopar.compile`` on a dp or tp mesh of all ranks
  (ZeRO-3: ``TrainingSetup(zero=3)``); ``autopar-pp``: on a pp mesh, 1F1B over ``--microbatches``;
- ``autopar-megatron``: ``autopar.compile`` on a tp mesh of all ranks with Megatron's layout fixed (the DTensor TP
  peer's), each f fused with its matmuls so that its gradient's all-reduce overlaps their weight gradients
  (``runtime/comm/column_linear.py``); ``autopar-megatron-unfused``: the same without the fusion;
- ``autopar-search``: ``autopar.compile`` (default objective) on the mesh, ZeRO stage and pipeline that
  ``autopar.search`` chose for these ranks on this machine's cluster spec (``prepare_search``, once in the
  parent);
- ``eager``: the model itself on the whole batch, on every rank (one process's step, issue 13's first column);
  ``autopar-tp-gpt2``: autopar's tp plan of the dp pair's GPT-2 (the issue's last column);
- ``ddp``: ``DistributedDataParallel`` with torch's default AdamW (``ddp-fused``: its fused kernel, the one
  autopar's ``make_optimizer`` picks); ``fsdp2``: ``fully_shard`` per decoder layer, then the root;
  ``dtensor-tp``: ``parallelize_module`` with Megatron's layout (q/k/v/gate/up column-wise, o/down
  row-wise); ``fsdp2-tp``: torchtitan's 2-D layout, the same TP on a ``tp`` axis of 2 and ``fully_shard``
  over the ``dp`` axis of the rest.
"""

from __future__ import annotations

import contextlib
import json
import re

import torch
import torch.distributed as dist

# the dp pair's model is GPT-2 (issue 13's table)
GPT2_SYSTEMS = {"autopar-dp", "ddp", "ddp-fused", "eager", "autopar-tp-gpt2", "autopar-pp"}
MEGATRON_SYSTEMS = ("autopar-megatron", "autopar-megatron-unfused")


class LossOnly(torch.nn.Module):
    """A Hugging Face causal LM returning its loss only."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, labels=labels).loss


def model_spec(family: str, a, batch: int | None = None) -> str:
    """The preset string of the ``gpt2``, ``llama``, ``bert`` (masked LM) or ``moe`` (Mixtral: 4 experts, top 2)
    model of the bench's sizes."""
    b = a.batch if batch is None else batch
    if family == "gpt2":
        return (
            f"gpt2:n_layer={a.layers},n_embd={a.hidden},n_head={a.heads},vocab_size={a.vocab},"
            f"n_positions={a.seq},batch={b},seq={a.seq}"
        )
    if family == "bert":
        return (
            f"tiny-bert:num_hidden_layers={a.layers},hidden_size={a.hidden},num_attention_heads={a.heads},"
            f"intermediate_size={4 * a.hidden},vocab_size={a.vocab},max_position_embeddings={a.seq},"
            f"batch={b},seq={a.seq}"
        )
    if family == "moe":
        return (
            f"mixtral-8x22b:num_hidden_layers={a.layers},hidden_size={a.hidden},num_attention_heads={a.heads},"
            f"num_key_value_heads={a.heads},intermediate_size={2 * a.hidden},num_local_experts=4,num_experts_per_tok=2,"
            f"vocab_size={a.vocab},max_position_embeddings={a.seq},batch={b},seq={a.seq}"
        )
    return (
        f"tiny-llama:num_hidden_layers={a.layers},hidden_size={a.hidden},num_attention_heads={a.heads},"
        f"num_key_value_heads={a.heads},intermediate_size={4 * a.hidden},vocab_size={a.vocab},"
        f"max_position_embeddings={a.seq},batch={b},seq={a.seq}"
    )


def family_of(system: str, pair: str) -> str:
    return "gpt2" if system in GPT2_SYSTEMS and pair != "search" else "llama"


def prepare_search(a, world: int, path: str) -> str:
    """Search the llama model's plan for ``world`` ranks of this machine (global batch ``--batch``) and write how
    to launch it to ``path`` (JSON: mesh axes, ZeRO stage and MiCS group, pipeline schedule and microbatches);
    returns the search's line for the best plan. The run compiles the model on that mesh with that setup and
    the default objective, the whole batch per step (the search's gradient-accumulation microbatches, if
    any, are one step here: the same samples, fewer calls)."""
    from autopar.api import local_cluster_spec
    from autopar.search import search_model

    spec = re.sub(r",batch=\d+", "", model_spec("llama", a))  # the search sets the batch (seq stays)
    cluster = local_cluster_spec("cpu", world)
    result = search_model(spec, cluster, global_batch=a.batch, precision="fp32")  # fp32, as the bench trains
    c = result.best[0].candidate
    launch = {"axes": {k: n for k, n in c.mesh().items() if n > 1} or {"dp": 1}, "zero": c.zero, "mics": c.mics_group}
    if c.pp > 1:
        launch["pipeline"] = {"microbatches": c.microbatches, "schedule": c.schedule}
        launch["pipeline"]["schedule_options"] = {"chunks": c.chunks} if c.chunks > 1 else {}
    with open(path, "w") as f:
        json.dump(launch, f)
    return next(line for line in result.format(top=1).splitlines() if line.strip().startswith("1 "))


def build_system(system: str, family: str, a, rank: int):
    """(module to call with the batch or None for a pipeline, the ParallelModule or None, optimizer, batch)."""
    import autopar
    from autopar.models.resolve import build
    from autopar.passes.shard import ShardOptions
    from autopar.solver.sharding.cost import TrainingSetup

    m = build(model_spec(family, a), device="cpu", seed=0)
    model, batch = LossOnly(m.model), m.kwargs
    world = dist.get_world_size()
    if system.startswith("autopar"):
        kwargs: dict = {}
        if system == "autopar-search":
            with open(a.search_plan) as f:
                launch = json.load(f)
            axes, kwargs = launch["axes"], dict(launch.get("pipeline", {}))
            setup = TrainingSetup(zero=launch["zero"], mics_group=launch["mics"] or None)
            kwargs["options"] = ShardOptions(setup=setup)
        elif system == "autopar-pp":
            axes, kwargs = {"pp": world}, {"microbatches": a.microbatches}
        elif system in MEGATRON_SYSTEMS:  # Megatron's layout, as the DTensor TP peer's
            axes = {"tp": world}
            kwargs["options"] = _megatron_options(model, batch, axes)
        else:
            axes = {"tp": world} if system.startswith("autopar-tp") else {"dp": world}
        if system == "autopar-zero3":
            kwargs["options"] = ShardOptions(setup=TrainingSetup(zero=3))
        with _unfused() if system == "autopar-megatron-unfused" else contextlib.nullcontext():
            cm = autopar.compile(model, autopar.init_mesh("cpu", **axes), kwargs=batch, **kwargs)
        if cm.schedule.num_stages > 1:  # the caller steps it after train_step (an attached one zeroes the grads)
            return cm, torch.optim.AdamW(cm.parameters(), lr=1e-4), batch
        return cm, cm.make_optimizer(torch.optim.AdamW, lr=1e-4), batch  # ZeRO-1/2 slices where planned
    if system == "eager":  # one process's step, on each rank: the whole batch, no communication
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch
    local = {k: v.chunk(world)[rank] for k, v in batch.items()}
    if system in ("ddp", "ddp-fused"):  # ddp-fused: the optimizer kernel autopar's make_optimizer picks
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=system == "ddp-fused" or None), local
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if system == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.m.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), local
    if system in ("dtensor-tp", "fsdp2-tp"):
        tp = world if system == "dtensor-tp" else 2
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        _megatron_tp(model, mesh["tp"])
        if system == "dtensor-tp":
            return model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch
        for layer in model.m.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp_rank = mesh["dp"].get_local_rank()
        rows = {k: v.chunk(world // tp)[dp_rank] for k, v in batch.items()}
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), rows
    raise ValueError(f"unknown system {system!r}")


def _megatron_options(model: torch.nn.Module, batch: dict, axes: dict[str, int]):
    """autopar's sharding options that fix Megatron's layout (column/row-parallel linears, vocab-parallel
    embedding and head), computed with each weight shard in place."""
    from autopar.ir.core import MeshSpec
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.solver.sharding.baselines import megatron_options

    return megatron_options(lower(capture(model, (), batch), MeshSpec(tuple(axes.items()))))


@contextlib.contextmanager
def _unfused():
    """Compile without fusing Megatron's f with its matmuls (runtime/comm/column_linear.py): f's all-reduce then
    overlaps nothing, as before the fusion (the A/B of the benchmark's tp-megatron pair)."""
    from autopar.runtime.build import codegen

    groups = codegen.column_groups
    codegen.column_groups = lambda *args: {}  # same signature, no groups
    try:
        yield
    finally:
        codegen.column_groups = groups


def _megatron_tp(model: LossOnly, mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(model.m.model.layers)):
        p = f"m.model.layers.{i}."
        plan.update({p + f"self_attn.{x}_proj": ColwiseParallel() for x in "qkv"})
        plan[p + "self_attn.o_proj"] = RowwiseParallel()
        plan.update({p + f"mlp.{x}_proj": ColwiseParallel() for x in ("gate", "up")})
        plan[p + "mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
