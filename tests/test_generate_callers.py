"""One LMGenerator, many callers: threads are serialized (each gets its single-thread
result), a call from inside a running one (an on_token callback) is refused without
touching the running generation, and every argument of `generate` is checked before
the cache is. One tiny BitNet (1 layer, vocab 300) compiled once."""
import threading

import numpy as np
import pytest

import tercomp as tc
from tercomp import models

import bitnet_ref as R

CFG = R.TINY_CFG
MAX_SEQ = 32
PROMPT = [5, 17, 250, 3]


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    return tc.compile_lm(models.load(R.tiny_gguf(tmp_path_factory.mktemp("lm"))), max_seq=MAX_SEQ)


def _request(i):
    """The i-th of a few different requests: prompt and sampling options."""
    rng = np.random.default_rng(i)
    prompt = rng.integers(0, CFG["vocab"], 2 + i % 5).tolist()
    sampling = {} if i % 2 == 0 else dict(temperature=0.8, top_k=40, seed=i)
    return prompt, dict(max_new_tokens=10 + i % 4, **sampling)


def test_threads_sharing_a_generator_get_their_own_results(gen):
    n = 8
    alone = [gen.generate(p, **kw).tolist() for p, kw in map(_request, range(n))]
    assert len({tuple(a) for a in alone}) > 1          # the requests differ
    results, errors = {}, []
    start = threading.Barrier(n)

    def work(i):
        try:
            start.wait()
            for round_ in range(3):
                results[i, round_] = gen.generate(*_request(i)[:1], **_request(i)[1]).tolist()
        except Exception as e:          # reported below, with the thread that failed
            errors.append((i, e))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    wrong = [(i, r) for (i, r), got in results.items() if got != alone[i]]
    assert not wrong, f"{len(wrong)} of {len(results)} results differ from their single-thread result"


@pytest.mark.parametrize("call", [
    lambda g: g.prefill([1, 2, 3]),
    lambda g: g.decode(4),
    lambda g: g.generate([1, 2], max_new_tokens=2),
    lambda g: g.reset(),
])
def test_a_callback_calling_the_generator_is_refused_and_changes_nothing(gen, call):
    want = gen.generate(PROMPT, max_new_tokens=8)
    seen = []

    def on_token(tok):
        with pytest.raises(tc.TercompError, match=r"called from inside generate .* running generation"):
            call(gen)
        seen.append((tok, gen.position))
    got = gen.generate(PROMPT, max_new_tokens=8, on_token=on_token)
    np.testing.assert_array_equal(got, want)
    assert [t for t, _ in seen] == want.tolist()
    # the position the callback saw is the running generation's: prompt + tokens so far
    assert [p for _, p in seen] == [len(PROMPT) + k for k in range(8)]
    assert gen.position == len(PROMPT) + 7


def test_the_generator_is_usable_after_a_refused_call(gen):
    want = gen.generate(PROMPT, max_new_tokens=4)

    def on_token(tok):
        gen.prefill([1])             # not caught: it ends the generation with the error
    with pytest.raises(tc.TercompError, match="called from inside generate"):
        gen.generate(PROMPT, max_new_tokens=4, on_token=on_token)
    np.testing.assert_array_equal(gen.generate(PROMPT, max_new_tokens=4), want)


@pytest.mark.parametrize("kwargs, match", [
    (dict(on_token=42), "on_token must be a function"),
    (dict(on_token="print"), "on_token must be a function"),
    (dict(eos="12"), "eos must be a token id or a set of token ids"),
    (dict(eos=b"\x01"), "eos must be a token id"),
    (dict(eos=[1, "2"]), r"'2' \(str\) is not an int"),
    (dict(eos=[1.0]), r"1\.0 \(float\) is not an int"),
    (dict(eos=True), "eos must be a token id"),
    (dict(eos=[True]), "is not an int"),
    (dict(eos=3.5), "eos must be a token id"),
    (dict(eos=300), "eos id 300 is out of range"),
    (dict(eos={-1}), "eos id -1 is out of range"),
    (dict(max_new_tokens=-1), "max_new_tokens must be a non-negative int"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be a non-negative int"),
    (dict(max_new_tokens="4"), "max_new_tokens must be a non-negative int"),
    (dict(max_new_tokens=10 ** 30), "cache positions; the cache holds 32"),
    (dict(temperature=-0.5), "temperature must be a number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a number >= 0"),
    (dict(temperature="0.7"), "temperature must be a number >= 0"),
    (dict(temperature=0.7, top_k=0), "top_k must be None or an int >= 1"),
    (dict(temperature=0.7, top_k=2.5), "top_k must be None or an int >= 1"),
    (dict(temperature=0.7, top_k=True), "top_k must be None or an int >= 1"),
    (dict(temperature=0.7, top_p=0.0), r"top_p must be None or a number in \(0, 1\]"),
    (dict(temperature=0.7, top_p=1.5), r"top_p must be None or a number in \(0, 1\]"),
    (dict(temperature=0.7, top_p=float("nan")), r"top_p must be None or a number"),
    (dict(seed=-1), "seed must be a non-negative int"),
    (dict(seed=1.5), "seed must be a non-negative int"),
    (dict(seed="0"), "seed must be a non-negative int"),
])
def test_a_rejected_generate_changes_nothing(gen, kwargs, match):
    gen.generate(PROMPT, max_new_tokens=3)            # a running sequence to preserve
    position = gen.position
    following = gen.decode(7)                          # what the next step gives...
    gen.generate(PROMPT, max_new_tokens=3)             # ...from the same state again
    with pytest.raises(tc.InputError, match=match):
        gen.generate([9, 8, 7], **kwargs)
    assert gen.position == position
    np.testing.assert_array_equal(gen.decode(7), following)


def test_a_rejected_generate_leaves_the_next_generation_unchanged(gen):
    ask = dict(max_new_tokens=6, temperature=0.9, seed=3)
    want = gen.generate(PROMPT, **ask)
    for bad in (dict(eos="2"), dict(on_token=1), dict(temperature=-1.0)):
        with pytest.raises(tc.InputError):
            gen.generate(PROMPT, **{**ask, **bad})
        np.testing.assert_array_equal(gen.generate(PROMPT, **ask), want)


def test_eos_accepts_ints_of_any_integer_type(gen):
    greedy = gen.generate(PROMPT, max_new_tokens=6)
    stop = int(greedy[2])
    first = greedy.tolist().index(stop)       # the first time that token comes
    for eos in (stop, np.int64(stop), [stop], {stop, 299}, (np.int32(stop),), np.array([stop])):
        np.testing.assert_array_equal(gen.generate(PROMPT, max_new_tokens=6, eos=eos), greedy[:first + 1])


@pytest.mark.parametrize("temperature", [1e-308, 5e-324, 1e-300])
def test_a_tiny_temperature_samples_the_argmax(gen, temperature):
    """logits / 1e-308 overflows; the sampler shifts by the maximum first, so the limit
    (the argmax, as temperature 0) comes out, not NaN probabilities."""
    greedy = gen.generate(PROMPT, max_new_tokens=6)
    for seed in range(3):
        got = gen.generate(PROMPT, max_new_tokens=6, temperature=temperature, seed=seed)
        np.testing.assert_array_equal(got, greedy)


def test_a_huge_temperature_is_uniform():
    from tercomp.runtime.sampling import probabilities
    np.testing.assert_allclose(probabilities(np.array([0.0, 50.0, -30.0, 7.0]), 1e308), 0.25)
    p = probabilities(np.array([1.0, 3.0, 3.0, -2.0]), 1e-308)
    np.testing.assert_array_equal(p, [0, 0.5, 0.5, 0])
