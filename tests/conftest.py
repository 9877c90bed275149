import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "samples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)


# The files with the most test time (`--durations=0` of the default suite, 3 workers,
# 2026-11-27), collected first: pytest-xdist's `--dist loadfile` hands out files in
# collection order, and alphabetically the heaviest (test_readme, test_serve,
# test_ternary_kernels) came last, so one of them ran on alone while the other workers
# had finished.
HEAVY_FIRST = ("test_ternary_kernels.py", "test_autodiff_registry.py", "test_readme.py",
               "test_serve.py", "test_bitconv.py", "test_one_decoder.py", "test_llama_family.py",
               "test_compile_cache.py", "test_hostile_models.py", "test_artifacts.py",
               "test_embed.py", "test_cli.py", "test_hostile_ir.py", "test_distributed.py",
               "test_train.py", "test_batched.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # stable


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Compiles in tests never read or write the user's cache."""
    os.environ["TERCOMP_CACHE_DIR"] = str(tmp_path_factory.mktemp("tercomp-cache"))
    yield


def run_filecheck(text: str, checks: str):
    """Run LLVM-style FileCheck (the `filecheck` package) of `text` against `checks`."""
    import subprocess
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".check", delete=False) as f:
        f.write(checks)
        path = f.name
    try:
        exe = os.path.join(os.path.dirname(sys.executable), "filecheck")
        r = subprocess.run([exe if os.path.exists(exe) else "filecheck", path], input=text,
                           capture_output=True, text=True)
    finally:
        os.unlink(path)
    assert r.returncode == 0, f"FileCheck failed:\n{r.stdout}\n{r.stderr}\n--- input ---\n{text}"
