"""What `status` tells whom: an admin everything, a user only their own generations and
errors (App.status_details, in-process; test_access.py checks it over the socket)."""

from __future__ import annotations

from qvld.app import App
from qvld.config import Config
from qvld.engine.runners import Generation

ALICE, BOB = 1000, 1001


def test_a_user_sees_only_their_own_generations_and_errors() -> None:
    app = App(Config())
    generations = [Generation(uid=uid) for uid in (ALICE, BOB, BOB)]
    app._generations = lambda: generations  # type: ignore[method-assign]
    for uid in (ALICE, BOB, None):  # None: recorded without a uid
        app.last_errors.append({"at": 0.0, "op": "generate", "code": "bad_request",
                                "uid": uid})
    mine = app.status_details(ALICE)
    assert [g["uid"] for g in mine["generations"]] == [ALICE]
    assert [e["uid"] for e in mine["last_errors"]] == [ALICE]
    everything = app.status_details(None)
    assert [g["uid"] for g in everything["generations"]] == [ALICE, BOB, BOB]
    assert [e["uid"] for e in everything["last_errors"]] == [ALICE, BOB, None]
    assert {g["stage"] for g in everything["generations"]} == {"queued"}
