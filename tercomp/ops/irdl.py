"""Generate the `tern` dialect's IRDL definition from the registry.

    python -m tercomp.ops.irdl > dialects/tern.irdl.mlir

The printed IR of any graph then verifies with
`iree-opt --irdl-file=dialects/tern.irdl.mlir FILE.tern.mlir` (operand, result and
attribute names and counts). A test keeps the checked-in file in sync.

Two limits of IRDL in IREE 3.13 (MLIR's IRDLVerifiers.cpp) reach op bodies: an IRDL op
cannot be declared a terminator, so a body ending in `tern.yield` fails the block
terminator check; and a constraint variable binds the first type it meets, so a variadic
operand list must have one type throughout (ConstraintVerifier::verify). The entries of
tern.scan and tern.checkpoint (region, attributes) are generated all the same; IR that
holds them is checked by tercomp's own verifier (tercomp.ir.verifier), which walks
bodies, and iree-opt rejects it for the two reasons above.
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
        # a region op's body is printed as its region, not as an attribute
        attrs = [a for a, d in opdef.attrs.items() if d is not None
                 and not (opdef.region_args is not None and a == "body")]
        if attrs:
            entries = []
            for a in attrs:
                lines.append(f"    %{k} = irdl.any")
                entries.append(f'"{a}" = %{k}')
                k += 1
            lines.append(f"    irdl.attributes {{{', '.join(entries)}}}")
        if opdef.region_args is not None:
            lines.append(f"    %{k} = irdl.region")
            lines.append(f"    irdl.regions(body: %{k})")
            k += 1
        lines.append(f"    %{k} = irdl.any")
        if opdef.num_results is None:
            lines.append(f"    irdl.results(results: variadic %{k})")
        else:
            lines.append(f"    irdl.results({', '.join(f'r{i}: %{k}' for i in range(opdef.num_results))})")
        lines.append("  }")
    lines += ["  irdl.operation @yield {",       # the terminator of op bodies
              "    %0 = irdl.any",
              "    irdl.operands(operands: variadic %0)",
              "    irdl.results()",
              "  }"]
    lines.append("}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(generate(), end="")
