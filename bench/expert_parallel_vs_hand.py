"""autopar's expert-parallel plan beside a hand-written expert-parallel peer, on the same gloo ranks.

The model is Hugging Face's Mixtral built small from its config with the ``batched_mm`` experts kernel
(each (token, slot) row's expert matrices gathered and multiplied, ``aten.index.Tensor`` + ``bmm``). Both
systems train it with SGD on one global batch, on an ``ep`` axis of all ranks:

- **autopar**: ``autopar.compile(model, init_mesh(ep=n), objective="memory")``; the plan is checked to split
  every expert table over ``ep`` (each rank E/n experts) and to dispatch and combine by all-to-all.
- **hand**: what torchtitan does by hand. Every ``MixtralExperts`` is replaced by a module holding this rank's
  E/n experts; its tokens go to their experts' ranks by ``all_to_all_single`` (the counts exchanged first,
  the differentiable ``torch.distributed.nn.functional.all_to_all_single`` for the rows), are computed
  there with the same batched_mm math, and come back by the inverse all-to-all; everything else is
  data parallel under ``DistributedDataParallel`` (the expert tables left out of it, their gradients
  scaled by 1/n as DDP averages the others), each rank given its 1/n of the batch rows.

autopar runs twice: its own plan under the memory objective (the one whose ILP chooses expert parallelism
at this size), and the fastest plan (time objective) with the expert tables pinned split over ``ep``
(``ShardOptions.constrain``), the rest chosen by the ILP, as the peer's layout is by hand.

All are built in the same fresh processes and their timed steps alternate (A B B A ...), so they see the
same load (shared/BENCHMARKING.md). The first step's losses of the two are compared (they train the same
model on the same batch) so the peer is known to compute the same thing.

    python bench/expert_parallel_vs_hand.py --ranks 2 --steps 10
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._launch import free_port, init_worker  # noqa: E402


def build_mixtral(a: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=a.experts, num_experts_per_tok=2,
        max_position_embeddings=a.seq, router_aux_loss_coef=0.0, experts_implementation="batched_mm",
    )  # fmt: skip
    config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    return LogitsCE(MixtralForCausalLM(config)), {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}


class LogitsCE(torch.nn.Module):
    """The cross-entropy of the logits (Hugging Face's loss casts to float32 and shifts; this is plain)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class HandExperts(torch.nn.Module):
    """This rank's E/n experts of one ``MixtralExperts``, tokens dispatched to them by all-to-all."""

    def __init__(self, full: torch.nn.Module, rank: int, world: int):
        super().__init__()
        self.per = full.num_experts // world
        lo = rank * self.per
        self.gate_up_proj = torch.nn.Parameter(full.gate_up_proj.detach()[lo : lo + self.per].clone())
        self.down_proj = torch.nn.Parameter(full.down_proj.detach()[lo : lo + self.per].clone())
        self.act_fn, self.rank, self.world = full.act_fn, rank, world

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        k = top_k_index.shape[-1]
        rows = hidden.repeat_interleave(k, 0)
        idx = top_k_index.reshape(-1)
        dest = torch.div(idx, self.per, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)  # the counts first
        send_l, recv_l = send.tolist(), recv.tolist()
        x = all_to_all_single(rows.new_empty((sum(recv_l), rows.shape[1])), rows[order], recv_l, send_l)
        local = rows.new_empty(sum(recv_l), dtype=idx.dtype)
        dist.all_to_all_single(local, idx[order].contiguous(), recv_l, send_l)
        local = local - self.rank * self.per
        h = torch.bmm(self.gate_up_proj[local], x.unsqueeze(-1)).squeeze(-1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[local], (self.act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)
        back = all_to_all_single(y.new_empty((sum(send_l), y.shape[1])), y, send_l, recv_l)
        out = torch.empty_like(back).index_copy(0, order, back)  # each row at its place
        out = out * top_k_weights.reshape(-1, 1)
        return out.view(-1, k, out.shape[-1]).sum(1)


def hand_peer(model: torch.nn.Module, rank: int, world: int):
    """The model with hand-written expert parallelism and DDP over the rest; the expert parameters' names."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    peer = copy.deepcopy(model)
    experts = []
    for name, m in list(peer.named_modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, MixtralExperts):
                setattr(m, child_name, HandExperts(child, rank, world))
                prefix = f"{name}.{child_name}" if name else child_name
                experts += [f"{prefix}.gate_up_proj", f"{prefix}.down_proj"]
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(peer, experts)
    return torch.nn.parallel.DistributedDataParallel(peer), experts


def worker(rank: int, world: int, port: int, a: argparse.Namespace, out: str) -> None:
    import autopar
    from autopar.api import local_cluster_spec
    from autopar.ir.core import Shard
    from autopar.passes.experts import COMBINE, DISPATCH
    from autopar.passes.shard import ShardOptions
    from autopar.solver.sharding.baselines import Exactly

    init_worker(rank, world, port, a.timeout)
    model, batch = build_mixtral(a)
    mesh = autopar.init_mesh("cpu", ep=world)
    experts_names = [n for n, _ in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))]
    pinned = ShardOptions(  # the fastest plan with the expert tables split over ep (the hand peer's layout)
        objective="time", cluster=local_cluster_spec(), constrain={n: Exactly((Shard(0),)) for n in experts_names}
    )
    systems = {
        "autopar": autopar.compile(copy.deepcopy(model), mesh, kwargs=batch, objective="memory"),
        "pinned": autopar.compile(copy.deepcopy(model), mesh, kwargs=batch, options=pinned),
    }
    for compiled in systems.values():
        tables = [v for v in compiled.program.params if v.name.endswith(("gate_up_proj", "down_proj"))]
        local = dict(compiled.named_parameters())
        assert tables and all(local[t.name].shape[0] == a.experts // world for t in tables), "experts not on ep"
        assert any(op.target == DISPATCH for op in compiled.train_program.ops)
        assert any(op.target == COMBINE for op in compiled.train_program.ops)
    optimizers = {s: torch.optim.SGD(c.parameters(), lr=1e-3) for s, c in systems.items()}

    peer, experts = hand_peer(model, rank, world)
    rows = a.batch // world
    mine = {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}
    expert_params = [p for n, p in peer.module.named_parameters() if n in experts]
    opt_b = torch.optim.SGD(peer.parameters(), lr=1e-3)

    def step_autopar(system: str) -> float:
        optimizers[system].zero_grad(set_to_none=True)
        loss = systems[system].train_step(**batch)
        optimizers[system].step()
        return float(loss)

    def step_hand() -> float:
        opt_b.zero_grad(set_to_none=True)
        loss = peer(**mine)
        loss.backward()
        for p in expert_params:  # DDP averages the rest over the ranks; the experts' own tokens are all here
            p.grad.div_(world)
        opt_b.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return float(mean) / world

    steps = {"autopar": lambda: step_autopar("autopar"), "pinned": lambda: step_autopar("pinned"), "hand": step_hand}
    first = {s: steps[s]() for s in steps}  # warm-up, and the same model: the same first loss
    times: dict[str, list[float]] = {s: [] for s in steps}
    order = list(steps)
    for i in range(a.steps):
        for s in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            steps[s]()
            times[s].append(time.perf_counter() - t0)
    med = {s: torch.tensor([statistics.median(v)]) for s, v in times.items()}
    for v in med.values():
        dist.all_reduce(v, op=dist.ReduceOp.MAX)  # the slowest rank's median: the step's time
    if rank == 0:
        torch.save({"first": first, "median": {s: float(v) for s, v in med.items()}}, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps per system per round")
    p.add_argument("--repeats", type=int, default=3, help="rounds, each in fresh processes")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args()
    import tempfile

    ratios: dict[str, list[float]] = {"autopar": [], "pinned": []}
    meds = []
    for r in range(a.repeats):
        with tempfile.TemporaryDirectory() as d:
            out = str(Path(d) / "result.pt")
            mp.start_processes(worker, args=(a.ranks, free_port(), a, out), nprocs=a.ranks, start_method="spawn")
            res = torch.load(out, weights_only=True)
        m, first = res["median"], res["first"]
        meds.append(m)
        for s in ratios:
            ratios[s].append(m[s] / m["hand"])
        print(f"[round {r + 1}/{a.repeats}] " + ", ".join(f"{s} {m[s]:.4f} s/step" for s in m)
              + "; ratios " + ", ".join(f"{s}/hand {ratios[s][-1]:.2f}" for s in ratios)
              + "; first losses " + " / ".join(f"{first[s]:.6f}" for s in first), flush=True)  # fmt: skip
    what = f"Mixtral {a.layers} layers, hidden {a.hidden}, {a.experts} experts top-2, batch {a.batch} x {a.seq}"
    hand = statistics.median(m["hand"] for m in meds)
    for s, label in (("autopar", "memory objective"), ("pinned", "time objective, experts pinned on ep")):
        own = statistics.median(m[s] for m in meds)
        rs = ratios[s]
        print(f"| {what} ({label}) | ep={a.ranks} | {own:.4f} | {hand:.4f} | "
              f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f}) |")  # fmt: skip


if __name__ == "__main__":
    main()
