"""OpenAI's Responses API (``POST /v1/responses``) <-> protocol v1 ``generate``:
translation only, no I/O (what ``previous_response_id`` names is kept by
``response_store``).

``parse_responses`` turns a body into protocol v1 params:

- ``input``: a string, or items: messages (``role`` user, assistant, system or developer;
  ``content`` a string or ``input_text``, ``input_image`` (a ``data:`` URL, or an
  http(s) URL fetched under the server's image-URL rules) and, for an assistant,
  ``output_text`` parts), ``function_call`` items (a call the model made) and
  ``function_call_output`` items (its result, a ``tool`` message);
- ``instructions`` (the system message; not carried to a continuation, as OpenAI does),
  ``tools`` (function tools, flat: ``name``, ``description``, ``parameters``),
  ``tool_choice``, ``parallel_tool_calls``, ``text.format`` (``text``, ``json_object``,
  ``json_schema``: enforced), ``max_output_tokens``, ``temperature``, ``top_p``;
- ``previous_response_id`` continues a stored response of the same user: its
  conversation (inputs and outputs) goes before the new input, so the daemon's prefix
  cache finds it (the reply's ``usage.input_tokens_details.cached_tokens`` says how
  much); ``store: false`` keeps nothing;
- what asks for nothing here is accepted (``reasoning``, ``include``, ``truncation``,
  ``metadata``, ``user``, ``service_tier``, ``prompt_cache_key``...); unknown fields are
  refused with a did-you-mean.

``ResponseReplies`` shapes a ``response`` object or the semantic stream events
(``response.created``, ``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.completed``...).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from qvld.config import did_you_mean
from qvld.errors import QvlError
from qvld.http.dialect import bad, sse
from qvld.http.media import RemoteImage, data_url_bytes
from qvld.http.openai import error_body

FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
    "text", "max_output_tokens", "temperature", "top_p", "stream", "store",
    "previous_response_id",
    # accepted, asking for nothing here (checked for type)
    "reasoning", "include", "truncation", "metadata", "user", "service_tier",
    "prompt_cache_key", "safety_identifier", "background", "stream_options",
    "max_tool_calls", "top_logprobs",
    # qvld's extensions, as on chat completions
    "top_k", "min_p", "seed", "repetition_penalty", "ignore_eos", "max_image_tokens",
})
PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
          "ignore_eos", "max_image_tokens", "parallel_tool_calls")
ACCEPTED: dict[str, tuple[type, ...]] = {
    "reasoning": (dict,), "include": (list,), "truncation": (str,), "metadata": (dict,),
    "user": (str,), "service_tier": (str,), "prompt_cache_key": (str,),
    "safety_identifier": (str,), "stream_options": (dict,), "max_tool_calls": (int,),
    "top_logprobs": (int,)}
ROLES = {"user": "user", "assistant": "assistant", "system": "system",
         "developer": "system"}


@dataclass
class ResponsesRequest:
    params: dict[str, Any]  # protocol v1 generate params
    stream: bool
    store: bool
    model: str | None
    echo: dict[str, Any]  # the request's settings, as the response object repeats them
    conversation: list[dict[str, Any]]  # previous turns and this input, no instructions
    remote_images: list[RemoteImage] = field(default_factory=list)


def parse_responses(body: Any, previous: list[dict[str, Any]] | None) -> ResponsesRequest:
    """A Responses body -> protocol v1 generate params, after ``previous`` (the stored
    conversation ``previous_response_id`` names, looked up by the caller)."""
    if not isinstance(body, dict):
        raise bad("", "the request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise bad(str(name), f"unknown field {name!r}{did_you_mean(str(name), FIELDS)}")
    for name, types in ACCEPTED.items():
        if body.get(name) is not None and not isinstance(body[name], types):
            raise bad(name, f"{name} must be {' or '.join(t.__name__ for t in types)}")
    if body.get("background"):
        raise bad("background", "background responses are not supported")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string")
    stream, store = body.get("stream") or False, body.get("store", True)
    if not isinstance(stream, bool) or not isinstance(store, bool):
        raise bad("stream", "stream and store must be true or false")
    remote: list[RemoteImage] = []
    conversation = [*(previous or []), *_input(body.get("input"), remote)]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "instructions must be a string")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) \
        + conversation
    params: dict[str, Any] = {"messages": messages, "stream": stream}
    if body.get("max_output_tokens") is not None:
        params["max_tokens"] = body["max_output_tokens"]
    for name in PASSED:
        if body.get(name) is not None:
            params[name] = body[name]
    tools = _tools(body.get("tools"))
    if tools:
        params["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        params["tool_choice"] = choice
    fmt, format_echo = _format(body.get("text"))
    if fmt is not None:
        params["response_format"] = fmt
    echo = {"instructions": instructions, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "text": {"format": format_echo}, "store": store,
            "metadata": body.get("metadata") or {}, "user": body.get("user"),
            "reasoning": {"effort": None, "summary": None}, "truncation": "disabled"}
    return ResponsesRequest(params, stream, store, model, echo, conversation, remote)


def _input(value: Any, remote: list[RemoteImage]) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", "input must be a string or a non-empty list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            assert isinstance(item, dict)
            out.append(_message(item, where, remote))
        elif kind == "function_call":
            assert isinstance(item, dict)
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (item.get("call_id"), item.get("name"),
                                                    item.get("arguments"))):
                raise bad(where, f"{where} must be {{type: function_call, call_id, name, "
                          "arguments}}")
            if out and out[-1]["role"] == "assistant":  # the calls of one answer together
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            assert isinstance(item, dict)
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise bad(where, f"{where} must be {{type: function_call_output, call_id, "
                          "output}}")
            out.append({"role": "tool", "content": output})
        elif kind == "reasoning":
            continue  # another model's reasoning item: nothing this one reads
        else:
            raise bad(f"{where}.type", f"{where}: items are message, function_call or "
                      "function_call_output")
    return out


def _message(item: dict[str, Any], where: str, remote: list[RemoteImage]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"{where}.role must be one of {sorted(ROLES)}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": ROLES[role], "content": content}
    if not isinstance(content, list):
        raise bad(f"{where}.content", f"{where}.content must be a string or parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            assert isinstance(part, dict)
            if not isinstance(part.get("text"), str):
                raise bad(f"{at}.text", f"{at}.text must be a string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and role != "assistant":
            assert isinstance(part, dict)
            parts.append(_image(part, at, remote))
        else:
            raise bad(f"{at}.type", f"{at} must be input_text or input_image "
                      "(output_text for an assistant)")
    return {"role": ROLES[role], "content": parts}


def _image(part: dict[str, Any], where: str, remote: list[RemoteImage]) -> dict[str, Any]:
    url = part.get("image_url")
    if not isinstance(url, str):
        raise bad(f"{where}.image_url", f"{where}.image_url must be a data: or http(s) URL "
                  "(file_id is not supported)")
    if part.get("detail", "auto") not in ("auto", "low", "high"):
        raise bad(f"{where}.detail", f"{where}.detail must be auto, low or high")
    if url[:5].lower() == "data:":
        return {"type": "image", "image": data_url_bytes(url, where)}
    if url.lower().startswith(("http://", "https://")):
        placeholder: dict[str, Any] = {"type": "image", "image": None}
        remote.append(RemoteImage(url, placeholder))
        return placeholder
    raise bad(f"{where}.image_url", f"{where}.image_url must be a data: or http(s) URL")


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools", "tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad(f"tools[{i}]", f"tools[{i}]: only function tools are supported")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad("tool_choice", "tool_choice must be auto, none, required or "
              "{type: function, name}")


def _format(text: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``text.format`` -> (protocol v1's response_format, the format as echoed)."""
    if text is None:
        return None, {"type": "text"}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad("text", "text may hold format and verbosity")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None, {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}, {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad("text.format.schema", "text.format.schema must be a JSON schema")
        return {"type": "json_schema", "schema": schema}, dict(fmt)
    raise bad("text.format", "text.format.type must be text, json_object or json_schema")


# -- replies ----------------------------------------------------------------------------

class ResponseReplies:
    """How the Responses API answers: a ``response`` object, or its stream of semantic
    events. ``kept`` is called with the finished response and its conversation (to be
    stored when the request said so)."""

    media_type = "text/event-stream"

    def __init__(self, asked: ResponsesRequest, model: str,
                 kept: Any = None) -> None:
        self.id = "resp_" + secrets.token_hex(12)
        self.message_id = "msg_" + secrets.token_hex(12)
        self.created = int(time.time())
        self.asked = asked
        self.model = model
        self.kept = kept
        self._seq = 0
        self._text_open = False
        self._text = ""

    def _base(self, status: str) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "model": self.model, "output": [], "error": None,
                "incomplete_details": None, "usage": None, **self.asked.echo}

    def _response(self, result: dict[str, Any]) -> dict[str, Any]:
        complete = result["finish_reason"] != "length"
        out = self._base("completed" if complete else "incomplete")
        if not complete:
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        items: list[dict[str, Any]] = []
        if result["text"] or not result.get("tool_calls"):
            items.append(self._message_item(result["text"], "completed"))
        items += [self._call_item(call) for call in result.get("tool_calls") or []]
        u = result["usage"]
        out.update(output=items, usage={
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]})
        if self.kept is not None:
            answer: dict[str, Any] = {"role": "assistant", "content": result["text"]}
            if result.get("tool_calls"):
                answer["tool_calls"] = result["tool_calls"]
            self.kept(out, [*self.asked.conversation, answer])
        return out

    def _message_item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [],
                    "logprobs": []}] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": content}

    @staticmethod
    def _call_item(call: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
        function = call["function"]
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"),
                "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"] if arguments is None else arguments,
                "status": "completed" if arguments is None else "in_progress"}

    def _events(self, *events: dict[str, Any]) -> bytes:
        numbered = []
        for event in events:
            numbered.append({**event, "sequence_number": self._seq})
            self._seq += 1
        return sse(*numbered, names=tuple(e["type"] for e in events))

    def whole(self, result: dict[str, Any]) -> bytes:
        return json.dumps(self._response(result), ensure_ascii=False).encode()

    def first(self) -> bytes:
        return b""  # the events are numbered: ``_started`` puts them first

    def _started(self) -> list[dict[str, Any]]:
        """response.created and .in_progress, before the first event (once)."""
        if self._seq:
            return []
        return [{"type": "response.created", "response": self._base("in_progress")},
                {"type": "response.in_progress", "response": self._base("in_progress")}]

    def _open_text(self) -> list[dict[str, Any]]:
        if self._text_open:
            return []
        self._text_open = True
        return [{"type": "response.output_item.added", "output_index": 0,
                 "item": self._message_item("", "in_progress")},
                {"type": "response.content_part.added", "item_id": self.message_id,
                 "output_index": 0, "content_index": 0,
                 "part": {"type": "output_text", "text": "", "annotations": []}}]

    def tokens(self, event: dict[str, Any]) -> bytes:
        if not event["text"]:
            return b""
        self._text += event["text"]
        return self._events(*self._started(), *self._open_text(), {
            "type": "response.output_text.delta", "item_id": self.message_id,
            "output_index": 0, "content_index": 0, "delta": event["text"], "logprobs": []})

    def last(self, result: dict[str, Any]) -> bytes:
        events: list[dict[str, Any]] = self._started()
        calls = result.get("tool_calls") or []
        if self._text_open or not calls:
            events += self._open_text()
            part = {"type": "output_text", "text": result["text"], "annotations": []}
            events += [
                {"type": "response.output_text.done", "item_id": self.message_id,
                 "output_index": 0, "content_index": 0, "text": result["text"],
                 "logprobs": []},
                {"type": "response.content_part.done", "item_id": self.message_id,
                 "output_index": 0, "content_index": 0, "part": part},
                {"type": "response.output_item.done", "output_index": 0,
                 "item": self._message_item(result["text"], "completed")}]
        index = 1 if self._text_open else 0
        for call in calls:
            item = self._call_item(call)
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": self._call_item(call, "")},
                {"type": "response.function_call_arguments.delta", "item_id": item["id"],
                 "output_index": index, "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", "item_id": item["id"],
                 "output_index": index, "name": item["name"],
                 "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": index, "item": item}]
            index += 1
        response = self._response(result)
        kind = "response.completed" if response["status"] == "completed" \
            else "response.incomplete"
        return self._events(*events, {"type": kind, "response": response})

    def failed(self, exc: QvlError) -> bytes:
        _, body = error_body(exc)
        return self._events(*self._started(), {"type": "error", "code": body["error"]["code"],
                             "message": body["error"]["message"], "param": None})
