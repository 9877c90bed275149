"""Command-line arguments are checked before anything is loaded or compiled: malformed
flags are usage errors (status 2) naming the flag, a prompt that does not fit the model
is an error before the compile, and hints name flags (--max-seq), not Python parameters
(max_seq). compile_lm is replaced by a function that fails the test wherever a check
must come first."""
import subprocess
import sys

import numpy as np
import pytest

import tercomp as tc
from tercomp import models
from tercomp.cli import UsageError, main, parse_spec

import bitnet_ref as R

CFG = dict(hidden=256, ff=256, vocab=300, heads=4, kv_heads=2, layers=1, eps=1e-5,
           theta=10000.0, ctx=128)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return str(R.write_gguf(tmp_path_factory.mktemp("lm") / "tiny.gguf", CFG, R.random_weights(CFG, seed=7)))


@pytest.fixture(scope="module")
def gen(gguf):
    return tc.compile_lm(models.load(gguf), max_seq=16)


@pytest.fixture(scope="module")
def lm_tcm(gen, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("art") / "lm.tcm")
    gen.save(path)
    return path


@pytest.fixture(scope="module")
def fn_tcm(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("art") / "fn.tcm")
    tc.compile(lambda x: x * 2.0, tc.spec(("B", 8))).save(path)
    return path


@pytest.fixture
def no_compile(monkeypatch):
    """compile_lm and models.load fail the test: the check under test must come first."""
    def boom(*a, **k):
        raise AssertionError("reached the model load or the compile")
    monkeypatch.setattr(tc, "compile_lm", boom)
    monkeypatch.setattr(models, "load", boom)


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tercomp: error: "), err
    assert "internal error" not in err[0]
    return err[0]


@pytest.mark.parametrize("flags, message", [
    (["--prompt-ids", "1 2"], "--prompt-ids must be comma-separated token ids (ASCII digits) like 1,2,3; '1 2'"),
    (["--prompt-ids", "1,,2"], "--prompt-ids must be comma-separated token ids (ASCII digits) like 1,2,3; an empty item"),
    (["--prompt-ids", "1,2,"], "an empty item in '1,2,'"),
    (["--prompt-ids", "１２"], "'１２' in '１２' is not one"),
    (["--prompt-ids", "-1"], "'-1' in '-1' is not one"),
    (["--prompt-ids", "0x10"], "'0x10'"),
    (["--prompt-ids", ""], "--prompt-ids is empty"),
    (["--prompt-ids", "  "], "--prompt-ids is empty"),
    (["--prompt-ids", "3," + "9" * 20], "--prompt-ids: " + "9" * 20 + " is too large for a token id"),
    (["--prompt-ids", str(2 ** 31)], "is too large for a token id (at most 2147483647)"),
    (["--prompt-ids", "9" * 5000], "--prompt-ids: 999999999999...(5000 digits) is too large"),
    (["--prompt-ids", "1", "--eos", "1" * 5000], "--eos: 111111111111...(5000 digits) is too large"),
    (["--prompt-ids", "1", "--eos", ""], "--eos is empty"),
    (["--prompt-ids", "1", "--eos", "2;3"], "--eos must be comma-separated token ids"),
    (["--prompt-ids", "1", "--save", ""], "--save needs a file path"),
    (["--prompt-ids", "1", "--save", "  "], "--save needs a file path"),
    (["--prompt-ids", "1", "--save", "/no/such/dir/lm.tcm"], "--save /no/such/dir/lm.tcm: the directory /no/such/dir does not exist"),
    (["--prompt", "caf\udce9"], "--prompt is not valid UTF-8 text"),
    (["--chat", "\udcff"], "--chat is not valid UTF-8 text"),
    (["--prompt-ids", "1", "--temperature", "-0.5"], "--temperature must be a number >= 0 (0 is greedy), got -0.5"),
    (["--prompt-ids", "1", "--temperature", "nan"], "--temperature must be a number >= 0"),
    (["--prompt-ids", "1", "--temperature", "inf"], "--temperature must be a number >= 0"),
    (["--prompt-ids", "1", "--top-p", "0"], "--top-p must be a number in (0, 1], got 0.0"),
    (["--prompt-ids", "1", "--top-p", "1.5"], "--top-p must be a number in (0, 1]"),
    (["--prompt-ids", "1", "--top-p", "nan"], "--top-p must be a number in (0, 1]"),
    (["--prompt-ids", "1", "--seed", "-3"], "--seed must be a non-negative integer, got -3"),
    (["--prompt-ids", "1", "-n", "²"], "expected a positive integer, got '²'"),
    (["--prompt-ids", "1", "-n", "１２"], "expected a positive integer, got '１２'"),
    (["--prompt-ids", "1", "--max-seq", "0"], "expected a positive integer, got '0'"),
    (["--prompt-ids", "1", "--target", "llvm-cpu", "--target", "llvm-cpu-generic"],
     "--target given 2 times: tercomp generate compiles for one target"),
])
def test_generate_usage_errors_come_before_the_model(gguf, no_compile, capsys, flags, message):
    assert main(["generate", gguf, *flags]) == 2
    assert message in one_error(capsys)


def test_save_to_a_directory_is_a_usage_error(gguf, no_compile, capsys, tmp_path):
    assert main(["generate", gguf, "--prompt-ids", "1", "--save", str(tmp_path)]) == 2
    assert f"--save {tmp_path}: that is a directory" in one_error(capsys)


def test_a_non_utf8_prompt_in_a_subprocess(gguf):
    r = subprocess.run([sys.executable, "-m", "tercomp.cli", "generate", gguf.encode(), "--prompt",
                        b"caf\xe9 \xff"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "--prompt is not valid UTF-8 text" in r.stderr and "internal error" not in r.stderr


@pytest.fixture
def loads_but_never_compiles(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("reached the compile")
    monkeypatch.setattr(tc, "compile_lm", boom)


@pytest.mark.parametrize("flags, message", [
    (["--prompt", "hello"], "--prompt needs the model's tokenizer, and {m} has no tokenizer (hint: pass token ids with --prompt-ids"),
    (["--chat", "hello"], "--chat needs the model's tokenizer"),
    (["--prompt-ids", "1,300"], "--prompt-ids: token id 300 is out of range for the model's vocabulary of 300"),
    (["--prompt-ids", "1", "--eos", "2,999"], "--eos: token id 999 is out of range"),
    (["--prompt-ids", "1", "--max-seq", "4096"], "--max-seq 4096 is more than {m}'s context of 128 positions "
                                                 "(max_position_embeddings) (hint: pass --max-seq 128 or less)"),
    (["--prompt-ids", "1,2,3", "-n", "20", "--max-seq", "16"],
     "3 prompt tokens and -n 20 need 22 cache positions; the cache holds 16 (hint: pass a larger --max-seq, "
     "or fewer tokens with -n)"),
    (["--prompt-ids", "1,2,3", "-n", "200"], "need 202 cache positions; the cache holds 128"),
])
def test_generate_checks_the_prompt_before_the_compile(gguf, loads_but_never_compiles, capsys, flags, message):
    assert main(["generate", gguf, *flags]) == 1
    err = one_error(capsys)
    assert message.format(m=gguf) in err and "max_seq" not in err


def test_compile_flags_with_an_artifact_are_usage_errors(lm_tcm, capsys):
    assert main(["generate", lm_tcm, "--prompt-ids", "1", "--max-seq", "64"]) == 2
    assert f"--max-seq applies when compiling a model; {lm_tcm} is a compiled artifact" in one_error(capsys)
    assert main(["generate", lm_tcm, "--prompt-ids", "1", "--kv-dtype", "float32", "--no-cache"]) == 2
    assert "--kv-dtype, --no-cache apply when compiling" in one_error(capsys)


def test_an_artifact_names_flags_when_the_prompt_does_not_fit(lm_tcm, capsys):
    assert main(["generate", lm_tcm, "--prompt-ids", "1,2,3", "-n", "20"]) == 1
    err = one_error(capsys)
    assert "need 22 cache positions; the artifact holds 16" in err
    assert "ask for fewer tokens with -n, or compile the model file again with a larger --max-seq" in err
    assert main(["generate", lm_tcm, "--prompt", "hi"]) == 1
    assert "has no tokenizer" in one_error(capsys)


def test_well_formed_ids_with_spaces_around_commas(lm_tcm, gen, capsys):
    assert main(["generate", lm_tcm, "--prompt-ids", " 1, 2 ,3", "-n", "4", "--eos", "299, 298"]) == 0
    out = capsys.readouterr().out
    want = gen.generate([1, 2, 3], max_new_tokens=4, eos={298, 299})
    assert [int(t) for t in out.split()] == want.tolist()


def test_run_without_inputs_says_to_pass_input(fn_tcm, capsys):
    assert main(["run", fn_tcm]) == 2
    err = one_error(capsys)
    assert "no --input given; " in err and "takes 1 input (x: [B, 8] f32)" in err
    assert "pass one --input per input" in err and "e.g. --input 2x8xf32=0" in err
    assert main(["run", fn_tcm, "--input", "1x8xf32=0", "--input", "f32=1"]) == 2
    assert "2 --input given; " in one_error(capsys)


def test_run_and_bench_of_a_language_model_name_generate(lm_tcm, capsys):
    for command in ("run", "bench"):
        assert main([command, lm_tcm]) == 2
        assert f"is a language model: `tercomp {command}` runs a function; generate with " \
               f"`tercomp generate {lm_tcm}" in one_error(capsys)


def test_bench_shows_the_dim_syntax(fn_tcm, capsys):
    assert main(["bench", fn_tcm]) == 2
    assert "input x has the symbolic dim B: give its size with --dim NAME=INT, e.g. --dim B=8" in one_error(capsys)
    assert main(["bench", fn_tcm, "--dim", "B=²"]) == 2
    assert "bad --dim 'B=²': use NAME=INT like B=8" in one_error(capsys)


def test_compile_of_an_unknown_name_lists_the_names(tmp_path, capsys):
    src = tmp_path / "m.py"
    src.write_text("import os\nimport numpy as np\n\ndef double(x):\n    return x * 2\n\n"
                   "def _hidden(x):\n    return x\n\nclass Net:\n    pass\n\nSIZE = 4\n")
    assert main(["compile", f"{src}:doubel", "--example", "4:f32", "-o", str(tmp_path / "o.tcm")]) == 2
    err = one_error(capsys)
    assert f"{src} has no 'doubel'; it defines Net, double (use {src}:NAME)" in err
    empty = tmp_path / "e.py"
    empty.write_text("X = 1\n")
    assert main(["compile", f"{empty}:f", "--example", "4:f32", "-o", str(tmp_path / "o.tcm")]) == 2
    assert "it defines no function, class or nn.Module to compile" in one_error(capsys)


def test_spec_dims_are_ascii_digits():
    with pytest.raises(UsageError, match="bad dim '²'"):
        parse_spec("²,4:f32")
    assert parse_spec("2,B:f32").shape == (2, "B")
