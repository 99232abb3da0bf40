"""What a keyless listener checks so that a web page cannot act as its visitor.

Without API keys the HTTP API answers as the local user the kernel names (the visitor's
own uid, for a browser on the same machine). Any page the visitor opens could then use
it: a ``fetch(..., {mode: "no-cors"})`` POST of ``text/plain`` or a form needs no CORS
preflight, and a DNS rebinding (a page's own name made to resolve to 127.0.0.1) lets a
page read the answers too. So, as ollama does for the same problem, a keyless listener
refuses:

- a ``Host`` that is not one of its names (TCP only: a browser cannot reach a Unix
  socket): loopback addresses, ``localhost``, the address it listens on, and
  ``http.allowed_hosts``; 421, so that a rebound name reads nothing;
- an ``Origin`` (sent by browsers on every cross-origin request and on same-origin
  POSTs) other than the listener's own (``http://`` + its Host) or one in
  ``http.cors_allow_origins``; 403;
- a POST whose body is not declared JSON (``Content-Type: application/json``): the
  types a page may send without a preflight are never parsed as JSON; 415.

With API keys none of this applies: a page cannot send a key it does not know.
No I/O here; the HTTP front calls ``check`` on every request.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping

from qvld.errors import BadRequest, Forbidden

LOCAL_NAMES = frozenset({"localhost"})


class MisdirectedHost(Forbidden):
    http_status = 421


class CrossSiteOrigin(Forbidden):
    http_status = 403


class NotJson(BadRequest):
    http_status = 415


def host_name(host: str) -> str:
    """The name part of a Host header, lowercase: no port, no IPv6 brackets, no final
    dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    name, _, port = host.rpartition(":")
    if name and port.isdigit():
        host = name
    return host.rstrip(".")


def _loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check(method: str, headers: Mapping[str, str], *, tcp: bool, own_names: Iterable[str],
          cors_allow_origins: Iterable[str]) -> None:
    """Raise the refusal for a request to a keyless listener, or nothing. ``own_names``:
    the address it listens on and ``http.allowed_hosts``."""
    host = headers.get("Host", "")
    names = {host_name(n) for n in own_names} | LOCAL_NAMES
    if tcp and host:
        name = host_name(host)
        if name not in names and not _loopback(name):
            raise MisdirectedHost(
                f"Host {host!r} is not a name of this keyless API (it answers to "
                "localhost, loopback addresses, its listen address and "
                "http.allowed_hosts)")
    origin = headers.get("Origin")
    if origin is not None and method != "OPTIONS":
        own = {f"{scheme}://{host.strip().lower()}" for scheme in ("http", "https")}
        if origin.lower() not in own and origin not in set(cors_allow_origins):
            raise CrossSiteOrigin(
                f"a page from {origin!r} may not call this keyless API: it would act as "
                "the page's visitor (http.cors_allow_origins lists the origins that may)")
    if method == "POST":
        media = headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/")
                                                and media.endswith("+json")):
            raise NotJson(
                f"Content-Type {media or 'none'!r}: this API takes JSON bodies only "
                "(send Content-Type: application/json; curl: -H 'Content-Type: "
                "application/json')")
