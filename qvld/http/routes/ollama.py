"""Ollama's API: chat, generate, and the model listings its clients ask for."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from qvld import __version__
from qvld.http import ollama
from qvld.http.dialect import bad
from qvld.http.routing import Front, Handler, Route, session_header


class OllamaRoutes:
    def __init__(self, front: Front) -> None:
        self.front = front

    def routes(self) -> list[Route]:
        def route(method: str, path: str, handler: Handler, op: str) -> Route:
            return Route(method, path, handler, op, "ollama", ollama.error_body)

        return [route("POST", "/api/chat", self.chat, "generate"),
                route("POST", "/api/generate", self.generate, "generate"),
                route("GET", "/api/tags", self.tags, "models"),
                route("POST", "/api/show", self.show, "models"),
                route("GET", "/api/ps", self.ps, "models"),
                route("GET", "/api/version", self.version, "models")]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, ollama.parse_chat, "message")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, ollama.parse_generate, "response")

    async def _generation(self, request: web.Request,
                          parse: Callable[[Any, str | None], ollama.OllamaRequest],
                          key: str) -> web.StreamResponse:
        front = self.front
        caller = await front.callers.identify(request)
        body = await front.bodies.read_json(request, caller.peer.uid)
        asked = parse(body, session_header(request))
        replies = ollama.OllamaReplies(asked.model or front.model_name(), key)
        response, request["outcome"] = await front.generations.run(
            request, asked.params, asked.stream, replies, caller.peer, request["fields"])
        return response

    def _model(self) -> dict[str, Any]:
        """The served model as Ollama lists it."""
        engine = self.front.state.require_engine()
        files = [p for p in engine.served.path.rglob("*") if p.is_file()]
        digest = hashlib.sha256(b"".join(
            f"{p.relative_to(engine.served.path)}:{p.stat().st_size}\n".encode()
            for p in sorted(files))).hexdigest()
        modified = max((p.stat().st_mtime for p in files), default=time.time())
        runtime = engine.stats()["runtime"]
        return {"name": engine.served.name, "model": engine.served.name,
                "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(modified)),
                "size": sum(p.stat().st_size for p in files), "digest": digest,
                "details": {"parent_model": "", "format": runtime["name"],
                            "family": "qwen3vl", "families": ["qwen3vl"],
                            "parameter_size": "", "quantization_level":
                            runtime.get("WEIGHTS", "unknown")}}

    async def tags(self, request: web.Request) -> web.StreamResponse:
        await self.front.callers.identify(request)
        return web.json_response({"models": [self._model()]})

    async def ps(self, request: web.Request) -> web.StreamResponse:
        await self.front.callers.identify(request)
        entry = self._model()
        engine = self.front.state.require_engine()
        return web.json_response({"models": [{
            **entry, "expires_at": "2318-01-01T00:00:00Z",  # loaded while the daemon runs
            "size_vram": 0, "context_length": engine.stats()["max_context_tokens"]}]})

    async def show(self, request: web.Request) -> web.StreamResponse:
        front = self.front
        caller = await front.callers.identify(request)
        body = await front.bodies.read_json(request, caller.peer.uid)
        if not isinstance(body, dict) or not isinstance(body.get("model") or
                                                        body.get("name"), str):
            raise bad("model", "model must be a string")
        engine = front.state.require_engine()
        entry = self._model()
        context = engine.stats()["max_context_tokens"]
        return web.json_response({
            "modelfile": "", "parameters": "", "template": engine.served.chat_template,
            "details": entry["details"], "modified_at": entry["modified_at"],
            "model_info": {"general.architecture": "qwen3vl",
                           "general.basename": engine.served.name,
                           "qwen3vl.context_length": context},
            "capabilities": ["completion", "vision", "tools"]})

    async def version(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"version": __version__})
