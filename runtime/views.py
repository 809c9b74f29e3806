"""What a ParallelModule shows of itself: the whole model's values, this rank's tensors, its schedule and last step.

``ModuleViews`` is a base of ``ParallelModule`` (``runtime/module.py``), which builds every attribute
read here; these methods only read them (the whole-model ones gather: collectives over the mesh).
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.ir.core import Program
from autopar.passes.manager import PassManager
from autopar.passes.stage_program import StageProgram
from autopar.runtime.build.params import LocalTensors
from autopar.runtime.build.stages import StageBuilder
from autopar.runtime.checkpoint.export import save_pretrained, share_over_pipeline, whole_values
from autopar.runtime.comm.context import Comm
from autopar.runtime.execute.executor import Executor
from autopar.runtime.grads.zero3 import Zero3Params
from autopar.runtime.measure.trace import TraceEvent, gathered_result, measured_result
from autopar.schedule.actions import Schedule
from autopar.schedule.timeline import SimResult


class ModuleViews:
    """The whole model, this rank's tensors and the inspection properties of a ``ParallelModule``."""

    program: Program
    comm: Comm
    device: torch.device
    zero3: Zero3Params | None
    _state: tuple[dict[str, str], dict[str, torch.Tensor]] | None
    _values: dict[str, Any]
    _local: LocalTensors
    _params: dict[str, torch.nn.Parameter]
    _schedule: Schedule
    _pp_group: Any
    _optimizer: Any
    _stages: dict[int, StageProgram]
    _builder: StageBuilder
    _executor: Executor | None

    # -- the whole model -------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Every key of the user's ``model.state_dict()`` (parameters and buffers, tied names too),
        gathered whole over every mesh axis, on every rank (a collective over all of them).
        ``grads=True``: the parameters' gradients instead (zeros where there is none)."""
        values = self._whole(grads)
        if self._state is None:
            return values
        keys, unread = self._state
        out = {}
        for key, name in keys.items():
            if name in values:
                out[key] = values[name]
        if not grads:
            out.update({k: v.clone() for k, v in unread.items()})
        return out

    def as_dtensors(self):
        """This rank's parameters and buffers as DTensors with the plan's placements, under the user's
        keys, sharing storage with the shards the program runs on (a ZeRO-3 slice no placement describes: a
        gathered copy; ``runtime/checkpoint/dtensors.py``): torch's ``get_state_dict``/``set_state_dict`` (with
        ``view.optimizer_view(opt)``), DCP and ``clip_grad_norm_`` work on it. Collective under ZeRO-3."""
        from autopar.runtime.checkpoint.dtensors import dtensor_view

        return dtensor_view(self)

    def save_pretrained(self, directory, *, max_shard_size: int | str = "5GB", config=None):
        """The whole model as a Hugging Face directory (sharded safetensors, ``model.safetensors.index.json``,
        ``config.json``) that transformers' ``from_pretrained`` loads, gathered to rank 0 one tensor at a time
        (``runtime/checkpoint/export.py``; collective over every rank)."""
        return save_pretrained(self, directory, max_shard_size=max_shard_size, config=config)

    def _whole(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Every value of the programs, whole, by program name, on every rank."""

        def local(name: str) -> torch.Tensor | None:
            if self.zero3 is not None and self.zero3.manages(name):
                return self.zero3.whole_value(name, grad=grads)
            t = self._local.tensors.get(name)
            if t is None or (grads and not isinstance(t, torch.nn.Parameter)):
                return None
            if grads:
                return t.grad.detach() if t.grad is not None else torch.zeros_like(t)
            return t.detach()

        values = whole_values(self.program, local, self.comm)
        if self._schedule.num_ranks > 1:
            values = share_over_pipeline(values, self._pp_group, self.device)
        return values

    def state_keys(self) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
        """(each key of the user's ``model.state_dict()`` -> the program value holding it, tied names to
        one value; the whole tensors of the keys no program reads): what checkpoints are keyed by."""
        if self._state is None:
            return {n: n for n, v in self._values.items() if v.kind != "input"}, {}
        return self._state

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers by program name, as it holds them (a ZeRO-3 slice in its
        parameter's place)."""
        return {**self._local.tensors, **self._params}

    # -- inspection ------------------------------------------------------------------------------
    @property
    def optimizer(self):
        """The optimizer ``make_optimizer`` attached (``None`` if the caller steps its own)."""
        return self._optimizer

    @property
    def schedule(self) -> Schedule:
        return self._schedule

    @property
    def stages(self) -> dict[int, StageProgram]:
        """This rank's stage programs of training."""
        return dict(self._stages)

    @property
    def stage_modules(self) -> dict[str, torch.fx.GraphModule]:
        """Generated GraphModules of this rank: ``forward{s}`` (every output), ``stage{s}`` (training)
        and recompute parts ``stage{s}.head{x}`` / ``stage{s}.rest{x}``."""
        return dict(self._builder.modules)

    @property
    def passes(self) -> PassManager:
        """The PassManager that generated this rank's modules (the flow's ``codegen``): its timings, and its
        dumps ``09-codegen.rank{r}.{label}.py`` (``passes.dump_into(dir)`` writes them)."""
        return self._builder.passes

    @property
    def trace(self) -> list[TraceEvent]:
        """Start and end of every action of this rank's last training step (seconds since it began)."""
        return list(self._executor.trace) if self._executor is not None else []

    @property
    def peak_stash(self) -> int:
        """Most microbatch-stages whose activations this rank held at once in the last step."""
        return self._executor.peak_stash if self._executor is not None else 0

    def measured(self) -> SimResult:
        """The last step as a SimResult (chart, bubble ratios) from every pipeline rank's trace.
        Collective over the pipeline axis."""
        if self._schedule.num_ranks == 1:
            return measured_result(self._schedule, [self.trace])
        origin = self._executor.trace_origin if self._executor is not None else 0.0
        return gathered_result(self._schedule, self.trace, origin, self._pp_group)

    def coords(self) -> dict[str, int]:
        return dict(self.comm.coords)


__all__ = ["ModuleViews"]
