"""bench/serve.py's pure parts, without a server: reading a streamed completion (tercomp's
chunks and llama-server's), the latency figures computed from it, the sweep's prompts,
options and llama-server command line, and the table with its ratios."""
import doctest
import importlib.util
import json
import os
import stat

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("bench_serve", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "bench", "serve.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


class Clock:
    """A clock that reads the next of the given times."""
    def __init__(self, times):
        self.times = iter(times)

    def __call__(self):
        return next(self.times)


def sse(chunks):
    return [f"data: {json.dumps(c)}" for c in chunks] + ["", "data: [DONE]"]


def test_a_tercomp_stream_gives_its_ids_and_the_time_of_each_chunk():
    lines = sse([{"choices": [{"index": 0, "text": "a", "token_ids": [5], "finish_reason": None}]},
                 {"choices": [{"index": 0, "text": "bc", "token_ids": [6, 7],
                               "finish_reason": None}]},
                 {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}]}])
    out = bench.read_stream(lines, clock=Clock([10.25, 10.5]), t0=10.0)
    assert out["tokens"] == [5, 6, 7] and out["count"] == 3
    assert out["times"] == [(0.25, 1), (0.5, 2)] and out["ttft"] == 0.25
    assert out["finish_reason"] == "length" and out["usage"] is None


def test_a_llama_server_stream_is_counted_by_its_text_and_its_usage():
    # the shape of llama-server's /v1/completions stream: text only, the usage (and
    # its timings) on the last chunk; one character per token in the bench's vocabulary
    head = {"object": "text_completion", "model": "m", "id": "cmpl-1"}
    lines = sse([{**head, "choices": [{"index": 0, "text": "\u4e01", "logprobs": None,
                                       "finish_reason": None}]},
                 {**head, "choices": [{"index": 0, "text": "\u4e02", "logprobs": None,
                                       "finish_reason": None}]},
                 {**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                       "finish_reason": "length"}],
                  "usage": {"completion_tokens": 2, "prompt_tokens": 40, "total_tokens": 42},
                  "timings": {"predicted_n": 2}}])
    out = bench.read_stream(lines, clock=Clock([1.5, 1.75]), t0=1.0)
    assert out["tokens"] == [] and out["count"] == 2 and out["ttft"] == 0.5
    assert [t for t, _ in out["times"]] == [0.5, 0.75]
    assert out["usage"]["prompt_tokens"] == 40 and out["finish_reason"] == "length"
    # the usage chunk's count is the count (a token whose text is empty still counts)
    lines[-3] = lines[-3].replace('"completion_tokens": 2', '"completion_tokens": 3')
    assert bench.read_stream(lines, clock=Clock([1.5, 1.75]), t0=1.0)["count"] == 3
    # a chat stream's deltas count the same way
    chat = sse([{"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                {"choices": [{"index": 0, "delta": {"content": "\u4e01"}}]}])
    assert bench.read_stream(chat, clock=Clock([2.0]), t0=1.0)["times"] == [(1.0, 1)]


def test_llama_servers_own_stream_format_counts_the_same():
    # older llama-server builds answer /v1/completions in their own format
    lines = sse([{"content": "\u4e01", "stop": False, "id_slot": 0},
                 {"content": "\u4e02\u4e03", "stop": False, "id_slot": 0},
                 {"content": "", "stop": True, "stop_type": "limit", "tokens_predicted": 3,
                  "timings": {"predicted_n": 3}}])
    out = bench.read_stream(lines, clock=Clock([0.5, 0.75]), t0=0.0)
    assert out["count"] == 3 and out["times"] == [(0.5, 1), (0.75, 2)]
    assert out["finish_reason"] == "limit" and out["ttft"] == 0.5


def test_an_error_event_is_raised():
    lines = sse([{"error": {"message": "generation failed: boom", "type": "server_error"}}])
    with pytest.raises(RuntimeError, match="boom"):
        bench.read_stream(lines, clock=Clock([]), t0=0.0)


def test_summary_percentiles_of_first_tokens_and_of_every_gap():
    # two requests: chunks at known times; gaps 0.1, 0.1, 0.5 and 0.2; one is short
    results = [{"times": [(0.2, 1), (0.3, 1), (0.4, 1), (0.9, 1)], "ttft": 0.2, "count": 4,
                "wanted": 4, "latency": 1.0, "tokens": []},
               {"times": [(0.6, 1), (0.8, 1)], "ttft": 0.6, "count": 2, "wanted": 4,
                "latency": 0.9, "tokens": []}]
    s = bench.summary({"results": results + [None], "errors": ["lost"], "wall": 2.0})
    assert (s["requests"], s["ok"], s["errors"], s["short"]) == (3, 2, 1, 1)
    assert s["tokens"] == 6 and s["tokens_per_s"] == 3.0 and s["requests_per_s"] == 1.0
    gaps = [0.1, 0.1, 0.5, 0.2]
    assert s["itl_p50_s"] == pytest.approx(np.percentile(gaps, 50))
    assert s["itl_p99_s"] == pytest.approx(np.percentile(gaps, 99))
    assert s["ttft_p50_s"] == pytest.approx(0.4) and s["ttft_p99_s"] == pytest.approx(0.596)
    assert s["p99_s"] == pytest.approx(0.999)
    # nothing came back: no figure, rather than a made-up zero
    empty = bench.summary({"results": [None], "errors": ["x"], "wall": 1.0})
    assert np.isnan(empty["itl_p99_s"]) and np.isnan(empty["ttft_p50_s"])


def test_the_sweep_prompts_share_a_system_prompt_and_repeat_with_the_seed():
    def make():
        return bench.sweep_prompts(np.random.default_rng(0), 100, 5, (2, 4), [1, 4], 3, 8)
    warm, levels = make()
    assert len(warm) == 8 and [len(levels[c]) for c in (1, 4)] == [3, 12]
    head = warm[0][:5]
    for p in warm + levels[1] + levels[4]:
        assert p[:5] == head and 7 <= len(p) <= 9 and min(p) >= 3 and max(p) < 100
    assert make() == (warm, levels)


def peer_dir(tmp_path, tools):
    for t in tools:
        f = tmp_path / t
        f.write_text("#!/bin/sh\n")
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    return str(tmp_path)


def test_options_alone_load_test_tercomp_as_before():
    a = bench.parse_args([])
    assert a.sweep is None and a.peers == {}
    assert (a.hidden, a.layers, a.vocab, a.threads) == (512, 4, 1024, None)
    assert a.prompt == (8, 64) and a.max_tokens == (16, 64)


def test_options_with_a_peer_sweep_the_700m_shape(tmp_path):
    d = peer_dir(tmp_path, ["llama-server", "llama-quantize"])
    a = bench.parse_args(["--ik-llama", d, "--llama-cpp", d])
    assert a.sweep == [1, 4, 8, 16] and a.peers == {"ik_llama.cpp": d, "llama.cpp": d}
    assert (a.hidden, a.ffn, a.layers, a.heads, a.vocab, a.threads) == \
        (1536, 4096, 24, 16, 32002, 2)
    assert bench.parse_args(["--sweep", "2,3"]).sweep == [2, 3]
    assert a.step_tokens == [None]
    assert bench.parse_args(["--sweep", "1", "--step-tokens", "default,16"]).step_tokens == [None, 16]
    assert bench.parse_args(["--sweep", "1", "--step-tokens", "0,default"]).step_tokens == [0, None]


@pytest.mark.parametrize("argv, message", [
    (["--sweep", "1,x"], "--sweep: '1,x' is not a comma-separated list"),
    (["--sweep", "0"], "client counts must be >= 1"),
    (["--sweep", "1", "--max-seq", "64"], "--max-seq 64 holds no system prompt"),
    (["--sweep", "1", "--url", "http://127.0.0.1:1/v1"], "not with --url"),
    (["--prompt", "9,3"], "--prompt: '9,3' needs 0 <= MIN <= MAX"),
    (["--no-tercomp", "--sweep", "1"], "give a peer"),
    (["--sweep", "1", "--step-tokens", "default,x"], "--step-tokens: 'default,x' is not"),
    (["--sweep", "1", "--step-tokens", "-1"], "token counts must be >= 0"),
])
def test_bad_options_say_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_peer_directory_without_llama_server_is_refused(tmp_path, capsys):
    d = peer_dir(tmp_path, ["llama-quantize", "llama-bench"])   # built with the server off
    with pytest.raises(SystemExit):
        bench.parse_args(["--ik-llama", d])
    err = capsys.readouterr().err
    assert f"--ik-llama {d}: no llama-server there" in err and "LLAMA_BUILD_SERVER=ON" in err
    # llama.cpp serves the bench's file as written: no llama-quantize needed
    (tmp_path / "lcpp").mkdir()
    d2 = peer_dir(tmp_path / "lcpp", ["llama-server"])
    assert bench.parse_args(["--llama-cpp", d2]).peers == {"llama.cpp": d2}


def test_llama_server_runs_on_localhost_with_the_same_threads_and_slots():
    ik = bench.peers.PEERS["ik_llama.cpp"]
    cmd = bench.llama_server_command("/b", ik, "/m.gguf", 8123, 2, 8, 256, cache_reuse=True)
    assert cmd[0] == "/b/llama-server"
    pairs = dict(zip(cmd[1::2], cmd[2::2]))
    assert pairs["--host"] == "127.0.0.1" and pairs["--port"] == "8123"
    assert (pairs["-t"], pairs["-tb"], pairs["-np"], pairs["-c"]) == ("2", "2", "8", "2048")
    assert cmd[cmd.index("-rtr"):cmd.index("-rtr") + 3] == ["-rtr", "-fa", "0"]
    assert cmd[-2:] == ["--cache-reuse", "64"]
    lcpp = bench.peers.PEERS["llama.cpp"]
    assert "--cache-reuse" not in bench.llama_server_command("/b", lcpp, "/m", 1, 2, 8, 256, False)


def test_every_tercomp_row_gets_a_ratio_to_the_strongest_peer_at_each_count():
    def row(tps, itl99):
        return dict(tokens_per_s=tps, ttft_p50_s=0.1, ttft_p99_s=0.2, itl_p50_s=0.01,
                    itl_p99_s=itl99, errors=0, short=0, ok=4)
    text = bench.format_sweep({
        "tercomp serve": {1: row(80, 0.02), 8: row(180, 0.17)},
        "tercomp serve --step-tokens 16": {1: row(80, 0.02), 8: row(150, 0.05)},
        "ik": {1: row(70, 0.02), 8: row(130, 0.06)},
        "lcpp": {1: row(90, 0.03), 8: row(70, 0.12)}})
    ratios = {tuple(ln.split()[:5]): ln.split()[5:] for ln in text.splitlines() if " / " in ln}
    assert ratios[("1", "tercomp", "serve", "/", "lcpp")][:1] == ["0.89x"]
    assert ratios[("8", "tercomp", "serve", "/", "ik")] == ["1.38x", "1.00x", "1.00x", "1.00x",
                                                           "2.83x"]
    assert ratios[("8", "tercomp", "serve", "--step-tokens", "16")][2:] == \
        ["1.15x", "1.00x", "1.00x", "1.00x", "0.83x"]


def test_doctests():
    assert doctest.testmod(bench, raise_on_error=False).failed == 0
