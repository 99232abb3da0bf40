"""Caches are per user over the socket: another user's reply never shows, by its
cached_tokens or its image-cache lookups, that someone sent the same prompt or image;
engine.share_caches turns sharing back on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import NOBODY, TINY, Daemon, run_as

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another uid")

IMAGE = (TINY / "images" / "small.png").read_bytes()  # small: frames travel in argv


# Longer than one KV block (the prefix cache keeps whole blocks).
PREAMBLE = "Look at the picture below with care, then answer in one short sentence. " * 2


def question(text: str) -> dict[str, Any]:
    # The text before the image: another question about the same image shares only the
    # first prompt rows, so the image itself is looked up in the embedding cache.
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": PREAMBLE + text}, {"type": "image", "image": IMAGE}]}],
        "max_tokens": 2, "temperature": 0}


def as_nobody(daemon: Daemon, params: dict[str, Any]) -> dict[str, Any]:
    replies = run_as(NOBODY, daemon.socket, [{"id": 1, "op": "generate", "params": params}])
    assert isinstance(replies, list)
    reply = replies[0][1]
    assert reply["ok"], reply
    return dict(reply["result"])


def image_lookups(client: Any) -> tuple[int, int]:
    stats = client.status()["caches"]["image"]
    return stats["hits"], stats["misses"]


@pytest.mark.parametrize("share", [False, True], ids=["per-user", "shared"])
def test_another_users_reply_shows_nothing_of_mine_unless_shared(shared_dir: Path,
                                                                share: bool) -> None:
    daemon = Daemon(shared_dir, args=[
        "--set", "server.socket_mode=0666", "--set", f"server.allow_uids=[{NOBODY}]",
        "--set", f"engine.share_caches={'true' if share else 'false'}"]).start()
    try:
        with daemon.client() as client:
            client.generate(question("What is this?"))  # (root shares the warm-up's rows)
            hits, misses = image_lookups(client)
            theirs = as_nobody(daemon, question("What is that?"))
            assert theirs["token_ids"] != [] and theirs["usage"]["image_tokens"] > 0
            if share:
                assert theirs["usage"]["cached_tokens"] > 0  # the shared first rows
                assert image_lookups(client) == (hits + 1, misses)
            else:
                assert theirs["usage"]["cached_tokens"] == 0
                assert image_lookups(client) == (hits, misses + 1)
            # My own caches still serve me.
            hits, misses = image_lookups(client)
            again = client.generate(question("What else?"))
            assert again["usage"]["cached_tokens"] > 0
            assert image_lookups(client) == (hits + 1, misses)
    finally:
        assert daemon.stop() == 0
