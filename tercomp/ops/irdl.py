"""Generate the `tern` dialect's IRDL definition from the registry.

    python -m tercomp.ops.irdl > dialects/tern.irdl.mlir

The printed IR of any graph then verifies with
`iree-opt --irdl-file=dialects/tern.irdl.mlir FILE.tern.mlir` (operand, result and
attribute names and counts). A test keeps the checked-in file in sync.
"""
from __future__ import annotations

from . import REGISTRY


def generate() -> str:
    lines = ["// Generated from tercomp's op registry by `python -m tercomp.ops.irdl`. Do not edit.",
             "irdl.dialect @tern {"]
    for name in sorted(REGISTRY):
        opdef = REGISTRY[name]
        lines.append(f"  irdl.operation @{name} {{")
        n = opdef.num_operands
        k = 0
        operands = []
        if n is None:
            lines.append(f"    %{k} = irdl.any")
            operands.append(f"operands: variadic %{k}")
            k += 1
        else:
            for i in range(n):
                lines.append(f"    %{k} = irdl.any")
                operands.append(f"x{i}: %{k}")
                k += 1
        lines.append(f"    irdl.operands({', '.join(operands)})")
        attrs = [a for a, d in opdef.attrs.items() if d is not None]
        if attrs:
            entries = []
            for a in attrs:
                lines.append(f"    %{k} = irdl.any")
                entries.append(f'"{a}" = %{k}')
                k += 1
            lines.append(f"    irdl.attributes {{{', '.join(entries)}}}")
        lines.append(f"    %{k} = irdl.any")
        if opdef.num_results is None:
            lines.append(f"    irdl.results(results: variadic %{k})")
        else:
            lines.append(f"    irdl.results({', '.join(f'r{i}: %{k}' for i in range(opdef.num_results))})")
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(generate(), end="")
