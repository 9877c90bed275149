"""Stateful modules (tercomp/lowering/state.py) with the KV-cache ops: a one-layer
attention toy with its cache in two mutable globals, prefill and decode entry points in
one module, checked against an independent NumPy attention."""
import dataclasses

import numpy as np
import pytest

import tercomp as tc
from tercomp.codegen.iree_session import HOST_CPU_FLAGS, compile_module, new_session
from tercomp.lowering import Entry, StateVar, to_stateful_mlir
from tercomp.errors import CompileError
from tercomp.ir import TensorType
from tercomp.runtime.module import CompiledModule
from tercomp.runtime.signature import Signature
from tercomp.tracing.tracer import apply

from conftest import run_filecheck

S, H, KV, D, E = 16, 4, 2, 8, 32
rng = np.random.default_rng(0)
WQ, WK, WV = (rng.standard_normal((E, n)).astype(np.float32) / 6 for n in (H * D, KV * D, KV * D))


def step(x, start, kc, vc):
    q = (x @ WQ).reshape(-1, H, D)
    k = (x @ WK).reshape(-1, KV, D).astype("float16")
    v = (x @ WV).reshape(-1, KV, D).astype("float16")
    kc = apply("cache_write", kc, k, start)
    vc = apply("cache_write", vc, v, start)
    return apply("cached_attention", q, kc, vc, start, scale=D ** -0.5).reshape(-1, H * D), kc, vc


def numpy_attention(x):
    """Causal GQA attention over all rows of x, from scratch (f16-rounded k and v)."""
    t = x.shape[0]
    q = (x @ WQ).reshape(t, H, D).astype(np.float64)
    k = (x @ WK).reshape(t, KV, D).astype(np.float16).astype(np.float64)
    v = (x @ WV).reshape(t, KV, D).astype(np.float16).astype(np.float64)
    out = np.zeros((t, H, D))
    for i in range(t):
        for h in range(H):
            s = k[: i + 1, h // (H // KV)] @ q[i, h] / np.sqrt(D)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[: i + 1, h // (H // KV)]
    return out.reshape(t, H * D)


@pytest.fixture(scope="module")
def toy():
    cache = tc.spec((S, KV, D), "float16")
    gp = tc.trace(step, tc.spec(("T", E)), tc.spec((), "int32"), cache, cache, name="prefill_step")
    gd = tc.trace(step, tc.spec((1, E)), tc.spec((), "int32"), cache, cache, name="decode_step")
    state = [StateVar("k", TensorType((S, KV, D), "f16")), StateVar("v", TensorType((S, KV, D), "f16"))]
    bind_in, bind_out = {2: "k", 3: "v"}, {1: "k", 2: "v"}
    session, ctx = new_session()
    module = to_stateful_mlir([Entry("prefill", gp, bind_in, bind_out),
                               Entry("decode", gd, bind_in, bind_out),
                               Entry("step", gp, bind_in, bind_out),      # gp again
                               Entry("step_scalar", gp, bind_in, bind_out, frozenset({1}))],
                              state, ctx).module
    run_filecheck(str(module), """
        CHECK-LABEL: func.func @step_scalar(
        CHECK-SAME:    %[[X:.+]]: tensor<?x32xf32>, %[[S:.+]]: i32) -> tensor<?x32xf32>
        CHECK:         %[[T:.+]] = tensor.from_elements %[[S]] : tensor<i32>
        CHECK:         call @prefill_step(%[[X]], %[[T]],
        """)
    vmfb = compile_module(session, module, HOST_CPU_FLAGS)
    exe = CompiledModule(vmfb, dataclasses.replace(Signature.from_graph(gp), function="prefill"))
    return exe, gp


def test_prefill_then_decode_match_numpy(toy):
    exe, _ = toy
    prefill, decode = exe.function("prefill"), exe.function("decode")
    x = rng.standard_normal((12, E)).astype(np.float32)
    want = numpy_attention(x)
    got = prefill(x[:7], np.array(0, np.int32)).to_host()
    np.testing.assert_allclose(got, want[:7], atol=2e-5)
    for i in range(7, 12):             # each step reads the rows earlier calls wrote
        row = decode(x[i:i + 1], np.array(i, np.int32)).to_host()
        np.testing.assert_allclose(row, want[i:i + 1], atol=2e-5)


def test_prefill_restarts_and_caches_are_separate(toy):
    # k and v are two globals of one type and one initial shape: they must not alias
    # (IREE 3.13 fuses globals initialized from one deduplicated constant)
    exe, gp = toy
    prefill = exe.function("prefill")
    x = rng.standard_normal((5, E)).astype(np.float32)
    for _ in range(2):
        got = prefill(x, np.array(0, np.int32)).to_host()
        np.testing.assert_allclose(got, numpy_attention(x), atol=2e-5)
    zeros = np.zeros((S, KV, D), np.float16)
    ref = tc.ops.interpret(gp, x, np.int32(0), zeros, zeros)[0]
    np.testing.assert_allclose(got, ref, atol=2e-5)


def test_state_binding_errors():
    g = tc.trace(step, tc.spec((1, E)), tc.spec((), "int32"), tc.spec((S, KV, D), "float16"),
                 tc.spec((S, KV, D), "float16"), name="decode_step")
    _, ctx = new_session()
    bad_type = [StateVar("k", TensorType((S, KV, D), "f32"))]
    with pytest.raises(CompileError, match="does not have the type of state 'k'"):
        to_stateful_mlir([Entry("decode", g, {2: "k"}, {})], bad_type, ctx)
    with pytest.raises(CompileError, match="unknown state 'nope'"):
        to_stateful_mlir([Entry("decode", g, {2: "nope"}, {})], [], ctx)
    with pytest.raises(CompileError, match="static shape"):
        StateVar("k", TensorType(("S", KV, D), "f16"))


def test_a_scalar_start_runs_as_the_tensor_one(toy):
    # Entry.scalars: the 0-d start taken as a plain i32 (a Python int), the same results
    exe, _ = toy
    prefill, step = exe.function("prefill"), exe.function("step_scalar")
    x = rng.standard_normal((6, E)).astype(np.float32)
    want = numpy_attention(x)
    prefill(x[:3], np.array(0, np.int32))
    for i in range(3, 6):
        np.testing.assert_allclose(step(x[i:i + 1], i).to_host(), want[i:i + 1], atol=2e-5)


def test_scalar_inputs_must_be_unbound_0d_integers():
    cache = tc.spec((S, KV, D), "float16")
    g = tc.trace(step, tc.spec((1, E)), tc.spec((), "int32"), cache, cache, name="decode_step")
    state = [StateVar("k", TensorType((S, KV, D), "f16"))]
    _, ctx = new_session()
    for bad in (0, 2, 7):       # x [1, E], a bound cache, no such input
        with pytest.raises(CompileError, match="taken as a scalar"):
            to_stateful_mlir([Entry("decode", g, {2: "k"}, {}, frozenset({bad}))], state, ctx)


def test_entries_share_a_graph(toy):
    # "step" runs the prefill graph (T symbolic) on the same globals, one token at a time
    exe, _ = toy
    prefill, step = exe.function("prefill"), exe.function("step")
    x = rng.standard_normal((6, E)).astype(np.float32)
    want = numpy_attention(x)
    prefill(x[:2], np.array(0, np.int32))
    for i in range(2, 6):
        np.testing.assert_allclose(step(x[i:i + 1], np.array(i, np.int32)).to_host(),
                                   want[i:i + 1], atol=2e-5)

