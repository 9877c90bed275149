"""bench/lm.py's pure parts, without any peer binary: reading llama-bench's JSON and the
table of medians, bests and ratios it prints."""
import doctest
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import lm  # noqa: E402  (bench/lm.py)
import peers  # noqa: E402  (bench/peers.py)

# `llama-bench -m M -p 128,512 -n 64 -r 3 -t 2 -o json -rtr 1 -fa 0` as ik_llama.cpp prints
# it (its log goes to stderr; fields cut to those that matter and a few beside them)
IK_JSON = """[
  {
    "build_commit": "8337e4cd",
    "build_number": 4321,
    "cpu_info": "AMD EPYC 9R14",
    "model_filename": "/tmp/m.gguf",
    "model_type": "bitnet 700M IQ2_BN - 2.00 bpw Bitnet",
    "n_threads": 2,
    "flash_attn": false,
    "repack": true,
    "n_prompt": 128,
    "n_gen": 0,
    "test_time": "2026-11-27T12:00:00Z",
    "avg_ns": 332000000,
    "stddev_ns": 4000000,
    "avg_ts": 385.6,
    "stddev_ts": 4.6,
    "test": "pp128",
    "samples_ns": [ 330000000, 336000000, 330000000 ],
    "samples_ts": [ 387.879, 380.952, 387.879 ]
  },
  {
    "build_commit": "8337e4cd",
    "build_number": 4321,
    "cpu_info": "AMD EPYC 9R14",
    "model_filename": "/tmp/m.gguf",
    "model_type": "bitnet 700M IQ2_BN - 2.00 bpw Bitnet",
    "n_threads": 2,
    "flash_attn": false,
    "repack": true,
    "n_prompt": 512,
    "n_gen": 0,
    "test_time": "2026-11-27T12:00:02Z",
    "avg_ns": 1400000000,
    "stddev_ns": 10000000,
    "avg_ts": 365.7,
    "stddev_ts": 2.6,
    "test": "pp512",
    "samples_ns": [ 1390000000, 1400000000, 1410000000 ],
    "samples_ts": [ 368.345, 365.714, 363.121 ]
  },
  {
    "build_commit": "8337e4cd",
    "build_number": 4321,
    "cpu_info": "AMD EPYC 9R14",
    "model_filename": "/tmp/m.gguf",
    "model_type": "bitnet 700M IQ2_BN - 2.00 bpw Bitnet",
    "n_threads": 2,
    "flash_attn": false,
    "repack": true,
    "n_prompt": 0,
    "n_gen": 64,
    "test_time": "2026-11-27T12:00:05Z",
    "avg_ns": 685000000,
    "stddev_ns": 10000000,
    "avg_ts": 93.4,
    "stddev_ts": 1.4,
    "test": "tg64",
    "samples_ns": [ 680000000, 700000000, 675000000 ],
    "samples_ts": [ 94.1176, 91.4286, 94.8148 ]
  }
]
"""


def test_llama_bench_json_gives_every_repetition():
    r = peers.parse_llama_bench("main: a log line that reached stdout\n" + IK_JSON)
    # one prompt test for each length of -p 128,512
    assert r["pp"] == {128: [387.879, 380.952, 387.879], 512: [368.345, 365.714, 363.121]}
    assert r["tg"] == (64, [94.1176, 91.4286, 94.8148])
    assert r["build"] == "8337e4cd (4321)"
    assert r["cpu"] == "AMD EPYC 9R14"


def test_llama_bench_json_without_a_generation_test_is_an_error():
    only_pp = IK_JSON[:IK_JSON.index("  },") + 3] + "\n]"
    with pytest.raises(ValueError, match="no prompt or no generation test"):
        peers.parse_llama_bench(only_pp)


def test_table_of_medians_bests_and_ratios():
    peer = peers.parse_llama_bench(IK_JSON)
    rows = {"tercomp int8": {"pp": [400.0, 410.0, 420.0], "tg": [80.0, 82.0, 95.0]},
            "ik_llama.cpp IQ2_BN->R4": {"pp": peer["pp"][128], "tg": peer["tg"][1]},
            "bitnet.cpp I2_S": {"pp": [250.0], "tg": [80.0]}}
    lines = lm.format_table(rows, 128, 64, wrong={"bitnet.cpp I2_S"}).splitlines()
    header, ours, ik, bitnet, *ratios = lines
    assert header.split()[:2] == ["engine", "pp128"] and "tg64" in header
    assert ours.split()[-6:] == ["410.0", "/", "420.0", "82.0", "/", "95.0"]
    assert ik.split()[-6:] == ["387.9", "/", "387.9", "94.1", "/", "94.8"]
    assert bitnet.startswith("bitnet.cpp I2_S (wrong)")
    # a peer whose logits are wrong is in no ratio: median/median, best/best
    assert len(ratios) == 1
    assert ratios[0].split() == ["tercomp", "int8", "/", "ik_llama.cpp", "IQ2_BN->R4",
                                 "1.06x", "/", "1.08x", "0.87x", "/", "1.00x"]


def test_table_has_a_pp512_column_with_its_ratios():
    peer = peers.parse_llama_bench(IK_JSON)
    rows = {"tercomp int8": {"pp": [400.0, 410.0, 420.0], "tg": [80.0, 82.0, 95.0],
                             "pp_long": [550.0, 540.0, 600.0]},
            "ik_llama.cpp IQ2_BN->R4": {"pp": peer["pp"][128], "tg": peer["tg"][1],
                                        "pp_long": peer["pp"][512]},
            "bitnet.cpp I2_S": {"pp": [250.0], "tg": [80.0], "pp_long": []}}
    header, ours, ik, bitnet, ratio = lm.format_table(rows, 128, 64, long_prompt=512).splitlines()[:5]
    assert header.split()[:2] == ["engine", "pp128"] and header.split()[-5] == "pp512"
    assert ours.split()[-3:] == ["550.0", "/", "600.0"]
    assert ik.split()[-3:] == ["365.7", "/", "368.3"]
    assert bitnet.split()[-1] == "-"                    # a peer without the test
    # pp128, tg64, pp512: median / median, best / best
    assert ratio.split()[-9:] == ["1.06x", "/", "1.08x", "0.87x", "/", "1.00x",
                                  "1.50x", "/", "1.63x"]
    # without long_prompt, no third column whatever the rows hold
    assert "pp512" not in lm.format_table(rows, 128, 64)


def test_bench_refuses_a_cache_shorter_than_its_prompts(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lm.py", "--max-seq", "256"])     # pp512 needs 512
    with pytest.raises(SystemExit):
        lm.main()
    assert "--max-seq 256" in capsys.readouterr().err


def test_summary_is_median_and_best():
    assert lm.summarize([3.0, 1.0, 2.0, 10.0]) == (2.5, 10.0)


def test_format_table_docstring_example():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for t in finder.find(lm.format_table, "format_table", globs={"format_table": lm.format_table}):
        runner.run(t)
    assert runner.summarize(verbose=False).failed == 0


def test_stream_line_sets_median_against_median_and_best_against_best():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for t in finder.find(lm.stream_line, "stream_line", globs={"stream_line": lm.stream_line}):
        runner.run(t)
    assert runner.summarize(verbose=False).failed == 0
    # a read whose sweeps moved 16 -> 24 GB/s: the decode's median against the read's median
    line = lm.stream_line(1, [16.0, 20.0, 24.0], {"tercomp f16": {"bytes_per_token": 10**8},
                                                  "tercomp int8": {"bytes_per_token": None}},
                          {"tercomp f16": {"tg": [150.0, 170.0, 200.0]}})
    assert line.startswith("a streaming read, 1 thread: 20.0 / 24.0 GB/s (median / best of 3")
    assert "tercomp f16 reads 95 MiB a token: 17.0 GB/s at its median (85% of the read's " \
           "median), 20.0 at its best (83%)" in line
    assert "tercomp int8" not in line          # no bytes a token known: no fraction


def test_every_peer_flag_is_an_option_of_the_bench():
    flags = {p.flag for p in peers.PEERS.values()}
    assert flags == {"ik-llama", "bitnet-cpp", "llama-cpp"}


BATCHED_BENCH = """
main: n_kv_max = 1600, n_batch = 2048, n_ubatch = 512, flash_attn = 0, is_pp_shared = 0

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     64 |    1 |    192 |    0.331 |   386.71 |    0.689 |    92.89 |    1.020 |   188.24 |
|   128 |     64 |    8 |   1536 |    2.905 |   352.50 |    1.902 |   269.18 |    4.807 |   319.50 |
"""


def test_batched_bench_table_gives_aggregate_rates_per_batch():
    got = peers.parse_batched_bench(BATCHED_BENCH)
    assert got == {1: (386.71, 92.89), 8: (352.5, 269.18)}
    with pytest.raises(ValueError, match="no result rows"):
        peers.parse_batched_bench("main: error: unable to load model")


def test_char_tokens_cover_a_128k_vocabulary_in_utf8():
    toks = peers.char_tokens(128256)
    assert len(set(toks)) == 128256 and all(len(t) == 1 for t in toks)
    assert toks[:3] == [chr(0x4E00), chr(0x4E01), chr(0x4E02)]   # the 32k files' tokens kept
    "".join(toks).encode("utf-8")                                  # no surrogate


def test_the_logits_check_follows_the_network_s_precision_floor():
    """A shallow network (f16 and float32 KV caches agree closely) keeps the 0.99 bar; a
    deep one whose f16 cache alone moves its logits to cosine 0.985 asks 1 - 3 x 0.015."""
    import numpy as np
    rng = np.random.default_rng(0)
    base = rng.standard_normal((4, 64))
    one = base[:1]

    def ref(noise):
        moved = base + noise * rng.standard_normal(base.shape)
        return {"batch": base, "one": one, "batch_f32kv": moved, "one_f32kv": moved[:1]}
    floor, need = lm.check_floor(ref(1e-3))
    assert floor < 1e-5 and need == lm.COS_MIN
    floor, need = lm.check_floor(ref(0.18))          # cosine ~0.984
    assert 0.01 < floor < 0.03 and need == pytest.approx(1 - 3 * floor)


# ------------------------------------------------ the files: written once, reused after
def tiny(arch="llama"):
    import argparse
    return argparse.Namespace(hidden=256, ffn=512, vocab=300, layers=2, heads=4,
                              kv_heads=2 if arch == "llama" else 0, arch=arch, act=None)


@pytest.mark.parametrize("arch", ["llama", "bitnet"])
def test_the_peers_f16_source_holds_the_tq2_0_file_s_weights(tmp_path, arch):
    """write_model streams its tensors; its F16 form (what the peers' llama-quantize read)
    holds the TQ2_0 file's weights: codes x scale, exactly for the llama arch (TQ2_0's
    block scale is that f16 value), to f16's rounding of the bitnet arch's f32 `.scale`."""
    import gguf
    import numpy as np
    a = tiny(arch)
    lm.write_model(tmp_path / "m.gguf", a)
    lm.write_model(tmp_path / "f.gguf", a, projection="F16")
    ours = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    theirs = {t.name: t for t in gguf.GGUFReader(tmp_path / "f.gguf").tensors}
    assert set(theirs) == {n for n in ours if not n.endswith(".scale")}
    projections = 0
    for name, t in theirs.items():
        mine = ours[name]
        x = np.asarray(t.data, np.float32)
        if mine.tensor_type.name == "TQ2_0":
            projections += 1
            assert t.tensor_type.name == "F16"
            w = gguf.quants.dequantize(mine.data, mine.tensor_type).reshape(x.shape)
            if arch == "bitnet":
                w = w * np.asarray(ours[name[:-len("weight")] + "scale"].data)[0]
                np.testing.assert_allclose(x, w, rtol=3e-4)
            else:
                np.testing.assert_array_equal(x, w)
            assert set(np.unique(np.round(x / np.abs(x).max()))) == {-1.0, 0.0, 1.0}
        else:
            np.testing.assert_array_equal(x, np.asarray(mine.data, np.float32))
    assert projections == 7 * a.layers


def test_peer_files_convert_from_one_f16_source_then_remove_it(tmp_path, monkeypatch):
    """Every peer's llama-quantize gets the same f16 file (with the output table kept f16),
    which is removed after; a second run finds the peers' files and writes nothing."""
    import argparse
    import gguf
    calls = []

    def convert(peer, bin_dir, source, out):
        calls.append((peer.flag, source))
        assert {t.tensor_type.name for t in gguf.GGUFReader(source).tensors} == {"F16", "F32"}
        open(out, "wb").close()
    monkeypatch.setattr(peers, "convert", convert)
    a = argparse.Namespace(**vars(tiny()), dir=str(tmp_path), model=str(tmp_path / "m.gguf"))
    given = {"ik_llama.cpp": "IK", "bitnet.cpp": "BN", "llama.cpp": "LC"}
    files = lm.peer_files(a, given, "T")
    assert files == {"ik_llama.cpp": str(tmp_path / "bitnet-T-ik-llama-IQ2_BN.gguf"),
                     "bitnet.cpp": str(tmp_path / "bitnet-T-bitnet-cpp-I2_S.gguf"),
                     "llama.cpp": a.model}
    assert [c[0] for c in calls] == ["ik-llama", "bitnet-cpp"]
    assert {c[1] for c in calls} == {str(tmp_path / "bitnet-T-f16.gguf")}
    assert not os.path.exists(tmp_path / "bitnet-T-f16.gguf")
    assert lm.peer_files(a, given, "T") == files and len(calls) == 2
    q = peers.QUANTIZE_OPTIONS
    assert q[q.index("--output-tensor-type") + 1] == "f16"      # not ik's Q6_K head


def test_a_generator_is_compiled_once_and_again_when_its_key_changes(tmp_path, monkeypatch):
    """compile_once reuses a saved generator (and its logits check) compiled from the same
    model file with the same options by the same tercomp; another stamp, model or option
    compiles again and drops the old check."""
    import argparse
    compiles = []

    def run_worker(name, a, extra=()):
        assert name == "tercomp-compile"
        compiles.append(list(extra))
        open(a.artifact, "wb").close()
        return {"compile_cold_s": 1.0, "compile_cached_s": 0.5, "compile_peak_mb": 9.0,
                "bytes_per_token": 100}
    monkeypatch.setattr(lm, "run_worker", run_worker)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"gguf")
    a = argparse.Namespace(model=str(model), artifact=str(tmp_path / "g.tcm"),
                           passthrough=["--layers=2", "--prompt=128", "--max-batch=1"])
    stamp = {"tercomp": "abc", "iree": "3.13"}
    first = lm.compile_once(a, ["--output-dtype=int8"], stamp)
    assert "reused" not in first and len(compiles) == 1
    (tmp_path / "g.tcm.check.npz").write_bytes(b"x")
    a.passthrough[1] = "--prompt=512"               # not a compile option
    again = lm.compile_once(a, ["--output-dtype=int8"], stamp)
    assert again == {**first, "reused": True} and len(compiles) == 1
    assert os.path.exists(tmp_path / "g.tcm.check.npz")
    lm.compile_once(a, ["--output-dtype=int8"], {**stamp, "tercomp": "abd"})
    assert len(compiles) == 2 and not os.path.exists(tmp_path / "g.tcm.check.npz")
    lm.compile_once(a, ["--output-dtype=float16"], {**stamp, "tercomp": "abd"})
    assert len(compiles) == 3
    model.write_bytes(b"gguf2")                      # another model file
    lm.compile_once(a, ["--output-dtype=float16"], {**stamp, "tercomp": "abd"})
    assert len(compiles) == 4
    lm.compile_once(a, ["--output-dtype=float16"], None)        # no stamp: never reused
    lm.compile_once(a, ["--output-dtype=float16"], None)
    assert len(compiles) == 6
