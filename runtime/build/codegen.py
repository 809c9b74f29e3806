"""Codegen: one torch.fx.GraphModule per rank, holding only that rank's parameter shards.

Each IR op becomes one call: ATen ops with local shapes substituted into their shape arguments,
collectives as calls into autopar.runtime.comm.collectives. A matmul and the bias add that lowering split
it into (so a row-parallel matmul can sum before its bias) are one call again where nothing came
between them on this rank: ``addmm`` / a biased ``linear``, as eager runs them (``_bias_adds``).
The module's parameters are named as in the user's model (``transformer.h.0.attn.c_attn.weight``),
so state dicts line up with the original. A parameter held in another dtype than the program's (fp32
master weights of a program captured in bf16, ``runtime/build/precision.py``) is cast where it is read, and
so are half-typed float inputs.

``codegen`` is the flow's last pass (``passes/flow.py``), registered here with the PassManager: each rank runs
it on every stage part it holds (``runtime/build/stages.py``), its dumps ``09-codegen.rank{r}.{label}.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.errors import PlanError, UnsupportedOpError
from autopar.ir.core import COLLECTIVES, Device, Op, Program, Ref, Shard, Value, map_refs, resolve_target
from autopar.ir.verify import local_args
from autopar.passes.dropout import is_keyed
from autopar.passes.experts import CAPACITY
from autopar.passes.manager import register_pass
from autopar.runtime.build import rng as keyed
from autopar.runtime.build.differentiable import DIFFERENTIABLE
from autopar.runtime.build.precision import cast_to
from autopar.runtime.comm import all_to_all as experts
from autopar.runtime.comm import collectives as coll
from autopar.runtime.comm.column_linear import ColumnGroup, column_groups, column_linears
from autopar.runtime.comm.context import current_comm
from autopar.runtime.comm.context_attention import query_block_sdpa, ring_sdpa
from autopar.runtime.comm.shards import shard_tensor
from autopar.runtime.comm.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_embedding
from autopar.solver.sharding.experts import EP_ROWS, GROUPED_COMBINE, GROUPED_DISPATCH, grouped_expert_axes
from autopar.solver.sharding.rules.context import is_ring

_HALF = (torch.bfloat16, torch.float16)
_LIST_RESULTS = {"aten.unbind.int", "aten.chunk"}  # a list even of one tensor


def shard_param(full: torch.Tensor, placements, mesh_names, sizes, coords) -> torch.Tensor:
    """This rank's shard of a whole tensor, for the given placements (outer axis first)."""
    x = full
    for p, name, n in zip(placements, mesh_names, sizes):
        if isinstance(p, Shard):
            x = shard_tensor(x, p.dim, p.chunks, n, coords[name])
    return x


def codegen(
    prog: Program,
    coords: dict[str, int],
    get_tensor: Callable[[str], torch.Tensor],
    device: torch.device | str = "cpu",
    local_tensor: Callable[[Value], torch.Tensor] | None = None,
    rng: keyed.DropoutRng | None = None,
    overlap_tp: bool = True,
) -> fx.GraphModule:
    """Build the GraphModule of the rank at mesh coordinates ``coords``.

    ``get_tensor(name)`` returns a parameter or buffer's whole value; only the local shard is kept.
    ``local_tensor(value)``, when given, returns the rank's ready local shard (a Parameter for a
    parameter) and is used as it is, not copied: pipeline stages on one rank share their tied
    parameters this way (autopar.passes.stage_program).
    ``rng`` is the state the rank's keyed dropouts read (seed, step, microbatch; runtime/build/rng.py), shared
    by every module of the rank; the module keeps it as ``autopar_rng`` (a fresh one, seed 0, if none).
    ``overlap_tp``: each Megatron f read only by matmuls is emitted fused with them, so that its gradient's
    all-reduce overlaps their weight gradients (``runtime/comm/column_linear.py``); off where the backward is split
    (zero-bubble's B and W) or cut at f (sub-pipelined tensor parallelism).
    """
    device = torch.device(device)
    sizes = prog.mesh.sizes
    types = prog.types()
    root = torch.nn.Module()
    root.autopar_rng = rng if rng is not None else keyed.DropoutRng(seed=0)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for v in prog.inputs:
        if v.kind == "input":
            ident = v.name.replace(".", "_")
            env[v.name] = graph.placeholder(ident if ident.isidentifier() else f"v{ident}")
            if v.type.torch_dtype in _HALF:  # captured in a compute dtype: float inputs cast to it
                env[v.name] = graph.call_function(cast_to, (env[v.name], v.type.torch_dtype))
            continue
        owner, attr = _owner(root, v.name)
        if local_tensor is not None:
            local = local_tensor(v)
            if isinstance(local, torch.nn.Parameter):
                owner.register_parameter(attr, local)
            else:
                owner.register_buffer(attr, local)
        else:
            local = shard_param(get_tensor(v.name), v.type.placements, prog.mesh.names, sizes, coords)
            local = local.detach().to(device).clone().contiguous()
            if v.kind == "param":
                grad = v.type.is_float and not v.attrs.get("frozen")
                owner.register_parameter(attr, torch.nn.Parameter(local, requires_grad=grad))
            else:
                owner.register_buffer(attr, local)
        env[v.name] = graph.get_attr(v.name)
        if local.is_floating_point() and local.dtype != v.type.torch_dtype:  # fp32 masters, compute-dtype reads
            env[v.name] = graph.call_function(cast_to, (env[v.name], v.type.torch_dtype))

    def arg(x):
        return map_refs(x, lambda r: env[r.name])

    def dev(x):
        if isinstance(x, Device):
            return device
        if isinstance(x, (list, tuple)):
            return type(x)(dev(v) for v in x)
        return x

    users = prog.users()
    fused = _bias_adds(prog, types, users)
    deferred = _returned_scalar_sums(prog, types, users)
    one_rank = {name: n == 1 for name, n in zip(prog.mesh.names, sizes)}  # collectives there are the identity
    groups = column_groups(prog, types, users, fused) if overlap_tp else {}
    producers = prog.producers()
    fused_matmuls = {mm.result for mm, _ in fused.values()}
    done: set[str] = set()  # results emitted ahead of their place (a fused group's readers, hoisted weights)

    def emit(op: Op) -> None:
        if op.result in fused_matmuls:  # emitted with its bias add
            return
        if op.result in fused:
            mm, bias = fused[op.result]
            x, w = (env[r.name] for r in mm.args)
            if mm.target == "aten.mm":
                node = graph.call_function(torch.ops.aten.addmm.default, (env[bias], x, w))
            else:
                node = graph.call_function(torch.ops.aten.linear.default, (x, w, env[bias]))
        elif op.target in COLLECTIVES and one_rank.get(op.kwargs.get("axis"), False):  # over one rank: x itself
            node = graph.call_function(torch.ops.aten.alias.default, (env[op.args[0].name],))
        elif op.result in groups and _ready(groups[op.result], env, producers, emit, done):
            _emit_group(graph, groups[op.result], env, done)
            return
        elif op.target in COLLECTIVES:
            kwargs = dict(op.kwargs)
            if op.result in deferred:
                kwargs["defer"] = True
            node = graph.call_function(coll.FUNCTIONS[op.target], (env[op.args[0].name],), kwargs)
        elif op.target in experts.FUNCTIONS:  # expert parallelism's dispatch and combine (passes/experts.py)
            kwargs = dict(op.kwargs)
            if op.target in (GROUPED_DISPATCH, GROUPED_COMBINE):  # the rows' blocks, from their type
                kwargs["rows"] = tuple(_row_axes(op.types[0], prog))
                if op.target == GROUPED_COMBINE:
                    kwargs["size"] = op.types[0].local_shape_for(sizes)[0]
            node = graph.call_function(experts.FUNCTIONS[op.target], tuple(arg(op.args)), kwargs)
        elif op.target == "aten.embedding" and _vocab_axes(op, types, prog):
            w, ids = op.args[0], op.args[1]
            pad = op.args[2] if len(op.args) > 2 else op.kwargs.get("padding_idx", -1)
            node = graph.call_function(
                vocab_parallel_embedding,
                (env[w.name], env[ids.name]),
                {"axes": _vocab_axes(op, types, prog), "padding_idx": pad, "vocab": types[w.name].shape[0]},
            )
        elif is_keyed(op.target, op.args):
            site = _dropout_site(op, prog, coords, device, root.autopar_rng)
            setattr(root, f"autopar_dropout_{site.key}", site)
            site_node = graph.get_attr(f"autopar_dropout_{site.key}")
            node = graph.call_function(keyed.keyed_dropout, (env[op.args[0].name], site_node))
        elif op.target == "aten.cross_entropy_loss" and _class_axes(op, types, prog):
            logits, target = op.args[0], op.args[1]
            reduction = op.args[3] if len(op.args) > 3 else op.kwargs.get("reduction", 1)
            ignore = op.args[4] if len(op.args) > 4 else op.kwargs.get("ignore_index", -100)
            node = graph.call_function(
                vocab_parallel_cross_entropy,
                (env[logits.name], env[target.name], _class_axes(op, types, prog), reduction, ignore),
                {"classes": types[logits.name].shape[1]},
            )
        elif op.target == "aten.scaled_dot_product_attention" and (ring := _ring_axis(op, types, prog)):
            q, k, v, *rest = arg(op.args)
            node = graph.call_function(ring_sdpa, (q, k, v, ring), dict(zip(_SDPA_ARGS, rest), **arg(op.kwargs)))
        elif op.target == "aten.scaled_dot_product_attention" and _causal_query_axes(op, types, prog):
            q, k, v, *rest = arg(op.args)
            kwargs = dict(zip(_SDPA_ARGS, rest), **arg(op.kwargs))
            axes = _causal_query_axes(op, types, prog)
            node = graph.call_function(query_block_sdpa, (q, k, v, axes), kwargs)
        elif op.target in GROUPED_MM and (ep := _grouped_expert_axis(op, types, prog)):
            x = types[op.args[0].name]
            kwargs = {"kernel": _callable(op), "axis": ep, "experts": types[op.args[1].name].shape[0]}
            kwargs["rows"] = tuple(_row_axes(x, prog))
            if op.attrs.get(CAPACITY) is not None:  # each expert's first rows only (passes/experts.py set_capacity)
                kwargs["capacity"] = op.attrs[CAPACITY]
            if op.attrs.get(EP_ROWS):  # on rows an expert_grouped_dispatch sent (passes/experts.py)
                fn, kwargs["size"] = experts.expert_local_grouped_mm, x.local_shape_for(sizes)[0]
            else:  # a program that has not been through insert_expert_dispatch: the exchanges inside the op
                fn = experts.expert_grouped_mm
            node = graph.call_function(fn, tuple(arg(op.args)), {**arg(op.kwargs), **kwargs})
        elif op.target in GROUPED_MM and op.attrs.get(CAPACITY) is not None:  # rows over capacity dropped
            kwargs = {"kernel": _callable(op), "rows": tuple(_row_axes(types[op.args[0].name], prog))}
            kwargs["capacity"] = op.attrs[CAPACITY]
            node = graph.call_function(experts.capacity_grouped_mm, tuple(arg(op.args)), {**arg(op.kwargs), **kwargs})
        elif op.target in GROUPED_MM and _row_axes(types[op.args[0].name], prog):
            node = graph.call_function(
                grouped_rows, (_callable(op), _row_axes(types[op.args[0].name], prog), *arg(op.args)), arg(op.kwargs)
            )
        else:
            args = dev(arg(local_args(op, sizes)))
            kwargs = {k: dev(v) for k, v in arg(op.kwargs).items()}
            node = graph.call_function(DIFFERENTIABLE.get(op.target) or _callable(op), args, kwargs)
        if len(op.results) == 1 and not op.target.startswith("aten.split") and op.target not in _LIST_RESULTS:
            env[op.result] = node
            node.meta["autopar_value"] = op.result  # the IR value it computes (autopar check records it)
        else:
            for i, r in enumerate(op.results):
                env[r] = graph.call_function(_getitem, (node, i))
                env[r].meta["autopar_value"] = r
        node.meta["path"] = op.path

    for op in prog.ops:
        if op.result not in done:
            emit(op)
    graph.output(tuple(map_refs(list(prog.outputs), lambda r: env[r.name])))
    gm = fx.GraphModule(root, graph, class_name="RankModule")
    gm.autopar_rng = root.autopar_rng  # read by no node (the sites hold it): GraphModule would not copy it
    return gm


# grouped matmuls: x[S, K] rows grouped by expert, w[E, K, N], offs[E] the groups' cumulative row ends
GROUPED_MM = frozenset({"aten._grouped_mm", "transformers.grouped_mm_fallback"})


def _grouped_expert_axis(op: Op, types, prog: Program) -> str | None:
    """The expert axis on which a grouped matmul is expert-parallel (``solver/sharding/experts.py``), or None."""
    refs = op.input_refs()
    axes = grouped_expert_axes([types[r.name] for r in refs], [types[r.name].placements for r in refs])
    if len(axes) > 1:
        raise PlanError(f"%{op.result} = {op.target} is split over its experts on {len(axes)} mesh axes; use one")
    return prog.mesh.names[axes[0]] if axes else None


def _row_axes(x, prog: Program) -> list[str]:
    """Mesh axes over which a grouped matmul's ``x`` is split by rows in contiguous blocks (outer first)."""
    return [name for p, name in zip(x.placements, prog.mesh.names) if isinstance(p, Shard) and p.dim == 0]


def grouped_rows(fn, axes: list[str], x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None = None, **kwargs):
    """``fn(x, w, offs)`` on this rank's block of rows (its block over ``axes``, outer axis first, as
    vocab-parallel lookups find theirs): the whole offsets shifted to the block and clipped to it, so a group
    before the block or after it is empty here."""
    if offs is None:
        offs = kwargs.pop("offs")
    c = current_comm()
    block = 0
    for a in axes:
        block = block * c.sizes[a] + c.coords[a]
    local = (offs.to(torch.int64) - block * x.shape[0]).clamp(0, x.shape[0]).to(offs.dtype)
    return fn(x, w, local, **kwargs)


def _callable(op: Op):
    """The torch op ``op.target`` names; an UnsupportedOpError naming it where none is registered (a plan's
    program read from a file whose custom op's library this process has not imported)."""
    try:
        return resolve_target(op.target)
    except KeyError as e:
        raise UnsupportedOpError(
            f"%{op.result} = {op.target} ({op.path or 'no module path'}): {e.args[0]}; import the library that "
            "registers it on every rank before building the model"
        ) from None


def _returned_scalar_sums(prog: Program, types, users) -> set[str]:
    """The all-reduces of a scalar that only the program returns (the loss): returned in flight and
    waited for when read (``runtime/comm/lazy.py``), so a backward does not wait for them."""
    returned = {r.name for r in prog.outputs if isinstance(r, Ref)}
    return {
        op.result
        for op in prog.ops
        if op.target == "all_reduce" and op.result in returned and not users[op.result] and types[op.result].shape == ()
    }


def _bias_adds(prog: Program, types, users) -> dict[str, tuple[Op, str]]:
    """add result -> (the matmul it adds a bias to, the bias) for each ``aten.add.Tensor`` of a 1-D
    bias to the local result of a two-operand ``aten.mm`` / ``aten.linear`` that nothing else reads:
    the pairs lowering split from ``addmm`` and biased ``linear`` (passes/lower.py), fused again."""
    producers = prog.producers()
    sizes = prog.mesh.sizes
    out: dict[str, tuple[Op, str]] = {}
    for op in prog.ops:
        if op.target != "aten.add.Tensor" or op.kwargs or len(op.args) != 2:
            continue
        if not all(isinstance(a, Ref) for a in op.args):
            continue
        for mm_ref, bias in (op.args, op.args[::-1]):
            mm = producers[mm_ref.name]
            if not isinstance(mm, Op) or mm.target not in ("aten.mm", "aten.linear") or len(mm.args) != 2:
                continue
            out_shape = types[mm.result].local_shape_for(sizes)
            b = types[bias.name]
            if (
                len(users[mm.result]) == 1
                and b.local_shape_for(sizes) == out_shape[-1:]
                and b.dtype == types[mm.result].dtype
                and types[op.result].local_shape_for(sizes) == out_shape
            ):
                out[op.result] = (mm, bias.name)
                break
    return out


# ops a fused group may run ahead of their place to have its weights (views and casts of values it can read)
_HOISTABLE = {
    "aten.t",
    "aten.transpose.int",
    "aten.permute",
    "aten.view",
    "aten.reshape",
    "aten._unsafe_view",
    "aten.to.dtype",
    "aten._to_copy",
    "aten.contiguous",
}


def _ready(group: ColumnGroup, env: dict, producers: dict, emit: Callable[[Op], None], done: set[str]) -> bool:
    """Whether every weight and bias of ``group`` can be read where its f stands: already emitted, or a view or
    cast of such values, which is then emitted there (``done``). Nothing emitted before f depends on f."""
    needed = [r.weight for r in group.readers] + [r.bias for r in group.readers if r.bias is not None]
    plan: list[Op] = []

    def reach(name: str) -> bool:
        if name in env or any(name in p.results for p in plan):
            return True
        p = producers.get(name)
        if not isinstance(p, Op) or p.target not in _HOISTABLE or len(p.results) != 1:
            return False
        if not all(reach(r.name) for r in p.input_refs()):
            return False
        plan.append(p)
        return True

    if not all(reach(n) for n in needed):
        return False
    for p in plan:
        emit(p)
        done.add(p.result)
    return True


def _emit_group(graph: fx.Graph, group: ColumnGroup, env: dict, done: set[str]) -> None:
    """One call for f and all its readers; each reader's value is its output."""
    readers = group.readers
    node = graph.call_function(
        column_linears,
        (
            env[group.f.args[0].name],
            tuple(env[r.weight] for r in readers),
            tuple(env[r.bias] if r.bias is not None else None for r in readers),
            tuple(r.kind for r in readers),
            group.f.kwargs["axis"],
        ),
    )
    node.meta["path"] = group.f.path
    for i, r in enumerate(readers):
        env[r.result] = graph.call_function(_getitem, (node, i))
        env[r.result].meta["autopar_value"] = r.result
        env[r.result].meta["path"] = r.op.path
        done.update(r.skipped)


def _dropout_site(op: Op, prog: Program, coords, device, rng: keyed.DropoutRng) -> keyed.DropoutSite:
    """The rank's keyed-dropout site of a dropout op numbered by passes/dropout.py."""
    if "rng" not in op.attrs:
        raise PlanError(
            f"dropout %{op.result} ({op.path or 'no module path'}) has no dropout key: the program was planned "
            "by an older autopar; plan it again (autopar plan, or compile without plan=)"
        )
    t = op.type
    return keyed.DropoutSite.of(
        rng,
        op.attrs["rng"],
        float(op.args[1]),
        t.shape,
        op.attrs.get("batch_dim"),
        t.placements,
        prog.mesh.names,
        prog.mesh.sizes,
        coords,
        device,
    )


_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")  # after q, k, v


def _ring_axis(op: Op, types, prog: Program) -> str | None:
    """The mesh axis (of more than one rank) over which an attention is ring attention (queries, keys and values
    split on the sequence, ``solver/sharding/rules/context.py``), or None."""
    q, k = types[op.args[0].name], types[op.args[1].name]
    for p_q, p_k, name, n in zip(q.placements, k.placements, prog.mesh.names, prog.mesh.sizes):
        if n > 1 and is_ring(q, k, p_q, p_k):
            return name
    return None


def _causal_query_axes(op: Op, types, prog: Program) -> list[str]:
    """Mesh axes over which a causal attention's query sequence is split (context parallelism's query blocks:
    each rank's mask on its global rows, ``runtime/comm/context_attention.py``)."""
    kwargs = dict(zip(_SDPA_ARGS, op.args[3:]), **op.kwargs)
    if not kwargs.get("is_causal"):
        return []
    q = types[op.args[0].name]
    seq = len(q.shape) - 2
    return [name for p, name in zip(q.placements, prog.mesh.names) if isinstance(p, Shard) and p.dim == seq]


def _vocab_axes(op: Op, types, prog: Program) -> list[str]:
    """Mesh axes over which an embedding's table is split by rows (vocab-parallel lookups)."""
    w = types[op.args[0].name]
    return [name for p, name in zip(w.placements, prog.mesh.names) if isinstance(p, Shard) and p.dim == 0]


def _class_axes(op: Op, types, prog: Program) -> list[str]:
    """Mesh axes over which a cross-entropy's logits are split by class (vocab-parallel losses)."""
    logits = types[op.args[0].name]
    return [name for p, name in zip(logits.placements, prog.mesh.names) if isinstance(p, Shard) and p.dim == 1]


@dataclass(frozen=True)
class CodegenOptions:
    """The ``codegen`` pass's options: ``codegen``'s arguments besides the program."""

    coords: dict[str, int]
    get_tensor: Callable[[str], torch.Tensor]
    device: torch.device | str = "cpu"
    local_tensor: Callable[[Value], torch.Tensor] | None = None
    rng: keyed.DropoutRng | None = None
    overlap_tp: bool = True


def codegen_pass(prog: Program, options: CodegenOptions) -> fx.GraphModule:
    """The ``codegen`` pass: the GraphModule of ``prog`` on the rank ``options`` describe."""
    o = options
    return codegen(prog, o.coords, o.get_tensor, o.device, o.local_tensor, o.rng, o.overlap_tp)


def module_code(gm: fx.GraphModule) -> str:
    """``codegen``'s dump: the generated Python."""
    return gm.code


register_pass("codegen", codegen_pass, dump=module_code, suffix=".py")


def _getitem(xs, i):
    return xs[i]


def _owner(root: torch.nn.Module, qualname: str) -> tuple[torch.nn.Module, str]:
    *path, attr = qualname.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, torch.nn.Module())
        mod = getattr(mod, p)
    return mod, attr


__all__ = [
    "GROUPED_MM", "CodegenOptions", "Ref", "codegen", "codegen_pass", "grouped_rows", "local_args", "shard_param",
]  # fmt: skip
