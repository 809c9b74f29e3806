"""Parse the textual IR printed by ir/printer.py back into a Program."""

from __future__ import annotations

import ast
import re
from typing import Any

import torch

from autopar.errors import ParseError
from autopar.ir.core import (
    DEVICE,
    MeshSpec,
    Op,
    Partial,
    Placement,
    Program,
    R,
    Ref,
    Shard,
    TensorType,
    Value,
)

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<comment>\#.*$)
  | (?P<ref>%[\w.]+)
  | (?P<device>@device)
  | (?P<meshname>@\w+)
  | (?P<string>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
  | (?P<number>-?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+|inf(?![\w.]))|nan(?![\w.]))
  | (?P<name>[A-Za-z_][\w.]*)
  | (?P<punct>[()\[\]{}<>,=:|])
    """,
    re.VERBOSE,
)


class _Tokens:
    def __init__(self, line: str, lineno: int):
        self.toks: list[tuple[str, str]] = []
        self.comment = ""
        self.line, self.lineno = line, lineno
        pos = 0
        while pos < len(line):
            m = _TOKEN.match(line, pos)
            if not m:
                self.fail(f"unexpected character {line[pos]!r} at column {pos + 1}")
            pos = m.end()
            kind = m.lastgroup
            if kind == "ws":
                continue
            if kind == "comment":
                self.comment = m.group()[1:].strip()
                break
            self.toks.append((kind, m.group()))
        self.i = 0

    def fail(self, msg: str):
        raise ParseError(f"line {self.lineno}: {msg}\n    {self.line}")

    def peek(self, k: int = 0) -> tuple[str, str] | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def next(self) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            self.fail("unexpected end of line")
        self.i += 1
        return tok

    def expect(self, text: str) -> None:
        kind, val = self.next()
        if val != text:
            self.fail(f"expected {text!r}, found {val!r}")

    def accept(self, text: str) -> bool:
        tok = self.peek()
        if tok is not None and tok[1] == text:
            self.i += 1
            return True
        return False

    def done(self) -> bool:
        return self.i >= len(self.toks)


def _torch_enum(name: str) -> Any:
    attr = name.removeprefix("torch.")
    val = getattr(torch, attr, None)
    if isinstance(val, (torch.dtype, torch.layout, torch.memory_format)):
        return val
    return None


def _literal(t: _Tokens) -> Any:
    kind, val = t.next()
    if kind == "ref":
        return Ref(val[1:])
    if kind == "device":
        return DEVICE
    if kind == "string":
        return ast.literal_eval(val)
    if kind == "number":
        if val in ("inf", "-inf", "nan") or any(c in val for c in ".eE") and val not in ("inf",):
            return float(val)
        return int(val)
    if kind == "name":
        if val in ("True", "False", "None"):
            return {"True": True, "False": False, "None": None}[val]
        enum = _torch_enum(val)
        if enum is not None:
            return enum
        return val  # a bare word, e.g. an axis name in attributes
    if val == "[":
        return _sequence(t, "]")
    if val == "(":
        return tuple(_sequence(t, ")"))
    if val == "{":
        return _mapping(t, "}")
    t.fail(f"expected a value, found {val!r}")


def _sequence(t: _Tokens, close: str) -> list[Any]:
    out: list[Any] = []
    while not t.accept(close):
        out.append(_literal(t))
        if not t.accept(","):
            t.expect(close)
            break
    return out


def _mapping(t: _Tokens, close: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    while not t.accept(close):
        kind, key = t.next()
        if kind != "name":
            t.fail(f"expected a key, found {key!r}")
        t.expect("=")
        out[key] = _literal(t)
        if not t.accept(","):
            t.expect(close)
            break
    return out


def _placement(t: _Tokens) -> Placement:
    kind, val = t.next()
    if val == "R":
        return R
    if val == "S":
        t.expect("(")
        nums = [int(x) for x in _sequence(t, ")")]
        return Shard(*nums)
    if val == "P":
        t.expect("(")
        _, op = t.next()
        t.expect(")")
        return Partial(op)
    t.fail(f"expected a placement (R, S(d), P(op)), found {val!r}")


def _type(t: _Tokens) -> TensorType:
    kind, dtype = t.next()
    if kind != "name":
        t.fail(f"expected a dtype, found {dtype!r}")
    t.expect("[")
    shape = tuple(int(x) for x in _sequence(t, "]"))
    t.expect("{")
    placements: list[Placement] = []
    while not t.accept("}"):
        placements.append(_placement(t))
        if not t.accept(","):
            t.expect("}")
            break
    return TensorType(dtype, shape, tuple(placements))


def _mesh(t: _Tokens) -> MeshSpec:
    t.expect("[")
    axes = []
    while not t.accept("]"):
        _, name = t.next()
        t.expect("=")
        axes.append((name, int(t.next()[1])))
        if not t.accept(","):
            t.expect("]")
            break
    return MeshSpec(tuple(axes))


def _comment(text: str) -> tuple[str, int, int]:
    path, flops, nbytes = text, 0, 0
    if "|" in text:
        path, stats = text.split("|", 1)
        for item in stats.split():
            key, _, val = item.partition("=")
            if key == "flops":
                flops = int(val)
            elif key == "bytes":
                nbytes = int(val)
    return path.strip(), flops, nbytes


def parse(text: str) -> Program:
    """Parse IR text; raises ParseError naming the line on malformed input."""
    mesh = MeshSpec()
    inputs: list[Value] = []
    ops: list[Op] = []
    outputs: tuple[Any, ...] = ()
    attrs: dict[str, Any] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        t = _Tokens(line, lineno)
        kind, head = t.peek()
        if head == "mesh":
            t.next()
            t.next()  # @m
            t.expect("=")
            mesh = _mesh(t)
        elif head == "attr":
            t.next()
            _, key = t.next()
            t.expect("=")
            attrs[key] = _literal(t)
        elif head in ("param", "buffer", "input"):
            t.next()
            kind, ref = t.next()
            if kind != "ref":
                t.fail(f"expected %name after {head}")
            t.expect(":")
            ty = _type(t)
            vattrs = _mapping(t, ">") if t.accept("<") else {}
            inputs.append(Value(ref[1:], head, ty, vattrs))
        elif head == "output":
            t.next()
            outputs = tuple(_literal(t))
        elif kind == "ref":
            results = []
            while True:
                kind, ref = t.next()
                if kind != "ref":
                    t.fail(f"expected %name, found {ref!r}")
                results.append(ref[1:])
                if not t.accept(","):
                    break
            t.expect(":")
            types = [_type(t)]
            while t.accept(","):
                types.append(_type(t))
            t.expect("=")
            _, target = t.next()
            t.expect("(")
            args = tuple(_sequence(t, ")"))
            kwargs = _mapping(t, "}") if t.accept("{") else {}
            oattrs = _mapping(t, ">") if t.accept("<") else {}
            path, flops, nbytes = _comment(t.comment)
            ops.append(Op(tuple(results), tuple(types), target, args, kwargs, oattrs, path, flops, nbytes))
        else:
            t.fail(f"a line starts with mesh, attr, param, buffer, input, output or %name, not {head!r}")
        if not t.done():
            t.fail(f"unexpected {t.peek()[1]!r} at the end of the line")
    return Program(mesh, tuple(inputs), tuple(ops), outputs, attrs)
