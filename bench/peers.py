"""The peers of bench/lm.py, each run through its own tools from a build made outside
this repository: ik_llama.cpp, bitnet.cpp (Microsoft's BitNet engine) and llama.cpp.

    python bench/lm.py --ik-llama IK/build/bin --bitnet-cpp BITNET/build/bin \
        --llama-cpp LLAMA/build/bin

Each directory holds that build's `llama-quantize`, `llama-bench` and `llama-embedding`
(README.md names the projects, the commits measured and their cmake flags). For each peer:

- its file: the bench's weights in the peer's best format, made by the peer's own
  `llama-quantize` from a float16 GGUF of the same codes x scale (bench/lm.py
  `write_model(projection="F16")`; ik_llama.cpp: IQ2_BN, repacked to IQ2_BN_R4 at load
  by `-rtr 1`; bitnet.cpp: I2_S), or the bench's TQ2_0 file as written (llama.cpp); the
  output table stays float16 (the tied token embedding, or a llama file's untied
  `output.weight`, which ik_llama.cpp would otherwise make Q6_K). float16, not a
  quantized type: ik_llama.cpp's ggml has no TQ2_0 to read, and of the types both tools
  dequantize only the float ones hold ternary codes exactly; not float32, which at the
  Llama3-8B shape is a 32 GB file;
- its logits (`embedding_logits`): `llama-embedding --pooling none` gives the final
  norm's output at every position, times the tied float16 embedding;
- its speed: `llama-bench -p PROMPT,LONG -n GEN -r REPEAT -t THREADS -o json` (both
  prompt lengths in one invocation: pp128 and pp512 by default), every sample
  (`samples_ts`) kept (`parse_llama_bench`).

The token strings are single characters (`char_tokens`), so a prompt's text tokenizes to
exactly its ids in every peer.
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Peer:
    """One engine: where its files come from and how its tools are called."""
    flag: str                   # bench/lm.py's option naming the binary directory
    label: str                  # its row in the table
    source: str                 # the bench file it starts from: "f16" or "tq2_0"
    quantize_type: str | None   # llama-quantize's type; None: the source file as written
    bench_args: tuple = ()      # extra llama-bench arguments
    tool_args: tuple = ()       # the same settings in the common options (llama-embedding)
    why: str = ""


# Quantized with the token embedding and the output table kept float16, as in tercomp's
# file: every engine reads the same output table.
QUANTIZE_OPTIONS = ("--token-embedding-type", "f16", "--output-tensor-type", "f16")

PEERS = {
    "ik_llama.cpp": Peer(
        "ik-llama", "ik_llama.cpp IQ2_BN->R4", "f16", "IQ2_BN",
        ("-rtr", "1", "-fa", "0"), ("-rtr", "-fa", "0"),
        why="IQ2_BN repacked to the row-interleaved IQ2_BN_R4 at load (-rtr); flash "
            "attention off, which decodes faster than its default (on) at this size"),
    "bitnet.cpp": Peer("bitnet-cpp", "bitnet.cpp I2_S", "f16", "I2_S",
                       why="its x86 ternary kernel for every shape (TL2 needs kernels "
                           "generated per model shape at build time)"),
    "llama.cpp": Peer("llama-cpp", "llama.cpp TQ2_0", "tq2_0", None,
                      why="its ternary type; the bench's file as written"),
}

TOOLS = ("llama-quantize", "llama-bench", "llama-embedding")


def missing_tools(bin_dir: str) -> list[str]:
    return [t for t in TOOLS if not os.access(os.path.join(bin_dir, t), os.X_OK)]


def char_tokens(vocab: int) -> list[str]:
    """One character per token, none of them a space or a byte token, so a string of them
    tokenizes (SPM, no space prefix, no BOS) to exactly their ids: CJK ideographs from
    U+4E00 up to the surrogates, then the private-use planes 15 and 16 (a 128k
    vocabulary: 2B4T's, Llama 3's) without their non-characters."""
    first = [chr(c) for c in range(0x4E00, min(0x4E00 + vocab, 0xD800))]
    rest = (chr(c) for c in (*range(0xF0000, 0xFFFFE), *range(0x100000, 0x10FFFE)))
    return first + [next(rest) for _ in range(vocab - len(first))]


def run(cmd: list[str], beside: str) -> tuple[str, str]:
    """(stdout, stderr) of a peer's tool: results go to stdout, its log to stderr. It runs
    in the directory of the file `beside`: the forks' tools write a llama.log where they
    run."""
    r = subprocess.run(cmd, capture_output=True, text=True, check=False,
                       cwd=os.path.dirname(os.path.abspath(beside)))
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\nfailed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout, r.stderr


def convert(peer: Peer, bin_dir: str, source: str, out: str) -> None:
    """The peer's file `out`, made from `source` by the peer's own llama-quantize. One
    thread, as BitNet's setup_env.py quantizes: bitnet.cpp 4645960's I2_S written with 2
    threads gives wrong logits (cosine ~0 against tercomp's, where 1 thread gives 0.999)."""
    run([os.path.join(bin_dir, "llama-quantize"), *QUANTIZE_OPTIONS, source, out + ".part",
         peer.quantize_type, "1"], beside=out)
    os.replace(out + ".part", out)


def parse_llama_bench(text: str) -> dict:
    """llama-bench's `-o json` output -> {"pp": {n_prompt: [t/s, ...], ...}, "tg": (n_gen,
    [t/s, ...]), "build": "commit (number)", "cpu": ...}: every repetition's tokens/s
    (`samples_ts`) of each prompt test (n_gen 0: one per length of `-p 128,512`) and of
    the generation test (n_prompt 0).
    All three peers print the same fields."""
    start = text.index("[")
    tests = json.loads(text[start:text.rindex("]") + 1])
    out = {}
    for t in tests:
        if t["n_gen"] == 0:
            out.setdefault("pp", {})[t["n_prompt"]] = [float(x) for x in t["samples_ts"]]
        elif t["n_prompt"] == 0:
            out["tg"] = (t["n_gen"], [float(x) for x in t["samples_ts"]])
        out["build"] = f"{t.get('build_commit', '?')} ({t.get('build_number', '?')})"
        out["cpu"] = t.get("cpu_info", "?")
    if "pp" not in out or "tg" not in out:
        raise ValueError(f"llama-bench gave no prompt or no generation test: {text[-2000:]}")
    return out


def llama_bench(peer: Peer, bin_dir: str, path: str, threads: int, prompts: list[int],
                gen: int, repeat: int) -> dict:
    """The peer's `llama-bench`: a prompt test of each length of `prompts` (one
    invocation, `-p 128,512`) and a generation test of `gen` tokens, `repeat` times each."""
    out, _ = run([os.path.join(bin_dir, "llama-bench"), "-m", path,
                  "-p", ",".join(str(n) for n in prompts),
                  "-n", str(gen), "-r", str(repeat), "-t", str(threads), "-o", "json",
                  *peer.bench_args], beside=path)
    return parse_llama_bench(out)


def parse_batched_bench(text: str) -> dict:
    """llama-batched-bench's table -> {parallel sequences B: (prompt tokens/s, generation
    tokens/s aggregated over the B sequences)}: the columns S_PP t/s and S_TG t/s of each
    row `| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |`."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or not cells[0].isdigit():
            continue
        out[int(cells[2])] = (float(cells[5]), float(cells[7]))
    if not out:
        raise ValueError(f"llama-batched-bench printed no result rows: {text[-2000:]}")
    return out


def batched_bench(peer: Peer, bin_dir: str, path: str, threads: int, prompt: int, gen: int,
                  parallel: list) -> dict:
    """The peer's `llama-batched-bench`: B sequences of a PROMPT-token prompt each (not
    shared), then GEN tokens generated for all B at once, for each B of `parallel`."""
    tool = os.path.join(bin_dir, "llama-batched-bench")
    if not os.access(tool, os.X_OK):
        raise RuntimeError(f"no llama-batched-bench in {bin_dir}")
    ctx = (prompt + gen) * max(parallel) + 64
    out, err = run([tool, "-m", path, "-c", str(ctx), "-b", "2048", "-ub", "512",
                    "-npp", str(prompt), "-ntg", str(gen),
                    "-npl", ",".join(str(b) for b in parallel), "-t", str(threads),
                    *peer.tool_args], beside=path)
    return parse_batched_bench(out + "\n" + err)


def embedding_logits(peer: Peer, bin_dir: str, path: str, ids, embedding: np.ndarray,
                     threads: int) -> np.ndarray:
    """The peer's logits of the prompt `ids` at every position, the prompt in one batch:
    the final norm's output (llama-embedding, no pooling, not normalized) times the
    output table `embedding` (the tied float16 embedding, or a llama file's untied
    `output.weight`)."""
    vocab, hidden = embedding.shape
    text = "".join(char_tokens(vocab)[i] for i in ids)
    out, _ = run([os.path.join(bin_dir, "llama-embedding"), "-m", path, "-p", text,
                  "-t", str(threads), "-c", "512",    # llama.cpp 0.3.36's asserts at -b 64
                  "--pooling", "none", "--embd-normalize", "-1",
                  "--embd-output-format", "array", *peer.tool_args], beside=path)
    start = out.index("[[")
    text = out[start:out.index("]]", start) + 2].replace("-nan", "NaN").replace("nan", "NaN")
    states = np.array(json.loads(text), np.float32)
    if states.shape != (len(ids), hidden):
        raise RuntimeError(f"llama-embedding gave hidden states of shape {states.shape}, not "
                           f"{(len(ids), hidden)}: the prompt did not tokenize to its ids")
    return states @ embedding.T


def agreement(ours: np.ndarray, theirs: np.ndarray) -> dict:
    """Cosine of each position's logits (min, mean) and how often the greedy token agrees."""
    cos = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    cos = np.nan_to_num(cos, nan=-1.0)          # NaN logits count as disagreeing
    return {"cos_min": float(cos.min()), "cos_mean": float(cos.mean()),
            "top1": float(np.mean(ours.argmax(1) == theirs.argmax(1)))}
