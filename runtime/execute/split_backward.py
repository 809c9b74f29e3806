"""Split a backward on autograd's graph: B now (input gradients), W later (weight gradients), nothing twice.

Zero-bubble schedules run a microbatch-stage's backward as two actions. ``B`` must produce the
gradients of the stage's inputs (the previous stage waits for them); ``W`` the gradients of its
weights, at any later time. Both run on the autograd graph the forward recorded, which is kept
between them; neither traverses the forward again, and no backward node computes the same output
twice:

- **B** (``input_gradients``) back-propagates from the stage's outputs to every leaf that is not a
  ``torch.nn.Parameter`` (the received inputs and the executor's own cut leaves), with
  ``retain_graph=True``. Autograd's engine then runs only the nodes on paths to those leaves, and of
  a node on such a path only the outputs those paths need: a matmul computes dX, not dW.
- Where a weight's branch leaves that input-gradient path, at node ``n`` (the matmul whose other
  input is the weight; a layer norm's backward for its weight and bias), a pre-hook captures the
  gradient ``n`` received during B. Weights hanging off the same nodes form one group.
- **W** (``WeightGrads.run``) restarts the engine at those nodes, once per group, with the captured
  gradients and ``inputs=`` the group's weights: ``n`` now computes only its weight-side outputs
  (dW), then the weight's own branch (a transpose, ZeRO-3's gather) runs, and the gradient
  accumulates into ``.grad`` as a whole backward would. An output of the stage that no input depends
  on (the first stage of a language model takes token ids) is a starting point of W with the
  gradient it was given; B has nothing to compute there.
- A weight reached from two such nodes, one of which lies on the other's input path (a parameter
  used twice), would have the engine run the path between them again; a pre-hook clamps the lower
  node's gradient to the captured one, so nothing is counted twice (only that path's work repeats).
- A compiled region (``torch_compile=True``, runtime/build/compiled.py) is one autograd node. Where its
  backward is compiled as two graphs (runtime/build/compiled_split.py), B asks it, by a pre-hook, for its
  input gradients alone (``wants_region_weights``): it runs its B graph and hands over a thunk running its
  W graph (``hand_over_region_weights``), which a post-hook keeps; W runs the thunk and starts below the node
  from the gradients it gives the weight-side inputs. A region compiled whole computes every input's
  gradient in B: the post-hook keeps what it gave its weight-side inputs, and W starts below it from those.
  Either way the region's backward runs once.

Memory kept from B to W: the graph below the highest capture point, i.e. what the forward saved for
backward (B cannot free it: W reads the same saved inputs), plus the captured gradients, about one
output gradient per weight op (docs/runtime.md). This is the approach of
``torch.distributed.pipelining._backward`` (stage_backward_input / stage_backward_weight), written
here for any set of (output, gradient) pairs so that recomputation's two parts and sub-pipelined
tensor parallelism's segments split the same way.

The executor does not call these directly: ``run_backward`` is its one way to back-propagate, and
inside ``deferring_weights()`` it runs B and appends the ``WeightGrads`` to the yielded list.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

# the stack of deferring_weights blocks, per thread: the rank simulator runs every rank in a thread of one
# process, and a rank's B must never file its W with another rank's step
_LOCAL = threading.local()
Starts = dict[Node, list[tuple[GradientEdge, torch.Tensor]]]  # an output node no input depends on -> (edge, grad)
_COMPILED_REGION = "CompiledFunctionBackward"  # AOTAutograd's node: one backward for every input of the region
_REGION = threading.local()  # a compiled region's backward being run by a B: asked (bool), the W it handed over


def wants_region_weights() -> bool:
    """Called by a compiled region's backward (runtime/build/compiled_split.py): whether a B runs it, so that it
    is to compute its input gradients only and hand over its weight gradients (``hand_over_region_weights``)."""
    return getattr(_REGION, "asked", False)


def hand_over_region_weights(thunk) -> None:
    """A compiled region's backward, asked by ``wants_region_weights``, hands over what computes its weight
    gradients (a list aligned with the region's inputs, ``None`` where B gave the gradient) for W."""
    _REGION.asked = False
    _REGION.thunk = thunk


def _ask_region(_grads) -> None:
    _REGION.asked, _REGION.thunk = True, None


def _taken_region_weights():
    thunk = getattr(_REGION, "thunk", None)
    _REGION.asked, _REGION.thunk = False, None
    return thunk


class _Group:
    """Weights whose gradients start at the same capture points."""

    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []
        self.captures: list[Node] = []  # nodes on the input path: their B-time gradients are captured
        self.roots: list[Node] = []  # output nodes no input depends on: their given gradients start W


class WeightGrads:
    """What a B kept for its W: per group, the starting gradient edges and the weights they reach."""

    def __init__(self, groups: list[_Group], captured: dict[Node, tuple], roots: Starts, below: Starts, later: dict):
        self._groups, self._captured, self._roots, self._below = groups, captured, roots, below
        self._later = later  # a compiled region -> (its W thunk, [(input position, edge to a weight-side input)])

    def run(self) -> None:
        """W: accumulate every weight's gradient into its ``.grad`` (call once)."""
        for g in self._groups:
            edges, grads = [], []
            for node in g.captures:
                for i, grad in enumerate(self._captured.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(grad)
            for node in g.roots:  # an output no input depends on: W starts there with its given gradient
                for edge, grad in self._roots.get(node, ()):
                    edges.append(edge)
                    grads.append(grad)
            for node in g.captures:  # a compiled region: W starts below it, from what it gave its weights in B
                for edge, grad in self._below.get(node, ()):
                    edges.append(edge)
                    grads.append(grad)
                if node in self._later:  # ... or from what its W graph computes now
                    thunk, weight_edges = self._later[node]
                    computed = thunk()
                    for i, edge in weight_edges:
                        if computed[i] is not None:
                            edges.append(edge)
                            grads.append(computed[i])
            if not edges:
                continue  # no gradient reached this group's weights: they get none, as in a whole backward
            clamps = []
            pre = [node for node in g.captures if node in self._captured]
            if len(pre) > 1:  # one capture point may lie on another's path: keep each at its B value
                for node in pre:
                    saved = self._captured[node]
                    clamps.append(node.register_prehook(lambda _grads, saved=saved: saved))
            try:
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=g.weights)
            finally:
                for handle in clamps:
                    handle.remove()
        self._groups, self._captured, self._roots, self._below, self._later = [], {}, {}, {}, {}  # graph freed


def input_gradients(pairs: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> WeightGrads:
    """B: back-propagate ``pairs`` of (output, its gradient; ``None``: none) into the ``.grad`` of every
    leaf that is not a parameter; returns what W needs for the parameters."""
    roots: dict[tuple[Node, int], tuple[GradientEdge, torch.Tensor]] = {}
    for t, g in pairs:
        if g is None or not isinstance(t, torch.Tensor) or not t.requires_grad:
            continue
        edge = get_gradient_edge(t)  # a leaf's edge owns its grad accumulator
        key = (edge.node, edge.output_nr)
        roots[key] = (edge, roots[key][1] + g) if key in roots else (edge, g)
    parents: dict[Node, list[Node]] = defaultdict(list)
    order: list[Node] = []
    seen: set[Node] = set()
    queue = deque(node for node, _ in roots)
    while queue:
        n = queue.popleft()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        for child, _ in n.next_functions:
            if child is not None:
                parents[child].append(n)
                queue.append(child)
    leaves = [n for n in order if hasattr(n, "variable")]  # AccumulateGrad: the graph's leaves
    inputs = [n for n in leaves if not isinstance(n.variable, torch.nn.Parameter)]
    on_path = _ancestors(inputs, parents)  # nodes whose gradient reaches an input
    groups = _groups([n for n in leaves if n not in on_path], parents, on_path, {node for node, _ in roots})
    captured: dict[Node, tuple] = {}
    below: Starts = {}  # a compiled region -> (edge to a weight-side input, the gradient the region gave it)

    later: dict = {}  # a compiled region -> (the W thunk it handed over, its weight-side edges by position)

    def keep_below(node: Node, grad_inputs) -> None:
        weight_side = [
            (i, GradientEdge(child, nr))
            for i, (child, nr) in enumerate(node.next_functions)
            if child is not None and child not in on_path
        ]
        below[node] = [(edge, grad_inputs[i]) for i, edge in weight_side if grad_inputs[i] is not None]
        thunk = _taken_region_weights()
        if thunk is not None:
            later[node] = (thunk, weight_side)

    hooks = []
    for g in groups:
        for node in g.captures:
            if type(node).__name__ == _COMPILED_REGION:
                hooks.append(node.register_prehook(_ask_region))
                hooks.append(node.register_hook(lambda grad_inputs, _grads, node=node: keep_below(node, grad_inputs)))
            else:
                hooks.append(node.register_prehook(lambda grads, node=node: captured.__setitem__(node, tuple(grads))))
    try:
        if inputs:
            starts = [(edge, g) for (node, _), (edge, g) in roots.items() if node in on_path]
            torch.autograd.backward(
                [edge for edge, _ in starts],
                [g for _, g in starts],
                retain_graph=True,
                inputs=[n.variable for n in inputs],
            )
    finally:
        for handle in hooks:
            handle.remove()
        _REGION.asked, _REGION.thunk = False, None  # a failed B leaves no request behind
    starts: Starts = defaultdict(list)
    for (node, _), pair in roots.items():
        if node not in on_path:
            starts[node].append(pair)
    return WeightGrads(groups, captured, starts, below, later)


def _ancestors(nodes: list[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``nodes`` and every node from which one of them is reached."""
    out = set(nodes)
    queue = deque(nodes)
    while queue:
        for p in parents[queue.popleft()]:
            if p not in out:
                out.add(p)
                queue.append(p)
    return out


def _groups(weights: list[Node], parents: dict[Node, list[Node]], on_path: set[Node], roots: set[Node]) -> list[_Group]:
    """Group the weights' leaves by where their branches meet the input path (or the outputs)."""
    owner: dict[Node, _Group] = {}  # capture point or root -> its group
    groups: list[_Group] = []
    for w in weights:
        captures, starts = [], []
        seen = {w}
        queue = deque([w])
        while queue:
            n = queue.popleft()
            if n in roots:
                starts.append(n)
            for p in parents[n]:
                if p in seen:
                    continue
                seen.add(p)
                if p in on_path:
                    captures.append(p)
                else:
                    queue.append(p)
        mine = _Group()
        for other in {id(owner[n]): owner[n] for n in captures + starts if n in owner}.values():
            mine.weights += other.weights
            mine.captures += [c for c in other.captures if c not in mine.captures]
            mine.roots += [r for r in other.roots if r not in mine.roots]
            groups.remove(other)
        mine.weights.append(w.variable)
        mine.captures += [c for c in captures if c not in mine.captures]
        mine.roots += [r for r in starts if r not in mine.roots]
        for n in mine.captures + mine.roots:
            owner[n] = mine
        groups.append(mine)
    return groups


def _deferred() -> list[list[WeightGrads]]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


@contextlib.contextmanager
def deferring_weights() -> Iterator[list[WeightGrads]]:
    """Inside the block ``run_backward`` runs B only; the yielded list collects each call's W."""
    pending: list[WeightGrads] = []
    stack = _deferred()
    stack.append(pending)
    try:
        yield pending
    finally:
        stack.pop()


def run_backward(tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """``torch.autograd.backward(tensors, grads)``, or inside ``deferring_weights`` its B (W deferred)."""
    stack = _deferred()
    if stack:
        stack[-1].append(input_gradients(list(zip(tensors, grads))))
    else:
        torch.autograd.backward(list(tensors), list(grads))


__all__ = [
    "WeightGrads",
    "deferring_weights",
    "hand_over_region_weights",
    "input_gradients",
    "run_backward",
    "wants_region_weights",
]
