"""The docstring examples that are complete programs run as written (doctest), so the
documentation cannot drift from the code. Examples elsewhere are sketches (they use a
`model` or files they do not create) and are not collected."""
import doctest
import importlib

import pytest

MODULES = ["tercomp.ternary_pack", "tercomp.dimexpr", "tercomp.dtypes", "tercomp.ir.literals",
           "tercomp.kernels.table", "tercomp.kernels.template",
           "tercomp.kernels.ternary.strategies", "tercomp.kernels.ternary.builder",
           "tercomp.kernels.ternary.blocked", "tercomp.codegen.targets",
           "tercomp.models.config", "tercomp.runtime.sampling", "tercomp.runtime.speculative", "tercomp.cli", "tercomp.cli.base",
           "tercomp.serve.tools"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name))    # prints what failed
    assert result.attempted > 0, f"{name} has no doctest examples left"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} fail"
