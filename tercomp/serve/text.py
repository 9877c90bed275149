"""From generated token ids to the text a client sees: incremental detokenization and
stop strings, as OpenAI's API applies them.

A `TextStream` takes a request's tokens one at a time and returns the text that may be
sent now. It holds back (a) trailing U+FFFD (a byte-level tokenizer
splits one character over several tokens; decoding a prefix ends in U+FFFD until the
rest comes), and (b) a tail that could be the start of a stop string. A stop
string ends the text before it (the stop string itself is not returned, as OpenAI
does); a stop token id ends it too (its own text is not returned either). Streamed and
non-streamed responses both come from this class, so their text is the same by
construction.

        s = TextStream(tok, stop=["\\n\\n"], stop_ids={eos})
        for t in req:                  # a request's token ids as they come
            piece = s.push(t)          # the text they make safe to send, or ""
            if s.finished:             # a stop string or id was reached
                req.cancel()
                break
        piece = s.flush()              # what was held back, once the request ended
"""
from __future__ import annotations


class TextStream:
    """Text of one generated sequence. `tokenizer` is a `tokenizers.Tokenizer` (None: a
    model without one; then text stays empty and only token ids are reported).
    Attributes: `tokens` (every id pushed, stop tokens included: the usage count),
    `text` (all text returned so far), `finished` (a stop string or stop id was seen).
    Special tokens are left out of the text, but for `keep` ({id: text}: a tool-call
    syntax's tags, which the answer's parser reads)."""

    def __init__(self, tokenizer, stop=(), stop_ids=(), keep=None):
        self.tokenizer, self.keep = tokenizer, dict(keep or {})
        self.stop = [s for s in stop if s]
        self.stop_ids = set(stop_ids)
        self.longest = max(map(len, self.stop), default=0)
        self.tokens: list[int] = []
        self._text_ids: list[int] = []
        self.text = ""
        self.finished = False
        self._cut = False           # a stop string ended the text

    def push(self, token: int) -> str:
        """Take the next token; returns the text that can be sent now ("" if none)."""
        if self.finished:
            return ""
        self.tokens.append(int(token))
        if token in self.stop_ids:
            self.finished = True
            return ""
        if self.tokenizer is None:
            return ""
        self._text_ids.append(int(token))
        # a trailing U+FFFD may be a character whose other bytes are to come: text up to
        # the last whole character is final (lossy UTF-8 decoding of a prefix is a prefix)
        full = self._decode(self._text_ids).rstrip("\ufffd")
        return self._advance(full, final=False)

    def flush(self) -> str:
        """The request has ended: the text held back, up to a stop string if one is
        complete in it."""
        if self._cut or self.tokenizer is None:
            return ""
        return self._advance(self._decode(self._text_ids), final=True)

    def _decode(self, ids) -> str:
        """The text of `ids`: the runs between kept tokens decoded, the kept ones' text
        between them."""
        if not self.keep or not self.keep.keys() & set(ids):
            return self.tokenizer.decode(ids)
        out, run = [], []
        for t in ids:
            if t in self.keep:
                out += [self.tokenizer.decode(run), self.keep[t]]
                run = []
            else:
                run.append(t)
        return "".join(out) + self.tokenizer.decode(run)

    def _advance(self, full: str, final: bool) -> str:
        start = len(self.text)
        if not full.startswith(self.text):
            # a decoder that rewrote text already sent (not seen with byte-level or
            # SentencePiece decoders): send what follows it, never resend
            full = self.text + full[start:]
        end = len(full)
        hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            end, self.finished, self._cut = min(hits), True, True
        elif not final:
            end -= self._held(full)
        if end <= start:
            return ""
        self.text = full[:end]
        return full[start:end]

    def _held(self, full: str) -> int:
        """The length of the longest tail of `full` that begins some stop string."""
        for k in range(min(self.longest - 1, len(full)), 0, -1):
            tail = full[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


#: GPT-2's byte-to-character table, inverted: the bytes of a byte-level BPE piece
_SHOWN = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
_BYTE_OF = {chr(b): b for b in _SHOWN}
_BYTE_OF.update({chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in _SHOWN)})


class TokenPieces:
    """The bytes and the display string of single tokens (log-probability entries,
    /tokenize's pieces): a byte-level BPE piece maps back through GPT-2's byte table,
    a SentencePiece piece has its ▁ as a space and `<0xNN>` as the byte NN, an added
    token is its own text. A string that is not whole UTF-8 is shown as vLLM shows
    it: `bytes:\\xe2\\x80`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict = {}
        self.added = {}
        self.byte_level = False
        if tokenizer is not None:
            self.added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
            decoder = tokenizer.decoder
            state = decoder.__getstate__().decode() if decoder is not None else ""
            self.byte_level = '"ByteLevel"' in state

    def bytes(self, token: int) -> bytes:
        b = self._cache.get(token)
        if b is None:
            b = self._cache[token] = self._bytes(token)
        return b

    def _bytes(self, token: int) -> bytes:
        if self.tokenizer is None:
            return b""
        if token in self.added:
            return self.added[token].encode()
        piece = self.tokenizer.id_to_token(token) or ""
        if self.byte_level:
            if all(c in _BYTE_OF for c in piece):
                return bytes(_BYTE_OF[c] for c in piece)
            return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    def text(self, token: int) -> str:
        b = self.bytes(token)
        try:
            return b.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{c:02x}" for c in b)

