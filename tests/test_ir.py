"""The IR: print/parse round-trip (property), the verifier, lowering of real models."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import ParseError, VerifyError
from autopar.ir.core import DEVICE, MeshSpec, Op, Partial, Program, R, Ref, Shard, TensorType, Value
from autopar.ir.parser import parse
from autopar.ir.printer import print_program
from autopar.ir.verify import verify
from autopar.models.resolve import build
from autopar.passes.capture import capture
from autopar.passes.lower import lower

placements = st.one_of(
    st.just(R),
    st.builds(Shard, st.integers(0, 3), st.sampled_from([1, 3])),
    st.builds(Partial, st.sampled_from(["sum", "avg"])),
)
names = st.from_regex(r"[a-z][a-z0-9_]{0,6}(\.[a-z0-9_]{1,5}){0,3}", fullmatch=True)
scalars = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.strided, torch.contiguous_format, DEVICE]),
)
literals = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner), max_leaves=6)


@st.composite
def programs(draw):
    n_axes = draw(st.integers(0, 2))
    mesh = MeshSpec(tuple((f"a{i}", draw(st.integers(1, 4))) for i in range(n_axes)))

    def ttype():
        shape = tuple(draw(st.lists(st.integers(0, 64), max_size=4)))
        return TensorType(
            draw(st.sampled_from(["f32", "bf16", "i64", "b8"])),
            shape,
            tuple(draw(placements) for _ in range(n_axes)),
        )

    inputs = tuple(
        Value(
            n,
            draw(st.sampled_from(["param", "buffer", "input"])),
            ttype(),
            draw(st.dictionaries(st.sampled_from(["grad_sync", "x"]), literals, max_size=1)),
        )
        for n in draw(st.lists(names, min_size=1, max_size=3, unique=True))
    )
    defined = [v.name for v in inputs]
    ops = []
    for i in range(draw(st.integers(0, 4))):
        k = draw(st.integers(1, 2))
        results = tuple(f"{i}_{j}" for j in range(k))
        args = tuple(draw(st.lists(st.one_of(literals, st.sampled_from(defined).map(Ref)), max_size=4)))
        kwargs = draw(st.dictionaries(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), literals, max_size=2))
        attrs = draw(st.dictionaries(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), literals, max_size=2))
        path = draw(st.from_regex(r"([a-z0-9_]{1,4}(\.[a-z0-9_]{1,4}){0,3})?", fullmatch=True))
        ops.append(
            Op(
                results,
                tuple(ttype() for _ in results),
                draw(st.sampled_from(["aten.view", "aten.add.Tensor", "all_reduce"])),
                args,
                kwargs,
                attrs,
                path,
                draw(st.integers(0, 10**12)),
                draw(st.integers(0, 10**12)),
            )
        )
        defined += results
    outputs = tuple(draw(st.lists(st.sampled_from(defined).map(Ref) | st.none(), max_size=3)))
    attrs = draw(st.dictionaries(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), literals, max_size=2))
    return Program(mesh, inputs, tuple(ops), outputs, attrs)


@settings(max_examples=150, deadline=None)
@given(programs())
def test_parse_print_roundtrip(prog):
    text = print_program(prog)
    assert parse(text) == prog, text


def test_strings_named_like_torch_enums_stay_strings():
    """A bare word is a string unless it names a torch dtype/layout/format (``float``, ``strided``): those
    are quoted when printed (hypothesis once drew ``grad_sync='float'``, which read back as torch.float32)."""
    attrs = {"a": "float", "b": "strided", "c": "long", "d": "tp", "e": torch.float32, "f": torch.strided}
    prog = Program(MeshSpec(()), (Value("x", "param", TensorType("f32", ()), attrs),), (), ())
    text = print_program(prog)
    assert "d=tp" in text and "a='float'" in text
    assert parse(text) == prog


def test_words_starting_like_inf_or_nan_stay_strings():
    """Hypothesis drew grad_sync='inf0': printed bare, it read back as the number inf followed by 0."""
    attrs = {"a": "inf0", "b": "nanx", "c": "inf.x", "d": float("inf"), "e": -float("inf")}
    prog = Program(MeshSpec(()), (Value("x", "param", TensorType("f32", ()), attrs),), (), ())
    assert parse(print_program(prog)) == prog


def _tiny_gpt2_program(mesh: MeshSpec | None = None):
    spec = build("tiny-gpt2")
    return lower(capture(spec.model, spec.args, spec.kwargs), mesh)


def test_lowered_gpt2_verifies_with_shapes_and_counts_parameters():
    prog = _tiny_gpt2_program(MeshSpec((("dp", 2), ("tp", 2))))
    verify(prog, shapes=True)
    assert parse(print_program(prog)) == prog
    spec = build("tiny-gpt2")
    # tied embeddings: the graph reads the shared weight once
    assert sum(v.type.numel for v in prog.params) == sum(p.numel() for p in spec.model.parameters())
    targets = {op.target for op in prog.ops}
    assert {"aten.mm", "aten.scaled_dot_product_attention", "aten.layer_norm", "aten.embedding"} <= targets
    assert all(op.flops >= 0 and op.bytes > 0 for op in prog.ops)


def test_verifier_names_the_problem():
    t = TensorType("f32", (4, 6), (R,))
    mesh = MeshSpec((("tp", 4),))
    good = Program(mesh, (Value("x", "input", t),), (Op(("0",), (t,), "aten.relu", (Ref("x"),)),), (Ref("0"),))
    verify(good)
    with pytest.raises(VerifyError, match="before it is defined"):
        verify(good.with_(ops=(Op(("0",), (t,), "aten.relu", (Ref("y"),)),)))
    with pytest.raises(VerifyError, match="not divisible"):
        verify(good.with_(inputs=(Value("x", "input", t.with_placements((Shard(1),))),)))
    with pytest.raises(VerifyError, match="placements for a mesh"):
        verify(good.with_(inputs=(Value("x", "input", t.with_placements((R, R))),)))
    with pytest.raises(VerifyError, match="defined twice"):
        verify(good.with_(ops=good.ops * 2))
    bad_ar = Op(("1",), (t,), "all_reduce", (Ref("0"),), {"axis": "tp", "op": "sum"})
    with pytest.raises(VerifyError, match="cannot turn R into R"):
        verify(good.with_(ops=good.ops + (bad_ar,)))


def test_parse_errors_name_the_line():
    with pytest.raises(ParseError, match="line 2"):
        parse("mesh @m = []\n%0 : f32[4] {} = aten.relu(%x\n")
    with pytest.raises(ParseError, match="line 1"):
        parse("bogus line\n")
