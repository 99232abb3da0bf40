"""The Anthropic Messages API (``POST /v1/messages``) <-> protocol v1 ``generate``:
translation only, no I/O.

``parse_messages`` turns a Messages body into the params the socket's ``generate`` takes
(one parser, ``qvld.engine.inputs.request``, still checks every value):

- ``system`` (a string or text blocks) becomes the first message; ``messages`` hold
  ``text``, ``image`` (``source`` of type ``base64``, or ``url`` fetched under the
  server's image-URL rules), ``tool_use`` (an assistant's call: its ``input`` becomes
  the call's arguments) and ``tool_result`` blocks (each a ``tool`` message, in order);
- ``tools`` (``name``, ``description``, ``input_schema``) and ``tool_choice`` (``auto``,
  ``any``, ``tool``, ``none``; ``disable_parallel_tool_use``) become OpenAI-shaped tools,
  the calls enforced by the same grammar; ``stop_sequences`` are ``stop``;
- ``max_tokens`` is required, as the API requires it; ``output_config.format`` (a JSON
  schema) is enforced as a response format; ``temperature``, ``top_p``, ``top_k`` (which
  the API has since dropped) pass through for the clients that send them;
  ``metadata.user_id`` is logged; what asks for nothing here (``cache_control``: the
  prefix cache is automatic; ``thinking`` disabled or adaptive: this model does not
  think; ``service_tier``, ``speed``, ``inference_geo``...) is accepted; unknown fields
  are refused with a did-you-mean.

``MessageReplies`` shapes the answer: a ``message`` with ``text`` and ``tool_use``
blocks, ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``)
and ``usage`` (cached prompt tokens as ``cache_read_input_tokens``), or the stream's
events (``message_start``, ``content_block_start``/``delta``/``stop``, ``message_delta``,
``message_stop``). A call's ``input`` is the model's JSON as written (never
re-serialised). Errors have the API's shape: ``{"type": "error", "error": {"type",
"message"}}``.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from qvld.config import did_you_mean
from qvld.errors import QvlError
from qvld.http.dialect import bad, dumps_with_raw, error_status, raw_json, sse
from qvld.http.media import DATA_URL, RemoteImage, data_url_bytes

FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "tools",
    "tool_choice", "metadata", "output_config",
    # sampling, as the API had it and older clients send it; qvld's extensions
    "temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty", "ignore_eos",
    "max_image_tokens",
    # accepted, asking for nothing here (checked for their type): the prefix cache is
    # automatic, there is one place, one speed, one tier, and the model does not think
    "thinking", "service_tier", "cache_control", "container", "diagnostics",
    "inference_geo", "speed", "user_profile_id", "workspace_id",
})
# Passed to protocol v1 as they are (its parser checks them).
PASSED = ("temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty",
          "ignore_eos", "max_image_tokens")
# name -> the types it may have (what the API documents).
ACCEPTED: dict[str, tuple[type, ...]] = {
    "service_tier": (str,), "cache_control": (dict,), "diagnostics": (dict,),
    "inference_geo": (str,), "speed": (str,), "user_profile_id": (str,),
    "workspace_id": (str,), "container": (str, dict)}
# What the API's error "type" is for each HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               415: "invalid_request_error", 421: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
IMAGE_MEDIA = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})


@dataclass
class MessagesRequest:
    params: dict[str, Any]  # protocol v1 generate params
    stream: bool
    model: str | None
    stop_sequences: list[str]
    user: str | None = None
    remote_images: list[RemoteImage] = field(default_factory=list)


def parse_messages(body: Any, session: str | None = None, *,
                   counting: bool = False) -> MessagesRequest:
    """A Messages body -> protocol v1 generate params (``session``: the X-Qvld-Session
    header; ``counting``: for count_tokens, where max_tokens is not sent)."""
    if not isinstance(body, dict):
        raise bad("", "the request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise bad(str(name), f"unknown field {name!r}{did_you_mean(str(name), FIELDS)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string")
    tokens = body.get("max_tokens")
    if tokens is None and not counting:
        raise bad("max_tokens", "max_tokens is required")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be true or false")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type")
                                 not in ("disabled", "adaptive")):
        raise bad("thinking", "this model does not think: thinking may be "
                  "{\"type\": \"disabled\"} or {\"type\": \"adaptive\"}")
    for name, types in ACCEPTED.items():
        if body.get(name) is not None and not isinstance(body[name], types):
            raise bad(name, f"{name} must be {' or '.join(t.__name__ for t in types)}")
    user = _user(body.get("metadata"))
    remote: list[RemoteImage] = []
    messages = _system(body.get("system")) + _messages(body.get("messages"), remote)
    params: dict[str, Any] = {"messages": messages, "stream": stream}
    if tokens is not None:
        params["max_tokens"] = tokens
    for name in PASSED:
        if body.get(name) is not None:
            params[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("stop_sequences", "stop_sequences must be a list of strings")
        params["stop"] = stops
    tools, choice, parallel = _tools(body.get("tools"), body.get("tool_choice"))
    if tools is not None:
        params["tools"] = tools
    if choice is not None:
        params["tool_choice"] = choice
    if parallel is not None:
        params["parallel_tool_calls"] = parallel
    output = _output_format(body.get("output_config"))
    if output is not None:
        params["response_format"] = output
    if session is not None:
        params["session"] = session
    return MessagesRequest(params, stream, model, list(stops or []), user, remote)


def _output_format(config: Any) -> dict[str, Any] | None:
    """``output_config``: its ``format`` (a JSON schema the answer must match) becomes the
    response format; ``effort`` is accepted (one effort here)."""
    if config is None:
        return None
    if not isinstance(config, dict) or set(config) - {"format", "effort"}:
        raise bad("output_config", "output_config may hold format and effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict) or set(fmt) - {"type", "schema"}:
        raise bad("output_config.format", "output_config.format must be "
                  "{type: json_schema, schema: {...}}")
    return {"type": "json_schema", "schema": fmt["schema"]}


def _user(metadata: Any) -> str | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
        raise bad("metadata", "metadata may hold user_id only")
    user = metadata.get("user_id")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise bad("metadata.user_id", "metadata.user_id must be a string of at most 256 "
                  "characters")
    return user


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        texts = [_text(block, f"system[{i}]") for i, block in enumerate(system)]
        return [{"role": "system", "content": "\n".join(texts)}]
    raise bad("system", "system must be a string or a list of text blocks")


def _text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" \
            or not isinstance(block.get("text"), str):
        raise bad(where, f"{where} must be a text block {{type: text, text}}")
    return str(block["text"])


def _messages(messages: Any, remote: list[RemoteImage]) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise bad(where, f"{where} must be an object {{role, content}}")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role", f"{where}.role must be user or assistant")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += _blocks(role, content, where, remote)
        else:
            raise bad(f"{where}.content", f"{where}.content must be a string or a list of "
                      "content blocks")
    return out


def _blocks(role: str, blocks: list[Any], where: str,
            remote: list[RemoteImage]) -> list[dict[str, Any]]:
    """One message's blocks: its tool results as ``tool`` messages first (in order),
    then the message with its text, images and (an assistant's) calls."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image" and role == "user":
            parts.append(_image(block, at, remote))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_result(block, at, remote))
        else:
            allowed = ("text, image or tool_result" if role == "user"
                       else "text or tool_use")
            raise bad(f"{at}.type", f"{at}: a {role} message holds {allowed} blocks")
    out = list(results)
    if parts or calls or not results:
        shown: dict[str, Any] = {"role": role, "content": parts}
        if calls:
            shown["tool_calls"] = calls
        out.append(shown)
    return out


def _image(block: dict[str, Any], where: str, remote: list[RemoteImage]) -> dict[str, Any]:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        assert isinstance(source, dict)
        media, data = source.get("media_type"), source.get("data")
        if media not in IMAGE_MEDIA or not isinstance(data, str):
            raise bad(f"{where}.source", f"{where}.source must have media_type (one of "
                      f"{', '.join(sorted(IMAGE_MEDIA))}) and base64 data")
        url = f"data:{media};base64,{data}"
        assert DATA_URL.match(url) is not None
        return {"type": "image", "image": data_url_bytes(url, where)}
    if kind == "url":
        assert isinstance(source, dict)
        link = source.get("url")
        if not isinstance(link, str) or not link.lower().startswith(("http://", "https://")):
            raise bad(f"{where}.source.url", f"{where}.source.url must be an http(s) URL")
        placeholder: dict[str, Any] = {"type": "image", "image": None}
        remote.append(RemoteImage(link, placeholder))
        return placeholder
    raise bad(f"{where}.source", f"{where}.source must be {{type: base64, media_type, "
              "data}} or {type: url, url}")


def _call(block: dict[str, Any], where: str) -> dict[str, Any]:
    ident, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(ident, str) or not isinstance(name, str) \
            or not isinstance(arguments, dict):
        raise bad(where, f"{where} must be {{type: tool_use, id, name, input: {{...}}}}")
    return {"id": ident, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments,
                                                               ensure_ascii=False)}}


def _result(block: dict[str, Any], where: str, remote: list[RemoteImage]) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise bad(f"{where}.tool_use_id", f"{where}.tool_use_id must be a string")
    content = block.get("content", "")
    if block.get("is_error") not in (None, True, False):
        raise bad(f"{where}.is_error", f"{where}.is_error must be true or false")
    if isinstance(content, str):
        return {"role": "tool", "content": content}
    if not isinstance(content, list):
        raise bad(f"{where}.content", f"{where}.content must be a string or blocks")
    parts = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(part, at)})
        elif kind == "image":
            parts.append(_image(part, at, remote))
        else:
            raise bad(f"{at}.type", f"{at} must be a text or image block")
    return {"role": "tool", "content": parts}


def _tools(tools: Any, choice: Any) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
    """Anthropic's tools and tool_choice -> OpenAI's (protocol v1 checks the schemas)."""
    out = None
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "tools must be a list")
        out = []
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
                raise bad(where, f"{where}: only client tools {{name, description, "
                          "input_schema}} are supported")
            extra = sorted(set(tool) - {"type", "name", "description", "input_schema",
                                        "cache_control"})
            if extra:
                raise bad(f"{where}.{extra[0]}", f"{where}.{extra[0]} is not supported")
            function: dict[str, Any] = {"name": tool.get("name"),
                                        "parameters": tool.get("input_schema")}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            out.append({"type": "function", "function": function})
    if choice is None:
        return out, None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none") or set(choice) - {
            "type", "name", "disable_parallel_tool_use"}:
        raise bad("tool_choice", "tool_choice must be {type: auto|any|tool|none} (tool "
                  "with its name)")
    parallel = None
    if choice.get("disable_parallel_tool_use") is not None:
        if not isinstance(choice["disable_parallel_tool_use"], bool):
            raise bad("tool_choice.disable_parallel_tool_use",
                      "disable_parallel_tool_use must be true or false")
        parallel = not choice["disable_parallel_tool_use"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad("tool_choice.name", "tool_choice of type tool names the tool")
        return out, {"type": "function", "function": {"name": choice["name"]}}, parallel
    return out, {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


# -- replies ----------------------------------------------------------------------------

def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


class MessageReplies:
    """How the Messages API answers: a ``message``, or its stream of events."""

    media_type = "text/event-stream"

    def __init__(self, request: MessagesRequest, model: str,
                 eos_ids: frozenset[int] = frozenset()) -> None:
        self.id = message_id()
        self.model = model
        self.stop_sequences = request.stop_sequences
        self.eos_ids = eos_ids  # to tell a stop sequence from the model's own end
        self._text_open = False

    def _stop(self, result: dict[str, Any]) -> tuple[str, str | None]:
        reason = result["finish_reason"]
        if reason != "stop":
            return STOP_REASONS.get(reason, "end_turn"), None
        ids = result.get("token_ids") or []
        if self.stop_sequences and not (ids and ids[-1] in self.eos_ids):
            # A stop string ended it; which one is known when only one was given.
            one = self.stop_sequences[0] if len(self.stop_sequences) == 1 else None
            return "stop_sequence", one
        return "end_turn", None

    def _usage(self, result: dict[str, Any]) -> dict[str, Any]:
        u = result["usage"]
        return {"input_tokens": u["prompt_tokens"] - u["cached_tokens"],
                "cache_read_input_tokens": u["cached_tokens"],
                "cache_creation_input_tokens": 0,
                "output_tokens": u["completion_tokens"]}

    def _blocks(self, result: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
        """The content blocks, each call's ``input`` as a placeholder for its raw
        JSON (the model's text, put in by ``_dumps``)."""
        blocks: list[dict[str, Any]] = []
        raws: list[str] = []
        if result["text"] or not result.get("tool_calls"):
            blocks.append({"type": "text", "text": result["text"]})
        for call in result.get("tool_calls") or []:
            raws.append(call["function"]["arguments"])
            blocks.append({"type": "tool_use", "id": call["id"].replace("call_", "toolu_"),
                           "name": call["function"]["name"], "input": raw_json(len(raws) - 1)})
        return blocks, raws

    def whole(self, result: dict[str, Any]) -> bytes:
        blocks, raws = self._blocks(result)
        reason, sequence = self._stop(result)
        return dumps_with_raw({"id": self.id, "type": "message", "role": "assistant",
                               "model": self.model, "content": blocks,
                               "stop_reason": reason, "stop_sequence": sequence,
                               "usage": self._usage(result)}, raws).encode()

    def first(self) -> bytes:
        return sse({"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}},
            names=("message_start",))

    def tokens(self, event: dict[str, Any]) -> bytes:
        if not event["text"]:
            return b""
        events: list[dict[str, Any]] = []
        if not self._text_open:
            self._text_open = True
            events.append({"type": "content_block_start", "index": 0,
                           "content_block": {"type": "text", "text": ""}})
        events.append({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "text_delta", "text": event["text"]}})
        return sse(*events, names=tuple(e["type"] for e in events))

    def last(self, result: dict[str, Any]) -> bytes:
        events: list[dict[str, Any]] = []
        index = 0
        if self._text_open:
            events.append({"type": "content_block_stop", "index": 0})
            index = 1
        for call in result.get("tool_calls") or []:
            function = call["function"]
            events += [
                {"type": "content_block_start", "index": index, "content_block": {
                    "type": "tool_use", "id": call["id"].replace("call_", "toolu_"),
                    "name": function["name"], "input": {}}},
                {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": function["arguments"]}},
                {"type": "content_block_stop", "index": index}]
            index += 1
        reason, sequence = self._stop(result)
        events += [{"type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": self._usage(result)},
                   {"type": "message_stop"}]
        return sse(*events, names=tuple(e["type"] for e in events))

    def failed(self, exc: QvlError) -> bytes:
        return sse(error_body(exc)[1], names=("error",))


def error_body(exc: QvlError | None = None, *, code: str = "", message: str = "",
               param: str | None = None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, the API's error object) for a qvld error or an HTTP-level one."""
    status, message = error_status(exc, code, message)
    kind = ERROR_TYPES.get(status, "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}
