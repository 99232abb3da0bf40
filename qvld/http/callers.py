"""Who an HTTP request comes from.

With ``http.api_keys_file``, a bearer key (or Anthropic's ``x-api-key``) names the user;
HTTP users get ids above every uid (``keys.HTTP_USER_ID_BASE``), so a key never stands
for root or for a socket user. Without a keys file a caller is who the kernel says
(``qvld.http.listener``): the uid owning the client's end of a loopback TCP connection,
or SO_PEERCRED on an HTTP Unix socket, authorised exactly as on the protocol socket
(``server.allow_uids``, ``allow_groups``) and served as that uid: its own sessions,
caches and share of the queue. An ``Authorization`` header is then ignored. Callers
from other hosts need a key.

A key taken out of the file by a reload ends its user's sessions and generations; a
generation ended so is answered 401, not "retry".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from qvld.config import HttpConfig
from qvld.errors import Forbidden, QvlError, Unavailable
from qvld.http.fetch import normalize_host_pattern
from qvld.http.keys import ApiKeys, KeyFileError, UserIds, parse_bearer
from qvld.http.listener import Connections
from qvld.server import AccessPolicy, Peer

if TYPE_CHECKING:
    from qvld.engine import Engine

log = logging.getLogger("qvld.http")


@dataclass(frozen=True)
class Caller:
    """Who an HTTP request comes from: the peer the handlers, scheduler, sessions and
    caches key on, and how logs name it: ``user`` (a key's name) or ``uid``."""

    peer: Peer
    name_field: tuple[str, str | int]

    @property
    def log_name(self) -> str:
        return "{}={}".format(*self.name_field)


class Unauthorized(QvlError):
    """No key, or one the keys file does not hold (HTTP 401)."""

    code = "invalid_api_key"


class HttpSetupError(Exception):
    """What keeps the HTTP section from being applied: every problem, one per line."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


def load_http(config: HttpConfig) -> ApiKeys | None:
    """The keys file's keys (None: loopback clients only), with the fetch allow-lists
    checked too; raises HttpSetupError, so a start fails and a reload keeps the old."""
    errors = []
    keys = None
    if config.api_keys_file is not None:
        try:
            keys = ApiKeys.load(config.api_keys_file)
        except KeyFileError as exc:
            errors += [f"http.api_keys_file: {line}" for line in exc.errors]
    if config.fetch_image_urls:
        for pattern in (*config.fetch_allow_hosts, *config.fetch_allow_private):
            try:
                normalize_host_pattern(pattern)
            except ValueError as exc:
                errors.append(f"http.fetch_allow_hosts/fetch_allow_private: {exc}")
    if errors:
        raise HttpSetupError(errors)
    return keys


class Callers:
    """Tells who each request comes from, by its key or by the kernel's word, and
    remembers the users whose keys a reload revoked."""

    def __init__(self, keys: ApiKeys | None, connections: Connections,
                 policy: Callable[[], AccessPolicy]) -> None:
        self.keys = keys
        self.connections = connections
        # The socket's access decision, as it stands after the last reload.
        self.policy = policy
        self.users = UserIds()
        self.revoked_uids: set[int] = set()

    async def identify(self, request: web.Request) -> Caller:
        """Who is asking (see the module docstring), or 401/403. The caller is left on
        the request (``request["caller"]``) for its log line, a refusal's too."""
        if self.keys is not None:
            key = parse_bearer(request.headers.get("Authorization")) \
                or request.headers.get("x-api-key") or None
            if key is None:
                raise Unauthorized("an API key is needed: Authorization: Bearer <key> "
                                   "(or x-api-key: <key>)")
            found = self.keys.identify(key)
            if found is None:
                raise Unauthorized("the API key is not valid")
            uid = self.users.id(*found)
            caller = Caller(Peer(pid=0, uid=uid, gid=uid, groups=frozenset()),
                            ("user", found[0]))
            request["caller"] = caller
            return caller
        peer = await self.connections.peer_of(request.transport)
        if peer == "remote":
            raise Forbidden("this listener serves local users only: callers from "
                            "other hosts need an API key (http.api_keys_file)")
        if not isinstance(peer, Peer):
            raise Forbidden("the kernel shows no open socket of this machine at the "
                            "other end of this connection; cannot tell who is asking")
        caller = Caller(peer, ("uid", peer.uid))
        request["caller"] = caller
        if not self.policy().allowed(peer):
            log.warning("HTTP: refused uid %d: not allowed", peer.uid)
            raise Forbidden(f"uid {peer.uid} may not use this daemon; ask for "
                            "membership of one of server.allow_groups")
        return caller

    def stopped(self, request: web.Request) -> QvlError:
        """Why the daemon, not the client, ended a generation: its key was revoked, or
        the daemon is shutting down."""
        caller = request.get("caller")
        if caller is not None and caller.peer.uid in self.revoked_uids:
            return Unauthorized("the API key was revoked while this generation ran")
        return Unavailable("the daemon stopped this generation (it is shutting down); "
                           "retry")

    def rekey(self, keys: ApiKeys | None) -> dict[str, str]:
        """A reload's keys; the keys (hash -> user name) no longer in the file."""
        old, self.keys = self.keys, keys
        if old is None:
            return {}
        kept = dict(keys.users_by_hash) if keys is not None else {}
        return {h: n for h, n in old.users_by_hash.items() if kept.get(h) != n}

    def revoke(self, revoked: dict[str, str], engine: Engine | None) -> None:
        """End the sessions and generations of keys (hash -> name) taken out of the
        keys file."""
        if not revoked:
            return
        ended = cancelled = 0
        for key_hash, name in revoked.items():
            uid = self.users.known(name, key_hash)
            if uid is not None and engine is not None:
                ended += engine.close_user_sessions(uid)
                # Its generations in flight end too: a revoked key gets nothing more.
                self.revoked_uids.add(uid)
                for gen in engine.generations():
                    if gen.uid == uid:
                        engine.cancel(gen)
                        cancelled += 1
        log.info("API keys revoked: %s (sessions ended: %d, generations cancelled: %d)",
                 ", ".join(sorted(revoked.values())), ended, cancelled)
