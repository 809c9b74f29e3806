"""Lower an exported fx graph to the autopar IR: SSA ops with global types, params, paths, FLOPs."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from autopar.errors import CaptureError, UnsupportedOpError
from autopar.ir.core import (
    DEVICE,
    DTYPE_SHORT,
    MeshSpec,
    Op,
    Program,
    R,
    Ref,
    TensorType,
    Value,
    resolve_target,
    target_name,
)
from autopar.passes.capture import Captured
from autopar.passes.dropout import key_dropouts
from autopar.passes.experts import mark_expert_blocks
from autopar.passes.functionalize import functionalize
from autopar.passes.repeat_layers import expand_layers

# Random ops autopar draws itself (passes/dropout.py, runtime/build/rng.py); any other random op is refused.
_KEYED_RANDOM = {"aten.dropout", "aten.scaled_dot_product_attention"}
# Ops that only check metadata at trace time; on the meta device they mean nothing.
_DROPPED = {"aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_constrain_range_for_size"}


def _draws_random(node: torch.fx.Node) -> bool:
    """Whether the op draws from torch's generator: tagged nondeterministic_seeded, unless its schema's
    own `dropout` probability is 0 or its `train` flag is off (nn.GRU/LSTM/RNN without dropout)."""
    op = node.target
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    names = [a.name for a in op._schema.arguments]
    if "dropout" not in names or "train" not in names:
        return True
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    return bool(bound.get("dropout")) and bool(bound.get("train"))


def tensor_type(val: Any, mesh: MeshSpec, where: str = "") -> TensorType:
    at = f" ({where})" if where else ""
    if not isinstance(val, torch.Tensor):
        raise CaptureError(f"autopar's IR holds tensors; the graph produced a {type(val).__name__} ({val!r}){at}")
    if val.dtype not in DTYPE_SHORT:
        raise CaptureError(f"dtype {val.dtype} is not supported by autopar's IR{at}")
    if not all(is_concrete_int(s) for s in val.shape):
        raise CaptureError(
            f"a tensor whose shape depends on the data ({list(val.shape)}){at}: autopar plans fixed shapes. Keep "
            "shapes static, e.g. torch.where(mask, x, 0).sum() instead of x[mask].sum(), or a fixed-size topk"
        )
    shape = tuple(int(s) for s in val.shape)
    return TensorType(DTYPE_SHORT[val.dtype], shape, (R,) * len(mesh.axes))


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.removeprefix("L['self'].").removeprefix("L__self__.")


def lower(captured: Captured, mesh: MeshSpec | None = None) -> Program:
    """fx graph -> Program with every placement R. A non-tensor input (a float or bool argument) is
    baked into the ops by torch.export: it is no program input, and ``attrs["constant_inputs"]`` keeps
    its position among the call's input leaves and its value (a call must pass the same). In-place
    ops and writes through views become out-of-place ops first (passes/functionalize.py). addmm and
    biased linear are split into a matmul and an add, so a row-parallel matmul can produce a partial
    sum before its bias. A planning capture of a few layers standing for the rest (``Captured.repeat``) lowers
    to the program of the whole model (``passes/repeat_layers.py``)."""
    mesh = mesh or MeshSpec()
    ep = captured.exported
    placeholders = [n.name for n in ep.graph_module.graph.nodes if n.op == "placeholder"]
    specs = dict(zip(placeholders, ep.graph_signature.input_specs))
    buffers = frozenset(n for n, spec in specs.items() if spec.kind == InputKind.BUFFER)
    params = {n: spec.target for n, spec in specs.items() if spec.kind == InputKind.PARAMETER}
    gm = functionalize(ep.graph_module, buffers, params)
    names: dict[str, Any] = {}  # fx node name -> Ref, or a tuple of Refs for multi-result ops
    inputs: list[Value] = []
    constants: list[tuple[int, Any]] = []  # (leaf of the call's inputs, value) of each non-tensor input
    leaf = iter(range(1 << 62))
    for spec, node in zip(ep.graph_signature.input_specs, (n for n in gm.graph.nodes if n.op == "placeholder")):
        kind = {
            InputKind.PARAMETER: "param",
            InputKind.BUFFER: "buffer",
            InputKind.USER_INPUT: "input",
            InputKind.CONSTANT_TENSOR: "buffer",
        }.get(spec.kind)
        if kind is None:
            raise CaptureError(f"input {node.name} of kind {spec.kind.name} is not supported by autopar")
        index = next(leaf) if kind == "input" else -1
        if isinstance(spec.arg, ConstantArgument):  # a non-tensor input: torch.export baked its value in
            constants.append((index, spec.arg.value))
            continue
        name = spec.target if kind != "input" else spec.arg.name
        attrs = {"constant": True} if spec.kind == InputKind.CONSTANT_TENSOR else {}
        if kind == "param" and not getattr(ep.state_dict.get(name), "requires_grad", True):
            attrs = {"frozen": True}  # requires_grad=False: trained by no one, given no gradient
        inputs.append(Value(name, kind, tensor_type(node.meta["val"], mesh), attrs))
        names[node.name] = Ref(name)

    ops: list[Op] = []
    counter = iter(range(1 << 62))

    def conv(x: Any) -> Any:
        if isinstance(x, torch.fx.Node):
            ref = names.get(x.name)
            if ref is None or isinstance(ref, tuple):
                raise CaptureError(f"node {x.name} is used as a tensor but is not one")
            return ref
        if isinstance(x, torch.device):
            return DEVICE
        if isinstance(x, (list, tuple)):
            return type(x)(conv(v) for v in x)
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise CaptureError("autopar needs static shapes; the graph has a symbolic size")
        return x

    def emit(target: str, args: tuple, kwargs: dict, vals: list, node: torch.fx.Node) -> tuple[str, ...]:
        types = tuple(tensor_type(v, mesh, f"{target} at {_module_path(node) or node.name}") for v in vals)
        results = tuple(str(next(counter)) for _ in types)
        op = Op(results, types, target, args, kwargs, path=_module_path(node))
        ops.append(op)
        return results

    _lower_nodes(gm, gm.graph.nodes, names, conv, emit)

    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = []
    for spec, arg in zip(ep.graph_signature.output_specs, out_node.args[0]):
        if spec.kind != OutputKind.USER_OUTPUT:
            raise CaptureError(
                f"the model mutates {spec.target} in forward ({spec.kind.name}); in-place buffer updates "
                "(e.g. BatchNorm running statistics) are not supported yet: use eval-mode norms or LayerNorm"
            )
        outputs.append(conv(arg) if isinstance(arg, torch.fx.Node) else arg)
    used = {r.name for op in ops for r in op.input_refs()} | {r.name for r in outputs if isinstance(r, Ref)}
    # a tied weight is listed under each of its names; keep the ones the graph reads
    inputs = [v for v in inputs if v.kind == "input" or v.name in used]
    attrs = {"constant_inputs": tuple(constants)} if constants else {}
    prog = Program(mesh, tuple(inputs), tuple(ops), tuple(outputs), attrs)
    if captured.repeat is not None:  # a planning capture of some layers: the program of all of them
        prog = expand_layers(prog, captured.repeat)
    return mark_expert_blocks(key_dropouts(annotate_costs(prog)))


def _lower_nodes(gm, nodes, names, conv, emit) -> Any:
    """Lower call_function nodes in order; inline wrap_with_set_grad_enabled subgraphs (LLaMA's
    rotary embedding is computed under no_grad). The results of a no_grad subgraph are detached: its
    inputs may need gradients (``with torch.no_grad(): s = h.norm()``), and none may flow through it."""
    for node in nodes:
        if node.op == "output":
            return node.args[0]
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            src, idx = node.args
            names[node.name] = names[src.name][idx]
            continue
        if node.target is torch.ops.higher_order.wrap_with_set_grad_enabled:
            sub = getattr(gm, node.args[1].target)
            placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
            for ph, operand in zip(placeholders, node.args[2:]):
                names[ph.name] = conv(operand)
            result = _lower_nodes(sub, sub.graph.nodes, names, conv, emit)
            refs = tuple(conv(r) for r in result)
            if not node.args[0]:  # computed under no_grad: no gradient flows back through the results
                refs = tuple(
                    Ref(emit("aten.detach", (r,), {}, [x.meta["val"]], node)[0]) if isinstance(r, Ref) else r
                    for r, x in zip(refs, result)
                )
            names[node.name] = refs
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            raise CaptureError(
                f"{node.target} at {_module_path(node) or node.name} is not an ATen op; autopar lowers ATen "
                "graphs only (higher-order ops such as cond/while_loop are not supported yet)"
            )
        target = target_name(node.target)
        if target in _DROPPED:
            continue
        _check_emittable(target, node)
        if _draws_random(node) and target not in _KEYED_RANDOM:
            raise CaptureError(
                f"{target} at {_module_path(node) or node.name} draws random numbers from torch's generator, "
                "whose stream differs between ranks, so a sharded run would not compute what one device computes; "
                "autopar keys only dropout (nn.Dropout, F.dropout, attention dropout) to the element's place in "
                "the model: use one of those, or move the random draw out of the model's forward"
            )
        val = node.meta.get("val")
        args, kwargs = conv(node.args), {k: conv(v) for k, v in node.kwargs.items()}
        if target == "aten.addmm" and not kwargs and len(args) == 3:
            bias, x, w = args
            (mm,) = emit("aten.mm", (x, w), {}, [val], node)
            (res,) = emit("aten.add.Tensor", (Ref(mm), bias), {}, [val], node)
            names[node.name] = Ref(res)
            continue
        if target == "aten.linear" and len(args) == 3 and args[2] is not None:
            x, w, bias = args
            (mm,) = emit("aten.linear", (x, w), {}, [val], node)
            (res,) = emit("aten.add.Tensor", (Ref(mm), bias), {}, [val], node)
            names[node.name] = Ref(res)
            continue
        if target == "aten.scaled_dot_product_attention" and _attention_dropout(args, kwargs):
            names[node.name] = _lower_attention_with_dropout(args, kwargs, node, emit)
            continue
        if target == "aten.scaled_dot_product_attention" and _sdpa_args(args, kwargs)[7]:
            args, kwargs = _repeat_grouped_heads(args, kwargs, node, emit)
        if target == "aten.cross_entropy_loss" and _mean_without_weight(args, kwargs):
            names[node.name] = _lower_mean_cross_entropy(args, kwargs, node, emit)
            continue
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        results = emit(target, args, kwargs, vals, node)
        names[node.name] = tuple(Ref(r) for r in results) if isinstance(val, (list, tuple)) else Ref(results[0])
    return None


def _check_emittable(target: str, node: torch.fx.Node) -> None:
    """Refuse, here rather than on the ranks, an op the generated code could not call: each rank's module calls
    ``resolve_target(target)`` (``runtime/build/codegen.py``), which must give back the op torch.export traced."""
    try:
        found = resolve_target(target)
    except KeyError as e:
        found = e
    if found is not node.target:
        raise UnsupportedOpError(
            f"the op {node.target._schema.name} at {_module_path(node) or node.name} is named {target!r} in autopar's "
            "IR, and that name "
            f"gives {'no op' if isinstance(found, KeyError) else found}, so no rank could call it. Import the library "
            "that registers the op before compiling (a custom op must be registered with torch.library on every "
            "rank), or replace it in the model's forward with ATen ops"
        )


_CROSS_ENTROPY_ARGS = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
_CROSS_ENTROPY_DEFAULTS = (None, None, None, 1, -100, 0.0)


def _cross_entropy_args(args: tuple, kwargs: dict) -> list:
    """cross_entropy_loss's arguments by position, defaults filled in."""
    return [
        args[i] if i < len(args) else kwargs.get(name, default)
        for i, (name, default) in enumerate(zip(_CROSS_ENTROPY_ARGS, _CROSS_ENTROPY_DEFAULTS))
    ]


def _mean_without_weight(args: tuple, kwargs: dict) -> bool:
    _, _, weight, reduction, _, _ = _cross_entropy_args(args, kwargs)
    return weight is None and reduction == 1


def _lower_mean_cross_entropy(args: tuple, kwargs: dict, node: torch.fx.Node, emit) -> Ref:
    """A mean cross-entropy is its sum over the targets that are not ``ignore_index`` divided by
    their count. As one op, rows split over ranks would make each rank's mean divide by its own count
    (a partial average is right only when every rank ignores as many targets); as sum / count both
    parts are partial sums over split rows, reduced before the division."""
    logits, target, _, _, ignore, smoothing = _cross_entropy_args(args, kwargs)
    val, target_val = node.meta["val"], node.args[1].meta["val"]
    (total,) = emit("aten.cross_entropy_loss", (logits, target, None, 2, ignore, smoothing), {}, [val], node)
    kept = torch.empty(target_val.shape, dtype=torch.bool, device="meta")
    (mask,) = emit("aten.ne.Scalar", (target, ignore), {}, [kept], node)
    (count,) = emit("aten.sum", (Ref(mask),), {}, [torch.empty((), dtype=torch.int64, device="meta")], node)
    (mean,) = emit("aten.div.Tensor", (Ref(total), Ref(count)), {}, [val], node)
    return Ref(mean)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


def _sdpa_args(args: tuple, kwargs: dict) -> list:
    return [args[i] if i < len(args) else kwargs.get(n, d) for i, (n, d) in enumerate(zip(_SDPA_ARGS, _SDPA_DEFAULTS))]


def _attention_dropout(args: tuple, kwargs: dict) -> bool:
    return float(_sdpa_args(args, kwargs)[4]) > 0.0


def _repeat_grouped_heads(args: tuple, kwargs: dict, node: torch.fx.Node, emit) -> tuple[tuple, dict]:
    """SDPA's ``enable_gqa`` (Hugging Face passes it when there is no mask) as its keys and values repeated to the
    query heads, then SDPA without it: the views Hugging Face's ``repeat_kv`` makes on its masked path (unsqueeze,
    expand, reshape: query head ``j`` reads key head ``j // groups``), so the attention splits on its query heads
    over any number of ranks dividing them and the cp all-gathers fold before the repeat, as before
    (``enable_gqa`` would bound the head split by the key heads)."""
    q, k, v = (a.meta["val"] for a in node.args[:3])
    groups = q.shape[-3] // k.shape[-3]
    args = list(args)
    for i, val in ((1, k), (2, v)) if groups > 1 else ():
        *lead, heads, seq, dim = val.shape
        one = val.unsqueeze(-3)
        wide = one.expand(*lead, heads, groups, seq, dim)
        rep = wide.reshape(*lead, heads * groups, seq, dim)
        (a,) = emit("aten.unsqueeze", (args[i], -3), {}, [one], node)
        (b,) = emit("aten.expand", (Ref(a), list(wide.shape)), {}, [wide], node)
        (c,) = emit("aten.reshape", (Ref(b), list(rep.shape)), {}, [rep], node)
        args[i] = Ref(c)
    if len(args) > 7:
        args[7] = False
    return tuple(args), {n: x for n, x in kwargs.items() if n != "enable_gqa"}


def _lower_attention_with_dropout(args: tuple, kwargs: dict, node: torch.fx.Node, emit) -> Ref:
    """``scaled_dot_product_attention`` with ``dropout_p > 0`` as PyTorch's math attention: scores,
    mask, softmax, dropout, weighted sum (grouped-query keys and values, ``enable_gqa``, repeated to the query
    heads first, each for its group of query heads). A fused kernel draws its dropout mask inside, from torch's
    stream generator; as ops the dropout is keyed like any other (runtime/build/rng.py), so every mesh and
    microbatch count draws the mask one device draws."""
    q, k, v, mask, p, causal, scale, gqa = _sdpa_args(args, kwargs)
    qv, kv, vv = (a.meta["val"] for a in node.args[:3])
    dev = qv.device
    scale = 1.0 / math.sqrt(qv.shape[-1]) if scale is None else float(scale)

    def call(target: str, *a, **kw) -> tuple[Ref, torch.Tensor]:
        """Emit ``target`` on (Ref, meta value) pairs and constants; its meta value comes from running it."""
        metas = [x[1] if isinstance(x, tuple) else x for x in a]
        val = resolve_target(target)(*metas, **{n: dev if x is DEVICE else x for n, x in kw.items()})
        (res,) = emit(target, tuple(x[0] if isinstance(x, tuple) else x for x in a), kw, [val], node)
        return Ref(res), val

    if gqa and kv.shape[-3] != qv.shape[-3]:  # query head j reads key head j // groups, as SDPA's enable_gqa
        groups = qv.shape[-3] // kv.shape[-3]
        k, kv = call("aten.repeat_interleave.self_int", (k, kv), groups, -3)
        v, vv = call("aten.repeat_interleave.self_int", (v, vv), groups, -3)
    kt = call("aten.transpose.int", (k, kv), -2, -1)
    scores = call("aten.mul.Scalar", call("aten.matmul", (q, qv), kt), scale)
    if causal:
        ones = call("aten.ones", [qv.shape[-2], kv.shape[-2]], dtype=torch.bool, device=DEVICE)
        keep = call("aten.tril", ones)
        scores = call("aten.masked_fill.Scalar", scores, call("aten.logical_not", keep), float("-inf"))
    if mask is not None:
        mv = node.args[3].meta["val"] if len(node.args) > 3 else node.kwargs["attn_mask"].meta["val"]
        if mv.dtype == torch.bool:
            scores = call("aten.masked_fill.Scalar", scores, call("aten.logical_not", (mask, mv)), float("-inf"))
        else:
            scores = call("aten.add.Tensor", scores, (mask, mv))
    probs = call("aten.softmax.int", scores, -1)
    dropped = call("aten.dropout", probs, float(p), True)
    out, _ = call("aten.matmul", dropped, (v, vv))
    return out


# ---------------------------------------------------------------------------------------------
# FLOPs and bytes per op (global, forward only)


def op_flops(op: Op, types: dict[str, TensorType]) -> int:
    t = op.target
    ins = [types[r.name] for r in op.input_refs()]
    out = op.types[0]
    if t == "aten.mm":
        (m, k), (_, n) = ins[0].shape, ins[1].shape
        return 2 * m * k * n
    if t in ("aten.bmm", "aten.matmul"):
        k = ins[0].shape[-1]
        return 2 * out.numel * k
    if t == "aten.linear":
        return 2 * out.numel * ins[1].shape[-1]
    if t in ("aten._grouped_mm", "transformers.grouped_mm_fallback") and len(ins[0].shape) == 2 == len(out.shape):
        return 2 * out.numel * ins[0].shape[-1]  # each row by its own expert's [K, N] matrix
    if t == "aten.scaled_dot_product_attention":
        q, k = ins[0], ins[1]
        return 4 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
    if t == "aten.convolution" or t == "aten.conv2d":
        w = ins[1]
        return 2 * out.numel * math.prod(w.shape[1:])
    if t in (
        "aten.layer_norm",
        "aten._softmax",
        "aten.softmax.int",
        "aten._log_softmax",
        "aten.log_softmax.int",
    ):
        return 5 * out.numel
    if t == "aten.cross_entropy_loss":
        return 4 * ins[0].numel
    if t == "aten.embedding":
        return 0
    return sum(o.numel for o in op.types)


def annotate_costs(prog: Program) -> Program:
    types = prog.types()
    ops = []
    for op in prog.ops:
        nbytes = sum(types[r.name].nbytes for r in op.input_refs()) + sum(t.nbytes for t in op.types)
        ops.append(op.with_(flops=op_flops(op, types), bytes=nbytes))
    return prog.with_(ops=tuple(ops))
