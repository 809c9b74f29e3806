"""Megatron-LM's Table 1 (megatron-ptdp-interleaved.md) priced by autopar: predicted vs reported TFLOP/s per GPU.

A benchmark of the cost model, used by ``bench/calibrate_megatron.py`` (it was ``solver/calibrate.py``;
it needs ``autopar.search``, which the solver layer must not import).

Each row of Table 1 up to 145.6B parameters is a GPT model (V = 51,200, s = 2048) trained with
tensor size t, pipeline size p, n A100-80GB GPUs (DGX A100 nodes of 8) and global batch B, with
activation recomputation, the interleaved schedule and the scatter/gather optimization. The paper
reports per-GPU throughput as Eq. 3 FLOPs (which counts the recomputation pass) over the measured
iteration time. ``predict`` prices the same configuration with autopar's cost model
(``autopar.search.price.Analytic`` + the pipeline simulator) on the ``dgx-a100`` preset and turns the
predicted step time into TFLOP/s the same way.

Table 1 does not list the micro-batch size b or the number of model chunks v. ``predict`` takes the
(b, v) that the cost model finds fastest for Megatron's (t, p, d) (b dividing B / d; v > 1 dividing
the layers per stage when p > 1, as Sec. 5.1 says the interleaved schedule was used; no pipeline
when p = 1) and reports which it took.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.search.evaluation import Evaluation
from autopar.search.price import Analytic
from autopar.search.score import Scorer
from autopar.search.space import Candidate, divisors
from autopar.solver.cluster.spec import ClusterSpec

A100_PEAK = 312e12  # the paper's 16-bit peak, the dgx-a100 preset's bf16 figure


@dataclass(frozen=True)
class MegatronRow:
    """One row of PTD-P Table 1."""

    billions: float
    heads: int
    hidden: int
    layers: int
    t: int
    p: int
    gpus: int
    batch: int
    tflops: float  # reported, per GPU
    percent: int  # reported, of peak

    @property
    def d(self) -> int:
        return self.gpus // (self.t * self.p)

    @property
    def spec(self) -> str:
        """The model as an autopar MODEL string (GPT-2 architecture, Megatron's vocabulary and sequence)."""
        return (
            f"gpt2:n_layer={self.layers},n_embd={self.hidden},n_head={self.heads},n_positions=2048,"
            "vocab_size=51200,seq=2048,batch=1"
        )

    @property
    def cluster(self) -> str:
        return f"dgx-a100:nodes={self.gpus // 8}"

    def eq3(self, seq: int = 2048, vocab: int = 51200) -> float:
        """Megatron's Eq. 3: FLOPs per iteration with activation recomputation."""
        B, s, l, h, V = self.batch, seq, self.layers, self.hidden, vocab
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


TABLE1: tuple[MegatronRow, ...] = (
    MegatronRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    MegatronRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    MegatronRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    MegatronRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    MegatronRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    MegatronRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    MegatronRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
)


def megatron_candidates(row: MegatronRow, analytic: Analytic) -> list[Candidate]:
    """Megatron's (t, p, d) with full recomputation, no ZeRO, L / (p v) layers per stage, every (b, v)."""
    per_replica = row.batch // row.d
    out = []
    for b in divisors(per_replica):
        m = per_replica // b
        if row.p == 1:
            out.append(Candidate(1, row.d, row.t, b, m, "none", recompute="full", zero=0, layout="even"))
            continue
        for v in divisors(row.layers // row.p):
            if v > 1:
                out.append(
                    Candidate(row.p, row.d, row.t, b, m, "interleaved", v, recompute="full", zero=0, layout="even")
                )
    return out


@dataclass
class Prediction:
    row: MegatronRow
    evaluation: Evaluation
    tflops: float  # predicted per GPU (Eq. 3 / step time)
    breakdown: dict[str, float]

    @property
    def error(self) -> float:
        """(predicted - reported) / reported."""
        return (self.tflops - self.row.tflops) / self.row.tflops


def predict(row: MegatronRow, profile, scorer=None, budget_bytes: float | None = None) -> Prediction:
    """Megatron's configuration of ``row`` priced by autopar's cost model (best b and v, see module doc)."""
    cluster = ClusterSpec.load(row.cluster)
    an = Analytic(profile, cluster, row.batch, precision="bf16", attention="unfused")  # Megatron of 2021
    scorer = scorer or Scorer()
    budget = budget_bytes if budget_bytes is not None else cluster.device_memory
    best: Evaluation | None = None
    for c in megatron_candidates(row, an):
        ev = an.evaluate(c)
        if ev is None or ev.memory > budget:
            continue
        if best is not None and ev.lower_bound > best.step_time:
            continue
        scorer.score(ev)
        if best is None or ev.sort_key < best.sort_key:
            best = ev
    if best is None:
        raise ValueError(f"no Megatron configuration of the {row.billions}B row fits {budget / 2**30:.0f} GiB")
    tflops = an.eq3_flops() / (best.step_time * cluster.world_size) / 1e12
    return Prediction(row, best, tflops, breakdown(best, an))


def breakdown(ev: Evaluation, an: Analytic) -> dict[str, float]:
    """Where a step's time goes on the busiest rank, in seconds: compute (forward, backward,
    recomputation), tensor-parallel all-reduces, pipeline bubble and transfers, data-parallel sync."""
    c = ev.candidate
    m = c.microbatches
    ranks = ev.stage_rank
    worst = max(
        range(c.pp), key=lambda r: sum(ev.tf[s] + ev.tb[s] + ev.tr[s] for s in range(len(ranks)) if ranks[s] == r)
    )
    mine = [s for s in range(len(ranks)) if ranks[s] == worst]
    compute = tp = 0.0
    for s in mine:
        a, e = ev.stages[s]
        fwd = an._sec("fwd", a, e, c.micro_batch, c.tp) + an._sec("bwd", a, e, c.micro_batch, c.tp)
        rfwd = an._sec("lfwd", a, e, c.micro_batch, c.tp)
        x = ev.recompute_fraction[s]
        compute += m * (fwd + x * rfwd)
        tp += m * (ev.tf[s] + ev.tb[s] + x * ev.tr[s]) - m * (fwd + x * rfwd)
    dp = ev.reduce[worst]
    rest = ev.step_time - compute - tp - dp
    return {"compute": compute, "tp_comm": tp, "bubble_and_p2p": rest, "dp_sync": dp, "step": ev.step_time}


def row_summary(p: Prediction) -> dict[str, Any]:
    c = p.evaluation.candidate
    return {
        "billions": p.row.billions,
        "t": p.row.t,
        "p": p.row.p,
        "d": p.row.d,
        "gpus": p.row.gpus,
        "batch": p.row.batch,
        "b": c.micro_batch,
        "v": c.chunks,
        "reported_tflops": p.row.tflops,
        "predicted_tflops": p.tflops,
        "error": p.error,
        "step_seconds": p.evaluation.step_time,
        "memory_gib": p.evaluation.memory / 2**30,
        "breakdown": p.breakdown,
    }


__all__ = ["A100_PEAK", "TABLE1", "MegatronRow", "Prediction", "megatron_candidates", "predict", "row_summary"]
