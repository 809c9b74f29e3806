"""Draw a simulated pipeline step as a Gantt chart, one row per rank, as in the papers' figures.

Forward, backward (input gradients, where a zero-bubble schedule splits it), weight-gradient and
recompute boxes carry their microbatch number; a rank's later model chunks
(interleaved, waves) are drawn in lighter shades of the same colour, like Megatron's Fig. 4.
Point-to-point transfers are thin bars under the receiving rank's boxes. Uses matplotlib's
object API (no pyplot), so it works headless and inside notebooks alike.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from autopar.schedule.actions import COMPUTE_KINDS, Kind
from autopar.schedule.timeline import SimResult

COLOURS = {Kind.F: "#4C72B0", Kind.B: "#DD8452", Kind.W: "#55A868", Kind.RECOMPUTE: "#8172B3"}
COMM_COLOUR = "#9E9E9E"
LABELS = {Kind.F: "forward", Kind.B: "backward", Kind.W: "weight gradients", Kind.RECOMPUTE: "recompute"}


def _shade(colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """Lighten ``colour`` for later chunks: chunk 0 full colour, the last about half-way to white."""
    t = 0.55 * chunk / max(chunks - 1, 1)
    return tuple(c + (1 - c) * t for c in to_rgb(colour))  # type: ignore[return-value]


def draw_gantt(result: SimResult, title: str | None = None, width: float = 12.0) -> Figure:
    """Figure with the timeline of every rank; rank 0 on top, time flowing right."""
    sched = result.schedule
    P = sched.num_ranks
    local = {s: sched.stages_of_rank(r).index(s) for r in range(P) for s in sched.stages_of_rank(r)}
    chunks = max(len(sched.stages_of_rank(r)) for r in range(P))
    fig = Figure(figsize=(width, 0.55 * P + 1.4))
    ax = fig.add_subplot()
    step = float(result.step_time) or 1.0
    boxes: dict[tuple[int, tuple[float, float, float]], list[tuple[float, float]]] = defaultdict(list)
    for events in result.timeline:
        for e in events:
            a, start, dur = e.action, float(e.start), float(e.end - e.start)
            if a.kind not in COMPUTE_KINDS or dur <= 0:
                continue
            y = P - 1 - e.rank
            boxes[(y, _shade(COLOURS[a.kind], local[a.stage], chunks))].append((start, dur))  # type: ignore[index]
            if dur / step > 0.008:
                ax.text(start + dur / 2, y - 0.05, str(a.mb), ha="center", va="center", fontsize=7, c="w")
    for (y, colour), spans in boxes.items():
        ax.broken_barh(spans, (y - 0.4, 0.7), facecolors=colour, edgecolors="white", linewidth=0.6)
    comm: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for t in result.transfers:
        if t.end > t.start:
            comm[P - 1 - t.dst_rank].append((float(t.start), float(t.end - t.start)))
    for y, spans in comm.items():
        ax.broken_barh(spans, (y - 0.48, 0.07), facecolors=COMM_COLOUR)
    ax.set_yticks(range(P), [f"rank {P - 1 - y}" for y in range(P)])
    ax.set_xlim(0, step)
    ax.set_ylim(-0.6, P - 0.4)
    ax.set_xlabel("time")
    opts = " ".join(f"{k}={v}" for k, v in sched.options)
    ax.set_title(
        title
        or f"{sched.name} {opts}  P={P} M={sched.num_microbatches}  step={float(result.step_time):g}  "
        f"bubble={float(result.bubble_ratio):.3f}"
    )
    kinds = [k for k in COLOURS if any(e.action.kind is k for ev in result.timeline for e in ev)]
    handles = [Patch(color=COLOURS[k], label=LABELS[k]) for k in kinds]
    if any(t.end > t.start for t in result.transfers):
        handles.append(Patch(color=COMM_COLOUR, label="p2p transfer"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=len(handles), frameon=False)
    fig.tight_layout()
    return fig


def save_gantt(result: SimResult, path: str | Path, title: str | None = None) -> Path:
    """Draw ``result`` and write it to ``path`` (PNG, or any format matplotlib infers)."""
    out = Path(path)
    draw_gantt(result, title).savefig(out, dpi=130)
    return out
