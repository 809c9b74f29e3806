"""Mixed precision: the policy (FSDP2's ``MixedPrecisionPolicy``), the model's compute-dtype copy, fp16 loss scaling.

    model = autopar.compile(model, mesh, kwargs=batch, mixed_precision="bf16")    # or a MixedPrecisionPolicy

What runs (docs/runtime.md, "Mixed precision"):

- **Capture in the compute dtype.** The model is captured from a copy whose floating parameters are in
  ``param_dtype`` (``compute_copy``; on the meta device when the model is there) and with its floating
  inputs cast to it, so the IR is the program the model runs in bf16: a Hugging Face RMSNorm's
  ``.to(input_dtype)`` or an upcast of the logits to fp32 for the loss are in the graph as constants of
  that program. Buffers keep their dtype (FSDP2 casts parameters only).
- **fp32 master weights are the parameters.** Each rank's parameter shards are sliced from the user's
  (fp32) model and stay in its dtype; the generated code casts each parameter where it is read
  (``codegen``: a read whose held dtype differs from the IR's). The compute copy is per use: made in
  every forward, saved for backward by the ops that need it, freed with that microbatch's activations.
  Under ZeRO-3 a gathered unit's copies are made when the unit starts computing and saved as tokens, cast
  again in the backward from the unit gathered again (``runtime/grads/zero3.py``): no copy is held with the
  activations. Its backward (``_to_copy``'s) hands the parameter an fp32 gradient, accumulated over
  microbatches in fp32. The optimizer, ZeRO-1/2 slices, ZeRO-3 slices and MiCS see fp32 tensors only.
- **Gradient reduction in ``reduce_dtype``** (fp32 by default; FSDP2's default is ``param_dtype``): each
  reduced buffer is cast to it before the collective and back after (``Comm.grad_dtype``).
- **Loss scaling (fp16)**: ``LossScaler``, torch's ``GradScaler`` arithmetic, with the overflow check
  all-reduced over every mesh axis so every rank skips the same steps.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree

from autopar.errors import PrecisionError
from autopar.passes.shard import ShardOptions
from autopar.runtime.comm.watch import guarded
from autopar.solver.sharding.cost import TrainingSetup

_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling (``torch.amp.GradScaler``'s defaults): the loss's gradient is multiplied by
    ``scale``; a step whose gradients hold an inf or NaN on any rank is skipped and the scale multiplied
    by ``backoff_factor``; after ``growth_interval`` good steps in a row it is multiplied by
    ``growth_factor``. Powers of two keep scaling and unscaling exact."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy`` fields, and its meaning: ``param_dtype`` is the dtype parameters
    and activations compute in (the masters stay in the model's dtype); ``reduce_dtype`` the dtype of the
    data-parallel (and ZeRO) gradient reductions, fp32 by default here (FSDP2: ``param_dtype``);
    ``output_dtype`` casts the floating outputs of a call (``None``: as computed); ``cast_forward_inputs``
    casts floating inputs to ``param_dtype``. ``loss_scaling``: ``None`` scales dynamically for fp16 only,
    ``False`` never, a ``LossScaling`` with its settings."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    loss_scaling: LossScaling | bool | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            d = getattr(self, field)
            if d is not None and (not isinstance(d, torch.dtype) or not d.is_floating_point):
                raise PrecisionError(f"MixedPrecisionPolicy.{field} must be a floating torch.dtype or None, not {d!r}")

    @property
    def name(self) -> str:
        """``bf16``, ``fp16`` or ``fp32``: the cost model's ``TrainingSetup.precision``."""
        return dtype_name(self.param_dtype)

    @property
    def scaling(self) -> LossScaling | None:
        if self.loss_scaling is None:
            return LossScaling() if self.param_dtype == torch.float16 else None
        if self.loss_scaling is True:
            return LossScaling()
        return self.loss_scaling or None


def dtype_of(name: str) -> torch.dtype:
    """``bf16`` / ``bfloat16`` / ``fp16`` / ``fp32`` ... -> the torch dtype."""
    key = _ALIASES.get(name, name)
    if key not in _NAMES:
        raise PrecisionError(f"unknown precision {name!r}: use fp32, bf16 or fp16")
    return _NAMES[key]


def policy_of(spec: MixedPrecisionPolicy | str | torch.dtype | None) -> MixedPrecisionPolicy | None:
    """``compile(mixed_precision=...)``: a policy, a dtype or its name (``"bf16"``); fp32 or ``None``: none."""
    if spec is None or isinstance(spec, MixedPrecisionPolicy):
        return spec if spec is None or spec.param_dtype not in (None, torch.float32) else None
    if isinstance(spec, str):
        spec = dtype_of(spec)
    if not isinstance(spec, torch.dtype):
        raise PrecisionError(
            f"mixed_precision must be 'bf16', 'fp16', 'fp32', a torch dtype or a MixedPrecisionPolicy, not {spec!r}"
        )
    return None if spec == torch.float32 else MixedPrecisionPolicy(param_dtype=spec)


def dtype_name(dtype: torch.dtype | None) -> str:
    """torch.bfloat16 -> ``bf16`` (``None``, torch.float32: ``fp32``)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}.get(dtype, "fp32")


def policy_of_setup(setup: TrainingSetup) -> MixedPrecisionPolicy | None:
    """The policy a training setup prices: its precision, gradients reduced in its ``reduce_dtype``."""
    policy = policy_of(setup.precision)
    return None if policy is None else dataclasses.replace(policy, reduce_dtype=dtype_of(setup.reduce_dtype))


def setup_dtypes(policy: MixedPrecisionPolicy | None) -> tuple[str, str]:
    """(``TrainingSetup.precision``, ``TrainingSetup.reduce_dtype``) of ``policy`` (None: fp32); FSDP2's
    ``reduce_dtype=None`` reduces in ``param_dtype``."""
    if policy is None:
        return "fp32", "fp32"
    return policy.name, policy.name if policy.reduce_dtype is None else dtype_name(policy.reduce_dtype)


def precision_setup(
    spec: MixedPrecisionPolicy | str | torch.dtype | None, options: ShardOptions | None
) -> tuple[MixedPrecisionPolicy | None, ShardOptions | None]:
    """(the policy ``compile`` runs, ``options`` whose training setup prices it): ``spec`` when given, else
    the precision and reduce dtype of ``options``' setup (a plan file's, or the caller's)."""
    setup = options.setup if options is not None else TrainingSetup()
    policy = policy_of_setup(setup) if spec is None else policy_of(spec)
    name, reduce = setup_dtypes(policy)
    if (setup.precision, setup.reduce_dtype) == (name, reduce):
        return policy, options
    setup = dataclasses.replace(setup, precision=name, reduce_dtype=reduce)
    return policy, dataclasses.replace(options or ShardOptions(), setup=setup)


# -- capture ---------------------------------------------------------------------------------------
def compute_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` with its floating parameters in ``dtype``, for capture: the same modules (deep-copied) and
    buffers (shared, not copied); parameters on the meta device when the model has any there (nothing
    allocated), else real copies (``dtype``'s bytes per parameter, for the capture only). Ties stay tied.

    Batch norms keep their parameters in their own dtype, as FSDP's ``MixedPrecision`` does by default
    (``_module_classes_to_ignore``) and autocast runs them: their running statistics are buffers, which keep
    theirs, and a batch norm with bf16 weights and fp32 statistics is an error (torch runs bf16 inputs with
    fp32 weights and statistics)."""
    params = list(model.named_parameters(remove_duplicate=True))
    on_meta = any(p.device.type == "meta" for _, p in params)
    kept = {id(p) for m in model.modules() if isinstance(m, _BatchNorm) for p in m.parameters(recurse=False)}
    memo: dict[int, Any] = {}
    for _, p in params:
        d = dtype if p.is_floating_point() and id(p) not in kept else p.dtype
        t = torch.empty_like(p, dtype=d, device="meta") if on_meta else p.detach().to(d)
        memo[id(p)] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.to("meta") if on_meta else b
    return copy.deepcopy(model, memo)


def for_capture(model: torch.nn.Module, args: tuple, kwargs: dict, precision: str) -> tuple[Any, tuple, dict]:
    """(model, args, kwargs) to capture for a training setup's ``precision`` (``fp32``: as given; ``bf16`` /
    ``fp16``: the compute copy and the floating inputs cast), as ``compile`` captures under that policy:
    ``autopar plan`` and the search's plans must be made from the same graph."""
    if precision == "fp32":
        return model, args, kwargs
    dtype = dtype_of(precision)
    args, kwargs = cast_floats((args, kwargs), dtype)
    return compute_copy(model, dtype), args, kwargs


def cast_floats(tree: Any, dtype: torch.dtype | None) -> Any:
    """Every floating tensor of ``tree`` in ``dtype`` (``None``: unchanged)."""
    if dtype is None:
        return tree
    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def cast_to(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``x`` in ``dtype`` (``None``: as it is): a read of a parameter or input in the compute dtype (the
    generated code's cast; autograd-tracked), a gradient on its way to a reduction in ``reduce_dtype``."""
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


# -- loss scaling ----------------------------------------------------------------------------------
class LossScaler:
    """fp16 loss scaling for ``train_step``: ``seeds`` scales the gradient each loss back-propagates,
    ``unscale`` checks every rank's gradients for inf/NaN (one flag all-reduced over every mesh axis:
    tp, pp, dp and ZeRO shards alike) and either divides them by the scale or drops them (the step is
    skipped, on every rank). ``skipped`` counts the skipped steps."""

    def __init__(self, settings: LossScaling):
        self.settings = settings
        self.scale = float(settings.init_scale)
        self.skipped = 0
        self._good = 0

    def seeds(self, scales: Sequence[Sequence[float]] | None, microbatches: int, sub: int) -> list[list[float]]:
        """Each piece's loss gradient times the scale (``scales``: the unscaled ones; ``None``: equal pieces)."""
        if scales is None:
            scales = [[1.0 / (microbatches * sub)] * sub] * microbatches
        return [[s * self.scale for s in mb] for mb in scales]

    @torch.no_grad()
    def unscale(self, grads: Iterable[torch.Tensor], comm, device: torch.device) -> bool:
        """Divide ``grads`` by the scale and return True, or return False when any rank's gradients overflowed
        (the caller drops them: the step is skipped). Updates the scale either way."""
        grads = [g for g in grads if g is not None]
        bad = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            bad = torch.maximum(bad, (~torch.isfinite(g)).any().to(bad.dtype))
        for axis in sorted(comm.groups):  # max over every axis in turn is the max over the whole mesh
            if comm.sizes[axis] > 1:
                group = comm.groups[axis]
                guarded(
                    group,
                    axis,
                    "all_reduce (fp16 overflow flag)",
                    dist.all_reduce,
                    bad,
                    op=dist.ReduceOp.MAX,
                    group=group,
                )
        if bad.item() > 0:
            self.scale *= self.settings.backoff_factor
            self.skipped += 1
            self._good = 0
            return False
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
        self._good += 1
        if self._good >= self.settings.growth_interval:
            self.scale *= self.settings.growth_factor
            self._good = 0
        return True

    def step_ok(self, params: dict[str, torch.nn.Parameter], optimizer, comm) -> bool:
        """``STEP``'s check: unscale every parameter's gradient and return True, or (an overflow on some rank)
        drop them and the optimizer's and return False: the step is skipped on every rank."""
        grads = [p.grad for p in params.values()]
        device = next((g.device for g in grads if g is not None), torch.device("cpu"))
        if self.unscale(grads, comm, device):
            return True
        for p in params.values():
            p.grad = None
        if optimizer is not None:
            optimizer.zero_grad()
        return False

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "skipped": self.skipped, "good": self._good}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.skipped, self._good = float(state["scale"]), int(state["skipped"]), int(state["good"])


__all__ = [
    "LossScaler",
    "LossScaling",
    "MixedPrecisionPolicy",
    "cast_floats",
    "cast_to",
    "compute_copy",
    "dtype_name",
    "dtype_of",
    "for_capture",
    "policy_of",
    "policy_of_setup",
    "precision_setup",
    "setup_dtypes",
]
