"""bitnet.cpp, Microsoft's BitNet engine (a llama.cpp fork with the I2_S and TL2 ternary
kernels), as a peer of bench/lm.py: `python bench/lm.py --bitnet-cpp BUILD`, where BUILD
is what bench/build_bitnet_cpp.sh built.

Its files carry the weights of the bench's model exactly, made the way BitNet's
setup_env.py makes them from a checkpoint, and with no `.scale` tensors (a TL2 build, the
one setup_env.py builds on x86, does not load them: each I2_S or TL2 tensor keeps its
scale beside its codes):

- I2_S: a GGUF with the projections as float32 (codes x scale, as BitNet's converter
  writes them), which the build's `llama-quantize ... I2_S 1` packs (setup_env.py's step);
- TL2: the converter's own packing (`transform_to_tl2` of
  utils/convert-hf-to-gguf-bitnet.py, for the kernel shapes in include/kernel_config.ini),
  written by the fork's gguf-py, as the converter does with `--outtype tl2 --quant-embd`.

The token embedding stays float16 (tied output), as in the bench's GGUF. The token
strings are single characters, so that a prompt's text tokenizes to exactly its ids:
`check` feeds bitnet.cpp a prompt as text and compares its logits with tercomp's.

Speed is llama-batched-bench's: a prompt of `--prompt` tokens (the last position's logits
only), then `--gen` decode steps after it (each step's logits), as bench/lm.py measures
llama.cpp through llama-cpp-python.

TL2's kernels for more than one row (prefill) give wrong logits in BitNet 4645960: the
generated `three_qgemm_lut_<M>_<K><BATCH_SIZE>` (utils/codegen_tl2.py, unchanged at
BitNet's newest commit) copies every batch row's result to row 0 of C, so rows 1.. keep
whatever was there (NaN here). Its one-row kernel (decode) agrees with tercomp. `check`
finds this, and bench/lm.py leaves such a figure out of bitnet.cpp's best.
"""
from __future__ import annotations

import ast
import json
import os
import re
import resource
import subprocess
import sys
import types
from configparser import ConfigParser
from typing import Tuple

import numpy as np

TOOLS = ("llama-quantize", "llama-batched-bench", "llama-embedding")


def find(build: str) -> str | None:
    """What is missing from `build` for the bench, or None when everything is there."""
    missing = [t for t in TOOLS if not os.path.exists(os.path.join(build, "bin", t))]
    if missing:
        return (f"{build}/bin lacks {', '.join(missing)}: build with "
                f"bench/build_bitnet_cpp.sh BITNET_SRC {build}")
    if not os.path.exists(os.path.join(build, "source", "include", "kernel_config.ini")):
        return (f"{build}/source/include/kernel_config.ini is missing: bench/build_bitnet_cpp.sh "
                f"links the BitNet checkout there after the TL2 codegen")
    return None


def tl2_shapes(build: str) -> set[tuple[int, int]]:
    """The (rows, columns) of the projections the build's TL2 kernels were generated for."""
    config = ConfigParser()
    config.read(os.path.join(build, "source", "include", "kernel_config.ini"))
    return {(int(config.get(s, "m")), int(config.get(s, "k"))) for s in config.sections()}


def model_shapes(a) -> set[tuple[int, int]]:
    h, ff = a.hidden, a.ffn
    return {(h, h), (ff, h), (h, ff)}


def char_tokens(vocab: int) -> list[str]:
    """One character per token, none of them a space or a byte token, so a string of them
    tokenizes (SPM, no space prefix, no BOS) to exactly their ids."""
    return [chr(0x4E00 + i) for i in range(vocab)]


def float_projection(w, gguf, name, t, scale, arch):
    """A projection as BitNet's converter writes it for llama-quantize: codes x scale, f32."""
    w.add_tensor(f"{name}.weight", t * np.float32(scale))


def tl2_projection(convert):
    """A projection packed by the converter's `transform_to_tl2`, its scale in the hidden
    `_scale` tensor that the fork's gguf-py writes after the codes."""
    def write(w, gguf, name, t, scale, arch):
        data, s = convert(t * np.float32(scale))
        QT = gguf.GGMLQuantizationType
        w.add_tensor(f"{name}.weight", data, raw_shape=t.shape, raw_dtype=QT.TL2)
        w.add_tensor(f"{name}.weight_scale", s, raw_dtype=QT.F32)
    return write


def converter_tl2(source: str):
    """`transform_to_tl2` and the functions it calls, taken from BitNet's converter by
    name: the file imports torch at the top, which the bench does not need (the packing
    is numpy). It reads include/kernel_config.ini relative to the working directory."""
    path = os.path.join(source, "utils", "convert-hf-to-gguf-bitnet.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    wanted = {"transform_to_tl2", "preprocess_weights_tl2", "preprocess_three_weights_tl2",
              "preprocess_two_weights_tl2"}
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    if {n.name for n in body} != wanted:
        raise RuntimeError(f"{path} lacks {sorted(wanted - {n.name for n in body})}: a "
                           f"BitNet checkout this bench does not know")
    scope = {"np": np, "Tuple": Tuple}     # the names the functions use
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), scope)
    return scope["transform_to_tl2"]


def use_fork_gguf(source: str) -> None:
    """Make `import gguf` load the fork's gguf-py (it has the TL2 type and writes the
    hidden scales). Its vocab helpers import sentencepiece at the top; the bench writes
    its own vocabulary, so a stand-in does when sentencepiece is not installed."""
    sys.path.insert(0, os.path.join(source, "3rdparty", "llama.cpp", "gguf-py"))
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        sys.modules["sentencepiece"] = types.SimpleNamespace(SentencePieceProcessor=None)


def write_tl2(a, write_model) -> dict:
    """The --worker bitnet-tl2 step: writes a.artifact in a process of its own (it
    imports the fork's gguf, not the installed one)."""
    source = os.path.join(a.bitnet_cpp, "source")
    use_fork_gguf(source)
    convert = converter_tl2(source)
    out = os.path.abspath(a.artifact)
    os.chdir(source)
    write_model(out, a, projection=tl2_projection(convert), tokens=char_tokens(a.vocab))
    return {"path": out}


def prepare(a, write_model, run_worker, tag) -> dict:
    """bitnet.cpp's files of the bench's model, {column name: path}; made once per
    directory (reused with --keep, like the bench's GGUF). Kernels the build cannot run
    for this shape are left out with a message."""
    bin_dir = os.path.join(a.bitnet_cpp, "bin")
    files = {}
    i2s = os.path.join(a.dir, f"bitnet-{tag}-bitnet-cpp-i2_s.gguf")
    if not os.path.exists(i2s):
        f32 = os.path.join(a.dir, f"bitnet-{tag}-bitnet-cpp-f32.gguf")
        write_model(f32, a, projection=float_projection, tokens=char_tokens(a.vocab))
        r = subprocess.run([os.path.join(bin_dir, "llama-quantize"), f32, i2s + ".part", "I2_S",
                            "1"], capture_output=True, text=True)
        os.remove(f32)              # 4 bytes a weight: not worth keeping
        if r.returncode != 0:
            print(f"bitnet.cpp llama-quantize failed: I2_S skipped\n{r.stderr[-2000:]}",
                  file=sys.stderr)
        else:
            os.replace(i2s + ".part", i2s)
    if os.path.exists(i2s):
        files["bitnet.cpp I2_S"] = i2s
    missing = model_shapes(a) - tl2_shapes(a.bitnet_cpp)
    if missing:
        print(f"bitnet.cpp TL2 skipped: {a.bitnet_cpp} has no TL2 kernel for the (rows, "
              f"columns) {sorted(missing)}; its codegen (utils/codegen_tl2.py, step 1 of "
              f"bench/build_bitnet_cpp.sh) makes kernels per model shape", file=sys.stderr)
        return files
    tl2 = os.path.join(a.dir, f"bitnet-{tag}-bitnet-cpp-tl2.gguf")
    if not os.path.exists(tl2):
        a.artifact = tl2 + ".part"
        if run_worker("bitnet-tl2", a) is not None:
            os.replace(tl2 + ".part", tl2)
    if os.path.exists(tl2):
        files["bitnet.cpp TL2"] = tl2
    return files


def _run(cmd):
    """(stdout, stderr) of a bitnet.cpp tool: results go to stdout, its log to stderr."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed ({r.returncode}):\n"
                           f"{r.stderr[-3000:]}")
    return r.stdout, r.stderr


def worker_bench(a) -> dict:
    """llama-batched-bench on a.artifact: `repeat` prompts of `prompt` tokens each followed
    by `gen` decode steps, best of each; the cache sized n_ctx = max_seq, n_batch = prompt
    (as the llama.cpp worker). The binary is this worker's only child, so the children's
    peak RSS is its own."""
    cmd = [os.path.join(a.bitnet_cpp, "bin", "llama-batched-bench"), "-m", a.artifact,
           "-t", str(a.threads), "-tb", str(a.threads), "-c", str(a.max_seq),
           "-b", str(a.prompt), "-ub", str(a.prompt), "-npp", ",".join([str(a.prompt)] * a.repeat),
           "-ntg", str(a.gen), "-npl", "1", "--output-format", "jsonl"]
    out, log = _run(cmd)
    runs = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    if len(runs) != a.repeat:
        raise RuntimeError(f"llama-batched-bench gave {len(runs)} results, not {a.repeat}:\n"
                           f"{out[-3000:]}")
    load = re.search(r"load time =\s*([\d.]+) ms", log)
    return {"prefill_tps": max(r["speed_pp"] for r in runs),
            "decode_tps": max(r["speed_tg"] for r in runs),
            "rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            "load_s": float(load.group(1)) / 1e3 if load else None,
            "bytes_per_token_mb": os.path.getsize(a.artifact) / 2**20}


def logits(a, path, ids, embedding) -> np.ndarray:
    """bitnet.cpp's logits of the prompt `ids` at every position, the prompt in one batch:
    the final norm's output (llama-embedding, no pooling, not normalized) times the tied
    float16 embedding."""
    text = "".join(char_tokens(a.vocab)[i] for i in ids)
    out, _ = _run([os.path.join(a.bitnet_cpp, "bin", "llama-embedding"), "-m", path, "-p", text,
                   "-t", str(a.threads), "-c", str(len(ids)), "-b", str(len(ids)),
                   "--pooling", "none", "--embd-normalize", "-1", "--embd-output-format", "array"])
    start = out.index("[[")
    text = out[start:out.index("]]", start) + 2].replace("-nan", "NaN").replace("nan", "NaN")
    hidden = np.array(json.loads(text), np.float32)
    if hidden.shape != (len(ids), a.hidden):
        raise RuntimeError(f"llama-embedding gave hidden states of shape {hidden.shape}, not "
                           f"{(len(ids), a.hidden)}: the prompt did not tokenize to its ids")
    return hidden @ embedding.T


def agreement(ours, theirs) -> dict:
    cos = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    cos = np.nan_to_num(cos, nan=-1.0)          # NaN logits count as disagreeing
    return {"cos_min": float(cos.min()), "cos_mean": float(cos.mean()),
            "top1": float(np.mean(ours.argmax(1) == theirs.argmax(1)))}


def worker_check(a) -> dict:
    """The logits of tercomp (the a.artifact generator) against each bitnet.cpp file in
    --bitnet-files: a 32-token prompt in one batch (the prefill kernels: cosine per
    position, min and mean, and how often the top-1 token agrees), and its first token
    alone (the one-row kernels decode runs). Random models have flat logits: the top-1
    flips where two logits are within the kernels' rounding, the cosine is the check."""
    # Imported in the worker: gguf after use_fork_gguf chose the fork's, and tercomp only
    # in the processes that run it (bench/lm.py measures each engine's memory alone).
    import gguf
    import tercomp as tc
    ids = np.random.default_rng(2).integers(3, a.vocab, 32)     # 0-2: unk, bos, eos
    reader = gguf.GGUFReader(a.model)
    embedding = next(np.asarray(t.data, np.float32) for t in reader.tensors
                     if t.name == "token_embd.weight")
    ours = np.asarray(tc.load(a.artifact, threads=a.threads).prefill(ids.astype(np.int32)),
                      np.float32).reshape(len(ids), -1)
    return {name: {"prefill": agreement(ours, logits(a, path, ids, embedding)),
                   "step": agreement(ours[:1], logits(a, path, ids[:1], embedding))}
            for name, path in json.loads(a.bitnet_files).items()}
