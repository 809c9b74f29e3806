"""Causal attention on a rank's block of the query sequence (context parallelism, ``solver/sharding/rules/context.py``).

``scaled_dot_product_attention(..., is_causal=True)`` aligns its mask to the top-left corner of the local
``[queries, keys]`` block, which is right only for the whole sequence. A rank holding query rows
``[start, start + Lq)`` of the sequence against all of its keys needs the mask on those global rows: query
``start + i`` sees key ``j`` where ``j <= start + i``. The generated rank modules call this in place of the
causal call (plain ATen ops, so autograd needs nothing special).
"""

from __future__ import annotations

import torch

from autopar.runtime.comm.context import current_comm


def query_block_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axes: list[str], **kwargs) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)`` of the whole sequence, restricted to
    this rank's query rows: its block over ``axes`` (outer axis first) of the query dim, ``q.shape[-2]`` rows."""
    c = current_comm()
    block = 0
    for a in axes:
        block = block * c.sizes[a] + c.coords[a]
    start = block * q.shape[-2]
    rows = torch.arange(start, start + q.shape[-2], device=q.device).unsqueeze(1)
    mask = torch.arange(k.shape[-2], device=q.device).unsqueeze(0) <= rows
    kwargs.pop("is_causal", None)
    return torch.ops.aten.scaled_dot_product_attention(q, k, v, mask, **kwargs)


__all__ = ["query_block_sdpa"]
