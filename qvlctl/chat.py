"""`qvlctl chat`: a conversation kept as a daemon session (the image is encoded once).

Commands: /image PATH attaches an image to your next message, /video PATH a video
clip (MP4, WebM, MKV, ...), /set KEY VALUE changes a sampling setting (temperature,
top_p, top_k, max_tokens, seed, the penalties) or the system prompt (/set system TEXT:
a new conversation), /set alone shows them, /reset starts over, /quit (or end of input)
leaves and closes the session. A message that starts with three double quotes goes on
over lines until one ends with three (as in ``ollama run``).

On a terminal, lines are edited with readline, and earlier ones come back with the Up
arrow (kept in ``$XDG_STATE_HOME/qvlctl/chat_history``); Ctrl-C stops the answer being
written (the turn is dropped: the conversation goes on from before it) or clears the
line being typed, and Ctrl-D leaves. With input from a pipe, Ctrl-C leaves quietly with 0.

Answers and the daemon's messages go through ``render.cleaner``: on a terminal their
control characters are shown as ``\\xNN``, never obeyed. An answer the daemon cuts
short (it is stopping: finish ``cancelled``) is reported and the chat ends with exit 5
(retry later), since the daemon will not take the next turn either; a refusal it may
not recover from (unavailable, forbidden) ends it with that error's exit code; other
refusals (a bad image, a prompt too long) are reported and the chat goes on.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from pathlib import Path
from typing import Any, TextIO

from qvlctl import exits, render, replies
from qvlctl.client import Client, MalformedReply
from qvld.errors import QvlError

HELP = ("commands: /image PATH, /video PATH, /set [KEY VALUE] (temperature, top_p, top_k, "
        "max_tokens, seed, system ...), /reset, /quit; \"\"\" starts and ends a "
        "message of several lines; Ctrl-C stops an answer, Ctrl-D leaves")
# /set KEY VALUE: the sampling settings a chat may change, and how each value is read.
SETTINGS: dict[str, type] = {"temperature": float, "top_p": float, "top_k": int,
                             "max_tokens": int, "seed": int, "repetition_penalty": float,
                             "presence_penalty": float, "frequency_penalty": float}
QUOTES = '"""'
HISTORY_LINES = 1000
FATAL = ("unavailable", "forbidden")  # the next turn would be refused the same way


class Chat:
    def __init__(self, client: Client, params: dict[str, Any], images: list[bytes],
                 system: str | None, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
                 session: str | None = None) -> None:
        self.client = client
        self.params = params
        # The parts attached to the next message (images, videos).
        self.pending: list[dict[str, Any]] = [{"type": "image", "image": d} for d in images]
        self.system = system
        self.out, self.err = out, err
        # Decided once per stream: answers stream token by token.
        self.clean_out, self.clean_err = render.cleaner(out), render.cleaner(err)
        self.session = session or self.new_id()
        self.turns = 0

    @staticmethod
    def new_id() -> str:
        return f"chat-{os.getpid()}-{secrets.token_hex(4)}"

    def say(self, text: str) -> dict[str, Any]:
        """One turn: the answer streams to ``out``; the generate result is returned."""
        content: list[dict[str, Any]] = list(self.pending)
        content.append({"type": "text", "text": text})
        messages: list[dict[str, Any]] = []
        if self.turns == 0 and self.system:
            messages.append({"role": "system", "content": self.system})
        messages.append({"role": "user", "content": content})

        def show(piece: str, ids: list[int]) -> None:
            self.out.write(self.clean_out(piece))
            self.out.flush()

        self.out.write("qvl> ")
        result = self.client.generate({**self.params, "messages": messages,
                                       "session": self.session}, on_token=show)
        self.out.write("\n")
        self.out.flush()
        self.err.write(self.clean_err(render.timings_line(result)) + "\n")
        self.pending = []
        self.turns += 1
        return result

    def warn(self, text: str) -> None:
        self.err.write(self.clean_err(f"qvlctl: {text}") + "\n")

    def command(self, line: str) -> bool:
        """Handle a /command; False means leave."""
        name, _, arg = line.partition(" ")
        if name in ("/quit", "/exit"):
            return False
        if name == "/reset":
            self.close()
            self.session, self.turns, self.pending = self.new_id(), 0, []
            self.err.write("(new conversation)\n")
        elif name == "/set":
            self.set(arg.strip())
        elif name in ("/image", "/video"):
            kind = name[1:]
            try:
                data = Path(arg.strip()).expanduser().read_bytes()
                self.pending.append({"type": kind, kind: data})
                self.err.write(f"({kind} attached to your next message: {arg.strip()})\n")
            except OSError as exc:
                self.err.write(self.clean_err(f"cannot read {arg.strip()}: {exc.strerror}")
                               + "\n")
        else:
            self.err.write(HELP + "\n")
        return True

    def set(self, arg: str) -> None:
        """``/set KEY VALUE``; ``/set`` alone shows what is set."""
        key, _, value = arg.partition(" ")
        value = value.strip()
        if not key:
            shown = {**self.params, "system": self.system}
            self.err.write(", ".join(f"{k} {v}" for k, v in shown.items()
                                     if v is not None and k in (*SETTINGS, "system"))
                           or "(the daemon's defaults)")
            self.err.write("\n")
        elif key == "system":
            self.system = value or None
            if self.turns:  # the system prompt opens a conversation: start a new one
                self.close()
                self.session, self.turns = self.new_id(), 0
                self.err.write("(new conversation with this system prompt)\n")
            else:
                self.err.write("(system prompt set)\n")
        elif key in SETTINGS:
            try:
                self.params[key] = SETTINGS[key](value)
            except ValueError:
                self.warn(f"/set {key} takes a {SETTINGS[key].__name__}, not {value!r}")
                return
            self.err.write(f"({key} {self.params[key]})\n")
        else:
            self.warn(f"/set knows {', '.join([*SETTINGS, 'system'])}; not {key!r}")

    def close(self) -> None:
        if self.turns:
            with contextlib.suppress(QvlError, MalformedReply, OSError):
                self.client.close_session(self.session)

    def read(self, stdin: TextIO, interactive: bool) -> str | None:
        """The next message or command (None: end of input). A message opened with
        \"\"\" runs until a line that ends with \"\"\"."""
        def line(prompt: str) -> str | None:
            if interactive:
                try:
                    return input(prompt)
                except EOFError:
                    return None
            text = stdin.readline()
            return text.rstrip("\n") if text else None

        first = line("you> ")
        if first is None or not first.lstrip().startswith(QUOTES):
            return first
        text = first.lstrip()[len(QUOTES):]
        lines = []
        while True:
            if text.endswith(QUOTES):
                lines.append(text[:-len(QUOTES)])
                return "\n".join(lines)
            lines.append(text)
            more = line("... ")
            if more is None:
                return "\n".join(lines)
            text = more

    def loop(self, stdin: TextIO = sys.stdin) -> int:
        interactive = stdin is sys.stdin and stdin.isatty()
        if interactive:
            history = line_editing()
            self.err.write(f"qvlctl chat — {HELP}\n")
        try:
            while True:
                try:
                    line = self.read(stdin, interactive)
                except KeyboardInterrupt:
                    if not interactive:
                        raise
                    self.out.write("\n")  # the line typed so far is dropped
                    continue
                if line is None:
                    break
                line = line.strip()
                if not line:
                    continue
                if line.startswith("/") and "\n" not in line:
                    if not self.command(line):
                        break
                    continue
                try:
                    result = self.say(line)
                except KeyboardInterrupt:
                    if not interactive:
                        raise
                    # The daemon ends a generation whose client left; the turn is not
                    # kept, and the next one opens a new connection.
                    self.client.close()
                    self.out.write("\n")
                    self.err.write("(stopped)\n")
                    continue
                except QvlError as exc:
                    self.out.write("\n")
                    self.warn(f"{exc.code}: {exc.message}")
                    if exc.code in FATAL:
                        return exits.for_error_code(exc.code)
                    continue
                if replies.cut_short(result):
                    self.warn(render.CUT_SHORT)
                    return exits.EXIT_RETRY
        except KeyboardInterrupt:
            self.out.write("\n")
        finally:
            self.close()
            if interactive:
                save_history(history)
        return exits.EXIT_OK


def history_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "qvlctl" / "chat_history"


def line_editing() -> Path:
    """readline for ``input()``: editing, and the history of earlier chats loaded."""
    import readline

    path = history_path()
    readline.set_history_length(HISTORY_LINES)
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    return path


def save_history(path: Path) -> None:
    import readline

    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(path)
