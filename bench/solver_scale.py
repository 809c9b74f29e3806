"""ILP size and solve time for whole models on a 64-device mesh (repeated layers solved once).

    .venv/bin/python bench/solver_scale.py                      # gpt2-xl and gpt3-175b on dp=8,tp=8
    .venv/bin/python bench/solver_scale.py llama-70b --mesh dp=4,tp=16
    .venv/bin/python bench/solver_scale.py deepseek-v3-tiny --mesh dp=2,tp=2 --backend highs

``deepseek-v3-tiny`` is built here from transformers' ``DeepseekV3Config`` (no preset): 2 layers (the first
dense, ``first_k_dense_replace=1``, the second a mixture of 4 routed experts, top-2, and one shared expert),
hidden 64, MLA with q_lora_rank 32, kv_lora_rank 16, rope and nope head dims 8, on the ``batched_mm`` expert
kernel (transformers' default ``grouped_mm`` is the kernel issue 31's lowering work covers; the planning
problem is the same), batch 4 x 8 tokens. The status is the ILP's (``optimal``, or ``feasible`` /
``heuristic`` with the gap when the time limit passed: solver/sharding/ilp.py).

Each model runs in a fresh process. Peer figure (shared/BENCHMARKING.md): meta-pytorch/autoparallel
on this machine, transformer blocks of dim 6144 on an (8, 8) mesh: 1 layer 67k variables 5.8 s;
4 layers 159k variables 45 s with its layer clustering (202 s without).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def deepseek_v3_tiny(layers: int = 2):
    """(model, args, kwargs): the tiny DeepSeek-V3 of the module docstring, with a cross-entropy loss; ``layers``:
    its decoder layers (the first dense, the others mixtures of experts)."""
    import torch
    import transformers

    from autopar.models.small_families import LogitsCE

    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=32,
        experts_implementation="batched_mm", pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ids = torch.randint(3, 64, (4, 8))
    return LogitsCE(transformers.DeepseekV3ForCausalLM(cfg)), (), {"input_ids": ids, "labels": ids}


def deepseek_v3():
    """(model, args, kwargs): DeepSeek-V3 671B as transformers' ``DeepseekV3Config()`` defaults build it (61 layers,
    the first 3 dense; 256 routed experts, top-8, one shared; MLA), on meta, batch 1 x 4096 tokens, with the
    ``batched_mm`` expert kernel (no preset here: autopar/models/presets.py is another change's)."""
    import torch
    import transformers

    from autopar.models.small_families import LogitsCE

    cfg = transformers.DeepseekV3Config(experts_implementation="batched_mm")
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = LogitsCE(transformers.DeepseekV3ForCausalLM(cfg))
        ids = torch.zeros((1, 4096), dtype=torch.long)
    return model, (), {"input_ids": ids, "labels": ids}


INLINE = {"deepseek-v3-tiny": deepseek_v3_tiny, "deepseek-v3": deepseek_v3}  # built here, not from a preset


def measure(model: str, mesh: str, time_limit: float = 60.0, backend: str = "cbc") -> dict:
    from autopar.api import parse_mesh
    from autopar.models.resolve import build
    from autopar.passes.capture import capture
    from autopar.passes.lower import lower
    from autopar.passes.shard import ShardOptions, shard
    from autopar.solver.cluster.spec import ClusterSpec
    from autopar.solver.sharding.solve import build_problem

    if model in INLINE:
        call = INLINE[model]()
    else:
        spec = build(model, device="meta")
        call = spec.model, spec.args, spec.kwargs
    t0 = time.perf_counter()
    captured = capture(*call)
    t1 = time.perf_counter()
    prog = lower(captured, parse_mesh(mesh))
    opts = ShardOptions(cluster=ClusterSpec.load("dgx-a100"), time_limit=time_limit, backend=backend)
    t2 = time.perf_counter()
    _, groups, nodes, edges = build_problem(prog, opts)
    t3 = time.perf_counter()
    try:
        res = shard(prog, opts)  # builds again and solves
    except Exception as e:  # the solver before issue 31 gave up ("Not Solved"): reported as the status
        return {"model": model, "mesh": mesh, "ops": len(prog.ops), "decisions": len(groups),
                "status": f"{type(e).__name__}: {e}", "plan_s": time.perf_counter() - t3}  # fmt: skip
    t4 = time.perf_counter()
    return {
        "model": model,
        "mesh": mesh,
        "layers": res.solution.layers,
        "ops": len(prog.ops),
        "decisions": len(groups),
        "variables": res.solution.variables,
        "constraints": res.solution.constraints,
        "capture_s": t1 - t0,
        "build_s": t3 - t2,
        "solve_s": res.solution.seconds,
        "plan_s": t4 - t3,
        "status": res.solution.status,
        "gap": getattr(res.solution, "gap", 0.0),
        "memory_gib": res.memory_bytes / 2**30,
        "full_ilp_variables": sum(len(n.costs) for n in nodes) + sum(len(e.cost) for e in edges),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", default=["gpt2-xl", "gpt3-175b"])
    p.add_argument("--mesh", default="dp=8,tp=8")
    p.add_argument("--time-limit", type=float, default=60.0, help="the ILP's time limit in seconds (default 60)")
    p.add_argument("--backend", choices=["cbc", "highs"], default="cbc")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.mesh, args.time_limit, args.backend)))
        return 0
    print("| model | mesh | layers solved once | ops | decisions | variables before elimination | ILP variables "
          f"| constraints | capture (s) | build ILP (s) | {args.backend} solve (s) | shard pass total (s) | status "
          "| gap |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        cmd = [sys.executable, __file__, "--one", model, "--mesh", args.mesh, "--time-limit", str(args.time_limit)]
        out = subprocess.run([*cmd, "--backend", args.backend], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        if "variables" not in r:
            print(f"| {model} | {r['mesh']} | | {r['ops']:,} | {r['decisions']:,} | | | | | | | {r['plan_s']:.1f} "
                  f"| {r['status']} | |", flush=True)  # fmt: skip
            continue
        gap = "unknown" if r["gap"] is None else f"{100 * r['gap']:.2f}%"
        print(
            f"| {model} | {r['mesh']} | {r['layers']} | {r['ops']:,} | {r['decisions']:,} "
            f"| {r['full_ilp_variables']:,} | {r['variables']:,} | {r['constraints']:,} | {r['capture_s']:.1f} "
            f"| {r['build_s']:.1f} | {r['solve_s']:.2f} | {r['plan_s']:.1f} | {r['status']} | {gap} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
