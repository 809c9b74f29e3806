"""The compiled module's step meter (``runtime/measure/metrics.py``) as ``compile`` makes it from the config, the
cluster the plan was priced on and the model."""

from __future__ import annotations

import math

import torch

from autopar.errors import ClusterSpecError, MetricsWriterError
from autopar.ir.axes import data_axes
from autopar.runtime.measure.metrics import StepMeter, StepMetrics
from autopar.runtime.module import ParallelModule
from autopar.solver.cluster.spec import ClusterSpec


def step_meter(module: ParallelModule, model: torch.nn.Module, cfg, cluster: ClusterSpec | None, rank: int, world: int):
    """The meter of ``module``'s train_step: MFU against one device's peak in the compute dtype on ``cluster``
    (none where the spec has no figure for it), the model's config for Megatron's formula, ``cfg``'s callback
    and log interval (``TrainConfig.on_metrics``, ``log_every``)."""
    policy = cfg.policy()
    dtype = policy.param_dtype if policy is not None else torch.float32
    try:
        peak = cluster.peak(dtype) if cluster is not None else None
    except ClusterSpecError:
        peak = None
    mesh = module.program.mesh
    dp = math.prod(s for n, s in mesh.axes if n in data_axes(mesh.names))
    run = module.options
    return StepMeter(
        rank=rank,
        world=world,
        device=module.device,
        peak_flops=peak,
        model_config=getattr(model, "config", None),
        program=module.program,
        microbatches=run.microbatches * run.sub_microbatches,
        batch_scale=dp if run.batch == "local" else 1,
        callback=cfg.on_metrics,
        log_every=cfg.log_every,
    )


def tensorboard_writer(log_dir: str, rank_zero_only: bool = True):
    """A ``TrainConfig.on_metrics`` callback writing each step's metrics as TensorBoard scalars under ``log_dir``
    (``torch.utils.tensorboard``; the ``tensorboard`` extra: ``pip install 'autopar[tensorboard]'``), from rank 0
    only unless ``rank_zero_only`` is False (then each rank writes ``log_dir/rank{r}``). The package is imported
    here, when the writer is made, so autopar itself does not need it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise MetricsWriterError(
            f"the TensorBoard writer needs the tensorboard package ({e}); install it with "
            "pip install 'autopar[tensorboard]'"
        ) from None
    writers: dict[int, SummaryWriter] = {}

    def write(m: StepMetrics) -> None:
        if rank_zero_only and m.rank != 0:
            return
        if m.rank not in writers:
            writers[m.rank] = SummaryWriter(log_dir if rank_zero_only else f"{log_dir}/rank{m.rank}")
        w = writers[m.rank]
        for key, value in _scalars(m).items():
            w.add_scalar(f"train/{key}", value, m.step)
        w.flush()

    return write


def wandb_writer(rank_zero_only: bool = True, **init):
    """A ``TrainConfig.on_metrics`` callback logging each step's metrics to Weights & Biases (``wandb.init(**init)``
    at the first step; the ``wandb`` extra), from rank 0 only unless ``rank_zero_only`` is False."""
    try:
        import wandb
    except ImportError as e:
        raise MetricsWriterError(
            f"the W&B writer needs the wandb package ({e}); install it with pip install 'autopar[wandb]'"
        ) from None
    run = []

    def write(m: StepMetrics) -> None:
        if rank_zero_only and m.rank != 0:
            return
        if not run:
            run.append(wandb.init(**init))
        run[0].log({f"train/{k}": v for k, v in _scalars(m).items()}, step=m.step)

    return write


def _scalars(m: StepMetrics) -> dict[str, float]:
    """The metrics a writer records: every number of ``m`` that is known (not the step and the rank)."""
    return {k: float(v) for k, v in m.as_dict().items() if k not in ("step", "rank") and v is not None}


__all__ = ["StepMetrics", "step_meter", "tensorboard_writer", "wandb_writer"]
