import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "samples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)


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
