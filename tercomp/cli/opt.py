"""`tercomp opt`: passes run on a tern IR file, the result printed.

    tercomp opt FILE.tern.mlir|- --pass NAME [--pass NAME]... [--print-constants]

The IR parser and the passes are imported when the command runs.
"""
from __future__ import annotations

import sys

from ..errors import MissingDependency
from .base import UsageError


def add_parser(sub):
    """Add the `opt` command to the subparsers `sub`."""
    o = sub.add_parser("opt", help="run passes on a tern IR file and print the result",
                       description="Parse FILE (tern IR; - reads stdin), run the passes in order, print.")
    o.add_argument("file", metavar="FILE.tern.mlir")
    o.add_argument("--pass", dest="pass_names", action="append", metavar="NAME", help="a pass to run")
    o.add_argument("--print-constants", action="store_true", help="print large constants in full")
    o.set_defaults(run=run)
    return o


def run(args) -> int:
    import tercomp as tc
    if not hasattr(tc, "passes"):
        raise MissingDependency("tercomp opt needs iree-base-compiler", hint="pip install iree-base-compiler")
    from ..ir import print_graph
    from ..ops import parse
    from ..passes import run_pipeline
    from .. import autodiff  # noqa: F401  registers the autodiff pass
    if args.file == "-":
        try:
            text, filename = sys.stdin.read(), "<stdin>"
        except (OSError, UnicodeDecodeError) as e:     # no standard input, or not text
            raise UsageError(f"FILE is -, but standard input cannot be read as tern IR text "
                             f"({e}); give the file's path") from None
    else:
        try:
            with open(args.file) as f:
                text, filename = f.read(), args.file
        except UnicodeDecodeError as e:
            raise UsageError(f"{args.file} is not UTF-8 text (byte {e.start}): tercomp opt reads "
                             "tern IR text (.tern.mlir)") from None
        except (OSError, ValueError) as e:      # ValueError: a NUL in the path
            shown = args.file.replace("\0", "\\0")
            raise UsageError(f"cannot read {shown}: {getattr(e, 'strerror', None) or e}") from None
    graph = run_pipeline(parse(text, filename), args.pass_names or [])
    sys.stdout.write(print_graph(graph, elide=not args.print_constants))
    return 0
