"""Many streams: the slot ops (kv_scatter, slot_attention) against their references on
every kernel, compile_lm(max_batch=N)'s BatchedLMGenerator against the single-stream
generator, and runtime.Engine's continuous batching (requests joining and leaving,
chunked prefill, cancellation) against single-stream generation."""
import threading

import numpy as np
import pytest

import tercomp as tc
from tercomp import models, nn
from tercomp.kernels.table import AVX2, host_cpu_features
from tercomp.errors import InputError, TercompError
from tercomp.nn.stored import StoredTable
from tercomp.ops import get
from tercomp.runtime.batched import BatchedLMGenerator
from tercomp.runtime.devices import driver_present
from tercomp.runtime.scheduler import Engine, QueueFull
from tercomp.tracing.tracer import apply

from conftest import run_filecheck

CFG = models.BitNetConfig(vocab_size=96, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64)
MAX_SEQ = 48
needs_vulkan = pytest.mark.skipif(not driver_present("vulkan"),
                                  reason="no Vulkan device (apt-get install mesa-vulkan-drivers)")


# -- the ops ---------------------------------------------------------------------------------
N, S, KV, D, H = 3, 16, 2, 16, 4


def _slot_case(t, seed=0, kv="float16"):
    rng = np.random.default_rng(seed)
    slots = rng.integers(0, N, t).astype(np.int32)
    pos = rng.choice(S, t, replace=False).astype(np.int32)       # distinct (slot, pos) pairs
    return (rng.standard_normal((t, H, D)).astype(np.float32),
            rng.standard_normal((N, S, KV, D)).astype(kv),
            rng.standard_normal((N, S, KV, D)).astype(kv),
            rng.standard_normal((t, KV, D)).astype(kv), slots, pos)


def _slot_module(kernel, target="llvm-cpu", kv="float16"):
    def f(q, k, v, rows, slots, pos):
        k2 = apply("kv_scatter", k, rows, slots, pos)
        return apply("slot_attention", q, k2, v, slots, pos, scale=0.3, kernel=kernel), k2
    specs = [tc.spec(("T", H, D), "float32"), tc.spec((N, S, KV, D), kv),
             tc.spec((N, S, KV, D), kv), tc.spec(("T", KV, D), kv),
             tc.spec(("T",), "int32"), tc.spec(("T",), "int32")]
    return tc.compile(f, *specs, target=target, cache=False)


def _check_slot_module(m, kernel, ts=(1, 5, 9), kv="float16"):
    for t in ts:
        q, k, v, rows, slots, pos = _slot_case(t, seed=t, kv=kv)
        out, k2 = m(q, k, v, rows, slots, pos)
        want_k = get("kv_scatter").reference([k, rows, slots, pos], {})[0]
        want = get("slot_attention").reference([q, want_k, v, slots, pos],
                                               {"scale": 0.3, "kernel": kernel})[0]
        np.testing.assert_array_equal(np.asarray(k2), want_k)
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["cpu", "generic"])
def test_slot_ops_match_their_references(kernel):
    _check_slot_module(_slot_module(kernel), kernel)


@needs_vulkan
def test_slot_ops_on_vulkan():
    # f32 caches: the default Vulkan target has no 16-bit storage
    _check_slot_module(_slot_module("generic", target="vulkan", kv="float32"), "generic",
                       ts=(1, 5), kv="float32")


@pytest.mark.parametrize("kernel", ["cpu", "generic"])
def test_slot_attention_with_a_window(kernel):
    # a sliding-window layer's attention over slots: query t sees rows
    # positions[t] - W + 1 .. positions[t] of its slot, as a float64 brute force computes
    win = 5
    def f(q, k, v, slots, pos):
        return apply("slot_attention", q, k, v, slots, pos, scale=0.3, window=win, kernel=kernel)
    m = tc.compile(f, tc.spec(("T", H, D), "float32"), tc.spec((N, S, KV, D), "float32"),
                   tc.spec((N, S, KV, D), "float32"), tc.spec(("T",), "int32"),
                   tc.spec(("T",), "int32"), cache=False)
    q, k, v, _, slots, pos = _slot_case(9, seed=11, kv="float32")
    g = H // KV
    want = np.empty(q.shape)
    for t, (b, p) in enumerate(zip(slots, pos)):
        lo = max(0, p - win + 1)
        kk = np.repeat(k[b, lo:p + 1].astype(np.float64), g, axis=1)
        vv = np.repeat(v[b, lo:p + 1].astype(np.float64), g, axis=1)
        sc = np.einsum("hd,shd->hs", q[t].astype(np.float64), kk) * 0.3
        w = np.exp(sc - sc.max(-1, keepdims=True))
        want[t] = np.einsum("hs,shd->hd", w / w.sum(-1, keepdims=True), vv)
    ref = get("slot_attention").reference([q, k, v, slots, pos], {"scale": 0.3, "window": win})[0]
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(m(q, k, v, slots, pos)), want, rtol=1e-5, atol=1e-5)
    assert pos.max() >= win     # some query has rows outside its window


def test_slot_attention_reads_only_its_slot_up_to_its_position():
    q, k, v, rows, slots, pos = _slot_case(4)
    ref = get("slot_attention").reference
    base = ref([q, k, v, slots, pos], {"scale": 0.3})[0]
    k2, v2 = k.copy(), v.copy()
    for s in range(N):                  # garbage in every row no query may read
        for p in range(S):
            if not any(sl == s and p <= ps for sl, ps in zip(slots, pos)):
                k2[s, p], v2[s, p] = 1e4, -1e4
    m = _slot_module("cpu")
    out, _ = m(q, k2, v2, k2[slots, pos], slots, pos)
    np.testing.assert_allclose(np.asarray(out), base, rtol=1e-5, atol=1e-5)


def test_slot_attention_dispatches_the_cpu_kernel():
    run_filecheck(_slot_module("cpu").ir("mlir"), """
# CHECK: stream.executable private @tern_slot_attention_rows_4x2x16x3x16_f16
# CHECK:   workgroups(%[[M:.*]]: index)
# CHECK:   arith.muli %[[M]], %{{.*}} : index
# CHECK:   memref.load %{{.*}}[%{{.*}}] : memref<?xi32>
# CHECK:   vector.load %{{.*}}[%{{.*}}, %{{.*}}, %{{.*}}, %{{.*}}] : memref<3x16x2x16xf16>, vector<8xf16>
# CHECK: iree_linalg_ext.scatter
# CHECK: flow.dispatch @tern_slot_attention_rows_4x2x16x3x16_f16
""")


def _brute_slot_attention(q, k, v, slots, pos, scale, window=0):
    g = q.shape[1] // k.shape[2]
    want = np.empty(q.shape)
    for t, (b, p) in enumerate(zip(slots, pos)):
        lo = max(0, p - window + 1) if window else 0
        kk = np.repeat(k[b, lo:p + 1].astype(np.float64), g, axis=1)
        vv = np.repeat(v[b, lo:p + 1].astype(np.float64), g, axis=1)
        sc = np.einsum("hd,shd->hs", q[t].astype(np.float64), kk) * scale
        w = np.exp(sc - sc.max(-1, keepdims=True))
        want[t] = np.einsum("hs,shd->hd", w / w.sum(-1, keepdims=True), vv)
    return want


@pytest.mark.parametrize("kv_heads,prefetch,window,kv", [
    (2, 8, 0, "float16"), (4, 0, 0, "float32"), (2, 0, 11, "float16"), (1, 3, 0, "float16")])
def test_slot_attention_row_kernel_over_many_chunks(monkeypatch, kv_heads, prefetch, window, kv):
    # the row-wise slot kernel (attention_rows.mlir: a workgroup per query and group of KV
    # heads, rows 4 a step) with chunks of 8 rows: ragged positions per query (1..47, most
    # not a multiple of 4 or 8, several chunks), GQA and one query head per KV head,
    # with and without software prefetch, against a float64 brute force
    from tercomp.kernels.attention import attention_cpu
    monkeypatch.setattr(attention_cpu, "SCORE_BYTES", 8 * 4 * (H // attention_cpu.row_groups(kv_heads)))
    monkeypatch.setattr(attention_cpu, "ROW_PREFETCH", prefetch)
    n, s, d = 3, 48, 16
    win = {"window": window} if window else {}
    def f(q, k, v, slots, pos):
        return apply("slot_attention", q, k, v, slots, pos, scale=0.3, kernel="cpu", **win)
    m = tc.compile(f, tc.spec(("T", H, d), "float32"), tc.spec((n, s, kv_heads, d), kv),
                   tc.spec((n, s, kv_heads, d), kv), tc.spec(("T",), "int32"),
                   tc.spec(("T",), "int32"), cache=False)
    hg = H // attention_cpu.row_groups(kv_heads)
    assert f"memref<{hg}x8xf32>" in m.ir("mlir")     # the chunks' scores: 8 rows
    rng = np.random.default_rng(kv_heads + prefetch)
    k = rng.standard_normal((n, s, kv_heads, d)).astype(kv)
    v = rng.standard_normal((n, s, kv_heads, d)).astype(kv)
    for t, pos in [(1, [0]), (1, [46]), (7, [1, 2, 3, 9, 17, 30, 47])]:
        q = rng.standard_normal((t, H, d)).astype(np.float32)
        slots = rng.integers(0, n, t).astype(np.int32)
        pos = np.array(pos, np.int32)
        want = _brute_slot_attention(q, k, v, slots, pos, 0.3, window)
        np.testing.assert_allclose(np.asarray(m(q, k, v, slots, pos)), want, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(AVX2 not in host_cpu_features(), reason="host CPU lacks AVX2")
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_output_layer_kernel_at_every_batch_size(dtype):
    """dense_avx2 shares each widened weight vector between up to 4 rows of x on
    AVX-512 hosts; every M (whole blocks and every remainder, a batched decode's 8 rows
    among them) matches the reference."""
    rng = np.random.default_rng(0)
    table = StoredTable.from_weight(rng.standard_normal((100, 64)).astype(np.float32), dtype)

    class Head(nn.Module):
        def __init__(self):
            self.t = table

        def forward(self, x):
            scale = [] if self.t.scale is None else [self.t.scale]
            return apply("widening_matmul", x, self.t.values, *scale, kernel="avx2")
    m = tc.compile(Head(), tc.spec(("M", 64), "float32"), cache=False)
    w = table.values.astype(np.float64) * (table.scale[:, None] if dtype == "int8" else 1)
    for rows in (1, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 20):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        np.testing.assert_allclose(m(x), x @ w.T, rtol=1e-4, atol=1e-4)


# -- the batched generator -----------------------------------------------------------------
@pytest.fixture(scope="module")
def lm():
    nn.manual_seed(0)
    return models.BitNetLM(CFG)


@pytest.fixture(scope="module")
def single(lm):
    return tc.compile_lm(lm, max_seq=MAX_SEQ)


@pytest.fixture(scope="module")
def batched(lm):
    return tc.compile_lm(lm, max_seq=MAX_SEQ, max_batch=4)


def _prompts(n, seed=0, lo=1, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 96, int(k)).astype(np.int32) for k in rng.integers(lo, hi, n)]


def test_max_batch_one_is_the_single_stream_generator(lm, single):
    assert type(single) is tc.LMGenerator and single.exe.meta["lm"]["max_batch"] == 1
    assert type(tc.compile_lm(lm, max_seq=MAX_SEQ, max_batch=1)) is tc.LMGenerator


def test_slots_prefill_and_step_like_single_streams(batched, single):
    assert isinstance(batched, BatchedLMGenerator) and batched.max_batch == 4
    prompts = _prompts(3, seed=1)
    firsts = []
    for s, p in enumerate(prompts):
        got = batched.prefill(p, slot=s)
        np.testing.assert_allclose(got, single.prefill(p), rtol=1e-5, atol=1e-5)
        firsts.append(int(got[-1].argmax()))
    # three sequences decode together; each equals its own single-stream decode
    tokens = np.array(firsts, np.int32)
    for _ in range(5):
        got = batched.step(tokens, [0, 1, 2])
        assert got.shape == (3, 96)
        tokens = got.argmax(-1).astype(np.int32)
    for s, p in enumerate(prompts):
        want = single.generate(p, max_new_tokens=6)
        ours = [firsts[s]]
        batched.prefill(p, slot=3)          # replay in a free slot, alone
        for _ in range(5):
            ours.append(int(batched.decode(ours[-1], slot=3).argmax()))
        np.testing.assert_array_equal(ours, want)
    assert batched.filled.tolist() == [p.size + 5 for p in prompts] + [prompts[-1].size + 5]


def test_int8_table_rows_do_not_depend_on_the_batch(lm):
    """With the int8 output table (on an AVX-512 VNNI host its kernel quantizes the
    hidden state to int8 a row at a time), a sequence's logits in a step of three equal
    its logits stepped alone."""
    from conftest import run_filecheck
    from tercomp.kernels.table import VNNI
    b8 = tc.compile_lm(lm, max_seq=MAX_SEQ, max_batch=4, output_dtype="int8")
    if VNNI in host_cpu_features():
        run_filecheck(b8.exe.ir("mlir"), "# CHECK: flow.dispatch @tern_vnni_i8_gemv_96x128")
    prompts = _prompts(3, seed=4)
    for s, p in enumerate(prompts):
        b8.prefill(p, slot=s)
    together = b8.step([5, 6, 7], [0, 1, 2])
    for s, p in enumerate(prompts):
        b8.prefill(p, slot=s)
        np.testing.assert_allclose(b8.step([5 + s], [s])[0], together[s], rtol=1e-5, atol=1e-5)


def test_a_slot_does_not_disturb_the_others(batched):
    p, q = _prompts(2, seed=2)
    batched.prefill(p, slot=0)
    a = batched.decode(7, slot=0)
    batched.prefill(p, slot=0)
    batched.prefill(q, slot=1)          # another sequence fills slot 1 in between
    batched.step([3], [1])
    np.testing.assert_allclose(batched.decode(7, slot=0), a, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("call,match", [
    (lambda g: g.step([1, 2], [0, 0]), "repeat a slot"),
    (lambda g: g.step([1], [4]), "slot must be an int from 0 to 3"),
    (lambda g: g.step([1], [2]), "slot 2 is empty"),
    (lambda g: g.step([96], [0]), "out of range"),
    (lambda g: g.prefill([1] * (MAX_SEQ + 1), slot=1), "the cache holds 1 to"),
    (lambda g: g.forward([1, 2], [0, 0], [9, 11]), "consecutive"),
    (lambda g: g.forward([1], [0], [MAX_SEQ]), "past the cache"),
    (lambda g: g.forward([1], [0], [3], rows=[1]), "rows must pick"),
    (lambda g: g.copy_prefix(0, 0, 1), "both slot 0"),
    (lambda g: g.copy_prefix(0, 1, MAX_SEQ), "rows must be an int from 0 to"),
    (lambda g: g.copy_prefix(0, 1, 2, start=1), r"start must be an int from 0 to 0 \(the rows"),
    (lambda g: g.copy_prefix(0, 4, 1), "slot must be an int from 0 to 3"),
    (lambda g: g.copy_prefixes([(0, 1, 2, 0), (0, 1, 2, 0)]), "repeat a destination"),
    (lambda g: g.copy_prefixes([(0, 1, 2, 0), (1, 0, 0, 0)]), "into a source slot"),
    (lambda g: g.copy_prefixes([(0, 1)]), "a move is"),
])
def test_bad_calls_change_nothing(batched, call, match):
    batched.reset()
    p = _prompts(1, seed=3)[0]
    batched.prefill(p, slot=0)
    before = batched.filled.copy()
    with pytest.raises(InputError, match=match):
        call(batched)
    assert batched.filled.tolist() == before.tolist()
    batched.prefill(p, slot=0)
    np.testing.assert_array_equal(batched.decode(5, slot=0), batched.prefill(np.append(p, 5))[-1])


def test_a_saved_batched_generator_loads_as_one(batched, tmp_path):
    batched.save(tmp_path / "b.tcm")
    back = tc.load(tmp_path / "b.tcm")
    assert isinstance(back, BatchedLMGenerator) and back.max_batch == 4 and back.can_copy
    p = _prompts(1, seed=4)[0]
    np.testing.assert_array_equal(back.prefill(p, slot=2), batched.prefill(p, slot=2))
    back.copy_prefix(2, 0, p.size - 1)                   # the saved module copies rows too
    np.testing.assert_array_equal(back.decode(int(p[-1]), slot=0), batched.prefill(p)[-1])


def _check_copies(gen, seed):
    """copy_prefix gives a slot the rows prefill would compute there: its next tokens'
    logits are those of the whole prompt's prefill; the source is untouched."""
    gen.reset()
    rng = np.random.default_rng(seed)
    p = rng.integers(0, 96, 30).astype(np.int32)
    want = gen.prefill(p, slot=0)
    gen.prefill(rng.integers(0, 96, 40), slot=1)          # other rows in the destination
    gen.prefill(rng.integers(0, 96, 9), slot=2)
    gen.copy_prefix(0, 1, 12)
    assert gen.filled.tolist()[:3] == [30, 12, 9]
    np.testing.assert_allclose(gen.forward(p[12:], [1] * 18, np.arange(12, 30)), want[12:],
                               rtol=1e-5, atol=1e-5)
    # several moves in one call; a destination that shares rows 0..4 gets rows 5.. only
    gen.prefill(p[:5], slot=2)
    gen.copy_prefixes([(0, 2, 25, 5), (0, 1, 20, 0)])
    assert gen.filled.tolist()[:3] == [30, 20, 25]
    got = gen.forward(np.concatenate([p[25:], p[20:]]), [2] * 5 + [1] * 10,
                      np.concatenate([np.arange(25, 30), np.arange(20, 30)]))
    np.testing.assert_allclose(got, np.concatenate([want[25:], want[20:]]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gen.decode(7, slot=0), gen.prefill(np.append(p, 7), slot=3)[-1],
                               rtol=1e-5, atol=1e-5)
    gen.copy_prefix(0, 3, 0)                                # no rows: the slot holds none
    assert gen.filled[3] == 0


def test_copy_prefix_gives_the_rows_prefill_computes(batched, single):
    _check_copies(batched, 41)
    # and those of a single-stream generator
    p = np.random.default_rng(41).integers(0, 96, 30).astype(np.int32)
    batched.copy_prefix(0, 3, 20)
    np.testing.assert_allclose(batched.forward(p[20:], [3] * 10, np.arange(20, 30)),
                               single.prefill(p)[20:], rtol=1e-5, atol=1e-5)


def test_copy_prefix_of_f32_caches(lm):
    gen = tc.compile_lm(lm, max_seq=MAX_SEQ, max_batch=4, kv_dtype="float32")
    assert gen.kv_dtype == "f32" and gen.can_copy
    _check_copies(gen, 42)


def test_max_batch_is_checked(lm):
    for bad in (0, -1, 1.5, True, 10 ** 6):
        with pytest.raises(TercompError, match="max_batch must be an int"):
            tc.compile_lm(lm, max_seq=8, max_batch=bad)


# -- continuous batching --------------------------------------------------------------------
def _expected(single, prompts, lengths):
    return [single.generate(p, max_new_tokens=n, temperature=0.8 if i % 3 == 0 else 0.0, seed=i)
            for i, (p, n) in enumerate(zip(prompts, lengths))]


def test_engine_equals_single_streams_with_many_concurrent_requests(batched, single):
    """14 requests of different prompt and output lengths (every third sampled with
    its seed) on 4 slots, submitted from 7 threads: each request's tokens are its
    single-stream generation's; prompts are prefilled in chunks of 8 tokens."""
    prompts = _prompts(14, seed=5)
    lengths = [int(n) for n in np.random.default_rng(6).integers(1, 14, 14)]
    want = _expected(single, prompts, lengths)
    batched.reset()
    got = [None] * 14
    with Engine(batched, chunk=8) as engine:
        errors = []

        def client(ids):
            try:
                reqs = [(i, engine.submit(prompts[i], max_tokens=lengths[i],
                                          temperature=0.8 if i % 3 == 0 else 0.0, seed=i))
                        for i in ids]
                for i, r in reqs:
                    got[i] = list(r)            # streamed, token by token
            except Exception as e:              # pragma: no cover - reported below
                errors.append(e)
        threads = [threading.Thread(target=client, args=(range(k, 14, 7),)) for k in range(7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stats = engine.stats()
    assert not errors
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert stats["requests_finished"] == 14 and stats["free_slots"] == 4
    assert stats["generated_tokens_total"] == sum(len(w) for w in want)
    assert stats["prompt_tokens_total"] == sum(p.size for p in prompts)


def test_a_long_prompt_does_not_stall_running_streams(batched, single):
    batched.reset()
    short = _prompts(1, seed=7, lo=3, hi=4)[0]
    long = np.random.default_rng(8).integers(0, 96, 40).astype(np.int32)
    with Engine(batched, chunk=4) as engine:
        a = engine.submit(short, max_tokens=40)          # still decoding when b comes
        first = next(iter(a))                       # a is decoding
        b = engine.submit(long, max_tokens=3)
        ra, rb = a.result(60), b.result(60)
    np.testing.assert_array_equal(ra, single.generate(short, max_new_tokens=40))
    np.testing.assert_array_equal(rb, single.generate(long, max_new_tokens=3))
    assert ra[0] == first
    # b's 40 prompt tokens took 10 steps of 4, and each of them decoded a token of a
    during = [t for t in a.token_times if b.submitted < t < b.first_token]
    assert len(during) >= 9


def test_a_step_token_budget_holds_prompt_chunks_to_what_decoding_leaves(batched, single,
                                                                         monkeypatch):
    # step_tokens=6: while a decodes, each step is its token and at most 5 of b's prompt
    batched.reset()
    sizes, forward = [], batched.forward

    def counted(ids, *args):
        sizes.append(len(ids))
        return forward(ids, *args)
    monkeypatch.setattr(batched, "forward", counted)
    short = _prompts(1, seed=7, lo=3, hi=4)[0]
    long = np.random.default_rng(8).integers(0, 96, 40).astype(np.int32)
    with Engine(batched, chunk=32, step_tokens=6) as engine:
        a = engine.submit(short, max_tokens=40)
        next(iter(a))                               # a is decoding
        start = len(sizes)
        b = engine.submit(long, max_tokens=3)
        ra, rb = a.result(60), b.result(60)
        with pytest.raises(TercompError, match="step_tokens must be a positive int"):
            Engine(batched, step_tokens=0, start=False)
    np.testing.assert_array_equal(ra, single.generate(short, max_new_tokens=40))
    np.testing.assert_array_equal(rb, single.generate(long, max_new_tokens=3))
    assert max(sizes[start:]) == 6                  # 1 + 5 of b's 40 tokens: 8 steps
    assert sizes[start:].count(6) == 8


def test_the_queue_is_bounded(batched, single):
    batched.reset()
    p = _prompts(1, seed=9)[0]
    engine = Engine(batched, max_queue=2, start=False)      # nothing admitted yet
    try:
        waiting = [engine.submit(p, max_tokens=2) for _ in range(2)]
        with pytest.raises(QueueFull, match="queue is full"):
            engine.submit(p, max_tokens=2)
        assert engine.stats()["requests_rejected"] == 1
        engine.start()
        for r in waiting:
            np.testing.assert_array_equal(r.result(60), single.generate(p, max_new_tokens=2))
    finally:
        engine.close()


def test_a_cancelled_waiting_request_leaves_the_queue_at_once(batched, single):
    batched.reset()
    p = _prompts(1, seed=9)[0]
    engine = Engine(batched, max_queue=2, start=False)      # nothing admitted yet
    try:
        gone = [engine.submit(p, max_tokens=2) for _ in range(2)]
        for r in gone:
            r.cancel()
            assert r.done and r.finish_reason == "cancelled" and r.result(0).size == 0
        assert engine.stats()["waiting"] == 0
        kept = [engine.submit(p, max_tokens=2) for _ in range(2)]    # no QueueFull
        engine.start()
        for r in kept:
            np.testing.assert_array_equal(r.result(60), single.generate(p, max_new_tokens=2))
    finally:
        engine.close()


def test_slots_are_shared_fairly_between_groups(batched):
    # 8 sequences of one request, then 1 of another: the second is admitted with the
    # first wave, not after all 8 (first come, first served)
    batched.reset()
    p = _prompts(1, seed=3)[0]
    engine = Engine(batched, start=False)
    try:
        big = [engine.submit(p, max_tokens=20, group="big") for _ in range(8)]
        small = engine.submit(p, max_tokens=2, group="small")
        engine.start()
        small.result(60)
        for r in big:
            r.result(60)
        firsts = sorted(r.first_token for r in big)
        assert small.first_token <= firsts[3] < firsts[4]
        assert small.finished < firsts[4]
    finally:
        engine.close()


def test_cancel_frees_the_slot(batched, single):
    batched.reset()
    p = _prompts(1, seed=9)[0]
    with Engine(batched) as engine:
        reqs = [engine.submit(p, max_tokens=100) for _ in range(6)]   # 4 run, 2 wait
        for r in reqs:
            r.cancel()
        for r in reqs:
            r.result(60)
        assert all(r.finish_reason in ("cancelled", "length") for r in reqs)
        assert any(r.finish_reason == "cancelled" for r in reqs)
        np.testing.assert_array_equal(engine.generate(p, 5), single.generate(p, max_new_tokens=5))
        stats = engine.stats()
        assert stats["free_slots"] == 4 and stats["running"] == stats["waiting"] == 0


@pytest.mark.parametrize("kw,match", [
    ({"max_tokens": -1}, "max_tokens"), ({"logprobs": 21}, "logprobs"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"seed": "x"}, "seed"), ({"stop": "eos"}, "eos"),
])
def test_engine_rejects_bad_requests_before_queueing(batched, kw, match):
    with Engine(batched) as engine:
        with pytest.raises(InputError, match=match):
            engine.submit([1, 2, 3], **{"max_tokens": 4, **kw})
        for bad in ([], [96], [1] * MAX_SEQ):
            with pytest.raises(InputError):
                engine.submit(bad)
        assert engine.stats()["requests_total"] == 0


def test_engine_over_a_single_stream_generator(single):
    prompts = _prompts(3, seed=10)
    want = _expected(single, prompts, [4, 6, 2])
    with Engine(single) as engine:
        reqs = [engine.submit(p, max_tokens=n, temperature=0.8 if i % 3 == 0 else 0.0, seed=i)
                for i, (p, n) in enumerate(zip(prompts, [4, 6, 2]))]
        for r, w in zip(reqs, want):
            np.testing.assert_array_equal(r.result(60), w)


def test_a_request_stops_at_its_stop_token_and_at_the_cache_end(batched, single):
    p = _prompts(1, seed=11, lo=40, hi=41)[0]
    want = single.generate(p, max_new_tokens=MAX_SEQ - p.size + 1)
    with Engine(batched) as engine:
        r = engine.submit(p, max_tokens=100)
        np.testing.assert_array_equal(r.result(60), want)
        assert r.finish_reason == "length" and len(want) == MAX_SEQ - p.size + 1
        stop = int(want[2])
        r = engine.submit(p, max_tokens=100, stop=stop)
        got = r.result(60)
        assert r.finish_reason == "stop" and got[-1] == stop
        np.testing.assert_array_equal(got, want[:list(want).index(stop) + 1])


# -- prefix caching ------------------------------------------------------------------------
def _chat(engine, opening, messages, max_tokens=3):
    """A chat: each turn's prompt is the whole history and a new message; returns each
    turn's (prompt, tokens, cached_tokens)."""
    history, turns = opening, []
    for msg in messages:
        prompt = np.concatenate([history, msg]).astype(np.int32)
        r = engine.submit(prompt, max_tokens=max_tokens)
        toks = r.result(60)
        turns.append((prompt, toks, r.cached_tokens))
        history = np.concatenate([prompt, toks])
    return turns


@pytest.mark.parametrize("which", ["batched", "single"])
def test_prefix_cache_prefills_only_the_new_turn_and_keeps_greedy_tokens(which, batched, single):
    gen = batched if which == "batched" else single
    rng = np.random.default_rng(21)
    opening, messages = rng.integers(0, 96, 6), [rng.integers(0, 96, 3) for _ in range(4)]
    with Engine(gen, chunk=8) as engine:
        turns = _chat(engine, opening, messages)
        stats = engine.stats()
    for i, (prompt, toks, cached) in enumerate(turns):
        np.testing.assert_array_equal(toks, single.generate(prompt, max_new_tokens=3))
        # the slot held the previous prompt and its tokens but the last (never run)
        assert cached == (turns[i - 1][0].size + 2 if i else 0)
    prompts = sum(t[0].size for t in turns)
    assert stats["prompt_tokens_total"] == prompts
    assert stats["prompt_tokens_cached_total"] == sum(t[2] for t in turns) > prompts / 2
    assert stats["prefix_cache_tokens"] == turns[-1][0].size + 2
    with Engine(gen, chunk=8, prefix_cache=False) as engine:
        again = _chat(engine, opening, messages)
        assert engine.stats()["prompt_tokens_cached_total"] == 0
    for (_, toks, _), (_, toks2, cached2) in zip(turns, again):
        np.testing.assert_array_equal(toks, toks2)
        assert cached2 == 0


def test_prefix_cache_overwrites_the_rows_past_a_shorter_shared_prefix(batched, single):
    """Prompts that branch off a cached sequence (an edited message, a prefix of it):
    the slot's rows past the shared prefix hold the old sequence and must not leak."""
    rng = np.random.default_rng(22)
    base = rng.integers(0, 96, 30).astype(np.int32)
    branches = [np.concatenate([base[:12], rng.integers(0, 96, 9)]),   # an edit at 12
                base[:20],                                              # a prefix of it
                np.concatenate([base[:20], base[25:]]),                 # rows shifted
                base[:1], base]
    with Engine(batched, chunk=5) as engine:
        engine.generate(base, max_tokens=6)
        for p in branches:
            r = engine.submit(p.astype(np.int32), max_tokens=6)
            np.testing.assert_array_equal(r.result(60), single.generate(p, max_new_tokens=6))
            assert 0 <= r.cached_tokens < p.size


def test_the_prefix_cache_forgets_rows_another_caller_wrote(single):
    """A generator used outside the engine between two requests: its rows are not the
    engine's any more, and nothing is reused."""
    p = np.arange(1, 15, dtype=np.int32)
    with Engine(single) as engine:
        first = engine.generate(p, max_tokens=3)
        single.generate(np.arange(30, 44), max_new_tokens=3)       # same length, other rows
        r = engine.submit(np.concatenate([p, first]), max_tokens=3)
        r.result(60)
        assert r.cached_tokens == 0
        np.testing.assert_array_equal(
            r.result(), single.generate(np.concatenate([p, first]), max_new_tokens=3))


def test_a_request_takes_the_free_slot_with_the_longest_shared_prefix(batched, single):
    rng = np.random.default_rng(23)
    chats = [rng.integers(0, 96, 10).astype(np.int32) for _ in range(3)]
    with Engine(batched, chunk=8) as engine:
        for c in chats:                              # each into its own slot
            engine.generate(c, max_tokens=2)
        for c in reversed(chats):                    # the next turn of each finds its rows
            p = np.concatenate([c, rng.integers(0, 96, 4)]).astype(np.int32)
            r = engine.submit(p, max_tokens=4)
            np.testing.assert_array_equal(r.result(60), single.generate(p, max_new_tokens=4))
            assert r.cached_tokens == c.size
        # prompt log-probabilities need every prompt position's logits: nothing reused
        r = engine.submit(chats[0], max_tokens=1, prompt_logprobs=1)
        r.result(60)
        assert r.cached_tokens == 0 and len(r.prompt_scores) == chats[0].size


def test_concurrent_requests_copy_a_running_prefix_with_the_same_tokens(batched, single):
    """Six requests with one 24-token system prompt arriving together on 4 slots: the
    first prefills it, the next three wait for it and copy its rows into their slots
    (one chunk of 8 short of the prefix: 16 rows, MIN_SHARED), the last two find it in
    a freed slot; every request's tokens are single-stream generation's (one sampled
    with its seed), and the counters add up."""
    rng = np.random.default_rng(43)
    system = rng.integers(0, 96, 24)
    prompts = [np.concatenate([system, rng.integers(0, 96, k)]).astype(np.int32)
               for k in (3, 5, 2, 6, 4, 7)]
    kws = [{"temperature": 0.8, "seed": 5} if i == 2 else {} for i in range(6)]
    want = [single.generate(p, max_new_tokens=5, **kw) for p, kw in zip(prompts, kws)]
    results = {}
    for share in (True, False):
        with Engine(batched, chunk=8, start=False, prefix_cache=share) as engine:
            reqs = [engine.submit(p, max_tokens=5, **kw) for p, kw in zip(prompts, kws)]
            engine.start()
            for r, w in zip(reqs, want):
                np.testing.assert_array_equal(r.result(60), w)
            results[share] = [r.cached_tokens for r in reqs], engine.stats()
    cached, stats = results[True]
    assert cached[0] == 0 and cached[1:4] == [16] * 3 and min(cached[4:]) >= 24
    assert stats["prompt_tokens_copied_total"] == 48
    assert stats["prompt_tokens_cached_total"] == sum(cached)
    assert stats["prompt_tokens_total"] == sum(p.size for p in prompts)
    cached, stats = results[False]
    assert cached == [0] * 6 and stats["prompt_tokens_copied_total"] == 0


def test_a_waiting_request_copies_from_the_slot_its_leader_freed(batched, single):
    """A request waits for the one computing its prefix, which ends with its prefill
    (max_tokens=0) and frees its slot: the rows are copied from that free slot."""
    rng = np.random.default_rng(45)
    system = rng.integers(0, 96, 30)
    lead = np.append(system, 7).astype(np.int32)
    p = np.concatenate([system, rng.integers(0, 96, 10)]).astype(np.int32)
    with Engine(batched, chunk=32, start=False) as engine:
        a = engine.submit(lead, max_tokens=0)
        b = engine.submit(p, max_tokens=5)
        engine.start()
        np.testing.assert_array_equal(b.result(60), single.generate(p, max_new_tokens=5))
        assert a.result(60).size == 0 and a.cached_tokens == 0 and b.cached_tokens == 30
        stats = engine.stats()
    assert stats["prompt_tokens_copied_total"] == 30
    assert stats["prompt_tokens_total"] == lead.size + p.size


def test_a_request_copies_the_rows_of_a_sequence_still_decoding(batched, single):
    """A prompt that continues a running request's prompt and first generated tokens
    gets those rows (the generated ones too) from its slot, or from the slot once
    freed; its tokens are single-stream generation's."""
    rng = np.random.default_rng(44)
    p = rng.integers(0, 96, 18).astype(np.int32)
    with Engine(batched, chunk=8) as engine:
        a = engine.submit(p, max_tokens=24)
        first = []
        for tok in a:
            first.append(tok)
            if len(first) == 4:
                break
        q = np.concatenate([p, first[:3], rng.integers(0, 96, 5)]).astype(np.int32)
        b = engine.submit(q, max_tokens=6)
        np.testing.assert_array_equal(b.result(60), single.generate(q, max_new_tokens=6))
        assert b.cached_tokens == p.size + 3
        np.testing.assert_array_equal(a.result(60), single.generate(p, max_new_tokens=24))


# -- speculative decoding of a request served alone ---------------------------------------------
@pytest.mark.parametrize("which", ["batched", "single"])
def test_a_request_alone_decodes_speculatively_with_greedy_tokens(which, batched, single):
    gen = batched if which == "batched" else single
    rng = np.random.default_rng(31)
    block = rng.integers(0, 96, 6)
    prompts = [np.tile(block, 3).astype(np.int32), rng.integers(0, 96, 12).astype(np.int32)]
    wants = [single.generate(p, max_new_tokens=20) for p in prompts]
    with Engine(gen, chunk=8, num_draft=4) as engine:
        for p, want in zip(prompts, wants):
            r = engine.submit(p, max_tokens=20)
            np.testing.assert_array_equal(r.result(60), want)
            stop = int(want[-1])                 # a stop token inside an accepted draft
            r = engine.submit(p, max_tokens=20, stop=stop)
            np.testing.assert_array_equal(r.result(60), want[:want.tolist().index(stop) + 1])
        # several at once: the usual batched step, the same tokens
        reqs = [engine.submit(p, max_tokens=10) for p in prompts]
        for r, want in zip(reqs, wants):
            np.testing.assert_array_equal(r.result(60), want[:10])
        stats = engine.stats()
    assert stats["draft_tokens_accepted_total"] > 0
    assert stats["generated_tokens_total"] > stats["steps_total"]
    with pytest.raises(TercompError, match="num_draft must be an int from 0"):
        Engine(gen, num_draft=65, start=False)
