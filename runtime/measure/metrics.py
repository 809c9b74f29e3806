"""Training metrics per step from the runtime: what each ``train_step`` took and did, on every rank.

    model = autopar.compile(model, mesh, kwargs=batch, on_metrics=print)   # or TrainConfig(on_metrics=...)
    model.train_step(**batch)   # -> StepMetrics(step=1, seconds=..., tokens_per_second=..., mfu=..., ...)

Each ``train_step`` is timed (wall clock, after the step's loss is on every rank; on CUDA after a
``torch.cuda.synchronize``) and reported as a ``StepMetrics``:

- ``tokens``: the step's tokens, the number of elements of its first integer input with a batch and a
  sequence dim (``input_ids``), else its batch rows; the global batch's (a local batch's times the dp ranks);
- ``mfu``: model FLOPs utilization as Megatron-LM measures it (Narayanan et al. 2021, Sec. 5.1): the model's
  FLOPs per step divided by the step's seconds, the world size and the device's peak FLOP/s in the
  compute dtype (from the cluster spec the plan was priced on). For a transformer whose config names its
  layers ``l``, hidden size ``h`` and vocabulary ``V`` (Hugging Face's ``n_layer``/``num_hidden_layers``,
  ``n_embd``/``hidden_size``, ``vocab_size``), a batch of ``B`` sequences of ``s`` tokens is
  ``72 B s l h^2 (1 + s / (6 h) + V / (12 l h))`` FLOPs per step (forward and backward, no recomputation:
  the paper's formula is the same with 96 and V / (16 l h), counting its recomputed forward); any other
  model is three times the forward FLOPs of its program (``Op.flops``, per microbatch, times the step's);
- ``peak_memory_bytes``: this rank's peak: CUDA's max allocated bytes since the step began; on CPU the
  process's peak resident set (``getrusage``), which only grows;
- ``loss`` and ``grad_norm``: the step's loss, and the global gradient norm (the clipped one when
  ``make_optimizer(max_grad_norm=...)`` clips; otherwise measured before the optimizer's step when a
  callback is given, an all-reduce of one number per step).

Rank 0 logs each step's metrics on logger ``autopar`` (INFO, every ``log_every`` steps); the callback is
called on every rank with that rank's metrics. ``runtime/measure/writers.py`` has TensorBoard and W&B
callbacks.
"""

from __future__ import annotations

import logging
import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from autopar.ir.core import Program

log = logging.getLogger("autopar")


@dataclass(frozen=True)
class StepMetrics:
    """One ``train_step`` on one rank (see the module docstring)."""

    step: int
    rank: int
    seconds: float
    tokens: int
    tokens_per_second: float
    flops: float  # the model's FLOPs of the step, all ranks together
    mfu: float | None  # None where the device's peak is unknown
    peak_memory_bytes: int
    loss: float
    grad_norm: float | None

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)

    def line(self) -> str:
        """The log line."""
        mfu = f", MFU {self.mfu * 100:.1f}%" if self.mfu is not None else ""
        norm = f", grad norm {self.grad_norm:.4g}" if self.grad_norm is not None else ""
        return (
            f"step {self.step}: loss {self.loss:.4f}{norm}, {self.seconds * 1e3:.1f} ms, "
            f"{self.tokens_per_second:,.0f} tokens/s{mfu}, peak memory {self.peak_memory_bytes / 2**20:.1f} MiB"
        )


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one training step of a GPT-style transformer (forward and backward, no recomputation), Megatron-LM's
    formula (see the module docstring)."""
    return 72.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def transformer_shape(config) -> tuple[int, int, int] | None:
    """(layers, hidden, vocab) of a Hugging Face style model config, or None when it names none of them."""

    def first(*names: str) -> int | None:
        for n in names:
            v = getattr(config, n, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        return None

    shape = (first("n_layer", "num_hidden_layers"), first("n_embd", "hidden_size", "d_model"), first("vocab_size"))
    return None if None in shape else shape  # type: ignore[return-value]


def step_tokens(leaves: list) -> tuple[int, tuple[int, int] | None]:
    """The tokens of a call's flattened inputs, and (batch, sequence) when they are token ids (see the module
    docstring)."""
    ints = [x for x in leaves if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dim() >= 1]
    seqs = [x for x in ints if x.dim() == 2]
    if seqs:
        b, s = seqs[0].shape
        return b * s, (b, s)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim() >= 1]
    return (tensors[0].shape[0] if tensors else 0), None


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory (see the module docstring)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kib if sys.platform == "darwin" else kib * 1024)  # bytes on macOS, KiB on Linux


class StepMeter:
    """Times ``train_step`` and reports ``StepMetrics`` (logged on rank 0, given to ``callback`` on every rank)."""

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        device: torch.device,
        peak_flops: float | None,
        model_config=None,
        program: Program | None = None,
        microbatches: int = 1,
        batch_scale: int = 1,
        callback: Callable[[StepMetrics], None] | None = None,
        log_every: int = 1,
    ):
        """``peak_flops``: one device's peak in the compute dtype (None: MFU not reported); ``model_config``: the
        model's config (for Megatron's formula); ``program``: the planned program of one microbatch (the FLOPs of
        any other model); ``batch_scale``: global rows per call's row (the dp ranks under a local batch)."""
        self.rank, self.world, self.device = rank, world, device
        self.peak_flops, self.callback, self.log_every = peak_flops, callback, log_every
        self.shape = transformer_shape(model_config) if model_config is not None else None
        forward = sum(op.flops for op in program.ops) if program is not None else 0.0
        self.program_flops = 3.0 * forward * microbatches
        self.batch_scale = batch_scale
        self.step = 0
        self.last: StepMetrics | None = None
        self._t0 = 0.0

    @property
    def wants_grad_norm(self) -> bool:
        """Whether the step should measure the gradient norm when it does not clip (a callback reads it)."""
        return self.callback is not None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._t0 = time.perf_counter()

    def finish(self, loss: torch.Tensor, grad_norm: torch.Tensor | None, leaves: list) -> StepMetrics:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self._t0
        self.step += 1
        tokens, bs = step_tokens(leaves)
        tokens *= self.batch_scale
        if self.shape is not None and bs is not None:
            flops = megatron_flops(bs[0] * self.batch_scale, bs[1], *self.shape)
        else:
            flops = self.program_flops
        mfu = flops / (seconds * self.world * self.peak_flops) if self.peak_flops and seconds > 0 else None
        m = StepMetrics(
            step=self.step,
            rank=self.rank,
            seconds=seconds,
            tokens=tokens,
            tokens_per_second=tokens / seconds if seconds > 0 else math.inf,
            flops=flops,
            mfu=mfu,
            peak_memory_bytes=peak_memory_bytes(self.device),
            loss=float(loss),
            grad_norm=float(grad_norm) if grad_norm is not None else None,
        )
        self.last = m
        if self.rank == 0 and self.log_every and self.step % self.log_every == 0:
            log.info("%s", m.line())
        if self.callback is not None:
            self.callback(m)
        return m


__all__ = ["StepMeter", "StepMetrics", "megatron_flops", "peak_memory_bytes", "step_tokens", "transformer_shape"]
