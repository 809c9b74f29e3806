"""The vocabulary-parallel lookup and loss as ``torch_compile=True`` emits them (runtime/build/compiled.py
``embedding_block``, ``vocab_cross_entropy``): traced whole by dynamo (``fullgraph``), the loss equal to torch's,
and an out-of-range label or token id raising ``InputRangeError`` as the eager program does (the check is the op
``autopar::checked_index``, whose output the graph reads, so it is never dropped). No Inductor: fast."""

from __future__ import annotations

import pytest
import torch

from autopar.errors import InputRangeError


def test_compiled_vocab_parallel_lookup_and_loss_check_their_ranges(one_rank_tp):
    from autopar.runtime.build import compiled as C

    C._COMMS.append(one_rank_tp)
    comm = len(C._COMMS) - 1

    def f(logits, target, w, ids):
        e = C.embedding_block(w, ids, 0, -1, 16)
        return C.vocab_cross_entropy(logits, target, comm, ["tp"], 1, -100, classes=8) + e.sum()

    torch._dynamo.reset()
    g = torch.compile(f, backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 8, dtype=torch.float64, generator=gen)
    w = torch.randn(16, 3, dtype=torch.float64, generator=gen)
    target, ids = torch.tensor([1, 2, -100, 7]), torch.tensor([0, 15])
    want = torch.nn.functional.cross_entropy(logits, target) + w[ids].sum()
    assert torch.allclose(g(logits, target, w, ids), want, rtol=1e-12, atol=0)
    with pytest.raises(InputRangeError, match=r"1 labels are outside \[0, 8\)"):
        g(logits, torch.tensor([1, 2, 8, 7]), w, ids)
    with pytest.raises(InputRangeError, match=r"1 token ids are outside \[0, 16\)"):
        g(logits, target, w, torch.tensor([0, 16]))
