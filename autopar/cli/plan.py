"""`autopar plan MODEL --mesh ...`: solve the sharding strategy offline and write a plan file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from autopar.api import parse_mesh
from autopar.cli.listing import print_models
from autopar.config import TrainConfig
from autopar.errors import AutoparError
from autopar.ir.axes import PIPELINE_AXIS, data_axes
from autopar.passes.describe import describe_plan
from autopar.passes.shard import planning_options
from autopar.planner import PipelinePlanOptions, plan_model
from autopar.runtime.build.compiled import mesh_eager_parts
from autopar.schedule.generators import SCHEDULES, schedule_kind, splits_backward
from autopar.schedule.placement import schedule_of
from autopar.search import run_cli
from autopar.search.profile import with_seq
from autopar.solver.sharding.baselines import BASELINES
from autopar.solver.sharding.options import decide_gathers

GiB = 2**30
DEFAULT_CLUSTER = "dgx-a100"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="solve a sharding strategy for a model on a mesh (no GPU needed) and write a plan file",
        description=(
            "Capture MODEL on the meta device, enumerate sharding candidates for every op on the mesh, and solve "
            "the strategy ILP (by default the least predicted step time within the memory budget; --objective "
            "memory: minimal redundant memory plus alpha x communication). Prints the predicted memory and "
            "communication beside the Megatron, data-parallel, ZeRO-2/3 and Alpa (comm) baselines priced by the "
            "same cost model. Without --mesh, --global-batch searches the whole plan (mesh, schedule, micro-batch, "
            "ZeRO, recomputation) for --cluster. --config FILE takes a TrainConfig (YAML/JSON); flags override it."
        ),
        epilog="example: autopar plan gpt2 --mesh dp=2,tp=4 --cluster dgx-a100 -o plan.json",
    )
    p.add_argument("model", metavar="MODEL", nargs="?", help="preset[:overrides] or file.py:fn (see --list-models)")
    p.add_argument("--mesh", help="mesh axes, e.g. dp=2,tp=4 (axes named dp* are data parallel for ZeRO)")
    p.add_argument(
        "--config",
        metavar="FILE",
        help="a TrainConfig as YAML or JSON (its fields: objective, budget, zero, schedule, microbatches, precision, "
        "...); the flags below override it, and the plan file keeps the result",
    )
    p.add_argument(
        "--cluster",
        default=None,
        help="cluster spec: a preset (default dgx-a100; merak-3090, ...) or a file",
    )
    p.add_argument(
        "--objective",
        choices=["time", "memory", "comm"],
        default=None,
        help="time (default): the fastest plan within the memory budget; memory: least redundant memory "
        "(+ alpha x communication bytes); comm: time under Alpa's name",
    )
    p.add_argument("--alpha", type=float, default=None, help="weight of communication bytes (memory objective)")
    p.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="per-device memory budget in GiB (default: the cluster's device memory less its reserve, "
        "memory_reserve: 1 GiB + 5%% of the device unless the spec sets it)",
    )
    p.add_argument(
        "--roles", choices=["name", "auto"], default=None,
        help="name (default): each axis does what its name says (dp* data parallel, tp* tensor parallel as "
        "Megatron); auto: the ILP chooses every axis's placements by cost",
    )  # fmt: skip
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage over the dp axes")
    p.add_argument("--mics-group", type=int, default=None, help="MiCS partition group size over the dp axes")
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="training precision: bf16/fp16 capture the model in that dtype with fp32 master weights "
        "(compile applies the plan's precision); default, with --mesh and in the search alike: bf16 on a GPU "
        "(NCCL) cluster, fp32 on a gloo one",
    )
    p.add_argument(
        "--router-imbalance", type=float, default=None, metavar="F",
        help="a mixture of experts on an ep axis: price the busiest expert rank at F times the mean rows (default 1: "
        "uniform routing; TrainConfig.router_imbalance), with --mesh and in the search alike",
    )  # fmt: skip
    p.add_argument(
        "--capacity-factor", type=float, default=None, metavar="C",
        help="a mixture of experts: each expert keeps ceil(C x tokens x top-k / experts) of its rows and drops the "
        "rest (default: dropless; TrainConfig.capacity_factor), priced and planned with --mesh and in the search alike",
    )  # fmt: skip
    p.add_argument("--time-limit", type=float, default=None, help="ILP time limit in seconds (default 60)")
    p.add_argument("--solver", choices=["cbc", "highs"], default=None, help="ILP back end (default CBC)")
    p.add_argument("--chunks", type=int, default=None, help="virtual pipeline chunks per rank (interleaved schedule)")
    p.add_argument("--waves", type=int, default=None, help="Hanayo waves per rank (wave schedule)")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per step (pipeline meshes)")
    p.add_argument(
        "--schedule",
        choices=sorted(SCHEDULES),
        default=None,
        help="pipeline schedule the stages are balanced for (pipeline meshes; default 1f1b, interleaved with "
        "--chunks, wave with --waves): a zero-bubble one prices the output gradients its split backward keeps",
    )
    p.add_argument(
        "--torch-compile", action="store_true", default=None,
        help="the plan runs with torch_compile=True: also list which parts of it run eagerly or give up an overlap, "
        "and why",
    )  # fmt: skip
    p.add_argument("--no-baselines", action="store_true", help="skip the baselines")
    p.add_argument("-o", "--output", default=None, help="write the plan file (JSON) here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--verbose", action="store_true", help="also list every parameter's placement and unruled ops")
    p.add_argument("--list-models", action="store_true", help="list the model presets and exit")
    p.set_defaults(func=run)
    # -- search hook (autopar/search/): without --mesh, --global-batch searches the whole plan --------
    g = p.add_argument_group(
        "search (--global-batch): mesh, schedule, micro-batch, ZeRO/MiCS and recomputation; with --mesh and the "
        "flags below, a published configuration pinned and priced as given"
    )
    batch_help = "global batch per step: search the whole plan for --cluster (with --mesh: price the mesh pinned)"
    g.add_argument("--global-batch", type=int, default=None, metavar="B", help=batch_help)
    g.add_argument("--top", type=int, default=1, metavar="K", help="list the K best plans (search)")
    g.add_argument(
        "--seq-len", type=int, default=None, metavar="S",
        help="the preset's sequence length (MODEL:seq=S); the search also tries context parallelism (cp) where "
        "each cp rank keeps at least 2048 tokens of a sequence",
    )  # fmt: skip
    g.add_argument(
        "--recompute", choices=["none", "full", "stage-aware"], default=None,
        help="with --global-batch: pin the activation recomputation (full: every transformer layer keeps only "
        "its input, Megatron's --recompute-granularity full)",
    )  # fmt: skip
    g.add_argument(
        "--microbatch-size", type=int, default=None, metavar="b",
        help="with --global-batch: pin the micro-batch size b (samples per microbatch per data-parallel replica; "
        "B / (dp b) microbatches, accumulated without a pp axis)",
    )  # fmt: skip
    g.add_argument(
        "--layout",
        choices=["even", "balanced"],
        default=None,
        help="with --global-batch: pin the stage layout (even: Megatron's L / S layers per stage)",
    )
    g.add_argument(
        "--attention",
        choices=["fused", "unfused"],
        default=None,
        help="with --global-batch: how attention runs, an assumption of every price (default fused: one kernel, "
        "FlashAttention or SDPA, no scores kept; unfused: Megatron-LM of 2021's batched matmuls, fused softmax and "
        "dropout, the s x s scores kept for the backward)",
    )
    g.add_argument(
        "--recompute-at",
        choices=["early", "backward"],
        default=None,
        help="with --global-batch: when recomputation runs, an assumption of every price (default early: as autopar "
        "runs it, before the output gradient arrives, filling the bubbles; backward: inside the backward, once the "
        "gradient is in, as torch.utils.checkpoint, Megatron-LM and DeepSpeed run it)",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        default=None,
        help="with --global-batch: Megatron's sequence parallelism wherever tp > 1 (norms, residuals and dropouts "
        "split over tp along the sequence, each tp all-reduce a reduce-scatter and an all-gather; NeMo's recipes run "
        "it): priced only, no plan file (-o) yet",
    )
    g.add_argument(
        "--explain-step",
        action="store_true",
        help="with --global-batch: break each plan's predicted step into compute per stage, exposed communication "
        "per axis, bubble, recomputation and optimizer",
    )
    p.set_defaults(precision=None, zero=None)  # given values restrict the search; plan_config() sets the rest
    # -- end search hook --------------------------------------------------------------------------------


def plan_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig an ``autopar plan`` call plans with: ``--config``'s file (default: TrainConfig's
    defaults), each flag given overriding its field; priced on dgx-a100 when neither names a cluster."""
    cfg = TrainConfig.load(args.config) if args.config else TrainConfig()
    changes = {
        "objective": args.objective,
        "alpha": args.alpha,
        "budget": args.budget_gb * GiB if args.budget_gb is not None else None,
        "time_limit": args.time_limit,
        "solver": args.solver,
        "zero": args.zero,
        "mics_group": args.mics_group,
        "precision": args.precision,
        "microbatches": args.microbatches,
        "cluster": args.cluster,
        "roles": args.roles,
        "torch_compile": getattr(args, "torch_compile", None),
        "router_imbalance": getattr(args, "router_imbalance", None),
        "capacity_factor": getattr(args, "capacity_factor", None),
    }
    changes = {k: v for k, v in changes.items() if v is not None}
    shape = {k: v for k, v in (("chunks", args.chunks), ("waves", args.waves)) if v is not None}
    chunks, waves = shape.get("chunks", 1), shape.get("waves")
    schedule = args.schedule or (schedule_of(2, chunks, waves) if waves or chunks > 1 else None)  # the shape's own
    if schedule is not None and schedule != cfg.schedule:
        changes["schedule"], changes["schedule_options"] = schedule, {}
    if shape:
        kind = schedule_kind(changes.get("schedule", cfg.schedule))
        opts = dict(changes.get("schedule_options", cfg.schedule_options))
        changes["schedule_options"] = opts | {k: v for k, v in shape.items() if k in kind.options() and v != 1}
    cfg = cfg.replace(**changes)
    cfg = cfg if cfg.cluster is not None else cfg.replace(cluster=DEFAULT_CLUSTER)
    if args.precision is None and not _config_sets(args.config, "precision"):
        # one default with the search: the cluster's (bf16 on a GPU cluster, fp32 on gloo)
        cfg = cfg.replace(precision=cfg.cluster_spec().default_precision())
    return cfg


def _config_sets(path, name: str) -> bool:
    """Whether the ``--config`` file at ``path`` (None: no file) sets the field ``name``."""
    if path is None:
        return False
    text = Path(path).read_text()
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    return isinstance(data, dict) and name in data


def pipeline_options(cfg: TrainConfig, args: argparse.Namespace) -> PipelinePlanOptions:
    """The pipeline the stages are balanced for: the flags as given (no ``--schedule``: the shape's own), or
    with ``--config`` the config's schedule and microbatches."""
    if args.config is None:
        return PipelinePlanOptions(args.chunks or 1, args.waves, args.microbatches, args.schedule)
    o, kind = cfg.schedule_options, schedule_kind(cfg.schedule)
    chunks = int(o.get("chunks", 2 if cfg.schedule == "interleaved" else 1)) if "chunks" in kind.options() else 1
    waves = int(o.get("waves", 1)) if "waves" in kind.options() else None
    return PipelinePlanOptions(chunks, waves, cfg.microbatches, cfg.schedule)


def run(args: argparse.Namespace) -> int:
    if args.list_models:
        return print_models()
    cfg = plan_config(args)
    args.cluster, args.time_limit, args.solver = cfg.cluster, cfg.time_limit, cfg.solver  # the search's
    args.router_imbalance, args.capacity_factor = cfg.router_imbalance, cfg.capacity_factor  # priced as --mesh does
    if getattr(args, "seq_len", None) is not None and args.model:
        args.model = with_seq(args.model, args.seq_len)
    # -- search hook ------------------------------------------------------------------------------------
    if args.global_batch is not None:
        # --mesh with --global-batch pins the mesh (and whatever else is given) and prices it with the search's model
        args.pin_mesh = dict(parse_mesh(args.mesh).axes) if args.mesh else None
        return run_cli(args)
    priced = ("recompute", "microbatch_size", "layout", "attention", "recompute_at", "explain_step")
    priced += ("sequence_parallel",)
    pinned = [f for f in priced if getattr(args, f)]
    if pinned:
        flags = ", ".join("--" + f.replace("_", "-") for f in pinned)
        raise AutoparError(f"{flags} price a whole step: give --global-batch B (e.g. --mesh dp=32 --global-batch 512)")
    # -- end search hook --------------------------------------------------------------------------------
    if not args.model or not args.mesh:
        raise AutoparError("give MODEL and --mesh (e.g. autopar plan gpt2 --mesh dp=2,tp=4); see --help")
    mesh = parse_mesh(args.mesh)
    opts = cfg.shard_options()
    opts = planning_options(opts, opts.cluster)  # the time objective's budget: the device memory
    opts = decide_gathers(opts, mesh, cfg.hierarchical_gather)  # ZeRO-3's gathers across nodes: two steps if they pay
    if ((args.chunks or 1) > 1 or args.waves or args.schedule) and PIPELINE_AXIS not in mesh.names:
        raise AutoparError("--chunks, --waves and --schedule need a pipeline axis in the mesh, e.g. --mesh pp=4,dp=2")
    pipe = pipeline_options(cfg, args)
    report = plan_model(
        args.model, mesh, opts, baselines=() if args.no_baselines else BASELINES, pipeline=pipe, config=cfg.to_dict()
    )
    plan = report.plan
    if args.output:
        plan.save(args.output)
    eager = compiled_eager_parts(cfg, plan) if cfg.torch_compile else None
    if args.json:
        out = dict(plan.stats)
        if eager is not None:
            out["torch_compile_eager"] = eager
        # a baseline that cannot run on this mesh: null here, its reason in baselines_detail[name]["unavailable"]
        out["baselines"] = {k: v.get("memory_per_device_bytes") for k, v in plan.baselines.items()}
        out["baselines_detail"] = plan.baselines
        out["mesh"] = dict(plan.launch_mesh.axes)
        out["fingerprint"] = plan.fingerprint
        if plan.pipeline:
            sp = plan.pipeline["stage_plan"]
            out["stages"] = sp["stages"]
            out["split_seconds"] = plan.pipeline["split_seconds"]
            out["schedule"] = plan.pipeline["schedule"]
        if args.output:
            out["plan_file"] = args.output
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    _print_report(args, report)
    if eager is not None:
        print("\ntorch_compile=True: every program compiled with Inductor" + (", but:" if eager else ", nothing eager"))
        for line in eager:
            print(f"  - {line}")
    return 0


def compiled_eager_parts(cfg: TrainConfig, plan) -> list[str]:
    """What of ``plan`` a ``torch_compile=True`` run leaves eager or unoverlapped, and why
    (runtime/build/compiled.py ``eager_parts``; the compile log repeats it when the plan runs)."""
    schedule = plan.pipeline["schedule"] if plan.pipeline else None
    split = schedule is not None and splits_backward(schedule)
    return mesh_eager_parts(dict(plan.launch_mesh.axes), cfg.zero, cfg.sub_pipeline_tp, split)


def precision_line(setup: dict) -> str:
    """How a plan's training setup computes: ``bf16 compute, fp32 master weights and Adam states, gradients
    reduced in fp32`` (mixed precision) or ``fp32`` (``autopar plan``'s report)."""
    precision = setup.get("precision", "fp32")
    if precision == "fp32":
        return "fp32 (parameters, activations, gradients and optimizer states)"
    scaling = ", dynamic loss scaling" if precision == "fp16" else ""
    reduce = setup.get("reduce_dtype", "fp32")
    masters = "fp32 master weights and optimizer states"
    return f"{precision} compute (captured in {precision}), {masters}, gradients reduced in {reduce}{scaling}"


def _print_report(args, report) -> None:
    s = report.plan.stats
    objective = {"time": "time (fastest within the budget)", "memory": f"memory (least redundancy, alpha {args.alpha})"}
    budget = f", budget {s['budget_bytes'] / GiB:.2f} GiB/device" if s.get("budget_bytes") else ""
    print(f"{args.model} on mesh {args.mesh}  ({s['ops']} ops, objective {objective[s['objective']]}{budget})")
    print(f"predicted step: {s['step_seconds'] * 1e3:.3f} ms (computation + communication per device)")
    print(f"precision: {precision_line(report.plan.options.get('setup', {}))}")
    setup = report.plan.options.get("setup", {})
    zero_axes = tuple(setup.get("zero_axes") or data_axes(report.plan.launch_mesh.names))
    print(
        describe_plan(
            report.plan.parsed(), setup.get("bucket_cap_mb", 25.0) * 2**20, setup.get("zero", 0), zero_axes,
            report.plan.pipeline.get("schedule") if report.plan.pipeline else None,
            report.plan.launch_mesh.pipeline_size,
        )
    )  # fmt: skip
    folded = f", {s['layers_solved_once']} identical layers solved once" if s["layers_solved_once"] else ""
    eliminated = f" ({s['ilp_eliminated']} solved by elimination first)" if s.get("ilp_eliminated") else ""
    print(
        f"ILP: {s['status']} in {s['solve_seconds']:.2f} s, {s['ilp_variables']:,} variables, "
        f"{s['ilp_constraints']:,} constraints, {s['ilp_groups']} decisions{eliminated}{folded}"
    )
    if s["status"] != "optimal":  # the time limit passed: the plan is valid, not proven optimal
        gap = "unknown" if s.get("ilp_gap") is None else f"{100 * s['ilp_gap']:.2f}%"
        print(f"  not proven optimal (gap to the solver's bound: {gap}): raise --time-limit or try --solver highs")
    mem = s["memory_per_device_bytes"]
    print(f"\n{'strategy':10s} {'memory/device':>14s} {'vs autopar':>11s} {'comm/step':>12s} {'comm time':>11s}")
    rows = [
        ("autopar", {"memory_per_device_bytes": mem, "comm_bytes": s["comm_bytes"], "comm_seconds": s["comm_seconds"]})
    ]
    for name, v in rows + list(report.plan.baselines.items()):
        if "unavailable" in v:
            print(f"{name:10s} {'n/a':>14s}  {v['unavailable']}")
            continue
        m, cb, cs = v["memory_per_device_bytes"], v["comm_bytes"], v["comm_seconds"]
        ratio = f"{mem / m:.2f}x" if m else "-"
        t = f"{cs * 1e3:.2f} ms" if report.plan.cluster else "-"
        print(f"{name:10s} {m / GiB:>10.3f} GiB {ratio:>11s} {cb / 2**20:>8.1f} MiB {t:>11s}")
    gb = s.get("grad_buckets")
    if gb and gb["buckets"]:
        sizes = ", ".join(f"{b['axis']} {b['bytes'] / 2**20:.2f} MiB ({b['params']} params)" for b in gb["buckets"])
        lat = f", {gb['latency_seconds'] * 1e3:.2f} ms of latency" if report.plan.cluster else ""
        print(f"\ngradient buckets (cap {gb['cap_mb']:g} MiB, one all-reduce each{lat}): {sizes}")
    print("\n(vs autopar: autopar's memory divided by the strategy's; comm counts forward and backward;")
    print(" n/a: the baseline's layout cannot exist on this mesh)")
    if report.plan.pipeline:
        print(f"\npipeline ({report.plan.pipeline['schedule']}):\n{report.plan.pipeline['table']}")
        print("(the strategy table above is the whole model on the non-pp axes; each stage holds its share)")
    if args.verbose:
        prog = report.plan.parsed()
        print("\nparameters:")
        for v in prog.params:
            sync = f"  grad sync over {','.join(v.attrs['grad_sync'])}" if v.attrs.get("grad_sync") else ""
            print(f"  {v.name:50s} {v.type}{sync}")
        if s["unruled_ops"]:
            print("\nops without a sharding rule (replicated):", ", ".join(s["unruled_ops"]))
    if args.output:
        print(f"\nplan written to {args.output}")
