"""`tercomp serve` as a real server process on 127.0.0.1, driven by OpenAI's own Python
client and raw httpx: the answers equal a single-stream generator's, streamed equals
non-streamed, chat equals the template + generate, every bad request gets its status
and an OpenAI error body while the server keeps answering the next one correctly, a
client that goes away frees its slot, and a bounded load loses no request; log-probabilities
equal log_softmax of the generator's logits (as lm-evaluation-harness reads them), n /
best_of and the penalties match NumPy written out, user text never becomes a special
token, hostile clients (lone surrogates, slow heads and bodies, too many connections,
SIGTERM) get JSON errors in bounded time, structured output always validates, and
/v1/embeddings equals tc.compile_embed's encoder (a .tcm server refuses it)."""
import base64
import concurrent.futures as cf
import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

fastapi = pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import tercomp as tc  # noqa: E402
from tercomp import models, nn  # noqa: E402
from tercomp.runtime.chat import ChatTemplate  # noqa: E402
from tercomp.models.tokenizer import Tokenizer  # noqa: E402

import backbone_ref as B  # noqa: E402

# bench/serve.py: the load test and the server launcher
_spec = importlib.util.spec_from_file_location("bench_serve", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "bench", "serve.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

KEY = "test-key"
MAX_SEQ, SLOTS, MAX_QUEUE, MAX_BODY = 256, 4, 8, 64 << 10
READ_TIMEOUT, MAX_CONNECTIONS = 1.5, 48
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_lm(max_seq: int = MAX_SEQ, specials=()):
    """A 2-layer random BitNet with a byte-level BPE tokenizer and a chat template (the
    same weights whatever `max_seq`; `specials`: more special tokens, after the
    template's)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models as tm, pre_tokenizers, trainers
    tok = HFTokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world the quick brown fox"] * 20, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|user|>", "<|assistant|>", "<|end|>", *specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    nn.manual_seed(0)
    lm = models.BitNetLM(models.BitNetConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_seq))
    lm.tokenizer = Tokenizer(tok, ChatTemplate(TEMPLATE, eos_token="<|end|>"))
    return lm


@pytest.fixture(scope="module")
def tcm(tmp_path_factory):
    """(the tiny LM, the path of its batched .tcm)."""
    lm = tiny_lm()
    path = str(tmp_path_factory.mktemp("serve") / "tiny.tcm")
    tc.compile_lm(lm, max_seq=MAX_SEQ, max_batch=SLOTS).save(path)
    return lm, path


@pytest.fixture(scope="module")
def served(tcm):
    """(the single-stream reference generator, the server's base URL). The server
    drafts speculatively (--speculative 4) for a greedy request served alone, so every
    greedy answer checked against `ref` checks speculative decoding too."""
    lm, path = tcm
    ref = tc.compile_lm(lm, max_seq=MAX_SEQ)
    port = bench.free_port()
    proc = bench.start_server(path, port, ["--api-key", KEY, "--max-queue", str(MAX_QUEUE),
                                           "--max-body", str(MAX_BODY), "--read-timeout",
                                           str(READ_TIMEOUT), "--max-connections",
                                           str(MAX_CONNECTIONS), "--speculative", "4"])
    try:
        yield ref, f"http://127.0.0.1:{port}"
    finally:
        bench.stop_server(proc)


@pytest.fixture(scope="module")
def ref(served):
    return served[0]


@pytest.fixture(scope="module")
def base(served):
    return served[1]


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)


EOS = 2     # <|end|>: the chat template's eos, which ends completions too


def expected(ref, ids, n, **kw):
    """(token ids, text) that the server must answer: the single-stream generator's,
    the eos token ending the text and left out of it."""
    out = ref.generate(np.asarray(ids), max_new_tokens=n, eos={EOS}, **kw).tolist()
    return out, ref.decode_text(out[:-1] if out and out[-1] == EOS else out)


def post(base, path, body, key=KEY, timeout=60):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{base}{path}", json=body, headers=headers, timeout=timeout)


def stats(base) -> dict:
    return httpx.get(f"{base}/health", timeout=10).json()


def metric(base, name) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


def check_serves(ref, client):
    """The server still answers a greedy completion correctly."""
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=6, temperature=0)
    ids, text = expected(ref, ref.encode("hello world"), 6)
    assert r.choices[0].model_extra["token_ids"] == ids and r.choices[0].text == text


# -- the answers ---------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["hello world", "the quick brown fox", "hello", [5, 17, 250, 3]])
def test_greedy_completion_equals_generate(ref, client, prompt):
    ids = ref.encode(prompt) if isinstance(prompt, str) else prompt
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    want_ids, want_text = expected(ref, ids, 24)
    c = r.choices[0]
    assert c.model_extra["token_ids"] == want_ids and c.text == want_text
    assert c.finish_reason == ("stop" if want_ids[-1] == EOS else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (len(ids), len(want_ids), len(ids) + len(want_ids))
    assert r.object == "text_completion" and r.model == "tiny"


def test_seeded_sampling_equals_generate(ref, client):
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=16, temperature=0.9,
                                  top_p=0.95, seed=7, extra_body={"top_k": 40})
    assert r.choices[0].model_extra["token_ids"] == expected(
        ref, ref.encode("hello"), 16, temperature=0.9, top_p=0.95, top_k=40, seed=7)[0]


def test_streamed_text_equals_non_streamed(ref, client):
    for prompt in ["hello world", "the quick brown fox", "fox"]:
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=30,
                                          temperature=0)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=30,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
            whole.choices[0].finish_reason
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert chunks[-1].choices == [] and [getattr(chunks[-1].usage, k) for k in counts] \
            == [getattr(whole.usage, k) for k in counts]


def test_raw_sse_format(base):
    with httpx.stream("POST", f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3,
                            "temperature": 0, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 3


@pytest.mark.parametrize("prompt,stop", [("hello", "kk"), ("hello world", "FFF"),
                                         ("hello", " brown"), ("hello world", "ooooX")])
def test_stop_strings_trim_as_openai(ref, client, prompt, stop):
    _, full = expected(ref, ref.encode(prompt), 40)
    cut = full.find(stop)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                  stop=[stop, "never seen"])
    assert r.choices[0].text == (full if cut < 0 else full[:cut])
    assert r.choices[0].finish_reason == ("length" if cut < 0 else "stop")
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                         temperature=0, stop=[stop, "never seen"], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_stop_token_ids(ref, client):
    ids, _ = expected(ref, ref.encode("hello world"), 20)
    stop_id = ids[7]
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=20,
                                  temperature=0, extra_body={"stop_token_ids": [stop_id]})
    got = r.choices[0].model_extra["token_ids"]
    assert got == ids[:ids.index(stop_id) + 1] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref.decode_text(got[:-1])


def test_several_prompts_one_request(ref, client):
    prompts = [[4, 5, 6], [40, 41], [100]]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, p in zip(r.choices, prompts):
        assert c.model_extra["token_ids"] == expected(ref, p, 8)[0]


def test_chat_equals_template_and_generate(ref, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    text = ChatTemplate.from_dict(ref.chat_template).render(messages, add_generation_prompt=True)
    ids = ref.tokenizer.encode(text, add_special_tokens=False).ids
    want_ids, want = expected(ref, ids, 20)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                       temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_models_health_and_metrics(base, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    h = stats(base)
    assert h["status"] == "ok" and h["slots"] == SLOTS
    text = httpx.get(f"{base}/metrics", timeout=10).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"tercomp_requests", "tercomp_generation_tokens", "tercomp_requests_waiting",
            "tercomp_time_to_first_token_seconds", "tercomp_generation_tokens_per_second"} <= names
    assert metric(base, "tercomp_generation_tokens_total") > 0


def test_a_chat_s_next_turn_reuses_the_cached_prefix(ref, base, client):
    """The second turn's prompt starts with the first turn's: its rows come from the
    prefix cache (usage.prompt_tokens_details.cached_tokens, /metrics), and the answer
    is still the single-stream generator's."""
    turn = [{"role": "user", "content": "the quick brown fox and the quick brown"}]
    template = ChatTemplate.from_dict(ref.chat_template)

    def ask(messages):
        text = template.render(messages, add_generation_prompt=True)
        ids = ref.tokenizer.encode(text, add_special_tokens=False).ids
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                           temperature=0)
        assert r.choices[0].message.content == expected(ref, ids, 8)[1]
        return ids, r
    before = (metric(base, "tercomp_prompt_tokens_cached_total"),
              metric(base, "tercomp_prompt_tokens_total"))
    first, r = ask(turn)
    turn += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": "hello world"}]
    second, r2 = ask(turn)
    assert second[:len(first)] == first
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert len(first) <= cached < len(second) and r2.usage.prompt_tokens == len(second)
    reused = metric(base, "tercomp_prompt_tokens_cached_total") - before[0]
    assert reused == r.usage.prompt_tokens_details.cached_tokens + cached
    assert metric(base, "tercomp_prompt_tokens_total") - before[1] == len(first) + len(second)
    assert 0 < metric(base, "tercomp_prefix_cache_hit_rate") < 1
    # the server runs with --speculative 4: requests served alone verified drafts
    assert 0 < metric(base, "tercomp_draft_tokens_accepted_total") \
        <= metric(base, "tercomp_draft_tokens_total")
    assert metric(base, "tercomp_prefix_cache_tokens") >= len(second)


def test_concurrent_chats_with_one_system_prompt_share_its_rows(ref, base, client):
    """Four clients at once (the server's slots), one long system prompt, each its own
    question: those arriving while another's request runs copy the system prompt's
    rows from its slot (tercomp_prompt_tokens_copied_total) or find them in a freed one;
    every answer is still the single-stream generator's, and /metrics counts the
    tokens each usage reports as cached."""
    system = "the brown fox and the quick world " * 6 + "hello"
    questions = ["hello world", "the quick fox", "brown brown hello", "world the fox"]
    template = ChatTemplate.from_dict(ref.chat_template)
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in questions]
    ids = [ref.tokenizer.encode(template.render(m, add_generation_prompt=True),
                                add_special_tokens=False).ids for m in chats]
    shared = min(next(i for i, (a, b) in enumerate(zip(ids[0], x)) if a != b) for x in ids[1:])
    assert shared >= 40
    before = {k: metric(base, f"tercomp_prompt_tokens_{k}_total") for k in ("cached", "copied")}
    barrier = threading.Barrier(len(chats))

    def ask(messages):
        barrier.wait(30)
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                              temperature=0)
    with cf.ThreadPoolExecutor(len(chats)) as pool:
        answers = list(pool.map(ask, chats))
    for r, x in zip(answers, ids):
        assert r.choices[0].message.content == expected(ref, x, 24)[1]
        assert r.usage.prompt_tokens == len(x)
    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in answers)
    assert all(c >= shared - 16 for c in cached[1:])      # all but the first reuse it
    assert metric(base, "tercomp_prompt_tokens_cached_total") - before["cached"] == sum(cached)
    assert metric(base, "tercomp_prompt_tokens_copied_total") > before["copied"]


# -- log-probabilities ------------------------------------------------------------------------

def log_softmax(logits):
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scores_the_prompt_as_log_softmax_of_prefill(ref, base, max_tokens):
    # what lm-evaluation-harness's local-completions sends for a log-likelihood task
    prompt = "the quick brown fox hello world"
    ids = ref.encode(prompt).tolist()
    r = post(base, "/v1/completions", {"model": "tiny", "prompt": prompt, "echo": True,
                                       "logprobs": 3, "max_tokens": max_tokens,
                                       "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    want = log_softmax(ref.prefill(np.array(ids, np.int32)))       # [T, vocab]
    n = len(ids) + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = np.array(lp["token_logprobs"][1:len(ids)])
    np.testing.assert_allclose(got, want[np.arange(len(ids) - 1), ids[1:]], atol=2e-3)
    for i in range(1, len(ids)):
        top = lp["top_logprobs"][i]
        assert 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(want[i - 1].max(), abs=2e-3)
    assert c["text"].startswith(prompt) and lp["text_offset"][0] == 0
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
    assert "".join(lp["tokens"][:len(ids)]) == prompt
    if max_tokens:      # the greedy token, scored from the last prompt position
        tok = int(want[-1].argmax())
        assert c["token_ids"] == [tok]
        assert lp["token_logprobs"][-1] == pytest.approx(want[-1, tok], abs=2e-3)
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
    else:
        assert c["token_ids"] == [] and c["text"] == prompt and c["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 0


def test_what_lm_eval_local_completions_does(ref, base):
    # lm-evaluation-harness's local-completions with its remote tokenizer (vLLM's
    # /tokenizer_info, /tokenize, /detokenize), scoring a continuation as it does
    auth = {"Authorization": f"Bearer {KEY}"}
    info = httpx.get(f"{base}/tokenizer_info", headers=auth, timeout=30).json()
    assert info["eos_token"] == "<|end|>" and info["chat_template"] == TEMPLATE
    context, continuation = "the quick brown", " fox hello"

    def encode(text):
        r = post(base, "/tokenize", {"prompt": text, "add_special_tokens": False})
        return r.json()["tokens"]
    ctxlen = len(encode(context))
    assert post(base, "/detokenize", {"tokens": encode(context)}).json()["prompt"] == context
    r = post(base, "/v1/completions", {"model": "tiny", "prompt": [context + continuation],
                                       "temperature": 0, "max_tokens": 1, "logprobs": 1,
                                       "seed": 1234, "echo": True})
    assert r.status_code == 200, r.text
    choice = sorted(r.json()["choices"], key=lambda c: c["index"])[0]
    got = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
    lp = choice["logprobs"]
    greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][ctxlen:-1],
                                                          lp["top_logprobs"][ctxlen:-1]))
    ids = ref.encode(context + continuation).tolist()
    want = log_softmax(ref.prefill(np.array(ids, np.int32)))
    assert got == pytest.approx(sum(want[i - 1, ids[i]] for i in range(ctxlen, len(ids))), abs=1e-2)
    assert greedy == all(want[i - 1].argmax() == ids[i] for i in range(ctxlen, len(ids)))


def test_generated_token_logprobs_streamed_and_not(ref, client):
    ids = ref.encode("hello").tolist()
    want_ids, _ = expected(ref, ids, 8)
    whole = client.completions.create(model="tiny", prompt="hello", max_tokens=8,
                                      temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    scores = log_softmax(ref.prefill(np.array(ids + want_ids[:-1], np.int32)))[len(ids) - 1:]
    np.testing.assert_allclose(lp.token_logprobs, scores[np.arange(len(want_ids)), want_ids],
                               atol=2e-3)
    chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=8,
                                            temperature=0, logprobs=2, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_chat_logprobs(ref, client):
    messages = [{"role": "user", "content": "hello"}]
    text = ChatTemplate.from_dict(ref.chat_template).render(messages, add_generation_prompt=True)
    ids = ref.tokenizer.encode(text, add_special_tokens=False).ids
    want_ids, want = expected(ref, ids, 10)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want_ids)
    scores = log_softmax(ref.prefill(np.array(ids + want_ids[:-1], np.int32)))[len(ids) - 1:]
    for e, tok, row in zip(content, want_ids, scores):
        assert e.logprob == pytest.approx(row[tok], abs=2e-3)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs),
                                                             reverse=True)
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob == pytest.approx(row.max(), abs=2e-3)
    assert bytes(b for e in content for b in e.bytes).decode().startswith(want)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                                 temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True))
    assert [e.logprob for c in chunks if c.choices[0].logprobs
            for e in c.choices[0].logprobs.content] == [e.logprob for e in content]
    bad = post(client.base_url.__str__().removesuffix("/v1/"), "/v1/chat/completions",
               {"model": "tiny", "messages": messages, "top_logprobs": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"


# temperature, top_k, a penalty and a bias: what changes the tokens drawn
TRANSFORMS = dict(temperature=0.7, presence_penalty=1.0, logit_bias={"100": 3.0},
                  extra_body={"top_k": 5})


def sampled_with_logprobs(client, n=3):
    """(prompt ids, the tokens drawn under TRANSFORMS, their logprobs, their top-n
    alternatives' logprobs, most likely first) of a completion."""
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=12, seed=4,
                                  logprobs=n, **TRANSFORMS)
    c = r.choices[0]
    tops = [sorted(d.values(), reverse=True) for d in c.logprobs.top_logprobs]
    return c.model_extra["token_ids"], c.logprobs.token_logprobs, tops


def test_logprobs_are_the_model_s_whatever_the_sampling_transforms(ref, client):
    """By default (OpenAI's and vLLM's raw_logprobs) a drawn token's logprob and the top
    alternatives are log_softmax of the model's logits: temperature, top_k, penalties
    and logit_bias change which token is drawn, not what is reported (the drawn token
    is listed with the top ones where it is not among them, as OpenAI lists it)."""
    ids = ref.encode("hello world").tolist()
    out, lps, tops = sampled_with_logprobs(client)
    raw = log_softmax(ref.prefill(np.array(ids + out[:-1], np.int32)))[len(ids) - 1:]
    np.testing.assert_allclose(lps, raw[np.arange(len(out)), out], atol=2e-3)
    for row, tok, top in zip(raw, out, tops):
        best = np.sort(row)[::-1][:3]
        np.testing.assert_allclose(top[:3], best, atol=2e-3)
        assert len(top) == 3 + (row[tok] < best[-1] - 2e-3)


def test_processed_logprobs_are_the_distribution_sampled_from(tcm, ref, client):
    """--logprobs-mode processed_logprobs (vLLM's): the logprobs are those of the
    distribution the token was drawn from, after the logit bias, the penalties,
    temperature and top_k (the tokens top_k drops have none: top_k 5 lists 5 whose
    probabilities sum to 1); the tokens drawn are the raw server's."""
    from tercomp.runtime.sampling import processed_logprobs
    _, path = tcm
    port = bench.free_port()
    proc = bench.start_server(path, port, ["--logprobs-mode", "processed_logprobs"])
    try:
        processed = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                  max_retries=0, timeout=60)
        out, lps, tops = sampled_with_logprobs(processed, n=8)
    finally:
        bench.stop_server(proc)
    assert out == sampled_with_logprobs(client)[0]
    ids = ref.encode("hello world").tolist()
    logits = ref.prefill(np.array(ids + out[:-1], np.int32))[len(ids) - 1:].astype(np.float64)
    for j, (tok, lp, top) in enumerate(zip(out, lps, tops)):
        z = logits[j].copy()
        z[100] += 3.0                                   # the bias, then presence over the output
        z[sorted(set(out[:j]))] -= 1.0
        want = processed_logprobs(z, 0.7, top_k=5)
        assert lp == pytest.approx(want[tok], abs=2e-3)
        assert len(top) == 8 and top[5:] == [-9999.0] * 3       # OpenAI's floor for -inf
        np.testing.assert_allclose(top[:5], np.sort(want)[::-1][:5], atol=2e-3)
        assert np.exp(top[:5]).sum() == pytest.approx(1.0, abs=1e-3)


# -- sampling parameters --------------------------------------------------------------------------

def penalized_greedy(ref, ids, n, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """Greedy tokens with vLLM's transforms, written out in NumPy: bias, then repetition
    over prompt and output, then frequency and presence over the output."""
    out, logits = [], ref.prefill(np.array(ids, np.int32))[-1]
    for _ in range(n):
        z = logits.astype(np.float64)
        for t, v in (bias or {}).items():
            z[int(t)] += v
        for t in set(ids) | set(out):
            z[t] = z[t] / repetition if z[t] > 0 else z[t] * repetition
        counts = np.bincount(out, minlength=z.size)
        z = z - frequency * counts - presence * (counts > 0)
        out.append(int(z.argmax()))
        if out[-1] == EOS:
            break
        logits = ref.decode(out[-1])
    return out


@pytest.mark.parametrize("params", [
    {"presence_penalty": 1.5}, {"frequency_penalty": 0.7}, {"repetition_penalty": 1.3},
    {"logit_bias": {"100": 4.0, "7": -100}},
    {"presence_penalty": -0.5, "frequency_penalty": 0.4, "repetition_penalty": 0.8}])
def test_penalties_as_vllm_applies_them(ref, client, params):
    ids = ref.encode("hello world").tolist()
    plain = expected(ref, ids, 24)[0]
    want = penalized_greedy(ref, ids, 24, params.get("presence_penalty", 0.0),
                            params.get("frequency_penalty", 0.0),
                            params.get("repetition_penalty", 1.0), params.get("logit_bias"))
    assert want != plain                  # the parameter changes the answer
    extra = {"repetition_penalty": params["repetition_penalty"]} \
        if "repetition_penalty" in params else {}
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=24,
                                  temperature=0, extra_body=extra,
                                  **{k: v for k, v in params.items() if k != "repetition_penalty"})
    assert r.choices[0].model_extra["token_ids"] == want


def test_min_p_one_keeps_only_the_most_likely(ref, client):
    ids = ref.encode("the quick").tolist()
    r = client.completions.create(model="tiny", prompt="the quick", max_tokens=12,
                                  temperature=1.5, seed=3, extra_body={"min_p": 1.0})
    assert r.choices[0].model_extra["token_ids"] == expected(ref, ids, 12)[0]


def test_n_choices_and_best_of(ref, client):
    ids = ref.encode("hello").tolist()
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0.9,
                                  seed=5, n=3)
    want = [expected(ref, ids, 8, temperature=0.9, seed=5 + j)[0] for j in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in r.choices] == want
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), sum(map(len, want)))
    streamed = {0: [], 1: [], 2: []}
    for chunk in client.completions.create(model="tiny", prompt="hello", max_tokens=8,
                                           temperature=0.9, seed=5, n=3, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.model_extra["token_ids"]
    assert [streamed[j] for j in range(3)] == want
    # best_of: the most likely of 3 candidates (the sum of their tokens' log-probabilities)
    cands = [expected(ref, ids, 8, temperature=1.0, seed=11 + j)[0] for j in range(3)]

    def score(c):
        lp = log_softmax(ref.prefill(np.array(ids + c[:-1], np.int32)))[len(ids) - 1:]
        return lp[np.arange(len(c)), c].sum()
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=1.0,
                                  seed=11, best_of=3, n=1)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    assert r.choices[0].model_extra["token_ids"] == max(cands, key=score)
    assert r.usage.completion_tokens == sum(map(len, cands))
    chat = client.chat.completions.create(model="tiny", n=2, max_tokens=6, temperature=0,
                                          messages=[{"role": "user", "content": "hello"}])
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


#: every field OpenAI's API lets be null (completions; chat), null
COMPLETION_NULLS = dict.fromkeys([
    "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
    "top_p", "user"])
CHAT_NULLS = dict.fromkeys([
    "audio", "frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format",
    "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
    "verbosity", "web_search_options"])


def test_nulls_where_openai_allows_them(ref, base):
    """Every field OpenAI allows null may be null and then means its default: the
    answer equals the one without it (completions' max_tokens 16, temperature 1)."""
    body = {"model": "tiny", "prompt": "hello", "seed": 3, "ignore_eos": True}
    r = post(base, "/v1/completions", {**COMPLETION_NULLS, **body})
    assert r.status_code == 200, r.text
    want = expected(ref, ref.encode("hello"), 16, temperature=1.0, seed=3)[0]
    assert r.json()["choices"][0]["token_ids"] == want
    assert post(base, "/v1/completions", body).json()["choices"][0]["token_ids"] == want
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": 5}
    r = post(base, "/v1/chat/completions", {**CHAT_NULLS, **chat})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == \
        post(base, "/v1/chat/completions", chat).json()["choices"][0]["message"]
    # fields that change nothing here (storage, routing, hints) are accepted and ignored
    hints = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "user": "u",
             "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
             "verbosity": "low", "modalities": ["text"], "response_format": {"type": "text"},
             "logprobs": False, "parallel_tool_calls": True}
    r = post(base, "/v1/chat/completions", {**chat, **hints, "max_tokens": 4})
    assert r.status_code == 200, r.text
    # what this server cannot do is refused by name, never ignored
    for field, value in (("tool_choice", "required"), ("functions", [{"name": "f"}]),
                         ("audio", {}), ("audio", {"voice": "alloy", "format": "wav"}),
                         ("modalities", ["text", "audio"]), ("web_search_options", {})):
        r = post(base, "/v1/chat/completions", {"model": "tiny", field: value,
                                                "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = post(base, "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = post(base, "/v1/chat/completions", {"model": "tiny", "add_special_tokens": True,
                                            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens", r.text


# -- bad requests ----------------------------------------------------------------------------

BAD = [  # (what, body or raw bytes, key, status, param)
    ("no key", {"model": "tiny", "prompt": "hi"}, None, 401, None),
    ("wrong key", {"model": "tiny", "prompt": "hi"}, "nope", 401, None),
    ("prompt over max_seq", {"model": "tiny", "prompt": [1] * MAX_SEQ}, KEY, 400, "prompt"),
    ("id out of range", {"model": "tiny", "prompt": [1, 280]}, KEY, 400, "prompt"),
    ("negative id", {"model": "tiny", "prompt": [-1]}, KEY, 400, "prompt"),
    ("ids not ints", {"model": "tiny", "prompt": [1.5, True]}, KEY, 400, "prompt"),
    ("max_tokens < 0", {"model": "tiny", "prompt": "hi", "max_tokens": -3}, KEY, 400, "max_tokens"),
    ("temperature < 0", {"model": "tiny", "prompt": "hi", "temperature": -0.5}, KEY, 400,
     "temperature"),
    ("top_p 0", {"model": "tiny", "prompt": "hi", "top_p": 0}, KEY, 400, "top_p"),
    ("malformed JSON", b'{"model": "tiny", "prompt": ', KEY, 400, None),
    ("not an object", b'[1, 2]', KEY, 400, None),
    ("oversized body", {"model": "tiny", "prompt": "x" * MAX_BODY}, KEY, 413, None),
    ("another model", {"model": "gpt-4", "prompt": "hi"}, KEY, 404, "model"),
    ("n > 16", {"model": "tiny", "prompt": "hi", "n": 17}, KEY, 400, "n"),
    ("64 prompts x 2", {"model": "tiny", "prompt": [[1]] * 64, "n": 2}, KEY, 400, "n"),
    ("best_of < n", {"model": "tiny", "prompt": "hi", "n": 3, "best_of": 2}, KEY, 400, "best_of"),
    ("best_of streamed", {"model": "tiny", "prompt": "hi", "best_of": 2, "stream": True}, KEY,
     400, "best_of"),
    ("presence > 2", {"model": "tiny", "prompt": "hi", "presence_penalty": 2.5}, KEY, 400,
     "presence_penalty"),
    ("repetition 0", {"model": "tiny", "prompt": "hi", "repetition_penalty": 0}, KEY, 400,
     "repetition_penalty"),
    ("min_p > 1", {"model": "tiny", "prompt": "hi", "min_p": 1.5}, KEY, 400, "min_p"),
    ("bias key", {"model": "tiny", "prompt": "hi", "logit_bias": {"x": 1}}, KEY, 400, "logit_bias"),
    ("bias > 100", {"model": "tiny", "prompt": "hi", "logit_bias": {"3": 101}}, KEY, 400,
     "logit_bias"),
    ("bias id", {"model": "tiny", "prompt": "hi", "logit_bias": {"280": 1}}, KEY, 400,
     "logit_bias"),
    ("xml output", {"model": "tiny", "prompt": "hi", "response_format": {"type": "xml"}},
     KEY, 400, "response_format"),
    ("schema-less", {"model": "tiny", "prompt": "hi", "response_format": {"type": "json_schema"}},
     KEY, 400, "response_format"),
    ("bad schema", {"model": "tiny", "prompt": "hi", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     KEY, 400, "response_format"),
    ("structured_outputs", {"model": "tiny", "prompt": "hi", "structured_outputs": {"regex": "a"}},
     KEY, 400, "structured_outputs"),
    ("two constraints", {"model": "tiny", "prompt": "hi", "guided_regex": "a",
                         "response_format": {"type": "json_object"}}, KEY, 400, "guided_regex"),
    ("bad regex", {"model": "tiny", "prompt": "hi", "guided_regex": "(a"}, KEY, 400,
     "guided_regex"),
    ("suffix", {"model": "tiny", "prompt": "hi", "suffix": "x"}, KEY, 400, "suffix"),
    ("logprobs > 20", {"model": "tiny", "prompt": "hi", "logprobs": 21}, KEY, 400, "logprobs"),
    ("empty prompt", {"model": "tiny", "prompt": []}, KEY, 400, "prompt"),
]


@pytest.mark.parametrize("what,body,key,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_openai_error_and_hurts_no_one(ref, base, client, what, body, key,
                                                          status, param):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, bytes):
        r = httpx.post(f"{base}/v1/completions", content=body, timeout=60,
                       headers={**headers, "Content-Type": "application/json"})
    else:
        r = post(base, "/v1/completions", body, key=key)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    check_serves(ref, client)


#: a value of each refused field that asks for what this server does not do
ASKING = {"suffix": "x", "functions": [{"name": "f"}], "function_call": "auto",
          "structured_outputs": {"regex": "a"}, "use_beam_search": True, "min_tokens": 3,
          "bad_words": ["a"], "allowed_token_ids": [1, 2], "prompt_logprobs": 1,
          "typical_p": 0.5, "mirostat": 2, "suffix_prompt": "x", "audio": {},
          "modalities": ["text", "audio"], "web_search_options": {}}


def test_every_refused_field_is_a_400_naming_it_unless_it_asks_for_nothing(base):
    from tercomp.serve.protocol import REFUSED
    assert set(ASKING) == set(REFUSED)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", chat)):
        for field, value in ASKING.items():
            r = post(base, path, {**body, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, r.text)
            assert field in r.json()["error"]["message"]
            for nothing in (None, *REFUSED[field]):
                r = post(base, path, {**body, field: nothing})
                assert r.status_code == 200, (path, field, nothing, r.text)


def test_bad_chat_requests(ref, base, client):
    for body in ({"model": "tiny", "messages": []},
                 {"model": "tiny", "messages": [{"content": "no role"}]},
                 {"model": "tiny", "messages": [{"role": "user", "content": "x" * 4 * MAX_SEQ}]},
                 {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                  "max_completion_tokens": 0},
                 {"model": "tiny", "messages": [{"role": "user", "content": [  # text only
                     {"type": "text", "text": "what is this?"},
                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}):
        r = post(base, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("messages", "max_completion_tokens"), r.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       temperature=-1)
    check_serves(ref, client)


def test_full_queue_is_429(ref, base, client):
    # 4 slots + 8 waiting: of 24 long requests sent at once, some are refused
    body = {"model": "tiny", "prompt": [7, 8], "max_tokens": 250, "temperature": 0,
            "ignore_eos": True}
    with cf.ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(lambda _: post(base, "/v1/completions", body), range(24)))
    codes = [a.status_code for a in answers]
    assert 429 in codes and set(codes) <= {200, 429}, codes
    refused = next(a for a in answers if a.status_code == 429).json()["error"]
    assert refused["code"] == "queue_full"
    want = ref.generate([7, 8], max_new_tokens=250).tolist()
    assert all(a.json()["choices"][0]["token_ids"] == want for a in answers if a.status_code == 200)
    assert metric(base, "tercomp_requests_rejected_total") >= codes.count(429)
    check_serves(ref, client)


def _wait_idle(base, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = stats(base)
        if h["running"] == 0 and h["waiting"] == 0 and h["free_slots"] == SLOTS:
            return h
        time.sleep(0.05)
    raise AssertionError(f"the server kept its slots: {stats(base)}")


def test_disconnect_mid_stream_frees_the_slot(ref, base, client):
    _wait_idle(base)
    before = metric(base, "tercomp_generation_tokens_total")
    finished = metric(base, "tercomp_requests_finished_total")
    body = {"model": "tiny", "prompt": [9, 10], "max_tokens": 250, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    # the connection is closed: the request is cancelled, its slot freed
    _wait_idle(base)
    assert metric(base, "tercomp_generation_tokens_total") - before < 250
    assert metric(base, "tercomp_requests_finished_total") == finished
    check_serves(ref, client)


def test_disconnect_while_waiting_for_a_whole_answer(ref, base, client):
    # the slots are busy with 4 long requests; a 5th waits for one and its client gives up:
    # it is dropped without a token generated
    _wait_idle(base)
    tokens, finished = (metric(base, f"tercomp_{m}_total") for m in ("generation_tokens",
                                                                      "requests_finished"))
    # a penalty keeps each long request off the speculative path (the server drafts for
    # a greedy request running alone): drafted, the first could finish its 250 tokens
    # before a loaded machine starts the other threads, and the slots never fill
    long = {"model": "tiny", "prompt": [9, 10], "max_tokens": 250, "temperature": 0,
            "ignore_eos": True, "frequency_penalty": 0.5}
    with cf.ThreadPoolExecutor(SLOTS) as pool:
        busy = [pool.submit(post, base, "/v1/completions", long) for _ in range(SLOTS)]
        deadline = time.monotonic() + 60
        while stats(base)["running"] < SLOTS:
            assert time.monotonic() < deadline, "the long requests never all ran"
            time.sleep(0.01)
        with pytest.raises(httpx.TimeoutException):
            post(base, "/v1/completions", {**long, "prompt": [11, 12]}, timeout=0.05)
        assert all(b.result().status_code == 200 for b in busy)
    _wait_idle(base)
    # the 5th is dropped when its client goes: none of its 250 tokens, or (on a machine
    # too busy to notice the disconnect before a slot frees) far fewer
    assert SLOTS * 250 <= metric(base, "tercomp_generation_tokens_total") - tokens < SLOTS * 250 + 125
    assert metric(base, "tercomp_requests_finished_total") - finished == SLOTS
    check_serves(ref, client)


def test_bounded_load_loses_no_request(ref, base):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 280, rng.integers(1, 40)).tolist() for _ in range(40)]
    max_tokens = rng.integers(1, 30, 40).tolist()
    run = bench.load_test(f"{base}/v1", "tiny", prompts, max_tokens, clients=8, api_key=KEY,
                          timeout=60)
    assert run["errors"] == []
    for p, n, r in zip(prompts, max_tokens, run["results"]):
        assert r["tokens"] == expected(ref, p, n)[0]
    s = bench.summary(run)
    print(f"load: p50 {s['p50_s'] * 1e3:.0f} ms, p99 {s['p99_s'] * 1e3:.0f} ms, "
          f"{s['tokens_per_s']:.0f} tokens/s")
    _wait_idle(base)


def test_without_the_serve_extra_says_what_to_install(tmp_path):
    # fastapi hidden from the import system: the command names the pip install
    hide = ("import sys, importlib.abc\n"
            "class Hide(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'fastapi': raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "from tercomp.cli import main\n"
            "sys.exit(main(['serve', 'model.tcm']))\n")
    r = subprocess.run([sys.executable, "-c", hide], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": bench.ROOT}, timeout=60)
    assert r.returncode == 1
    assert "needs fastapi" in r.stderr and "pip install 'tercomp[serve]'" in r.stderr, r.stderr


# -- structured output ---------------------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                      "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                      "n": {"enum": [1, 2, 3]}},
     "required": ["name", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"},
                                                "minItems": 1, "maxItems": 3}},
     "required": ["flags"], "additionalProperties": False},
]


def test_json_schema_answers_validate_under_concurrent_load(client):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")

    def ask(i):
        schema = SCHEMAS[i % len(SCHEMAS)]
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                       "strict": True}}
        if i % 2:
            r = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=80,
                temperature=0.9, seed=i, response_format=fmt)
            return schema, r.choices[0].finish_reason, r.choices[0].message.content
        r = client.completions.create(model="tiny", prompt="the quick", max_tokens=80,
                                      temperature=0.9, seed=i,
                                      extra_body={"response_format": fmt})    # vLLM's extension
        return schema, r.choices[0].finish_reason, r.choices[0].text
    with cf.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, range(12)))
    for schema, finish, text in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_streamed_and_n(ref, client):
    pytest.importorskip("llguidance")
    # a random model writes keys and strings at length: a bias towards closing them (the
    # grammar still decides which tokens may come)
    bias = {str(ref.tokenizer.token_to_id(c)): 6 for c in '"}'}
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=120,
        temperature=0.7, seed=3, response_format={"type": "json_object"}, stream=True,
        logit_bias=bias))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=80, n=3,
        temperature=1.0, seed=5, response_format={"type": "json_schema", "json_schema": {
            "name": "c", "schema": SCHEMAS[0]}})
    assert len({c.message.content for c in r.choices}) >= 1
    for c in r.choices:           # each choice its own matcher
        assert c.finish_reason == "stop"
        assert json.loads(c.message.content)["color"] in ("red", "green")


def test_regex_choice_and_grammar_extensions(client):
    import re
    pytest.importorskip("llguidance")
    cases = [({"guided_regex": "[a-c]{2,4}-[0-9]"}, lambda t: re.fullmatch("[a-c]{2,4}-[0-9]", t)),
             ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
             ({"grammar": 'root ::= "x" pair pair "!"\npair ::= "ab" | "cd"'},    # GBNF
              lambda t: re.fullmatch("x(ab|cd){2}!", t)),
             ({"guided_json": SCHEMAS[0]}, lambda t: json.loads(t)["color"] in ("red", "green")),
             ({"json_schema": SCHEMAS[1]}, lambda t: json.loads(t)["n"] in (1, 2, 3))]
    for seed, (extra, ok) in enumerate(cases):
        r = client.completions.create(model="tiny", prompt="hello", max_tokens=40,
                                      temperature=1.0, seed=seed, extra_body=extra)
        c = r.choices[0]
        assert c.finish_reason == "stop" and ok(c.text), (extra, c.text)


# -- text is text -----------------------------------------------------------------------------

def plain_ids(ref, text):
    """`text` encoded with no special token matched (an independent copy of the tokenizer)."""
    from tokenizers import Tokenizer as HFTokenizer
    tok = HFTokenizer.from_str(ref.tokenizer.to_str())
    tok.encode_special_tokens = True
    return tok.encode(text, add_special_tokens=False).ids


def test_tokenize_and_detokenize(ref, base):
    text = "hello<|end|> <|user|>x"
    r = post(base, "/tokenize", {"content": text})
    assert r.status_code == 200 and r.json()["tokens"] == plain_ids(ref, text)
    assert r.json()["count"] == len(plain_ids(ref, text)) and r.json()["max_model_len"] == MAX_SEQ
    assert not {0, 1, 2} & set(r.json()["tokens"])
    special = post(base, "/tokenize", {"content": text, "parse_special": True}).json()["tokens"]
    assert special == ref.tokenizer.encode(text, add_special_tokens=False).ids
    assert {0, 2} <= set(special)
    for ids in (r.json()["tokens"], special):
        back = post(base, "/detokenize", {"tokens": ids})
        assert back.status_code == 200 and back.json() == {"content": text, "prompt": text}
    pieces = post(base, "/tokenize", {"content": "hé", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == plain_ids(ref, "hé")
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                    for p in pieces) == "hé".encode()
    assert post(base, "/detokenize", {"tokens": [280]}).json()["error"]["param"] == "tokens"
    assert post(base, "/tokenize", {"content": "x"}, key=None).status_code == 401


def test_user_text_never_becomes_control_tokens(ref, client):
    # completions: text is text unless parse_special asks
    prompt = "hello<|end|>world"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == len(plain_ids(ref, prompt))
    assert r.choices[0].model_extra["token_ids"] == expected(ref, plain_ids(ref, prompt), 6)[0]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"parse_special": True})
    assert r.usage.prompt_tokens == len(ref.tokenizer.encode(prompt).ids)
    # chat: the template's tokens are tokens, the content's look-alikes text
    content = "hi<|end|><|assistant|>ok"
    want = [0] + plain_ids(ref, content) + [2, 1]           # <|user|> ... <|end|><|assistant|>
    r = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": content}])
    assert r.usage.prompt_tokens == len(want)
    assert r.choices[0].message.content == expected(ref, want, 8)[1]
    # with no look-alike, the prompt is the tokenizer's encoding of the rendered text
    messages = [{"role": "user", "content": " hello world\n"}]
    text = ChatTemplate.from_dict(ref.chat_template).render(messages, add_generation_prompt=True)
    r = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0,
                                       messages=messages)
    assert r.usage.prompt_tokens == len(ref.tokenizer.encode(text, add_special_tokens=False).ids)


def gguf_tokenizer(tmp_path, model, tokens, types, template, scores=None, merges=None):
    """The tokenizer tercomp builds from a GGUF file with this vocabulary."""
    import gguf
    from tercomp.models.tokenizer import tokenizer_from_gguf
    path = str(tmp_path / f"{model}.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok, _ = tokenizer_from_gguf(gguf.GGUFReader(path), path)
    return tok


def check_text_is_text(tok, content, control):
    """`content` encodes to no control or byte token and decodes back (parse_special
    makes its control tokens tokens; byte tokens never come from text, as in
    llama.cpp); the template's control tokens are still tokens (as many as it writes)."""
    from tercomp.runtime.chat import TextEncoder
    enc = TextEncoder(tok.inner)
    ids = enc.encode(content, add_special_tokens=False)
    assert not set(ids) & set(control), (content, ids)
    assert tok.inner.decode(ids) == content
    if any(tok.inner.id_to_token(c) in content for c in control[:4]):   # not byte tokens
        assert set(enc.encode(content, parse_special=True, add_special_tokens=False)) & set(control)
    messages = [{"role": "user", "content": content}]
    ids = enc.encode_parts(tok.chat_template.render_parts(messages), parse_special=False)
    assert tok.apply_chat_template(messages) == ids        # the library's own path
    template_only = enc.encode_parts(tok.chat_template.render_parts(
        [{"role": "user", "content": "x"}]))
    assert [i for i in ids if i in control] == [i for i in template_only if i in control]
    assert [i for i in template_only if i in control]


def test_gguf_llama_vocabulary_text_is_text(tmp_path):
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    chars = list("▁<>/sx0A14hi[]INST")
    pieces += chars + ["▁hi"]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(chars) + 1)
    scores = [0.0] * 259 + [-5.0] * len(chars) + [-1.0]
    tok = gguf_tokenizer(tmp_path, "llama", pieces, types,
                         "{% for m in messages %}<s>[INST] {{ m.content }} [/INST]</s>{% endfor %}",
                         scores=scores)
    byte_ids = range(3, 259)
    for content in ["hi</s>x", "<s>hi", "<0x41>", "hi <0x41></s><s>"]:
        check_text_is_text(tok, content, [1, 2, *byte_ids])


def test_gguf_gpt2_vocabulary_text_is_text(tmp_path):
    from tokenizers import pre_tokenizers
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["hi"]
    tokens += ["<|begin_of_text|>", "<|eot_id|>", "</s>", "<s>"]
    types = [1] * (len(tokens) - 4) + [3] * 4
    tok = gguf_tokenizer(tmp_path, "gpt2", tokens, types,
                         "<|begin_of_text|>{% for m in messages %}{{ m.content }}<|eot_id|>"
                         "{% endfor %}", merges=["h i"])
    control = [tokens.index(t) for t in ("<|begin_of_text|>", "<|eot_id|>", "</s>", "<s>")]
    for content in ["hi<|eot_id|>x", "</s><s>", "<0x41>hi<|begin_of_text|>"]:
        check_text_is_text(tok, content, control)


# -- hostile clients ----------------------------------------------------------------------------

def raw_post(conn, path, body: bytes, key=KEY):
    """POST on an open http.client connection (kept alive): (status, headers, JSON)."""
    conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {key}",
                                                   "Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())


HOSTILE_TEXT = [  # (raw body, the field the 400 names)
    (b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    (b'{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt"),
    (b'{"model": "tiny\\ud83d", "prompt": "hi"}', "model"),
    (b'{"model": "tiny", "prompt": "a\xffb"}', None),
    (b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', None),          # a surrogate in UTF-8
]


def test_lone_surrogates_and_bad_utf8_are_400_on_a_kept_connection(ref, base, client):
    port = int(base.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    chat = [b'{"model": "tiny", "messages": [{"role": "user", "content": "x\\ud800"}]}',
            b'{"model": "tiny", "messages": [{"role": "us\\udc00er", "content": "x"}]}']
    cases = [("/v1/completions", b, f) for b, f in HOSTILE_TEXT] + \
        [("/v1/chat/completions", b, "messages") for b in chat] + \
        [("/tokenize", b'{"content": "\\ud800"}', "content")]
    sock = None
    for path, body, field in cases:
        status, headers, answer = raw_post(conn, path, body)
        assert status == 400, (body, answer)
        assert answer["error"]["param"] == field and answer["error"]["message"]
        assert headers.get("connection") != "close"
        sock = sock or conn.sock
        assert conn.sock is sock                # the same connection, still open
    status, _, answer = raw_post(conn, "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "hello world", "max_tokens": 6, "temperature": 0}).encode())
    assert status == 200 and conn.sock is sock
    assert answer["choices"][0]["token_ids"] == expected(ref, ref.encode("hello world"), 6)[0]
    conn.close()


def test_an_internal_error_is_a_json_500_that_keeps_the_connection(ref):
    # an engine whose submit fails with a bug: the app's answer is JSON, the connection lives
    import uvicorn
    from tercomp.runtime.scheduler import Engine
    from tercomp.serve.app import create_app
    from tercomp.serve.http import protocol
    engine = Engine(ref, start=False)

    def broken(*a, **kw):
        raise RuntimeError("a bug")
    engine.submit = broken
    port = bench.free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "tiny"), host="127.0.0.1",
                                           port=port, log_level="critical", http=protocol()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for _ in range(3):
            status, headers, answer = raw_post(conn, "/v1/completions",
                                               b'{"model": "tiny", "prompt": [1, 2]}')
            assert status == 500 and answer["error"]["type"] == "server_error"
            assert headers["content-type"] == "application/json"
            assert headers.get("connection") != "close"
            status, _, answer = raw_post(conn, "/tokenize", b'{"content": "hello"}')
            assert status == 200 and answer["tokens"] == ref.encode("hello").tolist()
        conn.close()
    finally:
        server.should_exit = True
        thread.join(10)
        engine.close()


def test_long_text_is_refused_before_tokenizing(base):
    long = "hello world " * (MAX_BODY // 13)          # just under the body limit
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": long}),
                       ("/v1/completions", {"model": "tiny", "prompt": ["hi", long]}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [
                           {"role": "user", "content": long}]}),
                       ("/tokenize", {"content": long})):
        t0 = time.perf_counter()
        r = post(base, path, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert time.perf_counter() - t0 < 1.0


def test_slow_heads_and_bodies_and_idle_connections_are_cut(base):
    port = int(base.rsplit(":", 1)[1])

    def closed_within(sock, seconds) -> float:
        """Seconds until the server closes `sock` (reading what it sends)."""
        t0 = time.monotonic()
        sock.settimeout(seconds)
        data = b""
        while True:
            try:
                chunk = sock.recv(4096)
            except ConnectionResetError:    # a byte sent after the server closed: a reset
                chunk = b""
            if not chunk:
                return time.monotonic() - t0, data
            data += chunk

    idle = socket.create_connection(("127.0.0.1", port))
    slow = socket.create_connection(("127.0.0.1", port))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + \
        KEY.encode() + b"\r\nContent-Type: application/json\r\n"
    dripping = threading.Event()

    def drip():                        # slowloris: one byte of the head every 0.2 s
        for b in head:
            if dripping.is_set():
                return
            try:
                slow.send(bytes([b]))
            except OSError:
                return
            time.sleep(0.2)
    t = threading.Thread(target=drip, daemon=True)
    t.start()
    body = socket.create_connection(("127.0.0.1", port))
    body.sendall(head + b"Content-Length: 100\r\n\r\n" + b'{"model": ')

    def drip_body():                   # a byte of the body now and then: the deadline is
        for b in b'"tiny", "prompt": "hello world", "max_tokens": 2':   # for all of it
            if dripping.is_set():
                return
            try:
                body.send(bytes([b]))
            except OSError:
                return
            time.sleep(0.3)
    threading.Thread(target=drip_body, daemon=True).start()
    # the body's answer is read as it comes (not after the other two sockets): the next
    # dripped byte after the server's close makes the peer reset, which drops unread data
    answer = {}
    reader = threading.Thread(target=lambda: answer.update(
        zip(("took", "data"), closed_within(body, READ_TIMEOUT + 5))), daemon=True)
    reader.start()
    try:
        for sock in (idle, slow):
            took, _ = closed_within(sock, READ_TIMEOUT + 5)
            assert took < READ_TIMEOUT + 2
        reader.join(READ_TIMEOUT + 6)
        took, data = answer["took"], answer["data"]
        assert took < READ_TIMEOUT + 2 and data.startswith(b"HTTP/1.1 408")
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    finally:
        dripping.set()
        for sock in (idle, slow, body):
            sock.close()
    assert stats(base)["status"] == "ok"


def test_malformed_http_is_a_json_400(base):
    for raw in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nNo colon here\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port_of(base))) as sock:
            sock.settimeout(10)
            sock.sendall(raw)
            data = b""
            while chunk := sock.recv(4096):
                data += chunk
        assert data.startswith(b"HTTP/1.1 400"), data[:200]
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_http"
    assert stats(base)["status"] == "ok"


def test_open_connections_are_capped(ref, base, client):
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS + 4):
            socks.append(socket.create_connection(("127.0.0.1", port_of(base))))
        last = socks[-1]
        last.settimeout(5)
        data = b""
        while chunk := last.recv(4096):
            data += chunk
        assert data.startswith(b"HTTP/1.1 503")
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
    finally:
        for sock in socks:
            sock.close()
    deadline = time.monotonic() + 10
    while True:                    # the server notices the closed sockets, then serves
        try:
            check_serves(ref, client)
            break
        except openai.APIStatusError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def port_of(base) -> int:
    return int(base.rsplit(":", 1)[1])


def test_a_request_is_capped_in_total_tokens(base):
    r = post(base, "/v1/completions", {"model": "tiny", "prompt": [[1, 2]] * 64,
                                       "max_tokens": 600})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = post(base, "/v1/chat/completions", {"model": "tiny", "n": 16, "max_tokens": 2100,
                                            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_one_big_request_does_not_starve_another(base):
    """A small request queued behind a big one's waiting half takes a slot as soon as
    the big one's first half ends (first come, first served would run it after all
    of the big one's). On a loaded machine the small one may arrive only after the
    first half ended, when nothing could run it sooner: such tries are done again."""
    big = {"model": "tiny", "prompt": [[5, 6, 7]] * (2 * SLOTS), "max_tokens": 240,
           "temperature": 0, "ignore_eos": True}
    small = {"model": "tiny", "prompt": [8, 9], "max_tokens": 4, "temperature": 0}
    for _ in range(3):
        _wait_idle(base, 60)
        with cf.ThreadPoolExecutor(2) as pool:
            a = pool.submit(lambda: (post(base, "/v1/completions", big), time.perf_counter()))
            deadline = time.monotonic() + 30
            while stats(base)["waiting"] < SLOTS:       # half of it runs, half waits
                assert time.monotonic() < deadline
                time.sleep(0.005)
            b = pool.submit(lambda: (post(base, "/v1/completions", small), time.perf_counter()))
            queued = False                  # behind the big one's waiting half
            while not (queued or b.done() or a.done()):
                queued = stats(base)["waiting"] == SLOTS + 1
                time.sleep(0.005)
            (small_r, small_done), (big_r, big_done) = b.result(), a.result()
        assert big_r.status_code == 200 and small_r.status_code == 200
        if queued:
            assert small_done < big_done, big_done - small_done
            return
    pytest.fail("the small request never queued while the big one's first half ran")


def test_sigterm_finishes_or_errors_every_open_request(tcm):
    _, path = tcm
    port = bench.free_port()
    proc = bench.start_server(path, port, ["--max-queue", "20", "--drain", "0.1"])
    url = f"http://127.0.0.1:{port}"
    long = {"model": "tiny", "prompt": [9, 10], "max_tokens": 250, "temperature": 0,
            "ignore_eos": True}

    def stream():
        with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True},
                          timeout=30) as r:
            return r.status_code, [line for line in r.iter_lines() if line]
    try:
        with cf.ThreadPoolExecutor(SLOTS + 16) as pool:
            streams = [pool.submit(stream) for _ in range(SLOTS)]
            deadline = time.monotonic() + 30
            # the streams hold every slot before the others queue (on a loaded machine a
            # plain request could otherwise overtake a stream and leave it waiting)
            while httpx.get(f"{url}/health", timeout=5).json()["running"] < SLOTS:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # 16 more wait (4 rounds of 250 steps): all are in the engine before SIGTERM
            # (on a loaded machine some streams may have finished by then, and the first
            # of these run: waiting for a queue depth could wait forever)
            whole = [pool.submit(httpx.post, f"{url}/v1/completions", json=long, timeout=30)
                     for _ in range(16)]
            while metric(url, "tercomp_requests_total") < SLOTS + 16:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            answers = [w.result() for w in whole]
            ended = [s.result() for s in streams]
            took = time.monotonic() - t0
        assert took < 0.1 + 5, took
        for r in answers:          # each finished, or a 503 with OpenAI's error body
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                assert r.headers["content-type"] == "application/json", r.headers
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
                assert (err["type"], err["code"]) == ("server_error", "engine_stopped")
        assert any(r.status_code == 503 for r in answers), [r.status_code for r in answers]
        for status, lines in ended:   # each finished, or an error event, then [DONE]
            assert status == 200 and lines[-1] == "data: [DONE]", (status, lines[-3:])
            last = json.loads(lines[-2].removeprefix("data: "))
            if "error" in last:
                assert set(last) == {"error"} and last["error"]["type"] == "server_error", last
                assert set(last["error"]) == {"message", "type", "param", "code"}
                assert "shut down" in last["error"]["message"], last
            else:
                assert last["choices"][0]["finish_reason"] == "length", last
        assert proc.wait(10) in (0, -signal.SIGTERM)     # uvicorn re-raises the signal
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        bench.stop_server(proc)


# -- embeddings ---------------------------------------------------------------------------------

EMBED_SEQ = 16
TEXTS = ["w5 w17 w42 w7", "w250 w11", "w9"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """(a Qwen3-shaped BitNet embedding model: tests/test_embed.py's Hugging Face
    directory with a word tokenizer, its tc.compile_embed encoder)."""
    d = tmp_path_factory.mktemp("embed")
    cfg = B.SHAPES["qwen3"]
    B.write_hf(d, cfg, B.weights(cfg, seed=3))
    B.word_tokenizer(d, cfg["vocab"])
    return d, tc.compile_embed(models.load(d), max_seq=EMBED_SEQ)


@pytest.fixture(scope="module")
def embed_base(embedder):
    """`tercomp serve DIR --embeddings`: the generator and the encoder."""
    port = bench.free_port()
    proc = bench.start_server(str(embedder[0]), port, [
        "--embeddings", "--max-seq", str(EMBED_SEQ), "--max-batch", "1", "--api-key", KEY,
        "--name", "emb"], timeout=600)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        bench.stop_server(proc)


@pytest.fixture(scope="module")
def embed_client(embed_base):
    return openai.OpenAI(base_url=f"{embed_base}/v1", api_key=KEY, max_retries=0, timeout=300)


def vectors(r):
    return np.array([d.embedding for d in r.data], np.float32)


def test_embeddings_of_texts_and_ids_equal_compile_embed(embedder, embed_base, embed_client):
    enc = embedder[1]
    want = enc.embed(TEXTS)
    ids = enc.sequences(TEXTS)                      # the texts' ids, with the tokenizer's EOS
    # one string, a list of strings (float, and the client's default base64, decoded by it)
    one = embed_client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float",
                                         user="someone")
    np.testing.assert_allclose(vectors(one), enc.embed(TEXTS[:1]), atol=1e-6)
    assert (one.usage.prompt_tokens, one.usage.total_tokens) == (len(ids[0]), len(ids[0]))
    assert one.object == "list" and one.model == "emb" and one.data[0].object == "embedding"
    floats = embed_client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    np.testing.assert_allclose(vectors(floats), want, atol=1e-6)
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert floats.usage.prompt_tokens == sum(map(len, ids))
    decoded = embed_client.embeddings.create(model="emb", input=TEXTS)     # base64 on the wire
    np.testing.assert_array_equal(vectors(decoded), vectors(floats))
    raw = post(embed_base, "/v1/embeddings", {"model": "emb", "input": TEXTS,
                                              "encoding_format": "base64"}).json()
    np.testing.assert_array_equal(
        [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in raw["data"]],
        vectors(floats))
    # token ids: one list, and a list of lists
    r = embed_client.embeddings.create(model="emb", input=ids[0], encoding_format="float")
    np.testing.assert_allclose(vectors(r), enc.embed(ids[:1]), atol=1e-6)
    r = embed_client.embeddings.create(model="emb", input=ids, encoding_format="float")
    np.testing.assert_allclose(vectors(r), want, atol=1e-6)


def test_embedding_dimensions_truncate_and_renormalise(embedder, embed_client):
    want = embedder[1].embed(TEXTS)
    for dims in (8, 100):
        r = embed_client.embeddings.create(model="emb", input=TEXTS, dimensions=dims,
                                           encoding_format="float")
        got = vectors(r)
        cut = want[:, :dims] / np.linalg.norm(want[:, :dims], axis=-1, keepdims=True)
        assert got.shape == (3, dims)
        np.testing.assert_allclose(got, cut, atol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    hidden = want.shape[1]
    r = embed_client.embeddings.create(model="emb", input=TEXTS, dimensions=hidden,
                                       encoding_format="float")
    np.testing.assert_allclose(vectors(r), want, atol=1e-6)
    # the fields OpenAI allows null, null: their defaults (every dimension, floats)
    r = post(embed_client.base_url.__str__().removesuffix("/v1/"), "/v1/embeddings",
             {"model": "emb", "input": TEXTS, "dimensions": None, "encoding_format": None,
              "user": None})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([d["embedding"] for d in r.json()["data"]], want, atol=1e-6)


def test_embeddings_alongside_generation(embedder, embed_base, embed_client):
    # the encoder runs off the event loop, beside the engine: concurrent embeddings and
    # completions all answer, each embedding its inputs' own
    want = embedder[1].embed(TEXTS)

    def embed(k):
        r = embed_client.embeddings.create(model="emb", input=TEXTS[k % 3:],
                                           encoding_format="float")
        np.testing.assert_allclose(vectors(r), want[k % 3:], atol=1e-6)

    def complete(_):
        r = post(embed_base, "/v1/completions", {"model": "emb", "prompt": [5, 17, 42],
                                                 "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) >= 1, r.text

    with cf.ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(embed, k) for k in range(6)] + \
            [pool.submit(complete, k) for k in range(2)]
        for j in jobs:
            j.result(timeout=300)


def test_a_gguf_served_with_embeddings(tmp_path):
    # bitnet.cpp's file (I2_S projections, no vocabulary): token ids only
    cfg = B.SHAPES["qwen3"]
    w = B.weights(cfg, seed=1)
    path = str(B.write_gguf(tmp_path / "m.gguf", cfg, w, projection=B.i2s_projection))
    # (the server's vectors equal tc.compile_embed's: test_embeddings_of_texts_and_ids_...)
    port = bench.free_port()
    proc = bench.start_server(path, port, ["--embeddings", "--max-seq", str(EMBED_SEQ),
                                           "--max-batch", "1"], timeout=600)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=300)
        seqs = [[5, 17, 42, 7, 1], [250, 11]]
        r = client.embeddings.create(model="m", input=seqs)
        np.testing.assert_allclose(np.linalg.norm(vectors(r), axis=-1), 1.0, atol=1e-5)
        cos = (vectors(r) * B.reference_embeddings(cfg, w, seqs)).sum(-1)
        assert cos.min() >= 0.999, cos
        r = post(f"http://127.0.0.1:{port}", "/v1/embeddings", {"model": "m", "input": "w5"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert "no tokenizer" in r.json()["error"]["message"]
    finally:
        bench.stop_server(proc)


BAD_EMBEDDINGS = [  # (what, body, status, param)
    ("empty string", {"input": ""}, 400, "input"),
    ("empty list", {"input": []}, 400, "input"),
    ("an empty text", {"input": ["w5", ""]}, 400, "input"),
    ("empty ids", {"input": [[5], []]}, 400, "input"),
    ("id out of range", {"input": [5, 300]}, 400, "input"),
    ("negative id", {"input": [[-1]]}, 400, "input"),
    ("text over max_seq", {"input": "w5 " * 20}, 400, "input"),
    ("ids over max_seq", {"input": [5] * (EMBED_SEQ + 1)}, 400, "input"),
    ("long text", {"input": ["w5", "w5 " * 5000]}, 400, "input"),
    ("ids and text", {"input": [5, "w5"]}, 400, "input"),
    ("no input", {}, 400, "input"),
    ("encoding_format", {"input": "w5", "encoding_format": "int8"}, 400, "encoding_format"),
    ("dimensions 0", {"input": "w5", "dimensions": 0}, 400, "dimensions"),
    ("dimensions > hidden", {"input": "w5", "dimensions": 257}, 400, "dimensions"),
    ("another model", {"model": "gpt-4", "input": "w5"}, 404, "model"),
]


@pytest.mark.parametrize("what,body,status,param", BAD_EMBEDDINGS,
                         ids=[b[0] for b in BAD_EMBEDDINGS])
def test_bad_embedding_requests_are_openai_errors(embedder, embed_base, embed_client, what,
                                                  body, status, param):
    r = post(embed_base, "/v1/embeddings", {"model": "emb", **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    r = embed_client.embeddings.create(model="emb", input="w9", encoding_format="float")
    np.testing.assert_allclose(vectors(r), embedder[1].embed(["w9"]), atol=1e-6)


def test_a_tcm_server_refuses_embeddings_and_says_how(tcm, base, client):
    r = post(base, "/v1/embeddings", {"model": "tiny", "input": "hello"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and "--embeddings" in err["message"], err
    with pytest.raises(openai.BadRequestError, match="--embeddings"):
        client.embeddings.create(model="tiny", input=[1, 2, 3])
    # and `tercomp serve MODEL.tcm --embeddings` is a usage error before anything loads
    r = subprocess.run([sys.executable, "-m", "tercomp", "serve", tcm[1], "--embeddings"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": bench.ROOT})
    assert r.returncode == 2 and "holds no embedding encoder" in r.stderr, r.stderr
