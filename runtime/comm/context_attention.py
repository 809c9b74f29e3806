"""Attention on a rank's block of the sequence (context parallelism, ``solver/sharding/rules/context.py``).

Two forms the generated rank modules call in place of ``scaled_dot_product_attention``:

- ``query_block_sdpa``, the all-gather form's causal call: the rank holds query rows ``[start, start + Lq)`` of the
  sequence against all of its keys. ``is_causal=True`` would align the mask to the top-left corner of the local
  ``[queries, keys]`` block, right only for the whole sequence; query ``start + i`` sees key ``j`` where
  ``j <= start + i``, so the mask is built on those global rows (plain ATen ops, so autograd needs nothing special).
- ``ring_sdpa``, ring attention: queries, keys and values all split on the sequence (rank ``r`` holds block ``r``).
  Each rank's key/value block travels around the ring of the axis by point-to-point send/recv (``n - 1`` steps, the
  next block's transfer posted before the current block is computed, so on NCCL it runs beside it), and each query
  row's softmax is merged block by block with its log-sum-exp (the online softmax of FlashAttention and of
  Liu et al.'s ring attention). Under a causal or explicit mask the queries are first load-balanced: the sequence is
  cut into ``2n`` pieces and rank ``r`` computes pieces ``r`` and ``2n - 1 - r`` (Megatron-Core's and torchtitan's
  layout), reached from its contiguous pieces ``2r, 2r + 1`` by one point-to-point exchange of half its queries (and
  mask rows) forward and of half its output back; every rank then attends to ``2n + 1`` pieces of keys, where the
  contiguous layout gives rank ``r`` only ``2r + 1``. Sub-blocks a causal mask hides (a key piece after the query
  piece) or a boolean mask hides wholly are skipped, and a boolean sub-block mask that hides nothing or is the causal
  triangle runs on the kernel's unmasked or causal path. The backward is written out (``_Ring.backward``): the key
  and value blocks go around the ring again; each block's gradient accumulator starts at its first visitor (the
  owner keeps its own share) and goes on with it, ``n - 1`` hops, the last of which hands it back to the owner; a
  hop is sent once the visitor's share is added and waited for only when the next rank needs it, a step later.
  Each sub-block's gradients come from torch's CPU flash backward kernel given the ring's merged output and global
  log-sum-exp (``_flash_block_backward``); a mask that needs its own gradient (the kernel returns none) and tensors
  off the CPU take the explicit recomputation of the scores from the saved log-sum-exp. Both kernels take float64,
  so the float64 exactness tests run the flash path.
"""

from __future__ import annotations

import math

import torch

from autopar.runtime.comm.context import Comm, current_comm


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
    kwargs.pop("attn_mask", None)  # None: a causal call has no mask of its own (a captured one passes None)
    return torch.ops.aten.scaled_dot_product_attention(q, k, v, mask, **kwargs)


# -- point to point on one mesh axis ------------------------------------------------------------------------------


def _peer(c: Comm, axis: str, member: int) -> int:
    return c.peers.global_rank(c.groups[axis], member)


def _exchange(c: Comm, axis: str, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]):
    """Post sends of ``(tensor, member)`` and receives into ``(buffer, member)`` on ``axis``; the handles to wait.
    Messages of one pair match in the order listed (both sides list them in one global order)."""
    ops = [(True, t.contiguous(), _peer(c, axis, m)) for t, m in sends]
    ops += [(False, buf, _peer(c, axis, m)) for buf, m in recvs]
    return c.peers.batch_isend_irecv(ops) if ops else []


def _wait(works) -> None:
    for w in works:
        w.wait()


def _buffer(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor to receive one like ``t`` into."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _ring_shift(c: Comm, axis: str, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
    """Start sending ``tensors`` to the next member of the ring and receiving the previous member's: the buffers
    the received tensors land in, and the handles to wait."""
    n, r = c.sizes[axis], c.coords[axis]
    bufs = [_buffer(t) for t in tensors]
    works = _exchange(c, axis, [(t, (r + 1) % n) for t in tensors], [(b, (r - 1) % n) for b in bufs])
    return bufs, works


# -- the load-balanced layout ---------------------------------------------------------------------------------------


def _balanced_owner(p: int, n: int) -> tuple[int, int]:
    """(member, slot) holding piece ``p`` of ``2n`` in the load-balanced layout: member r holds pieces r, 2n-1-r."""
    return (p, 0) if p < n else (2 * n - 1 - p, 1)


def _permute(c: Comm, axis: str, x: torch.Tensor, dim: int, to_balanced: bool) -> torch.Tensor:
    """``x``'s two pieces along ``dim`` (this member's slots) moved from the contiguous layout (member r holds pieces
    2r, 2r+1) to the balanced one, or back."""
    n, r = c.sizes[axis], c.coords[axis]
    mine = list(x.chunk(2, dim))
    out = [_buffer(mine[0]), _buffer(mine[1])]
    sends, recvs = [], []
    for p in range(2 * n):  # one global order: a pair's messages match in it
        src = (p // 2, p % 2)
        dst = _balanced_owner(p, n)
        if not to_balanced:
            src, dst = dst, src
        if src[0] == r and dst[0] == r:
            out[dst[1]] = mine[src[1]]
        elif src[0] == r:
            sends.append((mine[src[1]], dst[0]))
        elif dst[0] == r:
            recvs.append((out[dst[1]], src[0]))
    _wait(_exchange(c, axis, sends, recvs))
    return torch.cat(out, dim)


class _Permute(torch.autograd.Function):
    """``_permute`` with its inverse as the backward."""

    @staticmethod
    def forward(ctx, x, axis, dim, to_balanced):
        ctx.comm, ctx.args = current_comm(), (axis, dim, not to_balanced)
        return _permute(ctx.comm, axis, x, dim, to_balanced)

    @staticmethod
    def backward(ctx, g):
        return _permute(ctx.comm, ctx.args[0], g, ctx.args[1], ctx.args[2]), None, None, None


# -- the ring ---------------------------------------------------------------------------------------------------


def _sub_blocks(pieces: tuple[int, int], block: int, causal: bool, mask) -> list[tuple]:
    """The (query slot, key slot, diagonal, mask) of this rank's two query pieces (global piece numbers ``pieces``)
    against the two key pieces ``2 * block``, ``2 * block + 1`` worth computing: under a causal mask a key piece
    after the query piece is hidden; under a boolean mask a sub-block it hides wholly is skipped. Each sub-block's
    mask is ``mask(a, b)`` (None without one); a boolean one that hides nothing is dropped and one that is the
    causal triangle of a square sub-block becomes ``diagonal`` (``_simplified``), so the sub-block runs on the
    kernel's unmasked or causal path, not its masked one (LLaMA's explicit causal mask: 2.6 and 4.1 times the
    time forward on a [1, 4, 2048, 16] block, ``bench/ring_blocks.py``)."""
    out = []
    for a, qp in enumerate(pieces):
        for b in range(2):
            kp = 2 * block + b
            if causal and kp > qp:
                continue
            m, diag = (mask(a, b) if mask is not None else None), causal and kp == qp
            if m is not None and m.dtype == torch.bool:
                seen = int(torch.count_nonzero(m))  # (a quarter of the time of m.any() on these strided views)
                if not seen:
                    continue
                m, diag = _simplified(m, diag, seen)
            out.append((a, b, diag, m))
    return out


def _simplified(m: torch.Tensor, diag: bool, seen: int) -> tuple[torch.Tensor | None, bool]:
    """(mask, diagonal) equivalent to boolean sub-block mask ``m`` (``seen`` of its entries true) under ``diag``: no
    mask where ``m`` hides nothing, none and the causal triangle where it is exactly that triangle of a square
    sub-block (every batch and head alike), else ``m`` as it is."""
    if seen == m.numel():
        return None, diag
    rows, cols = m.shape[-2], m.shape[-1]
    if rows == cols and seen == m.numel() // (rows * cols) * rows * (rows + 1) // 2:
        tri = torch.ones(rows, cols, dtype=torch.bool, device=m.device).tril()
        if bool((m == tri).all()):
            return None, True
    return m, diag


def _scores(q, k, scale, mask, diag):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
    if diag:
        hide = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(hide, -math.inf)
    return s


# a block's forward on torch's CPU flash kernel, which returns the log-sum-exp the merge needs (``_flash_block``);
# False: the explicit matmul / softmax (bench/ring_blocks.py times both)
FLASH = True


def _flash_block(q, k, v, scale, mask, diag):
    """(output, log-sum-exp) of one sub-block by ``aten._scaled_dot_product_flash_attention_for_cpu``: the
    result of ``_scores``' softmax times ``v`` and its ``logsumexp``. A boolean mask goes in as an additive one
    (the kernel takes only the query's dtype); under a mask the diagonal's causal triangle is added to it (the
    kernel takes a mask or ``is_causal``, not both); rows the mask hides wholly get log-sum-exp -inf (the
    kernel returns 0 there, and an output of zeros, which the merge then weighs by nothing)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if mask is None:
        return flash(q, k, v, 0.0, diag, scale=scale)
    add = _additive(q, k, mask, diag)
    out, lse = flash(q, k, v, 0.0, False, attn_mask=add, scale=scale)
    dead = torch.isneginf(add).all(-1)
    return out, lse.masked_fill(dead, -math.inf) if bool(dead.any()) else lse


def _additive(q, k, mask, diag):
    """``mask`` (boolean or additive) as the additive ``[..., queries, keys]`` mask of the query's dtype the flash
    kernels take, the diagonal's causal triangle added to it when ``diag``."""
    add = (
        mask.to(q.dtype)
        if mask.dtype != torch.bool
        else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, -math.inf)
    )
    add = add.expand(*add.shape[:-2], q.shape[-2], k.shape[-2])
    if diag:
        hide = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        add = add.masked_fill(hide, -math.inf)
    return add


def _flash_block_backward(g, q, k, v, out, lse, scale, mask, diag):
    """(dq, dk, dv) of one sub-block by ``aten._scaled_dot_product_flash_attention_for_cpu_backward``, given the
    ring's merged output ``out`` and global log-sum-exp ``lse`` of these query rows (the standard ring backward:
    the kernel's ``exp(s - lse)`` is then the sub-block's slice of the global softmax and its
    ``D = rowsum(g * out)`` the global one, so the three gradients are this sub-block's exact contributions).
    Rows hidden everywhere have ``lse`` -inf; it goes in as 0, where every score is -inf and the weights 0."""
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    lse = _finite(lse).contiguous()
    if mask is None:
        return bwd(g, q, k, v, out, lse, 0.0, diag, scale=scale)
    return bwd(g, q, k, v, out, lse, 0.0, False, attn_mask=_additive(q, k, mask, diag), scale=scale)


def _finite(x):
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _sum_to(g: torch.Tensor, shape) -> torch.Tensor:
    """``g`` summed over the dims a tensor of ``shape`` broadcast to it along."""
    lead = g.dim() - len(shape)
    g = g.sum(tuple(range(lead))) if lead else g
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    return g.sum(dims, keepdim=True) if dims else g


class _Ring(torch.autograd.Function):
    """Ring attention of this rank's queries ``q`` (two pieces, global piece numbers ``pieces``) over every rank's
    key/value block; ``mask`` (or None) has this rank's query rows and every key column."""

    @staticmethod
    def forward(ctx, q, k, v, mask, axis, pieces, causal, scale, groups):
        c = current_comm()
        n, r = c.sizes[axis], c.coords[axis]
        acc = torch.promote_types(q.dtype, torch.float32)
        qa = [x.to(acc) for x in q.chunk(2, -2)]
        width = k.shape[-2] // 2  # one piece of keys
        outs = [torch.zeros(*x.shape[:-1], v.shape[-1], dtype=acc, device=q.device) for x in qa]
        lses = [torch.full(x.shape[:-1], -math.inf, dtype=acc, device=q.device) for x in qa]
        kv, plans = [k, v], []  # each step's sub-blocks, which the backward computes again
        for step in range(n):
            block = (r - step) % n
            works = []
            if step < n - 1:
                nxt, works = _ring_shift(c, axis, kv)
            kb, vb = (_heads(x.to(acc), groups).chunk(2, -2) for x in kv)
            plans.append(_sub_blocks(pieces, block, causal, _mask_of(mask, block, width)))
            for a, b, diag, m in plans[-1]:
                if FLASH and qa[a].device.type == "cpu":
                    o, lse = _flash_block(qa[a], kb[b], vb[b], scale, m, diag)
                else:
                    s = _scores(qa[a], kb[b], scale, m, diag)
                    lse = torch.logsumexp(s, -1)
                    o = torch.matmul(torch.exp(s - _finite(lse).unsqueeze(-1)), vb[b])
                new = torch.logaddexp(lses[a], lse)
                outs[a] = outs[a] * torch.exp(lses[a] - _finite(new)).unsqueeze(-1) + o * torch.exp(
                    lse - _finite(new)
                ).unsqueeze(-1)
                lses[a] = new
            _wait(works)
            if step < n - 1:
                kv = nxt
        out = torch.cat(outs, -2)
        lse = torch.cat(lses, -1)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.comm, ctx.args, ctx.plans = c, (axis, pieces, causal, scale, groups), plans
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, g):
        q, k, v, mask, out, lse = ctx.saved_tensors
        c = ctx.comm
        axis, pieces, causal, scale, groups = ctx.args
        n, r = c.sizes[axis], c.coords[axis]
        acc = out.dtype
        qa = [x.to(acc).contiguous() for x in q.chunk(2, -2)]
        ga = [x.contiguous() for x in g.to(acc).chunk(2, -2)]
        oa = [x.contiguous() for x in out.chunk(2, -2)]
        lr = [x.contiguous() for x in lse.chunk(2, -1)]
        la = [_finite(x).unsqueeze(-1) for x in lr]
        da = [(x * o).sum(-1, keepdim=True) for x, o in zip(ga, oa)]  # FlashAttention's D = rowsum(dO * O)
        dq = [torch.zeros_like(x) for x in qa]
        width = k.shape[-2] // 2
        grad_mask = mask is not None and ctx.needs_input_grad[3]
        dmask = torch.zeros_like(mask, dtype=acc) if grad_mask else None
        kv, own, incoming = [k, v], None, None
        for step in range(n):
            works = []
            if step < n - 1:
                nxt, works = _ring_shift(c, axis, kv)
            kb, vb = (_heads(x.to(acc), groups).chunk(2, -2) for x in kv)
            # this step's contributions to the block's key/value gradients, at the keys' own heads
            dkb = list(torch.zeros(k.shape, dtype=acc, device=k.device).chunk(2, -2))
            dvb = list(torch.zeros(v.shape, dtype=acc, device=v.device).chunk(2, -2))
            block = (r - step) % n
            for a, b, diag, m in ctx.plans[step]:
                if FLASH and not grad_mask and qa[a].device.type == "cpu":
                    # the flash backward kernel returns no mask gradient: a mask that wants one stays explicit
                    gq, gk, gv = _flash_block_backward(ga[a], qa[a], kb[b], vb[b], oa[a], lr[a], scale, m, diag)
                    dq[a] = dq[a] + gq
                    dkb[b] = dkb[b] + _fold_heads(gk, groups)
                    dvb[b] = dvb[b] + _fold_heads(gv, groups)
                    continue
                p = torch.exp(_scores(qa[a], kb[b], scale, m, diag) - la[a])
                dvb[b] = dvb[b] + _fold_heads(torch.matmul(p.transpose(-1, -2), ga[a]), groups)
                ds = p * (torch.matmul(ga[a], vb[b].transpose(-1, -2)) - da[a])
                dq[a] = dq[a] + torch.matmul(ds, kb[b]) * scale
                dkb[b] = dkb[b] + _fold_heads(torch.matmul(ds.transpose(-1, -2), qa[a]), groups) * scale
                if grad_mask:
                    rows = (
                        slice(a * q.shape[-2] // 2, (a + 1) * q.shape[-2] // 2) if mask.shape[-2] != 1 else slice(None)
                    )
                    cols = slice((2 * block + b) * width, (2 * block + b + 1) * width)
                    dmask[..., rows, cols] += _sum_to(ds, dmask[..., rows, cols].shape)
            part = [torch.cat(dkb, -2), torch.cat(dvb, -2)]
            if step == 0:  # the rank's own block: its share stays here until the others' come home
                own = part
            else:
                # the visited block's accumulator: the visitors' shares before this one (none for the first),
                # passed on to the next rank, which at the last step is the block's owner; the previous rank's
                # accumulator, for the block this rank visits next, is received meanwhile
                if incoming is not None:
                    _wait(incoming[1])
                    part = [x + y for x, y in zip(part, incoming[0])]
                incoming = _ring_shift(c, axis, part)
            _wait(works)
            if step < n - 1:
                kv = nxt
        dk, dv = own
        if incoming is not None:  # the other ranks' shares of this rank's block, home with its last hop
            _wait(incoming[1])
            dk, dv = dk + incoming[0][0], dv + incoming[0][1]
        dq = torch.cat(dq, -2).to(q.dtype)
        dk, dv = dk.to(k.dtype), dv.to(v.dtype)
        return dq, dk, dv, (dmask.to(mask.dtype) if grad_mask else None), None, None, None, None, None


def _heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Keys or values repeated to the queries' heads (grouped-query attention's ``enable_gqa``)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def _fold_heads(g: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_heads``: each group of repeated heads summed."""
    if groups == 1:
        return g
    shape = g.shape
    return g.reshape(*shape[:-3], shape[-3] // groups, groups, *shape[-2:]).sum(-3)


def _mask_of(mask, block: int, width: int):
    """The mask's sub-block of query slot a and key slot b of ``block``, as a function (None without a mask)."""
    if mask is None:
        return None
    rows = mask.shape[-2]

    def sub(a: int, b: int) -> torch.Tensor:
        m = mask if rows == 1 else mask.narrow(-2, a * rows // 2, rows // 2)
        return m if m.shape[-1] == 1 else m.narrow(-1, (2 * block + b) * width, width)

    return sub


def ring_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis: str,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, attn_mask, is_causal=..., scale=..., enable_gqa=...)`` of the whole
    sequence on this rank's block of queries, keys and values (the sequence split in contiguous blocks over
    ``axis``; ``attn_mask``, if any, with this rank's query rows and every key column): ring attention (the
    module docstring). The result is this rank's block of the output rows."""
    if dropout_p:
        raise ValueError("ring attention with dropout_p > 0: the sharding rule offers no such candidate")
    c = current_comm()
    n, r = c.sizes[axis], c.coords[axis]
    groups = q.shape[-3] // k.shape[-3] if enable_gqa else 1
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = attn_mask
    if mask is not None and mask.dim() < q.dim():
        mask = mask.reshape((1,) * (q.dim() - mask.dim()) + tuple(mask.shape))
    balance = is_causal or mask is not None
    if balance:
        q = _Permute.apply(q, axis, -2, True)
        if mask is not None and mask.shape[-2] != 1:
            mask = _Permute.apply(mask, axis, -2, True)
        pieces = (r, 2 * n - 1 - r)
    else:
        pieces = (2 * r, 2 * r + 1)
    out = _Ring.apply(q, k, v, mask, axis, pieces, is_causal, scale, groups)
    return _Permute.apply(out, axis, -2, False) if balance else out


__all__ = ["query_block_sdpa", "ring_sdpa"]
