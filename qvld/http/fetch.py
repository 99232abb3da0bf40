"""Fetch ``image_url`` URLs from the network without becoming an SSRF proxy.

Only hosts the admin listed are fetched, and only when every address they resolve to is
public (unless the host is also listed in ``allow_private``). Addresses that embed an
IPv4 address (mapped, translated, NAT64, 6to4) are judged by it; the rest of ``::/8``
(IPv4-compatible ``::a.b.c.d`` among it) and local-use NAT64 are never public.

What goes wrong fetching from a host in ``allow_private`` is not told to the client,
only logged: "connection refused" against "timed out" against "HTTP 404" would let any
user map which ports of those internal hosts answer. The client reads one message.

The address check runs in the connector's resolver, so the addresses checked are the
addresses connected to: a DNS answer that changes between a check and the connect
(rebinding) cannot slip through. IP-literal hosts never reach a resolver in aiohttp,
so they are checked before connecting. Redirects are followed by hand, only to the same host.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from collections.abc import Callable, Sequence
from typing import TypeAlias
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from qvld.errors import BadRequest, Forbidden, ImageInvalid, ImageTooLarge, QvlError

__all__ = [
    "ImageFetcher",
    "PublicOnlyResolver",
    "address_is_public",
    "host_matches",
    "normalize_host_pattern",
]

log = logging.getLogger("qvld.http")

MAX_URL_CHARS = 4096
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 << 10
# 6to4 and NAT64 addresses carry an IPv4 address that a gateway may deliver to.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# Reserved (IPv4-compatible ::a.b.c.d, unspecified, loopback...) and local-use NAT64
# (RFC 8215): never the public internet; IPv4-mapped and -translated are judged above.
_NEVER_PUBLIC = (ipaddress.IPv6Network("::/8"), ipaddress.IPv6Network("64:ff9b:1::/48"))
_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip_literal(host: str) -> IPAddress | None:
    """The address if ``host`` is an IP literal (brackets and a zone allowed), else None."""
    host = host.strip("[]").replace("%25", "%")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _canonical_name(name: str) -> str:
    """A host name as yarl puts it on the wire: IDNA-encoded, lower case, no final dot."""
    name = name.strip().rstrip(".")
    try:
        raw = URL.build(scheme="http", host=name).raw_host
    except (ValueError, TypeError, UnicodeError) as exc:
        raise ValueError(f"not a valid host name: {name!r}") from exc
    return (raw or "").rstrip(".")


def normalize_host_pattern(pattern: str) -> str:
    """One ``allow_hosts`` entry in the form :func:`host_matches` compares: ``*``,
    ``*.`` + a canonical domain, a canonical host name, or an IP address (compressed).
    Raises ValueError for anything else, so a bad config entry is refused at start."""
    p = pattern.strip()
    if p == "*":
        return p
    ip = _ip_literal(p)
    if ip is not None:
        return ip.compressed
    if p.startswith("*."):
        suffix = _canonical_name(p[2:])
        if not suffix or "*" in suffix:
            raise ValueError(f"not a valid host pattern: {pattern!r}")
        return "*." + suffix
    name = _canonical_name(p)
    if not name or "*" in name:
        raise ValueError(f"not a valid host pattern: {pattern!r}")
    return name


def _normalize_host(host: str) -> str:
    ip = _ip_literal(host)
    if ip is not None:
        return ip.compressed
    try:
        return _canonical_name(host)
    except ValueError:
        return host.lower().rstrip(".")


def host_matches(host: str, patterns: Sequence[str]) -> bool:
    """Whether ``host`` is allowed by ``patterns``: exact names (case-insensitive, IDNA),
    ``*.example.com`` (subdomains only, not example.com itself), IP literals, or ``*``.
    An empty list matches nothing."""
    h = _normalize_host(host)
    for pattern in patterns:
        p = normalize_host_pattern(pattern)
        if p == "*" or p == h:
            return True
        if p.startswith("*.") and h.endswith(p[1:]) and len(h) > len(p) - 1:
            return True
    return False


def address_is_public(address: str | IPAddress) -> bool:
    """Whether connecting to ``address`` reaches the public internet only."""
    ip = address if not isinstance(address, str) else _ip_literal(address)
    if ip is None:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        # An address that embeds IPv4 is judged by the IPv4 address it reaches.
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and (ip in _NAT64 or ip in _TRANSLATED):
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return address_is_public(embedded)
        if any(ip in network for network in _NEVER_PUBLIC):
            return False
    return ip.is_global and not ip.is_multicast


def _private_refusal(host: str) -> Forbidden:
    return Forbidden(f"image URL host {host!r} resolves to a private, loopback or "
                     "link-local address, and is not in http.fetch_allow_private")


class PublicOnlyResolver(AbstractResolver):
    """Resolves with ``inner`` and refuses any answer holding a non-public address,
    unless the host is in ``allow_private``. The connector connects only to what this
    returns, so the check cannot be raced by a second DNS answer."""

    def __init__(self, inner: AbstractResolver, allow_private: Sequence[str] = ()) -> None:
        self._inner = inner
        self._allow_private = [normalize_host_pattern(p) for p in allow_private]

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        # All or nothing: filtering would still let a mixed answer reach an internal
        # address whenever the public one is down.
        if not host_matches(host, self._allow_private) \
                and any(not address_is_public(r["host"]) for r in results):
            raise _private_refusal(host.rstrip("."))
        return results

    async def close(self) -> None:
        await self._inner.close()


def _unwrap(exc: BaseException) -> QvlError | None:
    """Our own refusal raised in the resolver, if aiohttp wrapped it."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, QvlError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _reason(exc: BaseException) -> str:
    """Why a fetch failed, without the URL: aiohttp puts it in some messages and its
    query string may hold a token."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return "TLS certificate verification failed"
    if isinstance(exc, (aiohttp.ClientSSLError, ssl.SSLError)):
        return "TLS error"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return "could not resolve the host"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or type(exc.os_error).__name__})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "server disconnected"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "malformed response body"
    if isinstance(exc, aiohttp.ClientResponseError):
        return "malformed response"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__


class ImageFetcher:
    """Fetches image URLs under the admin's ``http.fetch_*`` policy (see module doc)."""

    def __init__(self, allow_hosts: Sequence[str], allow_private: Sequence[str] = (),
                 max_bytes: int = 10 << 20, timeout_s: float = 10.0,
                 max_redirects: int = 3) -> None:
        if max_bytes <= 0 or timeout_s <= 0 or max_redirects < 0:
            raise ValueError("max_bytes and timeout_s must be positive, max_redirects >= 0")
        self._allow_hosts = [normalize_host_pattern(p) for p in allow_hosts]
        self._allow_private = [normalize_host_pattern(p) for p in allow_private]
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_redirects = max_redirects
        self._session: aiohttp.ClientSession | None = None
        self._resolver: PublicOnlyResolver | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        # Created here, not in __init__: a session belongs to the loop that runs it.
        if self._session is None or self._session.closed:
            self._resolver = PublicOnlyResolver(aiohttp.ThreadedResolver(),
                                                self._allow_private)
            # No DNS cache: every connection asks the checking resolver afresh.
            connector = aiohttp.TCPConnector(resolver=self._resolver, use_dns_cache=False)
            self._session = aiohttp.ClientSession(
                connector=connector,
                trust_env=False,  # an environment proxy would connect for us, unchecked
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                # Cookies from one user's fetch must not ride along on another's.
                cookie_jar=aiohttp.DummyCookieJar(),
                headers={"User-Agent": "qvld-image-fetch", "Accept": "image/*",
                         "Accept-Encoding": "identity"},
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._resolver is not None:
            # The connector closes only a resolver it created itself.
            await self._resolver.close()
            self._resolver = None

    def _check_url(self, url: str | URL) -> URL:
        """The parsed URL if policy lets us connect to it; IP literals are judged here
        because aiohttp connects to them without asking the resolver."""
        text = str(url)
        if len(text) > MAX_URL_CHARS:
            raise BadRequest(f"image URL is longer than {MAX_URL_CHARS} characters")
        try:
            parsed = url if isinstance(url, URL) else URL(url)
            netloc = urlsplit(text).netloc
        except (ValueError, TypeError, UnicodeError) as exc:
            raise BadRequest("image URL is not a valid URL") from exc
        if parsed.scheme not in ("http", "https"):
            raise BadRequest(f"image URL scheme {parsed.scheme!r} is not allowed "
                             "(only http and https)")
        # yarl drops an empty userinfo ("http://@host/"), so look at the text as well.
        if parsed.raw_user is not None or parsed.raw_password is not None \
                or "@" in netloc:
            raise BadRequest("image URL must not contain user info (user:password@)")
        host = (parsed.raw_host or "").rstrip(".")
        if not host:
            raise BadRequest("image URL has no host")
        if not host_matches(host, self._allow_hosts):
            raise Forbidden(f"image URL host {host!r} is not in http.fetch_allow_hosts")
        ip = _ip_literal(host)
        if ip is None:
            last = host.rsplit(".", 1)[-1]
            if last.isdigit() or last.startswith("0x"):
                # 127.1, 2130706433, 0x7f.1: legacy forms socket maps onto addresses.
                raise BadRequest(f"image URL host {host!r} is not a canonical IP address")
        elif not address_is_public(ip) and not host_matches(host, self._allow_private):
            raise _private_refusal(host)
        return parsed.with_fragment(None)

    def _redirect_target(self, current: URL, location: str | None) -> URL:
        host = (current.raw_host or "").rstrip(".")
        if not location:
            raise ImageInvalid(f"could not fetch image URL {host}: redirect without Location")
        try:
            target = current.join(URL(location))
        except (ValueError, TypeError, UnicodeError) as exc:
            raise ImageInvalid(f"could not fetch image URL {host}: bad redirect") from exc
        same_host = _normalize_host(target.raw_host or "") == _normalize_host(host)
        same_origin = target.scheme == current.scheme and target.port == current.port
        # http -> https of the same host, to its own port or the default one.
        upgrade = (current.scheme, target.scheme) == ("http", "https") \
            and target.port in (current.port, 443)
        if not (same_host and (same_origin or upgrade)):
            other = (target.raw_host or "").rstrip(".")
            raise Forbidden(f"image URL redirects to another host, port or scheme "
                            f"({host!r} -> {other!r}); only same-host redirects are followed")
        return self._check_url(target)

    async def fetch(self, url: str,
                    accept: Callable[[bytes], str | None] | None = None) -> bytes:
        """The body of ``url``; ``accept`` may refuse it (it returns why). Raises
        BadRequest, Forbidden, ImageTooLarge or ImageInvalid (including timeouts:
        ``timeout_s`` bounds the whole fetch); for a host in ``allow_private``, every
        failure after the URL was accepted is one ImageInvalid (see the module doc)."""
        current = self._check_url(url)
        host = (current.raw_host or "").rstrip(".")
        try:
            data = await self._fetch_mapped(current, host)
            why = accept(data) if accept is not None else None
            if why is not None:
                raise ImageInvalid(f"the image at {host} {why}")
            return data
        except QvlError as exc:
            if not host_matches(host, self._allow_private):
                raise
            log.info("image URL fetch from %s (in http.fetch_allow_private) failed: %s",
                     host, exc.message)
            raise ImageInvalid(f"could not fetch an image from image URL host {host!r} "
                               "(why is logged, not shown: it is an internal host)") from None

    async def _fetch_mapped(self, current: URL, host: str) -> bytes:
        try:
            return await asyncio.wait_for(self._fetch(current), self.timeout_s)
        except QvlError:
            raise
        except asyncio.TimeoutError as exc:  # before OSError: TimeoutError is one
            raise ImageInvalid(f"could not fetch image URL: timed out after "
                               f"{self.timeout_s:g} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            ours = _unwrap(exc)
            if ours is not None:
                raise ours from exc
            raise ImageInvalid(f"could not fetch image URL {host}: {_reason(exc)}") from exc

    async def _fetch(self, current: URL) -> bytes:
        session = self._get_session()
        for _ in range(self.max_redirects + 1):
            host = (current.raw_host or "").rstrip(".")
            async with session.get(current, allow_redirects=False) as resp:
                if resp.status in REDIRECT_STATUSES:
                    current = self._redirect_target(current, resp.headers.get("Location"))
                    continue
                if resp.status != 200:
                    raise ImageInvalid(f"could not fetch image URL {host}: "
                                       f"HTTP {resp.status}")
                too_large = ImageTooLarge(f"image at {host} is larger than "
                                          f"{self.max_bytes} bytes")
                if resp.content_length is not None and resp.content_length > self.max_bytes:
                    raise too_large
                body = bytearray()
                async for chunk in resp.content.iter_chunked(_CHUNK):
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise too_large  # leaving the block drops the connection
                log.debug("fetched image URL host %s: %d bytes", host, len(body))
                return bytes(body)
        raise BadRequest(f"image URL redirected more than {self.max_redirects} times")
