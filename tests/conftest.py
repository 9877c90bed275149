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
# (test_hostile_models, test_hostile_ir and test_cli ran a python a case or command
# until tests/box.py forked them from a preloaded process: 60, 41, 56 s before.)
HEAVY_FIRST = ("test_ternary_kernels.py", "test_autodiff_registry.py", "test_readme.py",
               "test_serve.py", "test_bitconv.py", "test_one_decoder.py", "test_llama_family.py",
               "test_compile_cache.py", "test_artifacts.py", "test_embed.py",
               "test_distributed.py", "test_cli.py", "test_train.py", "test_batched.py")


# Cases under -m slow because a faster sibling in the default suite checks the same
# behaviour (the default suite must stay under 10 minutes on CI's 2 cores). By node id,
# where the case comes from a module fixture's parameter and cannot carry a mark itself.
SLOW_CASES = (
    # the other llama-family shape (falcon3_1b) generates, and each shape loads and agrees
    "test_llama_family.py::test_llama_bitnet_generates_as_it_computes[llama3_8b-gguf]",
    "test_llama_family.py::test_gguf_llama_tq1_0[llama3_8b-34]",
    "test_llama_family.py::test_save_gguf_writes_the_llama_arch[falcon3_1b]",
    # two of the four attention shapes (a prefill form and a decode form) stay on the CPU;
    # on Vulkan (lavapipe: ~7 s each, polling threads) they are all -m slow cases
    "test_gpu_lm.py::test_generic_attention_matches_the_reference[2-1-5-0-",
    "test_gpu_lm.py::test_generic_attention_matches_the_reference[4-4-8-3-",
    "test_gpu_lm.py::test_generic_attention_matches_the_reference[4-2-8-0-vulkan]",
    "test_gpu_lm.py::test_generic_attention_matches_the_reference[4-2-3-5-vulkan]",
    # one blocking of the blocked kernel stays; the others are its -m slow cases
    "test_ternary_kernels.py::test_blocked_unpacks_block_by_block[6-6]",
    "test_ternary_kernels.py::test_blocked_unpacks_block_by_block[7-1]",
    # the default strategy stays (the addsub kernel has its own tests)
    "test_weights.py::test_bitlinear_inline_and_irpa_agree[addsub]",
    # qwen3's last-token pooling and gemma3's stay (cls: gemma3 mean/cls are slow already)
    "test_embed.py::test_pooled_embeddings_agree_with_the_reference[qwen3-cls]",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.nodeid.split("/")[-1].startswith(case) for case in SLOW_CASES):
            item.add_marker(pytest.mark.slow)
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
