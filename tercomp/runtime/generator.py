"""LMGenerator: token generation with a compiled language model (tc.compile_lm, or
tc.load of a saved LM artifact).

The module (see tercomp/generate.py) has one entry point, `step(ids [T], start, rows [L])`,
over a KV cache held in the module's globals on the device: `prefill` calls it with the
prompt, `decode` with one token. This class keeps the position (how many cache rows are filled), checks every input on
the host BEFORE calling IREE (so a rejected call leaves the cache as it was), samples,
and times the calls. Like the rest of tercomp.runtime it needs only NumPy and
iree.runtime (and `tokenizers`, optionally, for text).

One generator may be shared by threads: `prefill`, `decode`, `generate` and `reset`
hold a lock, so calls from different threads run one after the other (each gets what
it would alone). A call from inside another on the same thread (an `on_token` callback
that calls `prefill`) would rewrite the cache under the running generation: it is a
TercompError, and the running generation goes on unchanged.

    >>> gen = tc.load("lm.tcm")
    >>> logits = gen.prefill(np.array([1, 2, 3], np.int32))      # [3, vocab], cache rows 0..2
    >>> nxt = gen.decode(int(logits[-1].argmax()))                # [vocab], cache row 3
    >>> gen.generate([1, 2, 3], max_new_tokens=8, temperature=0.7, top_k=40, seed=0)
"""
from __future__ import annotations

import contextlib
import numbers
import threading
import time

import numpy as np

from ..errors import ConfigError, InputError, ArtifactError, UnsupportedError, ExecutionError
from .module import _to_host
from .numerics import report as report_numerics
from .sampling import check_sampling, sample
from .scoring import token_log_probs
from .signature import declared_types, parse_types
from .speculative import METHODS, DraftSchedule, accepted, prompt_lookup
from .step_abi import STEP, StepABI

KV_DTYPES = {"float16": "f16", "f16": "f16", "float32": "f32", "f32": "f32"}
_FIRST_ROW = np.zeros(1, np.int32)


def _ids(ids, vocab: int, what: str) -> np.ndarray:
    """`ids` as a contiguous int32 vector, or an InputError (integers only, in range)."""
    if isinstance(ids, (bool, np.bool_)):
        raise InputError(f"{what}: token ids must be integers, got a bool")
    try:
        arr = np.asarray(ids)
    except (ValueError, TypeError) as e:    # ragged [[1, 2], [3]], or objects NumPy refuses
        raise InputError(f"{what}: token ids must be a 1-D sequence of integers, got "
                         f"{type(ids).__name__} that is not one ({e})",
                         hint="pass one sequence, e.g. [1, 2, 3]") from None
    if arr.size == 0 and isinstance(ids, (list, tuple)):
        arr = arr.astype(np.int32)          # [] is float64 to NumPy
    if arr.dtype.kind not in "iu":
        raise InputError(f"{what}: token ids must be integers, got dtype {arr.dtype}",
                         hint="pass an int32 array or a list of ints")
    arr = arr.reshape(-1) if arr.ndim == 0 else arr
    if arr.ndim != 1:
        raise InputError(f"{what}: token ids must be a 1-D sequence [T], got shape {list(arr.shape)}",
                         hint="batch size is 1: pass one sequence")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        bad = int(arr[(arr < 0) | (arr >= vocab)][0])
        raise InputError(f"{what}: token id {bad} is out of range for a vocabulary of {vocab}",
                         hint=f"ids must be in [0, {vocab - 1}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


class LMGenerator:
    """A compiled LM with an on-device KV cache. Attributes: `exe` (the CompiledModule),
    `config` (the model config as a dict), `max_seq`, `kv_dtype`, `vocab_size`,
    `position` (cache rows filled), `tokenizer` (a `tokenizers.Tokenizer` or None),
    `stats` (token counts and seconds of the last `generate`), `calls` (step calls run:
    a caller that keeps cache rows for later, as runtime.Engine's prefix cache, sees
    from it that someone else wrote the cache in between)."""

    #: the step this generator calls (an artifact whose metadata names other inputs was
    #: compiled by an older tercomp)
    ABI = StepABI(batched=False)

    def __init__(self, exe):
        info = exe.meta.get("lm")
        if not isinstance(info, dict) or not {"config", "max_seq", "kv_dtype"} <= set(info):
            raise ConfigError("this module is not a compiled language model (no 'lm' metadata)",
                              hint="compile one with tc.compile_lm(lm)")
        if info.get("step_inputs") != list(self.ABI.inputs):
            raise ArtifactError("this language model artifact was compiled by an older tercomp "
                                "(its step function takes no `rows` input)",
                                hint="compile it again with tc.compile_lm or `tercomp generate`")
        self.exe = exe
        self.config = dict(info["config"])
        self.max_seq = int(info["max_seq"])
        self.kv_dtype = info["kv_dtype"]
        self.vocab_size = int(self.config["vocab_size"])
        self.position = 0
        self.tokenizer = _load_tokenizer(info.get("tokenizer"))
        # the model's chat template as data (rendered by runtime.chat, which needs jinja2)
        self.chat_template = info.get("chat") if isinstance(info.get("chat"), dict) else None
        self.stats: dict = {}
        self.calls = 0
        self._step = None
        self._lock = threading.Lock()
        self._owner = None          # the thread ident inside a call, for re-entry checks
        self._running = None        # the name of that call

    @staticmethod
    def describe(config: dict, max_seq: int, kv_dtype: str, tokenizer=None, chat=None,
                 max_batch: int = 1) -> dict:
        """The JSON metadata a compiled LM carries (artifact `signature.json` key "lm"):
        `chat` is the model's chat template ({"template", "bos_token", "eos_token"});
        `max_batch` > 1 for a batched generator (runtime.batched), whose step takes
        StepABI(batched=True)'s inputs."""
        return {"config": dict(config), "max_seq": int(max_seq), "kv_dtype": kv_dtype,
                "entries": StepABI.of(max_batch).entries, "max_batch": int(max_batch),
                "step_inputs": list(StepABI.of(max_batch).inputs),
                "tokenizer": tokenizer, "chat": chat}

    @staticmethod
    def module_mismatch(info, reflection: dict) -> str | None:
        """How LM metadata `info` (describe()'s dict, from an artifact) disagrees with the
        compiled module, whose `step` function reflects `reflection` (its declaration and
        the KV cache globals, lowering/state.py), or None. A max_seq or vocabulary larger
        than the module's would run past the cache or the output table unnoticed."""
        config = info.get("config") if isinstance(info, dict) else None
        if not isinstance(config, dict):
            return "its 'lm' entry has no model config"
        sizes = {}
        for key in ("vocab_size", "num_hidden_layers", "num_key_value_heads", "head_dim"):
            v = config.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                return f"the model config's {key} is {v!r}, not a positive int"
            sizes[key] = v
        max_seq, kv = info.get("max_seq"), KV_DTYPES.get(info.get("kv_dtype"))
        if isinstance(max_seq, bool) or not isinstance(max_seq, int) or max_seq < 1:
            return f"its max_seq is {max_seq!r}, not a positive int"
        if kv is None:
            return f"its kv_dtype is {info.get('kv_dtype')!r}, not one of {', '.join(KV_DTYPES)}"
        declared = declared_types(reflection.get("iree.abi.declaration", ""))
        if declared is None or "tercomp.state" not in reflection:
            return f"the module's {STEP} function does not describe its arguments and KV cache"
        inputs, outputs = declared
        batch = info.get("max_batch", 1)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            return f"its max_batch is {batch!r}, not a positive int"
        abi = StepABI.of(batch)
        if abi.scalar_inputs(inputs) is None:
            return f"the module's {STEP} takes {inputs}, not ({', '.join(abi.inputs)})"
        if not outputs or outputs[0] is None or len(outputs[0][0]) != 2:
            return f"the module's {STEP} returns {outputs}, not logits [rows, vocab]"
        if outputs[0][0][1] != sizes["vocab_size"]:
            return (f"its vocab_size is {sizes['vocab_size']}, the module's logits have "
                    f"{outputs[0][0][1]} columns")
        caches = parse_types(reflection["tercomp.state"])
        want = (list(abi.cache_shape(batch, max_seq, sizes["num_key_value_heads"],
                                     sizes["head_dim"])), kv)
        if len(caches) != 2 * sizes["num_hidden_layers"]:
            return (f"its {sizes['num_hidden_layers']} layers need {2 * sizes['num_hidden_layers']} "
                    f"KV caches, the module has {len(caches)}")
        for got in caches:
            if got != want:
                shown = "?" if got is None else f"[{', '.join(map(str, got[0]))}] {got[1]}"
                return (f"its max_batch, max_seq {max_seq}, kv heads, head_dim and kv_dtype give caches "
                        f"[{', '.join(map(str, want[0]))}] {kv}; the module's are {shown}")
        return None

    def _fn(self):
        if self._step is None:
            # one compiled function serves prefill and decode (T = 1 for decode)
            step = self.exe.function(STEP)
            declared = declared_types(dict(step.vm_function.reflection).get(
                "iree.abi.declaration", ""))
            # a module compiled before `start` was a scalar takes a 0-d tensor
            self._scalar = not declared or self.ABI.scalar_inputs(declared[0]) is not False
            self._step = step
        return self._step

    def _start_arg(self, position: int):
        """The step's `start` argument (StepABI: an int, or a 0-d array for older modules)."""
        return int(position) if self._scalar else np.array(position, np.int32)

    @contextlib.contextmanager
    def _exclusive(self, what: str):
        """Hold the generator for one call: other threads wait; the same thread calling
        again from inside (a callback) is refused before it touches the cache."""
        me = threading.get_ident()
        if self._owner == me:
            raise ExecutionError(f"{what} called from inside {self._running} on the same generator "
                                 f"(an on_token callback?): it would overwrite the KV cache of the "
                                 f"running generation",
                                 hint=f"call {what} after {self._running} returns, or use another "
                                      f"generator (tc.load the artifact again)")
        with self._lock:
            self._owner, self._running = me, what
            try:
                yield
            finally:
                self._owner = self._running = None

    def _run(self, fn, args) -> np.ndarray:
        self.calls += 1
        try:
            out = fn(*args)
        except Exception as e:
            raise ExecutionError(f"the IREE runtime failed running the LM on {self.exe.device}: {e}") from None
        if self.exe.meta.get("numerics"):        # compiled with check_numerics
            out, checks = out
            report_numerics(_to_host(checks), self.exe.meta["numerics"])
        # a copy: to_host() can be a view of a buffer that a later call reuses
        return _to_host(out, self.exe.device in ("local-task", "local-sync"))

    # -- the two entry points ----------------------------------------------------------
    def prefill(self, ids, logits_to_keep: int | None = None) -> np.ndarray:
        """Run the prompt `ids` (int32 [T], 1 <= T <= max_seq) from position 0 in one
        call: returns the logits [T, vocab] (teacher-forced) and fills cache rows 0..T-1.
        Starts over whatever was generated before. `logits_to_keep=n` computes the logits
        of the last n positions only ([n, vocab]; 1 is what generation needs, and skips
        most of the output layer's work)."""
        with self._exclusive("prefill"):
            return self._prefill(ids, logits_to_keep)

    def _prefill(self, ids, logits_to_keep):
        arr, rows = self._prompt(ids, logits_to_keep)
        logits = self._run(self._fn(), (arr, self._start_arg(0), rows))
        self.position = arr.size
        return logits

    def _prompt(self, ids, logits_to_keep, what: str = "prefill") -> tuple:
        """(ids as int32 [T], the rows whose logits prefill returns), checked: 1 <= T <=
        max_seq, logits_to_keep None (all) or an int from 1 to T."""
        arr = _ids(ids, self.vocab_size, what)
        if not 1 <= arr.size <= self.max_seq:
            raise InputError(f"{what}: {arr.size} tokens; the cache holds 1 to {self.max_seq}",
                             hint="compile with a larger max_seq, or shorten the prompt")
        keep = arr.size if logits_to_keep is None else logits_to_keep
        if isinstance(keep, (bool, np.bool_)) or not isinstance(keep, numbers.Integral) \
                or not 1 <= keep <= arr.size:
            raise InputError(f"{what}: logits_to_keep must be an int from 1 to the prompt "
                             f"length {arr.size}, got {logits_to_keep!r}")
        return arr, np.arange(arr.size - keep, arr.size, dtype=np.int32)

    def score(self, ids) -> np.ndarray:
        """The log-probability of each token of `ids` (int [T], 2 <= T <= max_seq) given
        the ones before it: float64 [T - 1], entry t - 1 the log_softmax of prefill's
        logits at position t - 1, at token ids[t]. Runs a prefill (the cache then holds
        `ids`). Its negative mean is the sequence's cross-entropy; exp of that is its
        perplexity (`tercomp perplexity` does llama-perplexity's chunking).

        >>> lp = gen.score([1, 2, 3, 4])          # log p(2|1), log p(3|1 2), log p(4|1 2 3)
        """
        arr = _ids(ids, self.vocab_size, "score")
        if arr.size < 2:
            raise InputError(f"score: needs at least 2 tokens (the first is only context), "
                             f"got {arr.size}")
        return token_log_probs(self.prefill(arr)[:-1], arr[1:])

    def extend(self, ids, start: int | None = None, logits_to_keep: int | None = None) -> np.ndarray:
        """Run `ids` (int32 [T]) at positions `start`.. in one call (default: the current
        position; at most it, and a start before it drops the rows from there: the
        sequence then is its first `start` tokens and `ids`); returns the logits of the
        last `logits_to_keep` (default all) of them, like prefill. `extend(ids, 0)` is
        `prefill(ids)`; speculative decoding scores a draft with it and a server reusing
        a cached prompt prefix runs only the rest of the prompt.

        >>> gen.prefill([1, 2, 3]); gen.extend([4, 5]).shape      # rows 3, 4
        (2, vocab)
        """
        with self._exclusive("extend"):
            arr, rows = self._prompt(ids, logits_to_keep, "extend")
            return self._extend(arr, self._start(start, arr.size), rows)

    def _start(self, start, size: int) -> int:
        """`start` (None: the position) checked: from 0 to the position, room for `size`."""
        if start is None:
            start = self.position
        if isinstance(start, (bool, np.bool_)) or not isinstance(start, numbers.Integral) \
                or not 0 <= start <= self.position:
            raise InputError(f"extend: start must be an int from 0 to the position "
                             f"{self.position} (the rows filled), got {start!r}")
        if start + size > self.max_seq:
            raise InputError(f"extend: {size} tokens from position {start} run past the cache "
                             f"of {self.max_seq} positions",
                             hint="compile with a larger max_seq, or reset()")
        return int(start)

    def _extend(self, arr, start: int, rows) -> np.ndarray:
        logits = self._run(self._fn(), (arr, self._start_arg(start), rows))
        self.position = start + arr.size
        return logits

    def decode(self, token) -> np.ndarray:
        """Append one token at the current position; returns the next-token logits [vocab]."""
        with self._exclusive("decode"):
            return self._decode(token)

    def _decode(self, token) -> np.ndarray:
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (numbers.Integral, np.ndarray)):
            raise InputError(f"decode: the token must be an int, got {type(token).__name__}")
        arr = _ids(token, self.vocab_size, "decode")
        if arr.size != 1:
            raise InputError(f"decode: takes one token, got {arr.size}")
        if self.position == 0:
            raise InputError("decode before prefill: the cache is empty",
                             hint="call gen.prefill(prompt_ids) first")
        if self.position >= self.max_seq:
            raise InputError(f"decode: the cache is full ({self.max_seq} positions)",
                             hint="compile with a larger max_seq, or reset()")
        logits = self._run(self._fn(), (arr, self._start_arg(self.position), _FIRST_ROW))
        self.position += 1
        return logits[0]

    def reset(self) -> None:
        """Forget the sequence (the next call must be prefill)."""
        with self._exclusive("reset"):
            self.position = 0

    # -- generation --------------------------------------------------------------------
    def generate(self, prompt_ids, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k=None, top_p=None, seed: int = 0, eos=None, on_token=None,
                 speculative: str | None = None, num_draft: int = 8) -> np.ndarray:
        """Prefill `prompt_ids`, then sample up to `max_new_tokens` tokens; returns the new
        tokens (int32). temperature 0 is greedy (argmax); otherwise the logits / temperature
        are restricted to the `top_k` most likely and the smallest set with probability
        >= `top_p`, and drawn with a NumPy generator seeded by `seed` (the same seed
        gives the same tokens). Stops after a token in `eos` (an int or a set of ints;
        it is included in the result). `on_token(token)` is called for each new token; it
        must not call this generator (that is a TercompError inside the callback, and the
        generation goes on). `stats` then holds prefill/decode token counts and seconds.
        A temperature too small for `logits / temperature` to be finite samples among the
        largest logits (the limit of the distribution as the temperature goes to 0).

        `speculative="prompt_lookup"` (greedy only) drafts up to `num_draft` tokens per
        step from the context (runtime.speculative) and verifies them in one call: the
        same tokens as plain greedy decoding, fewer calls on text that repeats its
        context; `stats` then also counts `drafted` and `accepted` tokens and `steps`.

        >>> gen.generate(code_ids, max_new_tokens=128, speculative="prompt_lookup", num_draft=8)
        """
        with self._exclusive("generate"):
            # every argument is checked before the cache is touched: a rejected call
            # leaves the generator as it was
            if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
                    or max_new_tokens < 0:
                raise InputError(f"generate: max_new_tokens must be a non-negative int, "
                                 f"got {max_new_tokens!r}")
            check_sampling(temperature, top_k, top_p, seed)
            eos_set = _eos_set(eos, self.vocab_size)
            if on_token is not None and not callable(on_token):
                raise InputError(f"generate: on_token must be a function of one token id (or "
                                 f"None), got {type(on_token).__name__}")
            if speculative is not None:
                _check_speculative(speculative, num_draft, temperature)
            prompt = _ids(prompt_ids, self.vocab_size, "generate")
            need = prompt.size + max(int(max_new_tokens) - 1, 0)
            if need > self.max_seq:
                raise InputError(f"generate: {prompt.size} prompt tokens + {max_new_tokens} new ones "
                                 f"need {need} cache positions; the cache holds {self.max_seq}",
                                 hint="compile with a larger max_seq or ask for fewer tokens")
            rng = np.random.default_rng(seed)
            t0 = time.perf_counter()
            logits = self._prefill(prompt, 1)[-1]
            t1 = time.perf_counter()
            out, extra = [], {}
            if speculative is not None:
                extra = self._lookup_decode(prompt, logits, int(max_new_tokens), eos_set,
                                            on_token, int(num_draft), out)
            for i in range(int(max_new_tokens) if speculative is None else 0):
                tok = sample(logits, temperature, top_k, top_p, rng)
                out.append(tok)
                if on_token is not None:
                    on_token(tok)
                if tok in eos_set or i == max_new_tokens - 1:
                    break
                logits = self._decode(tok)
            t2 = time.perf_counter()
            self.stats = {"prefill_tokens": int(prompt.size), "prefill_s": t1 - t0,
                          "decode_tokens": max(len(out) - 1, 0), "decode_s": t2 - t1, **extra}
            return np.array(out, np.int32)

    def _lookup_decode(self, prompt, logits, max_new: int, eos: set, on_token, num_draft: int,
                       out: list) -> dict:
        """Greedy decoding with prompt-lookup drafts (sized by a DraftSchedule), appending
        to `out`: each call runs the last token and a draft, keeps the draft's confirmed
        prefix and the model's next token, and moves the position back over the rejected
        rows (attention reads rows up to a token's own position only, so the stale rows
        past it are never seen and the next call overwrites them)."""
        context = np.empty(prompt.size + max_new, np.int32)
        context[:prompt.size] = prompt
        size, pending = prompt.size, [int(np.argmax(logits))]
        drafted = confirmed = steps = 0
        schedule = DraftSchedule(num_draft)
        while True:
            for tok in pending:
                out.append(tok)
                context[size] = tok
                size += 1
                if on_token is not None:
                    on_token(tok)
                if tok in eos or len(out) == max_new:
                    return {"drafted": drafted, "accepted": confirmed, "steps": steps}
            # the draft: no more tokens than are still wanted, nor past the cache's end
            room = min(schedule.size(), max_new - len(out) - 1, self.max_seq - size)
            draft = prompt_lookup(context[:size], room) if room > 0 else context[:0]
            ids = np.concatenate([context[size - 1:size], draft])
            scores = self._extend(ids, size - 1, np.arange(ids.size, dtype=np.int32))
            a = accepted(draft, scores)
            schedule.update(draft.size, a)
            self.position = size + a        # the last token and the confirmed drafts
            pending = draft[:a].tolist() + [int(np.argmax(scores[a]))]
            drafted, confirmed, steps = drafted + draft.size, confirmed + a, steps + 1

    # -- text (with a tokenizer) -------------------------------------------------------
    def encode(self, text: str) -> np.ndarray:
        if self.tokenizer is None:
            raise UnsupportedError("this model has no tokenizer", hint="pass token ids instead of text")
        return np.array(self.tokenizer.encode(text).ids, np.int32)

    def decode_text(self, ids) -> str:
        if self.tokenizer is None:
            raise UnsupportedError("this model has no tokenizer")
        return self.tokenizer.decode([int(i) for i in ids])

    def save(self, path: str) -> None:
        """One artifact file (tercomp.runtime.artifact) with both entry points, the
        weights and the model config; `tc.load(path)` gives an LMGenerator again."""
        self.exe.save(path)

    def __repr__(self):
        c = self.config
        return (f"LMGenerator(layers={c.get('num_hidden_layers')}, hidden={c.get('hidden_size')}, "
                f"vocab={self.vocab_size}, max_seq={self.max_seq}, kv={self.kv_dtype}, "
                f"position={self.position}, device={self.exe.device!r})")


def _check_speculative(method, num_draft, temperature) -> None:
    if method not in METHODS:
        raise InputError(f"generate: speculative must be None or one of {', '.join(METHODS)}, "
                         f"got {method!r}")
    if isinstance(num_draft, (bool, np.bool_)) or not isinstance(num_draft, numbers.Integral) \
            or not 1 <= num_draft <= 64:
        raise InputError(f"generate: num_draft must be an int from 1 to 64, got {num_draft!r}")
    if temperature != 0:
        raise InputError(f"generate: speculative decoding verifies drafts against greedy "
                         f"decoding; temperature {temperature} samples",
                         hint="pass temperature=0, or speculative=None to sample")


def _eos_set(eos, vocab: int) -> set:
    """`eos` (None, an int, or an iterable of ints) as a set of token ids in range."""
    if eos is None:
        return set()
    bad = InputError(f"generate: eos must be a token id or a set of token ids, got {eos!r}",
                     hint="pass eos=2 or eos={2, 3}")
    if isinstance(eos, (str, bytes, bytearray, bool, np.bool_)):
        raise bad
    items = [eos] if isinstance(eos, numbers.Integral) else eos
    try:
        items = list(items)
    except TypeError:
        raise bad from None
    for e in items:
        if isinstance(e, (bool, np.bool_)) or not isinstance(e, numbers.Integral):
            raise InputError(f"generate: eos must be a token id or a set of token ids; "
                             f"{e!r} ({type(e).__name__}) is not an int", hint="pass eos=2 or eos={2, 3}")
        if not 0 <= e < vocab:
            raise InputError(f"generate: eos id {e} is out of range for a vocabulary of {vocab}",
                             hint=f"ids must be in [0, {vocab - 1}]")
    return {int(e) for e in items}


def _load_tokenizer(text):
    if not text:
        return None
    try:
        import tokenizers
        return tokenizers.Tokenizer.from_str(text)
    except Exception:          # tokenizers missing or a newer format: ids still work
        return None
