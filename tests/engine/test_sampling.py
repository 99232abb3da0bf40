from __future__ import annotations

import numpy as np
import pytest

from qvld.engine.decoding.sampling import Sampler, SamplingParams, StopStrings


def test_greedy_is_argmax_after_repetition_penalty() -> None:
    logits = np.array([1.0, 2.0, 1.9, -1.0], dtype=np.float32)
    # Token 1 was in the prompt: 2.0 / 1.2 = 1.67 < 1.9, so token 2 wins.
    sampler = Sampler(SamplingParams(repetition_penalty=1.2), prompt_ids=[1, 3], vocab_size=4)
    assert sampler.choose(logits.copy()) == 2
    assert Sampler(SamplingParams(), [1], 4).choose(logits.copy()) == 1


def test_repetition_penalty_matches_transformers_rule() -> None:
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1, 1], vocab_size=3)
    sampler._penalise(logits)
    np.testing.assert_allclose(logits, [1.0, -4.0, 1.0])


def test_generated_tokens_are_penalised_on_later_steps() -> None:
    sampler = Sampler(SamplingParams(repetition_penalty=10.0), prompt_ids=[], vocab_size=3)
    assert sampler.choose(np.array([1.0, 0.9, 0.0], np.float32)) == 0
    assert sampler.choose(np.array([1.0, 0.9, 0.0], np.float32)) == 1


def test_presence_penalty_only_touches_generated_tokens() -> None:
    sampler = Sampler(SamplingParams(presence_penalty=1.5), prompt_ids=[1], vocab_size=3)
    assert sampler.choose(np.array([0.0, 1.0, 0.5], np.float32)) == 1
    logits = np.array([0.0, 1.0, 0.5], np.float32)
    sampler._penalise(logits)
    np.testing.assert_allclose(logits, [0.0, -0.5, 0.5])


def test_frequency_penalty_scales_with_generated_counts() -> None:
    sampler = Sampler(SamplingParams(frequency_penalty=0.5), prompt_ids=[1], vocab_size=8)
    for _ in range(3):  # 10 - 0.5 * count stays the maximum
        assert sampler.choose(np.array([0, 0, 0, 0, 0, 10, 0, 0], np.float32)) == 5
    assert sampler.choose(np.array([0, 0, 10, 0, 0, 0, 0, 0], np.float32)) == 2
    logits = np.zeros(8, np.float32)
    sampler._penalise(logits)
    # 5 generated three times, 2 once; 1 only in the prompt: untouched.
    np.testing.assert_allclose(logits, [0, 0, -0.5, 0, 0, -1.5, 0, 0])
    # Greedy is argmax after the penalty: 5 (3.0 - 1.5) now loses to 3 (2.0).
    assert sampler.choose(np.array([0, 0, 0, 2, 0, 3, 0, 0], np.float32)) == 3


def test_negative_frequency_penalty_favours_repeats() -> None:
    sampler = Sampler(SamplingParams(frequency_penalty=-1.0), prompt_ids=[], vocab_size=3)
    assert sampler.choose(np.array([1.0, 0.0, 0.0], np.float32)) == 0
    assert sampler.choose(np.array([0.0, 0.0, 0.5], np.float32)) == 0  # 0 + 1 > 0.5
    logits = np.zeros(3, np.float32)
    sampler._penalise(logits)
    np.testing.assert_allclose(logits, [2.0, 0.0, 0.0])


def test_frequency_penalty_stacks_on_presence_penalty() -> None:
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.25)
    sampler = Sampler(params, prompt_ids=[0, 3], vocab_size=4)
    for token in (1, 1, 2):
        logits = np.zeros(4, np.float32)
        logits[token] = 10.0
        assert sampler.choose(logits) == token
    logits = np.zeros(4, np.float32)
    sampler._penalise(logits)
    np.testing.assert_allclose(logits, [0.0, -1.5, -1.25, 0.0])
    # Sampling sees the penalised logits too (top_k=1 keeps only their argmax).
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=1, presence_penalty=1.0,
                                     frequency_penalty=0.25, seed=0), [], 3)
    picks = [sampler.choose(np.array([2.0, 0.6, 0.0], np.float32)) for _ in range(3)]
    assert picks == [0, 0, 1]  # token 0: 2.0, then 2 - 1 - 0.25 = 0.75, then 0.5 < 0.6


def _old_penalise(params: SamplingParams, prompt: list[int], generated: list[int],
                  logits: np.ndarray) -> None:
    """The rule before frequency_penalty: repetition, then presence."""
    seen = sorted(set(prompt) | set(generated))
    vals = logits[seen]
    if params.repetition_penalty != 1.0:
        logits[seen] = np.where(vals < 0, vals * params.repetition_penalty,
                                vals / params.repetition_penalty)
    if params.presence_penalty:
        logits[sorted(set(generated))] -= params.presence_penalty


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_zero_frequency_penalty_is_the_old_behaviour(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, repetition_penalty=1.3,
                            presence_penalty=0.7, frequency_penalty=0.0, seed=11)
    prompt = [2, 4, 4]
    sampler = Sampler(params, prompt, vocab_size=16)
    assert sampler._counts.size == 0  # no count array, no per-step counting
    rng = np.random.default_rng(0)
    generated: list[int] = []
    for _ in range(40):
        logits = rng.normal(size=16).astype(np.float32)
        expected = logits.copy()
        _old_penalise(params, prompt, generated, expected)
        probe = logits.copy()
        sampler._penalise(probe)
        np.testing.assert_array_equal(probe, expected)
        generated.append(sampler.choose(logits))
    same = Sampler(SamplingParams(temperature=temperature, repetition_penalty=1.3,
                                  presence_penalty=0.7, seed=11), prompt, 16)
    rng = np.random.default_rng(0)
    assert [same.choose(rng.normal(size=16).astype(np.float32)) for _ in range(40)] \
        == generated


def test_top_k_restricts_the_support() -> None:
    logits = np.linspace(0, 1, 50).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=3, seed=1), [], 50)
    picks = {sampler.choose(logits.copy()) for _ in range(300)}
    assert picks == {47, 48, 49}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=3), [], 4)
    picks = [sampler.choose(logits.copy()) for _ in range(2000)]
    assert set(picks) == {0, 1}
    share = picks.count(0) / len(picks)
    assert abs(share - 0.5 / 0.8) < 0.05


def test_min_p_keeps_tokens_near_the_likeliest() -> None:
    probs = np.array([0.5, 0.3, 0.12, 0.08])
    logits = np.log(probs).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.2, seed=5), [], 4)
    picks = [sampler.choose(logits.copy()) for _ in range(2000)]
    assert set(picks) == {0, 1, 2}  # 0.08 < 0.2 * 0.5; 0.12 is not
    assert abs(picks.count(0) / len(picks) - 0.5 / 0.92) < 0.05
    only = Sampler(SamplingParams(temperature=1.0, min_p=1.0, seed=5), [], 4)
    assert {only.choose(logits.copy()) for _ in range(200)} == {0}


def test_sampling_follows_the_distribution_and_the_seed() -> None:
    logits = np.log(np.array([0.7, 0.2, 0.1])).astype(np.float32)

    def draws(seed: int) -> list[int]:
        s = Sampler(SamplingParams(temperature=1.0, seed=seed), [], 3)
        return [s.choose(logits.copy()) for _ in range(3000)]

    a = draws(5)
    assert a == draws(5)
    assert a != draws(6)
    assert abs(a.count(0) / 3000 - 0.7) < 0.04
    assert abs(a.count(2) / 3000 - 0.1) < 0.03


@pytest.mark.parametrize(
    ("stops", "text", "found", "held"),
    [
        (["END"], "abcEN", None, 2),
        (["END"], "abcENDxyz", 3, 0),
        (["END", "c"], "abcEND", 2, 0),
        (["xyz"], "hello", None, 0),
        (["ab", "abc"], "zzab", 2, 0),
        ([], "anything", None, 0),
        (["\n\n"], "line\n", None, 1),
    ],
)
def test_stop_strings(stops: list[str], text: str, found: int | None, held: int) -> None:
    matcher = StopStrings(stops)
    assert matcher.find(text) == found
    if found is None:
        assert matcher.holdback(text) == held
