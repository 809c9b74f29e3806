"""A compiled region's backward as two Inductor graphs: B (the input gradients) and W (the weight gradients).

AOTAutograd hands Inductor one backward graph per compiled region, whose outputs are the gradients of the
region's inputs. For a part whose schedule splits its backwards (``compile_part(..., retains_graph=True)``:
ZB-H1/H2, ZB-V, DualPipeV) that graph is cut in two here, each compiled by Inductor (``compile_fx_inner``):

- **W's outputs** are the gradients of the *weight-side* inputs: a parameter, or a tensor computed from
  parameters only (ZeRO-3's gathered weights); every other output (a received activation's gradient) is B's.
- **B** computes every node B's outputs need, nothing else; the nodes W's outputs need that B computed too
  (a matmul's output gradient, which both dX and dW read) are extra outputs of B, handed to W. **W** computes
  the rest from those and the saved tensors it reads. No node is computed twice.
- When the runtime asks for it (``split_backward.wants_region_weights``: a zero-bubble ``B`` is running this
  region's backward), the region's backward runs B and returns ``None`` for W's outputs, and hands over a
  thunk that runs W (``split_backward.hand_over_region_weights``); the schedule's ``W`` calls it and starts
  autograd below the region from its gradients (``WeightGrads.run``). Otherwise (an unsplit backward of the
  same part) B then W run at once and every gradient is returned.

What W keeps from B to W: the boundary tensors and the saved tensors W reads, the same as the eager split
keeps (the output gradient of each weight op, and its saved input). AOTAutograd's cache is off for such a
part (its entries would hold the unsplit backward); Inductor's FX graph cache keeps B's and W's kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.runtime.execute.split_backward import hand_over_region_weights, wants_region_weights


@dataclass
class SplitLog:
    """What the split did to one part's backward graphs: per graph, B's and W's output counts and kernels
    run (``calls``: B alone, with W handed over / B and W at once / W run later)."""

    # per backward graph: {"B": its outputs, "W": its outputs, "boundary": tensors from B to W, "compiled": halves
    # handed to the compiler (a half that computes nothing is not)}
    graphs: list[dict] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=lambda: {"split": 0, "whole": 0, "W": 0})


def weight_side(x) -> bool:
    """Whether ``x`` (an input of a compiled region, at trace time) is a parameter or computed from parameters
    only (every leaf autograd reaches from it is a ``torch.nn.Parameter``)."""
    if isinstance(x, torch.nn.Parameter):
        return True
    if not isinstance(x, torch.Tensor) or not x.requires_grad or x.grad_fn is None:
        return False
    seen, stack, leaves = set(), [x.grad_fn], 0
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if hasattr(n, "variable"):
            if not isinstance(n.variable, torch.nn.Parameter):
                return False
            leaves += 1
        stack.extend(c for c, _ in n.next_functions)
    return leaves > 0


def weight_outputs(gm: fx.GraphModule, weight_inputs: set[int]) -> list[int]:
    """The positions of a backward graph's outputs that are gradients of the region's inputs ``weight_inputs``
    (indices of the dynamo graph's inputs), from the output node's descriptors (AOTAutograd's ``desc``)."""
    from torch._functorch._aot_autograd.descriptors import GradAOTOutput, ParamAOTInput, PlainAOTInput

    out = next(n for n in gm.graph.nodes if n.op == "output")
    found = []
    for i, d in enumerate(out.meta.get("desc") or ()):
        of = d.grad_of if isinstance(d, GradAOTOutput) else None
        if isinstance(of, ParamAOTInput) or (isinstance(of, PlainAOTInput) and of.idx in weight_inputs):
            found.append(i)
    return found


def _ancestors(nodes) -> set[fx.Node]:
    out: set[fx.Node] = set()
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in out:
            out.add(n)
            stack.extend(n.all_input_nodes)
    return out


@dataclass
class _Half:
    """One of the two graphs: its module, which original placeholders it reads (by position), how many
    boundary tensors it reads after them (W) or returns after its gradients (B), and its example inputs."""

    gm: fx.GraphModule
    reads: list[int]
    examples: list


def _half(
    gm: fx.GraphModule, keep: set[fx.Node], outs: list, boundary_in: list[fx.Node], boundary_out: list[fx.Node]
) -> _Half:
    """The graph of ``gm``'s nodes in ``keep`` (in order) returning ``outs`` (then ``boundary_out``), reading
    ``gm``'s placeholders it uses, then ``boundary_in`` as placeholders."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    reads = []
    for i, p in enumerate(placeholders):
        if p in keep:
            env[p] = g.node_copy(p)
            reads.append(i)
    for b in boundary_in:
        ph = g.placeholder(f"b_{b.name}")
        ph.meta = dict(b.meta)
        env[b] = ph
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output") or n not in keep or n in env:
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    results = [env[o] if isinstance(o, fx.Node) else o for o in outs] + [env[b] for b in boundary_out]
    out = g.output(tuple(results))
    out.meta["user_visible_output_idxs"] = [i for i, o in enumerate(outs) if isinstance(o, fx.Node)]
    g.lint()
    examples = [env[placeholders[i]].meta.get("val") for i in reads] + [b.meta.get("val") for b in boundary_in]
    return _Half(fx.GraphModule(gm, g), reads, examples)


class SplitBackward:
    """A region's backward compiled as B and W (the module docstring); called boxed (a list of the backward
    graph's inputs) by AOTAutograd like the Inductor graph it replaces."""

    def __init__(self, gm: fx.GraphModule, weights: list[int], compile_fn: Callable, static: set[int], log: SplitLog):
        self._boxed_call = True  # an instance attribute: dynamo's disable wrapper copies the instance's __dict__
        out = next(n for n in gm.graph.nodes if n.op == "output")
        outs = list(out.args[0])
        self.n = len(outs)
        self.w_pos = [i for i in weights if isinstance(outs[i], fx.Node)]
        self.b_pos = [i for i in range(self.n) if i not in self.w_pos and isinstance(outs[i], fx.Node)]
        self.constants = {i: o for i, o in enumerate(outs) if not isinstance(o, fx.Node)}  # None gradients
        need_b = _ancestors(outs[i] for i in self.b_pos)
        need_w = _ancestors(outs[i] for i in self.w_pos)
        # B's nodes W reads (or returns): handed from B to W; placeholders W reads itself
        boundary = [
            n
            for n in gm.graph.nodes
            if n in need_b
            and n.op != "placeholder"
            and (any(u in need_w and u not in need_b for u in n.users) or any(outs[i] is n for i in self.w_pos))
        ]
        self.b = _half(gm, need_b, [outs[i] for i in self.b_pos], [], boundary)
        w_keep = (need_w - need_b) | {n for n in need_w if n.op == "placeholder"}
        self.w = _half(gm, w_keep, [outs[i] for i in self.w_pos], boundary, [])
        self.b_fn = self._compile(self.b, compile_fn, static)
        self.w_fn = self._compile(self.w, compile_fn, static)
        self.log = log
        compiled = sum(_computes(h.gm) for h in (self.b, self.w))  # an empty half (no input gradient) is not
        log.graphs.append({"B": len(self.b_pos), "W": len(self.w_pos), "boundary": len(boundary), "compiled": compiled})

    @staticmethod
    def _compile(half: _Half, compile_fn: Callable, static: set[int]) -> Callable:
        if not _computes(half.gm):  # returns its inputs (B of a stage without input gradients): nothing to compile
            gm = half.gm

            def run(args):
                out = gm(*args)
                args.clear()
                return list(out)

            return run
        idxs = [j for j, i in enumerate(half.reads) if i in static]
        return compile_fn(half.gm, half.examples, static_input_idxs=idxs)

    def _w(self, args: list, boundary: list) -> list:
        """W: the weight gradients, at their positions among the region's inputs (``None`` elsewhere)."""
        full: list = [None] * self.n
        for i, g in zip(self.w_pos, self.w_fn(args + boundary)):
            full[i] = g
        return full

    def _deferred_w(self, args: list, boundary: list) -> list:
        self.log.calls["W"] += 1
        return self._w(args, boundary)

    def __call__(self, args: list) -> list:
        b_args = [args[i] for i in self.b.reads]
        w_args = [args[i] for i in self.w.reads]
        args.clear()  # AOTAutograd's boxed convention: the callee frees its inputs
        got = list(self.b_fn(b_args))
        nb = len(self.b_pos)
        out: list = [None] * self.n
        for i, g in zip(self.b_pos, got[:nb]):
            out[i] = g
        for i, c in self.constants.items():
            out[i] = c
        boundary = got[nb:]
        if self.w_pos and wants_region_weights():  # a zero-bubble B: W is handed over for the schedule's W
            self.log.calls["split"] += 1
            hand_over_region_weights(lambda: self._deferred_w(w_args, boundary))
            return out
        self.log.calls["whole"] += 1
        for i, g in enumerate(self._w(w_args, boundary) if self.w_pos else ()):
            if g is not None:
                out[i] = g
        return out


def _computes(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" for n in gm.graph.nodes)


def split_inner_compile(weight_inputs: set[int], log: SplitLog, inner: Callable) -> Callable:
    """An ``inner_compile`` for ``compile_fx``: the forward graph as ``inner`` compiles it; the backward graph
    as a ``SplitBackward`` when it has weight gradients (``weight_inputs``: the weight-side inputs of the dynamo
    graph), else as ``inner`` compiles it."""

    def compile_(gm: fx.GraphModule, example_inputs, **kwargs):
        weights = weight_outputs(gm, weight_inputs) if kwargs.get("is_backward") else []
        if not weights:
            return inner(gm, example_inputs, **kwargs)
        static = set(kwargs.pop("static_input_idxs", ()) or ())

        def compile_fn(half: fx.GraphModule, examples: list, static_input_idxs: list[int]):
            return inner(half, examples, static_input_idxs=static_input_idxs, **kwargs)

        return SplitBackward(gm, weights, compile_fn, static, log)

    return compile_


__all__ = ["SplitBackward", "SplitLog", "split_inner_compile", "weight_outputs", "weight_side"]
