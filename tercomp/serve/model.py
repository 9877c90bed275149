"""The served model's text side: what the API needs of the generator (its tokenizer,
chat template, eos and vocabulary), text to ids (text is text: runtime.chat's
TextEncoder), the bound on text before it is tokenized, OpenAI's log-probability
entries, and the embedding encoder of /v1/embeddings (ServedEncoder).
"""
from __future__ import annotations

import base64
import json

import numpy as np

from ..errors import InputError
from ..runtime.chat import ChatTemplate, ChatTemplateError, TextEncoder
from .guard import APIError
from .structured import Grammars
from .text import TokenPieces
from .tools import SYNTAXES, TAGS, TemplateSupport, prepare


class ServedModel:
    """What the API needs of the generator: its tokenizer, chat template and eos.
    `chat_template` (a Jinja template's text, vLLM's --chat-template) replaces the
    model's own, with the model's bos and eos tokens."""

    def __init__(self, gen, tool_call_parser: str | None = None,
                 chat_template: str | None = None, template_origin: str = "--chat-template"):
        if tool_call_parser is not None and tool_call_parser not in SYNTAXES:
            raise InputError(f"unknown tool-call parser {tool_call_parser!r}",
                             hint=f"one of {', '.join(SYNTAXES)} (vLLM's names)")
        self.tool_call_parser = tool_call_parser
        self.tokenizer, self.max_seq, self.vocab_size = gen.tokenizer, gen.max_seq, gen.vocab_size
        self.template = ChatTemplate.from_dict(gen.chat_template)
        if chat_template is not None:       # the model's bos and eos tokens with it
            base = self.template
            self.template = ChatTemplate(chat_template, base.bos_token if base else "",
                                         base.eos_token if base else "", template_origin)
        self._support = None        # serve.tools.TemplateSupport, probed on first use
        eos = None
        if self.template is not None and self.template.eos_token and self.tokenizer is not None:
            eos = self.tokenizer.token_to_id(self.template.eos_token)
        self.eos = {eos} if eos is not None else set()
        self.pieces = TokenPieces(self.tokenizer)
        self.encoder = TextEncoder(self.tokenizer) if self.tokenizer is not None else None
        self.grammars = Grammars(self.tokenizer, self.vocab_size, next(iter(self.eos), None))
        # the most bytes a token covers: text of more than max_seq times it (twice, for
        # normalizers that shrink text) is over the context whatever its tokens
        n = self.tokenizer.get_vocab_size(with_added_tokens=True) if self.tokenizer else 0
        self.longest = max(max((len(self.pieces.bytes(i)) for i in range(n)), default=1), 1)
        self.max_text_bytes = 2 * self.max_seq * self.longest

    def check_length(self, text, param: str, max_seq: int | None = None) -> None:
        """A 400 for text too long for the context (or `max_seq` tokens), before
        tokenizing it (its time is bounded by the bytes this lets through)."""
        max_seq = max_seq or self.max_seq
        limit = 2 * max_seq * self.longest
        if isinstance(text, str) and len(text) > limit // 4 \
                and len(text.encode("utf-8", "surrogatepass")) > limit:
            raise APIError(400, f"This model's maximum context length is {max_seq} "
                                f"tokens; the text has over {limit} bytes, more "
                                f"than that many tokens cover", param=param,
                           code="context_length_exceeded")

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def completion_logprobs(self, run, ids, scores) -> dict:
        """OpenAI's completions `logprobs` of tokens `ids`: their strings, log-probabilities
        and most likely alternatives (with the token itself, as OpenAI adds it), and
        their offsets in the choice's text (run.offset carries on between chunks)."""
        tokens = [self.pieces.text(t) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(run.offset)
            run.offset += len(t)
        tops = []
        for t, s in zip(ids, scores):
            if s is None:
                tops.append(None)
                continue
            d = {self.pieces.text(a): finite(lp) for a, lp in s[1]}
            d.setdefault(self.pieces.text(t), finite(s[0]))
            tops.append(d)
        return {"tokens": tokens, "token_logprobs": [None if s is None else finite(s[0])
                                                     for s in scores],
                "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, ids, scores) -> list:
        """OpenAI's chat `logprobs.content` entries of tokens `ids`."""
        def entry(t, lp):
            b = self.pieces.bytes(t)
            return {"token": self.pieces.text(t), "logprob": finite(lp), "bytes": list(b)}
        return [{**entry(t, s[0]), "top_logprobs": [entry(a, lp) for a, lp in s[1]]}
                for t, s in zip(ids, scores)]

    def encode(self, prompt, parse_special: bool = False, add_special_tokens: bool = True,
               param: str = "prompt") -> list:
        """A prompt's ids: token ids as they are, text as text (special tokens only with
        `parse_special`)."""
        if not isinstance(prompt, str):
            return prompt
        if self.encoder is None:
            raise APIError(400, "this model has no tokenizer: pass the prompt as token ids",
                           param=param)
        return self.encoder.encode(prompt, parse_special, add_special_tokens)

    def render_chat(self, messages, parse_special: bool = False, tools=None) -> list:
        """The ids of `messages` (protocol.ChatMessage) in the chat template: its special
        tokens are tokens, the messages' contents text (unless `parse_special`).
        `tools` (protocol.Tool, None: not offered) go to the template, or in the generic
        format where it does not write them (serve.tools)."""
        if self.tokenizer is None or self.template is None:
            raise APIError(400, "this model's files carry no chat template (or no tokenizer): "
                                "use /v1/completions", param="messages")
        listed, kw = self.chat_messages(messages, tools)
        try:
            parts = self.template.render_parts(listed, add_generation_prompt=True, **kw)
        except ChatTemplateError as e:
            raise APIError(400, e.message, param="messages") from None
        return self.encoder.encode_parts(parts, parse_special)

    @property
    def tool_syntax(self) -> str:
        """The call syntax answers are parsed and forced in: `tool_call_parser` where the
        server was told one (vLLM's --tool-call-parser), else the one the tool prompt
        asks for (serve.tools.template_syntax): the template's own where it writes
        tools, else the generic format's "hermes"."""
        if self.tool_call_parser is not None:
            return self.tool_call_parser
        if self._support is None and self.template is not None:
            self._support = TemplateSupport.probe(self.template)
        return self._support.syntax if self._support is not None else "hermes"

    def tool_tags(self) -> dict:
        """{text: token id} of the tool syntax's tags (serve.tools.TAGS) that are special
        tokens of this vocabulary: decoding would drop them from the answer's text, and
        a forced call writes them as those tokens."""
        if self.tokenizer is None:
            return {}
        ids = {tag: self.tokenizer.token_to_id(tag) for tag in TAGS[self.tool_syntax]}
        return {tag: i for tag, i in ids.items() if i is not None and i in self.encoder.special_ids}

    def chat_messages(self, messages, tools=None):
        """(messages as dicts, {"tools": ...} or {}) as the template is given them."""
        listed = [m.for_template() for m in messages]
        tools = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in listed):
            return listed, {}
        if self._support is None:
            self._support = TemplateSupport.probe(self.template)
        self._check_template_text(listed, tools)
        listed, tools = prepare(listed, tools, self._support)
        return listed, ({"tools": tools} if tools else {})

    def _check_template_text(self, listed, tools) -> None:
        """Text the model's template writes itself (its tools and the history's calls,
        outside the messages' contents) is parsed for special tokens as the template's
        own: a 400 where a user's text there holds one (in the generic format it is
        content, text as text)."""
        specials = [self.tokenizer.id_to_token(i) for i in self.encoder.special_ids]
        specials = [t for t in specials if t]
        where = []
        if tools and self._support.tools:
            where.append(("tools", tools))
        if self._support.calls:
            where += [("messages", [m.get("tool_calls"), m.get("tool_call_id"), m.get("name")])
                      for m in listed if m.get("tool_calls") or m["role"] == "tool"]
        for field, value in where:
            text = json.dumps(value, ensure_ascii=False)
            hit = next((t for t in specials if t in text), None)
            if hit is not None:
                raise APIError(400, f"{field}: {hit!r} is a special token of this model, and "
                                    f"its chat template writes tools and tool calls as its own "
                                    f"text, where it would become that token: leave it out",
                                    param=field)


class ServedEncoder:
    """What /v1/embeddings needs of an embedding encoder (tc.compile_embed's Embedder,
    built by whoever starts the server: nothing here imports the compiler): inputs as
    checked token ids (text is text, as in the completions, with the EOS the model
    file asks for appended as Embedder.encode appends it), and their embeddings."""

    def __init__(self, embedder, model: ServedModel, max_tokens: int):
        self.embedder, self.model, self.max_tokens = embedder, model, max_tokens
        self.max_seq, self.hidden_size = embedder.max_seq, embedder.hidden_size
        self.vocab_size = embedder.lm.config.vocab_size

    def sequences(self, inputs) -> list:
        """Each input (a text or token ids) as token ids: a 400 naming `input` for text
        too long before it is tokenized, and for ids that are none, too many or out
        of the vocabulary."""
        seqs = []
        for k, x in enumerate(inputs):
            if isinstance(x, str):
                self.model.check_length(x, "input", self.max_seq)
                x = list(self.model.encode(x, param="input"))
                eos = self.embedder.eos
                if eos is not None and (not x or x[-1] != eos):
                    x.append(eos)
            if not x:
                raise APIError(400, f"input {k} has no tokens", param="input")
            if len(x) > self.max_seq:
                raise APIError(400, f"This model's maximum context length is {self.max_seq} "
                                    f"tokens; input {k} has {len(x)}", param="input",
                               code="context_length_exceeded")
            bad = next((t for t in x if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"input {k}: token id {bad} is out of range for a "
                                    f"vocabulary of {self.vocab_size}", param="input")
            seqs.append(x)
        total = sum(map(len, seqs))
        if total > self.max_tokens:
            raise APIError(400, f"the inputs have {total} tokens, over the {self.max_tokens} "
                                f"one request may embed", param="input")
        return seqs

    def embed(self, seqs, dimensions: int | None = None) -> np.ndarray:
        """float32 [len(seqs), dimensions or hidden]: one batched call of the encoder,
        truncated to the first `dimensions` (Matryoshka) and normalised again where the
        encoder normalises."""
        e = self.embedder.embed(seqs)
        if dimensions is not None and dimensions < e.shape[-1]:
            e = e[:, :dimensions]
            if self.embedder.normalize:
                e = e / np.maximum(np.linalg.norm(e, axis=-1, keepdims=True), 1e-12)
        return np.ascontiguousarray(e, np.float32)


def encode_embedding(row, encoding_format: str):
    """One embedding as OpenAI sends it: JSON numbers, or "base64" of its little-endian
    float32 bytes (what OpenAI's client decodes with numpy.frombuffer)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(row, "<f4").tobytes()).decode("ascii")
    return row.tolist()


def finite(lp: float) -> float:
    """A log-probability as JSON can hold it (OpenAI's floor for -inf: -9999)."""
    return max(float(lp), -9999.0) if lp == lp else -9999.0
