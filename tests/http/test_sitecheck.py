"""What a keyless listener refuses so that a web page cannot act as its visitor: the
checks alone (no I/O), then against the real daemon."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from qvld.http.sitecheck import CrossSiteOrigin, MisdirectedHost, NotJson, check, host_name
from tests.test_http import HttpDaemon

JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize(("header", "name"), [
    ("127.0.0.1:8090", "127.0.0.1"), ("LocalHost", "localhost"), ("[::1]:80", "::1"),
    ("qvld.lan.", "qvld.lan"), ("example.com:notaport", "example.com:notaport")])
def test_host_names(header: str, name: str) -> None:
    assert host_name(header) == name


def allowed(method: str = "POST", tcp: bool = True, **headers: str) -> None:
    check(method, {**JSON, **headers}, tcp=tcp, own_names=["qvld.lan"],
          cors_allow_origins=["http://app.example:3000"])


def test_what_passes() -> None:
    allowed(Host="127.0.0.1:8090")
    allowed(Host="127.5.6.7")  # all of 127/8 is loopback
    allowed(Host="localhost:8090", Origin="http://localhost:8090")  # the page's own POST
    allowed(Host="[::1]:8090")
    allowed(Host="qvld.lan")  # http.allowed_hosts
    allowed(Host="127.0.0.1", Origin="http://app.example:3000")  # cors_allow_origins
    allowed(Host="rebind.example", tcp=False)  # a browser cannot reach a Unix socket
    allowed("GET", Host="127.0.0.1", **{"Content-Type": ""})  # types only for POST
    allowed(Host="127.0.0.1", **{"Content-Type": "application/json; charset=utf-8"})
    allowed("OPTIONS", Host="127.0.0.1", Origin="http://evil.example")  # preflight: 405


@pytest.mark.parametrize(("headers", "error"), [
    ({"Host": "rebind.example:8090"}, MisdirectedHost),
    ({"Host": "127.0.0.1.evil.example"}, MisdirectedHost),
    ({"Host": "127.0.0.1", "Origin": "http://evil.example"}, CrossSiteOrigin),
    ({"Host": "127.0.0.1", "Origin": "null"}, CrossSiteOrigin),
    ({"Host": "127.0.0.1:8090", "Origin": "http://127.0.0.1:9999"}, CrossSiteOrigin),
    ({"Host": "127.0.0.1", "Content-Type": "text/plain"}, NotJson),
    ({"Host": "127.0.0.1", "Content-Type": "application/x-www-form-urlencoded"}, NotJson),
    ({"Host": "127.0.0.1", "Content-Type": "multipart/form-data; boundary=x"}, NotJson),
    ({"Host": "127.0.0.1", "Content-Type": ""}, NotJson),
])
def test_what_is_refused(headers: dict[str, str], error: type[Exception]) -> None:
    with pytest.raises(error):
        allowed(**headers)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    d = HttpDaemon(tmp_path_factory.mktemp("sitecheck"),
                   args=["--set", 'http.allowed_hosts=["qvld.lan"]']).start()
    try:
        yield d
    finally:
        d.stop()


HI = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}'


def post(daemon: HttpDaemon, **headers: str) -> tuple[int, Any]:
    status, _, body = daemon.request("POST", "/v1/chat/completions", HI, headers)
    return status, body


def test_the_daemon_refuses_what_a_page_could_send_as_its_visitor(daemon: HttpDaemon) -> None:
    served = f"127.0.0.1:{daemon.port}"
    for content_type in ("text/plain", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x"):
        status, body = post(daemon, **{"Content-Type": content_type})
        assert status == 415 and "application/json" in body["error"]["message"]
    status, body = post(daemon, Origin="http://evil.example")
    assert status == 403 and body["error"]["code"] == "forbidden"
    status, body = post(daemon, Host=f"rebind.example:{daemon.port}")
    assert status == 421 and "allowed_hosts" in body["error"]["message"]
    status, _, body = daemon.request("GET", "/v1/models",
                                     headers={"Host": "rebind.example"})
    assert status == 421  # a rebound page reads nothing, not even the model list
    # What the API's own users send is served.
    for headers in ({}, {"Origin": f"http://{served}"}, {"Host": f"localhost:{daemon.port}"},
                    {"Host": "qvld.lan"}):
        status, body = post(daemon, **headers)
        assert status == 200 and body["usage"]["completion_tokens"] == 2, (headers, body)
    assert daemon.openai().models.list().data  # the openai client, as ever


@pytest.mark.slow  # a daemon of its own: the default tier stays under 5 minutes
def test_with_keys_a_page_cannot_act_as_anyone(tmp_path: Any) -> None:
    """With API keys the checks are off: a page cannot send a key it does not know, and
    a caller with one may be anywhere (a proxy, another origin listed or not)."""
    from qvld.http.keys import hash_key

    key = "qvld-test-key-alice-0123456789"
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{hash_key(key)}\n")
    keys.chmod(0o600)
    d = HttpDaemon(tmp_path, args=["--set", f"http.api_keys_file={keys}"]).start()
    try:
        status, _ = post(d, Host="proxy.example", Origin="http://other.example",
                         Authorization=f"Bearer {key}")
        assert status == 200
        assert post(d, Origin="http://evil.example")[0] == 401  # no key: no one
    finally:
        d.stop()
