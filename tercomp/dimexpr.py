"""Symbolic dimension expressions as text ("B", "2*B + 1", "floor(T/2)"): a small grammar,
never `eval` or `sympy.parse_expr`.

IR text, saved signatures and CLI arguments spell symbolic dims the way sympy prints
them. This leaf module reads that text into a tree, with limits on length, nesting and
exponents, and evaluates the tree either with concrete sizes (the runtime, the CLI) or
into sympy expressions (the compiler, through `tercomp.ir.types.parse_dim`):

    expr    := term (("+" | "-") term)*
    term    := unary (("*" | "/" | "//") unary)*
    unary   := "-" unary | power
    power   := atom ["**" INT]            (exponent at most MAX_EXPONENT, base a name or INT)
    atom    := INT | NAME | "(" expr ")" | ("floor" | "ceiling") "(" expr ")"

>>> evaluate(parse("2*B + floor(T/2)"), {"B": 3, "T": 5})
8
"""
from __future__ import annotations

import math
import re
from fractions import Fraction

from .errors import ParseError

MAX_LENGTH = 512        # characters of one dim expression
MAX_DEPTH = 32          # nesting of parentheses and unary minus
MAX_EXPONENT = 8
MAX_DIGITS = 19         # an integer literal fits in int64

_TOKEN = re.compile(r"\s*(?:(?P<int>\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>\*\*|//|[-+*/()]))")
_FUNCS = ("floor", "ceiling")


class _Reader:
    def __init__(self, text: str):
        if not isinstance(text, str):
            raise ParseError(f"a dimension expression must be text, got {type(text).__name__}")
        if len(text) > MAX_LENGTH:
            raise ParseError(f"dimension expression of {len(text)} characters (at most {MAX_LENGTH})")
        self.text, self.toks, pos = text, [], 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                if text[pos:].strip() == "":
                    break
                raise self.error(f"unexpected character {text[pos]!r} at column {pos + 1}")
            kind = m.lastgroup
            self.toks.append((kind, m.group(kind)))
            pos = m.end()
        self.toks.append(("eof", ""))
        self.i = 0
        self.depth = 0

    def error(self, msg):
        return ParseError(f"cannot read the dimension {self.text!r}: {msg}",
                          hint="write symbolic dims as names, integers, + - * // and parentheses")

    def peek(self):
        return self.toks[self.i]

    def take(self, text=None):
        kind, tok = self.toks[self.i]
        if text is not None and tok != text:
            raise self.error(f"expected {text!r}, found {tok or 'end of input'!r}")
        self.i += 1
        return kind, tok

    def nest(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(f"nested deeper than {MAX_DEPTH}")

    def expr(self):
        self.nest()
        node = self.term()
        while self.peek()[1] in ("+", "-"):
            op = {"+": "add", "-": "sub"}[self.take()[1]]
            node = (op, node, self.term())
        self.depth -= 1
        return node

    def term(self):
        node = self.unary()
        while self.peek()[1] in ("*", "/", "//"):
            op = {"*": "mul", "/": "div", "//": "floordiv"}[self.take()[1]]
            node = (op, node, self.unary())
        return node

    def unary(self):
        if self.peek()[1] == "-":
            self.take()
            self.nest()
            node = ("neg", self.unary())
            self.depth -= 1
            return node
        return self.power()

    def power(self):
        kind = self.peek()[0]
        node = self.atom()
        if self.peek()[1] == "**":
            self.take()
            if kind not in ("int", "name") or node[0] not in ("int", "sym"):
                raise self.error("only a name or an integer may be raised to a power")
            ekind, etok = self.take()
            if ekind != "int" or int(etok) > MAX_EXPONENT:
                raise self.error(f"an exponent must be an integer from 0 to {MAX_EXPONENT}")
            node = ("pow", node, int(etok))
        return node

    def atom(self):
        kind, tok = self.take()
        if kind == "int":
            if len(tok) > MAX_DIGITS:
                raise self.error(f"integer {tok[:24]}... has more than {MAX_DIGITS} digits")
            return ("int", int(tok))
        if kind == "name" and tok in _FUNCS:
            self.take("(")
            node = (tok, self.expr())
            self.take(")")
            return node
        if kind == "name":
            return ("sym", tok)
        if tok == "(":
            node = self.expr()
            self.take(")")
            return node
        raise self.error(f"expected a number, a name or '(', found {tok or 'end of input'!r}")


def parse(text: str) -> tuple:
    """Read a dim expression into a tree of tuples: ("int", 3), ("sym", "B"),
    ("add" | "sub" | "mul" | "div" | "floordiv", a, b), ("neg", a), ("pow", a, n),
    ("floor" | "ceiling", a). Raises ParseError."""
    r = _Reader(text)
    tree = r.expr()
    if r.peek()[0] != "eof":
        raise r.error(f"unexpected {r.peek()[1]!r} after the expression")
    return tree


def names(tree) -> set:
    """The symbol names a tree uses."""
    if tree[0] == "sym":
        return {tree[1]}
    return set().union(*(names(c) for c in tree[1:] if isinstance(c, tuple)))


def fold(tree, symbol, integer, floor, ceiling):
    """Evaluate `tree` with the given leaves and rounding functions (any number type
    with + - * / // and integer powers: Fraction, sympy, ...)."""
    op = tree[0]
    if op == "int":
        return integer(tree[1])
    if op == "sym":
        return symbol(tree[1])
    if op == "pow":
        return fold(tree[1], symbol, integer, floor, ceiling) ** tree[2]
    args = [fold(c, symbol, integer, floor, ceiling) for c in tree[1:]]
    if op == "neg":
        return -args[0]
    if op == "floor":
        return floor(args[0])
    if op == "ceiling":
        return ceiling(args[0])
    a, b = args
    if op in ("div", "floordiv") and b == 0:
        raise ParseError("division by zero in a dimension expression")
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul":
        return a * b
    return a / b if op == "div" else a // b


def evaluate(tree, bindings: dict) -> int:
    """The integer value of `tree` given {name: int}. Raises KeyError naming an unbound
    symbol and ParseError for a value that is not an integer."""
    def symbol(n):
        return Fraction(int(bindings[n]))
    v = fold(tree, symbol, Fraction, math.floor, math.ceil)
    if isinstance(v, Fraction) and v.denominator != 1:
        raise ParseError(f"dimension evaluates to {v}, not an integer")
    return int(v)
