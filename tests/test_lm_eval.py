"""lm-evaluation-harness itself (`lm_eval`, its `local-completions` model with
`tokenized_requests=False` and the server's remote tokenizer) against a real
`tercomp serve` process on 127.0.0.1: a log-likelihood task (multiple choice) and a
generate_until task, from small local task files. The harness must complete, its
log-likelihoods must be the server's own scores of the same texts, and its generations
the server's greedy answers. Skipped where lm_eval is not installed (the `eval` extra
installs it: `pip install -e '.[test,eval]'`, `lm-eval[api]`, no torch)."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval")
httpx = pytest.importorskip("httpx")

import tercomp as tc  # noqa: E402

import test_serve as S  # noqa: E402  (the tiny model and its tokenizer)

_spec = importlib.util.spec_from_file_location("bench_serve", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "bench", "serve.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

MC = [{"question": "the quick brown", "choices": ["fox", "hello", "world"], "answer": 0},
      {"question": "hello", "choices": ["world", "the quick"], "answer": 0},
      {"question": "the quick brown fox", "choices": ["hello world", "the", "brown"],
       "answer": 1}]
GEN = [{"prompt": "the quick", "target": " brown"}, {"prompt": "hello world", "target": " the"}]


def _task_files(d):
    """Two lm-eval task YAMLs over local JSON lines files (datasets' `json` builder)."""
    for name, rows in (("mc", MC), ("gen", GEN)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (d / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["<|end|>"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval")
    path = str(d / "tiny.tcm")
    tc.compile_lm(S.tiny_lm(), max_seq=S.MAX_SEQ, max_batch=2).save(path)
    port = bench.free_port()
    proc = bench.start_server(path, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        bench.stop_server(proc)


def _post(base, path, body):
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _server_loglikelihood(base, context, continuation):
    """The server's log-probability of `continuation` after `context`: its echoed
    prompt scores (max_tokens 0) summed over the continuation's tokens."""
    ctx = len(_post(base, "/tokenize", {"prompt": context, "add_special_tokens": False})["tokens"])
    c = _post(base, "/v1/completions", {"model": "tiny", "prompt": context + continuation,
                                        "echo": True, "logprobs": 1, "max_tokens": 0,
                                        "temperature": 0})["choices"][0]
    return sum(c["logprobs"]["token_logprobs"][ctx:])


@pytest.mark.slow   # ~2 min on 2 cores (lm_eval's imports); test_serve replays its requests fast
def test_lm_eval_local_completions_runs_against_tercomp_serve(server, tmp_path):
    _task_files(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
           f"model=tiny,base_url={server}/v1/completions,tokenized_requests=False,"
           f"tokenizer_backend=remote,num_concurrent=1,max_retries=1",
           "--tasks", "tiny_mc,tiny_gen", "--include_path", str(tmp_path),
           "--output_path", str(out), "--log_samples"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert set(results) == {"tiny_mc", "tiny_gen"}
    assert 0 <= results["tiny_mc"]["acc,none"] <= 1
    assert 0 <= results["tiny_gen"]["exact_match,none"] <= 1

    def samples(task):
        return [json.loads(line) for f in out.rglob(f"samples_{task}_*.jsonl")
                for line in f.read_text().splitlines()]
    mc = samples("tiny_mc")
    assert len(mc) == len(MC) and sum(len(s["arguments"]) for s in mc) == 8
    for s in mc:    # each choice: (context, " " + choice) -> [[loglikelihood, is_greedy]]
        args = [s["arguments"][f"gen_args_{i}"] for i in range(len(s["arguments"]))]
        assert [a["arg_1"] for a in args] == [" " + c for c in s["doc"]["choices"]]
        for a, resp in zip(args, s["resps"]):
            want = _server_loglikelihood(server, a["arg_0"], a["arg_1"])
            np.testing.assert_allclose(float(resp[0][0]), want, rtol=1e-6, atol=1e-6)
    gen = samples("tiny_gen")
    assert len(gen) == len(GEN)
    for s in gen:           # the server's greedy answer to the same prompt
        prompt = s["arguments"]["gen_args_0"]["arg_0"]
        assert prompt == s["doc"]["prompt"]
        want = _post(server, "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                 "max_tokens": 6, "temperature": 0,
                                                 "stop": ["<|end|>"]})["choices"][0]["text"]
        assert s["resps"][0][0] == want
