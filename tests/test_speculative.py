"""Speculative decoding with prompt-lookup drafts (runtime.speculative) and the step it
needs (gen.extend: tokens at a position at or before the filled rows): tokens equal to
plain greedy decoding on prompts whose drafts are accepted and on ones whose drafts are
rejected, the cache left as plain decoding leaves it, and the drafting rule itself."""
import numpy as np
import pytest

import tercomp as tc
from tercomp import models
from tercomp.errors import InputError
from tercomp.runtime.speculative import DraftSchedule, accepted, prompt_lookup

import bitnet_ref as R

CFG = dict(hidden=256, ff=512, vocab=300, heads=4, kv_heads=2, layers=2, eps=1e-5,
           theta=10000.0, ctx=128)
MAX_SEQ = 64
RNG = np.random.default_rng(7)
PROMPTS = {
    "random": RNG.integers(0, 300, 20),
    "code": np.tile(RNG.integers(0, 300, 7), 4),          # a block repeated: drafts accepted
    "edited": np.concatenate([np.arange(40, 52), np.arange(40, 46), [7, 8], np.arange(46, 52)]),
    "one token": np.array([11]),
}


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return models.load(R.write_gguf(tmp_path_factory.mktemp("lm") / "tiny.gguf", CFG,
                                    R.random_weights(CFG, seed=5)))


@pytest.fixture(scope="module")
def gen(lm):
    return tc.compile_lm(lm, max_seq=MAX_SEQ)


# -- drafting --------------------------------------------------------------------------------
def test_prompt_lookup_follows_the_longest_recent_ngram():
    assert prompt_lookup([5, 6, 7, 8, 5, 6], 3).tolist() == [7, 8, 5]
    # the 3-gram (2, 3, 4) decides over the later 1-gram 4
    assert prompt_lookup([2, 3, 4, 9, 9, 4, 1, 2, 3, 4], 2).tolist() == [9, 9]
    # the most recent occurrence with num_draft tokens after it (a document's latest edit)
    assert prompt_lookup([1, 2, 10, 11, 1, 2, 20, 21, 0, 1, 2], 2).tolist() == [20, 21]
    # none has num_draft tokens after it: the one with the most
    assert prompt_lookup([1, 2, 3, 1, 2, 3, 1, 2], 4).tolist() == [3, 1, 2]
    assert prompt_lookup([1, 2, 3], 4).size == 0 and prompt_lookup([4], 4).size == 0


def test_accepted_is_the_prefix_greedy_decoding_confirms():
    logits = np.eye(5)[[1, 2, 4, 0]]          # argmax per row: 1, 2, 4, 0
    assert accepted(np.array([1, 2, 3]), logits) == 2
    assert accepted(np.array([1, 2, 4]), logits) == 3
    assert accepted(np.array([0, 2, 4]), logits) == 0
    assert accepted(np.zeros(0, np.int64), logits[:1]) == 0


def test_the_draft_schedule_grows_shrinks_and_pauses():
    s = DraftSchedule(6)
    # (the size it gives, how many of those drafts are accepted); a size 0 is a plain step
    steps = [(6, 0), (5, 2), (4, 4),                       # rejections shrink, a whole one grows
             (6, 0), (5, 0), (4, 0), (3, 0), (2, 0), (1, 0),
             (0, None), (1, 0),                            # a rejected 1-token draft pauses
             (0, None), (0, None), (1, 1),                 # ... twice as long the next time
             (3, 3), (5, 5), (6, 6), (6, 6)]               # an accepted one resets the pauses
    for want, ok in steps:
        assert s.size() == want
        if want:
            s.update(want, ok)


# -- the step --------------------------------------------------------------------------------
def test_extend_continues_or_rolls_back_the_sequence(gen):
    ids = PROMPTS["random"]
    full = gen.prefill(ids)
    gen.prefill(ids[:8])
    np.testing.assert_allclose(gen.extend(ids[8:]), full[8:], rtol=1e-4, atol=1e-4)
    assert gen.position == ids.size
    # from row 5 again, with other tokens: the rows past 5 are replaced, not attended
    other = np.concatenate([ids[:5], [1, 2, 3]])
    np.testing.assert_allclose(gen.extend([1, 2, 3], 5, logits_to_keep=1),
                               gen.prefill(other)[-1:], rtol=1e-4, atol=1e-4)
    for bad in (gen.position + 1, -1, True):
        with pytest.raises(InputError, match="start must be an int from 0 to the position"):
            gen.extend([1], bad)
    with pytest.raises(InputError, match="run past the cache"):
        gen.extend(np.ones(MAX_SEQ, np.int32), 1)
    assert gen.position == other.size


# -- generation ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_speculative_tokens_are_greedy_tokens(gen, name):
    p = PROMPTS[name]
    n = MAX_SEQ - p.size + 1 if name == "code" else 24        # "code" fills the cache
    want = gen.generate(p, max_new_tokens=n)
    after = gen.decode(int(want[-1])) if gen.position < MAX_SEQ else None
    streamed = []
    got = gen.generate(p, max_new_tokens=n, speculative="prompt_lookup", num_draft=5,
                       on_token=streamed.append)
    np.testing.assert_array_equal(got, want)
    assert streamed == want.tolist()
    s = gen.stats
    assert s["decode_tokens"] == n - 1 and s["steps"] + s["accepted"] == n - 1
    # the cache holds the sequence as plain decoding leaves it
    assert gen.position == p.size + n - 1
    if after is not None:
        np.testing.assert_allclose(gen.decode(int(got[-1])), after, rtol=1e-4, atol=1e-4)
    if name == "code":
        assert s["accepted"] >= n // 2                 # most tokens come from drafts


def test_rejected_drafts_are_rolled_back(gen):
    """Prompts whose drafts the model does not follow: every rejection rolls back."""
    rejected = 0
    for seed in range(4):
        rng = np.random.default_rng(seed)
        text = rng.integers(0, 300, 15)
        p = np.concatenate([text, text[:3]])    # drafts text[3:], which the model need not say
        want = gen.generate(p, max_new_tokens=16)
        np.testing.assert_array_equal(
            gen.generate(p, max_new_tokens=16, speculative="prompt_lookup", num_draft=4), want)
        rejected += gen.stats["drafted"] - gen.stats["accepted"]
    assert rejected > 0


def test_speculative_stops_at_eos_and_in_a_batched_generator(lm, gen):
    p = PROMPTS["code"]
    want = gen.generate(p, max_new_tokens=12)
    eos = int(want[5])
    got = gen.generate(p, max_new_tokens=12, eos=eos, speculative="prompt_lookup")
    np.testing.assert_array_equal(got, want[:want.tolist().index(eos) + 1])
    batched = tc.compile_lm(lm, max_seq=MAX_SEQ, max_batch=2)
    np.testing.assert_array_equal(batched.generate(p, 12, speculative="prompt_lookup"), want)
    assert batched.filled[0] == p.size + 11 and batched.filled[1] == 0


@pytest.mark.parametrize("kw, match", [
    ({"speculative": "medusa"}, "speculative must be None or one of prompt_lookup"),
    ({"speculative": "prompt_lookup", "num_draft": 0}, "num_draft must be an int from 1 to 64"),
    ({"speculative": "prompt_lookup", "temperature": 0.7}, "temperature 0.7 samples"),
])
def test_bad_speculative_arguments_change_nothing(gen, kw, match):
    gen.prefill(PROMPTS["random"])
    with pytest.raises(InputError, match=match):
        gen.generate(PROMPTS["code"], max_new_tokens=4, **kw)
    assert gen.position == PROMPTS["random"].size


def test_cli_generate_speculative(gen, tmp_path, capsys):
    from tercomp.cli import main
    path = tmp_path / "lm.tcm"
    gen.save(path)
    p = PROMPTS["code"]
    ids = ",".join(map(str, p))
    assert main(["generate", str(path), "--prompt-ids", ids, "-n", "20", "--speculative"]) == 0
    out, err = capsys.readouterr()
    assert [int(t) for t in out.split()] == gen.generate(p, max_new_tokens=20).tolist()
    assert "speculative:" in err and "drafted tokens accepted" in err
    assert main(["generate", str(path), "--prompt-ids", ids, "--speculative",
                 "--temperature", "0.5"]) == 2
    assert "--speculative verifies drafts against greedy" in capsys.readouterr().err
