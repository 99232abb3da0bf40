"""OpenAI's chat completions, legacy text completions and model listing."""

from __future__ import annotations

import json
import time

from aiohttp import web

from qvld.engine.inputs.video import MAX_DECODED_FRAMES
from qvld.http import completions, openai, openai_replies
from qvld.http.routing import Front, Route, error_response, session_header


class OpenAIRoutes:
    def __init__(self, front: Front) -> None:
        self.front = front

    def routes(self) -> list[Route]:
        return [Route("POST", "/v1/chat/completions", self.chat_completions, "generate"),
                Route("POST", "/v1/completions", self.completions, "generate"),
                Route("GET", "/v1/models", self.models, "models"),
                Route("GET", "/v1/models/{model}", self.models, "models")]

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        front = self.front
        caller = await front.callers.identify(request)
        body = await front.bodies.read_json(request, caller.peer.uid)
        chat = openai.parse_chat(body, session_header(request),
                                 front.config.low_detail_image_tokens)
        fields = request["fields"]
        if chat.user is not None:
            fields["end_user"] = json.dumps(chat.user)
        await front.fetch_images(chat.remote_images)
        response, request["outcome"] = await front.generations.run(
            request, chat.params, chat.stream, openai_replies.ChatReplies(chat, front.model_name()),
            caller.peer, fields)
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """The legacy text completions: a raw prompt, no chat template."""
        front = self.front
        caller = await front.callers.identify(request)
        body = await front.bodies.read_json(request, caller.peer.uid)
        asked = completions.parse_completion(body)
        if asked.user is not None:
            request["fields"]["end_user"] = json.dumps(asked.user)
        replies = completions.CompletionReplies(asked, asked.model or front.model_name())
        response, request["outcome"] = await front.generations.run(
            request, asked.params, asked.stream, replies, caller.peer, request["fields"])
        return response

    async def models(self, request: web.Request) -> web.StreamResponse:
        front = self.front
        await front.callers.identify(request)
        state = front.state
        engine = state.require_engine()
        entry = {"id": engine.served.name, "object": "model",
                 "created": int(time.time() - (time.monotonic() - state.started)),
                 "owned_by": "qvld", "input_modalities": ["text", "image", "video"],
                 "output_modalities": ["text"],
                 # Which runtime computes the answers (the web page shows it).
                 "runtime": f"{engine.served.runtime} {engine.served.runtime_version}",
                 "context_length": engine.stats()["max_context_tokens"],
                 "max_completion_tokens": (state.config.engine.max_new_tokens or
                                           engine.stats()["max_context_tokens"]),
                 # The largest body taken (the page checks a picture or clip's size first).
                 "max_request_bytes": front.config.max_body_bytes,
                 # What a clip may cost to decode (the page reads a clip's header and
                 # refuses one past these before sending it).
                 "clip_limits": {
                     "max_frame_pixels": state.config.engine.max_decode_pixels,
                     "max_decoded_pixels": state.config.engine.max_clip_decode_pixels,
                     "max_frames": MAX_DECODED_FRAMES}}
        wanted = request.match_info.get("model")
        if wanted is None:
            return web.json_response({"object": "list", "data": [entry]})
        if wanted != entry["id"]:
            request["outcome"] = "not_found"
            return error_response(*openai.error_body(
                code="not_found", message=f"model {wanted!r} is not served here; "
                f"this server serves {entry['id']!r}", param="model"))
        return web.json_response(entry)
