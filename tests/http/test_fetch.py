"""The SSRF-safe image fetcher, against a real aiohttp server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

from qvld.errors import BadRequest, Forbidden, ImageInvalid, ImageTooLarge
from qvld.http.fetch import ImageFetcher, PublicOnlyResolver, address_is_public, host_matches

IMAGE = bytes(range(256)) * 8
MAX = 4096  # max_bytes in the size tests; IMAGE fits under it
LOOPBACK = ["127.0.0.1", "localhost"]


@dataclass
class Server:
    port: int
    never: asyncio.Event  # the slow handlers wait on it; only teardown sets it
    hits: Counter[str] = field(default_factory=Counter)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


def _app(server: Server) -> web.Application:
    async def counted(request: web.Request) -> None:
        server.hits[request.path] += 1

    async def image(request: web.Request) -> web.StreamResponse:
        await counted(request)
        return web.Response(body=IMAGE, content_type="image/png")

    async def big(request: web.Request) -> web.StreamResponse:
        # Announces a huge body, sends a little, then stalls: only an early refusal on
        # Content-Length returns before the timeout.
        resp = web.StreamResponse()
        resp.content_length = 1 << 30
        await resp.prepare(request)
        await resp.write(b"x" * 100)
        await server.never.wait()
        return resp

    async def stream(request: web.Request) -> web.StreamResponse:
        # No Content-Length; more than MAX arrives, then it stalls: only a reader that
        # stops at the limit returns before the timeout.
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for _ in range(2 * MAX // 512 + 1):
            await resp.write(b"y" * 512)
        await server.never.wait()
        return resp

    async def slow(request: web.Request) -> web.StreamResponse:
        await server.never.wait()
        return web.Response(body=IMAGE)

    def redirect(location: Callable[[], str]) -> Callable[[web.Request],
                                                          Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            await counted(request)
            raise web.HTTPFound(location())
        return handler

    app = web.Application()
    app.router.add_get("/image", image)
    app.router.add_get("/big", big)
    app.router.add_get("/stream", stream)
    app.router.add_get("/slow", slow)
    app.router.add_get("/redirect", redirect(lambda: "/image"))
    app.router.add_get("/redirect-other-host",
                       redirect(lambda: server.url("/image", host="localhost")))
    app.router.add_get("/redirect-other-port",
                       redirect(lambda: f"http://127.0.0.1:{server.port + 1}/image"))
    app.router.add_get("/redirect-https",
                       redirect(lambda: f"https://127.0.0.1:{server.port}/image"))
    app.router.add_get("/loop", redirect(lambda: "/loop"))
    return app


@contextlib.asynccontextmanager
async def serve() -> AsyncIterator[Server]:
    server = Server(port=0, never=asyncio.Event())
    runner = web.AppRunner(_app(server), handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    server.port = runner.addresses[0][1]
    try:
        yield server
    finally:
        server.never.set()  # release stalled handlers so cleanup does not wait on them
        await runner.cleanup()


def run(body: Callable[[Server], Awaitable[None]]) -> None:
    """Run ``body`` against a fresh server in a fresh loop (no pytest-asyncio here)."""
    async def main() -> None:
        async with serve() as server:
            await body(server)
    asyncio.run(main())


async def fetch(url: str, allow_hosts: Sequence[str], allow_private: Sequence[str] = (),
                accept: Callable[[bytes], str | None] | None = None,
                **kwargs: Any) -> bytes:
    fetcher = ImageFetcher(allow_hosts, allow_private, **kwargs)
    try:
        return await fetcher.fetch(url, accept)
    finally:
        await fetcher.close()


def test_allowed_private_host_fetches_the_exact_bytes(caplog: pytest.LogCaptureFixture
                                                      ) -> None:
    async def body(s: Server) -> None:
        fetcher = ImageFetcher(["127.0.0.1"], ["127.0.0.1"])
        try:
            assert await fetcher.fetch(s.url("/image")) == IMAGE
            session = fetcher._session
            assert await fetcher.fetch(s.url("/image?x=1")) == IMAGE
            assert fetcher._session is session  # one session, reused
        finally:
            await fetcher.close()
        assert fetcher._session is None
    with caplog.at_level(logging.DEBUG, logger="qvld.http"):
        run(body)
    assert f"127.0.0.1: {len(IMAGE)} bytes" in caplog.text


def test_loopback_refused_unless_allow_private() -> None:
    async def body(s: Server) -> None:
        with pytest.raises(Forbidden, match=re.escape("'127.0.0.1' resolves to a private")):
            await fetch(s.url("/image"), ["127.0.0.1"])
        # A name goes through the resolver path, not the literal check.
        with pytest.raises(Forbidden, match=re.escape("'localhost' resolves to a private")):
            await fetch(s.url("/image", host="localhost"), ["localhost"])
        # "*" allows every host, but still no private addresses.
        for host in LOOPBACK:
            with pytest.raises(Forbidden, match="private"):
                await fetch(s.url("/image", host=host), ["*"])
        assert s.hits["/image"] == 0
        # allow_private for one name does not cover the other.
        with pytest.raises(Forbidden, match=re.escape("'localhost' resolves to a private")):
            await fetch(s.url("/image", host="localhost"), ["*"], ["127.0.0.1"])
    run(body)


def test_localhost_allowed_private_is_fetched() -> None:
    async def body(s: Server) -> None:
        assert await fetch(s.url("/image", host="localhost"), ["*"], ["LOCALHOST"]) == IMAGE
    run(body)


def test_host_not_in_allow_hosts() -> None:
    async def body(s: Server) -> None:
        msg = "image URL host '127.0.0.1' is not in http.fetch_allow_hosts"
        with pytest.raises(Forbidden, match=re.escape(msg)):
            await fetch(s.url("/image"), ["localhost"], ["127.0.0.1"])
        with pytest.raises(Forbidden, match=re.escape("not in http.fetch_allow_hosts")):
            await fetch(s.url("/image"), [], ["*"])
        assert s.hits["/image"] == 0
    run(body)


@pytest.mark.parametrize("url", [
    "http://10.0.0.1/x.png",
    "http://169.254.169.254/latest/meta-data/",
    "http://[::1]/x.png",
    "http://[::ffff:127.0.0.1]/x.png",
    "http://0.0.0.0/x.png",
    "http://224.0.0.1/x.png",
    "http://[fe80::1%25eth0]/x.png",
    "http://[64:ff9b::a9fe:a9fe]/x.png",  # NAT64 of 169.254.169.254
    "https://[2002:7f00:1::]/x.png",  # 6to4 of 127.0.0.1
    "http://[::127.0.0.1]/x.png",  # IPv4-compatible (deprecated) loopback
    "http://[::ffff:0:127.0.0.1]/x.png",  # IPv4-translated loopback
    "http://[64:ff9b:1::a9fe:a9fe]/x.png",  # local-use NAT64
    "http://[::8.8.8.8]/x.png",  # IPv4-compatible: reserved space, never public
])
def test_private_literals_refused_without_connecting(url: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_connect(*args: object, **kwargs: object) -> None:
        raise AssertionError("a connection was attempted")
    monkeypatch.setattr(aiohttp.TCPConnector, "connect", no_connect)
    start = time.monotonic()
    with pytest.raises(Forbidden, match="resolves to a private, loopback or link-local"):
        asyncio.run(fetch(url, ["*"]))
    assert time.monotonic() - start < 1


@pytest.mark.parametrize(("url", "match"), [
    ("ftp://127.0.0.1/x.png", "scheme 'ftp'"),
    ("file:///etc/passwd", "scheme 'file'"),
    ("http://user:pass@127.0.0.1/x.png", "user info"),
    ("http://user@127.0.0.1/x.png", "user info"),
    ("http://@127.0.0.1/x.png", "user info"),
    ("http://127.0.0.1/" + "a" * 4096, "longer than 4096"),
    ("http:///x.png", "no host"),
    ("http://127.1/x.png", "not a canonical IP"),
    ("http://2130706433/x.png", "not a canonical IP"),
    ("http://0x7f.1/x.png", "not a canonical IP"),
])
def test_bad_urls(url: str, match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        asyncio.run(fetch(url, ["*"], ["*"]))


UNIFORM = "could not fetch an image from image URL host '127.0.0.1'"


async def failure(url: str, caplog: pytest.LogCaptureFixture, **kwargs: Any) -> str:
    """Fetch ``url`` from a host in allow_private, which must fail with the one message
    that says nothing about the host; what the log says went wrong."""
    kwargs.setdefault("allow_hosts", LOOPBACK)
    kwargs.setdefault("allow_private", LOOPBACK)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="qvld.http"), \
            pytest.raises(ImageInvalid) as info:
        await fetch(url, **kwargs)
    assert str(info.value).startswith(UNIFORM), info.value
    assert "token" not in str(info.value)
    reasons = [r.getMessage() for r in caplog.records if "failed:" in r.getMessage()]
    assert len(reasons) == 1, caplog.text
    return reasons[0]


def test_redirects(caplog: pytest.LogCaptureFixture) -> None:
    async def body(s: Server) -> None:
        both: dict[str, Any] = dict(allow_hosts=LOOPBACK, allow_private=LOOPBACK)
        assert await fetch(s.url("/redirect"), **both) == IMAGE
        assert s.hits["/redirect"] == 1 and s.hits["/image"] == 1
        assert "redirects to another host" in await failure(s.url("/redirect-other-host"),
                                                            caplog)
        assert "redirects to another host" in await failure(s.url("/redirect-other-port"),
                                                            caplog)
        assert s.hits["/image"] == 1
        assert "redirected more than 3 times" in await failure(s.url("/loop"), caplog)
        assert s.hits["/loop"] == 4  # the first request and 3 redirects followed
        assert "more than 0 times" in await failure(s.url("/redirect"), caplog,
                                                    max_redirects=0)
        # An https upgrade of the same host is followed (this server does not speak TLS).
        assert "127.0.0.1: TLS" in await failure(s.url("/redirect-https"), caplog)
    run(body)


def test_failures_at_an_internal_host_all_read_the_same(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    """A refused port, a 404, a TLS error, a timeout, a body that is too large or not an
    image: the client cannot tell them apart (a port scan of internal hosts learns
    nothing); the log says which, naming the host and never the URL's query."""
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]

    async def body(s: Server) -> None:
        reasons = [
            await failure(f"http://127.0.0.1:{closed_port}/x?token=s3cret", caplog),
            await failure(s.url("/missing?token=s3cret"), caplog),
            await failure(f"https://127.0.0.1:{s.port}/image?token=s3cret", caplog),
            await failure(s.url("/slow"), caplog, timeout_s=0.5),
            await failure(s.url("/big"), caplog, max_bytes=MAX, timeout_s=5.0),
            await failure(s.url("/image"), caplog,
                          accept=lambda data: "is not PNG, JPEG, WebP, GIF or BMP"),
        ]
        expected = ["127.0.0.1: cannot connect", "127.0.0.1: HTTP 404",
                    "127.0.0.1: TLS error", "timed out after 0.5 s",
                    f"larger than {MAX} bytes", "is not PNG, JPEG, WebP, GIF or BMP"]
        for reason, wanted in zip(reasons, expected, strict=True):
            assert wanted in reason and "s3cret" not in reason, reason
    run(body)


def test_public_hosts_keep_their_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside allow_private, the client is told what went wrong (the loopback server
    stands in for a public one: the address check is what allow_private lifts)."""
    monkeypatch.setattr("qvld.http.fetch.address_is_public", lambda address: True)

    async def body(s: Server) -> None:
        with pytest.raises(ImageInvalid, match=re.escape("image URL 127.0.0.1: HTTP 404")):
            await fetch(s.url("/missing?token=s3cret"), ["127.0.0.1"])
        with pytest.raises(ImageInvalid, match=r"timed out after 0.5 s"):
            await fetch(s.url("/slow"), ["127.0.0.1"], timeout_s=0.5)
        with pytest.raises(ImageTooLarge, match=f"larger than {MAX} bytes"):
            await fetch(s.url("/stream"), ["127.0.0.1"], max_bytes=MAX, timeout_s=5.0)
        with pytest.raises(Forbidden, match="redirects to another host"):
            await fetch(s.url("/redirect-other-port"), ["127.0.0.1"])
    run(body)


def test_size_limits(caplog: pytest.LogCaptureFixture) -> None:
    async def body(s: Server) -> None:
        small: dict[str, Any] = dict(max_bytes=MAX, timeout_s=5.0)
        assert await fetch(s.url("/image"), ["*"], ["*"], **small) == IMAGE
        start = time.monotonic()
        assert f"larger than {MAX} bytes" in await failure(s.url("/big"), caplog, **small)
        assert f"larger than {MAX} bytes" in await failure(s.url("/stream"), caplog,
                                                           **small)
        # Both stall after sending: returning before the timeout shows we stopped early.
        assert time.monotonic() - start < 2.5
        assert "larger than" in await failure(s.url("/image"), caplog,
                                              max_bytes=len(IMAGE) - 1)
    run(body)


def test_host_matches() -> None:
    wild = ["*.example.com"]
    assert host_matches("a.example.com", wild)
    assert host_matches("a.b.EXAMPLE.com.", wild)
    assert not host_matches("example.com", wild)
    assert not host_matches("badexample.com", wild)
    assert not host_matches("example.com.evil.net", wild)
    assert host_matches("Example.COM", ["example.com"])
    assert not host_matches("a.example.com", ["example.com"])
    assert host_matches("xn--exmple-cua.com", ["exämple.com"])
    assert host_matches("EXÄMPLE.com", ["xn--exmple-cua.com"])
    assert host_matches("anything.at.all", ["*"])
    assert not host_matches("example.com", [])
    assert host_matches("::ffff:7f00:1", ["[::ffff:127.0.0.1]"])
    assert host_matches("[::1]", ["::1"])
    assert not host_matches("127.0.0.2", ["127.0.0.1"])
    for bad in ("a.*.com", "*example.com", "*.", ""):
        with pytest.raises(ValueError):
            host_matches("a.example.com", [bad])
    with pytest.raises(ValueError):
        ImageFetcher(["ex*ample.com"])


def test_address_is_public() -> None:
    assert address_is_public("93.184.216.34")
    assert address_is_public("2606:2800:220:1:248:1893:25c8:1946")
    for private in ("127.0.0.1", "10.1.2.3", "192.168.0.1", "172.16.0.1", "100.64.0.1",
                    "169.254.169.254", "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1",
                    "::", "fe80::1", "fc00::1", "::ffff:10.0.0.1", "ff02::1", "not an ip",
                    "::127.0.0.1", "::8.8.8.8", "::ffff:0:10.0.0.1", "64:ff9b:1::8.8.8.8"):
        assert not address_is_public(private), private


class FakeResolver(AbstractResolver):
    def __init__(self, *addresses: str) -> None:
        self.addresses = addresses
        self.closed = False

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        return [ResolveResult(hostname=host, host=a, port=port, family=socket.AF_INET,
                              proto=0, flags=0) for a in self.addresses]

    async def close(self) -> None:
        self.closed = True


def test_resolver_refuses_private_answers() -> None:
    async def resolve(inner: FakeResolver, host: str = "img.example.com",
                      allow_private: Sequence[str] = ()) -> list[str]:
        resolver = PublicOnlyResolver(inner, allow_private)
        return [r["host"] for r in await resolver.resolve(host, 443)]

    public = "93.184.216.34"
    assert asyncio.run(resolve(FakeResolver(public))) == [public]
    for answer in (["10.0.0.7"], [public, "127.0.0.1"], ["::ffff:192.168.1.1"]):
        with pytest.raises(Forbidden, match=re.escape("'img.example.com' resolves to a private")):
            asyncio.run(resolve(FakeResolver(*answer)))
    internal = asyncio.run(resolve(FakeResolver("10.0.0.7"), "cam.lan", ["*.lan"]))
    assert internal == ["10.0.0.7"]

    inner = FakeResolver()
    asyncio.run(PublicOnlyResolver(inner).close())
    assert inner.closed
