"""Run one rank's pipeline action list with torch.distributed point-to-point, and record what ran.

The executor interprets the lists of ``autopar.schedule.generators`` (docs/schedules.md is the
contract) for any schedule: GPipe, 1F1B, interleaved, waves, shifted critical path.

- ``F(mb, s)`` runs stage ``s``'s GraphModule on what it received (or what the previous stage on
  this rank handed over) plus the microbatch's user inputs, and stashes what the backward needs.
  ``F`` with ``recompute=x`` runs the first ``x`` of the stage's subgraphs without autograd (stashing
  only the stage's inputs) and the rest with it; ``RECOMPUTE`` re-runs that prefix with autograd
  (restoring the RNG state of the forward) before ``B``, without waiting for the gradient.
- ``B(mb, s)`` back-propagates the received output gradient (the last stage: the loss times
  ``1/M``, so the step's gradient is that of the mean microbatch loss; or times each microbatch's
  ``loss_scales`` entry, e.g. its share of the batch's tokens), accumulates parameter
  gradients, and frees the microbatch's stash at once. When the list holds ``W(mb, s)`` too, ``B``
  computes only the input gradients and ``W`` later the weight gradients, from the graph ``B`` kept
  (``runtime/execute/split_backward.py``); the stash is freed at ``W``.
- Consecutive ``SEND_*``/``RECV_*`` between two compute actions are one
  ``torch.distributed.batch_isend_irecv`` (``runtime/execute/p2p.py``). Receives are posted where
  the list puts them, ahead of their consumers (Hanayo's prefetch), into buffers whose local shapes
  come from the IR (kept from step to step while nothing else holds them); the consumer waits for
  them. On gloo (``post_ahead``) each channel's next receive is posted earlier still, once the one
  before it is taken and its consumer has computed, because gloo moves a message only once its
  receive is posted. Sends stay in flight until the end of the step.
  Neighbouring stages on one rank (a wave's or a V's turn) hand tensors over locally.
- ``REDUCE_GRADS(s)`` and ``STEP`` call back into the pipeline module (data-parallel gradient
  reduction, tied-parameter reduction, the optimizer); the gradient buckets of a stage start during
  its last ``B``/``W`` and are waited at its ``REDUCE_GRADS`` (``runtime/grads/sync.py``).
- With ``sub_microbatches=n > 1`` (Merak's sub-pipelined tensor parallelism) every microbatch
  arrives as ``n`` sub-microbatches: ``F`` and ``B`` run them together, interleaved at the stage's
  tensor-parallel collectives (``runtime/execute/subpipeline.py``); boundary messages carry each
  sub-microbatch's tensors in turn, a microbatch's loss is the mean of its sub-microbatches' losses
  and each back-propagates ``1/(M n)``.

Every wait has a timeout; a failed or timed-out transfer raises ``RuntimeCommError`` naming the
action and the peer, so a rank whose peer died stops with a clear error instead of hanging.

Each step records the start and end of every action (``Executor.trace``); ``measured_result``
turns the traces of all ranks into the simulator's ``SimResult``, so the Gantt chart
(``autopar.schedule.chart``) and both bubble ratios of a measured step compare directly with a
simulated one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from autopar.errors import PipelineError, RuntimeCommError
from autopar.runtime.comm import watch
from autopar.runtime.comm.context import Comm, use_comm
from autopar.runtime.execute.p2p import PointToPoint
from autopar.runtime.execute.split_backward import WeightGrads, deferring_weights
from autopar.runtime.execute.stage_runner import Part, StageRunner
from autopar.runtime.execute.state import Stash, backprop, is_comm_failure, restored_rng, rng_state, to_wire
from autopar.runtime.execute.subpipeline import Interleaved, Tape
from autopar.runtime.measure.trace import TraceEvent, finish_receive
from autopar.schedule.actions import P2P_KINDS, Action, Kind, Schedule, ends_backward, split_backwards


class Executor:
    """Runs this rank's action list of ``schedule`` once per ``run`` call.

    ``stages``: this rank's stages. ``peer_rank(s)``: the global rank holding stage ``s`` in this
    rank's pipeline (same data/tensor-parallel coordinates). ``reduce_grads(s)`` and ``step()``
    implement ``REDUCE_GRADS`` and ``STEP``. ``sub_microbatches``: how many sub-microbatches each
    microbatch comes as (sub-pipelined tensor parallelism; 1: none). ``keep_outputs``: the last stage
    keeps every output of each microbatch (``outputs``) instead of taking the first as the loss (a
    forward-only run). ``stage_context(s)`` wraps each action computing on stage ``s`` (F, RECOMPUTE, B, W:
    ZeRO-3's scope of gathers, ``runtime/grads/zero3.py``). ``arm(a)`` runs before
    each ``B``/``W`` (the gradient buckets that action finishes start in it, ``runtime/grads/sync.py``).
    ``post_ahead``: keep each channel's next receive posted ahead of the list (default: where the
    transport issues each op on its own, ``Comm.peers.posts_independently()``: gloo, the rank simulator).
    """

    def __init__(
        self,
        schedule: Schedule,
        pp_rank: int,
        stages: dict[int, StageRunner],
        peer_rank: Callable[[int], int],
        comm: Comm,
        reduce_grads: Callable[[int], None],
        step: Callable[[], None],
        *,
        timeout: float = 600.0,
        record: bool = True,
        device: torch.device | str = "cpu",
        sub_microbatches: int = 1,
        keep_outputs: bool = False,
        stage_context: Callable[[int], contextlib.AbstractContextManager] | None = None,
        arm: Callable[[Action], None] | None = None,
        post_ahead: bool | None = None,
    ):
        self.schedule = schedule
        self.keep_outputs = keep_outputs
        self.stage_context = stage_context or (lambda _stage: contextlib.nullcontext())
        self.arm = arm or (lambda _action: None)
        self.outputs: list[list[tuple]] = []
        self.sub = sub_microbatches
        self._interleaved: dict[int, Interleaved] = {}
        self.pp_rank = pp_rank
        self.stages = stages
        self.peer_rank = peer_rank
        self.comm = comm
        self.reduce_grads = reduce_grads
        self.step_fn = step
        self.timeout = timeout
        self.record = record
        self.device = torch.device(device)
        self.actions = schedule.actions[pp_rank]
        self._split = split_backwards(self.actions)  # (mb, stage) whose B and W are apart
        ahead = comm.peers.posts_independently() if post_ahead is None else post_ahead
        self._out_of_step: str | None = None  # why no further step can run (a step raised mid-transfer)
        self.p2p = PointToPoint(
            stages,
            peer_rank,
            comm.peers.batch_isend_irecv,
            self._guard,
            timeout,
            self.device,
            sub_microbatches,
            self.actions,
            ahead,
        )
        self.trace: list[TraceEvent] = []
        self.trace_origin = 0.0  # time.perf_counter() when the recorded step began: traces of one host align by it
        self.peak_stash = 0
        s2r = schedule.stage_to_rank
        self._local = {s for s, r in enumerate(s2r) if r == pp_rank}
        if set(stages) != self._local:
            raise RuntimeCommError(
                f"pipeline rank {pp_rank} holds stages {sorted(self._local)} in the schedule but was given "
                f"{sorted(stages)}"
            )

    # -- one step --------------------------------------------------------------------------------
    def run(
        self,
        microbatches: Sequence[dict[str, torch.Tensor] | Sequence[dict[str, torch.Tensor]]],
        loss_scales: Sequence[Sequence[float]] | None = None,
    ) -> list:
        """Run the list once; returns the losses of the microbatches if this rank holds the last stage.
        Each microbatch is its user inputs by name, or with sub-microbatches a list of them.
        ``loss_scales``: per microbatch, the gradient each sub-microbatch's loss back-propagates
        (default ``1/(M n)``); a microbatch's loss is then its sub-microbatches' weighted mean."""
        m = self.schedule.num_microbatches
        if len(microbatches) != m:
            raise ValueError(f"the schedule is for {m} microbatches, got {len(microbatches)}")
        self._mbs = [list(mb) if isinstance(mb, (list, tuple)) else [mb] for mb in microbatches]
        if any(len(mb) != self.sub for mb in self._mbs):
            raise ValueError(f"each microbatch should come as {self.sub} sub-microbatches")
        self._scales = [list(s) for s in loss_scales] if loss_scales else [[1.0 / (m * self.sub)] * self.sub] * m
        self._acts: dict[tuple[int, int], list[torch.Tensor]] = {}  # (mb, stage) -> its inputs, handed over
        self._grads: dict[tuple[int, int], list[torch.Tensor]] = {}  # (mb, stage) -> its output grads
        self.p2p.reset()
        self._stash: dict[tuple[int, int], Stash] = {}
        self._weights: dict[tuple[int, int], list[WeightGrads]] = {}  # what each split B left for its W
        self._losses: list[torch.Tensor] = [torch.zeros(())] * m
        self.outputs = [[] for _ in range(m)]
        trace: list[TraceEvent] = []
        t0 = time.perf_counter()
        if self._out_of_step is not None:
            raise PipelineError(self._out_of_step)
        self.p2p.step = step = watch.step_begun()
        try:
            return self._run(trace, t0)
        except BaseException as e:  # every other rank told now, not at its transfer timeout (comm/watch.py)
            if self.p2p.in_flight() or isinstance(e, RuntimeCommError):
                self._out_of_step = (
                    f"a step of this pipeline raised on this rank ({type(e).__name__}) with transfers in flight, so "
                    "its sends and receives are out of step with the other ranks': no further step can run on this "
                    "module; restart the job (or compile the model again on every rank)"
                )
            watch.publish(e, step, self.p2p.timeout)
            raise

    def _run(self, trace: list[TraceEvent], t0: float) -> list[torch.Tensor]:
        self.p2p.start()
        live = peak = 0
        i, n = 0, len(self.actions)
        with use_comm(self.comm):
            while i < n:
                a = self.actions[i]
                if a.kind in P2P_KINDS:
                    j = i
                    while j < n and self.actions[j].kind in P2P_KINDS:
                        j += 1
                    start = time.perf_counter() - t0
                    self.p2p.post(self.actions[i:j])
                    end = time.perf_counter() - t0
                    for b in self.actions[i:j]:  # a receive posted ahead: from when it was
                        trace.append(TraceEvent(b, min(start, self.p2p.posted_at.get(b, t0 + start) - t0), end))
                    i = j
                    continue
                start = time.perf_counter() - t0
                self._ready = None
                waited = self._guard(lambda a=a: self._do(a), a, -1)  # e.g. a tp collective inside a stage
                end = time.perf_counter() - t0
                if self._ready is not None:  # the compute began once its inputs had arrived
                    start = max(start, self._ready - t0)
                for recv, done in waited:  # a receive ends when its consumer has its data
                    finish_receive(trace, recv, done - t0)
                trace.append(TraceEvent(a, start, end))
                if a.kind is Kind.F:
                    live += 1
                    peak = max(peak, live)
                live -= ends_backward(a, self._split)
                i += 1
                if i < n and self.actions[i].kind not in P2P_KINDS:  # no sends to carry the next receives
                    self.p2p.post_due()
            self.p2p.drain()
        self._stash = {}  # a forward-only run leaves its stashes
        self.trace, self.trace_origin = trace, t0  # origin: perf_counter at the step's start
        self.peak_stash = peak
        return self._losses if self._last_local() else []

    def _last_local(self) -> bool:
        return self.schedule.num_stages - 1 in self._local

    # -- compute ---------------------------------------------------------------------------------
    def _do(self, a: Action) -> list[tuple[Action, float]]:
        waited: list[tuple[Action, float]] = []
        if a.kind is Kind.F:
            with self.stage_context(a.stage):
                self._forward(a, waited)
        elif a.kind is Kind.RECOMPUTE:
            with self.stage_context(a.stage):
                self._recompute(a)
        elif a.kind is Kind.B:
            self.arm(a)
            with self.stage_context(a.stage):
                self._backward(a, waited)
        elif a.kind is Kind.W:
            self.arm(a)
            with self.stage_context(a.stage):
                for weights in self._weights.pop((a.mb, a.stage)):
                    weights.run()  # the graph its B kept, and the microbatch's activations, are freed here
        elif a.kind is Kind.REDUCE_GRADS:
            self.p2p.drain()
            self._guard(lambda: self.reduce_grads(a.stage), a, -1)
        elif a.kind is Kind.STEP:
            self.p2p.drain()
            self._guard(self.step_fn, a, -1)
        return waited

    def _inputs(self, a: Action, waited) -> list[torch.Tensor]:
        st = self.stages[a.stage]
        if not st.recv:
            return []
        key = (a.mb, a.stage)
        if key in self._acts:
            return [t.detach() for t in self._acts.pop(key)]
        return self.p2p.wait((Kind.RECV_ACT, a.mb, a.stage), waited)

    def _call(self, part: Part, envs: list[dict[str, torch.Tensor]], mb: int) -> tuple[list[tuple], Tape | None]:
        """Run ``part`` on each sub-microbatch of microbatch ``mb``: the plain module for one,
        interleaved at its collectives for more (then with the tape its backward needs). Keyed
        dropouts (runtime/build/rng.py) learn which microbatch runs, so a recomputation redraws its mask."""
        rng = getattr(part.module, "autopar_rng", None)
        if self.sub == 1:
            if rng is not None:
                rng.microbatch = mb
            return [part(envs[0], mb)], None
        inter = self._interleaved.get(id(part.module))
        if inter is None:
            inter = self._interleaved[id(part.module)] = Interleaved(part.module)
        return inter([[env[n] for n in part.inputs] for env in envs], first=mb * self.sub)

    def _backprop(self, outputs: list[tuple], grads: list[list], tape: Tape | None, loss: list[float] | None = None):
        """``backprop`` of every sub-microbatch (interleaved with a tape); ``loss``: each one's loss scale."""
        if tape is None:
            for h, (o, g) in enumerate(zip(outputs, grads)):
                backprop(o, g, loss[h] if loss is not None else None)
            return
        if loss is not None:
            tape.backward([[(o[0], torch.full_like(o[0], s))] for o, s in zip(outputs, loss)])
        else:
            tape.backward([list(zip(o, g)) for o, g in zip(outputs, grads)])

    def _forward(self, a: Action, waited) -> None:
        st = self.stages[a.stage]
        received = self._inputs(a, waited)  # each sub-microbatch's tensors in turn
        self._ready = time.perf_counter()
        k = len(st.recv)
        envs: list[dict[str, torch.Tensor]] = []
        for h, inputs in enumerate(self._mbs[a.mb]):
            leaves: dict[str, torch.Tensor] = {}
            for buf, t in zip(st.recv, received[h * k : (h + 1) * k]):
                leaves[buf.name] = t.requires_grad_(True) if buf.grad and t.is_floating_point() else t
            leaves.update(inputs)
            envs.append(leaves)
        if st.tail is not None:  # a batch tail (runtime/execute/batch_tail.py): the step's forwards all at once
            for mb, stash, outs in st.tail.forward(
                a.mb, envs, lambda e, m: self._call(st.whole, e, m)[0], self._scales
            ):
                self._stash[(mb, a.stage)] = stash
                self._keep_loss(mb, outs)
            return
        x = a.recompute
        stash = Stash(envs, recompute=x)
        if not x:
            outs, stash.tape = self._call(st.whole, envs, a.mb)
            stash.outputs = outs
        else:
            head, rest = st.variants[x]
            stash.rng = rng_state()
            with torch.no_grad():
                h_outs, _ = self._call(head, envs, a.mb)
            if rest is None:
                outs = h_outs
            else:
                stash.head_leaves = [
                    {
                        name: (t.detach().requires_grad_(g) if t.is_floating_point() else t.detach())
                        for name, t, g in zip(rest.inputs, ho, rest.grad)
                    }
                    for ho in h_outs
                ]
                outs, stash.tape = self._call(rest, [{**e, **hl} for e, hl in zip(envs, stash.head_leaves)], a.mb)
                stash.outputs = outs
        self._stash[(a.mb, a.stage)] = stash
        if st.is_last and self.keep_outputs:
            self.outputs[a.mb] = [tuple(o) for o in outs]
            return
        if st.is_last:
            self._keep_loss(a.mb, outs)
            return
        flat = [o for out in outs for o in out]
        nxt = a.stage + 1
        if nxt in self._local:
            self._acts[(a.mb, nxt)] = [o.detach() for o in flat]
        else:
            self.p2p.to_send[(Kind.SEND_ACT, a.mb, a.stage)] = [to_wire(o) for o in flat]

    def _keep_loss(self, mb: int, outs: list[tuple]) -> None:
        """Microbatch ``mb``'s loss: its sub-microbatches' first outputs, weighed by their loss scales."""
        losses = [o[0].detach() for o in outs]
        w = self._scales[mb]
        if len(losses) == 1 or not sum(w):
            self._losses[mb] = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        else:
            self._losses[mb] = sum(s * x for s, x in zip(w, losses)) / sum(w)

    def _recompute(self, a: Action) -> None:
        st = self.stages[a.stage]
        stash = self._stash[(a.mb, a.stage)]
        head, _rest = st.variants[stash.recompute]
        with restored_rng(stash.rng), torch.enable_grad():
            stash.head_outputs, stash.head_tape = self._call(head, stash.leaves, a.mb)

    def _backward(self, a: Action, waited) -> None:
        st = self.stages[a.stage]
        stash = self._stash.pop((a.mb, a.stage))
        n = len(stash.leaves)
        if st.is_last:
            grads: list[list[torch.Tensor | None]] = [[None] for _ in range(n)]
        else:
            key = (a.mb, a.stage)
            got = self._grads.pop(key) if key in self._grads else self.p2p.wait((Kind.RECV_GRAD, a.mb, a.stage), waited)
            it = iter(got)  # each sub-microbatch's gradients in turn
            grads = [[next(it) if b.grad else None for b in st.send] for _ in range(n)]
        self._ready = time.perf_counter()
        if stash.recompute and stash.head_outputs is None:
            raise RuntimeCommError(f"{Action(Kind.B, a.stage, a.mb)} ran before its RECOMPUTE")
        if (a.mb, a.stage) in self._split:  # input gradients now, the weights' at its W
            with deferring_weights() as self._weights[(a.mb, a.stage)]:
                self._propagate(st, stash, grads, a.mb)
        else:
            self._propagate(st, stash, grads, a.mb)
        if a.stage > 0:
            out = []
            for leaves in stash.leaves:
                for b in st.recv:
                    if b.grad:
                        leaf = leaves[b.name]
                        g = leaf.grad
                        out.append(g if g is not None else torch.zeros(b.shape, dtype=b.dtype, device=leaf.device))
            prev = a.stage - 1
            if prev in self._local:
                self._grads[(a.mb, prev)] = out
            else:
                self.p2p.to_send[(Kind.SEND_GRAD, a.mb, a.stage)] = [to_wire(g) for g in out]
        del stash  # the microbatch's activations are freed here

    def _propagate(self, st: StageRunner, stash: Stash, grads: list[list], mb: int) -> None:
        """Back-propagate a stage's output gradients ``grads`` (the last stage: the loss scale) through
        what its forward stashed: the recomputed prefix after the rest when it was checkpointed."""
        loss = self._scales[mb] if st.is_last else None
        if not stash.recompute:
            self._backprop(stash.outputs, grads, stash.tape, loss)
            return
        _head, rest = st.variants[stash.recompute]
        if rest is None:
            self._backprop(stash.head_outputs, grads, stash.head_tape, loss)  # type: ignore[arg-type]
            return
        self._backprop(stash.outputs, grads, stash.tape, loss)
        k = len(stash.head_outputs[0])  # type: ignore[index]
        names = list(zip(rest.inputs[:k], rest.grad[:k]))
        inner = [[hl[name].grad if g else None for name, g in names] for hl in stash.head_leaves]
        self._backprop(stash.head_outputs, inner, stash.head_tape)  # type: ignore[arg-type]

    # -- failures --------------------------------------------------------------------------------
    def _guard(self, fn, what, peer: int):
        try:
            return fn()
        except RuntimeCommError:
            raise
        except RuntimeError as e:  # gloo/NCCL report a dead peer or a timeout as RuntimeError
            if not is_comm_failure(e):
                raise
            me = dist.get_rank() if dist.is_initialized() else 0
            with_peer = f" with rank {peer}" if peer >= 0 else ""
            raise RuntimeCommError(
                f"rank {me} (pipeline rank {self.pp_rank}): {what}{with_peer} failed after at most "
                f"{self.timeout:g}s: {str(e).splitlines()[0] if str(e) else type(e).__name__}. A peer rank "
                "probably died or stopped; every rank stops here instead of waiting forever."
            ) from e


__all__ = ["Executor"]
