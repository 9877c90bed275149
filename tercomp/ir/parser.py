"""Parse tern IR text (as printed by printer.py, or written by hand) back into a Graph.

Errors are ParseErrors naming the line and column. Given the op registry's `OpRules`
(tercomp.ops.RULES; `tercomp.ops.parse` passes them), result types of ops are recomputed
by the registry's shape rules and checked against the printed types, so symbolic dims
come back as the same sympy expressions they were traced with. Without rules only the
syntax, the types and the names are checked, and op bodies cannot be read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..errors import ParseError
from .graph import Graph, SourceLoc, UNKNOWN_LOC
from .lexer import tokenize
from .literals import LiteralError, read_dense, unescape
from .types import DTYPES, MAX_DIM, TensorType, as_dim, is_static, numpy_dtype

# Limits that keep hostile text from exhausting the stack or the memory.
MAX_ATTR_DEPTH = 32        # nesting of [...] in attributes
MAX_REGION_DEPTH = 8       # nesting of op bodies (a scan in a scan in ...)


@dataclass(frozen=True)
class OpRules:
    """What the IR layer needs to know of ops, given by the op registry (tercomp.ops.RULES):
    infer(opname, operand_types, attrs) -> list[TensorType], raising on a bad op; and
    region_args(opname, operand_types, attrs) -> [(attr name, [input TensorType])], one
    pair per body region of the op (a body's input types follow from its op's operands)."""
    infer: Callable
    region_args: Callable


_MLIR_TO_DTYPE = {v[1]: k for k, v in DTYPES.items()}


class _Parser:
    def __init__(self, text: str, filename: str, rules: Optional[OpRules] = None):
        self.filename = filename
        self.rules = rules
        self.toks = tokenize(text, filename)
        self.i = 0
        self.depth = 0          # region nesting of the op being parsed

    # -- token helpers ---------------------------------------------------------------
    @property
    def tok(self):
        return self.toks[self.i]

    def error(self, msg, tok=None, hint=None):
        tok = tok or self.tok
        return ParseError(f"{msg} (found {tok.text or 'end of input'!r})",
                          loc=SourceLoc(self.filename, tok.line, tok.col), hint=hint)

    def accept(self, text):
        if self.tok.text == text:
            self.i += 1
            return True
        return False

    def expect(self, text):
        if not self.accept(text):
            raise self.error(f"expected {text!r}")

    def expect_kind(self, kind):
        t = self.tok
        if t.kind != kind:
            raise self.error(f"expected a {kind}")
        self.i += 1
        return t

    # -- grammar -----------------------------------------------------------------------
    def parse_type(self) -> TensorType:
        t = self.expect_kind("tensor")
        body = t.text[len("tensor<"):-1]
        parts = body.split("x")
        elem = parts[-1]
        if elem not in _MLIR_TO_DTYPE:
            raise ParseError(f"unknown element type {elem!r}", loc=SourceLoc(self.filename, t.line, t.col),
                             hint=f"use one of {sorted(_MLIR_TO_DTYPE)}")
        dims = []
        for p in parts[:-1]:
            if p == "?":
                dims.append(None)
            elif p.isdigit() and len(p) <= 13 and int(p) <= MAX_DIM:
                dims.append(int(p))
            elif p.isdigit():
                raise ParseError(f"dimension {p[:20]} in {t.text[:60]} is larger than {MAX_DIM}",
                                 loc=SourceLoc(self.filename, t.line, t.col))
            else:
                raise ParseError(f"bad dimension {p!r} in {t.text}", loc=SourceLoc(self.filename, t.line, t.col))
        return dims, _MLIR_TO_DTYPE[elem]

    def parse_types(self, close=")"):
        out = []
        if self.accept(close):
            return out
        while True:
            out.append((self.tok, self.parse_type()))
            if self.accept(close):
                return out
            self.expect(",")

    def parse_attr(self, depth=0):
        t = self.tok
        if t.text in ("true", "false"):
            self.i += 1
            return t.text == "true"
        if t.kind == "string":
            self.i += 1
            try:
                return unescape(t.text[1:-1])
            except LiteralError as e:
                raise self.error(str(e), t) from None
        if t.kind == "number":
            self.i += 1
            num = t.text
            ty = None
            if self.accept(":"):
                ty = self.expect_kind("ident").text
            if ty in ("f64", "f32", "f16") or ("." in num) or "inf" in num or num == "nan":
                if num.lower().startswith(("0x", "-0x")) and ty:
                    bits = int(num, 16)
                    return float(np.array(bits, dtype=np.uint64).view(np.float64))
                return float(num)
            return int(num, 16) if num.lower().lstrip("-").startswith("0x") else int(num)
        if t.text == "[":
            if depth >= MAX_ATTR_DEPTH:
                raise self.error(f"attribute lists nested deeper than {MAX_ATTR_DEPTH}")
            self.i += 1
            items = []
            if self.accept("]"):
                return items
            while True:
                items.append(self.parse_attr(depth + 1))
                if self.accept("]"):
                    return items
                self.expect(",")
        if t.kind == "dense":
            self.i += 1
            self.expect(":")
            ttok = self.tok
            dims, dtype = self.parse_type()
            return _DenseLiteral(t, ttok, dims, dtype)
        raise self.error("expected an attribute value")

    def parse_attr_dict(self):
        out = {}
        self.expect("{")
        if self.accept("}"):
            return out
        while True:
            key = self.expect_kind("ident").text
            self.expect("=")
            out[key] = self.parse_attr()
            if self.accept("}"):
                return out
            self.expect(",")

    def parse_loc(self):
        if not self.accept("loc"):
            return UNKNOWN_LOC
        self.expect("(")
        f = self.expect_kind("string").text[1:-1]
        self.expect(":")
        line = int(self.expect_kind("number").text)
        col = 0
        if self.accept(":"):
            col = int(self.expect_kind("number").text)
        self.expect(")")
        return SourceLoc(f, line, col)

    def parse(self) -> Graph:
        wrapped = self.accept("module")
        if wrapped:
            self.expect("{")
        g = self.parse_func()
        if wrapped:
            self.expect("}")
        if self.tok.kind != "eof":
            raise self.error("expected end of input after the function")
        return g

    def parse_func(self) -> Graph:
        self.expect("func.func")
        g = Graph(name=self.expect_kind("symbol").text[1:])
        env = {}
        self.expect("(")
        if not self.accept(")"):
            while True:
                vt = self.expect_kind("value")
                self.expect(":")
                ttok = self.tok
                dims, dtype = self.parse_type()
                attrs = self.parse_attr_dict() if self.tok.text == "{" else {}
                names = attrs.get("tern.dims")
                if names is not None:
                    if len(names) != len(dims):
                        raise self.error("tern.dims has a different rank than the type", ttok)
                    bad = [n for n in names if not isinstance(n, (str, int)) or isinstance(n, bool)]
                    if bad:
                        raise self.error(f"bad tern.dims: {bad[0]!r} is not a dimension", ttok)
                    try:
                        dims = [as_dim(n) for n in names]
                    except (ParseError, ValueError) as e:
                        raise self.error(f"bad tern.dims: {getattr(e, 'message', e)}", ttok) from None
                elif any(d is None for d in dims):
                    dims = [d if d is not None else f"{vt.text[1:]}_d{k}" for k, d in enumerate(dims)]
                name = vt.text[1:]
                if name in env:
                    raise self.error(f"value %{name} defined twice", vt)
                v = g.add_input(name, TensorType(tuple(dims), dtype))
                env[name] = v
                if self.accept(")"):
                    break
                self.expect(",")
        self.expect("->")
        if self.accept("("):
            self.parse_types()
        else:
            self.parse_type()
        fattrs = self.parse_attr_dict() if self.accept("attributes") else {}
        self.expect("{")
        while True:
            if self.tok.text in ('"func.return"', "return"):
                self.parse_return(g, env, fattrs)
                self.expect("}")
                return g
            self.parse_op(g, env)

    def lookup(self, env, tok):
        name = tok.text[1:]
        if name not in env:
            raise self.error(f"use of undefined value %{name}", tok)
        return env[name]

    def parse_values(self, env, close=")"):
        vals = []
        if self.accept(close):
            return vals
        while True:
            vals.append(self.lookup(env, self.expect_kind("value")))
            if self.accept(close):
                return vals
            self.expect(",")

    def parse_return(self, g, env, fattrs):
        if self.accept("return"):
            vals = []
            if self.tok.kind == "value":
                while True:
                    vals.append(self.lookup(env, self.expect_kind("value")))
                    if not self.accept(","):
                        break
                self.expect(":")
                while True:
                    self.parse_type()
                    if not self.accept(","):
                        break
        else:
            self.i += 1
            self.expect("(")
            vals = self.parse_values(env)
            self.expect(":")
            self.expect("(")
            self.parse_types()
            self.expect("->")
            self.expect("(")
            self.expect(")")
        self.parse_loc()
        names = fattrs.get("tern.output_names")
        if names is not None and len(names) != len(vals):
            names = None
        g.set_outputs(vals, names)

    def parse_op(self, g, env):
        results = []
        if self.tok.kind == "value":
            while True:
                results.append(self.expect_kind("value"))
                if not self.accept(","):
                    break
            self.expect("=")
        name_tok = self.expect_kind("string")
        full = name_tok.text[1:-1]
        if not full.startswith("tern."):
            raise self.error(f"unknown op {full!r}: only tern ops may appear in tern IR", name_tok)
        opname = full[len("tern."):]
        self.expect("(")
        operands = self.parse_values(env)
        region_start = self.i if self.tok.text == "(" else None
        if region_start is not None:
            self.skip_regions()
        attrs = self.parse_attr_dict() if self.tok.text == "{" else {}
        self.expect(":")
        self.expect("(")
        in_types = self.parse_types()
        self.expect("->")
        if self.accept("("):
            out_types = self.parse_types()
        else:
            out_types = [(self.tok, self.parse_type())]
        loc = self.parse_loc()
        if len(in_types) != len(operands):
            raise self.error(f"{full} has {len(operands)} operands but {len(in_types)} operand types", name_tok)
        for (ttok, (dims, dtype)), v in zip(in_types, operands):
            self.check_type(ttok, dims, dtype, v.type, f"operand %{v.name}")
        if len(out_types) != len(results):
            raise self.error(f"{full} has {len(results)} results but {len(out_types)} result types", name_tok)
        for k, a in list(attrs.items()):
            if isinstance(a, _DenseLiteral):
                attrs[k] = a.to_numpy(self)
        if region_start is not None:
            end = self.i
            self.i = region_start
            attrs.update(self.parse_regions(g, opname, operands, attrs, name_tok))
            self.i = end
        if self.rules is not None:
            try:
                types = self.rules.infer(opname, [v.type for v in operands], attrs)
            except ParseError:
                raise
            except Exception as e:
                raise _rule_error(full, e, SourceLoc(self.filename, name_tok.line, name_tok.col)) from None
            if len(types) != len(results):
                raise self.error(f"{full} produces {len(types)} results, not {len(results)}", name_tok)
        else:
            types = [TensorType(tuple(d if d is not None else f"d{k}" for k, d in enumerate(dims)), dt)
                     for _, (dims, dt) in out_types]
        for (ttok, (dims, dtype)), t in zip(out_types, types):
            self.check_type(ttok, dims, dtype, t, "result")
        op = g.add_op(opname, operands, attrs, types, loc, names=[r.text[1:] for r in results])
        for rtok, r in zip(results, op.results):
            if rtok.text[1:] in env:
                raise self.error(f"value {rtok.text} defined twice", rtok)
            if r.name != rtok.text[1:]:
                raise self.error(f"value name {rtok.text} clashes with another", rtok)
            env[r.name] = r

    # -- regions (op bodies) -------------------------------------------------------------
    # The generic syntax puts regions before the attributes, but a body's input types
    # follow from the op's operands and attributes: the regions are skipped first, then
    # parsed once the attributes are known.
    def skip_regions(self):
        start, depth = self.tok, 0
        while True:
            t = self.tok
            if t.kind == "eof":
                raise self.error("unterminated region", start)
            if t.text in ("(", "{"):
                depth += 1
                if depth > 2 * MAX_REGION_DEPTH + 2:
                    raise self.error(f"regions nested deeper than {MAX_REGION_DEPTH}", t)
            elif t.text in (")", "}"):
                depth -= 1
            self.i += 1
            if depth == 0:
                return

    def parse_regions(self, g, opname, operands, attrs, name_tok) -> dict:
        if self.depth >= MAX_REGION_DEPTH:
            raise self.error(f"regions nested deeper than {MAX_REGION_DEPTH}", name_tok)
        if self.rules is None:
            raise self.error("op bodies need the op registry's rules", name_tok,
                             hint="parse with tercomp.ops.parse")
        try:
            sigs = self.rules.region_args(opname, [v.type for v in operands], attrs)
        except ParseError:
            raise
        except Exception as e:
            raise _rule_error(f"tern.{opname}", e, SourceLoc(self.filename, name_tok.line, name_tok.col)) from None
        self.expect("(")
        out = {}
        for k, (name, types) in enumerate(sigs):
            if k:
                self.expect(",")
            self.depth += 1
            out[name] = self.parse_region(g, types)
            self.depth -= 1
        self.expect(")")
        return out

    def parse_region(self, parent: Graph, types) -> Graph:
        """`{ ^bb0(%a: T, ...): ops "tern.yield"(...) : (...) -> () }` into a Graph whose
        names share the enclosing function's namespace (names are unique function-wide)."""
        body = Graph(name=f"{parent.name}.body", _names=parent._names)
        env = {}
        self.expect("{")
        label = self.expect_kind("label")
        args = []
        if self.accept("("):
            if not self.accept(")"):
                while True:
                    vt = self.expect_kind("value")
                    self.expect(":")
                    args.append((vt, self.tok, self.parse_type()))
                    if self.accept(")"):
                        break
                    self.expect(",")
        self.expect(":")
        if len(args) != len(types):
            raise self.error(f"the body takes {len(types)} arguments, the block has {len(args)}", label)
        for (vt, ttok, (dims, dtype)), t in zip(args, types):
            self.check_type(ttok, dims, dtype, t, f"block argument {vt.text}")
            name = vt.text[1:]
            if name in env or name in parent._names:
                raise self.error(f"value %{name} defined twice", vt)
            env[name] = body.add_input(name, t)
        while self.tok.text != '"tern.yield"':
            if self.tok.kind == "eof" or self.tok.text == "}":
                raise self.error('expected "tern.yield" at the end of the body')
            self.parse_op(body, env)
        self.i += 1
        self.expect("(")
        outs = self.parse_values(env)
        self.expect(":")
        self.expect("(")
        out_types = self.parse_types()
        self.expect("->")
        self.expect("(")
        self.expect(")")
        self.parse_loc()
        if len(out_types) != len(outs):
            raise self.error(f"tern.yield has {len(outs)} values but {len(out_types)} types")
        for (ttok, (dims, dtype)), v in zip(out_types, outs):
            self.check_type(ttok, dims, dtype, v.type, f"yielded %{v.name}")
        self.expect("}")
        body.set_outputs(outs)
        return body

    def check_type(self, tok, dims, dtype, t: TensorType, what):
        ok = dtype == t.dtype and len(dims) == len(t.shape) and all(
            (d is None and not is_static(e)) or d == e for d, e in zip(dims, t.shape))
        if not ok:
            raise ParseError(f"{what} has type {t.mlir()} but the text says {tok.text}",
                             loc=SourceLoc(self.filename, tok.line, tok.col))


def _rule_error(op: str, e: Exception, loc: SourceLoc) -> ParseError:
    """An op rule (shape inference, region signature) rejected the op: its message and
    hint (a TercompError's) at the op's position in the text."""
    return ParseError(f"{op}: {getattr(e, 'message', e)}", loc=loc, hint=getattr(e, "hint", None))


class ElidedConstant:
    """Stands in for a constant whose data was elided from the text: it knows its shape
    and dtype (so types are recomputed) but cannot be evaluated or compiled."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = math.prod(self.shape)


class _DenseLiteral:
    def __init__(self, tok, ttok, dims, dtype):
        self.tok, self.ttok, self.dims, self.dtype = tok, ttok, dims, dtype

    def to_numpy(self, p: _Parser):
        text = self.tok.text
        if any(d is None for d in self.dims):
            raise p.error("a constant must have a static shape", self.ttok)
        shape = tuple(self.dims)
        if text.startswith("dense_resource"):
            return ElidedConstant(shape, numpy_dtype(self.dtype))
        try:
            return read_dense(text[len("dense<"):-1], shape, numpy_dtype(self.dtype))
        except LiteralError as e:
            raise ParseError(f"malformed dense literal: {e}",
                             loc=SourceLoc(p.filename, self.tok.line, self.tok.col)) from None


def parse(text: str, filename: str = "<string>", rules: Optional[OpRules] = None) -> Graph:
    """Parse tern IR text into a Graph, checking each op by `rules` (see the module
    docstring; `tercomp.ops.parse(text)` is this with the registry's rules). Raises
    ParseError with line and column."""
    p = _Parser(text, filename, rules)
    try:
        return p.parse()
    except ParseError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, ArithmeticError) as e:
        # a malformed token the grammar let through (a number out of range, ...)
        raise p.error(f"malformed input: {e}") from None
    except (RecursionError, MemoryError) as e:
        raise p.error(f"input too large or nested too deeply ({type(e).__name__})") from None
