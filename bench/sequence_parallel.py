"""Predicted activation and communication bytes per rank of a small LLaMA on tp=2, with and without sequence
parallelism, as the ILP chooses it under a memory budget (BENCHMARKS.md, "Sequence parallelism").

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.sequence_parallel [--hidden 64] [--seq 512] [--layers 2]
        [--fractions 0.97 0.93] [--cluster dgx-a100]

The weights are fixed in Megatron's layout (``megatron_options``: column/row-parallel projections,
vocabulary-parallel embedding and head) and the ILP places every activation (objective ``time``, priced on
``--cluster``): first without a budget, then within each fraction of that plan's predicted bytes per device.
Each row: the budget, the predicted bytes by category (``solver/sharding/memory.py``: activations are what
autograd saves), the predicted communication bytes per step, how many RMS norms run on a sequence shard
(``S(1)`` over tp) and the activation collectives of the plan (reduce-scatter and all-gather of
``[batch, seq, hidden]`` in place of all-reduce). Nothing runs: these are the planner's predictions (the
plan's exactness is tests/test_sequence_parallel.py).
"""

from __future__ import annotations

import argparse

import torch

from autopar.errors import InfeasibleError
from autopar.ir.core import MeshSpec, Shard
from autopar.models.small_families import LogitsCE
from autopar.passes.capture import capture
from autopar.passes.flow import FLOW, FlowOptions, plan_program
from autopar.passes.manager import PassManager
from autopar.passes.shard import ShardOptions
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.baselines import megatron_options
from autopar.solver.sharding.memory import memory_categories

TP = MeshSpec((("tp", 2),))


def small_llama(layers: int, hidden: int, seq: int) -> tuple[torch.nn.Module, dict]:
    import transformers  # deferred: an optional dependency

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq,
    )  # fmt: skip
    config._attn_implementation = "eager"
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(0))
    return LogitsCE(transformers.LlamaForCausalLM(config)), {"input_ids": ids, "labels": ids}


def row(name: str, planned, hidden: int, seq: int) -> dict:
    prog = planned.sharded
    cats = memory_categories(prog, ShardOptions().setup)
    stream = (1, seq, hidden)
    norms = [op for op in prog.ops if op.target == "aten.pow.Tensor_Scalar" and op.types[0].shape == stream]
    counts = {
        k: sum(op.target == k and op.types[0].shape == stream for op in prog.ops)
        for k in ("all_reduce", "reduce_scatter", "all_gather")
    }
    return {
        "budget": name,
        "total": planned.shard_result.memory_bytes,
        "activations": cats["activations"],
        "comm": planned.shard_result.comm_bytes,
        "norms on S(1)": f"{sum(op.types[0].placements == (Shard(1),) for op in norms)}/{len(norms)}",
        **counts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--fractions", type=float, nargs="*", default=[0.97, 0.93])
    ap.add_argument("--cluster", default="dgx-a100", help="the cluster preset priced on (default: autopar plan's)")
    a = ap.parse_args()
    model, batch = small_llama(a.layers, a.hidden, a.seq)
    captured = capture(model, (), batch)
    lowered = PassManager(FLOW, options={"lower": TP}).run(captured, start="lower", stop="lower")

    def plan(budget):
        opts = ShardOptions(objective="time", budget_bytes=budget, cluster=ClusterSpec.load(a.cluster))
        opts = megatron_options(lowered, opts)
        return plan_program(captured, TP, FlowOptions(shard=opts, cache=False))

    free = plan(None)
    rows = [row("none", free, a.hidden, a.seq)]
    for f in a.fractions:
        budget = f * free.shard_result.memory_bytes
        try:
            rows.append(row(f"{f:.2f} x ({budget:,.0f})", plan(budget), a.hidden, a.seq))
        except InfeasibleError as e:
            rows.append({"budget": f"{f:.2f} x ({budget:,.0f})", "total": f"infeasible: {e}"})
    print(f"LLaMA {a.layers} layers, hidden {a.hidden}, sequence {a.seq}, batch 1, fp32, tp=2 on {a.cluster}")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = [r.get(k, "") for k in keys]
        print("| " + " | ".join(f"{c:,.0f}" if isinstance(c, float) else str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
