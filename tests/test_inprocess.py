"""Server, Handlers and App in this process, with their injected callbacks: what each
component does on its own, without a model (the daemon tests cover them together)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from qvld import protocol
from qvld.app import App
from qvld.config import Config, ServerConfig
from qvld.handlers import ADMIN_ONLY_CONFIG, HIDDEN, DaemonState, Handlers
from qvld.prepare import PrepareStage
from qvld.server import AccessPolicy, Peer, RequestContext, Server


class Policy(AccessPolicy):
    """Lets in exactly the uids given, whatever the process's own uid."""

    def __init__(self, config: ServerConfig, allowed: set[int]) -> None:
        super().__init__(config)
        self.allowed_uids = allowed

    def allowed(self, peer: Peer) -> bool:
        return peer.uid in self.allowed_uids


async def exchange(path: Path, *messages: dict[str, Any]) -> list[dict[str, Any] | None]:
    """Send ``messages`` on one connection; one reply each (None once the line closes)."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    replies: list[dict[str, Any] | None] = []
    for message in messages:
        writer.write(protocol.pack(message))
        try:
            header = await asyncio.wait_for(reader.readexactly(4), 10)
            payload = await reader.readexactly(protocol.frame_length(header, 1 << 20))
            replies.append(dict(protocol.unpack(payload)))
        except asyncio.IncompleteReadError:
            replies.append(None)
    writer.close()
    return replies


def serve(tmp_path: Path, dispatch: Any, allowed: set[int] | None = None,
          **limits: Any) -> tuple[Server, list[tuple[object, str, int]]]:
    config = ServerConfig(socket=tmp_path / "s.sock", **limits)
    replies: list[tuple[object, str, int]] = []
    policy = Policy(config, {os.getuid()} if allowed is None else allowed)
    server = Server(config, dispatch, policy,
                    on_reply=lambda op, outcome, seconds, uid: replies.append((op, outcome,
                                                                               uid)))
    return server, replies


def test_server_reports_each_reply_with_its_outcome_and_uid(tmp_path: Path) -> None:
    async def dispatch(ctx: RequestContext) -> Any:
        if ctx.request.op == "status":
            ctx.outcome = "cancelled"  # the handler, not the server, decides
        return {"op": ctx.request.op}

    server, replies = serve(tmp_path, dispatch)

    async def scenario() -> list[dict[str, Any] | None]:
        await server.start()
        try:
            return await exchange(server.config.socket, {"id": 1, "op": "health"},
                                  {"id": 2, "op": "status"}, {"id": 3, "op": "dance"})
        finally:
            await server.close()

    got = asyncio.run(scenario())
    assert [r["result"]["op"] if r["ok"] else r["error"]["code"] for r in got
            if r is not None] == ["health", "status", "bad_request"]
    uid = os.getuid()
    assert replies == [("health", "ok", uid), ("status", "cancelled", uid),
                       ("dance", "bad_request", uid)]


def test_server_refuses_a_peer_the_policy_refuses_without_dispatching(tmp_path: Path) -> None:
    called: list[str] = []

    async def dispatch(ctx: RequestContext) -> Any:
        called.append(ctx.request.op)
        return {}

    async def scenario() -> list[dict[str, Any] | None]:
        server, _ = serve(tmp_path, dispatch, allowed=set())
        await server.start()
        try:
            return await exchange(server.config.socket, {"id": 5, "op": "health"})
        finally:
            await server.close()

    (reply,) = asyncio.run(scenario())
    assert reply is not None and reply["id"] == 5 and reply["error"]["code"] == "forbidden"
    assert called == []


def test_server_closes_an_idle_connection_but_not_a_busy_one(tmp_path: Path) -> None:
    release = asyncio.Event()

    async def dispatch(ctx: RequestContext) -> Any:
        if ctx.request.op == "generate":
            await release.wait()
        return {}

    async def scenario() -> tuple[bytes, dict[str, Any] | None]:
        server, _ = serve(tmp_path, dispatch, idle_timeout_s=0.3)
        await server.start()
        try:
            idle_reader, _idle = await asyncio.open_unix_connection(str(server.config.socket))
            closed = await asyncio.wait_for(idle_reader.read(1), 5)  # b"": closed
            reader, writer = await asyncio.open_unix_connection(str(server.config.socket))
            writer.write(protocol.pack({"id": 1, "op": "generate"}))
            await asyncio.sleep(0.8)  # the scenario: well past idle_timeout_s, in flight
            release.set()
            header = await asyncio.wait_for(reader.readexactly(4), 5)
            reply = protocol.unpack(await reader.readexactly(protocol.frame_length(header,
                                                                                   1 << 20)))
            writer.close()
            return closed, dict(reply)
        finally:
            await server.close()

    closed, reply = asyncio.run(scenario())
    assert closed == b""
    assert reply is not None and reply["ok"]


def _handlers(config: Config, admin: bool, **callbacks: Any) -> Handlers:
    state = DaemonState(config, state="ready")
    return Handlers(state, PrepareStage(1, 1),
                    is_admin=lambda peer: admin, **callbacks)


def _context(op: str, params: dict[str, Any] | None = None, uid: int = 1000) -> RequestContext:
    conn: Any = None
    return RequestContext(request=protocol.Request(1, op, params or {}),
                          peer=Peer(pid=1, uid=uid, gid=uid, groups=frozenset()),
                          connection=conn)


@pytest.mark.parametrize("admin", [True, False])
def test_handlers_config_masks_what_only_admins_see(admin: bool) -> None:
    config = Config.model_validate({"server": {"allow_uids": [1000]},
                                    "model": {"path": "/srv/models/x"}})
    handlers = _handlers(config, admin)
    shown = asyncio.run(handlers(_context("config")))
    for section, key in ADMIN_ONLY_CONFIG:
        assert (shown[section][key] == HIDDEN) != admin, (section, key)
    assert shown["server"]["queue_max"] == config.server.queue_max


def test_handlers_call_their_injected_callbacks() -> None:
    calls: list[str] = []

    async def reload() -> dict[str, Any]:
        calls.append("reload")
        return {"reloaded": True}

    def extra(viewer: int | None) -> dict[str, Any]:
        calls.append(f"status for {viewer}")
        return {"generations": []}

    handlers = _handlers(Config(), admin=False, reload=reload, extra_status=extra,
                         preflight=lambda: {"ok": True, "checks": [], "tuning": []},
                         in_flight=lambda: 3)
    status = asyncio.run(handlers(_context("status", uid=42)))
    assert status["requests_in_flight"] == 3 and status["model"] is None
    assert asyncio.run(handlers(_context("preflight")))["ok"] is True
    with pytest.raises(Exception, match="admin"):
        asyncio.run(handlers(_context("reload")))
    admin = _handlers(Config(), admin=True, reload=reload)
    assert asyncio.run(admin(_context("reload"))) == {"reloaded": True}
    assert calls == ["status for 42", "reload"]
    health = asyncio.run(handlers(_context("health")))
    assert health == {"state": "ready", "ready": False}  # no engine yet


def test_app_records_errors_per_uid_and_shows_each_user_their_own() -> None:
    app = App(Config())
    app._on_reply("generate", "bad_request", 0.01, 1000)
    app._on_reply("status", "ok", 0.01, 1000)
    app._on_reply("generate", "busy", 0.01, 2000)
    mine = app.status_details(viewer=1000)["last_errors"]
    assert [(e["uid"], e["code"]) for e in mine] == [(1000, "bad_request")]
    everyone = app.status_details(viewer=None)["last_errors"]
    assert [e["uid"] for e in everyone] == [1000, 2000]
    text = app.metrics.exposition()
    assert 'qvld_requests_total{api="socket",op="generate",outcome="busy"} 1.0' in text


def test_the_server_socket_has_the_configured_mode_and_goes_on_close(tmp_path: Path
                                                                       ) -> None:
    async def scenario() -> int:
        server, _ = serve(tmp_path, lambda ctx: asyncio.sleep(0), socket_mode="0600")
        await server.start()
        try:
            return os.stat(server.config.socket).st_mode & 0o777
        finally:
            await server.close()

    assert asyncio.run(scenario()) == 0o600
    assert not (tmp_path / "s.sock").exists()  # removed on close
