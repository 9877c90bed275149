"""Engine: continuous batching of generation requests over one compiled LM.

One thread (the engine's) owns the generator and its device state; any number of
threads submit requests and read their tokens. Each engine step is ONE call of the
batched step function (runtime.batched) holding:

- the next token of every running sequence (decode), and
- a chunk of the prompt of sequences still being prefilled, up to `chunk` prompt
  tokens per step over all of them (chunked prefill: a long prompt does not stall
  the running streams for its whole length, as vLLM's and llama-server's schedulers do),
  and, while any sequence decodes, no more than `step_tokens` tokens in all (vLLM's
  max_num_batched_tokens: a step's time grows with its tokens, so a new prompt's
  chunk would stall every running stream's next token; it waits for later steps).

Prefix caching (on by default, as llama-server's `cache_prompt`): a slot keeps the
tokens whose KV rows it holds after its request ends, and a new request takes the free
slot whose tokens share the longest prefix with its prompt and prefills only the rest
(a chat's next turn: only the new messages). Running sequences share theirs too (a
module with copy_rows, BatchedLMGenerator.copy_prefix): before each step, a request
still prefilling copies, on the device, the rows of its prompt's prefix that a running
sequence's slot (or a free one) holds and its own does not, and waits while an earlier
request is still computing more of that prefix (clients sending one system prompt at
once: the first prefills it, the others copy it and prefill only their own part; all
the step's copies are one call). A prefix shorter than MIN_SHARED tokens is computed
rather than waited for. The rows past the shared prefix need no clearing: attention
reads a slot's rows up to each token's own position, and the new prompt's chunks
overwrite them in order. A request asking for `prompt_logprobs` needs the logits of
every prompt token and reuses nothing.

Speculative decoding (`num_draft=k`, off by default) for a request served alone: while
it is the only one running and nothing waits, a greedy request without penalties,
constraint or logprobs drafts up to k tokens by prompt lookup (runtime.speculative)
and the step verifies them (its tokens are still greedy decoding's); with other
requests in the batch the step is the usual one, whose rows are already shared.

Requests join between steps (when a slot is free: one slot per sequence) and leave
when they finish (max_tokens, a stop token, the cache full) or are cancelled (a client
that went away: its slot is freed at the next step; a waiting request leaves the queue
at once). A free slot goes to the waiting request whose `group` (the API request it
belongs to: its prompts and choices) has the fewest running sequences, the oldest on
ties, so one request of 64 prompts does not hold every slot while another waits.
Sampling is the generator's
(runtime.sampling with a NumPy generator seeded per request), so a request's tokens
are the ones `gen.generate` gives for the same arguments.

    >>> engine = Engine(tc.compile_lm(lm, max_seq=512, max_batch=8))
    >>> req = engine.submit([1, 2, 3], max_tokens=16)
    >>> for token in req: ...               # as they are generated
    >>> engine.generate([1, 2, 3], max_tokens=16)     # submit and wait: np.int32 array
    >>> r = engine.submit([1, 2, 3, 4], max_tokens=4); r.result()
    >>> r.cached_tokens                 # 3: the rows of [1, 2, 3] came from the cache
    >>> engine.close()
"""
from __future__ import annotations

import collections
import itertools
import numbers
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import TercompError, ConfigError, InputError
from .batched import BatchedLMGenerator
from .generator import LMGenerator, _eos_set, _ids
from .sampling import (LOGPROBS_MODES, MAX_LOGPROBS, Penalties, check_penalties, check_sampling,
                       processed_logprobs, sample, scored_token)
from .speculative import DraftSchedule, accepted, prompt_lookup

_DONE = object()

#: a server's step budget a slot (`tercomp serve`'s default --step-tokens, Ray Serve's
#: replicas): 8 slots step at most 16 tokens while streams decode, which kept p99
#: inter-token latency at or under llama-server's at 1-16 clients (bench/RESULTS.md)
STEP_TOKENS_PER_SLOT = 2

#: the fewest prompt tokens a request copies from another slot, or waits
#: for while an earlier request computes them (fewer cost less to prefill in the step)
MIN_SHARED = 16


class QueueFull(TercompError):
    """The engine's queue of waiting requests is full (a server answers 429)."""


class EngineClosed(TercompError):
    """The engine was closed, or its thread stopped on an error."""


@dataclass
class Request:
    """A submitted generation. Iterate it for its tokens as they come (blocks), or call
    `result()` for all of them. `finish_reason`: "length" (max_tokens or the cache
    full), "stop" (a stop token, included in the tokens), "cancelled", or "error"
    (then `error` holds the exception). Times are time.perf_counter() values.

    With `logprobs=n`, `token_logprobs[i]` is (log-probability of tokens[i], its `n`
    most likely alternatives as [(id, log-probability)]), set before the token is
    yielded; with `prompt_logprobs=n`, `prompt_scores[i]` is the same for prompt[i]
    (None for prompt[0], which nothing predicts), complete once the prompt is
    prefilled. Log-probabilities are `log_softmax` of the model's logits, before any
    sampling transform (vLLM's raw logprobs). `cached_tokens`: the prompt tokens whose
    KV rows came from the prefix cache (set when the request gets its slot, and grown
    by rows copied from a running sequence while it prefills)."""
    id: int
    prompt: np.ndarray
    max_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop: set = field(default_factory=set)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    penalties: Penalties | None = None
    constraint: object = None
    tokens: list = field(default_factory=list)
    token_logprobs: list = field(default_factory=list)
    prompt_scores: list = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: BaseException | None = None
    submitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    token_times: list = field(default_factory=list)
    # engine state
    _queue: queue.Queue = field(default_factory=queue.Queue, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _cancel: bool = False
    _slot: int | None = None
    _prefilled: int = 0
    _rng: np.random.Generator | None = None
    _withdraw: object = field(default=None, repr=False)
    _drafts: DraftSchedule | None = field(default=None, repr=False)
    group: object = None

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is _DONE:
                if self.error is not None:
                    raise self.error
                return
            yield item

    def result(self, timeout: float | None = None) -> np.ndarray:
        """All tokens (np.int32), once the request has finished."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish in {timeout} s")
        if self.error is not None:
            raise self.error
        return np.array(self.tokens, np.int32)

    def cancel(self) -> None:
        """Stop generating: a waiting request leaves the queue now, a running one frees
        its slot at the engine's next step."""
        self._cancel = True
        if self._withdraw is not None:
            self._withdraw(self)

    @property
    def done(self) -> bool:
        return self._done.is_set()


class _OneSlot:
    """A single-sequence LMGenerator seen as a batched one of one slot (the engine then
    runs one request at a time)."""

    def __init__(self, gen: LMGenerator):
        self.gen, self.max_batch = gen, 1
        self.max_seq, self.vocab_size = gen.max_seq, gen.vocab_size

    def forward(self, ids, slots, positions, rows):
        # a prompt (from 0, or from the end of a cached prefix) or a decode token
        return self.gen.extend(ids, int(positions[0]), logits_to_keep=ids.size - int(rows[0]))

    def free(self, slot):
        self.gen.reset()

    def rollback(self, slot, rows):
        self.gen.position = rows

    @property
    def filled(self):
        return [self.gen.position]

    @property
    def calls(self):
        return self.gen.calls


class Engine:
    """Continuous batching over `gen` (a BatchedLMGenerator; an LMGenerator runs one
    request at a time). `max_queue`: waiting requests beyond which submit raises
    QueueFull; `chunk`: prompt tokens prefilled per step; `step_tokens`: while any
    sequence decodes, the tokens of a step in all, its decode tokens included (prompt
    chunks get what is left, at least one token; None: `chunk` on top of the decode
    tokens); `start=False` queues requests until `start()` (a server warming up);
    `prefix_cache=False` forgets each slot's tokens when its request ends (every prompt
    is prefilled in full); `num_draft=k` > 0 verifies up to k prompt-lookup drafts per
    step for a greedy request running alone; `logprobs_mode` (vLLM's) "raw_logprobs":
    a generated token's log-probabilities are log_softmax of the model's logits,
    "processed_logprobs": of the distribution it was sampled from (after the logit
    bias, penalties, grammar mask and, unless greedy, temperature, min_p, top_k and
    top_p; runtime.sampling.processed_logprobs). A prompt's are always the model's."""

    def __init__(self, gen, max_queue: int = 256, chunk: int = 128, start: bool = True,
                 prefix_cache: bool = True, num_draft: int = 0, step_tokens: int | None = None,
                 logprobs_mode: str = "raw_logprobs"):
        if isinstance(gen, BatchedLMGenerator):
            self.gen = gen
        elif isinstance(gen, LMGenerator):
            self.gen, chunk = _OneSlot(gen), gen.max_seq    # its prefill is one call
        else:
            raise ConfigError(f"Engine needs a compiled LM (tc.compile_lm), got {type(gen).__name__}")
        for what, v in (("max_queue", max_queue), ("chunk", chunk),
                        ("step_tokens", 1 if step_tokens is None else step_tokens)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ConfigError(f"Engine: {what} must be a positive int, got {v!r}")
        if isinstance(num_draft, bool) or not isinstance(num_draft, numbers.Integral) \
                or not 0 <= num_draft <= 64:
            raise ConfigError(f"Engine: num_draft must be an int from 0 (off) to 64, "
                              f"got {num_draft!r}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"Engine: logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, "
                              f"got {logprobs_mode!r}")
        self.num_draft, self.logprobs_mode = int(num_draft), logprobs_mode
        self.model = gen
        self.max_queue, self.chunk = int(max_queue), int(chunk)
        self.step_tokens = None if step_tokens is None else int(step_tokens)
        self.max_batch, self.max_seq, self.vocab_size = self.gen.max_batch, gen.max_seq, gen.vocab_size
        self._waiting: collections.deque = collections.deque()
        self._running: list[Request] = []
        self._free = list(range(self.max_batch))     # the least recently freed first
        self.prefix_cache = bool(prefix_cache)
        # the tokens whose KV rows each free slot holds (the prefix cache)
        self._cached = [np.zeros(0, np.int32) for _ in range(self.max_batch)]
        # running sequences share their rows (a module with copy_rows)
        self._copies = bool(getattr(self.gen, "can_copy", False))
        self._calls = self.gen.calls        # the generator's step calls after our last one
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._closed = False
        self._draining: str | None = None
        self._close_error: EngineClosed | None = None
        self._failed: BaseException | None = None
        self.counters = {"requests_total": 0, "requests_finished": 0, "requests_rejected": 0,
                         "prompt_tokens_total": 0, "prompt_tokens_cached_total": 0,
                         "prompt_tokens_copied_total": 0,
                         "generated_tokens_total": 0, "steps_total": 0,
                         "draft_tokens_total": 0, "draft_tokens_accepted_total": 0,
                         "step_seconds_total": 0.0, "ttft_seconds_total": 0.0}
        self._thread = threading.Thread(target=self._loop, name="tercomp-engine", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        """Start the engine's thread (once)."""
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()

    # -- the callers' side ---------------------------------------------------------------
    def submit(self, prompt_ids, max_tokens: int = 16, temperature: float = 0.0, top_k=None,
               top_p=None, seed: int = 0, stop=None, logprobs=None, prompt_logprobs=None,
               min_p: float = 0.0, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
               logit_bias=None, group=None, constraint=None) -> Request:
        """Queue a request (every argument checked here, in the caller's thread).
        `max_tokens=0` prefills the prompt only (for its `prompt_logprobs`); the
        penalties and `logit_bias` ({id: value}) are runtime.sampling.Penalties'.
        Requests of one `group` (any hashable; default: the request alone) share the
        slots fairly with other groups. A `constraint` (structured output: an object
        with `mask(logits)` -> the logits with forbidden tokens at -inf or None if none
        is allowed, `accept(token)`, `done` and `error`, as serve.structured.Constraint)
        is applied after the penalties; the request ends when it is `done`."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) \
                or max_tokens < 0:
            raise InputError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        check_sampling(temperature, top_k, top_p, seed)
        check_penalties(self.vocab_size, min_p, presence_penalty, frequency_penalty,
                        repetition_penalty, logit_bias)
        for what, n in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral)
                                  or not 0 <= n <= MAX_LOGPROBS):
                raise InputError(f"{what} must be None or an int from 0 to {MAX_LOGPROBS}, "
                                 f"got {n!r}")
        stop = _eos_set(stop, self.vocab_size)
        prompt = _ids(prompt_ids, self.vocab_size, "prompt")
        if prompt.size == 0:
            raise InputError("the prompt is empty", hint="pass at least one token")
        if prompt.size >= self.max_seq:
            raise InputError(f"the prompt has {prompt.size} tokens; this model's context holds "
                             f"{self.max_seq} (prompt and generated tokens)",
                             hint="shorten the prompt, or compile with a larger max_seq")
        req = Request(next(self._ids), prompt, int(max_tokens), float(temperature), top_k, top_p,
                      int(seed), stop, logprobs, prompt_logprobs, float(min_p),
                      submitted=time.perf_counter())
        pen = Penalties(self.vocab_size, prompt, float(presence_penalty),
                        float(frequency_penalty), float(repetition_penalty), logit_bias)
        req.penalties = pen if pen.active else None
        req.group = req.id if group is None else group
        req.constraint = constraint
        req._withdraw = self._withdraw
        with self._cv:
            if self._closed or self._failed is not None or self._draining:
                raise EngineClosed(f"the engine stopped: {self._failed}" if self._failed else
                                   self._draining or "the engine is closed")
            if len(self._waiting) >= self.max_queue:
                self.counters["requests_rejected"] += 1
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)",
                                hint="retry later")
            self._waiting.append(req)
            self.counters["requests_total"] += 1
            self._cv.notify()
        return req

    def generate(self, prompt_ids, max_tokens: int = 16, **kw) -> np.ndarray:
        """submit and wait: the new tokens (np.int32)."""
        return self.submit(prompt_ids, max_tokens, **kw).result()

    def stats(self) -> dict:
        """Counters and the current queue: waiting, running, free slots, and
        `prefix_cache_tokens` (the tokens free slots hold for reuse). Of
        `prompt_tokens_total`, `prompt_tokens_cached_total` came from the prefix cache,
        `prompt_tokens_copied_total` of those from a running sequence's slot."""
        with self._cv:
            return {**self.counters, "waiting": len(self._waiting), "running": len(self._running),
                    "slots": self.max_batch, "free_slots": len(self._free),
                    "prefix_cache_tokens": sum(self._cached[s].size for s in self._free)}

    @property
    def alive(self) -> bool:
        """True until the engine drains, is closed or its thread stops on an error."""
        return self._thread.is_alive() and not self._closed and self._failed is None \
            and not self._draining

    def drain(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests (EngineClosed with `reason`); running and waiting ones go on."""
        with self._cv:
            self._draining = reason

    def close(self, timeout: float = 10.0, reason: str | None = None) -> None:
        """Stop the engine: running and waiting requests finish as "cancelled", or with
        `reason` as "error" with an EngineClosed(reason) (a server shutting down)."""
        with self._cv:
            self._closed = True
            if reason is not None:
                self._close_error = EngineClosed(reason)
            self._cv.notify()
        if self._thread.ident is None:          # never started: finish what waits
            self._thread.start()
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the engine's thread -----------------------------------------------------------------
    def _loop(self):
        try:
            while True:
                with self._cv:
                    while not self._closed and not self._waiting and not self._running:
                        self._cv.wait()
                    if self._closed:
                        break
                    self._admit()
                self._drop_cancelled()
                if self._running and not self._speculate():
                    self._step()
        except BaseException as e:            # a device failure: every request learns it
            self._failed = e if isinstance(e, TercompError) else \
                EngineClosed(f"the engine stopped on {type(e).__name__}: {e}")
        error = self._failed or self._close_error
        for r in list(self._running) + list(self._waiting):
            self._finish(r, "error" if error else "cancelled", error)
        self._running.clear()
        self._waiting.clear()

    def _withdraw(self, r: Request) -> None:
        """A cancelled request leaves the queue now (its client is gone)."""
        with self._cv:
            try:
                self._waiting.remove(r)
            except ValueError:
                return                      # running (freed at the next step) or done
        self._finish(r, "cancelled")

    def _admit(self):
        while self._waiting and self._free:
            running = collections.Counter(q.group for q in self._running)
            r = min(self._waiting, key=lambda q: running[q.group])   # the oldest on ties
            self._waiting.remove(r)
            if r._cancel:
                self._finish(r, "cancelled")
                continue
            r._slot, r._prefilled = self._take_slot(r)
            r.cached_tokens = r._prefilled
            self.counters["prompt_tokens_total"] += r._prefilled
            self.counters["prompt_tokens_cached_total"] += r._prefilled
            r._rng = np.random.default_rng(r.seed)
            r.prompt_scores = [None] if r.prompt_logprobs is not None else []
            self._running.append(r)

    def _take_slot(self, r: Request) -> tuple:
        """(a free slot for `r`, how many of its prompt tokens that slot's rows hold): the
        slot sharing the longest prefix with the prompt, the least recently freed on ties.
        The last prompt token always runs (its logits give the first new token)."""
        best, reuse = self._free[0], 0
        if self.gen.calls != self._calls:    # someone else ran the generator: rows unknown
            self._cached = [c[:0] for c in self._cached]
        if self.prefix_cache and r.prompt_logprobs is None:
            for s in self._free:
                n = _common_prefix(self._cached[s], r.prompt[:-1])
                if n > reuse:
                    best, reuse = s, n
        self._free.remove(best)
        self._cached[best] = self._cached[best][:0]
        return best, reuse

    def _held(self, q: Request) -> np.ndarray:
        """The tokens of running request `q` whose KV rows its slot holds: the prompt
        prefilled so far, or the prompt and every generated token but the last (a slot
        just taken may hold stale rows past the prefix it reuses: not counted)."""
        n = min(int(self.gen.filled[q._slot]), q._prefilled + max(len(q.tokens) - 1, 0))
        if n <= q.prompt.size:
            return q.prompt[:n]
        return np.concatenate([q.prompt, np.array(q.tokens[:n - q.prompt.size], np.int32)])

    def _share(self) -> set:
        """Copy into each request still prefilling the rows of its prompt's prefix that
        another slot holds beyond its own: a running sequence's, or a free slot's (a
        sequence that finished after this request took its slot). One copy_rows call
        for all, each source's rows as they were before it. Returns the ids of the
        requests that wait this step for an earlier one to compute more of their
        prefix (the first of any chain of them always runs)."""
        if not self.prefix_cache or not self._copies:
            return set()
        todo = [r for r in self._running
                if r._prefilled < r.prompt.size and r.prompt_logprobs is None]
        if not todo:
            return set()
        if self.gen.calls != self._calls:    # someone else ran the generator: rows unknown
            self._cached = [c[:0] for c in self._cached]
        held = {q.id: self._held(q) for q in self._running}
        sources = [(q._slot, held[q.id]) for q in self._running] + \
            [(s, self._cached[s]) for s in self._free]
        moves, wait = [], set()
        for r in todo:
            want, have = r.prompt[:-1], r._prefilled
            src, rows = None, have
            for slot, tokens in sources:
                n = _common_prefix(tokens, want) if slot != r._slot else 0
                if n > rows:
                    src, rows = slot, n
            if src is not None and rows - have >= MIN_SHARED and r._slot not in \
                    {m[0] for m in moves} and src not in {m[1] for m in moves}:
                moves.append((src, r._slot, rows, have))
                have = rows
            for q in self._running:     # an earlier request computing more of r's prefix
                if q is r:
                    break
                common = _common_prefix(q.prompt, want)
                if q._prefilled < q.prompt.size and q.id not in wait \
                        and common > held[q.id].size and common >= have + MIN_SHARED:
                    wait.add(r.id)
                    break
        if moves:
            self.gen.copy_prefixes(moves)
            self._calls = self.gen.calls
            by_slot = {r._slot: r for r in todo}
            for _, dst, rows, have in moves:
                r = by_slot[dst]
                r._prefilled = rows
                r.cached_tokens += rows - have
                for key in ("prompt_tokens_total", "prompt_tokens_cached_total",
                            "prompt_tokens_copied_total"):
                    self.counters[key] += rows - have
        return wait

    def _drop_cancelled(self):
        for r in [r for r in self._running if r._cancel]:
            self._finish(r, "cancelled")

    def _speculate(self) -> bool:
        """The step of a greedy request running alone with a prompt-lookup draft (False:
        no draft, or not alone: the usual step runs). The slot's rows past the last token
        and the confirmed drafts are dropped (attention never reads past a token's
        position; the next step overwrites them)."""
        if not self.num_draft or len(self._running) != 1 or self._waiting:
            return False
        r = self._running[0]
        if r._prefilled < r.prompt.size or not r.tokens or r.temperature != 0 \
                or r.penalties is not None or r.constraint is not None or r.logprobs is not None:
            return False
        size = r.prompt.size + len(r.tokens)             # the rows hold size - 1 of them
        if r._drafts is None:
            r._drafts = DraftSchedule(self.num_draft)
        room = min(r._drafts.size(), r.max_tokens - len(r.tokens) - 1, self.max_seq - size)
        if room < 1:
            return False
        context = np.concatenate([r.prompt, np.array(r.tokens, np.int32)])
        draft = prompt_lookup(context, room)
        if draft.size == 0:
            return False
        ids = np.concatenate([context[-1:], draft])
        t0 = time.perf_counter()
        logits = self.gen.forward(ids, np.full(ids.size, r._slot, np.int32),
                                  np.arange(size - 1, size + draft.size, dtype=np.int32),
                                  np.arange(ids.size, dtype=np.int32))
        now = time.perf_counter()
        self._calls = self.gen.calls
        a = accepted(draft, logits)
        r._drafts.update(draft.size, a)
        self.gen.rollback(r._slot, size + a)
        self.counters["steps_total"] += 1
        self.counters["step_seconds_total"] += now - t0
        self.counters["draft_tokens_total"] += int(draft.size)
        self.counters["draft_tokens_accepted_total"] += a
        for tok in draft[:a].tolist() + [int(np.argmax(logits[a]))]:
            self._emit(r, tok, now)
            if r._done.is_set():
                break
        return True

    def _step(self):
        """One call: every decoding sequence's next token, then prompt chunks. `uses`
        pairs each row of logits with (request, the position it was computed at)."""
        ids, slots, positions, rows, uses = [], [], [], [], []
        for r in self._running:
            if r._prefilled == r.prompt.size:            # decoding
                rows.append(len(ids))
                uses.append((r, r.prompt.size + len(r.tokens) - 1))
                ids.append(r.tokens[-1])
                slots.append(r._slot)
                positions.append(r.prompt.size + len(r.tokens) - 1)
        budget = self.chunk
        if rows and self.step_tokens is not None:         # sequences decode: they come first
            budget = min(budget, max(self.step_tokens - len(rows), 1))
        wait = self._share()
        for r in self._running:
            if r._prefilled < r.prompt.size and budget > 0 and r.id not in wait:
                n = min(budget, r.prompt.size - r._prefilled)
                first = r._prefilled
                ids.extend(r.prompt[first:first + n].tolist())
                slots.extend([r._slot] * n)
                positions.extend(range(first, first + n))
                r._prefilled += n
                budget -= n
                self.counters["prompt_tokens_total"] += n
                # the logits that score the prompt's next tokens, and those of its last token
                scored = range(first, first + n) if r.prompt_logprobs is not None else ()
                wanted = [p for p in scored if p < r.prompt.size - 1]
                if r._prefilled == r.prompt.size:
                    wanted.append(r.prompt.size - 1)
                for p in wanted:
                    rows.append(len(ids) - n + (p - first))
                    uses.append((r, p))
        if not rows:                                     # prompt chunks only
            rows.append(len(ids) - 1)
            uses.append((None, None))
        t0 = time.perf_counter()
        logits = self.gen.forward(np.array(ids, np.int32), np.array(slots, np.int32),
                                  np.array(positions, np.int32), np.array(rows, np.int32))
        now = time.perf_counter()
        self._calls = self.gen.calls
        self.counters["steps_total"] += 1
        self.counters["step_seconds_total"] += now - t0
        for (r, p), lg in zip(uses, logits):
            if r is None or r._done.is_set():
                continue
            if p < r.prompt.size - 1:                    # scores prompt[p + 1]
                r.prompt_scores.append(scored_token(lg, int(r.prompt[p + 1]), r.prompt_logprobs))
            elif r.max_tokens == 0:                      # prefill only
                self._finish(r, "length")
            else:
                pen, con = r.penalties, r.constraint
                z = lg if pen is None else pen.apply(lg)
                if con is not None:
                    z = con.mask(z)
                    if z is None:
                        self._finish(r, "error", InputError(f"structured output: {con.error}"))
                        continue
                tok = sample(z, r.temperature, r.top_k, r.top_p, r._rng, r.min_p)
                if pen is not None:
                    pen.add(tok)
                if r.logprobs is not None:
                    if self.logprobs_mode == "processed_logprobs":
                        z = processed_logprobs(z, r.temperature, r.top_k, r.top_p, r.min_p)
                    else:
                        z = lg
                    r.token_logprobs.append(scored_token(z, tok, r.logprobs))
                if con is not None and not con.accept(tok):
                    self._finish(r, "error", InputError(f"structured output: {con.error}"))
                    continue
                self._emit(r, tok, now)
                if con is not None and con.done:
                    self._finish(r, "stop")

    def _emit(self, r: Request, tok: int, now: float):
        if not r.tokens:
            r.first_token = now
            self.counters["ttft_seconds_total"] += now - r.submitted
        r.tokens.append(tok)
        r.token_times.append(now)
        r._queue.put(tok)
        self.counters["generated_tokens_total"] += 1
        if tok in r.stop:
            self._finish(r, "stop")
        elif len(r.tokens) >= r.max_tokens or r.prompt.size + len(r.tokens) > self.max_seq:
            # (the next token would be at position max_seq)
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str, error=None):
        if r._done.is_set():
            return
        r.finish_reason, r.error, r.finished = reason, error, time.perf_counter()
        if r in self._running:
            self._running.remove(r)
            if self.prefix_cache:       # keep the slot's rows: what it holds of the sequence
                filled = int(self.gen.filled[r._slot])
                self._cached[r._slot] = np.concatenate(
                    [r.prompt, np.array(r.tokens, np.int32)])[:filled]
            else:
                self.gen.free(r._slot)
            with self._cv:
                self._free.append(r._slot)
        if reason != "cancelled" or error is not None:
            self.counters["requests_finished"] += 1
        r._queue.put(_DONE)
        r._done.set()


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


__all__ = ["Engine", "Request", "QueueFull", "EngineClosed"]
