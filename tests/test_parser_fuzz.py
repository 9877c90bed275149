"""Malformed IR text never escapes as anything but a TercompError (and never crashes)."""
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import tercomp as tc
from tercomp.ir import parse

_TEXT = str(tc.trace(lambda x, w: tc.softmax(tc.matmul(x, w), axis=-1).sum(axis=0),
                     tc.spec(("B", 4)), np.ones((4, 3), np.float32)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(_TEXT) - 1), st.integers(0, 8),
                          st.text(alphabet='%"(){}[]<>:,=x?0123456789abcdefghijklmnoptern.-@ \n', max_size=6)),
                min_size=1, max_size=4))
def test_mutated_ir_parses_or_raises_a_tercomp_error(edits):
    text = _TEXT
    for pos, cut, insert in edits:
        pos = min(pos, len(text))
        text = text[:pos] + insert + text[pos + cut:]
    try:
        g = parse(text, "fuzz.tern.mlir")
    except tc.TercompError as e:
        assert e.loc is None or e.loc.line >= 1
        return
    assert str(g)   # whatever parsed prints again


def test_the_unmutated_text_parses():
    assert str(parse(_TEXT)) == _TEXT
