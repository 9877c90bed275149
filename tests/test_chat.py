"""Chat templates: `lm.tokenizer.apply_chat_template` renders the template that came with
the model file (tokenizer_config.json, or the GGUF's tokenizer.chat_template) as
transformers does, in jinja2's sandbox; `tercomp generate --chat`; a compiled LM and its
saved artifact keep the template."""
import json

import numpy as np
import pytest

import tercomp as tc
from tercomp import models
from tercomp.runtime.chat import ChatTemplate, ChatTemplateError

import bitnet_ref as R
import box
from test_models_formats import CFG, hf_config, write_hf

# Llama 3's template, as its tokenizer_config.json carries it
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
          "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi! "}]
RENDERED = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def byte_tokenizer():
    """A byte-level BPE tokenizer with Llama 3's special tokens, 300 ids."""
    from tokenizers import Tokenizer, decoders, models as tm, pre_tokenizers, trainers
    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["system user assistant Be brief. Hi! hello"] * 20,
                            trainers.BpeTrainer(vocab_size=290, special_tokens=SPECIALS,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat") / "hf"
    write_hf(d, config=hf_config(tie_word_embeddings=True), tokenizer=byte_tokenizer())
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": LLAMA3, "bos_token": "<|begin_of_text|>",
                   "eos_token": {"content": "<|eot_id|>", "special": True}}, f)
    return d


def test_hf_chat_template_renders_as_transformers(hf_dir):
    tok = models.load(hf_dir).tokenizer
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == RENDERED
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert ids == tok.encode(RENDERED, add_special_tokens=False).ids
    assert ids[0] == tok.token_to_id("<|begin_of_text|>")
    assert tok.decode(ids, skip_special_tokens=False) == RENDERED
    assert not tok.apply_chat_template(MESSAGES, tokenize=False).endswith("assistant<|end_header_id|>\n\n")


def test_gguf_chat_template_and_save_round_trip(tmp_path, hf_dir):
    lm = models.load(hf_dir)
    models.save_gguf(lm, tmp_path / "chat.gguf")
    back = models.load(tmp_path / "chat.gguf")
    assert back.tokenizer.chat_template.source == LLAMA3
    # the GGUF names bos by id: the rendered text starts with that token
    text = back.tokenizer.apply_chat_template(MESSAGES[1:], add_generation_prompt=True,
                                              tokenize=False)
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") and "Hi!" in text


def test_gguf_template_with_bos_and_eos_ids(tmp_path):
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [f"▁w{i}" for i in range(300 - len(pieces))]
    vocab = {"model": "llama", "tokens": pieces, "scores": [0.0] * 300, "bos": 1, "eos": 2,
             "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] "
                              "{{ m.content }}{{ eos_token }}{% endfor %}"}
    path = R.write_gguf(tmp_path / "t.gguf", CFG, R.random_weights(CFG, seed=1), vocab=vocab)
    tok = models.load(path).tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == \
        "<s>[user] x</s>"


@pytest.mark.parametrize("source,match", [
    ("{{ ''.__class__.__mro__ }}", "unsafe|access"),
    ("{{ messages.append(1) }}", "unsafe|immutable|not safely callable"),
    ("{% for i in range(10**9) %}{% endfor %}", "range too big|MAX_RANGE|range"),
    ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
    ("{% for %}", "does not compile"),
])
def test_a_hostile_template_is_an_error_not_code(source, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(source, origin="t.json").render(MESSAGES)


def test_bad_messages_and_no_template(hf_dir, tmp_path):
    tok = models.load(hf_dir).tokenizer
    for bad in ("hello", [{"content": "no role"}], [("user", "hi")]):
        with pytest.raises(ChatTemplateError, match="messages must be a list"):
            tok.apply_chat_template(bad)
    d = tmp_path / "plain"
    write_hf(d, config=hf_config(tie_word_embeddings=True), tokenizer=byte_tokenizer())
    with pytest.raises(ChatTemplateError, match="carry no chat template"):
        models.load(d).tokenizer.apply_chat_template(MESSAGES)


def test_a_broken_template_file_leaves_the_model_usable(tmp_path):
    d = tmp_path / "broken"
    write_hf(d, config=hf_config(tie_word_embeddings=True), tokenizer=byte_tokenizer())
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.warns(UserWarning, match="chat template not loaded"):
        lm = models.load(d)
    assert lm.tokenizer.chat_template is None and lm.tokenizer.encode("hello").ids


def test_generate_chat_from_the_command_line_and_a_saved_artifact(hf_dir, tmp_path):
    lm = models.load(hf_dir)
    gen = tc.compile_lm(lm, max_seq=64)
    assert gen.chat_template["template"] == LLAMA3
    gen.save(str(tmp_path / "chat.tcm"))
    assert tc.load(str(tmp_path / "chat.tcm")).chat_template["eos_token"] == "<|eot_id|>"
    for model in (str(hf_dir), str(tmp_path / "chat.tcm")):
        # the command line in a process of its own (tests/box.py), with a cache of its own
        rc, stdout, stderr = box.cli("generate", model, "--chat", "Hi!", "-n", "4", timeout=600,
                                     env={"TERCOMP_CACHE_DIR": tmp_path / "cache"})
        assert rc == 0, stderr
        assert "prefill:" in stderr and "from the compile cache" not in stderr
        prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}],
                                                  add_generation_prompt=True)
        want = gen.generate(np.array(prompt), max_new_tokens=4,
                            eos={lm.tokenizer.token_to_id("<|eot_id|>")})
        assert stdout[:-1] == gen.decode_text(want), (stdout, want)
