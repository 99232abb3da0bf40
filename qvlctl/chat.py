"""`qvlctl chat`: a conversation kept as a daemon session (the image is encoded once).

Commands: /image PATH attaches an image to your next message, /video PATH a video
clip (MP4, WebM, MKV, ...), /reset starts over,
/quit (or end of input) leaves and closes the session.

Answers and the daemon's messages go through ``render.cleaner``: on a terminal their
control characters are shown as ``\\xNN``, never obeyed. An answer the daemon cuts
short (it is stopping: finish ``cancelled``) is reported and the chat ends with exit 5
(retry later), since the daemon will not take the next turn either; a refusal it may
not recover from (unavailable, forbidden) ends it with that error's exit code; other
refusals (a bad image, a prompt too long) are reported and the chat goes on. Ctrl-C
leaves quietly with 0, as /quit does.
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

HELP = "commands: /image PATH, /video PATH, /reset, /quit"
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

    def close(self) -> None:
        if self.turns:
            with contextlib.suppress(QvlError, MalformedReply, OSError):
                self.client.close_session(self.session)

    def loop(self, stdin: TextIO = sys.stdin) -> int:
        interactive = stdin.isatty()
        if interactive:
            self.err.write(f"qvlctl chat — {HELP}\n")
        try:
            while True:
                if interactive:
                    self.out.write("you> ")
                    self.out.flush()
                line = stdin.readline()
                if not line:
                    break
                line = line.strip()
                if not line:
                    continue
                if line.startswith("/"):
                    if not self.command(line):
                        break
                    continue
                try:
                    result = self.say(line)
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
        return exits.EXIT_OK
