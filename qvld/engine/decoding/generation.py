"""Positions (mRoPE), a prompt as fed, and one generation's token choice: stop rules,
logprobs and streaming text (``Decoding``), whatever computed the logits."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from qvld.engine.decoding.constraints import Constraint
from qvld.engine.decoding.sampling import Sampler, StopStrings
from qvld.engine.model.interface import Slot
from qvld.engine.model.tokenizer import IncrementalText, TextTokenizer

# "tool_calls": the answer is calls of the request's tools (it stopped after them).
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]

# on_token(text_delta, new_token_ids): called as text becomes final (never mid-character,
# never a possible stop-string prefix). A request that asks for logprobs calls it with a
# third argument, the entries of those ids (``logprobs=``).
TokenCallback = Callable[..., None]


def mrope_positions(length: int,
                    images: Sequence[tuple[int, int, int] | tuple[int, int, int, Any]]
                    ) -> tuple[np.ndarray, int]:
    """3-axis positions [3,S] and rope_delta, as transformers' ``get_rope_index``.

    ``images`` are (start row, merged grid h, merged grid w[, kept tokens]) in prompt
    order. Text runs sequentially on all axes. An image's gh*gw rows at base position b
    get t=b, h=b+row, w=b+col; the text after it resumes at b+max(gh, gw). A pruned
    image (kept tokens: indices into its row-major merged grid) has rows for those
    tokens only, each at the position it has unpruned, and the text after it resumes
    where it would: pruning moves no other row.
    ``rope_delta = max + 1 - S`` shifts every later decode step.
    """
    pos = np.empty((3, length), dtype=np.int64)
    i = nxt = 0
    for start, gh, gw, *kept in [*images, (length, 0, 0)]:
        pos[:, i:start] = nxt + np.arange(start - i)  # the text before this image
        nxt += start - i
        if gh == 0:
            break
        cells = np.arange(gh * gw) if not kept or kept[0] is None else np.asarray(kept[0])
        count = len(cells)
        pos[0, start:start + count] = nxt
        pos[1, start:start + count] = nxt + cells // gw
        pos[2, start:start + count] = nxt + cells % gw
        nxt += max(gh, gw)
        i = start + count
    delta = int(pos.max()) + 1 - length if length else 0
    return pos, delta


@dataclass
class Prompt:
    """A tokenised prompt with its image rows filled in."""

    ids: list[int]
    positions: np.ndarray  # [3,S]
    rope_delta: int
    visual_mask: np.ndarray  # [S] bool: rows taken from image embeddings
    visual_embeds: np.ndarray  # [Nvis,H]
    deepstack: np.ndarray  # [k,Nvis,H]
    # The KV-cache key of each row: (token id, image hash for image rows).
    keys: list[tuple[int, bytes | None]] = field(default_factory=list)
    image_cache_hits: int = 0
    image_cache_misses: int = 0


@dataclass
class Outcome:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prefill_s: float
    ttft_s: float
    decode_s: float
    cached_tokens: int
    token_gaps: list[float] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    forced_tokens: int = 0  # chosen by a response format, not sampled
    closed: bool = False  # a response format ended it early: the budget was running out


def prefill(slot: Slot, prompt: Prompt, start: int, chunk: int,
            should_stop: Callable[[], bool]) -> np.ndarray | None:
    """Feed prompt rows [start:] on one slot in chunks; the last chunk's logits, or None
    if stopped (the engine feeds prompts in the step loop: this is for measuring a slot
    alone, ``bench/logit_agreement.py``)."""
    vis_index = np.cumsum(prompt.visual_mask) - 1  # row -> index into visual_embeds
    logits = None
    for lo in range(start, len(prompt.ids), chunk):
        if should_stop():
            return None
        hi = min(lo + chunk, len(prompt.ids))
        embeds = slot.embed(np.asarray(prompt.ids[lo:hi]))
        mask = prompt.visual_mask[lo:hi]
        if mask.any():
            rows = vis_index[lo:hi][mask]
            embeds[mask] = prompt.visual_embeds[rows]
            deepstack = np.ascontiguousarray(prompt.deepstack[:, rows])
        else:
            deepstack = slot.no_deepstack()
        logits = slot.step(embeds, prompt.positions[:, lo:hi], mask, deepstack)
    return logits


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p over the vocabulary, in float64 (masked tokens: -inf)."""
    scores: np.ndarray = logits.astype(np.float64)
    top = float(scores.max())
    scores -= top + float(np.log(np.exp(scores - top).sum()))
    return scores


def never() -> bool:
    """The default ``should_stop``: nothing cancels."""
    return False


class Decoding:
    """One generation's token choice, stop rules and streamed text, step by step: the
    part of decoding that does not care how the logits were computed (alone on a slot,
    or batched with others).

    With a response format (``constraint``), three rules on top of the mask:

    - **Forced tokens.** Where the grammar leaves no choice (a key, a quote, a brace, an
      enum's shared prefix) the token is the first of its canonical fast-forward tokens,
      not a sample; with ``fast_forward`` the rest of the run follows at once, so that
      the caller feeds them all in one step (several rows, as a prompt chunk is fed)
      instead of one step each. The ids are the same either way: a forced run is always
      tokenised canonically, one token per step or all in one.
    - **Always closes.** Every step keeps a known way to end the answer within what the
      budget (max_tokens, the context) leaves; a token after which no end would fit is
      taken back and that end is emitted instead (``closed``; finish "length"). The
      shortest answer the grammar allows not fitting the budget at all is a
      ``bad_request`` at the first step.
    - Forced tokens report log-probability 0 (the only choice), themselves the only top
      token.
    """

    def __init__(self, tokenizer: TextTokenizer, sampler: Sampler, *, prompt_len: int,
                 max_tokens: int, max_context: int, eos_ids: Sequence[int],
                 stops: StopStrings, on_token: TokenCallback | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 constraint: Constraint | None = None, logprobs: int | None = None,
                 fast_forward: bool = True) -> None:
        self.sampler = sampler
        self.tokenizer = tokenizer
        # Asked: each token's log-probability and this many alternatives.
        self.top_logprobs = logprobs
        self.logprobs: list[dict[str, Any]] = []
        self.pending_logprobs: list[dict[str, Any]] = []
        self.constraint = constraint
        self.fast_forward = fast_forward
        self.forced_tokens = 0
        self.closed = False
        self._ending: list[int] | None = None  # a way to end that fits the budget
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.max_context = max_context
        self.eos = set(eos_ids)
        self.stops = stops
        self.on_token = on_token
        self.should_stop = should_stop or never
        self.text = IncrementalText(tokenizer)
        self.released = 0  # characters of text already passed to on_token
        self.pending: list[int] = []  # ids not yet passed to on_token
        self.finish: FinishReason | None = None
        self.stop_at: int | None = None
        self.gaps: list[float] = []
        self.t_first = 0.0
        self.t_last = 0.0

    @property
    def budget(self) -> int:
        """Tokens this answer may still have (max_tokens, and the context)."""
        made = len(self.text.ids)
        return min(self.max_tokens - made, self.max_context - self.prompt_len - made)

    def accept(self, logits: np.ndarray) -> list[int] | None:
        """Choose the next token from ``logits`` (changed in place) and stream what became
        final; the tokens to feed next (the chosen one, then any a response format
        forces after it), or None when a stop rule fired (``finish``).

        A response format masks the logits first; the answer stops where its grammar is
        complete (nothing else may follow), whether or not the model chose an eos."""
        if self.constraint is not None:
            return self._accept_constrained(self.constraint, logits)
        scores = None if self.top_logprobs is None else log_softmax(logits)
        token = self.sampler.choose(logits)
        return self._emit([token], [self._entry(token, scores)], [False], complete=False)

    def _accept_constrained(self, constraint: Constraint, logits: np.ndarray
                            ) -> list[int] | None:
        budget = self.budget
        if not self.text.ids:
            # Compiled before the shortest answer is read: a compile still running (a
            # loaded machine) must not leave this answer without a way to close.
            constraint.wait()
            constraint.check_room(budget)
            self._ending = constraint.shortest
        forced = constraint.forced()
        if forced:
            token = forced[0]
            self.sampler.note(token)
            entries = [self._forced_entry(token)]
        else:
            constraint.mask(logits)
            scores = None if self.top_logprobs is None else log_softmax(logits)
            token = self.sampler.choose(logits)
            entries = [self._entry(token, scores)]
        run, was_forced = [token], [bool(forced)]
        complete = constraint.advance(token)
        while self.fast_forward and not complete and len(run) < budget:
            more = constraint.forced()[:budget - len(run)]
            if not more:
                break
            for token in more:
                complete = constraint.advance(token)
                self.sampler.note(token)
                run.append(token)
                entries.append(self._forced_entry(token))
                was_forced.append(True)
                if complete:
                    break
        if not complete and run[-1] not in self.eos and self._ending is not None:
            ending = constraint.finish(budget - len(run), known=self._ending)
            if ending is not None:
                self._ending = ending
            elif not constraint.can_finish:  # its searches cost too much: no more
                self._ending = None
            else:  # no end fits after this run: end from before it, as known to fit
                constraint.rollback(len(run))
                run, complete, self.closed = list(self._ending), True, True
                for token in run:
                    constraint.advance(token)
                entries = [self._forced_entry(token) for token in run]
                was_forced = [True] * len(run)
        return self._emit(run, entries, was_forced, complete)

    def _emit(self, tokens: list[int], entries: list[dict[str, Any] | None],
              forced: list[bool], complete: bool) -> list[int] | None:
        """Add ``tokens`` to the answer and apply the stop rules; the tokens to feed next,
        or None when it ended (``complete``: the grammar is, after the last token)."""
        now = time.perf_counter()
        if not self.text.ids:
            self.t_first = now
        else:  # one gap per delivery: a forced run arrives at once
            self.gaps.append(now - self.t_last)
        self.t_last = now
        text, stops = self.text, self.stops
        for i, token in enumerate(tokens):
            # Only text the new token can have changed is searched for stop strings.
            searched = max(0, text.settled_length - stops.longest + 1)
            text.add(token)
            self.pending.append(token)
            self.forced_tokens += forced[i]
            entry = entries[i]
            if entry is not None:
                self.logprobs.append(entry)
                self.pending_logprobs.append(entry)
            if token not in self.eos and stops.stops:
                self.stop_at = stops.find(text.text, searched)
            if token in self.eos or self.stop_at is not None or (
                    complete and i == len(tokens) - 1):
                self.finish = "length" if self.closed else "stop"
            elif (len(text.ids) >= self.max_tokens
                  or self.prompt_len + len(text.ids) >= self.max_context):
                self.finish = "length"
            if self.finish is not None:
                break
        if self.finish is None and complete and not tokens:
            # Ended from before a run that no ending fit after, with nothing left to
            # add: the answer is complete as it stands (it was closed at the budget).
            self.finish = "length" if self.closed else "stop"
        if self.finish is None and self.should_stop():
            self.finish = "cancelled"
        if self.finish is not None:
            self._flush()
            return None
        if self.on_token is not None:
            stable = text.stable_text()
            limit = len(stable) - stops.holdback(stable)
            if limit > self.released:
                self._release(stable[self.released:limit])
                self.released = limit
        return tokens

    def _release(self, text: str) -> None:
        """Pass ``text`` and the ids not yet passed (with their logprobs when asked)."""
        assert self.on_token is not None
        if self.top_logprobs is None:
            self.on_token(text, self.pending)
        else:
            self.on_token(text, self.pending, logprobs=self.pending_logprobs)
            self.pending_logprobs = []
        self.pending = []

    def _entry(self, token: int, scores: np.ndarray | None) -> dict[str, Any] | None:
        """``token``'s log-probability and the ``top_logprobs`` likeliest, under the
        model's distribution (after a response format's mask; before temperature, top-p
        and penalties, as OpenAI reports them); None when not asked. Tokens a mask rules
        out are never alternatives."""
        if scores is None:
            return None
        n = self.top_logprobs or 0
        top = np.argpartition(scores, -n)[-n:] if n else np.empty(0, np.int64)
        top = top[np.argsort(-scores[top], kind="stable")]
        top = top[np.isfinite(scores[top])]
        decode = self.tokenizer.decode
        return {"token_id": token, "token": decode([token]), "logprob": float(scores[token]),
                "top": [{"token_id": int(t), "token": decode([int(t)]),
                         "logprob": float(scores[t])} for t in top]}

    def _forced_entry(self, token: int) -> dict[str, Any] | None:
        """A forced token's entry: certain (log-probability 0), nothing else possible;
        None when not asked."""
        if self.top_logprobs is None:
            return None
        text = self.tokenizer.decode([token])
        top = [{"token_id": token, "token": text, "logprob": 0.0}] if self.top_logprobs else []
        return {"token_id": token, "token": text, "logprob": 0.0, "top": top}

    def cancel(self) -> None:
        """End it as cancelled (before or between tokens)."""
        self.finish = "cancelled"
        self._flush()

    @property
    def final_text(self) -> str:
        return self.text.text if self.stop_at is None else self.text.text[:self.stop_at]

    def _flush(self) -> None:
        final = self.final_text
        if self.on_token is not None and (len(final) > self.released or self.pending):
            self._release(final[self.released:])
            self.released = len(final)

    def outcome(self, t0: float, t_prefill: float, cached: int) -> Outcome:
        """The result, timed from ``t0`` (start) and ``t_prefill`` (prompt fed)."""
        assert self.finish is not None
        t_end = time.perf_counter()
        first = self.t_first or t_end
        return Outcome(token_ids=self.text.ids, text=self.final_text,
                       logprobs=None if self.top_logprobs is None else self.logprobs,
                       finish_reason=self.finish, prefill_s=t_prefill - t0,
                       ttft_s=(first - t0) if self.text.ids else 0.0,
                       decode_s=(t_end - first) if self.text.ids else 0.0,
                       cached_tokens=cached, token_gaps=self.gaps,
                       forced_tokens=self.forced_tokens, closed=self.closed)
