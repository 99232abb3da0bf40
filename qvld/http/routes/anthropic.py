"""Anthropic's Messages API and its token count."""

from __future__ import annotations

import json

from aiohttp import web

from qvld.http import anthropic
from qvld.http.routing import Front, Route, session_header


class AnthropicRoutes:
    def __init__(self, front: Front) -> None:
        self.front = front

    def routes(self) -> list[Route]:
        return [Route("POST", "/v1/messages", self.messages, "generate",
                      "anthropic", anthropic.error_body),
                Route("POST", "/v1/messages/count_tokens", self.count_tokens,
                      "count_tokens", "anthropic", anthropic.error_body)]

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """The Anthropic Messages API (``anthropic``), on the same generation path."""
        front = self.front
        caller = await front.callers.identify(request)
        body = await front.bodies.read_json(request, caller.peer.uid)
        asked = anthropic.parse_messages(body, session_header(request))
        fields = request["fields"]
        if asked.user is not None:
            fields["end_user"] = json.dumps(asked.user)
        await front.fetch_images(asked.remote_images)
        engine = front.state.engine
        eos = frozenset(engine.served.eos_token_ids) if engine else frozenset()
        replies = anthropic.MessageReplies(asked, asked.model or front.model_name(), eos)
        response, request["outcome"] = await front.generations.run(
            request, asked.params, asked.stream, replies, caller.peer, fields)
        return response

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        """``/v1/messages/count_tokens``: the prompt's tokens, nothing run."""
        front = self.front
        caller = await front.callers.identify(request)
        body = await front.bodies.read_json(request, caller.peer.uid)
        asked = anthropic.parse_messages(body, counting=True)
        await front.fetch_images(asked.remote_images)
        counted = await front.generations.call("count_tokens", asked.params, caller.peer)
        return web.json_response({"input_tokens": counted["input_tokens"]})
