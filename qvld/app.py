"""Composition root: ordered start-up, signals, reverse teardown.

Start: listen (so `health` answers while loading) -> load and warm the model -> ready.
Stop (SIGTERM/SIGINT): stop accepting, cancel and finish in-flight work, close.
Signal handlers only record; the loop acts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from qvld.config import Config
from qvld.engine import Engine
from qvld.errors import ModelInvalid
from qvld.handlers import DaemonState, Handlers
from qvld.server import Server, SocketInUse
from qvld.systemd import Notifier, listen_fds

log = logging.getLogger("qvld")

EXIT_OK, EXIT_FAILURE, EXIT_CONFIG = 0, 1, 78


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"level": record.levelname.lower(), "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(config: Config) -> None:
    """stderr only: journald adds the timestamps and the unit."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if config.logging.format == "json"
                         else logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("qvld")
    root.handlers[:] = [handler]
    root.setLevel(config.logging.level.upper())
    root.propagate = False


class App:
    def __init__(self, config: Config, notifier: Notifier | None = None) -> None:
        self.config = config
        self.notifier = notifier or Notifier()
        self.state = DaemonState(config)
        self._stop: asyncio.Event | None = None
        self.exit_signal: int | None = None

    def _on_signal(self, signum: int) -> None:
        self.exit_signal = signum
        if self._stop is not None:
            self._stop.set()

    def _load_engine(self) -> Engine:
        t0 = time.perf_counter()
        engine = Engine(self.config)
        log.info("model %s compiled in %.1f s (%s)", engine.spec.path, engine.load_s,
                 ", ".join(f"{k}={v}" for k, v in engine.models.runtime_properties.items()))
        if self.config.model.warmup:
            self.notifier.status("warming up")
            engine.warmup()
        log.info("model ready in %.1f s", time.perf_counter() - t0)
        return engine

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        executor = ThreadPoolExecutor(max_workers=self.config.engine.infer_requests,
                                      thread_name_prefix="qvld-engine")
        server: Server | None = None
        try:
            handlers = Handlers(self.state, executor, in_flight=lambda: sum(
                len(c.in_flight) for c in server.connections) if server else 0)
            server = Server(self.config.server, handlers)
            fds = listen_fds()
            sock = socket.socket(fileno=fds[0]) if fds else None
            try:
                await server.start(sock)
            except (SocketInUse, OSError) as exc:
                log.error("cannot listen: %s", exc)
                return EXIT_FAILURE
            log.info("listening on %s%s", server.address, " (socket activation)" if fds else "")
            self.notifier.status("loading model")
            load: asyncio.Future[Engine] = loop.run_in_executor(None, self._load_engine)
            stop: asyncio.Future[Any] = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait([load, stop], return_when=asyncio.FIRST_COMPLETED)
            if not load.done():
                log.info("stopping before the model finished loading")
                stop.cancel()
                return EXIT_OK
            try:
                self.state.engine = load.result()
            except ModelInvalid as exc:
                log.error("model: %s", exc)
                return EXIT_CONFIG
            except Exception:
                log.exception("the model failed to load")
                return EXIT_FAILURE
            self.state.state = "ready"
            self.notifier.ready(f"ready: {self.state.engine.spec.name}")
            log.info("ready")
            await stop
            log.info("received %s: stopping", signal.Signals(self.exit_signal or 15).name)
            self.state.state = "draining"
            self.notifier.notify("STOPPING=1")
            return EXIT_OK
        finally:
            if server is not None:
                await server.close()
            executor.shutdown(wait=True, cancel_futures=True)
            self.notifier.close()
