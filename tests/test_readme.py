"""The README's first-run promises: the main job and the command-line examples run as
written."""
import importlib.util
import os
import re
import shlex
import socket
import subprocess
import sys

import numpy as np
import pytest

import bitnet_mlp  # samples/ is on sys.path (tests/conftest.py)
from tercomp import distributed
from tercomp.runtime.devices import driver_present

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_main_job_sample_checks_itself(capsys):
    bitnet_mlp.main(["--hidden", "256", "--repeat", "2"])
    out = capsys.readouterr().out
    assert out.count('"tern.ternary_matmul"') == 3 and "bitnet_mlp: OK" in out
    # each layer's kernel in full (its IR line is not cut) and the table row that chose it
    assert out.count("why: ternary_matmul kernel ") == 3 and " ..." not in out
    assert re.search(r"packed [\d.]+ MiB vs f32 [\d.]+ MiB \(1[2-6]\.\dx smaller\)", out), out


def test_command_line_examples_run_as_written(tmp_path):
    """The block as one bash session from the repository root, as a user pastes it: it
    moves to a scratch directory first, so nothing lands in the repository."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = text.split("## The command line", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert len(lines) >= 8 and any(ln.startswith("tercomp generate") for ln in lines)
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "TERCOMP_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmp_path)}
    before = set(os.listdir(ROOT))
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    made = r.stdout.strip().splitlines()[-1]
    assert made.startswith(str(tmp_path)) and os.path.getsize(made) > 0
    assert set(os.listdir(ROOT)) == before


@pytest.mark.skipif(not driver_present("vulkan"),
                    reason="no Vulkan device (apt-get install mesa-vulkan-drivers)")
def test_targets_section_trains_on_vulkan_as_written():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = text.split("## Targets", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    assert 'target="vulkan"' in block
    scope = {}
    exec(compile(block, "README.md#targets", "exec"), scope)
    assert scope["step"].exe.device == "vulkan"
    shown = re.search(r"losses = .*#\s*([\d.]+(?:, [\d.]+)+)\s*$", block, re.M).group(1)
    np.testing.assert_allclose(scope["losses"], [float(v) for v in shown.split(", ")], atol=3e-3)


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None
                        for m in ("fastapi", "uvicorn", "prometheus_client", "openai")),
                    reason="needs the serve extra and openai: pip install -e '.[test]'")
def test_serving_section_runs_as_written(tmp_path):
    """The Serving section's commands and client code, as written but on a free port
    (8000 may be taken): the `... &` line is the server, stopped at the end."""
    section = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read() \
        .split("## Serving", 1)[1].split("\n## ", 1)[0]
    bash = section.split("```bash", 1)[1].split("```", 1)[0]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    lines = [ln.replace("8000", port) for ln in bash.splitlines() if ln.strip()]
    assert any(ln.startswith("tercomp serve") for ln in lines) and "8000" in code
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "PYTHONPATH": os.path.abspath(ROOT), "TERCOMP_CACHE_DIR": str(tmp_path / "cache")}
    server = None
    try:
        for line in lines:
            words = shlex.split(line, comments=True)
            if words[-1] == "&":
                server = subprocess.Popen(words[:-1], cwd=tmp_path, env=env,
                                          stdout=subprocess.DEVNULL,
                                          stderr=open(tmp_path / "server.log", "w"))
                continue
            r = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True,
                               text=True, timeout=300)
            assert r.returncode == 0, f"{line}\n{r.stdout}\n{r.stderr}\n" \
                                      f"{(tmp_path / 'server.log').read_text()}"
        r = subprocess.run([sys.executable, "-c", code.replace("8000", port)], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == ["length 8", "8"]
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)


# flags appended to finetune_lm.py's command in the default test (the section as written
# takes minutes; the slow test runs it so)
FINETUNE_SHRINK = {"samples/finetune_lm.py": ["--steps", "8", "--seq", "64", "--lr", "1e-2",
                                              "--tokens", "4"]}


def run_finetune_section(tmp_path, shrink, skip_first=False):
    """Run the Fine-tuning section's commands in order (the sample ones with `shrink`'s
    flags appended; `skip_first`: not tiny_lm.py's); returns their outputs."""
    section = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read() \
        .split("## Fine-tuning a stored model", 1)[1].split("\n## ", 1)[0]
    bash = section.split("```bash", 1)[1].split("```", 1)[0]
    lines = [shlex.split(ln, comments=True) for ln in bash.splitlines() if ln.strip()]
    assert [w[:2] for w in lines] == [["python", "samples/tiny_lm.py"],
                                      ["python", "samples/finetune_lm.py"],
                                      ["tercomp", "generate"]]
    os.symlink(os.path.join(ROOT, "samples"), tmp_path / "samples")
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "PYTHONPATH": os.path.abspath(ROOT), "TERCOMP_CACHE_DIR": str(tmp_path / "cache")}
    outs = [None] if skip_first else []
    for words in lines[1:] if skip_first else lines:
        words = [sys.executable if w == "python" else w for w in words]
        words += shrink.get(words[1], [])
        r = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, f"{words}\n{r.stdout}\n{r.stderr}"
        outs.append(r.stdout)
    return outs


def check_finetune_outputs(tmp_path, outs):
    from tercomp import models
    before = float(re.search(r"held-out loss before: ([\d.]+)", outs[1]).group(1))
    after = float(re.search(r"held-out loss after: +([\d.]+)", outs[1]).group(1))
    assert after < before, outs[1]
    assert "def " in outs[2]
    tuned, tuned_hf = models.load(tmp_path / "tuned.gguf"), models.load(tmp_path / "tuned_hf")
    assert tuned.tokenizer.encode("def ").ids == [100, 101, 102, 32]    # bytes, as trained
    ids = np.arange(32, dtype=np.int32).reshape(2, 16)
    np.testing.assert_array_equal(tuned_hf(ids), tuned(ids))
    return before, after


@pytest.mark.slow     # tests/test_finetune.py trains the same way, on smaller models
def test_finetune_section_runs_small(tmp_path):
    """finetune_lm.py -> tercomp generate as the README writes them, at a small size
    (FINETUNE_SHRINK), on an untrained stand-in of what tiny_lm.py writes (a byte-level
    `bitnet` GGUF with its tokenizer, 1 layer of 64)."""
    import tiny_lm
    from tercomp import models, nn
    nn.manual_seed(0)
    lm = models.BitNetLM(tiny_lm.config(tiny_lm.argparse.Namespace(hidden=64, layers=1,
                                                                  seq=64)))
    lm.tokenizer = tiny_lm.byte_tokenizer()
    models.save_gguf(lm, tmp_path / "tiny.gguf")
    outs = run_finetune_section(tmp_path, FINETUNE_SHRINK, skip_first=True)
    before, after = check_finetune_outputs(tmp_path, outs)
    assert after < before - 0.1


@pytest.mark.slow
def test_finetune_section_runs_as_written(tmp_path):
    outs = run_finetune_section(tmp_path, {})
    print(*outs, sep="\n")
    check_finetune_outputs(tmp_path, outs)


def test_llama_architecture_chat_section_runs_as_written(tmp_path, monkeypatch):
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## A llama-architecture model, chatted with", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    command = section.split("```bash", 1)[1].split("```", 1)[0].strip()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TERCOMP_CACHE_DIR", str(tmp_path / "cache"))
    scope = {}
    exec(compile(code, "README.md#a-llama-architecture-model-chatted-with", "exec"), scope)
    assert (scope["lm"].config.family, scope["lm"].config.rope_style) == \
        ("llama_bitnet", "interleaved")
    assert 0 < len(scope["reply"]) <= 16
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    r = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"{command}\n{r.stdout}\n{r.stderr}"
    # the module compile_lm built above, as the README says (a compile of its own took 4 s)
    assert "(compiled module from the compile cache)" in r.stderr, r.stderr


@pytest.mark.skipif(distributed.mpi4py is None or distributed.launcher() is None,
                    reason=f"no mpi4py or mpiexec ({distributed.EXTRA})")
@pytest.mark.slow     # tests/test_distributed.py runs the same steps under mpiexec -n 2
def test_mpi_commands_run_as_written(tmp_path):
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Data-parallel training over MPI", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 2)[2].split("```", 1)[0]       # the second: mpiexec lines
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert lines and all(ln.startswith("mpiexec -n 2 ") for ln in lines), lines
    # mpiexec is found beside python, as after `pip install -e '.[distributed]'`
    env = {**os.environ, "PATH": os.path.dirname(distributed.launcher()) + os.pathsep
           + os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    outs = []
    for line in lines:
        r = subprocess.run(line, shell=True, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"{line}\n{r.stdout}\n{r.stderr}"
        outs.append(r.stdout)
    # (mpiexec merges the ranks' output in chunks: "0 of 21 of 2" happens)
    assert sorted(re.findall(r"(\d) of 2", outs[0])) == ["0", "1"], outs[0]
    # rank 0 alone prints the sample's report
    assert outs[1].count("test accuracy of the compiled") == 1, outs[1]
    assert "data parallel: 2 rank(s), 32 of each batch of 64 per rank" in outs[1]


def test_embeddings_section_runs_as_written(tmp_path, monkeypatch):
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Sentence embeddings", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TERCOMP_CACHE_DIR", str(tmp_path / "cache"))
    scope = {}
    exec(compile(code, "README.md#sentence-embeddings", "exec"), scope)
    e = scope["e"]
    assert e.shape == (2, 256) and np.allclose(np.linalg.norm(e, axis=-1), 1, atol=1e-5)
    assert -1 <= float(e[0] @ e[1]) < 0.9999


def test_families_table_lists_every_family():
    from tercomp.models import families
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    table = text.split("## Model families", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("| `")]
    assert sorted(r.split("`")[1] for r in rows) == sorted(f.name for f in families.FAMILIES)
    for f in families.FAMILIES:
        row = next(r for r in rows if r.startswith(f"| `{f.name}`"))
        assert f"`{f.gguf_arch}`" in row and any(m in row for m in f.hf_architectures)
