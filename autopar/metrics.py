"""The compiled module's step meter (``runtime/measure/metrics.py``) as ``compile`` makes it from the config, the
cluster the plan was priced on and the model."""

from __future__ import annotations

import math

import torch

from autopar.errors import ClusterSpecError
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


__all__ = ["StepMetrics", "step_meter"]
