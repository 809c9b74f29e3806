"""Ring attention's blocks on torch's CPU flash kernel beside the explicit matmul / softmax (BENCHMARKS.md, "Context
parallelism"): one sub-block's forward as ``runtime/comm/context_attention._Ring`` computes it, output and
log-sum-exp, both ways in one process, alternating A B A B, the medians and their ratio; with ``--backward``, the
sub-block's backward (dq, dk, dv from the merged output and log-sum-exp) on the flash backward kernel beside the
explicit recomputation of the scores.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.ring_blocks [--rows 2048] [--heads 4] [--dim 16] [--repeats 15]
        [--backward]

Cases: a full block (the keys before the queries), the diagonal block (causal inside), and a block under an
explicit boolean mask (transformers' causal mask, as the bench model passes it).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from autopar.runtime.comm.context_attention import _finite, _flash_block, _flash_block_backward, _scores


def explicit(q, k, v, scale, mask, diag):
    s = _scores(q, k, scale, mask, diag)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - _finite(lse).unsqueeze(-1)), v), lse


def explicit_backward(g, q, k, v, out, lse, scale, mask, diag):
    """``_Ring.backward``'s explicit path for one sub-block: (dq, dk, dv)."""
    p = torch.exp(_scores(q, k, scale, mask, diag) - _finite(lse).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), g)
    ds = p * (torch.matmul(g, v.transpose(-1, -2)) - (g * out).sum(-1, keepdim=True))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048, help="query and key rows of one block")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--backward", action="store_true", help="time the sub-block's backward instead")
    a = p.parse_args()
    torch.manual_seed(0)
    dt = getattr(torch, a.dtype)
    q, k, v = (torch.randn(1, a.heads, a.rows, a.dim, dtype=dt) for _ in range(3))
    scale = 1 / math.sqrt(a.dim)
    causal = torch.ones(a.rows, a.rows, dtype=torch.bool).tril().view(1, 1, a.rows, a.rows)
    cases = {"full": (None, False), "diagonal": (None, True), "boolean mask": (causal, False)}
    block = f"[1, {a.heads}, {a.rows}, {a.dim}] {a.dtype}"
    pass_ = "backward" if a.backward else "forward"
    g = torch.randn_like(q)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), block {block}, {pass_}")
    print("| block | explicit (ms) | flash (ms) | flash / explicit | max abs diff |")
    print("| --- | --- | --- | --- | --- |")
    for name, (mask, diag) in cases.items():
        times = {"explicit": [], "flash": []}
        if a.backward:
            out, lse = explicit(q, k, v, scale, mask, diag)
            args = (g, q, k, v, out, lse, scale, mask, diag)
            fns = (("explicit", explicit_backward), ("flash", _flash_block_backward))
        else:
            args = (q, k, v, scale, mask, diag)
            fns = (("explicit", explicit), ("flash", _flash_block))
        for _ in range(a.repeats):
            for label, fn in fns:
                t0 = time.perf_counter()
                fn(*args)
                times[label].append(time.perf_counter() - t0)
        diff = max((x - y).abs().max().item() for x, y in zip(fns[0][1](*args), fns[1][1](*args)))
        e, f = (statistics.median(times[x]) * 1e3 for x in ("explicit", "flash"))
        print(f"| {name} | {e:.2f} | {f:.2f} | {f / e:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
