"""tc.compile_embed: the model's own forward without its head, pooled over sequences of
different lengths in one batch and L2-normalised, against the float64 reference of
the published architectures (tests/backbone_ref.py)."""
import json

import numpy as np
import pytest

import tercomp as tc
from tercomp import models

import backbone_ref as B

SEQS = [[5, 17, 42, 7, 99, 3, 250, 11, 9, 80, 1, 2, 3, 4, 5, 6],
        [1, 2, 3], [42], [250, 11, 9, 80, 1, 2, 3, 4, 5]]


@pytest.fixture(scope="module", params=sorted(B.SHAPES))
def model(request, tmp_path_factory):
    cfg = B.SHAPES[request.param]
    w = B.weights(cfg, seed=len(request.param))
    d = tmp_path_factory.mktemp(request.param)
    # the file bitnet.cpp publishes: I2_S projections
    return cfg, w, models.load(B.write_gguf(d / "m.gguf", cfg, w, projection=B.i2s_projection))


def check(got, want):
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    cos = (got * want).sum(-1)          # both unit vectors
    assert cos.min() >= 0.999, cos


# the pooling is the same code for every family: gemma3's mean and cls under -m slow
@pytest.mark.parametrize("model,pooling", [
    (family, pooling) if family == "qwen3" or pooling == "last"
    else pytest.param(family, pooling, marks=pytest.mark.slow)
    for family in sorted(B.SHAPES) for pooling in ("last", "mean", "cls")], indirect=["model"])
def test_pooled_embeddings_agree_with_the_reference(model, pooling):
    cfg, w, lm = model
    enc = tc.compile_embed(lm, max_seq=16, pooling=pooling)
    got = enc.embed(SEQS)
    check(got, B.reference_embeddings(cfg, w, SEQS, pooling))
    # one batch of right-padded rows gives each row its own sequence's embedding,
    # whatever its neighbours
    alone = np.concatenate([enc.embed([s]) for s in SEQS[1:3]])
    np.testing.assert_allclose(got[1:3], alone, atol=2e-5)


def test_the_pooling_comes_from_the_model_file(model):
    cfg, w, lm = model
    assert lm.config.pooling == "last"
    enc = tc.compile_embed(lm, max_seq=16, normalize=False, max_batch=2)
    got = enc.embed(SEQS[1:])
    want = B.reference_embeddings(cfg, w, SEQS[1:], "last", normalize=False)
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.999 and np.allclose(np.linalg.norm(got, axis=-1),
                                               np.linalg.norm(want, axis=-1), rtol=1e-2)


def test_bad_inputs_are_errors(model):
    _, _, lm = model
    with pytest.raises(tc.TercompError, match="pooling must be one of last, mean, cls"):
        tc.compile_embed(lm, pooling="max")
    enc = tc.compile_embed(lm, max_seq=16)
    for bad, msg in (([list(range(17))], "input 0 has 17 tokens, more than max_seq 16"),
                     ([[]], "input 0 has no tokens"), ([[1, 300]], "token id 300"),
                     ([[1], ["a"]], "input 1 is neither"), ([], "non-empty list"),
                     (["text"], "no tokenizer")):
        with pytest.raises(tc.TercompError, match=msg):
            enc.embed(bad)
    with pytest.raises(tc.TercompError, match=r"lengths must be from 1 to T = 4, got \[0\]"):
        enc(np.ones((1, 4), np.int32), [0])


def test_a_gguf_that_asks_for_eos_gets_it(model, tmp_path):
    cfg, _, lm = model
    enc = tc.compile_embed(lm, max_seq=16)
    assert enc.eos == (1 if cfg["family"] == "qwen3" else None)
    B.word_tokenizer(tmp_path, cfg["vocab"], eos=False)
    from tercomp.models.tokenizer import tokenizer_from_hf
    enc.tokenizer = tokenizer_from_hf(tmp_path)
    assert enc.encode("w5 w7") == ([5, 7, 1] if cfg["family"] == "qwen3" else [5, 7])


def test_texts_and_the_cli(tmp_path, capsys):
    cfg = B.SHAPES["qwen3"]
    w = B.weights(cfg, seed=3)
    B.write_hf(tmp_path, cfg, w)
    B.word_tokenizer(tmp_path, cfg["vocab"])
    texts = ["w5 w17 w42 w7", "w250 w11"]
    want = B.reference_embeddings(cfg, w, [[5, 17, 42, 7, 1], [250, 11, 1]])
    enc = tc.compile_embed(models.load(tmp_path), max_seq=16)
    check(enc.embed(texts), want)
    from tercomp.cli import main
    assert main(["embed", str(tmp_path), "--text", texts[0], "--text", texts[1],
                 "--max-seq", "16", "--cosine"]) == 0
    cos = np.array([[float(v) for v in line.split()]
                    for line in capsys.readouterr().out.splitlines()])
    np.testing.assert_allclose(cos, want @ want.T, atol=2e-3)
    assert main(["embed", str(tmp_path), "--ids", "5,17,42,7,1", "--max-seq", "16",
                 "-o", str(tmp_path / "e.npy")]) == 0
    row = json.loads(capsys.readouterr().out)
    np.testing.assert_allclose(row, np.load(tmp_path / "e.npy")[0], rtol=1e-6)
    assert (row @ want[0]) >= 0.999
    assert main(["embed", str(tmp_path)]) == 2
    assert "at least one --text or --ids" in capsys.readouterr().err
