"""Structured output: a request's ``response_format`` -> a token mask at every step.

Built on llguidance (guidance-ai/llguidance): its matcher is Rust, needs no torch, drops
the GIL while it compiles or computes a mask, bounds its own work (lexer fuel, grammar
size: a hostile schema ends in an error, not a hang), and covers JSON Schema, regexes
and Lark/GBNF grammars with one API. Its wheel is abi3 (one wheel for Python 3.10-3.13).

- ``response_format.parse_response_format`` types the wire's value (no llguidance needed);
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
  answer the budget cuts still parses (``finisher``).

JSON is compact (no free whitespace between tokens): a weak or random-weight model
otherwise fills the budget with spaces and the answer never closes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from qvld.engine.decoding.finisher import (
    FINISH_WORK_PER_REQUEST,
    START_FINISH_LIMIT,
    START_FINISH_SECONDS,
    START_FINISH_WORK,
    Finisher,
    SearchWork,
    allowed_tokens,
)
from qvld.engine.decoding.response_format import ResponseFormat
from qvld.errors import BadRequest, InternalError
from qvld.fairqueue import FairQueue

log = logging.getLogger("qvld.engine")

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


# What following a grammar may cost one answer on the step thread, in CPU seconds of
# matcher work on that thread (masks, tokens fed, fast-forward, finishing searches; CPU
# time, so a loaded machine does not count against it): half a second, plus 10 ms a
# token. A JSON schema costs well under a millisecond a token; an ambiguous grammar
# (``e: e e | e e e``) re-walks a growing Earley chart at every token (37 ms a token on
# the tiny model, growing) and held the shared step loop for minutes. Past it the answer
# ends with a 400, and the format is refused from then on.
GRAMMAR_SECONDS = 0.5
GRAMMAR_SECONDS_PER_TOKEN = 0.010


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
        allowed = allowed_tokens(bits, flat.size)
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
