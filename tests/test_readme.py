"""The README's first-run promises: the main job and the command-line examples run as
written."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import bitnet_mlp  # samples/ is on sys.path (tests/conftest.py)
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
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = text.split("## The command line", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert len(lines) >= 8 and any(ln.startswith("tercomp generate") for ln in lines)
    os.symlink(os.path.join(ROOT, "samples"), tmp_path / "samples")
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "TERCOMP_CACHE_DIR": str(tmp_path / "cache")}
    for line in lines:
        r = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, f"{line}\n{r.stdout}\n{r.stderr}"
    assert (tmp_path / "lm.tcm").stat().st_size > 0


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
