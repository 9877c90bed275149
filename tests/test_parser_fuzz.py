"""Malformed IR text never escapes as anything but a TercompError (and never crashes or
runs code). The CI budget is small; `pytest -m fuzz` runs the long campaign."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tercomp as tc
from tercomp.ops import parse


def _sample(x, w):
    y = tc.softmax(tc.matmul(x, w) + np.array([1.0, -2.5, 3.0], np.float32), axis=-1)
    z = tc.reshape(tc.concatenate([y, y], axis=0), (-1,))
    return z.sum(axis=0) * np.float32(0.5), tc.where(y > 0.25, y, np.zeros((1, 3), np.float32))


_TEXT = str(tc.trace(_sample, tc.spec(("B", 4)), np.ones((4, 3), np.float32)))
# every character that matters to the grammars, plus the ones eval would have liked
_ALPHABET = '%"(){}[]<>:,=x?*_/+-.0123456789abcdefghijklmnoprstuvwxyzBT@#\\\' \n\t'
_EDIT = st.tuples(st.integers(0, len(_TEXT) - 1), st.integers(0, 8),
                  st.one_of(st.text(alphabet=_ALPHABET, max_size=8),
                            st.sampled_from(["9" * 400, "**9**9", "[" * 200, "]" * 200, "(" * 100,
                                             "__import__('os')", "-1", "0x", "1e999", "nan", "?x"])))


def _check(edits):
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


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_EDIT, min_size=1, max_size=4))
def test_mutated_ir_parses_or_raises_a_tercomp_error(edits):
    _check(edits)


@pytest.mark.fuzz
@settings(max_examples=20000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_EDIT, min_size=1, max_size=8))
def test_mutated_ir_long_campaign(edits):
    _check(edits)


def test_the_unmutated_text_parses():
    assert str(parse(_TEXT)) == _TEXT
