"""The pass manager: named passes, verification after each, a dump after each.

A pass is a function Graph -> Graph registered with `@register_pass("name")`. Options
reach a pass as keyword arguments. With a dump directory, stage k is written to
`NN-<stage>.tern.mlir` (constants elided); `stages` keeps every stage's text.
"""
from __future__ import annotations

import os
from typing import Callable

from ..errors import ConfigError
from ..ir import Graph
from ..ops import verify

PASSES: dict[str, Callable] = {}


def register_pass(name: str):
    def deco(fn):
        PASSES[name] = fn
        return fn
    return deco


def get_pass(name: str) -> Callable:
    if name not in PASSES:
        raise ConfigError(f"unknown pass {name!r}", hint=f"known passes: {', '.join(sorted(PASSES))}")
    return PASSES[name]


class Dumper:
    """Collects stage texts and, with a directory, writes them as numbered files."""

    def __init__(self, dump_dir: str | None = None):
        self.dump_dir = dump_dir or os.environ.get("TERCOMP_DUMP") or None
        self.stages: dict[str, str] = {}
        self.counter = 0
        if self.dump_dir:
            os.makedirs(self.dump_dir, exist_ok=True)

    def add(self, stage: str, text: str, ext: str = "tern.mlir"):
        self.stages[stage] = text
        if self.dump_dir:
            path = os.path.join(self.dump_dir, f"{self.counter:02d}-{stage}.{ext}")
            with open(path, "w") as f:
                f.write(text)
        self.counter += 1


def run_pipeline(graph: Graph, passes, dumper: Dumper | None = None, options: dict | None = None) -> Graph:
    """Run `passes` (names, or (name, kwargs) pairs) verifying after each."""
    verify(graph, "tracing")
    if dumper is not None and "tern" not in dumper.stages:
        dumper.add("tern", str(graph))
    for p in passes:
        name, kwargs = (p, {}) if isinstance(p, str) else p
        kwargs = {**(options or {}).get(name, {}), **kwargs}
        meta = graph.meta
        graph = get_pass(name)(graph, **kwargs)
        for k, v in meta.items():
            graph.meta.setdefault(k, v)
        verify(graph, f"the {name} pass")
        if dumper is not None:
            dumper.add(name, str(graph))
    return graph
