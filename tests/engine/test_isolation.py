"""Caches per user: one user's KV prefixes and image embeddings never make another's
request faster (which the reply's cached_tokens and timings would show), unless
engine.share_caches says so."""

from __future__ import annotations

from typing import Any

import pytest

from qvld.engine import Engine, GenerateRequest, GenerateResult
from tests.conftest import TINY, load_reference, parity_config, reused, with_image_bytes

CASES = {c["name"]: c for c in load_reference(TINY)["cases"]}
PHOTO = CASES["image_photo"]
ALICE, BOB = 1000, 1001


def ask(engine: Engine, case: dict[str, Any], uid: int) -> GenerateResult:
    result = engine.generate(GenerateRequest(
        messages=with_image_bytes(case["messages"], TINY), temperature=0.0,
        max_tokens=case["max_new_tokens"]), uid=uid)
    assert result.token_ids == case["token_ids"]  # exact whoever's cache served it
    return result


@pytest.mark.parametrize("slots", [1, 2])
def test_a_kv_prefix_is_reused_only_by_the_user_who_computed_it(slots: int) -> None:
    engine = Engine(parity_config(TINY, infer_requests=slots))
    ask(engine, PHOTO, ALICE)
    assert ask(engine, PHOTO, BOB).usage.cached_tokens == 0
    again = ask(engine, PHOTO, ALICE)
    # One slot without batching: Bob's request took it, and it was reset for him. With
    # batching, the blocks are a pool and Bob's never replace Alice's prefix.
    if slots > 1 or engine.batch is not None:
        assert again.usage.cached_tokens == reused(engine, len(PHOTO["input_ids"]) - 1) > 0


def test_an_image_embedding_is_reused_only_by_the_user_who_sent_the_image() -> None:
    engine = Engine(parity_config(TINY, infer_requests=1, kv_cache_mb=0))
    first = ask(engine, PHOTO, ALICE)
    assert (first.image_cache_hits, first.image_cache_misses) == (0, 1)
    prepared = engine.prepare(GenerateRequest(
        messages=with_image_bytes(PHOTO["messages"], TINY)), BOB)
    assert prepared.images[0].patches is not None  # decoded again: no shortcut for Bob
    bob = ask(engine, PHOTO, BOB)
    assert (bob.image_cache_hits, bob.image_cache_misses) == (0, 1)
    alice = ask(engine, PHOTO, ALICE)
    assert (alice.image_cache_hits, alice.image_cache_misses) == (1, 0)
    assert engine.images.stats()["entries"] == 2


def test_share_caches_lets_every_user_reuse_them() -> None:
    engine = Engine(parity_config(TINY, infer_requests=2, share_caches=True))
    ask(engine, PHOTO, ALICE)
    bob = ask(engine, PHOTO, BOB).usage.cached_tokens
    assert bob == reused(engine, len(PHOTO["input_ids"]) - 1) > 0
    images = Engine(parity_config(TINY, infer_requests=1, kv_cache_mb=0, share_caches=True))
    ask(images, PHOTO, ALICE)
    bob = ask(images, PHOTO, BOB)
    assert (bob.image_cache_hits, bob.image_cache_misses) == (1, 0)
