"""`tercomp info`: an artifact's signature, targets, sizes and versions.

    tercomp info ARTIFACT [--json]

Reads the artifact's files only: needs neither IREE's compiler nor its runtime devices.
"""
from __future__ import annotations

import json
import os

from ..runtime.artifact import read
from ..runtime.signature import Signature


def add_parser(sub):
    """Add the `info` command to the subparsers `sub`."""
    i = sub.add_parser("info", help="show an artifact's signature, targets, sizes and versions")
    i.add_argument("artifact")
    i.add_argument("--json", action="store_true", help="print signature.json and sizes as JSON")
    i.set_defaults(run=run)
    return i


def run(args) -> int:
    meta, vmfb, weights = read(args.artifact)
    if args.json:
        print(json.dumps({**meta, "file_size": os.path.getsize(args.artifact), "vmfb_size": len(vmfb),
                          "weights_size": len(weights) if weights is not None else 0}, indent=1))
        return 0
    sig = Signature.from_json(meta["signature"])
    rows = [
        ("artifact", f"{args.artifact} ({os.path.getsize(args.artifact)} bytes)"),
        ("function", sig.function),
        *[("input", t.describe()) for t in sig.inputs],
        *[("output", t.describe()) for t in sig.outputs],
        ("targets", ", ".join(meta.get("targets", []))),
        ("devices", ", ".join(meta.get("drivers", []))),
        ("ternary", ", ".join(meta.get("ternary") or []) or "none"),
        ("module.vmfb", f"{len(vmfb)} bytes"),
        ("weights.irpa", f"{len(weights)} bytes" if weights is not None else "none"),
        ("tercomp", meta.get("tercomp_version", "?")),
        ("IREE", meta.get("iree_version", "?")),
        ("content hash", meta.get("content_hash", "?")),
        ("flags", " ".join(meta.get("flags", []))),
    ]
    for key, value in rows:
        print(f"{key + ':':14} {value}")
    return 0
