"""OpenAI's Responses API and each user's stored responses."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from qvld.http import openai, responses
from qvld.http.dialect import bad
from qvld.http.response_store import ResponseStore
from qvld.http.routing import Front, Route


class ResponsesRoutes:
    def __init__(self, front: Front) -> None:
        self.front = front
        self.kept = ResponseStore()  # for previous_response_id

    def routes(self) -> list[Route]:
        return [Route("POST", "/v1/responses", self.responses, "generate",
                      "responses", openai.error_body),
                Route("GET", "/v1/responses/{id}", self.stored_response, "models",
                      "responses", openai.error_body),
                Route("DELETE", "/v1/responses/{id}", self.stored_response, "models",
                      "responses", openai.error_body)]

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API (``responses``), on the same generation path; stored
        responses are each user's own."""
        front = self.front
        caller = await front.callers.identify(request)
        uid = caller.peer.uid
        body = await front.bodies.read_json(request, uid)
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if previous is not None and not isinstance(previous, str):
            raise bad("previous_response_id", "previous_response_id must be a string")
        asked = responses.parse_responses(
            body, self.kept.conversation(uid, previous) if previous else None)
        await front.fetch_images(asked.remote_images)

        def kept(response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
            if asked.store:
                self.kept.keep(uid, response, conversation)

        replies = responses.ResponseReplies(asked, asked.model or front.model_name(), kept)
        response, request["outcome"] = await front.generations.run(
            request, asked.params, asked.stream, replies, caller.peer, request["fields"])
        return response

    async def stored_response(self, request: web.Request) -> web.StreamResponse:
        """GET or DELETE one of the caller's stored responses."""
        caller = await self.front.callers.identify(request)
        rid = request.match_info["id"]
        if request.method == "DELETE":
            self.kept.delete(caller.peer.uid, rid)
            return web.json_response({"id": rid, "object": "response.deleted",
                                      "deleted": True})
        return web.json_response(self.kept.get(caller.peer.uid, rid))
