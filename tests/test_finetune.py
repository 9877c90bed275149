"""Fine-tuning a loaded ternary LM (issue #24): `models.load(path, trainable=True,
freeze=...)`, `tc.compile_train_step`, `step.sync_to`, then `models.save_gguf` (which
llama.cpp runs with tercomp's logits) and `models.save_hf` (which loads back with the
same logits), for both families (bitnet, llama_bitnet) and both formats (GGUF, HF).
samples/finetune_lm.py runs in tests/test_readme.py (the README's fine-tune commands).

The files are the ones the family tests write (tests/test_models_formats.py,
tests/test_llama_family.py), made small: 1-2 layers, a 300/512-token vocabulary that
llama.cpp loads."""
import numpy as np
import pytest

import tercomp as tc
from tercomp import models, nn
from tercomp import ternary_pack as tp

import bitnet_ref as R
import test_llama_family as LF
import test_models_formats as MF

BITNET = dict(MF.CFG)
LLAMA = dict(vocab=512, hidden=256, ff=512, heads=8, kv_heads=2, head_dim=64, layers=1,
             theta=500000.0, eps=1e-5, rope_scaling=LF.SHAPES["llama3_8b"]["rope_scaling"])
IDS = np.random.default_rng(7).integers(0, 300, (2, 16)).astype(np.int32)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{(family, format): path} of four small stored models."""
    d = tmp_path_factory.mktemp("finetune")
    bitnet_gguf = R.write_gguf(d / "bitnet.gguf", BITNET, R.random_weights(BITNET, seed=3),
                               vocab=R.peer_vocab(BITNET["vocab"]))
    MF.write_hf(d / "bitnet_hf")
    w = LF.weights(LLAMA, seed=4)
    for k in w:                  # ~unit-gain projections: llama.cpp's per-block int8
        if k.endswith(".scale"):  # activations then round as BitLinear's per-token ones
            w[k] = np.float32(w[k] / 4)
    LF.write_hf_llama(d / "llama_hf", LLAMA, w)
    llama_gguf = LF.write_gguf_llama(d / "llama.gguf", LLAMA, w,
                                     vocab=R.peer_vocab(LLAMA["vocab"]))
    return {("bitnet", "gguf"): bitnet_gguf, ("bitnet", "hf"): d / "bitnet_hf",
            ("llama_bitnet", "hf"): d / "llama_hf", ("llama_bitnet", "gguf"): llama_gguf}


def codes(lm):
    """{projection name: (T, scale)}."""
    return {name: getattr(owner, attr).ternary() for name, owner, attr in lm.projections()}


def test_absmean_latent_quantizes_back_to_the_codes_and_the_scale():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n, k = rng.integers(1, 200, 2)
        p = rng.uniform(0.02, 0.5)
        t = rng.choice(np.array([-1, 0, 1], np.int8), size=(n, k), p=[p, 1 - 2 * p, p])
        s = np.float32(rng.uniform(1, 10) * 10.0 ** rng.integers(-4, 1))
        back_t, back_s = tp.absmean_ternarize(tp.absmean_latent(t, s))
        if t.any():
            assert back_s == s, (n, k, p, s, back_s)
        np.testing.assert_array_equal(back_t, t)


@pytest.mark.parametrize("key", [("bitnet", "gguf"), ("bitnet", "hf"), ("llama_bitnet", "gguf"),
                                 ("llama_bitnet", "hf")], ids="-".join)
def test_the_trainable_model_computes_the_stored_model(files, key):
    stored, latent = models.load(files[key]), models.load(files[key], trainable=True)
    assert latent.config.family == key[0]
    assert all(type(getattr(o, a)) is nn.BitLinear for _, o, a in latent.projections())
    assert "layers.0.attn.q_proj.weight" in latent.parameters()
    assert "layers.0.attn.q_proj.weight" not in stored.parameters()
    for name, (t, s) in codes(stored).items():
        t2, s2 = codes(latent)[name]
        np.testing.assert_array_equal(t2, t, err_msg=name)
        assert s2 == s, name
    want = stored(IDS)
    np.testing.assert_allclose(latent(IDS), want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_freeze_patterns_and_predicates(files):
    path = files[("bitnet", "gguf")]
    lm = models.load(path, trainable=True, freeze=["embed_tokens", "layers.0.mlp", "*norm*"])
    names = set(lm.parameters())
    assert names == {f"layers.0.attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert isinstance(lm.layers[0].mlp.up_proj, nn.StoredBitLinear)     # kept 2-bit
    only_q = models.load(path, trainable=True, freeze=lambda n: not n.endswith("q_proj.weight"))
    assert set(only_q.parameters()) == {"layers.0.attn.q_proj.weight"}
    with pytest.raises(tc.TercompError, match="'layer.0' matches no parameter"):
        models.load(path, trainable=True, freeze="layer.0")


def loss_fn(lm, x, y):
    logits = lm(x)
    return tc.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


FREEZE = {"bitnet": ["embed_tokens", "layers.0.attn.q_proj", "*sub_norm"],    # patterns
          "llama_bitnet": lambda name: name.startswith("lm_head") or "layernorm" in name}


@pytest.fixture(scope="module", params=["bitnet", "llama_bitnet"])
def tuned(request, files):
    """(family, source path, the stored model, the fine-tuned model, losses): four AdamW
    steps on one batch of the GGUF, frozen as FREEZE says, synced back."""
    family = request.param
    path = files[(family, "gguf")]
    lm = models.load(path, trainable=True, freeze=FREEZE[family])
    x, y = IDS, np.roll(IDS, -1, axis=1)
    step = tc.compile_train_step(loss_fn, lm, tc.optim.AdamW(2e-3), x, y, clip_norm=1.0)
    losses = [step(x, y) for _ in range(4)]
    assert step.sync_to(lm) is lm
    return family, path, models.load(path), lm, losses


def test_training_starts_at_the_stored_loss_and_lowers_it(tuned):
    family, _, stored, lm, losses = tuned
    logits = stored(IDS).astype(np.float64)
    y = np.roll(IDS, -1, axis=1)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, y[..., None], -1).mean()
    # the compiled step reduces in float32 in its own order (the absmean scale, the
    # activation absmax), and this random bitnet model's logits reach ~80: float noise
    # of 1e-3 relative; the eager forward above is exact (test_..._stored_model)
    assert losses[0] == pytest.approx(want, rel=2e-3), family
    assert losses[-1] < losses[0] - 0.05, losses


def test_freeze_keeps_the_frozen_arrays_bit_identical(tuned):
    family, path, stored, lm, _ = tuned
    start = models.load(path, trainable=True)
    frozen = [n for n in start.parameters() if n not in lm.parameters()]
    assert frozen, family
    for name in frozen:
        np.testing.assert_array_equal(_get(lm, name) if not name.endswith("proj.weight")
                                      else _get(lm, name[:-7]).ternary()[0],
                                      _get(start, name) if not name.endswith("proj.weight")
                                      else _get(stored, name[:-7]).ternary()[0], err_msg=name)
    before, after = codes(stored), codes(lm)
    for name, owner, attr in lm.projections():
        if isinstance(getattr(owner, attr), nn.StoredBitLinear):     # frozen projections
            assert f"{name}.weight" in frozen
            np.testing.assert_array_equal(after[name][0], before[name][0])
            assert after[name][1] == before[name][1]
    moved = [n for n in lm.parameters() if not np.array_equal(_get(lm, n), _get(start, n))]
    assert len(moved) == len(lm.parameters()), "training left a trainable array unchanged"


def _get(module, name):
    obj = module
    for p in name.split("."):
        obj = obj[int(p)] if isinstance(obj, list) else getattr(obj, p)
    return obj if isinstance(obj, nn.Module) else np.asarray(obj)


def test_save_gguf_of_the_fine_tuned_model_loads_back(tuned, tmp_path):
    family, _, _, lm, _ = tuned
    models.save_gguf(lm, tmp_path / "tuned.gguf")
    back = models.load(tmp_path / "tuned.gguf")
    assert back.config.family == family
    want = lm(IDS)
    if family == "bitnet":       # f32 tables and `.scale` tensors: nothing is rounded
        np.testing.assert_array_equal(back(IDS), want)
    else:                        # f16 tables and block scales, as llama.cpp's converter
        assert R.cosine(back(IDS), want).min() >= 0.999


def test_llama_cpp_runs_the_fine_tuned_gguf_as_tercomp_does(tuned, tmp_path):
    """The file save_gguf writes from the fine-tuned model: llama.cpp's logits against
    tercomp's for that same file."""
    llama_cpp = pytest.importorskip("llama_cpp")
    family, _, _, lm, _ = tuned
    path = tmp_path / "tuned.gguf"
    models.save_gguf(lm, path)
    peer = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True,
                           verbose=False)
    theirs = R.peer_logits(peer, IDS[0])
    ours = models.load(path)(IDS[:1])[0]
    cos = R.cosine(ours, theirs)
    top1, n = R.top1_agreement(ours, theirs, margin=0.05)
    print(f"{family} fine-tuned: llama.cpp cosine min {cos.min():.6f} mean {cos.mean():.6f}, "
          f"top-1 {top1:.3f} of {n}")
    assert cos.min() >= 0.999 and top1 >= 0.95, (cos.min(), top1, n)


def test_save_hf_of_the_fine_tuned_model_loads_back(tuned, tmp_path):
    family, _, _, lm, _ = tuned
    models.save_hf(lm, tmp_path / "tuned")
    back = models.load(tmp_path / "tuned")
    assert (back.config.family, back.config.rope_style) == (family, "neox")
    want = lm(IDS)
    # a llama GGUF's q/k rows are un-permuted to rotate-half order: same sums, reordered
    np.testing.assert_allclose(back(IDS), want, rtol=0, atol=1e-6 * np.abs(want).max())

