"""Published tables priced by autopar with the papers' own configurations pinned (``autopar/search/pin.py``).

    OMP_NUM_THREADS=1 .venv/bin/python bench/published_tables.py [--only table1|trends] [--json out.json]

- **Megatron-LM Table 1** (megatron-ptdp-interleaved.md), all 10 rows, each with the configuration of
  Megatron's ``examples/sc21/run_table_1.sh``: TP, PP, MBS, GBS, virtual stages from
  ``--num-layers-per-virtual-pipeline-stage`` (v = layers / PP / that), ``--recompute-method uniform``
  (full recomputation), Megatron's DDP (no ZeRO), L / (p v) layers per stage. Predicted per-GPU TFLOP/s
  (Eq. 3 / step, as the paper counts) beside the reported; mean and max |error| printed.
- **Section 5's trends** (Figs. 12-17), each configuration pinned, the paper's statement beside what autopar
  predicts (the figures' values are not in the text: the trend is what is compared). Fig. 16's 91B model's
  shape is not in the text: 72 layers, hidden 10240, 80 heads assumed (12 l h^2 = 90.6B).

Priced on ``dgx-a100`` (Selene: 8 A100-80GB per node, 8 HDR rails) in bf16 with Adam, attention unfused and the
recomputation inside the backward (as Megatron-LM of 2021 ran them: ``Scorer(recompute_at="backward")``), by the
same model and simulator as ``autopar plan --global-batch B --mesh ... --attention unfused --recompute-at backward``
(a pinned configuration is priced fitting or not).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

from autopar.search import Scorer, profile_model, search
from autopar.search.pin import Pin
from autopar.solver.cluster.spec import ClusterSpec

GiB = 2**30


def gpt(layers: int, hidden: int, heads: int) -> str:
    return f"gpt2:n_layer={layers},n_embd={hidden},n_head={heads},n_positions=2048,vocab_size=51200,seq=2048,batch=1"


@dataclass(frozen=True)
class Row:
    name: str
    layers: int
    hidden: int
    heads: int
    t: int
    p: int
    nodes: int
    batch: int
    mbs: int
    layers_per_vp: int | None  # --num-layers-per-virtual-pipeline-stage
    tflops: float  # reported per GPU

    @property
    def chunks(self) -> int:
        return self.layers // self.p // self.layers_per_vp if self.layers_per_vp else 1

    @property
    def d(self) -> int:
        return self.nodes * 8 // (self.t * self.p)


# examples/sc21/run_table_1.sh (NVIDIA/Megatron-LM) and Table 1's reported TFLOP/s per GPU
TABLE1 = (
    Row("1.7B", 24, 2304, 24, 1, 1, 4, 512, 16, None, 137),
    Row("3.6B", 30, 3072, 32, 2, 1, 8, 512, 16, None, 138),
    Row("7.5B", 36, 4096, 32, 4, 1, 16, 512, 16, None, 142),
    Row("18.4B", 40, 6144, 48, 8, 1, 32, 1024, 8, None, 135),
    Row("39.1B", 48, 8192, 64, 8, 2, 64, 1536, 4, None, 138),
    Row("76.1B", 60, 10240, 80, 8, 4, 128, 1792, 2, 5, 140),
    Row("145.6B", 80, 12288, 96, 8, 8, 192, 2304, 2, 5, 148),
    Row("310.1B", 96, 16384, 128, 8, 16, 240, 2160, 1, 3, 155),
    Row("529.6B", 105, 20480, 128, 8, 35, 315, 2520, 1, 1, 163),
    Row("1008.0B", 128, 25600, 160, 8, 64, 384, 3072, 1, None, 163),
)


def price(spec: str, cluster: str, batch: int, pin: Pin, scorer: Scorer, attention: str = "unfused"):
    """The pinned configuration's best evaluation (the search over what the pin leaves free) and its result;
    attention unfused by default, as Megatron-LM of 2021 ran it (batched matmuls, fused softmax, dropout)."""
    cl = ClusterSpec.load(cluster)
    pin.check(cl.world_size, batch)
    res = search(profile_model(spec), cl, batch, math.inf, pin.space(), precision="bf16", scorer=scorer,
                 attention=attention)  # fmt: skip
    return res.best[0], res


def megatron_pin(mesh: dict, mbs: int, chunks: int, recompute: str = "full", schedule: str | None = None) -> Pin:
    sched = schedule or ("interleaved" if chunks > 1 else None)
    if mesh.get("pp", 1) > 1 and sched is None:
        sched = "1f1b"
    return Pin(mesh, mbs, recompute, sched, chunks if chunks > 1 else None, zero=0, layout="even")


def table1(scorer: Scorer) -> list[dict]:
    rows = []
    print("Megatron-LM Table 1, run_table_1.sh's configurations pinned (dgx-a100, bf16)", flush=True)
    print(f"{'model':>8} {'t':>2} {'p':>3} {'d':>3} {'b':>2} {'v':>2} {'GPUs':>5} {'B':>5}  "
          f"{'paper':>6} {'autopar':>8} {'error':>7}  {'mem GiB':>7}")  # fmt: skip
    for r in TABLE1:
        mesh = {k: v for k, v in (("pp", r.p), ("dp", r.d), ("tp", r.t)) if v > 1} or {"dp": 1}
        ev, res = price(gpt(r.layers, r.hidden, r.heads), f"dgx-a100:nodes={r.nodes}", r.batch,
                        megatron_pin(mesh, r.mbs, r.chunks), scorer)  # fmt: skip
        tf = res.tflops_eq3(ev)
        err = (tf - r.tflops) / r.tflops
        rows.append({"model": r.name, "t": r.t, "p": r.p, "d": r.d, "b": r.mbs, "v": r.chunks, "gpus": r.nodes * 8,
                     "batch": r.batch, "reported_tflops": r.tflops, "predicted_tflops": tf, "error": err,
                     "memory_gib": ev.memory / GiB, "configuration": ev.candidate.describe()})  # fmt: skip
        print(f"{r.name:>8} {r.t:>2} {r.p:>3} {r.d:>3} {r.mbs:>2} {r.chunks:>2} {r.nodes * 8:>5} {r.batch:>5}  "
              f"{r.tflops:>6.0f} {tf:>8.1f} {err:>+7.1%}  {ev.memory / GiB:>7.1f}", flush=True)  # fmt: skip
    errs = [abs(x["error"]) for x in rows]
    print(f"mean |error| {sum(errs) / len(errs):.1%}, max {max(errs):.1%} over {len(errs)} rows", flush=True)
    return rows


def _tf(spec, cluster, B, pin, scorer):
    ev, res = price(spec, cluster, B, pin, scorer)
    return res.tflops_eq3(ev), ev


def trends(scorer: Scorer) -> list[dict]:
    out = []

    def report(fig: str, paper: str, series: dict, holds: bool) -> None:
        print(f"\n{fig}: paper: {paper}\n  autopar: " + "; ".join(f"{k}: {v}" for k, v in series.items()))
        print(f"  trend reproduced: {'yes' if holds else 'NO'}", flush=True)
        out.append({"figure": fig, "paper": paper, "autopar": series, "reproduced": holds})

    # Fig. 12: GPT-3 175B on 96 GPUs, (t, p) = (8, 12), b = 1: interleaved (v = 2) above 1F1B, the gap closing
    spec = gpt(96, 12288, 96)
    series, ok, gaps = {}, True, []
    for B in (12, 24, 36, 48, 60):
        one, _ = _tf(spec, "dgx-a100:nodes=12", B, megatron_pin({"pp": 12, "tp": 8}, 1, 1), scorer)
        inter, _ = _tf(spec, "dgx-a100:nodes=12", B, megatron_pin({"pp": 12, "tp": 8}, 1, 2), scorer)
        series[f"B={B}"] = f"1f1b {one:.0f}, interleaved {inter:.0f} TFLOP/s"
        ok &= inter > one
        gaps.append(inter / one)
    report("Fig. 12", "interleaved above non-interleaved at every batch, the gap closing with the batch", series,
           ok and gaps[-1] < gaps[0])  # fmt: skip

    # Fig. 13: 162.2B (32 layers, hidden 20480, 128 heads) on 64 GPUs, t x p = 64: (8, 8) the best
    spec = gpt(32, 20480, 128)
    for B in (32, 128, 512):
        series, best = {}, None
        for t, p in ((2, 32), (4, 16), (8, 8), (16, 4), (32, 2)):
            tf, _ = _tf(spec, "dgx-a100:nodes=8", B, megatron_pin({"pp": p, "tp": t}, 1, 1), scorer)
            series[f"(t,p)=({t},{p})"] = f"{tf:.0f}"
            best = max(best or (tf, (t, p)), (tf, (t, p)))
        report(f"Fig. 13 B={B}", "(t, p) = (8, 8) the best", series, best[1] == (8, 8))

    # Figs. 14 and 15: 5.9B (32 layers, hidden 3840, 32 heads) on 64 GPUs, b = 1: throughput falls with p, with t
    spec = gpt(32, 3840, 32)
    for fig, axis in (("Fig. 14", "pp"), ("Fig. 15", "tp")):
        for B in (32, 128, 512):
            series, vals = {}, []
            for k in (2, 4, 8, 16, 32):
                mesh = {axis: k, "dp": 64 // k}
                tf, _ = _tf(spec, "dgx-a100:nodes=8", B, megatron_pin(mesh, 1, 1), scorer)
                series[f"{axis}={k}"] = f"{tf:.0f}"
                vals.append(tf)
            falls = all(a >= b for a, b in zip(vals, vals[1:]))
            report(f"{fig} B={B}", f"throughput falls as {axis} grows (dp = 64 / {axis})", series, falls)

    # Fig. 16: 91B on 64 GPUs, (t, p) = (8, 8): micro-batch size 2 the best, for B = 128 and 512
    spec = gpt(72, 10240, 80)
    for B in (128, 512):
        series, best = {}, None
        for b in (1, 2, 4, 8):
            tf, _ = _tf(spec, "dgx-a100:nodes=8", B, megatron_pin({"pp": 8, "tp": 8}, b, 1), scorer)
            series[f"b={b}"] = f"{tf:.0f}"
            best = max(best or (tf, b), (tf, b))
        report(f"Fig. 16 B={B}", "micro-batch size 2 the best", series, best[1] == 2)

    # Fig. 17: 145B (80 layers, hidden 12288, 96 heads) on 128 GPUs, (t, p) = (8, 16): without recomputation only
    # small batches fit; the best with recomputation up to 2x the best without
    spec = gpt(80, 12288, 96)
    budget = ClusterSpec.load("dgx-a100").plan_memory
    series, best_none, best_full, fits = {}, 0.0, 0.0, []
    for B in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        row = []
        for rc in ("none", "full"):
            pin = megatron_pin({"pp": 16, "tp": 8}, 1, 1, recompute=rc)
            tf, ev = _tf(spec, "dgx-a100:nodes=16", B, pin, scorer)
            seqs = B / ev.step_time
            fit = ev.memory <= budget
            row.append(f"{rc} {seqs:.2f} seq/s{'' if fit else ' (OOM ' + format(ev.memory / GiB, '.0f') + ' GiB)'}")
            if fit:
                if rc == "none":
                    best_none = max(best_none, seqs)
                    fits.append(B)
                else:
                    best_full = max(best_full, seqs)
        series[f"B={B}"] = ", ".join(row)
    holds = bool(fits) and max(fits) < 256 and best_full > best_none
    series["largest B without recomputation that fits"] = max(fits) if fits else None
    # stage 0 stashes min(B, p) microbatches: "only small batches fit" puts the boundary at B <= 8 (B = 16 holds as
    # many as 256); the paper's "up to 2x" is then the best with recomputation over the best without at B <= 8
    small = [float(v.split(", ")[0].split()[1]) for k, v in series.items() if k.startswith("B=") and int(k[2:]) <= 8]
    series["best with recomputation / best without at B <= 8"] = f"{best_full / max(small):.2f}x (paper: up to 2x)"
    report("Fig. 17", "without recomputation only small batches fit; with it up to 2x the best without", series,
           holds)  # fmt: skip
    return out


# Merak Table 3 (merak-automated-3d-parallelism.md, Sec. 5.2): GPT-2.5B (hidden 1920; 54 layers and 20 heads
# assumed, the merak-gpt-2.5b preset), seq 1024, 8 RTX 3090 (one merak-3090 node pair: 2 nodes x 4), GBS 128,
# TMP 1, its "Default" column (full recomputation; its shifted-critical-path schedule priced as 1F1B, an upper
# bound on its bubble): (pp, micro-batch) -> (memory MB, samples/s), None where Merak ran out of memory
MERAK_TABLE3 = {
    (4, 1): (16720, 6.81),
    (4, 2): (21262, 6.84),
    (4, 4): (None, None),
    (8, 1): (9066, 6.39),
    (8, 2): (13130, 6.64),
    (8, 4): (21438, 6.21),
}


def merak(scorer: Scorer) -> list[dict]:
    rows = []
    print("\nMerak Table 3, Default column: GPT-2.5B, 8 RTX 3090, GBS 128, tp 1, full recomputation (fp16)", flush=True)
    print(f"{'pp':>3} {'dp':>3} {'b':>2}  {'paper MB':>9} {'autopar MB':>10}  {'paper s/s':>9} {'autopar':>8} "
          f"{'ratio':>6}")  # fmt: skip
    spec = "merak-gpt-2.5b:seq=1024,n_positions=1024"
    cl = ClusterSpec.load("merak-3090:nodes=2")
    for (pp, b), (mem, speed) in MERAK_TABLE3.items():
        pin = Pin({"pp": pp, "dp": 8 // pp}, b, "full", "1f1b", zero=0)
        pin.check(cl.world_size, 128)
        res = search(profile_model(spec), cl, 128, math.inf, pin.space(), precision="fp16", scorer=scorer,
                     attention="unfused")  # fmt: skip
        ev = res.best[0]
        sps = 128 / ev.step_time
        mb = ev.memory / 2**20
        fits = ev.memory <= cl.plan_memory
        rows.append({"pp": pp, "dp": 8 // pp, "b": b, "paper_memory_mb": mem, "paper_samples_per_s": speed,
                     "memory_mb": mb, "samples_per_s": sps, "fits": fits,
                     "configuration": ev.candidate.describe()})  # fmt: skip
        ratio = f"{sps / speed:>6.2f}" if speed else "     -"
        print(f"{pp:>3} {8 // pp:>3} {b:>2}  {mem if mem else 'OOM':>9} {mb:>10.0f}{'' if fits else '*'}  "
              f"{speed if speed else '-':>9} {sps:>8.2f} {ratio}", flush=True)  # fmt: skip
    print("(* over the plan budget: the search would call it out of memory)")
    return rows


def mics(scorer: Scorer) -> list[dict]:
    """MiCS Sec. 5.2.1 / Fig. 12: BERT 10B on 64 V100 (8 p3dn nodes), micro-batch 8, ZeRO-3 sharded in partition
    groups of 8 .. 64 (64: plain ZeRO-3); the paper: group 8 1.6x the throughput of group 64. Global batch 8192
    (the 2-hop experiment's, Sec. 5.2.3; Fig. 12's is not given), recomputation full (127 layers of b 8 s 512 do
    not fit otherwise), fp16."""
    print("\nMiCS Fig. 12: BERT 10B, 64 V100, micro-batch 8, ZeRO-3 in partition groups (fp16, full recomputation)")
    spec = ("bert-large:num_hidden_layers=127,hidden_size=2560,intermediate_size=10240,num_attention_heads=40,"
            "vocab_size=32008,seq=512")  # fmt: skip
    cl = ClusterSpec.load("mics-p3dn:nodes=8")
    rows, base = [], None
    for g in (64, 32, 16, 8):
        pin = Pin({"dp": 64}, 8, "full", zero=3, mics_group=None if g == 64 else g)
        pin.check(cl.world_size, 8192)
        res = search(profile_model(spec), cl, 8192, math.inf, pin.space(), precision="fp16", scorer=scorer,
                     attention="unfused")  # fmt: skip
        ev = res.best[0]
        sps = 8192 / ev.step_time
        base = base or sps
        rows.append({"group": g, "samples_per_s": sps, "vs_group_64": sps / base, "memory_gib": ev.memory / GiB,
                     "fits": ev.memory <= cl.plan_memory, "configuration": ev.candidate.describe()})  # fmt: skip
        print(f"  group {g:>2}: {sps:8.1f} samples/s ({sps / base:.2f}x group 64), {ev.memory / GiB:.1f} GiB "
              f"{'fits' if ev.memory <= cl.plan_memory else 'over the budget'}", flush=True)  # fmt: skip
    print("  paper: group 8 1.6x group 64")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["table1", "trends", "merak", "mics"])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    # Megatron-LM (and DeepSpeed, MiCS's base) recompute inside the backward, once the gradient has arrived
    # (torch.utils.checkpoint); Merak recomputes early, before the gradient arrives (its Fig. 3b), as autopar does
    megatron, early = Scorer(recompute_at="backward"), Scorer()
    data = {}
    if args.only in (None, "table1"):
        data["table1"] = table1(megatron)
    if args.only in (None, "trends"):
        data["trends"] = trends(megatron)
    if args.only in (None, "merak"):
        data["merak"] = merak(early)
    if args.only in (None, "mics"):
        data["mics"] = mics(megatron)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
