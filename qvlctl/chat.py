"""`qvlctl chat`: a conversation kept as a daemon session (the image is encoded once).

Commands: /image PATH attaches an image to your next message, /reset starts over,
/quit (or end of input) leaves and closes the session.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from pathlib import Path
from typing import Any, TextIO

from qvlctl import render
from qvlctl.client import Client
from qvld.errors import QvlError

HELP = "commands: /image PATH, /reset, /quit"


class Chat:
    def __init__(self, client: Client, params: dict[str, Any], images: list[bytes],
                 system: str | None, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
                 session: str | None = None) -> None:
        self.client = client
        self.params = params
        self.pending = list(images)
        self.system = system
        self.out, self.err = out, err
        self.session = session or self.new_id()
        self.turns = 0

    @staticmethod
    def new_id() -> str:
        return f"chat-{os.getpid()}-{secrets.token_hex(4)}"

    def say(self, text: str) -> None:
        content: list[dict[str, Any]] = [{"type": "image", "image": data}
                                         for data in self.pending]
        content.append({"type": "text", "text": text})
        messages: list[dict[str, Any]] = []
        if self.turns == 0 and self.system:
            messages.append({"role": "system", "content": self.system})
        messages.append({"role": "user", "content": content})

        def show(piece: str, ids: list[int]) -> None:
            self.out.write(piece)
            self.out.flush()

        self.out.write("qvl> ")
        result = self.client.generate({**self.params, "messages": messages,
                                       "session": self.session}, on_token=show)
        self.out.write("\n")
        self.out.flush()
        self.err.write(render.timings_line(result) + "\n")
        self.pending = []
        self.turns += 1

    def command(self, line: str) -> bool:
        """Handle a /command; False means leave."""
        name, _, arg = line.partition(" ")
        if name in ("/quit", "/exit"):
            return False
        if name == "/reset":
            self.close()
            self.session, self.turns, self.pending = self.new_id(), 0, []
            self.err.write("(new conversation)\n")
        elif name == "/image":
            try:
                self.pending.append(Path(arg.strip()).expanduser().read_bytes())
                self.err.write(f"(image attached to your next message: {arg.strip()})\n")
            except OSError as exc:
                self.err.write(f"cannot read {arg.strip()}: {exc.strerror}\n")
        else:
            self.err.write(HELP + "\n")
        return True

    def close(self) -> None:
        if self.turns:
            with contextlib.suppress(QvlError, OSError):
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
                    self.say(line)
                except QvlError as exc:
                    self.out.write("\n")
                    self.err.write(f"qvlctl: {exc.code}: {exc.message}\n")
                    if exc.code in ("unavailable", "forbidden"):
                        return 1
        except KeyboardInterrupt:
            self.out.write("\n")
        finally:
            self.close()
        return 0
