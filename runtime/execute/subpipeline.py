"""Sub-pipelined tensor parallelism (Merak 5.3): one stage run on sub-microbatches whose tensor-parallel
communication is in flight while another sub-microbatch computes.

``Interleaved(part)`` runs a stage's generated GraphModule on ``n`` sub-microbatches (Merak: two) as
``n`` interleaved node-by-node interpreters, one Python generator each, switched round robin:

- forward: at a collective that communicates in its forward (``all_reduce`` = Megatron's g,
  ``all_gather``, ``reduce_scatter``, ``all_to_all``) a sub-microbatch starts it asynchronously
  (``collectives.ASYNC``) and yields; the next one computes until its own collective; a
  sub-microbatch waits for its collective when it resumes, then lands it with the op's autograd
  backward.
- backward: a collective that communicates in its backward (``grad_all_reduce`` = Megatron's f,
  ``local_shard``, ``reduce_scatter``, ``all_to_all``) whose input needs a gradient is a *cut*: the
  forward makes its output a fresh leaf and detaches every other live non-leaf value there, so each
  sub-microbatch's autograd graph is a chain of segments. ``Tape.backward`` back-propagates one
  segment per sub-microbatch at a time (``torch.autograd.backward``), starts the cut's gradient
  collective asynchronously and yields; the other sub-microbatch back-propagates its segment while it
  is in flight. The gradient of each detached value goes back to its source with the next segment.

Why cuts rather than one ``torch.autograd.backward`` over both sub-microbatches: the CPU engine runs
ready nodes by decreasing sequence number, i.e. exactly in reverse creation order, so a backward
collective split into an issue node and a wait node created back to back (as the forward runs f)
waits at once; overlapping it would need the forward to switch at f as well, which halves the
forward's overlap (docs/runtime.md). Segments make both directions overlap as Merak's Fig. 4(b).

Every rank of a tensor-parallel group runs the same stage program on the same shapes, so the order
in which collectives are issued is the same on all of them (deterministic round robin), which is what
matching collectives needs. Collectives inside other functions (the vocabulary-parallel
cross-entropy's three all-reduces) stay synchronous: correct, not overlapped.

``record_events()`` records ``(phase, sub, kind, label)`` for every compute, issue and wait, in the
order they happen; the tests check that the other sub-microbatch computes between an issue and its
wait.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.runtime.comm import collectives as coll
from autopar.runtime.comm.context import Comm, current_comm
from autopar.runtime.execute.split_backward import run_backward

_EVENTS: list[tuple[str, int, str, str]] | None = None


@contextlib.contextmanager
def record_events() -> Iterator[list[tuple[str, int, str, str]]]:
    """Record ``(phase F/B, sub-microbatch, compute/issue/wait, label)`` while the block runs."""
    global _EVENTS
    saved, _EVENTS = _EVENTS, []
    try:
        yield _EVENTS
    finally:
        _EVENTS = saved


def _event(phase: str, sub: int, kind: str, label: str) -> None:
    if _EVENTS is not None:
        _EVENTS.append((phase, sub, kind, label))


# ---------------------------------------------------------------------------------------------
# The compiled node list


@dataclass(frozen=True)
class _Slot:
    """A reference to the value of node ``i`` in an argument template."""

    i: int


def _fill(x, env: list):
    if type(x) is _Slot:
        return env[x.i]
    if isinstance(x, (list, tuple)):
        return type(x)(_fill(v, env) for v in x)
    if isinstance(x, dict):
        return {k: _fill(v, env) for k, v in x.items()}
    return x


@dataclass
class _Step:
    """One node: what it calls, its argument templates, and what to free after it."""

    index: int
    name: str
    op: str  # get_attr | call_function
    target: object
    args: tuple
    kwargs: dict
    free: tuple[int, ...]  # nodes whose last use is this one
    form: coll.AsyncForm | None  # a collective (forward and/or backward communication)
    live: tuple[int, ...] = ()  # values defined before and used after this node (a cut detaches them)


@dataclass
class _Cut:
    """A cut of one sub-microbatch's graph at a collective with backward communication."""

    comm: Comm
    form: coll.AsyncForm
    kwargs: dict
    label: str
    source: torch.Tensor  # the collective's input
    leaf: torch.Tensor  # its output, as a leaf
    detached: list[tuple[torch.Tensor, torch.Tensor]]  # (live value, its leaf)


@dataclass
class Tape:
    """What the backward of one interleaved forward needs: each sub-microbatch's cuts, in order."""

    cuts: list[list[_Cut]] = field(default_factory=list)

    def backward(self, roots: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor | None]]]) -> None:
        """Back-propagate ``roots[h]`` (pairs of output and its gradient, ``None``: none) of every
        sub-microbatch, interleaved at the cuts."""
        _drive([self._backward(h, list(r)) for h, r in enumerate(roots)])
        self.cuts = []

    def _backward(self, h: int, pending: list[tuple[torch.Tensor, torch.Tensor | None]]):
        cuts = self.cuts[h]
        for k in range(len(cuts) - 1, -1, -1):
            cut = cuts[k]
            _autograd(pending, h, f"segment {k + 1}")
            g = cut.leaf.grad if cut.leaf.grad is not None else torch.zeros_like(cut.leaf)
            work = cut.form.backward(cut.comm, g, **cut.kwargs)
            _event("B", h, "issue", cut.label)
            yield
            gx = work.wait()
            _event("B", h, "wait", cut.label)
            pending = [(cut.source, gx)] + [(src, leaf.grad) for src, leaf in cut.detached]
            cuts[k] = None  # the leaves' gradients are freed with it
        _autograd(pending, h, "segment 0")


def _autograd(pairs: list[tuple[torch.Tensor, torch.Tensor | None]], h: int, label: str) -> None:
    """Back-propagate one segment of sub-microbatch ``h`` from (output, gradient) pairs (its B only
    inside ``split_backward.deferring_weights``: each segment's W is deferred on its own)."""
    ts, gs = [], []
    for t, g in pairs:
        if g is None or not isinstance(t, torch.Tensor) or not t.requires_grad:
            continue
        ts.append(t)
        gs.append(g)
    if ts:
        _event("B", h, "compute", label)
        run_backward(ts, gs)


def _drive(gens: list) -> list:
    """Run generators round robin until each returns; their return values in order."""
    results: list = [None] * len(gens)
    alive = list(range(len(gens)))
    while alive:
        for h in list(alive):
            try:
                next(gens[h])
            except StopIteration as stop:
                results[h] = stop.value
                alive.remove(h)
    return results


class Interleaved:
    """A GraphModule made runnable on several sub-microbatches at once, interleaved at its collectives."""

    def __init__(self, module: fx.GraphModule):
        self.module = module
        nodes = list(module.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        last = {i: i for i in range(len(nodes))}
        for n in nodes:
            for a in n.all_input_nodes:
                last[index[a]] = max(last[index[a]], index[n])
        frees: dict[int, list[int]] = {}
        for i, j in last.items():
            frees.setdefault(j, []).append(i)
        self.placeholders: list[int] = []
        self.steps: list[_Step] = []
        self.output: object = None
        self.size = len(nodes)

        def slot(n: fx.Node) -> _Slot:
            return _Slot(index[n])

        for i, n in enumerate(nodes):
            if n.op == "placeholder":
                self.placeholders.append(i)
            elif n.op == "output":
                self.output = fx.node.map_arg(n.args[0], slot)
            elif n.op in ("get_attr", "call_function"):
                form = coll.ASYNC.get(n.target) if n.op == "call_function" else None
                live = tuple(j for j in range(i) if last[j] > i) if form and form.backward else ()
                self.steps.append(
                    _Step(
                        i,
                        n.name,
                        n.op,
                        n.target,
                        fx.node.map_arg(n.args, slot),
                        fx.node.map_arg(n.kwargs, slot),
                        tuple(frees.get(i, [])),
                        form,
                        live,
                    )
                )
            else:
                raise NotImplementedError(f"sub-pipelined execution of a {n.op} node ({n.name})")

    def __call__(self, envs: Sequence[Sequence[torch.Tensor]], first: int = 0) -> tuple[list[tuple], Tape | None]:
        """Run on each sub-microbatch's placeholder values; their outputs, and the tape for the
        backward (``None`` without autograd). ``first``: the index of the first sub-microbatch in the
        step's batch (sub-microbatch h is ``first + h``), for keyed dropouts (runtime/build/rng.py)."""
        grad = torch.is_grad_enabled()
        tape = Tape([[] for _ in envs]) if grad else None
        gens = [self._forward(h, list(xs), tape, first + h) for h, xs in enumerate(envs)]
        return _drive(gens), tape

    def _forward(self, h: int, inputs: list[torch.Tensor], tape: Tape | None, index: int = 0):
        rng = getattr(self.module, "autopar_rng", None)
        env: list = [None] * self.size
        for i, x in zip(self.placeholders, inputs):
            env[i] = x
        for st in self.steps:
            if st.op == "get_attr":
                env[st.index] = functools.reduce(getattr, st.target.split("."), self.module)
                continue
            args, kwargs = _fill(st.args, env), _fill(st.kwargs, env)
            form = st.form
            if form is None:
                _event("F", h, "compute", st.name)
                if rng is not None:  # the sub-microbatches interleave: set before each op
                    rng.microbatch = index
                env[st.index] = st.target(*args, **kwargs)
            else:
                x = args[0]
                cut = tape is not None and form.backward is not None and x.requires_grad
                if form.forward is not None:
                    c = current_comm()
                    kwargs.pop("defer", None)  # a half waits for its own collective when it resumes
                    work = form.forward(c, *args, **kwargs)
                    _event("F", h, "issue", st.name)
                    yield
                    if cut:
                        out = work.wait()
                    else:
                        out = st.target(*args, **kwargs, pending=work)
                    _event("F", h, "wait", st.name)
                elif cut:
                    with torch.no_grad():
                        out = st.target(*args, **kwargs)
                else:
                    out = st.target(*args, **kwargs)
                if cut:
                    out = out.detach().requires_grad_(True)
                    detached: list[tuple[torch.Tensor, torch.Tensor]] = []
                    cut_off = functools.partial(_detach, detached=detached)
                    for j in st.live:
                        env[j] = pytree.tree_map(cut_off, env[j])
                    tape.cuts[h].append(_Cut(current_comm(), form, kwargs, st.name, x, out, detached))
                env[st.index] = out
            for k in st.free:
                env[k] = None
        return tuple(_fill(self.output, env))


def _detach(t, detached: list[tuple[torch.Tensor, torch.Tensor]]):
    """A live non-leaf tensor that needs a gradient becomes a leaf (its source is kept for the backward)."""
    if not isinstance(t, torch.Tensor) or not t.requires_grad or t.grad_fn is None:
        return t
    leaf = t.detach().requires_grad_(True)
    detached.append((t, leaf))
    return leaf


__all__ = ["Interleaved", "Tape", "record_events"]
