"""Op name -> function: validate params, call the engine, return plain data."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from qvld import __version__, protocol
from qvld.config import Config
from qvld.engine import Engine
from qvld.engine.inputs.prompt_builder import PrepareStopped
from qvld.engine.inputs.request import bool_param, int_param, parse_deadline, parse_generate
from qvld.engine.preparer import PreparedRequest
from qvld.engine.types import GenerateResult, TokenCallback, cancelled_result
from qvld.errors import BadRequest, Forbidden, Timeout, Unavailable, UnsupportedVersion
from qvld.metrics import Metrics
from qvld.prepare import PrepareCancelled, PrepareStage
from qvld.server import Peer, RequestContext

# Shown to admins only: who may connect or administer, and where things live.
ADMIN_ONLY_CONFIG = (("server", "allow_uids"), ("server", "allow_groups"),
                     ("server", "admin_groups"), ("server", "socket"),
                     ("model", "path"), ("model", "cache_dir"), ("http", "api_keys_file"))
HIDDEN = "<hidden>"

@dataclass
class DaemonState:
    """What the handlers report on: set by the app as it starts, reloads and stops."""

    config: Config
    # loading | ready | reloading | drained (an admin's drain: no new generations) |
    # draining (stopping)
    state: str = "loading"
    engine: Engine | None = None
    started: float = field(default_factory=time.monotonic)
    requests_total: int = 0

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.engine is not None

    def require_engine(self) -> Engine:
        if self.state == "drained":
            raise Unavailable("the daemon is drained: it takes no new generations "
                              "(qvlctl resume takes them again)")
        if self.engine is None or self.state in ("loading", "draining"):
            raise Unavailable(f"the daemon is {self.state}")
        return self.engine

    async def wait_engine(self, timeout: float) -> Engine:
        """The engine; while loading (e.g. just socket-activated), wait for it."""
        deadline = time.monotonic() + timeout
        while self.state == "loading" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.require_engine()


class Handlers:
    def __init__(self, state: DaemonState,
                 prepare_stage: PrepareStage,
                 in_flight: Callable[[], int] | None = None,
                 is_admin: Callable[[Peer], bool] | None = None,
                 reload: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                 metrics: Metrics | None = None,
                 extra_status: Callable[[int | None], dict[str, Any]] | None = None,
                 preflight: Callable[[], dict[str, Any]] | None = None,
                 drain: Callable[[bool], None] | None = None,
                 user_label: Callable[[int], str] | None = None) -> None:
        self._preflight = preflight
        self.user_label = user_label or (lambda uid: f"uid:{uid}")
        self._drain = drain
        self.generating = 0  # generate calls admitted and not finished, both front doors
        self.state = state
        self.metrics = metrics
        self.extra_status = extra_status
        self.prepare_stage = prepare_stage
        self.in_flight = in_flight
        self.is_admin = is_admin or (lambda peer: peer.uid == 0)
        self._reload = reload
        self.ops = {
            "hello": self.hello,
            "health": self.health,
            "status": self.status,
            "config": self.config,
            "generate": self.generate,
            "count_tokens": self.count_tokens,
            "cancel": self.cancel,
            "reload": self.reload,
            "drain": self.drain,
            "sessions": self.sessions,
            "metrics": self.metrics_text,
            "preflight": self.preflight,
        }

    async def __call__(self, ctx: RequestContext) -> Any:
        handler = self.ops.get(ctx.request.op)
        if handler is None:
            raise BadRequest(f"op {ctx.request.op!r} is not available in this version")
        self.state.requests_total += 1
        return await handler(ctx)

    def limits(self) -> dict[str, Any]:
        cfg = self.state.config
        return {
            "max_frame_bytes": cfg.server.max_frame_bytes,
            "max_images": cfg.engine.max_images,
            "max_image_tokens": cfg.engine.max_image_tokens,
            "max_new_tokens": cfg.engine.max_new_tokens,
            "max_context_tokens": cfg.engine.max_context_tokens,
            "max_stop_strings": protocol.MAX_STOP_STRINGS,
        }

    def model_name(self) -> str | None:
        engine = self.state.engine
        return None if engine is None else engine.served.name

    async def hello(self, ctx: RequestContext) -> dict[str, Any]:
        version = ctx.request.params.get("v", protocol.PROTOCOL_VERSION)
        if version != protocol.PROTOCOL_VERSION:
            raise UnsupportedVersion(f"protocol v{version} is not spoken here; "
                                     f"this daemon speaks v{protocol.PROTOCOL_VERSION}")
        return {"v": protocol.PROTOCOL_VERSION, "server_version": __version__,
                "model": self.model_name(), "limits": self.limits()}

    async def health(self, ctx: RequestContext) -> dict[str, Any]:
        return {"state": self.state.state, "ready": self.state.ready}

    async def status(self, ctx: RequestContext) -> dict[str, Any]:
        state = self.state
        engine = state.engine
        result: dict[str, Any] = {
            "state": state.state,
            "ready": state.ready,
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - state.started, 3),
            "requests_total": state.requests_total,
            "model": None,
        }
        if self.in_flight is not None:
            result["requests_in_flight"] = self.in_flight()
        admin = self.is_admin(ctx.peer)
        if self.extra_status is not None:  # a non-admin sees only their own requests
            result.update(self.extra_status(None if admin else ctx.peer.uid))
        if engine is not None:
            stats = engine.stats()
            result["model"] = {
                "name": stats["name"], "path": stats["path"] if admin else HIDDEN,
                **{key: stats[key] for key in ("load_s", "runtime", "infer_requests",
                                               "max_context_tokens")}}
        return result

    async def config(self, ctx: RequestContext) -> dict[str, Any]:
        """The effective configuration; to a non-admin without who may connect or
        administer, and where the model, its cache and the socket live."""
        config: dict[str, Any] = self.state.config.model_dump(mode="json")
        if not self.is_admin(ctx.peer):
            for section, key in ADMIN_ONLY_CONFIG:
                config[section][key] = HIDDEN
        return config

    async def count_tokens(self, ctx: RequestContext) -> dict[str, Any]:
        """The prompt tokens a ``generate`` with these params would feed (its template,
        tools and images; no session history), prepared on the prepare stage like a
        generation's, and nothing generated."""
        params = {k: v for k, v in ctx.request.params.items() if k != "session"}
        request, _ = parse_generate(params)
        uid = ctx.peer.uid
        timeout = self.state.config.server.request_timeout_s
        deadline = time.monotonic() + timeout
        engine = await self.state.wait_engine(timeout)
        ticket = self.prepare_stage.submit(
            uid, lambda: engine.tokenize(request, uid, ctx.cancelled.is_set), deadline,
            media=_has_media(request.messages))
        ctx.on_cancel.append(lambda: self.prepare_stage.cancel(ticket))
        ids, images, _ = await self.prepare_stage.result(ticket)
        return {"input_tokens": len(ids), "image_tokens": sum(i.tokens for i in images)}

    async def generate(self, ctx: RequestContext) -> dict[str, Any]:
        self.generating += 1
        try:
            return await self._generate(ctx)
        finally:
            self.generating -= 1

    async def _generate(self, ctx: RequestContext) -> dict[str, Any]:
        request, stream = parse_generate(ctx.request.params)
        uid = ctx.peer.uid
        limit = self.state.config.server.request_timeout_s
        deadline_s = parse_deadline(ctx.request.params)
        timeout = min(deadline_s or limit, limit)
        job_deadline = time.monotonic() + timeout
        # A request that woke the daemon (socket activation) waits for the model.
        engine = await self.state.wait_engine(timeout)

        def stop_preparing() -> bool:
            return ctx.cancelled.is_set() or time.monotonic() >= job_deadline

        ticket = self.prepare_stage.submit(
            uid, lambda: engine.prepare(request, uid, stop_preparing), job_deadline,
            media=_has_media(request.messages))
        ctx.on_cancel.append(lambda: self.prepare_stage.cancel(ticket))
        if ctx.cancelled.is_set():
            self.prepare_stage.cancel(ticket)
        try:
            prepared = await self.prepare_stage.result(ticket)
        except (PrepareCancelled, PrepareStopped, Timeout) as exc:
            if ctx.cancelled.is_set():  # the client left or cancelled it
                ctx.outcome = "cancelled"
                return cancelled_result().to_dict()
            if isinstance(exc, PrepareStopped):
                raise Timeout("the deadline passed while the request's images were "
                              f"decoded ({exc})") from None
            raise
        constraint = prepared.constraint
        if constraint is not None and constraint.ready:
            # Compiled already (or failed, or out of time): its typed error, or no answer
            # in the format fitting max_tokens, refused before anything runs. A compile
            # still running goes on beside image encoding and prefill; only the first
            # constrained token waits for it (and the budget is checked then).
            constraint.check()
            constraint.check_room(prepared.max_tokens)
        rid = ctx.request.id

        def events(index: int | None) -> TokenCallback:
            def on_token(text: str, ids: list[int],
                         logprobs: list[dict[str, Any]] | None = None) -> None:
                ctx.send_event(protocol.token_event(rid, text, ids, logprobs, index))
            return on_token

        n = request.n
        callbacks = [events(i if n > 1 else None) if stream else None for i in range(n)]
        results = await self._run(engine, prepared, callbacks, ctx, job_deadline)
        if self.metrics is not None:
            for one in results:
                self.metrics.observe_generation(one)
        result = results[0]
        t, usage = result.timings, result.usage
        # Typed, unit-named: logging.format json writes each as its own key.
        ctx.log_fields.update(
            prompt_tokens=usage.prompt_tokens, image_tokens=usage.image_tokens,
            cached_tokens=usage.cached_tokens, generated_tokens=usage.completion_tokens,
            finish=result.finish_reason, queue_s=round(t.queue_s, 6),
            ttft_s=round(t.ttft_s, 6), decode_s=round(t.decode_s, 6))
        if result.response_format is not None:
            ctx.log_fields["response_format"] = result.response_format
            ctx.log_fields["forced_tokens"] = sum(r.usage.forced_tokens for r in results)
        if self.state.config.logging.log_prompts:
            ctx.log_fields["prompt_text"] = repr(_prompt_text(request.messages))
        if result.finish_reason == "cancelled":
            ctx.outcome = "cancelled"
        if n == 1:
            return result.to_dict()
        ctx.log_fields.update(choices=n, generated_tokens=sum(
            r.usage.completion_tokens for r in results))
        return choices_result(results)

    @staticmethod
    async def _run(engine: Engine, prepared: PreparedRequest,
                   on_tokens: list[TokenCallback | None], ctx: RequestContext,
                   deadline: float) -> list[GenerateResult]:
        """The generation (one per choice), awaited without holding a thread: cancelled
        when the client leaves, and a Timeout when the deadline passes first (a waiting
        one ends at once, a running one at its next step). A choice that fails ends the
        others."""
        gens = engine.submit_choices(prepared, on_tokens,
                                     should_stop=lambda: time.monotonic() >= deadline)

        def cancel_all() -> None:
            for gen in gens:
                engine.cancel(gen)

        ctx.on_cancel.append(cancel_all)
        if ctx.cancelled.is_set():  # the client left while the request was prepared
            cancel_all()
        futures = [asyncio.wrap_future(gen.future) for gen in gens]
        everything = asyncio.gather(*futures)
        try:
            results = await asyncio.wait_for(asyncio.shield(everything),
                                             max(0.0, deadline - time.monotonic()) + 0.05)
        except asyncio.TimeoutError:
            cancel_all()
            results = await everything
        except Exception:
            cancel_all()  # one choice failed: the others stop too
            await asyncio.gather(*futures, return_exceptions=True)
            raise
        for gen, result in zip(gens, results, strict=True):
            if (result.finish_reason == "cancelled" and not ctx.cancelled.is_set()
                    and time.monotonic() >= deadline):
                where = (f"after {len(result.token_ids)} tokens" if gen.started is not None
                         else "while queued")
                raise Timeout(f"the deadline passed {where}")
        return list(results)

    async def cancel(self, ctx: RequestContext) -> dict[str, Any]:
        target = int_param(ctx.request.params, "target")
        if target is None:
            raise BadRequest("cancel needs params.target, the id of a request in flight")
        victim = ctx.connection.in_flight.get(target)
        if victim is None:
            return {"cancelled": False}
        victim.cancel()
        return {"cancelled": True}

    async def sessions(self, ctx: RequestContext) -> dict[str, Any]:
        """List or close your sessions. Sessions are per uid, so a non-admin's answers
        never depend on anyone else's. An admin may list everyone's (all: true) and close
        another user's by naming its uid; that user is told on their next turn (reset)."""
        engine = self.state.require_engine()
        params = ctx.request.params
        action = params.get("action", "list")
        admin = self.is_admin(ctx.peer)
        if action == "list":
            everyone = bool_param(params, "all")
            if everyone and not admin:
                raise Forbidden("listing every user's sessions is an admin op")
            return {"sessions": [{**s, "user": self.user_label(s["uid"])} for s in
                                 engine.list_sessions(None if everyone else ctx.peer.uid)]}
        if action == "close":
            sid = params.get("id")
            if not isinstance(sid, str):
                raise BadRequest("sessions close needs params.id")
            owner = int_param(params, "uid")
            owner = ctx.peer.uid if owner is None else owner
            if owner != ctx.peer.uid and not admin:
                raise Forbidden("closing another user's session is an admin op")
            return {"closed": engine.close_session(owner, sid,
                                                   by_owner=owner == ctx.peer.uid)}
        raise BadRequest("sessions action must be 'list' or 'close'")

    async def preflight(self, ctx: RequestContext) -> dict[str, Any]:
        """The checks run at start-up and the tuning the daemon applied."""
        if self._preflight is None:
            raise Unavailable("preflight results are not available")
        return self._preflight()

    async def metrics_text(self, ctx: RequestContext) -> dict[str, Any]:
        if self.metrics is None:
            raise Unavailable("metrics are not collected")
        return {"text": self.metrics.exposition()}

    async def reload(self, ctx: RequestContext) -> dict[str, Any]:
        if not self.is_admin(ctx.peer):
            raise Forbidden("reload is an admin op (root or a member of server.admin_groups)")
        if self._reload is None:
            raise Unavailable("reload is not available")
        return await self._reload()

    async def drain(self, ctx: RequestContext) -> dict[str, Any]:
        """``{action: start}`` (the default): take no new generations, finish the ones
        admitted, report not ready (a load balancer moves traffic away); ``stop``: take
        them again; ``status``: only report. The reply says how many are still running."""
        action = ctx.request.params.get("action", "start")
        if action not in ("start", "stop", "status"):
            raise BadRequest("drain: action must be start, stop or status")
        if action != "status" and not self.is_admin(ctx.peer):
            raise Forbidden("drain is an admin op (root or a member of server.admin_groups)")
        if self._drain is None:
            raise Unavailable("drain is not available")
        if action != "status":
            self._drain(action == "start")
        # this op's own call is not a generation; the others still running are
        return {"state": self.state.state, "in_flight": self.generating}


def choices_result(results: list[GenerateResult]) -> dict[str, Any]:
    """``n`` > 1: the first choice's result, every choice under ``choices`` (index, text,
    token_ids, finish_reason, and logprobs and tool_calls when there are), and usage
    counting the prompt once and every choice's tokens."""
    out = results[0].to_dict()
    keep = ("text", "token_ids", "finish_reason", "logprobs", "tool_calls")
    out["choices"] = [{"index": i, **{k: v for k, v in r.to_dict().items() if k in keep}}
                      for i, r in enumerate(results)]
    out["usage"]["completion_tokens"] = sum(r.usage.completion_tokens for r in results)
    out["usage"]["forced_tokens"] = sum(r.usage.forced_tokens for r in results)
    return out


def _prompt_text(messages: Any) -> str:
    """The text parts of a request (logged only with logging.log_prompts)."""
    parts = []
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [p.get("text", "[image]") for p in content if isinstance(p, dict)]
    return " | ".join(str(p) for p in parts)


def _has_media(messages: Any) -> bool:
    """Whether a request's messages hold images or video (their decoding is the prepare
    stage's long work). Not checked yet: anything malformed is the prepare's to refuse."""
    if not isinstance(messages, list):
        return False
    return any(isinstance(part, dict) and part.get("type") in ("image", "video")
               for message in messages if isinstance(message, dict)
               and isinstance(message.get("content"), list)
               for part in message["content"])
