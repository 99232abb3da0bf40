"""A short way to end a grammar from where an answer is (``Finisher``), so that an answer
the token budget cuts still parses; its searches bounded in matcher work
(``SearchWork``), never in seconds, so the same request ends the same way however
loaded the machine."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

# Bytes a finisher tries, in this order: what closes a string, an object, an array; what
# separates; the shortest values (0, true, false, null, [], {}); then the rest of
# printable ASCII.
_FINISH_ORDER = (b'"}],' + b"0987654321" + b"tfn[{-.:" + bytes(range(ord("a"), ord("z") + 1))
                 + bytes(range(ord("A"), ord("Z") + 1)) + b" _")
_FINISH_ORDER += bytes(b for b in range(32, 127) if b not in _FINISH_ORDER)
_QUICK_TRIES = 4  # tried one by one before the grammar's whole mask is computed
# Finishing searches are bounded in matcher operations, never in seconds: the same
# request gets the same answer however loaded the machine (a wall-clock bound made an
# answer's end depend on the load: CI saw it). A step of a search costs one unit, a
# whole mask _MASK_UNITS more (the costly operation with a real vocabulary).
_MASK_UNITS = 16
# What a request's searches may cost in all (a grammar whose greedy path loops could
# otherwise cost every step of the shared loop a search of the whole budget); past it
# the request gives up closing early (its answer may then be cut like free text). An
# ending still valid after the step is reused without a search (in a string, say), so
# most steps cost no search at all.
FINISH_WORK_PER_REQUEST = 65_536
# The compile thread's search for the shortest answer: also bounded in time, so that a
# grammar whose every step is costly cannot hold a compile thread (and a shutdown).
START_FINISH_SECONDS = 2.0
# A search from the grammar's start: the shortest answer it allows (compile thread).
START_FINISH_LIMIT = 2048
START_FINISH_WORK = 65_536


class SearchWork:
    """What finishing searches may still cost (units: see ``_MASK_UNITS``), and until
    when (``deadline``, ``time.monotonic()``; none for the step thread's searches)."""

    def __init__(self, units: int, deadline: float = float("inf")) -> None:
        self.left = units
        self.deadline = deadline

    def spend(self, units: int) -> bool:
        """Take ``units``; False when there were not that many left, or time is up."""
        self.left -= units
        if self.deadline != float("inf") and time.monotonic() > self.deadline:
            self.left = -1
        return self.left >= 0


def allowed_tokens(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """llguidance's bitmask (one bit per token, little-endian words) as booleans."""
    return np.unpackbits(bits.view(np.uint8), count=vocab_size, bitorder="little").view(bool)


class Finisher:
    """Finds a short way to end a grammar from a matcher's state: the tokens of an answer
    that ends as soon as the grammar lets it ("always closes").

    Greedy, one step at a time on a copy of the matcher: the grammar's forced tokens
    (fast-forward) when there are any, else a bracket that closes an array or object,
    else the first byte of ``_FINISH_ORDER`` it allows (closing a string; a comma; the
    shortest values: '""', ``0``, ``true``, ``[]``; a required key comes as forced
    bytes), else a special token it allows (``</tool_call>``), else its first allowed
    token. The result is tokenised canonically. Short, not always shortest: a string of
    minLength 2 becomes '"}}"', an integer of minimum 5 becomes ``9``, an enum its first
    value in that order ("fahrenheit" before "celsius"). None when no end is found within
    ``limit`` tokens: the grammar's end is further, or the greedy path loops (a regex
    ``x(a|b)*c`` never reaches its ``c`` when ``a`` comes first in the order)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        single = {b: tokenizer.tokenize_bytes(bytes([b])) for b in _FINISH_ORDER}
        self._order = [(b, int(ids[0])) for b, ids in single.items() if len(ids) == 1]
        byte_token = dict(self._order)
        self._brackets: list[int] = [byte_token[b] for b in b"]}" if b in byte_token]
        self._letter = byte_token.get(ord("x"))  # in a JSON string, never outside one
        self._by_token = np.array([t for _, t in self._order], dtype=np.int64)

    def finish(self, matcher: Any, limit: int, work: SearchWork,
               known: Sequence[int] | None = None) -> list[int] | None:
        """The tokens that end ``matcher``'s grammar soon (it is not changed), or None
        (none within ``limit`` tokens, or ``work`` ran out). ``known``: an ending found
        before the last tokens; taken as it is when it still ends the grammar from here
        within ``limit`` (no search)."""
        if known is not None and len(known) <= limit:
            check = matcher.deep_copy()
            if check.consume_tokens(list(known)) and check.is_accepting():
                return list(known)
        trial = matcher.deep_copy()
        raw: list[int] = []
        # Searches run on the step thread and on compile threads at once: a mask buffer
        # of their own each.
        bits = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        while not trial.is_accepting():
            # Tokens of single bytes: the canonical tokenisation can be much shorter.
            if len(raw) >= 4 * limit + 16 or trial.is_error() or not work.spend(1):
                return None
            forced = trial.compute_ff_tokens()
            if forced:
                if not trial.consume_tokens(forced):
                    return None
                raw.extend(forced)
                continue
            token = self._next(trial, bits, work)
            if token is None:
                return None
            raw.append(token)
        return self._canonical(matcher, raw, limit)

    def _next(self, trial: Any, bits: np.ndarray, work: SearchWork) -> int | None:
        """Consume the finishing order's first allowed token on ``trial``; which."""
        # A bracket that closes an array or an object first ("[]" rather than '[""]'),
        # unless it would be a character of a string (then "x" is allowed after it).
        for token in self._brackets:
            if trial.try_consume_tokens([token]) == 1:
                if self._letter is None or trial.validate_tokens([self._letter]) == 0:
                    return token
                trial.rollback(1)
        for _, token in self._order[:_QUICK_TRIES]:
            if trial.try_consume_tokens([token]) == 1:
                return token
        if not work.spend(_MASK_UNITS):
            return None
        trial.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = allowed_tokens(bits, self.vocab_size)
        hits = np.flatnonzero(allowed[self._by_token])
        if hits.size:
            token = int(self._by_token[hits[0]])
        else:
            ids = np.flatnonzero(allowed)
            if not ids.size:
                return None
            special = [int(t) for t in ids[:4096] if self.tokenizer.is_special_token(int(t))]
            token = special[0] if special else int(ids[0])
        return token if trial.consume_token(token) else None

    def _canonical(self, matcher: Any, raw: list[int], limit: int) -> list[int] | None:
        """``raw`` tokenised as the tokenizer would (its runs of text), if the grammar
        takes that; else ``raw``; None if it is longer than ``limit``."""
        out: list[int] = []
        run: list[int] = []
        for token in [*raw, -1]:
            if token >= 0 and not self.tokenizer.is_special_token(token):
                run.append(token)
                continue
            if run:
                out.extend(self.tokenizer.tokenize_bytes(self.tokenizer.decode_bytes(run)))
                run = []
            if token >= 0:
                out.append(token)
        check = matcher.deep_copy()
        tokens = out if check.consume_tokens(out) and check.is_accepting() else raw
        return tokens if len(tokens) <= limit else None
