"""One decoder: tc.compile_lm compiles the model's own forward (with a KV cache), so what
a user changes in the model is what generation runs; the `kernels` pass, not the model
or the generator, picks the hand-written CPU dispatches."""
import numpy as np
import pytest

import tercomp as tc
from tercomp import models, nn
from tercomp.models.kv_cache import KVCache
from tercomp.passes import run_pipeline
from tercomp.tracing.tracer import apply

from conftest import run_filecheck

CFG = models.BitNetConfig(vocab_size=96, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64)
IDS = np.random.default_rng(1).integers(0, 96, 12).astype(np.int32)


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def forward(lm, ids):
    """The logits of the model's own forward of `ids` (one sequence), traced and run by
    the reference interpreter (what tc.compile(lm) computes, to 1e-6, without an IREE
    compile: 0.3 s against 3 s)."""
    from tercomp.ops import interpret
    return interpret(tc.trace(lm, ids[None]), ids[None])[0][0]


class DoubledMLP(models.bitnet.FeedForward):
    """A user's change to one block: the FFN's output doubled and shifted."""

    def forward(self, x):
        return super().forward(x) * 2.0 + 0.25


def lm_with_a_subclassed_mlp():
    nn.manual_seed(0)           # the same weights whatever ran before
    lm = models.BitNetLM(CFG)
    old = lm.layers[0].mlp
    new = DoubledMLP.__new__(DoubledMLP)
    new.__dict__.update(old.__dict__)
    lm.layers[0].mlp = new
    return lm


@pytest.mark.parametrize("output_dtype,tol", [("float32", 1e-3),
                                              pytest.param("float16", 1e-3, marks=pytest.mark.slow)])
def test_a_changed_model_is_what_generation_runs(output_dtype, tol):
    """The issue's case: a BitNetLM whose first MLP is subclassed gave logits through
    compile_lm 17% away from tc.compile(lm), which saw the subclass (as the traced
    forward does)."""
    lm = lm_with_a_subclassed_mlp()
    if output_dtype == "float16":       # the table generation reads, rounded once
        lm.embed_tokens.weight = lm.embed_tokens.weight.astype(np.float16).astype(np.float32)
    want = forward(lm, IDS)
    nn.manual_seed(0)
    plain = forward(models.BitNetLM(CFG), IDS)
    assert rel(plain, want) > 0.05            # the change matters
    gen = tc.compile_lm(lm, max_seq=32, kv_dtype="float32", output_dtype=output_dtype)
    assert rel(gen.prefill(IDS), want) <= tol
    gen.prefill(IDS[:5])
    steps = np.stack([gen.decode(int(t)) for t in IDS[5:]])
    assert rel(steps, want[5:]) <= tol


def test_a_weight_changed_after_loading_reaches_generation():
    nn.manual_seed(0)
    lm = models.BitNetLM(CFG)
    exact = dict(max_seq=16, kv_dtype="float32", output_dtype="float32")
    before = tc.compile_lm(lm, **exact).prefill(IDS[:4])
    lm.layers[1].post_attention_layernorm.weight = np.full(128, 3.0, np.float32)
    after = tc.compile_lm(lm, **exact).prefill(IDS[:4])
    want = forward(lm, IDS[:4])
    assert rel(before, want) > 0.01 and rel(after, want) <= 1e-3


def test_the_forward_with_a_cache_is_the_forward():
    """Traced with a KVCache over empty caches at position 0, the model's forward
    gives the logits of its forward without one (in the reference interpreter)."""
    from tercomp.ops import interpret
    lm = models.BitNetLM(CFG)
    n = 2 * CFG.num_hidden_layers

    def with_cache(ids, start, caches):
        cache = KVCache(caches, "f32", start=start)
        return lm(ids, cache=cache), cache.updated
    caches = [np.zeros((16, 2, 32), np.float32)] * n
    g = tc.trace(with_cache, IDS[None, :6], np.int32(0), caches)
    logits, *written = interpret(g, IDS[None, :6], np.int32(0), *caches)
    want = tc.trace(lm, IDS[None, :6])
    (ref,) = interpret(want, IDS[None, :6])
    assert rel(logits, ref) <= 1e-5
    assert np.abs(written[0][:6]).max() > 0 and np.abs(written[0][6:]).max() == 0


def test_kernels_pass_picks_cpu_dispatches_for_the_host_only():
    def f(x, c, s):
        n = apply("rms_norm", x.reshape(-1, 64), np.ones(64, np.float32))
        return apply("rope", n.reshape(1, -1, 2, 32), c, s)
    g = tc.trace(f, tc.spec((1, "T", 64)), tc.spec(("T", 16)), tc.spec(("T", 16)))
    host = str(run_pipeline(g, [("kernels", {"targets": ["llvm-cpu"]})]))
    run_filecheck(host, """
CHECK: "tern.rms_norm"{{.*}}kernel = "cpu"
CHECK: "tern.rope"{{.*}}kernel = "cpu"
""")
    for targets in (["vulkan"], ["llvm-cpu-generic"], ["llvm-cpu", "cuda"]):
        other = str(run_pipeline(g, [("kernels", {"targets": targets})]))
        assert 'kernel = "cpu"' not in other and other.count('kernel = "generic"') == 2


def test_stored_output_shares_one_table():
    lm = models.BitNetLM(CFG)
    view = lm.with_stored_output("int8")
    assert view.lm_head._table is view.embed_tokens._table
    assert view.layers is lm.layers and lm.lm_head is None
    assert isinstance(view.lm_head, nn.StoredLinear)
    assert lm.with_stored_output("float32") is lm
