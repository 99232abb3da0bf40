"""Structured output: a request's ``response_format`` -> a token mask at every step.

Built on llguidance (guidance-ai/llguidance): its matcher is Rust, needs no torch, drops
the GIL while it compiles or computes a mask, bounds its own work (lexer fuel, grammar
size: a hostile schema ends in an error, not a hang), and covers JSON Schema, regexes
and Lark/GBNF grammars with one API. Its wheel is abi3 (one wheel for Python 3.10-3.13).

- ``parse_response_format`` types the wire's value (no llguidance needed);
- ``GrammarCompiler`` compiles on its own threads, once per content (an LRU of compiled
  matchers; a request gets a copy), so compiling runs beside image decoding, encoding
  and prefill, and a cached grammar costs nothing and waits behind nobody. Compiles
  wait their turn round-robin between users, one user runs on at most all threads but
  one while it could matter to another, and a compile every requester of which has
  left or passed its deadline is dropped before it starts (a running one cannot be
  stopped: llguidance gives no way; its result is cached);
- ``Constraint`` is one request's matcher: ``mask`` sets every token the grammar does
  not allow next to -inf in the sliced logits, ``advance`` feeds it the chosen token and
  says whether the grammar is complete (the answer ends there: nothing else may follow),
  ``forced`` names the tokens the grammar leaves no choice about (fast-forward) and
  ``finish`` a short way to end the answer from where it is (``Finisher``), so that an
  answer the budget cuts still parses.

JSON is compact (no free whitespace between tokens): a weak or random-weight model
otherwise fills the budget with spaces and the answer never closes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

import numpy as np

from qvld.errors import BadRequest, InternalError
from qvld.fairqueue import FairQueue

log = logging.getLogger("qvld.engine")

FormatType = Literal["json_schema", "json_object", "regex", "grammar"]
FORMAT_TYPES: tuple[FormatType, ...] = ("json_schema", "json_object", "regex", "grammar")
# Sources past these are refused before anything compiles them.
MAX_SOURCE_BYTES = 128 * 1024
MAX_SCHEMA_DEPTH = 64  # JSON nesting; llguidance's own parser stops at 128
FORMAT_KEYS: dict[str, frozenset[str]] = {
    "json_schema": frozenset({"type", "schema"}), "json_object": frozenset({"type"}),
    "regex": frozenset({"type", "pattern"}), "grammar": frozenset({"type", "grammar"}),
    "text": frozenset({"type"}),
}


@dataclass(frozen=True)
class ResponseFormat:
    """What the answer must match: the kind, and its source as llguidance takes it (a
    JSON Schema as JSON text, in the client's key order: properties come out in it)."""

    type: FormatType
    source: str

    @property
    def key(self) -> str:
        """The cache key: the same content compiles once."""
        return hashlib.sha256(f"{self.type}\0{self.source}".encode()).hexdigest()


def _depth(value: Any) -> int:
    """How deep JSON containers nest (iterative: a hostile value cannot overflow)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def schema_text(schema: Any, what: str = "response_format.schema") -> str:
    """A schema (a map, or JSON text: deeper than a protocol frame may nest) -> JSON;
    errors name it as ``what``."""
    if isinstance(schema, str):
        if len(schema.encode()) > MAX_SOURCE_BYTES:
            raise BadRequest(f"{what} is over {MAX_SOURCE_BYTES} bytes")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise BadRequest(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise BadRequest(f"{what} must be a JSON Schema (an object)")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise BadRequest(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError) as exc:  # NaN, bytes or other non-JSON values
        raise BadRequest(f"{what} is not JSON: {exc}") from None
    if len(text.encode()) > MAX_SOURCE_BYTES:
        raise BadRequest(f"{what} is over {MAX_SOURCE_BYTES} bytes")
    return text


def _text_field(value: dict[str, Any], key: str) -> str:
    text = value.get(key)
    if not isinstance(text, str) or not text:
        raise BadRequest(f"response_format.{key} must be a non-empty string")
    if len(text.encode()) > MAX_SOURCE_BYTES:
        raise BadRequest(f"response_format.{key} is over {MAX_SOURCE_BYTES} bytes")
    if "\0" in text:
        raise BadRequest(f"response_format.{key} must not contain a NUL character")
    return text


def parse_response_format(value: Any) -> ResponseFormat | None:
    """protocol v1's ``response_format`` -> what to compile; None for free text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in FORMAT_KEYS:
        raise BadRequest("response_format must be {type: json_schema, schema}, "
                         "{type: json_object}, {type: regex, pattern} or "
                         "{type: grammar, grammar}")
    assert isinstance(value, dict)
    extra = sorted(map(str, set(value) - FORMAT_KEYS[kind]))
    if extra:
        raise BadRequest(f"response_format of type {kind} takes no {extra[0]!r} "
                         f"(it has {', '.join(sorted(FORMAT_KEYS[kind]))})")
    if kind == "text":
        return None
    if kind == "json_schema":
        if "schema" not in value:
            raise BadRequest("response_format of type json_schema needs a schema")
        return ResponseFormat("json_schema", schema_text(value["schema"]))
    if kind == "json_object":
        return ResponseFormat("json_object", '{"type":"object"}')
    if kind == "regex":
        return ResponseFormat("regex", _text_field(value, "pattern"))
    return ResponseFormat("grammar", _text_field(value, "grammar"))


# -- compiling ---------------------------------------------------------------------------

def _grammar(fmt: ResponseFormat) -> str:
    """The llguidance grammar for ``fmt`` (its own errors come from the matcher)."""
    from llguidance import LLMatcher, grammar_from

    if fmt.type in ("json_schema", "json_object"):
        return str(LLMatcher.grammar_from_json_schema(
            fmt.source, overrides={"whitespace_flexible": False}))
    if fmt.type == "regex":
        return str(LLMatcher.grammar_from_regex(fmt.source))
    return grammar_from("grammar", fmt.source)  # Lark, or GBNF converted to Lark


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
# What following a grammar may cost one answer on the step thread, in CPU seconds of
# matcher work on that thread (masks, tokens fed, fast-forward, finishing searches; CPU
# time, so a loaded machine does not count against it): half a second, plus 10 ms a
# token. A JSON schema costs well under a millisecond a token; an ambiguous grammar
# (``e: e e | e e e``) re-walks a growing Earley chart at every token (37 ms a token on
# the tiny model, growing) and held the shared step loop for minutes. Past it the answer
# ends with a 400, and the format is refused from then on.
GRAMMAR_SECONDS = 0.5
GRAMMAR_SECONDS_PER_TOKEN = 0.010
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


def _allowed(bits: np.ndarray, vocab_size: int) -> np.ndarray:
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
        allowed = _allowed(bits, self.vocab_size)
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


@dataclass
class Compiled:
    """One content's compile: a matcher to copy, or why it failed; how long it took; the
    shortest answer its grammar allows (``Finisher``; None when none was found)."""

    matcher: Any | None
    error: str | None
    seconds: float
    shortest: list[int] | None = None
    internal: bool = False  # the error is qvld's (logged), not the format's


@dataclass(eq=False)
class _Job:
    """A compile waiting or running, and the requests that still want it."""

    fmt: ResponseFormat
    uid: int  # the user whose turn it takes
    future: Future[Compiled]
    deadline: float  # the latest of its requesters' (time.monotonic())
    wanted: int = 1
    started: bool = False


_ABANDONED = "not compiled: every request for it left or passed its deadline first"


class GrammarCompiler:
    """Compiles response formats for one tokenizer on background threads; keeps the last
    ``cache_size`` results by content (failures too: a hostile schema sent again costs
    nothing), and runs one compile per content at a time. Waiting compiles are taken
    round-robin between users (``FairQueue``); one user holds at most ``threads - 1``
    of the threads, so another user's compile never waits for all of its."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: Sequence[int],
                 *, cache_size: int = 64, threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.per_uid = max(1, threads - 1)
        self._lock = threading.Lock()
        self._done: OrderedDict[str, Compiled] = OrderedDict()
        self._jobs: dict[str, _Job] = {}  # waiting or running, by content
        self._waiting: FairQueue[_Job] = FairQueue()
        self._running: Counter[int] = Counter()  # compiles running per uid
        self._deferred = 0  # turns given up because every waiting user was at its share
        self._closed = False
        # A pool, not threads of our own: an engine a reload replaced lets its compiler
        # go (the pool's threads end with it), and the interpreter waits for a running
        # compile before it exits. Each queued compile is one turn submitted to it.
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="qvld-grammar")
        # The vocabulary's token trie takes ~0.8 s to build for Qwen's 151k tokens:
        # built on a compile thread, so that it delays neither loading nor any request
        # without a response format.
        # Set by the load, so declared before it starts (declared after, a load that won
        # the race was overwritten: a compile then failed its assertion, seen under load).
        self._finisher: Finisher | None = None
        self._tokenizer = self._pool.submit(self._load_tokenizer, tokenizer_json,
                                            list(eos_ids))
        self.compiles = 0  # compiles run (not served from the cache), for tests and stats
        self.dropped = 0  # compiles nobody wanted any more by their turn

    def _load_tokenizer(self, path: Path, eos_ids: list[int]) -> Any:
        from llguidance import LLTokenizer

        tokenizer = LLTokenizer(path.read_text(encoding="utf-8"), n_vocab=self.vocab_size,
                                eos_token=eos_ids)
        self._finisher = Finisher(tokenizer, self.vocab_size)
        return tokenizer

    @property
    def finisher(self) -> Finisher:
        self._tokenizer.result()
        assert self._finisher is not None
        return self._finisher

    def load(self) -> None:
        """Wait until the vocabulary's trie is built (warm-up: the first request with a
        response format then pays only its compile)."""
        self._tokenizer.result()

    def compile(self, fmt: ResponseFormat, uid: int = 0, deadline: float = float("inf")
                ) -> tuple[Future[Compiled], bool]:
        """The compile of ``fmt`` (cached, running, waiting, or queued now for ``uid``)
        and whether it was cached (done before this request asked)."""
        key = fmt.key
        with self._lock:
            done = self._done.get(key)
            if done is not None:
                self._done.move_to_end(key)
                future: Future[Compiled] = Future()
                future.set_result(done)
                return future, True
            job = self._jobs.get(key)
            if job is not None:
                job.wanted += 1
                job.deadline = max(job.deadline, deadline)
                return job.future, False
            if self._closed:
                raise BadRequest("the daemon is shutting down")
            job = _Job(fmt, uid, Future(), deadline)
            self._jobs[key] = job
            self._waiting.push(uid, job)
        self._pool.submit(self._turn)
        return job.future, False

    def abandon(self, fmt: ResponseFormat) -> None:
        """A requester no longer waits (it left, or passed its deadline): a compile that
        nobody wants any more is dropped before it starts."""
        with self._lock:
            job = self._jobs.get(fmt.key)
            if job is None or job.started:
                return
            job.wanted -= 1
            if job.wanted <= 0 and self._waiting.remove(job.uid, job):
                self._drop(job)

    def _drop(self, job: _Job) -> None:
        """(lock held) End a job that never ran; not cached."""
        del self._jobs[job.fmt.key]
        self.dropped += 1
        job.future.set_result(Compiled(None, _ABANDONED, 0.0))

    def _take(self) -> _Job | None:
        """The next compile: round-robin between users, none over its share, a job
        nobody waits for dropped on the way; None if no user may start one (lock
        held)."""
        while not self._closed:
            job = self._waiting.pop(lambda uid: self._running[uid] < self.per_uid)
            if job is None:
                if len(self._waiting):
                    self._deferred += 1  # a running compile's end gives the turn back
                return None
            if job.wanted <= 0 or time.monotonic() >= job.deadline:
                self._drop(job)
                continue
            job.started = True
            self._running[job.uid] += 1
            return job
        return None

    def _turn(self) -> None:
        """One turn on a pool thread: the next compile, if any may start."""
        with self._lock:
            job = self._take()
        if job is None:
            return
        try:
            result = self._compile(job.fmt)
        finally:
            with self._lock:
                self._running[job.uid] -= 1
                if not self._running[job.uid]:
                    del self._running[job.uid]
                again = self._deferred > 0 and not self._closed
                if again:
                    self._deferred -= 1
            if again:
                self._pool.submit(self._turn)
        job.future.set_result(result)

    def _compile(self, fmt: ResponseFormat) -> Compiled:
        from llguidance import LLMatcher

        t0 = time.perf_counter()
        shortest = None
        internal = False
        try:
            matcher = LLMatcher(self._tokenizer.result(), _grammar(fmt), log_level=0)
            error = matcher.get_error() if matcher.is_error() else None
        except Exception as exc:  # llguidance raises ValueError; the GBNF converter others
            matcher, error = None, str(exc) or type(exc).__name__
        if error is None:
            try:  # our own code: a failure here is a bug, not the request's fault
                shortest = self.finisher.finish(
                    matcher, START_FINISH_LIMIT,
                    SearchWork(START_FINISH_WORK, time.monotonic() + START_FINISH_SECONDS))
            except Exception as exc:
                log.exception("compiling a %s failed inside qvld", fmt.type)
                error, internal = f"{type(exc).__name__}: {exc}", True
        result = Compiled(None if error else matcher, error, time.perf_counter() - t0,
                          shortest, internal)
        with self._lock:
            self.compiles += 1
            self._jobs.pop(fmt.key, None)
            if not internal:  # a bug's failure is not the format's: tried again next time
                self._done[fmt.key] = result
            while len(self._done) > self.cache_size:
                self._done.popitem(last=False)
        return result

    def start(self, fmt: ResponseFormat, timeout_s: float, uid: int = 0) -> Constraint:
        """One request's constraint, its compile started (or found) now."""
        deadline = time.monotonic() + timeout_s
        future, cached = self.compile(fmt, uid, deadline)
        return Constraint(fmt, future, cached, deadline, timeout_s, self.vocab_size,
                          self)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"cached": len(self._done), "compiling": sum(self._running.values()),
                    "waiting": len(self._waiting), "compiles": self.compiles,
                    "cache_size": self.cache_size}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for job in self._waiting.clear():
                self._drop(job)
        self._pool.shutdown(wait=False, cancel_futures=True)


class Constraint:
    """One request's matcher: a copy of the compiled one, advanced token by token."""

    def __init__(self, fmt: ResponseFormat, future: Future[Compiled], cached: bool,
                 deadline: float, timeout_s: float, vocab_size: int,
                 compiler: GrammarCompiler | None = None) -> None:
        self.format = fmt
        self.cached = cached
        self.future = future  # the compile: awaited by the daemon, waited on here
        self._compiler = compiler
        self._abandoned = False
        self._deadline = deadline
        self._timeout_s = timeout_s
        self._matcher: Any | None = None
        self._bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.compile_s: float | None = None  # None while not compiled, and when cached
        self.mask_s: list[float] = []  # each step's mask computation and application
        # What finding ways to end the answer (``finish``) may still cost.
        self.finish_work = SearchWork(FINISH_WORK_PER_REQUEST)
        self.spent_s = 0.0  # CPU seconds of matcher work on its thread (GRAMMAR_SECONDS)
        self.tokens = 0

    def failed(self) -> str | None:
        """Why the compile failed, when it has already finished and failed (cheap: lets
        a request fail before its images are encoded)."""
        if not self.future.done():
            return None
        return self.future.result().error

    @property
    def ready(self) -> bool:
        """Whether the first token can be chosen now without waiting: compiled (or
        failed), or its compile time is up (``wait`` then raises at once)."""
        return self._matcher is not None or self.future.done() or not self.remaining_s

    @property
    def remaining_s(self) -> float:
        """Seconds left of ``engine.grammar_compile_timeout_s``."""
        return max(0.0, self._deadline - time.monotonic())

    def abandon(self) -> None:
        """This request no longer waits for the compile (it left, or timed out)."""
        if not self._abandoned and self._compiler is not None and not self.future.done():
            self._abandoned = True
            self._compiler.abandon(self.format)

    def _result(self, timeout_s: float) -> Compiled:
        """The compile, within ``timeout_s``: ``bad_request`` naming what failed, or on
        time out (``engine.grammar_compile_timeout_s`` of the request's start)."""
        try:
            compiled = self.future.result(timeout_s)
        except FutureTimeout:
            self.abandon()
            raise self._timed_out() from None
        if compiled.error == _ABANDONED and not self._abandoned:
            raise self._timed_out()  # its time was up before a thread took it
        if compiled.internal:
            raise InternalError(f"response_format: compiling the {self.format.type} failed "
                                "inside qvld (logged); please report it")
        if compiled.error is not None or compiled.matcher is None:
            raise BadRequest(f"response_format: the {self.format.type} cannot be used: "
                             f"{_first_lines(compiled.error or 'no matcher')}")
        return compiled

    def _timed_out(self) -> BadRequest:
        return BadRequest(f"response_format: compiling the {self.format.type} took longer "
                          f"than engine.grammar_compile_timeout_s ({self._timeout_s:g} s)")

    def check(self) -> None:
        """Without waiting: the typed error if the compile failed or its time is up."""
        self._result(0.0)

    def wait(self) -> None:
        """Block until compiled and take this request's copy of the matcher."""
        if self._matcher is not None:
            return
        compiled = self._result(self.remaining_s)
        assert compiled.matcher is not None
        if not self.cached:
            self.compile_s = compiled.seconds
        self._matcher = compiled.matcher.deep_copy()

    def mask(self, logits: np.ndarray) -> None:
        """Every token the grammar does not allow next -> -inf (in place)."""
        self.wait()
        assert self._matcher is not None
        t0, cpu0 = time.perf_counter(), time.thread_time()
        bits = self._bitmask
        self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if self._matcher.is_error():
            self._gave_up()
        flat = logits.reshape(-1)  # a view: the sampler's logits are one row
        allowed = _allowed(bits, flat.size)
        np.putmask(flat, ~allowed, -np.inf)
        self.mask_s.append(time.perf_counter() - t0)
        self._spent(time.thread_time() - cpu0)

    def advance(self, token: int) -> bool:
        """Feed the chosen token; True when the grammar is complete (the answer ends)."""
        assert self._matcher is not None
        t0 = time.thread_time()
        if not self._matcher.consume_token(token):
            self._gave_up()
        self.tokens += 1
        self._spent(time.thread_time() - t0)
        return bool(self._matcher.is_stopped())

    def forced(self) -> list[int]:
        """The tokens the grammar leaves no choice about next: llguidance's fast-forward
        tokens, the canonical tokenisation of the bytes it forces, less a last token that
        what follows could merge with (nothing is consumed)."""
        self.wait()
        assert self._matcher is not None
        t0 = time.thread_time()
        tokens = list(self._matcher.compute_ff_tokens())
        self._spent(time.thread_time() - t0)
        return tokens

    def _spent(self, seconds: float) -> None:
        """Count matcher work; past ``GRAMMAR_SECONDS`` (and its share per token) the
        answer ends: the grammar costs too much to follow on the shared step."""
        self.spent_s += seconds
        if self.spent_s > GRAMMAR_SECONDS + GRAMMAR_SECONDS_PER_TOKEN * self.tokens:
            self._refuse(f"following it took {self.spent_s:.1f} s of matcher work for "
                         f"{self.tokens} tokens (at most {GRAMMAR_SECONDS:g} s and "
                         f"{GRAMMAR_SECONDS_PER_TOKEN * 1000:g} ms a token)")

    def rollback(self, tokens: int) -> None:
        """Take back the last ``tokens`` fed."""
        assert self._matcher is not None
        if tokens and not self._matcher.rollback(tokens):
            self._gave_up()

    @property
    def shortest(self) -> list[int] | None:
        """The shortest answer the grammar allows, as the finisher found it (None: none
        found, or not compiled)."""
        if not self.future.done():
            return None
        return self.future.result().shortest

    @property
    def can_finish(self) -> bool:
        """Whether its finishing searches may go on (they have not cost too much)."""
        return self._compiler is not None and self.finish_work.left > 0

    def check_room(self, tokens: int) -> None:
        """``bad_request`` when the grammar's shortest answer is longer than ``tokens``
        (what max_tokens, or the context, leaves): no valid answer could be given."""
        shortest = self.shortest
        if shortest is not None and len(shortest) > tokens:
            raise BadRequest(f"the response_format's shortest answer is {len(shortest)} "
                             f"tokens; this request leaves room for {tokens} (max_tokens, "
                             "or the context)")

    def finish(self, limit: int, known: Sequence[int] | None = None) -> list[int] | None:
        """A short way to end the answer from here, at most ``limit`` tokens (nothing is
        consumed): ``known`` (an ending found before the last tokens) when it still is
        one, else a search's; None when none is found, or when this request's searches
        have cost ``FINISH_WORK_PER_REQUEST`` already."""
        assert self._matcher is not None
        if not self.can_finish:
            return None
        assert self._compiler is not None
        t0 = time.thread_time()
        ending = self._compiler.finisher.finish(self._matcher, limit, self.finish_work, known)
        self._spent(time.thread_time() - t0)
        return ending

    def _gave_up(self) -> NoReturn:
        """The matcher stopped inside a grammar that compiled: its parser passed one of
        llguidance's bounds (e.g. 2 000 items in a row: a schema of thousands of optional
        properties). A client error, not ours; the compiled entry remembers it, so the
        same content is refused before its next request runs, and it is logged once."""
        assert self._matcher is not None
        self._refuse(_first_lines(self._matcher.get_error() or "no reason given", 1))

    def _refuse(self, reason: str) -> NoReturn:
        """This format is beyond what the grammar engine can follow: refused from now on
        (the compiled entry remembers it), logged once, a 400 for this request."""
        compiled = self.future.result()
        first = compiled.matcher is not None
        compiled.matcher, compiled.error = None, f"the grammar engine gave up: {reason}"
        if first:
            log.warning("response_format %s (sha256 %s): the grammar engine gave up "
                        "following it; requests with it are refused from now on: %s",
                        self.format.type, self.format.key[:16], reason)
        raise BadRequest(f"response_format: the {self.format.type} is beyond what the "
                         f"grammar engine can follow: {reason}")


def _first_lines(text: str, lines: int = 4) -> str:
    """llguidance's errors can quote a whole grammar: the first lines say what failed."""
    head = text.strip().splitlines()[:lines]
    return " ".join(line.strip() for line in head)
