"""BatchedLMGenerator: a compiled LM with a KV cache of N slots (tc.compile_lm with
max_batch=N), one sequence per slot, and one step function that runs tokens of several
slots at their own positions in one call:

    step(ids: i32 [T], slots: i32 [T], positions: i32 [T], rows: i32 [L]) -> logits [L, vocab]

Token t is at position positions[t] of the sequence in slot slots[t]; its K/V rows go
into that slot and it attends to that slot's rows 0..positions[t] (ops/kv_slots.py).
So one call can hold the decode steps of B running sequences (B rows of every weight
matrix's GEMM: the 2-bit weights are read once for all of them) and a chunk of a new
prompt; `rows` picks the tokens whose logits are computed. The host keeps each slot's
filled length and checks every call before it reaches IREE (a rejected call changes
nothing). runtime.scheduler.Engine schedules requests over it; this class is the
device-state API:

    >>> gen = tc.compile_lm(lm, max_seq=512, max_batch=8)
    >>> a = gen.prefill([1, 2, 3], slot=0)[-1]         # [vocab]
    >>> b = gen.prefill([4, 5], slot=1)[-1]
    >>> logits = gen.step([int(a.argmax()), int(b.argmax())], slots=[0, 1])   # [2, vocab]
    >>> gen.free(1)
    >>> gen.copy_prefix(0, 1, 3)       # slot 1 now holds slot 0's rows 0..2: [1, 2, 3]
    >>> gen.decode(4, slot=1)          # as prefill([1, 2, 3, 4], slot=1) would give

`copy_prefix` runs the module's second function, copy_rows (runtime/step_abi.py): a
new request whose prompt begins as a running sequence's does copies that sequence's
rows instead of computing them again (runtime.Engine's prefix sharing).
"""
from __future__ import annotations

import numbers

import numpy as np

from ..errors import ExecutionError, InputError, UnsupportedError
from .generator import LMGenerator, _ids
from .step_abi import COPY, STEP, StepABI


class BatchedLMGenerator(LMGenerator):
    """Attributes as LMGenerator's (`config`, `max_seq`, `kv_dtype`, `vocab_size`,
    `tokenizer`, `chat_template`), plus `max_batch` (slots) and `filled` (int array:
    the rows each slot holds). Calls from several threads run one at a time (as
    LMGenerator's); runtime.Engine is the one owner a server needs. `generate` (the
    inherited single-sequence loop) runs in slot 0."""

    ABI = StepABI(batched=True)

    def __init__(self, exe):
        super().__init__(exe)
        self.max_batch = int(exe.meta["lm"]["max_batch"])
        self.filled = np.zeros(self.max_batch, np.int64)
        self._copy = None

    # -- the one entry point -------------------------------------------------------------
    def forward(self, ids, slots, positions, rows=None) -> np.ndarray:
        """Run tokens `ids` [T] at (`slots`[t], `positions`[t]); returns the logits of
        the tokens `rows` (default all) [L, vocab]. The tokens of one slot must be at
        consecutive positions starting at most at the slot's filled length (a start
        before it overwrites the rows from there: a new prompt restarts at 0); after
        the call the slot holds rows up to its last token."""
        with self._exclusive("forward"):
            return self._forward(ids, slots, positions, rows)

    def _forward(self, ids, slots, positions, rows=None) -> np.ndarray:
        ids = _ids(ids, self.vocab_size, "forward")
        slots = _index(slots, ids.size, "slots")
        positions = _index(positions, ids.size, "positions")
        if ids.size == 0:
            raise InputError("forward: no tokens")
        rows = np.arange(ids.size, dtype=np.int32) if rows is None else _index(rows, None, "rows")
        if rows.size == 0 or rows.min() < 0 or rows.max() >= ids.size:
            raise InputError(f"forward: rows must pick 1 or more of the {ids.size} tokens, got "
                             f"{rows.tolist()}")
        ends = self._check_positions(slots, positions)
        logits = self._run(self._fn(), (ids, slots, positions, rows))
        for s, end in ends.items():
            self.filled[s] = end
        return logits

    def _check_positions(self, slots, positions) -> dict:
        if slots.min() < 0 or slots.max() >= self.max_batch:
            raise InputError(f"slot {int(slots[(slots < 0) | (slots >= self.max_batch)][0])} "
                             f"is out of range: the cache has slots 0 to {self.max_batch - 1}")
        ends = {}
        for s in np.unique(slots).tolist():
            p = positions[slots == s]
            if p.max() >= self.max_seq:
                raise InputError(f"slot {s}: position {int(p.max())} is past the cache of "
                                 f"{self.max_seq} rows",
                                 hint="compile with a larger max_seq, or free the slot")
            if p[0] > self.filled[s] or np.any(np.diff(p) != 1):
                raise InputError(f"slot {s}: positions {p.tolist()} must be consecutive, from at "
                                 f"most {int(self.filled[s])} (the rows it holds)")
            ends[s] = int(p[-1]) + 1
        return ends

    # -- conveniences ----------------------------------------------------------------------
    def prefill(self, ids, slot: int = 0, logits_to_keep: int | None = None) -> np.ndarray:
        """Run the prompt `ids` into `slot` from position 0 (whatever it held is
        dropped); logits of the last `logits_to_keep` (default all) tokens."""
        with self._exclusive("prefill"):
            return self._prefill(ids, logits_to_keep, slot)

    def _prefill(self, ids, logits_to_keep, slot: int = 0) -> np.ndarray:
        slot = self._slot(slot)
        arr, rows = self._prompt(ids, logits_to_keep)
        self.filled[slot] = 0
        return self._forward(arr, np.full(arr.size, slot, np.int32), np.arange(arr.size, dtype=np.int32),
                             rows)

    def _extend(self, arr, start: int, rows, slot: int = 0) -> np.ndarray:
        # LMGenerator.extend and speculative generate, in `slot` (0 for those)
        return self._forward(arr, np.full(arr.size, slot, np.int32),
                             np.arange(start, start + arr.size, dtype=np.int32), rows)

    def step(self, tokens, slots) -> np.ndarray:
        """Append one token to each of the sequences in `slots` (distinct, each holding
        a prompt); returns their next-token logits [B, vocab]."""
        with self._exclusive("step"):
            return self._step_slots(tokens, slots)

    def _step_slots(self, tokens, slots) -> np.ndarray:
        tokens = _ids(tokens, self.vocab_size, "step")
        slots = _index(slots, tokens.size, "slots")
        if tokens.size == 0:
            raise InputError("step: no tokens")
        if len(set(slots.tolist())) != slots.size:
            raise InputError(f"step: slots {slots.tolist()} repeat a slot",
                             hint="one token per sequence per step")
        for s in slots.tolist():
            self._slot(s)
            if self.filled[s] == 0:
                raise InputError(f"step: slot {s} is empty", hint=f"prefill(ids, slot={s}) first")
        return self._forward(tokens, slots, self.filled[slots].astype(np.int32))

    def decode(self, token, slot: int = 0) -> np.ndarray:
        """One token of the sequence in `slot`: its next-token logits [vocab]."""
        with self._exclusive("decode"):
            return self._decode(token, slot)

    def _decode(self, token, slot: int = 0) -> np.ndarray:
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (numbers.Integral, np.ndarray)):
            raise InputError(f"decode: the token must be an int, got {type(token).__name__}")
        return self._step_slots(np.reshape(token, -1), [slot])[0]

    @property
    def can_copy(self) -> bool:
        """Whether the module has copy_rows (an artifact saved by an older tercomp has
        not: copy_prefix then raises UnsupportedError)."""
        return COPY in self.exe.meta["lm"].get("entries", ())

    def copy_prefix(self, src: int, dst: int, rows: int, start: int = 0) -> None:
        """Copy rows `start`..`rows`-1 of slot `src` (at most the rows it holds) to the
        same rows of slot `dst` (another slot, holding at least `start` rows: those it
        already shares with `src`), in every layer's K and V cache; `dst` then holds
        `rows` rows (whatever it held past them is dropped). One call of copy_rows, on
        the device: the rows never come to the host."""
        self.copy_prefixes([(src, dst, rows, start)])

    def copy_prefixes(self, moves) -> None:
        """copy_prefix of every (src, dst, rows, start) of `moves` in ONE call: the
        destinations distinct, and none of them a source (each source's rows are read
        as they were before the call)."""
        with self._exclusive("copy_prefixes"):
            moves = [self._move(m) for m in moves]
            dsts = [m[1] for m in moves]
            if len(set(dsts)) != len(dsts) or set(dsts) & {m[0] for m in moves}:
                raise InputError(f"copy_prefixes: moves {moves} repeat a destination or copy "
                                 f"into a source slot", hint="one call per chain of copies")
            if not self.can_copy:
                raise UnsupportedError("copy_prefix: this module has no copy_rows function "
                                       "(compiled by an older tercomp)",
                                       hint="compile it again with tc.compile_lm(max_batch=N)")
            pos = [np.arange(start, rows, dtype=np.int32) for _, _, rows, start in moves]
            n = sum(p.size for p in pos)
            if n:
                if self._copy is None:
                    self._copy = self.exe.function(COPY)
                self.calls += 1
                try:
                    self._copy(np.repeat(np.array([m[0] for m in moves], np.int32),
                                         [p.size for p in pos]),
                               np.repeat(np.array(dsts, np.int32), [p.size for p in pos]),
                               np.concatenate(pos))
                except Exception as e:
                    raise ExecutionError(f"the IREE runtime failed copying KV rows on "
                                         f"{self.exe.device}: {e}") from None
            for _, dst, rows, _ in moves:
                self.filled[dst] = rows

    def _move(self, move) -> tuple:
        """(src, dst, rows, start) checked against the slots' filled rows."""
        try:
            src, dst, rows, start = move
        except (TypeError, ValueError):
            raise InputError(f"copy_prefixes: a move is (src, dst, rows, start), got "
                             f"{move!r}") from None
        src, dst = self._slot(src), self._slot(dst)
        if src == dst:
            raise InputError(f"copy_prefix: source and destination are both slot {src}")
        for what, v, hi, held in (("rows", rows, int(self.filled[src]), "source"),
                                  ("start", start, int(self.filled[dst]), "destination")):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) \
                    or not 0 <= v <= hi:
                raise InputError(f"copy_prefix: {what} must be an int from 0 to {hi} (the "
                                 f"rows the {held} slot holds), got {v!r}")
        if start > rows:
            raise InputError(f"copy_prefix: start {start} is past rows {rows}")
        return src, dst, int(rows), int(start)

    def free(self, slot: int) -> None:
        """Forget the sequence in `slot` (its rows are overwritten by the next one)."""
        with self._exclusive("free"):
            self.filled[self._slot(slot)] = 0

    def rollback(self, slot: int, rows: int) -> None:
        """Keep the first `rows` rows of `slot` (at most those it holds): the next token
        of its sequence goes at position `rows` (speculative decoding's rejected drafts)."""
        with self._exclusive("rollback"):
            slot = self._slot(slot)
            if isinstance(rows, (bool, np.bool_)) or not isinstance(rows, numbers.Integral) \
                    or not 0 <= rows <= self.filled[slot]:
                raise InputError(f"rollback: rows must be an int from 0 to {int(self.filled[slot])} "
                                 f"(the rows slot {slot} holds), got {rows!r}")
            self.filled[slot] = rows

    def reset(self) -> None:
        """Forget every slot's sequence."""
        with self._exclusive("reset"):
            self.filled[:] = 0

    @property
    def position(self) -> int:          # LMGenerator's, for slot 0
        return int(self.filled[0])

    @position.setter
    def position(self, value):
        if hasattr(self, "filled"):
            self.filled[0] = value

    def _slot(self, slot) -> int:
        if isinstance(slot, (bool, np.bool_)) or not isinstance(slot, numbers.Integral) \
                or not 0 <= slot < self.max_batch:
            raise InputError(f"slot must be an int from 0 to {self.max_batch - 1}, got {slot!r}")
        return int(slot)

    def __repr__(self):
        c = self.config
        return (f"BatchedLMGenerator(layers={c.get('num_hidden_layers')}, "
                f"hidden={c.get('hidden_size')}, vocab={self.vocab_size}, "
                f"max_batch={self.max_batch}, max_seq={self.max_seq}, kv={self.kv_dtype}, "
                f"device={self.exe.device!r})")


def _index(x, n, what: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu" or arr.ndim > 1 or (n is not None and arr.size != n):
        want = f"{n} ints" if n is not None else "ints"
        raise InputError(f"{what}: expected a 1-D sequence of {want}, got {arr.dtype} "
                         f"of shape {list(arr.shape)}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise InputError(f"{what}: values must be in [0, 2^31), got {arr.tolist()}")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.int32)


def open_generator(exe):
    """The generator class a compiled LM's metadata asks for."""
    if int(exe.meta["lm"].get("max_batch", 1)) > 1:
        return BatchedLMGenerator(exe)
    return LMGenerator(exe)


__all__ = ["BatchedLMGenerator", "open_generator", "STEP"]
