"""The checks that apply on CUDA, one command: single-GPU compile on NCCL (world size 1), and CUDA tensors
through gloo with several ranks sharing one GPU.

    python bench/gpu/cuda_checks.py          # prints one PASS/FAIL line per check; exit 1 if any failed

Each check trains tiny GPT-2 for 3 SGD steps through ``autopar.compile`` on the GPU and compares with eager
PyTorch on the same GPU under the same policy:

- ``nccl-1-fp32``: NCCL, world size 1, fp32: losses and parameters within 1e-5 relative of eager fp32
  (cuBLAS may pick other kernels for the generated code's shapes: fp32 rounding, not a bound);
- ``nccl-1-bf16`` / ``nccl-1-fp16``: the same in mixed precision against eager running the same policy
  (a compute-dtype copy per step, fp32 masters; fp16 with the same loss scaling): every step's loss within
  s (R + k) u |L_s| (docs/runtime.md's bound) with R + k = 4 (R = 0 on one rank, widened for cuBLAS's own
  reduction orders);
- ``nccl-1-column-linears``: Megatron's f fused with the matmuls reading it (its input gradient all-reduced
  on NCCL while their weight gradients are computed) against the separate ops, fp32, within 1e-5 relative;
- ``gloo-2-cuda-<mesh>``: 2 processes on ``cuda:0`` through gloo (dp=2, tp=2, pp=2, and pp=2 under ZB-V,
  whose split backward then runs on CUDA tensors), bf16: the losses of rank 0 within the same bound of the
  eager run, scaled by R + k. NCCL's own point-to-point needs a GPU per rank, which one GPU cannot give.

Exits non-zero without CUDA (``make test`` never runs this; it needs a GPU).
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repository root, for tests._dist

SPEC = "tiny-gpt2:n_layer=2,n_embd=32,n_head=4,vocab_size=64,n_positions=16,attn_pdrop=0,resid_pdrop=0,embd_pdrop=0"
STEPS, LR = 3, 0.1
U = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _batches(device: str):
    from autopar.models.resolve import build
    from tests.equivalence import make_batches

    spec = build(f"{SPEC},batch=8,seq=8", device="cpu", seed=0)
    return spec.model.to(device), [
        {k: v.to(device) for k, v in b.items()} for b in make_batches(spec.model, spec.kwargs, STEPS)
    ]


def eager(precision: str, device: str = "cuda") -> list[float]:
    """Eager PyTorch on the GPU under the same policy as autopar's: each step a compute-dtype copy of the fp32
    model (``precision.compute_copy``) runs forward and backward, its gradients become the fp32 masters'
    (fp16: scaled and unscaled by autopar's ``LossScaler`` arithmetic, steps with an overflow skipped)."""
    from autopar.runtime.build.precision import LossScaler, LossScaling, compute_copy
    from autopar.runtime.comm.context import Comm

    model, batches = _batches(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = LossScaler(LossScaling()) if precision == "fp16" else None
    nobody = Comm(groups={}, coords={}, sizes={})
    losses = []
    for b in batches:
        run = model if precision == "fp32" else compute_copy(model, DTYPES[precision])
        loss = run(**b).loss
        (loss * (scaler.scale if scaler else 1.0)).backward()
        if run is not model:
            for p, q in zip(model.parameters(), run.parameters()):
                p.grad = q.grad.float() if q.grad is not None else None
        if scaler is None or scaler.unscale([p.grad for p in model.parameters()], nobody, torch.device(device)):
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def autopar_losses(precision: str, axes: dict[str, int], device: str, **pipeline) -> tuple[list[float], int]:
    """autopar on the current process group: 3 SGD steps, the losses and R (split reductions). ``pipeline``:
    ``compile``'s schedule options (default 2 microbatches)."""
    import autopar

    model, batches = _batches("cpu")
    mesh = autopar.init_mesh(device.split(":")[0], **axes)
    mp = None if precision == "fp32" else precision
    pipeline = {"microbatches": 2, **pipeline}
    pipe = autopar.compile(model, mesh, kwargs=batches[0], mixed_precision=mp, device=device, **pipeline)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses = []
    for b in batches:
        losses.append(pipe.train_step(**{k: v.to(device) for k, v in b.items()}).item())
        opt.step()
        opt.zero_grad()
    reductions = sum(op.target in ("all_reduce", "reduce_scatter") for op in pipe.train_program.ops)
    return losses, reductions


def within(got: list[float], want: list[float], factor: float) -> tuple[bool, float]:
    worst = max(abs(a - b) / ((s + 1) * factor * abs(b)) for s, (a, b) in enumerate(zip(got, want)))
    return worst <= 1.0, worst


def nccl_world_one() -> list[tuple[str, bool, str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    out = []
    try:
        for precision in ("fp32", "bf16", "fp16"):
            got, _ = autopar_losses(precision, {"dp": 1}, "cuda:0")
            want = eager(precision)
            factor = 1e-5 if precision == "fp32" else 4 * U[precision]
            ok, worst = within(got, want, factor)
            out.append((f"nccl-1-{precision}", ok, f"autopar {got} eager {want} (difference / bound {worst:.3f})"))
        out.append(column_linears_on_cuda())
    finally:
        dist.destroy_process_group()
    return out


def column_linears_on_cuda() -> tuple[str, bool, str]:
    """Megatron's f fused with its readers (runtime/comm/column_linear.py) on CUDA, the all-reduce on NCCL (the group
    of one as the tp axis): outputs and gradients against the separate ops, fp32, within 1e-5 relative."""
    from autopar.runtime.comm import collectives as coll
    from autopar.runtime.comm.column_linear import column_linears
    from autopar.runtime.comm.context import Comm, use_comm

    torch.manual_seed(0)
    x = torch.randn(64, 256, device="cuda")
    ws = [torch.randn(384, 256, device="cuda") / 16, torch.randn(256, 128, device="cuda") / 16]
    bs = [torch.randn(384, device="cuda"), None]
    comm = Comm(groups={"tp": dist.group.WORLD}, coords={"tp": 0}, sizes={"tp": 1})
    runs = []
    for fused in (True, False):
        leaf = x.clone().requires_grad_(True)
        w = [t.clone().requires_grad_(True) for t in ws]
        with use_comm(comm):
            if fused:
                ys = column_linears(leaf, tuple(w), tuple(bs), ("linear", "mm"), "tp")
            else:
                f = coll.grad_all_reduce(leaf, "tp")
                ys = (torch.nn.functional.linear(f, w[0], bs[0]), f @ w[1])
            torch.autograd.backward(list(ys), [torch.ones_like(y) for y in ys])
        torch.cuda.synchronize()
        runs.append([*ys, leaf.grad, *(t.grad for t in w)])
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*runs))
    return "nccl-1-column-linears", worst <= 1e-5, f"largest difference / largest value {worst:.2e}"


def _gloo_rank(rank: int, world: int, axes: dict[str, int], pipeline: dict) -> tuple[list[float], int]:
    return autopar_losses("bf16", axes, "cuda:0", **pipeline)


def gloo_shared_gpu() -> list[tuple[str, bool, str]]:
    from tests._dist import run_distributed

    want = eager("bf16")
    out = []
    zbv = {"schedule": "zbv", "microbatches": 4}
    for axes, pipeline in (({"dp": 2}, {}), ({"tp": 2}, {}), ({"pp": 2}, {}), ({"pp": 2}, zbv)):
        name = "gloo-2-cuda-" + ",".join(f"{k}={v}" for k, v in {**axes, **pipeline}.items())
        try:
            results = run_distributed(_gloo_rank, 2, axes, pipeline, timeout=300)
            got, reductions = results[0]
            ok, worst = within(got, want, (reductions + 2 + 4) * U["bf16"])
            out.append((name, ok, f"autopar {got} eager {want} (difference / bound {worst:.3f})"))
        except Exception as e:  # a failure is a result of this check, reported with the others
            out.append((name, False, f"{type(e).__name__}: {str(e)[-2000:]}"))
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/gpu/cuda_checks.py needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    results = []
    for check in (nccl_world_one, gloo_shared_gpu):
        try:
            results += check()
        except Exception:
            results.append((check.__name__, False, traceback.format_exc()))
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
