"""The served model's text side: what the API needs of the generator (its tokenizer,
chat template, eos and vocabulary), text to ids (text is text: runtime.chat's
TextEncoder), the bound on text before it is tokenized, and OpenAI's log-probability
entries.
"""
from __future__ import annotations

from ..runtime.chat import ChatTemplate, ChatTemplateError, TextEncoder
from .guard import APIError
from .structured import Grammars
from .text import TokenPieces


class ServedModel:
    """What the API needs of the generator: its tokenizer, chat template and eos."""

    def __init__(self, gen):
        self.tokenizer, self.max_seq, self.vocab_size = gen.tokenizer, gen.max_seq, gen.vocab_size
        self.template = ChatTemplate.from_dict(gen.chat_template)
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
        longest = max((len(self.pieces.bytes(i)) for i in range(n)), default=1)
        self.max_text_bytes = 2 * self.max_seq * max(longest, 1)

    def check_length(self, text, param: str) -> None:
        """A 400 for text too long for the context, before tokenizing it (its time is
        bounded by the bytes this lets through)."""
        if isinstance(text, str) and len(text) > self.max_text_bytes // 4 \
                and len(text.encode("utf-8", "surrogatepass")) > self.max_text_bytes:
            raise APIError(400, f"This model's maximum context length is {self.max_seq} "
                                f"tokens; the text has over {self.max_text_bytes} bytes, more "
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

    def render_chat(self, messages, parse_special: bool = False) -> list:
        """The ids of `messages` in the chat template: its special tokens are tokens, the
        messages' contents text (unless `parse_special`)."""
        if self.tokenizer is None or self.template is None:
            raise APIError(400, "this model's files carry no chat template (or no tokenizer): "
                                "use /v1/completions", param="messages")
        try:
            parts = self.template.render_parts(
                [{"role": m.role, "content": m.text()} for m in messages],
                add_generation_prompt=True)
        except ChatTemplateError as e:
            raise APIError(400, e.message, param="messages") from None
        return self.encoder.encode_parts(parts, parse_special)


def finite(lp: float) -> float:
    """A log-probability as JSON can hold it (OpenAI's floor for -inf: -9999)."""
    return max(float(lp), -9999.0) if lp == lp else -9999.0
