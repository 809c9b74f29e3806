"""What every float64 equivalence test shares: the model and batches in float64, the optimizers, the comparison.

A parallel run and a single-process run of the same model and data differ only by the order of float
sums when the sharding is right, so in float64 they agree to ~1e-15 relative; ``TOL`` leaves five
orders of magnitude for rounding to grow over a few steps and is still far below any sharding bug.
Three choices keep rounding rounding:

- The model computes in float64 end to end. Hugging Face's causal-LM loss casts the logits to
  float32, so a language model is wrapped in ``LogitsLoss``: no labels go to the model, and the
  cross-entropy of its logits is computed here in the logits' dtype (the wrapper prefixes every
  parameter name with ``model.``; ``user_name`` strips it in messages).
- Parameters that start at zero (Hugging Face zero-initializes biases) start from small random
  values. A parameter whose gradient is mathematically zero (BERT's key bias: softmax ignores a
  constant added to every score of a row) would otherwise hold nothing but rounding noise of that
  zero, which has no relative error; and a bias wrongly added on every tensor-parallel rank would
  be invisible while it is zero. Parameters still on the meta device keep the model's own
  initialization (autopar initializes them).
- SGD with momentum updates parameters linearly in the gradients, so their rounding is not
  amplified; its momentum is a state per element, which ZeRO shards. AdamW divides each entry by its
  own gradient's magnitude and so amplifies a noise-only gradient into a full step; in float64 that
  noise (~1e-21 against eps = 1e-8) moves a parameter by ~1e-16, so one AdamW run still checks the
  optimizer path at ``TOL``.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.fx as fx
import torch.nn.functional as F

TOL = 1e-10  # relative, for losses and for every parameter

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict]] = {
    # lr 0.1: three steps change the median tensor of tiny GPT-2 (BERT) by 3% (0.4%) of its largest
    # entry, so the final parameters carry the gradients' digits far above TOL
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    # lr 1e-3: each step moves an entry by about lr, 4-5% of the median tensor over three steps
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
}
STATES_PER_ELEMENT = {"sgd": 1, "adamw": 2}  # momentum buffer; Adam's two moments


class LogitsLoss(torch.nn.Module):
    """A language model trained on the cross-entropy of its logits against ``labels`` at every
    position, computed here in the logits' dtype (the model itself gets no labels)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def user_name(name: str) -> str:
    """A parameter's name in the user's model (without ``LogitsLoss``'s prefix)."""
    return name.removeprefix("model.")


@torch.no_grad()
def float64_model(model: torch.nn.Module, seed: int = 7) -> torch.nn.Module:
    """The model in float64 (a Hugging Face language model wrapped in ``LogitsLoss``), with every
    all-zero parameter given N(0, 0.02) values drawn from ``seed``."""
    transformers = sys.modules.get("transformers")  # a model is none of its classes unless it was imported
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        model = LogitsLoss(model)
    model = model.double()
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.device.type != "meta" and not p.any():
            p.copy_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def float64_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with its floating tensors in float64 (token ids unchanged)."""
    return {k: v.double() if v.dtype.is_floating_point else v for k, v in batch.items()}


def loss_of(out) -> torch.Tensor:
    """The loss a model returned: the tensor itself, or a Hugging Face output's ``loss``."""
    return out if isinstance(out, torch.Tensor) else out.loss


def make_optimizer(kind: str, params_or_module) -> torch.optim.Optimizer:
    """Optimizer ``kind`` (``OPTIMIZERS``) over parameters, or through a compiled module's
    ``make_optimizer`` (ZeRO's sharded optimizer when its plan says so)."""
    cls, kw = OPTIMIZERS[kind]
    make = getattr(params_or_module, "make_optimizer", None)
    if make is not None:
        return make(cls, **kw)
    params = params_or_module.parameters() if isinstance(params_or_module, torch.nn.Module) else params_or_module
    return cls(params, **kw)


def train(
    model, batches: list[dict], optimizer: str = "sgd", states: list[int] | None = None, set_to_none: bool = True
) -> torch.Tensor:
    """``len(batches)`` steps of ``optimizer`` on ``model`` (a module, or a compiled dp/tp module);
    the per-step losses in float64. ``states``: gets the number of optimizer-state elements this rank
    holds (per trained element: ``STATES_PER_ELEMENT``); ``set_to_none=False``: gradients are zeroed
    in place between steps (a compiled module's then accumulate into its gradient buckets)."""
    opt = make_optimizer(optimizer, model)
    losses = []
    for b in batches:
        loss = loss_of(model(**b))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        losses.append(loss.item())
    if states is not None:
        inner = getattr(opt, "optimizer", opt)  # ZeRO's wrapper holds the optimizer of its slice
        states.append(sum(t.numel() for st in inner.state.values() for t in st.values() if t.dim() > 0))
    return torch.tensor(losses, dtype=torch.float64)


def train_accumulating(model, batches: list[dict], optimizer: str = "sgd", no_sync: bool = True) -> torch.Tensor:
    """Gradient accumulation: each step backwards batch ``k`` then ``k + 1`` before the optimizer step
    (``len(batches) - 1`` steps), the first inside ``model.no_sync()`` where ``no_sync`` and the model
    has it (a compiled module); the per-step sums of the two losses in float64."""
    opt = make_optimizer(optimizer, model)
    losses = []
    for first, second in zip(batches, batches[1:]):
        quiet = model.no_sync() if no_sync and hasattr(model, "no_sync") else contextlib.nullcontext()
        with quiet:
            a = loss_of(model(**first))
            a.backward()
        b = loss_of(model(**second))
        b.backward()
        opt.step()
        opt.zero_grad()
        losses.append(a.item() + b.item())
    return torch.tensor(losses, dtype=torch.float64)


def loss_error(losses: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest relative difference of the per-step losses."""
    return ((losses - ref).abs() / ref.abs()).max().item()


def parameter_error(
    full: dict[str, torch.Tensor], reference: torch.nn.Module, whole: bool = True
) -> tuple[float, str, list[str]]:
    """The largest relative difference over the parameters of ``reference`` in ``full`` (the parallel
    run's state: it may hold buffers too, and a tied parameter under one of its names), each tensor
    measured as max|p - p_ref| / max|p_ref|; the (user's) name of that parameter; and the names of the
    parameters compared (a tied group by its first name). ``whole``: every parameter must be in ``full``
    (a pipeline rank holds only its stages': pass False and check the union over ranks)."""
    groups: dict[int, list[str]] = {}
    params = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        groups.setdefault(id(p), []).append(name)
    worst, where, compared = 0.0, "", []
    for group in groups.values():
        present = [n for n in group if n in full]
        if whole and not present:
            raise AssertionError(f"the parallel run has no parameter {[user_name(n) for n in group]}")
        for name in present:
            r = params[name].detach()
            err = ((full[name].to(r.dtype) - r).abs().max() / r.abs().max()).item()
            if not err <= worst:  # NaN counts as the worst
                worst, where = err, user_name(name)
        compared += [user_name(group[0])] if present else []
    return worst, where, compared


def state_error(full: dict[str, torch.Tensor], reference: torch.nn.Module) -> tuple[float, str, list[str]]:
    """``full`` against every key of ``reference.state_dict()`` (parameters and buffers, tied names
    too): the largest relative difference, each tensor measured as max|x - x_ref| / max|x_ref| (exact
    equality where the reference is all zeros or not a float), the (user's) key of that tensor, and
    the keys missing from ``full`` or not in the reference's state dict."""
    ref = reference.state_dict()
    worst, where = 0.0, ""
    for key, r in ref.items():
        if key not in full:
            continue
        x = full[key].to(r.device)
        if not r.is_floating_point() or not r.abs().max() > 0:
            err = 0.0 if torch.equal(x.to(r.dtype), r) else float("inf")
        else:
            err = ((x.to(r.dtype) - r).abs().max() / r.abs().max()).item()
        if not err <= worst:  # NaN counts as the worst
            worst, where = err, user_name(key)
    missing = sorted(user_name(k) for k in set(ref) ^ set(full))
    return worst, where, missing


def assert_sim_trains_as_one_process(
    sim, reference: torch.nn.Module, batch: dict, optimizer: str, steps: int = 2
) -> torch.Tensor:
    """``steps`` ``train_step`` calls on ``batch`` of the simulated ranks ``sim`` (``autopar.check.simtrain``'s
    ``SimCompiled``, its ``optimizer`` made already) against ``reference`` trained the same in float64 mode: the
    first rank's losses and the whole state within ``TOL``. Returns every rank's losses (a row per step)."""
    from autopar.check.float64 import Float64Mode

    losses = torch.tensor([[float(x) for x in sim.train_step(**batch)] for _ in range(steps)], dtype=torch.float64)
    with Float64Mode():
        ref = train(reference, [batch] * steps, optimizer)
    assert loss_error(losses[:, 0], ref) < TOL, (losses[:, 0], ref)
    err, where, missing = state_error(sim.full_state_dict(), reference)
    assert not missing and err < TOL, (err, where, missing)
    return losses


def drop_a_row_parallel_all_reduce(gm: fx.GraphModule) -> str:
    """Break a rank's program on purpose (tests only): the first all-reduce that sums a matmul's
    partial products (a row-parallel linear) is removed, so its consumers see this rank's partial sum.
    Returns the dropped node's name; raises if the program has no such all-reduce."""
    from autopar.runtime.comm.collectives import all_reduce

    matmuls = ("mm", "matmul", "linear", "addmm", "bmm")
    for node in gm.graph.nodes:
        src = node.args[0] if node.args else None
        if node.target is all_reduce and isinstance(src, fx.Node) and getattr(src.target, "_opname", "") in matmuls:
            node.replace_all_uses_with(src)
            gm.graph.erase_node(node)
            gm.recompile()
            return node.name
    raise AssertionError("no all-reduce of a matmul's partial sums to drop")
