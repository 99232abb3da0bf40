"""Logits processing and token choice, as transformers does it for greedy decoding.

Order: ``logit_bias`` added (OpenAI's: to the raw logits), repetition penalty (over
prompt + generated ids, as transformers' RepetitionPenaltyLogitsProcessor), presence
penalty (generated ids, OpenAI style),
frequency penalty (generated ids times their generated counts, OpenAI style), then for
sampling temperature -> top-k -> top-p -> min-p (transformers' warper order; min-p
keeps the tokens at least ``min_p`` times as likely as the likeliest).
``temperature == 0`` is argmax after the penalties, which is what
``generate(do_sample=False)`` computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)


class Sampler:
    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)
        ids = np.asarray(prompt_ids, dtype=np.int64)
        self._seen = np.zeros(vocab_size, dtype=bool)  # in the prompt or generated
        self._seen[ids[(ids >= 0) & (ids < vocab_size)]] = True
        self._generated = np.zeros(vocab_size, dtype=bool)
        # The same sets as id lists, so that penalties touch only those ids, never the
        # whole vocabulary (capacity: every id once).
        self._seen_ids = np.zeros(vocab_size, dtype=np.int64)
        self._n_seen = int(np.count_nonzero(self._seen))
        self._seen_ids[:self._n_seen] = np.flatnonzero(self._seen)
        self._generated_ids = np.zeros(vocab_size, dtype=np.int64)
        self._n_generated = 0
        # How often each id was generated; kept only when the frequency penalty needs it.
        self._counts = np.zeros(vocab_size if params.frequency_penalty else 0, dtype=np.int32)

    def _penalise(self, logits: np.ndarray) -> None:
        p = self.params
        if p.logit_bias:
            for token, bias in p.logit_bias:
                logits[token] += bias
        if p.repetition_penalty != 1.0:
            idx = self._seen_ids[:self._n_seen]
            vals = logits[idx]
            logits[idx] = np.where(vals < 0, vals * p.repetition_penalty,
                                   vals / p.repetition_penalty)
        if p.presence_penalty:
            logits[self._generated_ids[:self._n_generated]] -= p.presence_penalty
        if p.frequency_penalty:
            idx = self._generated_ids[:self._n_generated]
            logits[idx] -= p.frequency_penalty * self._counts[idx]

    def choose(self, logits: np.ndarray) -> int:
        """Pick the next token from the last position's logits (modified in place)."""
        self._penalise(logits)
        p = self.params
        if p.temperature <= 0.0:
            token = int(np.argmax(logits))
        else:
            token = self._sample(logits / np.float32(p.temperature))
        self.note(token)
        return token

    def note(self, token: int) -> None:
        """``token`` is generated (chosen here, or forced by a response format): the
        penalties count it from now on."""
        if self.params.frequency_penalty:
            self._counts[token] += 1
        if not self._generated[token]:
            self._generated[token] = True
            self._generated_ids[self._n_generated] = token
            self._n_generated += 1
        if not self._seen[token]:
            self._seen[token] = True
            self._seen_ids[self._n_seen] = token
            self._n_seen += 1

    def _sample(self, scores: np.ndarray) -> int:
        p = self.params
        if 0 < p.top_k < scores.size:
            candidates = np.argpartition(scores, -p.top_k)[-p.top_k:]
        else:
            candidates = np.arange(scores.size)
        order = candidates[np.argsort(-scores[candidates], kind="stable")]
        top = scores[order].astype(np.float64)
        probs = np.exp(top - top[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (at least one token).
            before = np.cumsum(probs) - probs
            keep = int(np.count_nonzero(before < p.top_p)) or 1
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        if p.min_p > 0.0:  # probs are sorted: the first is the likeliest
            keep = int(np.count_nonzero(probs >= p.min_p * probs[0])) or 1
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        pick = int(np.searchsorted(np.cumsum(probs), self._rng.random() * probs.sum()))
        return int(order[min(pick, order.size - 1)])


class StopStrings:
    """Finds stop strings in generated text and how much text must be held back."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, start: int = 0) -> int | None:
        """Index where the earliest stop string starts at or after ``start``, or None."""
        hits = [i for s in self.stops if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that could start a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
