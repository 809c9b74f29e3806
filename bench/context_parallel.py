"""Context parallelism on gloo ranks (BENCHMARKS.md, "Context parallelism"): activation bytes per rank for
cp = 1, 2, 4, predicted and measured, and autopar's cp=2 step beside a hand-written all-gather-KV peer.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.context_parallel memory [--seq 2048] [--hidden 64] [--layers 2]
        [--form auto|ring|all-gather|ulysses]
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.context_parallel time [--seq 4096] [--steps 6] [--repeats 3]
        [--forms auto ring all-gather ulysses]

The model: a LLaMA (``--layers``, ``--hidden``, 4 heads, 2 key/value heads, vocabulary 256) at transformers'
default attention (SDPA with an explicit causal mask), float32, one sequence of ``--seq`` tokens, compiled by
``autopar.compile`` on ``cp=n`` (roles by name: the sequence split over cp), priced on ``local-cpu``.

``memory``: on rank 0 of each mesh, what autograd saved for backward during one forward and backward (each
storage once, by saved-tensor hooks, the weights and the batch left out: ``runtime/measure/memory.py``, as the
memory benchmark counts them) beside the cost model's prediction of the same category
(``predicted_categories``) and the whole-plan search's price of the same mesh (``autopar/search``: the
model's profile, ``Analytic.evaluate`` of pp1 dp1 cpN tp1 in fp32, ``act_kept``); each cp degree in fresh
processes. The attention form each plan chose is printed (the search prices the all-gather form).

``time``: torch's own ``torch.distributed.tensor.experimental.context_parallel`` does not run on the CPU: on
torch 2.13 its SDPA dispatch raises ``NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered.`` So the
peer is written by hand on the same 2 gloo ranks: the same transformers model, each rank given its half of
the tokens and their global ``position_ids``, its attention (a registered transformers attention function)
all-gathering the keys and values with ``torch.distributed.nn.functional.all_gather`` (autograd: the backward
reduce-scatters) and slicing the causal mask to its query rows, the loss a sum over its tokens divided by the
global count, gradients all-reduced over the ranks. Both are timed alternately (A B A B) in one invocation;
the ratio is autopar over the peer of the slowest rank's median step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench._launch import free_port, init_worker

VOCAB = 256


def small_llama(a, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=a.seq,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, VOCAB, (1, a.seq), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def compiled(a, world: int, form: str = "auto"):
    import autopar
    from autopar.models.small_families import LogitsCE

    model, batch = small_llama(a)
    mesh = autopar.init_mesh("cpu", cp=world)
    module = autopar.compile(
        LogitsCE(model), mesh, kwargs=batch, objective="time", cluster="local-cpu", context_attention=form
    )
    return module, batch


def memory_worker(rank: int, world: int, port: int, a, out: str) -> None:
    init_worker(rank, world, port, a.timeout)
    from autopar.runtime.measure.memory import SavedTensors, predicted_categories

    module, batch = compiled(a, world, a.form)
    module(**batch).backward()  # warm-up
    with SavedTensors(list(module.parameters()) + list(batch.values())) as saved:
        module(**batch).backward()
    if rank == 0:
        pred = predicted_categories(module)["activations"]
        torch.save({"measured": saved.bytes, "predicted": float(pred), "forms": _forms(module.program)}, out)


def _forms(prog) -> str:
    """The context-parallel form of each SDPA call of ``prog`` on its cp axis ("-" without one)."""
    from autopar.solver.sharding.rules.context import attention_form

    if "cp" not in prog.mesh.names:
        return "-"
    axis, types = prog.mesh.names.index("cp"), prog.types()
    forms = {
        attention_form(
            [types[r.name] for r in op.input_refs()], [types[r.name].placements for r in op.input_refs()], axis
        )  # fmt: skip
        for op in prog.ops
        if op.target == "aten.scaled_dot_product_attention"
    }
    return ", ".join(sorted(str(f) for f in forms if f)) or "-"


def search_priced(a, cp: int) -> float:
    """The whole-plan search's activation bytes per rank for the model on pp1 dp1 cp``cp`` tp1 in fp32."""
    from autopar.ir.core import MeshSpec
    from autopar.models.small_families import LogitsCE
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.search.price import Analytic
    from autopar.search.profile import profile_program
    from autopar.search.space import Candidate
    from autopar.solver.cluster.spec import ClusterSpec

    model, batch = small_llama(a)
    prog = lower(capture(LogitsCE(model), (), batch), MeshSpec())
    prof = profile_program(prog, batch=1, seq=a.seq)
    an = Analytic(prof, ClusterSpec.load("local-cpu"), 1, precision="fp32")
    return an.evaluate(Candidate(1, 1, 1, 1, 1, "none", cp=cp)).info["act_kept"][0]


def _cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The peer's attention: keys and values all-gathered over the ranks (autograd), the mask's query rows this
    rank's, SDPA on the local queries; transformers' ``[batch, seq, heads, dim]`` output."""
    from torch.distributed.nn.functional import all_gather

    key = torch.cat(all_gather(key.contiguous()), dim=2)
    value = torch.cat(all_gather(value.contiguous()), dim=2)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    r, q, k = dist.get_rank(), query.shape[2], key.shape[2]
    rows = torch.arange(r * q, (r + 1) * q).unsqueeze(1)
    mask = rows >= torch.arange(k).unsqueeze(0)  # causal on global positions
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def time_worker(rank: int, world: int, port: int, a, out: str) -> None:
    init_worker(rank, world, port, a.timeout)
    import transformers

    transformers.AttentionInterface.register("cp_allgather", _cp_attention)
    modules = {}
    for form in a.forms:
        modules[form], batch = compiled(a, world, form)
    optims = {form: torch.optim.AdamW(m.parameters(), lr=1e-3) for form, m in modules.items()}
    peer, _ = small_llama(a)
    peer.config._attn_implementation = "cp_allgather"
    opt_b = torch.optim.AdamW(peer.parameters(), lr=1e-3)
    local = a.seq // world
    ids = batch["input_ids"]
    mine = ids[:, rank * local : (rank + 1) * local]
    positions = torch.arange(rank * local, (rank + 1) * local).unsqueeze(0)
    target = batch["labels"][:, rank * local : (rank + 1) * local]  # LogitsCE's: the label of each token
    total = float(a.seq)  # the global count of the mean

    def step_autopar(form: str) -> float:
        loss = modules[form](**batch)
        loss.backward()
        optims[form].step()
        optims[form].zero_grad(set_to_none=True)
        return float(loss)

    def step_peer() -> float:
        logits = peer(input_ids=mine, position_ids=positions).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / total
        loss.backward()
        for p in peer.parameters():
            dist.all_reduce(p.grad)
        opt_b.step()
        opt_b.zero_grad(set_to_none=True)
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        return float(whole)

    steps = {f"autopar {form}": (lambda form=form: step_autopar(form)) for form in a.forms} | {"peer": step_peer}
    first = {s: f() for s, f in steps.items()}  # warm-up; the same model and data: the same first loss
    times: dict[str, list[float]] = {s: [] for s in steps}
    for i in range(a.steps):
        for s in list(steps) if i % 2 == 0 else list(steps)[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            steps[s]()
            times[s].append(time.perf_counter() - t0)
    med = {s: torch.tensor([statistics.median(v)]) for s, v in times.items()}
    for v in med.values():
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
    if rank == 0:
        torch.save({"first": first, "median": {s: float(v) for s, v in med.items()}}, out)


def run(worker, world: int, a) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "result.pt")
        mp.start_processes(worker, args=(world, free_port(), a, out), nprocs=world, start_method="spawn")
        return torch.load(out, weights_only=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", choices=["memory", "time"])
    p.add_argument("--seq", type=int, default=None, help="tokens (default 2048 for memory, 4096 for time)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps per system per round")
    p.add_argument("--repeats", type=int, default=3, help="rounds, each in fresh processes")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--form", default="auto", help="memory: the form of context parallelism (context_attention)")
    p.add_argument("--forms", nargs="+", default=["auto"], help="time: the forms to time beside the peer, alternating")
    a = p.parse_args()
    what = f"LLaMA {a.layers} layers, hidden {a.hidden}"
    if a.part == "memory":
        a.seq = a.seq or 2048
        base = None
        print("| cp | predicted activations / rank (MiB) | search priced (MiB) | measured (MiB) | measured / predicted "
              "| measured / search | measured / cp=1 | form |")  # fmt: skip
        for cp in (1, 2, 4):
            r = run(memory_worker, cp, a)
            priced = search_priced(a, cp)
            base = base or r["measured"]
            form = r["forms"]
            print(f"| {cp} | {r['predicted'] / 2**20:.2f} | {priced / 2**20:.2f} | {r['measured'] / 2**20:.2f} | "
                  f"{r['measured'] / r['predicted']:.3f} | {r['measured'] / priced:.3f} | {r['measured'] / base:.2f} "
                  f"| {form} |", flush=True)  # fmt: skip
        print(f"({what}, one sequence of {a.seq})")
        return
    a.seq = a.seq or 4096
    ratios: dict[str, list[float]] = {f: [] for f in a.forms}
    meds = []
    for i in range(a.repeats):
        r = run(time_worker, 2, a)
        m = r["median"]
        meds.append(m)
        for f in a.forms:
            ratios[f].append(m[f"autopar {f}"] / m["peer"])
        said = ", ".join(f"{s} {v:.3f} s/step (first loss {r['first'][s]:.6f})" for s, v in m.items())
        print(f"[round {i + 1}/{a.repeats}] {said}")
    peer = statistics.median(m["peer"] for m in meds)
    for f in a.forms:
        own = statistics.median(m[f"autopar {f}"] for m in meds)
        rs = ratios[f]
        print(f"| {what}, seq {a.seq} | cp=2, {f} | {own:.3f} | {peer:.3f} | "
              f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f}) |")  # fmt: skip


if __name__ == "__main__":
    main()
