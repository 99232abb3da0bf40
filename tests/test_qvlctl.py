"""qvlctl against daemons that misbehave or are out of reach.

A fake daemon (a thread on a real Unix socket) answers each request with chosen raw
frames, so every test drives the real command line (or the real client) through the
real socket code: control characters in answers, answers cut short by a drain,
malformed replies, a socket this user may not open, an empty --socket.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from qvlctl import cli, render
from qvlctl.chat import Chat
from qvlctl.client import DEFAULT_SOCKET, Client
from qvld import protocol
from tests.conftest import NOBODY, Daemon, run_qvlctl

Responder = Callable[[dict[str, Any]], list[bytes]]

# Everything a terminal could act on, split across tokens, plus text that must survive.
EVIL_TOKENS = ["red\x1b", "[31m!\x1b]0;pwned\x07 ", "\x9b2J\rdone\x7f", "\ttab\nline2 é 中"]
EVIL = "".join(EVIL_TOKENS)
EVIL_SHOWN = "red\\x1b[31m!\\x1b]0;pwned\\x07 \\x9b2J\\x0ddone\\x7f\ttab\nline2 é 中"


# -- a fake daemon ----------------------------------------------------------------------


def frame(payload: bytes) -> bytes:
    return protocol.HEADER.pack(len(payload)) + payload


def packed(message: Any) -> bytes:
    """Any msgpack value as a frame (protocol.pack only takes maps)."""
    return frame(msgpack.packb(message, use_bin_type=True))


def ok(rid: int, result: Any) -> bytes:
    return packed({"id": rid, "ok": True, "result": result})


def generate_result(text: str, finish: str = "stop") -> dict[str, Any]:
    return {"text": text, "token_ids": [5, 6, 7], "finish_reason": finish,
            "usage": {"prompt_tokens": 9, "completion_tokens": 3, "image_tokens": 0,
                      "cached_tokens": 0},
            "timings": {"queue_s": 0.0, "image_s": 0.0, "prefill_s": 0.01, "ttft_s": 0.01,
                        "decode_s": 0.02, "total_s": 0.03}}


def answers(pieces: list[str], finish: str = "stop",
            others: dict[str, Any] | None = None) -> Responder:
    """A daemon that streams ``pieces`` for generate and answers other ops from ``others``."""
    def respond(request: dict[str, Any]) -> list[bytes]:
        rid = request["id"]
        if request["op"] != "generate":
            return [ok(rid, (others or {}).get(request["op"], {"closed": True}))]
        events = [packed(protocol.token_event(rid, p, [1])) for p in pieces] \
            if request["params"].get("stream") else []
        return [*events, ok(rid, generate_result("".join(pieces), finish))]
    return respond


class FakeDaemon:
    """A Unix socket answering each request with the frames ``respond`` returns."""

    def __init__(self, path: Path, respond: Responder) -> None:
        self.path, self.respond = path, respond
        self.requests: list[dict[str, Any]] = []
        self.stopping = threading.Event()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self.listener.settimeout(0.1)
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                self.converse(conn)

    def converse(self, conn: socket.socket) -> None:
        conn.settimeout(0.1)
        frames = protocol.FrameBuffer()
        while not self.stopping.is_set():
            try:
                data = conn.recv(65536)
                if not data:
                    return
                for payload in frames.feed(data):
                    request = protocol.unpack(payload)
                    self.requests.append(request)
                    for out in self.respond(request):
                        conn.sendall(out)
            except TimeoutError:
                continue
            except OSError:  # the client left (e.g. after a malformed frame)
                return

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.listener.close()


@pytest.fixture
def fake() -> Iterator[Callable[[Responder], Path]]:
    """Start fake daemons; their sockets live in a short path (sun_path is 108 bytes)."""
    workdir = Path(tempfile.mkdtemp(prefix="qvlctl-", dir="/tmp"))
    servers: list[FakeDaemon] = []

    def start(respond: Responder) -> Path:
        server = FakeDaemon(workdir / f"fake{len(servers)}.sock", respond)
        servers.append(server)
        return server.path

    yield start
    for server in servers:
        server.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def qvlctl_argv(socket_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "qvlctl.cli", "--socket", str(socket_path), *args]


def run_on_pty(socket_path: Path, *args: str, stdin: bytes = b"",
               timeout: float = 30) -> tuple[int, str]:
    """qvlctl with stdout and stderr on a real terminal: its exit code and what it showed.

    Output post-processing (OPOST: \\n -> \\r\\n) is off, so the bytes read are exactly
    the bytes qvlctl wrote.
    """
    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    proc = subprocess.Popen(qvlctl_argv(socket_path, *args), stdin=subprocess.PIPE,
                            stdout=slave, stderr=slave)
    os.close(slave)
    assert proc.stdin is not None
    proc.stdin.write(stdin)
    proc.stdin.close()
    shown = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer of the terminal is gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    return proc.wait(timeout), shown.decode()


def raw_controls(text: str) -> list[str]:
    """The characters a terminal would act on (newline and tab are fine)."""
    return [c for c in text if ord(c) in render.CONTROLS]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


# -- 1. control characters never reach a terminal ----------------------------------------


def test_escape_controls_shows_every_c0_c1_and_del_but_keeps_newline_and_tab() -> None:
    assert render.escape_controls(EVIL) == EVIL_SHOWN
    assert render.escape_controls("\x00\x1f\x80\x9f") == "\\x00\\x1f\\x80\\x9f"
    every = "".join(map(chr, range(0x100)))
    assert raw_controls(render.escape_controls(every)) == []
    assert render.escape_controls("plain, é, 中, \u00a0, \\x1b") == "plain, é, 中, \u00a0, \\x1b"


def test_the_terminal_decision_follows_the_stream() -> None:
    assert render.cleaner(FakeTTY())(EVIL) == EVIL_SHOWN
    assert render.cleaner(io.StringIO())(EVIL) == EVIL  # a pipe or file: exact text
    closed = open(os.devnull, "w")  # noqa: SIM115 - closed at once, on purpose
    closed.close()
    assert not render.is_terminal(closed)  # isatty() on a closed file raises


def test_json_text_is_exact_json_without_raw_controls() -> None:
    document = generate_result(EVIL)
    text = render.json_text(document)
    assert json.loads(text) == document
    assert raw_controls(text) == []
    assert "中" in text  # non-ASCII stays readable


def test_streamed_answer_is_escaped_on_a_terminal_and_exact_in_a_pipe(
        fake: Callable[[Responder], Path]) -> None:
    sock = fake(answers(EVIL_TOKENS))
    code, shown = run_on_pty(sock, "ask", "Q?")
    assert code == 0, shown
    assert EVIL_SHOWN in shown and raw_controls(shown) == []
    piped = run_qvlctl(sock, "ask", "Q?")
    assert piped.returncode == 0
    assert piped.stdout == EVIL.encode() + b"\n"  # scripts get the real answer


def test_each_stream_decides_for_itself(fake: Callable[[Responder], Path],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    sock = fake(answers(EVIL_TOKENS, others={"status": {"state": "re\x1bady"}}))
    stdout, stderr = FakeTTY(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    assert cli.main(["--socket", str(sock), "ask", "Q?"]) == 0
    assert stdout.getvalue() == EVIL_SHOWN + "\n"
    assert "TTFT" in stderr.getvalue()
    stdout.truncate(0)
    stdout.seek(0)
    assert cli.main(["--socket", str(sock), "status"]) == 0
    assert stdout.getvalue().startswith("qvld      ?, pid ?, re\\x1bady, up -\n")


def test_json_answer_on_a_terminal_is_exact_json(fake: Callable[[Responder], Path]) -> None:
    sock = fake(answers(EVIL_TOKENS))
    code, shown = run_on_pty(sock, "ask", "--json", "Q?")
    assert code == 0, shown
    assert json.loads(shown) == generate_result(EVIL)
    assert raw_controls(shown) == []
    piped = run_qvlctl(sock, "ask", "--json", "Q?")
    assert json.loads(piped.stdout) == generate_result(EVIL)


EVIL_RESULTS: dict[str, tuple[list[str], Any]] = {
    "status": (["status"], {"state": "ready", "model": {"name": "ti\x1b]52;c;ZXZpbA==\x07ny"}}),
    "config": (["config"], {"model": {"path": "/m\x1b[2J"}, "list": ["a\x9bb"]}),
    "sessions": (["sessions"], {"sessions": [{"id": "s\x1b[1A", "uid": 0, "turns": 1}]}),
    "health": (["health"], {"state": "ready\x1b[2J", "ready": True}),
    "metrics": (["metrics"], {"text": "qvld_ready{model=\"\x1b]0;x\x07\"} 1\n"}),
    "reload": (["reload"], {"reloaded": True, "model": "m\x1bc", "restart_required": ["k\x07"]}),
    "preflight": (["preflight"], {"ok": True, "tuning": [
        {"action": "a", "result": "applied", "detail": "d\x1b[0m"}], "checks": [
        {"id": "cpu", "status": "warn", "found": "f\x9b", "remedy": "r\x1b"}]}),
}


@pytest.mark.parametrize("name", sorted(EVIL_RESULTS))
def test_daemon_strings_are_escaped_on_a_terminal(name: str,
                                                  fake: Callable[[Responder], Path]) -> None:
    args, result = EVIL_RESULTS[name]
    sock = fake(answers([], others={args[0]: result}))
    code, shown = run_on_pty(sock, *args)
    assert code == 0, shown
    assert raw_controls(shown) == [] and "\\x" in shown, shown


def test_daemon_error_messages_are_escaped_on_a_terminal(
        fake: Callable[[Responder], Path]) -> None:
    def refuse(request: dict[str, Any]) -> list[bytes]:
        return [packed({"id": request["id"], "ok": False, "error": {
            "code": "bad_request", "message": "no\x1b[2Jpe", "retryable": False}})]

    sock = fake(refuse)
    code, shown = run_on_pty(sock, "status")
    assert code == 4  # a well-formed refusal stays a refusal
    assert shown == "qvlctl: bad_request: no\\x1b[2Jpe\n"
    assert run_qvlctl(sock, "status").stderr == b"qvlctl: bad_request: no\x1b[2Jpe\n"


def test_chat_escapes_answers_on_a_terminal(fake: Callable[[Responder], Path]) -> None:
    sock = fake(answers(EVIL_TOKENS))
    code, shown = run_on_pty(sock, "chat", stdin=b"Hello\n/quit\n")
    assert code == 0, shown
    assert f"qvl> {EVIL_SHOWN}\n" in shown and raw_controls(shown) == []


def test_chat_streams_pick_their_own_rendering(fake: Callable[[Responder], Path]) -> None:
    sock = fake(answers(EVIL_TOKENS))
    out: io.StringIO = FakeTTY()
    with Client(sock, timeout=10) as client:
        code = Chat(client, {}, [], None, out=out, err=io.StringIO()).loop(io.StringIO("Hi\n"))
    assert code == 0
    assert out.getvalue() == f"qvl> {EVIL_SHOWN}\n"
    out, err = io.StringIO(), FakeTTY()  # only stderr is a terminal: the answer stays exact
    with Client(sock, timeout=10) as client:
        Chat(client, {}, [], None, out=out, err=err).loop(io.StringIO("Hi\n"))
    assert out.getvalue() == f"qvl> {EVIL}\n" and "TTFT" in err.getvalue()


class Terminal:
    """qvlctl on a pseudo-terminal it has as its controlling terminal, as a person runs
    it: keys typed go through the terminal's line discipline (Ctrl-C is SIGINT to it)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: SIGINT as a shell gives a foreground command
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe(argv[0], argv, env)
        self.pid, self.fd = pid, fd
        self.shown = ""
        self.seen = 0  # how much of ``shown`` earlier expects consumed

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def expect(self, text: str, timeout: float = 30) -> str:
        """Read until ``text`` appears after what earlier expects consumed."""
        deadline = time.monotonic() + timeout
        while (at := self.shown.find(text, self.seen)) < 0:
            assert time.monotonic() < deadline, f"no {text!r} in {self.shown[self.seen:]!r}"
            ready, _, _ = select.select([self.fd], [], [], 0.1)
            if ready:
                try:
                    self.shown += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:  # EIO: the program is gone
                    break
        assert at >= 0, f"no {text!r} in {self.shown[self.seen:]!r}"
        self.seen = at + len(text)
        return self.shown[:self.seen]

    def wait_reading(self, timeout: float = 30) -> None:
        """Wait until readline has the terminal (canonical mode off) and sleeps in its
        wait for a key. CPython's readline only notices a SIGINT that interrupts that
        wait: one that lands while it is still handling the keys before is kept until
        the next key (a person presses Ctrl-C again; a test must not race it)."""
        deadline = time.monotonic() + timeout
        wchan = Path(f"/proc/{self.pid}/wchan")
        while (termios.tcgetattr(self.fd)[3] & termios.ICANON
               or not re.search("select|poll", wchan.read_text())):
            assert time.monotonic() < deadline, "readline never waited for a key"
            time.sleep(0.01)

    def exit_code(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            assert time.monotonic() < deadline, "qvlctl did not leave"
            with contextlib.suppress(OSError):
                if select.select([self.fd], [], [], 0.1)[0]:
                    self.shown += os.read(self.fd, 65536).decode(errors="replace")


def chat_on_a_terminal(sock: Path, tmp_path: Path) -> Terminal:
    env = {**os.environ, "HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state"),
           "TERM": "xterm"}
    return Terminal(qvlctl_argv(sock, "chat"), env)


def user_texts(daemon_requests: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(the user's words, the params) of each generate the daemon got."""
    out = []
    for request in daemon_requests:
        if request["op"] == "generate":
            parts = request["params"]["messages"][-1]["content"]
            out.append(("".join(p.get("text", "") for p in parts), request["params"]))
    return out


def test_chat_on_a_terminal_edits_lines_recalls_history_and_sets_parameters(
        fake: Callable[[Responder], Path], tmp_path: Path) -> None:
    # #49: the Up arrow was sent to the model as "^[[A"; no /set; one line per message.
    asked: list[dict[str, Any]] = []
    sock = fake(lambda request: asked.append(request) or answers(["ok"])(request))
    term = chat_on_a_terminal(sock, tmp_path)
    term.expect("you> ")
    term.type(b"Hellp\x7fo\r")  # a typo, erased with backspace
    term.expect("qvl> ok")
    term.expect("you> ")
    term.type(b"/set temperature 0.3\r")
    term.expect("(temperature 0.3)")
    term.expect("you> ")
    term.type(b"\x1b[A\x1b[A\r")  # Up twice: "Hello" again, edited by readline
    term.expect("qvl> ok")
    term.expect("you> ")
    term.type(b'"""first line\r')
    term.expect("... ")
    term.type(b'second line"""\r')
    term.expect("qvl> ok")
    term.expect("you> ")
    term.type(b"/set top_k lots\r")
    term.expect("takes a int, not 'lots'")
    term.expect("you> ")
    term.type(b"\x04")  # Ctrl-D leaves
    assert term.exit_code() == 0
    sent = user_texts(asked)
    assert [text for text, _ in sent] == ["Hello", "Hello", "first line\nsecond line"]
    assert "temperature" not in sent[0][1] and sent[1][1]["temperature"] == 0.3
    assert len({params["session"] for _, params in sent}) == 1
    # Kept for the next chat.
    assert "Hello" in (tmp_path / "state" / "qvlctl" / "chat_history").read_text()


def test_ctrl_c_on_a_terminal_stops_the_answer_and_the_chat_goes_on(
        fake: Callable[[Responder], Path], tmp_path: Path) -> None:
    # #49: Ctrl-C quit the chat instead of stopping the answer.
    calls = []

    def respond(request: dict[str, Any]) -> list[bytes]:
        if request["op"] == "generate":
            calls.append(request)
            if len(calls) == 1:  # streams one token, never ends: the user gives up
                return [packed(protocol.token_event(request["id"], "waiting", [1]))]
        return answers(["fine"])(request)

    sock = fake(respond)
    term = chat_on_a_terminal(sock, tmp_path)
    term.expect("you> ")
    term.type(b"Hi\r")
    term.expect("qvl> waiting")
    term.type(b"\x03")  # Ctrl-C
    term.expect("(stopped)")
    term.expect("you> ")
    term.type(b"Again\r")
    term.expect("qvl> fine")
    term.expect("you> ")
    term.type(b"\x04")
    assert term.exit_code() == 0
    assert [text for text, _ in user_texts(calls)] == ["Hi", "Again"]
    assert "Traceback" not in term.shown


def test_ctrl_c_at_the_prompt_drops_the_line_and_ctrl_d_leaves(
        fake: Callable[[Responder], Path], tmp_path: Path) -> None:
    calls: list[dict[str, Any]] = []

    def respond(request: dict[str, Any]) -> list[bytes]:
        if request["op"] == "generate":
            calls.append(request)
        return answers(["fine"])(request)

    term = chat_on_a_terminal(fake(respond), tmp_path)
    term.expect("you> ")
    term.wait_reading()
    term.type(b"half a thought")
    term.expect("half a thought")
    term.wait_reading()
    term.type(b"\x03")  # Ctrl-C: the line is dropped, the chat goes on
    term.expect("you> ")
    term.wait_reading()
    term.type(b"Hi\r")
    term.expect("qvl> fine")
    term.expect("you> ")
    term.wait_reading()
    term.type(b"\x04")  # Ctrl-D at an empty prompt: leave
    assert term.exit_code() == 0
    assert [text for text, _ in user_texts(calls)] == ["Hi"]
    assert "Traceback" not in term.shown


# -- 2. a socket this user may not open ------------------------------------------------------


def run_forked_as_nobody(argv: list[str]) -> tuple[int, str]:
    """``cli.main(argv)`` in a child that dropped to uid/gid 65534: its code and stderr.

    Forked rather than spawned: the checkout and its interpreter are private to root, and
    every module the child needs is already imported. The kernel's own permission check
    on connect() is what the child meets.
    """
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 99
        try:
            os.close(reader)
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
            code = cli.main(argv)
            os.write(writer, sys.stderr.getvalue().encode())
        except BaseException as exc:
            os.write(writer, f"child failed: {exc!r}".encode())
        finally:
            os._exit(code)
    os.close(writer)
    chunks = []
    while chunk := os.read(reader, 65536):
        chunks.append(chunk)
    os.close(reader)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode()


def listening_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(1)
    return sock


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another uid")
@pytest.mark.parametrize("layout", ["group-socket", "owner-only-socket", "private-directory"])
def test_a_socket_the_user_may_not_open_is_forbidden_with_a_hint(layout: str,
                                                                 shared_dir: Path) -> None:
    import grp

    group = grp.getgrgid(1).gr_name  # a group nobody is not in
    directory = shared_dir / "run"
    directory.mkdir()
    path = directory / "qvld.sock"
    server = listening_socket(path)
    try:
        if layout == "group-socket":
            os.chown(path, 0, 1)
            path.chmod(0o660)
        elif layout == "owner-only-socket":
            path.chmod(0o600)
        else:  # the socket is open to all, its directory is not: /run/qvld as packaged
            path.chmod(0o666)
            os.chown(directory, 0, 1)
            directory.chmod(0o750)
        code, err = run_forked_as_nobody(["--socket", str(path), "health"])
    finally:
        server.close()
    assert code == 7, err
    assert err.startswith(f"qvlctl: permission denied on {path}: ") and err.count("\n") == 1
    if layout == "owner-only-socket":
        assert "mode 0600 lets only its owner connect" in err
    else:
        assert f"join the group that owns it (e.g. `sudo usermod -aG {group} $USER`, " \
               f"then log in again)" in err
    assert "connection lost" not in err


# -- 3. an answer cut short by the daemon -------------------------------------------------


def test_an_answer_cut_short_exits_5_and_says_so(fake: Callable[[Responder], Path]) -> None:
    sock = fake(answers(["partial"], finish="cancelled"))
    out = run_qvlctl(sock, "ask", "Q?")
    assert out.returncode == 5
    assert out.stdout == b"partial\n"
    err = out.stderr.decode()
    assert "finish cancelled" in err and "qvlctl: the answer was cut short" in err
    assert "Traceback" not in err


def test_a_json_answer_cut_short_is_printed_then_exits_5(
        fake: Callable[[Responder], Path]) -> None:
    sock = fake(answers(["partial"], finish="cancelled"))
    out = run_qvlctl(sock, "ask", "--json", "Q?")
    assert out.returncode == 5
    assert json.loads(out.stdout) == generate_result("partial", "cancelled")
    assert out.stdout.count(b"\n") == 1  # still exactly one JSON object
    assert b"cut short" in out.stderr


def test_a_complete_answer_still_exits_0(fake: Callable[[Responder], Path]) -> None:
    for finish in ("stop", "length"):
        sock = fake(answers(["whole"], finish=finish))
        assert run_qvlctl(sock, "ask", "Q?").returncode == 0
        assert run_qvlctl(sock, "ask", "--json", "Q?").returncode == 0


def test_chat_reports_an_answer_cut_short_and_leaves_with_5(
        fake: Callable[[Responder], Path]) -> None:
    sock = fake(answers(["partial"], finish="cancelled"))
    out = run_qvlctl(sock, "chat", stdin=b"Hello\nAnd then?\n")
    assert out.returncode == 5
    assert out.stdout.decode().count("qvl> ") == 1  # the second turn was not attempted
    assert b"cut short" in out.stderr


def test_the_users_own_ctrl_c_still_exits_130_quietly(
        fake: Callable[[Responder], Path]) -> None:
    # The daemon streams one token and never finishes: the user gives up.
    sock = fake(lambda request: [packed(protocol.token_event(request["id"], "waiting", [1]))])
    # Ctrl-C as a terminal delivers it: a test run started in the background (`make
    # test &`) hands its children SIGINT ignored, and Python then never raises
    # KeyboardInterrupt.
    proc = subprocess.Popen(qvlctl_argv(sock, "ask", "Q?"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None and proc.stderr is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    assert ready and os.read(proc.stdout.fileno(), 100) == b"waiting"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130
    assert proc.stderr.read() == b""  # no "cut short", no traceback


# -- 4. an empty socket path ---------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--socket", ""], ["--socket="]])
def test_an_explicitly_empty_socket_is_a_usage_error(argv: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "qvlctl.cli", *argv, "health"],
                         capture_output=True, timeout=30, check=False)
    assert out.returncode == 2
    assert b"argument --socket: an empty path names no socket" in out.stderr


def test_an_empty_qvld_socket_means_unset(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    monkeypatch.setenv("QVLD_SOCKET", "")
    assert cli.build_parser().parse_args(["health"]).socket == DEFAULT_SOCKET
    assert Client().path == DEFAULT_SOCKET
    monkeypatch.setenv("QVLD_SOCKET", str(tmp_path / "s.sock"))
    assert cli.build_parser().parse_args(["health"]).socket == str(tmp_path / "s.sock")
    with pytest.raises(ValueError, match="empty"):
        Client("")


# -- 5. malformed replies ----------------------------------------------------------------------


def reply(**fields: Any) -> Callable[[int], bytes]:
    return lambda rid: packed({"id": rid, **fields})


GOOD_RESULT = generate_result("fine")
MALFORMED: dict[str, tuple[list[str], Callable[[int], bytes], str]] = {
    "not msgpack": (["health"], lambda rid: frame(b"\xc1"), "not valid msgpack"),
    "cut inside a value": (["health"], lambda rid: frame(b"\x82\xa2id"), "ends inside"),
    "two values": (["health"], lambda rid: frame(msgpack.packb({}) * 2), "more than one"),
    "bad utf-8": (["health"], lambda rid: frame(b"\x81\xa2id\xa2\xff\xfe"), "UTF-8"),
    "too large": (["health"], lambda rid: protocol.HEADER.pack(2**31), "exceeds the limit"),
    "not a map": (["health"], lambda rid: packed([rid, True]), "a frame holds list"),
    "no id": (["status"], lambda rid: packed({"ok": True, "result": {}}), "no 'id'"),
    "id of the wrong type": (["status"], lambda rid: packed({"id": str(rid), "ok": True}),
                             "id is str"),
    "no ok": (["status"], reply(result={}), "has no 'ok'"),
    "no result": (["status"], reply(ok=True), "no 'result'"),
    "status result 5": (["status"], reply(ok=True, result=5),
                        "the status result is int, expected a map"),
    "health ready a string": (["health"], reply(ok=True, result={"state": "x",
                                                                 "ready": "yes"}),
                              "ready is str"),
    "error not a map": (["status"], reply(ok=False, error="boom"), "error is str"),
    "error code not a string": (["status"], reply(ok=False, error={"code": 5, "message": "m"}),
                                "code is int"),
    "error without a code": (["status"], reply(ok=False, error={"message": "m"}),
                             "has no 'code'"),
    "sessions not a list": (["sessions"], reply(ok=True, result={"sessions": "x"}),
                            "sessions is str"),
    "session not a map": (["sessions"], reply(ok=True, result={"sessions": [3]}),
                          "a session is int"),
    "metrics text an int": (["metrics"], reply(ok=True, result={"text": 5}), "text is int"),
    "preflight check not a map": (["preflight"], reply(ok=True, result={
        "ok": True, "checks": [5], "tuning": []}), "a check is int"),
    "reload without reloaded": (["reload"], reply(ok=True, result={}), "no 'reloaded'"),
    "generate without text": (["ask", "Q?"], reply(ok=True, result={
        k: v for k, v in GOOD_RESULT.items() if k != "text"}), "no 'text'"),
    "token text an int": (["ask", "Q?"], reply(event="token", text=5, token_ids=[1]),
                          "text is int"),
    "usage not numbers": (["ask", "--json", "Q?"], reply(ok=True, result={
        **GOOD_RESULT, "usage": {"prompt_tokens": "many"}}), "usage.prompt_tokens is str"),
    "token_ids not ints": (["ask", "--json", "Q?"], reply(ok=True, result={
        **GOOD_RESULT, "token_ids": ["a"]}), "other than integers"),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_reply_is_one_line_and_exit_1(kind: str,
                                                  fake: Callable[[Responder], Path]) -> None:
    args, make, detail = MALFORMED[kind]
    sock = fake(lambda request: [make(request["id"])])
    out = run_qvlctl(sock, *args, timeout=30)
    err = out.stderr.decode()
    assert out.returncode == 1, err
    assert "Traceback" not in err
    assert err.startswith("qvlctl: the daemon sent a malformed reply: ") and \
        err.count("\n") == 1, err
    assert detail in err


# -- the real daemon's replies pass every check above ---------------------------------------


def test_the_real_daemons_replies_are_well_formed(daemon: Daemon) -> None:
    for args in (["health"], ["status"], ["config"], ["sessions"], ["metrics", "--summary"],
                 ["ask", "--max-tokens", "4", "Hi"], ["ask", "--json", "--max-tokens", "4", "Hi"],
                 ["reload"]):
        out = daemon.qvlctl(*args)
        assert out.returncode == 0, (args, out.stderr)
    preflight = daemon.qvlctl("preflight")  # exit 1 when a check fails on this machine
    assert preflight.returncode in (0, 1) and b"malformed" not in preflight.stderr
    code, shown = run_on_pty(daemon.socket, "ask", "--max-tokens", "8", "Describe.")
    assert code == 0 and "TTFT" in shown and raw_controls(shown) == [], shown


def test_the_client_checks_its_line_on_descriptors_past_1023() -> None:
    """An application with many files open (an HTTP server, say) gets socket numbers
    past select()'s limit; the idle-line check must still work there."""
    import resource

    from qvlctl.client import _readable

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2100:
        pytest.fail(f"the open-file limit ({hard}) is below what this test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2100), hard))
    a, b = socket.socketpair()
    high = socket.socket(fileno=os.dup2(a.fileno(), 2048))
    try:
        assert not _readable(high)
        b.sendall(b"x")
        assert _readable(high)
    finally:
        for sock in (high, a, b):
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- polish: --version, config as YAML, a closed stdout -------------------------------------


def test_version() -> None:
    from qvld import __version__

    out = subprocess.run([sys.executable, "-m", "qvlctl.cli", "--version"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.strip() == f"qvlctl {__version__}"


def test_config_prints_yaml_that_qvld_reads_back(fake: Callable[[Responder], Path],
                                                 tmp_path: Path) -> None:
    import yaml

    from qvld.config_loading import load_config

    effective = {"engine": {"max_new_tokens": 300, "grammar_compile_timeout_s": 2.5},
                 "server": {"allow_uids": [1000, 1001], "socket": "/run/qvld/x.sock"},
                 "logging": {"format": "json"}, "tuning": {"numa_node": None}}
    sock = fake(answers([], others={"config": effective}))
    out = run_qvlctl(sock, "config")
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout) == effective
    path = tmp_path / "qvld.yaml"
    path.write_bytes(out.stdout)
    config = load_config(path)
    assert config.engine.max_new_tokens == 300 and config.server.allow_uids == [1000, 1001]


def test_a_closed_stdout_is_not_a_lost_daemon(fake: Callable[[Responder], Path]) -> None:
    sock = fake(answers([], others={"config": {"engine": {"threads": "auto"}}}))
    reader, writer = os.pipe()
    os.close(reader)  # `| head` that has already had enough
    try:
        proc = subprocess.run(qvlctl_argv(sock, "config"), stdout=writer, stderr=subprocess.PIPE,
                              timeout=60, check=False)
    finally:
        os.close(writer)
    assert proc.returncode == 141 and proc.stderr == b""


# -- status and sessions for people ---------------------------------------------------------


@pytest.mark.parametrize("seconds, shown", [
    (0.25, "0.25 s"), (2.5, "2.5 s"), (42, "42 s"), (75, "1 min 15 s"), (3600, "1 h 0 min"),
    (9000, "2 h 30 min"), (200_000, "2 d 7 h"), (None, "-")])
def test_human_durations(seconds: float | None, shown: str) -> None:
    assert render.human_duration(seconds) == shown


@pytest.mark.parametrize("count, shown", [
    (0, "0 B"), (1023, "1023 B"), (2048, "2.0 KiB"), (253_440, "248 KiB"),
    (268_435_456, "256 MiB"), (5 * 2**40, "5120 GiB")])
def test_human_sizes(count: int, shown: str) -> None:
    assert render.human_bytes(count) == shown


STATUS = {
    "state": "ready", "ready": True, "version": "0.1.0", "pid": 41, "uptime_s": 7384.2,
    "requests_total": 12, "requests_in_flight": 2,
    "model": {"name": "qwen3-vl-2b-int8", "path": "/var/lib/qvld/models/q", "load_s": 3.2,
              "runtime": {"name": "openvino", "version": "2026.4.1",
                          "INFERENCE_PRECISION_HINT": "f32", "WEIGHTS": "int8"},
              "infer_requests": 4, "max_context_tokens": 4096},
    "generations": [{"uid": 1000, "stage": "running", "age_s": 65.0},
                    {"uid": 1001, "stage": "queued", "age_s": 0.5}],
    "queue": {"running": 1, "waiting": 1, "preemptions": 3},
    "last_errors": [{"at": 1_764_650_000.0, "op": "generate", "code": "image_invalid",
                     "uid": 1001}],
    "pinned_cpus": [0, 1], "threads": 2,
    "preflight": {"cpu_isa": "ok", "smt": "warn", "numa": "ok", "cpu_governor": "n/a"},
    "caches": {"image": {"entries": 3, "bytes": 5 * 2**20, "capacity_bytes": 2**28, "hits": 1,
                         "misses": 3, "hit_ratio": 0.25},
               "kv_cached_tokens": 800, "kv_budget_tokens": 33024, "sessions": 2,
               "sessions_bytes": 16852, "session_image_bytes": 0,
               "session_image_budget_bytes": 2**26,
               "grammars": {"cached": 1, "compiling": 0, "compiles": 1, "cache_size": 64}},
    "batch": {"continuous_batching": True, "max_batch_tokens": 512, "steps": 99,
              "peak_sequences": 2, "decoding": 1, "prefilling": 1,
              "prompt_runtime": "onnxruntime",
              "kv_blocks": {"blocks": 1000, "block_size": 32, "held": 40, "pinned": 2,
                            "kept": 4, "cached": 6, "free": 950},
              "kv_usage_ratio": 0.05,
              "sequences": [{"uid": 1000, "prompt_tokens": 180, "cached_tokens": 160,
                             "fed_tokens": 200, "generated_tokens": 20, "state": "decode",
                             "runtime": "openvino"},
                            {"uid": 1001, "prompt_tokens": 215, "cached_tokens": 0,
                             "fed_tokens": 64, "generated_tokens": 0, "state": "prefill",
                             "runtime": "onnxruntime"}]},
}


def test_status_for_people_is_aligned_fields_and_tables() -> None:
    now = 1_764_650_100.0  # the same day as the error
    shown = render.status_text(STATUS, now=now)
    lines = shown.splitlines()
    assert lines[0].split() == ["qvld", "0.1.0,", "pid", "41,", "ready,", "up", "2", "h", "3",
                                "min"]
    fields = {line.split("  ")[0]: line for line in lines if line and not line[0].isspace()}
    # values start in one column
    assert len({line.index(line.split()[1]) for line in
                (fields[k] for k in ("qvld", "requests", "model", "queue"))}) == 1
    assert "12 served, 2 in flight" in fields["requests"]
    assert "qwen3-vl-2b-int8 (openvino 2026.4.1, f32 compute, int8 weights)" in fields["model"]
    assert "pinned to 0,1" in fields["threads"]
    assert "1 running, 1 waiting, 3 preempted so far" in fields["queue"]
    # #46: it said "117 of 2064 in use (0%)" (cached and kept blocks counted as used).
    assert ("40 of 1000 held by sequences (4%), 4 kept for sessions, 6 cached, 950 free"
            in fields["KV blocks"])
    assert "3 entries, 5.0 MiB of 256 MiB; 1 hit, 3 misses (25%)" in fields["images"]
    assert "1 warn (smt)" in fields["preflight"]
    assert "generations:\nUID   STAGE    AGE\n1000  running  1 min 5 s\n1001  queued   0.50 s" \
        in shown
    assert "sequences:\nUID   STATE    RUNTIME      PROMPT  CACHED  FED  GENERATED\n" \
           "1000  decode   openvino     180     160     200  20\n" \
           "1001  prefill  onnxruntime  215     0       64   0" in shown
    assert fields["batch"].endswith("1 decoding, 1 prefilling, peak 2, 99 steps, "
                                    "prompts on onnxruntime")
    when = render.clock_time(1_764_650_000.0, now)
    assert re.fullmatch(r"\d\d:\d\d:\d\d", when)
    assert ("last errors:\nWHEN      OP        CODE           UID\n"
            f"{when}  generate  image_invalid  1001") in shown
    assert not re.search(r"\b(True|False|None)\b|\[|\{|_s\b", shown), shown


def test_status_for_people_copes_with_what_a_non_admin_or_a_loading_daemon_sends() -> None:
    shown = render.status_text({"state": "loading", "ready": False, "version": "0.1.0",
                                "pid": 7, "uptime_s": 0.4, "requests_total": 0, "model": None})
    assert shown.splitlines()[:3] == ["qvld      0.1.0, pid 7, loading, up 0.40 s",
                                      "requests  0 served", "model     not loaded"]
    hidden = {**STATUS, "model": {**STATUS["model"], "path": "(hidden)"}, "last_errors": [],
              "generations": []}
    text = render.status_text(hidden)
    assert "path (hidden)" in text and "last errors" not in text and "generations" not in text


def test_an_error_from_another_day_shows_its_date() -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d",
                        render.clock_time(1_764_650_000.0, now=1_764_650_000.0 + 3 * 86400))


def test_sessions_for_people(fake: Callable[[Responder], Path]) -> None:
    sock = fake(answers([], others={"sessions": {"sessions": [
        {"id": "chat-1", "uid": 1000, "turns": 3, "tokens": 900, "images": 1, "bytes": 4096,
         "age_s": 4000.0, "idle_s": 12.0, "busy": False},
        {"id": "b", "uid": 0, "turns": 1, "tokens": 5, "images": 0, "bytes": 20,
         "age_s": 1.5, "idle_s": 0.0, "busy": True}]}}))
    out = run_qvlctl(sock, "sessions")
    assert out.returncode == 0
    assert out.stdout.decode().splitlines() == [
        "ID      UID   TURNS  TOKENS  IMAGES  SIZE     AGE        IDLE    BUSY",
        "chat-1  1000  3      900     1       4.0 KiB  1 h 6 min  12 s    no",
        "b       0     1      5       0       20 B     1.5 s      0.00 s  yes"]


def test_instance_names_its_socket() -> None:
    args = cli.build_parser().parse_args(["--instance", "1", "health"])
    assert args.socket == "/run/qvld/qvld-1.sock"
    for bad in (["--instance", "../x", "health"],
                ["--instance", "1", "--socket", "/tmp/s", "health"]):
        out = subprocess.run([sys.executable, "-m", "qvlctl.cli", *bad], capture_output=True,
                             text=True, timeout=60, check=False)
        assert out.returncode == 2, out.stderr


def test_ask_finds_its_files_and_reads_a_piped_question(daemon: Daemon,
                                                        tmp_path: Path) -> None:
    """#49: ``qvlctl ask IMAGE`` with no question, a missing file, or the question on
    stdin sent the file name as a text-only question (exit 0)."""
    from tests.conftest import TINY

    picture = str(TINY / "images" / "photo.png")
    missing = run_qvlctl(daemon.socket, "ask", str(tmp_path / "holiday.jpg"), "What?")
    assert missing.returncode == cli.EXIT_USAGE
    assert b"holiday.jpg: no such file" in missing.stderr
    alone = run_qvlctl(daemon.socket, "ask", picture, stdin=b"")
    assert alone.returncode == cli.EXIT_USAGE and b"needs a QUESTION" in alone.stderr
    piped = run_qvlctl(daemon.socket, "ask", picture, "--json", "--max-tokens", "2",
                       stdin=b"What is in the picture?\n")
    assert piped.returncode == 0, piped.stderr
    asked = json.loads(piped.stdout)["usage"]
    assert asked["image_tokens"] > 0  # the picture went as a picture
    # The question first, in words, then the file: the same picture, the same prompt.
    spread = run_qvlctl(daemon.socket, "ask", "What", "is", "in", "the", "picture?",
                        picture, "--json", "--max-tokens", "2")
    assert spread.returncode == 0, spread.stderr
    usage = json.loads(spread.stdout)["usage"]
    assert (usage["image_tokens"], usage["prompt_tokens"]) == (asked["image_tokens"],
                                                               asked["prompt_tokens"])
