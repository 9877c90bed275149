"""The tokenizer of tern IR text (the parser's first stage): one regular expression,
no backtracking into code, every token with its line and column."""
from __future__ import annotations

import re

from ..errors import ParseError
from .graph import SourceLoc

TOKEN = re.compile(r"""
    (?P<ws>\s+|//[^\n]*)
  | (?P<tensor>tensor<[^>]*>)
  | (?P<dense>dense<"[^"]*">|dense<[^<>]*>|dense_resource<[^>]*>)
  | (?P<value>%[A-Za-z0-9_.$\-]+)
  | (?P<symbol>@[A-Za-z0-9_.$\-]+)
  | (?P<label>\^[A-Za-z0-9_]+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<number>-?0x[0-9A-Fa-f]+|-?\d+\.\d*(?:[eE][-+]?\d+)?|-?\d+(?:[eE][-+]?\d+)?|-?inf|nan)
  | (?P<arrow>->)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<punct>[(){}\[\],:=<>?])
""", re.VERBOSE)


class Tok:
    __slots__ = ("kind", "text", "line", "col")

    def __init__(self, kind, text, line, col):
        self.kind, self.text, self.line, self.col = kind, text, line, col


def tokenize(text: str, filename: str) -> list[Tok]:
    """The tokens of `text` (whitespace and // comments dropped), ending with an "eof"
    token; a character no token starts with is a ParseError at its line and column."""
    toks = []
    pos, line, line_start = 0, 1, 0
    while pos < len(text):
        m = TOKEN.match(text, pos)
        if not m:
            raise ParseError(f"unexpected character {text[pos]!r}",
                             loc=SourceLoc(filename, line, pos - line_start + 1))
        kind = m.lastgroup
        if kind != "ws":
            toks.append(Tok(kind, m.group(), line, pos - line_start + 1))
        nl = m.group().count("\n")
        if nl:
            line += nl
            line_start = pos + m.group().rfind("\n") + 1
        pos = m.end()
    toks.append(Tok("eof", "", line, pos - line_start + 1))
    return toks
