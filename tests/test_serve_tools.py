"""Tool calling's text side (tercomp.serve.tools), without a server: the history and the
offered tools as a chat template gets them (its own rendering where it writes tools, the
generic Hermes format where it ignores them), answers split into content and calls the
same way whole and streamed, and the grammar that "required" and a named tool_choice
enforce: every sequence it lets a random model write is a call whose arguments validate.
tests/test_serve.py drives the same through a server with OpenAI's client."""
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")

import test_serve as S  # noqa: E402
import tercomp.cli  # noqa: E402
from tercomp.runtime.chat import ChatTemplate, TextEncoder  # noqa: E402
from tercomp.serve.protocol import ChatRequest  # noqa: E402
from tercomp.serve.tools import (TemplateSupport, ToolParser, call_grammar,  # noqa: E402
                                 fallback_system, prepare, split)

# a template that ignores tools (tests/test_serve.py's tiny model's)
PLAIN = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# one that writes them, as Qwen 2.5's does: arguments as objects through tojson
NATIVE = ("{% if tools %}<|system|>TOOLS:{% for t in tools %}{{ t.function.name }}="
          "{{ t.function.parameters | tojson }};{% endfor %}<|end|>{% endif %}"
          "{% for m in messages %}{% if m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}"
          "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
          "</tool_call>{% endfor %}<|end|>{% elif m.role == 'tool' %}<|tool|>{{ m.content }}"
          "<|end|>{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# Llama 3.1's way (cut down): tools as JSON in the user turn, calls as bare JSON objects
# with "parameters", the python tag and the ipython role
LLAMA31_TOOLS = ("{% for m in messages %}<|{{ m.role }}|>{% if tools and loop.last %}Given the "
                 "following functions, respond with a JSON for a function call with its proper "
                 "arguments: {\"name\": function name, \"parameters\": dictionary}."
                 "{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}{% if m.tool_calls %}"
                 "<|python_tag|>{% for c in m.tool_calls %}{{ {'name': c.function.name, "
                 "'parameters': c.function.arguments} | tojson }}{% endfor %}{% elif m.role == "
                 "'tool' %}<|ipython|>{{ m.content }}{% else %}{{ m.content }}{% endif %}<|end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
# Llama 3.1's way in full (3.2's writes calls alike): headers, tools in the first user
# turn, one call a message as {"name", "parameters"}, tool answers in the ipython role
LLAMA31_FULL = (
    "{{ bos_token }}{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = '' %}{% set rest = messages %}"
    "{% endif %}<|start_header_id|>system<|end_header_id|>\n\n{% if tools %}Environment: "
    "ipython\n{% endif %}Cutting Knowledge Date: December 2023\n\n{{ system }}<|eot_id|>"
    "{%- if tools %}{% if not rest or rest[0].role != 'user' %}{{ raise_exception('tools go "
    "in the first user message, and there is none') }}{% endif %}<|start_header_id|>user"
    "<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a "
    "function call with its proper arguments that best answers the given prompt.\n\n"
    "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument "
    "name and its value}. Do not use variables.\n\n{% for t in tools %}{{ t | tojson }}"
    "\n\n{% endfor %}{{ rest[0].content }}<|eot_id|>{% set rest = rest[1:] %}{% endif %}"
    "{%- for m in rest %}{% if m.tool_calls %}{% if m.tool_calls | length != 1 %}"
    "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{{ {'name': m.tool_calls[0].function"
    ".name, 'parameters': m.tool_calls[0].function.arguments} | tojson }}<|eot_id|>"
    "{%- elif m.role in ['tool', 'ipython'] %}<|start_header_id|>ipython<|end_header_id|>"
    "\n\n{{ m.content }}<|eot_id|>{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
    "\n\n{{ m.content | trim }}<|eot_id|>{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Mistral's (v0.3, cut down): [AVAILABLE_TOOLS] before the last user turn, [TOOL_CALLS]
MISTRAL = ("{% for m in messages %}{% if m.role == 'user' %}{% if tools and loop.last %}"
           "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]"
           "{{ m.content }}[/INST]{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | "
           "map(attribute='function') | list | tojson }}<|end|>{% elif m.role == 'tool' %}"
           "[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% else %}{{ m.content }}<|end|>"
           "{% endif %}{% endfor %}")
# Mistral v0.3's way in full: turns must alternate (calls and tool answers aside), the tools
# before the last user turn, and every call id 9 letters or digits (else it raises, as
# Mistral's own templates do)
MISTRAL_V03 = (
    "{%- set ns = namespace(turn=0, last_user=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% if m.role in ['user', 'assistant'] and not m.tool_calls %}"
    "{% if (m.role == 'user') != (ns.turn % 2 == 0) %}{{ raise_exception('roles must "
    "alternate user/assistant') }}{% endif %}{% set ns.turn = ns.turn + 1 %}{% endif %}"
    "{%- endfor %}{{ bos_token }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{% if tools and loop.index0 == ns.last_user %}"
    "[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ m.content }}[/INST]"
    "{%- elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
    "{% if c.id is not string or c.id | length != 9 %}{{ raise_exception('Tool call IDs "
    "should be alphanumeric strings with length 9') }}{% endif %}"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{%- elif m.role == 'tool' %}{% if m.tool_call_id | length != 9 %}{{ raise_exception("
    "'Tool call IDs should be alphanumeric strings with length 9') }}{% endif %}"
    "[TOOL_RESULTS] {{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}"
    "[/TOOL_RESULTS]"
    "{%- elif m.role == 'assistant' %} {{ m.content | trim }}{{ eos_token }}"
    "{%- else %}{{ raise_exception('only user, assistant and tool roles') }}{% endif %}"
    "{%- endfor %}")

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"hour": {"enum": [6, 7]},
                                          "label": {"type": "string", "maxLength": 6}},
         "required": ["hour"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]


def rendered(template, messages, tools):
    """The prompt text the server renders (serve.model.ServedModel.chat_messages)."""
    req = ChatRequest(model="m", messages=messages, tools=tools)
    listed = [m.for_template() for m in req.messages]
    support = TemplateSupport.probe(template)
    dicts = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    listed, tools = prepare(listed, dicts, support)
    return template.render(listed, add_generation_prompt=True,
                           **({"tools": tools} if tools else {}))


def test_probe_tells_templates_that_write_tools():
    assert TemplateSupport.probe(ChatTemplate(PLAIN)) == (False, False, "hermes")
    assert TemplateSupport.probe(ChatTemplate(NATIVE)) == (True, True, "hermes")
    assert TemplateSupport.probe(ChatTemplate(LLAMA31_TOOLS)).syntax == "llama3_json"
    assert TemplateSupport.probe(ChatTemplate(MISTRAL)).syntax == "mistral"
    assert TemplateSupport.probe(ChatTemplate(LLAMA31_FULL)) == (True, True, "llama3_json")
    assert TemplateSupport.probe(ChatTemplate(MISTRAL_V03, eos_token="</s>")) == \
        (True, True, "mistral")
    # a template that lists the tools but drops the history's calls does not write them
    drops = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
             "{{ m.content }}{% endfor %}")
    assert TemplateSupport.probe(ChatTemplate(drops)) == (True, False, "hermes")
    # a template that mentions [TOOL_CALLS] but never writes tools gets the generic format
    assert TemplateSupport.probe(ChatTemplate(PLAIN + "{# [TOOL_CALLS] #}")).syntax == "hermes"
    # a template that refuses roles it does not know writes none of them
    strict = ChatTemplate("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                          "{{ raise_exception('bad role') }}{% endif %}{{ m.content }}"
                          "{% endfor %}")
    assert TemplateSupport.probe(strict) == (False, False, "hermes")


def test_generic_format_for_a_template_that_ignores_tools():
    text = rendered(ChatTemplate(PLAIN), HISTORY, TOOLS)
    listing = "\n".join(json.dumps(t) for t in TOOLS)
    assert text == (
        "<|system|>" + fallback_system(TOOLS) + "<|end|>"
        "<|user|>Weather in Paris?<|end|>"
        '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n'
        "</tool_call><|end|>"
        "<|user|><tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
        "</tool_response><|end|><|assistant|>")
    assert f"<tools>\n{listing}\n</tools>" in text
    # a system message keeps its text, the tools after it
    text = rendered(ChatTemplate(PLAIN), [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "hi"}], TOOLS)
    assert text.startswith("<|system|>Be brief.\n\n# Tools\n") and text.count("<|system|>") == 1
    # no tools offered: the history is still written
    text = rendered(ChatTemplate(PLAIN), HISTORY, None)
    assert "# Tools" not in text and "<tool_response>\nsunny" in text


def test_native_template_gets_tools_and_calls_as_transformers_passes_them():
    text = rendered(ChatTemplate(NATIVE), HISTORY, TOOLS)
    assert text == (
        f"<|system|>TOOLS:get_weather={json.dumps(WEATHER)};set_alarm={json.dumps(ALARM)};<|end|>"
        "<|user|>Weather in Paris?<|end|>"
        '<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
        '</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}'
        "</tool_call><|end|><|tool|>sunny<|end|><|tool|>rain<|end|><|assistant|>")
    assert "# Tools" not in text


# Llama 3.1's way: a call as {"name", "parameters"} JSON, a tool's answer through tojson
LLAMA31 = ("{% for m in messages %}{% if m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}"
           '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
           "{% endfor %}<|end|>{% elif m.role == 'tool' %}<|ipython|>"
           "{% if m.content is mapping or m.content is iterable %}{{ m.content | tojson }}"
           "{% else %}{{ m.content }}{% endif %}<|end|>{% else %}<|{{ m.role }}|>{{ m.content }}"
           "<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


ONE_CALL = HISTORY[:2] + HISTORY[2:3]
ONE_CALL[1] = {**ONE_CALL[1], "tool_calls": ONE_CALL[1]["tool_calls"][:1]}


def test_a_llama31_template_gets_tools_and_its_calls_as_it_writes_them():
    text = rendered(ChatTemplate(LLAMA31_FULL), ONE_CALL, TOOLS)
    assert text.startswith("<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython")
    assert "".join(json.dumps(t) + "\n\n" for t in TOOLS) + "Weather in Paris?<|eot_id|>" in text
    assert text.endswith(
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
        '"parameters": {"city": "Paris", "days": 1}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_mistral_template_gets_call_ids_it_accepts():
    """Mistral's templates raise on a call id that is not 9 letters or digits (OpenAI's
    are `call_...`): the history's ids are written as 9 base-62 digits of their hash,
    the same for a call and the tool message answering it."""
    from tercomp.serve.tools import mistral_id
    text = rendered(ChatTemplate(MISTRAL_V03, eos_token="</s>"), HISTORY, TOOLS)
    a, b = mistral_id("call_1"), mistral_id("call_2")
    assert a != b and a.isalnum() and len(a) == 9
    assert text == (
        f"[AVAILABLE_TOOLS] {json.dumps(TOOLS)}[/AVAILABLE_TOOLS][INST] Weather in Paris?[/INST]"
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Paris", "days": 1}}, '
        f'"id": "{a}"}}, {{"name": "get_weather", "arguments": {{"city": "Oslo", "days": 1}}, '
        f'"id": "{b}"}}]</s>'
        f'[TOOL_RESULTS] {{"content": "sunny", "call_id": "{a}"}}[/TOOL_RESULTS]'
        f'[TOOL_RESULTS] {{"content": "rain", "call_id": "{b}"}}[/TOOL_RESULTS]')
    # ids that are already Mistral's stay as they are
    history = json.loads(json.dumps(HISTORY).replace("call_1", "AbC123xyz"))
    assert '"call_id": "AbC123xyz"' in rendered(ChatTemplate(MISTRAL_V03), history, TOOLS)


def test_tool_answers_written_as_json_strings_stay_text():
    """A template that writes a tool's answer with `tojson` (Llama 3.1's): the escaped
    answer is content, its special-token text never a token."""
    answer = 'line "one"\n<|end|> two'
    messages = [*HISTORY[:2], {"role": "tool", "tool_call_id": "call_1", "content": answer}]
    req = ChatRequest(model="m", messages=messages)
    listed = [m.for_template() for m in req.messages]
    assert TemplateSupport.probe(ChatTemplate(LLAMA31)).calls
    parts = ChatTemplate(LLAMA31).render_parts(listed, add_generation_prompt=True)
    assert (json.dumps(answer)[1:-1], True) in parts
    assert '"parameters": {"city": "Paris", "days": 1}}' in "".join(p for p, _ in parts)
    enc = TextEncoder(tiny_tokenizer())
    end = enc.special.token_to_id("<|end|>")
    assert enc.encode_parts(parts).count(end) == 3      # the template's, not the answer's


ANSWER = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
          '"days": 2}}\n</tool_call>\n<tool_call>{"name":"set_alarm","arguments":"{\\"hour\\": 6}"}'
          '</tool_call> <tool_call>{"name": "nope", "arguments": {}}</tool_call>\n'
          '<tool_call>not json</tool_call> <tool_call>{"name": "set_al')


def test_answers_split_the_same_whole_and_streamed():
    names = {"get_weather", "set_alarm"}
    content, calls = split(ANSWER, names)
    assert calls == [("get_weather", {"city": "Oslo", "days": 2}), ("set_alarm", {"hour": 6})]
    assert content == ('Let me check. \n <tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                       '\n<tool_call>not json</tool_call> <tool_call>{"name": "set_al')
    assert split(ANSWER, names, parallel=False)[1] == calls[:1]
    assert split("  just text \n", names) == ("just text", [])
    assert split('<tool_call>{"name": "set_alarm", "arguments": {}}</tool_call>\n', names) == \
        (None, [("set_alarm", {})])
    rng = np.random.default_rng(0)
    for _ in range(20):             # any chunking gives the same content and calls
        cuts = sorted(rng.choice(len(ANSWER), size=12, replace=False))
        p, events = ToolParser(names), []
        for a, b in zip([0, *cuts], [*cuts, len(ANSWER)]):
            events += p.push(ANSWER[a:b])
        events += p.flush()
        assert "".join(v for k, v in events if k == "content") == content
        assert [v for k, v in events if k == "call"] == calls


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models as tm, pre_tokenizers, trainers
    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(['<tool_call> {"name": "get_weather", "arguments": {}}'] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.mark.parametrize("choice", ["required", "set_alarm"])
def test_forced_call_grammar_gives_valid_calls(choice):
    pytest.importorskip("llguidance")
    from tercomp.serve.structured import Grammars
    tok = tiny_tokenizer()
    eos = tok.token_to_id("<|end|>")
    tools = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS).tools
    grammar = Grammars(tok, tok.get_vocab_size(), eos).compile(
        "lark", call_grammar(tools, None if choice == "required" else choice, parallel=False))
    rng = np.random.default_rng(1)
    schemas = {"get_weather": WEATHER, "set_alarm": ALARM}
    seen = set()
    for _ in range(6):              # random logits: whatever the model prefers
        c, ids = grammar.constraint(), []
        while not c.done:
            logits = c.mask(rng.normal(size=tok.get_vocab_size()).astype(np.float32))
            assert logits is not None, c.error
            t = int(np.argmax(logits))
            assert c.accept(t)
            ids.append(t)
            assert len(ids) < 400
        text = tok.decode(ids)
        content, calls = split(text, set(schemas))
        assert content is None and len(calls) == 1, text
        name, args = calls[0]
        assert choice == "required" or name == choice
        jsonschema.validate(args, schemas[name])
        seen.add(name)
    assert choice != "required" or len(seen) >= 1


def test_special_tags_are_kept_in_the_text_and_forced_as_tokens():
    """The text of an answer keeps a syntax tag that is a special token (decoding leaves
    special tokens out), and the grammar of a forced call writes it as that token."""
    pytest.importorskip("llguidance")
    from tercomp.serve.structured import Grammars
    from tercomp.serve.text import TextStream
    tok = tiny_tokenizer()
    tok.add_special_tokens(["[TOOL_CALLS]"])
    tag = tok.token_to_id("[TOOL_CALLS]")
    ids = tok.encode('hi [TOOL_CALLS] [{"name": "get_weather", "arguments": {}}]').ids
    assert tag in ids
    for keep, want in ((None, 'hi  [{"name"'), ({tag: "[TOOL_CALLS]"}, 'hi [TOOL_CALLS] [{"name"')):
        stream = TextStream(tok, keep=keep)
        text = "".join(stream.push(t) for t in ids) + stream.flush()
        assert text.startswith(want), text
    tools = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS).tools
    grammar = Grammars(tok, tok.get_vocab_size(), tok.token_to_id("<|end|>")).compile(
        "lark", call_grammar(tools, "set_alarm", parallel=False, syntax="mistral",
                             tags={"[TOOL_CALLS]": tag}))
    c = grammar.constraint()
    allowed = np.isfinite(c.mask(np.zeros(tok.get_vocab_size(), np.float32)))
    assert np.flatnonzero(allowed).tolist() == [tag]


def test_tool_text_never_becomes_a_special_token():
    """The generic format puts tools in a message's content (text is text); a template
    that writes them itself would parse them as its own text: a user's special token
    there is a 400 naming the field."""
    from types import SimpleNamespace
    from tercomp.serve.guard import APIError
    from tercomp.serve.model import ServedModel
    tok = tiny_tokenizer()
    end = tok.token_to_id("<|end|>")
    sneaky = [{"type": "function", "function": {"name": "f", "description": "a<|end|>b"}}]
    req = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=sneaky)

    def model(template):
        return ServedModel(SimpleNamespace(tokenizer=tok, max_seq=4096, vocab_size=300,
                                           chat_template={"template": template,
                                                          "eos_token": "<|end|>"}))
    ids = model(PLAIN).render_chat(req.messages, tools=req.tools)
    assert ids.count(end) == 2                      # the template's two, not the text's
    with pytest.raises(APIError) as e:
        model(NATIVE).render_chat(req.messages, tools=req.tools)
    assert e.value.status == 400 and e.value.body["error"]["param"] == "tools"
    plain = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    ids = model(NATIVE).render_chat(plain.messages, tools=plain.tools)
    assert tok.decode(ids, skip_special_tokens=False).replace(" ", "") == \
        rendered(ChatTemplate(NATIVE), [{"role": "user", "content": "x"}], TOOLS).replace(" ", "")


def test_request_validation_names_the_field():
    from pydantic import ValidationError
    ok = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    bad = [({"tools": {"type": "function"}}, "tools"),
           ({"tools": [{"type": "retrieval"}]}, "tools"),
           ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
           ({"tools": [{"type": "function", "function": {
               "name": "f", "parameters": {"type": "objectx"}}}]}, "tools"),
           ({"tools": TOOLS + TOOLS[:1]}, "tools"),
           ({"tool_choice": "required"}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice"),
           ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
           ({"messages": [{"role": "user", "content": "x", "tool_calls": [
               {"id": "1", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages")]
    for extra, field in bad:
        with pytest.raises(ValidationError) as e:
            ChatRequest(**{**ok, **extra})
        assert e.value.errors()[0]["loc"][0] == field, (extra, e.value)
    r = ChatRequest(**ok, tools=TOOLS, tool_choice={"type": "function",
                                                    "function": {"name": "set_alarm"}})
    assert r.tool_mode() == "set_alarm"
    assert ChatRequest(**ok, tools=TOOLS).tool_mode() == "auto"
    assert ChatRequest(**ok, tools=TOOLS, tool_choice="none").tool_mode() is None
    assert ChatRequest(**ok, tool_choice="none").tool_mode() is None


# -- through a server, with OpenAI's client ------------------------------------------------

# the generic prompt of two tools is ~900 tokens of the tiny byte-level vocabulary
TOOL_SEQ = 2048


@pytest.fixture(scope="module")
def tool_tcm(tmp_path_factory):
    """tests/test_serve.py's tiny model with room for tool prompts, saved; servers of
    other chat templates serve it with --chat-template."""
    pytest.importorskip("openai")
    pytest.importorskip("llguidance")
    import tercomp as tc
    path = str(tmp_path_factory.mktemp("tools") / "tiny.tcm")
    tc.compile_lm(S.tiny_lm(TOOL_SEQ), max_seq=TOOL_SEQ, max_batch=2).save(path)
    return path


def template_file(tmp_path_factory, source: str) -> str:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(source)
    return str(path)


@pytest.fixture(scope="module")
def served(tool_tcm):
    """The server's base URL: the tiny model's own template, which ignores tools
    (test_serve checks its answers against a single-stream generator: here the
    server's own greedy completions of a prompt's ids are the reference)."""
    path = tool_tcm
    port = S.bench.free_port()
    proc = S.bench.start_server(path, port, ["--api-key", S.KEY])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        S.bench.stop_server(proc)


@pytest.fixture(scope="module")
def base(served):
    return served


@pytest.fixture(scope="module")
def client(base):
    import openai
    return openai.OpenAI(base_url=f"{base}/v1", api_key=S.KEY, max_retries=0, timeout=120)


def greedy(client, ids, n) -> str:
    """The server's greedy completion of prompt `ids` (the eos ending it left out)."""
    return client.completions.create(model="tiny", prompt=ids, max_tokens=n,
                                     temperature=0).choices[0].text


TOOL_SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
ASK = [{"role": "user", "content": "hello"}]


def tiny_vocabulary():
    """The tiny model's tokenizer (tokenizers.Tokenizer)."""
    return S.tiny_lm(64).tokenizer.inner


def check_calls(message, names=TOOL_SCHEMAS):
    """The message's tool calls, each checked: an id, a known name, arguments that parse
    and validate against its schema."""
    assert message.tool_calls, message
    for c in message.tool_calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), TOOL_SCHEMAS[c.function.name])
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_required_and_named_tool_choice_give_valid_calls(client):
    eos_bias = {str(S.EOS): 100}      # eos where the grammar allows it: after a whole call
    seen = set()
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=200,
                                           temperature=1.0, seed=seed, logit_bias=eos_bias)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        calls = check_calls(c.message)
        assert len(calls) == 1
        seen.add(calls[0][0])
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0, seed=7, n=2,
        tool_choice={"type": "function", "function": {"name": "set_alarm"}},
        parallel_tool_calls=False)
    for c in r.choices:             # each choice its own matcher; one call without eos bias
        assert c.finish_reason == "tool_calls"
        assert [n for n, _ in check_calls(c.message)] == ["set_alarm"]


def test_tool_calls_stream_as_deltas(client):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0,
              seed=3, tool_choice={"type": "function", "function": {"name": "get_weather"}},
              parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0].message
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads(deltas[0].function.arguments), WEATHER)
    assert deltas[0].function.arguments == whole.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


def test_auto_tool_choice_parses_calls_or_returns_content(client):
    # a random model writes text: it is the content, no calls
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=12,
                                       temperature=0)
    c = r.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
    assert c.message.content and "<tool_call>" not in c.message.content
    # tool_choice "none": the tools are not offered, the prompt is the plain chat's
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12,
                                           temperature=0)
    none = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                          tool_choice="none", max_tokens=12, temperature=0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < r.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    # a model that writes a call (guided_choice makes this one): parsed, text around it content
    said = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "set_alarm", "arguments": '
            '{"hour": 7, "label": "go"}}\n</tool_call>')
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200,
              extra_body={"guided_choice": [said]})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
    calls = [("get_weather", {"city": "Oslo", "days": 2}), ("set_alarm", {"hour": 7, "label": "go"})]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == calls
    assert len({t.id for t in c.message.tool_calls}) == 2
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
        [(i, n, a) for i, (n, a) in enumerate(calls)]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Checking."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert [t.function.name for t in one.message.tool_calls] == ["get_weather"]


def test_history_with_tool_calls_and_tool_messages_is_rendered(client):
    """The tiny model's template ignores tools: the generic format, whose prompt the
    answer must be the greedy continuation of."""
    from tercomp.serve.tools import fallback_system
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = ("<|system|>" + fallback_system(TOOLS) + "<|end|><|user|>Weather in Paris?<|end|>"
            '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"days": 1}}\n</tool_call><|end|><|user|><tool_response>\nsunny\n</tool_response>'
            "<|end|><|assistant|>")
    ids = tiny_vocabulary().encode(text, add_special_tokens=False).ids
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                       max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == (greedy(client, ids, 8).strip() or None)


TOOL_BAD = [  # (what, body fields, param)
    ("tools not a list", {"tools": {"type": "function"}}, "tools"),
    ("not a function", {"tools": [{"type": "retrieval"}]}, "tools"),
    ("bad schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objectx"}}}]}, "tools"),
    ("unknown name", {"tools": TOOLS, "tool_choice": {"type": "function",
                                                      "function": {"name": "nope"}}}, "tool_choice"),
    ("required, no tools", {"tool_choice": "required"}, "tool_choice"),
    ("with response_format", {"tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tool_choice"),
    ("tool message, no id", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
]


def test_bad_tool_requests_are_400s_naming_the_field(base, client):
    for what, fields, param in TOOL_BAD:
        r = S.post(base, "/v1/chat/completions", {"model": "tiny", "messages": ASK, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (what, r.text)
    r = S.post(base, "/v1/completions", {"model": "tiny", "prompt": "hi", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


LLAMA3_ANSWER = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}; '
                 '{"name": "set_alarm", "parameters": "{\\"hour\\": 6}"}')
MISTRAL_ANSWER = ('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
                  '"Oslo", "days": 2}}, {"name": "set_alarm", "arguments": {"hour": 6}}]')
MISTRAL_V11 = 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}' \
              '[TOOL_CALLS]set_alarm[ARGS]{"hour": 6}'


@pytest.mark.parametrize("syntax, answer, content", [
    ("llama3_json", LLAMA3_ANSWER, None),
    ("llama3_json", LLAMA3_ANSWER[len("<|python_tag|>"):], None),
    ("mistral", MISTRAL_ANSWER, "Let me check."),
    ("mistral", MISTRAL_V11, "Let me check."),
])
def test_llama3_and_mistral_calls_split_the_same_whole_and_streamed(syntax, answer, content):
    """vLLM's llama3_json and mistral parsers' formats: the calls, whole or in any
    chunking, and the first call alone without parallel_tool_calls."""
    names = {"get_weather", "set_alarm"}
    calls = [("get_weather", {"city": "Oslo", "days": 2}), ("set_alarm", {"hour": 6})]
    assert split(answer, names, syntax=syntax) == (content, calls)
    assert split(answer, names, parallel=False, syntax=syntax) == (content, calls[:1])
    rng = np.random.default_rng(0)
    for _ in range(20):
        cuts = sorted(rng.choice(len(answer), size=10, replace=False))
        p, events = ToolParser(names, syntax=syntax), []
        for a, b in zip([0, *cuts], [*cuts, len(answer)]):
            events += p.push(answer[a:b])
        events += p.flush()
        assert ("".join(v for k, v in events if k == "content") or None) == content
        assert [v for k, v in events if k == "call"] == calls


@pytest.mark.parametrize("syntax, answer", [
    ("llama3_json", "Sure, it is sunny."),                               # plain text
    ("llama3_json", 'The JSON is {"name": "get_weather", "parameters": {}}'),  # not first
    ("llama3_json", '{"name": "launch", "parameters": {}}'),             # unknown tool
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Os'),  # cut short
    ("llama3_json", '{"name": "get_weather", "parameters": {}} and more'),
    ("mistral", "No [TOOL call here"),
    ("mistral", 'x [TOOL_CALLS] [{"name": "get_weather", "arguments": {}}'),  # cut short
    ("mistral", '[TOOL_CALLS]launch[ARGS]{}'),
])
def test_what_is_not_a_call_stays_content(syntax, answer):
    assert split(answer, {"get_weather", "set_alarm"}, syntax=syntax) == (answer.strip(), [])


@pytest.mark.parametrize("syntax", ["llama3_json", "mistral"])
def test_forced_calls_in_the_template_s_syntax(syntax):
    """tool_choice "required" in Llama 3.1's and Mistral's syntax: every answer the
    grammar lets a random model write parses back into valid calls in that syntax."""
    pytest.importorskip("llguidance")
    from tercomp.serve.structured import Grammars
    tok = tiny_tokenizer()
    eos = tok.token_to_id("<|end|>")
    tools = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS).tools
    grammar = Grammars(tok, tok.get_vocab_size(), eos).compile(
        "lark", call_grammar(tools, None, parallel=True, syntax=syntax))
    rng = np.random.default_rng(2)
    schemas = {"get_weather": WEATHER, "set_alarm": ALARM}
    for _ in range(4):
        c, ids = grammar.constraint(), []
        while not c.done:
            logits = c.mask(rng.normal(size=tok.get_vocab_size()).astype(np.float32))
            assert logits is not None, c.error
            t = int(np.argmax(logits))
            assert c.accept(t)
            ids.append(t)
            assert len(ids) < 600
        text = tok.decode(ids)
        content, calls = split(text, set(schemas), syntax=syntax)
        assert content is None and calls, text
        for name, args in calls:
            jsonschema.validate(args, schemas[name])


@pytest.fixture(scope="module")
def llama3_client(tool_tcm, tmp_path_factory):
    """A server of the tiny model with a chat template that writes tools in Llama 3.1's
    way (--chat-template)."""
    import openai
    port = S.bench.free_port()
    proc = S.bench.start_server(tool_tcm, port, ["--api-key", S.KEY, "--chat-template",
                                                 template_file(tmp_path_factory, LLAMA31_FULL)])
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=S.KEY,
                            max_retries=0, timeout=120)
    finally:
        S.bench.stop_server(proc)


def test_a_llama3_template_s_calls_are_forced_and_parsed_in_its_syntax(llama3_client):
    """The template asks for Llama 3.1's bare JSON calls: tool_choice "required" forces
    one in that syntax and the answer (whole and streamed) comes back as tool_calls."""
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0,
              seed=1, tool_choice="required", parallel_tool_calls=False,
              logit_bias={str(S.EOS): 100})
    r = llama3_client.chat.completions.create(**kw, logprobs=True)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    calls = check_calls(c.message)
    assert len(calls) == 1
    raw = "".join(t.token for t in c.logprobs.content)      # what the model wrote
    assert raw.lstrip().startswith('{"name":') and "<tool_call>" not in raw, raw
    assert '"parameters":' in raw, raw
    chunks = list(llama3_client.chat.completions.create(**kw, stream=True))
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or ()]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # a history of one call and its answer, as the template writes it
    r = llama3_client.chat.completions.create(model="tiny", messages=ONE_CALL, tools=TOOLS,
                                              max_tokens=2)
    text = rendered(ChatTemplate(LLAMA31_FULL), ONE_CALL, TOOLS)
    assert r.usage.prompt_tokens == len(tiny_vocabulary().encode(text, add_special_tokens=False).ids)


@pytest.fixture(scope="module")
def mistral_template(tmp_path_factory):
    """A file of a chat template that writes tools in Mistral's way."""
    return template_file(tmp_path_factory, MISTRAL_V03)


def forced_calls(path, template, parser=None):
    """What a server of `path` with the chat template file `template` (and
    --tool-call-parser `parser`) answers to tool_choice "required" and a named
    function, whole and streamed: ([(raw text the model wrote, the parsed calls)], the
    prompt tokens of HISTORY with OpenAI's call ids)."""
    import openai
    port = S.bench.free_port()
    proc = S.bench.start_server(path, port, ["--api-key", S.KEY, "--chat-template", template] +
                                (["--tool-call-parser", parser] if parser else []))
    out = []
    # eos, and the "]" that ends Mistral's list of calls, where the grammar allows them
    # (after a whole call: a random model would go on writing calls to max_tokens)
    bias = {str(S.EOS): 100, str(tiny_vocabulary().token_to_id("]")): 100}
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=S.KEY,
                               max_retries=0, timeout=120)
        for choice, parallel in (("required", True),
                                 ({"type": "function", "function": {"name": "set_alarm"}}, False)):
            kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0,
                      seed=3, tool_choice=choice, parallel_tool_calls=parallel,
                      logit_bias=bias)
            c = client.chat.completions.create(**kw, logprobs=True).choices[0]
            assert c.finish_reason == "tool_calls" and c.message.content is None, c
            calls = check_calls(c.message)
            if not parallel:
                assert [n for n, _ in calls] == ["set_alarm"]
            chunks = list(client.chat.completions.create(**kw, stream=True))
            deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or ()]
            assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == calls
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            out.append(("".join(t.token for t in c.logprobs.content), calls,
                        c.logprobs.content[0].token))
        r = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS,
                                           max_tokens=2)
    finally:
        S.bench.stop_server(proc)
    return out, r.usage.prompt_tokens


def test_a_mistral_template_s_calls_are_forced_and_parsed_in_its_syntax(tool_tcm,
                                                                       mistral_template):
    """The template writes [TOOL_CALLS]: "required" and a named tool_choice force calls
    in Mistral's syntax, parsed back into tool_calls whole and streamed; a history with
    OpenAI's call ids is rendered with ids the template accepts."""
    answers, prompt_tokens = forced_calls(tool_tcm, mistral_template)
    for raw, calls, _ in answers:
        assert raw.lstrip().startswith("[TOOL_CALLS] [{") and "<tool_call>" not in raw, raw
        assert '"arguments":' in raw, raw
    text = rendered(ChatTemplate(MISTRAL_V03, eos_token="<|end|>"), HISTORY, TOOLS)
    assert prompt_tokens == len(tiny_vocabulary().encode(text, add_special_tokens=False).ids)


def test_a_vocabulary_s_special_tool_call_tag_is_written_and_read_as_that_token(
        tmp_path_factory, mistral_template):
    """Mistral's vocabularies hold [TOOL_CALLS] as one special token (so do Llama 3.1's
    <|python_tag|> and some Qwen conversions' <tool_call>): a forced call writes that
    token, not the text spelled out, and the answer's text keeps it (decoding drops
    special tokens), so the calls are parsed."""
    import tercomp as tc
    path = str(tmp_path_factory.mktemp("tag") / "tiny.tcm")
    tc.compile_lm(S.tiny_lm(TOOL_SEQ, specials=["[TOOL_CALLS]"]), max_seq=TOOL_SEQ,
                  max_batch=2).save(path)
    for raw, calls, first in forced_calls(path, mistral_template)[0]:
        assert first == "[TOOL_CALLS]" and raw.startswith("[TOOL_CALLS] [{"), raw


def test_tool_call_parser_overrides_the_template_s_syntax(tool_tcm, mistral_template):
    """--tool-call-parser (vLLM's option): the Mistral template's server parses and forces
    Llama 3.1's JSON calls instead."""
    for raw, calls, _ in forced_calls(tool_tcm, mistral_template, "llama3_json")[0]:
        assert raw.lstrip().startswith('{"name":') and '"parameters":' in raw, raw
        assert "[TOOL_CALLS]" not in raw, raw


def test_bad_tool_call_parser_and_chat_template_options_say_what_is_wrong(tmp_path, capsys):
    """Before the model is opened: an unknown parser and an unreadable template file are
    usage errors (status 2), a template that does not compile an error naming it."""
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    for args, status, messages in [
        (["--tool-call-parser", "pythonic"], 2,
         ["--tool-call-parser 'pythonic'", "hermes, llama3_json, mistral"]),
        (["--chat-template", str(tmp_path / "none.jinja")], 2, ["none.jinja: cannot read it"]),
        (["--chat-template", str(bad)], 1, ["bad.jinja: the chat template does not compile"]),
    ]:
        assert tercomp.cli.main(["serve", str(tmp_path / "none.tcm"), *args]) == status
        err = capsys.readouterr().err
        assert all(m in err for m in messages), err
