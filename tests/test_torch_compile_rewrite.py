"""The rewrite of a rank's programs for ``torch_compile=True`` (runtime/build/compiled.py ``compilable``), without
Inductor (fast): the vocabulary-parallel lookup and loss as it emits them (``embedding_block``,
``vocab_cross_entropy``) traced whole by dynamo (``fullgraph``), the loss equal to torch's, and an out-of-range
label or token id raising ``InputRangeError`` as the eager program does (the check is the op
``autopar::checked_index``, whose output the graph reads, so it is never dropped); a gradient bucket over
parameters read anywhere in the program (a mixed-precision program reads some after its first computation), and
the last microbatch's buckets summing the accumulated gradient; a program with calls left eager (ZeRO-3's gathers
and releases) keeps them and is cut at them, each value freed after its last use."""

from __future__ import annotations

import weakref

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


def test_a_gradient_bucket_syncs_parameters_read_after_the_first_computation(one_rank_tp):
    import torch.fx as fx

    from autopar.runtime.build.compiled import CompileLog, bucket_sync, compilable
    from autopar.runtime.comm.context import Comm

    comm = Comm(groups={"dp": torch.distributed.group.WORLD}, coords={"dp": 0}, sizes={"dp": 1})
    root = torch.nn.Module()
    root.w, root.b = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3))
    g = fx.Graph()
    x, w = g.placeholder("x"), g.get_attr("w")
    y = g.call_function(torch.ops.aten.mm.default, (x, w))
    g.output((g.call_function(torch.ops.aten.add.Tensor, (y, g.get_attr("b"))),))  # b read after the matmul
    gm = fx.GraphModule(root, g)
    out = compilable(gm, comm, "stage0", CompileLog(), [("dp", ["w", "b"])])
    syncs = [n for n in out.graph.nodes if n.target is bucket_sync]
    assert len(syncs) == 1 and [a.target for a in syncs[0].args[4:]] == ["w", "b"], out.graph
    xs = torch.randn(2, 3)
    assert torch.equal(out(xs)[0], gm(xs)[0])


def test_the_last_microbatchs_buckets_sum_the_accumulated_gradient_once(one_rank_tp):
    """``take=True`` (several microbatches a step): the bucket's backward adds what ``.grad`` holds before it
    sums, each parameter in the bucket its backward reaches first (b is in buckets over two axes), and leaves
    ``.grad`` the bucket's sum. Summed in float32 (``Comm.grad_dtype``) on one rank, the rounding shows which
    tensor was summed: the eager buckets' round(g0 + g1), not g0 + round(g1) (no take, or b's taken in its
    inner bucket). Under dynamo (aot_eager)."""
    import torch.fx as fx

    from autopar.runtime.build.compiled import CompileLog, bucket_sync, compilable
    from autopar.runtime.comm.context import Comm

    world = torch.distributed.group.WORLD
    sizes = {"dp": 1, "dq": 1}
    comm = Comm({"dp": world, "dq": world}, {"dp": 0, "dq": 0}, sizes, grad_dtype=torch.float32)
    root = torch.nn.Module()
    gen = torch.Generator().manual_seed(0)
    root.w = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64, generator=gen))
    root.b = torch.nn.Parameter(torch.randn(3, dtype=torch.float64, generator=gen))
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.mm.default, (x, g.get_attr("w")))
    z = g.call_function(torch.ops.aten.add.Tensor, (y, g.get_attr("b")))
    y = g.call_function(torch.ops.aten.mul.Tensor, (z, y))
    g.output((g.call_function(torch.ops.aten.sum.default, (y,)),))
    gm = fx.GraphModule(root, g)
    buckets = [("dp", ["w", "b"]), ("dq", ["b"])]  # b synced over two axes: taken in its last bucket only
    last = compilable(gm, comm, "stage0", CompileLog(), buckets, take=True)
    takes = [n.args[2:4] for n in last.graph.nodes if n.target is bucket_sync]
    assert [t[1] for t in takes] == [(0,), (0,)] and all(t[0] >= 0 for t in takes), takes  # w in 1st, b in 2nd
    before = compilable(gm, comm, "stage0.accumulate", CompileLog())
    assert not [n for n in before.graph.nodes if n.target is bucket_sync]
    xs = [torch.randn(2, 3, dtype=torch.float64, generator=gen) for _ in range(2)]
    grads = []
    for x in xs:  # each microbatch's gradient alone
        root.zero_grad()
        gm(x)[0].backward()
        grads.append({n: p.grad.clone() for n, p in root.named_parameters()})
    g0, g1 = grads
    want = {n: (g0[n] + g1[n]).float().double() for n in g0}  # eager: accumulated, then summed in float32
    wrong = {n: g0[n] + g1[n].float().double() for n in g0}  # only the last microbatch's summed
    assert all(not torch.equal(wrong[n], want[n]) for n in g0)  # the rounding tells them apart
    root.zero_grad()
    torch._dynamo.reset()
    torch.compile(before, backend="aot_eager", fullgraph=True)(xs[0])[0].backward()
    assert all(torch.equal(p.grad, g0[n]) for n, p in root.named_parameters())  # accumulated only
    torch.compile(last, backend="aot_eager", fullgraph=True)(xs[1])[0].backward()
    for n, p in root.named_parameters():
        assert torch.equal(p.grad, want[n]), (n, p.grad - want[n])


def test_a_returned_loss_is_reduced_after_the_graph_and_a_label_count_before_the_compute(one_rank_tp):
    """A mean loss's two all-reduces as the rewrite leaves them: the count of labels (a function of the inputs
    alone) moved ahead of the matmul, so Inductor starts it first; the returned loss's deferred all-reduce
    out of the graph (``deferred``), started by ``CompiledCall`` after it and returned in flight (``Deferred``,
    as the eager program returns it), its value and gradient those of the program run eagerly."""
    import torch.fx as fx

    from autopar.runtime.build import compiled as C
    from autopar.runtime.comm import collectives as coll
    from autopar.runtime.comm.context import use_comm
    from autopar.runtime.comm.lazy import Deferred

    root = torch.nn.Module()
    root.w = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    g = fx.Graph()
    x, w = g.placeholder("x"), g.get_attr("w")
    y = g.call_function(torch.ops.aten.mm.default, (x, w))
    labels = g.placeholder("labels")  # after a computation, as a pipeline stage's labels are
    y = g.call_function(torch.ops.aten.sum.default, (g.call_function(torch.ops.aten.mm.default, (y, w)),))
    kept = g.call_function(torch.ops.aten.ne.Scalar, (labels, -100))
    count = g.call_function(coll.all_reduce, (g.call_function(torch.ops.aten.sum.default, (kept,)), "tp"))
    mean = g.call_function(torch.ops.aten.div.Tensor, (y, count))
    g.output((g.call_function(coll.all_reduce, (mean,), {"axis": "tp", "op": "sum", "defer": True}),))
    gm = fx.GraphModule(root, g)
    out = C.compilable(gm, one_rank_tp, "forward0", C.CompileLog())
    nodes = list(out.graph.nodes)
    calls = [n.target for n in nodes if n.op == "call_function"]
    first = [n.target for n in nodes[nodes.index(next(n for n in nodes if n.name == "labels")) :]]
    assert first.index(C.all_reduce) < first.index(torch.ops.aten.mm.default), out.graph  # the count first
    assert calls.count(C.all_reduce) == 1 and out.deferred == [(0, "tp", "sum")], out.graph  # the loss's: after
    xs, ls = torch.randn(2, 3, dtype=torch.float64), torch.tensor([1, -100, 2])
    with use_comm(one_rank_tp):
        want = gm(xs, ls)[0]
        want_grad = torch.autograd.grad(want, root.w)[0]
    (loss,) = C.CompiledCall(out, "forward0", C.CompileLog(), one_rank_tp, out.deferred)(xs, ls)
    assert isinstance(loss, Deferred)
    assert torch.equal(loss.value(), want.value() if isinstance(want, Deferred) else want)
    assert torch.equal(torch.autograd.grad(loss, root.w)[0], want_grad)


# -- calls left eager (ZeRO-3's gathers and releases): kept, and the program cut at them --------------------
_SEEN: list = []  # what the eager calls below saw: (a weak reference to the copy,) then whether it was alive


def _gather(x):
    return [x * 3]  # a unit gathered: a list of its whole parameters


def _release(gathered, copies):
    _SEEN.append(weakref.ref(copies[0][1]))  # returns nothing: dead code to fx


def _probe(x):
    _SEEN.append(_SEEN[0]() is not None if _SEEN else None)  # after the copy's last reader: is it still held?
    return x


def test_a_program_cut_at_its_eager_calls_keeps_them_and_drops_each_value_after_its_last_use(one_rank_tp):
    """``compilable`` keeps an eager call returning nothing (ZeRO-3's release: fx's dead-code elimination would
    drop it), and ``_compiled`` cuts the program at its eager calls, so a tensor read last between two of them is
    freed after that read, as the eager program frees it. Compiled whole, each eager call is a dynamo graph break,
    and the frame resuming after it holds its arguments (here the copy) to the program's end; the same program
    through ``torch.compile`` alone shows it. Dynamo's ``eager`` back end: no Inductor, no compiling."""
    import torch.fx as fx

    from autopar.runtime.build import compiled as C
    from autopar.runtime.grads.unit_gathers import _item

    g = fx.Graph()
    x = g.placeholder("x")
    gathered = g.call_function(_gather, (g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0)),))
    copy = g.call_function(torch.ops.aten.add.Tensor, (g.call_function(_item, (gathered, 0)), 1.0))
    g.call_function(_release, (gathered, ((0, copy),)))
    y = g.call_function(torch.ops.aten.mul.Tensor, (copy, x))  # the copy's last reader
    g.output((g.call_function(torch.ops.aten.add.Tensor, (g.call_function(_probe, (y,)), 1.0)),))
    out = C.compilable(fx.GraphModule(torch.nn.Module(), g), one_rank_tp, "stage0", C.CompileLog())
    xs = torch.randn(64)
    want = (xs * 6 + 1) * xs + 1
    torch._dynamo.reset()
    for fn, held in ((torch.compile(out, backend="eager", dynamic=False), True), (C._compiled(out, "eager"), False)):
        _SEEN.clear()
        assert torch.equal(fn(xs)[0], want)
        assert len(_SEEN) == 2 and _SEEN[1] is held, (held, _SEEN)  # the release ran; the copy held or freed


def test_a_computation_reading_another_unit_starts_a_piece_of_its_own():
    """``_pieces``: the last block and the head reading the root's copy again are compiled apart (one piece would be
    one autograd node, whose backward gathers the root beside the block and the one arriving); a unit's own side
    (its items, their casts and views) and computations reading no unit stay with the piece."""
    import torch.fx as fx

    from autopar.runtime.build import compiled as C
    from autopar.runtime.build.precision import cast_to
    from autopar.runtime.grads.unit_gathers import _item

    g = fx.Graph()
    x = g.placeholder("x")
    root = g.call_function(_gather, (x,))
    w = g.call_function(cast_to, (g.call_function(_item, (root, 0)), torch.bfloat16))
    h = g.call_function(torch.ops.aten.mul.Tensor, (x, w))  # the embedding: reads the root
    block = g.call_function(_gather, (x,))
    v = g.call_function(torch.ops.aten.t.default, (g.call_function(_item, (block, 0)),))  # the block's side
    h = g.call_function(torch.ops.aten.mul.Tensor, (h, v))  # the block
    h = g.call_function(torch.ops.aten.add.Tensor, (h, 1.0))  # no unit: stays
    head = g.call_function(torch.ops.aten.mul.Tensor, (h, w))  # the head: the root's copy again
    g.output((head,))
    piece, kept = C._pieces(fx.GraphModule(torch.nn.Module(), g), {_gather})
    assert piece[v] == piece[h.args[0]] == piece[h] < piece[head], piece  # the head apart from the block
    assert piece[w] < piece[block] < piece[v] and kept == {f"submod_{piece[root]}", f"submod_{piece[block]}"}, piece
