"""Composition root: ordered start-up, signals, reload, reverse teardown.

Start: listen (so `health` answers while loading) -> load and warm the model -> ready.
SIGHUP: load the new config and model beside the old one, swap only on success.
SIGTERM (or a first SIGINT): stop accepting, let admitted work finish within
`server.drain_timeout_s`, cancel the rest, close. A second SIGINT cancels at once.
Signal handlers only record and wake the loop; the loop acts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry

from qvld import __version__, protocol, tuning
from qvld.config import Config, iter_keys
from qvld.config_loading import load_config
from qvld.engine import Engine
from qvld.engine.runners import Generation
from qvld.errors import ModelInvalid, Unavailable
from qvld.handlers import DaemonState, Handlers
from qvld.http.callers import HttpSetupError, load_http
from qvld.http.server import HttpFront
from qvld.journal import JournalHandler, stderr_fallback
from qvld.logfields import FIELDS_ATTR
from qvld.metrics import Exporter, Metrics
from qvld.preflight import PREPARE_THREADS, report, run_checks
from qvld.prepare import PrepareStage
from qvld.server import AccessPolicy, Server, SocketInUse
from qvld.systemd import Notifier, named_listen_fds

log = logging.getLogger("qvld")

EXIT_OK, EXIT_FAILURE, EXIT_CONFIG = 0, 1, 78
# What a reload cannot change in a running daemon: the listening socket, the metrics
# listener, the tuning applied at start-up, and the number of worker threads. Everything
# else is applied (each component's reconfigure, or a new engine).
RESTART_KEYS = ("server.socket", "server.socket_mode", "metrics.listen", "http.listen",
                *(key for key in iter_keys() if key.startswith("tuning.")))


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: an RFC 3339 timestamp (UTC, microseconds), the level,
    the logger, the message, and a request line's fields each as its own key."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        entry: dict[str, Any] = {"ts": stamp.isoformat(timespec="microseconds"),
                                 "level": record.levelname.lower(), "logger": record.name,
                                 "message": record.getMessage()}
        for key, value in getattr(record, FIELDS_ATTR, {}).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class _JournalFormatter(logging.Formatter):
    """Under systemd: sd-daemon priority prefixes, no timestamps (journald adds them)."""

    PRIORITY: ClassVar[dict[int, int]] = {
        logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
        logging.CRITICAL: 2}

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{self.PRIORITY.get(record.levelno, 6)}>"
        return prefix + super().format(record).replace("\n", "\n" + prefix)


def setup_logging(config: Config) -> None:
    """stderr; under systemd (JOURNAL_STREAM) the journal's native protocol, so that a
    request line's fields are structured fields too (stderr with priority prefixes when
    journald cannot be reached); ``logging.format: json`` always JSON lines on stderr."""
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    formatter: logging.Formatter
    if config.logging.format == "json":
        formatter = _JsonFormatter()
    elif os.environ.get("JOURNAL_STREAM"):
        formatter = logging.Formatter("%(name)s: %(message)s")
        handler = JournalHandler(stderr_fallback(_JournalFormatter("%(name)s: %(message)s")))
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler.setFormatter(formatter)
    root = logging.getLogger("qvld")
    for old in root.handlers:  # a reload: the old journal socket is let go
        old.close()
    root.handlers[:] = [handler]
    root.setLevel(config.logging.level.upper())
    root.propagate = False


def _model_fingerprint(path: Path | None) -> tuple[tuple[str, int, int], ...]:
    """Name, size and modification time of each file of a model directory."""
    if path is None or not path.is_dir():
        return ()
    files = []
    for entry in sorted(path.iterdir()):
        with contextlib.suppress(OSError):
            info = entry.stat()
            files.append((entry.name, info.st_size, info.st_mtime_ns))
    return tuple(files)


def _changed(old: Config, new: Config, key: str) -> bool:
    section, name = key.split(".")
    return bool(getattr(getattr(old, section), name) != getattr(getattr(new, section), name))


def _keep(old: Config, new: Config, keys: list[str]) -> Config:
    """``new`` with ``keys`` as they are in ``old``: the configuration in effect."""
    sections: dict[str, dict[str, Any]] = {}
    for key in keys:
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = getattr(getattr(old, section), name)
    return new.model_copy(update={
        section: getattr(new, section).model_copy(update=values)
        for section, values in sections.items()})


class App:
    def __init__(self, config: Config, config_path: Path | None = None,
                 overrides: list[str] | None = None, notifier: Notifier | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = list(overrides or [])
        self.notifier = notifier or Notifier()
        self.state = DaemonState(config)
        self.server: Server | None = None
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.metrics.bind(in_flight=lambda: sum(self._counts()),
                          queue_depth=lambda: self._counts()[1],
                          sessions=lambda: self.state.engine.session_count()
                          if self.state.engine is not None else 0,
                          batch=lambda: self.state.engine.batch_stats()
                          if self.state.engine is not None else {},
                          running=lambda: self._counts()[0])
        self.exporter: Exporter | None = None
        self.http: HttpFront | None = None
        self.prepare_stage: PrepareStage | None = None
        self._model_files = _model_fingerprint(config.model.path)
        self.last_errors: collections.deque[dict[str, Any]] = collections.deque(maxlen=10)
        self.preflight: dict[str, Any] = {"ok": True, "checks": [], "tuning": []}
        self.pinned_cpus: list[int] = []
        self._wake = asyncio.Event()
        self._signals: list[int] = []
        self._reload_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- signals: record and wake ---------------------------------------------------

    def _on_signal(self, signum: int) -> None:
        self._signals.append(signum)
        self._wake.set()

    # -- model ----------------------------------------------------------------------

    def _load_engine(self, config: Config) -> Engine:
        t0 = time.perf_counter()
        engine = Engine(config, on_step=self.metrics.observe_step,
                        on_prefill=self.metrics.observe_prefill)
        served = engine.served
        log.info("model %s compiled in %.1f s (%s)", served.path, served.load_s,
                 ", ".join(f"{k}={v}" for k, v in served.runtime_properties.items()))
        if config.model.warmup:
            self.notifier.status("warming up")
            engine.warmup()
        ready_s = time.perf_counter() - t0
        log.info("model ready in %.1f s", ready_s)
        if served.continuous_batching:
            self.metrics.prefill_tokens.labels(served.prompt_runtime)  # 0 until it runs
        self.metrics.set_model(__version__, served.runtime, served.runtime_version,
                               served.name,
                               served.runtime_properties["INFERENCE_PRECISION_HINT"],
                               ready_s)
        blocks = engine.batch_stats().get("kv_blocks", {})
        self.metrics.set_cache_layout(blocks.get("block_size"), blocks.get("blocks"))
        return engine

    def _preflight_and_tune(self) -> None:
        """Check the system, apply tuning, and let the engine's threads follow the pins."""
        checks = run_checks(self.config)
        actions, cpus = tuning.apply(self.config)
        self.preflight = report(checks, [a.to_dict() for a in actions])
        self.metrics.set_preflight(self.preflight["checks"])
        for check in checks:
            level = {"fail": logging.ERROR, "warn": logging.WARNING}.get(check.status)
            if level is not None and check.id != "model":  # loading the model reports it
                log.log(level, "preflight %s: %s: %s (remedy: %s)", check.id, check.status,
                        check.found, check.remedy)
        for action in actions:
            log.info("tuning %s: %s: %s", action.action, action.result, action.detail)
        self.pinned_cpus = cpus
        self.config = self._threads_follow_pins(self.config)
        self.state.config = self.config

    def _threads_follow_pins(self, config: Config) -> Config:
        """engine.threads auto: as many threads as the daemon is pinned to."""
        if not self.pinned_cpus or config.engine.threads != "auto":
            return config
        engine = config.engine.model_copy(update={"threads": len(self.pinned_cpus)})
        return config.model_copy(update={"engine": engine})

    def _on_reply(self, op: object, outcome: str, seconds: float, uid: int) -> None:
        self.metrics.observe_request(op, outcome, seconds)
        self._record_error(op, outcome, uid)

    def _record_error(self, op: object, outcome: str, uid: int) -> None:
        if outcome not in ("ok", "cancelled"):
            self.last_errors.append({"at": round(time.time(), 3), "op": protocol.op_label(op),
                                     "code": outcome, "uid": uid})

    def _counts(self) -> tuple[int, int]:
        """(running, waiting) generations of the engine serving."""
        engine = self.state.engine
        return engine.counts() if engine is not None else (0, 0)

    def user_label(self, uid: int) -> str:
        """Who ``uid`` is, for people: an HTTP user's key name, else ``uid:N``."""
        name = self.http.callers.users.name(uid) if self.http is not None else None
        return name if name is not None else f"uid:{uid}"

    def _generations(self) -> list[Generation]:
        engine = self.state.engine
        return engine.generations() if engine is not None else []

    def status_details(self, viewer: int | None = None) -> dict[str, Any]:
        """What the daemon is doing right now, for the status op: everything for an
        admin (``viewer`` None), else only the generations and errors of uid ``viewer``
        (errors recorded without a uid are shown to admins only)."""
        now = time.monotonic()
        jobs = [{"uid": gen.uid, "user": self.user_label(gen.uid), "stage": gen.stage,
                 "age_s": round(now - gen.enqueued, 3)}
                for gen in self._generations() if viewer in (None, gen.uid)]
        running, waiting = self._counts()
        engine = self.state.engine
        preempted = engine.preemptions if engine is not None else 0
        errors = [{**e, "user": self.user_label(e["uid"])} if e.get("uid") is not None else e
                  for e in self.last_errors if viewer is None or e.get("uid") == viewer]
        details: dict[str, Any] = {
            "generations": jobs,
            "queue": {"running": running, "waiting": waiting, "preemptions": preempted},
            "last_errors": errors, "pinned_cpus": self.pinned_cpus,
            "threads": self.config.engine.threads,
            "preflight": {c["id"]: c["status"] for c in self.preflight["checks"]}}
        engine = self.state.engine
        if engine is not None:
            stats = engine.stats()
            images, sessions = stats["image_cache"], stats["sessions"]
            lookups = images["hits"] + images["misses"]
            details["caches"] = {
                "image": {**images, "hit_ratio": round(images["hits"] / lookups, 3)
                          if lookups else None},
                "kv_cached_tokens": stats["kv_cached_tokens"],
                "kv_budget_tokens": stats["kv_budget_tokens"],
                "sessions": sessions["entries"],
                # history ids and the raw image bytes kept for rebuilding histories
                "sessions_bytes": sessions["bytes"],
                "session_image_bytes": sessions["image_bytes"],
                "session_image_budget_bytes": sessions["image_budget_bytes"],
                # compiled response formats (their content is never shown)
                "grammars": stats["grammars"],
            }
            batch = stats["batch"]
            if "sequences" in batch:  # a user sees their own running generations only
                batch = {**batch, "sequences": [{**s, "user": self.user_label(s["uid"])}
                                                for s in batch["sequences"]
                                                if viewer in (None, s["uid"])]}
            details["batch"] = batch
        return details

    async def _extend_start_timeout(self) -> None:
        """Keep systemd's start timeout ahead of a cold compile."""
        while True:
            self.notifier.notify("EXTEND_TIMEOUT_USEC=30000000")
            await asyncio.sleep(10)

    async def reload(self) -> dict[str, Any]:
        """Reload config and model beside the old ones; swap only if both are good.

        The model is loaded again only when its settings or files changed: a reload that
        only changes limits keeps the engine, and with it every session and cache. A
        reload that ends while the daemon drains changes nothing (draining wins).
        """
        if self._reload_lock.locked():
            raise Unavailable("a reload is already running")
        async with self._reload_lock:
            if self.state.state == "draining":
                raise Unavailable("the daemon is draining")
            previous = self.state.state
            if previous != "drained":  # a drained daemon stays closed to new work
                self.state.state = "reloading"
            now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            self.notifier.notify("RELOADING=1", f"MONOTONIC_USEC={now_usec}")
            log.info("reloading configuration and model")
            old_engine = self.state.engine
            try:
                config = self._threads_follow_pins(load_config(self.config_path,
                                                               self.overrides))
                restart = [key for key in RESTART_KEYS if _changed(self.config, config, key)]
                config = _keep(self.config, config, restart)
                keys = load_http(config.http)
                if old_engine is not None and self._same_model(config):
                    engine = old_engine
                else:
                    engine = await asyncio.get_running_loop().run_in_executor(
                        None, self._load_engine, config)
            except Exception as exc:
                reason = "; ".join(getattr(exc, "errors", [])) or str(exc)
                log.error("reload failed, still serving the previous model: %s", reason)
                if self.state.state == "reloading":
                    self.state.state = previous
                    self.notifier.ready("reload failed; serving the previous model")
                return {"reloaded": False, "error": reason}
            if self.state.state == "draining":
                log.info("reload finished while draining: not applied")
                return {"reloaded": False, "error": "the daemon is draining"}
            for key in restart:
                log.warning("%s changed: it takes effect only after a restart", key)
            self.config = config
            self.state.config = config
            if old_engine is not None and engine is not old_engine:
                engine.inherit_sessions(old_engine)  # their follow-ups say reset
            self.state.engine = engine  # running jobs finish on the engine they started on
            self._model_files = _model_fingerprint(config.model.path)
            engine.reconfigure(config)
            if self.prepare_stage is not None:
                self.prepare_stage.reconfigure(config)
            if self.server is not None:
                self.server.reconfigure(config.server)
            if self.http is not None:
                self.http.reconfigure(config, keys)
            setup_logging(config)
            # an admin's drain outlasts a reload
            self.state.state = "drained" if previous == "drained" else "ready"
            self.notifier.ready(f"{self.state.state}: {engine.served.name}")
            reloaded_model = engine is not old_engine
            log.info("reload done: serving %s (%s)", engine.served.path,
                     "model reloaded" if reloaded_model else "model unchanged, kept")
            return {"reloaded": True, "model": engine.served.name,
                    "model_reloaded": reloaded_model, "restart_required": restart}

    def _same_model(self, config: Config) -> bool:
        """Whether ``config`` would load the engine already serving: the same model and
        engine settings, and the model's files unchanged on disk."""
        return (config.model == self.config.model and config.engine == self.config.engine
                and _model_fingerprint(config.model.path) == self._model_files)

    # -- watchdog -------------------------------------------------------------------

    def _infer_stuck(self, bound_s: float) -> bool:
        engine = self.state.engine
        return engine is not None and engine.infer_stuck(bound_s)

    async def _watchdog(self, interval_s: float) -> None:
        """WATCHDOG=1 only while this loop runs and no infer call overran its bound."""
        while True:
            await asyncio.sleep(interval_s / 2)
            if self._infer_stuck(interval_s):
                log.error("an inference call has run longer than %.0f s; "
                          "withholding the watchdog ping", interval_s)
                continue
            self.notifier.notify("WATCHDOG=1")

    # -- life cycle -----------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(signum, self._on_signal, signum)
        if os.environ.get("QVLD_DEBUG_FREEZE_ON_SIGUSR2") == "1":
            # Test-only: SIGUSR2 blocks the event loop, as a hung daemon would, so that
            # tests can watch systemd's watchdog restart it.
            loop.add_signal_handler(signal.SIGUSR2, time.sleep, 10**6)
        background: list[asyncio.Task[None]] = []
        prepare = PrepareStage(workers=PREPARE_THREADS,
                               queue_max=self.config.server.prepare_queue_max)
        self.prepare_stage = prepare
        policy = AccessPolicy(self.config.server)
        handlers = Handlers(self.state, prepare,
                            in_flight=lambda: sum(self._counts()),
                            is_admin=lambda peer: self.server is not None
                            and self.server.policy.is_admin(peer),
                            reload=self.reload, metrics=self.metrics,
                            extra_status=self.status_details,
                            preflight=lambda: self.preflight, drain=self.set_drained,
                            user_label=self.user_label)
        self.server = Server(self.config.server, handlers, policy, on_reply=self._on_reply)
        try:
            if self.config.metrics.listen:
                self.exporter = Exporter(self.registry, self.config.metrics.listen)
                try:
                    await self.exporter.start()
                except OSError as exc:
                    # A second daemon on one machine meets the first one's port: say how.
                    log.error("cannot serve metrics on %s: %s; set metrics.listen to "
                              "another HOST:PORT, or to \"\" to serve /metrics on the "
                              "HTTP API (if any) and the socket's metrics op only",
                              self.config.metrics.listen, exc)
                    return EXIT_FAILURE
            fds = named_listen_fds()
            unix_fd = next((fd for fd, name in fds if name != "http"), None)
            http_fd = next((fd for fd, name in fds if name == "http"), None)
            sock = socket.socket(fileno=unix_fd) if unix_fd is not None else None
            try:
                await self.server.start(sock)
            except (SocketInUse, OSError) as exc:
                log.error("cannot listen: %s", exc)
                return EXIT_FAILURE
            log.info("listening on %s%s", self.server.address,
                     " (socket activation)" if sock is not None else "")
            code = await self._start_http(handlers, http_fd)
            if code is not None:
                return code
            if self.notifier.enabled:
                background.append(asyncio.create_task(self._extend_start_timeout()))
            self._preflight_and_tune()
            self.notifier.status("loading model")
            code = await self._start_engine(loop)
            for task in background:
                task.cancel()
            background.clear()
            if code is not None:
                return code
            self.state.state = "ready"
            self.metrics.ready.set(1)
            assert self.state.engine is not None
            self.notifier.ready(f"ready: {self.state.engine.served.name}")
            log.info("ready")
            watchdog_usec = os.environ.get("WATCHDOG_USEC")
            if watchdog_usec and os.environ.get("WATCHDOG_PID", str(os.getpid())) == str(
                    os.getpid()):
                background.append(asyncio.create_task(
                    self._watchdog(int(watchdog_usec) / 1e6)))
            return await self._serve_until_stopped()
        finally:
            for task in background:
                task.cancel()
            await self._shutdown()
            prepare.close()
            self.notifier.close()

    async def _start_http(self, handlers: Handlers, fd: int | None) -> int | None:
        """The OpenAI-compatible listener, when configured or passed by systemd; an exit
        code if the daemon must not go on."""
        if fd is None and not self.config.http.listen:
            return None
        try:
            keys = load_http(self.config.http)
        except HttpSetupError as exc:
            for line in exc.errors:
                log.error("%s", line)
            return EXIT_CONFIG
        self.http = HttpFront(self.config, self.state, handlers, self.metrics, keys,
                              policy=self._access_policy, on_reply=self._on_http_reply)
        try:
            await self.http.start(socket.socket(fileno=fd) if fd is not None else None)
        except OSError as exc:
            log.error("cannot serve HTTP on %s: %s", self.config.http.listen, exc)
            return EXIT_FAILURE
        return None

    def _access_policy(self) -> AccessPolicy:
        """Who may use the daemon: one decision for the socket and keyless HTTP."""
        assert self.server is not None
        return self.server.policy

    def _on_http_reply(self, op: str, outcome: str, seconds: float, uid: int) -> None:
        self._record_error(op, outcome, uid)

    async def _start_engine(self, loop: asyncio.AbstractEventLoop) -> int | None:
        """Load the model; an exit code if the daemon must not go on."""
        load: asyncio.Future[Engine] = loop.run_in_executor(None, self._load_engine,
                                                             self.config)
        while not load.done():
            self._wake.clear()
            waiter: asyncio.Future[Any] = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait([load, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if any(s in (signal.SIGTERM, signal.SIGINT) for s in self._signals):
                log.info("stopping before the model finished loading")
                return EXIT_OK
        try:
            self.state.engine = load.result()
        except ModelInvalid as exc:
            log.error("model: %s", exc)
            return EXIT_CONFIG
        except Exception:
            log.exception("the model failed to load")
            return EXIT_FAILURE
        return None

    async def _serve_until_stopped(self) -> int:
        while True:
            while self._signals:
                signum = self._signals.pop(0)
                if signum == signal.SIGHUP:
                    if not self._reload_lock.locked():
                        task = asyncio.create_task(self.reload())
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                    continue
                log.info("received %s: draining", signal.Signals(signum).name)
                await self._drain()
                return EXIT_OK
            await self._wake.wait()
            self._wake.clear()

    def set_drained(self, drained: bool) -> None:
        """The drain admin op: a drained daemon admits no new generations and reports
        not ready, but keeps its listeners, sessions and caches, finishes what it
        admitted, and takes work again when undrained. Only from ready (or back)."""
        state = self.state.state
        if drained and state == "ready":
            self.state.state = "drained"
            self.metrics.ready.set(0)
            self.notifier.status("drained: taking no new requests")
            log.info("drained by an admin: taking no new generations")
        elif not drained and state == "drained":
            self.state.state = "ready"
            self.metrics.ready.set(1)
            assert self.state.engine is not None
            self.notifier.status(f"ready: {self.state.engine.served.name}")
            log.info("resumed by an admin: taking generations again")
        elif state not in ("ready", "drained"):
            raise Unavailable(f"the daemon is {state}")

    async def _drain(self) -> None:
        self.state.state = "draining"
        self.metrics.ready.set(0)
        self.notifier.notify("STOPPING=1", "STATUS=draining")
        assert self.server is not None
        await self.server.stop_accepting()
        if self.http is not None:
            await self.http.stop_accepting()
        timeout = self.config.server.drain_timeout_s
        deadline = time.monotonic() + timeout
        while self._generations() and time.monotonic() < deadline:
            if signal.SIGINT in self._signals:  # a second SIGINT: no more waiting
                log.info("second SIGINT: cancelling at once")
                break
            await asyncio.sleep(0.02)
        left = self._generations()
        engine = self.state.engine
        if left and engine is not None:
            for gen in left:
                engine.cancel(gen)
            log.info("cancelled %d request(s) still running after the drain", len(left))
            deadline = time.monotonic() + 10
            while self._generations() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)

    async def _shutdown(self) -> None:
        """Reverse of start: no new work, workers stop, connections close."""
        if self.state.engine is not None:
            self.state.engine.close()
        if self.exporter is not None:
            await self.exporter.close()
        if self.http is not None:
            with contextlib.suppress(Exception):
                await self.http.close()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.sleep(0.05)  # let the last replies reach their sockets
                await self.server.close()
        # The journal's last word on this run: an operator reading it knows it ended here.
        log.info("stopped after %.0f s up", time.monotonic() - self.state.started)
