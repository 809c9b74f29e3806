"""Does the sharding ILP price the plan it picks as the program runs it? Predicted against emitted communication.

    .venv/bin/python bench/ilp_pricing.py
    .venv/bin/python bench/ilp_pricing.py --cases llama-7b-layer:tp=8 --cluster dgx-a100
    .venv/bin/python bench/ilp_pricing.py --survey     # presets x meshes x objectives, free plans only

For each case (a model and a mesh) the ILP is solved twice on the cluster spec: free (the default objective,
the least step time) and with Megatron's layout fixed (``megatron_options``). For each plan the table gives
the ILP's predicted communication seconds beside the same plan's program after ``insert-collectives``, each
collective priced on its own by the same cost model (``CostModel.program_comm``), and the predicted step time
(computation + communication). The two communication columns are equal where the ILP prices what the program
runs; the free plan's step can never exceed the constrained one's (constraints only remove candidates).

``--survey`` solves the free plan of every ``SURVEY`` model on every ``SURVEY_MESHES`` mesh under both objectives
(least step time, and the paper's least redundant memory + communication) and prints the same two columns and
their ratio, to find where the ILP's pricing and the program part.
"""

from __future__ import annotations

import argparse
import time

from autopar.api import DEFAULT_PIPELINE, parse_mesh
from autopar.models.resolve import build
from autopar.passes.capture import capture
from autopar.passes.lower import lower
from autopar.passes.manager import PassManager
from autopar.passes.shard import ShardOptions
from autopar.solver.cluster.spec import ClusterSpec
from autopar.solver.sharding.baselines import megatron_options
from autopar.solver.sharding.cost import CostModel
from autopar.solver.sharding.solve import solve_sharding

MODELS = {
    # issue 13's Llama (bench/vs_torch.py's sizes)
    "llama-small": "tiny-llama:num_hidden_layers=4,hidden_size=256,num_attention_heads=4,num_key_value_heads=4,"
    "intermediate_size=1024,vocab_size=4096,max_position_embeddings=128,batch=8,seq=128",
    # two layers of Llama-2 7B's shapes, two sequences of 2048
    "llama-7b-layer": "tiny-llama:num_hidden_layers=2,hidden_size=4096,num_attention_heads=32,num_key_value_heads=32,"
    "intermediate_size=11008,vocab_size=32000,max_position_embeddings=2048,batch=2,seq=2048",
    # GPT-2's fused c_attn: one reader per f, a control
    "gpt2-small": "gpt2:n_layer=4,n_embd=256,n_head=4,vocab_size=4096,n_positions=128,batch=8,seq=128",
}
SURVEY = [
    "tiny-llama", "tiny-gpt2", "tiny-bert", "tiny-encoder", "tiny-mlp", "mmr-bert-large",
    "llama-7b:num_hidden_layers=1,batch=2,seq=512", "bert-large:num_hidden_layers=1",
]  # fmt: skip
SURVEY_MESHES = ["tp=2", "dp=2,tp=2", "tp=4", "dp=2,sp=2,tp=2"]
CASES = ["llama-small:tp=2", "llama-small:dp=2,tp=2", "llama-7b-layer:tp=8", "llama-7b-layer:dp=2,tp=4"]
CASES += ["gpt2-small:tp=2"]


def priced(prog, opts: ShardOptions):
    """(the ILP's solution, its program's collectives priced one by one in seconds, solve seconds)."""
    t0 = time.perf_counter()
    sharding = solve_sharding(prog, opts)
    solve = time.perf_counter() - t0
    program = PassManager(DEFAULT_PIPELINE, options={"shard": opts}).run(prog)
    _, emitted = CostModel(prog.mesh, opts.setup, opts.cluster).program_comm(program)
    return sharding, emitted, solve


def row(case: str, cluster: ClusterSpec) -> str:
    model, mesh = case.split(":")
    m = build(MODELS[model], device="meta")
    prog = lower(capture(m.model, m.args, m.kwargs), parse_mesh(mesh))
    base = ShardOptions(cluster=cluster)
    cells = []
    for opts in (base, megatron_options(prog, base)):
        sharding, emitted, solve = priced(prog, opts)
        cells += [
            f"{sharding.comm_seconds * 1e3:.3f} / {emitted * 1e3:.3f}",
            f"{sharding.step_seconds * 1e3:.3f}",
            f"{solve:.1f}",
        ]
    return f"| {model} | {mesh} | " + " | ".join(cells) + " |"


def survey_rows(cluster: ClusterSpec):
    """(model, mesh, objective, predicted comm s, emitted comm s, solve s) of every survey case."""
    for spec in SURVEY:
        m = build(spec, device="meta")
        captured = capture(m.model, m.args, m.kwargs)
        for mesh in SURVEY_MESHES:
            prog = lower(captured, parse_mesh(mesh))
            for objective in ("time", "memory"):
                sharding, emitted, solve = priced(prog, ShardOptions(cluster=cluster, objective=objective))
                yield spec, mesh, objective, sharding.comm_seconds, emitted, solve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=";".join(CASES), help="MODEL:MESH;... (MODEL from MODELS)")
    ap.add_argument("--cluster", default="dgx-a100", help="cluster spec preset or file (default dgx-a100)")
    ap.add_argument("--survey", action="store_true", help="every SURVEY model x SURVEY_MESHES mesh x objective")
    a = ap.parse_args()
    cluster = ClusterSpec.load(a.cluster)
    if a.survey:
        print("| model | mesh | objective | predicted comm ms | emitted comm ms | predicted / emitted | solve s |")
        print("|---|---|---|---|---|---|---|")
        for spec, mesh, objective, predicted, emitted, solve in survey_rows(cluster):
            ratio = f"{predicted / emitted:.3f}" if emitted else ("1" if not predicted else "inf")
            cells = [spec, mesh, objective, f"{predicted * 1e3:.4f}", f"{emitted * 1e3:.4f}", ratio, f"{solve:.1f}"]
            print("| " + " | ".join(cells) + " |", flush=True)
        return
    print(
        "| model | mesh | free: predicted / emitted comm ms | free: step ms | free: s "
        "| Megatron: predicted / emitted comm ms | Megatron: step ms | Megatron: s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for case in a.cases.split(";"):
        print(row(case, cluster), flush=True)


if __name__ == "__main__":
    main()
