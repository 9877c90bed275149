"""The compile cache is keyed on the program (build.Pipeline.key): an edited layer is
compiled anew, in this process and in another one sharing the cache directory, for
tc.compile_lm, tc.compile and tc.compile_train_step; the unedited model comes back
from the cache with its own results."""
import copy
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tercomp as tc
from tercomp import models, nn
from tercomp.models.bitnet import FeedForward

import bitnet_ref as R

CFG = dict(hidden=256, ff=512, vocab=96, heads=4, kv_heads=2, layers=1, eps=1e-5,
           theta=10000.0, ctx=64)
MAX_SEQ = 16
IDS = np.arange(1, 9, dtype=np.int32)


def _post(y):
    """A module-level function the Scaled layer's forward calls (redefined by a test)."""
    return y


class Halved(FeedForward):
    """The issue's edit: a first MLP whose forward halves its output."""
    def forward(self, x):
        return super().forward(x) * 0.5


class Scaled(FeedForward):
    def forward(self, x):
        return _post(super().forward(x))


@pytest.fixture(scope="module")
def lm_file(tmp_path_factory):
    return R.write_gguf(tmp_path_factory.mktemp("lm") / "tiny.gguf", CFG,
                        R.random_weights(CFG, seed=11))


@pytest.fixture(scope="module")
def base(lm_file):
    """(logits of IDS from the unedited model, its cache key), compiled first."""
    gen = tc.compile_lm(models.load(lm_file), max_seq=MAX_SEQ)
    return gen.prefill(IDS), gen.exe.meta["cache_key"]


def _logits(lm):
    gen = tc.compile_lm(lm, max_seq=MAX_SEQ)
    return gen.prefill(IDS), gen.exe.meta


def _assert_recompiled(lm, base):
    """`lm`, edited, is compiled anew (not the base's entry) and computes other logits."""
    logits, meta = _logits(lm)
    assert not meta["cache_hit"] and meta["cache_key"] != base[1]
    assert np.abs(logits - base[0]).max() > 1e-3
    return logits, meta


def test_a_subclassed_layer_recompiles_and_the_original_comes_back(lm_file, base):
    lm = models.load(lm_file)
    mlp = lm.layers[0].mlp
    mlp.__class__ = Halved
    halved, meta = _assert_recompiled(lm, base)
    again, meta2 = _logits(lm)                  # the edited model is a hit of its own
    assert meta2["cache_hit"] and meta2["cache_key"] == meta["cache_key"]
    np.testing.assert_array_equal(again, halved)
    mlp.__class__ = FeedForward                 # the class set back: the original module
    logits, meta = _logits(lm)
    assert meta["cache_hit"] and meta["cache_key"] == base[1]
    np.testing.assert_array_equal(logits, base[0])


def test_a_patched_method_recompiles(lm_file, base, monkeypatch):
    monkeypatch.setattr(FeedForward, "activation", lambda self, g: tc.relu(g))
    _assert_recompiled(models.load(lm_file), base)


def test_a_redefined_module_level_function_recompiles(lm_file, base, monkeypatch):
    lm = models.load(lm_file)
    lm.layers[0].mlp.__class__ = Scaled
    logits, meta = _logits(lm)                  # _post is the identity: the base program
    np.testing.assert_allclose(logits, base[0], rtol=0, atol=0)
    monkeypatch.setattr(sys.modules[__name__], "_post", lambda y: y * 2.0)
    _assert_recompiled(lm, base)


def test_a_swapped_callable_attribute_recompiles(lm_file, base):
    lm = models.load(lm_file)
    lm.layers[0].mlp.activation = tc.tanh       # an instance attribute over the method
    _assert_recompiled(lm, base)


def test_a_changed_config_field_recompiles(lm_file, base):
    lm = models.load(lm_file)
    lm.layers[0].mlp.hidden_act = "relu2"
    _assert_recompiled(lm, base)
    lm = models.load(lm_file)
    lm.config.rope_theta = 500.0                # read by the forward's RoPE tables
    _assert_recompiled(lm, base)


def test_another_process_sharing_the_cache_gets_its_own_program(lm_file, base):
    """A second process, same cache directory: the unedited model is the base's entry, and
    a layer edited there (a class of its own) is compiled anew, not taken from it."""
    script = textwrap.dedent(f"""
        import sys, numpy as np
        import tercomp as tc
        from tercomp import models
        from tercomp.models.bitnet import FeedForward
        class Tripled(FeedForward):
            def forward(self, x):
                return super().forward(x) * 3.0
        ids = np.arange(1, 9, dtype=np.int32)
        lm = models.load({str(lm_file)!r})
        plain = tc.compile_lm(lm, max_seq={MAX_SEQ})
        lm.layers[0].mlp.__class__ = Tripled
        edited = tc.compile_lm(lm, max_seq={MAX_SEQ})
        np.save(sys.argv[1], np.stack([plain.prefill(ids), edited.prefill(ids)]))
        print(plain.exe.meta["cache_hit"], edited.exe.meta["cache_hit"],
              plain.exe.meta["cache_key"])
    """)
    out = os.path.join(os.environ["TERCOMP_CACHE_DIR"], "..", "two.npy")
    r = subprocess.run([sys.executable, "-c", script, out], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    plain_hit, edited_hit, key = r.stdout.split()
    assert (plain_hit, edited_hit, key) == ("True", "False", base[1])
    plain, edited = np.load(out)
    np.testing.assert_array_equal(plain, base[0])
    assert np.abs(edited - base[0]).max() > 1e-3


class _Net(nn.Module):
    def __init__(self):
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(tc.relu(self.fc1(x)))


class _Tanh(_Net):
    def forward(self, x):
        return self.fc2(tc.tanh(self.fc1(x)))


def _loss(m, x, y):
    return tc.cross_entropy(m(x), y)


def test_compile_and_train_step_recompile_an_edited_model():
    x = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    y = np.arange(6, dtype=np.int32) % 4
    net = _Net()
    first = copy.deepcopy(net)
    exe = tc.compile(net, x)
    want = exe(x)
    net.__class__ = _Tanh
    edited = tc.compile(net, x)
    assert not edited.meta["cache_hit"] and edited.meta["cache_key"] != exe.meta["cache_key"]
    assert np.abs(edited(x) - want).max() > 1e-4
    net.__class__ = _Net
    again = tc.compile(net, x)
    assert again.meta["cache_hit"] and again.meta["cache_key"] == exe.meta["cache_key"]
    np.testing.assert_array_equal(again(x), want)

    losses = {}
    for cls in (_Net, _Tanh, _Net):
        net = copy.deepcopy(first)              # the same initial weights each time
        net.__class__ = cls
        step = tc.compile_train_step(_loss, net, tc.optim.SGD(0.1), x, y)
        losses.setdefault(cls, []).append((float(step(x, y)), step.exe.meta["cache_hit"],
                                           step.exe.meta["cache_key"]))
    (net1, hit1, key1), (net2, hit2, key2) = losses[_Net]
    (tanh, hit_t, key_t), = losses[_Tanh]
    assert (hit1, hit_t, hit2) == (False, False, True) and key1 == key2 != key_t
    assert net1 == net2 and abs(tanh - net1) > 1e-4



def test_the_output_table_choice_is_remembered_by_the_bytes_it_was_made_from(monkeypatch,
                                                                              tmp_path):
    """compile_lm's "auto" output table: the probe runs once per (table, norm, tercomp)
    and a cached compile reads its answer back; other bytes probe again, cache=False
    always probes, and an unreadable memo is probed over."""
    from tercomp import generate
    from tercomp.nn import stored
    monkeypatch.setenv("TERCOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(stored, "AUTO_INT8_MIN", 1)
    calls = []
    real = generate.choose_table
    monkeypatch.setattr(generate, "choose_table", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 64)).astype(np.float16)
    norm = np.ones(64, np.float32)
    first = generate._choose_table(w, norm, True)
    again = generate._choose_table(w, norm, True)
    assert len(calls) == 1 and first[0] == again[0] == real(w, norm)[0] and first[2] == again[2]
    np.testing.assert_array_equal(first[1].values, again[1].values)
    edited = w.copy()
    edited[7, 3] += np.float16(0.5)
    generate._choose_table(edited, norm, True)
    generate._choose_table(w, norm * 2, True)
    generate._choose_table(w, norm, False)
    assert len(calls) == 4
    memos = list((tmp_path / "output-table").iterdir())
    assert len(memos) == 3          # w, the edited table, the other norm
    for p in memos:
        p.write_text("{not json")
    assert generate._choose_table(w, norm, True)[0] == first[0] and len(calls) == 5


def test_a_fresh_entry_is_stamped_so_its_first_hit_does_not_hash_its_weights(lm_file, base,
                                                                              monkeypatch):
    """compile_cache.store writes an entry durably and stamps it verified: the hit that
    follows maps it without hashing its weights."""
    from tercomp.runtime import artifact, compile_cache
    path = compile_cache.entry_path(base[1])
    st = os.stat(path)
    meta, _, weights = artifact.read(path)
    assert artifact._stamped(artifact._stamp_path(path, st), meta["sha256"]["weights.irpa"])
    size = memoryview(weights).cast("B").nbytes
    hashed = []
    real = artifact._digest
    monkeypatch.setattr(artifact, "_digest", lambda d: hashed.append(len(memoryview(d).cast("B")))
                        or real(d))
    logits, meta = _logits(models.load(lm_file))
    assert meta["cache_hit"] and hashed and size not in hashed
    np.testing.assert_array_equal(logits, base[0])
